"""FLOP accounting and MFU: analytic counts, XLA's own count, peak table, MFU figures.

Counting conventions (what "model FLOPs" means in every MFU gemjax reports):
- matmuls only: a [m, k] x [k, n] product is 2 m k n; norms, activations and other
  element-wise work are not counted (XLA's ``cost_analysis`` counts adds/multiplies
  of element-wise ops too, so analytic <= XLA, close when matmuls dominate);
- attention counts only valid (query, key) pairs of the jagged layout:
  4 H D * pairs forward (Q K^T and P V), never the padded rectangle;
- embedding lookups are 0 FLOPs (memory-bound gathers);
- a training step is 3x the forward (backward = 2x: input and weight gradients);
  no recompute is counted (that would be hardware FLOPs, not model FLOPs).
- measured FLOPs of a compiled program (``compiled_flops``) are XLA's cost
  analysis, which sees nothing inside a Pallas custom call (a probe on the H200:
  4,650 "FLOPs" for a gdpa call of ~8.4 MFLOPs); gemjax.perf.local_mfu adds
  the valid-pair attention count of every Pallas-run attention call, for the
  Local-MFU layers and for the E2E step alike.

MFU figures (as GEM's training blog defines them):
- ``mfu(flops_per_step, step_time, n_devices, peak)``: achieved / peak;
- ``local_mfu``: each layer timed alone on one device, FLOP-weighted mean of the
  per-layer MFUs;
- ``scaling_ratio = e2e_mfu / local_mfu`` (so E2E MFU = Local MFU x Scaling Ratio).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# Dense peak FLOP/s per device (no sparsity), by device_kind prefix.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "NVIDIA H200": {"bf16": 989e12, "fp16": 989e12, "fp8": 1979e12, "tf32": 494e12, "fp32": 67e12},
    "NVIDIA H100": {"bf16": 989e12, "fp16": 989e12, "fp8": 1979e12, "tf32": 494e12, "fp32": 67e12},
    "NVIDIA A100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
}


def peak_flops(device_kind: str | None = None, dtype: str = "bf16", override: float | None = None) -> float:
    """Peak dense FLOP/s of one device of ``device_kind`` (default: jax.devices()[0]) in ``dtype``.

    override (e.g. from a ``--peak_flops`` flag) wins. Unknown kinds (CPU included)
    raise: pass an override, or use ``measure_peak_flops()`` for a CPU figure.
    """
    if override is not None:
        if override <= 0:
            raise ValueError(f"peak_flops override must be > 0, got {override}")
        return float(override)
    kind = device_kind if device_kind is not None else jax.devices()[0].device_kind
    matches = [k for k in PEAK_FLOPS if kind.startswith(k)]
    if not matches:
        raise ValueError(f"no peak FLOP/s for device kind {kind!r} (known: {sorted(PEAK_FLOPS)}); "
                         "pass --peak_flops, or measure_peak_flops() on CPU")
    table = PEAK_FLOPS[max(matches, key=len)]
    if dtype not in table:
        raise ValueError(f"no {dtype!r} peak for {kind!r}; known dtypes {sorted(table)}")
    return table[dtype]


def measure_peak_flops(n: int = 1024, dtype=jnp.float32, repeats: int = 5) -> float:
    """Best observed FLOP/s of an n^3 matmul on the default device (a practical CPU 'peak')."""
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda a: a @ a)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2.0 * n ** 3 / best


# ----------------------------------------------------------------------------- analytic counts


def dense_flops(m: int, k: int, n: int) -> int:
    """[m, k] @ [k, n]: 2 m k n."""
    return 2 * int(m) * int(k) * int(n)


def mlp_flops(rows: int, widths: Sequence[int]) -> int:
    """MLP with layer widths (in, h1, ..., out) applied to ``rows`` rows."""
    return sum(dense_flops(rows, a, b) for a, b in zip(widths[:-1], widths[1:]))


def wukong_layer_flops(batch: int, num_tokens: int, dim: int, *, fmb_tokens: int, lcb_tokens: int,
                       rank: int, mlp_hidden: Sequence[int] = ()) -> int:
    """One Wukong layer on x [B, n, d] (gemjax.layers.wukong.WukongLayer).

    FMB: X^T Y and X (X^T Y), each 2 B n d k, then the MLP n k -> hidden -> f d;
    LCB: W_L [l, n] along tokens, 2 B l n d; residual projection [f + l, n] when
    f + l != n, 2 B (f + l) n d.
    """
    b, n, d, k = batch, num_tokens, dim, rank
    f, l = fmb_tokens, lcb_tokens
    total = 0
    if f:
        total += 2 * dense_flops(b * n, d, k)  # X^T Y [B,d,k] sums over n; X (X^T Y) [B,n,k] over d
        total += mlp_flops(b, (n * k, *mlp_hidden, f * d))
    if l:
        total += dense_flops(b * l, n, d)
    if f + l != n:
        total += dense_flops(b * (f + l), n, d)
    return total


def wukong_flops(batch: int, num_tokens: int, dim: int, *, num_layers: int, fmb_tokens: int,
                 lcb_tokens: int, rank: int, mlp_hidden: Sequence[int] = ()) -> int:
    """A Wukong stack: the first layer maps n -> f + l tokens, the rest keep f + l."""
    total, n = 0, num_tokens
    for _ in range(num_layers):
        total += wukong_layer_flops(batch, n, dim, fmb_tokens=fmb_tokens, lcb_tokens=lcb_tokens,
                                    rank=rank, mlp_hidden=mlp_hidden)
        n = fmb_tokens + lcb_tokens
    return total


def valid_pairs(q_lengths: Sequence[int], kv_lengths: Sequence[int] | None = None, *, causal: bool = False,
                window: int | None = None, block: int | None = None) -> int:
    """Number of (query, key) pairs attention computes over a jagged batch.

    Same mask convention as kernels/common.py: causal keeps pos_k <= pos_q; window w
    keeps pos_q - pos_k < w (causal) or |pos_q - pos_k| < w; block b keeps pairs in
    the same b-token block (BlockAttention). kv_lengths default to q_lengths.
    """
    lq = np.asarray(q_lengths, np.int64)
    lk = lq if kv_lengths is None else np.asarray(kv_lengths, np.int64)
    if lq.shape != lk.shape or (lq < 0).any() or (lk < 0).any():
        raise ValueError(f"q_lengths {lq.shape} and kv_lengths {lk.shape} must match and be >= 0")
    if lq.sum() == 0:
        return 0
    sample = np.repeat(np.arange(lq.size), lq)
    i = np.arange(lq.sum()) - np.repeat(np.cumsum(lq) - lq, lq)   # position of each query
    kmax = lk[sample] - 1
    lo, hi = np.zeros_like(i), kmax.copy()
    if causal:
        hi = np.minimum(hi, i)
    if window is not None:
        lo = np.maximum(lo, i - window + 1)
        if not causal:
            hi = np.minimum(hi, i + window - 1)
    if block is not None:
        lo = np.maximum(lo, (i // block) * block)
        hi = np.minimum(hi, (i // block + 1) * block - 1)
    return int(np.maximum(hi - lo + 1, 0).sum())


def attention_flops(q_lengths: Sequence[int], kv_lengths: Sequence[int] | None = None, *, heads: int,
                    head_dim: int, causal: bool = False, window: int | None = None,
                    block: int | None = None) -> int:
    """Forward attention FLOPs over valid pairs only: 4 H D * pairs (Q K^T and P V)."""
    return 4 * heads * head_dim * valid_pairs(q_lengths, kv_lengths, causal=causal, window=window, block=block)


def embedding_flops(*_args, **_kwargs) -> int:
    """Embedding lookups count as 0 FLOPs (gathers, memory-bound)."""
    return 0


def train_step_flops(forward_flops: int) -> int:
    """Forward + backward (2x forward) model FLOPs of one training step."""
    return 3 * int(forward_flops)


# ----------------------------------------------------------------------------- XLA's count and MFU


def compiled_flops(compiled: Any, default: float | None = None) -> float:
    """FLOPs in a compiled program's cost analysis (per device for SPMD programs).

    Raises ValueError when XLA reports none, unless `default` is given.
    """
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jax: one dict per computation
        cost = cost[0] if cost else None
    if not cost or "flops" not in cost:
        if default is not None:
            return default
        raise ValueError("XLA cost analysis has no 'flops' entry")
    return float(cost["flops"])


def xla_flops(fn: Callable, *args: Any, **kwargs: Any) -> float:
    """FLOPs XLA's cost analysis reports for ``jax.jit(fn)(*args, **kwargs)`` (after optimisation)."""
    return compiled_flops(jax.jit(fn).lower(*args, **kwargs).compile())


