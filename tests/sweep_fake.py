"""A stand-in for experiments.train in sweep tests (experiments.sweep.RUNNER's signature).

A training call writes WORKDIR/summary.json with a selection block whose best_value
is `objective(overrides)` (a known function of the trial's --override values); an
eval call (--mode=eval) writes WORKDIR/eval/step_7.json with that value + TEST_SHIFT.
Every finished call appends {"mode", "workdir", "override"} to $SWEEP_FAKE_CALLS
(after its output file, so a kill between the two leaves no record of a finished
call). $SWEEP_FAKE_SLEEP seconds of sleep per call let a test kill a sweep mid-run;
a train call whose model.fm_rank is 3 exits 1 (a failing trial).
"""

from __future__ import annotations

import json
import math
import os
import time

BEST_STEP = 7
TEST_SHIFT = 1.0


def objective(over: dict[str, str]) -> float:
    """(log10 lr + 2.5)^2 + 0.1 * [dim != 64] + 0.01 * seed; minimum 0 at lr 10^-2.5, dim 64, seed 0."""
    lr = float(over.get("train.dense_lr", 10 ** -2.5))
    dim = int(over.get("model.dim", 64))
    return (math.log10(lr) + 2.5) ** 2 + 0.1 * (dim != 64) + 0.01 * int(over.get("train.seed", 0))


def flag(argv, name: str) -> str | None:
    for a in argv:
        if a.startswith(f"--{name}="):
            return a.split("=", 1)[1]
    return None


def parse(text: str) -> dict[str, str]:
    return dict(p.split("=", 1) for p in text.split(",") if p)


def run(argv, workdir: str, log_path: str) -> int:
    time.sleep(float(os.environ.get("SWEEP_FAKE_SLEEP", "0")))
    over = parse(flag(argv, "override") or "")
    mode = "eval" if "--mode=eval" in argv else "train"
    os.makedirs(workdir, exist_ok=True)
    if mode == "train":
        if over.get("model.fm_rank") == "3":
            return 1
        metric = over["train.select_metric"]
        value = objective(over)
        with open(os.path.join(workdir, "fake_train.json"), "w") as fh:
            json.dump(over, fh)
        with open(os.path.join(workdir, "summary.json"), "w") as fh:
            json.dump({"selection": {"metric": metric, "mode": "min", "best_step": BEST_STEP,
                                     "best_value": value}}, fh)
    else:
        with open(os.path.join(workdir, "fake_train.json")) as fh:
            trained = json.load(fh)
        os.makedirs(os.path.join(workdir, "eval"), exist_ok=True)
        with open(os.path.join(workdir, "eval", f"step_{BEST_STEP}.json"), "w") as fh:
            json.dump({"step": BEST_STEP, trained["train.select_metric"]: objective(trained) + TEST_SHIFT,
                       "eval_path": over.get("data.eval_path")}, fh)
    calls = os.environ.get("SWEEP_FAKE_CALLS")
    if calls:
        with open(calls, "a") as fh:
            fh.write(json.dumps({"mode": mode, "workdir": workdir, "override": over}) + "\n")
    return 0
