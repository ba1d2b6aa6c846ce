"""The Mosaic GPU forward kernel (GDPA and softmax) and its direct entries
gdpa_mosaic_forward / softmax_mosaic_forward."""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels.common import check_attention_inputs
from kernels.mosaic.layout import build_layout
from kernels.mosaic.pipeline import (activation_times_scale, for_items, item_tiles,
                                     load_stationary, mma_from, produce, run_walk, tile_mask,
                                     walk_ranges, work_items)
from kernels.mosaic.tuning import F32, LOG2E, NEG, NUM_CONSUMERS, mosaic_config


def _kernel(table_ref, start_ref, end_ref, q_ref, k_ref, v_ref, *refs, cfg, deferred):
    """One CTA of the forward (kernels.mosaic's docstring). deferred: a step's P V is
    awaited by the next step's score wait (off: in its own step; the interpreter's
    softmax, which cannot store into a wgmma accumulator)."""
    softmax = cfg.mode == "softmax"
    if softmax:
        (o_ref, lse_ref, qo_smem, k_smem, v_smem, p_smem, lse_smem, q_bar, k_bar, v_bar, k_free,
         v_free, sched_bar) = refs
    else:
        (o_ref, qo_smem, k_smem, v_smem, p_smem, q_bar, k_bar, v_bar, k_free, v_free,
         sched_bar) = refs
    bq, bk, stages = cfg.block_q, cfg.block_kv, cfg.num_stages
    d = q_ref.shape[-1]
    dtype = q_ref.dtype
    wg = lax.axis_index("wg")
    count, item = work_items()

    # The K/V ring is indexed by the CTA's global key step g (over all its items), so
    # slot g % stages and every barrier phase follow one sequence in all three threads.
    def sched():
        if cfg.schedule_barrier:
            plgpu.barrier_arrive(sched_bar)
            plgpu.barrier_wait(sched_bar)

    @pl.when(wg < NUM_CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(cfg.consumer_registers, action="increase")
        q_smem = qo_smem.at[wg]
        row_layout = plgpu.Layout.WGMMA.reduce(1)

        def one_item(row, head, g0):
            c_lo, c_hi, ranges, row0, base = item_tiles(table_ref, row, wg, cfg)
            rows = pl.ds(row0, bq)
            wait = load_stationary(((q_ref.at[rows, head], q_smem),), q_bar, wg)
            start = plgpu.load(start_ref.at[rows], layout=row_layout, optimized=False)
            end = plgpu.load(end_ref.at[rows], layout=row_layout, optimized=False)
            wait()

            in_ref = deferred or not softmax   # the accumulator: a wgmma ref for the walk

            def step(j, kind, carry, acc_ref=None):
                """One key step; the accumulator is acc_ref (gdpa; softmax when
                deferred) or carried (softmax: (acc, m, l)); softmax carries (m, l)
                and `deferred` the slot whose P V is still in flight (-1: none) last.
                A "narrow" step works on the first half of the slot's keys."""
                w = bk // 2 if kind == "narrow" else bk
                keys = lambda ref: ref if w == bk else ref.at[pl.ds(0, w)]  # noqa: E731
                slot = lax.rem(g0 + j - c_lo, jnp.int32(stages))
                plgpu.barrier_wait(k_bar.at[slot])
                if kind == "skip":       # keep the barrier phases in step, no math
                    sched()
                    plgpu.barrier_arrive(k_free.at[slot])
                    if cfg.schedule_barrier:
                        plgpu.barrier_arrive(sched_bar)
                    plgpu.barrier_wait(v_bar.at[slot])
                    if cfg.schedule_barrier:
                        plgpu.barrier_wait(sched_bar)
                    plgpu.barrier_arrive(v_free.at[slot])
                    return carry

                def qk(s_ref):
                    plgpu.wgmma(s_ref, q_smem, keys(k_smem.at[slot]).transpose((1, 0)))
                    sched()
                    return s_ref[...]             # waits for the wgmma
                s = pl.run_scoped(qk, plgpu.ACC((bq, w), F32))
                plgpu.barrier_arrive(k_free.at[slot])
                if deferred:   # S's wait also waited for the last P V: release its V
                    pend = carry[-1]
                    pl.when(pend >= 0)(lambda: plgpu.barrier_arrive(v_free.at[pend]))
                valid = None if kind == "plain" else tile_mask(start, end, base + j * bk, bq, w)

                def pv(acc_ref, p16, slot):   # P from registers (FA3), or staged
                    stage = None if p_smem is None else (
                        p_smem.at[wg] if w == bk else p_smem.at[wg, :, pl.ds(0, w)])
                    mma_from(acc_ref, p16, stage, keys(v_smem.at[slot]))
                if softmax:   # online softmax in base 2 (the Triton kernels' lse convention)
                    acc, m, l = (None, *carry[:2]) if in_ref else carry
                    c = cfg.scale * LOG2E
                    fold = c > 0   # max(s) c = max(s c) for c > 0
                    if not fold:
                        s = s * c
                    if valid is not None:
                        s = jnp.where(valid, s, NEG)
                    if fold:    # m in scaled units; s c - m contracts to one FMA
                        m_new = jnp.maximum(m, jnp.max(s, axis=1) * c)
                        pr = jnp.exp2(s * c - lax.broadcast_in_dim(m_new, (bq, w), [0]))
                    else:
                        m_new = jnp.maximum(m, jnp.max(s, axis=1))
                        pr = jnp.exp2(s - lax.broadcast_in_dim(m_new, (bq, w), [0]))
                    if valid is not None:   # a row with no valid key yet: exp2(0) = 1 there
                        pr = jnp.where(valid, pr, 0.0)
                    alpha = jnp.exp2(m - m_new)
                    l = l * alpha + jnp.sum(pr, axis=1)
                    if in_ref:   # its P V is done (S's wait)
                        acc_ref[...] = acc_ref[...] * lax.broadcast_in_dim(alpha, (bq, d), [0])
                    else:
                        acc = acc * lax.broadcast_in_dim(alpha, (bq, d), [0])
                elif cfg.packed_act:   # scale: on the output (below)
                    pr = activation_times_scale(s.astype(dtype), cfg.activation, 1.0)
                    if valid is not None:
                        pr = jnp.where(valid, pr, jnp.zeros_like(pr))
                else:
                    pr = activation_times_scale(s, cfg.activation, cfg.scale)
                    if valid is not None:
                        pr = jnp.where(valid, pr, 0.0)
                p16 = pr.astype(dtype)
                if cfg.schedule_barrier:
                    plgpu.barrier_arrive(sched_bar)
                plgpu.barrier_wait(v_bar.at[slot])
                if cfg.schedule_barrier:
                    plgpu.barrier_wait(sched_bar)
                if in_ref:
                    pv(acc_ref, p16, slot)
                    if deferred:   # awaited by the next step's S (or the walk's end)
                        return (m_new, l, slot) if softmax else (slot,)
                else:                   # a fresh accumulator added in registers
                    def fresh(r):
                        pv(r, p16, slot)
                        return r[...]
                    acc = acc + pl.run_scoped(fresh, plgpu.ACC((bq, d), F32))
                plgpu.wgmma_wait(0)               # V's slot is read: release it
                plgpu.barrier_arrive(v_free.at[slot])
                return (acc, m_new, l) if softmax else carry

            ranges = walk_ranges(c_lo, c_hi, ranges, cfg.narrow)
            release = (lambda slot: plgpu.barrier_arrive(v_free.at[slot])) if deferred else None

            carry = None
            if softmax:
                carry = (plgpu.layout_cast(jnp.full((bq,), NEG, F32), row_layout),
                         plgpu.layout_cast(jnp.zeros((bq,), F32), row_layout))
                if not in_ref:
                    carry = (plgpu.layout_cast(jnp.zeros((bq, d), F32), plgpu.Layout.WGMMA),
                             *carry)
            if deferred:
                carry = (*(carry or ()), jnp.int32(-1))

            def walk(acc_ref):
                out = run_walk(ranges, functools.partial(step, acc_ref=acc_ref), carry,
                                release)
                return acc_ref[...], out
            if in_ref:
                acc, carry = pl.run_scoped(walk, plgpu.ACC((bq, d), F32))   # zero-initialised
            else:
                acc, *carry = run_walk(ranges, step, carry)
            if softmax:
                m, l = carry[:2]
                has = l > 0.0
                l_safe = jnp.where(has, l, 1.0)
                acc = acc / lax.broadcast_in_dim(l_safe, (bq, d), [0])
                lse_smem.at[wg][...] = jnp.where(has, m + jnp.log(l_safe) * LOG2E, 0.0)
            elif cfg.packed_act:
                acc = acc * cfg.scale
            q_smem[...] = acc.astype(dtype)   # Q's tile is free: stage the output there
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem, o_ref.at[rows, head])
            if softmax:
                plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[head, rows])
            return g0 + (c_hi - c_lo)

        pl.when(wg == 1)(sched)   # consumer 1 runs one schedule phase ahead
        for_items(count, item, one_item)
        pl.when(wg == 0)(sched)
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == NUM_CONSUMERS)
    def _producer():
        plgpu.set_max_registers(cfg.producer_registers, action="decrease")
        produce(table_ref, k_ref, v_ref, k_smem, v_smem, k_bar, v_bar, k_free, v_free,
                 tile=bk, stages=stages, count=count, item=item)


