"""The Pallas Mosaic GPU kernels (kernels/mosaic), GDPA and softmax, against
gdpa_reference / jagged_attention_reference.

CPU (default suite):
  * export: the kernel traces and lowers for cuda (jax.export, platforms=["cuda"]):
    Pallas -> Mosaic GPU lowering, wgmma / TMA / layout checks and the shared-memory
    budget all run at export; PTX / ptxas only run on a GPU.
  * interpreter: Mosaic GPU's interpreter (jax/_src/pallas/mosaic_gpu/interpret) runs
    the kernel on CPU with its 3 warpgroups as threads, TMA copies, mbarriers (phase
    bookkeeping checked: a skipped or extra wait deadlocks or raises) and wgmma
    (synchronous, exact f32 math). One difference from the GPU path: the
    interpreter's wgmma takes shared-memory operands only, so in interpret mode
    P is staged through shared memory, where the GPU feeds P to the P @ V wgmma from
    registers; the GPU tests below cover that path. The interpreter also cannot store
    into a wgmma accumulator, so its softmax awaits each step's P V in the step (on
    the GPU the accumulator stays in one `run_scoped` ACC ref for the walk). Its race
    detector (detect_races) runs on two cases. Not modelled: wgmma asynchrony (a
    slot released before its wgmma completes would pass here), tanh.approx (exact
    tanh here). Realistic sizes are GPU-only (one 3.7k-token case ran > 15 min).
GPU (`-m gpu`, one H200): the same cases compiled, plus realistic lengths and the
knob variants the benchmark sweeps, and a W1 comparison with the Triton forward.

The interpreter runs the self cases on SELF_CPU (the same length classes in fewer CTAs)
and a covering subset of each case list (its `CPU_*` indices): every
activation, mode, head dim (64, 128), head count (1, 2), self / cross layout, knob
(interior, heavy_first, num_stages, block_kv, schedule_barrier, fused_dq) and length
class runs at least once on CPU; every case runs compiled in its GPU twin. interior and heavy_first change only the tile table (test_tile_table_covers_exactly_
the_valid_pairs), not the kernels' code. The cases only the GPU twins run, with the CPU
test that covers each of their parts:
  * INTERPRET_CASES (test_gpu_edge_cases): silu-d64-self-default (the forward of
    test_impl_mosaic_forward_and_grads_match_reference; h=2: test_interpreter_finds_no_races),
    relu-d64-self-heavy_firstFalse_block_kv64 (test_interpreter_finds_no_races runs its
    config with two heads), silu-d64-cross-block_kv64 and gelu-d64-cross-interiorFalse
    (cross: gelu_tanh-d128-cross; block_kv 64: gelu-d128-self; interior: gelu_tanh-d64-self).
    The identity forward: test_interpreter_float16_isolates_samples.
  * SOFTMAX_CASES (test_gpu_softmax_edge_cases): d64-self-default (default knobs, D = 64,
    self, the default scale: the forward of test_softmax_impl_mosaic_forward_and_grads_match_
    reference, its output checked; lse: d64-self-schedule_barrierFalse; h=2: d64-cross
    scale -0.3), d64-cross-block_kv64 with the default scale, d128-self-interiorFalse,
    d64-cross-interiorFalse (cross and block_kv 64: d64-cross scale -0.3; d128 and
    interior: d128-self-block_kv64_num_stages3).
  * BACKWARD_CASES (test_gpu_backward_edge_cases; on CPU in the knob and fused_dq tests):
    softmax-d64-self and gdpa-silu-d64-self (D = 64, self, default knobs: the grads of
    test_softmax_impl_mosaic_forward_and_grads_match_reference and
    test_impl_mosaic_forward_and_grads_match_reference, one head; two heads:
    gdpa-gelu-d64-cross), softmax-d128-cross (with fused_dq; the dQ and dK / dV kernels:
    softmax in the softmax impl test, D = 128 on gdpa-relu-d128-self, cross on
    gdpa-gelu-d64-cross), gdpa-identity-d64-self (the identity's forward:
    test_interpreter_float16_isolates_samples; its backward:
    test_backward_fused_dq_finds_no_races[64], in the kernel whose dK / dV step is the
    dK / dV kernel's), gdpa-gelu-d64-cross and gdpa-relu-d128-self (with heavy_first=False /
    num_stages=3 in the knob test).
  * KNOB_CASES (test_gpu_backward_knobs): interior on softmax-d64-self and on
    softmax-d128-cross (interior=False runs with fused_dq on softmax-d128-cross).
  * fused_dq (test_gpu_backward_fused_dq_edge_cases): softmax-d64-self, gdpa-silu-d64-self,
    gdpa-gelu-d64-cross, gdpa-relu-d128-self (softmax-d128-cross runs; GDPA D = 64 and
    128, dQ, dK and dV, in test_backward_fused_dq_finds_no_races).
"""

import dataclasses
import faulthandler

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.gdpa import gdpa_reference
from kernels.jagged_attention import jagged_attention_reference
from kernels.mosaic import (MosaicConfig, gdpa_mosaic_forward, row_key_intervals,
                            softmax_mosaic_forward, tile_table)
from kernels.mosaic.layout import BASE_COL, TABLE_COLS, WG_COLS
from kernels.mosaic.tuning import BIG

# Lengths around the tiles (64-row consumer tile, 128-row CTA, 64 / 128-key tiles):
# empty, 1, tile - 1 / tile / tile + 1; 580 tokens in capacity 768: a 188-row
# all-padding tail, the last 128-row CTA entirely padding.
SELF = [0, 1, 63, 64, 65, 127, 128, 129, 3]
# The interpreter's self lengths (its time grows with the CTAs and tiles): the same classes
# in 325 tokens of capacity 512 (64 / 128-key tiles: 63, 64, 65 and 129 = one full tile +
# 1; a sample across a CTA edge; the last CTA entirely padding). The compiled runs keep SELF.
SELF_CPU = [0, 1, 63, 64, 65, 129, 3]
# Cross: q and kv lengths differ, samples without keys (1, 3, 6) and without queries (1).
CROSS_Q = [5, 0, 300, 2, 64, 1, 40]
CROSS_KV = [1, 7, 64, 0, 200, 129, 0]
TOL = 2e-2  # bf16


def offsets_of(lengths):
    return jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)


def interpreted(q_lens, kv_lens, tq, tk):
    """A case's lengths and capacities in the interpreter: SELF in 768 runs as SELF_CPU
    in 512."""
    if q_lens is SELF:
        return SELF_CPU, SELF_CPU, 512, 512
    return q_lens, kv_lens, tq, tk


def make_case(q_lens, kv_lens, tq, tk, h, d, seed=0, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(tq, h, d)) * 0.5, dtype)
    k = jnp.asarray(rng.normal(size=(tk, h, d)) * 0.5, dtype)
    v = jnp.asarray(rng.normal(size=(tk, h, d)), dtype)
    return q, k, v, offsets_of(q_lens), offsets_of(kv_lens)


def check(q_lens, kv_lens, tq, tk, *, h, d, activation, scale, interpret, seed=0, **tuning):
    if interpret:
        q_lens, kv_lens, tq, tk = interpreted(q_lens, kv_lens, tq, tk)
    q, k, v, qo, ko = make_case(q_lens, kv_lens, tq, tk, h, d, seed)
    got = jax.jit(lambda q, k, v, qo, ko: gdpa_mosaic_forward(
        q, k, v, qo, ko, activation=activation, scale=scale, interpret=interpret,
        **tuning))(q, k, v, qo, ko)
    want = gdpa_reference(q, k, v, qo, ko, activation=activation, scale=scale)
    assert got.shape == q.shape and got.dtype == q.dtype
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    err = float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))
    what = f"gdpa_mosaic {activation} d={d} {tuning}"
    assert err < TOL, f"{what}: relative error {err:.2e} >= {TOL}"
    end = int(qo[-1])
    assert np.all(got[end:] == 0), f"{what}: rows past q_offsets[-1] not 0"
    return err


# ------------------------------------------------------------------ CPU: export

