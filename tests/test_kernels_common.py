"""Float64 numpy references for the attention kernels (per-sample, padded dense), and
tests of the shared pieces in kernels/common.py and kernels/triton.

The references here are written independently of kernels/: per sample, dense
[H, Lq, Lk] scores in float64 with hand-derived gradients. Other kernel tests
import them.
"""

import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.special import erf

from kernels.common import pair_mask, rope, segment_layout
from kernels.triton.layout import build_layout
from kernels.triton.tile import act_and_grad
from kernels.triton.tuning import FlashConfig

# ------------------------------------------------------------------ helpers


def offsets_of(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def rel_err(got, want):
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def tol(dtype):
    return 2e-2 if jnp.dtype(dtype) == jnp.bfloat16 else 1e-5


def random_qkv(rng, tq, tk, h, d, dtype, scale=0.5):
    q = jnp.asarray(rng.normal(size=(tq, h, d)) * scale, dtype)
    k = jnp.asarray(rng.normal(size=(tk, h, d)) * scale, dtype)
    v = jnp.asarray(rng.normal(size=(tk, h, d)), dtype)
    do = jnp.asarray(rng.normal(size=(tq, h, d)), dtype)
    return q, k, v, do


def np_act(s, name):
    """(act, act') in float64."""
    if name == "identity":
        return s, np.ones_like(s)
    if name == "relu":
        return np.maximum(s, 0), (s > 0).astype(np.float64)
    if name == "silu":
        sig = 1 / (1 + np.exp(-s))
        return s * sig, sig + s * sig * (1 - sig)
    if name == "gelu":
        cdf = 0.5 * (1 + erf(s / math.sqrt(2)))
        return s * cdf, cdf + s * np.exp(-s * s / 2) / math.sqrt(2 * math.pi)
    if name == "gelu_tanh":
        c = math.sqrt(2 / math.pi)
        u = c * (s + 0.044715 * s ** 3)
        t = np.tanh(u)
        return 0.5 * s * (1 + t), 0.5 * (1 + t) + 0.5 * s * (1 - t * t) * c * (1 + 3 * 0.044715 * s * s)
    raise ValueError(name)


def np_mask(lq, lk, causal=False, window=None, block=None):
    pq = np.arange(lq)[:, None]
    pk = np.arange(lk)[None, :]
    m = np.ones((lq, lk), bool)
    if causal:
        m &= pk <= pq
    if window is not None:
        m &= (pq - pk < window) if causal else (np.abs(pq - pk) < window)
    if block is not None:
        m &= pq // block == pk // block
    return m


def np_rope(x, pos, theta):
    """x [L,H,D] float64 -> rotated, rotate-half convention."""
    d = x.shape[-1]
    half = d // 2
    freq = theta ** (-np.arange(half) * 2.0 / d)
    a = pos[:, None] * freq[None, :]
    c, s = np.cos(a)[:, None, :], np.sin(a)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)


def np_rope_transpose(g, pos, theta):
    """The adjoint of np_rope (rotation by -angle)."""
    d = g.shape[-1]
    half = d // 2
    freq = theta ** (-np.arange(half) * 2.0 / d)
    a = pos[:, None] * freq[None, :]
    c, s = np.cos(a)[:, None, :], np.sin(a)[:, None, :]
    g1, g2 = g[..., :half], g[..., half:]
    return np.concatenate([g1 * c + g2 * s, g2 * c - g1 * s], -1)


