"""The Triton engine's configuration: one tuning record per op (TUNING: gdpa and
jagged_attention a TritonTuning of the tiled kernels, block_attention a BlockTuning of
its per-block kernel holding the TritonTuning of its tiled fallback), the op's spec apart
from it (AttentionSpec: mode, activation, scale, masks, RoPE), FlashConfig (a spec, a
tuning and the engine fields: cfg.spec, cfg.tuning), and the rules that adapt a tuning
to the shapes of a call. What varies, and where it is set:

    op                  TUNING[op]: 64 x 64 tiles, 4 warps; 3 forward stages (2 for
                        block_attention's tiled form); backward 4 warps, 2 stages
    dtype               adapt_tiles: float32 tiles at most 64 x 32 (shared memory);
                        fast_act: 16-bit GDPA forms silu / gelu_tanh through tanh.approx
    tokens per sample   adapt_tiles: tiles of about one sample where samples are short;
                        fused_backward_side: "q_rows" / "k_rows" where a side holds at
                        most SHORT_SIDE tokens per sample; backward_knobs: with "k_rows"
                        the 32 heaviest key tiles split in 4, with either fused form the
                        rest kernel over 8 tiles per program

Fixed by the kernels' design rather than tuned: tiles launch heaviest-first (in order
where the inner loop runs over a short side); tiles whose pairs are all valid skip the
mask (the interior loop); a per-block program whose group of blocks is a power of two
loads the group's block-table entries up front (W4 forward 0.075 against 0.078 ms,
forward + backward 0.223 against 0.226, 4 of 4 interleaved rounds on an H200).
"""

import dataclasses

import jax.numpy as jnp

from kernels.common import SpecTuningParts

F32 = jnp.float32
PAD_MULTIPLE = 128  # token capacities are padded to this (all tiles divide it)
# Tokens per sample (capacity / B) at or below which a side counts as short: tiles over
# the other side launch in order (one or two tiles of inner loop each, no sort), and a
# short side gets the fused backward (fused_bwd="auto": "q_rows" / "k_rows").
SHORT_SIDE = 32
FUSED_BWD = ("auto", "off", "q_rows", "k_rows")   # TritonTuning.fused_bwd


@dataclasses.dataclass(frozen=True)
class TritonTuning:
    """Launch parameters of the Triton tiled kernels (defaults: gdpa's and
    jagged_attention's, TUNING). Tiles: powers of two >= 16 dividing PAD_MULTIPLE."""
    bq: int = 64                   # forward / dQ: query tile
    bk: int = 64                   # forward / dQ: key tile
    bq_dkv: int = 64               # dK / dV: query step
    bk_dkv: int = 64               # dK / dV: key tile
    num_warps: int = 4             # forward
    num_stages: int = 3            # forward
    num_warps_bwd: int = 4         # dQ, dK / dV
    num_stages_bwd: int = 2        # dQ, dK / dV
    # FUSED_BWD: "k_rows" / "q_rows" (rows of one side whose whole interval lies in one
    # tile of the other get their gradient from that tile's program, the rest from
    # their own kernel), "off" (the dQ and dK/dV kernels), "auto" (fused_backward_side).
    # On one H200, forward + backward: W3 (PMA, q_rows) 0.519 ms against 0.574 for an
    # atomic form, W2 (cross, k_rows) 0.343 against 0.357 unfused
    fused_bwd: str = "auto"
    # dK / dV: the query loop of each of the first dkv_split_tiles key tiles of the
    # launch order (the heaviest; 0: every tile) cut into dkv_split chunks, one program
    # each, their float32 partials summed after the kernel; 1 = off. "auto":
    # backward_knobs (with k_rows the 32 heaviest split in 4 and rest_group 8: W2
    # forward + backward 0.285 ms against 0.330 on one H200)
    dkv_split: int | str = "auto"
    dkv_split_tiles: int | str = "auto"
    # fused_bwd "k_rows" / "q_rows": tiles per program of the kernel that takes the rows
    # no tile of the other side owns (a loop in the program); "auto": backward_knobs
    rest_group: int | str = "auto"


