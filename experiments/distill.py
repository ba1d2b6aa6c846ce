"""Knowledge transfer, one table: a teacher, students trained with each transfer
method, their eval NE over seeds.

    python -m experiments.distill --dataset=synthetic --seeds=0,1,2 --out=runs/distill

Per seed:
1. The teacher (`--teacher_override` on the dataset's base config; model.kind=gem by
   default) trains with gemjax.train.loop.train into OUT/<dataset>/teacher_sSEED (a
   finished one, with summary.json, is reused) and is read back from its checkpoint
   (`Teacher.from_workdir`: the offline teacher). --teacher_mode=cotrain trains a fresh
   teacher inside each student's run instead (the same batches, the teacher's outputs
   taken before it trains on them; checkpointed with the student in its run's
   teacher/; the teacher's NE is that of the first row's teacher after
   --student_steps steps; no hierarchical row).
2. One student (model.kind=student, `--student_override`: by default a DLRM of the
   teacher's width 16, so shared tables need no projection) per row, trained
   --student_steps steps from the same init seed on the same stream with
   gemjax.distill.transfer.Distiller (the student Trainer's own train_step):
     none      the labels alone
     kd        standard KD (--alpha, --temperature)
     kd+adapter    KD on the Student Adapter's corrected teacher logits (--adapter:
               affine, a per-task Platt scaling, or features, plus a linear term in
               --adapter_features: dense inputs, the teacher's repr, the student's
               own logits; L2 --adapter_l2, fitted on the newest --adapter_window rows)
     +repr     kd+adapter and the teacher's sequence embeddings (a teacher without
               sequences: its user row) as inputs (each sample's own by default;
               --repr_window=N serves a user's cached one up to N steps) through one
               projected token; --repr_norm=standardize, --repr_dropout
     +share    kd+adapter and the teacher's embedding tables (--share tuned by default,
               with fresh Adagrad accumulators, --share_accum; or frozen: then checked
               bit-identical after training) and its --share_dense groups (dense_proj)
     all       kd+adapter+repr+share
     hier      (--hierarchical) teacher -> domain model (a wider wukong student,
               kd+adapter) -> the student (kd+adapter)
3. Every model's NE on the dataset's eval stream (synthetic: data.eval_batches
   batches; Frappe: every row of test.parquet). gain = NE(none) - NE(row), per seed;
   the table shows mean ± std (population) over seeds and the ratio of the combined
   gain to the KD gain.
4. The students' budget: forward FLOPs per sample (gemjax.models.student.forward_flops,
   matmuls) and CPU latency of the forward at batch 512 (the eval step, one device,
   median of 10 calls after a warm-up).

--dataset=frappe reads the converted Frappe of --frappe_dir (experiments/frappe.py
converts it); when it is absent the run says so and exits 0. --data_overrides applies
to the dataset config of every model.

--dataset=drift is the drifting synthetic stream (gemjax.data.drift.DriftingStream,
DRIFT_DATA: windows of data.drift_every steps, the planted model and the item
popularity moving at each window start), time-ordered per seed; every model is a run
reading it through make_source (data.drift_start: the stream step of its step 0):
  teacher   trains (offline, before any student) on global steps [0, T) with
            T = --teacher_steps, the earlier windows, as the run OUT/drift/teacher_sSEED
            (--drift_teacher_lr constant: optim.schedule=warmup_constant);
  students  (and the hierarchical row's domain model) train on the next
            --student_steps steps [T, T + S), the recent window(s), with the fixed
            teacher's outputs (data.drift_start=T); the Student Adapter observes only
            these labels, so its fit is on the newest labeled rows (--adapter_window rows);
  eval      every row, the teacher too, on the whole window after them (the
            drift_every steps from T + S), labelled by that window's planted model:
            samples none of the models trained on; its Bayes-optimal NE is printed too.
T and S must be multiples of data.drift_every; data.new_id_rate must be 0 (fresh raw
ids need an id admission, experiments/online.py); every run's data.eval_batches is
data.drift_every (a student run's own eval is the eval window; the teacher run's, not
used, the students' window); --teacher_mode=cotrain is refused. A line under the table
scores the teacher's eval logits through the kd+adapter student's final adapter
(restored from its run: gemjax.distill.runs.restore_student; how much of the teacher's
drift a recalibration removes). results.json records, per seed and model
("drift_steps"), the global steps it trained on and was evaluated on.
Writes OUT/<dataset>/results.json and OUT/<dataset>/table.md and prints the table.

Students as runs: every student (every dataset, drift included; cotrain too, its
teacher a run inside the student's: WORKDIR/teacher), the hierarchical row's domain
model included, trains as a run in OUT/<dataset>/students/<row>_s<seed>
(gemjax.distill.runs.train_student: checkpoints/, config.json, metrics.jsonl,
summary.json and student.json, the DistillConfig and the teacher's run and step).
`python -m experiments.train --mode=eval --workdir=<student dir>` evaluates it again;
gemjax.distill.runs.export_student exports it (a +repr student with its teacher's
representation inside). SIGTERM / SIGINT: the run in training saves a checkpoint and the
command ends with one line, exit 143 / 130; rerunning the same command resumes it
(exactly: the Distiller's host state is in the checkpoints) and reuses finished runs.
"""

