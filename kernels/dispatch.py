"""The one entry that picks an engine per op: the jnp reference, the Pallas Triton
kernels (kernels/triton) or the Pallas Mosaic GPU kernels (kernels/mosaic).

    resolve_impl(op, head_dim, impl)   impl=None's choice: "mosaic" for gdpa and
                                       jagged_attention on a GPU whose kernels take the
                                       head dim, "pallas" (Triton) for block_attention,
                                       else "reference"
    jagged_flash(cfg, q, k, v, ...)    the differentiable tiled op: forward and backward
                                       each on the engine cfg names, the Mosaic kernels
                                       where they apply (mosaic_forward / mosaic_backward)
                                       and the Triton kernels elsewhere
    gdpa_pallas, jagged_attention_pallas, block_attention_pallas
                                       the ops on the kernels, tuned from the engines'
                                       tables

Neither engine imports the other: their layouts share kernels.common, and only this
module joins a Mosaic forward to a Triton backward (or the reverse).
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from kernels import mosaic
from kernels.common import (MAX_PADDED, default_impl, pad_halves, pad_head_dim, padded_head_dim,
                            rope_freq_parts)
from kernels.mosaic.forward import run_kernel
from kernels.mosaic.layout import tile_table
from kernels.mosaic.tuning import TUNING as MOSAIC_TUNING
from kernels.mosaic.tuning import MosaicConfig, mosaic_config
from kernels.triton.backward import run_backward as triton_backward
from kernels.triton.backward import softmax_delta
from kernels.triton.block import ENGINE, block_table, per_block_kernel_fits, run_block_attention
from kernels.triton.forward import run_forward as triton_forward
from kernels.triton.layout import build_layout, pad_rows
from kernels.triton.tuning import (BLOCK_KNOBS, F32, PAD_MULTIPLE, FlashConfig, adapt_tiles,
                                   backward_knobs, fused_backward_side, tuning_of)

# The Triton tuning of gdpa and jagged_attention, and of block_attention's tiled form, as
# keyword arguments (kernels.triton.tuning.TUNING; benchmarks start their sweeps there).
TILES = tuning_of("gdpa")
BLOCK_TILES = tuning_of("block_attention")


def resolve_impl(op, head_dim, impl):
    """impl as given, or impl=None's choice for `op` (module docstring)."""
    if impl is None:
        impl = default_impl(op, head_dim)
        if impl == "pallas" and op != "block_attention":
            impl = "mosaic"    # Triton where the Mosaic kernels do not apply
    return impl


# ------------------------------------------------------------------- the tiled op

@dataclasses.dataclass(frozen=True)
class MosaicFlashForward:
    """The Mosaic forward on jagged_flash's layout: reads the per-row key intervals
    kernels.triton.layout.build_layout made (q_start, q_end), so either backward reads
    the same layout. Returns out (gdpa) or (out, lse) (softmax)."""
    cfg: MosaicConfig
    interpret: bool = False

    def __call__(self, q, k, v, lay):
        start, end = lay["q_start"], lay["q_end"]
        layout = tile_table(self.cfg, start, end, k.shape[0]), start, end
        return run_kernel(self.cfg, layout, q, k, v, self.interpret)


def is_hopper(device=None) -> bool:
    """Whether `device` (default: the first) runs the Mosaic kernels: wgmma and TMA need
    an sm_90 GPU (H100 / H200); Ampere has neither, Blackwell has no wgmma."""
    device = device or jax.devices()[0]
    if device.platform != "gpu":
        return False
    cc = getattr(device, "compute_capability", None)
    if cc is not None:
        return str(cc).split(".")[0] == "9"
    return any(name in device.device_kind for name in ("H100", "H200", "H800", "GH200"))