def np_attention(q, k, v, do, q_off, kv_off, *, mode, activation="silu", scale=1.0,
                 causal=False, window=None, block=None, rope_theta=None, positions=None):
    """Per-sample dense float64 attention and its gradients.

    mode "gdpa": O = (act(S) * scale * M) V with S = Q K^T.
    mode "softmax": O = softmax_M(S * scale) V (rows with no key -> 0).
    rope_theta: rotate q and k (block attention) at `positions` (default p).
    Returns (o, dq, dk, dv) float64, same packed layout as the inputs.
    """
    q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
    o, dq, dk, dv = (np.zeros_like(x) for x in (q, q, k, v))
    for b in range(len(q_off) - 1):
        qa, qb, ka, kb = q_off[b], q_off[b + 1], kv_off[b], kv_off[b + 1]
        if qb == qa or kb == ka:  # nothing to attend: out and grads stay 0
            continue
        qq, kk, vv, dd = q[qa:qb], k[ka:kb], v[ka:kb], do[qa:qb]
        if rope_theta is not None:
            pos = np.arange(qb - qa) if positions is None else np.asarray(positions[qa:qb], np.float64)
            qq, kk = np_rope(qq, pos, rope_theta), np_rope(kk, pos, rope_theta)
        m = np_mask(qb - qa, kb - ka, causal, window, block)[None]
        s = np.einsum("qhd,khd->hqk", qq, kk)
        if mode == "gdpa":
            a, da = np_act(s, activation)
            p = np.where(m, a * scale, 0)
            dp = np.einsum("qhd,khd->hqk", dd, vv)
            ds = np.where(m, dp * da * scale, 0)
        else:
            z = np.where(m, s * scale, -np.inf)
            mx = np.max(z, -1, keepdims=True)
            mx = np.where(np.isfinite(mx), mx, 0)
            e = np.where(m, np.exp(z - mx), 0)
            p = e / np.maximum(e.sum(-1, keepdims=True), 1e-300)
            dp = np.einsum("qhd,khd->hqk", dd, vv)
            ds = p * (dp - np.sum(dp * p, -1, keepdims=True)) * scale
        o[qa:qb] = np.einsum("hqk,khd->qhd", p, vv)
        dv[ka:kb] = np.einsum("hqk,qhd->khd", p, dd)
        gq = np.einsum("hqk,khd->qhd", ds, kk)
        gk = np.einsum("hqk,qhd->khd", ds, qq)
        if rope_theta is not None:
            gq, gk = np_rope_transpose(gq, pos, rope_theta), np_rope_transpose(gk, pos, rope_theta)
        dq[qa:qb], dk[ka:kb] = gq, gk
    return o, dq, dk, dv


def vjp_outputs(fn, q, k, v, do):
    """(o, dq, dk, dv) of fn(q, k, v) with cotangent do, traced (for use inside a jit)."""
    o, vjp = jax.vjp(fn, q, k, v)
    return (o,) + tuple(vjp(do))


def run_vjp(fn, q, k, v, do):
    """(o, dq, dk, dv) of fn(q, k, v) with cotangent do: forward and backward in one jitted
    program (one compilation, not a forward and a backward one)."""
    return jax.jit(lambda q, k, v, do: vjp_outputs(fn, q, k, v, do))(q, k, v, do)


def assert_only_slice_changes(f, q, k, v, sl, rng):
    """Perturb q, k and v rows `sl` (one sample or block): f's output changes there and
    is bit-identical everywhere else."""
    a = np.asarray(f(q, k, v))
    noise = jnp.asarray(rng.normal(size=q[sl].shape) * 3, jnp.float32)
    b = np.asarray(f(q.at[sl].add(noise), k.at[sl].add(noise), v.at[sl].add(noise)))
    other = np.ones(q.shape[0], bool)
    other[sl] = False
    np.testing.assert_array_equal(a[other], b[other])
    assert not np.allclose(a[sl], b[sl])


def check_against(got, want, dtype, what, q_end=None):
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        e = rel_err(g, w)
        assert e < tol(dtype), f"{what}: {name} relative error {e:.2e} >= {tol(dtype)}"
    if q_end is not None:
        assert np.all(np.asarray(got[0])[q_end:] == 0), f"{what}: padding rows of out not 0"


# ------------------------------------------------------------------ tests


