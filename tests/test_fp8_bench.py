"""benchmarks/bench_fp8.py --smoke on CPU: the GEMM shapes it reads from the lowered train
step are the model's linear layers, and its figures follow from the timings it reports.

Every command line runs in one child process (imports and tracing paid once): each
command's stdout, stderr and outcome (0, or the UsageError it raised) are kept apart."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from suite_cache import smoke_teacher_override, with_suite_cache   # tests/suite_cache.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIRST = "model.precision=fp8,model.fp8_scaling=tensor"
SECOND = "model.precision=fp8,model.fp8_scaling=delayed"   # the --limit run's FP8 steps: compiled once

# the commands' main runs as app.run would run it, a UsageError caught per command
_CHILD = """
import json, sys
from absl import app, flags
from benchmarks import bench_fp8
for name, argv in json.loads(sys.argv[1]):
    for stream in (sys.stdout, sys.stderr):
        print(f"[test] command {name}", file=stream, flush=True)
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["bench_fp8", *argv])
    try:
        bench_fp8.main(["bench_fp8"])
        code = 0
    except app.UsageError as e:
        print(f"FATAL Flags parsing error: {e}", file=sys.stderr)
        code = 1
    sys.stdout.flush()
    print(f"[test] exit {code}", file=sys.stderr, flush=True)
"""


def _split(text):
    return {part.split("\n", 1)[0]: part.split("\n", 1)[1] if "\n" in part else ""
            for part in text.split("[test] command ")[1:]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: (exit code, stdout, stderr, out json path)} of every command."""
    d = tmp_path_factory.mktemp("fp8")
    teacher = smoke_teacher_override()   # the other benchmark tests' tiny teacher
    spec = {
        "shapes": ["--smoke", "--nostep", f"--override={teacher}", "--max_shapes=1"],
        "variants": ["--smoke", "--nostep", "--shapes=32x64x48:2", "--variants=fp8_tensor"],
        "steps": ["--smoke", "--nogemms", "--override=model.use_sequences=false",
                  f"--fp8_override={FIRST}", f"--fp8_override={SECOND}"],
        "limit": ["--smoke", "--limit", "--override=model.use_sequences=false",
                  "--shapes=32x64x48:2,16x32x32:3", "--scalings=tensor,delayed",
                  "--gemm_share=0.5", "--batches=1"],
        "bogus": ["--nostep", "--variants=fp8_rowwise,fp8_bogus"],
        "nothing": ["--nostep", "--nogemms"],
    }
    cmds = [[n, a + ([f"--out={d / n}.json"] if "--smoke" in a else [])] for n, a in spec.items()]
    env = with_suite_cache(dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"))
    r = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(cmds)], capture_output=True,
                       text=True, timeout=900, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    out, err = _split(r.stdout), _split(r.stderr)
    assert list(err) == list(spec), r.stderr[-3000:]
    res = {}
    for name in spec:
        body, _, code = err[name].rpartition("[test] exit ")
        res[name] = (int(code), out.get(name, ""), body, d / f"{name}.json")
    return res


def _ok(runs, name):
    code, stdout, stderr, path = runs[name]
    assert code == 0, stderr[-3000:]
    return stdout, json.load(open(path))


def test_smoke_shapes_and_figures(runs):
    stdout, res = _ok(runs, "shapes")
    teacher = smoke_teacher_override()
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
    assert stdout.strip().splitlines()[-1].startswith("total fp8_gemm_only")


def test_chosen_variants_only_each_printed_as_timed(runs):
    stdout, res = _ok(runs, "variants")
    g = res["gemms"][0]
    assert res["variants"] == ["fp8_tensor"] and (g["m"], g["k"], g["n"], g["count"]) == (32, 64, 48, 2)
    assert {"bf16", "fp8_tensor", "fp8_gemm_only"} <= set(g) and not {"fp8_rowwise", "fp8_blocked"} & set(g)
    np.testing.assert_allclose(g["fp8_tensor"]["fwd_speedup"], g["bf16"]["fwd_ms"] / g["fp8_tensor"]["fwd_ms"])
    lines = [ln.split(":")[0].strip() for ln in stdout.splitlines() if ln.startswith("  32x64x48")]
    assert lines == ["32x64x48 bf16", "32x64x48 fp8_tensor", "32x64x48 fp8_gemm_only"]
    assert set(res["gemm_totals_ms"]) == {"bf16", "fp8_tensor", "fp8_gemm_only"}


def test_unknown_variant_is_named(runs):
    code, _, stderr, _ = runs["bogus"]
    assert code != 0 and "--variants: unknown ['fp8_bogus']" in stderr
    code, _, stderr, _ = runs["nothing"]
    assert code != 0 and "leaves nothing to time" in stderr


def test_steps_only_each_printed_and_saved_as_timed(runs):
    """--nogemms: the BF16 and FP8 train steps alone; each step's line comes as it is
    timed, the JSON holds both and their ratio. A repeated --fp8_override times each FP8
    variant, the first also as the step's "fp8". The tiny model without sequences (the
    --limit smoke's): what is checked is the steps' bookkeeping, not the model's size."""
    second = SECOND
    stdout, res = _ok(runs, "steps")
    assert res["gemms"] == [] and res["all_shapes"] == []
    st = res["step"]
    assert st["bf16"]["step_ms"] > 0 and st["fp8"]["step_ms"] > 0
    np.testing.assert_allclose(st["speedup"], st["bf16"]["step_ms"] / st["fp8"]["step_ms"])
    variants = st["fp8_variants"]
    assert [v["fp8_override"] for v in variants] == [FIRST, second]
    assert variants[0] == st["fp8"]
    for v in variants:
        np.testing.assert_allclose(v["speedup"], st["bf16"]["step_ms"] / v["step_ms"])
    lines = [ln.split(":")[0] for ln in stdout.splitlines() if ln.startswith(("step ", "train "))]
    assert lines == ["step bf16", f"step fp8 [{FIRST}]", f"step fp8 [{second}]",
                     "train step", "train step"]
    assert stdout.splitlines()[-1].startswith("train step: bf16") and second in stdout.splitlines()[-1]
    assert not any(ln.startswith("total ") for ln in stdout.splitlines())


def test_limit_table_smoke(runs):
    """--limit: BF16 and FP8 steps per scaling (delayed included), the quantization-free
    step and the Amdahl bound, their figures recomputed here from the per-GEMM timings."""
    stdout, res = _ok(runs, "limit")
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
    assert "Amdahl bound" in stdout and "fp8 quantization free" in stdout