def mosaic_forward(flash_cfg, dtype, d, tq, tk):
    """MosaicFlashForward for a gdpa or softmax FlashConfig (its tiles adapted) and padded
    capacities tq / tk, or None where the Mosaic kernel does not apply and the Triton
    forward runs: causal / window / block / RoPE, inputs not bf16 / f16, D not 64 / 128,
    short samples (adapted Triton tiles below 64: cross-attention on a few keys, PMA),
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
        tuning = {**dataclasses.asdict(MOSAIC_TUNING[_op_of(flash_cfg)].forward),
                  **dict(flash_cfg.mosaic_fwd)}
        cfg = mosaic_config(d, dtype, mode=flash_cfg.mode, activation=flash_cfg.activation,
                            scale=flash_cfg.scale, **tuning)
    except NotImplementedError:
        return None
    if tq % cfg.cta_rows or tk % cfg.block_kv:
        return None
    return MosaicFlashForward(cfg, interpret=flash_cfg.interpret)


def mosaic_backward(flash_cfg, dtype, d, tq, tk):
    """MosaicConfig of kernels.mosaic.run_backward for a FlashConfig (tiles adapted) and
    padded capacities, or None where those kernels do not apply (mosaic_forward's list)."""
    if mosaic_forward(flash_cfg, dtype, d, tq, tk) is None:
        return None
    tuning = {**dataclasses.asdict(MOSAIC_TUNING[_op_of(flash_cfg)].backward),
              **dict(flash_cfg.mosaic_bwd)}
    cfg = mosaic_config(d, dtype, mode=flash_cfg.mode, activation=flash_cfg.activation,
                        scale=flash_cfg.scale, forward=False, **tuning)
    if any(tq % t or tk % t for t in (cfg.cta_rows, cfg.block_kv)):
        return None
    return cfg


def _op_of(flash_cfg):
    """The op whose Mosaic tuning a FlashConfig runs with: gdpa, or jagged_attention
    (softmax)."""
    return "gdpa" if flash_cfg.mode == "gdpa" else "jagged_attention"


def _forward(cfg, q, k, v, lay):
    if cfg.forward == "mosaic":
        kern = mosaic_forward(cfg, q.dtype, q.shape[-1], q.shape[0], k.shape[0])
        if kern is not None:
            out = kern(q, k, v, lay)
            return out if cfg.mode == "softmax" else (out, None)
    return triton_forward(cfg, q, k, v, lay)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg, q, k, v, lay):
    return _forward(cfg, q, k, v, lay)[0]


def _flash_fwd(cfg, q, k, v, lay):
    o, lse = _forward(cfg, q, k, v, lay)
    return o, (q, k, v, lay, o, lse)


def _flash_bwd(cfg, res, do):
    q, k, v, lay, o, lse = res
    mcfg = None
    if cfg.backward == "mosaic":
        mcfg = mosaic_backward(cfg, q.dtype, q.shape[-1], q.shape[0], k.shape[0])
    if mcfg is None:
        dq, dk, dv = triton_backward(cfg, q, k, v, lay, o, lse, do)
    else:
        h, tq = q.shape[1], q.shape[0]
        if cfg.mode != "softmax":
            lse = delta = jnp.zeros((h, tq), F32)                         # unread
        elif not mcfg.fused_dq:
            delta = None                                  # the dQ kernel computes it from o
        else:
            delta = softmax_delta(o, do)
        dq, dk, dv = mosaic.run_backward(mcfg, lay, q, k, v, do, lse, delta,
                                         interpret=cfg.interpret, o=o)
    zero_lay = jax.tree.map(_zero_cotangent, lay)
    return dq, dk, dv, zero_lay


def _zero_cotangent(x):
    if jnp.issubdtype(x.dtype, jnp.integer):
        return jnp.zeros(x.shape, jax.dtypes.float0)
    return jnp.zeros_like(x)


