"""Train a GEM model on the synthetic planted-teacher stream.

    python experiments/train.py --config=small --workdir=runs/small
    python experiments/train.py --config=tiny --steps=50 --override=model.dim=16,data.batch_size=128

Writes WORKDIR/metrics.jsonl and WORKDIR/summary.json; rerunning with the same
workdir resumes. With train.baselines (default on for `small`), a logistic
regression and the same model without sequence inputs train on the same
stream for the same steps, under WORKDIR/baselines/, and the summary reports
all three next to the Bayes-optimal NE.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags, logging  # noqa: E402

from gemjax.config import PRESETS, apply_overrides, get_config  # noqa: E402

flags.DEFINE_string("config", "small", f"preset: one of {sorted(PRESETS)}")
flags.DEFINE_string("workdir", "runs/default", "output directory (resumes if it holds checkpoints)")
flags.DEFINE_integer("steps", None, "train steps (overrides the preset)")
flags.DEFINE_integer("eval_every", None, "eval interval in steps")
flags.DEFINE_integer("seed", None, "seed of data, teacher and init")
flags.DEFINE_integer("batch_size", None, "global batch size")
flags.DEFINE_bool("baselines", None, "also train LR and the no-sequence model (same stream)")
flags.DEFINE_string("override", "", "comma-separated section.field=value (tuples as 64:64), "
                    "e.g. model.dim=32,data.seq_median=64")


def build_config():
    f = flags.FLAGS
    cfg = get_config(f.config)
    over = {}
    for flag, path in (("steps", "train.steps"), ("eval_every", "train.eval_every"),
                       ("seed", "train.seed"), ("batch_size", "data.batch_size"),
                       ("baselines", "train.baselines")):
        if getattr(f, flag) is not None:
            over[path] = str(getattr(f, flag))
    cfg = apply_overrides(cfg, over)
    return apply_overrides(cfg, f.override)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    try:
        cfg = build_config()
    except ValueError as e:
        raise app.UsageError(str(e))
    logging.set_verbosity(logging.WARNING)   # orbax logs every save at INFO
    from gemjax.train.loop import train  # after flags: importing jax is slow

    workdir = flags.FLAGS.workdir
    summary = train(cfg, workdir)
    if cfg.train.baselines:
        summary["baselines"] = {}
        variants = {"logistic_regression": apply_overrides(cfg, {"model.kind": "lr"}),
                    "no_sequences": apply_overrides(cfg, {"model.use_sequences": "false"})}
        for name, vcfg in variants.items():
            vcfg = dataclasses.replace(vcfg, train=dataclasses.replace(vcfg.train, baselines=False))
            print(f"[gemjax] baseline {name}")
            s = train(vcfg, os.path.join(workdir, "baselines", name))
            summary["baselines"][name] = {k: s[k] for k in ("eval_ne", "eval_auc", "samples_per_sec")}
        with open(os.path.join(workdir, "summary.json"), "w") as fh:
            json.dump(summary, fh, indent=1)
    print(f"[gemjax] summary ({workdir}/summary.json):")
    rows = [(summary["model"], summary)] + list(summary.get("baselines", {}).items())
    print(f"  {'model':<22}{'eval NE':>10}{'eval AUC':>10}")
    for name, s in rows:
        print(f"  {name:<22}{s['eval_ne']:>10.4f}{s['eval_auc']:>10.4f}")
    print(f"  {'bayes-optimal':<22}{summary['bayes_ne']:>10.4f}{summary['bayes_auc']:>10.4f}")


if __name__ == "__main__":
    app.run(main)
