"""Export a trained model's forward for serving with `jax.export`, and load it back.

    export_model("runs/tiny")                     # -> runs/tiny/export/
    model = load_exported("runs/tiny/export")     # any fresh process: jax + numpy
    probs = model(batch)                          # numpy float32 [B, K]

The exported function is one device's pure forward (no mesh, no shard_map):

    forward(params {path: array}, tables {table: weights [V, D]}, batch {path: array})
        -> sigmoid probabilities [B, K] float32

params are the dense parameters (state["params"] flattened by key path, e.g.
"wukong/layers/0/..."), tables every embedding table's weights in logical row
order (row i = id i, V = the table's vocab; gathered from any mesh with
`EmbeddingCollection.logical_arrays`, as the checkpoints store them), batch the
leaves of a one-device `Batch` by path ("dense", "sparse/user",
"sequences/clicks/values/item", "sequences/clicks/offsets", ...). Inside, each
feature's ids are bounded as its table's `bounds` says (clamped, or taken modulo
the vocab for "hash"), their rows gathered (zero rows on padding tokens, as the
trainer's lookup gives) and the run's model applied. The parameters and tables
are arguments, not constants baked into the program: the embedding tables are
most of a model's bytes (1.41B parameters in the h200 preset), far past what a
StableHLO module holds comfortably (protobuf's 2 GiB), and as arguments a server
keeps them in its own memory and can swap a newer checkpoint's in without a
new export. Shapes are static: those of the example batch (default: the run's
first eval batch on one shard, [data.batch_size] samples, sequence capacity
`SyntheticStream.sequence_capacity(1)`); serve other shapes by exporting again
with `batch=`.

Files under the export directory:
    model.jax_exported   jax.export serialization (StableHLO + calling convention):
                         what load_exported reads
    model.stablehlo      the same StableHLO module as MLIR bytecode, for other runtimes
    params.npz           the dense parameters by path
    tables.npz           the embedding tables' weights, logical row order
    manifest.json        format, checkpoint step, platforms, input / output shapes and
                         dtypes, features (table, vocab, bounds, input path, mask path),
                         the run's config
    checksums.sha256     sha256 of each file above (`sha256sum -c` format), checked by
                         load_exported before it reads anything (ExportDamaged names a
                         missing, altered or unexpected file, or no checksums file)

The files are written and flushed into a temporary directory beside the target
(.NAME.tmp-PID) and put in place by one rename; an earlier export there is swapped
out whole (renameat2 RENAME_EXCHANGE; where the filesystem lacks it, two renames, with
the earlier export kept as .NAME.old-PID between them) and then deleted. So a process
killed mid-export leaves the earlier export, whole, or none; the temporary
directories of killed exports are deleted by the next export to the same target.

The program is lowered for `platforms` (default: the current backend). The attention
ops pick their implementation from the exporting process's backend
(kernels.common.default_impl): exported on a GPU they are Pallas kernels (custom
calls); a CPU process can export for ("cpu", "cuda") with the plain-jnp references in
both lowerings (the tests run the cpu one).
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import glob
import json
import os
import shutil
import time
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from gemjax import checksums
from gemjax.config import Config, config_from_dict
from gemjax.data.batch import Batch

FORMAT = "gemjax.export/1"


class ExportDamaged(OSError):
    """An export directory whose files do not match its checksums.sha256 (or lack it)."""


FILES = {"exported": "model.jax_exported", "stablehlo": "model.stablehlo", "params": "params.npz",
         "tables": "tables.npz", "manifest": "manifest.json"}


def _entry(e) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(e, attr):
            return str(getattr(e, attr))
    return str(e)


def flatten_by_path(tree) -> dict[str, Any]:
    """{"a/b/0": leaf} of a pytree (dict keys, dataclass fields, sequence indices)."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = "/".join(_entry(e) for e in path)
        if name in out:
            raise ValueError(f"two leaves share the path {name!r}")
        out[name] = leaf
    return out


def _unflatten(like, flat: Mapping[str, Any]):
    paths = list(flatten_by_path(like))
    return jax.tree.unflatten(jax.tree.structure(like), [flat[p] for p in paths])


def feature_inputs(cfg: Config) -> dict[str, dict]:
    """{feature: {table, vocab, bounds, input (batch path), mask (path of the sequence's
    segment_ids, real tokens where < B; None for plain features)}} of the run's tables."""
    from gemjax.train.optim import table_specs

    out = {}
    for spec in table_specs(cfg):
        if spec.pooling is not None:
            raise NotImplementedError(f"table {spec.name!r}: export handles unpooled tables only")
        for f in spec.features:
            seq, _, field = f.partition(".")
            out[f] = {"table": spec.name, "vocab": spec.vocab, "bounds": spec.bounds,
                      "input": f"sequences/{seq}/values/{field}" if field else f"sparse/{f}",
                      "mask": f"sequences/{seq}/segment_ids" if field else None}
    return out


