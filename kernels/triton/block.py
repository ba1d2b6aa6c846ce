"""block_attention's per-block Triton kernel: one program per (head, block), RoPE fused.

A sample of length L splits into ceil(L / block) blocks; block n starts at token
start[n] and holds len[n] <= block tokens. Each program loads its block's q, k, v
rows ([block, D], at an unaligned start, rows past len masked to 0), rotates q and
k in registers and does the whole softmax in one tile: no key loop, no online
rescaling, no saved statistics. RoPE angles are computed in the kernel (`_trig`):
with the default positions, from each token's offset in its block (scores and
gradients depend on position differences only; 16-bit inputs skip the angle
reduction); with given positions, from those, Cody-Waite reduced as
kernels.common.rope_tables.

Backward: one program per (head, block) recomputes P from q and k and produces
dQ, dK and dV together (a block is one tile, so nothing is shared across
programs); delta = rowsum(P * dP) is formed in the tile (equal to rowsum(dO * O)),
so O is not read. dQ and dK are rotated back before the store (RoPE backward fused).

Rows of the packed buffer past offsets[-1] are covered by extra "tail" programs
that store zeros, so every output row is written exactly once and nothing needs a
memset. Blocks other than 16/32/64 (or 128 in 16-bit) use the tiled kernels
(kernels.dispatch.jagged_flash) with a block mask.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels.common import rope_angle, segment_layout
from kernels.triton.tile import LOG2E

F32 = jnp.float32

# Which kernel a block the per-block kernel takes goes to: "per_block" or "tiled" (the
# tiled kernels with a block mask).
ENGINE = "per_block"


def per_block_kernel_fits(block, dtype):
    """Whether the one-program-per-block kernel takes this block size (else tiled engine)."""
    if block in (16, 32, 64):
        return True
    return block == 128 and jnp.dtype(dtype).itemsize == 2


def block_table(offsets, capacity, block, multiple=1):
    """Per program n: (start [NB], len [NB], write_len [NB]) int32, NB static.

    Real blocks first (sample by sample), then tail programs covering rows
    offsets[-1]..capacity (len 0: they store zeros), then idle programs
    (write_len 0). NB = ceil(capacity / block) + B + 1 bounds the count, rounded up
    to a multiple of `multiple` (idle programs fill the last group of a kernel that
    takes `multiple` blocks per program).
    """
    b = offsets.shape[0] - 1
    nb = -(-capacity // block) + b + 1
    nb += -nb % multiple
    offsets = offsets.astype(jnp.int32)
    lengths = offsets[1:] - offsets[:-1]
    nblk = (lengths + block - 1) // block
    base = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(nblk).astype(jnp.int32)])
    seg, idx = segment_layout(base, nb)                  # block n -> (sample, block in sample)
    real = seg < b
    s = jnp.clip(seg, 0, max(b - 1, 0))
    start = jnp.take(offsets, s) + idx * block
    ln = jnp.clip(jnp.take(lengths, s) - idx * block, 0, block)
    tail_i = jnp.arange(nb, dtype=jnp.int32) - base[-1]
    tail_start = offsets[-1] + tail_i * block
    tail_w = jnp.clip(capacity - tail_start, 0, block)
    start = jnp.where(real, start, jnp.where(tail_w > 0, tail_start, 0))
    return (start.astype(jnp.int32), jnp.where(real, ln, 0).astype(jnp.int32),
            jnp.where(real, ln, tail_w).astype(jnp.int32))


# ----------------------------------------------------------------------------- kernels

def _dot(a, b, dims):
    prec = lax.Precision.HIGHEST if a.dtype == F32 else None  # fp32: IEEE, not TF32
    return lax.dot_general(a, b, (dims, ((), ())), precision=prec, preferred_element_type=F32)


def _load(ref, rows, cols, valid):
    return plgpu.load(ref.at[rows, cols], mask=valid[:, None], other=0)


def _rotated(ref, rows, valid, cos, sin):
    """The block's rows of `ref` rotated by RoPE, as two [block, D/2] halves (ref dtype)."""
    return _rotated_cols(ref, rows, _halves(ref), valid, cos, sin)


