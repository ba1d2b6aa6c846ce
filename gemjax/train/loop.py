"""The train loop: feed, step, log, evaluate, checkpoint, resume.

    summary = train(cfg, workdir)

Writes WORKDIR/metrics.jsonl (one JSON object per log or eval point; the same
numbers as TensorBoard scalars under WORKDIR/tensorboard: `tracking.RunLog`),
WORKDIR/summary.json at the end (eval figures, timing, devices, mesh, versions,
git revision: `tracking.timing`, `tracking.run_facts`), and Orbax checkpoints under
WORKDIR/checkpoints. model.kind="retrieval" trains and evaluates through
gemjax.train.retrieval (RetrievalTrainer, RetrievalEvaluator): its eval rows and summary
hold HR@k / NDCG@k where the others hold NE / AUC. Rerunning with the same workdir resumes from the newest
checkpoint, on any mesh shape and table plan (tables are saved in logical row
order: `checkpoint.save_train_state` / `restore_train_state`); the data stream is a pure
function of the step (and of the shard count), so a resumed run on the same mesh
equals an uninterrupted one.

Model selection (train.select_metric, data.valid_path; gemjax.train.selection): the
validation rows are evaluated every train.valid_every steps and at the last step (rows of
kind "valid"), the best eval's state is kept in WORKDIR/best, the run stops after
train.patience evals without improvement, and the eval rows are read once at the end on
the best state (a kind "eval" row with "split" "test" and "eval_step"); summary.json gets
"selection" and "eval". The selection state rides in every checkpoint's meta.

Faults (gemjax.train.guards): one run per workdir (WORKDIR/train.lock, naming its
holder to a second run). SIGINT or SIGTERM stops the run at the next step
boundary with a checkpoint of the state it holds, then raises `Interrupted`; a
second signal stops at once (saving if the state is intact). Every exit path
waits for in-flight async saves. A checkpoint is labelled with the state's own
step counter (state["step"]), and a restore checks the label against it. No
checkpoint is saved of a non-finite state (an all-finite reduction over params,
optimizer state and tables first; FloatingPointError instead), nor is a
non-finite loss or grad norm trained past (checked at log points). A resume
picks the newest intact checkpoint: a step whose files fail their checksums or
cannot be read is logged, moved to WORKDIR/checkpoints-damaged/ and counted in
metrics.jsonl ("checkpoints_damaged"); a resume whose config changes the data
stream, a table vocabulary, the batch or the seed, or asks for fewer steps than
the checkpoint holds, is refused (`ResumeMismatch`). A crash (kill -9) loses the
steps since the newest finished checkpoint: at most train.checkpoint_every plus
those run while that checkpoint was written in the background.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from gemjax.config import Config, schema_of, validate, with_schema
from gemjax.data import balance
from gemjax.data.feeding import Feeder
from gemjax.data.source import counter_names, eval_steps, fallback_counters, make_source
from gemjax.train.checkpoint import (CheckpointDamaged, CheckpointMismatch, Checkpointer,
                                     restore_train_state, save_train_state, state_step)
from gemjax.train import layout, multistep, runtime, selection
from gemjax.train.guards import (Interrupted, ResumeMismatch, StopSignals, check_resume,
                                 lock_workdir, pause_for_test, run_fields)
from gemjax.train.metrics import EvalAccumulator, flat
from gemjax.train.retrieval import METRICS as RETRIEVAL_METRICS
from gemjax.train.retrieval import RetrievalEvaluator, RetrievalTrainer, is_retrieval
from gemjax.train.step import BinaryTasks, Trainer
from gemjax.train.throughput import Throughput, progress_line
from gemjax.train import tracking

# while the first step of a run (its compile: minutes for a large FP8 step) has not returned,
# a line every this many seconds says so (tracking.Heartbeat)
COMPILE_HEARTBEAT_S = 60.0


def _rewrite_jsonl(path: str, rows: list[dict]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, path)


def _window_ne(ms: list[dict]) -> float:
    """NE over a window of steps from per-task sums, averaged over tasks by weight."""
    loss = sum(np.asarray(m["loss_sum"], np.float64) for m in ms)
    w = sum(np.asarray(m["weight_sum"], np.float64) for m in ms)
    pos = sum(np.asarray(m["positive_sum"], np.float64) for m in ms)
    rate = np.clip(pos / np.maximum(w, 1e-12), 1e-12, 1 - 1e-12)
    ent = -(rate * np.log(rate) + (1 - rate) * np.log(1 - rate))
    per_task = (loss / np.maximum(w, 1e-12)) / ent
    return float(np.sum(per_task * w) / max(np.sum(w), 1e-12))


@functools.lru_cache(maxsize=8)
def _all_finite(mesh) -> Callable:
    """The jitted [n_leaves] all-finite flags of a list of arrays, one per mesh: every
    saver of a process (the run's, the selection's best, the next run's) calls the same
    jitted function, so a state's program is compiled (or read from the cache) once."""
    return jax.jit(lambda leaves: jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]),
                   out_shardings=NamedSharding(mesh, P()))


