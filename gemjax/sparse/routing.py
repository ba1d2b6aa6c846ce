"""Per-device id routing for one table, run inside `jax.shard_map`.

Forward (`lookup_rows`), for the N ids a device holds for one table:
  1. dedupe: sort + unique (invalid ids sort last), so each row travels once;
  2. bucket the unique ids by owning model shard (stable sort by owner), give
     each a slot `owner * C + rank`; ranks >= C overflow (zero row, counted);
  3. all_to_all the [S_m, C] requests over the model axes;
  4. gather the requested rows locally (fs2d: all-gather the requests over the
     replica axes, each sub-shard fills the rows it owns, psum_scatter back);
  5. all_to_all the [S_m, C, D] rows back, un-permute to unique order, then to
     the original ids.

Backward (`route_grads`) retraces the same slots: per-id grads are summed per
unique id (segment_sum), sent to the owner through the inverse all_to_all,
and (2d / replicated) all-gathered over the replica axes so every replica
applies the same update; `update_rows` dedupes again on the owner (sort +
segment_sum) and runs the fused optimizer on the touched rows only.

Duplicate summing, `dedup=`:
  "sort"     one stable key-value sort of the ids gives the permutation `perm`
             and each sorted position's unique index `seg` (a cumsum over run
             starts, so non-decreasing); grads are summed as
             segment_sum(g[perm], seg, indices_are_sorted=True): runs of equal
             rows are contiguous, so the scatter-add meets few collisions.
             The forward's sort is kept in the residual and reused.
  "sort_scatter"  the same sort for the dedupe, then the inverse index (an
             int32 scatter) and an unsorted segment_sum by it: on GPU an
             unsorted scatter-add spreads a hot row's adds over time, while
             sorted order makes neighbouring threads collide on it (measured
             on H200, Zipf 1.05: sorted 2.5 ms vs unsorted 1.7 ms for 1.3M ids).
  "scatter"  jnp.unique(return_inverse) + segment_sum by the inverse (unsorted
             scatter-add), the plain jnp path.
All give the same unique ids in the same (ascending) order; sums may differ
in float rounding only (summation order).
The sort path's sum, `segment_sum=`: "xla" (XLA's sorted segment_sum, an atomic
scatter-add: on one H200 its gem1b calls, N = 2.6M, D = 512, took ~25 ms each),
"pallas" (kernels.segment_sum, a Pallas Triton kernel that writes each row once)
or "auto" (default: pallas on GPU, xla elsewhere); train.sparse_segment_sum.
Small segment counts, `onehot_rows=` (opt-in, 0 = off; sparse.onehot_rows):
where K <= onehot_rows and every source row is read by one position (unpooled
features), the sum is one_hot(segment of each source row, K)^T @ g over the rows
in their own order (`onehot_sums`): a sequential read of g instead of a row
gather in sorted order. Its GPU timing is not measured yet.

Row update, `update_impl=` (`update_rows`, `update_unique_bucketed`):
  "xla"     segment_sum, gather the touched rows, optimizer, scatter back (default).
  "pallas"  `kernels.sparse_update` (impl "pallas"): one Pallas Triton pass over the sorted
            ids sums each unique row's grads in registers and applies row-wise
            Adagrad in place (RowWiseAdagrad only; D a power of two >= 16). Uses
            the sort residual ({"perm", "seg"}); from an {"inv"} residual it sorts
            the inverse once more. Interpret mode off GPU (slow: tests only).

`sync_update_bucketed` (a local copy kept in sync over replicas: replicated, or
2d with a one-device model group): each replica sums its duplicates, then the
replicas all-gather only the smallest bucket holding every replica's unique
rows (pmax), not all N per-id slots (for the h200 teacher on two replicas the
all-N gathers send ~2.9 GB per device per step, estimated from the compiled
step's shapes).

`update_unique_bucketed` (local tables): the duplicate sum and the row update
run on the smallest static bucket of unique rows >= the batch's actual count
(lax.switch), instead of N rows, so their cost follows U. With buckets the
sorted segment_sum is the fastest (H200, 1e8 x 128, Zipf 1.05, 1.3M ids:
step 1.98 ms vs 2.74 ms sort_scatter with buckets off).

Exchange capacity buckets (`lookup_rows(exchange_buckets=...)`,
`route_update_bucketed`): C is sized for the worst case, but Zipf ids dedupe
to far fewer unique ids per destination. With buckets (fractions of C, full C
last, `exchange_caps`), the largest per-destination unique count, pmax'd over
the mesh so every device of an all_to_all agrees, picks the smallest capacity
c that holds it; a lax.switch runs the exchange at [S_m, c] ids / [S_m, c, D]
rows, and the backward reuses the branch (residual "xb") for the grads and
the replica all-gathers. Slots stay in full-C coordinates in the residual
(`rebucket_slots` maps them per branch), so results and overflow are those of
the static path; only the full-C branch can overflow.

Fixed branches (`branch=` of `lookup_rows`, `route_update_bucketed`,
`sync_update_bucketed`): XLA:GPU keeps a lax.switch whose branches hold
collectives out of its CUDA graphs and runs it as a host conditional: it copies
the index to the host and waits for the device to get there, so the host cannot
queue the next step while this one runs (2 H200s, h200 teacher: 20-30 ms of idle
device per step; 83 ms on fsdp=2). `bucket_needs` counts, without collectives,
what the switches need; computed from the batch before the step
(EmbeddingCollection.branch_needs / branch_plan, gemjax.train.planned.PlannedStep),
the branch is a trace-time constant and the switch disappears (same results;
on those GPUs fsdp=2 takes 171 ms per step against 232 with the host conditional,
replica=2 159 against 164).

Shapes (per device): ids [N] int32, weights [rows_per_shard, D], C static.
Row indices use -1 for "no row".
"""

