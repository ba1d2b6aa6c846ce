"""gemjax.precision.fsdp on a simulated 8-device CPU mesh: the compiled all-gathers of FP8
weights carry <= 0.55x the bytes of the BF16 gather (scales included), and the gathered
weight is each shard's own quantization, dequantized (float64 reference built here).
all_gather_fp8_weight (the train step's gather) on fsdp=4: the whole weight's quantization
in fp8_dot's blocks, its gradient the plain gather's; the tiny train step with it gathers
the FP8 kernels in 1 byte per element and trains as the unsharded FP8 step."""

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


# --- all_gather_fp8_weight: the train step's gather of an FP8 linear's kernel -----------

def _global_ref(w, block, dtype):
    """float64 dequantized E4M3 quantization of the whole w (cast to dtype first) in blocks
    `block` over the whole weight, float32 scales amax / 448 (fp8_dot's weight scales)."""
    import ml_dtypes
    w = np.asarray(jnp.asarray(w).astype(dtype).astype(jnp.float32))
    (r, c), (br, bc) = w.shape, block
    out = np.zeros((r, c))
    for i in range(0, r, br):
        for j in range(0, c, bc):
            blk = w[i:i + br, j:j + bc]
            amax = np.abs(blk).max()
            s = np.float32(amax) / np.float32(448.0) if amax > 0 else np.float32(1.0)
            q = (blk / s).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
            out[i:i + br, j:j + bc] = q * np.float64(s)
    return out


