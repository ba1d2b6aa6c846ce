"""The compiled (non-interpret) kernels lower to Triton IR that verifies, on CPU.

Interpret mode runs the kernels' jaxpr through XLA, so it cannot see what only the
Triton lowering does (tanh.approx inline asm, masked pointer loads/stores, block
shapes). Here jax.export lowers forward+backward for platform "cuda" (sm_90) on
this CPU machine and every Triton module must pass the MLIR verifier. Whether
Triton then compiles and runs it is left to the gpu-marked tests. Uses JAX
internals (GPU info lookup, the lowering entry point): skipped if they move.
"""

import types

import jax
import jax.numpy as jnp
import pytest
from jax import export

try:
    import jax._src.pallas.triton.pallas_call_registration as reg
    _LOWER = reg.lowering.lower_jaxpr_to_triton_module
    _GPU_INFO = reg.gpu_info_lib
except (ImportError, AttributeError):  # pragma: no cover
    reg = None


@pytest.fixture
def cuda_lowering(monkeypatch):
    if reg is None:
        pytest.skip("JAX internals for the Triton lowering moved")
    count = [0]

    def verified(*args, **kwargs):
        out = _LOWER(*args, **kwargs)
        assert out.module.operation.verify(), "Triton module does not verify"
        count[0] += 1
        return out

    monkeypatch.setattr(reg.lowering, "lower_jaxpr_to_triton_module", verified)
    monkeypatch.setattr(_GPU_INFO, "get_gpu_info",
                        lambda: types.SimpleNamespace(compute_capability=90))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # kernels: not interpret
    return count


def _lower_train(fn, t, h, d, dtype):
    x = jax.ShapeDtypeStruct((t, h, d), dtype)

    def train(q, k, v):
        o, vjp = jax.vjp(fn, q, k, v)
        return o, vjp(o)
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    return export.export(jax.jit(train), platforms=["cuda"], disabled_checks=checks)(x, x, x)


OFF = jnp.array([0, 1, 64, 128, 300, 700, 1000], jnp.int32)


@pytest.mark.parametrize("case", ["block", "block_group4_f32", "block_early_loads",
                                  "gdpa_silu_fast",
                                  "gdpa_gelu_tanh_causal_window", "softmax_causal",
                                  "gdpa_d24_padded", "block_d48_padded", "softmax_d8_padded",
                                  "gdpa_k_rows_rest_group_split", "softmax_q_rows_rest_group",
                                  "softmax_split_tiles"])
def test_kernels_lower_to_verified_triton(cuda_lowering, case):
    from kernels.dispatch import block_attention_pallas
    from kernels.dispatch import gdpa_pallas
    from kernels.dispatch import jagged_attention_pallas
    from kernels import block_attention, gdpa, jagged_attention
    dtype, n_kernels, d = jnp.bfloat16, 3, 128
    if case == "gdpa_d24_padded":      # the public ops pad D to a power of two
        fn, d = (lambda q, k, v: gdpa(q, k, v, OFF, OFF, scale=0.01, impl="pallas")), 24
    elif case == "block_d48_padded":
        fn, n_kernels, d = (lambda q, k, v: block_attention(q, k, v, OFF, impl="pallas")), 2, 48
    elif case == "softmax_d8_padded":
        fn, d = (lambda q, k, v: jagged_attention(q, k, v, OFF, OFF, impl="pallas")), 8
    elif case == "block":
        fn, n_kernels = (lambda q, k, v: block_attention_pallas(q, k, v, OFF)), 2
    elif case == "block_early_loads":
        fn, n_kernels = (lambda q, k, v: block_attention_pallas(
            q, k, v, OFF, early_loads_bwd=True, group_bwd=2, num_stages_bwd=2)), 2
    elif case == "block_group4_f32":
        fn, dtype, n_kernels = (lambda q, k, v: block_attention_pallas(q, k, v, OFF, group=4),
                                jnp.float32, 2)
    elif case == "gdpa_silu_fast":
        fn = lambda q, k, v: gdpa_pallas(q, k, v, OFF, OFF, activation="silu", scale=0.01)
    elif case == "gdpa_gelu_tanh_causal_window":
        fn = lambda q, k, v: gdpa_pallas(q, k, v, OFF, OFF, activation="gelu_tanh",
                                         causal=True, window=100)
    elif case == "gdpa_k_rows_rest_group_split":   # fused backward, looped rest, split dK/dV
        fn = lambda q, k, v: gdpa_pallas(q, k, v, OFF, OFF, scale=0.01, fused_bwd="k_rows",
                                         rest_group=4, dkv_split=2, dkv_split_tiles=3)
    elif case == "softmax_q_rows_rest_group":
        fn = lambda q, k, v: jagged_attention_pallas(q, k, v, OFF, OFF, fused_bwd="q_rows",
                                                     rest_group=3)
    elif case == "softmax_split_tiles":   # plain backward, 2 heaviest key tiles in 3 chunks
        fn = lambda q, k, v: jagged_attention_pallas(q, k, v, OFF, OFF, fused_bwd="off",
                                                     dkv_split=3, dkv_split_tiles=2)
    else:
        fn = lambda q, k, v: jagged_attention_pallas(q, k, v, OFF, OFF, causal=True)
    exp = _lower_train(fn, 1024, 2, d, dtype)
    assert cuda_lowering[0] == n_kernels
    assert exp.mlir_module().count("__gpu$xla.gpu.triton") == n_kernels
