"""The Mosaic GPU engine's configuration: one tuning record per op (TUNING[op], a
MosaicOpTuning: the MosaicTuning its forward and its backward kernels run with), the
op's spec apart from it (MosaicSpec: mode, activation, scale; the kernels take no masks),
MosaicConfig (a spec and one direction's tuning: cfg.spec, cfg.tuning) and what the
kernels take (check_config).

Fixed by the kernels' design rather than tuned: two consumer warpgroups of BLOCK_Q = 64
rows each (wgmma's M); softmax folds its scale into the exp2 FMA; the streamed tiles of
a CTA start at its first valid key (rounded down to 8, the TMA tile rows); the
forward's last masked step is half-width where a consumer's keys end in its first half
(block_kv 128 or 256); GDPA silu / gelu_tanh form P in the inputs' 16-bit type; the
forward does not await a step's P V until the next step's scores; the softmax backward
computes delta = rowsum(O dO) in its dQ kernel.
"""

import dataclasses
import math

import jax.numpy as jnp

from kernels.common import SpecTuningParts

F32 = jnp.float32
LOG2E = math.log2(math.e)
NEG = -1e30              # softmax: the score of a masked pair
BIG = 1 << 30            # start of an empty key interval (padding query rows)
NUM_CONSUMERS = 2        # consumer warpgroups per CTA; the producer is warpgroup 2
BLOCK_Q = 64             # rows per consumer warpgroup (wgmma M)
SMEM_BYTES = 227 * 1024  # shared memory a CTA may opt into (H100, H200)
# Shared memory the lowering takes beside the forward's own buffers: a softmax CTA of
# block_kv 128, 3 stages, D 128 asked 232,568 bytes on an H100, its buffers (1 KiB
# aligned) and barriers 230,520.
SMEM_LOWERING_BYTES = 2048
# Activations the kernels form (the names of kernels.gdpa.reference.ACTIVATIONS).
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu", "identity")


@dataclasses.dataclass(frozen=True)
class MosaicTuning:
    """Launch parameters of the Mosaic kernels (defaults: the forward's, TUNING)."""
    block_kv: int = 128            # streamed rows per pipeline step (64, 128, 192, 256)
    num_stages: int = 2            # streamed-tile shared-memory slots (>= 2)
    consumer_registers: int = 232  # per thread of a consumer warpgroup
    producer_registers: int = 40   # per thread of the producer warpgroup
    schedule_barrier: bool = True  # forward: the two consumers ping-pong (FA3)
    heavy_first: bool = True       # CTAs with the longest streamed range launch first
    interior: bool = True          # an unmasked loop over tiles whose pairs are all valid
    # backward: one kernel forms dK, dV and dQ (dQ reduce-added in float32 through TMA).
    # Off: on one H200, W1 forward + backward GDPA 0.942 ms against 0.993 (4 of 4 rounds)
    # but softmax 1.049 against 1.004 (0 of 4), and dQ's summation order (so its float32
    # bits) varies run to run; kept for GDPA-only use and its A/B rows (bench_attention
    # --mosaic_variants, tools.ab_attention).
    fused_dq: bool = False


# The backward's tuning: it streams 64-row tiles (its dK / dV consumers hold two [64, D]
# float32 accumulators beside S^T and dP^T, so wider score tiles do not fit); its producer
# needs few registers, so the consumers take 240.
_BACKWARD = MosaicTuning(block_kv=64, consumer_registers=240, producer_registers=24)


@dataclasses.dataclass(frozen=True)
class MosaicOpTuning:
    """An op's tuning on the Mosaic engine, one MosaicTuning per direction."""
    forward: MosaicTuning = MosaicTuning()
    backward: MosaicTuning = _BACKWARD


