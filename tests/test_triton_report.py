"""tools/triton_report.py: the occupancy arithmetic by hand, and step 1 (lowering the
kernels for sm_90 on this CPU) keeps one Triton module per kernel with the launch
parameters the kernels ask for. Step 2 needs the triton package (not in CI)."""

import os

import pytest
from tools import triton_report as R



def test_occupancy_by_hand():
    # 168 regs -> 5376 per warp (already a multiple of 256) -> 21504 per 4-warp CTA: 3 by
    # registers; 113 KB + 1 KB reserved of 228 KB: 2 by shared memory
    o = R.occupancy(168, 113 * 1024, 4)
    assert (o["ctas_by_regs"], o["ctas_by_smem"], o["ctas_per_sm"]) == (3, 2, 2)
    assert o["limited_by"] == "shared memory" and o["warps_per_sm"] == 8
    # 255 regs -> 8160, rounded up to 8192 per warp -> 32768 per CTA: 2 CTAs by registers
    o = R.occupancy(255, 72 * 1024, 4)
    assert (o["ctas_by_regs"], o["ctas_per_sm"], o["limited_by"]) == (2, 2, "registers")
    # 16 regs (512 per warp, 16 CTAs by registers), no shared memory, 8 warps: 8 CTAs by
    # the 64-warp limit
    o = R.occupancy(16, 0, 8)
    assert (o["ctas_per_sm"], o["limited_by"], o["warps_per_sm"]) == (8, "warps", 64)


def test_lowering_keeps_every_kernel_with_its_launch_parameters(tmp_path):
    from kernels.dispatch import TILES
    rows = R.lower(["gdpa"], 64, str(tmp_path))
    assert [r["kernel"] for r in rows] == ["jagged_flash_fwd_gdpa", "jagged_flash_dq_gdpa",
                                           "jagged_flash_dkv_gdpa"]
    assert [(r["num_warps"], r["num_stages"]) for r in rows] == [
        (TILES["num_warps"], TILES["num_stages"])] + 2 * [(TILES["num_warps_bwd"], TILES["num_stages_bwd"])]
    for r in rows:
        with open(r["ttir"]) as f:
            text = f.read()
        assert text.startswith(f"module @{r['kernel']}") and "tt.dot" in text
    with pytest.raises(ValueError, match="unknown op"):
        R.lower(["mosaic"], 64, str(tmp_path))
    with pytest.raises(ValueError, match="self-attention"):
        R.lower(["block"], 64, str(tmp_path), workload="W2")
    cross = R.lower(["softmax"], 64, str(tmp_path), workload="W2")      # 32 keys per sample
    assert [r["workload"] for r in cross] == ["W2"] * 3 and os.path.exists(cross[0]["ttir"])
    import jax
    assert jax.default_backend() == "cpu"          # the patches are undone


def test_compile_step_reports_resources(tmp_path):
    pytest.importorskip("triton")
    rows = R.compile_report(R.lower(["block"], 64, str(tmp_path)))
    assert [r["kernel"] for r in rows] == ["block_attention_fwd", "block_attention_bwd"]
    assert all(r["registers"] > 0 and r["ctas_per_sm"] >= 1 for r in rows)