def _halves(ref):
    """Column slices of ref's two RoPE halves."""
    half = ref.shape[-1] // 2
    return pl.ds(0, half), pl.ds(half, half)


def _approx(op, x):
    [y] = plgpu.elementwise_inline_asm(f"{op}.approx.f32 $0, $1;", args=[x], constraints="=f,f",
                                       pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct.like(x)])
    return y


def _cos_sin(a, fast):
    """(cos, sin) of angles in [-pi, pi]: MUFU approximations when fast, else libdevice."""
    if fast:
        return _approx("cos", a), _approx("sin", a)
    return jnp.cos(a), jnp.sin(a)


def _rows_of(entry, block):
    """(rows, valid [block], write [block]) of a block's table entry (start, len, write_len)."""
    start, ln, wl = entry
    rows = pl.ds(start, block)
    r = lax.broadcasted_iota(jnp.int32, (block,), 0)
    return rows, r < ln, r < wl


def _trig(rope_refs, rows, valid, cs, fast_trig, dtype):
    """trig(cols) -> (cos, sin) [block, w] f32 of the RoPE half-columns `cols` for the
    block's rows. rope_refs: (f1, f2, f3) (rope_freq_parts) with the angles of the rows'
    offsets in the block (relative angles; see block_attention_pallas), or (positions [T],
    f1, f2, f3). Angles are reduced to [-pi, pi] (Cody-Waite, kernels.common.rope_angle)
    except relative ones for 16-bit inputs: offset * freq < block rad, one multiply per
    element instead of the reduction's ~12 ops, goes to cos / sin as is (cos.approx /
    sin.approx under fast_trig reduce it themselves: absolute error ~1e-5 at 128 rad,
    far below 16-bit rounding)."""
    block = valid.shape[0]
    *pos_ref, f1, f2, f3 = rope_refs
    if pos_ref:
        p = plgpu.load(pos_ref[0].at[rows], mask=valid, other=0).astype(F32)[:, None]
    else:
        p = lax.broadcasted_iota(jnp.int32, (block, 1), 0).astype(F32)
    if not pos_ref and jnp.dtype(dtype).itemsize == 2:
        return lambda cols: _cos_sin(p * (f1[cols] + f2[cols] + f3[cols])[None, :], fast_trig)
    return lambda cols: _cos_sin(rope_angle(p, *(f[cols][None, :] for f in (f1, f2, f3)), cs),
                                 fast_trig)


def _scores_by_chunks(q_ref, k_ref, rows, valid, trig, chunks):
    """S = rot(q) rot(k)^T [block, block] f32 with RoPE applied in a loop over `chunks`
    column chunks of each half: a chunk's angles, cos / sin and rotated columns die
    before the next, so far fewer registers are live than with whole [block, D/2]
    tables (the resource report: 244 -> 130 per thread at 4 warps, 80 at 8)."""
    half = q_ref.shape[-1] // 2
    w = half // chunks

    def chunk(c, s):
        cols = (pl.ds(c * w, w), pl.ds(half + c * w, w))
        cos, sin = trig(cols[0])
        (q1, q2), (k1, k2) = (_rotated_cols(ref, rows, cols, valid, cos, sin)
                              for ref in (q_ref, k_ref))
        return s + _dot(q1, k1, ((1,), (1,))) + _dot(q2, k2, ((1,), (1,)))
    block = valid.shape[0]
    return lax.fori_loop(0, chunks, chunk, jnp.zeros((block, block), F32))


def _rotated_cols(ref, rows, cols, valid, cos, sin):
    """Columns cols = (first-half chunk, second-half chunk) of the block's rows of ref,
    rotated by RoPE (ref dtype)."""
    x1, x2 = (_load(ref, rows, c, valid).astype(F32) for c in cols)
    dt = ref.dtype
    return (x1 * cos - x2 * sin).astype(dt), (x2 * cos + x1 * sin).astype(dt)


