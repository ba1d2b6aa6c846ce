"""MovieLens-1M next-item retrieval through the trainer: convert if needed, train (selecting
the step on validation), print the test table beside the published figures.

    python -m experiments.movielens --workdir=runs/ml_retrieval                        # selection run
    python -m experiments.movielens --preset=movielens_hstu_large --seeds=0,1,2 \
        --workdir=runs/ml_hstu --epochs=101 --eval_epochs=1 --patience=10              # 3 seeds
    python -m experiments.movielens --workdir=/tmp/ml_smoke --max_users=64 --epochs=2 \
        --override=data.batch_size=16                                                  # CPU smoke

Step 1 (skipped when --data_out already holds it): experiments/convert_movielens.py
--tasks=retrieval --train_positions=1 [--valid] writes --data_out/retrieval/ from
../shared/datasets/ml-1m (or --data_dir), outside the repository. With --valid (the
default), per user: a train row (the newest 200 items before position L-2 -> item L-2,
positions 1-based over the L train items), a valid row (-> item L-1, the last train
item) and a test row (the newest 200 train items -> the leave-last-out test item);
--novalid: no valid row, the train row ends on item L-1.
Step 2: gemjax.train.loop.train with --preset (movielens_retrieval: the two-block
softmax tower; movielens_hstu_large: HSTU blocks; their docstrings in gemjax/config.py
give the recipes; --override changes any field) for --epochs epochs (one epoch:
ceil(train rows / batch) steps: 48 at batch 128). With --valid the validation rows are
ranked every --eval_epochs epochs; the best --select_metric step is kept
(WORKDIR/best), the run stops after --patience evals without gain, and the test rows
are ranked once, on the best state (train.select_metric / valid_every / patience,
data.valid_path). --refit then trains WORKDIR/refit for the best run's step count and
tests it (gemjax.train.refit): on the valid rows alone by default (--refit_rows=valid; a
valid row is the user's train row extended by item L-1, so they are the --novalid train
rows, the split the published runs train on), or on train + valid rows appended
(--refit_rows=train+valid: each history trained twice per epoch). --novalid: the test
rows every --eval_epochs epochs, the last state reported. --seeds=0,1,2: one run per seed in
WORKDIR/seed<N>, then mean +- std (sample std over the seeds). --steps_per_call=0 runs
an epoch's steps per jitted call (train.steps_per_call: the same numbers, one launch).
Step 3: the table (HR@10, NDCG@10, HR@50, NDCG@50, HR@200, NDCG@200, MRR, wall
seconds, samples/s) beside the published figures; WORKDIR/summary.json and
metrics.jsonl hold every eval.

Protocol (gemjax.train.retrieval): leave-last-out; the model reads the newest 200
train items; the test item is ranked against every item that occurs in the files
(3,649 of ML-1M's 3,706: items seen only before a user's 200 newest events never reach
the model; ranking against all 3,706 gave the same figures to the last digit on a
2-epoch run), the items of the user's history window excluded from the ranking as the
HSTU repository's eval does ("history excluded"); "history kept" leaves them in.
MRR = mean 1 / (rank + 1) over the full ranking. Training: every position of each
user's window predicts the next item (the last position the row's item).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import numpy as np
from absl import app, flags

# generative-recommenders' README, ML-1M (sampled softmax; HR@10, NDCG@10, HR@50, NDCG@50,
# HR@200, NDCG@200); no MRR is published for ML-1M
PUBLISHED = (("SASRec (published)", 0.2853, 0.1603, 0.5474, 0.2185, 0.7528, 0.2498),
             ("HSTU (published)", 0.3097, 0.1720, 0.5754, 0.2307, 0.7716, 0.2606),
             ("HSTU-large (published)", 0.3294, 0.1893, 0.5935, 0.2481, 0.7839, 0.2771))
COLUMNS = ("hr@10", "ndcg@10", "hr@50", "ndcg@50", "hr@200", "ndcg@200", "mrr")


def define_flags() -> None:
    """The flags (defined only when run as a script, so tests can import this module)."""
    flags.DEFINE_string("data_dir", None, "ml-1m directory (default ../shared/datasets/ml-1m)")
    flags.DEFINE_string("data_out", "/tmp/gemjax-data/ml-1m",
                        "converted Parquet (outside any git work tree); reused when present")
    flags.DEFINE_string("workdir", "runs/ml_retrieval", "run directory (resumes if it holds one)")
    flags.DEFINE_string("preset", "movielens_retrieval",
                        "movielens_retrieval (softmax tower), movielens_hstu_large (HSTU blocks) or "
                        "movielens_hstu_large_rab (HSTU blocks, relative position bias)")
    flags.DEFINE_integer("epochs", 100, "training epochs over the train rows (at most)")
    flags.DEFINE_integer("eval_epochs", 2, "epochs between evaluations (validation with "
                         "--valid, else test) and checkpoints")
    flags.DEFINE_bool("valid", True, "select the step on the validation rows (valid.parquet); "
                      "--novalid: no validation, the last state tested")
    flags.DEFINE_string("select_metric", "ndcg@10", "validation metric of the selection")
    flags.DEFINE_integer("patience", 5, "validation evals without gain before stopping (0: never)")
    flags.DEFINE_bool("refit", False, "after selection: train WORKDIR/refit for the best step "
                      "count on --refit_rows and test that too")
    flags.DEFINE_enum("refit_rows", "valid", ["valid", "train+valid"],
                      "rows of the refit: valid (each user's train row extended by item L-1: the "
                      "--novalid train rows) or train+valid (both row sets, appended)")
    flags.DEFINE_integer("max_users", 0, "convert only the first N users (0 = all; smoke runs)")
    flags.DEFINE_integer("seed", 0, "train.seed (one run)")
    flags.DEFINE_string("seeds", "", "comma-separated seeds: one run each in WORKDIR/seed<N>, "
                        "then mean +- std")
    flags.DEFINE_string("override", "", "preset overrides, section.field=value,...")
    flags.DEFINE_integer("steps_per_call", 1, "train steps per jitted call (train.steps_per_call; "
                         "must divide an epoch's steps; 0: one epoch per call); the same "
                         "numbers as one step per call, with one launch per call")


def _converter():
    from experiments import convert_movielens   # defines no flags at import
    return convert_movielens


def ensure_converted(data_dir: str, out: str, max_users: int = 0, log=print,
                     valid: bool = False) -> str:
    """out/retrieval (converted now unless its counts.json says it holds the same data:
    data_dir, users, one train position per user, a valid split iff `valid`)."""
    d = os.path.join(out, "retrieval")
    counts_path = os.path.join(d, "counts.json")
    if os.path.exists(counts_path):
        c = json.load(open(counts_path))
        want_users = c.get("dataset_users") if max_users <= 0 else min(max_users,
                                                                       c.get("dataset_users", 0))
        if (c.get("data_dir") == os.path.abspath(data_dir) and c.get("train_positions") == 1
                and c.get("users") == want_users and bool(c.get("valid")) == valid):
            log(f"[movielens] reusing {d}")
            return d
    log(f"[movielens] converting {data_dir} -> {d}")
    _converter().convert(data_dir, out, ("retrieval",), train_positions=1, max_users=max_users,
                         valid=valid)
    return d


def has_selection() -> bool:
    """Whether this gemjax's trainer selects on validation rows (train.select_metric)."""
    from gemjax.config import TrainConfig
    return "select_metric" in {f.name for f in dataclasses.fields(TrainConfig)}


