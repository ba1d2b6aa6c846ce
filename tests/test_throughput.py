"""Throughput meter with a fake clock, and the progress-line format."""

import math

import pytest

from gemjax.train.throughput import Throughput, format_duration, format_si, progress_line


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_rates_over_sliding_window_and_eta():
    clock = FakeClock()
    meter = Throughput(window=3, clock=clock)
    assert math.isnan(meter.samples_per_sec) and math.isnan(meter.eta(5))
    meter.update(samples=999, tokens=999)  # opens the clock (compile step): not counted
    assert math.isnan(meter.samples_per_sec)
    # step durations 1, 2, 3, 4 s; samples 10, 20, 30, 40; tokens 100x
    for dt, n in [(1, 10), (2, 20), (3, 30), (4, 40)]:
        clock.t += dt
        meter.update(samples=n, tokens=100 * n)
    # window = last 3 steps: 9 s, 90 samples, 9000 tokens
    assert meter.samples_per_sec == pytest.approx(90 / 9)
    assert meter.tokens_per_sec == pytest.approx(9000 / 9)
    assert meter.seconds_per_step == pytest.approx(3.0)
    assert meter.eta(10) == pytest.approx(30.0)
    assert meter.eta(0) == 0.0
    assert meter.total_samples_per_sec == pytest.approx(100 / 10)
    assert meter.total_samples == 100 and meter.steps == 4


def test_paused_time_is_excluded_and_reset_forgets():
    clock = FakeClock()
    meter = Throughput(window=10, clock=clock)
    meter.update(samples=0)
    clock.t += 2
    meter.update(samples=8)
    with meter.paused():
        clock.t += 50  # eval
    clock.t += 2
    meter.update(samples=8)
    assert meter.samples_per_sec == pytest.approx(16 / 4)
    assert meter.total_samples_per_sec == pytest.approx(16 / 4)
    meter.reset()
    assert math.isnan(meter.samples_per_sec) and meter.total_samples == 0
    meter.update(samples=5)
    clock.t += 5
    meter.update(samples=5)
    assert meter.samples_per_sec == pytest.approx(1.0)


def test_bad_input():
    with pytest.raises(ValueError, match="window"):
        Throughput(window=0)
    with pytest.raises(ValueError, match="samples"):
        Throughput().update(samples=-1)


@pytest.mark.parametrize("value, text", [(0, "0.00"), (7.5, "7.50"), (999, "999"), (1234, "1.23k"),
                                         (56_700, "56.7k"), (5.6e6, "5.60M"), (2e9, "2.00G"),
                                         (math.nan, "nan"), (None, "nan")])
def test_format_si(value, text):
    assert format_si(value) == text


@pytest.mark.parametrize("seconds, text", [(0, "0s"), (44.6, "45s"), (185, "3m05s"),
                                           (3720, "1h02m"), (183600, "2d03h"),
                                           (math.nan, "?"), (None, "?"), (-1, "?")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


def test_progress_line():
    line = progress_line(120, 1000, 0.52341, 0.81234, 12345.0, 3720)
    assert line == "step  120/1000 ( 12.0%) | loss 0.5234 | ne 0.8123 | 12.3k samples/s | eta 1h02m"
    line = progress_line(1, 10, float("nan"), None, math.nan, math.nan, tokens_per_sec=2.5e6)
    assert line == "step  1/10 ( 10.0%) | loss nan | ne - | nan samples/s | 2.50M tokens/s | eta ?"
