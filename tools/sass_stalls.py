"""Where a kernel's warps stall, from Nsight Compute's per-instruction samples.

On the H200 machine (Firecracker runtime: ncu reads the hardware counters), profile
the second launch of a kernel and export its SASS page:

    ncu --clock-control none --kernel-name regex:mosaic --launch-skip 1 --launch-count 1 \\
        --set full --import-source no -o prof -f python3 my_script.py
    ncu -i prof.ncu-rep --page source --print-source sass --csv | gzip > sass.csv.gz
    ncu -i prof.ncu-rep --page details > details.txt     # throughputs, spills, occupancy

then, anywhere:

    python3 -m tools.sass_stalls sass.csv.gz --regions=8 --mix=2

It prints the warp-stall samples by reason over the whole kernel, then the hottest
regions: runs of consecutive instructions executed equally often, i.e. straight-line
code such as a loop body, with their share of the samples, their length and the
instructions executed, and for the first --mix of them the samples per opcode. A
software-pipelined kernel's main loop is one region, so two variants of a kernel can
be compared loop body against loop body (docs/kernels.md: the Mosaic softmax and GDPA
forwards). Samples are per warp and every warp is sampled alike:
a producer warp waiting on a barrier counts as much as a consumer that computes.
"""

from __future__ import annotations

import collections
import csv
import gzip
import sys

from absl import app, flags

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def read_sass(path):
    """[dict per SASS instruction] from an ncu --page source --csv export (.gz or plain)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        rows = list(csv.reader(f))
    header = next((i for i, r in enumerate(rows) if "Source" in r and SAMPLES in r), None)
    if header is None:
        raise ValueError(f"{path}: no SASS table (a header row with 'Source' and "
                         f"'{SAMPLES}'); export it with --page source --print-source sass --csv")
    names = rows[header]
    return [dict(zip(names, r)) for r in rows[header + 1:] if len(r) == len(names)]


def _int(x):
    try:
        return int(float(x.replace(",", "")))
    except (AttributeError, ValueError):
        return 0


def opcode(source):
    """'@!P0 BRA 0x7f..' -> 'BRA'; 'HGMMA.64x128x16.F32.BF16 R24, ..' -> 'HGMMA'."""
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def stall_reasons(instrs):
    """Counter {reason: samples} over all instructions (ncu's stall_* columns)."""
    total = collections.Counter()
    for ins in instrs:
        for k, v in ins.items():
            if k.startswith("stall_") and "Not Issued" not in k:
                total[k[len("stall_"):]] += _int(v)
    return total


def regions(instrs):
    """[(first, last, executed, samples)] runs of consecutive instructions with equal
    execution counts, hottest (most samples) first."""
    out = []
    for i, ins in enumerate(instrs):
        ex, s = _int(ins.get(EXECUTED)), _int(ins.get(SAMPLES))
        if out and out[-1][2] == ex:
            a, _, _, s0 = out[-1]
            out[-1] = (a, i, ex, s0 + s)
        else:
            out.append((i, i, ex, s))
    return sorted(out, key=lambda r: -r[3])


def opcode_mix(instrs, first, last):
    """[(opcode, count, samples)] of instructions first..last, most samples first."""
    n, s = collections.Counter(), collections.Counter()
    for ins in instrs[first:last + 1]:
        op = opcode(ins.get("Source", ""))
        n[op] += 1
        s[op] += _int(ins.get(SAMPLES))
    return sorted(((op, n[op], s[op]) for op in n), key=lambda r: -r[2])


def summary(instrs, n_regions=8, n_mix=2):
    """The report as text."""
    lines = []
    reasons = stall_reasons(instrs)
    total = sum(_int(i.get(SAMPLES)) for i in instrs)
    lines.append(f"{len(instrs)} instructions, {total} stall samples")
    for r, n in reasons.most_common(8):
        lines.append(f"  {r:16s} {n:8d}  {100 * n / max(total, 1):5.1f}%")
    local = [i for i in instrs if opcode(i.get("Source", "")) in ("LDL", "STL")]
    lines.append(f"local memory (spill) instructions: {len(local)}, executed "
                 f"{sum(_int(i.get(EXECUTED)) for i in local)}, samples "
                 f"{sum(_int(i.get(SAMPLES)) for i in local)}")
    lines.append("hottest regions (straight-line runs, equal execution counts):")
    for k, (a, b, ex, s) in enumerate(regions(instrs)[:n_regions]):
        lines.append(f"  [{a}, {b}] {b - a + 1} instructions, executed {ex} times, "
                     f"{s} samples ({100 * s / max(total, 1):.1f}%)")
        if k < n_mix:
            lines.append("    " + ", ".join(f"{op} {c} ({sm})" for op, c, sm in
                                           opcode_mix(instrs, a, b)[:12]))
    return "\n".join(lines)


def main(argv):
    if len(argv) != 2:
        sys.exit("usage: sass_stalls.py SASS_CSV[.gz] [--regions=N --mix=M]")
    print(summary(read_sass(argv[1]), flags.FLAGS.regions, flags.FLAGS.mix))


if __name__ == "__main__":
    flags.DEFINE_integer("regions", 8, "hottest regions to list")
    flags.DEFINE_integer("mix", 2, "regions (hottest first) whose opcode mix is printed")
    app.run(main)
