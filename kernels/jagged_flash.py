"""Tiled jagged attention on the Pallas Triton backend: forward, dQ and dK/dV kernels.

One engine serves the three public ops (kernels/gdpa, kernels/jagged_attention,
kernels/block_attention). Scores S = Q K^T of one (query tile, key tile, head) are
formed in registers and turned into P by either
  "gdpa":     P = act(S) * scale                     (no normalisation)
  "softmax":  P = exp(S * sm_scale - lse)             (online softmax, flash-style,
                                                       computed in base 2 with exp2)
then masked with the exact pair mask of kernels.common (same sample, causal,
window, block) and multiplied into V. Only key tiles that can hold a valid pair
are visited: per query tile the range [first, last] key tile is precomputed from
the offsets (and per key tile the query-tile range for dK/dV), so tiles with no
valid pair cost nothing. Tiles whose pairs are all valid ("interior", a
precomputed [first, last) range per tile) skip the mask. With `rope`, q and k
tiles are rotated on load (rotate-half, in two D/2 halves) and dQ/dK are rotated
back before storing: the RoPE backward is fused. GDPA silu / gelu_tanh can run
through tanh.approx (fast_act, for 16-bit inputs).

Backward: dQ kernel (grid over query tiles) and dK/dV kernel (grid over key
tiles), no atomics. Where one side is short (at most SHORT_SIDE tokens per sample:
PMA's 16 learned queries, cross-attention to 32 keys) the kernel over the short
side's tiles also stores the long side's gradient rows whose whole interval lies
in its tile (`fused_bwd` "q_rows" / "k_rows"), so the other kernel only runs for
tiles holding rows that straddle a tile edge. Softmax needs delta = rowsum(dO * O),
computed in XLA. Triton dots need every dim >= 16, so tiles are >= 16 and D (D/2 with rope) must
be a multiple of 16.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels.common import key_layout, rope_tables, segment_layout

F32 = jnp.float32
PAD_MULTIPLE = 128  # token capacities are padded to this (all tiles divide it)
# Tokens per sample (capacity / B) at or below which a side counts as short: tiles over
# the other side launch in order (one or two tiles of inner loop each, no sort), and a
# short side gets the fused backward (fused_bwd="auto": "q_rows" / "k_rows").
SHORT_SIDE = 32
FUSED_BWD = ("auto", "off", "q_rows", "k_rows")   # FlashConfig.fused_bwd


@dataclasses.dataclass(frozen=True)
class FlashConfig:
    mode: str                      # "gdpa" | "softmax"
    activation: str = "identity"   # gdpa only
    scale: float = 1.0             # gdpa: after act; softmax: sm_scale on scores
    causal: bool = False
    window: int | None = None
    block: int | None = None       # block_attention: same pos // block
    rope: bool = False
    bq: int = 128                  # forward / dQ query tile
    bk: int = 64                   # forward / dQ key tile
    bq_dkv: int = 64               # dK/dV: query step
    bk_dkv: int = 64               # dK/dV: key tile
    num_warps: int = 8
    num_stages: int = 2
    num_warps_bwd: int = 8
    num_stages_bwd: int = 2
    heavy_first: bool = True       # launch tiles with the longest key range first
    interior: bool = True          # tiles whose pairs are all valid skip the mask
    fast_act: bool = False         # gdpa silu / gelu_tanh through tanh.approx (16-bit inputs)
    interpret: bool = False
    # forward engine: "triton" (this module's kernel) or "mosaic" (the Mosaic GPU kernel,
    # kernels/mosaic_flash.py, gdpa and softmax, where it applies: flash_forward; Triton
    # elsewhere); either engine's forward feeds either backward
    forward: str = "triton"
    # backward engine: "triton" (the dQ and dK/dV kernels here) or "mosaic" (the Mosaic
    # GPU dQ and dK/dV kernels, kernels/mosaic_flash.py run_backward, where they apply:
    # flash_backward; Triton elsewhere)
    backward: str = "triton"
    # MosaicConfig overrides, ((knob, value), ...), for the Mosaic forward / backward
    # (benchmarks and tests: e.g. (("fused_delta", True),), (("overlap_dp", True),))
    mosaic_fwd: tuple = ()
    mosaic_bwd: tuple = ()
    # Triton backward, FUSED_BWD: "k_rows" / "q_rows" (rows of one side whose whole
    # interval lies in one tile of the other get their gradient from that tile's
    # program, the rest from their own kernel), "off" (the dQ and dK/dV kernels), "auto"
    # (fused_backward_side: "q_rows" for short query sides, "k_rows" for short key sides,
    # else off; off with RoPE)
    fused_bwd: str = "auto"
    # The next three are "auto" by default, resolved by backward_knobs (H200 timings
    # there). Triton dK/dV kernel: each key tile's query loop cut into this many equal
    # chunks, one program each, their float32 partial dK / dV summed in XLA after the
    # kernel (a long sample's key tile is no longer one long serial program: W2's 2975
    # queries are 47 query tiles). 1 = off. Applies to the plain and "k_rows" backwards.
    dkv_split: int | str = "auto"
    # dkv_split over the first dkv_split_tiles key tiles of the launch order only (the
    # heaviest, with heavy_first): their float32 partials go to a small buffer
    # [split * L * bk_dkv, H, D], summed and scattered into dK / dV after the kernel,
    # while every other tile runs whole and stores dK / dV directly. 0 = every tile split
    # (partials [split * Tk, H, D] summed in full: on W2 two 12 us passes, CUPTI).
    dkv_split_tiles: int | str = "auto"
    # fused_bwd "k_rows" / "q_rows": tiles per program of the kernel that takes the rows
    # no tile of the other side owns (a loop in the program). On W2 / W3 nearly every
    # tile has none, and one program per tile and head (W2: 5660) costs 13 us of launches
    # for no work (CUPTI). 1 = one program per tile.
    rest_group: int | str = "auto"


# ----------------------------------------------------------------------------- math

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


def _act_grad(s, cfg):
    if cfg.fast_act:
        return fast_act_and_grad(s, cfg.activation, cfg.interpret)
    return act_and_grad(s, cfg.activation)


def _act(s, cfg):
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


def _dot_nt(a, b):  # [M,K] x [N,K] -> [M,N] f32
    return _dot(a, b, ((1,), (1,)))


def _dot_nn(a, b):  # [M,K] x [K,N] -> [M,N]
    return _dot(a, b, ((1,), (0,)))


def _dot_tn(a, b):  # [K,M] x [K,N] -> [M,N]
    return _dot(a, b, ((0,), (0,)))


def _mask(cfg, qs, qp, ks, kp, masked=True):
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

def _load_parts(ref, rows, cs, cfg):
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


def _load_cs(cos_ref, sin_ref, rows, cfg):
    if not cfg.rope:
        return None
    return cos_ref[rows, :], sin_ref[rows, :]


def _store_parts(ref, rows, parts, cs, cfg):
    """Store a gradient given w.r.t. the rotated halves, rotated back (RoPE^T)."""
    if not cfg.rope:
        ref[rows, :] = parts[0].astype(ref.dtype)
        return
    half = ref.shape[-1] // 2
    g1, g2 = parts
    c, s = cs
    ref[rows, pl.ds(0, half)] = (g1 * c + g2 * s).astype(ref.dtype)
    ref[rows, pl.ds(half, half)] = (g2 * c - g1 * s).astype(ref.dtype)


def _where(m, x, other):
    return x if m is None else jnp.where(m, x, other)


def _three_loops(lo, flo, fhi, hi, body, init, cfg):
    """fori over [lo, hi) with body(j, carry, masked): tiles in [flo, fhi) are interior."""
    if not cfg.interior:
        return lax.fori_loop(lo, hi, functools.partial(body, masked=True), init)
    c = lax.fori_loop(lo, flo, functools.partial(body, masked=True), init)
    c = lax.fori_loop(flo, fhi, functools.partial(body, masked=False), c)
    return lax.fori_loop(fhi, hi, functools.partial(body, masked=True), c)


def _scores(qp, kp):
    s = _dot_nt(qp[0], kp[0])
    for a, b in zip(qp[1:], kp[1:]):
        s += _dot_nt(a, b)
    return s


# --------------------------------------------------------------------------- kernels

def _fwd_kernel(qs_ref, qp_ref, ks_ref, kp_ref, perm_ref, lo_ref, hi_ref, flo_ref, fhi_ref,
                cq_ref, sq_ref, ck_ref, sk_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, cfg):
    i = perm_ref[pl.program_id(0)]  # heaviest tiles first
    bq, bk = cfg.bq, cfg.bk
    qrows = pl.ds(i * bq, bq)
    qs, qpos = qs_ref[qrows], qp_ref[qrows]
    qparts = _load_parts(q_ref, qrows, _load_cs(cq_ref, sq_ref, qrows, cfg), cfg)
    d = v_ref.shape[-1]
    ranges = lo_ref[i], flo_ref[i], fhi_ref[i], hi_ref[i]

    def tile(j, masked):
        rows = pl.ds(j * bk, bk)
        kparts = _load_parts(k_ref, rows, _load_cs(ck_ref, sk_ref, rows, cfg), cfg)
        m = _mask(cfg, qs, qpos, ks_ref[rows], kp_ref[rows], masked)
        return _scores(qparts, kparts), m, v_ref[rows, :]

    if cfg.mode == "gdpa":
        def body(j, acc, masked):
            s, m, v = tile(j, masked)
            p = _where(m, _act(s, cfg) * cfg.scale, 0.0)
            return acc + _dot_nn(p.astype(v.dtype), v)
        acc = _three_loops(*ranges, body, jnp.zeros((bq, d), F32), cfg)
        o_ref[qrows, :] = acc.astype(o_ref.dtype)
        return

    scale2 = cfg.scale * LOG2E  # softmax in base 2: exp2 is one MUFU op, exp is not

    def body(j, carry, masked):
        acc, mx, l = carry
        s, m, v = tile(j, masked)
        s = _where(m, s * scale2, -1e30)
        mx_new = jnp.maximum(mx, jnp.max(s, axis=1))
        p = _where(m, jnp.exp2(s - mx_new[:, None]), 0.0)
        alpha = jnp.exp2(mx - mx_new)
        l = l * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot_nn(p.astype(v.dtype), v)
        return acc, mx_new, l

    init = (jnp.zeros((bq, d), F32), jnp.full((bq,), -1e30, F32), jnp.zeros((bq,), F32))
    acc, mx, l = _three_loops(*ranges, body, init, cfg)
    safe = jnp.where(l > 0, l, 1.0)
    o_ref[qrows, :] = (acc / safe[:, None]).astype(o_ref.dtype)
    lse_ref[qrows] = jnp.where(l > 0, mx + jnp.log2(safe), 0.0)  # base-2 log-sum-exp


def _probs_and_dscores(cfg, s, m, lse, delta, dp):
    """(P, dS) of one tile; dS is the gradient w.r.t. the raw scores Q K^T."""
    if cfg.mode == "gdpa":
        a, da = _act_grad(s, cfg)
        p = _where(m, a * cfg.scale, 0.0)
        ds = _where(m, dp * da * cfg.scale, 0.0)
        return p, ds
    p = _where(m, jnp.exp2(s * (cfg.scale * LOG2E) - lse[:, None]), 0.0)  # lse in base 2
    return p, p * (dp - delta[:, None]) * cfg.scale


def _dq_kernel(qs_ref, qp_ref, ks_ref, kp_ref, perm_ref, lo_ref, hi_ref, flo_ref, fhi_ref, cq_ref,
               sq_ref, ck_ref, sk_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref,
               dk_ref=None, dv_ref=None, *, cfg, other_own=None, own=None, need=None,
               slot=None):
    """dQ of one query tile. With dk_ref / dv_ref and other_own (fused_bwd "q_rows", no
    RoPE) also each key tile's dK / dV, stored for the key rows other_own assigns to
    this query tile (all their queries are in it). With own / need ("k_rows": the dK/dV
    kernel stores the rest) only the rows own marks -1, and only tiles need marks run
    the key loop (else their rows get zeros). slot: the tile's place in the launch
    order (default the program id; rest_group loops over several)."""
    i = perm_ref[pl.program_id(0) if slot is None else slot]
    bq, bk = cfg.bq, cfg.bk
    qrows = pl.ds(i * bq, bq)

    def compute():
        qs, qpos = qs_ref[qrows], qp_ref[qrows]
        cs_q = _load_cs(cq_ref, sq_ref, qrows, cfg)
        qparts = _load_parts(q_ref, qrows, cs_q, cfg)
        do = do_ref[qrows, :]
        lse = lse_ref[qrows] if lse_ref is not None else None
        delta = delta_ref[qrows] if delta_ref is not None else None

        def body(j, acc, masked):
            rows = pl.ds(j * bk, bk)
            kparts = _load_parts(k_ref, rows, _load_cs(ck_ref, sk_ref, rows, cfg), cfg)
            m = _mask(cfg, qs, qpos, ks_ref[rows], kp_ref[rows], masked)
            s = _scores(qparts, kparts)
            dp = _dot_nt(do, v_ref[rows, :])
            p, ds = _probs_and_dscores(cfg, s, m, lse, delta, dp)
            ds = ds.astype(kparts[0].dtype)
            if dk_ref is not None:
                mine = other_own[rows] == i
                _store_rows(dv_ref, rows, _dot_tn(p.astype(do.dtype), do), mine)
                _store_rows(dk_ref, rows, _dot_tn(ds, qparts[0]), mine)
            return tuple(a + _dot_nn(ds, kp) for a, kp in zip(acc, kparts))

        init = tuple(jnp.zeros(p.shape, F32) for p in qparts)
        acc = _three_loops(lo_ref[i], flo_ref[i], fhi_ref[i], hi_ref[i], body, init, cfg)
        if own is None:
            _store_parts(dq_ref, qrows, acc, cs_q, cfg)
        else:
            _store_rows(dq_ref, qrows, acc[0], own[qrows] == -1)

    _only_needed(compute, need, i, lambda: _store_rows(
        dq_ref, qrows, jnp.zeros((bq, dq_ref.shape[-1]), F32), own[qrows] == -1))


def _store_rows(ref, rows, x, mask):
    """ref[rows] = x where mask (a [rows] bool), in ref's dtype."""
    plgpu.store(ref.at[rows, :], x.astype(ref.dtype), mask=mask[:, None])