from __future__ import annotations

import math
import operator
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from kernels.segment_sum import sorted_segment_sum
from kernels.sparse_update import row_wise_adagrad
from gemjax.sparse.optimizers import RowWiseAdagrad
from gemjax.sparse.plans import Layout

Array = Any
INVALID = jnp.iinfo(jnp.int32).max
DEDUPS = ("sort", "sort_scatter", "scatter")
DEFAULT_BUCKETS = (0.25, 0.375, 0.5)
DEFAULT_EXCHANGE_BUCKETS = (0.125, 0.25, 0.5)
UPDATE_IMPLS = ("xla", "pallas")
SEGMENT_SUMS = ("auto", "xla", "pallas")


def sorted_unique(key: Array):
    """key [N] int32 (INVALID = none) -> (uniq [N], perm [N], seg [N]) int32.

    uniq: the distinct keys ascending, INVALID-filled past the last one (an
    INVALID key, if any, is itself the last entry); perm: the stable sort
    permutation (key[perm] ascending); seg: the unique index of each sorted
    position, non-decreasing, so uniq[seg] == key[perm].
    """
    n = key.shape[0]
    sk, perm = jax.lax.sort_key_val(key, jnp.arange(n, dtype=jnp.int32), is_stable=True)
    start = jnp.concatenate([jnp.ones((1,), bool), sk[1:] != sk[:-1]])
    seg = jnp.cumsum(start, dtype=jnp.int32) - 1
    uniq = jnp.full((n,), INVALID, jnp.int32).at[jnp.where(start, seg, n)].set(
        sk, mode="drop", indices_are_sorted=True, unique_indices=True)
    return uniq, perm, seg


def dedup_ids(key: Array, dedup: str):
    """key [N] int32 (INVALID = none) -> (uniq [N], residual dict) for `dedup`.

    residual: {"inv": [N]} (scatter) or {"perm": [N], "seg": [N]} (sort).
    """
    if dedup not in DEDUPS:
        raise ValueError(f"dedup must be one of {DEDUPS}, got {dedup!r}")
    n = key.shape[0]
    if dedup == "scatter":
        uniq, inv = jnp.unique(key, size=n, fill_value=INVALID, return_inverse=True)
        return uniq, {"inv": inv.reshape(-1).astype(jnp.int32)}
    uniq, perm, seg = sorted_unique(key)
    if dedup == "sort_scatter":
        return uniq, {"inv": inverse({"perm": perm, "seg": seg})}
    return uniq, {"perm": perm, "seg": seg}


def inverse(res: dict) -> Array:
    """The unique index of every original position, [N] int32, from either residual."""
    if "inv" in res:
        return res["inv"]
    return jnp.zeros_like(res["perm"]).at[res["perm"]].set(res["seg"], unique_indices=True)