from __future__ import annotations

import json
import os
import sys
import time

from absl import app, flags, logging

from gemjax.train.runtime import default_compile_cache  # no jax import

ROWS = {"none": "", "kd": "kd", "kd+adapter": "kd,adapter", "+repr": "kd,adapter,repr",
        "+share": "kd,adapter,share", "all": "kd,adapter,repr,share"}

# the synthetic teacher / student on the tiny preset's data (a few CPU minutes)
SYNTHETIC_DATA = ("data.batch_size=128,data.vocab_user=2000,data.vocab_item=400,data.seq_median=8,"
                  "data.seq_cap=32,data.recent=8,data.eval_batches=8")
TEACHER = ("model.kind=gem,model.dim=16,model.wukong_layers=2,model.fmb_tokens=4,"
           "model.lcb_tokens=4,model.fm_rank=4,model.wukong_mlp=32,model.head_mlp=32,"
           "train.dense_lr=4e-3,train.sparse_lr=0.2")
STUDENT = ("model.kind=student,model.student_arch=dlrm,model.dim=16,model.head_mlp=16,"
           "model.student_recent=8,train.dense_lr=4e-3,train.sparse_lr=0.2")
# the drifting stream: windows of 50 steps, 30% fresh planted parameters per window, item
# popularity ranks rotated by 2 per window (the default 400 / 150 steps: 8 teacher windows,
# 3 student windows, the 12th window evaluated)
DRIFT_DATA = "data.drift_every=50,data.drift_strength=0.3,data.popularity_shift=2"
DOMAIN = "model.kind=student,model.student_arch=wukong,model.dim=16,model.head_mlp=32"


