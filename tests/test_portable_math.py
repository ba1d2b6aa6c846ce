"""gemjax.data.portable_math against the C library's float64 functions and exact sums."""

import math

import numpy as np
import pytest

from gemjax.data import portable_math as pm


def _ulps(got, ref):
    return np.max(np.abs(got - ref) / np.spacing(np.abs(ref)))


@pytest.mark.parametrize("lo,hi", [(-1.0, 1.0), (-700.0, 709.0), (-745.0, -708.0)])
def test_exp_is_within_two_ulp_of_libm(lo, hi):
    x = np.random.default_rng(0).uniform(lo, hi, 200_000)
    ref = np.array([math.exp(v) for v in x[:20_000]])
    got = pm.exp(x)
    normal = ref > 2.3e-308                      # subnormal results: compare absolutely
    assert _ulps(got[:20_000][normal], ref[normal]) <= 2
    assert np.max(np.abs(got[:20_000][~normal] - ref[~normal]), initial=0) <= 5e-324
    assert _ulps(got, np.exp(x)) <= 2


@pytest.mark.parametrize("lo,hi", [(-700.0, 700.0), (-1e-6, 1e-6), (-0.4, 0.4)])
def test_log_is_within_three_ulp_of_libm(lo, hi):
    x = np.exp(np.random.default_rng(1).uniform(lo, hi, 200_000))   # x > 0 around 1 or wide
    ref = np.array([math.log(v) for v in x[:20_000]])
    assert _ulps(pm.log(x)[:20_000], ref) <= 3 or np.max(np.abs(pm.log(x)[:20_000] - ref)) < 3e-16


def test_special_values_follow_the_c_library():
    x = np.array([0.0, -0.0, -np.inf, np.inf, np.nan, 709.79, -745.2, 5e-324])
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(pm.exp(x), np.exp(x))
    y = np.array([0.0, -0.0, -1.0, np.inf, -np.inf, np.nan, 1.0, 5e-324, 1e-310, 1.7976931348623157e308])
    with np.errstate(all="ignore"):
        ref = np.log(y)
    got = pm.log(y)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    fin = ~np.isnan(ref)
    np.testing.assert_allclose(got[fin], ref[fin], rtol=1e-15)


def test_shapes_scalars_and_chunk_independence(monkeypatch):
    x = np.random.default_rng(2).uniform(-5, 5, (3, 7001))
    a = pm.exp(x)
    assert a.shape == x.shape and pm.exp(0.5).shape == () and float(pm.log(1.0)) == 0.0
    monkeypatch.setattr(pm, "_CHUNK", 1000)      # other chunk boundaries, the same bits
    np.testing.assert_array_equal(pm.exp(x), a)
    b = pm.log(np.abs(x) + 1e-3)
    monkeypatch.setattr(pm, "_CHUNK", 16_384)
    np.testing.assert_array_equal(pm.log(np.abs(x) + 1e-3), b)


def test_pow_and_dot_against_float64_references():
    rng = np.random.default_rng(3)
    x = rng.uniform(1.0, 5001.0, 50_000)
    for y in (1 / (1 - 1.05), -0.05, 0.5, 3.0):
        bound = (4 + abs(y) * math.log(5001.0)) * np.finfo(np.float64).eps   # the docstring's
        np.testing.assert_allclose(pm.pow(x, y), x ** y, rtol=bound)
    a = rng.normal(size=(257, 13))
    w = rng.normal(size=13)
    exact = np.array([math.fsum(a[i] * w) for i in range(a.shape[0])])
    np.testing.assert_allclose(pm.dot(a, w), exact, rtol=1e-13, atol=1e-15)
    # left to right: the same bits as a plain Python loop of the same operations
    loop = np.array([sum((a[i, j] * w[j] for j in range(13)), 0.0) for i in range(a.shape[0])])
    np.testing.assert_array_equal(pm.dot(a, w), loop)
    with pytest.raises(ValueError, match=r"dot: expected a \[N, F\] and w \[F\]"):
        pm.dot(a, w[:3])
