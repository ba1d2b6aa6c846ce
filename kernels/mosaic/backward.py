"""The Mosaic GPU backward kernels: dQ (query tiles stationary, K / V streamed) and
dK / dV (key tiles stationary, Q / dO streamed), or with fused_dq one kernel for all three."""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels.mosaic.layout import tile_table
from kernels.mosaic.pipeline import (activation_grad_times_scale, activation_times_scale,
                                     for_items, item_tiles, load_stationary, mma_from, produce,
                                     run_walk, scores_nt, tile_mask, walk_ranges, work_items)
from kernels.mosaic.tuning import F32, LOG2E, NUM_CONSUMERS


def _grad_p(cfg, s, stat, valid, transposed):
    """P of one tile from the scores s (float32): softmax exp2(s * scale log2 e - lse),
    gdpa act(s) scale; masked pairs 0. stat: lse along the query dim (rows, or columns
    if `transposed`: dK / dV's [keys, queries] tiles)."""
    if cfg.mode == "softmax":
        p = jnp.exp2(s * (cfg.scale * LOG2E) - _along_queries(stat, s.shape, transposed))
    else:
        p = activation_times_scale(s, cfg.activation, cfg.scale)
    return p if valid is None else jnp.where(valid, p, 0.0)


def _grad_ds(cfg, s, p, dp, delta, valid, transposed):
    """dS of one tile from s, its P (_grad_p) and dP: softmax P (dP scale - delta scale),
    delta scaled once per row and dP scale - that one FMA per score (P's masked zeros
    carry over); gdpa dP act'(s) scale, masked pairs 0."""
    if cfg.mode == "softmax":
        return p * (dp * cfg.scale - _along_queries(delta * cfg.scale, dp.shape, transposed))
    ds = dp * activation_grad_times_scale(s, cfg.activation, cfg.scale)
    return ds if valid is None else jnp.where(valid, ds, 0.0)


def _along_queries(x, shape, transposed):
    return lax.broadcast_in_dim(x, shape, [1 if transposed else 0])


def _grad_tiles(cfg, s, dp, stat, delta, valid, transposed):
    """(P, dS) of one tile (_grad_p, _grad_ds)."""
    p = _grad_p(cfg, s, stat, valid, transposed)
    return p, _grad_ds(cfg, s, p, dp, delta, valid, transposed)


def _backward_roles(cfg, make_item, stream):
    """The backward kernels' warpgroups: each consumer wg runs make_item(wg) (its
    one_item(row, head, g0) -> g0') over this CTA's items and waits for its stores; the
    producer streams `stream` (produce's table, two gmem refs, their rings, loaded and
    free barriers)."""
    wg = lax.axis_index("wg")
    count, item = work_items()

    @pl.when(wg < NUM_CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(cfg.consumer_registers, action="increase")
        for_items(count, item, make_item(wg))
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == NUM_CONSUMERS)
    def _producer():
        plgpu.set_max_registers(cfg.producer_registers, action="decrease")
        produce(*stream, tile=cfg.block_kv, stages=cfg.num_stages, count=count, item=item)


