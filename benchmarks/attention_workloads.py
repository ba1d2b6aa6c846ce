"""The attention benchmark workloads of issue 6 (bf16, 4 heads, head dim 128; lengths seed 0).

  W1 jagged self: 64 samples, log-normal lengths, median 512, sigma 0.8, in [16, 4096]
  W2 cross, short K/V: 256 samples, Q median 256 (same sigma and clip), 32 K/V each
  W3 PMA, short Q: 256 samples, 16 queries each, K/V lengths drawn as W1's
  W4 BlockAttention on W1's lengths
  G1 BlockAttention at the gem1b pyramid's size: 1,024 samples, log-normal lengths,
     median 1,024, sigma 0.6, in [1, 8192] (~1.25M tokens; one event sequence of a step).
     bench_attention closes over the offsets, so XLA folds the block table at compile
     time (13 s a compile on an H200 host at this size); XLA_FLAGS=
     --xla_disable_hlo_passes=constant_folding builds it at run time, as training does

Shared by bench_attention.py, bench_gdpa_mosaic.py and ab_attention.py (time them) and
triton_report.py (lowers the kernels on their shapes); no flags here, so all can
import it.
"""

import time

import numpy as np


def lognormal_lengths(rng, n, median, sigma=0.8, lo=16, hi=4096):
    return np.clip(rng.lognormal(np.log(median), sigma, n).astype(np.int64), lo, hi)


def workload(name):
    """(kind, q_lengths, kv_lengths) with lengths drawn from seed 0."""
    rng = np.random.default_rng(0)
    if name in ("W1", "W4"):
        lens = lognormal_lengths(rng, 64, 512)
        return ("self" if name == "W1" else "block"), lens, lens
    if name == "G1":
        lens = lognormal_lengths(rng, 1024, 1024, sigma=0.6, lo=1, hi=8192)
        return "block", lens, lens
    if name == "W2":
        return "cross", lognormal_lengths(rng, 256, 256), np.full(256, 32)
    if name == "W3":
        return "pma", np.full(256, 16), lognormal_lengths(rng, 256, 512)
    raise ValueError(f"unknown workload {name!r}")


def time_stream(fn, *args, iters: int = 20, warm_s: float = 0.3,
                pairs: int = 3) -> tuple[float, float]:
    """(seconds per call in a steady stream, seconds per call of one round of 2 * iters).

    First fn runs back to back for warm_s seconds: the H200 reaches its 700 W power cap
    within tens of ms of dense matmul work and its SM clock then drops (1980 to ~1455
    MHz measured on W1), so W1's forward+backward runs ~9% slower sustained than in a
    burst of 5 calls. The figures here are the sustained ones a training run sees, for
    every row alike; a row timed right after a lighter one would otherwise start
    at the boost clock.

    A round issues its calls back to back with one sync at the end, so dispatch overlaps
    with execution. It also holds a fixed cost: the first call's dispatch latency and
    the final sync, about 0.2 ms on the H200 machine (its one-element jit takes 50 us per
    call), i.e. 10 us per call in a round of 20. The steady figure drops it: the slope
    between rounds of iters and 2 * iters calls, (t(2n) - t(n)) / n. A function whose
    dispatch takes longer than its device time stays dispatch-bound in both figures.
    Medians of `pairs` round pairs, after the warm-up. Where noise makes the median slope
    not positive (rounds of a few fast calls), the steady figure is the round's.
    """
    import jax

    def round_s(n):
        t0 = time.perf_counter()
        for _ in range(n):
            out = fn(*args)
        jax.block_until_ready(out)
        return time.perf_counter() - t0

    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < warm_s:
        round_s(iters)
    slopes, rounds = [], []
    for _ in range(pairs):
        short, long = round_s(iters), round_s(2 * iters)
        slopes.append((long - short) / iters)
        rounds.append(long / (2 * iters))
    slope, per_round = float(np.median(slopes)), float(np.median(rounds))
    return (slope if slope > 0 else per_round), per_round