def sum_duplicates(g: Array, res: dict, num_segments: int, src_index: Array | None = None,
                   segment_sum: str = "auto", onehot_rows: int = 0) -> Array:
    """Per-position grads -> per-unique-id sums [num_segments, D] float32.

    g [N, D] per position, or with src_index [N] int32 a source [M, D] of which
    position i takes row src_index[i] (pooled bags: one row per bag), so the
    [N, D] per-position grads are never built: the sort path reads
    g[src_index[perm]] straight into the sorted segment sum. g may also be a tuple
    of arrays [M_j, D] standing for their row concatenation (a table's features'
    grads): the sort path's kernel reads them where they are, without the copy.
    segment_sum (sort residual only): "xla" (XLA's sorted segment_sum, an atomic
    scatter-add), "pallas" (kernels.segment_sum's Triton kernel; interpret mode off
    GPU) or "auto" (pallas on GPU, xla elsewhere).
    onehot_rows (0 = off): with num_segments <= onehot_rows, the sums are `onehot_sums`
    (a one-hot matmul over the source rows in their own order) instead. Only for
    sources whose rows are each read by at most one position (unpooled features), or
    are zero (the zero row missing features read); the caller decides.
    """
    if segment_sum not in SEGMENT_SUMS:
        raise ValueError(f"segment_sum must be one of {SEGMENT_SUMS}, got {segment_sum!r}")
    onehot_rows = check_onehot_rows(onehot_rows)
    if 0 < num_segments <= onehot_rows:
        return onehot_sums(g, res, num_segments, src_index, segment_sum)
    if "inv" in res:
        if isinstance(g, tuple):
            g = jnp.concatenate(g)
        if src_index is not None:
            g = jnp.take(g, src_index, axis=0)
        return jax.ops.segment_sum(g.astype(jnp.float32), res["inv"], num_segments=num_segments)
    idx = res["perm"] if src_index is None else jnp.take(src_index, res["perm"])
    impl = {"auto": None, "xla": "reference", "pallas": "pallas"}[segment_sum]
    return sorted_segment_sum(g, idx, res["seg"], num_segments, impl=impl)


def check_onehot_rows(onehot_rows) -> int:
    """onehot_rows as an int >= 0; ValueError naming it otherwise."""
    try:
        n = None if isinstance(onehot_rows, bool) else operator.index(onehot_rows)
    except TypeError:
        n = None
    if n is None or n < 0:
        raise ValueError(f"onehot_rows must be an int >= 0 (0 = off), got {onehot_rows!r}")
    return n


def onehot_sums(g: Array, res: dict, num_segments: int, src_index: Array | None = None,
                segment_sum: str = "auto") -> Array:
    """`sum_duplicates` of a small segment count K as a one-hot matmul: [K, D] float32.

    g, res, src_index, segment_sum as in `sum_duplicates`. Each source row r gets
    the segment of the position reading it, seg_row [M] (-1 where none reads it, or
    the segment lies outside [0, K): a zero one-hot row), and source j (rows
    [o_j, o_j + M_j) of the concatenation) adds one_hot(seg_row[o_j:o_j + M_j], K)^T
    @ g_j, float32 accumulation: g is read once in its own (sequential) order, no
    row gather. Valid only where no two positions of different segments read one
    nonzero source row: unpooled features, one row per id (the caller decides).
    NaN / Inf: 0 * Inf = NaN would spread a non-finite entry into every segment of
    its column, so where the [K, D] result is not all finite (a non-finite entry in
    g, or a float32 overflow) the sums are recomputed by the sorted path (a lax.cond
    on the small result, no extra pass over g): a segment is non-finite only from
    its own rows, as there. Sums equal the sorted path's up to float32 summation
    order (bfloat16 products with the one-hot are exact).
    """
    gs = tuple(g) if isinstance(g, (tuple, list)) else (g,)
    k = num_segments
    if "inv" in res:
        seg = res["inv"]
        idx = jnp.arange(seg.shape[0], dtype=jnp.int32) if src_index is None else src_index
    else:
        seg = res["seg"]
        idx = res["perm"] if src_index is None else jnp.take(src_index, res["perm"])
    m = sum(x.shape[0] for x in gs)
    seg = jnp.where((seg >= 0) & (seg < k), seg, -1).astype(jnp.int32)
    seg_row = jnp.full((m,), -1, jnp.int32).at[idx].set(seg, mode="drop")
    out = jnp.zeros((k, gs[0].shape[1]), jnp.float32)
    off = 0
    for x in gs:
        if x.shape[0]:
            oh = jax.nn.one_hot(seg_row[off:off + x.shape[0]], k, dtype=x.dtype)   # [M_j, K]
            prec = (jax.lax.Precision.HIGHEST if jnp.dtype(x.dtype) == jnp.float32
                    else jax.lax.Precision.DEFAULT)   # float32: no TF32 rounding on GPU
            out = out + jax.lax.dot_general(oh, x, (((0,), (0,)), ((), ())), precision=prec,
                                            preferred_element_type=jnp.float32)
        off += x.shape[0]

    def sorted_path(_):
        return sum_duplicates(g, res, k, src_index, segment_sum)

    return jax.lax.cond(jnp.isfinite(out).all(), lambda out: out, sorted_path, out)


