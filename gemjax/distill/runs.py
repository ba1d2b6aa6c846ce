"""Distilled students as training runs: each student trains through gemjax.train.loop.train
in its own workdir, like any run, and resumes exactly after a stop.

    summary = train_student(student_cfg, "runs/students/kd", teacher, DistillConfig("kd,adapter"))
    row = evaluate_student("runs/students/kd")      # WORKDIR/eval/step_N.json
    predict = load_student("runs/students/kd")      # predict(Batch) -> probabilities [B, K]
    distiller, state = restore_student("runs/students/kd")   # its adapter, teacher, state
    out = export_student("runs/students/kd")        # a gemjax export (serve.export.load_exported)

The workdir holds what every train() run writes (config.json: the student's Config
after `student_config`; checkpoints/; metrics.jsonl; summary.json) and student.json:
{"format", "distill": the DistillConfig's fields, "teacher": {"workdir", "step"} of the
offline teacher (Teacher.from_workdir), or null for a teacher built in memory}. Resuming
a workdir that holds checkpoints with another DistillConfig or teacher is refused
(ResumeMismatch, naming the fields).

The train state is the student Trainer's own (step, params, opt_state, tables), so the
checkpoints restore with gemjax.serve.restore like any run's. What the Distiller keeps
on the host and the next steps depend on (the Student Adapter's coefficients and
labeled window, the per-user repr cache, the repr normaliser's sums, the
repr-dropout generator, its step counter: `Distiller.host_state`) is saved in every
checkpoint's meta, meta["distill"] = {"arrays": base64 of an .npz (exact), "rng": the
generator's state}, through train()'s checkpoint_meta / resume_meta hooks; so a
student stopped by a signal and resumed ends as an uninterrupted one does.

Serving. A student without teacher features (methods "", kd, adapter, share) is a
plain model.kind=student run: train.py --mode=eval, load_for_inference and
export_model read it as any run (shared tables are the student's own copy in its
checkpoint; the adapter and KD shape training only). A `repr` student's forward also
reads the teacher's features of each sample (gemjax.distill.represent: a teacher with
sequences, its encoders' pooled output of the sample's own history; without, its row
of the sample's user), through the normaliser's final statistics. evaluate_student
and load_student recompute them from the teacher run named in student.json.
export_student makes the export self-contained by folding the teacher's representation
into it: the teacher's embedding tables are tables of the export ("teacher/<table>"),
its dense parameters and the normaliser's statistics are params of the export
("teacher/<path>", "teacher_repr/mean", "teacher_repr/std", [E] float32), and the
exported function computes the features from the same batch inputs before the
student's forward. Not a precomputed per-user table: with sequences the features are
a function of the request's history, not of the user id, so a user-keyed table would
serve other values than the student trained and was evaluated on; not an input of
the exported function: that would leave the teacher's model to the server. Inside,
the export reproduces the student's eval to float32 rounding with no teacher
checkpoint present. For a teacher without sequences the features are its user
table's row: a table of the export. XLA drops the teacher computation the features do
not use (its logits); every teacher dense parameter is still an input (params.npz).

Co-training (DistillConfig teacher_mode "cotrain": a fresh teacher trains on each batch
after the student's step): the teacher's state is checkpointed with the student's, at
the same step, as the run directory WORKDIR/teacher (config.json and checkpoints/, as a
train() run's: Teacher.from_workdir reads it), written synchronously before the
student's checkpoint (`save_cotrained`); the student's meta["distill"]["teacher_step"]
names it and a resume restores the teacher from there. student.json's "teacher" is then
{"cotrained": "teacher"}, and a repr student's features are recomputed from the teacher
as it was at the student's checkpoint.

One process (the teacher's outputs pass through the host).
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gemjax.config import Config, schema_of, with_schema
from gemjax.distill.batch import with_teacher
from gemjax.distill.represent import represent
from gemjax.distill.transfer import DistillConfig, Distiller, Teacher, student_config
from gemjax.serve.evaluate import evaluate_checkpoint
from gemjax.serve.export import (export_model, feature_inputs, flatten_by_path, host_tables,
                                 lookup_features, serving_forward)
from gemjax.serve.inference import Predictor, load_for_inference
from gemjax.serve.restore import read_config, restore
from gemjax.train.checkpoint import Checkpointer, save_train_state, state_step
from gemjax.train.guards import ResumeMismatch, run_fields
from gemjax.train.loop import train
from gemjax.train.step import Trainer

FORMAT = "gemjax.student/1"
RECORD = "student.json"


def _pack(arrays: dict[str, np.ndarray]) -> str:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _unpack(text: str) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(base64.b64decode(text))) as z:
        return {k: z[k] for k in z.files}


def load_meta(distiller: Distiller, meta: dict, where: str) -> None:
    """Give `distiller` the host state of a student checkpoint's meta (`where` names it)."""
    saved = meta.get("distill")
    if saved is None:
        raise ValueError(f"{where}: the checkpoint's meta holds no distillation state "
                         f"(meta['distill']): not a student run's checkpoint")
    distiller.load_host_state(_unpack(saved["arrays"]), saved["rng"])


