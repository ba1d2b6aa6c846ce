"""Scaling curves on MovieLens-1M: test metric against training compute, two families.

    python -m experiments.scaling --task=retrieval --out=runs/scaling_retrieval --jobs=10
    python -m experiments.scaling --task=ranking --out=runs/scaling_ranking --jobs=10
    python -m experiments.scaling --task=retrieval --dry_run      # the ladder and its FLOPs
    python -m experiments.scaling --task=retrieval --out=/tmp/scale_smoke --max_users=16 \\
        --families=gem_tower --ladder=8x1,16x1,32x2,64x4 --rungs=0,1 --epochs=1 \\
        --valid_epochs=1 --override=data.batch_size=16             # CPU smoke

Families (FAMILIES; the first of a task is the teacher family, the second the
comparison sized to it):

  retrieval  gem_tower  the retrieval tower of GEM's sequence blocks (preset
                        movielens_retrieval: gemjax.layers.sequence.SequenceEncoder,
                        causal softmax attention, full softmax over the item table)
             hstu       the HSTU tower (preset movielens_hstu_large,
                        model.retrieval_encoder=hstu); needs that preset
  ranking    teacher    the GEM teacher (preset movielens_rank, model.kind=teacher)
             gem        Wukong + sequence encoder (model.kind=gem on the same preset);
                        its FLOPs need gemjax.perf.forward_flops
                        both with the ranking benchmark's model overrides and the settings
                        its validation chose (experiments.ranking.MODELS, ranking_hparams.json)

A retrieval tower reads one event sequence and nothing else, so there is no
interaction arch (Wukong) to compare on retrieval: the retrieval curve compares two
sequence towers, and the teacher-versus-Wukong comparison is the ranking curve.

Ladder: the teacher family's rungs are (width, depth) pairs scaled together
(--ladder, default LADDERS). Each comparison rung keeps the teacher rung's depth and
takes the width (a multiple of the family's width_step) whose dense forward FLOPs per
sample come nearest; other depths are tried when that misses by more than MATCH_TOL.
The FLOPs of every rung are counted and printed before any training
(gemjax.perf.model_flops for the teacher, gemjax.perf.forward_flops for GEM v0,
gemjax.perf.retrieval_flops for the towers, on the first --flops_batches batches of
the train stream), and a ladder whose teacher rungs span less than MIN_SPAN x is
refused, as is a comparison rung off by more than MATCH_TOL.

Compute convention: dense forward FLOPs per sample count the model's matmuls and
attention (embedding lookups 0; a retrieval tower's product with the item table,
the "scoring", is a column of its own and not in the dense count); training compute =
3 x dense forward FLOPs per sample x samples seen up to the selected (best) step.

Protocol per rung and seed: trained through gemjax.train.loop.train in a subprocess of
its own (--jobs of them side by side), in OUT/<family>/r<rung>_s<seed> (rerunning
resumes; a finished rung, one with its summary.json, is not rerun; a workdir holding
another config is refused), for --epochs epochs with model selection on the validation
split (the converter's valid.parquet: each user's last train item; train.select_metric =
--metric, evaluated every --valid_epochs epochs, --patience evals without improvement
stop the run); the test split is read once, on the best checkpoint. Outputs:
OUT/scaling.json (every rung and seed), OUT/scaling.md (the table) and OUT/scaling.png
(test metric vs training PFLOP, log x, one line per family).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import sys
from typing import Callable

import numpy as np

from experiments import ranking
from experiments.child import (REPO, Stopped, check_stopped, log_tail, repo_env, run_processes,
                               train_here)

MIN_SPAN = 16.0          # the teacher rungs' dense FLOPs per sample: largest / smallest
MATCH_TOL = 0.10         # a comparison rung's dense FLOPs within 10% of its teacher rung's


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family: a preset, overrides on it, and the overrides of one size.

    shape(width, depth) -> {"section.field": value} sets the size; width_step: the
    widths a matched rung may take (multiples of it); requires() -> None when the
    family can run here, else the reason it cannot.
    """

    name: str
    label: str
    preset: str
    base: dict
    shape: Callable[[int, int], dict]
    width_step: int = 4
    requires: Callable[[], str | None] = lambda: None


def _tower_shape(d: int, layers: int) -> dict:
    return {"model.dim": str(d), "model.seq_layers": str(layers)}


def _ranking_shape(d: int, layers: int) -> dict:
    return {"model.dim": str(d), "model.interformer_layers": str(layers),
            "model.seq_layers": str(layers), "model.wukong_layers": str(layers),
            "model.wukong_mlp": str(2 * d), "model.head_mlp": str(2 * d)}


def _needs_hstu() -> str | None:
    from gemjax.config import PRESETS, ModelConfig
    if "movielens_hstu_large" not in PRESETS or not hasattr(ModelConfig().retrieval, "encoder"):
        return "needs the HSTU tower (preset movielens_hstu_large, model.retrieval.encoder)"
    return None


def _needs_gem_flops() -> str | None:
    if importlib.util.find_spec("gemjax.perf.forward_flops") is None:
        return "needs gemjax.perf.forward_flops (the FLOPs of model.kind=gem)"
    return None


def _ranking_base(model: str) -> dict:
    """The ranking benchmark's overrides for `model` (experiments.ranking.MODELS) and the
    settings its validation chose (experiments/ranking_hparams.json)."""
    return {**ranking.MODELS[model], **ranking.load_hparams(ranking.HPARAMS).get(model, {})}


FAMILIES: dict[str, tuple[Family, Family]] = {
    "retrieval": (
        Family("gem_tower", "GEM sequence-block tower", "movielens_retrieval", {}, _tower_shape),
        Family("hstu", "HSTU tower", "movielens_hstu_large", {}, _tower_shape,
               requires=_needs_hstu)),
    "ranking": (
        Family("teacher", "GEM teacher", "movielens_rank", _ranking_base("teacher"),
               _ranking_shape),
        Family("gem", "Wukong + sequence encoder", "movielens_rank", _ranking_base("gem"),
               _ranking_shape, requires=_needs_gem_flops)),
}
# the teacher family's (width, depth) rungs
LADDERS = {"retrieval": ((32, 1), (48, 1), (64, 2), (96, 3), (128, 4)),
           "ranking": ((16, 1), (32, 1), (48, 2), (64, 2), (96, 3))}
# per task: selection metric, converter arguments, epochs, validation interval (epochs)
TASKS = {"retrieval": dict(metric="hr@10", train_positions=1, epochs=30, valid_epochs=3.0),
         "ranking": dict(metric="auc", train_positions=5, epochs=3, valid_epochs=0.5)}


# --------------------------------------------------------------------------- ladder


@dataclasses.dataclass(frozen=True)
class Rung:
    """One size of one family: its overrides and counted size (per sample, forward)."""

    family: str
    index: int
    width: int
    depth: int
    overrides: dict
    params: int
    dense_flops: float        # forward FLOPs per sample, dense (module docstring)
    scoring_flops: float      # retrieval: the product with the item table per sample; else 0


def parse_ladder(text: str) -> tuple[tuple[int, int], ...]:
    """"32x1,64x2" -> ((32, 1), (64, 2)); ValueError naming --ladder otherwise."""
    out = []
    for part in text.split(","):
        try:
            w, d = (int(v) for v in part.strip().lower().split("x"))
        except ValueError:
            raise ValueError(f"--ladder={text!r}: each rung is WIDTHxDEPTH, got {part!r}") from None
        if w < 1 or d < 1:
            raise ValueError(f"--ladder={text!r}: width and depth must be >= 1, got {part!r}")
        out.append((w, d))
    return tuple(out)


def forward_flops(cfg, batches) -> tuple[float, float]:
    """(dense, scoring) forward FLOPs per sample of cfg's model, averaged over `batches`
    (host Batches of cfg's train stream)."""
    dense = scoring = samples = 0
    for batch in batches:
        kind = cfg.model.kind
        if kind == "retrieval":
            from gemjax.models.retrieval import retrieval_sequence
            from gemjax.perf.retrieval_flops import retrieval_forward_flops
            lengths = np.diff(np.asarray(batch.sequences[retrieval_sequence(cfg)].offsets))
            e, s = retrieval_forward_flops(cfg, lengths)
            dense, scoring, samples = dense + e, scoring + s, samples + len(lengths)
            continue
        if kind == "teacher":
            from gemjax.perf.model_flops import batch_block_detail
            f = sum(v.total for v in batch_block_detail(cfg, batch)["model"].values())
        else:
            from gemjax.perf.forward_flops import forward_flops as ranking_flops
            f = ranking_flops(cfg, batch)
        dense, samples = dense + f, samples + int(np.asarray(batch.dense).shape[0])
    return dense / samples, scoring / samples


