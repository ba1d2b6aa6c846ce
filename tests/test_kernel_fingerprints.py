"""tools/kernel_fingerprints.py: the hash of a kernel's cuda export ignores where the
code sits in its file and changes when the program does."""

import jax.numpy as jnp
import numpy as np

from tools.kernel_fingerprints import forward_backward, fingerprint

SRC = """
from kernels.dispatch import gdpa_pallas
def op(q, k, v):
    return gdpa_pallas(q, k, v, QO, KO, activation="silu", scale=0.1, fused_bwd=FB)
"""
QO = jnp.asarray(np.array([0, 16, 32, 48, 64]), jnp.int32)
KO = jnp.asarray(np.array([0, 100, 101, 166, 300]), jnp.int32)
DIMS = [(128, 2, 64), (384, 2, 64), (384, 2, 64), (128, 2, 64)]


def _op(fused_bwd, blank_lines):
    scope = dict(QO=QO, KO=KO, FB=fused_bwd)
    exec(compile("\n" * blank_lines + SRC, "<fingerprint test>", "exec"), scope)
    return forward_backward(scope["op"])


def test_fingerprint_ignores_line_numbers_and_sees_program_changes():
    a = fingerprint(_op("off", 0), *DIMS)
    assert fingerprint(_op("off", 7), *DIMS) == a          # the same code, moved down
    assert fingerprint(_op("q_rows", 0), *DIMS) != a       # another backward program


def test_fingerprint_of_a_mosaic_kernel_sees_its_body():
    """A Mosaic GPU kernel's export blob carries source locations, so the hash reads its
    jaxpr: the same for the same kernel, different when a knob changes its body
    (schedule_barrier)."""
    from kernels.mosaic import gdpa_mosaic_forward
    qo = jnp.asarray(np.array([0, 100, 356, 512]), jnp.int32)

    def fwd(**tuning):
        return lambda q, k, v, do: gdpa_mosaic_forward(q, k, v, qo, qo, **tuning)
    dims = [(512, 2, 64)] * 4
    a = fingerprint(fwd(), *dims)
    assert fingerprint(fwd(), *dims) == a
    assert fingerprint(fwd(schedule_barrier=False), *dims) != a