class StudentTrainer:
    """The trainer train() runs for a student: the student Trainer's attributes (cfg,
    coll, mesh, graphdef, ...) with init_state, the train step and the eval step of
    `distiller` (its teacher's outputs taken per batch), and its host state in every
    checkpoint's meta (module docstring). teacher_dir (a co-trained teacher): the run
    directory its state is checkpointed in at every student checkpoint's step."""

    def __init__(self, distiller: Distiller, teacher_dir: str | None = None):
        self.distiller, self.trainer = distiller, distiller.trainer
        self.teacher_dir = teacher_dir

    def __getattr__(self, name):
        if name in ("distiller", "trainer", "teacher_dir"):
            raise AttributeError(name)
        return getattr(self.trainer, name)

    def init_state(self, seed: int) -> dict:
        return self.distiller.init_state(seed)

    def make_train_step(self) -> Callable:
        d = self.distiller

        def step(state, batch, next_batch=None):
            return d.step(state, batch, state_step(state))   # the step counter: the cache's clock
        return step

    def make_eval_step(self) -> Callable:
        return self.distiller.predict

    def checkpoint_meta(self) -> dict:
        arrays, rng = self.distiller.host_state()
        saved = {"arrays": _pack(arrays), "rng": rng}
        if self.teacher_dir is not None:     # the co-trained teacher at the same step
            saved["teacher_step"] = save_cotrained(self.teacher_dir, self.distiller.teacher,
                                                   self.distiller.steps_done)
        return {"distill": saved}

    def resume_meta(self, meta: dict) -> None:
        load_meta(self.distiller, meta, "student resume")
        if self.teacher_dir is not None:
            step = meta["distill"].get("teacher_step")
            if step is None:
                raise ValueError(f"student resume: the checkpoint's meta names no co-trained "
                                 f"teacher step (meta['distill']['teacher_step'])")
            saved = Teacher.from_workdir(self.teacher_dir, step, mesh=self.trainer.mesh)
            if saved.cfg.model != self.distiller.teacher.cfg.model:
                raise ResumeMismatch(f"cannot resume the student: its co-trained teacher in "
                                     f"{self.teacher_dir} has another model config than this "
                                     f"run's teacher. Rerun with the checkpoint's teacher "
                                     f"settings, or use a new workdir")
            self.distiller.teacher.state = saved.state


COTRAINED = "teacher"     # WORKDIR/teacher: a co-trained teacher's run directory


def save_cotrained(teacher_dir: str, teacher: Teacher, step: int) -> int:
    """Checkpoint a co-trained teacher's state as `step` of the run directory
    `teacher_dir` (config.json and checkpoints/, as train() writes them: restore and
    Teacher.from_workdir read it), synchronously; returns step. A step already there
    is kept (an exact resume recomputes the same state)."""
    cfg = teacher.cfg
    path = os.path.join(teacher_dir, "config.json")
    if not os.path.isfile(path):
        os.makedirs(teacher_dir, exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(dataclasses.asdict(with_schema(cfg)), f, indent=1)
        os.replace(path + ".tmp", path)
    with Checkpointer(os.path.join(teacher_dir, "checkpoints"), keep=cfg.train.keep_checkpoints + 1,
                      async_save=False) as ckpt:
        if step not in ckpt.all_steps():
            save_train_state(ckpt, teacher.trainer.coll, step, teacher.state,
                             {"data_step": step, "config": cfg.name, "run": run_fields(cfg),
                              "features": schema_of(cfg).to_dict()})
    return step


def read_record(workdir: str) -> dict:
    """WORKDIR/student.json; FileNotFoundError naming it when the run is no student."""
    path = os.path.join(workdir, RECORD)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file; {workdir!r} is not a student run "
                                f"(gemjax.distill.runs.train_student writes it)")
    with open(path) as f:
        return json.load(f)


