"""block_attention vs the float64 per-sample numpy formula (block mask + RoPE), fwd and grads."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import block_attention
from kernels.block_attention import block_attention_reference, block_attention_reference_dense
from test_kernels_common import (assert_only_slice_changes, check_against, np_attention,
                                 offsets_of, random_qkv, run_vjp)

LENS = [0, 1, 63, 64, 65, 130, 3]  # 326 tokens in capacity 384


def _check(impl, lens, t, *, dtype=jnp.float32, h=2, d=32, block=64, theta=10_000.0,
           positions=None, seed=0, knobs=None):
    rng = np.random.default_rng(seed)
    q, k, v, do = random_qkv(rng, t, t, h, d, dtype, scale=1.0)
    off = offsets_of(lens)
    pos = None if positions is None else jnp.asarray(positions, jnp.int32)
    kw = dict(block=block, positions=pos, rope_theta=theta)
    if impl == "dense":
        fn = lambda q, k, v: block_attention_reference_dense(q, k, v, jnp.asarray(off), **kw)
    elif impl == "reference":
        fn = lambda q, k, v: block_attention_reference(q, k, v, jnp.asarray(off), **kw)
    elif knobs:
        from kernels.dispatch import block_attention_pallas
        fn = lambda q, k, v: block_attention_pallas(q, k, v, jnp.asarray(off), **kw, **knobs)
    else:
        fn = lambda q, k, v: block_attention(q, k, v, jnp.asarray(off), impl=impl, **kw)
    got = run_vjp(jax.jit(fn), q, k, v, do)
    want = np_attention(q, k, v, do, off, off, mode="softmax", scale=d ** -0.5, block=block,
                        rope_theta=theta, positions=positions)
    check_against(got, want, dtype, f"block_attention[{impl}] block={block}", q_end=off[-1])


@pytest.mark.parametrize("impl", ["reference", "dense", "pallas"])
def test_block64(impl):
    _check(impl, LENS, 384)


@pytest.mark.parametrize("block,lens,t,knobs", [
    (32, [31, 32, 33, 0, 1, 100], 197, None),       # per-block kernel, no tail (T = sum)
    (16, [0, 15, 16, 17, 40, 2], 160, dict(group=3, group_bwd=2)),  # tails; 3 / 2 per program
    (48, [0, 1, 47, 48, 49, 100], 384, None),       # other block sizes: tiled engine
])
def test_pallas_block_sizes_and_tails(block, lens, t, knobs):
    _check("pallas", lens, t, block=block, h=1, d=32, seed=2, knobs=knobs)


def test_pallas_engines_agree_and_bad_engine_is_named():
    _check("pallas", LENS, 384, seed=3, knobs=dict(engine="tiled"))
    _check("pallas", LENS, 384, seed=3, knobs=dict(engine="per_block", fast_trig=False))
    from kernels.dispatch import block_attention_pallas
    q = jnp.zeros((64, 1, 32), jnp.float32)
    with pytest.raises(ValueError, match="engine"):
        block_attention_pallas(q, q, q, jnp.array([0, 64], jnp.int32), engine="mosaic")


@pytest.mark.parametrize("d,block", [(8, 64), (24, 32), (48, 16)])
def test_pallas_pads_rope_halves(d, block):
    """Each RoPE half zero-padded to a power of two (zero frequencies on the zero
    lanes), the real D's frequencies and scale; custom positions."""
    rng = np.random.default_rng(9)
    pos = rng.integers(0, 3000, size=384)
    _check("pallas", LENS, 384, d=d, block=block, positions=pos, seed=4)


def test_padded_head_dims_only_through_the_per_block_kernel():
    from kernels.dispatch import block_attention_pallas
    q = jnp.zeros((64, 1, 24), jnp.float32)
    off = jnp.array([0, 64], jnp.int32)
    with pytest.raises(ValueError, match="tiled engine"):
        block_attention_pallas(q, q, q, off, engine="tiled")
    with pytest.raises(ValueError, match="tiled engine"):
        block_attention_pallas(q, q, q, off, block=48)


def test_reference_block16_custom_positions():
    rng = np.random.default_rng(5)
    pos = rng.integers(0, 5000, size=256)
    _check("reference", [0, 15, 16, 17, 40, 1, 100], 256, block=16, theta=500.0, positions=pos)


def test_pallas_custom_positions_bf16_d64():
    rng = np.random.default_rng(6)
    pos = rng.integers(0, 5000, size=384)
    _check("pallas", LENS, 384, dtype=jnp.bfloat16, d=64, h=1, positions=pos)


@pytest.mark.parametrize("block", [64, 128])
def test_pallas_bf16_default_positions(block):
    """16-bit inputs with the default positions: the kernels rotate by each token's offset
    in its block with unreduced angles (kernels/triton/block.py, _trig)."""
    _check("pallas", LENS + [128, 129], 640, dtype=jnp.bfloat16, d=64, h=1, block=block,
           seed=7)


def test_rope_changes_the_result():
    """RoPE is really applied: a different theta gives a different output."""
    rng = np.random.default_rng(7)
    q, k, v, _ = random_qkv(rng, 128, 128, 1, 32, jnp.float32, scale=1.0)
    off = jnp.asarray(offsets_of([100]))
    a = block_attention(q, k, v, off, rope_theta=10_000.0, impl="reference")
    b = block_attention(q, k, v, off, rope_theta=10.0, impl="reference")
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


@pytest.mark.parametrize("d,chunks,chunks_bwd,kw", [
    (64, 1, 2, {}), (64, 2, 1, {}), (128, 4, 4, dict(group=3, group_bwd=2)),  # 16-column chunks
    (64, 2, 2, dict(positions="random")), (96, 2, 4, {}),     # custom positions; padded halves
    (64, 1, 2, dict(early_loads_bwd=True, group_bwd=2)),     # dO / V loaded before the scores
])
def test_pallas_rope_chunks(d, chunks, chunks_bwd, kw):
    """RoPE in column chunks (rope_chunks, rope_chunks_bwd): out and all gradients
    against the float64 formula on the tile-edge lengths."""
    pos = (np.random.default_rng(3).integers(0, 5000, size=384)
           if kw.pop("positions", None) else None)
    _check("pallas", LENS, 384, d=d, h=1, seed=5, positions=pos,
           knobs=dict(rope_chunks=chunks, rope_chunks_bwd=chunks_bwd, **kw))


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
