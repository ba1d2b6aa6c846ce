"""Frappe CTR through the real trainer: convert once, train every model over seeds, print
the test AUC / NE table.

    python -m experiments.frappe --models=gem,lr --seeds=0,1,2 \
        --data_out=/tmp/gemjax-data/frappe --workdir=runs/frappe

1. Conversion: experiments/convert_frappe.py's `convert` writes the Parquet splits and
   schema.json of ../shared/datasets/frappe (or --data_dir) into --data_out (outside any
   git work tree), only when --data_out holds no conversion yet. A conversion already
   there is reused when its counts.json names the same source directory, split seed
   (--split_seed) and holdout fraction; otherwise the script stops and names the
   difference.
2. Training: gemjax.train.loop.train with the `frappe` preset (gemjax/config.py: 180
   steps of 512 rows of train.parquet, every row of test.parquet evaluated at the end),
   the converted schema, and for each model its `model.kind`:

     gem      GEM v0: Wukong over the 10 field tokens, then the multi-domain head.
              Frappe has no event sequences, so this is Wukong alone (the same model
              as model.kind=gem,model.use_sequences=false).
     lr       logistic regression on the same ids.

   The full GEM teacher (model.kind=teacher) is built around event sequences
   (gemjax.models.interformer refuses a schema without them), so it is not offered
   here; MovieLens ranking (preset movielens_rank) trains it.

   One workdir per (model, seed): WORKDIR/MODEL_sSEED, holding metrics.jsonl,
   summary.json and the checkpoints. A workdir whose summary.json already exists is
   not trained again (its figures are read back); other workdirs resume as train()
   does. --override applies on top of the preset for every model (e.g.
   train.steps=90).
3. Results: WORKDIR/results.json (every run's test AUC, NE, calibration, wall seconds)
   and, printed last, one row per model: test AUC and NE, mean ± std (population std)
   over the seeds.
"""

from __future__ import annotations

import json
import os
import time

from absl import app, flags, logging

MODELS = {"gem": "model.kind=gem", "lr": "model.kind=lr"}
CONVERTED = ("schema.json", "counts.json", "train.parquet", "holdout.parquet", "test.parquet")


def define_flags():
    """The command line's flags (defined when run as a script, so that tests can import
    this module beside other scripts defining the same names)."""
    flags.DEFINE_string("data_dir", None, "frappe directory (default ../shared/datasets/frappe)")
    flags.DEFINE_string("data_out", "/tmp/gemjax-data/frappe",
                        "converted Parquet directory (outside any git work tree)")
    flags.DEFINE_integer("split_seed", 0, "seed of the train / holdout split of valid.libsvm")
    flags.DEFINE_float("holdout_fraction", 0.2, "share of valid.libsvm held out (holdout.parquet)")
    flags.DEFINE_list("models", ["gem", "lr"], f"models to train: {sorted(MODELS)}")
    flags.DEFINE_list("seeds", ["0", "1", "2"], "train seeds (init and shuffle)")
    flags.DEFINE_string("workdir", "runs/frappe", "one subdirectory per model and seed")
    flags.DEFINE_string("override", "", "config overrides for every model, e.g. train.steps=90")


def ensure_converted(data_dir: str, out: str, split_seed: int, holdout_fraction: float) -> str:
    """`out` holding the Parquet splits of `data_dir`: converted now if `out` holds no
    conversion, else checked against counts.json. Returns the absolute `out`."""
    from gemjax.data.parquet_writer import check_out_dir
    out = check_out_dir(out)
    present = [n for n in CONVERTED if os.path.exists(os.path.join(out, n))]
    if not present:
        cf = _convert_frappe()
        cf.convert(data_dir, out, seed=split_seed, holdout_fraction=holdout_fraction)
        return out
    missing = sorted(set(CONVERTED) - set(present))
    if missing:
        raise ValueError(f"--data_out={out} holds a partial conversion (missing {missing}); "
                         f"delete the directory or pick another --data_out")
    with open(os.path.join(out, "counts.json")) as f:
        counts = json.load(f)
    want = {"data_dir": os.path.abspath(data_dir), "seed": split_seed,
            "holdout_fraction": holdout_fraction}
    diff = {k: (counts.get(k), v) for k, v in want.items() if counts.get(k) != v}
    if diff:
        raise ValueError(f"--data_out={out}: counts.json was converted with another split "
                         + ", ".join(f"{k}={a!r} (asked {b!r})" for k, (a, b) in diff.items())
                         + "; pick another --data_out")
    return out