@dataclasses.dataclass(frozen=True)
class BlockTuning:
    """Launch parameters of block_attention's per-block kernel (kernels/triton/block.py;
    defaults: the values that run, TUNING["block_attention"]) and the TritonTuning of its
    tiled fallback (`tiled`: block sizes the per-block kernel does not take)."""
    num_warps: int = 4             # forward
    num_stages: int = 2            # forward
    group: int = 4                 # forward: blocks per program (a loop in the program)
    num_warps_bwd: int = 4         # backward
    num_stages_bwd: int = 1        # backward
    # backward: blocks per program. On gem1b (one H200, its level-1 backward, 2 calls a
    # step) group_bwd 1 / rope_chunks_bwd 2 took 10.3-10.9 ms against 12.5 for 2 / 1,
    # which the G1 workload's sweep had ranked first (fwd+bwd 4.80 ms against 5.35):
    # time a change on the model, not on G1 alone.
    group_bwd: int = 1
    # RoPE cos / sin through cos.approx / sin.approx for 16-bit inputs (float32 keeps
    # libdevice cosf / sinf)
    fast_trig: bool = True
    # RoPE in a loop over this many column chunks of each half (fewer registers; capped to
    # what D/2 splits into), forward / backward: W4 f+b 0.297 ms with rope_chunks_bwd 2
    # against 0.347 with 1 (H200)
    rope_chunks: int = 1
    rope_chunks_bwd: int = 2
    # the chunked backward loads dO and V before its score loop (a setting of the
    # benchmarks' G1 / W4 sweep grid, BLOCK_BWD_GRID in benchmarks/attention_workloads.py)
    early_loads_bwd: bool = False
    tiled: TritonTuning = TritonTuning(num_stages=2)


# The values that run: one record per op.
TUNING = {"gdpa": TritonTuning(), "jagged_attention": TritonTuning(),
          "block_attention": BlockTuning()}
# The per-block kernel's knobs as keyword arguments (block_attention_pallas(**knobs)).
BLOCK_KNOBS = {f.name: getattr(TUNING["block_attention"], f.name)
               for f in dataclasses.fields(BlockTuning) if f.name != "tiled"}


def tuning_of(op):
    """The TritonTuning of `op`'s tiled kernels as keyword arguments
    (FlashConfig(**tuning_of(op), mode=...)); block_attention: its tiled fallback's."""
    tuning = TUNING[op]
    return dataclasses.asdict(tuning.tiled if isinstance(tuning, BlockTuning) else tuning)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionSpec:
    """What an attention op computes, apart from how it is tuned: the score map, its scale,
    the pair mask (kernels.common) and RoPE."""
    mode: str                      # "gdpa" | "softmax"
    activation: str = "identity"   # gdpa only
    scale: float = 1.0             # gdpa: after act; softmax: sm_scale on scores
    causal: bool = False
    window: int | None = None
    block: int | None = None       # block_attention: same pos // block
    rope: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class FlashConfig(SpecTuningParts, AttentionSpec, TritonTuning):
    """An op on the tiled kernels: its spec (AttentionSpec's fields), its tuning
    (TritonTuning's fields), and the engine of each direction (kernels.dispatch picks the
    Mosaic kernels where they apply). cfg.spec / cfg.tuning give the two parts;
    FlashConfig.of(spec, tuning, **engine) joins them."""

    SPEC = AttentionSpec
    TUNING = TritonTuning
    fast_act: bool = False         # gdpa silu / gelu_tanh through tanh.approx (set by
                                   # kernels.dispatch.jagged_flash for 16-bit inputs)
    interpret: bool = False
    forward: str = "triton"        # "triton" | "mosaic": the engine of each direction;
    backward: str = "triton"       # either forward feeds either backward
    mosaic_fwd: tuple = ()         # MosaicTuning overrides ((knob, value), ...) of the
    mosaic_bwd: tuple = ()         # Mosaic forward / backward (benchmarks and tests)

    @classmethod
    def of(cls, spec, tuning, **engine):
        """The FlashConfig of an AttentionSpec and a TritonTuning (engine: the other fields)."""
        return cls(**vars(spec), **vars(tuning), **engine)


