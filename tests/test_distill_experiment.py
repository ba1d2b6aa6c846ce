"""experiments/distill.py end to end at a toy size (one subprocess): the offline teacher
trained and read back from its checkpoint, every row of the table including the
hierarchical one, gains recomputed from the per-run NEs, frozen shared tables
unchanged, the FLOP column equal to forward_flops; and --dataset=frappe without the
converted files says so and exits 0."""

import json
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "experiments.distill", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_distill_experiment_table(tmp_path):
    p = _run([f"--out={tmp_path}", "--seeds=0", "--teacher_steps=4", "--student_steps=2",
              "--share=frozen",
              "--rows=none,kd,kd+adapter,+repr,+share,all", "--adapter_refresh=1",
              "--latency_batch=16", "--data_overrides=data.eval_batches=1,data.batch_size=32"],
             tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    out = os.path.join(tmp_path, "synthetic")
    res = json.load(open(os.path.join(out, "results.json")))
    rows = ["none", "kd", "kd+adapter", "+repr", "+share", "all", "hier"]
    assert sorted({r["row"] for r in res["runs"]}) == sorted(rows)
    for row in rows:
        ne = {r["seed"]: r["ne"] for r in res["runs"] if r["row"] == row}
        base = {r["seed"]: r["ne"] for r in res["runs"] if r["row"] == "none"}
        assert res["summary"][row]["ne"] == [ne[0]]
        np.testing.assert_allclose(res["summary"][row]["gain"], [base[0] - ne[0]])
        assert all(np.isfinite(v) for v in ne.values())
    assert all(r["shared_tables_unchanged"] for r in res["runs"] if r["row"] in ("+share", "all"))
    assert len(res["summary"]["teacher_ne"]) == 1
    assert os.path.exists(os.path.join(out, "teacher_s0", "summary.json"))   # offline checkpoint
    # the budget's FLOPs are the student's analytic count for its config
    from gemjax.config import apply_overrides, get_config
    from gemjax.models.student import forward_flops
    sys.path.insert(0, ROOT)
    from experiments import distill
    base_cfg = apply_overrides(get_config("tiny", distill.SYNTHETIC_DATA),
                               "data.eval_batches=1,data.batch_size=32")
    scfg = apply_overrides(base_cfg, distill.STUDENT)
    budget = {b["model"]: b for b in res["budget"]}
    assert budget["student"]["flops_per_sample"] == forward_flops(scfg)
    assert budget["student+share"]["own_table_bytes"] == 0
    assert all(b["latency_ms_b512"] > 0 for b in res["budget"])
    table = open(os.path.join(out, "table.md")).read()
    assert "| student all |" in table and "combined gain / KD gain" in table

    p = _run([f"--out={tmp_path}", "--dataset=frappe", f"--frappe_dir={tmp_path}/absent"], tmp_path)
    assert p.returncode == 0 and "no converted Frappe" in p.stdout
