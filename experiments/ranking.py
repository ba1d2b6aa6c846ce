"""MovieLens-1M ranking benchmark: five models x seeds, each chosen on validation, tested once.

    python -m experiments.ranking --data_out=/tmp/gemjax-data/ml-1m-bench \\
        --models=teacher,gem,wukong,dlrm,lr --seeds=0,1,2 \\
        --workdir=runs/ranking

Protocol (docs/ranking.md):
1. Data: experiments/convert_movielens.py's `convert` with --tasks=ranking --valid
   --resample_negatives into --data_out/ranking (converted here when absent; a
   conversion already there must have been made with the same source, seed, negatives,
   history cap and user count, else the script stops and names the difference). Per
   user with L train items: train = every position t = 1..L-2 (positives only), valid =
   t = L-1 (each user's second-to-last rating) and test = t = L (the leave-last-out
   item), valid and test each with --negatives fixed, seeded negatives.
2. Training: one subprocess per (model, seed) running gemjax.train.loop.train in
   WORKDIR/MODEL_sSEED on the `movielens_rank` preset with the converted schema and
     data:  train.parquet, --train_negatives negatives per positive drawn afresh every
            epoch (data.negatives; batch --positives x (1 + N) rows), valid.parquet as
            data.valid_path, test.parquet as data.eval_path, every eval row once;
     train: up to --max_epochs epochs, validation AUC after every epoch
            (train.select_metric=auc, train.valid_every = one epoch of steps), early
            stop after --patience epochs without improvement; the test rows are scored
            once, on the best validation checkpoint. The dense learning rate decays
            over the --max_epochs epochs of train.steps (an early stop ends part-way).
   then the model's overrides (MODELS), then its hyperparameters from --hparams, then
   --override. A workdir with summary.json is read back, not trained again; another is
   resumed by train() (a rerun continues where a killed one stopped; a SIGINT / SIGTERM
   to this command is passed on to the run, which saves, then the command exits 130;
   each run's output: WORKDIR/<model>_s<seed>/train.log). A workdir whose
   recorded config differs from the one asked for is refused (pick another --workdir).
3. Results: WORKDIR/results.json (every run) and a table per model: test AUC and NE
   (mean ± population std over seeds), forward GFLOP per sample
   (gemjax.perf.forward_flops on the first test batch), the epochs and steps the
   validation chose (mean over seeds).

--hparams: a JSON object {model: {override: value}}, e.g.
   {"teacher": {"train.dense_lr": 0.003, "model.dim": 64},
    "lr": {"train.sparse_lr": 0.1}, "gem": "sweeps/gem/sweep.json"}
values as in --override (numbers, true/false, strings; lists become tuples "64:64"); a
string instead of an object is the path (relative to the file) of a sweep.json written
by experiments.sweep, whose chosen trial's params are the model's overrides.
Models absent from the file run with the preset's settings. Choose them on validation
only (python -m experiments.sweep); the test rows never enter the choice. The default,
experiments/ranking_hparams.json, holds the settings this benchmark's validation AUC chose
(seed 0, dense learning rate 3e-3 or 1e-2 per model; the teacher without pyramid
pooling, which led the pooled preset on validation at equal epochs); --hparams='' runs
every model at the preset's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

from absl import app, flags, logging

from experiments.child import (REPO, Stopped, check_stopped, log_tail, repo_env, run_process,
                               train_here)

# Each model's settings chosen on the benchmark's validation AUC (seed 0; docs/results.md)
HPARAMS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ranking_hparams.json")

# model -> overrides on the movielens_rank preset (before --hparams and --override)
MODELS = {
    "teacher": {"model.kind": "teacher"},
    "gem": {"model.kind": "gem", "model.use_sequences": "true"},
    "wukong": {"model.kind": "gem", "model.use_sequences": "false"},
    "dlrm": {"model.kind": "student", "model.student_arch": "dlrm", "model.use_sequences": "true"},
    "lr": {"model.kind": "lr"},
}
DESCRIPTIONS = {
    "teacher": "GEM teacher (InterFormer + pyramid + Wukong)",
    "gem": "Wukong + sequence encoder (GEM v0)",
    "wukong": "Wukong alone (no sequences)",
    "dlrm": "DLRM-style dot interaction",
    "lr": "logistic regression",
}
PRESET = "movielens_rank"
CONVERTED = ("schema.json", "counts.json", "train.parquet", "valid.parquet", "test.parquet",
             "negatives.npz")
RUN_CONFIG = "ranking_config.json"       # the config a run was asked for, in its workdir


def define_flags():
    """The command line's flags (defined when run as a script, so that tests can import
    this module beside other scripts defining the same names)."""
    flags.DEFINE_string("data_dir", None, "ml-1m directory (default ../shared/datasets/ml-1m)")
    flags.DEFINE_string("data_out", "/tmp/gemjax-data/ml-1m-bench",
                        "converted data (outside any git work tree); its ranking/ is read")
    flags.DEFINE_integer("data_seed", 0, "seed of the valid / test negatives")
    flags.DEFINE_integer("negatives", 4, "fixed negatives per valid / test positive")
    flags.DEFINE_integer("max_history", 200, "newest events kept in each history")
    flags.DEFINE_integer("max_users", 0, "convert only the first N users (0 = all; smoke tests)")
    flags.DEFINE_list("models", list(MODELS), f"models: {list(MODELS)}")
    flags.DEFINE_list("seeds", ["0", "1", "2"], "train seeds (init, shuffle, train negatives)")
    flags.DEFINE_string("hparams", HPARAMS, "JSON {model: {override: value}} chosen on validation "
                        "(default: the benchmark's own choice; '' = the preset's settings)")
    flags.DEFINE_integer("train_negatives", 4, "train negatives per positive, drawn each epoch")
    flags.DEFINE_integer("positives", 512, "positives per step (batch = positives x (1 + N))")
    flags.DEFINE_integer("max_epochs", 50, "epochs at most (early stopping ends runs sooner)")
    flags.DEFINE_integer("patience", 2, "epochs without a better validation AUC before stopping")
    flags.DEFINE_string("override", "", "overrides for every model, after --hparams")
    flags.DEFINE_string("workdir", "runs/ranking", "one subdirectory per model and seed")
    flags.DEFINE_bool("table_only", False, "train nothing: tabulate the finished runs")
    flags.DEFINE_string("run_one", "", "internal: train the run whose workdir this is")


# --------------------------------------------------------------------------------- data

def ensure_converted(data_dir: str, out: str, seed: int, negatives: int, max_history: int,
                     max_users: int) -> str:
    """out/ranking holding the benchmark's conversion of data_dir (converted now when
    out holds none; else checked against its counts.json). Returns out/ranking."""
    from gemjax.data.parquet_writer import check_out_dir
    out = check_out_dir(out)
    d = os.path.join(out, "ranking")
    present = [n for n in CONVERTED if os.path.exists(os.path.join(d, n))]
    want = {"data_dir": os.path.abspath(data_dir), "seed": seed, "negatives": negatives,
            "max_history": max_history, "valid": True, "train_positions": 0,
            "train_negatives": "resampled per epoch"}
    if not present:
        from experiments import convert_movielens as cm     # defines no flags at import
        cm.convert(data_dir, out, tasks=("ranking",), seed=seed, negatives=negatives,
                   max_history=max_history, max_users=max_users, valid=True,
                   resample_negatives=True)
        return d
    missing = sorted(set(CONVERTED) - set(present))
    if missing:
        raise ValueError(f"--data_out={out}: {d} holds a partial conversion (missing {missing}); "
                         f"delete it or pick another --data_out")
    with open(os.path.join(d, "counts.json")) as f:
        counts = json.load(f)
    if max_users:
        want["users"] = max_users
    diff = {k: (counts.get(k), v) for k, v in want.items() if counts.get(k) != v}
    if not max_users and counts.get("users") != counts.get("dataset_users"):
        diff["users"] = (counts.get("users"), counts.get("dataset_users"))
    if diff:
        raise ValueError(f"--data_out={out}: {d}/counts.json differs from this benchmark's "
                         "conversion: " + ", ".join(f"{k}={a!r} (asked {b!r})"
                                                    for k, (a, b) in diff.items())
                         + "; pick another --data_out")
    return d


def train_positives(data: str) -> int:
    """Positive train rows of the conversion in `data`."""
    with open(os.path.join(data, "counts.json")) as f:
        return int(json.load(f)["splits"]["train"]["rows"])


# ------------------------------------------------------------------------------ configs

def load_hparams(path: str, models=MODELS) -> dict[str, dict[str, str]]:
    """{model: {override: value as text}} of a --hparams file ("" : {}); ValueError naming
    the file and the entry that is not {known model: {section.field: scalar or list}}."""
    if not path:
        return {}
    try:
        with open(path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"--hparams={path}: not JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--hparams={path}: expected an object {{model: {{override: value}}}}")
    out = {}
    for model, over in raw.items():
        if model not in models:
            raise ValueError(f"--hparams={path}: unknown model {model!r}; known: {list(models)}")
        if isinstance(over, str):
            over = _sweep_choice(os.path.join(os.path.dirname(os.path.abspath(path)), over),
                                 f"--hparams={path}: {model}")
        if not isinstance(over, dict):
            raise ValueError(f"--hparams={path}: {model}: expected an object of overrides or "
                             f"the path of a sweep.json")
        out[model] = {}
        for k, v in over.items():
            if "." not in k:
                raise ValueError(f"--hparams={path}: {model}: {k!r} is not section.field")
            out[model][k] = _text(v, f"--hparams={path}: {model}.{k}")
    return out


def _sweep_choice(path: str, where: str) -> dict:
    """The overrides a sweep chose: sweep.json's ["chosen"]["params"] (experiments.sweep)."""
    try:
        with open(path) as f:
            chosen = json.load(f).get("chosen")
    except (OSError, json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"{where}: {path} is not a readable sweep.json ({e})") from None
    if not isinstance(chosen, dict) or not isinstance(chosen.get("params"), dict):
        raise ValueError(f"{where}: {path} holds no chosen trial (chosen.params)")
    return chosen["params"]