def _only_needed(compute, need, i, zeros):
    """compute() for tile i, or with need (fused_bwd "*_rows"): compute() where need[i],
    else zeros() (the tile's rows have no pairs left to this kernel)."""
    if need is None:
        compute()
        return
    pl.when(need[i] != 0)(compute)
    pl.when(need[i] == 0)(zeros)


def _dkv_kernel(qs_ref, qp_ref, ks_ref, kp_ref, perm_ref, lo_ref, hi_ref, flo_ref, fhi_ref,
                cq_ref, sq_ref, ck_ref, sk_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
                dk_ref, dv_ref, dq_ref=None, *, cfg, other_own=None, own=None, need=None,
                slot=None, partial_refs=None):
    """dK, dV of one key tile. With dq_ref and other_own (fused_bwd "k_rows", no RoPE)
    also each query tile's dQ, stored for the query rows other_own assigns to this key
    tile (all their keys are in it). With
    own / need ("q_rows": the dQ kernel stores the rest) only the rows own marks -1, and
    only tiles need marks run the query loop (else their rows get zeros). slot: as in
    _dq_kernel. partial_refs (dkv_split_tiles): the float32 partial dK, dV of the split
    tiles (_dkv_top)."""
    split = _dkv_split(cfg, own)
    p = pl.program_id(0) if slot is None else slot
    bq, bk = cfg.bq_dkv, cfg.bk_dkv
    nk = k_ref.shape[0] // bk
    top = _dkv_top(cfg, split, nk)
    if top:   # programs < nk: tile perm[p] (chunk 0 if p < top); then chunks 1.. of the top
        e = p - nk
        s = jnp.where(e >= 0, e // (split - 1), p)      # place of the tile in the order
        c = jnp.where(e >= 0, 1 + e % (split - 1), 0)   # its chunk
        in_top = s < top
        j = perm_ref[s]
    else:
        c = None              # chunk p % split
        j = perm_ref[p // split] if split > 1 else perm_ref[p]
    krows = pl.ds(j * bk, bk)
    # where the partial dK / dV go: chunk c's at rows c * Tk + j * bk
    orows = pl.ds(p % split * k_ref.shape[0] + j * bk, bk) if split > 1 and not top else krows

    def query_range():
        """(lo, flo, fhi, hi) of the query loop: the tile's, or chunk c of it."""
        lo, flo, fhi, hi = lo_ref[j], flo_ref[j], fhi_ref[j], hi_ref[j]
        if split == 1:
            return lo, flo, fhi, hi
        cc = p % split if c is None else c
        a, b = lo + (hi - lo) * cc // split, lo + (hi - lo) * (cc + 1) // split
        if top:     # tiles past the top run whole
            a, b = jnp.where(in_top, a, lo), jnp.where(in_top, b, hi)
        return a, jnp.clip(flo, a, b), jnp.clip(fhi, a, b), b

    def compute():
        ks, kpos = ks_ref[krows], kp_ref[krows]
        cs_k = _load_cs(ck_ref, sk_ref, krows, cfg)
        kparts = _load_parts(k_ref, krows, cs_k, cfg)
        v = v_ref[krows, :]

        def body(i, carry, masked):
            dks, dv = carry
            rows = pl.ds(i * bq, bq)
            qparts = _load_parts(q_ref, rows, _load_cs(cq_ref, sq_ref, rows, cfg), cfg)
            m = _mask(cfg, qs_ref[rows], qp_ref[rows], ks, kpos, masked)
            s = _scores(qparts, kparts)
            do = do_ref[rows, :]
            dp = _dot_nt(do, v)
            lse = lse_ref[rows] if lse_ref is not None else None
            delta = delta_ref[rows] if delta_ref is not None else None
            p, ds = _probs_and_dscores(cfg, s, m, lse, delta, dp)
            dv = dv + _dot_tn(p.astype(do.dtype), do)
            ds = ds.astype(qparts[0].dtype)
            if dq_ref is not None:
                _store_rows(dq_ref, rows, _dot_nn(ds, kparts[0]), other_own[rows] == j)
            return tuple(a + _dot_tn(ds, qp) for a, qp in zip(dks, qparts)), dv

        init = (tuple(jnp.zeros(p.shape, F32) for p in kparts), jnp.zeros(v.shape, F32))
        dks, dv = _three_loops(*query_range(), body, init, cfg)

        def store(dk_out, dv_out, rows):
            _store_parts(dk_out, rows, dks, cs_k, cfg)
            dv_out[rows, :] = dv.astype(dv_out.dtype)
        if top:     # a split tile's chunk c: partial slot c * top + s; the rest direct
            pl.when(in_top)(lambda: store(*partial_refs, pl.ds((c * top + s) * bk, bk)))
            pl.when(jnp.logical_not(in_top))(lambda: store(dk_ref, dv_ref, krows))
        elif own is None:
            store(dk_ref, dv_ref, orows)
        else:
            mine = own[krows] == -1
            _store_rows(dk_ref, krows, dks[0], mine)
            _store_rows(dv_ref, krows, dv, mine)

    def zeros():
        z, mine = jnp.zeros((bk, dk_ref.shape[-1]), F32), own[krows] == -1
        _store_rows(dk_ref, krows, z, mine)
        _store_rows(dv_ref, krows, z, mine)

    _only_needed(compute, need, j, zeros)


def _dkv_split(cfg, own=None):
    """Programs per key tile of the dK/dV kernel: cfg.dkv_split, 1 where the kernel stores
    only some rows (own: "q_rows"'s rest kernel)."""
    return 1 if own is not None else cfg.dkv_split


def _dkv_top(cfg, split, nk):
    """Key tiles split by dkv_split_tiles (the first of the launch order), 0 = all."""
    return min(cfg.dkv_split_tiles, nk) if split > 1 else 0


def _dkv_grid(cfg, split, nk):
    """Programs of the dK/dV kernel over nk key tiles."""
    top = _dkv_top(cfg, split, nk)
    return nk + top * (split - 1) if top else nk * split


def _dkv_outputs(k, split, top, bk):
    """([out_shape], [out_spec]) of the dK/dV kernel's dK / dV outputs: dK, dV [Tk, H, D]
    in k's dtype; with split > 1 the float32 partials [split * Tk, H, D] instead
    (_sum_partials); with top > 0 (dkv_split_tiles) dK, dV and the split tiles'
    partials [split * top * bk, H, D] (_merge_top)."""
    tk, h, d = k.shape
    direct = (jax.ShapeDtypeStruct(k.shape, k.dtype), _x_spec(tk, d))
    if split == 1:
        outs = [direct] * 2
    elif top:
        rows = split * top * bk
        outs = [direct] * 2 + [(jax.ShapeDtypeStruct((rows, h, d), F32), _x_spec(rows, d))] * 2
    else:
        outs = [(jax.ShapeDtypeStruct((split * tk, h, d), F32), _x_spec(split * tk, d))] * 2
    return [o[0] for o in outs], [o[1] for o in outs]


def _dkv_results(outs, k, split, top, perm, bk):
    """(dK, dV) [Tk, H, D] in k's dtype from the dK/dV kernel's outputs (_dkv_outputs)."""
    if not top:
        return tuple(_sum_partials(x, k, split) for x in outs)
    dk, dv, pk, pv = outs
    return _merge_top(dk, pk, perm, split, top, bk), _merge_top(dv, pv, perm, split, top, bk)


def _merge_top(direct, partial, perm, split, top, bk):
    """direct [Tk, H, D] (the rows of tiles perm[:top] unwritten) with those tiles' rows
    set to the sum of their float32 partials [split * top * bk, H, D]."""
    tk, h, d = direct.shape
    sums = partial.reshape(split, top * bk, h, d).sum(axis=0).astype(direct.dtype)
    rows = (perm[:top, None] * bk + jnp.arange(bk, dtype=jnp.int32)[None, :]).reshape(-1)
    return direct.at[rows].set(sums, unique_indices=True)


def _sum_partials(x, like, split):
    """[split * Tk, H, D] float32 partials -> [Tk, H, D] in like's dtype."""
    if split == 1:
        return x
    return x.reshape(split, *like.shape).sum(axis=0).astype(like.dtype)


# ------------------------------------------------------------------- pallas calls

def _full(shape):
    nd = len(shape)
    return pl.BlockSpec(shape, lambda *_: (0,) * nd)


def _specs(cfg, tq, tk, d, ntile):
    """In-specs for (layout..., cos/sin..., q, k, v): whole arrays, one head per program.

    Every kernel picks its own rows with pl.ds from the tile order (perm), so the
    specs are the same for the forward, dQ and dK/dV calls.
    """
    hd = d // 2
    lay = [_full((tq,)), _full((tq,)), _full((tk,)), _full((tk,))] + [_full((ntile,))] * 5
    cs = [_full((tq, hd))] * 2 + [_full((tk, hd))] * 2 if cfg.rope else []
    return lay + cs + [_x_spec(tq, d), _x_spec(tk, d), _x_spec(tk, d)]


def _x_spec(t, d):
    return pl.BlockSpec((t, None, d), lambda i, j: (0, j, 0))


def _stat_spec(t):
    return pl.BlockSpec((None, t), lambda i, j: (j, 0))


def _adapt(kernel, cfg, n_in_extra, has_stats, n_out):
    """Kernel taking refs in a fixed order; absent rope tables / softmax stats -> None.

    has_stats: None (the kernel has no stats inputs), False (passed as None), True.
    """
    def wrapped(*refs):
        refs = list(refs)
        lay, refs = refs[:9], refs[9:]
        if cfg.rope:
            cs, refs = refs[:4], refs[4:]
        else:
            cs = [None] * 4
        qkv, refs = refs[:3], refs[3:]
        extra, refs = refs[:n_in_extra], refs[n_in_extra:]
        if has_stats:
            stats, refs = refs[:2], refs[2:]
        else:
            stats = [] if has_stats is None else [None, None]
        outs = refs
        assert len(outs) == n_out, (len(outs), n_out)
        return kernel(*lay, *cs, *qkv, *extra, *stats, *outs, cfg=cfg)
    return wrapped


def _params(cfg, bwd):
    if bwd:
        return plgpu.CompilerParams(num_warps=cfg.num_warps_bwd, num_stages=cfg.num_stages_bwd)
    return plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _inputs(lay, q, k, v, over_q):
    side = "q" if over_q else "k"
    xs = [lay["qs"], lay["qp"], lay["ks"], lay["kp"], lay[side + "_perm"], lay[side + "_lo"],
          lay[side + "_hi"], lay[side + "_flo"], lay[side + "_fhi"]]
    if lay["cos"] is not None:
        xs += [lay["cos"], lay["sin"], lay["cos"], lay["sin"]]
    return xs + [q, k, v]


def _forward(cfg, q, k, v, lay):
    tq, h, d = q.shape
    tk = k.shape[0]
    nq = tq // cfg.bq
    softmax = cfg.mode == "softmax"
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    out_specs = [_x_spec(tq, d)]
    if softmax:
        out_shape.append(jax.ShapeDtypeStruct((h, tq), F32))
        out_specs.append(_stat_spec(tq))

    def kernel(*refs, cfg):
        refs = list(refs)
        if not softmax:
            refs.append(None)  # lse_ref
        _fwd_kernel(*refs, cfg=cfg)

    if cfg.forward == "mosaic":
        from kernels.mosaic_flash import flash_forward  # here: that module imports this one
        kern = flash_forward(cfg, q.dtype, d, tq, tk)
        if kern is not None:
            out = kern(q, k, v, lay)
            return out if softmax else (out, None)

    outs = pl.pallas_call(
        _adapt(kernel, cfg, 0, None, len(out_shape)), grid=(nq, h),
        in_specs=_specs(cfg, tq, tk, d, nq), out_specs=out_specs, out_shape=out_shape,
        compiler_params=_params(cfg, False), interpret=cfg.interpret,
        name=f"jagged_flash_fwd_{cfg.mode}",
    )(*_inputs(lay, q, k, v, True))
    return outs[0], (outs[1] if softmax else None)


def softmax_delta(o, do):
    """[H, Tq] float32: rowsum(dO * O), the softmax backward's per-row term."""
    return jnp.sum(o.astype(F32) * do.astype(F32), axis=-1).T


def _backward(cfg, q, k, v, lay, o, lse, do):
    tq, h, d = q.shape
    tk = k.shape[0]
    softmax = cfg.mode == "softmax"
    stats, stat_specs = [], []
    if softmax:
        delta = softmax_delta(o, do)
        stats, stat_specs = [lse, delta], [_stat_spec(tq)] * 2
    if cfg.fused_bwd in ("q_rows", "k_rows"):
        return _backward_rows(cfg, q, k, v, lay, do, stats, stat_specs)

    nq = tq // cfg.bq
    dq = pl.pallas_call(
        _adapt(_dq_kernel, cfg, 1, softmax, 1), grid=(nq, h),
        in_specs=_specs(cfg, tq, tk, d, nq) + [_x_spec(tq, d)] + stat_specs,
        out_specs=_x_spec(tq, d), out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_params(cfg, True), interpret=cfg.interpret,
        name=f"jagged_flash_dq_{cfg.mode}",
    )(*_inputs(lay, q, k, v, True), do, *stats)

    nk = tk // cfg.bk_dkv
    split = _dkv_split(cfg)
    top = _dkv_top(cfg, split, nk)
    shapes, specs = _dkv_outputs(k, split, top, cfg.bk_dkv)

    def dkv_kernel(*refs, cfg):   # outs: dK, dV (+ the split tiles' partials)
        n = len(refs) - len(shapes) + 2
        _dkv_kernel(*refs[:n], cfg=cfg, partial_refs=refs[n:] or None)
    outs = pl.pallas_call(
        _adapt(dkv_kernel, cfg, 1, softmax, len(shapes)), grid=(_dkv_grid(cfg, split, nk), h),
        in_specs=_specs(cfg, tq, tk, d, nk) + [_x_spec(tq, d)] + stat_specs,
        out_specs=specs, out_shape=shapes,
        compiler_params=_params(cfg, True), interpret=cfg.interpret,
        name=f"jagged_flash_dkv_{cfg.mode}",
    )(*_inputs(lay, q, k, v, False), do, *stats)
    return (dq,) + _dkv_results(outs, k, split, top, lay["k_perm"], cfg.bk_dkv)


def row_owners(start, end, t_own, tile):
    """fused_bwd "*_rows": per row (own [T] int32) the tile of size t_own of the other side
    holding its whole [start, end) interval, -1 if it spans several or is empty; per tile
    of `tile` rows (need [T / tile] int32) whether one of its rows spans several."""
    single = (start < end) & (start // t_own == (end - 1) // t_own)
    own = jnp.where(single, start // t_own, -1).astype(jnp.int32)
    need = jnp.any(((own < 0) & (start < end)).reshape(-1, tile), axis=1).astype(jnp.int32)
    return own, need


def _backward_rows(cfg, q, k, v, lay, do, stats, stat_specs):
    """fused_bwd "k_rows" / "q_rows": no atomics. "k_rows": a query row whose key interval
    lies in one dK/dV key tile (e.g. cross-attention to 32 keys per sample, aligned) gets
    its dQ stored by that tile's program; the dQ kernel runs first and stores only the
    other rows (tiles with none skip their key loop) into the buffer the dK/dV kernel
    then completes (aliased). "q_rows": the same with the sides swapped (key rows whose
    query interval lies in one dQ query tile, e.g. PMA's 16 queries)."""
    tq, h, d = q.shape
    tk = k.shape[0]
    k_rows = cfg.fused_bwd == "k_rows"
    if k_rows:    # query rows, owned by dK/dV key tiles; B = the dQ kernel
        start, end, t_own, t_b, tile_b = lay["q_start"], lay["q_end"], cfg.bk_dkv, tq, cfg.bq
    else:         # key rows, owned by dQ query tiles; B = the dK/dV kernel
        start, end, t_own, t_b, tile_b = lay["k_start"], lay["k_end"], cfg.bq, tk, cfg.bk_dkv
    own, need = row_owners(start, end, t_own, tile_b)
    n_b = t_b // tile_b
    softmax = cfg.mode == "softmax"
    b_base, a_base = (_dq_kernel, _dkv_kernel) if k_rows else (_dkv_kernel, _dq_kernel)
    b_outs = [jax.ShapeDtypeStruct(q.shape, q.dtype)] if k_rows else [
        jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
    nb_out = len(b_outs)

    group = cfg.rest_group

    def b_kernel(*refs, cfg):   # 16 layout / cos, sin / q, k, v; do, own, need, lse, delta; outs
        def run(slot=None):
            b_base(*refs[:17], *refs[19:21], *refs[21:], cfg=cfg, own=refs[17], need=refs[18],
                   slot=slot)
        if group == 1:
            run()
            return

        first = pl.program_id(0) * group

        def body(g, carry):     # rest_group tiles per program; the last one's tail is idle
            slot = first + g
            pl.when(slot < n_b)(lambda: run(slot))
            return carry
        lax.fori_loop(0, group, body, 0)

    partial = pl.pallas_call(
        _adapt(b_kernel, cfg, 3, softmax, nb_out), grid=(-(-n_b // group), h),
        in_specs=(_specs(cfg, tq, tk, d, n_b) + [_x_spec(tq, d), _full((t_b,)), _full((n_b,))]
                  + stat_specs),
        out_specs=[_x_spec(t_b, d)] * nb_out, out_shape=b_outs,
        compiler_params=_params(cfg, True), interpret=cfg.interpret,
        name=f"jagged_flash_bwd_{'dq' if k_rows else 'dkv'}_rest_{cfg.mode}",
    )(*_inputs(lay, q, k, v, k_rows), do, own, need, *stats)

    def a_kernel(*refs, cfg):   # 16; do, other_own, the partial buffers (unread), lse, delta;
        n = 18 + nb_out         # outs (k_rows: dK, dV, dQ, then the split tiles' partials)
        outs = refs[n + 2:]
        parts = dict(partial_refs=outs[3:] or None) if k_rows else {}   # _dkv_kernel's
        a_base(*refs[:17], *refs[n:n + 2], *outs[:3], cfg=cfg, other_own=refs[17], **parts)

    ins = _inputs(lay, q, k, v, not k_rows)
    n_a = tk // cfg.bk_dkv if k_rows else tq // cfg.bq
    split = _dkv_split(cfg) if k_rows else 1
    top = _dkv_top(cfg, split, n_a) if k_rows else 0
    if k_rows:    # outputs dK, dV, dQ (aliased to the dQ kernel's partial buffer), partials
        shapes, specs = _dkv_outputs(k, split, top, cfg.bk_dkv)
        a_shapes = shapes[:2] + [jax.ShapeDtypeStruct(q.shape, q.dtype)] + shapes[2:]
        a_specs, alias = specs[:2] + [_x_spec(tq, d)] + specs[2:], {len(ins) + 2: 2}
    else:         # outputs dQ, dK, dV (dK, dV aliased to the dK/dV kernel's partial buffers)
        a_shapes = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
                    jax.ShapeDtypeStruct(v.shape, v.dtype)]
        a_specs, alias = [_x_spec(tq, d)] + [_x_spec(tk, d)] * 2, {len(ins) + 2: 1, len(ins) + 3: 2}
    outs = pl.pallas_call(
        _adapt(a_kernel, cfg, 2 + nb_out, softmax, len(a_shapes)),
        grid=(_dkv_grid(cfg, split, n_a) if k_rows else n_a, h),
        in_specs=(_specs(cfg, tq, tk, d, n_a) + [_x_spec(tq, d), _full((t_b,))]
                  + [_x_spec(t_b, d)] * nb_out + stat_specs),
        out_specs=a_specs, out_shape=a_shapes, input_output_aliases=alias,
        compiler_params=_params(cfg, True), interpret=cfg.interpret,
        name=f"jagged_flash_bwd_{cfg.fused_bwd}_{cfg.mode}",
    )(*ins, do, own, *partial, *stats)
    if k_rows:
        dq = outs[2]
        return (dq,) + _dkv_results(outs[:2] + outs[3:], k, split, top, lay["k_perm"],
                                    cfg.bk_dkv)
    return tuple(outs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg, q, k, v, lay):
    return _forward(cfg, q, k, v, lay)[0]


def _flash_fwd(cfg, q, k, v, lay):
    o, lse = _forward(cfg, q, k, v, lay)
    return o, (q, k, v, lay, o, lse)


def _flash_bwd(cfg, res, do):
    q, k, v, lay, o, lse = res
    mcfg = None
    if cfg.backward == "mosaic":
        from kernels.mosaic_flash import flash_backward, run_backward  # here: it imports this
        mcfg = flash_backward(cfg, q.dtype, q.shape[-1], q.shape[0], k.shape[0])
    if mcfg is None:
        dq, dk, dv = _backward(cfg, q, k, v, lay, o, lse, do)
    else:
        h, tq = q.shape[1], q.shape[0]
        if cfg.mode != "softmax":
            lse = delta = jnp.zeros((h, tq), F32)                         # unread
        elif mcfg.fused_delta and not mcfg.fused_dq:
            delta = None                                  # the dQ kernel computes it from o
        else:
            delta = softmax_delta(o, do)
        dq, dk, dv = run_backward(mcfg, lay, q, k, v, do, lse, delta, interpret=cfg.interpret,
                                  o=o)
    zero_lay = jax.tree.map(_zero_cotangent, lay)
    return dq, dk, dv, zero_lay


def _zero_cotangent(x):
    if jnp.issubdtype(x.dtype, jnp.integer):
        return jnp.zeros(x.shape, jax.dtypes.float0)
    return jnp.zeros_like(x)


_flash.defvjp(_flash_fwd, _flash_bwd)


# ------------------------------------------------------------------- tile ranges

_BIG = 1 << 30


def _token_ranges(seg, pos, b, other_off, cfg, side):
    """Per token [start, end) of the other side's rows it can pair with (empty: BIG, 0)."""
    valid = (seg >= 0) & (seg < b)
    s = jnp.clip(seg, 0, b - 1)
    base = jnp.take(other_off, s)
    n = jnp.take(other_off, s + 1) - base
    lo = jnp.zeros_like(pos)
    hi = n
    w = cfg.window
    if side == "q":
        if cfg.causal:
            hi = jnp.minimum(hi, pos + 1)
        if w is not None:
            lo = jnp.maximum(lo, pos - w + 1)
            if not cfg.causal:
                hi = jnp.minimum(hi, pos + w)
    else:
        if cfg.causal:
            lo = jnp.maximum(lo, pos)
        if w is not None:
            hi = jnp.minimum(hi, pos + w)
            if not cfg.causal:
                lo = jnp.maximum(lo, pos - w + 1)
    if cfg.block is not None:
        bl = (pos // cfg.block) * cfg.block
        lo = jnp.maximum(lo, bl)
        hi = jnp.minimum(hi, bl + cfg.block)
    ok = valid & (lo < hi)
    return jnp.where(ok, base + lo, _BIG), jnp.where(ok, base + hi, 0)


def tile_ranges(start, end, row_tile, col_tile):
    """Per row tile, the [first, last) column tiles covering its tokens' [start, end)."""
    n = start.shape[0] // row_tile
    lo = start.reshape(n, row_tile).min(axis=1)
    hi = end.reshape(n, row_tile).max(axis=1)
    first = lo // col_tile
    last = (hi + col_tile - 1) // col_tile
    empty = hi <= lo
    return jnp.where(empty, 0, first).astype(jnp.int32), jnp.where(empty, 0, last).astype(jnp.int32)


def interior_ranges(start, end, row_tile, col_tile, lo, hi):
    """Per row tile, the [first, last) column tiles whose every pair is valid.

    A pair is valid iff the column lies in its row's [start, end) (exact for the
    sample, causal, window and block masks, which give one interval per token), so
    the columns valid for the whole tile are the intersection [max start, min end);
    a padding row (start BIG, end 0) empties it. Clipped to [lo, hi) so that
    lo <= first <= last <= hi; empty -> first = last = hi (all tiles masked).
    """
    n = start.shape[0] // row_tile
    s = start.reshape(n, row_tile).max(axis=1)
    e = end.reshape(n, row_tile).min(axis=1)
    first = jnp.clip((s + col_tile - 1) // col_tile, lo, hi)
    last = jnp.clip(e // col_tile, first, hi)
    empty = last <= first
    return (jnp.where(empty, hi, first).astype(jnp.int32),
            jnp.where(empty, hi, last).astype(jnp.int32))


def build_layout(cfg, q_offsets, kv_offsets, tq, tk, d, rope_positions=None, rope_theta=None):
    """Everything the kernels read besides q/k/v: the offsets, segment ids, positions,
    per query row its key interval [q_start, q_end) and per key row its query interval
    [k_start, k_end) (empty: BIG, 0), tile ranges, RoPE."""
    b = q_offsets.shape[0] - 1
    q_offsets = q_offsets.astype(jnp.int32)
    kv_offsets = kv_offsets.astype(jnp.int32)
    qs, qp = segment_layout(q_offsets, tq)
    ks, kp = key_layout(kv_offsets, tk)
    qa, qb = _token_ranges(qs, qp, b, kv_offsets, cfg, "q")
    q_lo, q_hi = tile_ranges(qa, qb, cfg.bq, cfg.bk)       # per q tile: key tiles
    ka, kb = _token_ranges(ks, kp, b, q_offsets, cfg, "k")
    k_lo, k_hi = tile_ranges(ka, kb, cfg.bk_dkv, cfg.bq_dkv)  # per key tile: q tiles
    q_flo, q_fhi = interior_ranges(qa, qb, cfg.bq, cfg.bk, q_lo, q_hi)
    k_flo, k_fhi = interior_ranges(ka, kb, cfg.bk_dkv, cfg.bq_dkv, k_lo, k_hi)
    cos = sin = None
    if cfg.rope:
        pos = qp if rope_positions is None else rope_positions
        cos, sin = rope_tables(pos, d, rope_theta)
    return dict(q_offsets=q_offsets, kv_offsets=kv_offsets,
                qs=qs, qp=qp, ks=ks, kp=kp, q_start=qa, q_end=qb, k_start=ka, k_end=kb,
                q_lo=q_lo, q_hi=q_hi, k_lo=k_lo, k_hi=k_hi,
                q_flo=q_flo, q_fhi=q_fhi, k_flo=k_flo, k_fhi=k_fhi,
                q_perm=_heaviest_first(q_lo, q_hi, cfg, short=_is_short(tk, b)),
                k_perm=_heaviest_first(k_lo, k_hi, cfg, short=_is_short(tq, b)),
                cos=cos, sin=sin)


def _heaviest_first(lo, hi, cfg, short=False):
    """Tile launch order: most inner-loop work first (shorter tail of long samples).
    In order where the inner loop runs over a short side (at most SHORT_SIDE tokens per
    sample: one or two tiles for every tile, nothing to balance), saving the sort."""
    if not cfg.heavy_first or short:
        return jnp.arange(lo.shape[0], dtype=jnp.int32)
    return jnp.argsort(lo - hi, stable=True).astype(jnp.int32)


def _pad_rows(x, n):
    return x if x.shape[0] == n else jnp.pad(x, [(0, n - x.shape[0])] + [(0, 0)] * (x.ndim - 1))


def _pow2_floor(x):
    return 1 << (max(int(x), 1).bit_length() - 1)


def adapt_tiles(cfg, tq, tk, b, dtype):
    """Shrink tiles for short samples and for float32 (static shapes only).

    Short samples (capacity / B below the tile, e.g. 16 PMA queries or 32 summary
    keys per sample) get tiles of about one sample, so a tile does not pull in the
    neighbours' pairs; float32 tiles are halved to fit shared memory.
    """
    per_q = _pow2_floor(max(16, tq // max(b, 1)))
    per_k = _pow2_floor(max(16, tk // max(b, 1)))
    r = {}
    r["bq"], r["bq_dkv"] = min(cfg.bq, per_q), min(cfg.bq_dkv, per_q)
    r["bk"], r["bk_dkv"] = min(cfg.bk, per_k), min(cfg.bk_dkv, per_k)
    if jnp.dtype(dtype) == F32:
        r = dict(bq=min(r["bq"], 64), bk=min(r["bk"], 32), bq_dkv=min(r["bq_dkv"], 32),
                 bk_dkv=min(r["bk_dkv"], 32))
    return dataclasses.replace(cfg, **r)


def fused_backward_side(cfg, tq, tk, b):
    """cfg.fused_bwd resolved for capacities tq / tk and B samples: one of FUSED_BWD but
    "auto".

    "auto": "q_rows" where queries per sample are at most SHORT_SIDE (PMA's 16: W3 on an
    H200, forward+backward 0.519 ms against 0.610 unfused and 0.574 with dQ added by
    float32 atomics in the dK/dV kernel, a mode since removed), else "k_rows" where keys
    per sample are (W2's 32: 0.343 against 0.357 unfused), else "off"; "off" with RoPE
    (the fused kernels do not rotate).
    """
    if cfg.fused_bwd not in FUSED_BWD:
        raise ValueError(f"pallas attention: fused_bwd must be one of {FUSED_BWD}, "
                         f"got {cfg.fused_bwd!r}")
    if cfg.fused_bwd != "auto":
        if cfg.rope and cfg.fused_bwd != "off":
            raise ValueError(f"pallas attention: fused_bwd {cfg.fused_bwd!r} does not take "
                             "RoPE; use 'off' or 'auto'")
        return cfg.fused_bwd
    if cfg.rope:
        return "off"
    if _is_short(tq, b):
        return "q_rows"
    return "k_rows" if _is_short(tk, b) else "off"


def backward_knobs(cfg):
    """cfg's dkv_split, dkv_split_tiles and rest_group resolved (cfg.fused_bwd already
    resolved): ints.

    "auto", with "k_rows" (a short key side: each key tile's query loop runs over a whole
    sample's queries, up to 4096): the 32 heaviest key tiles split in 4, the rest kernel
    over 8 tiles per program; with "q_rows" the rest kernel over 8 tiles; else no split,
    one tile per program. H200, forward+backward per call, one run:
    W2 GDPA 0.287 ms against 0.330 with the former default (every tile split in 2),
    0.338 unsplit, 0.351 every tile in 4, 0.281-0.327 over splits {2, 4, 8} x top
    {16, 32, 64}; softmax 0.338 against 0.383; W3 (call 1) rest_group 8 0.516 / 0.526
    against 0.519 / 0.541 (GDPA / softmax).
    """
    k_rows, fused = cfg.fused_bwd == "k_rows", cfg.fused_bwd in ("k_rows", "q_rows")
    auto = dict(dkv_split=4 if k_rows else 1, dkv_split_tiles=32 if k_rows else 0,
                rest_group=8 if fused else 1)
    resolved = {}
    for name, least in (("dkv_split", 1), ("dkv_split_tiles", 0), ("rest_group", 1)):
        value = getattr(cfg, name)
        resolved[name] = (auto[name] if value == "auto"
                          else _int_knob(name, value, least))
    return dataclasses.replace(cfg, **resolved)


def _int_knob(name, value, least):
    """value, or a ValueError naming the knob unless it is an int >= least."""
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"pallas attention: {name} must be an int >= {least} or 'auto', "
                         f"got {value!r}")
    return value


def _is_short(capacity, b):
    """Whether a side of `capacity` tokens over b samples is short (SHORT_SIDE per sample)."""
    return capacity <= SHORT_SIDE * max(b, 1)


def jagged_flash(cfg, q, k, v, q_offsets, kv_offsets, rope_positions=None, rope_theta=None):
    """q [Tq,H,D], k/v [Tk,H,D], offsets [B+1] -> [Tq,H,D] in q.dtype; differentiable.

    Capacities are padded to a multiple of 128 internally; padding rows come out 0.
    Tiles are adapted to the shapes (adapt_tiles).
    """
    tq, h, d = q.shape
    tk = k.shape[0]
    cfg = adapt_tiles(cfg, tq, tk, q_offsets.shape[0] - 1, q.dtype)
    cfg = dataclasses.replace(cfg, fused_bwd=fused_backward_side(cfg, tq, tk,
                                                                 q_offsets.shape[0] - 1))
    step = 16 * (2 if cfg.rope else 1)
    if d % step:
        raise ValueError(f"pallas attention: head dim D={d} must be a multiple of {step} "
                         "(Triton dots need every dim >= 16); use impl='reference'")
    for name, engine in (("forward", cfg.forward), ("backward", cfg.backward)):
        if engine not in ("triton", "mosaic"):
            raise ValueError(f"pallas attention: {name} must be 'triton' or 'mosaic', got {engine!r}")
    cfg = backward_knobs(cfg)
    for t in (cfg.bq, cfg.bk, cfg.bq_dkv, cfg.bk_dkv):
        if t < 16 or PAD_MULTIPLE % t:
            raise ValueError(f"pallas attention: tile {t} must be >= 16 and divide {PAD_MULTIPLE}")
    if q_offsets.shape[0] == 1:  # no samples
        return jnp.zeros_like(q)
    tqp = -(-tq // PAD_MULTIPLE) * PAD_MULTIPLE
    tkp = -(-tk // PAD_MULTIPLE) * PAD_MULTIPLE
    if rope_positions is not None:
        rope_positions = _pad_rows(rope_positions, tqp)
    lay = build_layout(cfg, q_offsets, kv_offsets, tqp, tkp, d // 2 * 2 if cfg.rope else d,
                       rope_positions, rope_theta)
    lay = {kk: vv for kk, vv in lay.items()}
    out = _flash(cfg, _pad_rows(q, tqp), _pad_rows(k, tkp), _pad_rows(v, tkp), lay)
    return out[:tq]