def serving_forward(cfg: Config, graphdef, params_like, batch_like: Batch) -> Callable:
    """forward(params {path: array}, tables {table: [V, D]}, batch {path: array}) -> [B, K]
    probabilities: the model of `graphdef` (Trainer.graphdef) on one device.

    params_like / batch_like: pytrees with the structure of the params (state["params"])
    and of the batch, to rebuild them from their paths.
    """
    from flax import nnx

    feats = feature_inputs(cfg)

    def forward(params, tables, flat_batch):
        batch = _unflatten(batch_like, flat_batch)
        acts = lookup_features(feats, tables, flat_batch, batch.labels.shape[0])
        model = nnx.merge(graphdef, _unflatten(params_like, params))
        return jax.nn.sigmoid(model(acts, batch))

    return forward


def lookup_features(feats: dict[str, dict], tables: Mapping[str, Any], flat_batch: Mapping[str, Any],
                    b: int) -> dict[str, jax.Array]:
    """{feature: rows [B, D] or [T, D]}: each feature of `feats` (feature_inputs' form) looked
    up in tables[its table] from flat_batch[its input] (B samples), ids bounded as its
    table says, padding tokens' rows zero (as the trainer's lookup)."""
    acts = {}
    for f, fi in feats.items():
        raw = flat_batch[fi["input"]].astype(jnp.int32)
        ids = jnp.mod(raw, fi["vocab"]) if fi["bounds"] == "hash" else jnp.clip(raw, 0, fi["vocab"] - 1)
        rows = jnp.take(tables[fi["table"]], ids, axis=0)
        if fi["mask"] is not None:        # padding tokens: zero rows, as the trainer's lookup
            real = flat_batch[fi["mask"]] < b
            rows = jnp.where(real[:, None], rows, jnp.zeros((), rows.dtype))
        acts[f] = rows
    return acts


def host_tables(coll, state_tables: dict) -> dict[str, np.ndarray]:
    """{table: weights [V, D]} in logical row order on the host, from the tables of a
    train state on any mesh and plan (coll: their EmbeddingCollection)."""
    logical = coll.logical_arrays(state_tables)
    return {n: np.asarray(jax.device_get(logical[n]["weights"]))[:s.vocab] for n, s in coll.specs.items()}


def _spec(a: np.ndarray) -> dict:
    return {"shape": list(a.shape), "dtype": str(a.dtype)}