def test_segment_layout_matches_numpy():
    lengths = [0, 3, 1, 0, 5]
    off = offsets_of(lengths)
    seg, pos = segment_layout(jnp.asarray(off), 12)
    want_seg = np.array([1, 1, 1, 2, 4, 4, 4, 4, 4, 5, 5, 5])
    want_pos = np.array([0, 1, 2, 0, 0, 1, 2, 3, 4, 0, 0, 0])
    np.testing.assert_array_equal(seg, want_seg)
    np.testing.assert_array_equal(pos, want_pos)


@pytest.mark.parametrize("causal,window,block", [(False, None, None), (True, None, None),
                                                 (False, 3, None), (True, 2, None),
                                                 (False, None, 4)])
def test_pair_mask_matches_per_sample_mask(causal, window, block):
    ql, kl = [2, 0, 7, 5], [3, 4, 0, 6]
    qo, ko = offsets_of(ql), offsets_of(kl)
    m = np.asarray(pair_mask(jnp.asarray(qo), jnp.asarray(ko), 16, 16, causal, window, block))
    want = np.zeros((16, 16), bool)
    for b in range(4):
        want[qo[b]:qo[b + 1], ko[b]:ko[b + 1]] = np_mask(ql[b], kl[b], causal, window, block)
    np.testing.assert_array_equal(m, want)


@pytest.mark.parametrize("causal,window,block", [(False, None, None), (True, None, None),
                                                 (False, 5, None), (True, 3, None),
                                                 (False, None, 16)])
def test_tile_ranges_cover_every_valid_pair(causal, window, block):
    """Every valid (q, k) pair lies in a visited tile, in both loop orders."""
    ql, kl = [0, 1, 15, 16, 17, 40, 3], [5, 0, 16, 33, 17, 40, 1]
    if block is not None:
        kl = ql
    qo, ko = offsets_of(ql), offsets_of(kl)
    cfg = FlashConfig(mode="softmax", causal=causal, window=window, block=block,
                      bq=32, bk=16, bq_dkv=16, bk_dkv=32)
    lay = build_layout(cfg, jnp.asarray(qo), jnp.asarray(ko), 128, 128, 32)
    m = np.asarray(pair_mask(jnp.asarray(qo), jnp.asarray(ko), 128, 128, causal, window, block))
    visit_f = np.zeros_like(m)
    for i, (a, b) in enumerate(zip(np.asarray(lay["q_lo"]), np.asarray(lay["q_hi"]))):
        visit_f[i * 32:(i + 1) * 32, a * 16:b * 16] = True
    visit_b = np.zeros_like(m)
    for j, (a, b) in enumerate(zip(np.asarray(lay["k_lo"]), np.asarray(lay["k_hi"]))):
        visit_b[a * 16:b * 16, j * 32:(j + 1) * 32] = True
    assert m.any()
    assert not (m & ~visit_f).any(), "forward/dQ tile ranges miss a valid pair"
    assert not (m & ~visit_b).any(), "dK/dV tile ranges miss a valid pair"
    # and they skip: fewer tiles than the dense grid
    assert visit_f.sum() < visit_f.size and visit_b.sum() < visit_b.size


@pytest.mark.parametrize("causal,window,block", [(False, None, None), (True, None, None),
                                                 (False, 40, None), (True, 64, None),
                                                 (False, None, 32)])