def _convert_frappe():
    from experiments import convert_frappe   # defines no flags at import
    return convert_frappe


def run_config(data: str, model: str, seed: int, override: str = ""):
    """The `frappe` preset on the converted files in `data`, for `model` and `seed`."""
    from gemjax.config import apply_overrides, on_converted_files
    cfg = on_converted_files("frappe", data, f"{MODELS[model]},train.seed={seed},train.tensorboard=false")
    return apply_overrides(cfg, override) if override else cfg


def train_one(data: str, model: str, seed: int, workdir: str, override: str = "",
              log=print) -> dict:
    """One (model, seed) run of train() in `workdir`; its test figures."""
    from gemjax.train.loop import train
    done = os.path.join(workdir, "summary.json")
    t0 = time.time()
    if os.path.exists(done):
        with open(done) as f:
            summary = json.load(f)
    else:
        summary = train(run_config(data, model, seed, override), workdir, log=log)
    return {"model": model, "seed": seed, "test_auc": summary["eval_auc"],
            "test_ne": summary["eval_ne"], "test_calibration": summary["eval_calibration"],
            "steps": summary["steps"], "seconds": round(time.time() - t0, 1),
            "workdir": workdir}


def table(results: list[dict], models: list[str]) -> str:
    """One line per model: test AUC and NE, mean ± std over its seeds."""
    import numpy as np
    lines = [f"{'model':8s} {'seeds':>5s} {'test AUC':>17s} {'test NE':>17s} {'s/run':>6s}"]
    for m in models:
        rs = [r for r in results if r["model"] == m]
        auc = np.array([r["test_auc"] for r in rs])
        ne = np.array([r["test_ne"] for r in rs])
        sec = np.mean([r["seconds"] for r in rs])
        lines.append(f"{m:8s} {len(rs):5d} {auc.mean():8.4f} ± {auc.std():.4f} "
                     f"{ne.mean():8.4f} ± {ne.std():.4f} {sec:6.1f}")
    return "\n".join(lines)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    if "teacher" in f.models:
        raise app.UsageError("--models=teacher: the GEM teacher needs event sequences and "
                             "Frappe has none; pick from " + ", ".join(sorted(MODELS)))
    unknown = sorted(set(f.models) - set(MODELS))
    if unknown or not f.models:
        raise app.UsageError(f"--models: unknown {unknown}; pick from {sorted(MODELS)}")
    try:
        seeds = [int(s) for s in f.seeds]
    except ValueError:
        raise app.UsageError(f"--seeds: integers separated by commas, got {','.join(f.seeds)!r}")
    if not seeds:
        raise app.UsageError("--seeds: at least one seed")
    logging.set_verbosity(logging.WARNING)       # orbax logs every save at INFO
    from gemjax.data.frappe import DEFAULT_DIR
    try:
        data = ensure_converted(f.data_dir or DEFAULT_DIR, f.data_out, f.split_seed,
                                f.holdout_fraction)
        run_config(data, f.models[0], seeds[0], f.override)     # bad overrides stop here
    except (ValueError, FileNotFoundError) as e:
        raise app.UsageError(str(e))
    os.makedirs(f.workdir, exist_ok=True)
    results = []
    for model in f.models:
        for seed in seeds:
            r = train_one(data, model, seed, os.path.join(f.workdir, f"{model}_s{seed}"),
                          f.override, log=lambda s: None)
            print(f"{model} seed {seed}: test AUC {r['test_auc']:.4f} NE {r['test_ne']:.4f} "
                  f"({r['seconds']:.0f} s)", flush=True)
            results.append(r)
            with open(os.path.join(f.workdir, "results.json"), "w") as fh:
                json.dump({"data": data, "override": f.override, "results": results}, fh, indent=1)
    print(f"\nFrappe test ({data}/test.parquet), preset frappe"
          + (f" + {f.override}" if f.override else "") + f", seeds {','.join(map(str, seeds))}; "
          f"{os.path.join(f.workdir, 'results.json')}")
    print(table(results, f.models))


if __name__ == "__main__":
    define_flags()
    app.run(main)