def runnable(fns, passes):
    """(the variants whose passes all compile and run once, {variant: error} of the
    others); fns[variant][pass] = (f, args)."""
    import jax
    ok, errors = {}, {}
    for name, by_pass in fns.items():
        try:
            for p in passes:
                f, args = by_pass[p]
                jax.block_until_ready(f(*args))
            ok[name] = by_pass
        except Exception as e:  # noqa: BLE001 (e.g. shared memory over the budget)
            errors[name] = f"{p}: {type(e).__name__}: {str(e)[:300]}"
            print(f"{name}: {errors[name]}", flush=True)
    return ok, errors


def time_calls(fn, *args, iters: int = 20) -> float:
    """Seconds per call in a steady stream of calls (time_stream's first figure)."""
    return time_stream(fn, *args, iters=iters)[0]


def valid_pairs(kind, ql, kl, block=64):
    """Valid (query, key) pairs of a workload: sum Lq * Lk, or within 64-token blocks."""
    if kind != "block":
        return int(np.sum(ql.astype(np.int64) * kl))
    full, rem = ql // block, ql % block
    return int(np.sum(full * block * block + rem * rem))


def pack_arrays(ql, kl, h, d, dtype, rng):
    """Random packed q [Tq,H,D], k, v [Tk,H,D], do [Tq,H,D] (capacities rounded up to 128)
    and int32 offsets qo, ko [B+1] for the lengths ql, kl."""
    import jax.numpy as jnp
    tq = int(-(-ql.sum() // 128) * 128)
    tk = int(-(-kl.sum() // 128) * 128)
    mk = lambda t: jnp.asarray(rng.normal(size=(t, h, d)) * 0.5, dtype)  # noqa: E731
    q, k, v, do = mk(tq), mk(tk), mk(tk), mk(tq)
    qo = jnp.asarray(np.concatenate([[0], np.cumsum(ql)]), jnp.int32)
    ko = jnp.asarray(np.concatenate([[0], np.cumsum(kl)]), jnp.int32)
    return q, k, v, do, qo, ko


def parse_mosaic_knobs(spec):
    """'block_kv=64+num_stages=4' -> {'block_kv': 64, 'num_stages': 4}: MosaicConfig knobs
    (kernels/mosaic/tuning.py) as ints, 0 / 1 for its bool fields; ValueError if malformed."""
    import dataclasses
    from kernels.mosaic import MosaicConfig
    bools = {f.name for f in dataclasses.fields(MosaicConfig) if f.type in (bool, "bool")}
    knobs = {}
    for part in filter(None, spec.split("+")):
        key, _, val = part.partition("=")
        knobs[key.strip()] = int(val)
    return {k: bool(v) if k in bools else v for k, v in knobs.items()}


def parse_variant(spec):
    """'softmax_mosaic[fused_dq=1]' -> ('softmax', 'mosaic', (('fused_dq', True),)):
    an op (gdpa / softmax, or block: the per-block kernel, triton only), an engine
    (triton / mosaic) and MosaicConfig knobs (parse_mosaic_knobs, sorted);
    ValueError if malformed."""
    name, _, knobs = spec.partition("[")
    op, _, engine = name.partition("_")
    if (op not in ("gdpa", "softmax", "block") or engine not in ("triton", "mosaic")
            or (op == "block" and (engine != "triton" or knobs))):
        raise ValueError(f"variant {spec!r}: want gdpa|softmax _ triton|mosaic [knobs], "
                         "or block_triton")
    if knobs and not knobs.endswith("]"):
        raise ValueError(f"variant {spec!r}: unclosed '['")
    return op, engine, tuple(sorted(parse_mosaic_knobs(knobs[:-1]).items()))


def stream_same_bytes(q, k, v):
    """XLA moving the bytes the floor counts, for the memory-bound rows' measured floor:
    forward reads q, k, v and writes o; backward reads q, k, v, dO, writes dQ, dK, dV."""
    return q + k + v


def stream_same_bytes_train(q, k, v, do):
    import jax
    o = stream_same_bytes(q, k, v)
    q, k, v, do = jax.lax.optimization_barrier((q, k, v, do, o))[:4]   # a second pass
    return o, (q + do, k + do, v + do)


def fwd_and_train(fn):
    """(jit forward, jit forward+backward) of fn(q, k, v). forward+backward returns the
    output beside the gradients, as a training step uses both: GDPA's backward does not
    read the forward's output, so without it XLA would drop the forward."""
    import jax
    fwd = jax.jit(fn)

    def train(q, k, v, do):
        o, vjp = jax.vjp(fn, q, k, v)
        return o, vjp(do)
    return fwd, jax.jit(train)


def op_fn(op, engine, knobs, qo, ko, scale):
    """fn(q, k, v) of a parse_variant triple on offsets qo, ko (GDPA: SiLU with `scale`).
    The knobs go to all three Mosaic kernels; each takes the ones it has (forward-only
    knobs leave the backward as it is, and the other way round)."""
    from kernels.dispatch import block_attention_pallas
    from kernels.dispatch import gdpa_pallas
    from kernels.dispatch import jagged_attention_pallas
    if op == "block":
        return lambda q, k, v: block_attention_pallas(q, k, v, qo)
    kw = dict(forward=engine, backward=engine, mosaic_fwd=knobs, mosaic_bwd=knobs)
    if op == "gdpa":
        return lambda q, k, v: gdpa_pallas(q, k, v, qo, ko, activation="silu", scale=scale, **kw)
    return lambda q, k, v: jagged_attention_pallas(q, k, v, qo, ko, **kw)


# Per-block kernel (W4): num_warps:num_stages:group[:rope_chunks] for the forward,
# num_warps_bwd:num_stages_bwd:group_bwd[:rope_chunks_bwd] for the backward. First the
# chunked-RoPE sets (registers per the resource report: forward 8:1:1:4 80, 4:1:1:4 130;
# backward 8:1:1:4 123, 4:1:1:2 168, against 244 / 255 + spill unchunked), then the
# unchunked sets (the forward default 4:2:4 among them; the backward default is
# 4:1:1:2) and the rest. 2:1:1 ran 2.6x slower.
BLOCK_FWD_GRID = ["4:2:2:2", "4:2:4:2", "4:2:4:4", "4:2:2:4", "4:1:1:2", "4:3:4:2",
                  "4:2:2", "4:2:4", "4:1:1", "4:1:2", "4:3:2", "4:3:4", "4:2:8", "8:2:2"]
BLOCK_BWD_GRID = ["4:1:1:2", "4:1:1:2:e", "4:2:2:2:e", "4:2:1:2", "4:1:2:2", "4:2:2:2", "4:1:4:2",
                  "4:1:1:4", "4:2:1:4", "4:1:1", "4:2:1", "4:1:2", "8:1:1:2", "8:1:1:2:e"]


def block_knobs_fwd(spec):
    """BLOCK_FWD_GRID entry 'warps:stages:group[:rope_chunks]' -> per-block kernel knobs."""
    nw, ns, g, *ch = (int(x) for x in spec.split(":"))
    from kernels.triton.tuning import BLOCK_KNOBS
    return {**BLOCK_KNOBS, "num_warps": nw, "num_stages": ns, "group": g,
            "rope_chunks": ch[0] if ch else 1}


def block_knobs_bwd(spec):
    """BLOCK_BWD_GRID entry 'warps:stages:group[:rope_chunks_bwd[:e]]' -> knobs (e:
    early_loads_bwd)."""
    parts = spec.split(":")
    early = parts[-1] == "e"
    nw, ns, g, *ch = (int(x) for x in (parts[:-1] if early else parts))
    from kernels.triton.tuning import BLOCK_KNOBS
    return {**BLOCK_KNOBS, "num_warps_bwd": nw, "num_stages_bwd": ns, "group_bwd": g,
            "rope_chunks_bwd": ch[0] if ch else 1, "early_loads_bwd": early}
