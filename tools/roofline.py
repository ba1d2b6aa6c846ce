"""Each device kernel of a traced step against its roofline, from the trace and the optimized HLO.

    XLA_FLAGS=--xla_dump_to=DUMP --xla_dump_hlo_as_text python -m experiments.train ... \\
        --profile_steps=36:38 --workdir=W
    python -m tools.roofline W/profile DUMP/module_NNNN.jit_..._gpu_after_optimizations.txt \\
        --steps=2 --top=20

The trace (tools.profile_summary) gives every kernel's device time; the after-optimization
HLO of the same program gives what each kernel moves and computes. A fusion's kernel is
named after its HLO instruction ("input_scatter_fusion_31" is %input_scatter_fusion.31;
XLA's deduplicated call sites share one kernel and one name), so per call:

    bytes   the fused computation's parameters plus its outputs (read once, written once)
    flops   2 x output elements x contracted size, for cuBLAS(Lt) GEMM custom calls
    roofline  max(bytes / HBM bandwidth, flops / matmul rate)

cuBLAS kernels ("nvjet_...", "sm90_xmma_...") carry no HLO name: they are summed into one
"cuBLAS GEMMs" row against the FLOPs of every GEMM custom call in the module (times the
module's calls per step, --gemm_calls). Pallas / Triton kernels and anything else the HLO
does not name are listed with their time and no roofline. `ratio` = time / roofline: a
kernel far above 1 is slower than what it must read, write or compute allows.
A fusion's parameters count whole, so a fusion that gathers a few rows of a large
operand reads less than its bytes (its roofline is then an upper bound).
The source line of each row is the first frame of the instruction's stack trace.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import re
import sys

from tools.profile_summary import load_events

HBM_BYTES_PER_S = 4.8e12        # H200 HBM3e
MATMUL_FLOPS = 625e12           # dense BF16 GEMMs through XLA on an H200, measured

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1,
               "f8e8m0fnu": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
               "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^%?([\w.\-]+) \((.*)\) -> (.*) \{$")
_INSTR = re.compile(r"^\s+(?:ROOT )?%([\w.\-]+) = ")


def shape_bytes(text: str) -> int:
    """Bytes of every array shape in `text` ("bf16[8,512]{1,0}", tuples, parameter lists)."""
    total = 0
    for dtype, dims in _ARRAY.findall(text):
        if dtype not in DTYPE_BYTES:
            continue
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * DTYPE_BYTES[dtype]
    return total


def _dims(shape: str) -> list[int]:
    m = _ARRAY.search(shape)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def _split_shape(rest: str) -> tuple[str, str]:
    """'(bf16[2]{0}, s8[4]{0}) custom-call(...' -> (shape text, the rest)."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[:i + 1], rest[i + 1:].lstrip()
    shape, _, tail = rest.partition(" ")
    return shape, tail


@dataclasses.dataclass
class Instr:
    name: str
    shape: str
    op: str
    line: str


@dataclasses.dataclass
class Module:
    instrs: dict[str, Instr]              # every instruction (HLO names are module-unique)
    computations: dict[str, str]          # computation name -> its parameter list
    bodies: dict[str, list[str]]          # computation name -> its instruction names
    frames: dict[int, str]                # stack frame id -> "file:line function"


def parse_hlo(text: str) -> Module:
    instrs: dict[str, Instr] = {}
    comps: dict[str, str] = {}
    bodies: dict[str, list[str]] = collections.defaultdict(list)
    current = ""
    for line in text.splitlines():
        h = _HEADER.match(line.removeprefix("ENTRY "))
        if h:
            current = h.group(1)
            comps[current] = h.group(2) + " -> " + h.group(3)
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        shape, tail = _split_shape(line[m.end():])
        op = tail.split("(", 1)[0]
        instrs[m.group(1)] = Instr(m.group(1), shape, op, line)
        bodies[current].append(m.group(1))
    return Module(instrs, comps, dict(bodies), parse_frames(text))


def _elements(shape: str) -> list[str]:
    """Top-level elements of a tuple shape ('(a, (b, c))' -> ['a', '(b, c)']); [shape] else."""
    if not shape.startswith("("):
        return [shape]
    out, depth, start = [], 0, 1
    for i, ch in enumerate(shape):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if (ch == "," and depth == 1) or (ch == ")" and depth == 0):
            out.append(shape[start:i].strip())
            start = i + 1
    return out