def _text(v, where: str) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float, str)):
        return str(v)
    if v is None:
        return "none"
    if isinstance(v, list) and all(isinstance(x, (int, float)) for x in v):
        return ":".join(str(x) for x in v)
    raise ValueError(f"{where}: value {v!r} is not a number, bool, string or list of numbers")


def bench_overrides(data: str, positives_total: int, *, negatives: int, positives: int,
                    max_epochs: int, patience: int, seed: int) -> dict[str, str]:
    """The protocol's data and train overrides (module docstring, step 2)."""
    if positives < 1 or negatives < 1 or max_epochs < 1 or patience < 1:
        raise ValueError(f"--positives ({positives}), --train_negatives ({negatives}), "
                         f"--max_epochs ({max_epochs}) and --patience ({patience}) must be >= 1")
    epoch = max(positives_total // positives, 1)
    return {"data.source": "parquet", "data.train_path": os.path.join(data, "train.parquet"),
            "data.valid_path": os.path.join(data, "valid.parquet"),
            "data.eval_path": os.path.join(data, "test.parquet"), "data.eval_batches": "0",
            "data.negatives": str(negatives), "data.batch_size": str(positives * (1 + negatives)),
            "train.seed": str(seed), "train.steps": str(max_epochs * epoch),
            "train.valid_every": str(epoch), "train.eval_every": str(epoch),
            "train.checkpoint_every": str(epoch), "train.log_every": str(min(epoch, 100)),
            "train.select_metric": "auc",
            "train.patience": str(patience), "train.baselines": "false",
            "train.tensorboard": "false"}


def run_config(data: str, model: str, seed: int, hparams: dict, override: str = "", **bench):
    """The Config of one (model, seed) run: preset, schema, protocol, model, hparams, override."""
    from gemjax.config import PRESETS, apply_overrides
    from gemjax.features import FeatureSchema
    with open(os.path.join(data, "schema.json")) as f:
        schema = FeatureSchema.from_dict(json.load(f))
    over = {**bench_overrides(data, train_positives(data), seed=seed, **bench), **MODELS[model],
            **hparams.get(model, {})}
    cfg = apply_overrides(dataclasses.replace(PRESETS[PRESET], features=schema), over)
    return apply_overrides(cfg, override) if override else cfg


def has_selection() -> bool:
    """Whether the trainer selects checkpoints on validation (TrainConfig.select_metric)."""
    from gemjax.config import TrainConfig
    return "select_metric" in {f.name for f in dataclasses.fields(TrainConfig)}


# --------------------------------------------------------------------------------- runs

def _jsonable(cfg) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def train_one(cfg, workdir: str, log=print) -> dict:
    """One run in a subprocess (`--run_one=workdir`, its output in workdir/train.log): its
    summary.json (read back when the run finished before). ValueError when workdir was
    asked another config; Stopped when a SIGINT / SIGTERM (passed on to the subprocess)
    stopped it after its save; RuntimeError (with the log's tail) when it failed."""
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, RUN_CONFIG)
    want = _jsonable(cfg)
    if os.path.exists(path):
        from gemjax.config import nest_flat_fields
        with open(path) as f:
            had = nest_flat_fields(json.load(f))       # a flat config reads as nested
        if had != want:
            diff = sorted(f"{s}.{k}" for s in want if isinstance(want[s], dict)
                          for k in want[s] if had.get(s, {}).get(k) != want[s][k])
            raise ValueError(f"{workdir} holds a run of another config (differs in "
                             f"{diff or 'its sections'}); pick another --workdir")
    else:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(want, f, indent=1)
        os.replace(tmp, path)
    done = os.path.join(workdir, "summary.json")
    if not os.path.exists(done):
        t0, train_log = time.time(), os.path.join(workdir, "train.log")
        code = run_process([sys.executable, "-m", "experiments.ranking", f"--run_one={workdir}"],
                           workdir, train_log, cwd=REPO, env=repo_env())
        check_stopped(code, f"{workdir}:")
        if code != 0:
            raise RuntimeError(f"{workdir}: the run failed (exit {code}); rerun to resume. The "
                               f"end of its train.log:\n{log_tail(train_log)}")
        log(f"{workdir}: trained in {time.time() - t0:.0f} s")
    with open(done) as f:
        return json.load(f)


