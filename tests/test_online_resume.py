"""Online training (gemjax.train.online): a run stopped by SIGTERM, resumed, killed with
kill -9, and resumed again ends with the metrics rows and member states of an
uninterrupted run; a run with the KD students extended by a window equals a longer run.

The online model is model.kind=student (the students' architecture, a cheap program that
reads the sequences: the admitted item ids of the sequences reach the model); online
training reads every model through its Trainer alike. The interrupted runs are two
`experiments/online.py` commands run one after the other in one subprocess (the second
reads the first's programs, its imports already paid); the uninterrupted run and the
last resume run_online in this process as the command does (its config and OnlineSpec).
Every run, the child's included, is on a one-device mesh in a process of this process's
CPU device count, so all of them build the same programs and the suite's compilation
cache serves the child those this process compiled (the cache keys a program by the
device count of its process too)."""

import json
import os
import re
import signal
import sys

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from experiments.online import STREAM
from gemjax.config import apply_overrides, get_config
from gemjax.train.guards import ResumeMismatch
from gemjax.train.online import OnlineSpec, run_online, summary_table
from test_faults import Run

OVERRIDE = "data.drift_every=2,data.batch_size=64,model.kind=student"
WINDOWS = 4
ARGS = ["--config=tiny", f"--windows={WINDOWS}", f"--override={OVERRIDE}", "--item_rows=1024", "--students=0",
        "--min_count=2", "--buckets=16"]
SPEC = OnlineSpec(windows=WINDOWS, min_count=2, buckets=16, table_rows=(("item", 1024),))
# the experiments/online.py commands [argv, ...] one after another in one process, each
# followed by "[test] exit CODE" (main's return value); run_online on a one-device mesh
CHILD = """
import functools, json, sys
import jax, numpy as np
from jax.sharding import Mesh
from experiments import online
online.run_online = functools.partial(online.run_online,
                                      mesh=Mesh(np.array(jax.devices()[:1]), ("batch",)))
for argv in json.loads(sys.argv[1]):
    print(f"[test] exit {online.main(argv)}", flush=True)
"""


def _cfg():
    return apply_overrides(get_config("tiny"), STREAM + "," + OVERRIDE)