def _gather(weights: Array, rows: Array) -> Array:
    """weights [V, D], rows [...] with -1 = none -> [..., D] (zeros for none)."""
    ok = rows >= 0
    out = jnp.take(weights, jnp.where(ok, rows, 0), axis=0)
    return jnp.where(ok[..., None], out, jnp.zeros((), weights.dtype))


def exchange_caps(cap: int, buckets) -> list[int]:
    """Static exchange capacities: ceil(f * cap) for f in buckets (0 < f <= 1), plus cap, ascending."""
    for f in buckets:
        if not 0 < f <= 1:
            raise ValueError(f"exchange_buckets must lie in (0, 1], got {f}")
    return sorted({max(1, min(cap, math.ceil(f * cap))) for f in buckets} | {cap})


def rebucket_slots(slot: Array, cap: int, c: int, s_m: int) -> Array:
    """Slots owner * cap + rank (s_m * cap = none) -> owner * c + rank (s_m * c = none,
    also where rank >= c)."""
    owner, rank = slot // cap, slot % cap
    return jnp.where((slot < s_m * cap) & (rank < c), owner * c + rank, s_m * c)


def _exchange(weights: Array, slot: Array, l: Array, lay: Layout, c: int,
              model_axes: tuple[str, ...], fs_axes: tuple[str, ...]):
    """One request/reply exchange at per-destination capacity c.

    slot [N] (s_m * c = none), l [N] local rows -> (rows per unique id [N, D],
    recv [S_m, c] the rows this device served, -1 = none).
    """
    s_m = lay.num_model
    send = jnp.full((s_m * c,), -1, jnp.int32).at[slot].set(l.astype(jnp.int32), mode="drop")
    recv = jax.lax.all_to_all(send.reshape(s_m, c), model_axes, 0, 0, tiled=True)
    rows = _serve(weights, recv, lay, fs_axes)                        # [S_m, c, D]
    back = jax.lax.all_to_all(rows, model_axes, 0, 0, tiled=True).reshape(s_m * c, -1)
    return _gather(back, jnp.where(slot < s_m * c, slot, -1)), recv


def lookup_rows(weights: Array, ids: Array, valid: Array, lay: Layout, cap: int,
                model_axes: tuple[str, ...], fs_axes: tuple[str, ...], dedup: str = "sort",
                exchange_buckets=(), group_axes: tuple[str, ...] = (), branch: int | None = None):
    """Rows for ids [N] (invalid where ~valid) -> (rows [N, D], residual, overflow count).

    residual: {"uniq": [N], "slot": [N], "recv": [S_m * C]} int32, plus the
    dedup residual ({"inv"} or {"perm", "seg"}, see `dedup_ids`). Slots are
    always in full-C coordinates (owner * C + rank).
    exchange_buckets (fractions of C, see `exchange_caps`): the exchange runs at
    the smallest capacity c >= the largest per-destination unique count over
    `group_axes` (a pmax; every device of an all_to_all must pick the same
    branch: pass all mesh axes), one lax.switch branch per capacity; recv is
    padded to [S_m, C] with -1 (local memory, not traffic) and the branch index
    is kept in residual["xb"] [1] int32 for `route_update_bucketed`. Only the
    full-C branch can overflow; rows and overflow equal the unbucketed path's.
    branch (with exchange_buckets): the capacity index fixed at trace time (from
    `bucket_needs` on the same ids, see the module docstring): no pmax, no
    lax.switch. Ids past that capacity at their destination get zero rows and
    are counted in the overflow (none when the branch came from these ids).
    """
    n = ids.shape[0]
    key = jnp.where(valid, ids, INVALID)
    uniq, dres = dedup_ids(key, dedup)
    uvalid = uniq != INVALID
    if lay.num_model == 1 and lay.num_fs == 1:
        # local: gather straight from the ids (one [N, D] pass, fusable into pooling);
        # the unique ids are kept for the backward's dedupe.
        res = {**dres, "uniq": uniq, "slot": jnp.zeros((n,), jnp.int32),
               "recv": jnp.zeros((1,), jnp.int32)}
        return _gather(weights, jnp.where(valid, ids, -1)), res, jnp.zeros((), jnp.int32)
    inv = inverse(dres)

    s_m = lay.num_model
    m, l = lay.locate(jnp.where(uvalid, uniq, 0))
    m = jnp.where(uvalid, m, s_m).astype(jnp.int32)
    order = jnp.argsort(m, stable=True)
    m_sorted = m[order]
    counts = jnp.zeros((s_m + 1,), jnp.int32).at[m].add(1)
    starts = jnp.cumsum(counts) - counts
    rank = jnp.arange(n, dtype=jnp.int32) - starts[m_sorted]
    keep = (m_sorted < s_m) & (rank < cap)
    slot_sorted = jnp.where(keep, m_sorted * cap + rank, s_m * cap)
    slot = jnp.zeros((n,), jnp.int32).at[order].set(slot_sorted)
    dropped = uvalid & (slot >= s_m * cap)
    overflow = jnp.sum(dropped[inv] & valid, dtype=jnp.int32)
    res = {**dres, "uniq": uniq, "slot": slot}
    if not exchange_buckets:
        rows_u, recv = _exchange(weights, slot, l, lay, cap, model_axes, fs_axes)
        return rows_u[inv], {**res, "recv": recv.reshape(-1)}, overflow
    caps = exchange_caps(cap, exchange_buckets)

    def run_at(c):
        def run(weights, slot, l):
            rows_u, recv = _exchange(weights, rebucket_slots(slot, cap, c, s_m), l, lay, c,
                                     model_axes, fs_axes)
            recv = jnp.pad(recv, ((0, 0), (0, cap - c)), constant_values=-1)
            return rows_u, recv.reshape(-1)
        return run

    if branch is not None:
        c = caps[_check_branch(branch, caps)]
        rows_u, recv = run_at(c)(weights, slot, l)
        cut = uvalid & (slot < s_m * cap) & (slot % cap >= c)      # past the fixed capacity
        overflow = overflow + jnp.sum(cut[inv] & valid, dtype=jnp.int32)
        return rows_u[inv], {**res, "recv": recv, "xb": jnp.full((1,), branch, jnp.int32)}, overflow
    need = jnp.max(counts[:s_m])                      # largest per-destination unique count
    if group_axes:
        need = jax.lax.pmax(need, group_axes)
    which = jnp.minimum(first_at_least(caps, need), len(caps) - 1).astype(jnp.int32)
    rows_u, recv = jax.lax.switch(which, [run_at(c) for c in caps], weights, slot, l)
    return rows_u[inv], {**res, "recv": recv, "xb": which[None]}, overflow


