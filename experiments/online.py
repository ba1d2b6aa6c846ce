"""Continuous online training (gemjax.train.online) on the drifting synthetic stream, or on
time-ordered Parquet rows in windows of a timestamp column.

    python -m experiments.online --workdir=runs/online
    python -m experiments.online --config=tiny --windows=4 --override=data.drift_every=5
    python -m experiments.online --workdir=runs/online_ml --movielens=/tmp/gemjax-data/ml-1m-time \
        --max_rows=100000 --models=teacher,student             # MovieLens-1M in time order
    python -m experiments.online --workdir=runs/own --features=schema.json --override=\
        data.source=parquet,data.train_path=rows/,data.time_column=ts,data.window_seconds=86400

Trains a teacher continuously, window after window, next to a copy frozen after the
warm-up, each window validated before it is trained on (progressive validation), with
new item ids admitted by frequency. With --students (on by default), two students
(model.kind=student) train on every window after the warm-up with standard KD
(gemjax.distill): "student_fresh" from a snapshot of the fresh teacher retaken every
--refresh_every windows ("snapshot", sharing its id map), "student_frozen" from the
frozen teacher. Prints one line per window and the per-window NE
table at the end; WORKDIR holds metrics.jsonl (one "window" row per window),
summary.json and the checkpoints (rerunning the command resumes; SIGTERM stops after
the current window's checkpoint), and each model as a run directory WORKDIR/members/<name>
(load_for_inference, export_model; raw ids through gemjax.serve.admitted).

Parquet (--features, or --movielens): the rows of data.train_path, sorted by
data.time_column, cut into windows of data.window_seconds; every window is scored (NE,
AUC, rows) by each model before it trains on it, ids of --admit_tables unseen before
are admitted by frequency as on the synthetic stream. Each model of --models runs as an
online run of its own in WORKDIR/<model> ("teacher": the preset's model, "student":
the same with model.kind=student), each a fresh copy trained on every window next to a
frozen copy trained on the first --warmup_windows windows only; WORKDIR/online_table.md
and online_table.json hold the per-window table (window, time range, rows, NE and AUC
fresh vs frozen per model). --movielens=DIR reads experiments/convert_movielens_time.py's
output in DIR, writing it there first (from the shared implicit ML-1M copy, --max_rows
rows) when DIR holds none.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys

from gemjax.config import apply_overrides, get_config
from gemjax.features import FeatureSchema
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
    p.add_argument("--windows", type=int, default=None, help="windows to run (synthetic: 8 "
                   "by default; Parquet: 0, the default, runs every window of the files)")
    p.add_argument("--warmup_windows", type=int, default=1, help="windows before the frozen copy")
    p.add_argument("--min_count", type=int, default=2, help="sightings before an id gets its row")
    p.add_argument("--buckets", type=int, default=16, help="shared rows of ids not admitted")
    p.add_argument("--students", type=int, default=None, help="synthetic stream: 1 (the "
                   "default) also trains the two KD students")
    p.add_argument("--refresh_every", type=int, default=1, help="windows between snapshots of "
                   "the fresh teacher for student_fresh")
    p.add_argument("--kd_alpha", type=float, default=0.5, help="weight of the teacher's soft "
                   "labels in the students' loss")
    p.add_argument("--item_rows", type=int, default=2048, help="synthetic stream: rows of the item "
                   "table (raw item ids are unbounded: admitted ids take rows until they run out)")
    p.add_argument("--features", default="", help="JSON feature schema of Parquet rows: train "
                   "on data.train_path in windows of data.time_column (set them, "
                   "data.source=parquet and data.window_seconds with --override)")
    p.add_argument("--movielens", default="", help="directory of experiments/"
                   "convert_movielens_time.py's output (written there first when absent)")
    p.add_argument("--max_rows", type=int, default=0, help="--movielens: convert only the "
                   "first N rows in time order (0: all)")
    p.add_argument("--window_seconds", type=float, default=0, help="Parquet: "
                   "data.window_seconds (0: the config's; with --movielens an eighth of the "
                   "rows' time span)")
    p.add_argument("--models", default="teacher", help="Parquet: comma-separated models, one "
                   "online run each in WORKDIR/<model>: teacher (the preset's model), student "
                   "(model.kind=student)")
    p.add_argument("--admit_tables", default="item", help="Parquet: comma-separated tables "
                   "whose ids go through the frequency admission")
    p.add_argument("--admit_rows", type=int, default=0, help="Parquet: rows of each admitted "
                   "table (0: its vocab in the feature schema)")
    a = p.parse_args(argv)
    if a.refresh_every < 1:
        p.error(f"--refresh_every must be >= 1, got {a.refresh_every}")
    if a.features or a.movielens:
        if a.students:
            p.error("--students (KD students) is for the synthetic stream; on Parquet rows use "
                    "--models=teacher,student")
        return run_parquet(a, p)
    parquet_only = [f"--{k}" for k, v in (("models", "teacher"), ("admit_tables", "item"),
                                          ("admit_rows", 0), ("max_rows", 0), ("window_seconds", 0))
                    if getattr(a, k) != v]
    if parquet_only:
        p.error(f"{', '.join(parquet_only)}: for Parquet rows (--features or --movielens)")
    a.windows = 8 if a.windows is None else a.windows
    a.students = 1 if a.students is None else a.students
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


def movielens_data(a) -> tuple[str, str]:
    """(schema.json path, overrides) of the time-ordered MovieLens rows in --movielens,
    converted first when absent or written with another --max_rows."""
    from experiments.convert_movielens_time import convert
    counts_path = os.path.join(a.movielens, "counts.json")
    counts = None
    if os.path.exists(counts_path):
        with open(counts_path) as f:
            counts = json.load(f)
    if counts is None or counts.get("max_rows") != a.max_rows:
        print(f"[online] writing the time-ordered MovieLens rows to {a.movielens}", flush=True)
        counts = convert(a.movielens, max_rows=a.max_rows)
    width = a.window_seconds or (counts["ts_last"] - counts["ts_first"] + 1) / 8
    train = os.path.join(a.movielens, "train.parquet")
    over = (f"data.source=parquet,data.train_path={train},data.eval_path={train},data.order=time,"
            f"data.time_column=ts,data.window_seconds={float(width)!r}")
    return os.path.join(a.movielens, "schema.json"), over


def clock(t: float) -> str:
    """A time of the table: a UTC date-time for Unix seconds (>= 1e8), else the number."""
    if t >= 1e8:
        return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
    return f"{t:g}"


def window_table(summaries: dict[str, dict]) -> tuple[str, dict]:
    """(markdown, JSON) of the per-window table: window, time range, rows, then NE and AUC
    fresh vs frozen of each model ({model: run_online summary})."""
    models = list(summaries)
    first = summaries[models[0]]["rows"]
    out = []
    for i, r in enumerate(first):
        row = {"window": r["window"], "t_start": r["t_start"], "t_end": r["t_end"], "rows": r["rows"]}
        for m in models:
            s = summaries[m]["rows"][i]
            row[m] = {k: s[k] for k in ("ne_fresh", "ne_frozen", "auc_fresh", "auc_frozen")}
        out.append(row)
    head = ["window", "time range", "rows"] + [f"{m} {k}" for m in models for k in
                                               ("NE fresh", "NE frozen", "AUC fresh", "AUC frozen")]
    fmt = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for row in out:
        cells = [str(row["window"]), f"{clock(row['t_start'])} - {clock(row['t_end'])}",
                 str(row["rows"])]
        for m in models:
            cells += [fmt(row[m][k]) for k in ("ne_fresh", "ne_frozen", "auc_fresh", "auc_frozen")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines), {"models": models, "rows": out}


def run_parquet(a, p) -> int:
    """Online runs on Parquet rows, one per model of --models; then the window table."""
    features, over = a.features, ""
    if a.movielens:
        features, over = movielens_data(a)
    try:
        with open(features) as f:
            schema = FeatureSchema.from_dict(json.load(f))
    except (OSError, ValueError, KeyError, TypeError) as e:
        p.error(f"--features={features}: {e}")
    base = dataclasses.replace(get_config(a.config), features=schema)
    width = f"data.window_seconds={float(a.window_seconds)!r}" if a.window_seconds else ""
    base = apply_overrides(base, ",".join(x for x in (over, a.override, width) if x))
    if not base.data.eval_path:       # unused by online training; validate() asks for one
        base = dataclasses.replace(base, data=dataclasses.replace(base.data,
                                                                  eval_path=base.data.train_path))
    tables = tuple(t for t in a.admit_tables.split(",") if t)
    models = [m for m in a.models.split(",") if m]
    bad = [m for m in models if m not in ("teacher", "student")]
    if bad or not models:
        p.error(f"--models: teacher and/or student, got {a.models!r}")
    summaries = {}
    for m in models:
        cfg = base if m == "teacher" else dataclasses.replace(
            base, name=base.name + "-student", model=dataclasses.replace(base.model, kind="student"))
        spec = OnlineSpec(windows=a.windows or 0, warmup_windows=a.warmup_windows,
                          min_count=a.min_count, buckets=a.buckets, admit_tables=tables,
                          table_rows=tuple((t, a.admit_rows) for t in tables) if a.admit_rows else ())
        try:
            summaries[m] = run_online(cfg, os.path.join(a.workdir, m), spec)
        except Interrupted as e:
            print(f"[online] {m}: {e}", flush=True)
            return 128 + e.signum
    md, js = window_table(summaries)
    with open(os.path.join(a.workdir, "online_table.md"), "w") as f:
        f.write(md + "\n")
    with open(os.path.join(a.workdir, "online_table.json"), "w") as f:
        json.dump(js, f, indent=1)
    print(md)
    return 0


if __name__ == "__main__":
    code = main()
    from gemjax.train.checkpoint import join_background_threads
    join_background_threads()      # Orbax writes still in flight end before the exit
    sys.exit(code)