def _rows(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_sigterm_and_kill9_resume_equal_an_uninterrupted_run(tmp_path):
    ref_dir, dir_ = str(tmp_path / "reference"), str(tmp_path / "interrupted")
    mesh = Mesh(np.array(jax.devices()[:1]), ("batch",))
    run_online(_cfg(), ref_dir, SPEC, mesh=mesh, log=lambda s: None)            # uninterrupted
    with open(os.path.join(ref_dir, "summary.json")) as f:
        ref = json.load(f)

    # one child runs the command twice: SIGTERM during window 1 stops the first after its
    # checkpoint (main returns 128 + SIGTERM, printed), the second resumes and is killed
    # with kill -9 after the next window's checkpoint
    argv = [*ARGS, f"--workdir={dir_}"]
    run = Run(dir_, cmd=[sys.executable, "-c", CHILD, json.dumps([argv, argv])],
              devices=jax.device_count())
    run.wait_for("[online] window 0:")
    run.proc.send_signal(signal.SIGTERM)
    run.wait_for("[test] exit ")
    assert f"[test] exit {128 + signal.SIGTERM}\n" in run.lines, run.out[-3000:]
    stopped_at = int(re.search(r"stopped by SIGTERM after window (\d+): checkpoint", run.out)[1])
    assert stopped_at < WINDOWS - 1

    run.wait_for(f"[online] window {stopped_at + 1}:")
    run.proc.kill()
    assert run.finish() == -signal.SIGKILL
    assert f"resumed at window {stopped_at + 1}" in run.out
    assert max(r["window"] for r in _rows(dir_)) >= stopped_at + 1

    logged = []                                                                 # resume to the end
    run_online(_cfg(), dir_, SPEC, mesh=mesh, log=logged.append)
    assert any("resumed at window" in line for line in logged), logged

    assert _rows(dir_) == _rows(ref_dir)
    with open(os.path.join(dir_, "summary.json")) as f:
        got = json.load(f)
    assert got["digests"] == ref["digests"]
    assert got["admission"] == ref["admission"]
    assert ref["admission"]["item"]["admitted"] > 0 and ref["admission"]["item"]["hashed"] > 0
    rows = ref["rows"]
    assert [r["window"] for r in rows] == list(range(WINDOWS))
    # the frozen teacher is the fresh one at the end of window 0: equal on window 1's batches
    assert rows[0]["ne_frozen"] is None and rows[1]["ne_frozen"] == rows[1]["ne_fresh"]
    assert rows[2]["ne_frozen"] != rows[2]["ne_fresh"]
    assert all(r["item_new_ids"] > 0 for r in rows)
    assert "window | bayes | fresh | frozen" in summary_table(rows, ["fresh", "frozen"])

    # a resume with another admission rule is refused, naming it
    with pytest.raises(ResumeMismatch, match="min_count"):
        run_online(_cfg(), ref_dir, OnlineSpec(windows=WINDOWS, min_count=3, buckets=16,
                                               table_rows=(("item", 1024),)), mesh=mesh)


def test_students_and_snapshot_resume_exactly(tmp_path):
    """A run of 2 windows extended to 3 (restoring the teachers, the snapshot, both
    students and the shared id maps) equals a 3-window run; the students appear after
    the warm-up and learn from their own teachers."""
    from experiments.online import student_members
    from gemjax.distill.transfer import DistillConfig

    mesh = Mesh(np.array(jax.devices()[:1]), ("batch",))
    cfg = _cfg()          # the teachers' programs are those of the test above

    def spec(windows):
        return OnlineSpec(windows=windows, min_count=2, buckets=16, table_rows=(("item", 1024),),
                          extra_members=student_members(1, 1, DistillConfig(methods="kd")))
    whole = run_online(cfg, str(tmp_path / "whole"), spec(3), mesh=mesh, log=lambda s: None)
    run_online(cfg, str(tmp_path / "parts"), spec(2), mesh=mesh, log=lambda s: None)
    parts = run_online(cfg, str(tmp_path / "parts"), spec(3), mesh=mesh, log=lambda s: None)
    assert parts["rows"] == whole["rows"]
    assert parts["digests"] == whole["digests"]
    assert sorted(whole["digests"]) == ["fresh", "frozen", "snapshot", "student_fresh",
                                        "student_frozen"]
    r0, r1, r2 = whole["rows"]
    assert r0["ne_student_fresh"] is None and r1["ne_student_fresh"] is not None
    # window 1: the snapshot is the frozen teacher, so both students start alike
    assert r1["ne_student_fresh"] == r1["ne_student_frozen"]
    assert r2["ne_snapshot"] == r2["ne_fresh"] != r2["ne_frozen"]
    # every member, students included, is a run directory holding its final state, with the
    # id map it reads: the snapshot's for student_fresh
    from gemjax.serve.restore import restore
    from gemjax.train.online import member_dir, state_digest
    got = {n: restore(member_dir(str(tmp_path / "whole"), n), log=lambda s: None)
           for n in whole["digests"]}
    for n in whole["digests"]:
        assert state_digest(got[n].state, got[n].trainer) == whole["digests"][n], n
    # each directory records its own member's config (the students' is named apart)
    assert {n: r.cfg.name for n, r in got.items()} == {
        **dict.fromkeys(("fresh", "frozen", "snapshot"), cfg.name),
        **dict.fromkeys(("student_fresh", "student_frozen"), cfg.name + "-student")}
    assert got["student_fresh"].cfg.model.kind == "student"
    assert got["student_fresh"].meta["admission"] == got["snapshot"].meta["admission"]