def _probs(q1, q2, k1, k2, valid, scale):
    """Softmax probabilities [block, block] f32 of one block; invalid rows/cols are 0."""
    return _softmax(_dot(q1, k1, ((1,), (1,))) + _dot(q2, k2, ((1,), (1,))), valid, scale)


def _softmax(s, valid, scale):
    """Softmax of scores s [block, block] f32 (times scale); invalid rows/cols are 0."""
    s = s * (scale * LOG2E)
    both = valid[:, None] & valid[None, :]
    s = jnp.where(both, s, -1e30)
    p = jnp.exp2(s - jnp.max(s, axis=1)[:, None])  # base 2: exp2 is one MUFU op
    p = jnp.where(both, p, 0.0)
    inv = 1.0 / jnp.maximum(jnp.sum(p, axis=1), 1e-30)  # block divides, not block^2
    return p * inv[:, None]


def _store(ref, rows, write, x):
    plgpu.store(ref.at[rows, :], x.astype(ref.dtype), mask=write[:, None])


def _store_halves(ref, rows, write, g1, g2, cos, sin, cols=None):
    """Store a gradient given w.r.t. the rotated halves (or the half chunks `cols`),
    rotated back (RoPE^T)."""
    c1, c2 = cols or _halves(ref)
    plgpu.store(ref.at[rows, c1], (g1 * cos + g2 * sin).astype(ref.dtype), mask=write[:, None])
    plgpu.store(ref.at[rows, c2], (g2 * cos - g1 * sin).astype(ref.dtype), mask=write[:, None])


def _dscores(p, dp, scale, dtype):
    """dS = P (dP - rowsum(P dP)) scale of a softmax block, in dtype (rowsum(P dP) equals
    rowsum(dO O), so O is not read)."""
    delta = jnp.sum(p * dp, axis=1)
    return (p * (dp - delta[:, None]) * scale).astype(dtype)


def _each_block(group, tab_refs, fn):
    """Run fn(entry) for this program's `group` consecutive blocks, entry = the block's
    (start, len, write_len). A group of a power of two blocks loads its entries up front
    as three vectors, so a block's q / k / v loads wait for no table load of their own
    (one load latency per program instead of one per block)."""
    first = pl.program_id(1) * group
    if group == 1:
        fn(tuple(r[first] for r in tab_refs))
        return
    if group & (group - 1) == 0:
        vecs = [r[pl.ds(first, group)] for r in tab_refs]
        lane = lax.broadcasted_iota(jnp.int32, (group,), 0)
        entry = lambda g: tuple(jnp.sum(jnp.where(lane == g, x, 0)) for x in vecs)  # noqa: E731
    else:
        entry = lambda g: tuple(r[first + g] for r in tab_refs)  # noqa: E731

    def body(g, carry):
        fn(entry(g))
        return carry
    lax.fori_loop(0, group, body, 0)


def _fwd_kernel(*refs, block, scale, cs, group, fast_trig, rope_chunks):
    _each_block(group, refs[:3], lambda e: _fwd_block(
        e, *refs[3:], block=block, scale=scale, cs=cs, fast_trig=fast_trig,
        rope_chunks=rope_chunks))


def _bwd_kernel(*refs, block, scale, cs, group, fast_trig, rope_chunks, early_loads):
    _each_block(group, refs[:3], lambda e: _bwd_block(
        e, *refs[3:], block=block, scale=scale, cs=cs, fast_trig=fast_trig,
        rope_chunks=rope_chunks, early_loads=early_loads))


def _fwd_block(entry, *refs, block, scale, cs, fast_trig, rope_chunks):
    """entry: the block's table entry; refs: the RoPE inputs (`_trig`), q, k, v, o."""
    rope, (q_ref, k_ref, v_ref, o_ref) = refs[:-4], refs[-4:]
    rows, valid, write = _rows_of(entry, block)
    trig = _trig(rope, rows, valid, cs, fast_trig, q_ref.dtype)
    if rope_chunks > 1:
        p = _softmax(_scores_by_chunks(q_ref, k_ref, rows, valid, trig, rope_chunks), valid,
                     scale)
        v = _load(v_ref, rows, pl.ds(0, v_ref.shape[-1]), valid)
        _store(o_ref, rows, write, _dot(p.astype(v.dtype), v, ((1,), (0,))))
        return
    cos, sin = trig(_halves(q_ref)[0])
    q1, q2 = _rotated(q_ref, rows, valid, cos, sin)
    k1, k2 = _rotated(k_ref, rows, valid, cos, sin)
    v = _load(v_ref, rows, pl.ds(0, v_ref.shape[-1]), valid)
    p = _probs(q1, q2, k1, k2, valid, scale)
    _store(o_ref, rows, write, _dot(p.astype(v.dtype), v, ((1,), (0,))))


def _bwd_block(entry, *refs, block, scale, cs, fast_trig, rope_chunks, early_loads=False):
    """entry: the block's table entry; refs: the RoPE inputs (`_trig`), q, k, v, do, dq,
    dk, dv."""
    rope = refs[:-7]
    q_ref, k_ref, v_ref, do_ref, dq_ref, dk_ref, dv_ref = refs[-7:]
    rows, valid, write = _rows_of(entry, block)
    trig = _trig(rope, rows, valid, cs, fast_trig, q_ref.dtype)
    if rope_chunks > 1:
        _bwd_block_by_chunks(rows, valid, write, trig, q_ref, k_ref, v_ref, do_ref, dq_ref,
                             dk_ref, dv_ref, scale=scale, chunks=rope_chunks,
                             early_loads=early_loads)
        return
    cos, sin = trig(_halves(q_ref)[0])
    q1, q2 = _rotated(q_ref, rows, valid, cos, sin)
    k1, k2 = _rotated(k_ref, rows, valid, cos, sin)
    v = _load(v_ref, rows, pl.ds(0, v_ref.shape[-1]), valid)
    do = _load(do_ref, rows, pl.ds(0, do_ref.shape[-1]), valid)
    p = _probs(q1, q2, k1, k2, valid, scale)
    _store(dv_ref, rows, write, _dot(p.astype(do.dtype), do, ((0,), (0,))))
    ds = _dscores(p, _dot(do, v, ((1,), (1,))), scale, q1.dtype)
    nn, tn = ((1,), (0,)), ((0,), (0,))
    _store_halves(dq_ref, rows, write, _dot(ds, k1, nn), _dot(ds, k2, nn), cos, sin)
    _store_halves(dk_ref, rows, write, _dot(ds, q1, tn), _dot(ds, q2, tn), cos, sin)


def _bwd_block_by_chunks(rows, valid, write, trig, q_ref, k_ref, v_ref, do_ref, dq_ref, dk_ref,
                         dv_ref, *, scale, chunks, early_loads=False):
    """The backward with RoPE in column chunks (rope_chunks_bwd): S from the chunk loop
    of the forward, then dV and dS, then a second chunk loop that rotates q and k's
    chunk again (angles recomputed, rows re-read, from cache) for that chunk's dQ and
    dK columns, rotated back and stored. Only dS lives across the two loops.
    early_loads (knob early_loads_bwd): dO and V are loaded before the score loop, so
    their reads overlap it (more registers live across it)."""
    load = lambda ref: _load(ref, rows, pl.ds(0, ref.shape[-1]), valid)   # noqa: E731
    do, v = (load(do_ref), load(v_ref)) if early_loads else (None, None)
    p = _softmax(_scores_by_chunks(q_ref, k_ref, rows, valid, trig, chunks), valid, scale)
    do = load(do_ref) if do is None else do
    _store(dv_ref, rows, write, _dot(p.astype(do.dtype), do, ((0,), (0,))))
    dp = _dot(do, load(v_ref) if v is None else v, ((1,), (1,)))
    ds = _dscores(p, dp, scale, q_ref.dtype)
    half = q_ref.shape[-1] // 2
    w = half // chunks
    nn, tn = ((1,), (0,)), ((0,), (0,))

    def chunk(c, carry):
        cols = (pl.ds(c * w, w), pl.ds(half + c * w, w))
        cos, sin = trig(cols[0])
        q1, q2 = _rotated_cols(q_ref, rows, cols, valid, cos, sin)
        k1, k2 = _rotated_cols(k_ref, rows, cols, valid, cos, sin)
        _store_halves(dq_ref, rows, write, _dot(ds, k1, nn), _dot(ds, k2, nn), cos, sin, cols)
        _store_halves(dk_ref, rows, write, _dot(ds, q1, tn), _dot(ds, q2, tn), cos, sin, cols)
        return carry
    lax.fori_loop(0, chunks, chunk, 0)


# ------------------------------------------------------------------------ pallas calls

def _full(shape):
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def _call(kernel, n_out, cfg, tab, rope, xs, bwd):
    block, knobs, interpret, scale, cs = cfg
    tp, h, d = xs[0].shape
    nb = tab[0].shape[0]
    x_spec = pl.BlockSpec((tp, None, d), lambda hh, n: (0, hh, 0))
    in_specs = [_full((nb,))] * 3 + [_full(r.shape) for r in rope] + [x_spec] * len(xs)
    sfx = "_bwd" if bwd else ""
    params = plgpu.CompilerParams(num_warps=knobs["num_warps" + sfx],
                                  num_stages=knobs["num_stages" + sfx])
    group = knobs["group" + sfx]
    fast_trig = bool(knobs["fast_trig"]) and xs[0].dtype.itemsize == 2 and not interpret
    extra = dict(early_loads=bool(knobs["early_loads_bwd"])) if bwd else {}
    out = pl.pallas_call(
        functools.partial(kernel, block=block, scale=scale, cs=cs, group=group,
                          fast_trig=fast_trig, rope_chunks=int(knobs["rope_chunks" + sfx]),
                          **extra),
        grid=(h, nb // group),
        in_specs=in_specs, out_specs=[x_spec] * n_out,
        out_shape=[jax.ShapeDtypeStruct(xs[0].shape, xs[0].dtype)] * n_out,
        compiler_params=params, interpret=interpret,
        name="block_attention" + (sfx or "_fwd"),
    )(*tab, *rope, *xs)
    return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _block_attn(cfg, q, k, v, tab, rope):
    return _call(_fwd_kernel, 1, cfg, tab, rope, (q, k, v), False)[0]


def _block_attn_fwd(cfg, q, k, v, tab, rope):
    return _block_attn(cfg, q, k, v, tab, rope), (q, k, v, tab, rope)


def _block_attn_bwd(cfg, res, do):
    q, k, v, tab, rope = res
    dq, dk, dv = _call(_bwd_kernel, 3, cfg, tab, rope, (q, k, v, do), True)
    zero = lambda x: (jnp.zeros(x.shape, jax.dtypes.float0)  # noqa: E731
                      if jnp.issubdtype(x.dtype, jnp.integer) else jnp.zeros_like(x))
    return dq, dk, dv, tuple(map(zero, tab)), tuple(map(zero, rope))


_block_attn.defvjp(_block_attn_fwd, _block_attn_bwd)


def run_block_attention(cfg, q, k, v, tab, rope):
    """The per-block kernels as a differentiable op (custom VJP: forward, then the one
    backward kernel for dQ, dK, dV): q / k / v [T', H, DP] (halves padded as
    kernels.dispatch.block_attention_pallas lays them out), tab = block_table(...)'s
    arrays, rope = the frequency tables (positions first when given) -> [T', H, DP].
    cfg = (block, knobs (BLOCK_KNOBS keys), interpret, sm_scale, cs), static."""
    return _block_attn(cfg, q, k, v, tab, rope)