def _dq_kernel(table_ref, start_ref, end_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
               *refs, cfg):
    """dQ = dS K over each query tile's key tiles (K / V streamed as in the forward).

    Softmax: delta_ref is the forward's output O [Tq, H, D]; each consumer loads its rows
    of O beside Q and dO, computes delta = rowsum(O * dO) there and writes it out
    [H, Tq] float32 for the dK / dV kernel."""
    fused = cfg.mode == "softmax"
    if fused:
        (dq_ref, delta_out_ref, q_smem, do_smem, o_smem, delta_smem, k_smem, v_smem, ds_smem,
         q_bar, k_bar, v_bar, k_free, v_free) = refs
    else:
        dq_ref, q_smem, do_smem, k_smem, v_smem, ds_smem, q_bar, k_bar, v_bar, k_free, v_free = refs
    bq, bk, stages = cfg.block_q, cfg.block_kv, cfg.num_stages
    d, dtype = q_ref.shape[-1], q_ref.dtype

    def make_item(wg):
        row_layout = plgpu.Layout.WGMMA.reduce(1)
        qs, dos = q_smem.at[wg], do_smem.at[wg]
        stage = None if ds_smem is None else ds_smem.at[wg]

        def one_item(row, head, g0):
            c_lo, c_hi, ranges, row0, base = item_tiles(table_ref, row, wg, cfg)
            rows = pl.ds(row0, bq)
            copies = [(q_ref.at[rows, head], qs), (do_ref.at[rows, head], dos)]
            if fused:
                copies.append((delta_ref.at[rows, head], o_smem.at[wg]))
            wait = load_stationary(copies, q_bar, wg)
            load = lambda ref: plgpu.load(ref, layout=row_layout, optimized=False)  # noqa: E731
            start, end = load(start_ref.at[rows]), load(end_ref.at[rows])
            lse = delta = None
            if cfg.mode == "softmax":
                lse = load(lse_ref.at[head, rows])
            wait()
            if fused:   # delta = rowsum(O dO) in float32, as kernels.triton.softmax_delta
                tile = lambda ref: plgpu.load(ref, layout=plgpu.Layout.WGMMA,  # noqa: E731
                                              optimized=False).astype(F32)
                delta = jnp.sum(tile(o_smem.at[wg]) * tile(dos), axis=1)
                delta_smem.at[wg][...] = delta
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(delta_smem.at[wg], delta_out_ref.at[head, rows])

            def step(j, kind, carry, acc_ref):
                slot = lax.rem(g0 + j - c_lo, jnp.int32(stages))
                plgpu.barrier_wait(k_bar.at[slot])
                plgpu.barrier_wait(v_bar.at[slot])
                if kind != "skip":
                    s = scores_nt(qs, k_smem.at[slot], bq, bk)       # Q K^T
                    dp = scores_nt(dos, v_smem.at[slot], bq, bk)     # dO V^T
                    valid = (tile_mask(start, end, base + j * bk, bq, bk) if kind == "masked"
                             else None)
                    _, ds = _grad_tiles(cfg, s, dp, lse, delta, valid, False)
                    mma_from(acc_ref, ds.astype(dtype), stage, k_smem.at[slot])   # dS K
                if kind != "skip":
                    plgpu.wgmma_wait(0)
                plgpu.barrier_arrive(k_free.at[slot])
                plgpu.barrier_arrive(v_free.at[slot])

            def walk(acc_ref):
                run_walk(walk_ranges(c_lo, c_hi, ranges, False),
                          functools.partial(step, acc_ref=acc_ref), None)
                return acc_ref[...]

            acc = pl.run_scoped(walk, plgpu.ACC((bq, d), F32))
            qs[...] = acc.astype(dtype)        # Q's tile is free: stage dQ there
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(qs, dq_ref.at[rows, head])
            return g0 + (c_hi - c_lo)
        return one_item

    _backward_roles(cfg, make_item,
                    (table_ref, k_ref, v_ref, k_smem, v_smem, k_bar, v_bar, k_free, v_free))


def _fused_dq_cols(d):
    """fused_dq: dQ columns per consumer and step, D / 2 where that is whole 64-column
    shared-memory tiles (D = 128); else D (D = 64: the consumers take alternate steps)."""
    half = d // NUM_CONSUMERS
    return half if half % 64 == 0 else d


