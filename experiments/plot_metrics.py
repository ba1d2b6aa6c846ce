"""Loss, NE, AUC and samples/s curves of one or several training runs, in one PNG.

    python -m experiments.plot_metrics --workdirs=runs/tiny,runs/small --out=runs/curves.png

Reads WORKDIR/metrics.jsonl of each run (the rows train.py writes) and draws four
panels against the step: train loss (the mean over each log interval), NE (train
intervals as lines, eval points as markers, the stream's Bayes-optimal NE dashed),
eval AUC, and train samples/s (the loop's sliding window, so its first points hold
the compilation). One color per run, labelled by --labels or the workdir's name.
The PNG is --size pixels (width x height). Needs matplotlib (`pip install -e '.[plot]'`).
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
from absl import app, flags

FLAGS = flags.FLAGS

# curve name -> (row kind, row key)
CURVES = {
    "loss": ("train", "loss"),
    "train_ne": ("train", "ne"),
    "samples_per_sec": ("train", "samples_per_sec"),
    "eval_ne": ("eval", "ne"),
    "eval_auc": ("eval", "auc"),
    "bayes_ne": ("eval", "bayes_ne"),
}


def define_flags():
    """The script's flags (defined when run, so tests can import its functions)."""
    flags.DEFINE_list("workdirs", [], "run directories (each holds metrics.jsonl)")
    flags.DEFINE_list("labels", [], "one legend label per workdir (default: the workdir names)")
    flags.DEFINE_string("out", "metrics.png", "PNG path")
    flags.DEFINE_string("size", "1400x900", "PNG size in pixels, WIDTHxHEIGHT")


def read_curves(workdir: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{curve name (CURVES): (steps [N] int64, values [N] float64)} from
    WORKDIR/metrics.jsonl, in file order; a value that is missing or null is nan.
    ValueError names the file (and line) when it is missing or a line is not a
    metrics row."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such file (is {workdir!r} a training workdir?)")
    points: dict[str, list[tuple[int, float]]] = {name: [] for name in CURVES}
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                step, kind = int(row["step"]), row["kind"]
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: not a metrics row with 'step' and 'kind' "
                                 f"({e.__class__.__name__}: {e})") from None
            for name, (want, key) in CURVES.items():
                if kind == want:
                    value = row.get(key)
                    points[name].append((step, math.nan if value is None else float(value)))
    return {name: (np.array([p[0] for p in pts], np.int64), np.array([p[1] for p in pts], np.float64))
            for name, pts in points.items()}


def parse_size(text: str) -> tuple[int, int]:
    """"1400x900" -> (1400, 900); ValueError otherwise."""
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        w = h = 0
    if not (16 <= w <= 20000 and 16 <= h <= 20000):
        raise ValueError(f"--size={text!r}: expected WIDTHxHEIGHT in pixels, each in [16, 20000]")
    return w, h


def plot(runs: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]], out: str,
         size: tuple[int, int] = (1400, 900)) -> None:
    """Draw `runs` ({label: read_curves(...)}) into the PNG `out` of size (width, height)."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise RuntimeError(f"plot_metrics needs matplotlib ({e}): pip install -e '.[plot]'") from None
    dpi = 100
    fig = Figure(figsize=(size[0] / dpi, size[1] / dpi), dpi=dpi, layout="constrained")
    (ax_loss, ax_ne), (ax_auc, ax_sps) = fig.subplots(2, 2)
    colors = [f"C{i % 10}" for i in range(len(runs))]
    for color, (label, c) in zip(colors, runs.items()):
        ax_loss.plot(*c["loss"], color=color, label=label)
        ax_ne.plot(*c["train_ne"], color=color, alpha=0.6, label=f"{label} train")
        ax_ne.plot(*c["eval_ne"], "o-", color=color, label=f"{label} eval")
        if len(c["bayes_ne"][0]):
            ax_ne.axhline(float(np.nanmean(c["bayes_ne"][1])), color=color, ls="--", lw=1,
                          label=f"{label} Bayes")
        ax_auc.plot(*c["eval_auc"], "o-", color=color, label=label)
        ax_sps.plot(*c["samples_per_sec"], color=color, label=label)
    for ax, title in ((ax_loss, "train loss"), (ax_ne, "NE"), (ax_auc, "eval AUC"),
                      (ax_sps, "train samples/s")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=dpi, format="png")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not FLAGS.workdirs:
        raise app.UsageError("--workdirs: give at least one run directory")
    labels = FLAGS.labels or [os.path.basename(os.path.normpath(w)) for w in FLAGS.workdirs]
    if len(labels) != len(FLAGS.workdirs):
        raise app.UsageError(f"--labels: {len(labels)} labels for {len(FLAGS.workdirs)} workdirs")
    if len(set(labels)) != len(labels):
        raise app.UsageError(f"--labels: labels must differ, got {labels} (pass --labels)")
    try:
        size = parse_size(FLAGS.size)
        runs = {label: read_curves(w) for label, w in zip(labels, FLAGS.workdirs)}
    except ValueError as e:
        raise app.UsageError(str(e))
    plot(runs, FLAGS.out, size)
    print(f"[plot_metrics] {len(runs)} run(s) -> {FLAGS.out} ({size[0]}x{size[1]})")


if __name__ == "__main__":
    define_flags()
    app.run(main)