def operand_shape(ref: str, mod: Module) -> str:
    """'%name' or '%name#i' (tuple element i) -> its shape text ('' when unknown)."""
    name, _, index = ref.strip().lstrip("%").partition("#")
    if name not in mod.instrs:
        return ""
    shape = mod.instrs[name].shape
    return _elements(shape)[int(index)] if index else shape


def parse_frames(text: str) -> dict[int, str]:
    """The dump's FileNames / FunctionNames / FileLocations / StackFrames tables ->
    {frame id: "file:line function"} of the frame itself (its innermost location)."""
    tables: dict[str, dict[int, str]] = collections.defaultdict(dict)
    section = None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = line
            continue
        m = re.match(r"(\d+) (.*)$", line) if section else None
        if not m:
            section = None
            continue
        tables[section][int(m.group(1))] = m.group(2)
    out = {}
    for fid, rest in tables["StackFrames"].items():
        loc = dict(re.findall(r"(\w+)=(\d+)", tables["FileLocations"].get(
            int(dict(re.findall(r"(\w+)=(\d+)", rest)).get("file_location_id", 0)), "")))
        if not loc:
            continue
        fname = tables["FileNames"].get(int(loc.get("file_name_id", 0)), "?").strip('"')
        func = tables["FunctionNames"].get(int(loc.get("function_name_id", 0)), "?").strip('"')
        out[fid] = f"{fname.rsplit('/gemjax/', 1)[-1].rsplit('site-packages/', 1)[-1]}:" \
                   f"{loc.get('line', '?')} {func}"
    return out


def gemm_flops(ins: Instr, mod: Module) -> float:
    """2 x output elements x contracted size of a dot, a cuBLAS GEMM custom call, or the dots
    inside a fusion (XLA's Triton GEMM fusions); 0 for anything else."""
    if ins.op == "fusion":
        calls = re.search(r"calls=%([\w.\-]+)", ins.line)
        body = mod.bodies.get(calls.group(1), []) if calls else []
        return sum(gemm_flops(mod.instrs[n], mod) for n in body if mod.instrs[n].op == "dot")
    if ins.op == "dot":
        contracting = re.search(r"lhs_contracting_dims=\{([^}]*)\}", ins.line)
    elif ins.op == "custom-call" and "cublas" in ins.line:
        contracting = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', ins.line)
    else:
        return 0.0
    operands = re.search(re.escape(ins.op) + r"\(([^)]*)\)", ins.line)
    if not operands or not contracting:
        return 0.0
    lhs_dims = _dims(operand_shape(operands.group(1).split(",")[0], mod))
    k = 1
    for d in re.findall(r"\d+", contracting.group(1)):
        if int(d) >= len(lhs_dims):
            return 0.0
        k *= lhs_dims[int(d)]
    n = 1
    for d in _dims(_elements(ins.shape)[0]):          # the product (not the workspace)
        n *= d
    return 2.0 * n * k


def fusion_bytes(ins: Instr, mod: Module) -> int:
    """A fusion's parameters plus outputs, or 0 when it is not a fusion."""
    calls = re.search(r"calls=%([\w.\-]+)", ins.line)
    if ins.op != "fusion" or not calls or calls.group(1) not in mod.computations:
        return 0
    params = mod.computations[calls.group(1)].split(" -> ")[0]
    return shape_bytes(params) + shape_bytes(ins.shape)


def source(ins: Instr, mod: Module) -> str:
    m = re.search(r"stack_frame_id=(\d+)", ins.line)
    op = re.search(r'op_name="([^"]*)"', ins.line)
    where = mod.frames.get(int(m.group(1)), "") if m else ""
    return where or (op.group(1).rsplit("/", 1)[-1] if op else "")


def kernel_times(events: list[dict], steps: int) -> dict[str, tuple[float, float]]:
    """{kernel name: (ms per step, calls per step)} summed over every device process."""
    devices = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
               and e.get("args", {}).get("name", "").startswith("/device:")}
    ms, calls = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in devices:
            ms[e["name"]] += float(e.get("dur", 0.0)) / 1e3 / steps
            calls[e["name"]] += 1.0 / steps
    return {n: (ms[n], calls[n]) for n in ms}


CUBLAS_KERNEL = re.compile(r"nvjet|xmma|cutlass|cublas|gemv|splitKreduce", re.I)


