"""tools/kernel_times.py on CPU: its variant specs (attention_workloads.parse_variant)
and its no-GPU exit."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_variant_specs():
    from benchmarks.attention_workloads import parse_variant
    assert parse_variant("gdpa_triton") == ("gdpa", "triton", ())
    assert parse_variant("softmax_mosaic[schedule_barrier=0+fused_dq=1]") == (
        "softmax", "mosaic", (("fused_dq", True), ("schedule_barrier", False)))
    assert parse_variant("gdpa_mosaic[block_kv=128]") == (
        "gdpa", "mosaic", (("block_kv", 128),))
    assert parse_variant("block_triton") == ("block", "triton", ())
    for bad in ("block_mosaic", "block_triton[fused_delta=1]", "gdpa_cudnn",
                "softmax_mosaic[fused_delta=1", "gdpa_mosaic[x]"):
        with pytest.raises(ValueError):
            parse_variant(bad)


def test_without_gpu_exits_with_a_message(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "tools.kernel_times",
                        f"--out={tmp_path / 'k.json'}"], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode != 0
    assert "no GPU" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