def test_interior_ranges_are_exactly_the_full_tiles(causal, window, block):
    """Tiles flagged interior (mask skipped) have every pair valid; all full tiles are flagged."""
    ql = [0, 1, 15, 16, 17, 79, 70, 3]
    kl = ql if block is not None else [5, 0, 16, 60, 17, 96, 1, 64]
    qo, ko = offsets_of(ql), offsets_of(kl)
    cfg = FlashConfig(mode="softmax", causal=causal, window=window, block=block,
                      bq=16, bk=16, bq_dkv=16, bk_dkv=32)
    lay = build_layout(cfg, jnp.asarray(qo), jnp.asarray(ko), 384, 384, 32)
    m = np.asarray(pair_mask(jnp.asarray(qo), jnp.asarray(ko), 384, 384, causal, window, block))
    for side, rt, ct, mm in (("q", 16, 16, m), ("k", 32, 16, m.T)):
        lo, hi = np.asarray(lay[side + "_lo"]), np.asarray(lay[side + "_hi"])
        flo, fhi = np.asarray(lay[side + "_flo"]), np.asarray(lay[side + "_fhi"])
        assert ((lo <= flo) & (flo <= fhi) & (fhi <= hi)).all()
        n_interior = 0
        for i in range(len(lo)):
            full = [mm[i * rt:(i + 1) * rt, j * ct:(j + 1) * ct].all() for j in range(lo[i], hi[i])]
            flagged = [flo[i] <= j < fhi[i] for j in range(lo[i], hi[i])]
            assert full == flagged, (side, i, full, flagged)
            n_interior += sum(flagged)
        assert n_interior > 0, side  # the interior path is exercised