def define_flags():
    flags.DEFINE_enum("dataset", "synthetic", ["synthetic", "frappe", "drift"], "data of every model")
    flags.DEFINE_list("seeds", ["0", "1", "2"], "seeds (teacher and student init, stream)")
    flags.DEFINE_string("out", "runs/distill", "results.json, table.md and teacher runs")
    flags.DEFINE_integer("teacher_steps", 400, "teacher train steps")
    flags.DEFINE_integer("student_steps", 150, "student train steps")
    flags.DEFINE_string("data_overrides", "", "data.* overrides for every model")
    flags.DEFINE_string("teacher_override", TEACHER, "teacher config overrides")
    flags.DEFINE_string("student_override", STUDENT, "student config overrides")
    flags.DEFINE_list("rows", list(ROWS), f"rows of the table: {', '.join(ROWS)}")
    flags.DEFINE_bool("hierarchical", True, "add the teacher -> domain -> student row")
    flags.DEFINE_enum("teacher_mode", "offline", ["offline", "cotrain"], "teacher outputs from")
    flags.DEFINE_float("alpha", 0.5, "KD weight of the soft term")
    flags.DEFINE_float("temperature", 1.0, "KD temperature")
    flags.DEFINE_integer("adapter_window", 2048, "labeled rows per task the adapter fits on")
    flags.DEFINE_integer("adapter_refresh", 10, "steps between adapter refits")
    flags.DEFINE_enum("adapter", "affine", ["affine", "features"],
                      "Student Adapter: per-task Platt scaling of the teacher logit (affine) or "
                      "plus a linear term in --adapter_features (features)")
    flags.DEFINE_string("adapter_features", "dense",
                        "features adapter inputs: dense (the sample's dense inputs), repr (the "
                        "teacher's sequence embedding), student (the student's own logits "
                        "before its step), comma-separated")
    flags.DEFINE_float("adapter_l2", 1e-3, "L2 penalty of the adapter fit (toward the identity)")
    flags.DEFINE_integer("repr_window", 0,
                         "steps a cached user embedding is served (0: the sample's own)")
    flags.DEFINE_enum("share", "tuned", ["frozen", "tuned"], "shared teacher tables")
    flags.DEFINE_enum("repr_norm", "none", ["none", "standardize"],
                      "teacher features standardised per feature (training-batch statistics)")
    flags.DEFINE_float("repr_dropout", 0.0, "training: share of samples whose teacher features "
                       "are zeroed")
    flags.DEFINE_enum("share_accum", "fresh", ["teacher", "fresh"],
                      "tuned shared tables start with the teacher's Adagrad accumulators or fresh ones")
    flags.DEFINE_string("share_dense", "dense_proj", "share: dense parameter groups of the teacher copied "
                        "into the student (same shapes), e.g. dense_proj")
    flags.DEFINE_float("share_lr_scale", 1.0, "tuned shared tables: sparse lr times this")
    flags.DEFINE_integer("share_freeze_steps", 0, "tuned shared tables stay the teacher's for the "
                         "first N student steps")
    flags.DEFINE_enum("drift_teacher_lr", "decay", ["decay", "constant"],
                      "--dataset=drift: the teacher's dense lr decays over its steps (the batch "
                      "trainer's schedule) or stays at train.dense_lr after the warm-up "
                      "(gemjax.train.online.online_trainer: recent windows weigh as much as old ones)")
    flags.DEFINE_string("frappe_dir", "/tmp/gemjax-data/frappe", "converted Frappe")
    flags.DEFINE_integer("latency_batch", 512, "batch of the CPU latency figure (0: skip)")
    flags.DEFINE_string("compile_cache", default_compile_cache(),
                        "persistent jax compilation cache (default $JAX_COMPILATION_CACHE_DIR, else "
                        "TMPDIR/gemjax-jax-cache; '': none); seeds share programs")


def base_config(dataset: str, frappe_dir: str, data_overrides: str):
    """The dataset's config (its data section; model and train come from overrides)."""
    from gemjax.config import apply_overrides, get_config
    if dataset == "frappe":
        from gemjax.config import on_converted_files
        cfg = on_converted_files("frappe", frappe_dir, "data.batch_size=512,train.warmup_steps=20")
    elif dataset == "drift":
        cfg = get_config("tiny", f"{SYNTHETIC_DATA},{DRIFT_DATA}")
    else:
        cfg = get_config("tiny", SYNTHETIC_DATA)
    cfg = apply_overrides(cfg, "train.tensorboard=false,train.baselines=false")
    return apply_overrides(cfg, data_overrides) if data_overrides else cfg


def model_config(base, override: str, steps: int, seed: int):
    from gemjax.config import apply_overrides
    every = max(steps, 1)
    return apply_overrides(base, f"{override},train.steps={steps},train.seed={seed},"
                                 f"train.warmup_steps={min(20, steps // 4)},train.log_every={every},"
                                 f"train.eval_every={every},train.checkpoint_every={every}")


def train_teacher(cfg, workdir: str):
    from gemjax.train.loop import train
    if not os.path.exists(os.path.join(workdir, "summary.json")):
        train(cfg, workdir, log=lambda *_: None)


