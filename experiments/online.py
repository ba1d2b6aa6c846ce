"""Continuous online training on the drifting synthetic stream (gemjax.train.online).

    python -m experiments.online --workdir=runs/online
    python -m experiments.online --config=tiny --windows=4 --override=data.drift_every=5

Trains a teacher continuously, window after window, next to a copy frozen after the
warm-up, each window validated before it is trained on (progressive validation), with
new item ids admitted by frequency. Prints one line per window and the per-window NE
table at the end; WORKDIR holds metrics.jsonl (one "window" row per window),
summary.json and the checkpoints (rerunning the command resumes; SIGTERM stops after
the current window's checkpoint).
"""

from __future__ import annotations

import argparse
import sys

from gemjax.config import apply_overrides, get_config
from gemjax.train.guards import Interrupted
from gemjax.train.online import OnlineSpec, run_online

# The online stream on top of the preset: windows of 20 steps, 40% fresh teacher
# parameters per window, item popularity moving, 5% of items never seen before;
# per-item biases make the item ids (and their admission) matter.
STREAM = ("data.drift_every=20,data.drift_strength=0.4,data.popularity_shift=3,"
          "data.new_id_rate=0.05,data.item_bias=0.5,train.warmup_steps=10")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="tiny", help="config preset (gemjax.config.PRESETS)")
    p.add_argument("--override", default="", help="comma-separated field=value, after the "
                   "stream settings (STREAM)")
    p.add_argument("--workdir", default="runs/online")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--warmup_windows", type=int, default=1, help="windows before the frozen copy")
    p.add_argument("--min_count", type=int, default=2, help="sightings before an id gets its row")
    p.add_argument("--buckets", type=int, default=16, help="shared rows of ids not admitted")
    p.add_argument("--item_rows", type=int, default=2048, help="rows of the item table (raw item "
                   "ids are unbounded: admitted ids take rows until they run out)")
    a = p.parse_args(argv)
    cfg = apply_overrides(get_config(a.config), STREAM + ("," + a.override if a.override else ""))
    spec = OnlineSpec(windows=a.windows, warmup_windows=a.warmup_windows, min_count=a.min_count,
                      buckets=a.buckets, table_rows=(("item", a.item_rows),))
    try:
        summary = run_online(cfg, a.workdir, spec)
    except Interrupted as e:
        print(f"[online] {e}", flush=True)
        return 130
    print(f"[online] fresh teacher ahead of the frozen one on every window after the drift: "
          f"{summary['fresh_ahead_after_drift']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
