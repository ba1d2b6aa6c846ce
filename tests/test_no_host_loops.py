"""The GPU programs of the attention ops, forward and backward, hold no XLA while loop
outside the kernels: XLA:GPU steps a while loop from the host (a device-to-host copy
and a wait per iteration), which would stop the host from queuing ahead of the device
(an H200 trace of the sparse step showed ~0.45 ms idle from one binary search). Checked
on the cuda export of each op (kernels compiled, not interpreted), so it runs on CPU."""

import re
import types

import jax
import jax.numpy as jnp
import pytest
from jax import export

try:
    import jax._src.pallas.triton.pallas_call_registration as _reg
except ImportError:  # pragma: no cover
    _reg = None


def _host_loops(monkeypatch, fn, t=4096, b=17, want=None):
    """while_functions of fn's cuda export (forward + vjp)."""
    if _reg is None or not hasattr(_reg, "gpu_info_lib"):
        pytest.skip("JAX internals for the Triton lowering moved")
    monkeypatch.setattr(_reg.gpu_info_lib, "get_gpu_info",
                        lambda: types.SimpleNamespace(compute_capability=90))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")   # compiled kernels
    x = jax.ShapeDtypeStruct((t, 4, 128), jnp.bfloat16)
    off = jax.ShapeDtypeStruct((b + 1,), jnp.int32)

    def train(q, k, v, do, qo, ko):
        o, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, qo, ko), q, k, v)
        return o, vjp(do)
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    exp = export.export(jax.jit(train), platforms=["cuda"], disabled_checks=checks)(
        x, x, x, x, off, off)
    text = exp.mlir_module()
    assert want is None or want in text, f"{want} not in the program"
    return while_functions(text)


def while_functions(mlir: str) -> list[str]:
    """Names of the functions of a StableHLO module that hold a while loop, less the
    fallback bodies of composites (cumsum's chlo.scan.impl: XLA:GPU lowers the
    composite itself)."""
    funcs = mlir.split("func.func ")[1:]
    return [f.split("(")[0] for f in funcs if "stablehlo.while" in f
            and not re.match(r"private @chlo\.\w+\.impl", f)]


@pytest.mark.parametrize("op", ["gdpa_triton", "softmax_mosaic", "block"])
def test_attention_ops_have_no_host_stepped_loops(monkeypatch, op):
    from kernels.dispatch import block_attention_pallas
    from kernels.dispatch import gdpa_pallas
    from kernels.dispatch import jagged_attention_pallas
    fn = {"gdpa_triton": lambda q, k, v, qo, ko: gdpa_pallas(q, k, v, qo, ko, activation="silu",
                                                             scale=0.1),
          "softmax_mosaic": lambda q, k, v, qo, ko: jagged_attention_pallas(
              q, k, v, qo, ko, forward="mosaic", backward="mosaic"),
          "block": lambda q, k, v, qo, ko: block_attention_pallas(q, k, v, qo)}[op]
    if op == "softmax_mosaic":     # the Hopper default: the Mosaic GPU kernels
        import kernels.dispatch as mf
        monkeypatch.setattr(mf, "is_hopper", lambda *a: True)
    want = {"softmax_mosaic": "mosaic_gpu"}.get(op, "__gpu$xla.gpu.triton")
    assert _host_loops(monkeypatch, fn, want=want) == []


def test_the_check_sees_a_binary_search(monkeypatch):
    """jnp.searchsorted's default (a while loop) in the glue is caught."""
    from kernels.dispatch import gdpa_pallas

    def fn(q, k, v, qo, ko):
        shift = jnp.searchsorted(qo, jnp.arange(3, dtype=jnp.int32))
        return gdpa_pallas(q, k, v, qo, ko, activation="silu", scale=0.1) + shift.sum()
    loops = _host_loops(monkeypatch, fn)
    assert loops and "searchsorted" in loops[0], loops