class DriftWindows:
    """The drift dataset of one seed (module docstring): the DriftingStream of cfg.data
    and seed cfg.train.seed, the global step ranges of the teacher, the students and
    the eval window, and `consumed[model] = {"train": set, "eval": set}`, the steps
    each model's batches were read at: recorded by the source read for the evaluations
    made here (`evaluate`), and from its config for each run (`ran`)."""

    def __init__(self, cfg, teacher_steps: int, student_steps: int):
        from gemjax.data.drift import DriftingStream
        d = cfg.data
        if d.drift.every < 1:
            raise ValueError(f"--dataset=drift needs data.drift.every >= 1, got {d.drift.every}")
        for flag, n in (("--teacher_steps", teacher_steps), ("--student_steps", student_steps)):
            if n < 1 or n % d.drift.every:
                raise ValueError(f"--dataset=drift: {flag}={n} must be a positive multiple of "
                                 f"data.drift.every={d.drift.every} (whole windows)")
        if d.drift.new_id_rate:
            raise ValueError(f"--dataset=drift needs data.new_id_rate=0 (fresh raw ids need an id "
                             f"admission: experiments/online.py), got {d.drift.new_id_rate}")
        self.stream = DriftingStream(d, cfg.train.seed)
        self.teacher = range(0, teacher_steps)
        self.student = range(teacher_steps, teacher_steps + student_steps)
        self.eval = self.stream.window_steps(self.stream.window(self.student.stop))
        self.consumed: dict[str, dict[str, set]] = {}

    def source(self, model: str, use: str):
        """`shard_batch` of the stream, recording the steps read under consumed[model][use]."""
        seen = self.consumed.setdefault(model, {"train": set(), "eval": set()})[use]

        def shard_batch(step: int, shard: int = 0, num_shards: int = 1):
            seen.add(step)
            return self.stream.shard_batch(step, shard, num_shards)
        return shard_batch

    def evaluate(self, cfg, predict, mesh, model: str) -> dict:
        """EvalAccumulator.result of `predict(batch) -> probs [B, K]` over the eval window,
        with "bayes_ne": the NE of the window's true probabilities."""
        import numpy as np
        from gemjax.config import schema_of
        from gemjax.data.feeding import Feeder
        from gemjax.train.metrics import EvalAccumulator
        f = schema_of(cfg)
        acc, bayes = (EvalAccumulator(f.num_surfaces, f.num_tasks) for _ in range(2))
        feeder = Feeder(self.source(model, "eval"), mesh, prefetch=0)
        for step in self.eval:
            host, infos, _ = feeder.host_batch(step)
            cols = (host.labels, host.label_mask, host.surface, host.weights)
            acc.add(predict(feeder.to_device(host)), *cols)
            bayes.add(np.concatenate([i.true_probs for i in infos]), *cols)
        return {**acc.result(), "bayes_ne": bayes.result()["ne"]}

    def ran(self, model: str, workdir: str, use: tuple[str, ...] = ("train", "eval")) -> None:
        """Record under consumed[model] the steps the run in `workdir` trained (`use`
        "train") and was evaluated (`use` "eval") on: its config.json's data.drift_start,
        train.steps and data.eval_batches (make_source's drifting stream)."""
        from gemjax.serve.restore import read_config
        cfg = read_config(workdir)
        seen = self.consumed.setdefault(model, {"train": set(), "eval": set()})
        start, stop = cfg.data.drift.start, cfg.data.drift.start + cfg.train.steps
        steps = {"train": range(start, stop), "eval": range(stop, stop + cfg.data.eval_batches)}
        for u in use:
            seen[u].update(steps[u])

    def record(self) -> dict:
        """consumed as sorted lists (results.json)."""
        return {m: {u: sorted(v) for u, v in uses.items()} for m, uses in self.consumed.items()}


def drift_config(cfg, start: int, teacher_lr: str = "decay"):
    """cfg reading the drifting stream from global step `start` (data.drift_start), its
    run's eval the whole window after its training (data.eval_batches =
    data.drift_every); teacher_lr "constant": optim.schedule=warmup_constant (the lr of
    gemjax.train.online.online_trainer)."""
    from gemjax.config import apply_overrides
    over = f"data.drift_start={start},data.eval_batches={cfg.data.drift.every}"
    return apply_overrides(cfg, over + (",optim.schedule=warmup_constant"
                                        if teacher_lr == "constant" else ""))


