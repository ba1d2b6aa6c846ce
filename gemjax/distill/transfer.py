"""Knowledge transfer from a teacher to a student, each method selectable by config.

    dcfg = DistillConfig(methods="kd,adapter,repr,share", temperature=1.0, alpha=0.5)
    teacher = Teacher.from_workdir("runs/teacher")          # offline: a cached checkpoint
    scfg = student_config(student_cfg, teacher.cfg, dcfg)    # repr / share change the student
    d = Distiller(Trainer.create(scfg, teacher.trainer.mesh), teacher, dcfg)
    state = d.init_state(seed)
    for step, batch, _, _ in feeder.batches(0, steps):
        state, metrics = d.step(state, batch, step)

Methods (DistillConfig.methods, comma-separated; "" trains on the labels alone):
  kd       the student's loss mixes the labels with the teacher's probabilities
           (gemjax.distill.losses: temperature, alpha);
  adapter  the soft targets are the teacher's logits corrected by a StudentAdapter
           fitted on the newest `adapter_window` labeled rows (refit every
           `adapter_refresh` steps; a batch is corrected before its labels join the
           window); needs kd. adapter_kind "affine": per-task Platt scaling of the
           teacher logit; "features": plus a linear term in cheap per-sample
           features the drift changes the response to (`adapter_features`: "dense",
           the sample's dense inputs Batch.dense [B, D]; "repr", the teacher's
           sequence embedding [B, E]; "student", the student's own logits [B, K]
           before its step on the batch: one more forward), L2 penalty `adapter_l2`;
  repr     the teacher's sequence embedding of each sample (gemjax.distill.represent;
           a teacher without sequences: its user row) is a student input
           (model.student.teacher_repr_dim); in training it is served from a per-user cache
           refreshed when older than `repr_window` steps (0: always the sample's own),
           in eval the sample's own; `repr_norm` "standardize" divides each feature's
           deviation from its mean by its std over the training rows served so far
           (ReprNormalizer), `repr_dropout` zeroes a training sample's row with that
           probability;
  share    the student's embedding tables are the teacher's (model.dim = the
           teacher's, the student projects them to its width): "frozen" (the student
           never updates them: sparse lr 0; with a co-trained teacher they are copied
           from it before every step) or "tuned" (copied once, then trained at the
           student's sparse lr times `share_lr_scale`; `share_accum` "teacher" keeps
           the teacher's Adagrad accumulators, "fresh" starts from the student's own;
           `share_freeze_steps` N keeps the teacher's rows through the first N steps);
           `share_dense` names dense parameter groups of the same shape in both models
           (e.g. "dense_proj") copied into the student at init, then trained.
Hierarchical transfer is the same machinery twice: a Distiller trains a domain model
from the teacher, and `Teacher(domain_trainer, domain_state)` teaches the student.

Teacher modes: "offline" (the teacher's state is fixed: a checkpoint, `from_workdir`)
or "cotrain" (the Distiller also trains the teacher on each batch, after the
teacher's outputs for that batch are taken). One process (the teacher's outputs pass
through the host for the adapter and the cache).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from gemjax.config import Config, schema_of
from gemjax.data.batch import Batch, id_features
from gemjax.data.feeding import Feeder
from gemjax.data.source import eval_steps, make_source
from gemjax.distill.adapter import StudentAdapter
from gemjax.distill.batch import DistillBatch, with_teacher
from gemjax.distill.losses import kd_objective
from gemjax.distill.represent import repr_dim, represent
from gemjax.train.metrics import EvalAccumulator
from gemjax.train.step import CHECK_VMA, Trainer, gather_param, process_rows

METHODS = ("kd", "adapter", "repr", "share")
ADAPTER_FEATURES = ("dense", "repr", "student")


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    """How a student learns from its teacher (module docstring)."""

    methods: str = "kd"              # comma-separated subset of METHODS; "": labels only
    temperature: float = 1.0
    alpha: float = 0.5               # weight of the soft term (losses.kd_loss)
    adapter_window: int = 4096       # labeled rows per task the adapter fits on
    adapter_refresh: int = 10        # steps between adapter refits
    adapter_kind: str = "affine"     # "affine" | "features" (module docstring)
    adapter_features: str = "dense"  # comma-separated subset of ADAPTER_FEATURES
    adapter_l2: float = 1e-3         # the adapter fit's L2 penalty (toward the identity)
    repr_window: int = 50            # steps a user's cached teacher embedding is served
    share: str = "frozen"            # "frozen" | "tuned"
    teacher_mode: str = "offline"    # "offline" | "cotrain"
    repr_norm: str = "none"          # "none" | "standardize" (ReprNormalizer)
    repr_dropout: float = 0.0        # training: share of samples whose teacher features are zeroed
    share_accum: str = "teacher"     # tuned share: "teacher" (its Adagrad accumulators) | "fresh"
    share_freeze_steps: int = 0      # tuned share: steps the tables stay the teacher's first
    share_lr_scale: float = 1.0      # tuned share: the student's optim.sparse.lr times this
    share_dense: str = ""            # share: comma-separated dense param groups copied (tuned)

    @property
    def method_set(self) -> frozenset[str]:
        return frozenset(m.strip() for m in self.methods.split(",") if m.strip())

    @property
    def feature_list(self) -> tuple[str, ...]:
        """The adapter's feature sources, in column order ("affine": none)."""
        if self.adapter_kind != "features":
            return ()
        return tuple(f.strip() for f in self.adapter_features.split(",") if f.strip())

    def validate(self) -> None:
        """ValueError naming the first bad field."""
        bad = sorted(self.method_set - set(METHODS))
        checks = [
            (not bad, f"distill methods: unknown {bad}; choose from {', '.join(METHODS)}"),
            ("adapter" not in self.method_set or "kd" in self.method_set,
             "distill methods: adapter corrects the KD soft labels, so it needs kd"),
            (self.temperature > 0, f"distill temperature must be > 0, got {self.temperature}"),
            (0.0 <= self.alpha <= 1.0, f"distill alpha must be in [0, 1], got {self.alpha}"),
            (self.adapter_window >= 1, f"distill adapter_window must be >= 1, got {self.adapter_window}"),
            (self.adapter_refresh >= 1, f"distill adapter_refresh must be >= 1, got {self.adapter_refresh}"),
            (self.adapter_kind in ("affine", "features"),
             f"distill adapter_kind must be affine or features, got {self.adapter_kind!r}"),
            (set(self.feature_list) <= set(ADAPTER_FEATURES) and
             (self.adapter_kind == "affine" or self.feature_list),
             f"distill adapter_features must be a non-empty subset of {ADAPTER_FEATURES}, got "
             f"{self.adapter_features!r}"),
            (self.adapter_l2 >= 0, f"distill adapter_l2 must be >= 0, got {self.adapter_l2}"),
            (self.repr_window >= 0, f"distill repr_window must be >= 0, got {self.repr_window}"),
            (self.share in ("frozen", "tuned"), f"distill share must be frozen or tuned, got {self.share!r}"),
            (self.teacher_mode in ("offline", "cotrain"),
             f"distill teacher_mode must be offline or cotrain, got {self.teacher_mode!r}"),
            (self.repr_norm in ("none", "standardize"),
             f"distill repr_norm must be none or standardize, got {self.repr_norm!r}"),
            (0.0 <= self.repr_dropout < 1.0,
             f"distill repr_dropout must be in [0, 1), got {self.repr_dropout}"),
            (self.share_accum in ("teacher", "fresh"),
             f"distill share_accum must be teacher or fresh, got {self.share_accum!r}"),
            (self.share_freeze_steps >= 0,
             f"distill share_freeze_steps must be >= 0, got {self.share_freeze_steps}"),
            (self.share_lr_scale > 0,
             f"distill share_lr_scale must be > 0, got {self.share_lr_scale}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)


def student_config(student: Config, teacher: Config, dcfg: DistillConfig) -> Config:
    """The student's Config for these methods: repr sets model.student.teacher_repr_dim to
    the teacher's feature width; share makes the student's tables the teacher's width
    (model.dim = the teacher's, model.student.width = the student's own width) and,
    frozen, sets optim.sparse.lr = 0 (tuned: times share_lr_scale)."""
    dcfg.validate()
    m, sp = student.model, student.optim.sparse
    methods = dcfg.method_set
    if m.kind != "student" and methods & {"repr", "share"}:
        raise ValueError(f"distill methods repr / share need a model.kind=student student, got "
                         f"{m.kind!r}")
    if "repr" in methods:
        m = dataclasses.replace(m, student=dataclasses.replace(m.student,
                                                               teacher_repr_dim=repr_dim(teacher)))
    if "share" in methods:
        m = dataclasses.replace(m, dim=teacher.model.dim, student=dataclasses.replace(
            m.student, width=m.student.width or m.dim))
        if dcfg.share == "frozen":
            sp = dataclasses.replace(sp, lr=0.0)
        else:
            sp = dataclasses.replace(sp, lr=sp.lr * dcfg.share_lr_scale)
    return dataclasses.replace(student, model=m,
                               optim=dataclasses.replace(student.optim, sparse=sp))


def _local_outputs(ctx, params, acts, batch):
    full = jax.tree.map(gather_param, params, ctx.p_specs, ctx.local_dims)
    return represent(nnx.merge(ctx.graphdef, full), acts, batch)


def teacher_outputs(ctx, state: dict, batch: Batch) -> tuple[jax.Array, jax.Array]:
    """(logits [B, K], repr [B, E]) of the teacher in `ctx` (a StepContext) on `batch`."""
    acts, _ = ctx.coll.lookup(state["tables"], id_features(batch, ctx.id_fields))
    axes = ctx.batch_axes
    fwd = jax.shard_map(functools.partial(_local_outputs, ctx), mesh=ctx.mesh,
                        in_specs=(ctx.p_specs, P(axes), P(axes)), out_specs=(P(axes), P(axes)),
                        check_vma=CHECK_VMA)
    return fwd(state["params"], acts, batch)


class Teacher:
    """A model teaching a student: its Trainer and train state; `outputs(batch)` gives
    (logits [B, K], repr [B, E]) as numpy, `train(batch)` one optimizer step (co-training).
    `workdir` and `step`: the run and checkpoint it was read from (`from_workdir`), else None."""

    def __init__(self, trainer: Trainer, state: dict):
        self.trainer, self.state, self.cfg = trainer, state, trainer.cfg
        self.workdir: str | None = None
        self.step: int | None = None
        self._outputs = trainer._planned(functools.partial(teacher_outputs, trainer.context()),
                                         "teacher outputs")
        self._train = None

    @classmethod
    def from_workdir(cls, workdir: str, step: int | None = None, mesh=None) -> "Teacher":
        """The teacher of a finished run (its newest checkpoint, or `step`), offline."""
        from gemjax.serve.restore import restore
        run = restore(workdir, step, mesh)
        teacher = cls(run.trainer, run.state)
        teacher.workdir, teacher.step = os.path.abspath(workdir), run.step
        return teacher

    def outputs(self, batch: Batch) -> tuple[np.ndarray, np.ndarray]:
        logits, rep = self._outputs(self.state, batch)
        return process_rows(logits), process_rows(rep)

    def train(self, batch: Batch) -> dict:
        """One train step of the teacher on `batch` (its own labels); returns its metrics."""
        if self._train is None:
            self._train = self.trainer.make_train_step()
        self.state, metrics = self._train(self.state, batch)
        return metrics


class ReprCache:
    """Teacher embeddings per user: `serve(users [B], fresh [B, E], step)` returns [B, E],
    a user's cached row while it is younger than `window` steps, else (and then
    cached) the sample's fresh one. window 0: always the fresh rows."""

    def __init__(self, window: int):
        self.window = window
        self.rows: dict[int, tuple[np.ndarray, int]] = {}
        self.hits = self.misses = 0

    def serve(self, users: np.ndarray, fresh: np.ndarray, step: int) -> np.ndarray:
        if self.window == 0:
            self.misses += len(users)
            return fresh
        out = fresh.copy()
        for i, u in enumerate(np.asarray(users).tolist()):
            got = self.rows.get(u)
            if got is not None and step - got[1] < self.window:
                out[i] = got[0]
                self.hits += 1
            else:
                self.rows[u] = (fresh[i].copy(), step)
                self.misses += 1
        return out

    def state_arrays(self) -> dict[str, np.ndarray]:
        """users [N], rows [N, E], steps [N] of the cached rows; hits, misses []."""
        users = list(self.rows)
        rows = [self.rows[u][0] for u in users]
        return {"users": np.asarray(users, np.int64), "steps": np.asarray(
                    [self.rows[u][1] for u in users], np.int64),
                "rows": np.stack(rows) if rows else np.zeros((0, 0), np.float32),
                "hits": np.asarray(self.hits), "misses": np.asarray(self.misses)}

    def load_state_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        """Take the state `state_arrays` gave."""
        self.rows = {int(u): (np.asarray(r), int(t)) for u, r, t in
                     zip(arrays["users"], arrays["rows"], arrays["steps"])}
        self.hits, self.misses = int(arrays["hits"]), int(arrays["misses"])


class ReprNormalizer:
    """Per-feature standardisation of teacher features: `update(x [B, E])` adds a
    training batch to running sums, `apply(x [B, E])` returns (x - mean) / sqrt(var + eps)
    with the mean and (population) variance of every row seen so far (float64 sums;
    before any row: x unchanged). Statistics come from training batches only; eval
    applies the final ones."""

    def __init__(self, eps: float = 1e-6):
        self.eps, self.n = eps, 0
        self.s1 = self.s2 = None

    def update(self, x: np.ndarray) -> None:
        x = np.asarray(x, np.float64)
        if self.s1 is None:
            self.s1, self.s2 = np.zeros(x.shape[1]), np.zeros(x.shape[1])
        self.s1 += x.sum(0)
        self.s2 += (x * x).sum(0)
        self.n += x.shape[0]

    def apply(self, x: np.ndarray) -> np.ndarray:
        if not self.n:
            return np.asarray(x, np.float32)
        mean, std = self.statistics(np.shape(x)[1])
        return ((np.asarray(x, np.float64) - mean) / std).astype(np.float32)

    def statistics(self, width: int) -> tuple[np.ndarray, np.ndarray]:
        """(mean [E], std [E]) float64: apply(x) = (x - mean) / std, std = sqrt(var + eps);
        before any row (0, 1)."""
        if not self.n:
            return np.zeros(width), np.ones(width)
        mean = self.s1 / self.n
        var = np.maximum(self.s2 / self.n - mean * mean, 0.0)
        return mean, np.sqrt(var + self.eps)

    def state_arrays(self) -> dict[str, np.ndarray]:
        """n [] and, after a row, s1, s2 [E] (float64 sums)."""
        return {"n": np.asarray(self.n), **({} if self.s1 is None else {"s1": self.s1, "s2": self.s2})}

    def load_state_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        """Take the state `state_arrays` gave."""
        self.n = int(arrays["n"])
        self.s1 = np.array(arrays["s1"]) if "s1" in arrays else None
        self.s2 = np.array(arrays["s2"]) if "s2" in arrays else None


class Distiller:
    """Trains a student from `teacher` with `dcfg`'s methods, through the student
    Trainer's own train_step (its Trainer.objective is the KD loss, kd_objective, with kd on).

    student_trainer: built from `student_config(...)` on the teacher's mesh.
    """

    def __init__(self, student_trainer: Trainer, teacher: Teacher, dcfg: DistillConfig,
                 user_feature: str = "user"):
        dcfg.validate()
        self.dcfg, self.teacher, self.trainer = dcfg, teacher, student_trainer
        self.methods = dcfg.method_set
        self.mesh = student_trainer.mesh
        if "kd" in self.methods:
            student_trainer.objective = kd_objective(dcfg.alpha, dcfg.temperature)
        k = schema_of(student_trainer.cfg).num_tasks
        widths = {"dense": schema_of(student_trainer.cfg).num_dense, "student": k,
                  "repr": repr_dim(teacher.cfg) if "repr" in dcfg.feature_list else 0}
        self.adapter = (StudentAdapter(k, dcfg.adapter_window, dcfg.adapter_refresh,
                                       sum(widths[f] for f in dcfg.feature_list), dcfg.adapter_l2)
                        if "adapter" in self.methods else None)
        self.cache = ReprCache(dcfg.repr_window) if "repr" in self.methods else None
        self.norm = (ReprNormalizer() if "repr" in self.methods and dcfg.repr_norm == "standardize"
                     else None)
        self._rng = np.random.default_rng(0)
        self.steps_done = 0      # Distiller.step calls (share_freeze_steps' clock)
        self._initial_tables = None
        self.user_feature = user_feature
        self._step = student_trainer.make_train_step()
        self._eval = student_trainer.make_eval_step()
        if "share" in self.methods:
            self._check_shared_tables()

    def _check_shared_tables(self) -> None:
        mine = {n: (s.vocab, s.dim) for n, s in self.trainer.coll.specs.items()}
        theirs = {n: (s.vocab, s.dim) for n, s in self.teacher.trainer.coll.specs.items()}
        if any(theirs.get(n) != v for n, v in mine.items()):
            raise ValueError(f"share: the student's tables {mine} are not the teacher's {theirs} "
                             f"(build the student with student_config)")

    def shared_tables(self) -> dict:
        """A copy of the teacher's tables the student reads (share)."""
        return jax.tree.map(jnp.copy, {n: self.teacher.state["tables"][n]
                                       for n in self.trainer.coll.specs})

    def init_state(self, seed: int) -> dict:
        """The student's initial train state (with share: the teacher's tables; with
        share_accum "fresh", their rows with the student's own initial optimizer state).
        Seeds the repr-dropout draws."""
        state = self.trainer.init_state(seed)
        self._rng = np.random.default_rng(seed)
        if "share" in self.methods:
            state["tables"] = self._start_tables(state["tables"])
            for name in (g.strip() for g in self.dcfg.share_dense.split(",") if g.strip()):
                state["params"] = self._copy_group(state["params"], name)
        return state

    def _copy_group(self, params: dict, name: str) -> dict:
        """`params` with group `name` (a top-level key) replaced by a copy of the teacher's
        (placed as the student's); ValueError unless both models have it with the same tree of shapes."""
        mine, theirs = params.get(name), self.teacher.state["params"].get(name)
        shapes = [None if t is None else jax.tree.map(np.shape, t) for t in (mine, theirs)]
        if mine is None or theirs is None or shapes[0] != shapes[1]:
            raise ValueError(f"distill share_dense: {name!r} is not a parameter group of both "
                             f"models with one shape (student {shapes[0]}, teacher {shapes[1]})")
        return {**params, name: jax.tree.map(lambda t, m: jax.device_put(jnp.copy(t), m.sharding),
                                             theirs, mine)}

    def _start_tables(self, own: dict) -> dict:
        tables = self.shared_tables()
        if self.dcfg.share == "tuned" and self.dcfg.share_accum == "fresh":
            tables = {n: {k: (v if k == "weights" else own[n][k]) for k, v in t.items()}
                      for n, t in tables.items()}
        self._initial_tables = tables
        return jax.tree.map(jnp.copy, tables)

    def _uses_teacher(self) -> bool:
        return bool(self.methods & {"kd", "repr"})

    def adapter_inputs(self, batch: Batch, rep: np.ndarray, state: dict | None = None,
                       logits: np.ndarray | None = None) -> np.ndarray:
        """The adapter's features [B, F] of `batch` (dcfg.feature_list's sources in order;
        rep: the teacher's fresh repr [B, E]; "student" reads the student's logits [B, K]
        under `state`, before it trains on `batch`, with `logits` the teacher's raw
        logits as its soft targets); [B, 0] for the affine adapter."""
        def student():
            if state is None:
                raise ValueError("adapter_features 'student' needs the student's state")
            r = (self.transform_repr(rep, batch, 0, training=False) if "repr" in self.methods
                 else np.zeros((rep.shape[0], 0), np.float32))
            p = np.clip(np.asarray(self._eval(state, with_teacher(batch, logits, r, self.mesh)),
                                   np.float64), 1e-7, 1 - 1e-7)
            return np.log(p) - np.log1p(-p)
        cols = {"dense": lambda: process_rows(batch.dense), "repr": lambda: rep,
                "student": student}
        parts = [np.asarray(cols[f](), np.float64) for f in self.dcfg.feature_list]
        return np.concatenate(parts, 1) if parts else np.zeros((rep.shape[0], 0))

    def corrected_teacher(self, batch: Batch, state: dict | None = None) -> np.ndarray:
        """The teacher's logits [B, K] on `batch` through the adapter's current fit
        (`state`: the student's, for adapter_features "student")."""
        logits, rep = self.teacher.outputs(batch)
        return self.adapter.correct(logits, self.adapter_inputs(batch, rep, state, logits))

    def _prepare(self, batch: Batch, step: int, training: bool, state: dict | None = None):
        if not self._uses_teacher():
            return batch, None, None
        logits, rep = self.teacher.outputs(batch)
        soft, feats = logits, None
        if training and self.adapter is not None:
            feats = self.adapter_inputs(batch, rep, state, logits)
            soft = self.adapter.correct(logits, feats)
        if "repr" not in self.methods:
            rep = np.zeros((logits.shape[0], 0), np.float32)
        else:
            rep = self.transform_repr(rep, batch, step, training)
        return with_teacher(batch, soft, rep, self.mesh), logits, feats

    def transform_repr(self, rep: np.ndarray, batch: Batch, step: int,
                       training: bool) -> np.ndarray:
        """The teacher features [B, E] the student reads: training, through the per-user
        cache, then (repr_norm "standardize") the normaliser's statistics updated with
        them and applied, then (repr_dropout p) each sample's row zeroed with
        probability p (not rescaled: a zero row reads as "no teacher features", the
        mean after standardising); eval, the fresh rows through the final statistics."""
        if training and self.cache is not None:
            rep = self.cache.serve(process_rows(batch.sparse[self.user_feature]), rep, step)
        if self.norm is not None:
            if training:
                self.norm.update(rep)
            rep = self.norm.apply(rep)
        if training and self.dcfg.repr_dropout > 0:
            keep = self._rng.random(rep.shape[0]) >= self.dcfg.repr_dropout
            rep = np.where(keep[:, None], rep, 0.0).astype(np.float32)
        return rep

    def prepare(self, batch: Batch, step: int, *, training: bool = True,
                state: dict | None = None) -> tuple[Batch, Any]:
        """(the student's batch, the teacher's raw logits [B, K] or None) for `batch`.

        Training: soft targets adapter-corrected (with adapter: from the teacher's
        logits and, adapter_kind "features", `adapter_inputs`), teacher features
        through the per-user cache (with repr). Eval: raw logits and fresh features.
        """
        sbatch, logits, _ = self._prepare(batch, step, training, state)
        return sbatch, logits

    def step(self, state: dict, batch: Batch, step: int) -> tuple[dict, dict]:
        """One student step on `batch` (then the adapter observes its labels; co-training:
        then the teacher trains on it). Returns (student state, metrics)."""
        if "share" in self.methods and self.dcfg.share == "frozen" and \
                self.dcfg.teacher_mode == "cotrain":
            state = {**state, "tables": self.shared_tables()}
        sbatch, logits, feats = self._prepare(batch, step, True, state)
        state, metrics = self._step(state, sbatch)
        self.steps_done += 1
        if ("share" in self.methods and self.dcfg.share == "tuned"
                and self.steps_done <= self.dcfg.share_freeze_steps):
            # the first share_freeze_steps steps train the rest of the student on the
            # teacher's rows as they are; tuning then starts from them
            state = {**state, "tables": jax.tree.map(jnp.copy, self._initial_tables)}
        if self.adapter is not None:
            self.adapter.observe(logits, process_rows(batch.labels),
                                 process_rows(batch.label_mask), process_rows(batch.weights),
                                 feats)
        if self.dcfg.teacher_mode == "cotrain":
            self.teacher.train(batch)
        return state, metrics

    def host_state(self) -> tuple[dict[str, np.ndarray], dict]:
        """What the next steps depend on besides the student's train state: (arrays by
        "adapter/...", "cache/...", "norm/...", "steps_done"; the repr-dropout generator's
        state, JSON)."""
        arrays = {"steps_done": np.asarray(self.steps_done)}
        for name, part in (("adapter", self.adapter), ("cache", self.cache), ("norm", self.norm)):
            if part is not None:
                arrays.update({f"{name}/{k}": v for k, v in part.state_arrays().items()})
        return arrays, self._rng.bit_generator.state

    def load_host_state(self, arrays: dict[str, np.ndarray], rng: dict) -> None:
        """Take the state `host_state` gave (of a Distiller with the same DistillConfig)."""
        self.steps_done = int(arrays["steps_done"])
        for name, part in (("adapter", self.adapter), ("cache", self.cache), ("norm", self.norm)):
            if part is not None:
                part.load_state_arrays({k[len(name) + 1:]: v for k, v in arrays.items()
                                        if k.startswith(name + "/")})
        self._rng = np.random.default_rng()
        self._rng.bit_generator.state = rng

    def predict(self, state: dict, batch: Batch) -> np.ndarray:
        """The student's probabilities [B, K] on `batch` (fresh teacher features)."""
        sbatch, _ = self.prepare(batch, 0, training=False)
        return np.asarray(self._eval(state, sbatch))


def refresh_student(distiller: Distiller, student_state: dict, teacher_state: dict,
                    batches: Iterable[Batch], start_step: int = 0) -> tuple[dict, list[dict]]:
    """Refresh a student from the current teacher: `teacher_state` becomes the
    distiller's (offline) teacher state, then the student trains one Distiller.step
    per batch of `batches` (device Batches, e.g. Feeder.batches' second items),
    numbered from start_step (the repr cache's clock).

    Returns (student state, [metrics per step] as host dicts). The teacher state is
    read, never updated (also in cotrain mode: refreshing is not training it).
    """
    distiller.teacher.state = teacher_state
    mode = distiller.dcfg.teacher_mode
    distiller.dcfg = dataclasses.replace(distiller.dcfg, teacher_mode="offline")
    out = []
    try:
        for i, batch in enumerate(batches):
            student_state, m = distiller.step(student_state, batch, start_step + i)
            out.append(jax.device_get(m))
    finally:
        distiller.dcfg = dataclasses.replace(distiller.dcfg, teacher_mode=mode)
    return student_state, out


def evaluate(cfg: Config, predict, mesh) -> dict:
    """Eval metrics (EvalAccumulator.result: ne, auc, calibration, ...) of
    `predict(batch) -> probs [B, K]` over cfg's eval stream (one process)."""
    stream = make_source(cfg, "eval")
    feeder = Feeder(stream.shard_batch, mesh, prefetch=0)
    f = schema_of(cfg)
    acc = EvalAccumulator(f.num_surfaces, f.num_tasks)
    for i in range(eval_steps(stream, cfg)):
        host, _, _ = feeder.host_batch(i)
        probs = predict(feeder.to_device(host))
        acc.add(probs, host.labels, host.label_mask, host.surface, host.weights)
    return acc.result()
