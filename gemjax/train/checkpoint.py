"""Orbax checkpoints of the whole train state: async, keep-N, crash-safe, reshardable.

    ckpt = Checkpointer(directory, keep=3, async_save=True)
    ckpt.save(step, state, meta)          # returns once arrays are on the host; the
                                          # write continues in the background
    ckpt.latest_step() -> int | None      # newest finished checkpoint
    ckpt.verify(step) -> str | None       # what is damaged in a step (checksums), or None
    ckpt.check(step) -> str | None        # verify, refusing a step without checksums unless trusted
    step, x = newest_intact(ckpt, read)   # read(step) of the newest step that checks and reads
    step, state, meta = ckpt.restore(target)    # newest (or step=..., resizable=...)
    step, meta = ckpt.metadata()                # meta alone, no arrays read
    ckpt.wait(); ckpt.close()             # or `with Checkpointer(...) as ckpt:`

What a state may hold: any pytree (nested dicts, lists, tuples, optax namedtuple
states, NNX `State`, registered dataclasses) whose leaves are jax arrays (sharded
over any mesh, or on one device), typed PRNG key arrays (`jax.random.key`),
numpy arrays and python scalars. `meta` is a JSON-serialisable dict (data
position, config name, ...).

How it is stored: the state is flattened by key path into a nested dict whose
keys are the path entries (dict keys, attribute names, sequence indices),
percent-encoded so that "." and "/" in feature names stay unambiguous; orbax
writes that with `StandardSave`. Typed PRNG keys are stored as their raw
`jax.random.key_data` (uint32 [..., 2] for threefry) and re-wrapped on restore
with the implementation of the key in the restore target, so callers may keep
typed keys in the state. A JSON `layout` item records every leaf's path, kind,
shape and dtype.

Restoring: `target` is a pytree of the same structure whose leaves are
`jax.ShapeDtypeStruct` with `.sharding` (from `jax.eval_shape` plus shardings),
concrete arrays (their shape, dtype and sharding are used), numpy arrays or
python scalars. Arrays are restored directly onto the target shardings, so a
checkpoint written on one mesh restores onto any other mesh (e.g. 8 devices
to 4); leaves under `resizable` paths may also differ in their leading
dimension (zero padded or truncated), as embedding tables saved in logical row
order need (`restore_train_state`). The target's structure (the pytree containers,
e.g. optax namedtuples) is what comes back. A missing or unexpected leaf, or a shape or kind mismatch,
raises ValueError listing the offending paths before anything is read.

Crash safety: orbax writes each step into a temporary directory and renames it
into place only when complete, so a process killed mid-save leaves the previous
step as the latest; leftover temporary directories are deleted when the next
Checkpointer opens the directory. Saving a step that is not newer than the
latest saved step is skipped (`save` returns False), as in orbax.

Checksums: once every process has written its part of a step and before orbax
commits it (orbax's post-finalization callback, on the primary process, in the
background save thread), the sha256 of every file of the step directory goes
into STEP/checksums.sha256 (`sha256sum -c` format). So every committed step
carries its checksums, except the two files orbax writes at the commit itself
(STEP/_CHECKPOINT_METADATA, STEP/commit_success.txt), which `restore` needs
no data from. `verify(step)` names a missing, truncated, altered or unexpected
file, an empty step directory or a missing checksum file; `restore` verifies
first and raises CheckpointDamaged. A step without checksums.sha256 is reported
by `verify` as "unverified" and refused by `check` and `restore` unless the
Checkpointer trusts such steps (trust_unverified=True, the run's
train.trust_unverified_checkpoints): then only a failing read shows its damage.
`newest_intact(ckpt, read)` is the read-only fallback every reader of a checkpoint
directory uses: the newest step that checks and reads, naming each newer step it
skips, listing again when a step vanishes under a running training's rotation.
`set_aside(step)` moves a
damaged step out of the directory (to DIRECTORY-damaged/), so it is neither
the latest step nor counted by the keep-N rotation.

Test hook: GEMJAX_TEST_PAUSE=commit:STEP holds the save thread of STEP for 120 s
after every file is written and before its checksums and commit, printing
"[gemjax] test pause at commit STEP", so a test can kill a process mid-save.

The train state (gemjax.train.step): `save_train_state` / `restore_train_state` save
it with its embedding tables in logical row order (`EmbeddingCollection.logical_arrays`)
and restore it onto any mesh and table plan; `state_step` reads its step counter.

Donation: `save` copies device arrays to host memory before it returns, so the
caller may donate or delete the state buffers right after.
"""

