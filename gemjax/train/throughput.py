"""Training throughput (samples/s, sequence tokens/s, ETA) and the progress line.

    meter = Throughput(window=20)          # clock defaults to time.perf_counter
    for step in range(start, total):
        state, loss = train_step(state, batch)
        meter.update(samples=B, tokens=T)  # after the step's result is ready
        with meter.paused():               # eval / checkpoint time is not training
            run_eval()
        print(progress_line(step + 1, total, loss, ne, meter.samples_per_sec,
                            meter.eta(total - step - 1)))

Rates are over the last `window` steps: sum of their samples (tokens) divided by
the wall time between the update that opened the window and the newest
update. The first update only marks the start (its interval includes jit
compilation, unless the caller calls `reset()` after the first step), so every
rate is nan until two updates have happened. `total_samples_per_sec` averages
over everything since construction or `reset()`, excluding paused time;
`steady_samples_per_sec` / `steady_tokens_per_sec` over every update after the
first counted one (whose interval holds the compilation when the meter is opened
before the first step), and `first_interval` is that interval's (seconds, samples).
Every time a caller sees is in seconds from the injected clock, so tests use a
fake clock.

Call `update` only once the step's outputs are ready (e.g. after reading the
loss as a float), otherwise async dispatch makes the rates meaningless.
"""

from __future__ import annotations

import collections
import contextlib
import math
import time
from typing import Callable


class Throughput:
    """Sliding-window samples/s and tokens/s, and ETA from seconds per step."""

    def __init__(self, window: int = 20, clock: Callable[[], float] = time.perf_counter):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self._clock = clock
        self.reset()

    def _now(self) -> float:
        return self._clock() - self._paused_total

    def reset(self) -> None:
        """Forget all history; the next update only marks the start."""
        self._marks: collections.deque = collections.deque(maxlen=self.window + 1)
        self._paused_total = 0.0
        self._pause_started: float | None = None
        self._first: float | None = None
        self.total_samples = 0
        self.total_tokens = 0
        self.steps = 0
        self._steady_from: tuple[float, int, int] | None = None   # (time, samples, tokens)

    def update(self, samples: int, tokens: int = 0) -> None:
        """Record one finished step of `samples` samples and `tokens` sequence tokens."""
        if samples < 0 or tokens < 0:
            raise ValueError(f"samples ({samples}) and tokens ({tokens}) must be >= 0")
        if self._pause_started is not None:
            raise RuntimeError("update() called while paused")
        now = self._now()
        if self._first is None:
            self._first = now
        else:  # the first update opens the clock; its work is not counted
            self.total_samples += samples
            self.total_tokens += tokens
            self.steps += 1
            if self.steps == 1:
                self._steady_from = (now, self.total_samples, self.total_tokens)
        self._marks.append((now, samples, tokens))

    @contextlib.contextmanager
    def paused(self):
        """Time spent inside this block does not count (eval, checkpointing)."""
        self._pause_started = self._clock()
        try:
            yield
        finally:
            self._paused_total += self._clock() - self._pause_started
            self._pause_started = None

    def _window(self) -> tuple[float, int, int, int]:
        """(seconds, samples, tokens, steps) over the window; steps=0 if empty."""
        if len(self._marks) < 2:
            return 0.0, 0, 0, 0
        marks = list(self._marks)
        seconds = marks[-1][0] - marks[0][0]
        samples = sum(m[1] for m in marks[1:])
        tokens = sum(m[2] for m in marks[1:])
        return seconds, samples, tokens, len(marks) - 1

    @staticmethod
    def _rate(amount: float, seconds: float) -> float:
        return amount / seconds if seconds > 0 else math.nan

    @property
    def samples_per_sec(self) -> float:
        seconds, samples, _, steps = self._window()
        return self._rate(samples, seconds) if steps else math.nan

    @property
    def tokens_per_sec(self) -> float:
        seconds, _, tokens, steps = self._window()
        return self._rate(tokens, seconds) if steps else math.nan

    @property
    def seconds_per_step(self) -> float:
        seconds, _, _, steps = self._window()
        return seconds / steps if steps else math.nan

    @property
    def total_samples_per_sec(self) -> float:
        if self._first is None or self.steps == 0:
            return math.nan
        return self._rate(self.total_samples, self._marks[-1][0] - self._first)

    @property
    def first_interval(self) -> tuple[float | None, int]:
        """(seconds, samples) of the first counted update; (None, 0) before it."""
        if self._steady_from is None:
            return None, 0
        return self._steady_from[0] - self._first, self._steady_from[1]

    def _steady_rate(self, index: int) -> float:
        if self._steady_from is None or self.steps < 2:
            return math.nan
        amount = (self.total_samples, self.total_tokens)[index - 1] - self._steady_from[index]
        return self._rate(amount, self._marks[-1][0] - self._steady_from[0])

    @property
    def steady_samples_per_sec(self) -> float:
        """Samples/s over the updates after the first counted one (nan before two)."""
        return self._steady_rate(1)

    @property
    def steady_tokens_per_sec(self) -> float:
        return self._steady_rate(2)

    def eta(self, remaining_steps: int) -> float:
        """Seconds for `remaining_steps` more steps at the window's pace (nan if unknown)."""
        if remaining_steps <= 0:
            return 0.0
        return remaining_steps * self.seconds_per_step


def format_si(value: float) -> str:
    """1234 -> '1.23k', 5.6e6 -> '5.60M'; 3 significant digits; 'nan' for nan."""
    if value is None or not math.isfinite(value):
        return "nan"
    for div, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= div:
            scaled = value / div
            break
    else:
        scaled, suffix = value, ""
    digits = 2 if abs(scaled) < 10 else 1 if abs(scaled) < 100 else 0
    return f"{scaled:.{digits}f}{suffix}"


def format_duration(seconds: float | None) -> str:
    """Human ETA: '45s', '3m05s', '1h02m', '2d03h'; '?' when unknown."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _num(value, fmt: str) -> str:
    if value is None:
        return "-"
    value = float(value)
    return format(value, fmt) if math.isfinite(value) else str(value)


def progress_line(step: int, total: int, loss, ne, samples_per_sec, eta_s,
                  tokens_per_sec=None) -> str:
    """One log line, e.g.
    'step   120/1000 ( 12.0%) | loss 0.5234 | ne 0.8123 | 12.3k samples/s | eta 1h02m'.

    loss and ne may be None (shown as '-') or nan (shown as 'nan'); tokens/s is
    appended when given.
    """
    width = len(str(total))
    pct = 100.0 * step / total if total > 0 else math.nan
    parts = [f"step {step:>{width}d}/{total} ({pct:5.1f}%)",
             f"loss {_num(loss, '.4f')}",
             f"ne {_num(ne, '.4f')}",
             f"{format_si(samples_per_sec)} samples/s"]
    if tokens_per_sec is not None:
        parts.append(f"{format_si(tokens_per_sec)} tokens/s")
    parts.append(f"eta {format_duration(eta_s)}")
    return " | ".join(parts)
