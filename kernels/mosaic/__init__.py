"""Jagged attention on Pallas Mosaic GPU (Hopper), GDPA and softmax, forward and
backward: TMA loads, one producer warpgroup, two consumer warpgroups issuing wgmma
(the FlashAttention-3 layout). gdpa(impl="mosaic") and jagged_attention(impl="mosaic")
(both ops' default on a Hopper GPU) run these kernels through kernels.dispatch
(mosaic_forward, mosaic_backward), the Triton kernels where they do not apply.

    tuning.py    TUNING (per op a MosaicOpTuning: the MosaicTuning the forward and the
                 backward run with), MosaicSpec (what an op computes), MosaicConfig =
                 a spec + a tuning; check_config
    layout.py    per-row key intervals and the tile table, in XLA from the offsets
    pipeline.py  what both directions share: activations, the producer warpgroup, a
                 consumer's walk over its CTA's streamed tiles, masks, wgmma helpers
    forward.py   the forward kernel; gdpa_mosaic_forward / softmax_mosaic_forward
    backward.py  dQ and dK / dV (keys as the stationary rows), or with fused_dq one
                 kernel for all three (run_backward)

    out = gdpa_mosaic_forward(q, k, v, q_offsets, kv_offsets, activation="silu", scale=s)
    out, lse = softmax_mosaic_forward(q, k, v, q_offsets, kv_offsets, sm_scale=None)

Shapes (the contract of kernels.gdpa.gdpa_reference / jagged_attention_reference):
q [Tq,H,D], k/v [Tk,H,D] (bf16 or f16, one dtype), q_offsets / kv_offsets [B+1]
int32 (same B). Returns [Tq,H,D] in q.dtype: per sample b, GDPA out_b =
(act(Q_b K_b^T) * scale) @ V_b (no softmax, no 1/sqrt(D)); softmax out_b =
softmax(Q_b K_b^T * sm_scale) V_b plus lse [H, Tq] float32, the base-2 log-sum-exp
either backward reads (0 for rows without keys). Query rows of other samples
never mix; rows past q_offsets[-1] (and softmax rows without keys) are 0.

Schedule
  * Work item = (CTA tile of 2 * BLOCK_Q query rows, head): grid (tile, head), head
    fastest, one item per CTA.
  * A CTA runs 3 warpgroups. Warpgroups 0 and 1 (consumers) own BLOCK_Q = 64 rows
    each (wgmma's M); warpgroup 2 (producer) streams K and V tiles [block_kv, D] with
    TMA into a ring of `num_stages` shared-memory slots (forward: 128 keys x 2 stages,
    32 KB Q + 128 KB K/V at D=128). Each slot has a "loaded" mbarrier per operand (TMA
    completion) and a "free" mbarrier per operand that both consumers arrive on; the
    producer waits on "free" before refilling a slot. Each consumer loads its Q tile
    once (TMA) and writes its output back through the same shared-memory tile (TMA
    store).
  * Softmax: the consumer carries the running row max m and row sum l through its
    loops (online softmax in base 2, exp2, the scale folded into exp2's FMA where it is
    positive) and rescales the output accumulator by exp2(m_old - m_new) each step; the
    accumulator is a wgmma accumulator for the whole walk.
  * Per key step, a GDPA consumer: S = Q K^T (wgmma, both operands in shared memory, f32
    accumulator), P = act(S) in registers (silu as h + h tanh(h), h = S/2: one
    tanh.approx through approx_math, no exp and no divide; silu / gelu_tanh in the
    16-bit input type, two lanes per instruction, the scale applied to the output
    once), the mask where the step needs it, P cast to the input dtype, acc += P V
    (wgmma with P from registers). P V is not awaited in its step: the next step's
    wait for its scores covers it (wgmma groups retire in order) and the V slot is
    released there. With `schedule_barrier` the two consumers ping-pong as in FA3: a
    2-arrival mbarrier passed twice per step, consumer 1 one phase ahead, so one
    warpgroup's activation overlaps the other's matmuls.
  * Jagged ranges, computed in XLA from the offsets (layout.py): per query row its
    sample's key interval [start, end) = [kv_offsets[b], kv_offsets[b+1]) (padding
    rows, samples without keys: empty). Per consumer tile (64 rows) the key tiles
    [lo, hi) holding a valid pair and the interior [flo, fhi) whose pairs are all
    valid (kernels.common.tile_ranges / interior_ranges); per CTA the union
    [c_lo, c_hi) of its consumers' ranges, which the producer streams. Key tile j of
    a CTA starts at key base + j block_kv, base its first valid key rounded down to 8:
    a sample's keys then start near a tile's start instead of anywhere inside one. A
    consumer walks [c_lo, c_hi) in five loops: skip [c_lo, lo) (wait and release the
    slots, no math), masked [lo, flo), unmasked [flo, fhi), masked [fhi, hi), skip
    [hi, c_hi): every consumer passes every barrier phase, so the per-thread phase
    bits stay in step. The forward's last masked tile is a half-width step where the
    consumer's keys end in its first half (block_kv 128 or 256). The mask is per row:
    key index in [start, end). CTA tiles are launched heaviest-first (longest
    [c_lo, c_hi) first, `heavy_first`).
  * Tq a multiple of 2 * BLOCK_Q and Tk of block_kv avoid a padding copy.

Unsupported (NotImplementedError, so callers fall back to the Triton path): causal,
window, float32 inputs, D other than 64 / 128. Every activation of
kernels.gdpa.reference.ACTIVATIONS runs (gelu through an erf polynomial: Mosaic GPU
has no erf lowering). Shared memory over the 227 KB budget fails at lowering
("exceeds available shared memory").

`interpret=True` (or an InterpretGPUParams) runs the kernels in Mosaic GPU's
interpreter on CPU: warpgroups as threads, TMA copies, mbarriers and wgmma simulated,
exact math (jnp.tanh). Its wgmma takes shared-memory operands only and it cannot
store into a wgmma accumulator, so in interpret mode P and dS go through shared
memory and the softmax forward awaits each step's P V in its step, adding it to a
register accumulator."""

from kernels.mosaic.backward import run_backward
from kernels.mosaic.forward import gdpa_mosaic_forward, run_kernel, softmax_mosaic_forward
from kernels.mosaic.layout import build_layout, row_key_intervals, tile_table
from kernels.mosaic.tuning import (BACKWARD_TUNING, TUNING, MosaicConfig, MosaicOpTuning,
                                   MosaicSpec, MosaicTuning, check_config, mosaic_config)

__all__ = ["BACKWARD_TUNING", "MosaicConfig", "MosaicOpTuning", "MosaicSpec", "MosaicTuning",
           "TUNING", "build_layout",
           "check_config",
           "gdpa_mosaic_forward", "mosaic_config", "row_key_intervals", "run_backward",
           "run_kernel", "softmax_mosaic_forward", "tile_table"]