def mfu(flops_per_step: float, step_time: float, n_devices: int, peak: float) -> float:
    """Model FLOPs utilisation: flops_per_step / (step_time * n_devices * peak)."""
    if step_time <= 0 or n_devices < 1 or peak <= 0:
        raise ValueError(f"mfu: need step_time > 0, n_devices >= 1, peak > 0; got {step_time}, {n_devices}, {peak}")
    return float(flops_per_step) / (step_time * n_devices * peak)


def local_mfu(layer_flops: Sequence[float], layer_times: Sequence[float], peak: float) -> float:
    """FLOP-weighted mean of per-layer MFUs, each layer timed alone on one device.

    sum_i (f_i / F) * f_i / (t_i * peak), F = sum_i f_i.
    """
    f = np.asarray(layer_flops, np.float64)
    t = np.asarray(layer_times, np.float64)
    if f.shape != t.shape or f.size == 0 or (t <= 0).any() or (f < 0).any() or f.sum() <= 0:
        raise ValueError(f"local_mfu: need matching non-empty flops {f.shape} / positive times {t.shape}")
    return float(np.sum(f / f.sum() * f / (t * peak)))


def scaling_ratio(e2e_mfu: float, local: float) -> float:
    """E2E MFU / Local MFU."""
    if local <= 0:
        raise ValueError(f"scaling_ratio: local MFU must be > 0, got {local}")
    return float(e2e_mfu) / float(local)