def _nonfinite_leaves(mesh) -> Callable[[dict], list[str]]:
    """state -> key paths of float params / optimizer state / table leaves holding a NaN
    or inf (one jitted all-finite reduction per leaf, one host read of [n_leaves] bools)."""
    flags = _all_finite(mesh)

    def check(state: dict) -> list[str]:
        with_path = [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_leaves_with_path(
            {k: state[k] for k in ("params", "opt_state", "tables")})
            if jnp.issubdtype(x.dtype, jnp.floating)]
        if not with_path:
            return []
        ok = np.asarray(flags([x for _, x in with_path]).addressable_data(0))
        return [p for (p, _), good in zip(with_path, ok) if not good]

    return check


def _resume(ckpt: Checkpointer, coll, target: dict, cfg: Config, lead: bool,
            log: Callable[[str], None]) -> tuple[int, dict, int]:
    """(step, state, damaged): the newest intact checkpoint restored; `damaged` newer
    steps (failing their checksums, or unreadable) moved to DIRECTORY-damaged/.
    ResumeMismatch / CheckpointMismatch (the run does not fit) propagate at once."""
    damaged = []
    for step in reversed(ckpt.all_steps()):
        problem = ckpt.check(step, log)   # no checksums: refused unless trusted (train.trust_...)
        if problem is None:
            try:
                _, meta = ckpt.metadata(step)
                check_resume(meta, cfg, step, os.path.dirname(ckpt.directory))
                step, state, _ = restore_train_state(ckpt, coll, target, step)
                break
            except (ResumeMismatch, CheckpointMismatch):
                raise
            except Exception as e:  # noqa: BLE001 - any failing read of a step is damage
                problem = f"unreadable: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
        log(f"[gemjax] checkpoint step {step} is damaged ({problem}); trying an older one")
        damaged.append((step, problem))
    else:
        raise CheckpointDamaged(
            f"no intact checkpoint in {ckpt.directory}: "
            + "; ".join(f"step {s}: {p}" for s, p in damaged)
            + ". Move the directory away to start the run over")
    for s, _ in damaged:
        if lead:
            log(f"[gemjax] damaged checkpoint step {s} moved to {ckpt.set_aside(s)}")
    if damaged and jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("gemjax: damaged checkpoints set aside")
    ckpt.latest_step()          # every process re-lists the steps
    return step, state, len(damaged)


class Evaluator:
    """Eval over the fixed eval stream (`eval_steps` batches; stream "valid": the
    validation rows of model selection); `bayes` holds the stream's Bayes-optimal
    metrics where its infos carry the true probabilities (the synthetic stream), else
    {"ne": None, "auc": None} (a file source)."""

    def __init__(self, trainer: Trainer, cfg: Config, stream: str = "eval"):
        self.stream = make_source(cfg, stream)
        self.feeder = Feeder(self.stream.shard_batch, trainer.mesh, prefetch=0)
        self.step_fn = trainer.make_eval_step()
        self.cfg = cfg
        self.grid = (schema_of(cfg).num_surfaces, schema_of(cfg).num_tasks)
        self._host = [self.feeder.host_batch(i) for i in range(eval_steps(self.stream, cfg))]
        self.bayes = {"ne": None, "auc": None}
        if all(hasattr(i, "true_probs") for _, infos, _ in self._host for i in infos):
            bayes = EvalAccumulator(*self.grid, exact_auc_rows=cfg.train.exact_auc_rows)
            for batch, infos, _ in self._host:
                probs = np.concatenate([i.true_probs for i in infos])
                bayes.add(*_all_processes(probs, batch.labels, batch.label_mask, batch.surface,
                                          batch.weights))
            self.bayes = bayes.result()

    def __call__(self, state) -> dict:
        """Metrics over every process's eval shards (the same figures on every process)."""
        acc = EvalAccumulator(*self.grid, exact_auc_rows=self.cfg.train.exact_auc_rows)
        for batch, _, _ in self._host:
            probs = np.asarray(self.step_fn(state, self.feeder.to_device(batch)))  # this process's rows
            acc.add(*_all_processes(probs, batch.labels, batch.label_mask, batch.surface,
                                    batch.weights))
        return acc.result()


