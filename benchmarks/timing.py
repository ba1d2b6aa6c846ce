"""Blocking per-call timing shared by the kernel benchmarks."""

from __future__ import annotations

import time

import jax
import numpy as np


def timed(fn, args, warmup: int, iters: int):
    """(median ms over `iters` calls of fn(*args), each blocked on, after `warmup`
    untimed calls; the last output)."""
    out = None
    for _ in range(warmup):
        out = jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(ts)), out