@pytest.mark.parametrize("scaling", ["rowwise", "tensor", "blocked"])
@pytest.mark.parametrize("shape,dim,dtype", [((264, 40), 0, "float32"), ((40, 264), 1, "bfloat16")])
def test_weight_gather_is_the_gemms_quantization(scaling, shape, dim, dtype):
    """On fsdp=4 (128-blocks span shards, ragged edges): the gathered kernel is the whole
    weight's quantization in fp8_dot's weight blocks, fp8_dot on it computes what fp8_dot on
    the ungathered weight does, its gradient is the plain all_gather's (reduce-scatter),
    and only 1-byte elements cross the all-gather."""
    from gemjax.precision.fsdp import WeightGather, all_gather_fp8_weight, weight_block
    from gemjax.precision.gemm import Recipe, fp8_dot
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("fsdp",))
    rng = np.random.default_rng(1)
    w = (rng.normal(size=shape) * np.exp(rng.normal(size=shape))).astype(np.float32)
    w[: shape[0] // 2] *= 50.0                            # scales differ across shards
    recipe = Recipe(scaling=scaling)
    g = WeightGather(("fsdp",), dim, weight_block(recipe, shape), "e4m3", dtype)
    spec = P(*(["fsdp" if d == dim else None for d in range(2)]))
    c = rng.normal(size=shape).astype(np.float32)

    def run(gather):
        return jax.jit(jax.shard_map(lambda ws: gather(ws), mesh=mesh, in_specs=spec,
                                     out_specs=P(), check_vma=False))

    fp8 = run(lambda ws: all_gather_fp8_weight(ws, g))
    plain = run(lambda ws: jax.lax.all_gather(ws, "fsdp", axis=dim, tiled=True))
    wd = jax.device_put(w, NamedSharding(mesh, spec))
    got = np.asarray(fp8(wd), np.float64)
    ref = _global_ref(w, g.block, dtype)
    off = np.abs(got - ref) > 2 ** -20 * np.abs(ref)
    # an element one E4M3 step off where w / s is a rounding tie (see above): rare for
    # float32 w, more frequent for bfloat16 w (8-bit mantissas: exact ties of w / amax)
    assert off.mean() < (1e-3 if dtype == "float32" else 1e-2)
    np.testing.assert_allclose(got[off], ref[off], rtol=2 ** -3)
    assert np.abs(ref - w).max() > 0                      # it really quantizes
    x = jnp.asarray(rng.normal(size=(8, shape[0])), dtype)
    dot = jax.jit(fp8_dot, static_argnums=2)              # one program for both products
    y_fp8 = dot(x, jnp.asarray(got, jnp.float32).astype(dtype), recipe)
    y_ref = dot(x, jnp.asarray(w).astype(dtype), recipe)
    np.testing.assert_allclose(np.asarray(y_fp8, np.float64), np.asarray(y_ref, np.float64),
                               rtol=2e-6 if dtype == "float32" else 2 ** -7, atol=1e-6)
    grad = lambda f: jax.grad(lambda v: jnp.sum(f(v) * c))  # noqa: E731
    g_fp8, g_plain = jax.jit(lambda v: (grad(fp8)(v), grad(plain)(v)))(wd)   # one program
    np.testing.assert_allclose(np.asarray(g_fp8), np.asarray(g_plain), rtol=1e-6)
    text = fp8.lower(wd).compile().as_text()
    assert all_gather_bytes(text, 4) == all_gather_bytes(text, 4, {"u8"}) == w.size // 4


# --- the train step on fsdp=4 (4 of the simulated CPU devices) ---------------------------

STEP = "model.use_sequences=false,train.warmup_steps=1"
# weight gradients in float32: an FP8 wgrad's scales come from each device's own batch
# rows, so only an unquantized wgrad is the same on one device and on four
FP8 = STEP + (",model.precision=fp8,model.fp8_exclude=heads,model.fp8_scaling=blocked,"
              "model.wgrad_dtype=f32")


def _train(overrides: str, steps: int = 2, mesh_spec: str | None = "fsdp=4",
           tables0=None) -> dict:
    """The tiny preset's train step on `mesh_spec` (None: one device): compiled HLO text,
    per-step losses, params, logical tables at the start."""
    from gemjax.config import get_config
    from gemjax.data.feeding import Feeder, regroup
    from gemjax.data.source import make_source
    from gemjax.parallel.mesh import build_mesh
    from gemjax.train.step import Trainer, default_mesh

    cfg = get_config("tiny", overrides)
    devices = jax.devices()[:4]
    mesh = default_mesh(devices[:1]) if mesh_spec is None else build_mesh(mesh_spec, devices)
    tr = Trainer.create(cfg, mesh, replicate_below_bytes=0, capacity_factor=None)
    state = tr.init_state(0)
    tables = tr.coll.to_logical(jax.device_get(state["tables"]))
    if tables0 is not None:      # table init is drawn in storage order (shard-count dependent)
        state["tables"] = tr.coll.from_logical(tables0)
    feeder = Feeder(regroup(make_source(cfg, seed=0).shard_batch, 4), mesh,
                    check_ids=tr.coll.check_ids, id_fields=tr.id_fields)
    step = tr.make_train_step()
    batches = [feeder.to_device(feeder.host_batch(i)[0]) for i in range(max(steps, 1))]
    out = {"hlo": step.lower(state, batches[0]).compile().as_text(), "losses": [],
           "trainer": tr, "init": jax.device_get(state["params"]), "tables": tables}
    for b in batches[:steps]:
        state, m = step(state, b)
        out["losses"].append(float(m["loss"]))
        out.setdefault("grad_norms", []).append(float(m["grad_norm"]))
    out["params"] = jax.device_get(state["params"])
    return out


@pytest.fixture(scope="module")
def fp8_step():
    return _train(FP8)


def _fp8_kernel_elems(trainer) -> int:
    from flax import nnx
    from gemjax.models.gem import build_model
    from gemjax.precision.policy import fp8_kernels
    model = nnx.eval_shape(lambda: build_model(trainer.cfg, nnx.Rngs(0)))
    params = dict(nnx.iter_graph(model))
    return sum(int(np.prod(params[p[:-1]].kernel.shape)) for p in fp8_kernels(model))


def test_train_step_gathers_fp8_kernels(fp8_step):
    """The compiled step's all-gathers of the FP8 linears' kernels carry 1 byte per element:
    <= 0.55x (0.25x: float32 params) of the same kernels' bytes in the BF16 path's step,
    every other param gathered as before."""
    bf16 = _train(STEP, steps=0)
    elems = _fp8_kernel_elems(fp8_step["trainer"])
    assert elems > 0
    u8 = all_gather_bytes(fp8_step["hlo"], 4, {"u8"})
    rest = all_gather_bytes(fp8_step["hlo"], 4) - u8
    those_bf16 = all_gather_bytes(bf16["hlo"], 4) - rest     # the same kernels, BF16 path
    assert u8 == elems // 4 and those_bf16 == 4 * elems // 4, (u8, those_bf16, elems)
    assert u8 <= 0.55 * those_bf16


def test_train_step_equals_the_unsharded_step(fp8_step):
    """Two steps with the FP8 gather on fsdp=4 equal the same FP8 steps on one device (the
    whole float32 kernel quantized inside the GEMMs): loss, gradient norm, updated params."""
    from gemjax.train.equivalence import KEY_BIAS, global_rel_diff, max_rel_diff
    ref = _train(FP8, mesh_spec=None, tables0=fp8_step["tables"])
    assert all_gather_bytes(ref["hlo"], 1, {"u8"}) == 0
    np.testing.assert_allclose(fp8_step["losses"], ref["losses"], rtol=1e-6)
    # Adam's update is blind to a gradient's scale: the dense gradients' norm is not
    np.testing.assert_allclose(fp8_step["grad_norms"], ref["grad_norms"], rtol=1e-5)
    assert max_rel_diff(ref["params"], ref["init"]) > 1e-3   # the steps update the params
    assert max_rel_diff(fp8_step["params"], ref["params"], skip=KEY_BIAS) < 1e-5
    assert global_rel_diff(fp8_step["params"], ref["params"]) < 1e-5

def test_fp8_gather_flag_named():
    from gemjax.config import get_config
    with pytest.raises(ValueError, match="model.precision.gather must be exact, always or off"):
        get_config("tiny", "model.fp8_gather=yes")
