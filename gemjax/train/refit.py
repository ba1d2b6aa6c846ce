"""Refit after model selection: train again with the validation rows trained too.

    summary = refit(workdir)                  # WORKDIR/refit: train + validation rows
    summary = refit(workdir, rows="valid")    # the validation rows alone (see below)

A selection run (train.select_metric, gemjax.train.selection) picks its best step on the
validation rows; `refit` then trains a second run in WORKDIR/refit with the same config
(WORKDIR/config.json) for the first run's summary.json selection.best_step steps, without
selection (no validation, no early stop), and evaluates the eval rows (the test) once, at
the end. What it trains on (`rows`):

  "train+valid"  data.train_path's files plus data.valid_path's files: rows that are
                 separate examples (a ranking row per impression).
  "valid"        data.valid_path's files alone: for sequence rows where a user's
                 validation row is the train row extended by one event (the MovieLens
                 retrieval split: every position of a row is a target), so the
                 validation rows hold every train target plus the validation target, and
                 adding the train rows would train each history twice per epoch.

The files meet in WORKDIR/refit/data as symbolic links, train-NNNNN.parquet (the train
files, in their order) then valid-NNNNN.parquet, which data.train_path of the refit run
names, so its config.json records what it read. Rerunning resumes the refit run like any
other. Parquet sources only: the synthetic stream has no finite train rows to add to.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable

from gemjax.config import Config, apply_overrides, config_from_dict
from gemjax.data.files import list_files
from gemjax.data.source import valid_files

REFIT_DIR = "refit"
ROWS = ("train+valid", "valid")


def refit_config(workdir: str, rows: str = "train+valid") -> Config:
    """The refit run's Config (module docstring), its data directory linked; ValueError /
    FileNotFoundError when `workdir` holds no finished selection run on Parquet files or
    `rows` is not one of ROWS."""
    if rows not in ROWS:
        raise ValueError(f"refit rows={rows!r}: expected one of {', '.join(ROWS)}")
    with open(os.path.join(workdir, "config.json")) as f:
        cfg = config_from_dict(json.load(f))
    path = os.path.join(workdir, "summary.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file; refit follows a finished run")
    with open(path) as f:
        chosen = json.load(f).get("selection")
    if not chosen or chosen.get("best_step") is None:
        raise ValueError(f"{path} has no selection.best_step: refit follows a run with "
                         f"train.select_metric")
    if cfg.data.source != "parquet":
        raise ValueError(f"refit needs data.source=parquet (got {cfg.data.source}): the synthetic "
                         f"stream has no finite train rows to add the validation rows to")
    data = os.path.join(workdir, REFIT_DIR, "data")
    links = ([] if rows == "valid" else
             [(f"train-{i:05d}.parquet", p) for i, p in enumerate(list_files(cfg.data.train_path))])
    links += [(f"valid-{i:05d}.parquet", p) for i, p in enumerate(list_files(valid_files(cfg.data)))]
    os.makedirs(data, exist_ok=True)
    for name in os.listdir(data):
        if name not in dict(links):
            os.remove(os.path.join(data, name))
    for name, target in links:
        link = os.path.join(data, name)
        if os.path.islink(link) and os.readlink(link) == os.path.abspath(target):
            continue
        if os.path.lexists(link):
            os.remove(link)
        os.symlink(os.path.abspath(target), link)
    steps = int(chosen["best_step"])
    cfg = dataclasses.replace(
        cfg, data=dataclasses.replace(cfg.data, train_path=data, valid_path=""),
        train=dataclasses.replace(cfg.train, select_metric="", patience=0, valid_every=0))
    return apply_overrides(cfg, {"train.steps": str(steps), "train.eval_every": str(steps)})


def refit(workdir: str, *, rows: str = "train+valid", log: Callable[[str], None] = print,
          mesh=None, trainer_kw: dict | None = None) -> dict:
    """Train the refit run in WORKDIR/refit on `rows` (module docstring); returns its
    summary."""
    from gemjax.train.loop import train
    cfg = refit_config(workdir, rows)
    what = "validation rows" if rows == "valid" else "train and validation rows"
    log(f"[gemjax] refit: {cfg.train.steps} steps on the {what} "
        f"({cfg.data.train_path}) -> {os.path.join(workdir, REFIT_DIR)}")
    return train(cfg, os.path.join(workdir, REFIT_DIR), log=log, mesh=mesh, trainer_kw=trainer_kw)
