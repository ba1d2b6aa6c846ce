"""Train a GEM model on the synthetic planted-teacher stream, or on Parquet files.

    python -m experiments.train --config=small --workdir=runs/small
    python -m experiments.train --config=tiny --steps=50 --override=model.dim=16,data.batch_size=128

Your own data: --features names a JSON feature schema (gemjax.features,
FeatureSchema.to_dict's form) and data.source=parquet points the run at the files
(columns named after the features; README "Train on your own data"):

    python -m experiments.train --config=tiny --workdir=runs/own --features=schema.json \
        --override=data.source=parquet,data.train_path=train.parquet,data.eval_path=eval.parquet

Parallel layout: --mesh names the physical axes (default: all devices on one
"batch" axis), --logical_rules overrides the dense params' logical-axis rules,
--table_replica_axes picks the mesh axes the embedding tables are replicated
over (the rest form the model-parallel group):

    python -m experiments.train --config=tiny --mesh=replica=2,fsdp=2,expert=2 \
        --table_replica_axes=replica --cpu_devices=8

Multi-process (JAX's multi-controller runtime): every process runs this script;
under srun / mpirun JAX's cluster detection joins them (gemjax.parallel.multihost),
elsewhere give --coordinator=HOST:PORT --num_processes=N --process_id=I (or
$GEMJAX_COORDINATOR / $GEMJAX_NUM_PROCESSES / $GEMJAX_PROCESS_ID). Each process
prints its layout line and feeds only its own devices' shards.

Eval-only: --mode=eval restores a checkpoint of --workdir onto this run's mesh (the
best one, WORKDIR/best, when the run selected one on validation rows, else the newest;
--checkpoint=best|newest|N or --checkpoint_step=N picks another), with the run's
config.json (--override applies on top, e.g. data.eval_batches=64), runs the training's
evaluation and writes WORKDIR/eval/step_N.json (gemjax.serve.evaluate; a distilled student's workdir,
with student.json, through gemjax.distill.runs.evaluate_student):

    python -m experiments.train --mode=eval --workdir=runs/tiny [--checkpoint=newest]

Model selection (docs/train.md): with train.select_metric and data.valid_path the run
evaluates the validation rows every train.valid_every steps, keeps the best step in
WORKDIR/best, stops after train.patience evals without improvement and tests the best
state once; --refit then trains WORKDIR/refit for the best step count on the train and
validation rows (--refit_rows=valid: the validation rows alone, for sequence rows that extend
the train rows; gemjax.train.refit).

Writes WORKDIR/metrics.jsonl and WORKDIR/summary.json; rerunning with the same
workdir resumes. With train.baselines (default on for `small`), a logistic
regression and the same model without sequence inputs train on the same
stream for the same steps, under WORKDIR/baselines/, and the summary reports
all three next to the Bayes-optimal NE.

TensorBoard: the metrics rows also go to WORKDIR/tensorboard (train.tensorboard,
on by default). --profile_steps=A:B writes a jax.profiler trace of steps A..B-1
(0-based) to WORKDIR/profile, for xprof or TensorBoard's profile tab.

Compiled programs go to a persistent cache (--compile_cache, default
$JAX_COMPILATION_CACHE_DIR or TMPDIR/gemjax-jax-cache; '' off): a rerun or a resume of the
same configuration loads its step instead of compiling it again.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

from absl import app, flags, logging

from gemjax.config import PRESETS, apply_overrides, get_config, parse_overrides, validate
from gemjax.features import FeatureSchema  # no jax import
from gemjax.train.guards import Interrupted, RunRefused  # no jax import

flags.DEFINE_string("config", "small", f"preset: one of {sorted(PRESETS)}")
flags.DEFINE_string("workdir", "runs/default", "output directory (resumes if it holds checkpoints)")
flags.DEFINE_integer("steps", None, "train steps (overrides the preset)")
flags.DEFINE_integer("eval_every", None, "eval interval in steps")
flags.DEFINE_integer("seed", None, "seed of data, teacher and init")
flags.DEFINE_integer("batch_size", None, "global batch size")
flags.DEFINE_bool("baselines", None, "also train LR and the no-sequence model (same stream)")
flags.DEFINE_string("profile_steps", "", "A:B traces steps A..B-1 (0-based) into WORKDIR/profile")
flags.DEFINE_float("peak_flops", None, "peak FLOP/s per device of summary.json's e2e_mfu (default: "
                   "the device kind's spec peak; none on CPU)")
flags.DEFINE_string("mesh", "", "physical mesh axes outer to inner, e.g. replica=2,fsdp=-1,expert=2 "
                    "(default: every device on one 'batch' axis)")
flags.DEFINE_string("logical_rules", "", "logical-axis rule overrides, e.g. mlp=fsdp,embed= (name= replicates)")
flags.DEFINE_string("table_replica_axes", "", "'+'-separated mesh axes the embedding tables are replicated "
                    "over (e.g. replica); the other axes shard the rows")
flags.DEFINE_string("table_plan", "", "embedding table plan: '' (the planner), one kind for every table "
                    "(row_wise, row_wise_range, 2d, fs2d, replicated, table_wise, ...) or per table "
                    "table:kind[@capacity_factor]/...")
flags.DEFINE_string("coordinator", None, "multi-process: coordinator host:port ($GEMJAX_COORDINATOR)")
flags.DEFINE_integer("num_processes", None, "multi-process: process count ($GEMJAX_NUM_PROCESSES)")
flags.DEFINE_integer("process_id", None, "multi-process: this process's id ($GEMJAX_PROCESS_ID)")
flags.DEFINE_integer("cpu_devices", None, "simulate this many CPU devices per process (tests, laptops)")
flags.DEFINE_enum("mode", "train", ["train", "eval"], "train, or eval: evaluate a checkpoint of --workdir "
                  "(its config.json) and write WORKDIR/eval/step_N.json")
flags.DEFINE_integer("checkpoint_step", None, "--mode=eval: the checkpoint step to evaluate "
                     "(default: --checkpoint)")
flags.DEFINE_string("checkpoint", None, "--mode=eval: best, newest or a step number (default: best "
                    "when the run selected one on its validation rows, WORKDIR/best, else newest)")
flags.DEFINE_bool("refit", False, "after a run with train.select_metric: train WORKDIR/refit on "
                  "--refit_rows for the run's best step count, then test it once "
                  "(gemjax.train.refit)")
flags.DEFINE_enum("refit_rows", "train+valid", ["train+valid", "valid"],
                  "rows --refit trains on: train+valid, or valid alone (sequence rows whose "
                  "validation row extends the train row by one event)")
flags.DEFINE_string("features", "", "JSON file of the feature schema (FeatureSchema.to_dict's form): "
                    "the columns of data.source=parquet files")
flags.DEFINE_string("compile_cache", None, "directory of the persistent compilation cache: a rerun "
                    "or resume loads its compiled step, on GPU with XLA's autotuning results "
                    "(gemjax.train.runtime; default $JAX_COMPILATION_CACHE_DIR, else "
                    "TMPDIR/gemjax-jax-cache; '' turns it off)")
flags.DEFINE_bool("helpconfig", False, "print every config field of the preset (after --override): "
                  "its value, type and help, then exit")
flags.DEFINE_string("override", "", "comma-separated section.field=value (tuples as 64:64), "
                    "e.g. model.dim=32,data.seq_median=64")


def load_features(path: str) -> FeatureSchema:
    """The FeatureSchema of a JSON file; ValueError naming the file and the bad key."""
    try:
        with open(path) as fh:
            d = json.load(fh)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--features={path}: {e}") from None
    try:
        return FeatureSchema.from_dict(d)
    except ValueError as e:
        raise ValueError(f"--features={path}: {e}") from None


def build_config():
    """The preset with --features, the shortcut flags and --override (which wins), all
    applied before one validation."""
    f = flags.FLAGS
    cfg = get_config(f.config)
    if f.features:
        cfg = dataclasses.replace(cfg, features=load_features(f.features))
    over = {}
    for flag, path in (("steps", "train.steps"), ("eval_every", "train.eval_every"),
                       ("seed", "train.seed"), ("batch_size", "data.batch_size"),
                       ("baselines", "train.baselines")):
        if getattr(f, flag) is not None:
            over[path] = str(getattr(f, flag))
    for flag in ("mesh", "logical_rules", "table_replica_axes", "table_plan"):    # Config.parallel
        if getattr(f, flag):
            over[f"parallel.{flag}"] = getattr(f, flag)
    over.update(parse_overrides(f.override))
    cfg = apply_overrides(cfg, over)
    validate(cfg)
    return cfg


def profile_window(text: str, steps: int) -> tuple[int, int] | None:
    """--profile_steps "A:B" -> (A, B), 0 <= A < B <= steps; "" -> None."""
    if not text:
        return None
    try:
        a, b = (int(p) for p in text.split(":"))
    except ValueError:
        a = b = -1
    if not 0 <= a < b:
        raise app.UsageError(f"--profile_steps={text!r}: expected A:B, integers with 0 <= A < B "
                             f"(e.g. 5:8 traces steps 5, 6 and 7)")
    if b > steps:
        raise app.UsageError(f"--profile_steps={text!r}: the run has {steps} steps")
    return a, b


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    try:
        cfg = build_config()
    except ValueError as e:
        raise app.UsageError(str(e))
    if flags.FLAGS.helpconfig:
        from gemjax.config import describe_fields
        print(describe_fields(cfg))
        return
    if cfg.data.source == "parquet":        # files and columns checked before any compile
        from gemjax.data.source import make_source
        try:
            make_source(cfg, "train")
            if cfg.data.eval_path:
                make_source(cfg, "eval")
            if cfg.train.select_metric:
                make_source(cfg, "valid")
        except (ValueError, FileNotFoundError) as e:
            raise app.UsageError(str(e))
    profile_steps = profile_window(flags.FLAGS.profile_steps, cfg.train.steps)
    logging.set_verbosity(logging.WARNING)   # orbax logs every save at INFO
    f = flags.FLAGS
    for flag in ("checkpoint_step", "checkpoint"):
        if getattr(f, flag) is not None and f.mode != "eval":
            raise app.UsageError(f"--{flag} picks the checkpoint of --mode=eval; "
                                 f"training always resumes from the newest")
    if f.checkpoint_step is not None and f.checkpoint is not None:
        raise app.UsageError("--checkpoint and --checkpoint_step both name a checkpoint: give one")
    if f.refit and (f.mode != "train" or not cfg.train.select_metric):
        raise app.UsageError("--refit follows a training run with model selection "
                             "(train.select_metric; --mode=train)")
    from gemjax.parallel import multihost  # after flags: importing jax is slow
    try:   # before any jax call; no flags: SLURM / Open MPI / k8s found by JAX, else one process
        multihost.initialize(f.coordinator, f.num_processes, f.process_id, f.cpu_devices)
    except ValueError as e:
        raise app.UsageError(str(e))
    from gemjax.train import runtime
    try:   # CUDA graphs on GPU, before the backend starts (GEMJAX_GPU_GRAPHS=0: off)
        runtime.enable_gpu_graphs()
        runtime.enable_fp8_gemm_flags(cfg.model.precision.format)   # FP8 on GPU: cuBLAS GEMMs
    except ValueError as e:
        raise app.UsageError(str(e))
    import jax
    print(f"[gemjax] {multihost.describe()}", flush=True)   # every process: the job's layout
    cache = f.compile_cache if f.compile_cache is not None else runtime.default_compile_cache()
    try:   # before the first compile (runtime: compiled programs reused across runs)
        runtime.enable_compile_cache(cache, log=print if jax.process_index() == 0 else (lambda s: None))
    except ValueError as e:
        raise app.UsageError(f"--compile_cache: {e}")

    from gemjax.train import layout
    from gemjax.train.loop import train

    try:      # the layout of cfg.parallel (the flags above fill it); train() builds the same
        mesh, trainer_kw = layout.build(cfg)
    except ValueError as e:
        raise app.UsageError(str(e))
    replica_axes = trainer_kw["table_replica_axes"]
    lead = jax.process_index() == 0
    log = print if lead else (lambda s: None)
    if cfg.parallel.mesh:
        log(f"[gemjax] mesh {dict(mesh.shape)} over {jax.process_count()} process(es); "
            f"tables replicated over {replica_axes or 'none'}")
    workdir = f.workdir
    if f.mode == "eval":
        from gemjax.serve.evaluate import evaluate_checkpoint
        from gemjax.train.checkpoint import CheckpointDamaged
        if os.path.isfile(os.path.join(workdir, "student.json")):   # a distilled student
            from gemjax.distill.runs import evaluate_student as evaluate_checkpoint
        try:
            which = f.checkpoint_step if f.checkpoint_step is not None else f.checkpoint
            evaluate_checkpoint(workdir, which, mesh, trainer_kw=trainer_kw,
                                overrides=f.override, log=log)
        except (FileNotFoundError, ValueError, CheckpointDamaged) as e:
            sys.exit(f"[gemjax] --mode=eval: {e}")
        return
    if cfg.train.remat == "auto":     # the planner's plan for train.memory_budget_gb, measured here
        from gemjax.train import remat
        try:
            cfg = remat.resolve(cfg, log=log, mesh=mesh, trainer_kw=trainer_kw)
        except ValueError as e:
            raise app.UsageError(str(e))
    summary = train(cfg, workdir, log=log, profile_steps=profile_steps,
                    peak_flops=flags.FLAGS.peak_flops)
    if "selection" in summary and lead:
        sel = summary["selection"]
        print(f"[gemjax] selection: best {sel['metric']} {sel['best_value']} at step "
              f"{sel['best_step']} of {sel['last_step']} ({sel['evals']} validation evals"
              f"{', stopped early' if sel['stopped_early'] else ''}; {workdir}/best)")
    if f.refit:
        from gemjax.train.refit import refit
        try:
            refit_summary = refit(workdir, rows=f.refit_rows, log=log, mesh=mesh,
                                  trainer_kw=trainer_kw)
        except (ValueError, FileNotFoundError) as e:
            sys.exit(f"[gemjax] --refit: {e}")
        if lead:
            print(f"[gemjax] refit ({workdir}/refit/summary.json): eval NE "
                  f"{refit_summary['eval_ne']} AUC {refit_summary['eval_auc']}"
                  + (f" HR@10 {refit_summary['eval_hr@10']}" if 'eval_hr@10' in refit_summary else ""))
    if not lead:
        return
    if cfg.train.baselines:
        summary["baselines"] = {}
        variants = {"logistic_regression": apply_overrides(cfg, {"model.kind": "lr"}),
                    "no_sequences": apply_overrides(cfg, {"model.use_sequences": "false"})}
        for name, vcfg in variants.items():
            vcfg = dataclasses.replace(vcfg, train=dataclasses.replace(vcfg.train, baselines=False))
            log(f"[gemjax] baseline {name}")
            s = train(vcfg, os.path.join(workdir, "baselines", name), log=log)
            summary["baselines"][name] = {k: s[k] for k in ("eval_ne", "eval_auc", "samples_per_sec")}
        with open(os.path.join(workdir, "summary.json"), "w") as fh:
            json.dump(summary, fh, indent=1)
    print(f"[gemjax] summary ({workdir}/summary.json):")
    if summary.get("eval_hr@10") is not None:        # model.kind=retrieval: full ranking
        print(f"  {'model':<12}{'HR@10':>8}{'NDCG@10':>9}{'HR@50':>8}{'wall s':>9}{'samples/s':>11}"
              f"   (history excluded from the ranking; kept: HR@10 "
              f"{summary['eval_hr@10_unmasked']:.4f})")
        print(f"  {summary['model']:<12}{summary['eval_hr@10']:>8.4f}{summary['eval_ndcg@10']:>9.4f}"
              f"{summary['eval_hr@50']:>8.4f}{summary['wall_time_s']:>9.1f}"
              f"{summary['samples_per_sec'] or 0:>11.1f}")
        return
    rows = [(summary["model"], summary)] + list(summary.get("baselines", {}).items())
    print(f"  {'model':<22}{'eval NE':>10}{'eval AUC':>10}")
    for name, s in rows:
        if s["eval_ne"] is None:       # a selection run without eval rows (data.eval_path)
            print(f"  {name:<22}{'-':>10}{'-':>10}")
            continue
        print(f"  {name:<22}{s['eval_ne']:>10.4f}{s['eval_auc']:>10.4f}")
    if summary["bayes_ne"] is not None:        # known for the synthetic stream only
        print(f"  {'bayes-optimal':<22}{summary['bayes_ne']:>10.4f}{summary['bayes_auc']:>10.4f}")


def run(argv):
    """main, with a stop by SIGINT / SIGTERM (after its checkpoint), a refused run (busy
    workdir, resume mismatch), a bad flag or config value, or a filesystem refusing
    writes ending in one message and exit 128 + signal / 2 / 1 / 1."""
    try:
        main(argv)
    except Interrupted as e:
        print(f"[gemjax] {e}", flush=True)
        from gemjax.train.checkpoint import join_background_threads
        join_background_threads()      # Orbax writes still in flight end before the exit
        sys.exit(128 + e.signum)
    except RunRefused as e:
        print(f"[gemjax] refused: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    except app.UsageError as e:      # a bad flag or config value: its line, no flag listing
        print(f"[gemjax] error: {e} (--helpfull lists the flags)", file=sys.stderr, flush=True)
        sys.exit(1)
    except OSError as e:     # disk full, read-only or unwritable workdir: one line
        from gemjax.train.checkpoint import disk_error
        if disk_error(e) is None:
            raise
        print(f"[gemjax] stopped: {e}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    app.run(run)
