"""benchmarks/bench_saved_ne.py: its plan parsing and refusal of bad plans, and --smoke, the
NE-delta table of FP8-kept saved activations from real training runs of a small teacher
(one seed, two plans), all in one child process (the benchmark's absl flags stay out of
this one; its imports are paid once)."""

import json
import os
import subprocess
import sys

import pytest
from suite_cache import with_suite_cache   # tests/suite_cache.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BAD_PLANS = ["none@model.precision", "none@model.precison=fp8"]

CHILD = """
import json, sys
from absl import app, flags
from benchmarks import bench_saved_ne as b
p = b.plan_overrides
print("[parsed] " + json.dumps([p("all:quantize"), p("none@model.precision=fp8@model.norm_impl=auto")]))
trains = b.train_and_eval
b.train_and_eval = None          # a bad plan must stop the run before any training
for bad in json.loads(sys.argv[2]):
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["bench_saved_ne.py", "--smoke", f"--plans=none,{bad}"])
    try:
        b.main([])
        error = None
    except app.UsageError as e:
        error = str(e)
    print("[bad] " + json.dumps({"plan": bad, "error": error}), flush=True)
b.train_and_eval = trains
flags.FLAGS.unparse_flags()
flags.FLAGS(["bench_saved_ne.py", "--smoke", "--time_steps=1", f"--out={sys.argv[1]}"])
print("[smoke]", flush=True)
b.main([])
"""


@pytest.fixture(scope="module")
def child(tmp_path_factory):
    """(the child's CompletedProcess, the smoke's JSON path): plan parsing, the bad plans,
    then `--smoke --time_steps=1 --out=...` through main, in one process."""
    out = tmp_path_factory.mktemp("saved_ne") / "saved_ne.json"
    env = with_suite_cache(dict(os.environ, JAX_PLATFORMS="cpu"))   # a subprocess: one CPU device
    r = subprocess.run([sys.executable, "-c", CHILD, str(out), json.dumps(BAD_PLANS)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return r, out


@pytest.mark.slow
def test_bench_saved_ne_smoke_table_and_json(child):
    """The reference row has delta 0; all:quantize trains on 8-bit inputs (its NE moves, by
    little) and its compiled step keeps fewer temp bytes; the JSON's deltas are the NE
    ratios; the table is printed last."""
    r, out = child
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


def test_plan_overrides_parse_and_bad_plans_fail_before_training(child):
    """A plan is a remat value with optional "@section.field=value" overrides; a malformed
    or unknown override stops main (--smoke) before any training (the child's training
    function is None meanwhile), naming the plan."""
    r, _ = child
    lines = r.stdout.split("[smoke]")[0].splitlines()
    assert "[smoke]" in r.stdout, r.stderr[-3000:]      # the bad plans ran without a crash
    (parsed,) = [json.loads(ln[9:]) for ln in lines if ln.startswith("[parsed] ")]
    assert parsed == [
        {"train.remat": "all:quantize"},
        {"train.remat": "none", "model.precision": "fp8", "model.norm_impl": "auto"}]
    bad = [json.loads(ln[6:]) for ln in lines if ln.startswith("[bad] ")]
    assert [x["plan"] for x in bad] == BAD_PLANS
    for x in bad:
        assert x["error"] is not None and x["error"].startswith(f"--plans: {x['plan']!r}"), x
    assert "seed 0: NE" not in r.stdout.split("[smoke]")[0]       # nothing trained