_flash.defvjp(_flash_fwd, _flash_bwd)
def jagged_flash(cfg, q, k, v, q_offsets, kv_offsets, rope_positions=None, rope_theta=None):
    """q [Tq,H,D], k/v [Tk,H,D], offsets [B+1] -> [Tq,H,D] in q.dtype; differentiable.

    cfg: a FlashConfig (kernels.triton.tuning). Capacities are padded to a multiple of 128
    internally; padding rows come out 0. Tiles are adapted to the shapes (adapt_tiles);
    16-bit inputs form GDPA's silu / gelu_tanh through tanh.approx (~5e-4 relative, far
    below bf16's 2e-2 budget; fast_act), float32 keeps the exact formulas.
    """
    tq, h, d = q.shape
    tk = k.shape[0]
    cfg = dataclasses.replace(cfg, fast_act=jnp.dtype(q.dtype).itemsize == 2)
    cfg = adapt_tiles(cfg, tq, tk, q_offsets.shape[0] - 1, q.dtype)
    cfg = dataclasses.replace(cfg, fused_bwd=fused_backward_side(cfg, tq, tk,
                                                                 q_offsets.shape[0] - 1))
    step = 16 * (2 if cfg.rope else 1)
    if d % step:
        raise ValueError(f"pallas attention: head dim D={d} must be a multiple of {step} "
                         "(Triton dots need every dim >= 16); use impl='reference'")
    for name, engine in (("forward", cfg.forward), ("backward", cfg.backward)):
        if engine not in ("triton", "mosaic"):
            raise ValueError(f"pallas attention: {name} must be 'triton' or 'mosaic', got {engine!r}")
    cfg = backward_knobs(cfg)
    for t in (cfg.bq, cfg.bk, cfg.bq_dkv, cfg.bk_dkv):
        if t < 16 or PAD_MULTIPLE % t:
            raise ValueError(f"pallas attention: tile {t} must be >= 16 and divide {PAD_MULTIPLE}")
    if q_offsets.shape[0] == 1:  # no samples
        return jnp.zeros_like(q)
    tqp = -(-tq // PAD_MULTIPLE) * PAD_MULTIPLE
    tkp = -(-tk // PAD_MULTIPLE) * PAD_MULTIPLE
    if rope_positions is not None:
        rope_positions = pad_rows(rope_positions, tqp)
    lay = build_layout(cfg, q_offsets, kv_offsets, tqp, tkp, d // 2 * 2 if cfg.rope else d,
                       rope_positions, rope_theta)
    lay = {kk: vv for kk, vv in lay.items()}
    out = _flash(cfg, pad_rows(q, tqp), pad_rows(k, tkp), pad_rows(v, tkp), lay)
    return out[:tq]




# ------------------------------------------------------------------- the ops on the kernels

def gdpa_pallas(q, k, v, q_offsets, kv_offsets, *, activation="silu", scale=1.0, causal=False,
                window=None, **tiles):
    """Same contract as kernels.gdpa.gdpa; `tiles` overrides the Triton tuning
    (TUNING["gdpa"]) and FlashConfig's engine fields (forward, backward, mosaic_fwd,
    mosaic_bwd: benchmarks and tests)."""
    cfg = FlashConfig(mode="gdpa", activation=activation, scale=float(scale), causal=causal,
                      window=window, interpret=jax.default_backend() != "gpu",
                      **{**tuning_of("gdpa"), **tiles})
    return jagged_flash(cfg, q, k, v, q_offsets, kv_offsets)


def jagged_attention_pallas(q, k, v, q_offsets, kv_offsets, *, sm_scale=None, causal=False,
                            window=None, **tiles):
    """Same contract as kernels.jagged_attention.jagged_attention; `tiles` as gdpa_pallas's."""
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    cfg = FlashConfig(mode="softmax", scale=float(sm_scale), causal=causal, window=window,
                      interpret=jax.default_backend() != "gpu",
                      **{**tuning_of("jagged_attention"), **tiles})
    return jagged_flash(cfg, q, k, v, q_offsets, kv_offsets)


def block_attention_pallas(q, k, v, offsets, *, block=64, positions=None, rope_theta=10_000.0,
                           sm_scale=None, **knobs):
    """Same contract as kernels.block_attention.block_attention.

    knobs: engine ("per_block" or "tiled"; default ENGINE), then BLOCK_KNOBS of the
    per-block kernel, or TritonTuning fields when the block goes to the tiled kernels
    (engine="tiled", or a block size the per-block kernel does not take).
    """
    t, _, d = q.shape
    sm_scale = d ** -0.5 if sm_scale is None else sm_scale
    interpret = jax.default_backend() != "gpu"
    knobs = dict(knobs)
    engine = knobs.pop("engine", ENGINE)
    if engine not in ("per_block", "tiled"):
        raise ValueError(f"block_attention_pallas: engine must be 'per_block' or 'tiled', got {engine!r}")
    if engine == "tiled" or not per_block_kernel_fits(block, q.dtype):
        if padded_head_dim("block_attention", d) != d:
            raise ValueError(f"pallas block_attention: the tiled engine (block={block}, "
                             f"engine={engine!r}) needs D/2 a power of two >= 16, got D={d}; "
                             "use impl='reference' or a block of 16, 32 or 64")
        cfg = FlashConfig(mode="softmax", scale=float(sm_scale), block=block, rope=True,
                          interpret=interpret, **{**tuning_of("block_attention"), **knobs})
        return jagged_flash(cfg, q, k, v, offsets, offsets, rope_positions=positions,
                            rope_theta=float(rope_theta))
    dp = padded_head_dim("block_attention", d)
    if dp is None:
        raise ValueError(f"pallas block_attention: head dim D={d} must be even with D/2 at most "
                         f"{MAX_PADDED['block_attention']} or a power of two >= 16 (RoPE works on "
                         "halves, each zero-padded to a power of two; Triton block shapes); "
                         "use impl='reference'")
    unknown = set(knobs) - set(BLOCK_KNOBS)
    if unknown:
        raise ValueError(f"block_attention_pallas: unknown knobs {sorted(unknown)} for the "
                         f"per-block kernel (have {sorted(BLOCK_KNOBS)})")
    offsets = offsets.astype(jnp.int32)
    groups = [int(knobs.get(g, BLOCK_KNOBS[g])) for g in ("group", "group_bwd")]
    if min(groups) < 1:
        raise ValueError(f"block_attention_pallas: group and group_bwd must be >= 1, got {groups}")
    for name in ("rope_chunks", "rope_chunks_bwd"):
        if name not in knobs:   # the default, down to what D/2 splits into (>= 16 columns)
            knobs[name] = max([c for c in range(1, BLOCK_KNOBS[name] + 1)
                               if (dp // 2) % c == 0 and dp // 2 // c >= 16] or [1])
        chunks = int(knobs[name])
        if chunks < 1 or (dp // 2) % chunks or (chunks > 1 and dp // 2 // chunks < 16):
            raise ValueError(f"block_attention_pallas: {name}={chunks} must divide D/2 = "
                             f"{dp // 2} into chunks of at least 16 columns (Triton dots)")
    # idle programs (len 0, write 0) fill the last group of either kernel: built into
    # the table, not padded onto it (a pad is an XLA kernel launch per call)
    tab = block_table(offsets, t, block, multiple=math.lcm(*groups))
    # On GPU masked lanes never touch memory, so reads past T are harmless. Interpret
    # mode slices with clamped starts instead: pad there so every block read fits.
    pad = (lambda x: jnp.pad(x, [(0, block)] + [(0, 0)] * (x.ndim - 1))) if interpret else (
        lambda x: x)
    (f1, f2, f3), cs = rope_freq_parts(d, rope_theta)     # the real D's frequencies
    # padded halves [x1 | 0 | x2 | 0]: zero frequencies on the zero lanes (cos 1, sin 0)
    rope = tuple(jnp.asarray(np.pad(f, (0, (dp - d) // 2))) for f in (f1, f2, f3))
    # RoPE scores depend on position differences only: rot(q, a + r) . rot(k, a + c) =
    # rot(q, r) . rot(k, c), and gradients rotated back by rot(., a + r)^T match likewise.
    # With the default positions (the index within the sample) a block's tokens sit at
    # a + 0..block-1 for one a per block, so the kernels rotate by the offset r in the
    # block: no positions to load, and small angles (see _trig).
    if positions is not None:
        rope = (pad(positions.astype(jnp.int32)), *rope)
    if dp != d:
        q, k = pad_halves(q, dp), pad_halves(k, dp)
        v = pad_head_dim(v, dp)
    cfg = (block, {**BLOCK_KNOBS, **knobs}, interpret, float(sm_scale), cs)
    out = run_block_attention(cfg, pad(q), pad(k), pad(v), tab, rope)
    return out[:t, :, :d]