def student_dir(out: str, row: str, seed: int) -> str:
    """OUT/<dataset>/students/<row>_s<seed>: the workdir of a student run ("kd+adapter" ->
    kd_adapter, "+repr" -> repr, "hier/domain" -> hier_domain)."""
    name = row.strip("+").replace("+", "_").replace("/", "_")
    return os.path.join(out, "students", f"{name}_s{seed}")


def run_student(scfg, tcfg, teacher, methods: str, args, steps: int, mesh, workdir: str) -> dict:
    """Eval metrics of one student trained with `methods` for `steps` steps of the
    dataset's train stream (drift: from scfg's data.drift_start) as the run `workdir`
    (gemjax.distill.runs.train_student: checkpointed, resumed, servable), evaluated on
    its eval stream. --teacher_mode=cotrain: `teacher` is ignored; a fresh teacher of
    tcfg trains beside the student, checkpointed in WORKDIR/teacher."""
    from gemjax.distill.transfer import DistillConfig, Teacher
    from gemjax.train.step import Trainer
    dcfg = DistillConfig(methods=methods, temperature=args.temperature, alpha=args.alpha,
                         adapter_window=args.adapter_window, adapter_refresh=args.adapter_refresh,
                         adapter_kind=args.adapter, adapter_features=args.adapter_features,
                         adapter_l2=args.adapter_l2, repr_window=args.repr_window, share=args.share,
                         teacher_mode=args.teacher_mode, repr_norm=args.repr_norm,
                         repr_dropout=args.repr_dropout, share_accum=args.share_accum,
                         share_freeze_steps=args.share_freeze_steps,
                         share_lr_scale=args.share_lr_scale, share_dense=args.share_dense)
    if args.teacher_mode == "cotrain":
        tt = Trainer.create(tcfg, mesh)
        teacher = Teacher(tt, tt.init_state(tcfg.train.seed))
    return _student_run(scfg, teacher, dcfg, workdir, mesh)


def _student_run(scfg, teacher, dcfg, workdir: str, mesh) -> dict:
    """Eval metrics of the student run in `workdir` (trained, resumed or reused); frozen
    shared tables: "shared_tables_unchanged" read back from its checkpoint."""
    import numpy as np
    from gemjax.distill.runs import train_student
    from gemjax.serve.restore import restore
    summary = train_student(scfg, workdir, teacher, dcfg, mesh=mesh, log=lambda s: None)
    res = {k: summary[f"eval_{k}"] for k in ("ne", "auc", "calibration")}
    if "share" in dcfg.method_set and dcfg.share == "frozen" and dcfg.teacher_mode == "offline":
        tables = restore(workdir, mesh=mesh).state["tables"]
        res["shared_tables_unchanged"] = all(
            np.array_equal(np.asarray(tables[n]["weights"]),
                           np.asarray(teacher.state["tables"][n]["weights"])) for n in tables)
    return res


def latency_ms(cfg, batch_size: int, mesh) -> float:
    """Median ms of the eval step (forward + lookup) on one batch of `batch_size`."""
    import jax
    import numpy as np
    from gemjax.config import apply_overrides
    from gemjax.data.feeding import Feeder
    from gemjax.data.source import make_source
    from gemjax.distill.batch import with_teacher
    from gemjax.train.step import Trainer
    cfg = apply_overrides(cfg, f"data.batch_size={batch_size}")
    tr = Trainer.create(cfg, mesh)
    state = tr.init_state(0)
    feeder = Feeder(make_source(cfg, "eval").shard_batch, mesh, prefetch=0)
    host, _, _ = feeder.host_batch(0)
    batch = feeder.to_device(host)
    if cfg.model.student.teacher_repr_dim:
        batch = with_teacher(batch, np.zeros(host.labels.shape, np.float32),
                             np.ones((batch_size, cfg.model.student.teacher_repr_dim), np.float32), mesh)
    step = tr.make_eval_step()
    jax.block_until_ready(step(state, batch))
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        jax.block_until_ready(step(state, batch))
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def budget_rows(base, args, tcfg, mesh) -> list[dict]:
    """Per student variant: FLOPs per sample, parameters, table bytes, CPU latency."""
    from gemjax.distill.transfer import DistillConfig, student_config
    from gemjax.models import student as student_lib
    from gemjax.train.optim import table_specs
    out = []
    variants = {"student": "", "student+repr": "repr", "student+share": "share",
                "domain (wukong)": None}
    for name, methods in variants.items():
        if methods is None:
            cfg = model_config(base, DOMAIN, 1, 0)
        else:
            cfg = student_config(model_config(base, args.student_override, 1, 0), tcfg,
                                 DistillConfig(methods=methods, share=args.share))
        tables = sum(s.vocab * s.dim * 4 for s in table_specs(cfg))
        row = {"model": name, "arch": cfg.model.student.arch,
               "flops_per_sample": student_lib.forward_flops(cfg),
               "table_bytes": tables,
               "own_table_bytes": 0 if methods == "share" else tables,
               "latency_ms_b512": (round(latency_ms(cfg, args.latency_batch, mesh), 2)
                                   if args.latency_batch else None)}
        out.append(row)
    return out