def build_config(retrieval_dir: str, epochs: int, eval_epochs: int, seed: int, override: str,
                 preset: str = "movielens_retrieval", valid: bool = False,
                 select_metric: str = "ndcg@10", patience: int = 5, steps_per_call: int = 1):
    """`preset` on retrieval_dir's files and schema, train.steps = epochs * steps per
    epoch, evals (validation with `valid`, else test) and checkpoints every eval_epochs
    epochs, steps_per_call steps per jitted call (0: an epoch's; ValueError unless it
    divides an epoch's steps). valid: data.valid_path = valid.parquet, train.select_metric
    / patience / valid_every set (ValueError if the trainer has no selection); else no
    selection."""
    from gemjax.config import apply_overrides, get_config
    from gemjax.features import FeatureSchema
    schema = FeatureSchema.from_dict(json.load(open(os.path.join(retrieval_dir, "schema.json"))))
    counts = json.load(open(os.path.join(retrieval_dir, "counts.json")))
    cfg = dataclasses.replace(get_config(preset), features=schema)
    if cfg.model.kind != "retrieval":
        raise ValueError(f"--preset={preset} is no retrieval preset (model.kind={cfg.model.kind})")
    cfg = apply_overrides(cfg, {"data.train_path": os.path.join(retrieval_dir, "train.parquet"),
                                "data.eval_path": os.path.join(retrieval_dir, "test.parquet"),
                                "train.seed": str(seed)})
    if valid and not has_selection():
        raise ValueError("--valid needs a trainer with model selection (train.select_metric); "
                         "run with --novalid")
    if valid:
        cfg = apply_overrides(cfg, {"data.valid_path": os.path.join(retrieval_dir, "valid.parquet"),
                                    "train.select_metric": select_metric,
                                    "train.patience": str(patience)})
    elif has_selection():
        cfg = apply_overrides(cfg, {"data.valid_path": "", "train.select_metric": "",
                                    "train.patience": "0"})
    cfg = apply_overrides(cfg, override)
    per_epoch = math.ceil(counts["splits"]["train"]["rows"] / cfg.data.batch_size)
    every = max(1, min(eval_epochs, epochs)) * per_epoch
    k = steps_per_call or per_epoch
    if k < 1 or per_epoch % k:
        raise ValueError(f"--steps_per_call={steps_per_call} must divide the {per_epoch} steps "
                         f"of an epoch (or be 0: one epoch per call)")
    sched = {"train.steps_per_call": str(k), "train.steps": str(epochs * per_epoch),
             "train.eval_every": str(every), "train.checkpoint_every": str(every),
             "train.log_every": str(per_epoch),
             "train.warmup_steps": str(min(per_epoch, cfg.optim.dense.warmup_steps))}
    if valid:
        sched["train.valid_every"] = str(every)
    return apply_overrides(cfg, sched)