def _check_branch(branch: int, caps: Sequence[int]) -> int:
    if not 0 <= branch < len(caps):
        raise ValueError(f"branch {branch} is not an index of the capacities {list(caps)}")
    return branch


def bucket_needs(ids: Array, valid: Array, lay: Layout) -> tuple[Array, Array]:
    """What the bucketed switches of these ids [N] need, without collectives:
    (largest per-destination unique count, unique count), int32 scalars.

    The exchange picks the first capacity >= the first (pmax'd over the mesh),
    `sync_update_bucketed` the first unique bucket >= the second (over the
    replicas); computed ahead of the step, they fix the branches at trace time.
    """
    uniq, _, _ = sorted_unique(jnp.where(valid, ids, INVALID))
    uvalid = uniq != INVALID
    u = jnp.sum(uvalid, dtype=jnp.int32)
    if lay.num_model == 1 and lay.num_fs == 1:
        return u, u
    m, _ = lay.locate(jnp.where(uvalid, uniq, 0))
    m = jnp.where(uvalid, m, lay.num_model).astype(jnp.int32)
    counts = jnp.zeros((lay.num_model + 1,), jnp.int32).at[m].add(1)
    return jnp.max(counts[:lay.num_model]), u


def _serve(weights: Array, recv: Array, lay: Layout, fs_axes: tuple[str, ...]) -> Array:
    """Requested model-block rows recv [S_m, C] (-1 = none) -> rows [S_m, C, D]."""
    if lay.num_fs == 1:
        return _gather(weights, recv)
    # fs2d: every sub-shard of this model block serves the rows it owns for all
    # of its replica peers' requests; the sum over sub-shards (one nonzero each)
    # is scattered back, so each device gets the rows for its own requests.
    every = jax.lax.all_gather(recv, fs_axes, axis=0, tiled=False)    # [R, S_m, C]
    local = _owned(every, lay, fs_axes)
    return jax.lax.psum_scatter(_gather(weights, local), fs_axes, scatter_dimension=0,
                                tiled=False)


def _owned(rows: Array, lay: Layout, fs_axes: tuple[str, ...]) -> Array:
    """Model-block rows -> this sub-shard's local rows, -1 where another sub-shard owns them."""
    r = jax.lax.axis_index(fs_axes)
    lo = r * lay.rows_per_shard
    mine = (rows >= lo) & (rows < lo + lay.rows_per_shard)
    return jnp.where(mine, rows - lo, -1)


