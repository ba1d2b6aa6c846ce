"""Jagged attention on Pallas Mosaic GPU (Hopper), GDPA and softmax, forward and
backward: TMA loads, one producer warpgroup, two consumer warpgroups issuing wgmma
(the FlashAttention-3 layout). gdpa(impl="mosaic") and jagged_attention(impl="mosaic")
(both ops' default on a Hopper GPU) run these kernels as jagged_flash's forward
(flash_forward, MosaicFlashForward) and backward (flash_backward, run_backward: dQ,
and dK / dV with keys as the stationary rows; with `fused_dq` one kernel for all
three), the Triton kernels where they do not apply. Timings: docs/kernels.md.

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
(jnp.max instead).
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import triton as plgpu_triton

from kernels.common import check_attention_inputs, segment_layout
from kernels.gdpa.reference import ACTIVATIONS
from kernels.jagged_flash import interior_ranges, tile_ranges

F32 = jnp.float32
LOG2E = math.log2(math.e)
NEG = -1e30              # softmax: the score of a masked pair
BIG = 1 << 30            # start of an empty key interval (padding query rows)
NUM_CONSUMERS = 2        # consumer warpgroups per CTA; the producer is warpgroup 2
# tile, c_lo, c_hi, then (lo, flo, fhi, hn, hi) per consumer, then the streamed tiles'
# first row (tile_table)
WG_COLS = 5
TABLE_COLS = 4 + WG_COLS * NUM_CONSUMERS
BASE_COL = TABLE_COLS - 1


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    mode: str = "gdpa"            # "gdpa" | "softmax" (online, base 2; also returns lse)
    activation: str = "silu"      # gdpa
    scale: float = 1.0            # gdpa: after the activation; softmax: on the scores
    block_q: int = 64             # rows per consumer warpgroup (wgmma M = 64)
    block_kv: int = 128           # keys per pipeline step
    num_stages: int = 2           # K/V shared-memory slots
    schedule_barrier: bool = True  # FA3 ping-pong between the two consumers
    heavy_first: bool = True
    interior: bool = True         # unmasked loop over tiles whose pairs are all valid
    consumer_registers: int = 232
    producer_registers: int = 40
    p_via_smem: bool = False      # P V with P staged in shared memory (forced in interpret mode)
    pv_in_place: bool = True      # softmax: P V into the carried accumulator (FA3's
                                  # run_state form; off: a fresh one added in registers,
                                  # forced in interpret mode, whose wgmma cannot run it)
    pallas_layout: bool = False   # the tile table and row intervals from the offsets in
                                  # one Pallas Triton kernel (pallas_layout) instead of XLA ops
                                  # (its table: no anchor, no narrow steps)
    dq_block_kv: int | None = None  # backward: the dQ kernel's streamed key tile (None:
                                    # block_kv, the dK / dV kernel's streamed query tile)
    fused_delta: bool = False     # softmax backward: delta = rowsum(O dO) in the dQ kernel
                                  # (which writes it for dK / dV) instead of an XLA reduce
    overlap_dp: bool = False      # backward step: dP's wgmma issued right after S's wait,
                                  # what needs S alone (P; dV's wgmma in dK / dV) done
                                  # while it runs, one wait, then dS and its wgmma
    fold_scale: bool = True       # softmax, the scale into FMAs (W1 f+b:
                                  # 0.991-0.995 ms against 0.998-1.000 unfolded in three
                                  # runs; the forward within their noise):
                                  # forward (scale > 0), the row max over the raw scores,
                                  # then exp2(s * scale log2 e - m) as one FMA per score
                                  # instead of a multiply kept for the max and a subtract;
                                  # backward, dS = P (dP scale - delta scale)
    anchor: bool = True           # streamed tiles start at the CTA's first valid column
                                  # (rounded down to 8, the TMA tile rows) instead of at
                                  # multiples of the tile: W1 (64 x 128 tiles) computes
                                  # 1.12x its valid pairs instead of 1.17x
    narrow_last: bool = True      # forward: a consumer's last key tile as a half-width
                                  # step where its rows' keys end in the first half (W1:
                                  # 1.09x the valid pairs with anchor). block_kv 128 or
                                  # 256 only (P V's wgmma K is a multiple of 64 here);
                                  # the backward kernels run full-width steps
    act_packed: bool = True       # gdpa forward, silu / gelu_tanh: the activation in the
                                  # inputs' 16-bit type, two lanes per instruction
                                  # (tanh.approx.bf16x2), the scale applied to the output
                                  # once; P is rounded to 16 bits for its wgmma anyway (W1
                                  # silu, 4 interleaved rounds: fwd 0.227 ms
                                  # against 0.231, 0.215 against 0.224 with deferred_pv;
                                  # other modes and activations: ignored)
    deferred_pv: bool = True      # forward: a step's P V wgmma is not awaited in its
                                  # step; the next step's score wait covers it (wgmma
                                  # groups retire in order) and releases its V slot
                                  # there, so a consumer issues its next Q K^T without
                                  # idling on P V (softmax: the accumulator lives in a
                                  # wgmma accumulator for the whole walk, rescaled in
                                  # it; pv_in_place then does not apply). W1, 4
                                  # interleaved rounds: GDPA fwd 0.224 ms
                                  # against 0.231, softmax 0.256 against 0.263-0.270.
                                  # The same deferral in the backward kernels (dS K;
                                  # P^T dO, dS^T Q) was slower for softmax (W1 f+b
                                  # 1.098 ms against 1.007) and a tie for GDPA: not kept
    fused_dq: bool = False        # backward: one kernel. The dK / dV kernel also forms dQ:
                                  # per step both consumers share dS^T through shared
                                  # memory, consumer w multiplies it by K for dQ's
                                  # columns [w D/2, (w+1) D/2) (D = 64: the consumers
                                  # take alternate steps) and reduce-adds that float32
                                  # partial into a zeroed dQ buffer (TMA .add): 5 products
                                  # instead of 7, dQ's summation order not fixed.
                                  # Softmax's delta then comes from an XLA reduce
                                  # (fused_delta does not apply). Its gpu tests pass
                                  # on the H200. W1 f+b, 4 interleaved rounds: GDPA
                                  # 0.942 ms against 0.993 (4 of 4 faster), softmax
                                  # 1.049 against 1.004 (CUPTI: the fused kernel 0.664
                                  # ms against 0.285 + 0.375, plus the delta reduce,
                                  # the zeroed buffer and the cast, 0.088). Off: the
                                  # softmax loss, and a run-to-run varying dQ
    row_max_ilp: int = 0          # softmax forward: the row max of each score tile with
                                  # this many independent max chains per thread
                                  # (FragmentedArray.reduce's acc_ilp, through
                                  # plgpu.inline_mgpu); 0: jnp.max, whose lowering runs
                                  # one dependent chain of max.NaN per row (acc_ilp 4: 32
                                  # in a row at 128-key tiles) on the path from S's wait
                                  # to P V. W1, 4 interleaved rounds (two
                                  # calls): fwd 0.250 / 0.256 ms against 0.255 / 0.259
                                  # (3 of 4 rounds faster in each), f+b a tie; off, as
                                  # that does not move a target. The interpreter runs
                                  # jnp.max
    persistent: bool = False      # grid of num_ctas CTAs looping over the work items
    num_ctas: int | None = None   # persistent grid size (None: the GPU's SM count)

    @property
    def cta_rows(self):
        return NUM_CONSUMERS * self.block_q

    @property
    def packed_act(self):
        """Whether the forward forms act(S) in 16 bits (act_packed where it applies)."""
        return self.act_packed and self.mode == "gdpa" and self.activation in ("silu",
                                                                               "gelu_tanh")

    @property
    def narrow(self):
        """Whether the forward takes narrow last steps (narrow_last where it applies)."""
        return self.narrow_last and self.block_kv % 128 == 0


def check_config(cfg, d, dtype):
    """NotImplementedError (callers fall back) for what the kernel does not take."""
    if cfg.mode not in ("gdpa", "softmax"):
        raise ValueError(f"gdpa_mosaic: mode must be gdpa or softmax, got {cfg.mode!r}")
    if cfg.activation not in ACTIVATIONS:
        raise ValueError(f"gdpa_mosaic: activation must be one of {sorted(ACTIVATIONS)}, "
                         f"got {cfg.activation!r}")
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise NotImplementedError(f"gdpa_mosaic: only bf16 / f16 inputs, got {jnp.dtype(dtype)}")
    if d not in (64, 128):
        raise NotImplementedError(f"gdpa_mosaic: head dim D={d} must be 64 or 128")
    if cfg.block_q not in (64, 128):
        raise NotImplementedError(f"gdpa_mosaic: block_q={cfg.block_q} must be 64 or 128")
    for name in ("block_kv", "dq_block_kv"):
        if getattr(cfg, name) not in (64, 128, 192, 256) + ((None,) if name[0] == "d" else ()):
            raise NotImplementedError(f"gdpa_mosaic: {name}={getattr(cfg, name)} must be 64, "
                                      "128, 192 or 256")
    if cfg.num_stages < 2:
        raise NotImplementedError(f"gdpa_mosaic: num_stages={cfg.num_stages} must be >= 2")
    regs = (cfg.consumer_registers, cfg.producer_registers)
    if any(r % 8 or not 24 <= r <= 256 for r in regs) or (
            NUM_CONSUMERS * regs[0] + regs[1]) * 128 > 65536:
        raise NotImplementedError(f"gdpa_mosaic: registers {regs} must be multiples of 8 in "
                                  "[24, 256] and fit 64K per SM")
    if not 0 <= cfg.row_max_ilp <= 64:
        raise ValueError(f"gdpa_mosaic: row_max_ilp={cfg.row_max_ilp} must be in [0, 64] "
                         "(0: jnp.max)")


# ----------------------------------------------------------------- layout (XLA side)

def row_key_intervals(q_offsets, kv_offsets, tq):
    """Per query row the valid key interval [start, end) (its sample's keys); padding
    rows and rows of samples without keys get an empty interval (BIG, 0)."""
    b = q_offsets.shape[0] - 1
    seg, _ = segment_layout(q_offsets, tq)
    s = jnp.clip(seg, 0, b - 1)
    start = jnp.take(kv_offsets, s)
    end = jnp.take(kv_offsets, s + 1)
    ok = (seg < b) & (start < end)
    return jnp.where(ok, start, BIG).astype(jnp.int32), jnp.where(ok, end, 0).astype(jnp.int32)


def tile_table(cfg, start, end, n_cols=None):
    """[n_cta, TABLE_COLS] int32, one row per CTA in launch order.

    Columns: query CTA tile index, [c_lo, c_hi) key tiles the producer streams, then
    per consumer w (rows tile*cta_rows + w*block_q ...) its key tiles [lo, hi),
    interior [flo, fhi) and narrow tiles [hn, hi), with c_lo <= lo <= flo <= fhi <=
    hn <= hi <= c_hi (an empty consumer range is collapsed onto c_lo). hn = hi - 1
    where cfg.narrow and the consumer's rows have no key past the first half of
    their last tile (else hn = hi). Then `base`: key tile j covers keys
    [base + j block_kv, base + (j + 1) block_kv). base is 0 unless cfg.anchor; then it
    is the CTA's first valid key rounded down to 8, lowered where needed so that its
    last tile ends by n_cols (the streamed array's rows, a multiple of block_kv:
    no tile reads past it).
    """
    bq, bk = cfg.block_q, cfg.block_kv
    n = start.shape[0] // cfg.cta_rows
    base = jnp.zeros((n,), jnp.int32)
    if cfg.anchor:
        if n_cols is None or n_cols % bk:
            raise ValueError(f"tile_table: anchor needs n_cols, a multiple of {bk}, got {n_cols}")
        s_min = start.reshape(n, cfg.cta_rows).min(axis=1)
        e_max = end.reshape(n, cfg.cta_rows).max(axis=1)
        first = s_min // 8 * 8
        steps = (e_max - first + bk - 1) // bk
        base = jnp.where(e_max > s_min, jnp.clip(jnp.minimum(first, n_cols - steps * bk), 0),
                         0).astype(jnp.int32)
        shift = jnp.repeat(base, cfg.cta_rows, total_repeat_length=start.shape[0])
        start, end = start - shift, end - shift
    lo, hi = tile_ranges(start, end, bq, bk)                    # [n_wg]
    flo, fhi = interior_ranges(start, end, bq, bk, lo, hi)
    if not cfg.interior:
        flo = fhi = hi
    hn = hi
    if cfg.narrow:
        e_max = end.reshape(-1, bq).max(axis=1)
        hn = jnp.where((hi > lo) & (e_max - (hi - 1) * bk <= bk // 2), hi - 1, hi)
        flo, fhi = jnp.minimum(flo, hn), jnp.minimum(fhi, hn)
    lo, hi, flo, fhi, hn = (x.reshape(n, NUM_CONSUMERS) for x in (lo, hi, flo, fhi, hn))
    empty = hi <= lo
    c_lo = jnp.min(jnp.where(empty, BIG, lo), axis=1)
    c_hi = jnp.max(jnp.where(empty, 0, hi), axis=1)
    cta_empty = c_hi <= c_lo
    c_lo = jnp.where(cta_empty, 0, c_lo)
    c_hi = jnp.where(cta_empty, 0, c_hi)
    collapse = lambda x: jnp.where(empty, c_lo[:, None], x)
    lo, flo, fhi, hn, hi = (collapse(x) for x in (lo, flo, fhi, hn, hi))
    per_wg = jnp.stack([lo, flo, fhi, hn, hi], axis=2).reshape(n, WG_COLS * NUM_CONSUMERS)
    tile = jnp.arange(n, dtype=jnp.int32)
    table = jnp.concatenate([tile[:, None], c_lo[:, None], c_hi[:, None], per_wg,
                             base[:, None]], axis=1)
    if cfg.heavy_first:
        table = table[jnp.argsort(c_lo - c_hi, stable=True)]
    return table.astype(jnp.int32)


# -------------------------------------------------------------------- kernel pieces

# Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7): Mosaic GPU has no erf lowering.
_ERF_P = 0.3275911
_ERF_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)


def _erf(x):
    a = jnp.abs(x)
    t = 1.0 / (1.0 + _ERF_P * a)
    poly = _ERF_A[4]
    for c in _ERF_A[3::-1]:
        poly = poly * t + c
    y = 1.0 - poly * t * jnp.exp(-(a * a))
    return jnp.where(x >= 0.0, y, -y)


def activation_times_scale(s, activation, scale):
    """act(s) * scale in s's type, written with ops Mosaic GPU lowers (tanh is one
    tanh.approx with approx_math; silu needs no exp and no divide). The Python-float
    constants keep s's type: for 16-bit s (act_packed) the multiplies and tanh run
    two lanes per instruction."""
    if activation == "silu":       # s * sigmoid(s) = h + h tanh(h), h = s / 2
        t = jnp.tanh(s * 0.5)
        hs = s * (0.5 * scale)
        return hs + hs * t
    if activation == "gelu_tanh":
        c = math.sqrt(2.0 / math.pi)
        t = jnp.tanh(s * (c + (c * 0.044715) * (s * s)))
        hs = s * (0.5 * scale)
        return hs + hs * t
    if activation == "gelu":
        hs = s * (0.5 * scale)
        return hs + hs * _erf(s * (1.0 / math.sqrt(2.0)))
    if activation == "relu":
        return jnp.maximum(s, 0.0) * scale
    if activation == "identity":
        return s * scale
    raise ValueError(f"unknown activation {activation!r}")


def activation_grad_times_scale(s, activation, scale):
    """d act(s) / ds * scale in float32, in ops Mosaic GPU lowers (the backward's dS)."""
    zero = s * 0.0
    if activation == "silu":       # sig (1 + s (1 - sig)), sig = 1/2 + tanh(s/2)/2
        sig = 0.5 + 0.5 * jnp.tanh(s * 0.5)
        return sig * (1.0 + s * (1.0 - sig)) * scale
    if activation == "gelu_tanh":
        c = math.sqrt(2.0 / math.pi)
        t = jnp.tanh(s * (c + (c * 0.044715) * (s * s)))
        du = c + (3.0 * c * 0.044715) * (s * s)
        return (0.5 * (1.0 + t) + (0.5 * s) * (1.0 - t * t) * du) * scale
    if activation == "gelu":       # Phi(s) + s phi(s)
        phi = jnp.exp(s * s * -0.5) * (1.0 / math.sqrt(2.0 * math.pi))
        return (0.5 + 0.5 * _erf(s * (1.0 / math.sqrt(2.0))) + s * phi) * scale
    if activation == "relu":
        return jnp.where(s > 0.0, zero + scale, zero)
    if activation == "identity":
        return zero + scale
    raise ValueError(f"unknown activation {activation!r}")


def _items(cfg, n_tiles, n_heads):
    """This CTA's work items as (count, item(i) -> (table row, head)).

    A work item is one (CTA tile, head); items are numbered t = row * H + head in table
    (heaviest-first) order. Non-persistent: one item per CTA (grid (tile, head)).
    Persistent: grid (G = num_ctas,), round r hands items [r G, (r + 1) G) to the CTAs
    in snake order (c, then G - 1 - c on odd rounds), so no CTA gets the heaviest item
    of every round (W1 estimate: makespan 12% over the mean load, round-robin 18%).
    """
    if not cfg.persistent:
        row, head = lax.axis_index("tile"), lax.axis_index("head")
        return 1, lambda i: (row, head)
    c = lax.axis_index("cta")
    g = cfg.num_ctas
    full, rem = divmod(n_tiles * n_heads, g)
    last = c if full % 2 == 0 else g - 1 - c          # position in the partial round
    count = full + (last < rem).astype(jnp.int32)

    def item(i):
        t = i * g + jnp.where(lax.rem(i, 2) == 0, c, g - 1 - c)
        return lax.div(t, jnp.int32(n_heads)), lax.rem(t, jnp.int32(n_heads))
    return count, item


def _for_items(count, item, body):
    """carry = body(row, head, carry) over the items, from carry 0 (the global key step)."""
    if isinstance(count, int) and count == 1:
        return body(*item(0), jnp.int32(0))
    return pl.loop(0, count, init_carry=jnp.int32(0))(lambda i, g0: body(*item(i), g0))


def _kernel(table_ref, start_ref, end_ref, q_ref, k_ref, v_ref, *refs, cfg, n_tiles, n_heads):
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
    count, item = _items(cfg, n_tiles, n_heads)

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
            c_lo, c_hi, ranges, row0, base = _item_tiles(table_ref, row, wg, cfg)
            rows = pl.ds(row0, bq)
            wait = _load_stationary(((q_ref.at[rows, head], q_smem),), q_bar, wg)
            start = plgpu.load(start_ref.at[rows], layout=row_layout, optimized=False)
            end = plgpu.load(end_ref.at[rows], layout=row_layout, optimized=False)
            wait()

            deferred = cfg.deferred_pv
            in_ref = deferred or not softmax   # the accumulator: a wgmma ref for the walk

            def step(j, kind, carry, acc_ref=None):
                """One key step; the accumulator is acc_ref (gdpa; softmax with
                deferred_pv) or carried (softmax: (acc, m, l)); softmax carries (m, l)
                and deferred_pv the slot whose P V is still in flight (-1: none) last.
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
                valid = None if kind == "plain" else _tile_mask(start, end, base + j * bk, bq, w)

                def pv(acc_ref, p16, slot):   # P from registers (FA3), or staged
                    stage = None if p_smem is None else (
                        p_smem.at[wg] if w == bk else p_smem.at[wg, :, pl.ds(0, w)])
                    mma_from(acc_ref, p16, stage, keys(v_smem.at[slot]))
                if softmax:   # online softmax in base 2 (the Triton kernels' lse convention)
                    acc, m, l = (None, *carry[:2]) if in_ref else carry
                    c = cfg.scale * LOG2E
                    fold = cfg.fold_scale and c > 0   # max(s) c = max(s c) for c > 0
                    if not fold:
                        s = s * c
                    if valid is not None:
                        s = jnp.where(valid, s, NEG)
                    if fold:    # m in scaled units; s c - m contracts to one FMA
                        m_new = jnp.maximum(m, _row_max(s, cfg.row_max_ilp) * c)
                        pr = jnp.exp2(s * c - lax.broadcast_in_dim(m_new, (bq, w), [0]))
                    else:
                        m_new = jnp.maximum(m, _row_max(s, cfg.row_max_ilp))
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
                elif cfg.pv_in_place:   # FA3: the carried accumulator is wgmma's
                    acc = pl.run_state(lambda r: pv(r, p16, slot))(plgpu.ACC.init(acc))
                else:                   # a fresh accumulator added in registers
                    def fresh(r):
                        pv(r, p16, slot)
                        return r[...]
                    acc = acc + pl.run_scoped(fresh, plgpu.ACC((bq, d), F32))
                plgpu.wgmma_wait(0)               # V's slot is read: release it
                plgpu.barrier_arrive(v_free.at[slot])
                return (acc, m_new, l) if softmax else carry

            ranges = _walk_ranges(c_lo, c_hi, ranges, cfg.narrow)
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
                out = _run_walk(ranges, functools.partial(step, acc_ref=acc_ref), carry,
                                release)
                return acc_ref[...], out
            if in_ref:
                acc, carry = pl.run_scoped(walk, plgpu.ACC((bq, d), F32))   # zero-initialised
            else:
                acc, *carry = _run_walk(ranges, step, carry)
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
        _for_items(count, item, one_item)
        pl.when(wg == 0)(sched)
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == NUM_CONSUMERS)
    def _producer():
        plgpu.set_max_registers(cfg.producer_registers, action="decrease")
        _produce(table_ref, k_ref, v_ref, k_smem, v_smem, k_bar, v_bar, k_free, v_free,
                 tile=bk, stages=stages, count=count, item=item)


def _produce(table_ref, a_ref, b_ref, a_smem, b_smem, a_bar, b_bar, a_free, b_free, *, tile,
             stages, count, item):
    """The producer warpgroup: per work item, tiles [c_lo, c_hi) of a_ref and b_ref
    ([T, H, D], `tile` rows each) into the slot ring, slot = global step % stages."""
    def one_item(row, head, g0):
        c_lo = table_ref[row, 1]
        c_hi = table_ref[row, 2]
        base = pl.multiple_of(table_ref[row, BASE_COL], 8)   # TMA tile rows: see tile_table

        @pl.loop(c_lo, c_hi)
        def _(j):
            g = g0 + j - c_lo
            slot = lax.rem(g, jnp.int32(stages))
            rows = pl.ds(base + j * tile, tile)
            # step g - stages used this slot: wait until both consumers released it
            pl.when(g >= stages)(lambda: plgpu.barrier_wait(a_free.at[slot]))
            plgpu.copy_gmem_to_smem(a_ref.at[rows, head], a_smem.at[slot], a_bar.at[slot])
            pl.when(g >= stages)(lambda: plgpu.barrier_wait(b_free.at[slot]))
            plgpu.copy_gmem_to_smem(b_ref.at[rows, head], b_smem.at[slot], b_bar.at[slot])
        return g0 + (c_hi - c_lo)

    total = _for_items(count, item, one_item)

    # Observe the last releases too: harmless on the GPU, and the interpreter wants
    # every phase of a barrier a thread waits on to be seen by that thread.
    @pl.loop(jnp.maximum(total - stages, 0), total)
    def _drain(g):
        plgpu.barrier_wait(a_free.at[lax.rem(g, jnp.int32(stages))])
        plgpu.barrier_wait(b_free.at[lax.rem(g, jnp.int32(stages))])


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
    """dS of one tile from s, its P (_grad_p) and dP: softmax P (dP - delta) scale
    (P's masked zeros carry over), gdpa dP act'(s) scale, masked pairs 0."""
    if cfg.mode == "softmax":
        return _ds_apply(cfg, p, dp, delta, transposed)
    ds = dp * activation_grad_times_scale(s, cfg.activation, cfg.scale)
    return ds if valid is None else jnp.where(valid, ds, 0.0)


def _ds_factor(cfg, s, p, valid):
    """What dS takes from S alone: softmax P (masked), gdpa act'(s) scale (masked 0)."""
    if cfg.mode == "softmax":
        return p
    f = activation_grad_times_scale(s, cfg.activation, cfg.scale)
    return f if valid is None else jnp.where(valid, f, 0.0)


def _ds_apply(cfg, factor, dp, delta, transposed):
    """dS from _ds_factor's factor and dP: softmax factor (dP - delta) scale, gdpa dP factor.
    With cfg.fold_scale: factor (dP scale - delta scale), delta scaled once per row and
    dP scale - that one FMA per score."""
    if cfg.mode == "softmax" and cfg.fold_scale:
        return factor * (dp * cfg.scale - _along_queries(delta * cfg.scale, dp.shape, transposed))
    if cfg.mode == "softmax":
        return factor * (dp - _along_queries(delta, dp.shape, transposed)) * cfg.scale
    return dp * factor


def _along_queries(x, shape, transposed):
    return lax.broadcast_in_dim(x, shape, [1 if transposed else 0])


def _grad_tiles(cfg, s, dp, stat, delta, valid, transposed):
    """(P, dS) of one tile (_grad_p, _grad_ds)."""
    p = _grad_p(cfg, s, stat, valid, transposed)
    return p, _grad_ds(cfg, s, p, dp, delta, valid, transposed)


def _item_tiles(table_ref, row, wg, cfg):
    """Consumer wg's part of CTA table row `row`: (c_lo, c_hi, (lo, flo, fhi, hn, hi),
    row0, base), row0 its first stationary row, base the first streamed row of tile 0."""
    ranges = tuple(table_ref[row, 3 + WG_COLS * wg + c] for c in range(WG_COLS))
    return (table_ref[row, 1], table_ref[row, 2], ranges,
            table_ref[row, 0] * cfg.cta_rows + wg * cfg.block_q,
            pl.multiple_of(table_ref[row, BASE_COL], 8))


def _load_stationary(copies, bar, wg):
    """TMA each (gmem, smem) of `copies` on its own barrier (bar.at[i * NUM_CONSUMERS + wg]:
    a copy arrives once) after the last output store has left shared memory; returns the
    wait for all of them."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    for i, (src, dst) in enumerate(copies):
        plgpu.copy_gmem_to_smem(src, dst, bar.at[i * NUM_CONSUMERS + wg])

    def wait():
        for i in range(len(copies)):
            plgpu.barrier_wait(bar.at[i * NUM_CONSUMERS + wg])
    return wait


def _walk_ranges(c_lo, c_hi, ranges, narrow):
    """A consumer's loops over its CTA's tiles [c_lo, c_hi) (module docstring), ranges =
    (lo, flo, fhi, hn, hi) from _item_tiles: (first, last, kind) with kind "skip"
    (barriers only), "masked", "plain" or, where `narrow` (cfg.narrow in the forward;
    else hn = hi), "narrow" (masked, the tile's first half only)."""
    lo, flo, fhi, hn, hi = ranges
    last = ((fhi, hn, "masked"), (hn, hi, "narrow")) if narrow else ((fhi, hi, "masked"),)
    return ((c_lo, lo, "skip"), (lo, flo, "masked"), (flo, fhi, "plain"), *last,
            (hi, c_hi, "skip"))


def _run_walk(spans, step, carry, release=None):
    """carry = step(j, kind, carry) over the spans of _walk_ranges (carry None: no carry).
    With `release` (deferred wgmma waits) carry[-1] is the slot whose last wgmmas are
    still in flight (-1: none); after the last compute span they are awaited and
    release(slot) frees the slot, before the trailing skip steps wait on later slots
    (the producer refills that slot only once it is free)."""
    def loop(span, carry):
        a, b, kind = span
        body = functools.partial(lambda j, c, kind: step(j, kind, c), kind=kind)
        if carry is None:
            pl.loop(a, b)(functools.partial(body, c=None))
            return None
        return pl.loop(a, b, init_carry=carry)(body)
    for span in spans[:-1]:
        carry = loop(span, carry)
    if release is not None:
        plgpu.wgmma_wait(0)
        pend = carry[-1]
        pl.when(pend >= 0)(lambda: release(pend))
    return loop(spans[-1], carry)


def _row_max(s, ilp):
    """max(s, axis=1) of a float32 [rows, cols] tile in the wgmma layout; ilp > 0: with
    that many independent max chains per thread (acc_ilp), combined pairwise after."""
    if not ilp:
        return jnp.max(s, axis=1)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,),
                       return_type=plgpu.ShapeDtypeStruct((s.shape[0],), s.dtype,
                                                          layout=plgpu.Layout.WGMMA.reduce(1)))
    def row_max(_, x):
        return x.reduce("max", 1, acc_ilp=ilp)
    return row_max(s)


def _scores_nt(a_smem, b_smem, rows, cols):
    """a_smem [rows, D] @ b_smem [cols, D]^T as a float32 register tile (wgmma, waited)."""
    def f(acc_ref):
        plgpu.wgmma(acc_ref, a_smem, b_smem.transpose((1, 0)))
        return acc_ref[...]
    return pl.run_scoped(f, plgpu.ACC((rows, cols), F32))


def _tile_mask(start, end, col0, rows, cols):
    """valid [rows, cols]: column col0 + c lies in its row's [start, end)."""
    col = plgpu.broadcasted_iota(jnp.int32, (rows, cols), 1, layout=plgpu.Layout.WGMMA)
    a = lax.broadcast_in_dim(start - col0, (rows, cols), [0])
    b = lax.broadcast_in_dim(end - col0, (rows, cols), [0])
    return (col >= a) & (col < b)


def mma_from(acc_ref, x16, stage, b_smem):
    """acc += x16 @ b_smem with x16 from registers, or staged in shared memory (stage)."""
    if stage is None:
        plgpu.wgmma(acc_ref, x16, b_smem)
    else:
        stage[...] = x16
        plgpu.commit_smem()
        plgpu.wgmma(acc_ref, stage, b_smem)


def _backward_roles(cfg, n_tiles, n_heads, make_item, stream):
    """The backward kernels' warpgroups: each consumer wg runs make_item(wg) (its
    one_item(row, head, g0) -> g0') over this CTA's items and waits for its stores; the
    producer streams `stream` (_produce's table, two gmem refs, their rings, loaded and
    free barriers)."""
    wg = lax.axis_index("wg")
    count, item = _items(cfg, n_tiles, n_heads)

    @pl.when(wg < NUM_CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(cfg.consumer_registers, action="increase")
        _for_items(count, item, make_item(wg))
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == NUM_CONSUMERS)
    def _producer():
        plgpu.set_max_registers(cfg.producer_registers, action="decrease")
        _produce(*stream, tile=cfg.block_kv, stages=cfg.num_stages, count=count, item=item)


def _dq_kernel(table_ref, start_ref, end_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
               *refs, cfg, n_tiles, n_heads):
    """dQ = dS K over each query tile's key tiles (K / V streamed as in the forward).

    With cfg.fused_delta (softmax): delta_ref is the forward's output O [Tq, H, D]; each
    consumer loads its rows of O beside Q and dO, computes delta = rowsum(O * dO) there
    and writes it out [H, Tq] float32 for the dK / dV kernel."""
    fused = cfg.fused_delta and cfg.mode == "softmax"
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
            c_lo, c_hi, ranges, row0, base = _item_tiles(table_ref, row, wg, cfg)
            rows = pl.ds(row0, bq)
            copies = [(q_ref.at[rows, head], qs), (do_ref.at[rows, head], dos)]
            if fused:
                copies.append((delta_ref.at[rows, head], o_smem.at[wg]))
            wait = _load_stationary(copies, q_bar, wg)
            load = lambda ref: plgpu.load(ref, layout=row_layout, optimized=False)  # noqa: E731
            start, end = load(start_ref.at[rows]), load(end_ref.at[rows])
            lse = delta = None
            if cfg.mode == "softmax":
                lse = load(lse_ref.at[head, rows])
                if not fused:
                    delta = load(delta_ref.at[head, rows])
            wait()
            if fused:   # delta = rowsum(O dO) in float32, as jagged_flash.softmax_delta
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
                if kind != "skip" and cfg.overlap_dp:
                    s = _scores_nt(qs, k_smem.at[slot], bq, bk)       # Q K^T
                    valid = (_tile_mask(start, end, base + j * bk, bq, bk) if kind == "masked"
                             else None)

                    def overlapped(dp_ref):
                        plgpu.wgmma(dp_ref, dos, v_smem.at[slot].transpose((1, 0)))  # dO V^T
                        p = _grad_p(cfg, s, lse, valid, False) if cfg.mode == "softmax" else None
                        return _ds_factor(cfg, s, p, valid), dp_ref[...]   # factor: while dP runs
                    factor, dp = pl.run_scoped(overlapped, plgpu.ACC((bq, bk), F32))
                    ds = _ds_apply(cfg, factor, dp, delta, False)
                    mma_from(acc_ref, ds.astype(dtype), stage, k_smem.at[slot])   # dS K
                elif kind != "skip":
                    s = _scores_nt(qs, k_smem.at[slot], bq, bk)       # Q K^T
                    dp = _scores_nt(dos, v_smem.at[slot], bq, bk)     # dO V^T
                    valid = (_tile_mask(start, end, base + j * bk, bq, bk) if kind == "masked"
                             else None)
                    _, ds = _grad_tiles(cfg, s, dp, lse, delta, valid, False)
                    mma_from(acc_ref, ds.astype(dtype), stage, k_smem.at[slot])   # dS K
                if kind != "skip":
                    plgpu.wgmma_wait(0)
                plgpu.barrier_arrive(k_free.at[slot])
                plgpu.barrier_arrive(v_free.at[slot])

            def walk(acc_ref):
                _run_walk(_walk_ranges(c_lo, c_hi, ranges, False),
                          functools.partial(step, acc_ref=acc_ref), None)
                return acc_ref[...]

            acc = pl.run_scoped(walk, plgpu.ACC((bq, d), F32))
            qs[...] = acc.astype(dtype)        # Q's tile is free: stage dQ there
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(qs, dq_ref.at[rows, head])
            return g0 + (c_hi - c_lo)
        return one_item

    _backward_roles(cfg, n_tiles, n_heads, make_item,
                    (table_ref, k_ref, v_ref, k_smem, v_smem, k_bar, v_bar, k_free, v_free))


def _fused_dq_cols(d):
    """fused_dq: dQ columns per consumer and step, D / 2 where that is whole 64-column
    shared-memory tiles (D = 128); else D (D = 64: the consumers take alternate steps)."""
    half = d // NUM_CONSUMERS
    return half if half % 64 == 0 else d


def _dkv_kernel(table_ref, start_ref, end_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
                *refs, cfg, n_tiles, n_heads):
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
            c_lo, c_hi, ranges, row0, base = _item_tiles(table_ref, row, wg, cfg)
            rows = pl.ds(row0, bq)
            wait = _load_stationary(((k_ref.at[rows, head], ks), (v_ref.at[rows, head], vs)),
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
                if kind != "skip" and cfg.overlap_dp:
                    st = _scores_nt(ks, q_smem.at[slot], bq, bk)      # (Q K^T)^T
                    valid = (_tile_mask(start, end, base + j * bk, bq, bk) if kind == "masked"
                             else None)

                    def overlapped(dpt_ref):
                        plgpu.wgmma(dpt_ref, vs, do_smem.at[slot].transpose((1, 0)))  # dP^T
                        pt = _grad_p(cfg, st, lse, valid, True)       # while dP^T runs
                        mma_from(dv_ref_acc, pt.astype(dtype), p_stage, do_smem.at[slot])
                        return pt, dpt_ref[...]                       # waits for both
                    pt, dpt = pl.run_scoped(overlapped, plgpu.ACC((bq, bk), F32))
                    dst = _grad_ds(cfg, st, pt, dpt, delta, valid, True)
                    mma_from(dk_ref_acc, dst.astype(dtype), ds_stage, q_smem.at[slot])  # dS^T Q
                elif kind != "skip":
                    st = _scores_nt(ks, q_smem.at[slot], bq, bk)      # (Q K^T)^T
                    dpt = _scores_nt(vs, do_smem.at[slot], bq, bk)    # (dO V^T)^T
                    valid = (_tile_mask(start, end, base + j * bk, bq, bk) if kind == "masked"
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
                _run_walk(_walk_ranges(c_lo, c_hi, ranges, False),
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

    _backward_roles(cfg, n_tiles, n_heads, make_item,
                    (table_ref, q_ref, do_ref, q_smem, do_smem, q_bar, do_bar, q_free, do_free))


def run_backward(cfg, lay, q, k, v, do, lse, delta, interpret=False, o=None):
    """(dQ, dK, dV) of the forward `cfg` ran: lay from kernels.jagged_flash.build_layout
    (q_start / q_end, k_start / k_end), lse / delta [H, Tq] float32 (softmax; any
    [H, Tq] for gdpa, unread). Tq, Tk multiples of cfg.cta_rows and of both streamed
    tiles (cfg.block_kv for dK / dV, cfg.dq_block_kv for dQ). cfg.fused_delta
    (softmax): delta is not read (None is fine) but computed in the dQ kernel from o,
    the forward's output [Tq, H, D]."""
    tq, h, d = q.shape
    tk = k.shape[0]
    if cfg.persistent:
        raise NotImplementedError("mosaic backward: persistent CTAs are forward-only")
    dq_cfg = dataclasses.replace(cfg, block_kv=cfg.dq_block_kv or cfg.block_kv)
    for t in {cfg.cta_rows, cfg.block_kv, dq_cfg.block_kv}:
        if tq % t or tk % t:
            raise ValueError(f"mosaic backward: Tq={tq} / Tk={tk} must be multiples of "
                             f"{cfg.cta_rows}, {cfg.block_kv} and {dq_cfg.block_kv}")
    bq, stages = cfg.block_q, cfg.num_stages
    stage_p = interpret or cfg.p_via_smem
    transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    smem = lambda *shape: plgpu.SMEM(shape, q.dtype, transforms=transforms)  # noqa: E731
    params = plgpu.CompilerParams(approx_math=True)
    interp = (plgpu.InterpretGPUParams() if interpret is True else interpret) or None

    def launch(kernel, kcfg, start, end, n_cols, outs, staged, extra=(), loads=2,
               delta_in=None, more_in=(), tail=()):
        """kernel over kcfg's tile table of rows [start, end): scratch = two stationary
        [NC, block_q, D] tiles and `extra` (`loads` stationary tiles in all, each with
        its barriers, then any other scratch), the ring of two streamed [stages, kcfg.block_kv, D]
        tiles, `staged` P / dS staging tiles (interpret mode, p_via_smem), the
        stationary loads' barriers, the ring's loaded / free barriers, then `tail`;
        `more_in`: operands after delta (refs the kernel writes into)."""
        table, bk = tile_table(kcfg, start, end, n_cols), kcfg.block_kv
        ring = [smem(stages, bk, d), smem(stages, bk, d)]
        bars = ([plgpu.Barrier(num_barriers=stages)] * 2
                + [plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=stages)] * 2)
        stationary = [smem(NUM_CONSUMERS, bq, d), smem(NUM_CONSUMERS, bq, d), *extra]
        stage = [smem(NUM_CONSUMERS, bq, bk) if stage_p else None] * staged
        return plgpu.kernel(
            functools.partial(kernel, cfg=kcfg, n_tiles=table.shape[0], n_heads=h),
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

    if cfg.fused_delta and cfg.mode == "softmax":
        if o is None:
            raise ValueError("mosaic backward: fused_delta needs the forward's output o")
        dq, delta = launch(_dq_kernel, dq_cfg, lay["q_start"], lay["q_end"], tk,
                           (jax.ShapeDtypeStruct(q.shape, q.dtype),
                            jax.ShapeDtypeStruct((h, tq), F32)), 1,
                           extra=[smem(NUM_CONSUMERS, bq, d),
                                  plgpu.SMEM((NUM_CONSUMERS, bq), F32)], loads=3, delta_in=o)
    else:
        dq = launch(_dq_kernel, dq_cfg, lay["q_start"], lay["q_end"], tk,
                    jax.ShapeDtypeStruct(q.shape, q.dtype), 1)
    dk, dv = launch(_dkv_kernel, cfg, lay["k_start"], lay["k_end"], tq,
                    (jax.ShapeDtypeStruct(k.shape, k.dtype),) * 2, 2)
    return dq, dk, dv


def run_kernel(cfg, layout, q, k, v, interpret=False):
    """The pallas kernel alone: layout = build_layout(...), q [Tq,H,D] with Tq a multiple
    of cfg.cta_rows, k / v [Tk,H,D] with Tk a multiple of cfg.block_kv -> [Tq,H,D]."""
    table, start, end = layout
    tq, h, d = q.shape
    bq, bk, stages = cfg.block_q, cfg.block_kv, cfg.num_stages
    if tq % cfg.cta_rows or k.shape[0] % bk:
        raise ValueError(f"gdpa_mosaic: Tq={tq} / Tk={k.shape[0]} must be multiples of "
                         f"{cfg.cta_rows} / {bk}")
    if interpret:   # the interpreter's wgmma takes shared-memory operands only, and it
        # cannot store into a wgmma accumulator (softmax's deferred_pv rescales in one)
        cfg = dataclasses.replace(cfg, p_via_smem=True, pv_in_place=False, deferred_pv=(
            cfg.deferred_pv and cfg.mode != "softmax"), row_max_ilp=0)
    n_tiles = table.shape[0]
    softmax = cfg.mode == "softmax"
    if cfg.persistent:
        g = cfg.num_ctas or getattr(jax.local_devices()[0], "core_count", None) or 132
        cfg = dataclasses.replace(cfg, num_ctas=max(1, min(int(g), n_tiles * h)))
        grid, names = (cfg.num_ctas,), ("cta",)
    else:
        grid, names = (n_tiles, h), ("tile", "head")   # last axis fastest: heads together
    # 16-bit rows of 64 / 128 / 256 elements: 128-byte swizzle, (8, 64) tiles.
    transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    smem = lambda *shape: plgpu.SMEM(shape, q.dtype, transforms=transforms)  # noqa: E731
    scratch = [
        smem(NUM_CONSUMERS, bq, d),                     # Q per consumer, then its output
        smem(stages, bk, d), smem(stages, bk, d),       # K, V ring
        smem(NUM_CONSUMERS, bq, bk) if cfg.p_via_smem else None,   # P per consumer
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
    if softmax:   # lse [H, Tq] float32, base 2, as jagged_flash's softmax forward
        out_type = (out_type, jax.ShapeDtypeStruct((h, tq), F32))
    return plgpu.kernel(
        functools.partial(_kernel, cfg=cfg, n_tiles=n_tiles, n_heads=h),
        out_type=out_type,
        scratch_types=scratch,
        grid=grid,
        grid_names=names,
        num_threads=NUM_CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret or None,
    )(table, start, end, q, k, v)


def mosaic_config(d, dtype, *, mode="gdpa", activation="silu", scale=1.0, **tuning):
    """MosaicConfig from the tuning knobs, checked (TypeError for an unknown knob,
    NotImplementedError for what the kernel does not take)."""
    unknown = set(tuning) - {f.name for f in dataclasses.fields(MosaicConfig)}
    if unknown:
        raise TypeError(f"gdpa_mosaic: unknown tuning knobs {sorted(unknown)}")
    cfg = MosaicConfig(mode=mode, activation=activation, scale=float(scale), **tuning)
    check_config(cfg, d, dtype)
    return cfg


def build_layout(cfg, q_offsets, kv_offsets, tq, interpret=False, tk=None):
    """(table, start, end) for run_kernel, from the offsets; tq / tk: padded capacities
    (tk: needed with cfg.anchor).
    XLA ops, or one Pallas kernel with cfg.pallas_layout (interpret: as run_kernel's)."""
    q_offsets, kv_offsets = q_offsets.astype(jnp.int32), kv_offsets.astype(jnp.int32)
    if cfg.pallas_layout:
        return pallas_layout(cfg, q_offsets, kv_offsets, tq, interpret=bool(interpret))
    start, end = row_key_intervals(q_offsets, kv_offsets, tq)
    return tile_table(cfg, start, end, tk), start, end


def _layout_kernel(qo_ref, ko_ref, table_ref, start_ref, end_ref, *, cfg, b):
    """CTA tile p: its rows' key intervals (row_key_intervals) and its table row
    (tile_table's columns, padded to 16; launch order = tile order)."""
    bq, bk = cfg.block_q, cfg.block_kv
    p = pl.program_id(0)
    cols = []
    for w in range(NUM_CONSUMERS):
        row = p * cfg.cta_rows + w * bq + lax.broadcasted_iota(jnp.int32, (bq,), 0)
        lo, hi = jnp.zeros((bq,), jnp.int32), jnp.full((bq,), b, jnp.int32)
        for _ in range(max(1, b).bit_length()):   # seg: the last i with q_offsets[i] <= row
            mid = (lo + hi + 1) // 2
            ok = plgpu_triton.load(qo_ref.at[mid]) <= row
            lo, hi = jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)
        seg = jnp.minimum(lo, b - 1)
        ks, ke = plgpu_triton.load(ko_ref.at[seg]), plgpu_triton.load(ko_ref.at[seg + 1])
        ok = (lo < b) & (ks < ke)
        start, end = jnp.where(ok, ks, BIG), jnp.where(ok, ke, 0)
        start_ref[pl.ds(p * cfg.cta_rows + w * bq, bq)] = start
        end_ref[pl.ds(p * cfg.cta_rows + w * bq, bq)] = end
        # tile_ranges / interior_ranges of this consumer's rows (scalars)
        s_min, e_max, s_max, e_min = jnp.min(start), jnp.max(end), jnp.max(start), jnp.min(end)
        empty = e_max <= s_min
        t_lo = jnp.where(empty, 0, s_min // bk)
        t_hi = jnp.where(empty, 0, (e_max + bk - 1) // bk)
        f_lo = jnp.clip((s_max + bk - 1) // bk, t_lo, t_hi)
        f_hi = jnp.clip(e_min // bk, f_lo, t_hi)
        f_empty = f_hi <= f_lo
        f_lo, f_hi = jnp.where(f_empty, t_hi, f_lo), jnp.where(f_empty, t_hi, f_hi)
        if not cfg.interior:
            f_lo = f_hi = t_hi
        cols.append((empty, t_lo, f_lo, f_hi, t_hi, t_hi))   # hn = hi: no narrow step
    c_lo = functools.reduce(jnp.minimum, [jnp.where(e, BIG, a) for e, a, *_ in cols])
    c_hi = functools.reduce(jnp.maximum, [jnp.where(e, 0, c[-1]) for e, *c in cols])
    cta_empty = c_hi <= c_lo
    c_lo, c_hi = jnp.where(cta_empty, 0, c_lo), jnp.where(cta_empty, 0, c_hi)
    vals = [p, c_lo, c_hi]
    for empty, *ranges in cols:          # an empty consumer's range collapses onto c_lo
        vals += [jnp.where(empty, c_lo, x) for x in ranges]
    lane = lax.broadcasted_iota(jnp.int32, (16,), 0)
    out = jnp.zeros((16,), jnp.int32)
    for c, x in enumerate(vals):
        out = jnp.where(lane == c, x, out)
    table_ref[p, :] = out


def pallas_layout(cfg, q_offsets, kv_offsets, tq, interpret=False):
    """build_layout's (table [n_cta, 16], start, end [tq]) in one Pallas Triton launch
    (a binary search of each row's sample in q_offsets); table rows in tile order,
    or heaviest-first (an XLA argsort) with cfg.heavy_first."""
    b = q_offsets.shape[0] - 1
    n = tq // cfg.cta_rows
    full = lambda x: pl.BlockSpec(x.shape, lambda i: (0,) * x.ndim)  # noqa: E731
    table, start, end = pl.pallas_call(
        functools.partial(_layout_kernel, cfg=cfg, b=b), grid=(n,),
        in_specs=[full(q_offsets), full(kv_offsets)],
        out_specs=[pl.BlockSpec((n, 16), lambda i: (0, 0)), pl.BlockSpec((tq,), lambda i: (0,)),
                   pl.BlockSpec((tq,), lambda i: (0,))],
        out_shape=[jax.ShapeDtypeStruct((n, 16), jnp.int32),
                   jax.ShapeDtypeStruct((tq,), jnp.int32), jax.ShapeDtypeStruct((tq,), jnp.int32)],
        compiler_params=plgpu_triton.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret, name="mosaic_flash_layout",
    )(q_offsets, kv_offsets)
    if cfg.heavy_first:
        table = table[jnp.argsort(table[:, 1] - table[:, 2], stable=True)]
    return table, start, end


@dataclasses.dataclass(frozen=True)
class MosaicFlashForward:
    """The Mosaic kernel as jagged_flash's forward (FlashConfig.forward="mosaic"): reads
    the per-row key intervals jagged_flash.build_layout already made (q_start, q_end),
    so the Triton backward and this forward share one layout. Returns out (gdpa) or
    (out, lse) (softmax)."""
    cfg: MosaicConfig
    interpret: bool = False

    def __call__(self, q, k, v, lay):
        if self.cfg.pallas_layout:
            layout = build_layout(self.cfg, lay["q_offsets"], lay["kv_offsets"], q.shape[0],
                                  self.interpret)
        else:
            start, end = lay["q_start"], lay["q_end"]
            layout = tile_table(self.cfg, start, end, k.shape[0]), start, end
        return run_kernel(self.cfg, layout, q, k, v, self.interpret)


def is_hopper(device=None) -> bool:
    """Whether `device` (default: the first) runs these kernels: wgmma and TMA need an
    sm_90 GPU (H100 / H200); Ampere has neither, Blackwell has no wgmma."""
    device = device or jax.devices()[0]
    if device.platform != "gpu":
        return False
    cc = getattr(device, "compute_capability", None)
    if cc is not None:
        return str(cc).split(".")[0] == "9"
    return any(name in device.device_kind for name in ("H100", "H200", "H800", "GH200"))


def flash_forward(flash_cfg, dtype, d, tq, tk):
    """MosaicFlashForward for a gdpa or softmax FlashConfig (its tiles adapted) and padded
    capacities tq / tk, or None where this kernel does not apply and the Triton forward
    runs: causal / window / block / RoPE, inputs not bf16 / f16, D not 64 / 128, short
    samples (adapted Triton tiles below 64: cross-attention on a few keys, PMA),
    capacities not multiples of its tiles, a GPU other than Hopper (is_hopper; interpret
    mode runs anywhere)."""
    if not flash_cfg.interpret and not is_hopper():
        return None
    if flash_cfg.causal or flash_cfg.window is not None or flash_cfg.block is not None \
            or flash_cfg.rope:
        return None
    if min(flash_cfg.bq, flash_cfg.bk) < 64:
        return None
    try:
        cfg = mosaic_config(d, dtype, mode=flash_cfg.mode, activation=flash_cfg.activation,
                            scale=flash_cfg.scale, **dict(flash_cfg.mosaic_fwd))
    except NotImplementedError:
        return None
    if tq % cfg.cta_rows or tk % cfg.block_kv:
        return None
    return MosaicFlashForward(cfg, interpret=flash_cfg.interpret)


# The backward's streamed tile: 64 queries (dK / dV) or keys (dQ). dK and dV hold two
# [64, D] float32 accumulators per consumer (128 registers a thread at D = 128) beside
# S^T and dP^T; 128-wide score tiles would not fit too. dQ holds one accumulator and
# could take 128 keys (dq_block_kv=128), but measured slower on W1 (H200, same run:
# 0.337 vs 0.310 ms GDPA, 0.293 vs 0.281 softmax). The producer needs few
# registers: 240 / 24 (FA3's split for its backward) leaves the consumers the most.
# fused_delta (softmax): W1 on an H200, CUPTI device time of the whole forward + backward
# 0.970 vs 0.980 ms (the XLA delta reduce, 0.025 ms, gone; dQ 0.013 ms longer), wall
# 1.009 vs 1.012 ms. overlap_dp measured slower (dK / dV 0.441 vs 0.400 ms softmax,
# 0.425 vs 0.391 GDPA): off (docs/kernels.md).
BACKWARD_TUNING = dict(block_kv=64, consumer_registers=240, producer_registers=24,
                       fused_delta=True)


def flash_backward(flash_cfg, dtype, d, tq, tk):
    """MosaicConfig of run_backward for a FlashConfig (tiles adapted) and padded
    capacities, or None where those kernels do not apply (flash_forward's list)."""
    if flash_forward(flash_cfg, dtype, d, tq, tk) is None:
        return None
    tuning = {**BACKWARD_TUNING, **dict(flash_cfg.mosaic_bwd)}
    cfg = mosaic_config(d, dtype, mode=flash_cfg.mode, activation=flash_cfg.activation,
                        scale=flash_cfg.scale, **tuning)
    tiles = (cfg.cta_rows, cfg.block_kv, cfg.dq_block_kv or cfg.block_kv)
    if any(tq % t or tk % t for t in tiles):
        return None
    return cfg


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
    layout = build_layout(cfg, q_offsets, kv_offsets, tqp, interpret, tkp)
    out = run_kernel(cfg, layout, _pad_rows(q, tqp), _pad_rows(k, tkp), _pad_rows(v, tkp),
                     interpret)
    if mode == "softmax":
        return out[0][:tq], out[1][:, :tq]
    return out[:tq]


def gdpa_mosaic_forward(q, k, v, q_offsets, kv_offsets, *, activation="silu", scale=1.0,
                        interpret=False, causal=False, window=None, **tuning):
    """out = (act(Q K^T) * scale) @ V per jagged sample; see the module docstring.

    q [Tq,H,D], k/v [Tk,H,D] bf16/f16, offsets [B+1] int32 -> [Tq,H,D] in q.dtype.
    `tuning` overrides MosaicConfig fields (block_q, block_kv, num_stages, ...).
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