# ----------------------------------------------------------------------------- Local MFU measurement


def time_fn(fn: Callable, *args: Any, warmup: int = 2, iters: int = 10,
            clock: Callable[[], float] = time.perf_counter, jit: bool = True) -> float:
    """Median seconds of one ``jax.jit(fn)(*args)`` call (compiled, on the default device).

    jit=False: fn is already jitted or compiled (e.g. ``jit(f).lower(...).compile()``)
    and is called as is. Blocks on every call's outputs, so it times the device
    work alone (no overlap with the next call).
    """
    if iters < 1:
        raise ValueError(f"time_fn: iters must be >= 1, got {iters}")
    f = jax.jit(fn) if jit else fn
    for _ in range(warmup):
        jax.block_until_ready(f(*args))
    times = []
    for _ in range(iters):
        t = clock()
        jax.block_until_ready(f(*args))
        times.append(clock() - t)
    return float(np.median(times))


def local_mfu_report(layers: Sequence[tuple[str, Callable, tuple, float]], peak: float,
                     timer: Callable[..., float] = time_fn) -> dict:
    """Local MFU as the GEM blog defines it: each layer timed alone, FLOP-weighted.

    layers: (name, fn, args, flops) per layer; fn(*args) should run the layer's
    training work (forward + backward, no recompute) on one device with args
    already there; flops is its analytic count (e.g. train_step_flops(fwd)).
    Returns {"layers": [{name, flops, seconds, mfu}], "local_mfu": float}.
    """
    rows = []
    for name, fn, args, flops in layers:
        seconds = timer(fn, *args)
        rows.append({"name": name, "flops": float(flops), "seconds": seconds, "mfu": flops / (seconds * peak)})
    return {"layers": rows, "local_mfu": local_mfu([r["flops"] for r in rows], [r["seconds"] for r in rows], peak)}