def route_grads(g: Array, res: dict, lay: Layout, cap: int, model_axes: tuple[str, ...],
                fs_axes: tuple[str, ...], sync_axes: tuple[str, ...], src_index: Array | None = None,
                segment_sum: str = "auto"):
    """Per-id grads (zero on invalid ids) -> (local rows [K], grads [K, D]) at the owner.

    g [N, D] per id, or a source [M, D] indexed by src_index [N], and segment_sum:
    see `sum_duplicates`. Rows are -1 where there is nothing to apply. K = N
    (local), S_m * C, or times the replica count after the fs2d / 2d all-gathers.
    """
    n = res["uniq"].shape[0]
    g_u = sum_duplicates(g, res, n, src_index, segment_sum)           # [N, D] f32 per unique id
    if lay.num_model == 1 and lay.num_fs == 1:
        rows = jnp.where(res["uniq"] != INVALID, res["uniq"], -1)
        grads = g_u
    else:
        s_m = lay.num_model
        send = jnp.zeros((s_m * cap, g.shape[1]), g.dtype).at[res["slot"]].set(
            g_u.astype(g.dtype), mode="drop")
        grads = jax.lax.all_to_all(send.reshape(s_m, cap, -1), model_axes, 0, 0, tiled=True)
        grads = grads.reshape(s_m * cap, -1)
        rows = res["recv"]
        if lay.num_fs > 1:   # reduce-scatter to the sub-shard owning each row
            rows = _owned(jax.lax.all_gather(rows, fs_axes, axis=0, tiled=True), lay, fs_axes)
            grads = jax.lax.all_gather(grads, fs_axes, axis=0, tiled=True)
    if sync_axes:            # replicas apply the same (concatenated) update
        rows = jax.lax.all_gather(rows, sync_axes, axis=0, tiled=True)
        grads = jax.lax.all_gather(grads, sync_axes, axis=0, tiled=True)
    return rows, grads


def route_update_bucketed(state: dict[str, Array], g: Array, res: dict, lay: Layout, cap: int,
                          model_axes: tuple[str, ...], fs_axes: tuple[str, ...],
                          sync_axes: tuple[str, ...], exchange_buckets, optimizer,
                          src_index: Array | None = None, branch: int | None = None,
                          **update_kw) -> dict[str, Array]:
    """`route_grads` + `update_rows` at the exchange capacity the lookup chose.

    res: the residual of `lookup_rows` with exchange_buckets (same buckets and cap);
    the branch res["xb"][0] (the same on every device) routes the grads at capacity
    c: the [S_m, c, D] all_to_all and the replica all-gathers of [S_m * c] rows,
    then updates the owner's rows (update_kw: `update_rows` options; the unique
    buckets only in the full-C branch, the others are sized by c already, and
    nesting both switches multiplies the compiled update bodies). Exact: the
    same rows and grads in the same order as the full-C path, minus empty slots.
    branch: the lookup's fixed capacity index (`lookup_rows(branch=)`), no lax.switch.
    """
    caps = exchange_caps(cap, exchange_buckets)
    s_m = lay.num_model

    def run_at(c):
        def run(state):
            r = {**res, "slot": rebucket_slots(res["slot"], cap, c, s_m),
                 "recv": res["recv"].reshape(s_m, cap)[:, :c].reshape(-1)}
            rows, grads = route_grads(g, r, lay, c, model_axes, fs_axes, sync_axes, src_index,
                                      update_kw.get("segment_sum", "auto"))
            kw = update_kw if c == cap else {**update_kw, "buckets": ()}
            return update_rows(state, rows, grads, optimizer, **kw)
        return run

    if branch is not None:
        return run_at(caps[_check_branch(branch, caps)])(state)
    return jax.lax.switch(res["xb"][0], [run_at(c) for c in caps], state)