from __future__ import annotations

import dataclasses
import errno
import glob
import json
import logging
import os
import shutil
import time
import urllib.parse
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp

from gemjax import checksums

LAYOUT_VERSION = 1
CHECKSUM_FILE = checksums.FILE
UNVERIFIED = checksums.NO_SUMS
# written by orbax when it commits a step, after the checksums; restore reads no data from them
_COMMIT_FILES = ("_CHECKPOINT_METADATA", "commit_success.txt")
# Orbax splits the device-to-host copy of a replicated array over its replicas, each slice a
# program compiled once per array shape and process (a tiny model on 8 CPU devices: 160
# slice programs, about 7 s of compiling for its first save). Below this many bytes per
# replica the array is copied whole from one replica: splitting it saves no time. The saved
# files are the same either way.
REPLICA_PARALLEL_MIN_BYTES = 1 << 20


def _register_array_handler() -> None:
    """Orbax's jax.Array handler with REPLICA_PARALLEL_MIN_BYTES, in its global registry
    (orbax's StandardSave reads no other); orbax's warning that it replaces its default
    handler is held back."""
    absl_log = logging.getLogger("absl")
    level = absl_log.level
    absl_log.setLevel(logging.ERROR)
    try:
        ocp.type_handlers.register_type_handler(
            jax.Array, ocp.type_handlers.ArrayHandler(
                min_slice_bytes_for_replica_parallel=REPLICA_PARALLEL_MIN_BYTES), override=True)
    finally:
        absl_log.setLevel(level)


_register_array_handler()



def join_background_threads(timeout_s: float = 60.0) -> None:
    """Wait (up to timeout_s each) for the process's other non-daemon threads, such as
    Orbax's background metadata and commit writes, before a command exits on a signal.

    Python 3.12 refuses to start threads once interpreter shutdown has begun, so an Orbax
    write still running at sys.exit would end in a RuntimeError traceback instead of
    finishing; joined here, while the interpreter still runs, it finishes normally."""
    import threading
    for t in threading.enumerate():
        if t is not threading.current_thread() and not t.daemon and t.is_alive():
            t.join(timeout_s)


class CheckpointDamaged(OSError):
    """A checkpoint step whose files do not match its checksums (or cannot be read)."""


class CheckpointMismatch(ValueError):
    """A restore target (or run) that does not fit a readable checkpoint."""


class CheckpointWriteFailed(OSError):
    """A save the filesystem refused (disk full, read-only or not writable); errno set.
    Its message is one line: the step, the path, the reason and the steps kept."""


# errno -> the text orbax / tensorstore errors carry for it
DISK_ERRORS = {errno.ENOSPC: "No space left on device", errno.EROFS: "Read-only file system",
               errno.EACCES: "Permission denied", errno.EDQUOT: "Disk quota exceeded"}