def rows(times: dict[str, tuple[float, float]], mod: Module, *, hbm: float = HBM_BYTES_PER_S,
         matmul: float = MATMUL_FLOPS, gemm_calls: float = 1.0) -> list[dict]:
    """One row per kernel (largest time first), cuBLAS kernels summed into one row."""
    out, gemm_ms, gemm_n = [], 0.0, 0.0
    for name, (ms, calls) in times.items():
        ins = mod.instrs.get(name) or mod.instrs.get(re.sub(r"_(\d+)$", r".\1", name))
        if ins is None and CUBLAS_KERNEL.search(name):
            gemm_ms += ms
            gemm_n += calls
            continue
        row = {"name": name, "ms": ms, "calls": calls, "bytes": 0, "flops": 0.0,
               "roofline_ms": None, "ratio": None, "source": ""}
        if ins is not None:
            row["bytes"] = fusion_bytes(ins, mod)
            row["flops"] = gemm_flops(ins, mod)
            row["source"] = source(ins, mod)
            if row["bytes"] or row["flops"]:
                row["roofline_ms"] = max(row["bytes"] / hbm, row["flops"] / matmul) * 1e3 * calls
        out.append(row)
    flops = sum(gemm_flops(i, mod) for i in mod.instrs.values()
                if i.op == "custom-call") * gemm_calls
    if gemm_ms:
        roof = flops / matmul * 1e3 if flops else None
        out.append({"name": "cuBLAS GEMMs", "ms": gemm_ms, "calls": gemm_n, "bytes": 0,
                    "flops": flops, "roofline_ms": roof, "ratio": None,
                    "source": f"{flops / gemm_ms / 1e9:.0f} TFLOP/s achieved" if flops else ""})
    for r in out:
        if r["roofline_ms"]:
            r["ratio"] = r["ms"] / r["roofline_ms"]
    return sorted(out, key=lambda r: -r["ms"])


def format_rows(table: list[dict], top: int = 20) -> str:
    total = sum(r["ms"] for r in table)
    lines = [f"{'ms/step':>9} {'share':>6} {'calls':>6} {'GB/call':>8} {'roofline':>9} "
             f"{'ratio':>6}  kernel  (source)"]
    for r in table[:top]:
        roof = f"{r['roofline_ms']:9.3f}" if r["roofline_ms"] else f"{'-':>9}"
        ratio = f"{r['ratio']:6.1f}" if r["ratio"] else f"{'-':>6}"
        gb = r["bytes"] / 1e9
        lines.append(f"{r['ms']:9.3f} {r['ms'] / total:6.1%} {r['calls']:6.1f} {gb:8.3f} {roof} "
                     f"{ratio}  {r['name'][:48]}  ({r['source'][:60]})")
    lines.append(f"{total:9.3f} ms of device kernels per step in all; "
                 f"{at_roofline(table):.3f} ms with every kernel at its roofline "
                 f"(kernels without one at their time)")
    return "\n".join(lines)


def at_roofline(table: list[dict]) -> float:
    """ms per step if each kernel took min(its time, its roofline); no roofline: its time."""
    return sum(min(r["ms"], r["roofline_ms"]) if r["roofline_ms"] else r["ms"] for r in table)


def main(argv: list[str]) -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", help="perfetto_trace.json.gz or a directory holding one")
    ap.add_argument("hlo", help="the step's *after_optimizations.txt from --xla_dump_to")
    ap.add_argument("--steps", type=int, default=1, help="steps the trace holds")
    ap.add_argument("--top", type=int, default=20, help="rows printed")
    ap.add_argument("--hbm_tbps", type=float, default=HBM_BYTES_PER_S / 1e12, help="HBM TB/s")
    ap.add_argument("--matmul_tflops", type=float, default=MATMUL_FLOPS / 1e12,
                    help="GEMM rate the cuBLAS row is held to (TFLOP/s)")
    ap.add_argument("--gemm_calls", type=float, default=1.0,
                    help="calls of the HLO module per traced step (its GEMM FLOPs count this often)")
    ap.add_argument("--json", default="", help="write the rows here as JSON")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    with open(args.hlo) as f:
        mod = parse_hlo(f.read())
    if not mod.instrs:
        ap.error(f"{args.hlo}: no HLO instructions found (an *after_optimizations.txt dump?)")
    table = rows(kernel_times(load_events(args.trace), args.steps), mod,
                 hbm=args.hbm_tbps * 1e12, matmul=args.matmul_tflops * 1e12,
                 gemm_calls=args.gemm_calls)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)
    print(format_rows(table, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