def sync_update_bucketed(state: dict[str, Array], g: Array, res: dict, sync_axes: tuple[str, ...],
                         optimizer, src_index: Array | None = None, branch: int | None = None,
                         **update_kw) -> dict[str, Array]:
    """A local table copy kept in sync over replicas (replicated, or 2d with a
    one-device model group): all-gather only the unique rows, not all N ids.

    Each replica sums its duplicates first ([K, D] per unique id, as
    `update_unique_bucketed`); K is the smallest bucket of N holding the largest
    unique count over `sync_axes` (a pmax, so every replica takes the same
    lax.switch branch and its all-gathers match). The [R * K] rows and grads
    gathered then go through `update_rows` (dedupe across replicas, optimizer).
    The same (row, grad) pairs in the same order as the all-N path minus padding,
    so the same update; the gather and the update follow U instead of N.
    update_kw: `update_rows` options; their `buckets` (unique-row fractions of N)
    also size the gather, and the update's own buckets run in the full-N branch only.
    branch: the bucket index fixed at trace time (`bucket_needs` on the same ids,
    pmax'd over the replicas), no pmax and no lax.switch; unique rows past it are
    not applied (the collection counts them in ids_overflow at the lookup).
    """
    uniq = res["uniq"]
    caps = bucket_sizes(uniq.shape[0], update_kw.get("buckets", ()),
                        rows=state["weights"].shape[0])

    def run_at(cap):
        def run(state):
            g_u = sum_duplicates(g, res, cap, src_index,                  # [cap, D] f32
                                 update_kw.get("segment_sum", "auto"))
            rows = jnp.where(uniq[:cap] != INVALID, uniq[:cap], -1)
            rows = jax.lax.all_gather(rows, sync_axes, axis=0, tiled=True)
            g_u = jax.lax.all_gather(g_u, sync_axes, axis=0, tiled=True)
            kw = update_kw if cap == caps[-1] else {**update_kw, "buckets": ()}
            return update_rows(state, rows, g_u, optimizer, **kw)
        return run

    if branch is not None:
        return run_at(caps[_check_branch(branch, caps)])(state)
    which = sync_bucket(uniq, caps, sync_axes)
    return jax.lax.switch(which, [run_at(c) for c in caps], state)


def first_at_least(caps: Sequence[int], x: Array) -> Array:
    """Index of the first of the static ascending `caps` >= the scalar x (len(caps) if
    none), as compares: jnp.searchsorted's default lowers to an XLA while loop, which
    XLA:GPU steps from the host (a device-to-host copy and a wait per iteration)."""
    return jnp.sum(jnp.asarray(caps, jnp.int32) < x, dtype=jnp.int32)


def sync_bucket(uniq: Array, caps: Sequence[int], sync_axes: tuple[str, ...]) -> Array:
    """Index of the first of `caps` (ascending) holding the largest unique count
    (uniq [N], INVALID = none) over `sync_axes`: the same on every replica."""
    u = jax.lax.pmax(jnp.sum(uniq != INVALID, dtype=jnp.int32), sync_axes)
    return first_at_least(caps, u)


def _check_impl(update_impl: str, optimizer, state: dict[str, Array]) -> None:
    if update_impl not in UPDATE_IMPLS:
        raise ValueError(f"update_impl must be one of {UPDATE_IMPLS}, got {update_impl!r}")
    if update_impl == "pallas" and (set(state) != {"weights", "accum"}
                                    or not isinstance(optimizer, RowWiseAdagrad)):
        raise ValueError("update_impl='pallas' supports RowWiseAdagrad only, got "
                         f"{type(optimizer).__name__} with state {sorted(state)}")


def _sort_residual(res: dict) -> tuple[Array, Array]:
    """(perm, seg) of the sort path; from an {"inv"} residual, one stable sort of inv."""
    if "perm" in res:
        return res["perm"], res["seg"]
    inv = res["inv"]
    seg, perm = jax.lax.sort_key_val(inv, jnp.arange(inv.shape[0], dtype=jnp.int32),
                                     is_stable=True)
    return perm, seg


def _fused(state: dict[str, Array], rows: Array, perm: Array, seg: Array, g: Array,
           src_index: Array | None, optimizer, knobs=()) -> dict[str, Array]:
    """Fused sum + row-wise Adagrad (Pallas) of rows [K] (-1 = none) from the sorted ids;
    knobs: ((name, value), ...) of kernels.sparse_update.KNOBS."""
    index = perm if src_index is None else jnp.take(src_index, perm)
    w, a = row_wise_adagrad(state["weights"], state["accum"], rows, seg, index.astype(jnp.int32),
                            g, lr=optimizer.lr, eps=optimizer.eps, impl="pallas", **dict(knobs))
    return {"weights": w, "accum": a}