def _row(name: str, figures, wall=None, sps=None) -> str:
    cells = " ".join(f"{x:8.4f}" if x is not None else f"{'':8s}" for x in figures)
    tail = "" if wall is None else f" {wall:8.1f} {sps or 0.0:10.1f}"
    return f"{name:30s} {cells}{tail}"


def table(summary: dict) -> str:
    """The result lines: published figures, then this run (history excluded / kept)."""
    lines = [f"{'model':30s} " + " ".join(f"{c.upper():>8s}" for c in COLUMNS)
             + f" {'wall s':>8s} {'samples/s':>10s}"]
    for name, *m in PUBLISHED:
        lines.append(_row(name, list(m) + [None]))
    for name, sfx in (("gemjax (history excluded)", ""), ("gemjax (history kept)", "_unmasked")):
        lines.append(_row(name, [summary.get(f"eval_{c}{sfx}") for c in COLUMNS],
                          summary["wall_time_s"], summary.get("samples_per_sec")))
    return "\n".join(lines)


def seeds_table(summaries: dict[int, dict]) -> str:
    """Per seed the test figures (history excluded) and the best step, then mean +- std
    (sample std, ddof 1) over the seeds, beside the published figures."""
    lines = [f"{'model':30s} " + " ".join(f"{c.upper():>17s}" for c in COLUMNS)]
    for name, *m in PUBLISHED:
        lines.append(f"{name:30s} " + " ".join(f"{x:17.4f}" for x in m) + f" {'':>17s}")
    for s, summ in summaries.items():
        best = (summ.get("selection") or {}).get("best_step")
        lines.append(f"{f'gemjax seed {s}':30s} " + " ".join(
            f"{summ[f'eval_{c}']:17.4f}" for c in COLUMNS) + ("" if best is None
                                                                else f"  best step {best}"))
    figs = np.asarray([[summ[f"eval_{c}"] for c in COLUMNS] for summ in summaries.values()])
    std = figs.std(axis=0, ddof=1) if len(figs) > 1 else np.zeros(len(COLUMNS))
    lines.append(f"{f'gemjax mean +- std ({len(figs)})':30s} " + " ".join(
        f"{m:8.4f} +- {d:.4f}" for m, d in zip(figs.mean(axis=0), std)))
    return "\n".join(lines)


