"""tools/sass_stalls.py: ncu's per-instruction stall samples summed by reason, by
straight-line region and by opcode, from its SASS page export."""

import csv
import gzip

import pytest
from tools import sass_stalls as S


HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)",
          "Warp Stall Sampling (Not-issued Samples)", "Instructions Executed",
          "stall_long_sb", "stall_wait", "stall_long_sb (Not Issued)"]


def _export(path, instrs):
    """An ncu-like export: a kernel-name line, the header, one row per instruction
    (source, samples, executed, long_sb, wait)."""
    with gzip.open(path, "wt", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(["Kernel Name", "anonymous_mosaic_gpu_kernel"])
        w.writerow(HEADER)
        for i, (src, samples, ex, long_sb, wait) in enumerate(instrs):
            w.writerow([hex(i * 16), src, samples, samples, ex, long_sb, wait, long_sb])


INSTRS = [("LDC R1, c[0x0][0x28]", 2, 10, 0, 2),                 # prologue
          ("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24", 5, 100, 0, 5),   # loop body
          ("@!P0  BRA 0x7f00", 40, 100, 40, 0),
          ("MUFU.EX2 R3, R3", 7, 100, 0, 7),
          ("MUFU.EX2 R4, R4", 3, 100, 0, 3),
          ("STL [R1+0x8], R3", 1, 4, 1, 0),                        # epilogue
          ("EXIT", 0, 4, 0, 0)]


def test_reasons_regions_and_opcodes(tmp_path):
    path = str(tmp_path / "sass.csv.gz")
    _export(path, INSTRS)
    instrs = S.read_sass(path)
    assert len(instrs) == len(INSTRS)
    assert S.stall_reasons(instrs) == {"long_sb": 41, "wait": 17}   # Not Issued ignored
    regions = S.regions(instrs)
    assert regions[0] == (1, 4, 100, 55)            # the loop body, hottest first
    assert sorted(regions[1:]) == [(0, 0, 10, 2), (5, 6, 4, 1)]
    assert S.opcode_mix(instrs, 1, 4) == [("BRA", 1, 40), ("MUFU", 2, 10), ("HGMMA", 1, 5)]
    text = S.summary(instrs, n_regions=2, n_mix=1)
    assert "58 stall samples" in text and "[1, 4] 4 instructions, executed 100 times" in text
    assert "local memory (spill) instructions: 1, executed 4" in text


def test_opcode_strips_predicates_and_modifiers():
    assert S.opcode("@!P0  BRA 0x7f3f8f7b4b20") == "BRA"
    assert S.opcode("HGMMA.64x128x16.F32.BF16 R88, R168, gdesc[UR20].tnspB, R88") == "HGMMA"
    assert S.opcode("") == ""


def test_a_file_without_the_sass_table_is_named(tmp_path):
    path = str(tmp_path / "details.csv")
    with open(path, "w") as f:
        f.write('"Kernel Name","x"\n"Metric Name","Metric Value"\n"Duration","240"\n')
    with pytest.raises(ValueError, match="details.csv: no SASS table"):
        S.read_sass(path)
