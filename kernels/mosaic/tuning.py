"""The Mosaic GPU engine's configuration: MosaicConfig (the op and its tuning), the
backward's tuning (BACKWARD_TUNING), and what the kernels take (check_config)."""

import dataclasses
import math

import jax.numpy as jnp

F32 = jnp.float32
LOG2E = math.log2(math.e)
NEG = -1e30              # softmax: the score of a masked pair
BIG = 1 << 30            # start of an empty key interval (padding query rows)
NUM_CONSUMERS = 2        # consumer warpgroups per CTA; the producer is warpgroup 2
# Activations the kernels form (kernels.gdpa.reference.ACTIVATIONS, the same names).
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu", "identity")


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


def mosaic_config(d, dtype, *, mode="gdpa", activation="silu", scale=1.0, **tuning):
    """MosaicConfig from the tuning knobs, checked (TypeError for an unknown knob,
    NotImplementedError for what the kernel does not take)."""
    unknown = set(tuning) - {f.name for f in dataclasses.fields(MosaicConfig)}
    if unknown:
        raise TypeError(f"gdpa_mosaic: unknown tuning knobs {sorted(unknown)}")
    cfg = MosaicConfig(mode=mode, activation=activation, scale=float(scale), **tuning)
    check_config(cfg, d, dtype)
    return cfg


# The backward's streamed tile: 64 queries (dK / dV) or keys (dQ). dK and dV hold two
# [64, D] float32 accumulators per consumer (128 registers a thread at D = 128) beside
# S^T and dP^T; 128-wide score tiles would not fit too. dQ holds one accumulator and
# could take 128 keys (dq_block_kv=128), but measured slower on W1 (H200, same run:
# 0.337 vs 0.310 ms GDPA, 0.293 vs 0.281 softmax). The producer needs few
# registers: 240 / 24 (FA3's split for its backward) leaves the consumers the most.
# fused_delta (softmax): W1 on an H200, CUPTI device time of the whole forward + backward
# 0.970 vs 0.980 ms (the XLA delta reduce, 0.025 ms, gone; dQ 0.013 ms longer), wall
# 1.009 vs 1.012 ms. overlap_dp measured slower (dK / dV 0.441 vs 0.400 ms softmax,
# 0.425 vs 0.391 GDPA): off (kernels/NOTES.md).
BACKWARD_TUNING = dict(block_kv=64, consumer_registers=240, producer_registers=24,
                       fused_delta=True)

