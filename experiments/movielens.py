"""MovieLens-1M next-item retrieval through the trainer: convert if needed, train, print the table.

    python -m experiments.movielens --workdir=runs/ml_retrieval --epochs=100          # full run
    python -m experiments.movielens --workdir=/tmp/ml_smoke --max_users=64 --epochs=2 \\
        --override=data.batch_size=16                                                  # CPU smoke

Step 1 (skipped when --data_out already holds it): experiments/convert_movielens.py
--tasks=retrieval --train_positions=1 writes --data_out/retrieval/{train,test}.parquet
from ../shared/datasets/ml-1m (or --data_dir), outside the repository: per user one
train row (the newest 200 train items before the last one -> the last train item) and
one test row (the newest 200 train items -> the leave-last-out test item).
Step 2: gemjax.train.loop.train with the preset movielens_retrieval (its docstring in
gemjax/config.py gives the recipe; --override changes any field) on those files for
--epochs epochs (one epoch: ceil(train rows / batch) steps), evaluated every
--eval_epochs epochs and at the end; rerunning with the same --workdir resumes.
Step 3: the table (HR@10, NDCG@10, HR@50, wall seconds, samples/s) beside the published
figures; WORKDIR/summary.json and metrics.jsonl hold every eval.

Protocol (gemjax.train.retrieval): leave-last-out; the model reads the newest 200
train items; the test item is ranked against every item that occurs in the files
(3,649 of ML-1M's 3,706: items seen only before a user's 200 newest events never reach
the model; ranking against all 3,706 gave the same figures to the last digit on a
2-epoch run), the items of the user's history window excluded from the ranking as the
HSTU repository's eval does ("history excluded"); "history kept" leaves them in.
Training: every position of each user's window predicts the next item (the last
position the last train item), softmax over the shared item table.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

from absl import app, flags

PUBLISHED = (("SASRec (published)", 0.2853, 0.1603, 0.5474),
             ("HSTU (published)", 0.3097, 0.1720, 0.5754),
             ("HSTU-large (published)", 0.3294, 0.1893, 0.5935))


def define_flags() -> None:
    """The flags (defined only when run as a script, so tests can import this module)."""
    flags.DEFINE_string("data_dir", None, "ml-1m directory (default ../shared/datasets/ml-1m)")
    flags.DEFINE_string("data_out", "/tmp/gemjax-data/ml-1m",
                        "converted Parquet (outside any git work tree); reused when present")
    flags.DEFINE_string("workdir", "runs/ml_retrieval", "run directory (resumes if it holds one)")
    flags.DEFINE_integer("epochs", 100, "training epochs over the train rows")
    flags.DEFINE_integer("eval_epochs", 10, "epochs between evaluations (and checkpoints)")
    flags.DEFINE_integer("max_users", 0, "convert only the first N users (0 = all; smoke runs)")
    flags.DEFINE_integer("seed", 0, "train.seed")
    flags.DEFINE_string("override", "", "preset overrides, section.field=value,...")


def _converter():
    from experiments import convert_movielens   # defines no flags at import
    return convert_movielens


def ensure_converted(data_dir: str, out: str, max_users: int = 0, log=print) -> str:
    """out/retrieval (converted now unless its counts.json says it holds the same data:
    data_dir, users, one train position per user)."""
    d = os.path.join(out, "retrieval")
    counts_path = os.path.join(d, "counts.json")
    if os.path.exists(counts_path):
        c = json.load(open(counts_path))
        want_users = c.get("dataset_users") if max_users <= 0 else min(max_users,
                                                                       c.get("dataset_users", 0))
        if (c.get("data_dir") == os.path.abspath(data_dir) and c.get("train_positions") == 1
                and c.get("users") == want_users and not c.get("valid")):
            log(f"[movielens] reusing {d}")
            return d
    log(f"[movielens] converting {data_dir} -> {d}")
    _converter().convert(data_dir, out, ("retrieval",), train_positions=1, max_users=max_users)
    return d


def build_config(retrieval_dir: str, epochs: int, eval_epochs: int, seed: int, override: str):
    """The movielens_retrieval preset on retrieval_dir's files and schema, train.steps =
    epochs * steps per epoch, eval and checkpoints every eval_epochs epochs."""
    from gemjax.config import apply_overrides, get_config
    from gemjax.data.features import FeatureSchema
    schema = FeatureSchema.from_dict(json.load(open(os.path.join(retrieval_dir, "schema.json"))))
    counts = json.load(open(os.path.join(retrieval_dir, "counts.json")))
    cfg = dataclasses.replace(get_config("movielens_retrieval"), features=schema)
    cfg = apply_overrides(cfg, {"data.train_path": os.path.join(retrieval_dir, "train.parquet"),
                                "data.eval_path": os.path.join(retrieval_dir, "test.parquet"),
                                "train.seed": str(seed)})
    cfg = apply_overrides(cfg, override)
    per_epoch = math.ceil(counts["splits"]["train"]["rows"] / cfg.data.batch_size)
    every = max(1, min(eval_epochs, epochs)) * per_epoch
    return apply_overrides(cfg, {"train.steps": str(epochs * per_epoch),
                                 "train.eval_every": str(every),
                                 "train.checkpoint_every": str(every),
                                 "train.log_every": str(per_epoch),
                                 "train.warmup_steps": str(min(per_epoch, cfg.train.warmup_steps))})


def table(summary: dict) -> str:
    """The result lines: published figures, then this run (history excluded / kept)."""
    lines = [f"{'model':30s} {'HR@10':>7s} {'NDCG@10':>8s} {'HR@50':>7s} {'wall s':>8s} "
             f"{'samples/s':>10s}"]
    for name, *m in PUBLISHED:
        lines.append(f"{name:30s} {m[0]:7.4f} {m[1]:8.4f} {m[2]:7.4f}")
    sps = summary.get("samples_per_sec") or 0.0
    for name, sfx in (("gemjax (history excluded)", ""), ("gemjax (history kept)", "_unmasked")):
        lines.append(f"{name:30s} {summary[f'eval_hr@10{sfx}']:7.4f} "
                     f"{summary[f'eval_ndcg@10{sfx}']:8.4f} {summary[f'eval_hr@50{sfx}']:7.4f} "
                     f"{summary['wall_time_s']:8.1f} {sps:10.1f}")
    return "\n".join(lines)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    from gemjax.data.movielens import DEFAULT_DIR
    try:
        d = ensure_converted(f.data_dir or DEFAULT_DIR, f.data_out, f.max_users)
        cfg = build_config(d, f.epochs, f.eval_epochs, f.seed, f.override)
    except (ValueError, FileNotFoundError) as e:
        raise app.UsageError(str(e))
    from gemjax.train.loop import train
    print(f"[movielens] {f.epochs} epochs = {cfg.train.steps} steps of {cfg.data.batch_size} "
          f"users; workdir {f.workdir}", flush=True)
    summary = train(cfg, f.workdir, log=lambda s: print(s, flush=True))
    print(f"\nMovieLens-1M test (leave-last-out, full ranking; {summary['config']}, "
          f"{cfg.train.steps} steps; {f.workdir}/summary.json)")
    print(table(summary))


if __name__ == "__main__":
    define_flags()
    app.run(main)