@pytest.mark.parametrize("multiple", [1, 4, 7])
def test_block_table_covers_every_row_once(multiple):
    """Per-block programs: real blocks are the sample's 64-token blocks; tails zero the rest;
    the count is a multiple of `multiple`, the extra programs idle (nothing read or written)."""
    from kernels.triton.block import block_table
    lens = [0, 1, 63, 64, 65, 130, 3]
    off = offsets_of(lens)
    start, ln, wl = (np.asarray(x) for x in block_table(jnp.asarray(off), 400, 64, multiple))
    nb = -(-400 // 64) + len(lens) + 1
    assert len(start) == nb + (-nb % multiple) and len(start) % multiple == 0
    assert np.all(wl[nb:] == 0) and np.all(ln[nb:] == 0)
    written = np.zeros(400, int)
    for s, l, w in zip(start, ln, wl):
        assert 0 <= l <= w <= 64 and (l == 0 or l == w)
        written[s:s + w] += 1
        if l:  # one block of one sample: starts at a multiple of 64 within the sample
            b = np.searchsorted(off, s, side="right") - 1
            assert (s - off[b]) % 64 == 0 and s + l <= off[b + 1]
            assert l == min(64, off[b + 1] - s)
    np.testing.assert_array_equal(written, 1)
    assert ln.sum() == sum(lens)


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh", "relu", "identity"])
def test_kernel_activation_and_derivative_match_float64(activation):
    s = np.linspace(-9, 9, 721)
    a, da = act_and_grad(jnp.asarray(s, jnp.float32), activation)
    wa, wda = np_act(s, activation)
    np.testing.assert_allclose(np.asarray(a), wa, atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(da), wda, atol=5e-6, rtol=1e-5)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_fast_activation_forms_match_float64(activation):
    """The tanh forms used with tanh.approx (here with exact tanh) equal act and act'."""
    from kernels.triton.tile import fast_act_and_grad
    s = np.linspace(-9, 9, 721)
    a, da = fast_act_and_grad(jnp.asarray(s, jnp.float32), activation, interpret=True)
    wa, wda = np_act(s, activation)
    np.testing.assert_allclose(np.asarray(a), wa, atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(da), wda, atol=5e-6, rtol=1e-5)


def test_rope_matches_numpy_and_is_a_rotation():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(9, 2, 8))
    pos = np.array([0, 1, 2, 5, 63, 64, 100, 7, 3])
    got = np.asarray(rope(jnp.asarray(x, jnp.float32), jnp.asarray(pos), 10_000.0))
    np.testing.assert_allclose(got, np_rope(x, pos, 10_000.0), atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
    np.testing.assert_allclose(np_rope_transpose(np_rope(x, pos, 500.0), pos, 500.0), x, atol=1e-12)


def test_default_references_do_not_build_the_dense_score_matrix():
    """At T=4096 the default (CPU) paths stay far below one [H, T, T] f32 buffer, with grads."""
    from kernels import block_attention, gdpa, jagged_attention
    t, h, d = 4096, 4, 64
    dense_bytes = h * t * t * 4
    x = jax.ShapeDtypeStruct((t, h, d), jnp.float32)
    off = jax.ShapeDtypeStruct((9,), jnp.int32)
    ops = {
        "gdpa": lambda q, k, v, o: gdpa(q, k, v, o, o, impl="reference"),
        "jagged_attention": lambda q, k, v, o: jagged_attention(q, k, v, o, o, impl="reference"),
        "block_attention": lambda q, k, v, o: block_attention(q, k, v, o, impl="reference"),
    }
    for name, f in ops.items():
        loss = lambda q, k, v, o, f=f: jnp.sum(f(q, k, v, o) ** 2)
        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        mem = grad.lower(x, x, x, off).compile().memory_analysis()
        if mem is None:
            pytest.skip("backend reports no memory analysis")
        assert mem.temp_size_in_bytes < dense_bytes / 2, (
            f"{name}: {mem.temp_size_in_bytes / 2**20:.0f} MiB temp vs dense "
            f"{dense_bytes / 2**20:.0f} MiB")


def test_padded_head_dims_and_the_default_impl():
    from kernels.common import (default_impl, pad_halves, pad_head_dim, padded_head_dim)
    want = {"gdpa": {8: 32, 16: 16, 24: 32, 48: 64, 96: 128, 128: 128, 130: None, 256: 256},
            "block_attention": {7: None, 8: 32, 16: 32, 32: 32, 48: 64, 96: 128, 130: None,
                                256: 256}}
    for op, table in want.items():
        for d, p in table.items():
            assert padded_head_dim(op, d) == p, (op, d)
            assert default_impl(op, d, "gpu") == ("reference" if p is None else "pallas")
            assert default_impl(op, d, "cpu") == "reference"
    x = jnp.arange(2 * 1 * 6, dtype=jnp.float32).reshape(2, 1, 6)
    np.testing.assert_array_equal(pad_head_dim(x, 8)[..., :6], x)
    assert float(jnp.abs(pad_head_dim(x, 8)[..., 6:]).sum()) == 0
    h = pad_halves(x, 10)                             # [x1 | 0 0 | x2 | 0 0]
    np.testing.assert_array_equal(h[..., :3], x[..., :3])
    np.testing.assert_array_equal(h[..., 5:8], x[..., 3:])
    assert float(jnp.abs(h[..., 3:5]).sum() + jnp.abs(h[..., 8:]).sum()) == 0


_TRACE_CONTEXT_CHILD = """
import jax, jax.numpy as jnp, numpy as np
from jax._src import config
import kernels
from kernels.segment_sum import sorted_segment_sum
before = set(map(str, config.trace_context_names()))
g = jnp.arange(12, dtype=jnp.float32).reshape(4, 3)
idx, seg = jnp.array([0, 2, 3], jnp.int32), jnp.array([0, 0, 1], jnp.int32)
out = jax.jit(lambda g: sorted_segment_sum(g, idx, seg, 2, impl="pallas"))(g)
np.testing.assert_array_equal(np.asarray(out), [[6, 8, 10], [9, 10, 11]])
print(sorted(set(map(str, config.trace_context_names())) - before))
"""


def test_interpret_mode_kernels_leave_the_trace_context_alone():
    """An interpret-mode kernel's first lowering adds nothing to JAX's trace context once
    kernels is imported (kernels/common.py imports Pallas's fuser up front), so programs
    traced before it are not traced and lowered again. A fresh process: this one may have
    run interpret-mode kernels already."""
    r = subprocess.run([sys.executable, "-c", _TRACE_CONTEXT_CHILD], capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout
