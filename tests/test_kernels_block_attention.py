"""block_attention vs the float64 per-sample numpy formula (block mask + RoPE), fwd and grads."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import block_attention
from kernels.block_attention import block_attention_reference, block_attention_reference_dense
from test_kernels_common import (assert_only_slice_changes, check_against, np_attention,
                                 offsets_of, random_qkv, vjp_outputs)

LENS = [0, 1, 63, 64, 65, 130, 3]  # 326 tokens in capacity 384


def _check(impl, lens, t, **kw):
    _check_all([dict(impl=impl, lens=lens, t=t, **kw)])


def _check_all(cases):
    """Each case (dict: impl, lens, t, optional dtype, h, d, block, theta, positions, seed,
    knobs) against the float64 formula, out and all gradients; every case in one jitted
    program (its kernels compile together)."""
    runs, args = [], []
    for c in cases:
        impl, lens, t = c["impl"], c["lens"], c["t"]
        dtype, h, d, block = (c.get("dtype", jnp.float32), c.get("h", 2), c.get("d", 32),
                              c.get("block", 64))
        theta, positions, knobs = c.get("theta", 10_000.0), c.get("positions"), c.get("knobs")
        rng = np.random.default_rng(c.get("seed", 0))
        args.append(random_qkv(rng, t, t, h, d, dtype, scale=1.0))
        off = offsets_of(lens)
        pos = None if positions is None else jnp.asarray(positions, jnp.int32)
        kw = dict(block=block, positions=pos, rope_theta=theta)
        o = jnp.asarray(off)
        if impl == "dense":
            fn = lambda q, k, v, o=o, kw=kw: block_attention_reference_dense(q, k, v, o, **kw)
        elif impl == "reference":
            fn = lambda q, k, v, o=o, kw=kw: block_attention_reference(q, k, v, o, **kw)
        elif knobs:
            from kernels.dispatch import block_attention_pallas
            fn = lambda q, k, v, o=o, kw=kw, knobs=knobs: block_attention_pallas(
                q, k, v, o, **kw, **knobs)
        else:
            fn = lambda q, k, v, o=o, kw=kw, impl=impl: block_attention(q, k, v, o, impl=impl,
                                                                        **kw)
        runs.append((impl, dtype, d, block, theta, positions, off, knobs, fn))
    got = jax.jit(lambda args: [vjp_outputs(r[-1], *a) for r, a in zip(runs, args)])(args)
    for (impl, dtype, d, block, theta, positions, off, knobs, _), a, g in zip(runs, args, got):
        want = np_attention(*a, off, off, mode="softmax", scale=d ** -0.5, block=block,
                            rope_theta=theta, positions=positions)
        check_against(g, want, dtype, f"block_attention[{impl}] block={block} d={d} {knobs}",
                      q_end=off[-1])


def test_references():
    """Both references on blocks of 64; the chunked one on blocks of 16, theta 500,
    custom positions."""
    pos = np.random.default_rng(5).integers(0, 5000, size=256)
    _check_all([dict(impl="reference", lens=LENS, t=384), dict(impl="dense", lens=LENS, t=384),
                dict(impl="reference", lens=[0, 15, 16, 17, 40, 1, 100], t=256, block=16,
                     theta=500.0, positions=pos)])


def test_pallas_block_sizes_engines_and_padded_halves():
    """block 64 (default engine); other block sizes: 32 through the per-block kernel, no
    tail (T = sum); 16 with tails, 3 / 2 blocks per program; 48 through the tiled engine;
    both engines on block 64 (the per-block one with libdevice trig); each RoPE half
    zero-padded to a power of two (zero frequencies on the zero lanes; the real D's
    frequencies and scale), custom positions."""
    pos = np.random.default_rng(9).integers(0, 3000, size=384)
    _check_all([dict(impl="pallas", lens=LENS, t=384)] + [
        dict(impl="pallas", lens=lens, t=t, block=block, h=1, d=32, seed=2, knobs=knobs)
        for block, lens, t, knobs in [
            (32, [31, 32, 33, 0, 1, 100], 197, None),
            (16, [0, 15, 16, 17, 40, 2], 160, dict(group=3, group_bwd=2)),
            (48, [0, 1, 47, 48, 49, 100], 384, None)]] + [
        dict(impl="pallas", lens=LENS, t=384, seed=3, knobs=dict(engine="tiled")),
        dict(impl="pallas", lens=LENS, t=384, seed=3,
             knobs=dict(engine="per_block", fast_trig=False))] + [
        dict(impl="pallas", lens=LENS, t=384, d=d, block=block, positions=pos, seed=4)
        for d, block in [(8, 64), (48, 16)]])


def test_bad_engine_is_named():
    from kernels.dispatch import block_attention_pallas
    q = jnp.zeros((64, 1, 32), jnp.float32)
    with pytest.raises(ValueError, match="engine"):
        block_attention_pallas(q, q, q, jnp.array([0, 64], jnp.int32), engine="mosaic")


def test_padded_head_dims_only_through_the_per_block_kernel():
    from kernels.dispatch import block_attention_pallas
    q = jnp.zeros((64, 1, 24), jnp.float32)
    off = jnp.array([0, 64], jnp.int32)
    with pytest.raises(ValueError, match="tiled engine"):
        block_attention_pallas(q, q, q, off, engine="tiled")
    with pytest.raises(ValueError, match="tiled engine"):
        block_attention_pallas(q, q, q, off, block=48)


def test_pallas_bf16_custom_and_default_positions():
    """16-bit inputs, D = 64: custom positions; the default positions, where the kernels
    rotate by each token's offset in its block with unreduced angles
    (kernels/triton/block.py, _trig), on blocks of 64 and 128."""
    pos = np.random.default_rng(6).integers(0, 5000, size=384)
    _check_all([dict(impl="pallas", lens=LENS, t=384, dtype=jnp.bfloat16, d=64, h=1,
                     positions=pos)] + [
        dict(impl="pallas", lens=LENS + [128, 129], t=640, dtype=jnp.bfloat16, d=64, h=1,
             block=block, seed=7) for block in (64, 128)])


def test_rope_changes_the_result():
    """RoPE is really applied: a different theta gives a different output."""
    rng = np.random.default_rng(7)
    q, k, v, _ = random_qkv(rng, 128, 128, 1, 32, jnp.float32, scale=1.0)
    off = jnp.asarray(offsets_of([100]))
    a, b = jax.jit(lambda q, k, v: [block_attention(q, k, v, off, rope_theta=theta,
                                                    impl="reference")
                                    for theta in (10_000.0, 10.0)])(q, k, v)
    assert not np.allclose(a, b, atol=1e-3)


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_blocks_and_samples_are_isolated(impl):
    """Changing block 1 of sample 5 changes nothing outside that block."""
    rng = np.random.default_rng(1)
    q, k, v, _ = random_qkv(rng, 384, 384, 1, 32, jnp.float32, scale=1.0)
    off = offsets_of(LENS)
    f = jax.jit(lambda q, k, v: block_attention(q, k, v, jnp.asarray(off), impl=impl))
    sl = slice(off[5] + 64, off[5] + 128)
    assert_only_slice_changes(f, q, k, v, sl, rng)


def test_bad_inputs_name_the_input():
    q = jnp.zeros((16, 2, 32), jnp.float32)
    off = jnp.array([0, 4, 16], jnp.int32)
    with pytest.raises(ValueError, match="positions"):
        block_attention(q, q, q, off, positions=jnp.zeros((8,), jnp.int32))
    with pytest.raises(ValueError, match="even"):
        block_attention(q[..., :31], q[..., :31], q[..., :31], off)
    with pytest.raises(ValueError, match="block"):
        block_attention(q, q, q, off, block=0)
    with pytest.raises(ValueError, match="impl"):
        block_attention(q, q, q, off, impl="mosaic")
    q300 = jnp.zeros((16, 1, 300), jnp.float32)     # D/2 = 150: would pad past 64 per half
    with pytest.raises(ValueError, match="head dim D=300"):
        block_attention(q300, q300, q300, off, impl="pallas")


def test_pallas_rope_chunks():
    """RoPE in column chunks (rope_chunks, rope_chunks_bwd): out and all gradients
    against the float64 formula on the tile-edge lengths: forward 2 / backward 1 chunks;
    16-column chunks (D = 128, 4 / 4, 3 / 2 blocks per program); 2 / 2 with custom
    positions; padded halves (D = 96, 2 / 4); 1 / 2 with dO / V loaded before the scores
    (early_loads_bwd)."""
    pos = np.random.default_rng(3).integers(0, 5000, size=384)
    _check_all([dict(impl="pallas", lens=LENS, t=384, d=d, h=1, seed=5, positions=p,
                     knobs=dict(rope_chunks=chunks, rope_chunks_bwd=chunks_bwd, **kw))
                for d, chunks, chunks_bwd, p, kw in [
                    (64, 2, 1, None, {}), (128, 4, 4, None, dict(group=3, group_bwd=2)),
                    (64, 2, 2, pos, {}), (96, 2, 4, None, {}),
                    (64, 1, 2, None, dict(early_loads_bwd=True, group_bwd=2))]])


def test_rope_chunks_must_leave_16_columns():
    from kernels.dispatch import block_attention_pallas
    q = jnp.zeros((64, 1, 64), jnp.float32)
    for name in ("rope_chunks", "rope_chunks_bwd"):
        for bad in (0, 3, 4):     # D/2 = 32: 4 chunks of 8 columns, 3 does not divide
            with pytest.raises(ValueError, match=f"{name}={bad}"):
                block_attention_pallas(q, q, q, jnp.array([0, 64], jnp.int32), **{name: bad})


def _gpu_lengths(seed, n, spare=0):
    """(lengths, capacity) of n W4-like samples (log-normal, median 300, clipped to
    1500), the first four 0, 1, 63 and 65 tokens; capacity rounded up to 128, plus
    `spare` padding rows."""
    lens = np.clip(np.random.default_rng(seed).lognormal(np.log(300), 0.8, n).astype(int),
                   0, 1500)
    lens[:4] = [0, 1, 63, 65]
    return lens, int(-(-sum(lens) // 128) * 128 + spare)


@pytest.mark.gpu
@pytest.mark.parametrize("chunks,warps,early", [(2, 4, False), (4, 4, False), (4, 8, False),
                                                (2, 4, True)])
def test_gpu_rope_chunks(chunks, warps, early):
    """rope_chunks / rope_chunks_bwd (and early_loads_bwd) on an H200 (bf16, D=128, W4-like
    lengths), knob sets of the W4 sweep."""
    lens, t = _gpu_lengths(seed=12, n=10)
    _check("pallas", lens, t, dtype=jnp.bfloat16, h=4, d=128,
           knobs=dict(rope_chunks=chunks, num_warps=warps, num_stages=1, group=1,
                      rope_chunks_bwd=chunks, num_warps_bwd=warps, early_loads_bwd=early))


@pytest.mark.gpu
def test_gpu_last_sample_ends_at_capacity():
    """Block reads run past T (masked lanes): must not fault or leak; T = sum(lens)."""
    lens = [0, 1, 63, 64, 65, 700, 37]
    _check("pallas", lens, sum(lens), dtype=jnp.bfloat16, h=4, d=128)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [8, 24, 96])
def test_gpu_padded_rope_halves(d):
    lens, t = _gpu_lengths(seed=10, n=10)
    _check("pallas", lens, t, dtype=jnp.bfloat16, h=2, d=d)


@pytest.mark.gpu
@pytest.mark.parametrize("engine", ["per_block", "tiled"])
@pytest.mark.parametrize("fast_trig", [True, False])
def test_gpu_engines_bf16(engine, fast_trig):
    """Both engines (and the per-block kernel's MUFU and libdevice RoPE trig) on GPU."""
    if engine == "tiled" and not fast_trig:
        pytest.skip("fast_trig is a per-block kernel knob")
    lens, t = _gpu_lengths(seed=8, n=10)
    knobs = dict(engine=engine) if engine == "tiled" else dict(engine=engine, fast_trig=fast_trig)
    _check("pallas", lens, t, dtype=jnp.bfloat16, h=2, d=128, knobs=knobs)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_compiled(d, dtype):
    lens, t = _gpu_lengths(seed=4, n=12, spare=128)
    _check("pallas", lens, t, dtype=dtype, h=3, d=d)