def run_one(cfg, workdir: str, refit: bool, log=print, refit_rows: str = "valid") -> dict:
    """Train (resuming) in workdir; with refit, also WORKDIR/refit on refit_rows
    (gemjax.train.refit). Returns {"run": summary, "refit": summary or None}."""
    from gemjax.train.loop import train
    summary = train(cfg, workdir, log=log)
    refit_summary = None
    if refit:
        from gemjax.train.refit import refit as refit_run
        refit_summary = refit_run(workdir, rows=refit_rows, log=log)
    return {"run": summary, "refit": refit_summary}


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    from gemjax.data.movielens import DEFAULT_DIR
    if f.refit and not f.valid:
        raise app.UsageError("--refit follows a selection run: drop --novalid")
    try:
        seeds = [int(x) for x in f.seeds.split(",") if x.strip()] if f.seeds else [f.seed]
    except ValueError:
        raise app.UsageError(f"--seeds={f.seeds!r}: comma-separated integers expected")
    try:
        d = ensure_converted(f.data_dir or DEFAULT_DIR, f.data_out, f.max_users, valid=f.valid)
        cfgs = {s: build_config(d, f.epochs, f.eval_epochs, s, f.override, f.preset, f.valid,
                                f.select_metric, f.patience, f.steps_per_call) for s in seeds}
    except (ValueError, FileNotFoundError, KeyError) as e:
        raise app.UsageError(str(e))
    results = {}
    for s, cfg in cfgs.items():
        wd = f.workdir if not f.seeds else os.path.join(f.workdir, f"seed{s}")
        sel = (f" selecting on validation {f.select_metric}, patience {f.patience}"
               if f.valid else "")
        print(f"[movielens] {cfg.name}, seed {s}: {f.epochs} epochs = {cfg.train.steps} steps "
              f"of {cfg.data.batch_size} users{sel}; workdir {wd}", flush=True)
        results[s] = run_one(cfg, wd, f.refit, log=lambda x: print(x, flush=True),
                             refit_rows=f.refit_rows)
        summary = results[s]["run"]
        chosen = summary.get("selection") or {}
        where = (f"best validation {chosen.get('metric')} {chosen.get('best_value'):.4f} at step "
                 f"{chosen.get('best_step')}" if chosen.get("best_step") is not None
                 else f"{cfg.train.steps} steps")
        print(f"\nMovieLens-1M test (leave-last-out, full ranking; {summary['config']}, seed {s}, "
              f"{where}; {wd}/summary.json)")
        print(table(summary))
        if results[s]["refit"] is not None:
            print(f"\nrefit on the {f.refit_rows} rows ({wd}/refit/summary.json)")
            print(table(results[s]["refit"]))
    if len(results) > 1:
        print("\nMovieLens-1M test over seeds (history excluded)")
        print(seeds_table({s: r["run"] for s, r in results.items()}))
        if f.refit:
            print("\nrefit over seeds")
            print(seeds_table({s: r["refit"] for s, r in results.items()}))


if __name__ == "__main__":
    define_flags()
    app.run(main)