def run_kernel(cfg, layout, q, k, v, interpret=False):
    """The pallas kernel alone: layout = build_layout(...), q [Tq,H,D] with Tq a multiple
    of cfg.cta_rows, k / v [Tk,H,D] with Tk a multiple of cfg.block_kv -> [Tq,H,D]
    (softmax: and lse [H, Tq] float32). Grid (CTA tile, head), heads fastest.
    interpret: the interpreter's wgmma takes shared-memory operands only, so P goes
    through shared memory, and it cannot store into a wgmma accumulator, so softmax
    awaits each step's P V in its step."""
    table, start, end = layout
    tq, h, d = q.shape
    bq, bk, stages = cfg.block_q, cfg.block_kv, cfg.num_stages
    if tq % cfg.cta_rows or k.shape[0] % bk:
        raise ValueError(f"gdpa_mosaic: Tq={tq} / Tk={k.shape[0]} must be multiples of "
                         f"{cfg.cta_rows} / {bk}")
    n_tiles = table.shape[0]
    softmax = cfg.mode == "softmax"
    deferred = not (interpret and softmax)
    grid, names = (n_tiles, h), ("tile", "head")   # last axis fastest: heads together
    # 16-bit rows of 64 / 128 / 256 elements: 128-byte swizzle, (8, 64) tiles.
    transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    smem = lambda *shape: plgpu.SMEM(shape, q.dtype, transforms=transforms)  # noqa: E731
    scratch = [
        smem(NUM_CONSUMERS, bq, d),                     # Q per consumer, then its output
        smem(stages, bk, d), smem(stages, bk, d),       # K, V ring
        smem(NUM_CONSUMERS, bq, bk) if interpret else None,   # P per consumer
        *([plgpu.SMEM((NUM_CONSUMERS, bq), F32)] if softmax else []),  # lse per consumer
        plgpu.Barrier(num_barriers=NUM_CONSUMERS),      # Q loaded
        plgpu.Barrier(num_barriers=stages),             # K loaded
        plgpu.Barrier(num_barriers=stages),             # V loaded
        plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=stages),  # K slot free
        plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=stages),  # V slot free
        plgpu.Barrier(num_arrivals=NUM_CONSUMERS),      # consumer ping-pong
    ]
    if interpret is True:
        interpret = plgpu.InterpretGPUParams()
    out_type = jax.ShapeDtypeStruct(q.shape, q.dtype)
    if softmax:   # lse [H, Tq] float32, base 2, as the Triton softmax forward
        out_type = (out_type, jax.ShapeDtypeStruct((h, tq), F32))
    return plgpu.kernel(
        functools.partial(_kernel, cfg=cfg, deferred=deferred),
        out_type=out_type,
        scratch_types=scratch,
        grid=grid,
        grid_names=names,
        num_threads=NUM_CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret or None,
    )(table, start, end, q, k, v)