def run_one(workdir: str) -> None:
    """The subprocess: train() on WORKDIR/ranking_config.json's config."""
    from gemjax.config import config_from_dict
    with open(os.path.join(workdir, RUN_CONFIG)) as f:
        cfg = config_from_dict(json.load(f))
    train_here(cfg, workdir, "ranking")


def result(model: str, seed: int, cfg, summary: dict, workdir: str) -> dict:
    """One run's row: test AUC / NE of the best validation state, the chosen step."""
    test = summary.get("eval") if isinstance(summary.get("eval"), dict) else {}
    sel = summary.get("selection") or {}
    best = sel.get("best_step", summary.get("steps"))
    epoch = cfg.train.valid_every if has_selection() else cfg.train.eval_every
    return {"model": model, "seed": seed, "workdir": workdir,
            "test_auc": test.get("auc", summary.get("eval_auc")),
            "test_ne": test.get("ne", summary.get("eval_ne")),
            "valid_auc": sel.get("best_value"), "best_step": best,
            "best_epoch": best / epoch if best is not None else None,
            "stopped_early": sel.get("stopped_early"), "last_step": sel.get("last_step"),
            "gflop_per_sample": gflop_per_sample(cfg)}


def gflop_per_sample(cfg) -> float:
    """Forward GFLOP per sample of cfg's model on the first batch of the test rows."""
    from gemjax.data.source import make_source
    from gemjax.perf.forward_flops import forward_flops
    batch, _ = make_source(cfg, "eval").shard_batch(0, 0, 1)
    return forward_flops(cfg, batch) / batch.dense.shape[0] / 1e9


