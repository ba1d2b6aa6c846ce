"""A run's Config and a checkpointed train state, back from its workdir.

    cfg = read_config(workdir)                       # WORKDIR/config.json -> Config
    run = restore(workdir, step=None, mesh=None)     # best checkpoint, else newest (or `step`:
                                                     # "best", "newest", a step number)
    run.trainer, run.step, run.state, run.meta

The state is restored onto `mesh` (default: every device on one "batch" axis)
whatever mesh it was saved from (`gemjax.train.checkpoint.restore_train_state`).
A missing workdir, config or checkpoint, or a step with no checkpoint, is a
FileNotFoundError naming the path (and the steps there are). The newest step that
passes its checksums is read; newer damaged ones are skipped and named, and a step
rotated away by a running training while it is read makes the steps be listed again
(`gemjax.train.checkpoint.newest_intact`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable

from gemjax.config import Config, apply_overrides, config_from_dict


def read_config(workdir: str, overrides: str | dict | None = None) -> Config:
    """The Config of the run in `workdir` (its config.json), then `overrides` on top
    ("section.field=value,...", as train.py's --override)."""
    path = os.path.join(workdir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file; {workdir!r} is not a gemjax run directory "
                                f"(train.py writes config.json there when a run starts)")
    with open(path) as f:
        try:
            d = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
    try:
        cfg = config_from_dict(d)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return apply_overrides(cfg, overrides)


def pick_checkpoint(workdir: str, which: int | str | None = None) -> tuple[str, int | None]:
    """(checkpoint directory, step or None for its newest) of `which`: None (default:
    WORKDIR/best, the model selection's best step, when the run has one, else the newest
    of WORKDIR/checkpoints), "best", "newest", or a step number (of WORKDIR/checkpoints,
    or the best one's). FileNotFoundError names what is missing; ValueError a bad `which`."""
    best = os.path.join(workdir, "best")
    has_best = os.path.isdir(best) and any(n.isdigit() for n in os.listdir(best))
    if which is None:
        which = "best" if has_best else "newest"
    if isinstance(which, str) and which not in ("best", "newest"):
        try:
            which = int(which)
        except ValueError:
            raise ValueError(f"checkpoint {which!r}: expected best, newest or a step number") from None
    if which == "best":
        if not has_best:
            raise FileNotFoundError(f"no best checkpoint {best}: the run in {workdir!r} selected "
                                    f"no step (train.select_metric)")
        return best, None
    if which == "newest":
        return checkpoint_dir(workdir), None
    step = int(which)
    if has_best and str(step) in os.listdir(best) and not os.path.isdir(
            os.path.join(workdir, "checkpoints", str(step))):
        return best, step
    return checkpoint_dir(workdir), step


def checkpoint_dir(workdir: str) -> str:
    """WORKDIR/checkpoints, or FileNotFoundError when there is none (nothing is created)."""
    path = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint directory {path}: the run in {workdir!r} has not "
                                f"saved a checkpoint")
    return path


@dataclasses.dataclass
class RestoredRun:
    """A checkpoint on a mesh: the Trainer built from the run's config, the step
    restored, the train state placed on trainer.mesh (see gemjax.train.step) and the
    checkpoint's meta."""

    cfg: Config
    trainer: Any
    step: int
    state: dict
    meta: dict
    directory: str = ""      # the checkpoint directory it came from (WORKDIR/best or checkpoints)


def restore(workdir: str, step: int | str | None = None, mesh=None, *,
            trainer_kw: dict | None = None, overrides: str | dict | None = None,
            log: Callable[[str], None] = print) -> RestoredRun:
    """The checkpoint `step` of the run in `workdir` on `mesh`: default the best one
    (WORKDIR/best) when the run selected one, else the newest; "best", "newest" or a step
    number pick another (`pick_checkpoint`). RestoredRun.step says which step came back.

    trainer_kw: Trainer.create options (rules, table_replica_axes, table plan).
    overrides: applied to the run's config (see read_config); they must keep the
    model's parameter shapes, or the restore fails naming the leaves that differ.
    Without a step number, a newer step that is damaged (checksums, unreadable, empty) or
    has no checksums (unless train.trust_unverified_checkpoints) is skipped and
    logged, naming its directory (checkpoint.newest_intact), as a resuming training
    does, without moving it; none intact is CheckpointDamaged naming each step.
    """
    from gemjax.train.checkpoint import (Checkpointer, newest_intact,   # jax, orbax: on use
                                         restore_train_state)
    from gemjax.train.step import Trainer

    cfg = read_config(workdir, overrides)
    directory, step = pick_checkpoint(workdir, step)
    from gemjax.train.retrieval import RetrievalTrainer, is_retrieval
    trainer = (RetrievalTrainer if is_retrieval(cfg) else Trainer).create(cfg, mesh,
                                                                          **(trainer_kw or {}))
    with Checkpointer(directory, read_only=True,   # a training may be saving
                      trust_unverified=cfg.train.trust_unverified_checkpoints) as ckpt:
        # the target is abstract (shapes, dtypes, shardings): nothing drawn to be overwritten
        got, (_, state, meta) = newest_intact(
            ckpt, lambda s: restore_train_state(ckpt, trainer.coll, trainer.abstract_state(), s),
            step, log=log)
    return RestoredRun(cfg, trainer, got, state, meta, directory)