def _all_processes(*arrays):
    """Concatenate each process's host rows (no-op with one process)."""
    if jax.process_count() == 1:
        return arrays
    from jax.experimental import multihost_utils
    return tuple(np.asarray(multihost_utils.process_allgather(a, tiled=True)) for a in arrays)


def _close(ckpt: Checkpointer, log: Callable[[str], None], raise_errors: bool) -> None:
    """Finish in-flight saves and close; a failure is raised, or only logged when the
    loop is already ending on another error (`raise_errors` False: it would hide it)."""
    try:
        ckpt.close()
    except Exception as e:
        if raise_errors:
            raise
        log(f"[gemjax] finishing checkpoint writes failed too: {type(e).__name__}: {e}")


def _with_next(items):
    """(item, the next item's batch or None), one item ahead of the consumer."""
    prev = None
    for item in items:
        if prev is not None:
            yield prev, item[1]
        prev = item
    if prev is not None:
        yield prev, None


def train(cfg: Config, workdir: str, *, log: Callable[[str], None] = print,
          mesh=None, stop_after: int | None = None, trainer_kw: dict | None = None,
          profile_steps: tuple[int, int] | None = None, peak_flops: float | None = None,
          make_trainer: Callable | None = None) -> dict:
    """Train cfg.train.steps steps (resuming from workdir); returns the summary dict.

    stop_after: stop (with a checkpoint) once this many total steps are done;
    used to simulate an interrupted run. mesh / trainer_kw: passed to Trainer.create
    (e.g. rules, table_replica_axes); when both are None, the layout is cfg.parallel's
    (gemjax.train.layout.build). WORKDIR/config.json records the layout that runs
    (layout.record), so it rebuilds the same mesh and shardings. profile_steps: (a, b) writes a jax.profiler
    trace of steps a..b-1 (0-based) to WORKDIR/profile (`tracking.ProfileWindow`).
    peak_flops: the per-device peak FLOP/s of summary.json's e2e_mfu (default: the spec
    peak of the device kind, gemjax.perf.mfu.PEAK_FLOPS; none on CPU).
    make_trainer: (cfg, mesh, **trainer_kw) -> the run's trainer (default Trainer.create,
    or RetrievalTrainer.create); a trainer with host-side state beside its train state
    (a distilled student: gemjax.distill.runs) may define `checkpoint_meta() -> dict`,
    saved in every checkpoint's meta under its keys, and `resume_meta(meta)`, called
    with the restored checkpoint's meta on a resume.
    Raises WorkdirBusy (another run holds the workdir), ResumeMismatch, Interrupted
    (SIGINT / SIGTERM, after saving), FloatingPointError (non-finite loss or state;
    nothing non-finite saved).
    """
    validate(cfg)
    runtime.enable_gpu_graphs(log)   # CUDA graphs on GPU if no device was used yet (runtime)
    runtime.enable_fp8_gemm_flags(cfg.model.precision.format, log)   # FP8: cuBLAS GEMMs (runtime)
    os.makedirs(workdir, exist_ok=True)
    with lock_workdir(workdir, enabled=jax.process_index() == 0), StopSignals() as stop, \
            runtime.short_gil_switch():   # the loop's thread gets the GIL back sooner (runtime)
        return _train(cfg, workdir, log, mesh, stop_after, trainer_kw, stop, profile_steps,
                      peak_flops, make_trainer)


