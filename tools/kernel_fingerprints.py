"""Fingerprints of the GPU programs the Triton kernels lower to, on any machine.

Exports forward + backward of gdpa, jagged_attention (self, cross, PMA shapes; every
FlashConfig.fused_bwd setting), block_attention, the Mosaic GPU forward and backward
kernels, layer_norm and the fused sparse update for platforms=["cuda"] (jax.export lowers
the Pallas kernels without a GPU), strips source locations and prints a short hash per
program. Equal hashes before and after a refactor mean the GPU runs the same
kernels, so GPU test results and timings of the earlier code still stand.

    python3 -m tools.kernel_fingerprints --out=/tmp/after.json
    git stash; ...; python3 -m tools.kernel_fingerprints --out=/tmp/before.json
    python3 -m tools.kernel_fingerprints --compare=/tmp/before.json
"""

import hashlib
import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from kernels.dispatch import block_attention_pallas, gdpa_pallas, jagged_attention_pallas
from kernels.triton.tuning import FUSED_BWD

FLAGS = flags.FLAGS

SHAPES = {"self": ([300, 0, 65, 700], [300, 0, 65, 700]),
          "cross": ([300, 1, 65, 700], [32, 32, 32, 32]),
          "pma": ([16, 16, 16, 16], [300, 1, 65, 700])}
_LOC = re.compile(r"loc\([^()]*(\([^()]*\))*[^()]*\)")
_MOSAIC_BLOB = re.compile(r'(kernel_hash|module) = "(?:[^"\\]|\\.)*"')
# On a machine with a GPU, Pallas Triton kernels lower to this custom call, which
# jax.export does not count as stable across jaxlib versions; the fingerprints compare
# two exports of one jaxlib, so the check is off for it.
_TRITON_CALL = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]


def fingerprint(fn, *shapes):
    """Hash of fn's cuda export without source locations (line numbers move with edits)
    and of its jaxpr: a Mosaic GPU kernel travels as a serialized module that carries
    its locations, so its export blob is left out and its jaxpr (the kernel body's
    operations and the compiler parameters) stands for it."""
    sds = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes]
    text = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=_TRITON_CALL)(
        *sds).mlir_module()
    text = "\n".join(line for line in _LOC.sub("", text).splitlines()
                     if not line.startswith("#loc"))
    text = _MOSAIC_BLOB.sub(r'\1 = "<mosaic>"', text)
    text += "\n" + str(jax.make_jaxpr(fn)(*sds))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def forward_backward(op):
    """op(q, k, v) -> f(q, k, v, do) = (op's output, its VJP of do): both directions in
    one program."""
    def f(q, k, v, do):
        o, vjp = jax.vjp(op, q, k, v)
        return o, vjp(do)
    return f