def _dkv_kernel(table_ref, start_ref, end_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
                *refs, cfg):
    """dK = dS^T Q and dV = P^T dO over each key tile's query tiles (Q / dO streamed).

    Rows are keys here: the table's CTA tiles are key tiles, start / end each key's
    query interval, block_kv the streamed query tile.

    With cfg.fused_dq also dQ: dq_acc_ref (an input ref, [Tq, H, D] float32, zeroed by
    the caller) gets every step's dS K reduce-added. Each step, both consumers write
    their dS^T [block_q keys, block_kv queries] into one shared [2 block_q, block_kv]
    tile (two buffers, by step parity) and meet at a 2-arrival barrier; consumer w then
    computes dQ[:, w D/2 : (w+1) D/2] over both halves' keys (dS from the transposed
    shared tile, K's columns from both stationary K tiles), stages it in float32 and
    reduce-adds it. A consumer's skip steps write zeros there, as the other one's
    columns of dQ still need the step. One more barrier after the walk keeps the K tiles
    until both consumers' last dQ products have read them (dK and dV are staged there)."""
    fused = cfg.fused_dq
    if fused:
        (dq_acc_ref, dk_ref, dv_ref, k_smem, v_smem, dst_smem, dq_smem, q_smem, do_smem, p_smem,
         ds_smem, kv_bar, q_bar, do_bar, q_free, do_free, pair_bar) = refs
    else:
        (dk_ref, dv_ref, k_smem, v_smem, q_smem, do_smem, p_smem, ds_smem, kv_bar, q_bar,
         do_bar, q_free, do_free) = refs
    bq, bk, stages = cfg.block_q, cfg.block_kv, cfg.num_stages
    d, dtype = k_ref.shape[-1], k_ref.dtype
    wq = _fused_dq_cols(d)
    split = wq < d

    def pair():   # both consumers here (a 2-arrival barrier, one phase per call)
        plgpu.barrier_arrive(pair_bar)
        plgpu.barrier_wait(pair_bar)

    def make_item(wg):
        row_layout = plgpu.Layout.WGMMA.reduce(1)
        col_layout = plgpu.Layout.WGMMA.reduce(0)
        ks, vs = k_smem.at[wg], v_smem.at[wg]
        p_stage = None if p_smem is None else p_smem.at[wg]
        ds_stage = None if ds_smem is None else ds_smem.at[wg]

        def one_item(row, head, g0):
            c_lo, c_hi, ranges, row0, base = item_tiles(table_ref, row, wg, cfg)
            rows = pl.ds(row0, bq)
            wait = load_stationary(((k_ref.at[rows, head], ks), (v_ref.at[rows, head], vs)),
                                    kv_bar, wg)
            start = plgpu.load(start_ref.at[rows], layout=row_layout, optimized=False)
            end = plgpu.load(end_ref.at[rows], layout=row_layout, optimized=False)
            wait()

            def step(j, kind, carry, dk_ref_acc, dv_ref_acc):
                slot = lax.rem(g0 + j - c_lo, jnp.int32(stages))
                lse = delta = None
                if kind != "skip" and cfg.mode == "softmax":
                    # the streamed queries' lse / delta straight from global memory,
                    # issued before the barrier waits and the two wgmmas so that their
                    # latency hides behind them
                    cols = pl.ds(base + j * bk, bk)
                    load = lambda ref: plgpu.load(ref, layout=col_layout, optimized=False)  # noqa: E731
                    lse, delta = load(lse_ref.at[head, cols]), load(delta_ref.at[head, cols])
                plgpu.barrier_wait(q_bar.at[slot])
                plgpu.barrier_wait(do_bar.at[slot])
                if kind != "skip":
                    st = scores_nt(ks, q_smem.at[slot], bq, bk)      # (Q K^T)^T
                    dpt = scores_nt(vs, do_smem.at[slot], bq, bk)    # (dO V^T)^T
                    valid = (tile_mask(start, end, base + j * bk, bq, bk) if kind == "masked"
                             else None)
                    pt, dst = _grad_tiles(cfg, st, dpt, lse, delta, valid, True)
                    mma_from(dv_ref_acc, pt.astype(dtype), p_stage, do_smem.at[slot])   # P^T dO
                    mma_from(dk_ref_acc, dst.astype(dtype), ds_stage, q_smem.at[slot])  # dS^T Q
                if fused:
                    g = g0 + j - c_lo
                    shared = dst_smem.at[lax.rem(g, jnp.int32(2))]
                    mine = (plgpu.layout_cast(jnp.zeros((bq, bk), dtype), plgpu.Layout.WGMMA)
                            if kind == "skip" else dst.astype(dtype))
                    shared.at[pl.ds(wg * bq, bq)][...] = mine
                    plgpu.commit_smem()
                    pair()

                    col0 = wg * wq if split else 0

                    def dq_part(acc_ref):   # dS [queries, 2 bq keys] @ K[:, my columns]
                        for c in range(NUM_CONSUMERS):
                            plgpu.wgmma(acc_ref, shared.at[pl.ds(c * bq, bq)].transpose((1, 0)),
                                        k_smem.at[c].at[:, pl.ds(col0, wq)])
                        return acc_ref[...]

                    def dq_step():
                        part = pl.run_scoped(dq_part, plgpu.ACC((bk, wq), F32))
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the last reduce read it
                        dq_smem.at[wg][...] = part
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(
                            dq_smem.at[wg], dq_acc_ref.at[pl.ds(base + j * bk, bk), head,
                                                          pl.ds(col0, wq)],
                            reduction_op="add")
                    if split:
                        dq_step()
                    else:
                        pl.when(lax.rem(g, jnp.int32(NUM_CONSUMERS)) == wg)(dq_step)
                if kind != "skip" or fused:
                    plgpu.wgmma_wait(0)
                plgpu.barrier_arrive(q_free.at[slot])
                plgpu.barrier_arrive(do_free.at[slot])

            def walk(dk_acc, dv_acc):
                run_walk(walk_ranges(c_lo, c_hi, ranges, False),
                          functools.partial(step, dk_ref_acc=dk_acc, dv_ref_acc=dv_acc), None)
                return dk_acc[...], dv_acc[...]

            dk, dv = pl.run_scoped(walk, plgpu.ACC((bq, d), F32), plgpu.ACC((bq, d), F32))
            if fused:   # the other consumer's last dQ products have read my K tile
                pair()
            ks[...] = dk.astype(dtype)         # K's and V's tiles are free: stage dK, dV there
            vs[...] = dv.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(ks, dk_ref.at[rows, head])
            plgpu.copy_smem_to_gmem(vs, dv_ref.at[rows, head])
            return g0 + (c_hi - c_lo)
        return one_item

    _backward_roles(cfg, make_item,
                    (table_ref, q_ref, do_ref, q_smem, do_smem, q_bar, do_bar, q_free, do_free))


