"""Continuous online training on a time-ordered stream, with progressive validation.

    result = run_online(cfg, workdir, OnlineSpec(windows=8))

The stream is, with data.source="synthetic", `gemjax.data.drift.DriftingStream(cfg.data,
cfg.train.seed)` cut into windows of W = data.drift.every steps; with
data.source="parquet" (data.order="time"), the rows of data.train_path (columns from
cfg.features) cut into windows of data.window_seconds of data.time_column
(`gemjax.data.time_windows.TimeWindows`: window w is ceil(rows_w / B) batches, the last
one padded with masked rows; windows=0 runs every window of the files), ids of the
admitted tables read raw (`gemjax.data.time_windows.parquet_windows`). Raw item ids (and those of any table in
spec.admit_tables) go through a `FrequencyAdmission` per model and table before
a model sees them. The models are `Member`s:

  fresh    the teacher trained continuously, window after window;
  frozen   a copy of the fresh teacher (state and admission) taken at the end of
           window spec.warmup_windows - 1, never trained or admitting again;
  ...      more members added by `spec.extra_members` (students, teacher snapshots):
           each a Member with its own train and eval steps, an optional `refresh`
           run at the start of every window (e.g. taking a new snapshot of the fresh
           teacher), and its own admission or another member's (`shares_admission`:
           a student reads its teacher's id map, so both see the same rows).

Per window w:
  1. progressive validation: every member scores every batch of the window before
     anything trains on it (ids mapped with the member's admission as it stands at
     the window start); NE per member over the window, next to the window's
     Bayes-optimal NE (the stream's true probabilities);
  2. each trained member trains on the window's W batches in order (its own
     Trainer's jitted train step; the dense learning rate warms up over
     optim.dense.warmup_steps and then stays at optim.dense.lr: an endless stream has no
     decay horizon), and after each step its admission observes that step's raw ids;
  3. one metrics.jsonl row {"kind": "window", "step": (w + 1) * W, "window": w,
     "bayes_ne", "ne_<member>", "loss_<member>", "<table>_new_ids" (distinct raw ids
     first seen in the window), "<table>_hashed" (the fresh teacher's training
     lookups read from a shared row in the window), "<table>_admitted" /
     "<table>_refused" / "<table>_seen" (totals so far)}; on Parquet rows "step" is the
     batches read through window w, there is no "bayes_ne", and the row adds "t_start",
     "t_end" (the window's interval of the time column, seconds), "rows" and
     "auc_<member>";
  4. from the end of the warm-up on, a checkpoint labelled (w + 1) * W of every
     member's state (tables in logical row order) with the stream position, every
     admission state and the run's settings in its meta (written synchronously).

Resume: rerunning on the same workdir restores the newest checkpoint and cuts
metrics.jsonl back to its step; the stream is a pure function of the step and the
admission state is restored, so the rows and final states equal an uninterrupted
run's (Parquet: the windows are a pure function of the files). A resume with other
data / seed / online settings is refused
(ResumeMismatch). SIGINT / SIGTERM stop at the end of the current window, after its
checkpoint (`Interrupted`); kill -9 loses the windows since the newest checkpoint.
One process (the model may span all its local devices); a window's W host batches
are built once (raw ids) and held while the window runs.

Members as runs: with every checkpoint, each member holding a state is also written as a
standard run directory WORKDIR/members/<name>/ (`write_member_runs`): config.json (the
member's Config as train() records it: layout.record, schema explicit; written to a
temporary file and renamed) and checkpoints/STEP in the trainer's format
(`save_train_state`: tables in logical row order, checksummed, committed by one rename,
the newest 2 kept), labelled with the member's own step counter state["step"] (a member
that did not change since its last write, e.g. the frozen teacher, is not written
again). The step's meta holds "online" {"workdir", "window", "data_step", "member"} and
"admission" {table: `admission_map`}: the id map the member reads (its own, or the one it
shares) as it stands after the window, so the model and its map are one atomic,
checksummed step. gemjax.serve.restore / load_for_inference / export_model read these
directories like any run's; the model's ids are table rows, so raw ids go through the
map first (gemjax.serve.admitted). A fresh start (no online checkpoint) clears
WORKDIR/members; a resume rewrites the restored step's member runs (skipped where they
exist), so a kill between the online checkpoint and the member runs loses nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
from typing import Any, Callable

import jax
import numpy as np

from gemjax.config import Config, schema_of, validate, with_schema
from gemjax.data.batch import Batch
from gemjax.data.drift import DriftingStream
from gemjax.data.feeding import Feeder, concat_shards, validate_batch
from gemjax.data.time_windows import parquet_windows
from gemjax.sparse.admission import FrequencyAdmission
from gemjax.train.checkpoint import Checkpointer, save_train_state, state_step
from gemjax.train.guards import Interrupted, ResumeMismatch, StopSignals, lock_workdir, run_fields
from gemjax.train.metrics import EvalAccumulator
from gemjax.train.step import Trainer
from gemjax.train import layout, optim, tracking

MEMBERS_DIR = "members"     # WORKDIR/members/<name>/: each member as a run directory


def member_dir(workdir: str, name: str) -> str:
    """The run directory of online member `name` of the online run in `workdir`."""
    return os.path.join(workdir, MEMBERS_DIR, name)


def admission_map(adm: FrequencyAdmission) -> dict:
    """The raw id -> row map of `adm` (JSON values): {"rows": table rows, "buckets": shared
    rows, "ids": admitted raw ids ascending [A], "own_rows": their rows [A]}; any other raw
    id x reads row `gemjax.sparse.admission.bucket_of(x, buckets)`."""
    ids = sorted(adm.row_of)
    return {"rows": adm.rows, "buckets": adm.buckets, "ids": ids,
            "own_rows": [adm.row_of[i] for i in ids]}


@dataclasses.dataclass(frozen=True)
class OnlineSpec:
    """The online run beyond cfg: windows to train, the warm-up (windows before the
    teacher is frozen), the admission rule (min_count sightings before an id gets a
    row; buckets shared rows for the others) and the tables it applies to."""

    windows: int = 8
    warmup_windows: int = 1
    min_count: int = 2
    buckets: int = 16
    admit_tables: tuple[str, ...] = ("item",)
    # rows of each admitted table (its schema vocab when absent): the raw id space of an
    # endless stream is unbounded, the table is not
    table_rows: tuple[tuple[str, int], ...] = ()
    # hook: (cfg, {name: Member} so far) -> further Members; called once per run
    extra_members: Callable[[Config, dict], list["Member"]] | None = None

    def fields(self) -> dict:
        """The settings a resume must keep (JSON values)."""
        return {"warmup_windows": self.warmup_windows, "min_count": self.min_count,
                "buckets": self.buckets, "admit_tables": list(self.admit_tables),
                "table_rows": [list(p) for p in self.table_rows]}


def with_table_rows(cfg: Config, rows: tuple[tuple[str, int], ...]) -> Config:
    """cfg whose feature schema (config.features) gives table t rows[t] rows."""
    if not rows:
        return cfg
    schema, want = schema_of(cfg), dict(rows)
    bad = sorted(set(want) - {t.name for t in schema.tables})
    if bad:
        raise ValueError(f"table_rows {bad} are not tables of the feature schema")
    tables = tuple(dataclasses.replace(t, vocab=int(want.get(t.name, t.vocab))) for t in schema.tables)
    return dataclasses.replace(cfg, features=dataclasses.replace(schema, tables=tables))


@dataclasses.dataclass
class Member:
    """One model of the online run.

    state: its train state (None until it exists: the frozen teacher before the
    warm-up ends; a member without a state is neither validated, trained nor
    checkpointed); admission: {table: FrequencyAdmission} (unused with
    shares_admission: the member named there holds it); eval_step: (state, device
    batch) -> probabilities [B, K]; train_step: (state, device batch) -> (state,
    metrics with "loss"), None for a model that is never trained; refresh: (member,
    members by name, window) -> None, run at the start of every window before
    validation, in member order; trainer: its Trainer (model, tables, shardings).
    """

    name: str
    trainer: Trainer
    state: dict | None
    admission: dict[str, FrequencyAdmission]
    eval_step: Callable
    train_step: Callable | None
    refresh: Callable[["Member", dict, int], None] | None = None
    shares_admission: str | None = None


def online_trainer(cfg: Config, mesh=None) -> Trainer:
    """A Trainer for cfg whose dense optimizer keeps a constant optim.dense.lr after a
    linear warm-up of optim.dense.warmup_steps (optim.dense_transform's "warmup_constant": an
    endless stream has no end to decay towards; the same optimizer-state structure as
    the batch trainer's, so its shardings apply)."""
    trainer = Trainer.create(cfg, mesh)
    return dataclasses.replace(trainer, tx=optim.dense_transform(cfg, "warmup_constant"))


def copy_state(state: dict) -> dict:
    """A copy of a train state in new buffers (the original may then be donated)."""
    return jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, state)


