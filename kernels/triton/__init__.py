"""Tiled jagged attention on the Pallas Triton backend: forward, dQ and dK/dV kernels.

One engine serves the three public ops (kernels/gdpa, kernels/jagged_attention,
kernels/block_attention), through kernels.dispatch.jagged_flash:

    tuning.py    TUNING (per op a TritonTuning, block_attention a BlockTuning), the
                 values the kernels run with; AttentionSpec (what an op computes);
                 FlashConfig (a spec + a tuning); the rules that adapt a tuning to a
                 call's shapes
    layout.py    row intervals, tile ranges, launch order, RoPE tables (XLA, from offsets)
    tile.py      in-kernel pieces: activations, dots, masks, RoPE tile loads / stores
    launch.py    pallas_call plumbing (block specs, ref order, compiler params)
    forward.py   the forward kernel (run_forward)
    backward.py  the dQ and dK / dV kernels and the fused forms (run_backward)
    block.py     block_attention's per-block kernel (one program per block, RoPE fused)

Scores S = Q K^T of one (query tile, key tile, head) are
formed in registers and turned into P by either
  "gdpa":     P = act(S) * scale                     (no normalisation)
  "softmax":  P = exp(S * sm_scale - lse)             (online softmax, flash-style,
                                                       computed in base 2 with exp2)
then masked with the exact pair mask of kernels.common (same sample, causal,
window, block) and multiplied into V. Only key tiles that can hold a valid pair
are visited: per query tile the range [first, last] key tile is precomputed from
the offsets (and per key tile the query-tile range for dK/dV), so tiles with no
valid pair cost nothing. Tiles whose pairs are all valid ("interior", a
precomputed [first, last) range per tile) skip the mask. With `rope`, q and k
tiles are rotated on load (rotate-half, in two D/2 halves) and dQ/dK are rotated
back before storing: the RoPE backward is fused. GDPA silu / gelu_tanh can run
through tanh.approx (fast_act, for 16-bit inputs). Tiles launch heaviest-first (most
inner-loop work first; in order where the inner loop runs over a short side).

Backward: dQ kernel (grid over query tiles) and dK/dV kernel (grid over key
tiles), no atomics. Where one side is short (at most SHORT_SIDE tokens per sample:
PMA's 16 learned queries, cross-attention to 32 keys) the kernel over the short
side's tiles also stores the long side's gradient rows whose whole interval lies
in its tile (`fused_bwd` "q_rows" / "k_rows"), so the other kernel only runs for
tiles holding rows that straddle a tile edge. Softmax needs delta = rowsum(dO * O),
computed in XLA. Triton dots need every dim >= 16, so tiles are >= 16 and D (D/2 with rope) must
be a multiple of 16."""

from kernels.triton.backward import run_backward, softmax_delta
from kernels.triton.forward import run_forward
from kernels.triton.layout import build_layout
from kernels.triton.tuning import (BLOCK_KNOBS, FUSED_BWD, PAD_MULTIPLE, TUNING, AttentionSpec,
                                   BlockTuning, FlashConfig, TritonTuning, adapt_tiles,
                                   tuning_of)

__all__ = ["BLOCK_KNOBS", "FUSED_BWD", "PAD_MULTIPLE", "TUNING", "AttentionSpec", "BlockTuning",
           "FlashConfig", "TritonTuning", "adapt_tiles", "build_layout", "run_backward",
           "run_forward", "softmax_delta", "tuning_of"]