def disk_error(e: BaseException | None) -> int | None:
    """The errno of DISK_ERRORS behind `e` (an OSError, or orbax's / tensorstore's
    errors naming it in their text, or any of their causes), else None."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in DISK_ERRORS:
            return e.errno
        text = str(e)
        for code, words in DISK_ERRORS.items():
            if words in text or f"os_error_code='{code}'" in text:
                return code
        e = e.__cause__ or e.__context__
    return None


class _QuietDiskErrors(logging.Filter):
    """Drops orbax's logged tracebacks of a write the filesystem refused (one per
    background thread), and of its writer threads that were still writing into a
    refused step's temporary directory when Checkpointer deleted it (`gone`: those
    directories; such a thread fails with NOT_FOUND on a path under one).
    Checkpointer raises CheckpointWriteFailed for the refusal instead."""

    def __init__(self):
        super().__init__()
        self.gone: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if "orbax" not in record.pathname or record.levelno < logging.ERROR or exc is None:
            return True
        text = str(exc)
        return not (disk_error(exc) is not None or any(d in text for d in self.gone))


_QUIET = _QuietDiskErrors()


def write_checksums(step_dir: str) -> None:
    """STEP/checksums.sha256: "<sha256>  <path>" for every file but the commit files."""
    checksums.write(step_dir, skip=_COMMIT_FILES)


def verify_step_dir(step_dir: str) -> str | None:
    """What is wrong with a step directory (one line), UNVERIFIED without checksums,
    None when every file matches its checksum and no file is missing or extra."""
    if not os.path.isdir(step_dir):
        return "no step directory"
    if not checksums.files_under(step_dir):
        return "empty step directory"
    return checksums.check(step_dir, skip=_COMMIT_FILES)


def _entry_name(entry) -> str:
    if isinstance(entry, jax.tree_util.DictKey):
        raw = str(entry.key)
    elif isinstance(entry, jax.tree_util.GetAttrKey):
        raw = entry.name
    elif isinstance(entry, jax.tree_util.SequenceKey):
        raw = str(entry.idx)
    elif isinstance(entry, jax.tree_util.FlattenedIndexKey):
        raw = str(entry.key)
    else:
        raw = str(entry)
    return urllib.parse.quote(raw, safe="-_").replace(".", "%2E") or "%"


def _flatten(tree) -> tuple[list[str], list[Any], Any]:
    """Pytree -> (paths "a/b/0", leaves, treedef); paths are unique or ValueError."""
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    paths = ["/".join(_entry_name(e) for e in path) for path, _ in with_path]
    if len(set(paths)) != len(paths):
        dup = sorted({p for p in paths if paths.count(p) > 1})
        raise ValueError(f"state has leaves whose key paths collide after encoding: {dup[:5]}")
    return paths, [leaf for _, leaf in with_path], treedef


def _nest(paths: list[str], leaves: list[Any]) -> dict:
    out: dict = {}
    for path, leaf in zip(paths, leaves):
        *parents, name = path.split("/")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[name] = leaf
    return out


def _unnest(nested: dict, paths: list[str]) -> list[Any]:
    out = []
    for path in paths:
        node = nested
        for p in path.split("/"):
            node = node[p]
        out.append(node)
    return out


def _is_key(x) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _describe(leaf) -> dict:
    """Layout entry of one leaf (saved value or restore target)."""
    if _is_key(leaf):
        impl = leaf.dtype._impl  # PRNGImpl behind the key dtype
        return {"kind": "key", "shape": list(leaf.shape), "dtype": str(leaf.dtype),
                "impl": impl.name}
    if isinstance(leaf, (bool, int, float, complex)):
        return {"kind": "scalar", "shape": [], "dtype": type(leaf).__name__}
    if isinstance(leaf, np.generic):
        return {"kind": "scalar", "shape": [], "dtype": str(leaf.dtype)}
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return {"kind": "array", "shape": list(leaf.shape), "dtype": str(np.dtype(leaf.dtype))}
    raise TypeError(f"unsupported state leaf of type {type(leaf).__name__}: {leaf!r:.80}")


def _key_data_target(leaf):
    """Restore target for the raw data of a typed key target leaf."""
    if isinstance(leaf, jax.Array):
        data = jax.random.key_data(leaf)
        return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=data.sharding)
    data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
    # A NamedSharding spec shorter than the rank leaves the trailing key axis whole.
    return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=getattr(leaf, "sharding", None))


def _array_target(leaf):
    if isinstance(leaf, jax.Array):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
    return leaf


class Checkpointer:
    """Keep-N, optionally async checkpoints of a train-state pytree in `directory`."""

    def __init__(self, directory: str | os.PathLike, keep: int = 3, async_save: bool = True,
                 read_only: bool = False, trust_unverified: bool = False):
        """read_only: restore only (eval, inference, export): no save, and the temporary
        directories of a save in flight in another process are left alone.
        trust_unverified: restore steps that have no checksums.sha256 (their damage then
        shows only if a read fails); by default `check` and `restore` refuse them."""
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.directory = os.path.abspath(os.fspath(directory))
        self.trust_unverified = trust_unverified
        self._async = async_save
        self.read_only = read_only
        self._saving: int | None = None      # the step whose write is in flight
        self._verified: set[int] = set()     # steps verify() found intact
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            # always orbax's async checkpointer (its post-finalization callback writes the
            # checksums); a synchronous save waits for it in `save`
            enable_async_checkpointing=True,
            async_options=ocp.AsyncOptions(post_finalization_callback=self._write_checksums),
            cleanup_tmp_directories=not read_only,
            create=not read_only,
            read_only=read_only,
        )
        self._failed: CheckpointWriteFailed | None = None   # a refused write, reported once
        logging.getLogger("absl").addFilter(_QUIET)        # (once: filters are a set)
        try:
            self._manager = ocp.CheckpointManager(self.directory, options=options)
        except OSError as e:
            if disk_error(e) is None:
                raise
            raise CheckpointWriteFailed(e.errno, f"cannot open the checkpoint directory "
                                                 f"{self.directory}: {DISK_ERRORS[e.errno]}") from None

    def _write_checksums(self) -> None:
        """Checksums of the step being committed (orbax's save thread, primary process,
        after every process finished writing, before the directory is renamed)."""
        step = self._saving
        found = glob.glob(os.path.join(glob.escape(self.directory), f"{step}.orbax-checkpoint-tmp*"))
        found += [p for p in [os.path.join(self.directory, str(step))] if os.path.isdir(p)]
        if len(found) != 1:
            raise RuntimeError(f"checkpoint step {step}: expected one directory to checksum, "
                               f"found {found} in {self.directory}")
        if os.environ.get("GEMJAX_TEST_PAUSE") == f"commit:{step}":   # test hook: see below
            print(f"[gemjax] test pause at commit {step}", flush=True)
            time.sleep(120)
        write_checksums(found[0])

    # -- saving ---------------------------------------------------------------
    def save(self, step: int, state, meta: dict | None = None) -> bool:
        """Start saving `state` and `meta` as `step`; False if skipped (not newer)."""
        if self.read_only:
            raise ValueError(f"Checkpointer({self.directory!r}) is read-only: save refused")
        step = int(step)
        meta = {} if meta is None else meta
        try:
            json.dumps(meta)
        except TypeError as e:
            raise TypeError(f"meta must be JSON-serialisable: {e}") from None
        paths, leaves, _ = _flatten(state)
        if not leaves:
            raise ValueError("state has no leaves to save")
        layout = {"version": LAYOUT_VERSION, "leaves": {}}
        stored = []
        for path, leaf in zip(paths, leaves):
            layout["leaves"][path] = _describe(leaf)
            stored.append(jax.random.key_data(leaf) if _is_key(leaf) else leaf)
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(_nest(paths, stored)),
            meta=ocp.args.JsonSave(meta),
            layout=ocp.args.JsonSave(layout),
        )
        self._finish()   # the previous write (orbax waits here too)
        self._saving = step
        try:
            started = bool(self._manager.save(step, args=args))
        except Exception as e:
            self._refused(e)
            raise
        if not self._async:
            self._finish()
        return started

    def wait(self) -> None:
        """Block until every started save is on disk (CheckpointWriteFailed: one the
        filesystem refused)."""
        self._finish()

    def _finish(self) -> None:
        if self._failed is not None:
            raise self._failed
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            self._refused(e)
            raise

    def _refused(self, e: Exception) -> None:
        """Raise CheckpointWriteFailed (one line) for a write the filesystem refused,
        after deleting the step's partial temporary directory (the space it holds)."""
        code = disk_error(e)
        if code is None:
            return
        step = self._saving
        pattern = os.path.join(glob.escape(self.directory), f"{step}.orbax-checkpoint-tmp*")
        deadline = time.monotonic() + 5.0   # orbax's other writer threads may still be failing
        while glob.glob(pattern):
            for tmp in glob.glob(pattern):
                _QUIET.gone.add(tmp)
                shutil.rmtree(tmp, ignore_errors=True)
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        try:
            kept = sorted(int(n) for n in os.listdir(self.directory) if n.isdigit())
        except OSError:
            kept = []
        self._failed = CheckpointWriteFailed(
            code, f"checkpoint step {step} was not written to {self.directory}: "
                  f"{DISK_ERRORS[code]} (errno {errno.errorcode[code]}); its partial files are "
                  f"deleted; kept: " + (f"checkpoint steps {kept}, the newest resumes"
                                        if kept else "no finished checkpoint"))
        raise self._failed from None

    # -- restoring ------------------------------------------------------------
    def latest_step(self) -> int | None:
        """The newest step on disk, after the saves in flight finish."""
        self._finish()
        self._manager.reload()
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Every step on disk, saves still in flight included (it waits for them first;
        CheckpointWriteFailed if one was refused)."""
        self._finish()
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def verify(self, step: int) -> str | None:
        """None if every file of `step` matches its checksum; else what is wrong (one
        line), or UNVERIFIED for a step written without checksums. Reads every file."""
        problem = verify_step_dir(os.path.join(self.directory, str(int(step))))
        if problem is None:
            self._verified.add(int(step))
        return problem

    def check(self, step: int, log: Callable[[str], None] | None = None) -> str | None:
        """`verify` under this Checkpointer's trust: None for an intact step, or for a step
        without checksums when trust_unverified (logged); else what is wrong (one line)."""
        problem = self.verify(step)
        if problem != UNVERIFIED:
            return problem
        where = os.path.join(self.directory, str(int(step)), CHECKSUM_FILE)
        if not self.trust_unverified:
            return (f"{where} is missing, so its files cannot be verified (not trusted; "
                    f"train.trust_unverified_checkpoints=true accepts such a step)")
        if log is not None:
            log(f"[gemjax] checkpoint step {step}: {where} is missing; trusted "
                f"(train.trust_unverified_checkpoints) if it reads")
        return None

    def set_aside(self, step: int) -> str:
        """Move a damaged `step` to DIRECTORY-damaged/STEP[.n] (returned); the step is
        then no longer listed. Call on one process (a shared directory)."""
        dest_dir = self.directory + "-damaged"
        os.makedirs(dest_dir, exist_ok=True)
        dest, n = os.path.join(dest_dir, str(step)), 0
        while os.path.exists(dest):
            n += 1
            dest = os.path.join(dest_dir, f"{step}.{n}")
        shutil.move(os.path.join(self.directory, str(step)), dest)
        self._verified.discard(int(step))
        self._manager.reload()
        return dest

    def _resolve_step(self, step: int | None) -> int:
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"no finished checkpoint in {self.directory}")
        elif int(step) not in self.all_steps():
            raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory} "
                                    f"(have {self.all_steps()})")
        return int(step)

    def metadata(self, step: int | None = None) -> tuple[int, dict]:
        """(step, meta) of `step` (default: latest) without reading any array."""
        step = self._resolve_step(step)
        return step, self._manager.restore(
            step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def restore(self, target, step: int | None = None, *, resizable: tuple[str, ...] = ()):
        """(step, state, meta) of `step` (default: latest), laid out like `target`.

        resizable: key-path prefixes (e.g. ("tables",)) of array leaves whose leading
        dimension may differ from the saved one: rows past the saved length come back
        zero, saved rows past the target length are dropped (row-padded arrays such
        as logical-order embedding tables restored onto another mesh). Every other
        dimension must still match.
        """
        step = self._resolve_step(step)
        if step not in self._verified:
            problem = self.check(step)
            if problem is not None:
                raise CheckpointDamaged(f"checkpoint step {step} in {self.directory} is damaged: "
                                        f"{problem}")
        layout = self._manager.restore(
            step, args=ocp.args.Composite(layout=ocp.args.JsonRestore()))["layout"]
        saved = layout["leaves"]
        paths, leaves, treedef = _flatten(target)
        resized = self._check_target(step, saved, paths, leaves, tuple(resizable))

        abstract = [_key_data_target(x) if _is_key(x) else _array_target(x) for x in leaves]
        restored = self._manager.restore(step, args=ocp.args.Composite(
            # strict=False lets orbax pad / truncate; _check_target allowed that only
            # on the leading dim of resizable leaves
            state=ocp.args.StandardRestore(_nest(paths, abstract), strict=not resized),
            meta=ocp.args.JsonRestore(),
        ))
        values = _unnest(restored["state"], paths)
        out = []
        for leaf, value in zip(leaves, values):
            if _is_key(leaf):
                value = jax.random.wrap_key_data(value, impl=leaf.dtype._impl)
            elif isinstance(leaf, (bool, int, float)) and not isinstance(leaf, np.generic):
                value = type(leaf)(value)
            out.append(value)
        return step, jax.tree_util.tree_unflatten(treedef, out), restored["meta"]

    def _check_target(self, step: int, saved: dict, paths: list[str], leaves: list[Any],
                      resizable: tuple[str, ...] = ()) -> bool:
        """Raise on any mismatch; True if a resizable leaf's leading dim differs."""
        wanted = dict(zip(paths, leaves))
        resized = False
        missing = sorted(set(wanted) - set(saved))
        unexpected = sorted(set(saved) - set(wanted))
        problems = []
        if missing:
            problems.append(f"{len(missing)} leaves in the target are not in the checkpoint: "
                            f"{missing[:8]}")
        if unexpected:
            problems.append(f"{len(unexpected)} leaves in the checkpoint are not in the target: "
                            f"{unexpected[:8]}")
        for path in sorted(set(wanted) & set(saved)):
            want, have = _describe(wanted[path]), saved[path]
            if want["kind"] != have["kind"] and {want["kind"], have["kind"]} != {"scalar", "array"}:
                problems.append(f"{path}: checkpoint holds a {have['kind']}, target a {want['kind']}")
            elif (want["kind"] == have["kind"] == "array" and want["shape"] != have["shape"]
                  and any(path == r or path.startswith(r + "/") for r in resizable)
                  and len(want["shape"]) == len(have["shape"]) >= 1
                  and want["shape"][1:] == have["shape"][1:]):
                resized = True
            elif want["kind"] != "scalar" and have["kind"] != "scalar" and \
                    want["shape"] != have["shape"]:
                problems.append(f"{path}: checkpoint shape {tuple(have['shape'])}, "
                                f"target shape {tuple(want['shape'])}")
            elif want["kind"] == "key" and want["impl"] != have["impl"]:
                problems.append(f"{path}: checkpoint key impl {have['impl']}, "
                                f"target {want['impl']}")
        if problems:
            raise CheckpointMismatch(f"restore target does not match checkpoint step {step} in "
                             f"{self.directory}:\n  " + "\n  ".join(problems))
        return resized

    # -- lifetime -------------------------------------------------------------
    def close(self) -> None:
        """Finish pending saves and release the manager (a refused write is raised
        once: by the save, wait or close that meets it first)."""
        failed = self._failed
        try:
            self._finish()
        except CheckpointWriteFailed as e:
            if e is not failed:
                raise
        finally:
            try:
                self._manager.close()
            except Exception:
                if self._failed is None:
                    raise

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def newest_intact(ckpt: Checkpointer, read: Callable[[int], Any], step: int | None = None, *,
                  log: Callable[[str], None] = print, attempts: int = 5) -> tuple[int, Any]:
    """(step, read(step)) for the newest step of `ckpt` (or the given `step`) that
    `ckpt.check` finds intact and `read` reads; the reader of a checkpoint directory
    (WORKDIR/checkpoints or any other) that does not move anything.

    A newer step failing its checksums, without them (unless ckpt.trust_unverified),
    empty, or unreadable is skipped, logged naming its directory and the problem.
    A step whose directory vanishes while it is checked or read (the keep-N rotation of
    a training saving into the directory) makes the steps be listed again, up to
    `attempts` times. CheckpointMismatch from `read` (the target does not fit)
    propagates. No step at all, or a `step` not there: FileNotFoundError; none intact:
    CheckpointDamaged naming every step and its problem.
    """
    for _ in range(attempts):
        try:
            steps = ckpt.all_steps()
        except FileNotFoundError:         # a step renamed or deleted while orbax listed it
            time.sleep(0.05)
            continue
        if step is not None and int(step) not in steps:
            raise FileNotFoundError(f"no checkpoint for step {step} in {ckpt.directory} "
                                    f"(have {steps})")
        if not steps:
            raise FileNotFoundError(f"no finished checkpoint in {ckpt.directory}")
        skipped, vanished = [], None
        for s in [int(step)] if step is not None else reversed(steps):
            where = os.path.join(ckpt.directory, str(s))
            try:
                problem = ckpt.check(s, log)
                if problem is None:
                    return s, read(s)
            except CheckpointMismatch:
                raise
            except Exception as e:  # noqa: BLE001 - any failing read of a step is damage
                problem = f"unreadable: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
            if not os.path.isdir(where):
                vanished = s
                break
            if step is not None:
                raise CheckpointDamaged(f"checkpoint step {s} in {ckpt.directory} is damaged: "
                                        f"{problem}")
            log(f"[gemjax] checkpoint step {s} skipped ({where}): {problem}")
            skipped.append((s, problem))
        if vanished is None:
            raise CheckpointDamaged(f"no intact checkpoint in {ckpt.directory}: "
                                    + "; ".join(f"step {s}: {p}" for s, p in skipped))
        if step is not None:
            raise FileNotFoundError(f"checkpoint step {step} left {ckpt.directory} while it was "
                                    f"read (a running training rotates its checkpoints)")
        log(f"[gemjax] checkpoint step {vanished} left {ckpt.directory} while it was read (a "
            f"running training rotates its checkpoints); listing the steps again")
    raise CheckpointDamaged(f"checkpoints in {ckpt.directory} kept vanishing while read "
                            f"({attempts} attempts)")