def summarize(results: list[dict], rows: list[str], teacher_ne: list[float],
              bayes_ne: list[float] | None = None) -> tuple[str, dict]:
    """Markdown table (NE and gain, mean ± std over seeds) and the figures behind it;
    bayes_ne (drift): the eval window's Bayes-optimal NE per seed, a first row."""
    import numpy as np
    seeds = sorted({r["seed"] for r in results})
    ne = {row: np.array([next(r["ne"] for r in results if r["row"] == row and r["seed"] == s)
                         for s in seeds]) for row in rows}
    base = ne.get("none")
    lines = ["| model | NE (mean ± std) | gain vs none (mean ± std) |", "|---|---|---|",
             f"| teacher | {np.mean(teacher_ne):.4f} ± {np.std(teacher_ne):.4f} | |"]
    figures = {"teacher_ne": [float(x) for x in teacher_ne]}
    if bayes_ne:
        lines.insert(2, f"| Bayes-optimal | {np.mean(bayes_ne):.4f} ± {np.std(bayes_ne):.4f} | |")
        figures["bayes_ne"] = [float(x) for x in bayes_ne]
    for row in rows:
        gain = base - ne[row] if base is not None else None
        g = "" if gain is None else f"{gain.mean():+.4f} ± {gain.std():.4f}"
        lines.append(f"| student {row} | {ne[row].mean():.4f} ± {ne[row].std():.4f} | {g} |")
        figures[row] = {"ne": ne[row].tolist(), "gain": None if gain is None else gain.tolist()}
    if base is not None and "kd" in ne and "all" in ne:
        kd_gain, all_gain = (base - ne["kd"]).mean(), (base - ne["all"]).mean()
        ratio = all_gain / kd_gain if kd_gain != 0 else float("nan")
        figures["combined_over_kd_gain"] = float(ratio)
        note = "" if kd_gain > 0 else " (the KD gain is not positive: no ratio to read)"
        lines.append(f"\ncombined gain / KD gain: {ratio:.2f} (seeds {seeds}){note}")
    return "\n".join(lines), figures