def state_digest(state: dict, trainer: Trainer) -> str:
    """sha256 over every leaf of a train state (tables in logical row order)."""
    tree = {**state, "tables": trainer.coll.logical_arrays(state["tables"])}
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        h.update(jax.tree_util.keystr(path).encode())
        h.update(np.ascontiguousarray(jax.device_get(leaf)).tobytes())
    return h.hexdigest()


class _Fields:
    """Where each admitted table's ids sit in a batch: sparse features and sequence fields."""

    def __init__(self, cfg: Config, tables: tuple[str, ...]):
        schema = schema_of(cfg)
        known = {t.name for t in schema.tables}
        bad = [t for t in tables if t not in known]
        if bad:
            raise ValueError(f"admit_tables {bad} are not tables of the feature schema "
                             f"({sorted(known)})")
        self.rows = {t.name: t.vocab for t in schema.tables}
        self.sparse = {t: [f.name for f in schema.sparse if f.table == t] for t in tables}
        self.seq = {t: [(s.name, e.name) for s in schema.sequences for e in s.fields
                        if e.table == t] for t in tables}

    def raw_ids(self, shards: list[Batch], table: str, real=None) -> np.ndarray:
        """The table's raw ids of one step, in order: per shard, its sparse features
        then its sequences' real tokens (int64); real [shards] int: only the first
        real[i] samples of shard i (None: all)."""
        out = []
        for i, b in enumerate(shards):
            r = None if real is None else int(real[i])
            out += [np.asarray(b.sparse[f][:r], np.int64) for f in self.sparse[table]]
            for s, f in self.seq[table]:
                seq = b.sequences[s]
                out.append(np.asarray(seq.values[f][:int(seq.offsets[-1 if r is None else r])],
                                      np.int64))
        return np.concatenate(out) if out else np.zeros(0, np.int64)

    def mapped(self, shards: list[Batch], admission: dict[str, FrequencyAdmission],
               count: bool, real=None) -> tuple[list[Batch], dict[str, int]]:
        """The shards with every admitted table's ids replaced by their rows, and the
        lookups per table that read a shared row; real [shards] int: only the first
        real[i] samples of shard i count (None: all; the others map uncounted)."""
        hashed = {}
        out = []

        def lookup(adm, ids, r):
            if r is None:
                return adm.lookup(ids, count=count)
            (head, n), (tail, _) = adm.lookup(ids[:r], count=count), adm.lookup(ids[r:], count=False)
            return np.concatenate([head, tail]), n

        for i, b in enumerate(shards):
            r = None if real is None else int(real[i])
            sparse, seqs = dict(b.sparse), dict(b.sequences)
            for table, adm in admission.items():
                for f in self.sparse[table]:
                    sparse[f], n = lookup(adm, sparse[f], r)
                    hashed[table] = hashed.get(table, 0) + n
                for s, f in self.seq[table]:
                    seq = seqs[s]
                    vals = dict(seq.values)
                    n_real = int(seq.offsets[-1])
                    col = np.zeros_like(vals[f])
                    col[:n_real], n = lookup(adm, vals[f][:n_real],
                                             None if r is None else int(seq.offsets[r]))
                    vals[f] = col
                    seqs[s] = dataclasses.replace(seq, values=vals)
                    hashed[table] = hashed.get(table, 0) + n
            out.append(b.replace(sparse=sparse, sequences=seqs))
        return out, hashed


