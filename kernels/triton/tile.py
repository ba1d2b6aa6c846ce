"""In-kernel pieces of the Triton engine: activations and their derivatives (exact, and
through tanh.approx for 16-bit inputs), dots, the pair mask of a tile, RoPE-rotated tile
loads and stores, the masked / interior / masked loop."""

import functools
import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

F32 = jnp.float32


def _erf(x):
    """Abramowitz-Stegun 7.1.26, |error| < 1.5e-7 (Triton has no erf lowering)."""
    a = jnp.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    y = 1.0 - t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (
        -1.453152027 + t * 1.061405429)))) * jnp.exp(-a * a)
    return jnp.where(x >= 0, y, -y)


def act_and_grad(s, activation):
    """(act(s), act'(s)) in float32, written with ops the Triton lowering has."""
    if activation == "identity":
        return s, jnp.ones_like(s)
    if activation == "relu":
        return jnp.maximum(s, 0.0), (s > 0).astype(F32)
    if activation == "silu":
        sig = 1.0 / (1.0 + jnp.exp(-s))
        return s * sig, sig * (1.0 + s * (1.0 - sig))
    if activation == "gelu":
        cdf = 0.5 * (1.0 + _erf(s * (1.0 / math.sqrt(2.0))))
        pdf = jnp.exp(-0.5 * s * s) * (1.0 / math.sqrt(2.0 * math.pi))
        return s * cdf, cdf + s * pdf
    if activation == "gelu_tanh":
        c = math.sqrt(2.0 / math.pi)
        t = jnp.tanh(c * (s + 0.044715 * s * s * s))
        return 0.5 * s * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * s * (1.0 - t * t) * c * (
            1.0 + 3.0 * 0.044715 * s * s)
    raise ValueError(f"unknown activation {activation!r}")


def _tanh(x, interpret):
    """tanh.approx.f32 on GPU (one MUFU op, max rel. error ~2^-11); jnp.tanh in interpret mode."""
    return jnp.tanh(x) if interpret else plgpu.approx_tanh(x)


def fast_act_and_grad(s, activation, interpret, need_grad=True):
    """(act(s), act'(s) or None) through tanh.approx, for silu and gelu_tanh; else exact.

    silu(s) = h + h tanh(h) with h = s/2 (sigmoid(s) = 1/2 + tanh(s/2)/2): one MUFU op
    and no division, where the exact form needs exp and a full-precision divide.
    Accurate to ~5e-4 relative: used for 16-bit inputs only.
    """
    if activation == "silu":
        h = 0.5 * s
        t = _tanh(h, interpret)
        a = h + h * t
        if not need_grad:
            return a, None
        sig = 0.5 + 0.5 * t
        return a, sig + a * (1.0 - sig)
    if activation == "gelu_tanh":
        c = math.sqrt(2.0 / math.pi)
        t = _tanh(c * (s + 0.044715 * s * s * s), interpret)
        a = 0.5 * s * (1.0 + t)
        if not need_grad:
            return a, None
        return a, 0.5 * (1.0 + t) + 0.5 * s * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * s * s)
    a, da = act_and_grad(s, activation)
    return a, (da if need_grad else None)


def tile_act_grad(s, cfg):
    """(act(s), act'(s)) of a GDPA score tile, through tanh.approx with cfg.fast_act."""
    if cfg.fast_act:
        return fast_act_and_grad(s, cfg.activation, cfg.interpret)
    return act_and_grad(s, cfg.activation)


def tile_act(s, cfg):
    """act(s) of a GDPA score tile (the forward's: no derivative)."""
    if cfg.fast_act:
        return fast_act_and_grad(s, cfg.activation, cfg.interpret, need_grad=False)[0]
    if cfg.activation == "silu":
        return s / (1.0 + jnp.exp(-s))
    return act_and_grad(s, cfg.activation)[0]


LOG2E = math.log2(math.e)


def _dot(a, b, dims):
    # float32 operands: HIGHEST (IEEE) — the Triton default would be TF32 (~5e-4 error).
    prec = lax.Precision.HIGHEST if a.dtype == F32 else None
    return lax.dot_general(a, b, (dims, ((), ())), precision=prec, preferred_element_type=F32)


def dot_nt(a, b):
    """[M, K] x [N, K] -> [M, N] float32."""
    return _dot(a, b, ((1,), (1,)))


def dot_nn(a, b):
    """[M, K] x [K, N] -> [M, N] float32."""
    return _dot(a, b, ((1,), (0,)))


def dot_tn(a, b):
    """[K, M] x [K, N] -> [M, N] float32."""
    return _dot(a, b, ((0,), (0,)))


def tile_mask(cfg, qs, qp, ks, kp, masked=True):
    """Pair mask of a tile, or None for an interior tile (every pair valid)."""
    if not masked:
        return None
    m = qs[:, None] == ks[None, :]
    if cfg.causal or cfg.window is not None:
        d = qp[:, None] - kp[None, :]
        if cfg.causal:
            m &= d >= 0
        if cfg.window is not None:
            m &= (d < cfg.window) if cfg.causal else (jnp.abs(d) < cfg.window)
    if cfg.block is not None:
        m &= (qp[:, None] // cfg.block) == (kp[None, :] // cfg.block)
    return m


# ---------------------------------------------------------------- tile loads (RoPE)

def load_parts(ref, rows, cs, cfg):
    """Tile of `ref` ([T, D] view) at `rows` as a tuple of dot operands.

    Without rope: (x,). With rope: the rotated halves (x1 c - x2 s, x2 c + x1 s).
    """
    if not cfg.rope:
        return (ref[rows, :],)
    half = ref.shape[-1] // 2
    x1 = ref[rows, pl.ds(0, half)]
    x2 = ref[rows, pl.ds(half, half)]
    c, s = cs
    dt = x1.dtype
    x1, x2 = x1.astype(F32), x2.astype(F32)
    return ((x1 * c - x2 * s).astype(dt), (x2 * c + x1 * s).astype(dt))


def load_cos_sin(cos_ref, sin_ref, rows, cfg):
    """(cos, sin) [rows, D/2] of the RoPE tables at `rows`, or None without rope."""
    if not cfg.rope:
        return None
    return cos_ref[rows, :], sin_ref[rows, :]


def store_parts(ref, rows, parts, cs, cfg):
    """Store a gradient given w.r.t. the rotated halves, rotated back (RoPE^T)."""
    if not cfg.rope:
        ref[rows, :] = parts[0].astype(ref.dtype)
        return
    half = ref.shape[-1] // 2
    g1, g2 = parts
    c, s = cs
    ref[rows, pl.ds(0, half)] = (g1 * c + g2 * s).astype(ref.dtype)
    ref[rows, pl.ds(half, half)] = (g2 * c - g1 * s).astype(ref.dtype)


def where_masked(m, x, other):
    """x where the mask m holds, else other; x itself for m None (an interior tile)."""
    return x if m is None else jnp.where(m, x, other)


def three_loops(lo, flo, fhi, hi, body, init, cfg):
    """fori over [lo, hi) with body(j, carry, masked): tiles in [flo, fhi) are interior."""
    c = lax.fori_loop(lo, flo, functools.partial(body, masked=True), init)
    c = lax.fori_loop(flo, fhi, functools.partial(body, masked=False), c)
    return lax.fori_loop(fhi, hi, functools.partial(body, masked=True), c)


def scores(qp, kp):
    """S = Q K^T [BQ, BK] float32 from load_parts' operands (the halves summed with rope)."""
    s = dot_nt(qp[0], kp[0])
    for a, b in zip(qp[1:], kp[1:]):
        s += dot_nt(a, b)
    return s