def _write_record(workdir: str, record: dict) -> None:
    """student.json; a workdir with checkpoints of another record: ResumeMismatch."""
    path = os.path.join(workdir, RECORD)
    if os.path.isfile(path) and os.path.isdir(os.path.join(workdir, "checkpoints")):
        old = read_record(workdir)
        diff = [f"{k}: checkpoint's {old.get(k)!r}, now {record[k]!r}" for k in record
                if old.get(k) != record[k]]
        if diff:
            raise ResumeMismatch(f"cannot resume the student in {workdir}: " + "; ".join(diff)
                                 + ". Rerun with the checkpoint's values, or use a new workdir")
        return
    os.makedirs(workdir, exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, indent=1)
    os.replace(path + ".tmp", path)


def train_student(student_cfg: Config, workdir: str, teacher: Teacher, dcfg: DistillConfig, *,
                  mesh=None, log: Callable[[str], None] = print,
                  stop_after: int | None = None) -> dict:
    """Train the student of `student_cfg` (before `student_config`) from `teacher` with
    `dcfg` in `workdir` (resuming it); returns train()'s summary. mesh: default the
    teacher's; stop_after: as train()'s. dcfg.teacher_mode "cotrain": `teacher` is the
    fresh teacher that trains beside the student (its state is replaced by
    WORKDIR/teacher's on a resume; module docstring). Raises as train() does
    (Interrupted after a signal, with the checkpoint saved), ResumeMismatch for a
    workdir whose checkpoints were trained with another DistillConfig or teacher, and
    ValueError for train.steps_per_call > 1."""
    if student_cfg.train.steps_per_call != 1:
        raise ValueError(f"train_student: train.steps_per_call must be 1 (the teacher's outputs "
                         f"pass through the host per step), got {student_cfg.train.steps_per_call}")
    cfg = student_config(student_cfg, teacher.cfg, dcfg)
    cotrain = dcfg.teacher_mode == "cotrain"
    if cotrain:
        ref = {"cotrained": COTRAINED}
    else:
        ref = None if teacher.workdir is None else {"workdir": teacher.workdir, "step": teacher.step}
    _write_record(workdir, {"format": FORMAT, "distill": dataclasses.asdict(dcfg), "teacher": ref})
    teacher_dir = os.path.join(workdir, COTRAINED) if cotrain else None

    def make(cfg, mesh, **trainer_kw):
        return StudentTrainer(Distiller(Trainer.create(cfg, mesh, **trainer_kw), teacher, dcfg),
                              teacher_dir)

    return train(cfg, workdir, log=log, mesh=mesh or teacher.trainer.mesh, stop_after=stop_after,
                 make_trainer=make)


def _distiller(workdir: str, trainer: Trainer, meta: dict) -> Distiller:
    """The student's Distiller on `trainer` with its teacher (student.json) and the host
    state of the checkpoint's `meta`."""
    record = read_record(workdir)
    ref = record["teacher"]
    if ref is None:
        raise ValueError(f"{workdir}: the student's teacher was not read from a run "
                         f"(student.json teacher: null), so its features cannot be recomputed")
    if "cotrained" in ref:      # the co-trained teacher as it was at this checkpoint
        teacher = Teacher.from_workdir(os.path.join(workdir, ref["cotrained"]),
                                       meta["distill"]["teacher_step"], mesh=trainer.mesh)
    else:
        teacher = Teacher.from_workdir(ref["workdir"], ref["step"], mesh=trainer.mesh)
    d = Distiller(trainer, teacher, DistillConfig(**record["distill"]))
    load_meta(d, meta, workdir)
    return d


def restore_student(workdir: str, step: int | None = None, mesh=None) -> tuple[Distiller, dict]:
    """(the student's Distiller, its train state) at checkpoint `step` (default the
    newest) of a student run: the teacher read from the run named in student.json, the
    host state (the Student Adapter's fit, ...) from the checkpoint's meta; e.g. for
    `Distiller.corrected_teacher` with the adapter the student ended with."""
    run = restore(workdir, step, mesh, log=lambda s: None)
    return _distiller(workdir, run.trainer, run.meta), run.state