class OnlineRun:
    """The state of one online run (module docstring); `run_online` drives it."""

    def __init__(self, cfg: Config, workdir: str, spec: OnlineSpec,
                 log: Callable[[str], None] = print, mesh=None):
        cfg = with_table_rows(cfg, spec.table_rows)
        validate(cfg)
        if cfg.data.bbs:
            raise ValueError("data.bbs=true: online training reads its stream window by window, "
                             "which Base Batch Shuffling does not balance; set data.bbs=false")
        self.parquet = cfg.data.source == "parquet"
        self.fields = _Fields(cfg, spec.admit_tables)
        self.stream = (parquet_windows(cfg, spec.admit_tables) if self.parquet
                       else DriftingStream(cfg.data, cfg.train.seed))
        self.num_windows = spec.windows
        if self.parquet:
            have = self.stream.num_windows
            self.num_windows = spec.windows or have
            if self.num_windows > have:
                raise ValueError(f"online: {spec.windows} windows asked, {cfg.data.train_path} "
                                 f"holds {have} windows of {cfg.data.window_seconds:g} s of "
                                 f"{cfg.data.time_column!r}")
        if self.num_windows < spec.warmup_windows or spec.warmup_windows < 1:
            raise ValueError(f"online: need windows >= warmup_windows >= 1, got windows="
                             f"{self.num_windows}, warmup_windows={spec.warmup_windows}")
        self.cfg, self.workdir, self.spec, self.log = cfg, workdir, spec, log
        trainer = online_trainer(cfg, mesh)
        shard_batch = self.stream.source.shard_batch if self.parquet else self.stream.shard_batch
        self.feeder = Feeder(shard_batch, trainer.mesh)
        self.num_shards = trainer.num_shards
        self.grid = (schema_of(cfg).num_surfaces, schema_of(cfg).num_tasks)
        admission = {t: FrequencyAdmission(self.fields.rows[t], spec.min_count, spec.buckets)
                     for t in spec.admit_tables}
        fresh = Member("fresh", trainer, trainer.init_state(cfg.train.seed), admission,
                       trainer.make_eval_step(), trainer.make_train_step())
        frozen = Member("frozen", trainer, None, {}, fresh.eval_step, None)
        self.members = {"fresh": fresh, "frozen": frozen}
        for m in (spec.extra_members(cfg, dict(self.members)) if spec.extra_members else []):
            if m.name in self.members:
                raise ValueError(f"online: member name {m.name!r} is taken")
            self.members[m.name] = m
        for m in self.members.values():
            owner = self.members.get(m.shares_admission or m.name)
            if owner is None or owner.shares_admission:
                raise ValueError(f"online: member {m.name!r} shares the admission of "
                                 f"{m.shares_admission!r}, which is not a member owning one")
        self.ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=2, async_save=False)
        self.member_ckpts: dict[str, Checkpointer] = {}
        self.window = 0

    # -- one window ---------------------------------------------------------------
    def _raw_step(self, step: int) -> tuple[list[Batch], list[Any]]:
        shards, infos = zip(*(self.stream.shard_batch(step, s, self.num_shards)
                              for s in range(self.num_shards)))
        return list(shards), list(infos)

    def admission_of(self, member: Member) -> dict[str, FrequencyAdmission]:
        """The id maps `member` reads (its own, or those of the member it shares)."""
        return self.members[member.shares_admission or member.name].admission

    def _device_batch(self, member: Member, shards: list[Batch], count: bool, real=None):
        mapped, hashed = self.fields.mapped(shards, self.admission_of(member), count, real)
        coll, id_fields = member.trainer.coll, member.trainer.id_fields
        for s, b in enumerate(mapped):
            validate_batch(b, coll.check_ids, id_fields, where=f"member {member.name} shard {s}")
        return self.feeder.to_device(concat_shards(mapped)), hashed

    def run_window(self, w: int) -> dict:
        """Validate every member on window w, then train; returns its metrics row."""
        if self.parquet:
            raw = self.stream.batches(w, self.num_shards)
            row = {"step": self.step_at(w + 1), "kind": "window", "window": w,
                   **self.stream.describe(w)}
        else:
            steps = list(self.stream.window_steps(w))
            raw = [(*self._raw_step(t), None) for t in steps]
            row = {"step": steps[-1] + 1, "kind": "window", "window": w}
        for m in self.members.values():
            if m.refresh is not None:
                m.refresh(m, self.members, w)
        bayes = EvalAccumulator(*self.grid)
        accs = {n: EvalAccumulator(*self.grid) for n, m in self.members.items() if m.state is not None}
        for shards, infos, real in raw:
            host = concat_shards(shards)
            cols = (host.labels, host.label_mask, host.surface, host.weights)
            if not self.parquet:
                bayes.add(np.concatenate([i.true_probs for i in infos]), *cols)
            for n in accs:
                m = self.members[n]
                batch, _ = self._device_batch(m, shards, count=False, real=real)
                accs[n].add(np.asarray(m.eval_step(m.state, batch)), *cols)
        if not self.parquet:
            row["bayes_ne"] = bayes.result()["ne"]
        results = {n: a.result() for n, a in accs.items()}
        for n in self.members:
            row[f"ne_{n}"] = results[n]["ne"] if n in results else None
        if self.parquet:
            for n in self.members:
                row[f"auc_{n}"] = results[n]["auc"] if n in results else None
        fresh = self.members["fresh"]
        new_ids = dict.fromkeys(fresh.admission, 0)
        hashed_sum = dict.fromkeys(fresh.admission, 0)
        for n, m in self.members.items():
            if m.train_step is None or m.state is None:
                continue
            losses = []
            for shards, _, real in raw:
                batch, hashed = self._device_batch(m, shards, count=m is fresh, real=real)
                m.state, metrics = m.train_step(m.state, batch)
                losses.append(metrics["loss"])
                for table, adm in ({} if m.shares_admission else m.admission).items():
                    got = adm.observe(self.fields.raw_ids(shards, table, real))
                    if m is fresh:
                        new_ids[table] += got["new_ids"]
                        hashed_sum[table] += hashed.get(table, 0)
            row[f"loss_{n}"] = float(np.mean(jax.device_get(losses)))
        for table, adm in fresh.admission.items():
            row.update({f"{table}_new_ids": new_ids[table], f"{table}_hashed": hashed_sum[table],
                        f"{table}_admitted": adm.totals["admitted"],
                        f"{table}_refused": adm.totals["refused"], f"{table}_seen": adm.totals["seen"]})
        if w + 1 == self.spec.warmup_windows:
            frozen = self.members["frozen"]
            frozen.state = copy_state(fresh.state)
            frozen.admission = {t: a.copy() for t, a in fresh.admission.items()}
        self.window = w + 1
        return row

    def step_at(self, window: int) -> int:
        """The data step where `window` starts (a checkpoint taken after window w - 1 is
        labelled step_at(w))."""
        if self.parquet:
            return self.stream.start_step(window)
        return window * self.cfg.data.drift.every

    # -- checkpoints --------------------------------------------------------------
    def _targets(self, names) -> dict:
        return {n: {**self.members[n].trainer.init_state(self.cfg.train.seed),
                    "tables": self.members[n].trainer.coll.logical_targets()}
                for n in names}

    def _meta(self) -> dict:
        held = [n for n, m in self.members.items() if m.state is not None]
        meta = {"window": self.window, "data_step": self.step_at(self.window),
                "run": run_fields(self.cfg), "online": self.spec.fields(),
                "members": sorted(self.members), "held": held,
                "admission": {n: {t: a.state() for t, a in m.admission.items()}
                              for n, m in self.members.items() if not m.shares_admission}}
        if self.parquet:       # the windows the files make: a resume on other rows is refused
            tw = self.stream
            meta["stream"] = {"rows": tw.source.num_rows, "windows": tw.num_windows,
                              "t_first": float(tw.first_time[0]), "t_last": float(tw.last_time[-1]),
                              "steps": tw.start_step(tw.num_windows)}
        return meta

    def save(self) -> None:
        """Checkpoint every member that has a state, and every admission."""
        tree = {n: {**m.state, "tables": m.trainer.coll.logical_arrays(m.state["tables"])}
                for n, m in self.members.items() if m.state is not None}
        self.ckpt.save(self.step_at(self.window), tree, self._meta())
        self.write_member_runs()

    def write_member_runs(self) -> None:
        """WORKDIR/members/<name>/ of every member holding a state (module docstring):
        config.json and a checkpoint labelled state["step"] with the member's id maps in
        its meta; skipped for a member whose directory already holds that step."""
        for n, m in self.members.items():
            if m.state is None:
                continue
            ckpt = self.member_ckpts.get(n)
            if ckpt is None:
                d = member_dir(self.workdir, n)
                os.makedirs(d, exist_ok=True)
                rec = with_schema(layout.record(m.trainer.cfg, m.trainer, {}))
                tmp = os.path.join(d, f".config.json.tmp-{os.getpid()}")
                with open(tmp, "w") as f:
                    json.dump(dataclasses.asdict(rec), f, indent=1)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, os.path.join(d, "config.json"))
                ckpt = self.member_ckpts[n] = Checkpointer(os.path.join(d, "checkpoints"), keep=2,
                                                           async_save=False)
            step = state_step(m.state)
            if step in ckpt.all_steps():
                continue
            meta = {"online": {"workdir": os.path.abspath(self.workdir), "window": self.window,
                               "data_step": self.step_at(self.window), "member": n},
                    "admission": {t: admission_map(a) for t, a in self.admission_of(m).items()}}
            save_train_state(ckpt, m.trainer.coll, step, m.state, meta)

    def restore(self) -> int | None:
        """Restore the newest checkpoint (returns its step), or None if there is none."""
        if self.ckpt.latest_step() is None:
            return None
        step, meta = self.ckpt.metadata()
        want = self._meta()
        problems = [f"{k}: checkpoint {meta.get(k)!r}, this run {want[k]!r}"
                    for k in ("run", "online", "members") + (("stream",) if self.parquet else ())
                    if meta.get(k) != want[k]]
        if problems:
            raise ResumeMismatch(f"cannot resume {self.workdir} at step {step}: "
                                 + "; ".join(problems) + ". Use the checkpoint's settings or "
                                 "a new workdir")
        held = meta["held"]
        step, tree, meta = self.ckpt.restore(self._targets(held), step,
                                             resizable=tuple(f"{n}/tables" for n in held))
        for n in held:
            m = self.members[n]
            m.state = {**tree[n], "tables": m.trainer.coll.from_logical_arrays(tree[n]["tables"])}
        for n, tables in meta["admission"].items():
            self.members[n].admission = {t: FrequencyAdmission.from_state(s)
                                         for t, s in tables.items()}
        self.window = int(meta["window"])
        self.write_member_runs()
        return step

    def close(self) -> None:
        self.ckpt.close()
        for ckpt in self.member_ckpts.values():
            ckpt.close()


