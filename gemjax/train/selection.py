"""Model selection on a validation metric: the best step so far and the patience count.

    sel = Selection.of(cfg)               # train.select_metric, its direction, train.patience
    improved = sel.update(step, metrics)  # one validation eval (a metrics.jsonl row's figures)
    sel.exhausted                         # `patience` evals in a row without improvement
    sel.to_dict() / Selection.from_dict(d)   # what a checkpoint's meta holds ("selection")

The train loop (gemjax.train.loop) evaluates the validation rows every
train.valid_every steps, keeps the state of the best eval in WORKDIR/best (BEST_DIR, a
Checkpointer of one step) beside the newest ones in WORKDIR/checkpoints, and stores
`to_dict()` in every checkpoint's meta, so a resumed run continues with the best value,
best step and patience count of the step it resumed from. An eval improves when its
value is strictly better than the best so far ("min": lower, e.g. ne, loss; "max":
higher, e.g. auc, hr@10); a NaN never does.

summary.json's "selection" is `summary()`: {"metric", "mode", "best_step", "best_value",
"best" (the validation figures at best_step), "stopped_early", "evals", "last_step"}.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil

from gemjax.config import Config, select_mode

BEST_DIR = "best"
_NOT_FIGURES = ("step", "kind", "split", "samples_per_sec")   # row fields that are no metric          # WORKDIR/best: the checkpoint of the best validation eval


@dataclasses.dataclass
class Selection:
    """The selection state after some validation evals (module docstring)."""

    metric: str
    mode: str                         # "min" | "max"
    patience: int = 0                 # 0: never stop early
    best_step: int | None = None
    best_value: float | None = None
    best: dict = dataclasses.field(default_factory=dict)
    bad: int = 0                      # evals since the best one
    evals: int = 0

    @classmethod
    def of(cls, cfg: Config) -> "Selection":
        t = cfg.train
        mode = select_mode(t.select_metric, cfg.model.kind)
        if mode is None:
            raise ValueError(f"train.select_metric={t.select_metric!r} is no eval metric of "
                             f"model.kind={cfg.model.kind}")
        return cls(t.select_metric, mode, t.patience)

    def better(self, value: float) -> bool:
        if value is None or not math.isfinite(value):
            return False
        if self.best_value is None:
            return True
        return value < self.best_value if self.mode == "min" else value > self.best_value

    def update(self, step: int, metrics: dict) -> bool:
        """Record the validation eval of `step`; True when it is the new best."""
        if self.metric not in metrics:
            raise KeyError(f"train.select_metric={self.metric!r}: the validation eval has no "
                           f"such figure (it has {sorted(metrics)[:12]})")
        value = metrics[self.metric]
        value = None if value is None else float(value)
        self.evals += 1
        if self.better(value):
            self.best_step, self.best_value, self.bad = int(step), value, 0
            self.best = {k: v for k, v in metrics.items() if k not in _NOT_FIGURES}
            return True
        self.bad += 1
        return False

    @property
    def exhausted(self) -> bool:
        """`patience` evals in a row without improvement (never with patience 0)."""
        return self.patience > 0 and self.bad >= self.patience

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Selection":
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})

    def resumed(self, saved: dict | None, rows: list[dict]) -> "Selection":
        """The state at a resumed step: `saved` (the checkpoint's meta "selection") when it
        watched the same metric, else replayed from the validation `rows` kept in
        metrics.jsonl (kind "valid", in step order). The patience is this run's."""
        if saved and saved.get("metric") == self.metric and saved.get("mode") == self.mode:
            out = Selection.from_dict(saved)
        else:
            out = Selection(self.metric, self.mode)
            for r in rows:
                out.update(r["step"], r)
        out.patience = self.patience
        return out

    def summary(self, stopped_early: bool, last_step: int) -> dict:
        return {"metric": self.metric, "mode": self.mode, "best_step": self.best_step,
                "best_value": self.best_value, "best": self.best, "stopped_early": stopped_early,
                "evals": self.evals, "last_step": last_step, "patience": self.patience}


def drop_steps_from(directory: str, step: int) -> list[int]:
    """Delete the step directories >= `step` under a Checkpointer `directory` (best/ steps
    of a run's lost future: a crash after their save, before the next newest checkpoint);
    returns the steps deleted."""
    gone = []
    if os.path.isdir(directory):
        for name in os.listdir(directory):
            if name.isdigit() and int(name) >= step:
                shutil.rmtree(os.path.join(directory, name))
                gone.append(int(name))
    return sorted(gone)