def main(argv):
    del argv
    args = flags.FLAGS
    logging.set_verbosity(logging.WARNING)      # orbax's per-checkpoint info lines
    import jax
    import numpy as np
    from gemjax.train import runtime
    try:
        # programs compiling in >= 0.5 s are stored, unless $JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS says
        min_s = None if os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS") else 0.5
        runtime.enable_compile_cache(args.compile_cache, min_compile_s=min_s, log=lambda s: None)
    except ValueError as e:
        raise app.UsageError(f"--compile_cache: {e}")
    from gemjax.distill.runs import COTRAINED, restore_student
    from gemjax.distill.transfer import Teacher, evaluate
    from gemjax.train.step import default_mesh
    if args.dataset == "frappe" and not os.path.exists(os.path.join(args.frappe_dir, "schema.json")):
        print(f"[distill] --dataset=frappe: no converted Frappe in {args.frappe_dir} (run "
              f"python -m experiments.frappe, or experiments/convert_frappe.py, first); skipped")
        return
    unknown = [r for r in args.rows if r not in ROWS]
    if unknown:
        raise app.UsageError(f"--rows: unknown {unknown}; choose from {', '.join(ROWS)}")
    out = os.path.join(args.out, args.dataset)
    os.makedirs(out, exist_ok=True)
    base = base_config(args.dataset, args.frappe_dir, args.data_overrides)
    mesh = default_mesh(jax.devices()[:1])
    hier = args.hierarchical and args.teacher_mode == "offline"
    if args.hierarchical and not hier:
        print("[distill] --teacher_mode=cotrain: no hierarchical row (its domain model is an "
              "offline teacher)")
    drift = args.dataset == "drift"
    if drift and args.teacher_mode == "cotrain":
        raise app.UsageError("--dataset=drift trains the teacher offline on the earlier windows: "
                             "--teacher_mode must be offline")
    rows = list(args.rows) + (["hier"] if hier else [])
    results, teacher_ne, bayes_ne, consumed, teacher_adapter = [], [], [], {}, []
    t_start = time.time()
    for seed in [int(s) for s in args.seeds]:
        tcfg = model_config(base, args.teacher_override, args.teacher_steps, seed)
        scfg = model_config(base, args.student_override, args.student_steps, seed)
        teacher, windows = None, None
        if drift:
            try:
                windows = DriftWindows(tcfg, args.teacher_steps, args.student_steps)
            except ValueError as e:
                raise app.UsageError(str(e)) from None
            tcfg = drift_config(tcfg, 0, args.drift_teacher_lr)
            scfg = drift_config(scfg, args.teacher_steps)
            workdir = os.path.join(out, f"teacher_s{seed}")
            train_teacher(tcfg, workdir)
            windows.ran("teacher", workdir, ("train",))    # its own run's eval is not the table's
            teacher = Teacher.from_workdir(workdir, mesh=mesh)
            step = teacher.trainer.make_eval_step()
            got = windows.evaluate(tcfg, lambda b: step(teacher.state, b), mesh, "teacher")
            teacher_ne.append(got["ne"])
            bayes_ne.append(got["bayes_ne"])
        elif args.teacher_mode == "offline":
            workdir = os.path.join(out, f"teacher_s{seed}")
            train_teacher(tcfg, workdir)
            teacher = Teacher.from_workdir(workdir, mesh=mesh)
            step = teacher.trainer.make_eval_step()
            teacher_ne.append(evaluate(tcfg, lambda b: step(teacher.state, b), mesh)["ne"])
        for row in rows:
            t0 = time.time()
            wd = student_dir(out, row, seed)
            if row == "hier":
                # the domain model: on the drift stream, the students' recent windows
                dom_steps = args.student_steps if drift else args.teacher_steps // 2
                dom_cfg = model_config(base, DOMAIN, dom_steps, seed)
                if drift:
                    dom_cfg = drift_config(dom_cfg, args.teacher_steps)
                dom_wd = student_dir(out, "hier/domain", seed)
                run_student(dom_cfg, tcfg, teacher, "kd,adapter", args, dom_steps, mesh, dom_wd)
                if windows is not None:
                    windows.ran("hier/domain", dom_wd)
                domain = Teacher.from_workdir(dom_wd, mesh=mesh)
                res = run_student(scfg, dom_cfg, domain, "kd,adapter", args, args.student_steps,
                                  mesh, wd)
            else:
                res = run_student(scfg, tcfg, teacher, ROWS[row], args, args.student_steps, mesh, wd)
            if args.teacher_mode == "cotrain" and row == rows[0]:
                # the co-trained teacher of the first row, after its student_steps steps
                cot = Teacher.from_workdir(os.path.join(wd, COTRAINED), mesh=mesh)
                step = cot.trainer.make_eval_step()
                teacher_ne.append(evaluate(tcfg, lambda b: step(cot.state, b), mesh)["ne"])
            if windows is not None:
                windows.ran(row, wd)
                if row == "kd+adapter":
                    # the teacher's own eval logits through this student's final adapter
                    # (fitted on the newest student-window labels): its drift that
                    # calibration can correct
                    d, sstate = restore_student(wd, mesh=mesh)
                    got = windows.evaluate(
                        tcfg, lambda b: 1 / (1 + np.exp(-d.corrected_teacher(b, sstate))), mesh,
                        "teacher+adapter")
                    teacher_adapter.append({"ne": got["ne"], "auc": got["auc"]})
            results.append({"seed": seed, "row": row, "ne": res["ne"], "auc": res["auc"],
                            "calibration": res["calibration"],
                            "shared_tables_unchanged": res.get("shared_tables_unchanged"),
                            "workdir": wd, "seconds": round(time.time() - t0, 1)})
            print(f"[distill] seed {seed} {row:10s} NE {res['ne']:.4f} AUC {res['auc']:.4f} "
                  f"({results[-1]['seconds']} s)", flush=True)
        if windows is not None:
            consumed[seed] = {"teacher": [windows.teacher.start, windows.teacher.stop],
                              "student": [windows.student.start, windows.student.stop],
                              "eval": [windows.eval.start, windows.eval.stop],
                              "eval_window": windows.stream.window(windows.eval.start),
                              "models": windows.record()}
    table, figures = summarize(results, rows, teacher_ne or [float("nan")], bayes_ne)
    if teacher_adapter:
        ta = np.array([t["ne"] for t in teacher_adapter])
        figures["teacher_adapter"] = teacher_adapter
        table += (f"\nteacher through the kd+adapter student's final adapter (drift): NE "
                  f"{ta.mean():.4f} ± {ta.std():.4f}")
    tcfg = model_config(base, args.teacher_override, 1, 0)
    budget = budget_rows(base, args, tcfg, mesh)
    btable = ["| student | arch | FLOPs / sample | table bytes (own) | CPU ms, batch "
              f"{args.latency_batch} |", "|---|---|---|---|---|"]
    btable += [f"| {r['model']} | {r['arch']} | {r['flops_per_sample']:,} | "
               f"{r['table_bytes']:,} ({r['own_table_bytes']:,}) | {r['latency_ms_b512']} |"
               for r in budget]
    t_steps = (f"{args.teacher_steps} steps" if args.teacher_mode == "offline"
               else f"trained with each student, {args.student_steps} steps")
    if drift:
        w = base.data.drift.every
        t_steps += (f", windows 0-{args.teacher_steps // w - 1} of {w} steps; students on the "
                    f"next {args.student_steps // w}, every row evaluated on the window after")
    text = (f"dataset {args.dataset}, teacher {args.teacher_mode} ({t_steps}), "
            f"students {args.student_steps} steps, seeds {args.seeds}\n\n{table}\n\n"
            + "\n".join(btable))
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"flags": {k: getattr(args, k) for k in (
                       "dataset", "seeds", "teacher_steps", "student_steps", "data_overrides",
                       "teacher_override", "student_override", "teacher_mode", "alpha",
                       "temperature", "adapter_window", "adapter_refresh", "adapter",
                       "adapter_features", "adapter_l2", "repr_window", "share",
                       "repr_norm", "repr_dropout", "share_accum", "share_freeze_steps",
                       "share_lr_scale", "share_dense",
                       "drift_teacher_lr")},
                   "runs": results, "summary": figures, "budget": budget,
                   "drift_steps": consumed or None,
                   "wall_s": round(time.time() - t_start, 1)}, f, indent=1)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(text + "\n")
    print(text)


def run(argv):
    """main, with a stop by SIGINT / SIGTERM ending in one line and exit 128 + signal (a
    teacher or student run stopped mid-training saves its checkpoint first; rerunning
    the same command resumes it and reuses the finished ones), a second signal (stop at
    once) in exit 130, a refused run (busy workdir, resume mismatch) in exit 2."""
    import signal
    import sys
    from gemjax.train.checkpoint import join_background_threads
    from gemjax.train.guards import Interrupted, RunRefused

    def between_runs(signum, frame):     # train() installs its own handlers while it runs
        raise Interrupted(signum, None, f"stopped by {signal.Signals(signum).name} between "
                          f"runs: nothing in training; rerun the same command to resume")
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, between_runs)
    try:
        main(argv)
    except Interrupted as e:
        print(f"[distill] {e}", flush=True)
        join_background_threads()
        sys.exit(128 + e.signum)
    except KeyboardInterrupt as e:
        print(f"[distill] {e or 'interrupted'}", flush=True)
        join_background_threads()
        sys.exit(130)
    except RunRefused as e:
        print(f"[distill] refused: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    define_flags()
    app.run(run)