def _export(d, tuning, activation="silu", h=4, tq=1024, b=8):
    sds = [jax.ShapeDtypeStruct((tq, h, d), jnp.bfloat16)] * 3
    sds += [jax.ShapeDtypeStruct((b + 1,), jnp.int32)] * 2
    f = jax.jit(lambda q, k, v, qo, ko: gdpa_mosaic_forward(
        q, k, v, qo, ko, activation=activation, scale=0.5, **tuning))
    return jax.export.export(f, platforms=["cuda"])(*sds).mlir_module()


# (D, tuning, activation): both head dims with both tile sizes, every activation once
# (the activation code does not depend on D or the tuning; silu and gelu_tanh are packed)
EXPORT_CASES = [(64, {}, "silu"), (64, dict(block_kv=64, num_stages=3), "relu"),
                (128, {}, "gelu_tanh"), (128, dict(block_kv=64, num_stages=3), "identity"),
                (128, {}, "gelu")]


@pytest.mark.parametrize("d,tuning,activation", EXPORT_CASES,
                         ids=[f"{d}-{'bk64_s3' if t else 'bk128_s2'}-{a}" for d, t, a in EXPORT_CASES])
def test_exports_for_cuda(d, tuning, activation):
    assert "mosaic_gpu" in _export(d, tuning, activation=activation)


@pytest.mark.parametrize("tuning", [dict(block_kv=128, num_stages=3),
                                    dict(schedule_barrier=False, interior=False),
                                    dict(block_kv=64, num_stages=4, heavy_first=False)],
                         ids=["bk128_s3", "no_sched_no_interior", "bk64_s4_in_order"])
def test_exports_sweep_knobs(tuning):
    """The benchmark's sweep entries lower too (D=128 is the W1 head dim)."""
    assert "mosaic_gpu" in _export(128, tuning)


def test_shared_memory_overflow_is_refused_before_lowering():
    """A forward whose buffers exceed a CTA's shared memory is refused by its config
    (NotImplementedError: callers fall back) rather than by the GPU lowering; the estimate
    gives the bytes an H100 lowering asked for the softmax bk128 s3 D128 kernel."""
    from kernels.mosaic import mosaic_config
    from kernels.mosaic.tuning import SMEM_BYTES, forward_smem_bytes
    with pytest.raises(NotImplementedError, match="block_kv=256 num_stages=3 needs"):
        _export(128, dict(block_kv=256, num_stages=3))
    with pytest.raises(NotImplementedError, match="mode=softmax D=128 block_kv=128"):
        softmax_mosaic_forward(*make_case([100], [100], 128, 128, 1, 128, seed=0),
                               block_kv=128, num_stages=3)
    cfg = lambda mode: mosaic_config(128, jnp.bfloat16, mode=mode, block_kv=128,  # noqa: E731
                                     num_stages=3, forward=False)
    assert forward_smem_bytes(cfg("softmax"), 128) == 232568 > SMEM_BYTES
    assert forward_smem_bytes(cfg("gdpa"), 128) <= SMEM_BYTES      # exports (test above)
    # forward=False (the backward's kernels hold other buffers): not the forward's bound
    with pytest.raises(NotImplementedError, match="shared memory"):
        mosaic_config(128, jnp.bfloat16, mode="softmax", block_kv=128, num_stages=3)


# ------------------------------------------------------ CPU: tile table (pure XLA)

@pytest.mark.parametrize("heavy_first", [True, False])
@pytest.mark.parametrize("cfg_kw", [dict(), dict(block_kv=64), dict(interior=False),
                                    dict(block_kv=256)])