def _train(cfg: Config, workdir: str, log: Callable[[str], None], mesh, stop_after: int | None,
           trainer_kw: dict | None, stop: StopSignals,
           profile_steps: tuple[int, int] | None, peak_flops: float | None,
           make_trainer: Callable | None = None) -> dict:
    t = cfg.train
    started, compile_timer = time.perf_counter(), tracking.CompileTimer()
    lead = jax.process_index() == 0    # one process writes the files (all compute the same rows)
    if mesh is None and trainer_kw is None:        # the layout cfg.parallel describes
        mesh, trainer_kw = layout.build(cfg)
    retrieval = is_retrieval(cfg)   # next-item retrieval: gemjax.train.retrieval
    trainer = (make_trainer or (RetrievalTrainer if retrieval else Trainer).create)(
        cfg, mesh, **(trainer_kw or {}))
    stream = balance.train_source(cfg)        # with data.bbs: Base Batch Shuffling
    loads = balance.LoadLog(trainer.num_shards)
    k = t.steps_per_call      # K steps per jitted call (gemjax.train.multistep)
    feeder = multistep.feeder(k, loads.wrap(stream.shard_batch), trainer.mesh,
                              check_ids=trainer.coll.check_ids, id_fields=trainer.id_fields,
                              workers=cfg.data.host_workers)
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=t.keep_checkpoints,
                        trust_unverified=t.trust_unverified_checkpoints)
    start, state, last_eval, counters = _start(ckpt, trainer, trainer_kw or {}, stream, cfg, workdir,
                                               lead, log)
    _announce(cfg, workdir, trainer, state, lead, log)

    sel = _Selecting(cfg, workdir, trainer, ckpt, start, lead, log) if t.select_metric else None
    # with selection the eval rows (the test) are read once, at the end, on the best state
    evaluator = (None if sel is not None and not _has_test(cfg) else
                 (RetrievalEvaluator if retrieval else Evaluator)(trainer, cfg))
    train_step = trainer.make_train_step() if k == 1 else multistep.MultiStep(trainer, k)
    meter = Throughput(window=5)   # in log intervals
    meter.update(0, 0)             # opens the clock; compile time lands in the first interval
    end = t.steps if stop_after is None else min(t.steps, stop_after)
    multistep.check_bounds(k, start, end, profile_steps)
    window = _Window(counters, retrieval)
    runlog = tracking.RunLog(workdir, start_step=start, tensorboard=t.tensorboard, enabled=lead,
                             log=log)
    profile = tracking.ProfileWindow(profile_steps, os.path.join(workdir, "profile"), start, end,
                                     log=log, enabled=lead, paused=meter.paused)
    save = _Saver(ckpt, trainer, cfg, sel.meta if sel is not None else None)
    waits = tracking.HostWait()    # seconds blocked on the feed
    early = False                  # stopped by the selection's patience
    if sel is not None and sel.state.exhausted and start < t.steps:   # a rerun of an early stop
        log(f"[gemjax] the run stopped early at step {start} (patience {t.patience}): nothing "
            f"to train; the best step is {sel.state.best_step}")
        early, end = True, start

    finished = False
    try:
        if stop.agreed(True):
            raise Interrupted(stop.signum, None, f"stopped by {stop.name()} before the first "
                              f"step: nothing new to save (checkpoint step {start or 'none'})")
        for (step, batch, infos, tokens), nxt in _with_next(waits.timed(feeder.batches(start, end))):
            with (tracking.Heartbeat("the first step (compiling)", COMPILE_HEARTBEAT_S, log)
                  if step == start else contextlib.nullcontext()):
                state, m = train_step(state, batch, next_batch=nxt)   # nxt: see PlannedStep
            window.add(m, tokens, infos, steps=k)
            for s in range(step, step + k):
                loads.step_done(s)
            done = step + k
            pause_for_test("step", done, stop, log)
            at_log = done % t.log_every == 0 or done == end
            stopping = stop.agreed(at_log)   # a stop logs the open window and saves this step
            if at_log or stopping:
                window.log_point(done, cfg, meter, last_eval, ckpt,
                                 lambda row: runlog.append({**row, **loads.row()}), log)
                waits.log_point(done)
            if sel is None and (done % t.eval_every == 0 or done == end):
                pause_for_test("eval", done, stop, log)
                last_eval = _eval_point(evaluator, state, done, meter, runlog.append, log)
            elif sel is not None and sel.due(done):
                pause_for_test("eval", done, stop, log)
                last_eval = sel.evaluate(state, done, meter, runlog.append)
                early = sel.state.exhausted and done < t.steps
                if early and window.pending:     # the train row of the last steps run
                    window.log_point(done, cfg, meter, last_eval, ckpt,
                                     lambda row: runlog.append({**row, **loads.row()}), log)
            saved = done % t.checkpoint_every == 0 or done == end or stopping or early
            if saved:
                with tracking.idle_pause(meter.paused, state):
                    save(state)
                pause_for_test("save", done, stop, log)
            profile.step_done(done, state)
            if not stopping and not window.pending and stop.agreed(True):   # a signal during log/eval/save
                stopping = True
                if not saved:
                    save(state)
            if stopping:
                ckpt.wait()
                raise Interrupted(stop.signum, done, f"stopped by {stop.name()} after step {done}: "
                                  f"checkpoint step {done} saved in {ckpt.directory}; rerun the "
                                  f"same command to resume")
            if early:
                log(f"[gemjax] early stop at step {done}: {sel.state.bad} validation evals "
                    f"without a better {t.select_metric} than step {sel.state.best_step}'s")
                end = done
                break
        finished = True
    except Interrupted:
        raise
    except KeyboardInterrupt:        # a second signal: stop at once
        _save_at_once(save, state, ckpt, log)
        raise
    finally:
        _close(ckpt, log, raise_errors=finished)   # waits for in-flight saves on every exit path
        if sel is not None:
            _close(sel.best_ckpt, log, raise_errors=finished)
    if end < t.steps and not early:
        return {"steps": end, "stopped_early": True}
    chosen = None
    if sel is not None:     # the test rows once, on the best state
        state, last_eval = sel.finish(state, evaluator, end, meter, runlog.append)
        chosen = sel.state.summary(early, end)
    summary = _summary(cfg, trainer, evaluator, state, last_eval, window.counters, meter,
                       started, compile_timer, lead, runlog, chosen)
    if sel is not None and sel.test is not None:
        summary["eval"] = sel.test
    summary.update(tracking.run_efficiency(cfg, trainer.mesh, stream, summary["step_time_s"], waits,
                                           peak_flops))
    runlog.close()
    if lead:
        with open(os.path.join(workdir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
    return summary


# what a NaN message adds: huge finite inputs overflow a step too (gemjax.data.parquet)
_HUGE_INPUTS = (" (finite but huge dense inputs overflow too: data.dense_max_abs bounds them, "
                "naming the file, row and column)")


# The eval figures a train row and the summary repeat from the newest eval: those the
# objective reports (BinaryTasks; retrieval: NextItemSoftmax, RETRIEVAL_METRICS).
_HEADLINE = BinaryTasks.metrics


def _headline(cfg: Config) -> tuple[str, ...]:
    return RETRIEVAL_METRICS if is_retrieval(cfg) else _HEADLINE


def _start(ckpt: Checkpointer, trainer: Trainer, trainer_kw: dict, stream, cfg: Config, workdir: str,
           lead: bool,
           log: Callable[[str], None]) -> tuple[int, dict, dict, dict]:
    """(start step, state, last eval figures, fallback counters): the initial state, or
    the newest intact checkpoint with metrics.jsonl cut back to its step and the counters
    and eval figures logged up to it. Writes WORKDIR/config.json with the layout that runs (layout.record)."""
    state = trainer.init_state(cfg.train.seed)
    start, last_eval = 0, {}
    counters = {"seq_truncated_to_cap": 0, "seq_truncated_to_capacity": 0, "ids_out_of_range": 0,
                "ids_overflow": 0, "checkpoints_damaged": 0,   # fallbacks, counted over the whole run
                "metrics_lines_torn": 0,
                **dict.fromkeys(counter_names(stream), 0)}     # the source's own (parquet: ids_clamped, ...)
    metrics_path = os.path.join(workdir, "metrics.jsonl")
    damaged = torn = 0
    tracking.check_train_files(cfg, workdir, bool(ckpt.all_steps()), lead=lead, log=log)
    if ckpt.all_steps():
        start, state, damaged = _resume(ckpt, trainer.coll, state, cfg, lead, log)
        log(f"[gemjax] resumed from step {start} ({workdir}/checkpoints)")
        if hasattr(trainer, "resume_meta"):       # host-side state (train()'s make_trainer)
            trainer.resume_meta(ckpt.metadata(start)[1])
        rows, torn = tracking.read_metrics(metrics_path, log)   # a torn last row dropped
        kept = [r for r in rows if r["step"] <= start]
        if lead:
            _rewrite_jsonl(metrics_path, kept)
        evals = [r for r in kept if r["kind"] in ("eval", "valid")]
        if evals:
            last_eval = {k: evals[-1].get(k) for k in _headline(cfg)}
        trains = [r for r in kept if r["kind"] == "train"]
        if trains:
            counters = {k: trains[-1].get(k, 0) for k in counters}
    elif lead and os.path.exists(metrics_path):
        os.remove(metrics_path)
    counters["checkpoints_damaged"] += damaged
    counters["metrics_lines_torn"] += torn
    if lead:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            json.dump(dataclasses.asdict(with_schema(layout.record(cfg, trainer, trainer_kw))), f,
                      indent=1)
    return start, state, last_eval, counters


def _announce(cfg: Config, workdir: str, trainer: Trainer, state: dict, lead: bool,
              log: Callable[[str], None]) -> None:
    """The run's opening line: config, model, devices, parameter counts, steps, batch."""
    n_params = sum(x.size for x in jax.tree.leaves(state["params"]))
    n_rows = sum(s.vocab * s.dim for s in trainer.coll.specs.values())
    log(f"[gemjax] config={cfg.name} model={cfg.model.kind} devices={trainer.num_shards} "
        f"dense params={n_params:,} embedding params={n_rows:,} steps={cfg.train.steps} "
        f"batch={cfg.data.batch_size}")


class _Window:
    """The steps since the last log point: their metrics (device arrays until the log
    point reads them), tokens, and the run's fallback counters."""

    def __init__(self, counters: dict, retrieval: bool = False):
        self.counters, self.pending, self.tokens = counters, [], 0
        self.retrieval = retrieval   # no NE for a softmax over items; HR@10 in place of AUC

    def add(self, metrics: dict, tokens: int, infos, steps: int = 1) -> None:
        """metrics of one call of `steps` steps (each leaf stacked [steps, ...] when > 1)."""
        self.pending.append((metrics, steps))
        self.tokens += tokens
        for i in infos:
            for k, v in fallback_counters(i).items():
                if k in self.counters:
                    self.counters[k] += v

    def log_point(self, done: int, cfg: Config, meter: Throughput, last_eval: dict,
                  ckpt: Checkpointer, write: Callable[[dict], None],
                  log: Callable[[str], None]) -> None:
        """Read the window to the host (the only host sync: once per log interval), write
        its metrics.jsonl row and progress line, and open the next window.
        FloatingPointError on a non-finite loss or grad norm."""
        ms = [m for got, k in jax.device_get(self.pending) for m in multistep.unstack(got, k)]
        meter.update(len(ms) * cfg.data.batch_size, self.tokens)
        self.pending, self.tokens = [], 0
        loss = float(np.mean([x["loss"] for x in ms]))
        grad_norm = float(np.max([x["grad_norm"] for x in ms]))
        if not (np.isfinite(loss) and np.isfinite(grad_norm)):
            raise FloatingPointError(
                f"loss is {loss} (largest grad norm {grad_norm}) at step {done}: stopped, "
                f"nothing of it saved; the checkpoints kept ({ckpt.all_steps()}) hold "
                f"finite states{_HUGE_INPUTS}")
        for c in ("ids_out_of_range", "ids_overflow"):
            self.counters[c] += int(sum(x[c] for x in ms))
        ne = None if self.retrieval else _window_ne(ms)
        row = {"step": done, "kind": "train", "loss": loss, "ne": ne,
               "grad_norm": float(ms[-1]["grad_norm"]),
               "samples_per_sec": meter.samples_per_sec,
               "tokens_per_sec": meter.tokens_per_sec, **self.counters}
        if last_eval:
            key = "hr@10" if self.retrieval else "auc"
            row[key] = last_eval.get(key)
        write(row)
        steps = cfg.train.steps
        log(progress_line(done, steps, loss, row["ne"], meter.samples_per_sec,
                          meter.eta((steps - done) / max(len(ms), 1)),
                          tokens_per_sec=meter.tokens_per_sec))


def _eval_point(evaluator: "Evaluator", state: dict, done: int, meter: Throughput,
                write: Callable[[dict], None], log: Callable[[str], None], *,
                extra: dict | None = None, rows: list | None = None) -> dict:
    """Evaluate `state` (off the throughput clock), write its metrics.jsonl row (kind
    "eval"; `extra` fields on top, e.g. kind "valid") and eval line; returns the
    _HEADLINE figures (`rows` gets the whole row)."""
    extra = extra or {}
    with tracking.idle_pause(meter.paused, state):
        res = evaluator(state)
    if isinstance(evaluator, RetrievalEvaluator):
        row = {"step": done, "kind": "eval", **res, "samples_per_sec": meter.samples_per_sec,
               **extra}
        line, headline = evaluator.line(done, res), RETRIEVAL_METRICS
    else:
        row = {"step": done, "kind": "eval", "loss": res["log_loss"], **flat(res),
               "bayes_ne": evaluator.bayes["ne"], "samples_per_sec": meter.samples_per_sec, **extra}
        bayes = "" if evaluator.bayes["ne"] is None else f" (Bayes {evaluator.bayes['ne']:.4f})"
        line = (f"[eval] step {done}: NE {res['ne']:.4f}{bayes} "
                f"AUC {res['auc']:.4f} calibration {res['calibration']:.3f}")
        headline = _HEADLINE
    write(row)
    if rows is not None:
        rows.append(row)
    split = extra.get("split")
    log(line if split is None else line.replace("[eval]", f"[{split}]", 1))
    return {k: res[k] for k in headline}


class _Saver:
    """save(state) -> step: start saving a finite `state` labelled with its own step
    counter; FloatingPointError (nothing saved) if it holds a NaN or inf."""

    def __init__(self, ckpt: Checkpointer, trainer: Trainer, cfg: Config,
                 extra_meta: Callable[[], dict] | None = None):
        self.ckpt, self.coll, self.cfg = ckpt, trainer.coll, cfg
        self.host_meta = getattr(trainer, "checkpoint_meta", dict)   # train()'s make_trainer
        self.nonfinite = _nonfinite_leaves(trainer.mesh)
        self.extra_meta = extra_meta     # () -> more meta (the selection state)

    def __call__(self, state: dict) -> int:
        held = state_step(state)
        bad = self.nonfinite(state)
        if bad:
            raise FloatingPointError(
                f"train state at step {held} holds NaN or inf in {len(bad)} arrays ({bad[:3]}): "
                f"not saved; the checkpoints kept ({self.ckpt.all_steps()}) hold finite states"
                f"{_HUGE_INPUTS}")
        cfg = self.cfg
        save_train_state(self.ckpt, self.coll, held, state,
                         {"data_step": held, "config": cfg.name, "run": run_fields(cfg),
                          "features": schema_of(cfg).to_dict(), **self.host_meta(),
                          **(self.extra_meta() if self.extra_meta else {})})
        return held


def _has_test(cfg: Config) -> bool:
    """Whether the run has eval rows (the test): the synthetic eval stream, or data.eval_path."""
    return cfg.data.source == "synthetic" or bool(cfg.data.eval_path)


class _Selecting:
    """Model selection in the loop (gemjax.train.selection): the validation evaluator, the
    Selection state (resumed from the checkpoint of `start`) and WORKDIR/best."""

    def __init__(self, cfg: Config, workdir: str, trainer: Trainer, ckpt: Checkpointer, start: int,
                 lead: bool, log: Callable[[str], None]):
        t = cfg.train
        self.cfg, self.trainer, self.lead, self.log = cfg, trainer, lead, log
        self.workdir = workdir
        self.every = t.valid_every or t.eval_every
        self.state = selection.Selection.of(cfg)
        if start:
            rows = [r for r in tracking.read_metrics(os.path.join(workdir, "metrics.jsonl"),
                                                     log)[0]
                    if r.get("kind") == "valid" and r["step"] <= start]
            saved = ckpt.metadata(start)[1].get("selection")
            self.state = self.state.resumed(saved, rows)
        self.valid = (RetrievalEvaluator if is_retrieval(cfg) else Evaluator)(trainer, cfg, "valid")
        self.best_ckpt = Checkpointer(os.path.join(workdir, selection.BEST_DIR), keep=1)
        self.save = _Saver(self.best_ckpt, trainer, cfg, self.meta)
        self.test: dict | None = None

    def meta(self) -> dict:
        """The checkpoint meta of the selection state."""
        return {"selection": self.state.to_dict()}

    def due(self, done: int) -> bool:
        return done % self.every == 0 or done == self.cfg.train.steps

    def evaluate(self, state: dict, done: int, meter: Throughput,
                 write: Callable[[dict], None]) -> dict:
        """The validation eval of step `done` (a kind "valid" row); a new best goes to
        WORKDIR/best. Returns the headline figures."""
        rows: list = []
        headline = _eval_point(self.valid, state, done, meter, write, self.log,
                               extra={"kind": "valid", "split": "valid"}, rows=rows)
        if self.state.update(done, rows[0]):
            stale = [s for s in self.best_ckpt.all_steps() if s >= done]
            if stale:      # saved by a run that crashed before its next newest checkpoint
                self.best_ckpt.wait()
                if self.lead:
                    selection.drop_steps_from(self.best_ckpt.directory, done)
                self.best_ckpt.all_steps()
            with tracking.idle_pause(meter.paused, state):
                self.save(state)
            self.log(f"[valid] step {done}: best {self.state.metric} so far "
                     f"({self.state.best_value:.6g}) -> {self.best_ckpt.directory}")
        return headline

    def finish(self, state: dict, evaluator, end: int, meter: Throughput,
               write: Callable[[dict], None]) -> tuple[dict, dict]:
        """(state, test headline): the eval rows once on the best state (restored from
        WORKDIR/best unless it is `state`), written as a kind "eval" row of step `end` with
        "split" "test" and "eval_step"; ({} without eval rows)."""
        best = self.state.best_step
        if evaluator is None:
            return state, {}
        done = [r for r in tracking.read_metrics(os.path.join(self.workdir, "metrics.jsonl"),
                                                 self.log)[0]
                if r.get("split") == "test" and r["step"] == end]
        if done:          # a rerun of a finished run: its test eval stands
            self.test = {k: v for k, v in done[-1].items()
                         if k not in ("step", "kind", "split", "samples_per_sec")}
            return state, {k: done[-1].get(k) for k in _headline(self.cfg)}
        if best is not None and best != state_step(state):
            with Checkpointer(self.best_ckpt.directory, read_only=True) as bc:
                have = bc.all_steps()
                if have and have[-1] != best:   # a crash's lost stretch, replayed otherwise
                    self.log(f"[gemjax] {bc.directory} holds step {have[-1]}, not the selection's "
                             f"best step {best} (saved before a crash, resumed on another "
                             f"mesh): testing step {have[-1]}, what the serve readers load")
                    best = have[-1]
                _, state, _ = restore_train_state(bc, self.trainer.coll, state, best)
        rows: list = []
        step = best if best is not None else end
        headline = _eval_point(evaluator, state, end, meter, write, self.log,
                               extra={"split": "test", "eval_step": step}, rows=rows)
        self.log(f"[test] the eval rows on the best state (step {step}, validation "
                 f"{self.state.metric} {self.state.best_value})")
        self.test = {k: v for k, v in rows[0].items()
                     if k not in ("step", "kind", "split", "samples_per_sec")}
        return state, headline


def _save_at_once(save: _Saver, state: dict, ckpt: Checkpointer,
                  log: Callable[[str], None]) -> None:
    """On a second signal: save `state` and wait, unless the step it was in had donated
    it already (then the newest checkpoint stands)."""
    try:
        held = save(state)
        ckpt.wait()
        log(f"[gemjax] interrupted: saved step {held}")
    except Exception as e:  # interrupted inside the step: its donated input is gone
        log(f"[gemjax] interrupted mid-step, nothing new saved ({e.__class__.__name__}); "
            f"newest checkpoint: step {ckpt.latest_step()}")


def _summary(cfg: Config, trainer: Trainer, evaluator: "Evaluator | None", state: dict,
             last_eval: dict, counters: dict, meter: Throughput, started: float,
             compile_timer: tracking.CompileTimer, lead: bool, runlog: tracking.RunLog,
             selection: dict | None = None) -> dict:
    """summary.json of a finished run (evaluating `state` if no eval ran since the start;
    `started`: the run's time.perf_counter() at its start). selection: the model selection's
    summary (gemjax.train.selection); then last_eval is the test eval of the best state
    ({} without eval rows) and evaluator None without eval rows."""
    res = evaluator(state) if not last_eval and selection is None else None
    headline = _headline(cfg)
    final = last_eval if res is None else {k: res[k] for k in headline}
    summary = {"config": cfg.name, "model": cfg.model.kind, "steps": cfg.train.steps,
               "eval_ne": final.get("ne"), "eval_auc": final.get("auc"),
               "eval_calibration": final.get("calibration"),
               "bayes_ne": evaluator.bayes["ne"] if evaluator else None,
               "bayes_auc": evaluator.bayes["auc"] if evaluator else None,
               **({f"eval_{k}": final.get(k) for k in headline} if is_retrieval(cfg) else {}),
               **tracking.timing(meter, cfg.data.batch_size, time.perf_counter() - started,
                                 compile_timer.stop()), **counters}
    if selection is not None:
        summary["selection"] = selection
    summary.update(tracking.run_facts(trainer.mesh) if lead else {},
                   tensorboard_dir=runlog.tensorboard_dir)
    return summary