def run_backward(cfg, lay, q, k, v, do, lse, delta, interpret=False, o=None):
    """(dQ, dK, dV) of the forward `cfg` ran: lay from kernels.triton.build_layout
    (q_start / q_end, k_start / k_end), lse [H, Tq] float32 (softmax; any [H, Tq] for
    gdpa, unread). delta [H, Tq] float32 = rowsum(O dO) is read by the fused_dq kernel
    only (softmax); otherwise the dQ kernel computes it from o, the forward's output
    [Tq, H, D] (delta None is fine). Tq, Tk multiples of cfg.cta_rows and of
    cfg.block_kv (the streamed tile of both kernels). interpret: the P / dS operands of
    the wgmmas go through shared memory (the interpreter's wgmma takes no register
    operand)."""
    tq, h, d = q.shape
    tk = k.shape[0]
    for t in {cfg.cta_rows, cfg.block_kv}:
        if tq % t or tk % t:
            raise ValueError(f"mosaic backward: Tq={tq} / Tk={tk} must be multiples of "
                             f"{cfg.cta_rows} and {cfg.block_kv}")
    bq, stages = cfg.block_q, cfg.num_stages
    stage_p = bool(interpret)
    transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    smem = lambda *shape: plgpu.SMEM(shape, q.dtype, transforms=transforms)  # noqa: E731
    params = plgpu.CompilerParams(approx_math=True)
    interp = (plgpu.InterpretGPUParams() if interpret is True else interpret) or None

    def launch(kernel, kcfg, start, end, n_cols, outs, staged, extra=(), loads=2,
               delta_in=None, more_in=(), tail=()):
        """kernel over kcfg's tile table of rows [start, end): scratch = two stationary
        [NC, block_q, D] tiles and `extra` (`loads` stationary tiles in all, each with
        its barriers, then any other scratch), the ring of two streamed [stages, kcfg.block_kv, D]
        tiles, `staged` P / dS staging tiles (interpret mode), the
        stationary loads' barriers, the ring's loaded / free barriers, then `tail`;
        `more_in`: operands after delta (refs the kernel writes into)."""
        table, bk = tile_table(kcfg, start, end, n_cols), kcfg.block_kv
        ring = [smem(stages, bk, d), smem(stages, bk, d)]
        bars = ([plgpu.Barrier(num_barriers=stages)] * 2
                + [plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=stages)] * 2)
        stationary = [smem(NUM_CONSUMERS, bq, d), smem(NUM_CONSUMERS, bq, d), *extra]
        stage = [smem(NUM_CONSUMERS, bq, bk) if stage_p else None] * staged
        return plgpu.kernel(
            functools.partial(kernel, cfg=kcfg),
            out_type=outs, grid=(table.shape[0], h),
            scratch_types=[*stationary, *ring, *stage,
                           plgpu.Barrier(num_barriers=loads * NUM_CONSUMERS), *bars, *tail],
            grid_names=("tile", "head"), num_threads=NUM_CONSUMERS + 1, thread_name="wg",
            compiler_params=params, interpret=interp,
        )(table, start, end, q, k, v, do, lse, delta if delta_in is None else delta_in,
          *more_in)

    if cfg.fused_dq:   # one kernel: dK, dV and dQ reduce-added in float32
        dq_acc = jax.new_ref(jnp.zeros((tq, h, d), F32))
        dk, dv = launch(_dkv_kernel, cfg, lay["k_start"], lay["k_end"], tq,
                        (jax.ShapeDtypeStruct(k.shape, k.dtype),) * 2, 2,
                        extra=[smem(2, NUM_CONSUMERS * bq, cfg.block_kv),
                               plgpu.SMEM((NUM_CONSUMERS, cfg.block_kv, _fused_dq_cols(d)),
                                          F32)],
                        more_in=(dq_acc,),
                        tail=[plgpu.Barrier(num_arrivals=NUM_CONSUMERS)])
        return dq_acc[...].astype(q.dtype), dk, dv

    if cfg.mode == "softmax":
        if o is None:
            raise ValueError("mosaic backward: softmax needs the forward's output o")
        dq, delta = launch(_dq_kernel, cfg, lay["q_start"], lay["q_end"], tk,
                           (jax.ShapeDtypeStruct(q.shape, q.dtype),
                            jax.ShapeDtypeStruct((h, tq), F32)), 1,
                           extra=[smem(NUM_CONSUMERS, bq, d),
                                  plgpu.SMEM((NUM_CONSUMERS, bq), F32)], loads=3, delta_in=o)
    else:
        dq = launch(_dq_kernel, cfg, lay["q_start"], lay["q_end"], tk,
                    jax.ShapeDtypeStruct(q.shape, q.dtype), 1)
    dk, dv = launch(_dkv_kernel, cfg, lay["k_start"], lay["k_end"], tq,
                    (jax.ShapeDtypeStruct(k.shape, k.dtype),) * 2, 2)
    return dq, dk, dv