# The values that run: one record per op (gdpa and jagged_attention run the same).
TUNING = {"gdpa": MosaicOpTuning(), "jagged_attention": MosaicOpTuning()}
# The backward's entries that differ from the forward's (mosaic_config(**BACKWARD_TUNING)).
BACKWARD_TUNING = {f.name: getattr(_BACKWARD, f.name) for f in dataclasses.fields(MosaicTuning)
                   if getattr(_BACKWARD, f.name) != getattr(MosaicTuning(), f.name)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicSpec:
    """What a Mosaic kernel computes, apart from how it is tuned."""
    mode: str = "gdpa"            # "gdpa" | "softmax" (online, base 2; also returns lse)
    activation: str = "silu"      # gdpa
    scale: float = 1.0            # gdpa: after the activation; softmax: on the scores


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicConfig(SpecTuningParts, MosaicSpec, MosaicTuning):
    """An op's spec (MosaicSpec's fields) with one direction's tuning (MosaicTuning's);
    cfg.spec / cfg.tuning give the two parts."""

    SPEC = MosaicSpec
    TUNING = MosaicTuning

    @property
    def block_q(self):
        return BLOCK_Q

    @property
    def cta_rows(self):
        return NUM_CONSUMERS * BLOCK_Q

    @property
    def packed_act(self):
        """Whether the forward forms act(S) in 16 bits (GDPA silu / gelu_tanh)."""
        return self.mode == "gdpa" and self.activation in ("silu", "gelu_tanh")

    @property
    def narrow(self):
        """Whether the forward takes half-width last steps (block_kv 128 or 256: P V's
        wgmma K is a multiple of 64)."""
        return self.block_kv % 128 == 0


def forward_smem_bytes(cfg, d, itemsize=2):
    """Shared memory the forward kernel asks for: Q per consumer, the K / V ring, softmax's
    lse per consumer (each 1 KiB aligned), 8 bytes per barrier, and the lowering's own."""
    align = lambda n: -(-n // 1024) * 1024  # noqa: E731
    buffers = align(NUM_CONSUMERS * BLOCK_Q * d * itemsize)
    buffers += 2 * align(cfg.num_stages * cfg.block_kv * d * itemsize)
    if cfg.mode == "softmax":
        buffers += align(NUM_CONSUMERS * BLOCK_Q * 4)
    barriers = NUM_CONSUMERS + 4 * cfg.num_stages + 1
    return buffers + 8 * barriers + SMEM_LOWERING_BYTES


def check_config(cfg, d, dtype, forward=True):
    """NotImplementedError (callers fall back) for what the kernel does not take; forward:
    the forward kernel's shared memory too."""
    if cfg.mode not in ("gdpa", "softmax"):
        raise ValueError(f"gdpa_mosaic: mode must be gdpa or softmax, got {cfg.mode!r}")
    if cfg.activation not in ACTIVATIONS:
        raise ValueError(f"gdpa_mosaic: activation must be one of {sorted(ACTIVATIONS)}, "
                         f"got {cfg.activation!r}")
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise NotImplementedError(f"gdpa_mosaic: only bf16 / f16 inputs, got {jnp.dtype(dtype)}")
    if d not in (64, 128):
        raise NotImplementedError(f"gdpa_mosaic: head dim D={d} must be 64 or 128")
    if cfg.block_kv not in (64, 128, 192, 256):
        raise NotImplementedError(f"gdpa_mosaic: block_kv={cfg.block_kv} must be 64, 128, 192 "
                                  "or 256")
    if cfg.num_stages < 2:
        raise NotImplementedError(f"gdpa_mosaic: num_stages={cfg.num_stages} must be >= 2")
    regs = (cfg.consumer_registers, cfg.producer_registers)
    if any(r % 8 or not 24 <= r <= 256 for r in regs) or (
            NUM_CONSUMERS * regs[0] + regs[1]) * 128 > 65536:
        raise NotImplementedError(f"gdpa_mosaic: registers {regs} must be multiples of 8 in "
                                  "[24, 256] and fit 64K per SM")
    smem = forward_smem_bytes(cfg, d, jnp.dtype(dtype).itemsize) if forward else 0
    if smem > SMEM_BYTES:
        raise NotImplementedError(
            f"gdpa_mosaic: mode={cfg.mode} D={d} block_kv={cfg.block_kv} num_stages="
            f"{cfg.num_stages} needs {smem} bytes of shared memory, more than the "
            f"{SMEM_BYTES} a CTA has; lower num_stages or block_kv")


def mosaic_config(d, dtype, *, mode="gdpa", activation="silu", scale=1.0, forward=True,
                  **tuning):
    """MosaicConfig from the tuning knobs (MosaicTuning fields; default the forward's),
    checked (TypeError for an unknown knob, NotImplementedError for what the kernel
    does not take)."""
    unknown = set(tuning) - {f.name for f in dataclasses.fields(MosaicTuning)}
    if unknown:
        raise TypeError(f"gdpa_mosaic: unknown tuning knobs {sorted(unknown)}")
    cfg = MosaicConfig(mode=mode, activation=activation, scale=float(scale), **tuning)
    check_config(cfg, d, dtype, forward)
    return cfg