def _pad_rows(x, n):
    return x if x.shape[0] == n else jnp.pad(x, [(0, n - x.shape[0])] + [(0, 0)] * (x.ndim - 1))


def _mosaic_forward(name, mode, q, k, v, q_offsets, kv_offsets, causal, window, interpret,
                    **cfg_kw):
    check_attention_inputs(name, q, k, v, q_offsets, kv_offsets)
    if causal or window is not None:
        raise NotImplementedError(f"{name}: causal / window masks are not supported")
    tq, h, d = q.shape
    cfg = mosaic_config(d, q.dtype, mode=mode, **cfg_kw)
    if q_offsets.shape[0] == 1 or tq == 0:   # no samples
        return (jnp.zeros_like(q), jnp.zeros((h, tq), F32)) if mode == "softmax" else jnp.zeros_like(q)
    tqp = -(-tq // cfg.cta_rows) * cfg.cta_rows            # a copy unless already a multiple
    tkp = -(-max(k.shape[0], 1) // cfg.block_kv) * cfg.block_kv
    layout = build_layout(cfg, q_offsets, kv_offsets, tqp, tkp)
    out = run_kernel(cfg, layout, _pad_rows(q, tqp), _pad_rows(k, tkp), _pad_rows(v, tkp),
                     interpret)
    if mode == "softmax":
        return out[0][:tq], out[1][:, :tq]
    return out[:tq]


def gdpa_mosaic_forward(q, k, v, q_offsets, kv_offsets, *, activation="silu", scale=1.0,
                        interpret=False, causal=False, window=None, **tuning):
    """out = (act(Q K^T) * scale) @ V per jagged sample; see the module docstring.

    q [Tq,H,D], k/v [Tk,H,D] bf16/f16, offsets [B+1] int32 -> [Tq,H,D] in q.dtype.
    `tuning` overrides the forward's MosaicTuning fields (block_kv, num_stages, ...).
    interpret: False (compile for the GPU), True or an InterpretGPUParams (CPU).
    causal / window: not supported (NotImplementedError), accepted so that callers
    can pass gdpa's arguments through and fall back.
    """
    return _mosaic_forward("gdpa_mosaic", "gdpa", q, k, v, q_offsets, kv_offsets, causal,
                           window, interpret, activation=activation, scale=scale, **tuning)


def softmax_mosaic_forward(q, k, v, q_offsets, kv_offsets, *, sm_scale=None, interpret=False,
                           causal=False, window=None, **tuning):
    """(out, lse): softmax(Q K^T * sm_scale) V per jagged sample (sm_scale default
    1/sqrt(D)), and lse [H, Tq] float32, the base-2 log-sum-exp of the scaled scores
    (0 for rows without keys), which either backward reads. Shapes,
    dtypes, knobs and interpret as gdpa_mosaic_forward; rows without keys give 0."""
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    return _mosaic_forward("softmax_mosaic", "softmax", q, k, v, q_offsets, kv_offsets, causal,
                           window, interpret, scale=sm_scale, **tuning)
