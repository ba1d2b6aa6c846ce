"""The compiler's resource report of our Pallas Triton kernels for sm_90, on any machine.

    python -m tools.triton_report --ops=gdpa,softmax,block --out=runs/triton_report
    python -m tools.triton_report --triton_python=/path/to/venv/bin/python   # triton elsewhere

Step 1 (needs jax, no GPU): lower forward + backward of each op on a bench
workload's lengths (--workload; W1's are W4's too) for platform "cuda", sm_90, through
jax.export, as XLA would receive them, and keep every Triton module (.ttir) with
its num_warps / num_stages / grid. Uses JAX internals (the GPU info lookup and
the Triton lowering entry point, as tests/test_kernels_triton_lowering.py does):
a clear error if they move.

Step 2 (needs the `triton` package, e.g. 3.6.0 as on the device image; run with
--triton_python when it lives in another interpreter): compile each module to
PTX for sm_90 and run ptxas -v: registers per thread, spills, shared memory, and
from them the CTAs (and warps) one SM can hold, plus counts of wgmma, TMA bulk
copies, MUFU ex2 / tanh and local-memory accesses in the PTX.

XLA compiles the same IR with the Triton bundled in jaxlib, whose passes may
differ from the triton package's: treat the figures as that compiler's report
for this IR, a guide to what limits a kernel, not the exact binary that ran.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

# H100 / H200 (sm_90) per-SM limits
REGS_PER_SM = 65536
SMEM_PER_SM = 228 * 1024
SMEM_RESERVED_PER_CTA = 1024
MAX_WARPS_PER_SM = 64
MAX_CTAS_PER_SM = 32


def occupancy(regs: int, shared: int, warps: int) -> dict:
    """CTAs per SM allowed by registers, shared memory and warps (register allocation
    in units of 256 per warp), and the resulting resident warps."""
    regs_per_warp = -(-regs * 32 // 256) * 256
    by_regs = REGS_PER_SM // max(regs_per_warp * warps, 1)
    by_smem = SMEM_PER_SM // (shared + SMEM_RESERVED_PER_CTA) if shared else MAX_CTAS_PER_SM
    by_warps = MAX_WARPS_PER_SM // warps
    ctas = max(0, min(by_regs, by_smem, by_warps, MAX_CTAS_PER_SM))
    limit = min((("registers", by_regs), ("shared memory", by_smem), ("warps", by_warps)),
                key=lambda kv: kv[1])[0]
    return {"ctas_per_sm": ctas, "warps_per_sm": ctas * warps, "limited_by": limit,
            "ctas_by_regs": by_regs, "ctas_by_smem": by_smem}


# ----------------------------------------------------------------------------- step 1: lower


def lower(ops, head_dim: int, out_dir: str, workload: str = "W1") -> list[dict]:
    """Lower each op's forward + backward on bench_attention's `workload` lengths
    (block attention: self-attention workloads only) -> one row per Triton kernel."""
    import types

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import export
    try:
        import jax._src.pallas.triton.pallas_call_registration as reg
        real_lower = reg.lowering.lower_jaxpr_to_triton_module
        real_info = reg.gpu_info_lib.get_gpu_info
    except (ImportError, AttributeError) as e:  # pragma: no cover
        raise RuntimeError(f"triton_report: the JAX internals it patches moved ({e})") from e

    from kernels.dispatch import block_attention_pallas
    from kernels.dispatch import gdpa_pallas
    from kernels.dispatch import jagged_attention_pallas

    modules = []

    def record(*args, **kwargs):
        out = real_lower(*args, **kwargs)
        modules.append(out)
        return out

    reg.lowering.lower_jaxpr_to_triton_module = record
    reg.gpu_info_lib.get_gpu_info = lambda: types.SimpleNamespace(compute_capability=90)
    real_backend = jax.default_backend
    jax.default_backend = lambda: "gpu"          # the kernels' non-interpret path
    from benchmarks.attention_workloads import workload as lengths_of
    _, ql, kl = lengths_of(workload)          # bench_attention's lengths (seed 0)
    q_off, kv_off = (jnp.asarray(np.concatenate([[0], np.cumsum(x)]).astype(np.int32)) for x in (ql, kl))
    tq, tk = (int(-(-x.sum() // 128) * 128) for x in (ql, kl))
    fns = {"gdpa": lambda q, k, v: gdpa_pallas(q, k, v, q_off, kv_off, activation="silu", scale=1 / 4096),
           "softmax": lambda q, k, v: jagged_attention_pallas(q, k, v, q_off, kv_off),
           "block": lambda q, k, v: block_attention_pallas(q, k, v, q_off)}
    rows = []
    try:
        for op in ops:
            if op not in fns:
                raise ValueError(f"unknown op {op!r}; choose from {sorted(fns)}")
            if op == "block" and tq != tk:
                raise ValueError(f"block attention is self-attention: workload {workload} is cross")
            modules.clear()
            xq = jax.ShapeDtypeStruct((tq, 4, head_dim), jnp.bfloat16)
            xk = jax.ShapeDtypeStruct((tk, 4, head_dim), jnp.bfloat16)

            def train(q, k, v, fn=fns[op]):
                o, vjp = jax.vjp(fn, q, k, v)
                return o, vjp(o)
            exp = export.export(jax.jit(train), platforms=["cuda"], disabled_checks=[
                export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(xq, xk, xk)
            calls = re.findall(r'name = "([^"]+)"[^}]*?num_stages = (\d+)[^}]*?num_warps = (\d+)',
                               exp.mlir_module())
            if len(calls) != len(modules):
                raise RuntimeError(f"{op}: {len(modules)} Triton modules but {len(calls)} custom calls")
            for m, (name, stages, warps) in zip(modules, calls):
                path = os.path.join(out_dir, f"{workload}_{name}.ttir")
                with open(path, "w") as f:
                    f.write(str(m.module))
                rows.append({"op": op, "workload": workload, "kernel": name, "ttir": path,
                             "num_warps": int(warps), "num_stages": int(stages), "grid": list(m.grid),
                             "head_dim": head_dim})
    finally:
        reg.lowering.lower_jaxpr_to_triton_module = real_lower
        reg.gpu_info_lib.get_gpu_info = real_info
        jax.default_backend = real_backend
    return rows


# ----------------------------------------------------------------------------- step 2: compile


def compile_report(rows: list[dict]) -> list[dict]:
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", 90, 32)
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    out = []
    for r in rows:
        k = triton.compile(r["ttir"], target=target,
                           options={"num_warps": r["num_warps"], "num_stages": r["num_stages"]})
        ptx = k.asm["ptx"]
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
            f.write(ptx)
        res = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull],
                             capture_output=True, text=True)
        os.unlink(f.name)
        info = res.stderr
        regs = int(re.search(r"Used (\d+) registers", info).group(1))
        spill_st, spill_ld = (int(x) for x in re.search(
            r"(\d+) bytes spill stores, (\d+) bytes spill loads", info).groups())
        shared = int(k.metadata.shared)
        out.append({**r, "triton": triton.__version__, "registers": regs, "spill_stores": spill_st,
                    "spill_loads": spill_ld, "shared_bytes": shared,
                    **occupancy(regs, shared, r["num_warps"]),
                    "wgmma": ptx.count("wgmma.mma_async"), "mma_sync": ptx.count("mma.sync"),
                    "tma": ptx.count("cp.async.bulk.tensor"), "cp_async": ptx.count("cp.async.cg"),
                    "ex2": ptx.count("ex2.approx"), "tanh": ptx.count("tanh.approx"),
                    "sin_cos": ptx.count("sin.approx") + ptx.count("cos.approx"),
                    "local_mem": ptx.count("ld.local") + ptx.count("st.local")})
    return out


def format_report(rows: list[dict]) -> str:
    head = (f"{'kernel':<36}{'warps':>6}{'stg':>4}{'regs':>6}{'spill':>7}{'smem KB':>9}"
            f"{'CTA/SM':>7}{'warps/SM':>9}  limited by      wgmma  tma  ex2 tanh")
    lines = [head]
    for r in rows:
        lines.append(f"{r['kernel']:<36}{r['num_warps']:>6}{r['num_stages']:>4}{r['registers']:>6}"
                     f"{r['spill_stores'] + r['spill_loads']:>7}{r['shared_bytes'] / 1024:>9.1f}"
                     f"{r['ctas_per_sm']:>7}{r['warps_per_sm']:>9}  {r['limited_by']:<15}"
                     f"{r['wgmma']:>6}{r['tma']:>5}{r['ex2']:>5}{r['tanh']:>5}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default="gdpa,softmax,block", help="comma-separated: gdpa, softmax, block")
    ap.add_argument("--head_dim", type=int, default=128)
    ap.add_argument("--workload", default="W1", help="bench_attention workload whose lengths (and "
                    "so adapted tiles) are lowered: W1, W2, W3 (block: W1 = W4's lengths)")
    ap.add_argument("--out", default="runs/triton_report", help="directory for .ttir files and report.json")
    ap.add_argument("--triton_python", default=sys.executable,
                    help="interpreter with the triton package for step 2 (default: this one)")
    ap.add_argument("--compile_only", default="", help=argparse.SUPPRESS)   # step 2 in a subprocess
    args = ap.parse_args(argv)
    if args.compile_only:
        with open(args.compile_only) as f:
            rows = json.load(f)
        json.dump(compile_report(rows), sys.stdout)
        return 0
    os.makedirs(args.out, exist_ok=True)
    rows = lower([o for o in args.ops.split(",") if o], args.head_dim, args.out, args.workload)
    lowered = os.path.join(args.out, "lowered.json")
    with open(lowered, "w") as f:
        json.dump(rows, f, indent=1)
    res = subprocess.run([args.triton_python, os.path.abspath(__file__), "--compile_only", lowered],
                         capture_output=True, text=True)
    if res.returncode:
        print(f"step 2 (compile with {args.triton_python}) failed; the .ttir files are in "
              f"{args.out}:\n{res.stderr[-2000:]}")
        return 1
    report = json.loads(res.stdout)
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"Triton {report[0]['triton'] if report else '?'} for sm_90, head dim {args.head_dim}, "
          f"bf16, {args.workload} lengths:")
    print(format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