def _ms(xs) -> str:
    import numpy as np
    xs = np.asarray([x for x in xs if x is not None], float)
    return f"{xs.mean():.4f} ± {xs.std():.4f}" if xs.size else "-"


def table(results: list[dict], models: list[str]) -> str:
    """One line per model: test AUC and NE (mean ± population std over seeds), forward
    GFLOP per sample, the epochs and steps validation chose (means)."""
    import numpy as np
    lines = [f"{'model':8s} {'seeds':>5s} {'test AUC':>17s} {'test NE':>17s} {'GFLOP/sample':>12s} "
             f"{'epochs':>7s} {'steps':>8s}  description"]
    for m in models:
        rs = [r for r in results if r["model"] == m]
        if not rs:
            continue
        ep = [r["best_epoch"] for r in rs if r["best_epoch"] is not None]
        st = [r["best_step"] for r in rs if r["best_step"] is not None]
        lines.append(f"{m:8s} {len(rs):5d} {_ms(r['test_auc'] for r in rs):>17s} "
                     f"{_ms(r['test_ne'] for r in rs):>17s} "
                     f"{np.mean([r['gflop_per_sample'] for r in rs]):12.3g} "
                     f"{np.mean(ep) if ep else float('nan'):7.1f} "
                     f"{np.mean(st) if st else float('nan'):8.0f}  {DESCRIPTIONS[m]}")
    return "\n".join(lines)