def test_tile_table_covers_exactly_the_valid_pairs(cfg_kw, heavy_first):
    """Every valid (row, key) pair lies in its consumer's [lo, hi); interior tiles hold
    only valid pairs; c_lo <= lo <= flo <= fhi <= hi <= c_hi; each CTA tile once;
    tile j starts at key base + j block_kv, base a multiple of 8 and no
    tile past the keys' capacity; a narrow last tile [hn, hi) only where the rows' keys
    end in its first half."""
    cfg = MosaicConfig(heavy_first=heavy_first, **cfg_kw)
    for q_lens, kv_lens, tq in ((SELF, SELF, 768), (CROSS_Q, CROSS_KV, 512)):
        qo, ko = offsets_of(q_lens), offsets_of(kv_lens)
        start, end = (np.asarray(x) for x in row_key_intervals(qo, ko, tq))
        table = np.asarray(tile_table(cfg, jnp.asarray(start), jnp.asarray(end), tq))
        assert table.shape[1] == TABLE_COLS
        bq, bk = cfg.block_q, cfg.block_kv
        assert sorted(table[:, 0]) == list(range(tq // cfg.cta_rows))
        if heavy_first:
            work = table[:, 2] - table[:, 1]
            assert np.all(work[:-1] >= work[1:])
        seg = np.searchsorted(np.asarray(qo), np.arange(tq), side="right") - 1
        ko = np.asarray(ko)
        for row in table:
            tile, c_lo, c_hi, base = *row[:3], row[BASE_COL]
            assert base % 8 == 0 and base + c_hi * bk <= tq, row
            for w in range(2):
                lo, flo, fhi, hn, hi = row[3 + WG_COLS * w: 3 + WG_COLS * (w + 1)]
                assert c_lo <= lo <= flo <= fhi <= hn <= hi <= c_hi, row
                assert hn == hi or (cfg.narrow and hn == hi - 1), row
                rows = tile * cfg.cta_rows + w * bq + np.arange(bq)
                for r in rows:
                    b = seg[r]
                    valid = b < len(q_lens) and ko[b] < ko[b + 1]
                    assert (start[r], end[r]) == ((int(ko[b]), int(ko[b + 1])) if valid
                                                  else (BIG, 0))
                    if valid:  # its keys lie in the consumer's key tiles
                        assert base + lo * bk <= start[r] and end[r] <= base + hi * bk, (row, r)
                        assert hn == hi or end[r] <= base + hn * bk + bk // 2, (row, r)
                    # interior tiles: every key valid for this row
                    assert not (fhi > flo and not (start[r] <= base + flo * bk
                                                   and base + fhi * bk <= end[r]))


def w1_lengths(rng):
    """The bench workload W1's 64 sample lengths (rng = default_rng(0) gives its draw)."""
    return np.clip(rng.lognormal(np.log(512), 0.8, 64).astype(int), 16, 4096)


def test_anchored_tiles_compute_fewer_pairs():
    """On W1's lengths, the tile table (tiles anchored at each CTA's first key, narrow
    last steps) covers fewer (row, key) pairs than tiles at multiples of 128
    (kernels.common.tile_ranges on the raw intervals), and covers the valid ones."""
    from kernels.common import tile_ranges
    lens = w1_lengths(np.random.default_rng(0))
    qo = offsets_of(lens)
    tq = -(-int(lens.sum()) // 128) * 128
    start, end = row_key_intervals(qo, qo, tq)
    t = np.asarray(tile_table(MosaicConfig(), start, end, tq))
    lo, flo, fhi, hn, hi = t[:, 3:3 + 2 * WG_COLS].reshape(-1, 2, WG_COLS).transpose(2, 0, 1)
    covered = int(64 * 128 * (hn - lo).sum() + 64 * 64 * (hi - hn).sum())
    plain_lo, plain_hi = (np.asarray(x) for x in tile_ranges(start, end, 64, 128))
    plain = int(64 * 128 * (plain_hi - plain_lo).sum())
    valid = int((lens.astype(np.int64) ** 2).sum())
    assert valid <= covered < plain
    assert valid / plain < 0.86 and valid / covered > 0.91


# ---------------------------------------------------------- CPU: interpreter

@pytest.fixture
def interpreter_guard():
    """The interpreter deadlocks on a barrier protocol bug: abort (with tracebacks)
    instead of hanging; reset its global state if a kernel failed."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
    faulthandler.dump_traceback_later(300, exit=True)
    try:
        yield ipc
    finally:
        faulthandler.cancel_dump_traceback_later()
        ipc.reset_gpu_interpret_mode_state()


@pytest.fixture
def interpreter_reduce_add(monkeypatch):
    """The Mosaic interpreter raises NotImplementedError on TMA stores with a
    reduction_op. For the fused backward's dQ (`fused_dq`: float32 partials reduce-added
    into global memory, cp.reduce.async.bulk .add on the GPU) this swaps in a store task
    that adds the source window to the destination's content, under one lock (a whole
    read-add-write per store, as the hardware's reduce is per element), and that the race
    detector does not count as a conflicting write of the destination (reductions
    commute). Other stores are untouched."""
    import threading
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as cb
    store, plain_task = cb.copy_smem_to_gmem, cb.AsyncCopySmemToGmemTask
    rmw, swap = threading.Lock(), threading.Lock()

    class ReduceAdd(plain_task):
        def post_read(self, tma_thread_id, mem):
            # reduce-adds into global memory commute: the race detector's write check on
            # the destination is left out (its source read in shared memory is checked)
            if mem.detect_races:
                self.clock.inc(tma_thread_id)
                self.write_clock = self.clock.copy()

        def __call__(self, tma_thread_id):
            mem = cb._get_shared_memory()
            self.pre_read(tma_thread_id, mem)     # the race detector's clocks, as a store's
            with rmw:
                add, _, _ = mem.get_buffer_content(self.src_allocation_key, self.src_access,
                                                   self.thread, logging_info=self.logging_info)
                self.post_read(tma_thread_id, mem)
                cur, _, _ = mem.get_buffer_content(self.dst_allocation_key, self.dst_access,
                                                   self.thread, logging_info=self.logging_info)
                mem.store_buffer_content(self.dst_allocation_key, self.dst_access, cur + add,
                                         self.thread, logging_info=self.logging_info)
            self.post_write(tma_thread_id, mem)

    def patched(*args, reduction_op=None, **kw):
        with swap:   # the task class is looked up while the store is set up
            if reduction_op is not None:
                assert str(reduction_op) == "add", reduction_op
                monkeypatch.setattr(cb, "AsyncCopySmemToGmemTask", ReduceAdd)
            try:
                return store(*args, reduction_op=None, **kw)
            finally:
                monkeypatch.setattr(cb, "AsyncCopySmemToGmemTask", plain_task)
    monkeypatch.setattr(cb, "copy_smem_to_gmem", patched)


INTERPRET_CASES = [
    # (q lens, kv lens, Tq, Tk, h, d, activation, scale, tuning)
    (SELF, SELF, 768, 768, 2, 64, "silu", 0.3, {}),
    (SELF, SELF, 768, 768, 1, 128, "gelu", 0.2, dict(block_kv=64, num_stages=3)),
    (SELF, SELF, 768, 768, 1, 64, "gelu_tanh", 0.3, dict(schedule_barrier=False,
                                                          interior=False)),
    (SELF, SELF, 768, 768, 1, 64, "relu", 0.5, dict(heavy_first=False, block_kv=64)),
    (CROSS_Q, CROSS_KV, 512, 512, 2, 64, "silu", 1.0, dict(block_kv=64)),
    (CROSS_Q, CROSS_KV, 512, 512, 1, 128, "gelu_tanh", 0.3, {}),
    (CROSS_Q, CROSS_KV, 512, 512, 2, 64, "gelu", 0.3, dict(interior=False)),
]
INTERPRET_IDS = [f"{c[6]}-d{c[5]}-{'self' if c[0] is SELF else 'cross'}-"
                 + ("_".join(f"{k}{v}" for k, v in c[8].items()) or "default")
                 for c in INTERPRET_CASES]
CPU_INTERPRET = [1, 2, 5]        # 3: test_interpreter_finds_no_races; the others: GPU twin only
#                                  (module docstring)


@pytest.mark.parametrize("case", [INTERPRET_CASES[i] for i in CPU_INTERPRET],
                         ids=[INTERPRET_IDS[i] for i in CPU_INTERPRET])
def test_interpreter_matches_reference(case, interpreter_guard):
    ql, kl, tq, tk, h, d, act, scale, tuning = case
    check(ql, kl, tq, tk, h=h, d=d, activation=act, scale=scale, interpret=True, **tuning)


def test_interpreter_finds_no_races(interpreter_guard):
    """Happens-before race detector over TMA copies / barriers / shared memory (three
    warpgroups), on INTERPRET_CASES[3] (relu, 64-key tiles, in-order launch) with two
    heads; its output against the reference."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    ql, kl, tq, tk, _, d, act, scale, tuning = INTERPRET_CASES[3]
    params = plgpu.InterpretGPUParams(detect_races=True)
    check(ql, kl, tq, tk, h=2, d=d, activation=act, scale=scale, interpret=params, **tuning)
    assert not interpreter_guard.get_races().races_found


def test_interpreter_float16_isolates_samples(interpreter_guard):
    """float16 (the identity activation) against the reference; changing one sample's
    q, k, v changes only that sample's rows."""
    q, k, v, qo, ko = make_case(SELF_CPU, SELF_CPU, 512, 512, 1, 64, seed=4, dtype=jnp.float16)
    f = jax.jit(lambda q, k, v: gdpa_mosaic_forward(q, k, v, qo, ko, activation="identity",
                                                    scale=0.1, interpret=True))
    got = f(q, k, v)
    want = gdpa_reference(q, k, v, qo, ko, activation="identity", scale=0.1)
    assert got.dtype == jnp.float16
    a = np.asarray(got, np.float64)
    assert _rel(a, want) < TOL and not a[int(qo[-1]):].any()
    lo, hi = int(qo[5]), int(qo[6])           # the 129-token sample, across a CTA edge
    bump = lambda x: x.at[lo:hi].set(x[lo:hi] * -1.5)  # noqa: E731
    b = np.asarray(f(bump(q), bump(k), bump(v)), np.float64)
    changed = np.any(a != b, axis=(1, 2))
    assert changed[lo:hi].any() and not changed[:lo].any() and not changed[hi:].any()


# ------------------------------------------------------------ CPU: fall-backs

@pytest.mark.parametrize("kw,dtype,d,match", [
    (dict(causal=True), jnp.bfloat16, 64, "causal"),
    (dict(window=8), jnp.bfloat16, 64, "window"),
    ({}, jnp.float32, 64, "bf16"),
    ({}, jnp.bfloat16, 32, "head dim"),
    (dict(block_kv=96), jnp.bfloat16, 64, "block_kv"),
    (dict(num_stages=1), jnp.bfloat16, 64, "num_stages"),
])
def test_unsupported_options_raise(kw, dtype, d, match):
    q = jnp.zeros((128, 1, d), dtype)
    off = jnp.array([0, 100], jnp.int32)
    with pytest.raises(NotImplementedError, match=match):
        gdpa_mosaic_forward(q, q, q, off, off, **kw)


def test_bad_knob_and_activation():
    q = jnp.zeros((128, 1, 64), jnp.bfloat16)
    off = jnp.array([0, 100], jnp.int32)
    with pytest.raises(TypeError, match="tuning"):
        gdpa_mosaic_forward(q, q, q, off, off, bq=64)
    with pytest.raises(ValueError, match="activation"):
        gdpa_mosaic_forward(q, q, q, off, off, activation="tanh")
    with pytest.raises(TypeError, match="tuning"):
        softmax_mosaic_forward(q, q, q, off, off, row_max_ilp=16)   # not a knob



def test_narrow_steps_and_the_packed_activation_apply_where_the_kernel_can():
    """narrow steps need 128- or 256-key tiles (P V's wgmma K); the packed activation is
    for gdpa silu / gelu_tanh."""
    assert MosaicConfig().narrow and MosaicConfig(block_kv=256).narrow
    assert not MosaicConfig(block_kv=64).narrow
    assert MosaicConfig().packed_act and MosaicConfig(activation="gelu_tanh").packed_act
    for kw in (dict(activation="relu"), dict(activation="gelu"), dict(mode="softmax")):
        assert not MosaicConfig(**kw).packed_act


def test_the_tuning_table_holds_what_runs(monkeypatch):
    """gdpa(impl="mosaic") runs the forward with TUNING["gdpa"].forward and the backward
    with TUNING["gdpa"].backward (BACKWARD_TUNING: the entries that differ); the configs'
    spec and tuning parts join back into the config."""
    from kernels.gdpa import gdpa
    from kernels.mosaic import BACKWARD_TUNING, TUNING, MosaicConfig
    assert BACKWARD_TUNING == dict(block_kv=64, consumer_registers=240, producer_registers=24)
    assert TUNING["jagged_attention"] == TUNING["gdpa"]
    calls = _count_mosaic_calls(monkeypatch)
    q, k, v, qo, ko = make_case([100, 200], [100, 200], 512, 512, 1, 64, seed=1)
    jax.eval_shape(jax.grad(lambda q: gdpa(q, k, v, qo, ko, impl="mosaic").astype(
        jnp.float32).sum()), q)
    fwd = [c for c in calls if not isinstance(c, tuple)]
    bwd = [c[1] for c in calls if isinstance(c, tuple)]
    assert fwd and bwd
    assert all(c.tuning == TUNING["gdpa"].forward for c in fwd), fwd
    assert all(c.tuning == TUNING["gdpa"].backward for c in bwd), bwd
    assert all(c.spec.mode == "gdpa" and c.spec.activation == "silu" for c in fwd + bwd)
    assert all(MosaicConfig(**vars(c.spec), **vars(c.tuning)) == c for c in fwd + bwd)


def test_no_samples_gives_zeros():
    q = jnp.ones((128, 1, 64), jnp.bfloat16)
    off = jnp.zeros((1,), jnp.int32)
    np.testing.assert_array_equal(np.asarray(gdpa_mosaic_forward(q, q, q, off, off), np.float32), 0)


# ------------------------------------------------------------------ GPU (H200)

def _require_gpu():
    if jax.default_backend() != "gpu":
        pytest.fail("gpu-marked test needs a CUDA GPU (jax.default_backend() != 'gpu')")


@pytest.mark.gpu
@pytest.mark.parametrize("case", INTERPRET_CASES, ids=INTERPRET_IDS)
def test_gpu_edge_cases(case):
    _require_gpu()
    ql, kl, tq, tk, h, d, act, scale, tuning = case
    check(ql, kl, tq, tk, h=h, d=d, activation=act, scale=scale, interpret=False, **tuning)


def _lognormal_lengths(rng, n, median, cap):
    return np.clip(rng.lognormal(np.log(median), 0.8, n).astype(int), 0, cap)


GPU_TUNINGS = {
    "default": {}, "bk64_s4": dict(block_kv=64, num_stages=4),
    "bk128_s3": dict(block_kv=128, num_stages=3),
    "no_sched": dict(schedule_barrier=False, interior=False),
}
GPU_REALISTIC = [(128, name) for name in GPU_TUNINGS] + [(64, "default")]


@pytest.mark.gpu
@pytest.mark.parametrize("d,name", GPU_REALISTIC, ids=[f"d{d}-{n}" for d, n in GPU_REALISTIC])
def test_gpu_realistic_lengths(d, name):
    tuning = GPU_TUNINGS[name]
    _require_gpu()
    rng = np.random.default_rng(2)
    lens = _lognormal_lengths(rng, 12, 300, 1500)
    lens[:3] = [0, 1, 64]
    t = int(-(-lens.sum() // 128) * 128 + 128)
    check(lens, lens, t, t, h=3, d=d, activation="silu", scale=1 / 1500, interpret=False,
          **tuning)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu", "identity"])
def test_gpu_activations_cross(activation):
    _require_gpu()
    rng = np.random.default_rng(5)
    ql = _lognormal_lengths(rng, 12, 300, 1500)
    kl = _lognormal_lengths(rng, 12, 200, 1000)
    ql[:2], kl[2:4] = [0, 1], [0, 1]
    tq = int(-(-ql.sum() // 128) * 128)
    tk = int(-(-kl.sum() // 128) * 128)
    check(ql, kl, tq, tk, h=2, d=128, activation=activation, scale=0.02, interpret=False)


@pytest.mark.gpu
def test_gpu_matches_triton_path_on_w1_lengths():
    """W1 lengths (bench workload), bf16, H=4, D=128: Mosaic vs our Triton forward."""
    _require_gpu()
    from kernels.gdpa import gdpa
    lens = w1_lengths(np.random.default_rng(0))
    t = int(-(-lens.sum() // 128) * 128)
    q, k, v, qo, ko = make_case(lens, lens, t, t, 4, 128, seed=1)
    scale = 1.0 / int(lens.max())
    mine = jax.jit(lambda *a: gdpa_mosaic_forward(*a, scale=scale))(q, k, v, qo, ko)
    triton = jax.jit(lambda *a: gdpa(*a, scale=scale, impl="pallas"))(q, k, v, qo, ko)
    mine, triton = np.asarray(mine, np.float64), np.asarray(triton, np.float64)
    err = float(np.max(np.abs(mine - triton)) / np.max(np.abs(triton)))
    assert err < TOL, f"mosaic vs triton relative difference {err:.2e}"


# ------------------------- gdpa(impl="mosaic"): Mosaic forward + Mosaic backward

def _loss_and_grads(impl, q, k, v, qo, ko, w, op=None, with_out=False, **kw):
    """Value and (dQ, dK, dV) of sum(op(...) * w) for op (default kernels.gdpa.gdpa); with_out:
    the value is (value, op's output), from the same program."""
    if op is None:
        from kernels.gdpa import gdpa as op

    def loss(q, k, v):
        out = op(q, k, v, qo, ko, impl=impl, **kw)
        value = jnp.sum(out.astype(jnp.float32) * w)
        return (value, out) if with_out else value
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=with_out))(q, k, v)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _assert_grads_close(got, want):
    """(value, (dQ, dK, dV)) pairs: each gradient within TOL relative."""
    for name, g, r in zip("qkv", got[1], want[1]):
        assert _rel(g, r) < TOL, (name, _rel(g, r))


def _w1_case():
    """(rng, lengths, (q, k, v, q_offsets, kv_offsets), w): W1's 64 lengths (bench
    workload) with an empty sample, length 1 and 129 first; bf16, H=4, D=128."""
    rng = np.random.default_rng(0)
    lens = w1_lengths(rng)
    lens[:3] = [0, 1, 129]
    t = int(-(-lens.sum() // 128) * 128)
    case = make_case(lens, lens, t, t, 4, 128, seed=1)
    return rng, lens, case, jnp.asarray(rng.normal(size=case[0].shape), jnp.float32)


def _count_mosaic_calls(monkeypatch):
    """The MosaicConfig of every Mosaic forward traced from now on; the Mosaic backward's
    traces append ("backward", cfg)."""
    from kernels import dispatch, mosaic
    calls, run, back = [], dispatch.MosaicFlashForward.__call__, mosaic.run_backward
    monkeypatch.setattr(dispatch.MosaicFlashForward, "__call__",
                        lambda self, *a: calls.append(self.cfg) or run(self, *a))
    monkeypatch.setattr(mosaic, "run_backward",
                        lambda cfg, *a, **kw: calls.append(("backward", cfg)) or back(cfg, *a, **kw))
    return calls


def test_impl_mosaic_forward_and_grads_match_reference(interpreter_guard, monkeypatch):
    """Lengths around every tile edge, an empty sample, a padding tail: value and all
    three gradients of gdpa(impl="mosaic") (the interpreter's forward and backward)
    against the jnp reference; the Mosaic forward and backward really ran."""
    calls = _count_mosaic_calls(monkeypatch)
    q, k, v, qo, ko = make_case(SELF_CPU, SELF_CPU, 512, 512, 1, 64, seed=3)
    w = jnp.asarray(np.random.default_rng(4).normal(size=q.shape), jnp.float32)
    got = _loss_and_grads("mosaic", q, k, v, qo, ko, w, with_out=True, scale=0.3)
    want = _loss_and_grads("reference", q, k, v, qo, ko, w, with_out=True, scale=0.3)
    assert calls and calls[0].block_q == 64, calls
    assert any(isinstance(c, tuple) and c[1].mode == "gdpa" for c in calls), calls
    # the value through the output itself: the loss, a sum of +-terms, cancels to ~1/600
    # of its terms' magnitude, so its relative error says little
    assert _rel(got[0][1], want[0][1]) < TOL
    _assert_grads_close(got, want)
    for name, g in zip("qkv", got[1]):   # rows past the last offset get no gradient
        assert not np.any(np.asarray(g, np.float32)[int(qo[-1]):]), name


@pytest.mark.parametrize("case", ["float32", "causal", "short_samples", "window", "d32"])
def test_impl_mosaic_falls_back_to_triton_where_the_kernel_does_not_apply(case):
    """mosaic_forward says None (the Triton forward runs) for what the kernel lacks."""
    from kernels.dispatch import mosaic_forward
    from kernels.dispatch import TILES
    from kernels.triton import FlashConfig, adapt_tiles
    base = dict(mode="gdpa", activation="silu", scale=0.5, forward="mosaic", interpret=True, **TILES)
    d, dtype, tq, b = 64, jnp.bfloat16, 1024, 8
    if case == "float32":
        dtype = jnp.float32
    if case == "causal":
        base["causal"] = True
    if case == "window":
        base["window"] = 32
    if case == "short_samples":   # PMA: 16 queries per sample -> 16-row Triton tiles
        b = tq // 16
    if case == "d32":
        d = 32
    plain = adapt_tiles(FlashConfig(**{**base, "causal": False, "window": None}), 1024, 1024, 8,
                        jnp.bfloat16)
    assert mosaic_forward(plain, jnp.bfloat16, 64, 1024, 1024) is not None
    cfg = adapt_tiles(FlashConfig(**base), tq, tq, b, dtype)
    assert mosaic_forward(cfg, dtype, d, tq, tq) is None


def test_impl_mosaic_with_a_mask_equals_the_triton_path(monkeypatch):
    """causal: the Triton forward runs under impl="mosaic" (no Mosaic call), same values."""
    from kernels.gdpa import gdpa
    calls = _count_mosaic_calls(monkeypatch)
    q, k, v, qo, ko = make_case([40, 0, 70], [40, 0, 70], 128, 128, 1, 64, seed=5)
    f = lambda impl: jax.jit(lambda q, k, v: gdpa(q, k, v, qo, ko, causal=True, impl=impl))  # noqa: E731
    np.testing.assert_array_equal(np.asarray(f("mosaic")(q, k, v), np.float32),
                                  np.asarray(f("pallas")(q, k, v), np.float32))
    assert not calls


def test_impl_mosaic_is_not_for_block_attention():
    from kernels.block_attention import block_attention
    q, k, v, qo, ko = make_case([3], [3], 128, 128, 1, 64)
    with pytest.raises(ValueError, match="impl must be one of"):
        block_attention(q, k, v, qo, impl="mosaic")


# ------------------------------------------------------- softmax (online, base-2 lse)

def lse_reference(q, k, qo, ko, sm_scale):
    """[H, Tq] float64: log2 sum_k exp(q.k * sm_scale) over each row's sample keys, 0
    for rows without keys (the Triton forward's convention)."""
    qf, kf = np.asarray(q, np.float64), np.asarray(k, np.float64)
    qo, ko = np.asarray(qo), np.asarray(ko)
    out = np.zeros((q.shape[1], q.shape[0]))
    for b in range(len(qo) - 1):
        if ko[b + 1] > ko[b] and qo[b + 1] > qo[b]:
            s = np.einsum("qhd,khd->hqk", qf[qo[b]:qo[b + 1]], kf[ko[b]:ko[b + 1]]) * sm_scale
            mx = s.max(axis=-1, keepdims=True)
            out[:, qo[b]:qo[b + 1]] = (np.log(np.exp(s - mx).sum(-1)) + mx[..., 0]) / np.log(2)
    return out


def check_softmax(q_lens, kv_lens, tq, tk, *, h, d, interpret, seed=0, sm_scale=None, **tuning):
    if interpret:
        q_lens, kv_lens, tq, tk = interpreted(q_lens, kv_lens, tq, tk)
    q, k, v, qo, ko = make_case(q_lens, kv_lens, tq, tk, h, d, seed)
    out, lse = jax.jit(lambda *a: softmax_mosaic_forward(*a, sm_scale=sm_scale,
                                                          interpret=interpret, **tuning))(
        q, k, v, qo, ko)
    scale = d ** -0.5 if sm_scale is None else sm_scale
    want = np.asarray(jagged_attention_reference(q, k, v, qo, ko, sm_scale=scale), np.float64)
    got = np.asarray(out, np.float64)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (h, tq)
    err = float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))
    assert err < TOL, f"softmax_mosaic d={d} {tuning}: relative error {err:.2e}"
    assert np.all(got[int(qo[-1]):] == 0)
    lse_err = float(np.max(np.abs(np.asarray(lse, np.float64) - lse_reference(q, k, qo, ko, scale))))
    assert lse_err < 1e-3, f"softmax_mosaic lse: max abs error {lse_err:.2e}"


SOFTMAX_CASES = [   # (q lens, kv lens, Tq, Tk, h, d, sm_scale, tuning)
    (SELF, SELF, 768, 768, 2, 64, None, {}),
    (SELF, SELF, 768, 768, 1, 128, 0.2, dict(block_kv=64, num_stages=3, interior=False)),
    (CROSS_Q, CROSS_KV, 512, 512, 2, 64, None, dict(block_kv=64)),
    (SELF, SELF, 768, 768, 1, 64, 0.5, dict(schedule_barrier=False, heavy_first=False)),
    # the scale folded into exp2's FMA where it is positive; a negative scale keeps the
    # unfolded form (max(s c) != max(s) c)
    (SELF, SELF, 768, 768, 1, 128, None, dict(interior=False)),
    (CROSS_Q, CROSS_KV, 512, 512, 2, 64, -0.3, dict(block_kv=64)),
    (CROSS_Q, CROSS_KV, 512, 512, 2, 64, 0.3, dict(interior=False)),
]
SOFTMAX_IDS = [f"d{c[5]}-{'self' if c[0] is SELF else 'cross'}-"
               + ("_".join(f"{k}{v}" for k, v in c[7].items()) or "default") for c in SOFTMAX_CASES]
CPU_SOFTMAX = [1, 3, 5]          # the others: GPU twin only (module docstring)


@pytest.mark.parametrize("case", [SOFTMAX_CASES[i] for i in CPU_SOFTMAX],
                         ids=[SOFTMAX_IDS[i] for i in CPU_SOFTMAX])
def test_softmax_interpreter_matches_reference(case, interpreter_guard):
    """Out and the base-2 lse against the references; empty samples, length 1, tile edges,
    samples without keys (cross), padding tails."""
    ql, kl, tq, tk, h, d, scale, tuning = case
    check_softmax(ql, kl, tq, tk, h=h, d=d, sm_scale=scale, interpret=True, **tuning)


@pytest.mark.parametrize("tuning", [{}, dict(block_kv=64, schedule_barrier=False)],
                         ids=["default", "bk64_no_sched"])
def test_softmax_exports_for_cuda(tuning):
    """The GPU form (P from registers, the accumulator a wgmma ref for the walk) lowers."""
    sds = [jax.ShapeDtypeStruct((1024, 4, 128), jnp.bfloat16)] * 3
    sds += [jax.ShapeDtypeStruct((9,), jnp.int32)] * 2
    f = jax.jit(lambda *a: softmax_mosaic_forward(*a, **tuning))
    assert "mosaic_gpu" in jax.export.export(f, platforms=["cuda"])(*sds).mlir_module()


def test_softmax_impl_mosaic_forward_and_grads_match_reference(interpreter_guard, monkeypatch):
    """jagged_attention(impl="mosaic"): the Mosaic forward's out and lse feed the Mosaic
    backward (interpreter); the output and dQ, dK, dV against the jnp reference."""
    from kernels.jagged_attention import jagged_attention
    calls = _count_mosaic_calls(monkeypatch)
    q, k, v, qo, ko = make_case(SELF_CPU, SELF_CPU, 512, 512, 1, 64, seed=6)
    w = jnp.asarray(np.random.default_rng(7).normal(size=q.shape), jnp.float32)
    got = _loss_and_grads("mosaic", q, k, v, qo, ko, w, op=jagged_attention, with_out=True)
    want = _loss_and_grads("reference", q, k, v, qo, ko, w, op=jagged_attention, with_out=True)
    assert calls and calls[0].mode == "softmax", calls
    assert any(isinstance(c, tuple) and c[1].mode == "softmax" for c in calls), calls
    assert _rel(got[0][1], want[0][1]) < TOL
    assert not np.any(np.asarray(got[0][1], np.float32)[int(qo[-1]):])
    _assert_grads_close(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("case", SOFTMAX_CASES, ids=SOFTMAX_IDS)
def test_gpu_softmax_edge_cases(case):
    _require_gpu()
    ql, kl, tq, tk, h, d, scale, tuning = case
    check_softmax(ql, kl, tq, tk, h=h, d=d, sm_scale=scale, interpret=False, **tuning)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_TUNINGS))
def test_gpu_softmax_realistic_lengths(name):
    _require_gpu()
    tuning = GPU_TUNINGS[name]
    rng = np.random.default_rng(3)
    lens = _lognormal_lengths(rng, 12, 300, 1500)
    lens[:3] = [0, 1, 64]
    t = int(-(-lens.sum() // 128) * 128 + 128)
    if name == "bk128_s3":   # softmax's lse buffers leave no room for a third 128-row stage
        with pytest.raises(NotImplementedError, match="shared memory"):
            check_softmax(lens, lens, t, t, h=3, d=128, interpret=False, **tuning)
        tuning = dict(block_kv=128, num_stages=2)
    check_softmax(lens, lens, t, t, h=3, d=128, interpret=False, **tuning)


@pytest.mark.gpu
def test_gpu_softmax_impl_mosaic_on_w1_lengths(monkeypatch):
    """W1 lengths, bf16, H=4, D=128: jagged_attention(impl="mosaic") value and gradients
    vs the Triton path (impl="pallas")."""
    _require_gpu()
    from kernels.jagged_attention import jagged_attention
    _w1_mosaic_vs_triton_and_default(monkeypatch, _w1_case(), op=jagged_attention)


def _w1_mosaic_vs_triton_and_default(monkeypatch, case, **kw):
    """W1 lengths: value and gradients of impl="mosaic" (its forward and backward ran)
    against impl="pallas" within TOL, and against impl=None bit for bit (on a Hopper
    GPU the default runs the same Mosaic kernels)."""
    calls = _count_mosaic_calls(monkeypatch)
    rng, lens, (q, k, v, qo, ko), w = case
    got = _loss_and_grads("mosaic", q, k, v, qo, ko, w, **kw)
    tri = _loss_and_grads("pallas", q, k, v, qo, ko, w, **kw)
    assert calls and any(isinstance(c, tuple) for c in calls), calls
    n = len(calls)
    default = _loss_and_grads(None, q, k, v, qo, ko, w, **kw)
    assert len(calls) > n
    for g, m in zip(default[1], got[1]):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(m))
    _assert_grads_close(got, tri)


@pytest.mark.gpu
def test_gpu_impl_mosaic_forward_and_grads_on_w1_lengths(monkeypatch):
    """W1 lengths, bf16, H=4, D=128: gdpa(impl="mosaic") value and gradients vs the
    Triton path (impl="pallas") and, on a 16-sample slice, vs the f32 reference."""
    _require_gpu()
    case = _w1_case()
    rng, lens = case[:2]
    _w1_mosaic_vs_triton_and_default(monkeypatch, case, scale=1.0 / int(lens.max()))
    small = lens[:16]
    ts = int(-(-small.sum() // 128) * 128)
    q, k, v, qo, ko = make_case(small, small, ts, ts, 2, 128, seed=2)
    w = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    got = _loss_and_grads("mosaic", q, k, v, qo, ko, w, scale=0.01)
    ref = _loss_and_grads("reference", q.astype(jnp.float32), k.astype(jnp.float32),
                          v.astype(jnp.float32), qo, ko, w, scale=0.01)
    _assert_grads_close(got, ref)


# ------------------------------------------------ CPU: tools/bench_gdpa_mosaic.py

# the bench's sample clipped to 100 tokens: one partial 128-row tile a side (the script's
# rows, knobs and JSON; the kernels across tiles: the interpreter tests above)
_MAX_LEN = 100


@pytest.fixture(scope="module")
def bench_runs(tmp_path_factory):
    """tools/bench_gdpa_mosaic.py's command lines in one child (tests/script_commands.py):
    the GDPA and the softmax smoke runs in interpret mode, then one without --interpret,
    which exits (no GPU) and ends the child. (exit code, {command: stdout}, stderr, dir of
    the JSON outputs)."""
    import os
    from script_commands import run_commands
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path_factory.mktemp("bench")
    # 1 sample clipped to _MAX_LEN, 1 head, interpreter, each row timed on one call (the
    # interpreter's calls cost seconds and their times mean nothing); the sweep in the GDPA
    # command (the softmax one builds its rows through the same functions), no sweep
    # deadline (the child's clock starts at its import, before the first command)
    smoke = ["--interpret", "--max_samples=1", f"--max_len={_MAX_LEN}", "--heads=1", "--iters=0"]
    code, said, stderr = run_commands("bench_gdpa_mosaic", "main", [
        ["gdpa", [*smoke, f"--out={out / 'gdpa.json'}", "--sweep", "--sweep_deadline_s=3600",
                  "--configs=block_kv=64+num_stages=3,bogus"]],
        ["softmax", [*smoke, "--mode=softmax", f"--out={out / 'softmax.json'}"]],
        ["no_gpu", [f"--out={out / 'no_gpu.json'}"]]],
        cwd=root, env=dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu"), timeout=600,
        package="tools")
    return code, said, stderr, out


def test_bench_without_gpu_exits_with_a_message(bench_runs):
    code, said, stderr, _ = bench_runs
    assert "no_gpu" in said, stderr[-3000:]
    assert code != 0
    assert "no GPU" in stderr and "Traceback" not in stderr, stderr[-2000:]


def test_bench_smoke_in_interpret_mode(bench_runs):
    """The script end to end on CPU: rows, knobs, JSON."""
    import json
    code, said, stderr, out = bench_runs
    assert "softmax" in said, stderr[-3000:]      # the GDPA command returned
    res = json.load(open(out / "gdpa.json"))
    rows = {x["impl"]: x for x in res["rows"]}
    assert set(rows) == {"triton_gdpa_fwd", "mosaic_gdpa_fwd", "mosaic_gdpa_fwd_kernel_only",
                         "mosaic[block_kv=64+num_stages=3]", "mosaic[bogus]"}
    assert rows["mosaic[block_kv=64+num_stages=3]"]["knobs"] == dict(block_kv=64, num_stages=3)
    assert "bad spec" in rows["mosaic[bogus]"]["error"]
    for name in ("mosaic_gdpa_fwd", "mosaic_gdpa_fwd_kernel_only",
                 "mosaic[block_kv=64+num_stages=3]"):
        assert rows[name]["rel_diff_vs_triton"] < TOL, rows[name]
        assert rows[name]["ms"] > 0 and rows[name]["tflops"] > 0
    meta = res["meta"]
    n = min(int(w1_lengths(np.random.default_rng(0))[0]), _MAX_LEN)
    assert meta["valid_pairs"] == n ** 2 and meta["capacity_q"] == 128
    assert meta["fwd_gflop"] == pytest.approx(4 * 1 * 128 * n ** 2 / 1e9)


def test_bench_smoke_softmax_mode(bench_runs):
    """--mode=softmax: the softmax rows (Triton jagged_attention vs the Mosaic softmax
    forward), matching each other, scale 1 / sqrt(D)."""
    import json
    code, said, stderr, out = bench_runs
    assert "no_gpu" in said, stderr[-3000:]       # the softmax command returned
    res = json.load(open(out / "softmax.json"))
    rows = {x["impl"]: x for x in res["rows"]}
    assert set(rows) == {"triton_softmax_fwd", "mosaic_softmax_fwd",
                         "mosaic_softmax_fwd_kernel_only"}
    for name in set(rows) - {"triton_softmax_fwd"}:
        assert rows[name]["rel_diff_vs_triton"] < TOL, rows[name]
    assert res["meta"]["mode"] == "softmax" and res["meta"]["scale"] == pytest.approx(128 ** -0.5)
    assert "target" not in said["softmax"].split("best correct Mosaic")[-1]


# ------------------------------------- the Mosaic backward (run_backward, dQ and dK / dV)

def _engines_grads(mode, q, k, v, qo, ko, w, engine, **kw):
    """Value-and-grad of sum(out * w) through jagged_flash with both engines = `engine`
    ("triton" / "mosaic"), or the jnp reference (engine None)."""
    from kernels.dispatch import gdpa_pallas
    from kernels.dispatch import jagged_attention_pallas
    if engine is None:   # the Mosaic backward's knobs (mosaic_bwd) do not apply
        kw = {key: val for key, val in kw.items() if not key.startswith("mosaic_")}
        f = ((lambda q, k, v: jagged_attention_reference(q, k, v, qo, ko, **kw)) if mode == "softmax"
             else (lambda q, k, v: gdpa_reference(q, k, v, qo, ko, **kw)))
    elif mode == "softmax":
        f = lambda q, k, v: jagged_attention_pallas(q, k, v, qo, ko, forward=engine,  # noqa: E731
                                                    backward=engine, **kw)
    else:
        f = lambda q, k, v: gdpa_pallas(q, k, v, qo, ko, forward=engine, backward=engine,  # noqa: E731
                                        **kw)

    def loss(q, k, v):
        return jnp.sum(f(q, k, v).astype(jnp.float32) * w)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)


BACKWARD_CASES = [   # (mode, kwargs, q lens, kv lens, Tq, Tk, h, d)
    ("softmax", {}, SELF, SELF, 768, 768, 2, 64),
    ("softmax", dict(sm_scale=0.3), CROSS_Q, CROSS_KV, 512, 512, 1, 128),
    ("gdpa", dict(activation="silu", scale=0.3), SELF, SELF, 768, 768, 1, 64),
    ("gdpa", dict(activation="gelu", scale=0.2), CROSS_Q, CROSS_KV, 512, 512, 2, 64),
    ("gdpa", dict(activation="relu", scale=0.5), SELF, SELF, 768, 768, 1, 128),
    ("gdpa", dict(activation="identity", scale=0.1), SELF, SELF, 768, 768, 1, 64),
]
BACKWARD_IDS = [f"{c[0]}-{c[1].get('activation', '')}-d{c[7]}-{'self' if c[2] is SELF else 'cross'}"
                for c in BACKWARD_CASES]
_REFERENCE = {}


def _backward_inputs(i):
    """(q, k, v, q_offsets, kv_offsets, w) of BACKWARD_CASES[i] and the jnp reference's
    value and (dQ, dK, dV) of sum(out * w); the reference computed once per case (its
    knob variants share it)."""
    if i not in _REFERENCE:
        mode, kw, ql, kl, tq, tk, h, d = BACKWARD_CASES[i]
        if jax.default_backend() != "gpu":
            ql, kl, tq, tk = interpreted(ql, kl, tq, tk)
        q, k, v, qo, ko = make_case(ql, kl, tq, tk, h, d, seed=8)
        w = jnp.asarray(np.random.default_rng(9).normal(size=q.shape), jnp.float32)
        _REFERENCE[i] = (q, k, v, qo, ko, w), _engines_grads(mode, q, k, v, qo, ko, w, None, **kw)
    return _REFERENCE[i]


def _check_backward_case(i, monkeypatch):
    """Mosaic forward + Mosaic dQ and dK / dV of BACKWARD_CASES[i] vs the jnp reference's
    gradients; the Mosaic backward really ran."""
    from kernels import mosaic
    mode, kw = BACKWARD_CASES[i][:2]
    ran = []
    run = mosaic.run_backward
    monkeypatch.setattr(mosaic, "run_backward", lambda *a, **k: ran.append(1) or run(*a, **k))
    inputs, want = _backward_inputs(i)
    got = _engines_grads(mode, *inputs, "mosaic", **kw)
    assert ran, "the Mosaic backward did not run"
    _assert_grads_close(got, want)


# both modes at both head dims; fused_dq at both head dims (its own code depends on D, not
# on the mode: the mode's parts are the dK / dV kernel's, exported in both modes above).
# interior=False has no export: it changes the tile table only, not the kernels' code.
BACKWARD_EXPORTS = [("softmax", 64, {}), ("gdpa", 64, {}), ("softmax", 128, {}),
                    ("gdpa", 128, {}), ("softmax", 128, dict(fused_dq=True)),
                    ("gdpa", 64, dict(fused_dq=True))]


@pytest.mark.parametrize("mode,d,tuning", BACKWARD_EXPORTS,
                         ids=[f"{m}-{d}{'-fused_dq' if t else ''}" for m, d, t in BACKWARD_EXPORTS])
def test_backward_exports_for_cuda(mode, d, tuning):
    """dQ and dK / dV with P^T and dS^T fed to wgmma from registers (GPU form) lower; the
    softmax dQ kernel computes delta from O (O's tile beside Q and dO, delta's TMA
    store)."""
    from kernels.triton import FlashConfig, build_layout
    from kernels.mosaic import BACKWARD_TUNING, mosaic_config, run_backward
    cfg = mosaic_config(d, jnp.bfloat16, mode=mode, activation="gelu", scale=0.1,
                        **{**BACKWARD_TUNING, **tuning})

    def f(q, k, v, do, lse, delta, qo, ko):
        lay = build_layout(FlashConfig(mode=mode), qo, ko, 1024, 1024, d)
        return run_backward(cfg, lay, q, k, v, do, lse, delta, o=do)
    sds = [jax.ShapeDtypeStruct((1024, 4, d), jnp.bfloat16)] * 4
    sds += [jax.ShapeDtypeStruct((4, 1024), jnp.float32)] * 2
    sds += [jax.ShapeDtypeStruct((9,), jnp.int32)] * 2
    module = jax.export.export(jax.jit(f), platforms=["cuda"])(*sds).mlir_module()
    assert module.count("mosaic_gpu") >= 2


# (knobs, case index in BACKWARD_CASES): the backward's optional knobs on tile-edge cases
KNOB_CASES = [(dict(interior=False), 0), (dict(interior=False), 1),
              (dict(heavy_first=False), 3), (dict(num_stages=3), 4)]
KNOB_IDS = [f"{'+'.join(kn)}-{BACKWARD_IDS[i]}" for kn, i in KNOB_CASES]
# the interpreter's subsets (module docstring): (knobs, case) pairs, fused_dq cases (each
# with interior=False: the tile table's every tile masked, the kernels' code unchanged)
CPU_KNOBS = [2, 3]


@pytest.mark.parametrize("knobs,i", [KNOB_CASES[j] for j in CPU_KNOBS],
                         ids=[KNOB_IDS[j] for j in CPU_KNOBS])
def test_backward_knobs_interpreter_match_reference(knobs, i, interpreter_guard, monkeypatch):
    """mosaic_bwd knobs (launch in tile order, three stages; every tile masked: the fused_dq
    test): the same gradients as the reference; the kernels really ran with them."""
    _check_backward_knobs(knobs, i, monkeypatch)


def _check_backward_knobs(knobs, i, monkeypatch, kernels=("dq", "dkv")):
    """BACKWARD_CASES[i] with the Mosaic backward's `knobs` vs the jnp reference; the
    kernels that ran (dQ, dK / dV) are `kernels`, each with the knobs."""
    from kernels.mosaic import backward as mosaic_backward
    mode, kw = BACKWARD_CASES[i][:2]
    seen, ran = [], []
    dq_kernel, dkv_kernel = mosaic_backward._dq_kernel, mosaic_backward._dkv_kernel
    monkeypatch.setattr(mosaic_backward, "_dq_kernel", lambda *a, cfg, **k: ran.append("dq")
                        or seen.append(cfg) or dq_kernel(*a, cfg=cfg, **k))
    monkeypatch.setattr(mosaic_backward, "_dkv_kernel", lambda *a, cfg, **k: ran.append("dkv")
                        or seen.append(cfg) or dkv_kernel(*a, cfg=cfg, **k))
    inputs, want = _backward_inputs(i)
    kw = dict(kw, mosaic_bwd=tuple(knobs.items()))
    got = _engines_grads(mode, *inputs, "mosaic", **kw)
    assert tuple(ran) == tuple(kernels) and all(getattr(c, kn) == val for c in seen
                                                 for kn, val in knobs.items()), (ran, seen)
    _assert_grads_close(got, want)


CPU_FUSED_DQ = [1]


@pytest.mark.parametrize("i", CPU_FUSED_DQ, ids=[BACKWARD_IDS[i] for i in CPU_FUSED_DQ])
def test_backward_fused_dq_interpreter_matches_reference(i, interpreter_guard,
                                                         interpreter_reduce_add, monkeypatch):
    """fused_dq: one kernel forms dK, dV and dQ (dS shared between the consumers, dQ's
    halves reduce-added in float32); the same gradients as the reference, and only the
    dK / dV kernel ran, with the knobs (GDPA D = 64, where the consumers take alternate
    steps' dQ, and D = 128: test_backward_fused_dq_finds_no_races). Here with
    interior=False too (every tile masked)."""
    _check_backward_knobs(dict(fused_dq=True, interior=False), i, monkeypatch, kernels=("dkv",))


@pytest.mark.gpu
@pytest.mark.parametrize("i", [0, 1, 2, 3, 4], ids=[BACKWARD_IDS[i] for i in range(5)])
def test_gpu_backward_fused_dq_edge_cases(i, monkeypatch):
    _require_gpu()
    _check_fused_dq(i, monkeypatch)


def _check_fused_dq(i, monkeypatch):
    _check_backward_knobs(dict(fused_dq=True), i, monkeypatch, kernels=("dkv",))


@pytest.mark.parametrize("d,activation", [(64, "identity"), (128, "silu")])
def test_backward_fused_dq_finds_no_races(d, activation, interpreter_guard,
                                          interpreter_reduce_add):
    """The race detector over fused_dq's shared dS^T tiles (two buffers by step parity),
    its per-step barrier between the consumers, the float32 staging of the dQ partials
    and the final barrier before dK / dV overwrite the K tiles; dQ, dK and dV as the
    reference's (identity: its backward in the interpreter)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from kernels.gdpa import gdpa_reference
    from kernels.triton import FlashConfig, build_layout
    from kernels.mosaic import BACKWARD_TUNING, mosaic_config, run_backward
    q, k, v, qo, ko = make_case(SELF_CPU, SELF_CPU, 512, 512, 1, d, seed=5)
    do = jnp.asarray(np.random.default_rng(6).normal(size=q.shape), q.dtype)
    cfg = mosaic_config(d, q.dtype, mode="gdpa", activation=activation, scale=0.3,
                        **{**BACKWARD_TUNING, "fused_dq": True})
    lay = build_layout(FlashConfig(mode="gdpa"), qo, ko, 512, 512, d)
    zeros = jnp.zeros((1, 512), jnp.float32)
    got = run_backward(cfg, lay, q, k, v, do, zeros, zeros,
                       interpret=plgpu.InterpretGPUParams(detect_races=True))
    assert not interpreter_guard.get_races().races_found
    _, vjp = jax.vjp(lambda q, k, v: gdpa_reference(q, k, v, qo, ko, activation=activation,
                                                    scale=0.3), q, k, v)
    for name, g, r in zip("qkv", got, vjp(do)):
        assert g.shape == r.shape and _rel(g, r) < TOL, (name, _rel(g, r))


def test_backward_softmax_needs_the_output():
    from kernels.mosaic import BACKWARD_TUNING, mosaic_config, run_backward
    cfg = mosaic_config(64, jnp.bfloat16, mode="softmax", **BACKWARD_TUNING)
    x = jnp.zeros((256, 1, 64), jnp.bfloat16)
    lay = dict(q_start=jnp.zeros(256, jnp.int32), q_end=jnp.zeros(256, jnp.int32),
               k_start=jnp.zeros(256, jnp.int32), k_end=jnp.zeros(256, jnp.int32))
    with pytest.raises(ValueError, match="softmax needs the forward's output"):
        run_backward(cfg, lay, x, x, x, x, jnp.zeros((1, 256)), None, interpret=True)


def test_backward_falls_back_where_the_kernels_do_not_apply():
    from kernels.triton import FlashConfig
    from kernels.dispatch import mosaic_backward
    ok = FlashConfig(mode="softmax", scale=0.1, bq=64, bk=64, backward="mosaic", interpret=True)
    assert mosaic_backward(ok, jnp.bfloat16, 64, 1024, 1024) is not None
    for cfg, dtype, d in [(FlashConfig(mode="softmax", causal=True, bq=64, bk=64, interpret=True),
                           jnp.bfloat16, 64),
                          (ok, jnp.float32, 64), (ok, jnp.bfloat16, 96),
                          (FlashConfig(mode="gdpa", bq=16, bk=16, interpret=True), jnp.bfloat16, 64),
                          (dataclasses.replace(ok, interpret=False), jnp.bfloat16, 64)]:  # CPU
        assert mosaic_backward(cfg, dtype, d, 1024, 1024) is None


@pytest.mark.parametrize("platform,cc,kind,want", [
    ("gpu", "9.0", "NVIDIA H200", True), ("gpu", "8.0", "NVIDIA A100-SXM4-80GB", False),
    ("gpu", "10.0", "NVIDIA B200", False), ("gpu", None, "NVIDIA H100 80GB HBM3", True),
    ("gpu", None, "NVIDIA A100", False), ("cpu", None, "cpu", False)])
def test_mosaic_kernels_only_on_hopper(platform, cc, kind, want):
    """wgmma / TMA are sm_90 only: elsewhere mosaic_forward says None (Triton runs)."""
    import types
    from kernels.dispatch import is_hopper
    dev = types.SimpleNamespace(platform=platform, device_kind=kind,
                                **({} if cc is None else {"compute_capability": cc}))
    assert is_hopper(dev) is want


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["softmax", "gdpa", "softmax_fused", "gdpa_fused"])
def test_gpu_backward_on_w1_lengths(mode):
    """W1 lengths, bf16, H=4, D=128: the Mosaic forward + backward vs the Triton engines,
    and on a 16-sample slice vs the f32 reference (also with the fused dQ / dK / dV
    kernel)."""
    _require_gpu()
    mode, _, knobs = mode.partition("_")
    kw = {} if mode == "softmax" else dict(activation="silu", scale=1 / 2456)
    if knobs == "fused":
        kw["mosaic_bwd"] = (("fused_dq", True),)
    rng, lens, (q, k, v, qo, ko), w = _w1_case()
    got = _engines_grads(mode, q, k, v, qo, ko, w, "mosaic", **kw)
    tri = _engines_grads(mode, q, k, v, qo, ko, w, "triton", **kw)
    _assert_grads_close(got, tri)
    small = lens[:16]
    ts = int(-(-small.sum() // 128) * 128)
    q, k, v, qo, ko = make_case(small, small, ts, ts, 2, 128, seed=2)
    w = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    got = _engines_grads(mode, q, k, v, qo, ko, w, "mosaic", **kw)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    ref = _engines_grads(mode, f32(q), f32(k), f32(v), qo, ko, w, None, **kw)
    _assert_grads_close(got, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("i", range(len(BACKWARD_CASES)), ids=BACKWARD_IDS)
def test_gpu_backward_edge_cases(i, monkeypatch):
    _require_gpu()
    _check_backward_case(i, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("knobs,i", KNOB_CASES, ids=KNOB_IDS)
def test_gpu_backward_knobs(knobs, i, monkeypatch):
    _require_gpu()
    _check_backward_knobs(knobs, i, monkeypatch)