def evaluate_student(workdir: str, step: int | None = None, mesh=None, **kw) -> dict:
    """serve.evaluate.evaluate_checkpoint of a student run (kw: its trainer_kw,
    overrides, log): the eval row, also written to WORKDIR/eval/step_N.json; a repr
    student's features recomputed from its teacher."""
    if not read_config(workdir).model.student.teacher_repr_dim:
        return evaluate_checkpoint(workdir, step, mesh, **kw)
    return evaluate_checkpoint(workdir, step, mesh, **kw, wrap=lambda run: StudentTrainer(
        _distiller(workdir, run.trainer, run.meta)))


def load_student(workdir: str, step: int | None = None, mesh=None) -> Predictor:
    """serve.inference.load_for_inference of a student run; for a repr student the
    Predictor's eval step takes the teacher's features first (Distiller.predict)."""
    pred = load_for_inference(workdir, step, mesh, teacher_features=True)
    if pred.cfg.model.student.teacher_repr_dim:
        pred.eval_step = _distiller(workdir, pred.trainer, pred.meta).predict
    return pred


def _unflatten(like, flat: dict):
    return jax.tree.unflatten(jax.tree.structure(like), [flat[p] for p in flatten_by_path(like)])


def export_student(workdir: str, out: str | None = None, step: int | None = None, *,
                   batch=None, platforms: tuple[str, ...] | None = None,
                   log: Callable[[str], None] = print) -> str:
    """serve.export.export_model of a student run (default out WORKDIR/export; batch: the
    example one-device Batch fixing the shapes, as export_model's); a repr student's
    export computes the teacher's features itself (module docstring):

        forward(params {path, "teacher/<path>", "teacher_repr/mean", "teacher_repr/std"},
                tables {table, "teacher/<table>"}, batch {path}) -> probabilities [B, K]

    The manifest names the teacher run and step ("teacher") and the features
    ("teacher_repr": dim E, repr_norm)."""
    if not read_config(workdir).model.student.teacher_repr_dim:
        return export_model(workdir, out, step, batch=batch, platforms=platforms, log=log)

    def extend(pred, params, batch, flat_params, tables):
        d = _distiller(workdir, pred.trainer, pred.meta)
        teacher, cfg = d.teacher, pred.cfg
        e = cfg.model.student.teacher_repr_dim
        b, k = np.shape(batch.labels)
        mean, std = ((np.zeros(e), np.ones(e)) if d.norm is None else d.norm.statistics(e))
        student = serving_forward(cfg, pred.trainer.graphdef, params, with_teacher(
            batch, np.zeros((b, k), np.float32), np.zeros((b, e), np.float32)))
        t_params = jax.tree.map(np.asarray, jax.device_get(teacher.state["params"]))
        t_graph = teacher.trainer.graphdef
        t_feats = {f"teacher/{f}": {**fi, "table": f"teacher/{fi['table']}"}
                   for f, fi in feature_inputs(teacher.cfg).items()}

        def forward(p, t, fb):
            own = {n: v for n, v in p.items() if not n.startswith(("teacher/", "teacher_repr/"))}
            mine = {n: v for n, v in t.items() if not n.startswith("teacher/")}
            acts = lookup_features(t_feats, t, fb, b)
            model = nnx.merge(t_graph, _unflatten(t_params, {n[8:]: v for n, v in p.items()
                                                             if n.startswith("teacher/")}))
            _, rep = represent(model, {f[8:]: x for f, x in acts.items()}, _unflatten(batch, fb))
            rep = (rep - p["teacher_repr/mean"]) / p["teacher_repr/std"]
            return student(own, mine, {**fb, "teacher_logits": jnp.zeros((b, k), jnp.float32),
                                       "teacher_repr": rep})

        flat_params = {**flat_params, **{f"teacher/{n}": v for n, v in flatten_by_path(t_params).items()},
                       "teacher_repr/mean": mean.astype(np.float32),
                       "teacher_repr/std": std.astype(np.float32)}
        tables = {**tables, **{f"teacher/{n}": w for n, w in
                               host_tables(teacher.trainer.coll, teacher.state["tables"]).items()}}
        info = {"teacher": {"workdir": teacher.workdir, "step": teacher.step},
                "teacher_repr": {"dim": e, "repr_norm": d.dcfg.repr_norm,
                                 "what": "computed inside from the teacher/ params and tables"}}
        return forward, flat_params, tables, t_feats, info

    return export_model(workdir, out, step, batch=batch, platforms=platforms, log=log,
                        extend=extend)