def update_rows(state: dict[str, Array], rows: Array, grads: Array, optimizer,
                rows_unique: bool = False, dedup: str = "sort", buckets=(),
                update_impl: str = "xla", fused_knobs=(),
                segment_sum: str = "auto") -> dict[str, Array]:
    """Sum duplicate rows' grads, apply the optimizer to those rows only.

    state {"weights": [V, D], <opt>: [V, ...]}, rows [K] (-1 = none), grads [K, D].
    rows_unique=True skips the dedupe (rows already distinct and ascending, with
    the none entries last, as `route_grads` gives them on the local path).
    Each touched row and its state are read once and written once (one gather,
    one fused update, one scatter per array); padding entries are dropped.
    buckets (with rows_unique=False): size the duplicate sum and the update to
    the unique count as in `update_unique_bucketed` (the owner's K = S_m * C
    slots are mostly empty). update_impl: "xla" or "pallas" (see module docstring);
    fused_knobs: the fused kernel's knobs, ((name, value), ...), with "pallas".
    segment_sum: the "xla" update's duplicate sum (`sum_duplicates`).
    """
    _check_impl(update_impl, optimizer, state)
    k = rows.shape[0]
    key = jnp.where(rows >= 0, rows, INVALID)
    if update_impl == "pallas":
        if rows_unique:
            ar = jnp.arange(k, dtype=jnp.int32)
            return _fused(state, jnp.where(rows >= 0, rows, -1), ar, ar, grads, None, optimizer,
                          fused_knobs)
        uniq, dres = dedup_ids(key, "sort")
        if buckets:
            return update_unique_bucketed(state, grads, {**dres, "uniq": uniq}, optimizer, buckets,
                                          update_impl="pallas", fused_knobs=fused_knobs)
        perm, seg = _sort_residual(dres)
        return _fused(state, jnp.where(uniq != INVALID, uniq, -1), perm, seg, grads, None,
                      optimizer, fused_knobs)
    if rows_unique:
        uniq, g_sum = key, grads.astype(jnp.float32)
    else:
        uniq, dres = dedup_ids(key, dedup)
        if buckets:
            return update_unique_bucketed(state, grads, {**dres, "uniq": uniq}, optimizer, buckets,
                                          segment_sum=segment_sum)
        g_sum = sum_duplicates(grads, dres, k, segment_sum=segment_sum)
    # uniq ascending with INVALID last: clipping keeps it sorted (the padding
    # entries read the last row, and their writes are dropped)
    w = state["weights"].at[uniq].get(indices_are_sorted=True, mode="clip")
    opt = {name: a.at[uniq].get(indices_are_sorted=True, mode="clip")
           for name, a in state.items() if name != "weights"}
    new_w, new_opt = optimizer.update(w, opt, g_sum)
    out = {"weights": state["weights"].at[uniq].set(new_w, mode="drop", indices_are_sorted=True)}
    for name, a in new_opt.items():
        out[name] = state[name].at[uniq].set(a, mode="drop", indices_are_sorted=True)
    return out


def bucket_sizes(n: int, buckets, rows: int | None = None) -> list[int]:
    """Static unique-row capacities: ceil(f * n) for f in buckets (0 < f <= 1), plus n,
    ascending; each at most `rows` (the table's rows: no batch touches more)."""
    for f in buckets:
        if not 0 < f <= 1:
            raise ValueError(f"unique_buckets must lie in (0, 1], got {f}")
    top = n if rows is None else max(1, min(n, rows))
    return sorted({max(1, min(top, math.ceil(f * n))) for f in buckets} | {top})


def update_unique_bucketed(state: dict[str, Array], g: Array, res: dict, optimizer, buckets,
                           src_index: Array | None = None,
                           update_impl: str = "xla", fused_knobs=(),
                           segment_sum: str = "auto", onehot_rows: int = 0) -> dict[str, Array]:
    """Local table: sum duplicates and update the touched rows, sized to the unique count.

    g / src_index / segment_sum as in `sum_duplicates`; res the lookup residual (uniq ascending,
    INVALID-filled). With U the valid unique ids, the branch of the smallest
    capacity K >= U runs: duplicate sums [K, D] and the update of uniq[:K] (the
    segment indices are < U <= K, so nothing is dropped). Exact: the same sums
    and rows as the unbucketed path, whichever branch runs. update_impl="pallas":
    each branch runs the fused kernel over cap programs (buckets=() : one over N).
    onehot_rows (update_impl="xla"; 0 = off): branches of capacity K <= onehot_rows sum
    duplicates as a one-hot matmul (`onehot_sums`; unpooled sources only, see there).
    """
    _check_impl(update_impl, optimizer, state)
    uniq = res["uniq"]
    n = uniq.shape[0]
    caps = bucket_sizes(n, buckets, rows=state["weights"].shape[0])
    u = jnp.sum(uniq != INVALID, dtype=jnp.int32)
    if update_impl == "pallas":
        perm, seg = _sort_residual(res)

    def branch(cap):
        def run(state):
            if update_impl == "pallas":
                rows = jnp.where(uniq[:cap] != INVALID, uniq[:cap], -1)
                return _fused(state, rows, perm, seg, g, src_index, optimizer, fused_knobs)
            g_u = sum_duplicates(g, res, cap, src_index, segment_sum, onehot_rows)
            rows = jnp.where(uniq[:cap] != INVALID, uniq[:cap], -1)
            return update_rows(state, rows, g_u, optimizer, rows_unique=True)
        return run

    which = first_at_least(caps, u)
    return jax.lax.switch(which, [branch(c) for c in caps], state)
