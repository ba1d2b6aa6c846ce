"""The Triton forward kernel: one program per (query tile, head), heaviest tiles first,
over the key tiles that hold a valid pair; GDPA (P = act(S) * scale) or online softmax
in base 2 (also writes lse [H, Tq] float32, base 2)."""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels.triton.launch import (compiler_params, head_spec, in_specs, layout_inputs,
                                   ordered_refs, stat_spec)
from kernels.triton.tile import (F32, LOG2E, dot_nn, load_cos_sin, load_parts, scores, three_loops,
                                 tile_act, tile_mask, where_masked)


def _fwd_kernel(qs_ref, qp_ref, ks_ref, kp_ref, perm_ref, lo_ref, hi_ref, flo_ref, fhi_ref,
                cq_ref, sq_ref, ck_ref, sk_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, cfg):
    i = perm_ref[pl.program_id(0)]  # heaviest tiles first
    bq, bk = cfg.bq, cfg.bk
    qrows = pl.ds(i * bq, bq)
    qs, qpos = qs_ref[qrows], qp_ref[qrows]
    qparts = load_parts(q_ref, qrows, load_cos_sin(cq_ref, sq_ref, qrows, cfg), cfg)
    d = v_ref.shape[-1]
    ranges = lo_ref[i], flo_ref[i], fhi_ref[i], hi_ref[i]

    def tile(j, masked):
        rows = pl.ds(j * bk, bk)
        kparts = load_parts(k_ref, rows, load_cos_sin(ck_ref, sk_ref, rows, cfg), cfg)
        m = tile_mask(cfg, qs, qpos, ks_ref[rows], kp_ref[rows], masked)
        return scores(qparts, kparts), m, v_ref[rows, :]

    if cfg.mode == "gdpa":
        def body(j, acc, masked):
            s, m, v = tile(j, masked)
            p = where_masked(m, tile_act(s, cfg) * cfg.scale, 0.0)
            return acc + dot_nn(p.astype(v.dtype), v)
        acc = three_loops(*ranges, body, jnp.zeros((bq, d), F32), cfg)
        o_ref[qrows, :] = acc.astype(o_ref.dtype)
        return

    scale2 = cfg.scale * LOG2E  # softmax in base 2: exp2 is one MUFU op, exp is not

    def body(j, carry, masked):
        acc, mx, l = carry
        s, m, v = tile(j, masked)
        s = where_masked(m, s * scale2, -1e30)
        mx_new = jnp.maximum(mx, jnp.max(s, axis=1))
        p = where_masked(m, jnp.exp2(s - mx_new[:, None]), 0.0)
        alpha = jnp.exp2(mx - mx_new)
        l = l * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + dot_nn(p.astype(v.dtype), v)
        return acc, mx_new, l

    init = (jnp.zeros((bq, d), F32), jnp.full((bq,), -1e30, F32), jnp.zeros((bq,), F32))
    acc, mx, l = three_loops(*ranges, body, init, cfg)
    safe = jnp.where(l > 0, l, 1.0)
    o_ref[qrows, :] = (acc / safe[:, None]).astype(o_ref.dtype)
    lse_ref[qrows] = jnp.where(l > 0, mx + jnp.log2(safe), 0.0)  # base-2 log-sum-exp


def run_forward(cfg, q, k, v, lay):
    """(out [Tq,H,D], lse [H,Tq] float32 base 2 or None for gdpa): q / k / v padded to
    PAD_MULTIPLE rows, lay from kernels.triton.layout.build_layout."""
    tq, h, d = q.shape
    tk = k.shape[0]
    nq = tq // cfg.bq
    softmax = cfg.mode == "softmax"
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    out_specs = [head_spec(tq, d)]
    if softmax:
        out_shape.append(jax.ShapeDtypeStruct((h, tq), F32))
        out_specs.append(stat_spec(tq))

    def kernel(*refs, cfg):
        refs = list(refs)
        if not softmax:
            refs.append(None)  # lse_ref
        _fwd_kernel(*refs, cfg=cfg)

    outs = pl.pallas_call(
        ordered_refs(kernel, cfg, 0, None, len(out_shape)), grid=(nq, h),
        in_specs=in_specs(cfg, tq, tk, d, nq), out_specs=out_specs, out_shape=out_shape,
        compiler_params=compiler_params(cfg, False), interpret=cfg.interpret,
        name=f"jagged_flash_fwd_{cfg.mode}",
    )(*layout_inputs(lay, q, k, v, True))
    return outs[0], (outs[1] if softmax else None)