def export_model(workdir: str, out: str | None = None, step: int | str | None = None, *,
                 batch: Batch | None = None, mesh=None, trainer_kw: dict | None = None,
                 platforms: tuple[str, ...] | None = None,
                 log: Callable[[str], None] = print, extend: Callable | None = None) -> str:
    """Export checkpoint `step` of the run in `workdir` to `out` (default WORKDIR/export);
    returns `out`. step: default the best one (WORKDIR/best) when the run selected one, else
    the newest; "best", "newest" or a step number (gemjax.serve.restore.pick_checkpoint).

    batch: an example one-device Batch fixing the input shapes (default: the run's
    first eval batch on one shard). mesh / trainer_kw: where and how to restore
    (load_for_inference; default one device); the tables are gathered to the host in
    logical row order from any mesh and table plan. An existing `out` is replaced
    whole, so it must be an earlier export or empty (else FileExistsError).
    extend: (predictor, params tree, batch, flat_params, tables) -> (forward, flat_params,
    tables, extra features, extra manifest) replaces the forward and its arguments (a
    student reading its teacher's features: gemjax.distill.runs.export_student); without
    it, a model reading teacher features (model.student.teacher_repr_dim) is refused.
    Single-process only.
    """
    if jax.process_count() > 1:
        raise ValueError("export_model runs in one process (it gathers every table to the host)")
    from gemjax.data.source import make_source
    from gemjax.serve.inference import load_for_inference

    out = os.path.abspath(out or os.path.join(workdir, "export"))
    if os.path.lexists(out):            # replaced whole: only an earlier export (or nothing)
        other = (sorted(set(os.listdir(out)) - set(FILES.values()) - {checksums.FILE})
                 if os.path.isdir(out) and not os.path.islink(out) else [os.path.basename(out)])
        if other:
            raise FileExistsError(f"{out} is not an earlier export (it holds {other[:5]}): an "
                                  f"export replaces its whole directory, so give another out")
    pred = load_for_inference(workdir, step, mesh, trainer_kw=trainer_kw,
                              teacher_features=extend is not None)
    cfg, coll = pred.cfg, pred.trainer.coll
    if batch is None:
        batch, _ = make_source(cfg, "eval").shard_batch(0, 0, 1)
    batch = jax.tree.map(np.asarray, batch)
    params = jax.tree.map(np.asarray, jax.device_get(pred.state["params"]))
    tables = host_tables(coll, pred.state["tables"])
    flat_params, flat_batch = flatten_by_path(params), flatten_by_path(batch)
    forward = serving_forward(cfg, pred.trainer.graphdef, params, batch)
    extra_features, extra_manifest = {}, {}
    if extend is not None:
        forward, flat_params, tables, extra_features, extra_manifest = extend(
            pred, params, batch, flat_params, tables)
    specs = [jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), t)
             for t in (flat_params, tables, flat_batch)]
    exp = jax.export.export(jax.jit(forward), platforms=platforms)(*specs)
    manifest = {
        "format": FORMAT, "workdir": os.path.abspath(workdir), "step": pred.step,
        "checkpoint_dir": pred.directory,
        "platforms": list(exp.platforms), "jax_version": jax.__version__,
        "inputs": {"params": {k: _spec(v) for k, v in flat_params.items()},
                   "tables": {k: _spec(v) for k, v in tables.items()},
                   "batch": {k: _spec(v) for k, v in flat_batch.items()}},
        "output": {"shape": [int(d) for d in exp.out_avals[0].shape], "dtype": str(exp.out_avals[0].dtype),
                   "what": "sigmoid probabilities [B, K]: K = data.synthetic.num_tasks, each sample's own surface"},
        "features": {**feature_inputs(cfg), **extra_features},
        "config": dataclasses.asdict(cfg), **extra_manifest,
    }
    writers = {
        "exported": lambda f: f.write(exp.serialize()),
        "stablehlo": lambda f: f.write(exp.mlir_module_serialized),
        "params": lambda f: np.savez(f, **flat_params),
        "tables": lambda f: np.savez(f, **tables),
        "manifest": lambda f: f.write(json.dumps(manifest, indent=1).encode()),
    }
    _write_whole(out, writers)
    log(f"[gemjax] exported checkpoint step {pred.step} ({pred.directory}) -> {out} "
        f"(batch {manifest['output']['shape'][0]}, platforms {manifest['platforms']})")
    return out


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: str, b: str) -> bool:
    """Swap directories a and b in one step (Linux renameat2 RENAME_EXCHANGE); False
    where the C library or the filesystem lacks it."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, f"cannot swap {a} into {b}: {os.strerror(err)}")


def _siblings(out: str, kind: str) -> list[str]:
    """Leftover temporary (kind "tmp") or replaced ("old") directories of exports to `out`."""
    parent, base = os.path.split(out)
    return glob.glob(os.path.join(glob.escape(parent), f".{glob.escape(base)}.{kind}-*"))


def _pid_alive(path: str) -> bool:
    try:
        pid = int(path.rsplit("-", 1)[1])
        os.kill(pid, 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def _write_whole(out: str, writers: Mapping[str, Callable]) -> None:
    """Write FILES (writers[key](binary file)) and their checksums into a temporary
    directory beside `out`, flushed to disk, then put it at `out` in one rename (an
    earlier export there is swapped out whole, then deleted). A process killed on
    the way leaves `out` as it was: the earlier export or none."""
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    for stale in _siblings(out, "tmp"):          # of killed exports (a live one's is kept)
        if not _pid_alive(stale):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = os.path.join(parent, f".{os.path.basename(out)}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        for key, write in writers.items():
            with open(os.path.join(tmp, FILES[key]), "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
        checksums.write(tmp, fsync=True)
        _fsync_dir(tmp)
        if os.environ.get("GEMJAX_TEST_PAUSE") == "export:swap":   # test hook: kill -9 here
            print(f"[gemjax] test pause at export swap {tmp}", flush=True)
            time.sleep(120)
        if not os.path.lexists(out):
            os.rename(tmp, out)
        elif _exchange(tmp, out):                # tmp now holds the earlier export
            shutil.rmtree(tmp)
        else:                                    # no atomic swap here: out is absent for a moment
            old = os.path.join(parent, f".{os.path.basename(out)}.old-{os.getpid()}")
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old)
        _fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for stale in _siblings(out, "old"):
        if not _pid_alive(stale):
            shutil.rmtree(stale, ignore_errors=True)


class ExportedModel:
    """A loaded export: model(batch) -> probabilities [B, K] (numpy).

    Attributes: manifest (dict), config (the run's Config), exported
    (jax.export.Exported), params {path: array}, tables {table: [V, D]}.
    `call(params, tables, batch)` runs it on other parameters or tables of the
    same shapes (e.g. a newer checkpoint's).
    """

    def __init__(self, path: str, verify: bool = True):
        self.path = path
        files = {k: os.path.join(path, v) for k, v in FILES.items()}
        missing = [p for k, p in files.items() if k != "stablehlo" and not os.path.isfile(p)]
        if missing:
            moved = _siblings(os.path.abspath(path), "old") if not os.path.isdir(path) else []
            raise FileNotFoundError(
                f"{path}: not a gemjax export, missing {missing}"
                + (f" (an export replacing it was interrupted; the earlier one is {moved[0]})"
                   if moved else ""))
        if verify:
            problem = checksums.check(path)
            if problem == checksums.NO_SUMS:
                raise ExportDamaged(f"{os.path.join(path, checksums.FILE)}: no such file, so the "
                                    f"export's files cannot be checked: export again (or "
                                    f"load_exported(path, verify=False) to trust them)")
            if problem is not None:
                raise ExportDamaged(f"export {path} is damaged: {problem} "
                                    f"({checksums.FILE}); export again")
        with open(files["manifest"]) as f:
            self.manifest = json.load(f)
        if self.manifest.get("format") != FORMAT:
            raise ValueError(f"{files['manifest']}: format {self.manifest.get('format')!r}, "
                             f"this loader reads {FORMAT!r}")
        self.config = config_from_dict(self.manifest["config"])
        with open(files["exported"], "rb") as f:
            self.exported = jax.export.deserialize(bytearray(f.read()))
        with np.load(files["params"]) as z:
            self.params = {k: z[k] for k in z.files}
        with np.load(files["tables"]) as z:
            self.tables = {k: z[k] for k in z.files}

    def _check(self, group: str, given: Mapping[str, Any]) -> dict[str, np.ndarray]:
        want = self.manifest["inputs"][group]
        missing, extra = sorted(set(want) - set(given)), sorted(set(given) - set(want))
        if missing or extra:
            raise ValueError(f"exported model {self.path}: {group} inputs differ from the export: "
                             f"missing {missing}, unexpected {extra}")
        out = {}
        for k, spec in want.items():
            a = np.asarray(given[k])
            if list(a.shape) != spec["shape"] or str(a.dtype) != spec["dtype"]:
                raise ValueError(f"exported model {self.path}: {group} input {k!r} is "
                                 f"{a.dtype}{list(a.shape)}, "
                                 f"the export takes {spec['dtype']}{spec['shape']}")
            out[k] = a
        return out

    def _check_ids(self, batch: Mapping[str, np.ndarray]) -> None:
        b = self.manifest["output"]["shape"][0]
        for f, fi in self.manifest["features"].items():
            if fi["bounds"] != "strict":
                continue
            ids = batch[fi["input"]]
            if fi["mask"] is not None:
                ids = ids[batch[fi["mask"]] < b]
            bad = ids[(ids < 0) | (ids >= fi["vocab"])]
            if bad.size:
                raise ValueError(f"exported model {self.path}: feature {f!r} ({fi['input']}): {bad.size} ids "
                                 f"outside [0, {fi['vocab']}) of table {fi['table']!r} "
                                 f"(e.g. {bad[:3].tolist()})")

    def call(self, params: Mapping[str, Any], tables: Mapping[str, Any], batch) -> np.ndarray:
        """Probabilities [B, K] for `batch` (a Batch, or {path: array}) under the given
        params and tables; every input is checked against the manifest first."""
        flat = flatten_by_path(batch) if isinstance(batch, Batch) else dict(batch)
        flat = self._check("batch", flat)
        self._check_ids(flat)
        args = (self._check("params", params), self._check("tables", tables), flat)
        return np.asarray(self.exported.call(*args))

    def __call__(self, batch) -> np.ndarray:
        return self.call(self.params, self.tables, batch)


def load_exported(path: str, verify: bool = True) -> ExportedModel:
    """The export in directory `path` (export_model's output), ready to run.

    verify: check every file against the export's checksums.sha256 first; a missing,
    altered or unexpected file, or no checksums file, is ExportDamaged naming it."""
    return ExportedModel(path, verify)