def flops_batches(cfg, n: int) -> list:
    """The first n batches of cfg's train stream (one shard), host arrays."""
    from gemjax.data.source import make_source
    src = make_source(cfg, seed=0)
    return [src.shard_batch(i, 0, 1)[0] for i in range(n)]


def make_rung(base, family: Family, index: int, width: int, depth: int, batches,
              count_params: bool = True) -> Rung:
    """family at (width, depth) on `base`: its FLOPs per sample on `batches` and (when
    count_params) its dense parameters (else 0)."""
    from gemjax.config import apply_overrides
    from gemjax.perf.model_size import param_counts
    ov = family.shape(width, depth)
    cfg = apply_overrides(base, ov)
    dense, scoring = forward_flops(cfg, batches)
    params = param_counts(cfg).dense if count_params else 0
    return Rung(family.name, index, width, depth, ov, params, dense, scoring)


def match_rung(base, family: Family, index: int, target: float, depth: int, batches,
               max_width: int = 1024, count_params: bool = True) -> Rung:
    """The rung of `family` whose dense FLOPs per sample are nearest `target`: width a
    multiple of family.width_step at `depth`; other depths (1 .. 2 depth + 2) when that
    misses by more than MATCH_TOL. FLOPs are quadratic in width at a fixed depth, so
    the width is found by bisection on the counted FLOPs."""
    def best_at(dp: int) -> Rung:
        step = family.width_step
        lo, hi = 1, max_width // step                     # widths lo*step .. hi*step
        cache: dict[int, Rung] = {}

        def rung(k: int) -> Rung:
            if k not in cache:
                cache[k] = make_rung(base, family, index, k * step, dp, batches, False)
            return cache[k]
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if rung(mid).dense_flops <= target else (lo, mid)
        return min((rung(lo), rung(hi)), key=lambda r: abs(math.log(r.dense_flops / target)))

    best = best_at(depth)
    if abs(best.dense_flops / target - 1) > MATCH_TOL:
        for dp in range(1, 2 * depth + 3):
            if dp != depth:
                r = best_at(dp)
                if abs(math.log(r.dense_flops / target)) < abs(math.log(best.dense_flops / target)):
                    best = r
    return make_rung(base, family, index, best.width, best.depth, batches, count_params)


def check_span(rungs: list[Rung], min_span: float = MIN_SPAN) -> float:
    """The dense FLOPs span (largest / smallest) of a family's rungs; ValueError when
    fewer than 4 rungs or a span under min_span."""
    if len(rungs) < 4:
        raise ValueError(f"the ladder has {len(rungs)} rungs; a scaling curve needs >= 4")
    f = [r.dense_flops for r in rungs]
    span = max(f) / min(f)
    if span < min_span:
        raise ValueError(f"the ladder spans {span:.1f}x dense FLOPs per sample "
                         f"({min(f) / 1e9:.4f} .. {max(f) / 1e9:.4f} GFLOP); it must span >= "
                         f"{min_span:g}x: widen --ladder")
    return span


def check_match(teacher: list[Rung], other: list[Rung], tol: float = MATCH_TOL) -> None:
    """ValueError naming the first comparison rung off its teacher rung by more than tol."""
    for t, o in zip(teacher, other):
        if abs(o.dense_flops / t.dense_flops - 1) > tol:
            raise ValueError(f"rung {t.index}: {o.family} ({o.width}x{o.depth}) has "
                             f"{o.dense_flops / 1e9:.4f} GFLOP/sample, {t.family} "
                             f"{t.dense_flops / 1e9:.4f}: off by more than {tol:.0%}")


def build_ladder(bases: dict, families: tuple[Family, ...], ladder, batches,
                 log=print, count_params: bool = True) -> dict[str, list[Rung]]:
    """{family name: rungs}: the first family's rungs from `ladder` ((width, depth)
    pairs), each other family matched to them; the span and the matches checked
    (ValueError). bases: {family name: its base Config}; batches: FLOPs batches;
    count_params False leaves Rung.params 0 (no model is traced)."""
    first, *rest = families
    out = {first.name: [make_rung(bases[first.name], first, i, w, d, batches, count_params)
                        for i, (w, d) in enumerate(ladder)]}
    span = check_span(out[first.name])
    for fam in rest:
        out[fam.name] = [match_rung(bases[fam.name], fam, r.index, r.dense_flops, r.depth, batches,
                                    count_params=count_params) for r in out[first.name]]
        check_match(out[first.name], out[fam.name])
    log(ladder_table(out))
    log(f"[scaling] {first.name} spans {span:.1f}x dense FLOPs per sample (>= {MIN_SPAN:g}x)")
    return out


def ladder_table(ladder: dict[str, list[Rung]]) -> str:
    lines = [f"{'family':12s} {'rung':>4s} {'width':>6s} {'depth':>5s} {'params':>11s} "
             f"{'GFLOP/sample fwd':>17s} {'scoring GFLOP':>14s}"]
    for rungs in ladder.values():
        for r in rungs:
            lines.append(f"{r.family:12s} {r.index:4d} {r.width:6d} {r.depth:5d} {r.params:11,d} "
                         f"{r.dense_flops / 1e9:17.4f} {r.scoring_flops / 1e9:14.4f}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- configs


def selection_available() -> str | None:
    """None when the trainer has model selection (train.select_metric), else the reason."""
    from gemjax.config import TrainConfig
    if not hasattr(TrainConfig(), "select_metric"):
        return ("gemjax.config.TrainConfig has no field select_metric: the trainer has no "
                "validation selection yet")
    return None


def prepare_data(task: str, data_dir: str, out: str, max_users: int = 0, log=print) -> str:
    """out/<task>: the converted split with valid.parquet (converted now unless its
    counts.json says it holds the same data)."""
    d = os.path.abspath(os.path.join(out, task))      # the rungs' subprocesses run in REPO
    path = os.path.join(d, "counts.json")
    positions = TASKS[task]["train_positions"]
    if os.path.exists(path):
        c = json.load(open(path))
        users = c.get("dataset_users") if max_users <= 0 else min(max_users,
                                                                  c.get("dataset_users", 0))
        if (c.get("data_dir") == os.path.abspath(data_dir) and c.get("valid")
                and c.get("train_positions") == positions and c.get("users") == users):
            log(f"[scaling] reusing {d}")
            return d
    log(f"[scaling] converting {data_dir} -> {d}")
    from experiments import convert_movielens
    convert_movielens.convert(data_dir, out, (task,), train_positions=positions,
                              max_users=max_users, valid=True)
    return d


def base_config(family: Family, data: str, override: str = ""):
    """family's preset on the converted files in `data` (schema, train / valid / test
    paths, every eval row), then family.base, then `override`."""
    from gemjax.config import apply_overrides, get_config
    from gemjax.features import FeatureSchema
    schema = FeatureSchema.from_dict(json.load(open(os.path.join(data, "schema.json"))))
    cfg = dataclasses.replace(get_config(family.preset), features=schema)
    cfg = apply_overrides(cfg, {"data.source": "parquet", "data.eval_batches": "0",
                                "data.train_path": os.path.join(data, "train.parquet"),
                                "data.eval_path": os.path.join(data, "test.parquet")})
    return apply_overrides(apply_overrides(cfg, family.base), override)


def run_config(base, rung: Rung, *, rows: int, epochs: int, valid_epochs: float, patience: int,
               metric: str, seed: int, steps_per_call: int = 1):
    """The rung's training config: `epochs` epochs of `rows` train rows, selection on
    valid.parquet every valid_epochs epochs by `metric`, test once on the best state;
    steps_per_call train steps per jitted call (0: the largest count dividing an epoch's
    steps and the validation interval)."""
    from gemjax.config import apply_overrides
    cfg = apply_overrides(base, rung.overrides)
    per_epoch = math.ceil(rows / cfg.data.batch_size)
    every = max(1, round(valid_epochs * per_epoch))
    steps = max(every, epochs * per_epoch)
    valid = os.path.join(os.path.dirname(cfg.data.train_path), "valid.parquet")
    return apply_overrides(cfg, {
        "train.steps_per_call": str(steps_per_call or math.gcd(per_epoch, every)),
        "data.valid_path": valid, "train.select_metric": metric, "train.patience": str(patience),
        "train.valid_every": str(every), "train.eval_every": str(every),
        "train.checkpoint_every": str(every), "train.steps": str(steps),
        "train.log_every": str(max(1, min(per_epoch, every))),
        "train.warmup_steps": str(min(per_epoch, cfg.optim.dense.warmup_steps)),
        "train.seed": str(seed)})


# --------------------------------------------------------------------------- runs


def _jsonable(cfg) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def prepare_rung(cfg, workdir: str, log=print) -> dict | None:
    """The summary.json of cfg's finished run in `workdir`, read back; None when the run is
    still to train (its rung.json written). ValueError when workdir holds a run of another
    config."""
    workdir = os.path.abspath(workdir)                 # the subprocess runs in REPO
    os.makedirs(workdir, exist_ok=True)
    want = {"config": _jsonable(cfg)}
    spec = os.path.join(workdir, "rung.json")
    if os.path.exists(spec):
        from gemjax.config import nest_flat_fields
        had = json.load(open(spec))
        if {**had, "config": nest_flat_fields(had.get("config") or {})} != want:
            raise ValueError(f"{workdir} holds a run of another config ({spec}); give another "
                             f"--out or remove it")
    else:
        with open(spec + ".tmp", "w") as f:
            json.dump(want, f, indent=1)
        os.replace(spec + ".tmp", spec)
    summary = _read_summary(workdir)
    if summary is not None:
        log(f"[scaling] {workdir}: finished, reusing its summary.json")
        return summary
    log(f"[scaling] {workdir}: training {cfg.train.steps} steps")
    return None


def rung_process(workdir: str) -> tuple[list[str], str, str]:
    """(argv, workdir, log path) of the subprocess that trains workdir/rung.json (its
    output in workdir/train.log)."""
    workdir = os.path.abspath(workdir)
    return ([sys.executable, "-m", "experiments.scaling", f"--run_rung={workdir}"], workdir,
            os.path.join(workdir, "train.log"))


def rung_outcome(workdir: str, rc: int) -> dict:
    """The summary.json the subprocess that exited with rc wrote in workdir. Stopped when a
    SIGINT / SIGTERM (passed on to the subprocess) stopped it after its save; RuntimeError
    (with the log's tail) when it failed."""
    workdir = os.path.abspath(workdir)
    check_stopped(rc, f"{workdir}:")
    summary = _read_summary(workdir)
    if rc != 0 or summary is None:
        raise RuntimeError(f"{workdir}: training exited with {rc}; the end of its train.log:\n"
                           f"{log_tail(os.path.join(workdir, 'train.log'))}")
    return summary


def _read_summary(workdir: str) -> dict | None:
    try:
        with open(os.path.join(workdir, "summary.json")) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def train_rung(workdir: str) -> None:
    """The subprocess' side of rung_process: train workdir/rung.json's config in workdir."""
    from gemjax.config import config_from_dict
    cfg = config_from_dict(json.load(open(os.path.join(workdir, "rung.json")))["config"])
    train_here(cfg, workdir, "scaling")


def rung_result(rung: Rung, seed: int, cfg, summary: dict, metric: str) -> dict:
    """One trained rung and seed: the best step, compute to it, valid and test metric."""
    sel = summary.get("selection") or {}
    best = sel.get("best_step")
    best = summary.get("steps", cfg.train.steps) if best is None else best
    test = (summary.get("eval") or {}).get(metric, summary.get(f"eval_{metric}"))
    samples = best * cfg.data.batch_size
    return {"seed": seed, "best_step": best, "samples": samples,
            "train_pflop": 3 * rung.dense_flops * samples / 1e15,
            "valid": sel.get("best_value"), "test": test,
            "stopped_early": sel.get("stopped_early"), "wall_s": summary.get("wall_time_s")}


# --------------------------------------------------------------------------- report


def _mean_std(values) -> tuple[float | None, float | None]:
    v = [x for x in values if x is not None]
    if not v:
        return None, None
    return float(np.mean(v)), float(np.std(v, ddof=1)) if len(v) > 1 else 0.0


def aggregate(rung: dict) -> dict:
    """rung (a scaling.json rung with "seeds") + the means and stds over its seeds."""
    out = dict(rung)
    for key in ("train_pflop", "valid", "test"):
        out[f"{key}_mean"], out[f"{key}_std"] = _mean_std(s[key] for s in rung["seeds"])
    return out


LOWER_IS_BETTER = ("ne", "loss", "log_loss")


def _gain(metric: str) -> float:
    """+1 for metrics where higher is better (hr@k, ndcg@k, mrr, auc), -1 for ne / loss."""
    return -1.0 if metric.rsplit("/", 1)[-1] in LOWER_IS_BETTER else 1.0


def _slope(rows: list[dict]) -> float | None:
    pts = [(math.log10(r["train_pflop_mean"]), r["test_mean"]) for r in rows
           if r.get("test_mean") is not None and r.get("train_pflop_mean")]
    if len(pts) < 2:
        return None
    x, y = np.array(pts).T
    return float(np.polyfit(x, y, 1)[0])


def verdict(report: dict) -> str:
    """One plain sentence: does the teacher family scale better (a steeper least-squares
    slope of the test metric per decade of training compute, and the better metric at the
    largest rung; for ne / loss lower is better) than the comparison?"""
    fams = report["families"]
    if len(fams) < 2:
        return f"only {fams[0]['name']} ran: no comparison"
    first, second = fams[0]["name"], fams[1]["name"]
    rows = {f: [r for r in report["rungs"] if r["family"] == f] for f in (first, second)}
    s1, s2 = _slope(rows[first]), _slope(rows[second])
    if s1 is None or s2 is None:
        return "too few finished rungs to compare slopes"
    top = lambda f: max(rows[f], key=lambda r: r["index"]).get("test_mean")
    t1, t2 = top(first), top(second)
    m = report["metric"]
    g = _gain(m)
    better = g * s1 > g * s2 and t1 is not None and t2 is not None and g * t1 >= g * t2
    return (f"{first} {'scales better than' if better else 'does NOT scale better than'} {second}: "
            f"test {m} gains {s1:+.4f} vs {s2:+.4f} per decade of training compute, "
            f"{t1:.4f} vs {t2:.4f} at the largest rung")


def table(report: dict) -> str:
    m = report["metric"]
    lines = [f"| family | rung | width x depth | params | GFLOP/sample fwd | scoring GFLOP/sample "
             f"| training PFLOP to best | valid {m} | test {m} (mean ± std, {report['seeds']} "
             f"seed(s)) |", "|" + "---|" * 9]
    fmt = lambda v, p=".4f": "–" if v is None else f"{v:{p}}"
    for r in report["rungs"]:
        lines.append(f"| {r['family']} | {r['index']} | {r['width']}x{r['depth']} | "
                     f"{r['params']:,} | {r['dense_flops'] / 1e9:.4f} | "
                     f"{r['scoring_flops'] / 1e9:.4f} | {fmt(r['train_pflop_mean'], '.4g')} | "
                     f"{fmt(r['valid_mean'])} | {fmt(r['test_mean'])} ± {fmt(r['test_std'])} |")
    return "\n".join(lines)


def plot(report: dict, out: str) -> None:
    """Test metric (mean, std bars) vs training PFLOP to the best step, log x, one line
    per family, into the PNG `out`."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise RuntimeError(f"scaling needs matplotlib for its plot ({e}): pip install -e "
                           f"'.[plot]'") from None
    fig = Figure(figsize=(8, 5.5), dpi=100, layout="constrained")
    ax = fig.subplots()
    for i, fam in enumerate(report["families"]):
        rows = [r for r in report["rungs"] if r["family"] == fam["name"]
                and r.get("test_mean") is not None and r.get("train_pflop_mean")]
        if not rows:
            continue
        ax.errorbar([r["train_pflop_mean"] for r in rows], [r["test_mean"] for r in rows],
                    yerr=[r["test_std"] or 0.0 for r in rows], fmt="o-", color=f"C{i}",
                    capsize=3, label=f"{fam['name']}: {fam['label']}")
    ax.set_xscale("log")
    ax.set_xlabel("training compute to the best step (PFLOP, 3 x dense forward x samples)")
    ax.set_ylabel(f"test {report['metric']}")
    ax.set_title(f"MovieLens-1M {report['task']}: scaling")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize="small")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=100, format="png")


def write_report(report: dict, out: str, log=print) -> dict:
    """OUT/scaling.json (the report with aggregated rungs and the verdict), OUT/scaling.md
    (the table and the verdict) and OUT/scaling.png (logged and left out without
    matplotlib); returns the written report."""
    report = {**report, "rungs": [aggregate(r) for r in report["rungs"]]}
    report["verdict"] = verdict(report)
    os.makedirs(out, exist_ok=True)
    for name, text in (("scaling.json", json.dumps(report, indent=1)),
                       ("scaling.md", f"{table(report)}\n\n{report['verdict']}\n")):
        with open(os.path.join(out, name + ".tmp"), "w") as f:
            f.write(text)
        os.replace(os.path.join(out, name + ".tmp"), os.path.join(out, name))
    try:
        plot(report, os.path.join(out, "scaling.png"))
    except RuntimeError as e:
        log(f"[scaling] no plot: {e}")
    return report


# --------------------------------------------------------------------------- main


def define_flags() -> None:
    from absl import flags
    flags.DEFINE_enum("task", "retrieval", sorted(FAMILIES), "MovieLens-1M task")
    flags.DEFINE_string("out", "runs/scaling", "output directory (a workdir per rung and seed)")
    flags.DEFINE_string("data_dir", None, "ml-1m directory (default ../shared/datasets/ml-1m)")
    flags.DEFINE_string("data_out", "/tmp/gemjax-data/ml-1m-scaling",
                        "converted Parquet with valid.parquet (outside any git work tree)")
    flags.DEFINE_integer("max_users", 0, "convert only the first N users (0 = all; smoke runs)")
    flags.DEFINE_list("families", [], "families to run (default: the task's that can run here)")
    flags.DEFINE_string("ladder", "", "teacher rungs WIDTHxDEPTH,... (default LADDERS[task])")
    flags.DEFINE_list("rungs", [], "rung indices to train (default all; the span is checked "
                                   "on the whole ladder)")
    flags.DEFINE_integer("seeds", 1, "seeds per rung (train.seed 0 .. seeds-1)")
    flags.DEFINE_integer("jobs", 1, "runs (rung x seed) trained side by side, each in a process "
                                    "of its own (one GPU holds several small ones)")
    flags.DEFINE_integer("epochs", 0, "epochs per rung (0: TASKS[task]['epochs'])")
    flags.DEFINE_float("valid_epochs", 0.0, "epochs between validation evals (0: the task's)")
    flags.DEFINE_integer("steps_per_call", 1, "train steps per jitted call (train.steps_per_call; "
                         "0: the largest dividing an epoch and the validation interval); the "
                         "same numbers as one step per call, with one launch per call")
    flags.DEFINE_integer("patience", 3, "validation evals without improvement before stopping")
    flags.DEFINE_string("metric", "", "selection and test metric (default: hr@10 / auc)")
    flags.DEFINE_string("override", "", "overrides for every rung, section.field=value,...")
    flags.DEFINE_integer("flops_batches", 4, "train batches the FLOPs per sample average over")
    flags.DEFINE_bool("dry_run", False, "print the ladder and its FLOPs, train nothing")
    flags.DEFINE_string("run_rung", "", "internal: train WORKDIR/rung.json in WORKDIR")


def _pick_families(task: str, names: list[str], log) -> tuple[Family, ...]:
    fams = FAMILIES[task]
    known = {f.name: f for f in fams}
    bad = [n for n in names if n not in known]
    if bad:
        raise ValueError(f"--families: unknown {bad} for --task={task}; choose from {sorted(known)}")
    chosen = []
    for f in fams:
        if names and f.name not in names:
            continue
        why = f.requires()
        if why:
            if names:
                raise ValueError(f"--families: {f.name} cannot run here: {why}")
            log(f"[scaling] WARNING: family {f.name} left out: {why}")
            continue
        chosen.append(f)
    if not chosen:
        raise ValueError(f"--task={task}: no family can run here")
    return tuple(chosen)


def ladder_families(task: str, picked: tuple[Family, ...]) -> tuple[Family, ...]:
    """The families the ladder is built on: the task's teacher family, whose rungs are
    --ladder, then each picked comparison family matched to it. A comparison family
    trained alone (--families=hstu) so keeps the widths it has beside the teacher."""
    first = FAMILIES[task][0]
    return (first, *(f for f in picked if f.name != first.name))


def main(argv):
    from absl import app, flags
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    if f.run_rung:
        train_rung(f.run_rung)
        return
    log = lambda s: print(s, flush=True)
    task, spec = f.task, TASKS[f.task]
    metric = f.metric or spec["metric"]
    epochs = f.epochs or spec["epochs"]
    valid_epochs = f.valid_epochs or spec["valid_epochs"]
    from gemjax.data.movielens import DEFAULT_DIR
    try:
        why = selection_available()
        if why and not f.dry_run:
            raise ValueError(why)
        fams = _pick_families(task, f.families, log)
        every = ladder_families(task, fams)
        ladder = parse_ladder(f.ladder) if f.ladder else LADDERS[task]
        data = prepare_data(task, f.data_dir or DEFAULT_DIR, f.data_out, f.max_users, log)
        bases = {fam.name: base_config(fam, data, f.override) for fam in every}
        batches = flops_batches(bases[every[0].name], f.flops_batches)
        rungs = build_ladder(bases, every, ladder, batches, log)
        pick = [int(i) for i in f.rungs] if f.rungs else list(range(len(ladder)))
        if any(not 0 <= i < len(ladder) for i in pick):
            raise ValueError(f"--rungs={','.join(f.rungs)}: indices in [0, {len(ladder)})")
        if f.jobs < 1:
            raise ValueError(f"--jobs={f.jobs}: at least 1")
    except (ValueError, FileNotFoundError) as e:
        raise app.UsageError(str(e))
    if f.dry_run:
        return
    rows = json.load(open(os.path.join(data, "counts.json")))["splits"]["train"]["rows"]
    report = {"task": task, "metric": metric, "seeds": f.seeds, "epochs": epochs,
              "valid_epochs": valid_epochs, "patience": f.patience, "data": data,
              "convention": "training compute = 3 x dense forward FLOPs per sample x samples "
                            "seen to the best validation step",
              "families": [{"name": fam.name, "label": fam.label, "preset": fam.preset}
                           for fam in fams], "rungs": []}
    pending = []          # (entry, rung, seed, cfg, workdir) of the runs still to train

    def add(entry: dict, result: dict) -> None:
        entry["seeds"] = sorted(entry["seeds"] + [result], key=lambda r: r["seed"])

    for fam in fams:
        for i in pick:
            rung = rungs[fam.name][i]
            entry = {**dataclasses.asdict(rung), "seeds": []}
            report["rungs"].append(entry)
            for seed in range(f.seeds):
                cfg = run_config(bases[fam.name], rung, rows=rows, epochs=epochs,
                                 valid_epochs=valid_epochs, patience=f.patience, metric=metric,
                                 seed=seed, steps_per_call=f.steps_per_call)
                wd = os.path.join(f.out, fam.name, f"r{i}_s{seed}")
                try:
                    summary = prepare_rung(cfg, wd, log)
                except ValueError as e:            # the workdir holds another config
                    raise app.UsageError(str(e))
                if summary is None:
                    pending.append((entry, rung, seed, cfg, wd))
                else:
                    add(entry, rung_result(rung, seed, cfg, summary, metric))
    write_report(report, f.out)

    def ended(k: int, code: int) -> None:      # after every run: partial curves survive
        entry, rung, seed, cfg, wd = pending[k]
        summary = _read_summary(os.path.abspath(wd))
        if code == 0 and summary is not None:
            add(entry, rung_result(rung, seed, cfg, summary, metric))
            write_report(report, f.out)

    codes = run_processes([rung_process(p[-1]) for p in pending], f.jobs, cwd=REPO,
                          env=repo_env(), done=ended)
    failed = []
    for (*_, wd), code in zip(pending, codes):
        try:
            rung_outcome(wd, code)
        except Stopped as e:
            print(f"[scaling] {e}; rerun the same command to continue", flush=True)
            sys.exit(130)
        except RuntimeError as e:
            failed.append(str(e))
    if failed:
        raise RuntimeError("\n\n".join(failed))
    report = write_report(report, f.out)
    print(table(report))
    print(report["verdict"])
    print(f"[scaling] {f.out}/scaling.json, scaling.md, scaling.png")


if __name__ == "__main__":
    from absl import app
    define_flags()
    app.run(main)
