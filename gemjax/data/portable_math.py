"""exp, log and pow that give the same bits on every IEEE-754 machine.

numpy's transcendental functions pick a SIMD implementation at run time (AVX2,
AVX-512, or the C library), and BLAS picks a kernel per CPU type; their last bits
differ between them. A data stream that must be a pure function of its seed on any
host (resume on another machine, processes of one job on mixed hosts) uses these
instead: every step below is one correctly rounded IEEE operation (+, -, *, /,
rint, frexp, ldexp, comparisons), each a separate numpy call, so no vector width,
operation order or fused multiply-add can change a result.

    exp(x)        float64 array -> float64 array; error below 2 ulp
    log(x)        float64 array -> float64 array; error below 2 ulp (x <= 0: -inf / nan)
    pow(x, y)     exp(y * log(x)) for x > 0; relative error below ~(2 + |y log x|) ulp
    dot(a, w)     a [N, F] @ w [F] as a left-to-right sum over F (no BLAS)

Inputs are converted to float64 arrays; outputs are new float64 arrays (scalars in,
0-d arrays out). Special values follow the C library: exp(-inf) = 0, exp(inf) = inf,
overflow to inf, underflow to 0 through subnormals; log(0) = -inf, log(inf) = inf,
log(negative) = nan; nan stays nan.
"""

from __future__ import annotations

import numpy as np

# ln 2 split so that k * _LN2_HI is exact for |k| < 2**11 (Cody and Waite's reduction).
_LN2_HI = 6.93147180369123816490e-01     # 0x3FE62E42FEE00000: 32 significant bits
_LN2_LO = 1.90821492927058770002e-10     # ln 2 - _LN2_HI
_INV_LN2 = 1.44269504088896338700e+00
_EXP_MAX = 709.782712893384              # exp overflows above
_EXP_MIN = -745.1332191019412            # exp(x) rounds to 0 below

# 1 / n! for the Taylor series of exp on |r| <= ln2 / 2 (truncation error < 1e-18).
_EXP_COEFS = tuple(1.0 / float(np.prod(np.arange(1, n + 1, dtype=np.float64))) for n in range(14))
# 1 / (2n + 1) for log(m) = 2 atanh(s), s = (m - 1) / (m + 1), |s| <= 0.1716.
_ATANH_COEFS = tuple(1.0 / (2 * n + 1) for n in range(13))
_SQRT_HALF = 0.70710678118654752440


_CHUNK = 16_384      # elements per pass: the ~30 passes of a chunk stay in the L2 cache


def _chunked(fn, x) -> np.ndarray:
    """fn over a flat float64 copy of x, chunk by chunk (bits independent of the chunking:
    every operation is elementwise)."""
    x = np.array(x, np.float64)
    flat = x.reshape(-1)
    out = np.empty_like(flat)
    with np.errstate(all="ignore"):              # special values are fixed up in fn
        for i in range(0, flat.size, _CHUNK):
            out[i:i + _CHUNK] = fn(flat[i:i + _CHUNK])
    return out.reshape(x.shape)


def exp(x) -> np.ndarray:
    """e**x, elementwise, for a float64 array (see the module docstring)."""
    return _chunked(_exp, x)


def _exp(x: np.ndarray) -> np.ndarray:
    k = x * _INV_LN2
    np.rint(k, out=k)
    np.clip(k, -1100.0, 1100.0, out=k)           # finite for +-inf / huge inputs; nan stays
    r = k * _LN2_HI                              # exact: k * _LN2_HI has <= 43 significant bits
    np.subtract(x, r, out=r)
    r -= k * _LN2_LO
    p = np.full_like(r, _EXP_COEFS[-1])
    for c in _EXP_COEFS[-2::-1]:                 # Horner, one operation per call
        p *= r
        p += c
    k_int = k.astype(np.int64)                   # nan -> some integer: fixed up below
    # two ldexp steps: 2**k alone can overflow (or underflow) where p * 2**k does not
    half = k_int >> 1
    k_int -= half
    out = np.ldexp(p, half, out=p)
    np.ldexp(out, k_int, out=out)
    if not ((x <= _EXP_MAX) & (x >= _EXP_MIN)).all():   # rare: out of range, inf, nan
        out[x > _EXP_MAX] = np.inf
        out[x < _EXP_MIN] = 0.0
        nan = np.isnan(x)
        out[nan] = x[nan]
    return out


def log(x) -> np.ndarray:
    """Natural logarithm, elementwise, for a float64 array (see the module docstring)."""
    return _chunked(_log, x)


def _log(x: np.ndarray) -> np.ndarray:
    m, e = np.frexp(x)                           # x = m * 2**e, m in [0.5, 1) (subnormals too)
    small = m < _SQRT_HALF
    e = e.astype(np.float64)
    e -= small                                   # m in [sqrt(1/2), sqrt(2)) after the doubling
    np.ldexp(m, small.view(np.int8), out=m)
    s = m + 1.0
    m -= 1.0
    np.divide(m, s, out=s)                       # s = (m - 1) / (m + 1)
    s2 = s * s
    p = np.full_like(s, _ATANH_COEFS[-1])
    for c in _ATANH_COEFS[-2::-1]:
        p *= s2
        p += c
    p *= s                                       # atanh(s)
    p *= 2.0                                     # log(m)
    out = e * _LN2_LO
    out += p
    e *= _LN2_HI                                 # exact product (e has <= 11 bits)
    out += e
    if not ((x > 0.0) & (x < np.inf)).all():     # rare: zero, negative, inf, nan
        out[x == 0.0] = -np.inf
        out[x < 0.0] = np.nan
        out[np.isposinf(x)] = np.inf
        nan = np.isnan(x)
        out[nan] = x[nan]
    return out


def pow(x, y) -> np.ndarray:  # noqa: A001 (the field's name for x**y)
    """x**y for x > 0 (elementwise, broadcasting), as exp(y * log(x))."""
    return exp(np.multiply(y, log(x)))


def dot(a, w) -> np.ndarray:
    """a [N, F] @ w [F] -> [N] float64, summed left to right over F (no BLAS kernel)."""
    a = np.asarray(a, np.float64)
    w = np.asarray(w, np.float64)
    if a.ndim != 2 or w.shape != (a.shape[1],):
        raise ValueError(f"dot: expected a [N, F] and w [F], got {a.shape} and {w.shape}")
    out = np.zeros(a.shape[0], np.float64)
    for j in range(a.shape[1]):
        out += a[:, j] * w[j]
    return out
