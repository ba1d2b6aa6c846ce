"""The Triton backward kernels: dQ (grid over query tiles) and dK / dV (grid over key
tiles), no atomics; the fused forms "q_rows" / "k_rows" where one side is short, and
the dK / dV kernel's split of the heaviest key tiles (dkv_split, dkv_split_tiles)."""

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels.triton.launch import (compiler_params, full_spec, head_spec, in_specs,
                                   layout_inputs, ordered_refs, stat_spec)
from kernels.triton.layout import row_owners
from kernels.triton.tile import (F32, LOG2E, dot_nn, dot_nt, dot_tn, load_cos_sin, load_parts,
                                 scores, store_parts, three_loops, tile_act_grad, tile_mask,
                                 where_masked)


def _probs_and_dscores(cfg, s, m, lse, delta, dp):
    """(P, dS) of one tile; dS is the gradient w.r.t. the raw scores Q K^T."""
    if cfg.mode == "gdpa":
        a, da = tile_act_grad(s, cfg)
        p = where_masked(m, a * cfg.scale, 0.0)
        ds = where_masked(m, dp * da * cfg.scale, 0.0)
        return p, ds
    p = where_masked(m, jnp.exp2(s * (cfg.scale * LOG2E) - lse[:, None]), 0.0)  # lse in base 2
    return p, p * (dp - delta[:, None]) * cfg.scale


def _dq_kernel(qs_ref, qp_ref, ks_ref, kp_ref, perm_ref, lo_ref, hi_ref, flo_ref, fhi_ref, cq_ref,
               sq_ref, ck_ref, sk_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref,
               dk_ref=None, dv_ref=None, *, cfg, other_own=None, own=None, need=None,
               slot=None):
    """dQ of one query tile. With dk_ref / dv_ref and other_own (fused_bwd "q_rows", no
    RoPE) also each key tile's dK / dV, stored for the key rows other_own assigns to
    this query tile (all their queries are in it). With own / need ("k_rows": the dK/dV
    kernel stores the rest) only the rows own marks -1, and only tiles need marks run
    the key loop (else their rows get zeros). slot: the tile's place in the launch
    order (default the program id; rest_group loops over several)."""
    i = perm_ref[pl.program_id(0) if slot is None else slot]
    bq, bk = cfg.bq, cfg.bk
    qrows = pl.ds(i * bq, bq)

    def compute():
        qs, qpos = qs_ref[qrows], qp_ref[qrows]
        cs_q = load_cos_sin(cq_ref, sq_ref, qrows, cfg)
        qparts = load_parts(q_ref, qrows, cs_q, cfg)
        do = do_ref[qrows, :]
        lse = lse_ref[qrows] if lse_ref is not None else None
        delta = delta_ref[qrows] if delta_ref is not None else None

        def body(j, acc, masked):
            rows = pl.ds(j * bk, bk)
            kparts = load_parts(k_ref, rows, load_cos_sin(ck_ref, sk_ref, rows, cfg), cfg)
            m = tile_mask(cfg, qs, qpos, ks_ref[rows], kp_ref[rows], masked)
            s = scores(qparts, kparts)
            dp = dot_nt(do, v_ref[rows, :])
            p, ds = _probs_and_dscores(cfg, s, m, lse, delta, dp)
            ds = ds.astype(kparts[0].dtype)
            if dk_ref is not None:
                mine = other_own[rows] == i
                _store_rows(dv_ref, rows, dot_tn(p.astype(do.dtype), do), mine)
                _store_rows(dk_ref, rows, dot_tn(ds, qparts[0]), mine)
            return tuple(a + dot_nn(ds, kp) for a, kp in zip(acc, kparts))

        init = tuple(jnp.zeros(p.shape, F32) for p in qparts)
        acc = three_loops(lo_ref[i], flo_ref[i], fhi_ref[i], hi_ref[i], body, init, cfg)
        if own is None:
            store_parts(dq_ref, qrows, acc, cs_q, cfg)
        else:
            _store_rows(dq_ref, qrows, acc[0], own[qrows] == -1)

    _only_needed(compute, need, i, lambda: _store_rows(
        dq_ref, qrows, jnp.zeros((bq, dq_ref.shape[-1]), F32), own[qrows] == -1))