def _pow2_floor(x):
    return 1 << (max(int(x), 1).bit_length() - 1)


def adapt_tiles(cfg, tq, tk, b, dtype):
    """Shrink tiles for short samples and for float32 (static shapes only).

    Short samples (capacity / B below the tile, e.g. 16 PMA queries or 32 summary
    keys per sample) get tiles of about one sample, so a tile does not pull in the
    neighbours' pairs; float32 tiles are halved to fit shared memory.
    """
    per_q = _pow2_floor(max(16, tq // max(b, 1)))
    per_k = _pow2_floor(max(16, tk // max(b, 1)))
    r = {}
    r["bq"], r["bq_dkv"] = min(cfg.bq, per_q), min(cfg.bq_dkv, per_q)
    r["bk"], r["bk_dkv"] = min(cfg.bk, per_k), min(cfg.bk_dkv, per_k)
    if jnp.dtype(dtype) == F32:
        r = dict(bq=min(r["bq"], 64), bk=min(r["bk"], 32), bq_dkv=min(r["bq_dkv"], 32),
                 bk_dkv=min(r["bk_dkv"], 32))
    return dataclasses.replace(cfg, **r)


def fused_backward_side(cfg, tq, tk, b):
    """cfg.fused_bwd resolved for capacities tq / tk and B samples: one of FUSED_BWD but
    "auto".

    "auto": "q_rows" where queries per sample are at most SHORT_SIDE (PMA's 16), else
    "k_rows" where keys per sample are (cross-attention to 32 keys), else "off"; "off"
    with RoPE (the fused kernels do not rotate).
    """
    if cfg.fused_bwd not in FUSED_BWD:
        raise ValueError(f"pallas attention: fused_bwd must be one of {FUSED_BWD}, "
                         f"got {cfg.fused_bwd!r}")
    if cfg.fused_bwd != "auto":
        if cfg.rope and cfg.fused_bwd != "off":
            raise ValueError(f"pallas attention: fused_bwd {cfg.fused_bwd!r} does not take "
                             "RoPE; use 'off' or 'auto'")
        return cfg.fused_bwd
    if cfg.rope:
        return "off"
    if is_short(tq, b):
        return "q_rows"
    return "k_rows" if is_short(tk, b) else "off"


def backward_knobs(cfg):
    """cfg's dkv_split, dkv_split_tiles and rest_group resolved (cfg.fused_bwd already
    resolved): ints.

    "auto", with "k_rows" (a short key side: each key tile's query loop runs over a whole
    sample's queries, up to 4096): the 32 heaviest key tiles split in 4, the rest kernel
    over 8 tiles per program; with "q_rows" the rest kernel over 8 tiles; else no split,
    one tile per program.
    """
    k_rows, fused = cfg.fused_bwd == "k_rows", cfg.fused_bwd in ("k_rows", "q_rows")
    auto = dict(dkv_split=4 if k_rows else 1, dkv_split_tiles=32 if k_rows else 0,
                rest_group=8 if fused else 1)
    resolved = {}
    for name, least in (("dkv_split", 1), ("dkv_split_tiles", 0), ("rest_group", 1)):
        value = getattr(cfg, name)
        resolved[name] = (auto[name] if value == "auto"
                          else _int_knob(name, value, least))
    return dataclasses.replace(cfg, **resolved)


def _int_knob(name, value, least):
    """value, or a ValueError naming the knob unless it is an int >= least."""
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"pallas attention: {name} must be an int >= {least} or 'auto', "
                         f"got {value!r}")
    return value


def is_short(capacity, b):
    """Whether a side of `capacity` tokens over b samples is short (SHORT_SIDE per sample)."""
    return capacity <= SHORT_SIDE * max(b, 1)