def programs():
    """{name: (fwd + bwd function, shapes)} over the shapes and settings above."""
    out = {}
    off = lambda lens: jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)  # noqa: E731
    for shape, (ql, kl) in SHAPES.items():
        qo, ko = off(ql), off(kl)
        tq, tk = (-(-sum(x) // 128) * 128 for x in (ql, kl))
        dims = [(tq, 4, 128), (tk, 4, 128), (tk, 4, 128), (tq, 4, 128)]
        for fb in FUSED_BWD:
            out[f"gdpa-{shape}-{fb}"] = (forward_backward(
                lambda q, k, v, qo=qo, ko=ko, fb=fb: gdpa_pallas(
                    q, k, v, qo, ko, activation="silu", scale=0.1, fused_bwd=fb)), dims)
            out[f"softmax-{shape}-{fb}"] = (forward_backward(
                lambda q, k, v, qo=qo, ko=ko, fb=fb: jagged_attention_pallas(
                    q, k, v, qo, ko, fused_bwd=fb)), dims)
    qo = off(SHAPES["self"][0])
    t = -(-sum(SHAPES["self"][0]) // 128) * 128
    out["block-self"] = (forward_backward(
        lambda q, k, v: block_attention_pallas(q, k, v, qo)), [(t, 4, 128)] * 4)
    out["block-self-rope_chunks4"] = (forward_backward(lambda q, k, v: block_attention_pallas(
        q, k, v, qo, rope_chunks=4, rope_chunks_bwd=4)), [(t, 4, 128)] * 4)
    out.update(mosaic_programs(off(SHAPES["self"][0]), t))
    out.update(layer_norm_programs())
    out.update(sparse_update_programs())
    return out


def sparse_update_programs():
    """The fused duplicate sum + row-wise Adagrad (kernels.sparse_update) on 4096 sorted
    Zipf-like ids over 1024 unique slots of a [2048, 64] float32 table: short, medium and
    hot runs (split 256), so every launch of the kernel is in the program."""
    from kernels.sparse_update import row_wise_adagrad_fused
    n, k, v = 4096, 1024, 2048
    ids = np.minimum(np.random.RandomState(0).zipf(1.3, n) - 1, k - 1)
    seg = jnp.asarray(np.sort(ids), jnp.int32)

    def update(w, g):
        rows = jnp.arange(k, dtype=jnp.int32)
        return row_wise_adagrad_fused(w.astype(jnp.float32), jnp.zeros((v,), jnp.float32),
                                      rows, seg, jnp.arange(n, dtype=jnp.int32), g,
                                      lr=0.1, eps=1e-8)
    return {"sparse_update": (update, [(v, 64), (n, 64)])}


def layer_norm_programs():
    """kernels.layer_norm at [4096, 512], bf16 throughout: forward and backward."""
    from kernels.layer_norm import layer_norm
    t, d = 4096, 512

    def plain(x, s, b, dy):
        y, vjp = jax.vjp(lambda x, s, b: layer_norm(x, s, b, impl="pallas"), x, s, b)
        return y, vjp(dy)
    row, vec = (t, d), (d,)
    return {"layer_norm": (plain, [row, vec, vec, row])}


def mosaic_programs(qo, t):
    """The Mosaic GPU kernels (kernels/mosaic: forward, and the dQ + dK/dV
    backward at its default tuning) on the self shape, called directly: the public ops
    pick them on a Hopper GPU only."""
    from kernels.mosaic import (BACKWARD_TUNING, gdpa_mosaic_forward, mosaic_config,
                                run_backward, softmax_mosaic_forward)
    from kernels.triton import FlashConfig, build_layout
    t = -(-t // 256) * 256
    dims = [(t, 4, 128)] * 4
    out = {"mosaic-fwd-gdpa": (lambda q, k, v, do: gdpa_mosaic_forward(
               q, k, v, qo, qo, activation="silu", scale=0.1), dims),
           "mosaic-fwd-softmax": (lambda q, k, v, do: softmax_mosaic_forward(
               q, k, v, qo, qo), dims)}
    for mode in ("gdpa", "softmax"):
        cfg = mosaic_config(128, jnp.bfloat16, mode=mode, activation="silu", scale=0.1,
                            **BACKWARD_TUNING)

        def bwd(q, k, v, do, cfg=cfg, mode=mode):
            lay = build_layout(FlashConfig(mode=mode), qo, qo, t, t, 128)
            stat = jnp.zeros((4, t), jnp.float32)
            return run_backward(cfg, lay, q, k, v, do, stat, stat, o=do)
        out[f"mosaic-bwd-{mode}"] = (bwd, dims)
    return out


def main(_):
    hashes = {}
    for name, (fn, dims) in programs().items():
        hashes[name] = fingerprint(fn, *dims)
        print(f"{name:28} {hashes[name]}", flush=True)
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump(hashes, f, indent=1)
    if FLAGS.compare:
        before = json.load(open(FLAGS.compare))
        changed = sorted(n for n in hashes if n in before and before[n] != hashes[n])
        new = sorted(n for n in hashes if n not in before)
        gone = sorted(n for n in before if n not in hashes)
        print(f"\n{len(changed)} of {len(hashes) - len(new)} programs differ from "
              f"{FLAGS.compare}" + (": " + ", ".join(changed) if changed else "")
              + (f"; {len(new)} new: " + ", ".join(new) if new else "")
              + (f"; {len(gone)} no longer built: " + ", ".join(gone) if gone else ""))
        sys.exit(1 if changed else 0)


if __name__ == "__main__":
    # flags here, not at import: tests import this module beside other experiments'
    flags.DEFINE_string("out", "", "write {program: hash} JSON here")
    flags.DEFINE_string("compare", "", "a JSON of an earlier run: report the programs that differ")
    app.run(main)
