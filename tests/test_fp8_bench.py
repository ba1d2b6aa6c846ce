"""benchmarks/bench_fp8.py --smoke on CPU: the GEMM shapes it reads from the lowered train
step are the model's linear layers, and its figures follow from the timings it reports."""

import json
import os
import subprocess
import sys

import numpy as np
from suite_cache import smoke_teacher_override, with_suite_cache   # tests/suite_cache.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_smoke_shapes_and_figures(tmp_path):
    out = tmp_path / "fp8.json"
    env = with_suite_cache(dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"))
    teacher = smoke_teacher_override()   # the other benchmark tests' tiny teacher
    r = subprocess.run([sys.executable, "-m", "benchmarks.bench_fp8", "--smoke", "--nostep",
                        f"--override={teacher}", "--max_shapes=1", f"--out={out}"],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.load(open(out))
    from flax import nnx

    from gemjax.config import get_config
    from gemjax.models.gem import build_model
    cfg = get_config("tiny", teacher)
    model = nnx.eval_shape(lambda: build_model(cfg, nnx.Rngs(0)))
    kernels = {tuple(n.kernel.shape) for _, n in nnx.iter_graph(model) if isinstance(n, nnx.Linear)}
    assert len(res["gemms"]) == 1 and len(res["all_shapes"]) > 1   # the one of most FLOPs
    top = max(res["all_shapes"], key=lambda g: g["count"] * g["m"] * g["k"] * g["n"])
    assert {k: res["gemms"][0][k] for k in ("m", "k", "n", "count")} == top
    for g in res["gemms"]:
        m, k, n = g["m"], g["k"], g["n"]
        assert (k, n) in kernels and g["count"] >= 1
        for v in ("bf16", "fp8_rowwise", "fp8_tensor", "fp8_blocked"):
            x = g[v]
            np.testing.assert_allclose(x["fwd_tflops"], 2 * m * k * n / x["fwd_ms"] / 1e9, rtol=1e-6)
            np.testing.assert_allclose(x["fwdbwd_tflops"], 6 * m * k * n / x["fwdbwd_ms"] / 1e9,
                                       rtol=1e-6)
            if v != "bf16":
                np.testing.assert_allclose(x["fwd_speedup"], g["bf16"]["fwd_ms"] / x["fwd_ms"])
                # FP8 (3 mantissa bits) errs more than BF16 (7), within E4M3's 2 x 2**-4 per
                # product term times the sqrt(K) growth of random sums over max |y|
                assert g["bf16"]["rel_err"] < x["rel_err"] < 0.25
    assert r.stdout.strip().splitlines()[-1].startswith("total fp8_gemm_only")


def test_chosen_variants_only_each_printed_as_timed(tmp_path):
    # a subprocess: importing the benchmark here would define its absl flags in the suite
    out = tmp_path / "fp8.json"
    r = subprocess.run([sys.executable, "-m", "benchmarks.bench_fp8", "--smoke", "--nostep",
                        "--shapes=32x64x48:2", "--variants=fp8_tensor", f"--out={out}"],
                       capture_output=True, text=True, timeout=300,
                       env=with_suite_cache(dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")))
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.load(open(out))
    g = res["gemms"][0]
    assert res["variants"] == ["fp8_tensor"] and (g["m"], g["k"], g["n"], g["count"]) == (32, 64, 48, 2)
    assert {"bf16", "fp8_tensor", "fp8_gemm_only"} <= set(g) and not {"fp8_rowwise", "fp8_blocked"} & set(g)
    np.testing.assert_allclose(g["fp8_tensor"]["fwd_speedup"], g["bf16"]["fwd_ms"] / g["fp8_tensor"]["fwd_ms"])
    lines = [ln.split(":")[0].strip() for ln in r.stdout.splitlines() if ln.startswith("  32x64x48")]
    assert lines == ["32x64x48 bf16", "32x64x48 fp8_tensor", "32x64x48 fp8_gemm_only"]
    assert set(res["gemm_totals_ms"]) == {"bf16", "fp8_tensor", "fp8_gemm_only"}


def test_unknown_variant_is_named():
    r = subprocess.run([sys.executable, "-m", "benchmarks.bench_fp8", "--nostep",
                        "--variants=fp8_rowwise,fp8_bogus"], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"))
    assert r.returncode != 0 and "--variants: unknown ['fp8_bogus']" in r.stderr
    r = subprocess.run([sys.executable, "-m", "benchmarks.bench_fp8", "--nostep", "--nogemms"],
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"))
    assert r.returncode != 0 and "leaves nothing to time" in r.stderr


def test_steps_only_each_printed_and_saved_as_timed(tmp_path):
    """--nogemms: the BF16 and FP8 train steps alone; each step's line comes as it is
    timed, the JSON holds both and their ratio. A repeated --fp8_override times each FP8
    variant, the first also as the step's "fp8". The tiny model without sequences (the
    --limit smoke's): what is checked is the steps' bookkeeping, not the model's size."""
    out = tmp_path / "fp8.json"
    second = "model.precision=fp8,model.wgrad_dtype=bf16"
    r = subprocess.run([sys.executable, "-m", "benchmarks.bench_fp8", "--smoke", "--nogemms",
                        "--override=model.use_sequences=false", f"--out={out}",
                        "--fp8_override=model.precision=fp8", f"--fp8_override={second}"],
                       capture_output=True, text=True, timeout=600,
                       env=with_suite_cache(dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")))
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.load(open(out))
    assert res["gemms"] == [] and res["all_shapes"] == []
    st = res["step"]
    assert st["bf16"]["step_ms"] > 0 and st["fp8"]["step_ms"] > 0
    np.testing.assert_allclose(st["speedup"], st["bf16"]["step_ms"] / st["fp8"]["step_ms"])
    variants = st["fp8_variants"]
    assert [v["fp8_override"] for v in variants] == ["model.precision=fp8", second]
    assert variants[0] == st["fp8"]
    for v in variants:
        np.testing.assert_allclose(v["speedup"], st["bf16"]["step_ms"] / v["step_ms"])
    lines = [ln.split(":")[0] for ln in r.stdout.splitlines() if ln.startswith(("step ", "train "))]
    assert lines == ["step bf16", "step fp8 [model.precision=fp8]", f"step fp8 [{second}]",
                     "train step", "train step"]
    assert r.stdout.splitlines()[-1].startswith("train step: bf16") and second in r.stdout.splitlines()[-1]
    assert not any(ln.startswith("total ") for ln in r.stdout.splitlines())


def test_limit_table_smoke(tmp_path):
    """--limit: BF16 and FP8 steps per scaling (delayed included), the quantization-free
    step and the Amdahl bound, their figures recomputed here from the per-GEMM timings."""
    out = tmp_path / "fp8.json"
    r = subprocess.run([sys.executable, "-m", "benchmarks.bench_fp8", "--smoke", "--limit",
                        "--override=model.use_sequences=false", "--shapes=32x64x48:2,16x32x32:3",
                        "--scalings=tensor,delayed", "--gemm_share=0.5", "--batches=1",
                        f"--out={out}"], capture_output=True, text=True, timeout=600,
                       env=with_suite_cache(dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")))
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.load(open(out))
    t = res["limit"]
    names = [row["name"] for row in t["rows"]]
    assert names == ["bf16", "fp8 tensor", "fp8 delayed", "fp8 quantization free"]
    bf16 = res["step"]["bf16"]["step_ms"]
    g16 = sum(g["count"] * g["bf16"]["fwdbwd_ms"] for g in res["gemms"])
    g8 = sum(g["count"] * g["fp8_gemm_only"]["fwdbwd_ms"] for g in res["gemms"])
    np.testing.assert_allclose(t["rows"][-1]["step_ms"], bf16 - g16 + g8, rtol=1e-9)
    np.testing.assert_allclose(t["gemm_share_measured"], g16 / bf16, rtol=1e-9)
    np.testing.assert_allclose(t["amdahl"], 1 / (0.5 + 0.5 * g8 / g16), rtol=1e-9)
    assert t["amdahl_free"] == 2.0
    steps = {v["fp8_override"]: v["step_ms"] for v in res["step"]["fp8_variants"]}
    assert t["rows"][2]["step_ms"] == steps["model.precision=fp8,model.fp8_scaling=delayed"]
    assert res["variants"] == []          # --limit times no fp8_dot variant unless asked
    assert "Amdahl bound" in r.stdout and "fp8 quantization free" in r.stdout
