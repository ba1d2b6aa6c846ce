"""Continuous online training on the drifting synthetic stream (gemjax.train.online).

    python -m experiments.online --workdir=runs/online
    python -m experiments.online --config=tiny --windows=4 --override=data.drift_every=5

Trains a teacher continuously, window after window, next to a copy frozen after the
warm-up, each window validated before it is trained on (progressive validation), with
new item ids admitted by frequency. With --students (on by default), two students
(model.kind=student) train on every window after the warm-up with standard KD
(gemjax.distill): "student_fresh" from a snapshot of the fresh teacher retaken every
--refresh_every windows ("snapshot", sharing its id map), "student_frozen" from the
frozen teacher. Prints one line per window and the per-window NE
table at the end; WORKDIR holds metrics.jsonl (one "window" row per window),
summary.json and the checkpoints (rerunning the command resumes; SIGTERM stops after
the current window's checkpoint).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from gemjax.config import apply_overrides, get_config
from gemjax.train.guards import Interrupted
from gemjax.distill.transfer import DistillConfig, Distiller, Teacher, student_config
from gemjax.train.online import Member, OnlineSpec, copy_state, online_trainer, run_online

# The online stream on top of the preset: windows of 40 steps of 128 samples, 40% fresh
# teacher parameters per window, item popularity moving, 5% of items never seen before;
# per-item biases make the item ids (and their admission) matter; a constant learning
# rate after 10 warm-up steps (gemjax.train.online.online_trainer).
STREAM = ("data.drift_every=40,data.batch_size=128,data.drift_strength=0.4,data.popularity_shift=3,"
          "data.new_id_rate=0.05,data.item_bias=0.5,train.warmup_steps=10,train.dense_lr=5e-3,"
          "train.sparse_lr=0.3")


def snapshot_member(fresh: Member, refresh_every: int, warmup_windows: int) -> Member:
    """A copy of the fresh teacher (state and id map) retaken at the start of every
    refresh_every-th window from the end of the warm-up on; never trained."""
    def refresh(member: Member, members: dict, w: int) -> None:
        if w >= warmup_windows and (w - warmup_windows) % refresh_every == 0:
            member.state = copy_state(members["fresh"].state)
            member.admission = {t: a.copy() for t, a in members["fresh"].admission.items()}

    return Member("snapshot", fresh.trainer, None, {}, fresh.eval_step, None, refresh)


def student_members(refresh_every: int, warmup_windows: int, dcfg: DistillConfig):
    """OnlineSpec.extra_members: the snapshot, then student_fresh (taught by the
    snapshot) and student_frozen (taught by the frozen teacher); each student starts
    (seed train.seed) when its teacher first exists and reads its teacher's id map."""
    def build(cfg, members: dict) -> list[Member]:
        out = [snapshot_member(members["fresh"], refresh_every, warmup_windows)]
        scfg = dataclasses.replace(cfg, name=cfg.name + "-student",
                                   model=dataclasses.replace(cfg.model, kind="student"))
        for name, teacher_name in (("student_fresh", "snapshot"), ("student_frozen", "frozen")):
            teacher = Teacher(members["fresh"].trainer, None)
            d = Distiller(online_trainer(student_config(scfg, cfg, dcfg),
                                         members["fresh"].trainer.mesh), teacher, dcfg)
            def refresh(member, all_members, w, d=d, teacher_name=teacher_name):
                if member.state is None and all_members[teacher_name].state is not None:
                    member.state = d.init_state(cfg.train.seed)
                d.teacher.state = all_members[teacher_name].state

            def train_step(state, batch, d=d):
                return d.step(state, batch, 0)

            out.append(Member(name, d.trainer, None, {}, d.predict, train_step, refresh,
                              shares_admission=teacher_name))
        return out
    return build


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="tiny", help="config preset (gemjax.config.PRESETS)")
    p.add_argument("--override", default="", help="comma-separated field=value, after the "
                   "stream settings (STREAM)")
    p.add_argument("--workdir", default="runs/online")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--warmup_windows", type=int, default=1, help="windows before the frozen copy")
    p.add_argument("--min_count", type=int, default=2, help="sightings before an id gets its row")
    p.add_argument("--buckets", type=int, default=16, help="shared rows of ids not admitted")
    p.add_argument("--students", type=int, default=1, help="1: also train the two students")
    p.add_argument("--refresh_every", type=int, default=1, help="windows between snapshots of "
                   "the fresh teacher for student_fresh")
    p.add_argument("--kd_alpha", type=float, default=0.5, help="weight of the teacher's soft "
                   "labels in the students' loss")
    p.add_argument("--item_rows", type=int, default=2048, help="rows of the item table (raw item "
                   "ids are unbounded: admitted ids take rows until they run out)")
    a = p.parse_args(argv)
    if a.refresh_every < 1:
        p.error(f"--refresh_every must be >= 1, got {a.refresh_every}")
    cfg = apply_overrides(get_config(a.config), STREAM + ("," + a.override if a.override else ""))
    spec = OnlineSpec(windows=a.windows, warmup_windows=a.warmup_windows, min_count=a.min_count,
                      buckets=a.buckets, table_rows=(("item", a.item_rows),),
                      extra_members=student_members(a.refresh_every, a.warmup_windows,
                                                    DistillConfig(methods="kd", alpha=a.kd_alpha))
                      if a.students else None)
    try:
        summary = run_online(cfg, a.workdir, spec)
    except Interrupted as e:
        print(f"[online] {e}", flush=True)
        return 128 + e.signum       # 130 SIGINT, 143 SIGTERM, as experiments/train.py
    print(f"[online] fresh teacher ahead of the frozen one on every window after the drift: "
          f"{summary['fresh_ahead_after_drift']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