# ------------------------------------------------------------ the train state

def table_layouts(coll) -> dict[str, dict]:
    """How each table's rows are stored (JSON), saved with every checkpoint."""
    return {name: dataclasses.asdict(lay) for name, lay in coll.layouts.items()}


def _storage_order(lay: dict):
    """What fixes the row order of a table's storage array: a "range" split stores rows
    in logical order on any number of shards; "mod" and table-wise ones depend on them."""
    if lay["split"] == "range" and lay["fixed_shard"] < 0:
        return (lay["padded_vocab"],)
    return tuple(sorted(lay.items()))


def check_table_layouts(saved: dict, current: dict) -> None:
    """Refuse a restore of storage-order tables (checkpoints older than TABLE_ORDER)
    that would silently permute embedding rows."""
    bad = [n for n in current if n in saved and _storage_order(saved[n]) != _storage_order(current[n])]
    if bad:
        raise CheckpointMismatch(
            f"checkpoint tables {bad} were stored for another row layout (saved "
            f"{[saved[n] for n in bad]}, this mesh {[current[n] for n in bad]}): restore on a "
            f"mesh with the same table sharding, or use 'range' row splits, whose storage order "
            f"does not depend on the number of shards")


# Checkpoints store every table in logical row order (meta["table_order"]), so they
# restore onto any mesh shape and any plan; older ones hold the storage order.
TABLE_ORDER = "logical"


