"""benchmarks/bench_saved_ne.py --smoke: the NE-delta table of FP8-kept saved activations,
from real training runs of a small teacher (one seed, two plans)."""

import json
import os
import subprocess
import sys

import pytest
from suite_cache import with_suite_cache   # tests/suite_cache.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_bench_saved_ne_smoke_table_and_json(tmp_path):
    """The reference row has delta 0; all:quantize trains on 8-bit inputs (its NE moves, by
    little) and its compiled step keeps fewer temp bytes; the JSON's deltas are the NE
    ratios; the table is printed last."""
    out = tmp_path / "saved_ne.json"
    env = with_suite_cache(dict(os.environ, JAX_PLATFORMS="cpu"))   # a subprocess: one CPU device
    r = subprocess.run([sys.executable, "-m", "benchmarks.bench_saved_ne", "--smoke",
                        "--time_steps=1", f"--out={out}"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["reference"] == "none" and res["seeds"] == [0]
    ne = {run["plan"]: run["ne"] for run in res["runs"]}
    assert set(ne) == {"none", "all:quantize"}
    plans = {p["plan"]: p for p in res["plans"]}
    assert plans["none"]["deltas"] == [0.0]
    delta = plans["all:quantize"]["deltas"][0]
    assert delta == (ne["all:quantize"] - ne["none"]) / ne["none"]
    assert 0 < abs(delta) < 0.01, delta          # 8 bits were kept: the run moved, a little
    assert plans["all:quantize"]["temp_bytes"] < 0.8 * plans["none"]["temp_bytes"]
    last = r.stdout.rstrip().splitlines()[-1].split()
    assert last[0] == "all:quantize" and float(last[1]) == round(delta * 100, 4)



def test_plan_overrides_parse_and_bad_plans_fail_before_training():
    """A plan is a remat value with optional "@section.field=value" overrides (parsed in a
    subprocess: the benchmark's absl flags stay out of this one); a malformed or unknown
    override stops the run before any training, naming the plan."""
    env = with_suite_cache(dict(os.environ, JAX_PLATFORMS="cpu"))
    code = ("import json; from benchmarks.bench_saved_ne import plan_overrides as p; "
            "print(json.dumps([p('all:quantize'), "
            "p('none@model.precision=fp8@model.norm_impl=auto')]))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout) == [
        {"train.remat": "all:quantize"},
        {"train.remat": "none", "model.precision": "fp8", "model.norm_impl": "auto"}]
    for bad in ("none@model.precision", "none@model.precison=fp8"):
        r = subprocess.run([sys.executable, "-m", "benchmarks.bench_saved_ne", "--smoke",
                            f"--plans=none,{bad}"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode != 0 and f"--plans: {bad!r}" in r.stderr, r.stderr[-2000:]
        assert "seed 0: NE" not in r.stdout             # nothing trained
