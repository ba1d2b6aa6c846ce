"""The attention benchmark workloads of issue 6 (bf16, 4 heads, head dim 128; lengths seed 0).

  W1 jagged self: 64 samples, log-normal lengths, median 512, sigma 0.8, in [16, 4096]
  W2 cross, short K/V: 256 samples, Q median 256 (same sigma and clip), 32 K/V each
  W3 PMA, short Q: 256 samples, 16 queries each, K/V lengths drawn as W1's
  W4 BlockAttention on W1's lengths

Shared by bench_attention.py and bench_gdpa_mosaic.py (time them) and
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
    if name == "W2":
        return "cross", lognormal_lengths(rng, 256, 256), np.full(256, 32)
    if name == "W3":
        return "pma", np.full(256, 16), lognormal_lengths(rng, 256, 512)
    raise ValueError(f"unknown workload {name!r}")


def time_calls(fn, *args, iters: int = 20) -> float:
    """Seconds per call: `iters` calls issued back to back, one sync at the end.

    Dispatch overlaps with execution, so this is device time per call for anything
    longer than the ~10 us dispatch (median of 3 such rounds, after 2 warm-up calls).
    """
    import jax
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    rounds = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        rounds.append((time.perf_counter() - t0) / iters)
    return float(np.median(rounds))


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
    (kernels/mosaic_flash.py) as ints, 0 / 1 for its bool fields; ValueError if malformed."""
    import dataclasses
    from kernels.mosaic_flash import MosaicConfig
    bools = {f.name for f in dataclasses.fields(MosaicConfig) if f.type in (bool, "bool")}
    knobs = {}
    for part in filter(None, spec.split("+")):
        key, _, val = part.partition("=")
        knobs[key.strip()] = int(val)
    return {k: bool(v) if k in bools else v for k, v in knobs.items()}


def parse_variant(spec):
    """'softmax_mosaic[fused_delta=1]' -> ('softmax', 'mosaic', (('fused_delta', True),)):
    an op (gdpa / softmax, or block: the per-block kernel, triton only), an engine
    (triton / mosaic) and Mosaic backward knobs (parse_mosaic_knobs, sorted);
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


# Per-block kernel (W4): num_warps:num_stages:group[:rope_chunks] for the forward,
# num_warps_bwd:num_stages_bwd:group_bwd[:rope_chunks_bwd] for the backward. First the
# chunked-RoPE sets (registers per the resource report: forward 8:1:1:4 80, 4:1:1:4 130;
# backward 8:1:1:4 123, 4:1:1:2 168, against 244 / 255 + spill unchunked), then the
# unchunked sets (the forward default 4:2:4 among them; the backward default is
# 4:1:1:2) and the rest. 2:1:1 was 2.6x slower.
BLOCK_FWD_GRID = ["4:2:2:2", "4:2:4:2", "4:2:4:4", "4:2:2:4", "4:1:1:2", "4:3:4:2",
                  "4:2:2", "4:2:4", "4:1:1", "4:1:2", "4:3:2", "4:3:4", "4:2:8", "8:2:2"]
BLOCK_BWD_GRID = ["4:1:1:2", "4:2:1:2", "4:1:2:2", "4:2:2:2", "4:1:4:2", "4:1:1:4", "4:2:1:4",
                  "4:1:1", "4:2:1", "4:1:2", "8:1:1:2"]


def block_knobs_fwd(spec):
    """BLOCK_FWD_GRID entry 'warps:stages:group[:rope_chunks]' -> per-block kernel knobs."""
    nw, ns, g, *ch = (int(x) for x in spec.split(":"))
    from kernels.block_attention.pallas import BLOCK_KNOBS
    return {**BLOCK_KNOBS, "num_warps": nw, "num_stages": ns, "group": g,
            "rope_chunks": ch[0] if ch else 1}


def block_knobs_bwd(spec):
    """BLOCK_BWD_GRID entry 'warps:stages:group[:rope_chunks_bwd]' -> knobs."""
    nw, ns, g, *ch = (int(x) for x in spec.split(":"))
    from kernels.block_attention.pallas import BLOCK_KNOBS
    return {**BLOCK_KNOBS, "num_warps_bwd": nw, "num_stages_bwd": ns, "group_bwd": g,
            "rope_chunks_bwd": ch[0] if ch else 1}