def _store_rows(ref, rows, x, mask):
    """ref[rows] = x where mask (a [rows] bool), in ref's dtype."""
    plgpu.store(ref.at[rows, :], x.astype(ref.dtype), mask=mask[:, None])


def _only_needed(compute, need, i, zeros):
    """compute() for tile i, or with need (fused_bwd "*_rows"): compute() where need[i],
    else zeros() (the tile's rows have no pairs left to this kernel)."""
    if need is None:
        compute()
        return
    pl.when(need[i] != 0)(compute)
    pl.when(need[i] == 0)(zeros)


def _dkv_kernel(qs_ref, qp_ref, ks_ref, kp_ref, perm_ref, lo_ref, hi_ref, flo_ref, fhi_ref,
                cq_ref, sq_ref, ck_ref, sk_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
                dk_ref, dv_ref, dq_ref=None, *, cfg, other_own=None, own=None, need=None,
                slot=None, partial_refs=None):
    """dK, dV of one key tile. With dq_ref and other_own (fused_bwd "k_rows", no RoPE)
    also each query tile's dQ, stored for the query rows other_own assigns to this key
    tile (all their keys are in it). With
    own / need ("q_rows": the dQ kernel stores the rest) only the rows own marks -1, and
    only tiles need marks run the query loop (else their rows get zeros). slot: as in
    _dq_kernel. partial_refs (dkv_split_tiles): the float32 partial dK, dV of the split
    tiles (_dkv_top)."""
    split = _dkv_split(cfg, own)
    p = pl.program_id(0) if slot is None else slot
    bq, bk = cfg.bq_dkv, cfg.bk_dkv
    nk = k_ref.shape[0] // bk
    top = _dkv_top(cfg, split, nk)
    if top:   # programs < nk: tile perm[p] (chunk 0 if p < top); then chunks 1.. of the top
        e = p - nk
        s = jnp.where(e >= 0, e // (split - 1), p)      # place of the tile in the order
        c = jnp.where(e >= 0, 1 + e % (split - 1), 0)   # its chunk
        in_top = s < top
        j = perm_ref[s]
    else:
        c = None              # chunk p % split
        j = perm_ref[p // split] if split > 1 else perm_ref[p]
    krows = pl.ds(j * bk, bk)
    # where the partial dK / dV go: chunk c's at rows c * Tk + j * bk
    orows = pl.ds(p % split * k_ref.shape[0] + j * bk, bk) if split > 1 and not top else krows

    def query_range():
        """(lo, flo, fhi, hi) of the query loop: the tile's, or chunk c of it."""
        lo, flo, fhi, hi = lo_ref[j], flo_ref[j], fhi_ref[j], hi_ref[j]
        if split == 1:
            return lo, flo, fhi, hi
        cc = p % split if c is None else c
        a, b = lo + (hi - lo) * cc // split, lo + (hi - lo) * (cc + 1) // split
        if top:     # tiles past the top run whole
            a, b = jnp.where(in_top, a, lo), jnp.where(in_top, b, hi)
        return a, jnp.clip(flo, a, b), jnp.clip(fhi, a, b), b

    def compute():
        ks, kpos = ks_ref[krows], kp_ref[krows]
        cs_k = load_cos_sin(ck_ref, sk_ref, krows, cfg)
        kparts = load_parts(k_ref, krows, cs_k, cfg)
        v = v_ref[krows, :]

        def body(i, carry, masked):
            dks, dv = carry
            rows = pl.ds(i * bq, bq)
            qparts = load_parts(q_ref, rows, load_cos_sin(cq_ref, sq_ref, rows, cfg), cfg)
            m = tile_mask(cfg, qs_ref[rows], qp_ref[rows], ks, kpos, masked)
            s = scores(qparts, kparts)
            do = do_ref[rows, :]
            dp = dot_nt(do, v)
            lse = lse_ref[rows] if lse_ref is not None else None
            delta = delta_ref[rows] if delta_ref is not None else None
            p, ds = _probs_and_dscores(cfg, s, m, lse, delta, dp)
            dv = dv + dot_tn(p.astype(do.dtype), do)
            ds = ds.astype(qparts[0].dtype)
            if dq_ref is not None:
                _store_rows(dq_ref, rows, dot_nn(ds, kparts[0]), other_own[rows] == j)
            return tuple(a + dot_tn(ds, qp) for a, qp in zip(dks, qparts)), dv

        init = (tuple(jnp.zeros(p.shape, F32) for p in kparts), jnp.zeros(v.shape, F32))
        dks, dv = three_loops(*query_range(), body, init, cfg)

        def store(dk_out, dv_out, rows):
            store_parts(dk_out, rows, dks, cs_k, cfg)
            dv_out[rows, :] = dv.astype(dv_out.dtype)
        if top:     # a split tile's chunk c: partial slot c * top + s; the rest direct
            pl.when(in_top)(lambda: store(*partial_refs, pl.ds((c * top + s) * bk, bk)))
            pl.when(jnp.logical_not(in_top))(lambda: store(dk_ref, dv_ref, krows))
        elif own is None:
            store(dk_ref, dv_ref, orows)
        else:
            mine = own[krows] == -1
            _store_rows(dk_ref, krows, dks[0], mine)
            _store_rows(dv_ref, krows, dv, mine)

    def zeros():
        z, mine = jnp.zeros((bk, dk_ref.shape[-1]), F32), own[krows] == -1
        _store_rows(dk_ref, krows, z, mine)
        _store_rows(dv_ref, krows, z, mine)

    _only_needed(compute, need, j, zeros)


def _dkv_split(cfg, own=None):
    """Programs per key tile of the dK/dV kernel: cfg.dkv_split, 1 where the kernel stores
    only some rows (own: "q_rows"'s rest kernel)."""
    return 1 if own is not None else cfg.dkv_split


def _dkv_top(cfg, split, nk):
    """Key tiles split by dkv_split_tiles (the first of the launch order), 0 = all."""
    return min(cfg.dkv_split_tiles, nk) if split > 1 else 0


def _dkv_grid(cfg, split, nk):
    """Programs of the dK/dV kernel over nk key tiles."""
    top = _dkv_top(cfg, split, nk)
    return nk + top * (split - 1) if top else nk * split


def _dkv_outputs(k, split, top, bk):
    """([out_shape], [out_spec]) of the dK/dV kernel's dK / dV outputs: dK, dV [Tk, H, D]
    in k's dtype; with split > 1 the float32 partials [split * Tk, H, D] instead
    (_sum_partials); with top > 0 (dkv_split_tiles) dK, dV and the split tiles'
    partials [split * top * bk, H, D] (_merge_top)."""
    tk, h, d = k.shape
    direct = (jax.ShapeDtypeStruct(k.shape, k.dtype), head_spec(tk, d))
    if split == 1:
        outs = [direct] * 2
    elif top:
        rows = split * top * bk
        outs = [direct] * 2 + [(jax.ShapeDtypeStruct((rows, h, d), F32), head_spec(rows, d))] * 2
    else:
        outs = [(jax.ShapeDtypeStruct((split * tk, h, d), F32), head_spec(split * tk, d))] * 2
    return [o[0] for o in outs], [o[1] for o in outs]


def _dkv_results(outs, k, split, top, perm, bk):
    """(dK, dV) [Tk, H, D] in k's dtype from the dK/dV kernel's outputs (_dkv_outputs)."""
    if not top:
        return tuple(_sum_partials(x, k, split) for x in outs)
    dk, dv, pk, pv = outs
    return _merge_top(dk, pk, perm, split, top, bk), _merge_top(dv, pv, perm, split, top, bk)


def _merge_top(direct, partial, perm, split, top, bk):
    """direct [Tk, H, D] (the rows of tiles perm[:top] unwritten) with those tiles' rows
    set to the sum of their float32 partials [split * top * bk, H, D]."""
    tk, h, d = direct.shape
    sums = partial.reshape(split, top * bk, h, d).sum(axis=0).astype(direct.dtype)
    rows = (perm[:top, None] * bk + jnp.arange(bk, dtype=jnp.int32)[None, :]).reshape(-1)
    return direct.at[rows].set(sums, unique_indices=True)


def _sum_partials(x, like, split):
    """[split * Tk, H, D] float32 partials -> [Tk, H, D] in like's dtype."""
    if split == 1:
        return x
    return x.reshape(split, *like.shape).sum(axis=0).astype(like.dtype)


def softmax_delta(o, do):
    """[H, Tq] float32: rowsum(dO * O), the softmax backward's per-row term."""
    return jnp.sum(o.astype(F32) * do.astype(F32), axis=-1).T


def run_backward(cfg, q, k, v, lay, o, lse, do):
    """(dQ, dK, dV) of run_forward(cfg, q, k, v, lay) = (o, lse) for the cotangent do."""
    tq, h, d = q.shape
    tk = k.shape[0]
    softmax = cfg.mode == "softmax"
    stats, stat_specs = [], []
    if softmax:
        delta = softmax_delta(o, do)
        stats, stat_specs = [lse, delta], [stat_spec(tq)] * 2
    if cfg.fused_bwd in ("q_rows", "k_rows"):
        return _backward_rows(cfg, q, k, v, lay, do, stats, stat_specs)

    nq = tq // cfg.bq
    dq = pl.pallas_call(
        ordered_refs(_dq_kernel, cfg, 1, softmax, 1), grid=(nq, h),
        in_specs=in_specs(cfg, tq, tk, d, nq) + [head_spec(tq, d)] + stat_specs,
        out_specs=head_spec(tq, d), out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=compiler_params(cfg, True), interpret=cfg.interpret,
        name=f"jagged_flash_dq_{cfg.mode}",
    )(*layout_inputs(lay, q, k, v, True), do, *stats)

    nk = tk // cfg.bk_dkv
    split = _dkv_split(cfg)
    top = _dkv_top(cfg, split, nk)
    shapes, specs = _dkv_outputs(k, split, top, cfg.bk_dkv)

    def dkv_kernel(*refs, cfg):   # outs: dK, dV (+ the split tiles' partials)
        n = len(refs) - len(shapes) + 2
        _dkv_kernel(*refs[:n], cfg=cfg, partial_refs=refs[n:] or None)
    outs = pl.pallas_call(
        ordered_refs(dkv_kernel, cfg, 1, softmax, len(shapes)), grid=(_dkv_grid(cfg, split, nk), h),
        in_specs=in_specs(cfg, tq, tk, d, nk) + [head_spec(tq, d)] + stat_specs,
        out_specs=specs, out_shape=shapes,
        compiler_params=compiler_params(cfg, True), interpret=cfg.interpret,
        name=f"jagged_flash_dkv_{cfg.mode}",
    )(*layout_inputs(lay, q, k, v, False), do, *stats)
    return (dq,) + _dkv_results(outs, k, split, top, lay["k_perm"], cfg.bk_dkv)


def _backward_rows(cfg, q, k, v, lay, do, stats, stat_specs):
    """fused_bwd "k_rows" / "q_rows": no atomics. "k_rows": a query row whose key interval
    lies in one dK/dV key tile (e.g. cross-attention to 32 keys per sample, aligned) gets
    its dQ stored by that tile's program; the dQ kernel runs first and stores only the
    other rows (tiles with none skip their key loop) into the buffer the dK/dV kernel
    then completes (aliased). "q_rows": the same with the sides swapped (key rows whose
    query interval lies in one dQ query tile, e.g. PMA's 16 queries)."""
    tq, h, d = q.shape
    tk = k.shape[0]
    k_rows = cfg.fused_bwd == "k_rows"
    if k_rows:    # query rows, owned by dK/dV key tiles; B = the dQ kernel
        start, end, t_own, t_b, tile_b = lay["q_start"], lay["q_end"], cfg.bk_dkv, tq, cfg.bq
    else:         # key rows, owned by dQ query tiles; B = the dK/dV kernel
        start, end, t_own, t_b, tile_b = lay["k_start"], lay["k_end"], cfg.bq, tk, cfg.bk_dkv
    own, need = row_owners(start, end, t_own, tile_b)
    n_b = t_b // tile_b
    softmax = cfg.mode == "softmax"
    b_base, a_base = (_dq_kernel, _dkv_kernel) if k_rows else (_dkv_kernel, _dq_kernel)
    b_outs = [jax.ShapeDtypeStruct(q.shape, q.dtype)] if k_rows else [
        jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
    nb_out = len(b_outs)

    group = cfg.rest_group

    def b_kernel(*refs, cfg):   # 16 layout / cos, sin / q, k, v; do, own, need, lse, delta; outs
        def run(slot=None):
            b_base(*refs[:17], *refs[19:21], *refs[21:], cfg=cfg, own=refs[17], need=refs[18],
                   slot=slot)
        if group == 1:
            run()
            return

        first = pl.program_id(0) * group

        def body(g, carry):     # rest_group tiles per program; the last one's tail is idle
            slot = first + g
            pl.when(slot < n_b)(lambda: run(slot))
            return carry
        lax.fori_loop(0, group, body, 0)

    partial = pl.pallas_call(
        ordered_refs(b_kernel, cfg, 3, softmax, nb_out), grid=(-(-n_b // group), h),
        in_specs=(in_specs(cfg, tq, tk, d, n_b)
                  + [head_spec(tq, d), full_spec((t_b,)), full_spec((n_b,))] + stat_specs),
        out_specs=[head_spec(t_b, d)] * nb_out, out_shape=b_outs,
        compiler_params=compiler_params(cfg, True), interpret=cfg.interpret,
        name=f"jagged_flash_bwd_{'dq' if k_rows else 'dkv'}_rest_{cfg.mode}",
    )(*layout_inputs(lay, q, k, v, k_rows), do, own, need, *stats)

    def a_kernel(*refs, cfg):   # 16; do, other_own, the partial buffers (unread), lse, delta;
        n = 18 + nb_out         # outs (k_rows: dK, dV, dQ, then the split tiles' partials)
        outs = refs[n + 2:]
        parts = dict(partial_refs=outs[3:] or None) if k_rows else {}   # _dkv_kernel's
        a_base(*refs[:17], *refs[n:n + 2], *outs[:3], cfg=cfg, other_own=refs[17], **parts)

    ins = layout_inputs(lay, q, k, v, not k_rows)
    n_a = tk // cfg.bk_dkv if k_rows else tq // cfg.bq
    split = _dkv_split(cfg) if k_rows else 1
    top = _dkv_top(cfg, split, n_a) if k_rows else 0
    if k_rows:    # outputs dK, dV, dQ (aliased to the dQ kernel's partial buffer), partials
        shapes, specs = _dkv_outputs(k, split, top, cfg.bk_dkv)
        a_shapes = shapes[:2] + [jax.ShapeDtypeStruct(q.shape, q.dtype)] + shapes[2:]
        a_specs, alias = specs[:2] + [head_spec(tq, d)] + specs[2:], {len(ins) + 2: 2}
    else:         # outputs dQ, dK, dV (dK, dV aliased to the dK/dV kernel's partial buffers)
        a_shapes = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
                    jax.ShapeDtypeStruct(v.shape, v.dtype)]
        a_specs = [head_spec(tq, d)] + [head_spec(tk, d)] * 2
        alias = {len(ins) + 2: 1, len(ins) + 3: 2}
    outs = pl.pallas_call(
        ordered_refs(a_kernel, cfg, 2 + nb_out, softmax, len(a_shapes)),
        grid=(_dkv_grid(cfg, split, n_a) if k_rows else n_a, h),
        in_specs=(in_specs(cfg, tq, tk, d, n_a) + [head_spec(tq, d), full_spec((t_b,))]
                  + [head_spec(t_b, d)] * nb_out + stat_specs),
        out_specs=a_specs, out_shape=a_shapes, input_output_aliases=alias,
        compiler_params=compiler_params(cfg, True), interpret=cfg.interpret,
        name=f"jagged_flash_bwd_{cfg.fused_bwd}_{cfg.mode}",
    )(*ins, do, own, *partial, *stats)
    if k_rows:
        dq = outs[2]
        return (dq,) + _dkv_results(outs[:2] + outs[3:], k, split, top, lay["k_perm"],
                                    cfg.bk_dkv)
    return tuple(outs)
