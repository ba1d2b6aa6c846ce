"""Jagged attention on Pallas Mosaic GPU (Hopper), GDPA and softmax, forward and
backward: TMA loads, one producer warpgroup, two consumer warpgroups issuing wgmma
(the FlashAttention-3 layout). gdpa(impl="mosaic") and jagged_attention(impl="mosaic")
(both ops' default on a Hopper GPU) run these kernels as jagged_flash's forward
(flash_forward, MosaicFlashForward) and backward (flash_backward, run_backward: dQ,
and dK / dV with keys as the stationary rows; with `fused_dq` one kernel for all
three), the Triton kernels where they do not apply. Timings: kernels/NOTES.md.

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
  * Work item = (CTA tile of 2 * block_q query rows, head). Default launch: grid
    (tile, head), head fastest, one item per CTA. `persistent=True`: num_ctas CTAs
    (default the SM count) take the items round-robin in heaviest-first order; the
    K/V ring and its barrier phases run on across items (slot = the CTA's global
    key step % num_stages), so the producer prefetches the next item's keys while
    the consumers finish the current one; a consumer's output leaves through its Q
    tile (TMA store) and its next Q lands there once the store has read it.
  * A CTA runs 3 warpgroups. Warpgroups 0 and 1 (consumers, 232 registers) own
    block_q = 64 rows each (wgmma's M); warpgroup 2 (producer, 40 registers) streams
    K and V tiles [block_kv, D] with TMA into a ring of `num_stages` shared-memory
    slots (default 128 keys x 2 stages: 32 KB Q + 128 KB K/V at D=128). Each slot has
    a "loaded" mbarrier per operand (TMA completion) and a "free" mbarrier per operand
    that both consumers arrive on; the producer waits on "free" before refilling a
    slot. Each consumer loads its Q tile once (TMA) and writes its output back
    through the same shared-memory tile (TMA store).
  * Softmax: the consumer carries the running row max m and row sum l through its
    loops (online softmax in base 2, exp2) and rescales the output accumulator by
    exp2(m_old - m_new) each step. The accumulator is a wgmma accumulator for the
    whole walk (`deferred_pv`, the default), or carried in registers with P V into
    it as in FA3 (`pv_in_place`, pl.run_state) or into a fresh one added in registers.
  * Per key step, a GDPA consumer: S = Q K^T (wgmma, both operands in shared memory, f32
    accumulator), P = act(S) * scale in registers (silu as h + h tanh(h), h = S/2:
    one tanh.approx through approx_math, no exp and no divide), the mask where the
    step needs it, P cast to the input dtype, acc += P V (wgmma with P from
    registers; `p_via_smem` stages P in shared memory instead). silu / gelu_tanh
    run in the 16-bit input type, two lanes per instruction, with the scale applied
    to the output once (`act_packed`). P V is not awaited in its step: the next
    step's wait for its scores covers it (wgmma groups retire in order) and the V
    slot is released there (`deferred_pv`). With
    `schedule_barrier` the two consumers ping-pong as in FA3: a 2-arrival mbarrier
    passed twice per step, consumer 1 one phase ahead, so one warpgroup's activation
    overlaps the other's matmuls.
  * Jagged ranges, computed in XLA from the offsets (`build_layout`): per query row
    its sample's key interval [start, end) = [kv_offsets[b], kv_offsets[b+1])
    (padding rows, samples without keys: empty). Per consumer tile (64 rows) the key
    tiles [lo, hi) holding a valid pair and the interior [flo, fhi) whose pairs are
    all valid (kernels.jagged_flash.tile_ranges / interior_ranges); per CTA the union
    [c_lo, c_hi) of its consumers' ranges, which the producer streams. Key tile j
    of a CTA starts at key base + j block_kv, base its first valid key rounded down
    to 8 (`anchor`; else 0): a sample's keys then start near a tile's start instead
    of anywhere inside one. A consumer walks [c_lo, c_hi) in five loops: skip
    [c_lo, lo) (wait and release the slots, no math), masked [lo, flo), unmasked
    [flo, fhi), masked [fhi, hi), skip [hi, c_hi): every consumer passes every
    barrier phase, so the per-thread phase bits stay in step. With `narrow_last`
    the forward's last masked tile is a half-width step where the consumer's keys
    end in its first half. The mask is per row: key index in [start, end). CTA
    tiles are launched heaviest-first (longest [c_lo, c_hi) first, `heavy_first`).
  * Tq a multiple of 2 * block_q and Tk of block_kv avoid a padding copy (bench
    capacities are multiples of 128).

Unsupported (NotImplementedError, so callers fall back to the Triton path): causal,
window, float32 inputs, D other than 64 / 128. Every
activation of kernels.gdpa.reference.ACTIVATIONS runs (gelu through an erf
polynomial: Mosaic GPU has no erf lowering).

Tuning knobs (keyword arguments, MosaicConfig): block_q (64 or 128 rows per
consumer), block_kv (64, 128, 192, 256 keys), num_stages (>= 2), schedule_barrier,
heavy_first, interior, consumer_registers, producer_registers, p_via_smem,
persistent, num_ctas, pv_in_place (softmax), pallas_layout (the layout in one Pallas
Triton launch, `pallas_layout`, instead of XLA ops), anchor, narrow_last (forward),
act_packed (gdpa forward), deferred_pv (forward), row_max_ilp (softmax forward);
the backward's dq_block_kv, fused_delta, overlap_dp and fused_dq (MosaicConfig's
comments; FlashConfig.mosaic_fwd / mosaic_bwd pass them through jagged_flash).
Shared memory over the 227 KB budget fails at lowering ("exceeds available shared
memory").

`interpret=True` (or an InterpretGPUParams) runs the kernel in Mosaic GPU's
interpreter on CPU: warpgroups as threads, TMA copies, mbarriers and wgmma simulated,
exact math (jnp.tanh). Its wgmma takes shared-memory operands only, it cannot
run a wgmma into a run_state accumulator nor store into a wgmma accumulator, so
interpret mode forces p_via_smem, pv_in_place=False and, for softmax,
deferred_pv=False; row_max_ilp's inline Mosaic GPU code does not run there either
(jnp.max instead)."""

from kernels.mosaic.backward import run_backward
from kernels.mosaic.forward import gdpa_mosaic_forward, run_kernel, softmax_mosaic_forward
from kernels.mosaic.layout import build_layout, row_key_intervals, tile_table
from kernels.mosaic.tuning import BACKWARD_TUNING, MosaicConfig, check_config, mosaic_config

__all__ = ["BACKWARD_TUNING", "MosaicConfig", "build_layout", "check_config",
           "gdpa_mosaic_forward", "mosaic_config", "row_key_intervals", "run_backward",
           "run_kernel", "softmax_mosaic_forward", "tile_table"]
