"""The Triton engine's configuration: FlashConfig (the op and its tiles, warps, stages and
backward form) and the rules that adapt it to the shapes of a call (adapt_tiles,
fused_backward_side, backward_knobs)."""

import dataclasses

import jax.numpy as jnp

F32 = jnp.float32
PAD_MULTIPLE = 128  # token capacities are padded to this (all tiles divide it)
# Tokens per sample (capacity / B) at or below which a side counts as short: tiles over
# the other side launch in order (one or two tiles of inner loop each, no sort), and a
# short side gets the fused backward (fused_bwd="auto": "q_rows" / "k_rows").
SHORT_SIDE = 32
FUSED_BWD = ("auto", "off", "q_rows", "k_rows")   # FlashConfig.fused_bwd


@dataclasses.dataclass(frozen=True)
class FlashConfig:
    mode: str                      # "gdpa" | "softmax"
    activation: str = "identity"   # gdpa only
    scale: float = 1.0             # gdpa: after act; softmax: sm_scale on scores
    causal: bool = False
    window: int | None = None
    block: int | None = None       # block_attention: same pos // block
    rope: bool = False
    bq: int = 128                  # forward / dQ query tile
    bk: int = 64                   # forward / dQ key tile
    bq_dkv: int = 64               # dK/dV: query step
    bk_dkv: int = 64               # dK/dV: key tile
    num_warps: int = 8
    num_stages: int = 2
    num_warps_bwd: int = 8
    num_stages_bwd: int = 2
    heavy_first: bool = True       # launch tiles with the longest key range first
    interior: bool = True          # tiles whose pairs are all valid skip the mask
    fast_act: bool = False         # gdpa silu / gelu_tanh through tanh.approx (16-bit inputs)
    interpret: bool = False
    # forward engine: "triton" (this module's kernel) or "mosaic" (the Mosaic GPU kernel,
    # kernels/mosaic_flash.py, gdpa and softmax, where it applies: flash_forward; Triton
    # elsewhere); either engine's forward feeds either backward
    forward: str = "triton"
    # backward engine: "triton" (the dQ and dK/dV kernels here) or "mosaic" (the Mosaic
    # GPU dQ and dK/dV kernels, kernels/mosaic_flash.py run_backward, where they apply:
    # flash_backward; Triton elsewhere)
    backward: str = "triton"
    # MosaicConfig overrides, ((knob, value), ...), for the Mosaic forward / backward
    # (benchmarks and tests: e.g. (("fused_delta", True),), (("overlap_dp", True),))
    mosaic_fwd: tuple = ()
    mosaic_bwd: tuple = ()
    # Triton backward, FUSED_BWD: "k_rows" / "q_rows" (rows of one side whose whole
    # interval lies in one tile of the other get their gradient from that tile's
    # program, the rest from their own kernel), "off" (the dQ and dK/dV kernels), "auto"
    # (fused_backward_side: "q_rows" for short query sides, "k_rows" for short key sides,
    # else off; off with RoPE)
    fused_bwd: str = "auto"
    # The next three are "auto" by default, resolved by backward_knobs (H200 timings
    # there). Triton dK/dV kernel: each key tile's query loop cut into this many equal
    # chunks, one program each, their float32 partial dK / dV summed in XLA after the
    # kernel (a long sample's key tile is no longer one long serial program: W2's 2975
    # queries are 47 query tiles). 1 = off. Applies to the plain and "k_rows" backwards.
    dkv_split: int | str = "auto"
    # dkv_split over the first dkv_split_tiles key tiles of the launch order only (the
    # heaviest, with heavy_first): their float32 partials go to a small buffer
    # [split * L * bk_dkv, H, D], summed and scattered into dK / dV after the kernel,
    # while every other tile runs whole and stores dK / dV directly. 0 = every tile split
    # (partials [split * Tk, H, D] summed in full: on W2 two 12 us passes, CUPTI).
    dkv_split_tiles: int | str = "auto"
    # fused_bwd "k_rows" / "q_rows": tiles per program of the kernel that takes the rows
    # no tile of the other side owns (a loop in the program). On W2 / W3 nearly every
    # tile has none, and one program per tile and head (W2: 5660) costs 13 us of launches
    # for no work (CUPTI). 1 = one program per tile.
    rest_group: int | str = "auto"


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

    "auto": "q_rows" where queries per sample are at most SHORT_SIDE (PMA's 16: W3 on an
    H200, forward+backward 0.519 ms against 0.610 unfused and 0.574 with dQ added by
    float32 atomics in the dK/dV kernel, a mode since removed), else "k_rows" where keys
    per sample are (W2's 32: 0.343 against 0.357 unfused), else "off"; "off" with RoPE
    (the fused kernels do not rotate).
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
    if _is_short(tq, b):
        return "q_rows"
    return "k_rows" if _is_short(tk, b) else "off"


def backward_knobs(cfg):
    """cfg's dkv_split, dkv_split_tiles and rest_group resolved (cfg.fused_bwd already
    resolved): ints.

    "auto", with "k_rows" (a short key side: each key tile's query loop runs over a whole
    sample's queries, up to 4096): the 32 heaviest key tiles split in 4, the rest kernel
    over 8 tiles per program; with "q_rows" the rest kernel over 8 tiles; else no split,
    one tile per program. H200, forward+backward per call, one run:
    W2 GDPA 0.287 ms against 0.330 with the former default (every tile split in 2),
    0.338 unsplit, 0.351 every tile in 4, 0.281-0.327 over splits {2, 4, 8} x top
    {16, 32, 64}; softmax 0.338 against 0.383; W3 (call 1) rest_group 8 0.516 / 0.526
    against 0.519 / 0.541 (GDPA / softmax).
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


def _is_short(capacity, b):
    """Whether a side of `capacity` tokens over b samples is short (SHORT_SIDE per sample)."""
    return capacity <= SHORT_SIDE * max(b, 1)