def _read_rows(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def summary_table(rows: list[dict], members: list[str]) -> str:
    """The per-window table: window, Bayes NE, NE of each member, new ids, hashed lookups."""
    tables = sorted({k[:-len("_new_ids")] for r in rows for k in r if k.endswith("_new_ids")})
    head = ["window", "bayes"] + members + [f"{t} new/hashed/admitted" for t in tables]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    fmt = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
    for r in rows:
        cells = [str(r["window"]), fmt(r.get("bayes_ne"))] + [fmt(r.get(f"ne_{m}")) for m in members]
        cells += [f"{r[f'{t}_new_ids']}/{r[f'{t}_hashed']}/{r[f'{t}_admitted']}" for t in tables]
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def run_online(cfg: Config, workdir: str, spec: OnlineSpec, *, log: Callable[[str], None] = print,
               mesh=None) -> dict:
    """Run (or resume) the online run of the module docstring; returns the summary
    (also WORKDIR/summary.json): per-window rows, each member's state digest (sha256),
    and whether the fresh teacher beat the frozen one on every window after the
    first drifted one."""
    os.makedirs(workdir, exist_ok=True)
    with lock_workdir(workdir), StopSignals() as stop:
        run = OnlineRun(cfg, workdir, spec, log, mesh)
        try:
            return _run(run, stop)
        finally:
            run.close()


def _run(run: OnlineRun, stop: StopSignals) -> dict:
    cfg, spec, workdir, log = run.cfg, run.spec, run.workdir, run.log
    started = time.perf_counter()
    metrics_path = os.path.join(workdir, "metrics.jsonl")
    start = run.restore()
    if start is None:
        if os.path.exists(metrics_path):
            os.remove(metrics_path)
        shutil.rmtree(os.path.join(workdir, MEMBERS_DIR), ignore_errors=True)
        start = 0
    else:
        log(f"[online] resumed at window {run.window} (step {start})")
        kept = [r for r in _read_rows(metrics_path) if r["step"] <= start]
        with open(metrics_path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
    runlog = tracking.RunLog(workdir, start_step=start, tensorboard=False, log=log)
    windows = run.num_windows
    if run.parquet:
        log(f"[online] config={cfg.name} windows={windows} of {cfg.data.window_seconds:g} s of "
            f"{cfg.data.time_column!r} in {cfg.data.train_path} ({run.stream.source.num_rows} rows), "
            f"batch {cfg.data.batch_size}, admission min_count={spec.min_count} "
            f"buckets={spec.buckets} tables {list(spec.admit_tables)}, members {sorted(run.members)}")
    else:
        log(f"[online] config={cfg.name} windows={spec.windows} x {cfg.data.drift.every} steps, "
            f"batch {cfg.data.batch_size}, drift_strength={cfg.data.drift.strength}, "
            f"new_id_rate={cfg.data.drift.new_id_rate}, admission min_count={spec.min_count} "
            f"buckets={spec.buckets}, members {sorted(run.members)}")
    for w in range(run.window, windows):
        row = run.run_window(w)
        runlog.append(row)
        saved = run.window >= spec.warmup_windows
        if saved:
            run.save()
        nes = " ".join(f"{n} {row[f'ne_{n}']:.4f}" for n in run.members if row[f"ne_{n}"] is not None)
        tail = (f"{row['rows']} rows" if run.parquet else f"Bayes {row['bayes_ne']:.4f}")
        log(f"[online] window {w}: NE {nes} ({tail})"
            + (f"; checkpoint step {row['step']}" if saved else ""))
        if stop.signum is not None and w + 1 < windows:
            runlog.close()
            raise Interrupted(stop.signum, row["step"],
                              f"stopped by {stop.name()} after window {w}"
                              + (f": checkpoint step {row['step']} saved; rerun to resume"
                                 if saved else " (before the warm-up ended: nothing saved)"))
    runlog.close()
    rows = _read_rows(metrics_path)
    members = sorted(run.members, key=lambda n: (n not in ("fresh", "frozen"), n))
    table = summary_table(rows, members)
    log(table)
    after = [r for r in rows if r["window"] > spec.warmup_windows]   # past the first drift after freezing
    summary = {"windows": windows,
               "steps_per_window": None if run.parquet else cfg.data.drift.every,
               "rows": rows, "table": table,
               "fresh_ahead_after_drift": bool(after) and all(r["ne_fresh"] < r["ne_frozen"]
                                                              for r in after),
               "digests": {n: state_digest(m.state, m.trainer) for n, m in run.members.items()
                           if m.state is not None},
               "admission": {t: a.totals for t, a in run.members["fresh"].admission.items()},
               "wall_time_s": time.perf_counter() - started}
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary
