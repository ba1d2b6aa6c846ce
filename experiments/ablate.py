"""Ablation of the full GEM teacher on the synthetic planted-teacher stream.

    python -m experiments.ablate --config=small --steps=2000 --seeds=0,1,2 --workdir=runs/ablate
    python -m experiments.ablate --config=tiny --steps=4 --seeds=0,1 --variants=no_pma,no_experts

The full model is the teacher (model.kind=teacher) with a mixture of 4 Wukong
experts and BlockAttention; --override applies after that (so it can retune the
full model, e.g. model.top_k=2) and each variant then changes one thing:

  full               the full teacher
  no_sequences       no sequence inputs. The teacher is built around its sequence
                     side (its InterFormer needs one), so this is model v0's Wukong
                     over the non-sequence tokens (model.kind=gem,
                     model.use_sequences=false): the sequence features and the whole
                     sequence stack go together.
  no_pma             no PMA tokens in the sequence summary (model.pma_tokens=0)
  no_cross_layer     Wukong without cross-layer attention connections (these need
                     model.wukong_layers >= 2; `tiny` has 1, so there it equals full)
  no_experts         one Wukong instead of 4 experts (model.num_experts=0)
  softmax_attention  full softmax self-attention over each sequence instead of
                     model.block-token blocks (full vs block attention). Only the
                     InterFormer's attention changes (the pyramid levels stay block
                     attention), so it only matters for samples whose pyramid output
                     exceeds one block: never on `tiny`, for the longest samples on
                     `small` (at most 64 tokens vs block 32), widely on `h200`.
  gdpa_attention     full GDPA (SiLU) self-attention; against softmax_attention it
                     is softmax vs GDPA, the sequence attention kind

Every (variant, seed) pair trains through gemjax.train.loop.train with the same
steps and train.seed (data stream, planted teacher and init), baselines off, in
WORKDIR/<variant>/seed<seed>; a rerun reuses finished runs and resumes the rest.
The table gives eval NE mean ± std over seeds, the per-seed paired delta vs full
(mean ± std), and the Bayes-optimal NE of the eval stream; --out (default
WORKDIR/ablate.json) holds every run's summary.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Sequence

from absl import app, flags

from experiments.seeds import parse_seeds
from gemjax.config import PRESETS, Config, apply_overrides, get_config

# What turns a preset into the full teacher (before --override).
FULL = {"model.kind": "teacher", "model.use_sequences": "true", "model.num_experts": "4",
        "model.attention": "block"}

# variant -> (overrides on top of the full model, one line for the table's reader)
VARIANTS: dict[str, tuple[dict[str, str], str]] = {
    "full": ({}, "full teacher"),
    "no_sequences": ({"model.kind": "gem", "model.use_sequences": "false"},
                     "Wukong v0 without sequence inputs"),
    "no_pma": ({"model.pma_tokens": "0"}, "no PMA summary tokens"),
    "no_cross_layer": ({"model.cross_layer_attention": "false"}, "no cross-layer attention"),
    "no_experts": ({"model.num_experts": "0"}, "single Wukong, no experts"),
    "softmax_attention": ({"model.attention": "softmax"}, "full softmax, not block"),
    "gdpa_attention": ({"model.attention": "gdpa"}, "full GDPA, not block"),
}

flags.DEFINE_string("config", "small", f"preset: one of {sorted(PRESETS)}")
flags.DEFINE_string("override", "", "comma-separated section.field=value applied to the full model "
                    "(after the ablation's own full-model settings, before each variant's change)")
flags.DEFINE_integer("steps", None, "train steps per run (default: the preset's train.steps)")
flags.DEFINE_list("seeds", ["0", "1", "2"], "train.seed of each repetition")
flags.DEFINE_list("variants", ["all"], f"'all' or some of {list(VARIANTS)} (plus full, unless --nowith_full)")
flags.DEFINE_bool("with_full", True, "also run the full model (the paired deltas need it); turn off only "
                  "to split one ablation over parallel processes sharing --workdir, then rerun "
                  "with it on to tabulate (finished runs are reused)")
flags.DEFINE_bool("table_only", False, "train nothing: tabulate the runs already finished in --workdir "
                  "(those with this config and --steps), e.g. after parallel processes hit a time cap")
flags.DEFINE_string("workdir", "runs/ablate", "one subdirectory per variant and seed (reruns resume)")
flags.DEFINE_string("out", "", "JSON results path (default WORKDIR/ablate.json)")


def parse_variants(names: Sequence[str], with_full: bool = True) -> list[str]:
    """'all' or variant names -> ordered list (starting with 'full' when with_full);
    unknown names are errors."""
    names = [n.strip() for n in names if n.strip()]
    if not names or "all" in names:
        names = list(VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise ValueError(f"--variants: unknown {unknown}; choose 'all' or any of {list(VARIANTS)}")
    out = ["full"] if with_full else []
    return out + [n for n in VARIANTS if n in names and n != "full"]


def full_config(config: str, override: str = "") -> Config:
    """The preset as the full teacher, then the user's overrides."""
    return apply_overrides(apply_overrides(get_config(config), FULL), override)


def variant_config(full: Config, variant: str, seed: int, steps: int | None = None) -> Config:
    """full with one component removed or replaced; train.seed=seed, baselines off."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown ablation variant {variant!r}; choose one of {list(VARIANTS)}")
    over = {**VARIANTS[variant][0], "train.seed": str(seed), "train.baselines": "false"}
    if steps is not None:
        over["train.steps"] = str(steps)
    return apply_overrides(full, over)


def interformer_max_len(cfg: Config) -> int:
    """Most sequence tokens one sample can bring to the InterFormer: each sequence's
    data.seq_cap events through the pyramid (ceil(L / block) * pooled per pooling
    level), summed over the sequences."""
    from gemjax.data.synthetic import SEQUENCES
    b = cfg.model.block
    length = cfg.data.synthetic.seq_cap
    for block, pooled, _ in cfg.model.teacher.pyramid_levels or ((b, 4, 1), (b, None, 1)):
        if pooled is not None:
            length = -(-length // block) * pooled
    return length * len(SEQUENCES)


def _jsonable(cfg: Config) -> dict:
    """What train() writes to config.json for cfg (the schema made explicit)."""
    import dataclasses
    from gemjax.config import with_schema
    return json.loads(json.dumps(dataclasses.asdict(with_schema(cfg))))


def finished(cfg: Config, workdir: str) -> dict | None:
    """The summary of a finished run of cfg in workdir, or None (absent, unfinished or
    stopped early). A workdir holding another config is an error."""
    cfg_path, sum_path = (os.path.join(workdir, n) for n in ("config.json", "summary.json"))
    if not os.path.exists(cfg_path):
        return None
    with open(cfg_path) as f:
        saved = json.load(f)
    from gemjax.config import nest_flat_fields
    if nest_flat_fields(saved) != _jsonable(cfg):       # a flat config.json reads as nested
        raise ValueError(f"{workdir} holds a run of another config ({cfg_path}); "
                         f"use a fresh --workdir or remove it")
    if os.path.exists(sum_path):
        with open(sum_path) as f:
            summary = json.load(f)
        if summary.get("steps") == cfg.train.steps and not summary.get("stopped_early"):
            return summary
    return None


def run(cfg: Config, workdir: str, log: Callable[[str], None] = print, **train_kw) -> dict:
    """Train cfg in workdir (resuming) and return its summary; a finished run with the
    same config is read back, not retrained. A workdir holding another config is an error.
    train_kw: passed to gemjax.train.loop.train (mesh, trainer_kw)."""
    from gemjax.train.loop import train

    summary = finished(cfg, workdir)
    if summary is not None:
        log(f"[ablate] reusing {os.path.join(workdir, 'summary.json')}")
        return summary
    return train(cfg, workdir, log=log, **train_kw)


def table(runs: list[dict], variants: Sequence[str]) -> list[dict]:
    """Per variant: eval NE mean/std over seeds, paired delta vs full (same seed), Bayes NE."""
    import numpy as np

    def stats(xs):
        xs = np.asarray(xs, np.float64)
        return float(xs.mean()), float(xs.std(ddof=1)) if len(xs) > 1 else 0.0

    full = {r["seed"]: r["summary"]["eval_ne"] for r in runs if r["variant"] == "full"}
    rows = []
    for v in variants:
        rs = sorted((r for r in runs if r["variant"] == v), key=lambda r: r["seed"])
        if not rs:
            continue
        ne, ne_std = stats([r["summary"]["eval_ne"] for r in rs])
        paired = [r["summary"]["eval_ne"] - full[r["seed"]] for r in rs if r["seed"] in full]
        delta, delta_std = stats(paired) if paired else (float("nan"), float("nan"))
        auc, _ = stats([r["summary"]["eval_auc"] for r in rs])
        bayes, _ = stats([r["summary"]["bayes_ne"] for r in rs])
        rows.append({"variant": v, "what": VARIANTS[v][1], "seeds": [r["seed"] for r in rs],
                     "eval_ne_mean": ne, "eval_ne_std": ne_std, "delta_ne_mean": delta,
                     "delta_ne_std": delta_std, "eval_auc_mean": auc, "bayes_ne_mean": bayes})
    return rows


def format_table(rows: list[dict], steps: int, config: str) -> str:
    n = max((len(r["seeds"]) for r in rows), default=0)
    lines = [f"ablation: config={config} steps={steps} seeds={n} (std over seeds, delta paired by seed)",
             f"{'variant':<18}{'eval NE':>18}{'delta vs full':>20}{'AUC':>8}{'Bayes NE':>10}  what"]
    for r in rows:
        delta = ("—" if r["variant"] == "full"
                 else f"{r['delta_ne_mean']:+.4f} ± {r['delta_ne_std']:.4f}")
        lines.append(f"{r['variant']:<18}{r['eval_ne_mean']:>9.4f} ± {r['eval_ne_std']:.4f}"
                     f"{delta:>20}{r['eval_auc_mean']:>8.4f}{r['bayes_ne_mean']:>10.4f}  {r['what']}")
    return "\n".join(lines)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    try:
        variants = parse_variants(f.variants, f.with_full)
        seeds = parse_seeds(f.seeds)
        full = full_config(f.config, f.override)
        cfgs = {(v, s): variant_config(full, v, s, f.steps) for v in variants for s in seeds}
    except ValueError as e:
        raise app.UsageError(str(e))
    from absl import logging
    logging.set_verbosity(logging.WARNING)   # orbax logs every save at INFO
    out = f.out or os.path.join(f.workdir, "ablate.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    steps = full.train.steps if f.steps is None else f.steps
    if "softmax_attention" in variants and interformer_max_len(full) <= full.model.block:
        print(f"[ablate] note: at most {interformer_max_len(full)} sequence tokens per sample reach "
              f"the InterFormer (model.block={full.model.block}), so softmax_attention equals full")
    if "no_cross_layer" in variants and full.model.wukong_layers < 2:
        print(f"[ablate] note: model.wukong_layers={full.model.wukong_layers}, so the full model has "
              f"no cross-layer attention and no_cross_layer equals full")
    runs = []
    for (v, s), cfg in cfgs.items():
        wd = os.path.join(f.workdir, v, f"seed{s}")
        if f.table_only:
            summary = finished(cfg, wd)
            if summary is None:
                print(f"[ablate] {v} seed {s}: not finished in {wd}, left out of the table")
                continue
        else:
            print(f"[ablate] {v} seed {s} -> {wd}")
            summary = run(cfg, wd, log=lambda line: print(f"  {line}"))
        runs.append({"variant": v, "seed": s, "workdir": wd, "summary": summary,
                     "overrides": VARIANTS[v][0]})
        with open(out, "w") as fh:   # after every run: partial ablations keep their results
            json.dump({"config": f.config, "override": f.override, "full": FULL, "steps": steps,
                       "seeds": seeds, "variants": variants, "runs": runs,
                       "table": table(runs, variants)}, fh, indent=1)
    print(f"\nwrote {out}")
    print(format_table(table(runs, variants), steps, f.config))


if __name__ == "__main__":
    app.run(main)