def protocol(data: str, bench: dict, seeds, hparams_path: str) -> str:
    """The protocol line printed above the table."""
    with open(os.path.join(data, "counts.json")) as f:
        c = json.load(f)
    s = c["splits"]
    return (f"MovieLens-1M ranking ({data}; {c['users']} users): train every position t = 1..L-2 "
            f"({s['train']['rows']} positives, {bench['negatives']} negatives each resampled per "
            f"epoch, {bench['positives']} positives a step), valid t = L-1 ({s['valid']['positions']}"
            f" positives), test t = L ({s['test']['positions']} positives), {c['negatives']} fixed "
            f"negatives each; early stopping on valid AUC (patience {bench['patience']} epochs, at "
            f"most {bench['max_epochs']}); test scored once on the best valid checkpoint; seeds "
            f"{','.join(map(str, seeds))}; hyperparameters "
            f"{hparams_path or 'the preset movielens_rank (none given)'}")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    logging.set_verbosity(logging.WARNING)
    if f.run_one:
        run_one(f.run_one)
        return
    if not has_selection():
        raise app.UsageError("this trainer has no train.select_metric (validation-based "
                             "checkpoint selection); the benchmark needs it")
    unknown = sorted(set(f.models) - set(MODELS))
    if unknown or not f.models:
        raise app.UsageError(f"--models: unknown {unknown}; pick from {list(MODELS)}")
    try:
        seeds = [int(s) for s in f.seeds]
    except ValueError:
        raise app.UsageError(f"--seeds: integers separated by commas, got {','.join(f.seeds)!r}")
    from gemjax.data.movielens import DEFAULT_DIR
    bench = {"negatives": f.train_negatives, "positives": f.positives,
             "max_epochs": f.max_epochs, "patience": f.patience}
    try:
        hparams = load_hparams(f.hparams)
        data = ensure_converted(f.data_dir or DEFAULT_DIR, f.data_out, f.data_seed, f.negatives,
                                f.max_history, f.max_users)
        cfgs = {(m, s): run_config(data, m, s, hparams, f.override, **bench)
                for m in f.models for s in seeds}                 # bad settings stop here
    except (ValueError, FileNotFoundError) as e:
        raise app.UsageError(str(e))
    os.makedirs(f.workdir, exist_ok=True)
    results = []
    for (model, seed), cfg in cfgs.items():
        wd = os.path.join(f.workdir, f"{model}_s{seed}")
        if f.table_only and not os.path.exists(os.path.join(wd, "summary.json")):
            continue
        try:
            summary = train_one(cfg, wd)
        except Stopped as e:
            print(f"[ranking] {e}; rerun the same command to continue", flush=True)
            sys.exit(130)
        except RuntimeError as e:
            sys.exit(f"[ranking] {e}")
        r = result(model, seed, cfg, summary, wd)
        print(f"{model} seed {seed}: test AUC {r['test_auc']:.4f} NE {r['test_ne']:.4f} "
              f"(best epoch {r['best_epoch']:.1f})", flush=True)
        results.append(r)
        with open(os.path.join(f.workdir, "results.json"), "w") as fh:
            json.dump({"data": data, "bench": bench, "hparams": hparams, "override": f.override,
                       "results": results}, fh, indent=1)
    print("\n" + protocol(data, bench, seeds, f.hparams))
    print(table(results, f.models))


if __name__ == "__main__":
    define_flags()
    app.run(main)
