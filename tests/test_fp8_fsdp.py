"""gemjax.precision.fsdp on a simulated 8-device CPU mesh: the compiled all-gathers of FP8
weights carry <= 0.55x the bytes of the BF16 gather (scales included), and the gathered
weight is each shard's own quantization, dequantized (float64 reference built here)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from gemjax.precision.fsdp import all_gather_bytes, gather_dense, gather_fp8

pytestmark = pytest.mark.skipif(jax.device_count() < 8,
                                reason="needs 8 devices (the CPU suite simulates them)")

# (shape, sharded dim): a Wukong MLP's weights, a square projection, a ragged-block one
WEIGHTS = [((1024, 512), 0), ((512, 1536), 1), ((192, 136), 0)]


def _mesh():
    return jax.make_mesh((8,), ("fsdp",), devices=jax.devices()[:8])


def _ref_shard(ws):
    """float64 dequantized 128x128-block E4M3 quantization of one float32 shard."""
    import ml_dtypes
    r, c = ws.shape
    out = np.zeros((r, c))
    for i in range(0, r, 128):
        for j in range(0, c, 128):
            blk = ws[i:i + 128, j:j + 128]
            amax = np.abs(blk).max()
            s = np.float32(amax) / np.float32(448.0) if amax > 0 else np.float32(1.0)
            q = (blk / s).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
            out[i:i + 128, j:j + 128] = q * np.float64(s)
    return out


def test_fp8_all_gather_bytes_and_values():
    mesh = _mesh()
    rng = np.random.default_rng(0)
    ws = [rng.normal(size=shape).astype(np.float32) * (1 + 5 * (i == 1))
          for i, (shape, _) in enumerate(WEIGHTS)]
    placed = [jax.device_put(w, NamedSharding(mesh, P(*(["fsdp" if d == dim else None
                                                          for d in range(2)]))))
              for w, (_, dim) in zip(ws, WEIGHTS)]
    dims = [dim for _, dim in WEIGHTS]
    fp8 = jax.jit(lambda *w: [gather_fp8(x, mesh, "fsdp", d) for x, d in zip(w, dims)])
    bf16 = jax.jit(lambda *w: [gather_dense(x, mesh, "fsdp", d) for x, d in zip(w, dims)])
    b_fp8 = all_gather_bytes(fp8.lower(*placed).compile().as_text(), 8)
    b_bf16 = all_gather_bytes(bf16.lower(*placed).compile().as_text(), 8)
    elems = sum(np.prod(s) for s, _ in WEIGHTS) // 8          # per-device shard elements
    assert b_bf16 == 2 * elems                                # the parser reads the gathers
    assert elems <= b_fp8 <= 0.55 * b_bf16, (b_fp8, b_bf16)
    for w, (shape, dim), got in zip(ws, WEIGHTS, fp8(*placed)):
        assert got.dtype == jnp.bfloat16 and got.shape == shape
        ref = np.concatenate([_ref_shard(s) for s in np.split(w, 8, axis=dim)], axis=dim)
        # the bf16 rounding of the dequantized value; a rare element one E4M3 step off (a
        # value on a rounding tie: XLA may divide by the scale as a multiply by 1 / scale)
        got = np.asarray(got, np.float64)
        off = np.abs(got - ref) > 2 ** -8 * np.abs(ref)
        assert off.mean() < 1e-4
        np.testing.assert_allclose(got[off], ref[off], rtol=2 ** -3 + 2 ** -8)
        assert np.abs(ref - w).max() <= np.abs(w).max() * 2 ** -4 * 1.01


def test_bad_input_named():
    mesh = _mesh()
    with pytest.raises(ValueError, match="no axis 'data'"):
        gather_fp8(jnp.ones((16, 16)), mesh, "data")
    with pytest.raises(ValueError, match="not a multiple of the 8 devices"):
        gather_fp8(jnp.ones((12, 16)), mesh, "fsdp")