def save_train_state(ckpt: Checkpointer, coll, step: int, state: dict, meta: dict) -> bool:
    """Start saving `state` as `step` (False if skipped), tables in logical row order.

    coll: the EmbeddingCollection of state["tables"] (trainer.coll).
    The tables go in as {table: {name: [L, ...]}} (`EmbeddingCollection.logical_arrays`:
    sharded, one jitted all_to_all per mod-split array, no host copy of a whole table);
    meta gets "table_order" and "table_layouts". `state` is left intact (donatable
    once this returns, like Checkpointer.save).
    """
    tables = coll.logical_arrays(state["tables"])
    meta = {**meta, "table_order": TABLE_ORDER, "table_layouts": table_layouts(coll)}
    return ckpt.save(step, {**state, "tables": tables}, meta)


def restore_train_state(ckpt: Checkpointer, coll, target: dict,
                        step: int | None = None) -> tuple[int, dict, dict]:
    """(step, state, meta) from `ckpt` onto coll's mesh and table plan, whatever the
    mesh and plan it was saved from (logical-order tables; their leading dim is padded
    or truncated to this mesh's `logical_rows`, then permuted into storage order).

    coll: the EmbeddingCollection of the tables (trainer.coll).
    target: a train state (e.g. trainer.init_state(seed)); its "tables" arrays are
    deleted to make room. Checkpoints written before TABLE_ORDER (storage order)
    restore when their table layouts equal this mesh's, else ValueError.
    Peak device memory per device for a mod-split table: its logical shard as restored
    + about 4 shards of permutation temporaries (3.8 measured on XLA:CPU; the storage
    output reuses the donated logical buffer); tables already in logical order ("range",
    replicated, one shard) are used as restored, no copy. The host holds only what
    orbax reads for this process's shards; no whole table is built in numpy.
    A table whose saved vocabulary differs from coll's, or a state whose own step
    counter (state["step"]) differs from the checkpoint's step, is refused
    (CheckpointMismatch); damaged files: CheckpointDamaged.
    """
    step, meta = ckpt.metadata(step)
    saved = meta.get("table_layouts", {})
    vocab = [f"{n}: checkpoint {saved[n]['vocab']}, this model {lay.vocab}"
             for n, lay in coll.layouts.items() if n in saved and saved[n]["vocab"] != lay.vocab]
    if vocab:
        raise CheckpointMismatch(f"checkpoint step {step} in {ckpt.directory} holds tables of "
                                 f"another vocabulary ({'; '.join(vocab)})")
    if meta.get("table_order") != TABLE_ORDER:
        layouts = table_layouts(coll)
        check_table_layouts(meta.get("table_layouts", layouts), layouts)
        return _check_label(ckpt, *ckpt.restore(target, step))
    for leaf in jax.tree.leaves(target["tables"]):
        if isinstance(leaf, jax.Array):
            leaf.delete()
    step, state, meta = ckpt.restore({**target, "tables": coll.logical_targets()}, step,
                                     resizable=("tables",))
    return _check_label(ckpt, step, {**state, "tables": coll.from_logical_arrays(state["tables"])},
                        meta)


def state_step(state: dict) -> int | None:
    """The train state's own step counter (state["step"], int32 [] replicated) on the
    host; None if the state has none. Raises if its buffer was donated (mid-step)."""
    x = state.get("step")
    if x is None:
        return None
    if isinstance(x, jax.Array):
        x = x.addressable_data(0)
    return int(np.asarray(x))


def _check_label(ckpt: Checkpointer, step: int, state: dict, meta: dict):
    held = state_step(state)
    if held is not None and held != step:
        raise CheckpointMismatch(
            f"checkpoint step {step} in {ckpt.directory} holds a train state at step {held} "
            f"(state['step']): resuming from it would repeat or skip batches; move "
            f"{os.path.join(ckpt.directory, str(step))} away to resume from an older checkpoint")
    return step, state, meta
