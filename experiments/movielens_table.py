"""One table from several experiments/movielens.py result files.

    python -m experiments.movielens_table --dir=$OUT          # reads $OUT/ml1m_*.json

Columns: test HR@10 / NDCG@10 / HR@50 / NDCG@50 with the history window excluded
(the published protocol), HR@10 with it kept, the early-stopped model's HR@10
(select=valid), the epochs used, seconds per training epoch, wall seconds.
"""

from __future__ import annotations

import glob
import json
import os

from absl import app, flags


def define_flags() -> None:
    flags.DEFINE_string("dir", ".", "directory holding the result files")
    flags.DEFINE_string("pattern", "ml1m_*.json", "file name pattern inside --dir")


def rows(paths):
    """-> list of (name, results dict); unreadable files become a row with an error."""
    out = []
    for p in sorted(paths):
        name = os.path.basename(p)[:-5].removeprefix("ml1m_")
        try:
            with open(p) as fh:
                out.append((name, json.load(fh)))
        except (OSError, ValueError) as e:
            out.append((name, {"error": str(e)}))
    return out


def table(results) -> str:
    head = (f"{'variant':18s} {'from':6s} {'ep':>4s} {'HR@10':>7s} {'NDCG@10':>8s} {'HR@50':>7s} "
            f"{'NDCG@50':>8s} {'HR@10 kept':>10s} {'HR@10 es':>8s} {'s/ep':>5s} {'wall':>5s}")
    lines = [head, f"{'SASRec published':18s} {'':6s} {'':>4s} {0.2853:7.4f} {0.1603:8.4f} "
             f"{0.5474:7.4f} {0.2185:8.4f}",
             f"{'HSTU published':18s} {'':6s} {'':>4s} {0.3097:7.4f} {0.1720:8.4f} "
             f"{0.5754:7.4f} {0.2307:8.4f}"]
    for name, r in results:
        if "test" not in r:
            lines.append(f"{name:18s} no result ({r.get('error', 'incomplete file')})")
            continue
        t, k = r["test"], r["test_unmasked"]
        es = r.get("test_early_stopped", {}).get("hr@10")
        phases = [r[p] for p in ("select_phase", "refit_phase", "fixed_phase") if p in r]
        ep_s = [s for p in phases for s in p["epoch_s"][1:]]     # first epoch includes compile
        lines.append(
            f"{name:18s} {r['test_from'][:6]:6s} {r['epochs_picked']:4d} {t['hr@10']:7.4f} "
            f"{t['ndcg@10']:8.4f} {t['hr@50']:7.4f} {t['ndcg@50']:8.4f} {k['hr@10']:10.4f} "
            f"{(f'{es:.4f}' if es is not None else '-'):>8s} "
            f"{(sum(ep_s) / len(ep_s) if ep_s else float('nan')):5.2f} {r['wall_s']:5.0f}")
    return "\n".join(lines)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    paths = glob.glob(os.path.join(flags.FLAGS.dir, flags.FLAGS.pattern))
    if not paths:
        raise SystemExit(f"movielens_table: no {flags.FLAGS.pattern} in {flags.FLAGS.dir}")
    print(table(rows(paths)))


if __name__ == "__main__":
    define_flags()
    app.run(main)
