"""The engines' tuning records: one per op per engine, holding tuning only (the op's spec
is its own record); a config splits into its spec and tuning and joins back; the views the
benchmarks read (TILES, BLOCK_TILES, BLOCK_KNOBS, BACKWARD_TUNING) are those records."""

import dataclasses

import jax.numpy as jnp
import pytest

from kernels import dispatch
from kernels.mosaic import tuning as mosaic
from kernels.triton import tuning as triton


def _names(cls):
    return {f.name for f in dataclasses.fields(cls)}


def test_one_record_per_op_per_engine_and_no_spec_in_it():
    assert set(triton.TUNING) == {"gdpa", "jagged_attention", "block_attention"}
    assert isinstance(triton.TUNING["gdpa"], triton.TritonTuning)
    assert isinstance(triton.TUNING["jagged_attention"], triton.TritonTuning)
    assert isinstance(triton.TUNING["block_attention"], triton.BlockTuning)
    assert isinstance(triton.TUNING["block_attention"].tiled, triton.TritonTuning)
    assert set(mosaic.TUNING) == {"gdpa", "jagged_attention"}
    assert all(isinstance(t, mosaic.MosaicOpTuning) for t in mosaic.TUNING.values())
    spec = _names(triton.AttentionSpec)
    assert {"mode", "activation", "scale", "causal", "window", "block", "rope"} == spec
    assert not spec & (_names(triton.TritonTuning) | _names(triton.BlockTuning))
    assert not _names(mosaic.MosaicSpec) & _names(mosaic.MosaicTuning)


def test_configs_split_into_spec_and_tuning():
    spec = triton.AttentionSpec(mode="softmax", scale=0.3, causal=True, window=5)
    tuning = triton.TritonTuning(bq=32, fused_bwd="off")
    cfg = triton.FlashConfig.of(spec, tuning, interpret=True)
    assert cfg.spec == spec and cfg.tuning == tuning and cfg.interpret
    assert (cfg.bq, cfg.mode, cfg.window) == (32, "softmax", 5)
    m = mosaic.mosaic_config(128, jnp.bfloat16, mode="softmax", scale=0.5, block_kv=64)
    assert m.spec == mosaic.MosaicSpec(mode="softmax", activation="silu", scale=0.5)
    assert m.tuning == mosaic.MosaicTuning(block_kv=64)


def test_the_benchmarks_views_are_the_records():
    assert dispatch.TILES == dataclasses.asdict(triton.TUNING["gdpa"])
    assert dispatch.BLOCK_TILES == dataclasses.asdict(triton.TUNING["block_attention"].tiled)
    block = triton.TUNING["block_attention"]
    assert triton.BLOCK_KNOBS == {k: getattr(block, k)
                                  for k in _names(triton.BlockTuning) - {"tiled"}}
    op = mosaic.TUNING["gdpa"]
    assert mosaic.BACKWARD_TUNING == {k: getattr(op.backward, k)
                                      for k in _names(mosaic.MosaicTuning)
                                      if getattr(op.backward, k) != getattr(op.forward, k)}


def test_a_knob_that_is_gone_is_named():
    q = jnp.zeros((64, 1, 32), jnp.float32)
    off = jnp.asarray([0, 64], jnp.int32)
    with pytest.raises(ValueError, match="unknown knobs.*prefetch_table"):
        dispatch.block_attention_pallas(q, q, q, off, block=16, prefetch_table=False)
