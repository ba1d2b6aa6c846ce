"""FLOP accounting: analytic counts vs XLA's cost analysis and brute-force pair counts; MFU formulas."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gemjax.perf import mfu as M
from gemjax.perf import model_flops as MF
from kernels.common import pair_mask


def _rand(*shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def test_dense_and_mlp_match_xla_exactly():
    x, w = _rand(24, 40), _rand(40, 56, seed=1)
    assert M.xla_flops(lambda x, w: x @ w, x, w) == M.dense_flops(24, 40, 56) == 2 * 24 * 40 * 56
    ws = [_rand(40, 64, seed=2), _rand(64, 32, seed=3), _rand(32, 8, seed=4)]

    def mlp(x, ws):  # matmuls only: XLA's count must equal the analytic one
        for w in ws:
            x = x @ w
        return x

    assert M.xla_flops(mlp, x, ws) == M.mlp_flops(24, (40, 64, 32, 8))


def test_train_step_is_three_forwards():
    x, ws = _rand(32, 64), [_rand(64, 128, seed=1), _rand(128, 64, seed=2)]

    def fwd(ws, x):
        return (x @ ws[0]) @ ws[1]

    def step(ws, x, g):  # loss linear in the output with a random cotangent g: no extra matmuls
        return jax.value_and_grad(lambda ws, x: jnp.vdot(fwd(ws, x), g), argnums=(0, 1))(ws, x)

    analytic = M.train_step_flops(M.mlp_flops(32, (64, 128, 64)))
    xla = M.xla_flops(step, ws, x, _rand(32, 64, seed=3))
    assert analytic <= xla <= analytic * 1.02, (analytic, xla)


@pytest.mark.parametrize("f, l, hidden", [(4, 3, (64,)), (6, 0, ()), (0, 5, ())])
def test_wukong_layer_matches_xla(f, l, hidden):
    from gemjax.layers.wukong import WukongLayer
    b, n, d, k = 4, 48, 32, 16  # contractions long enough that matmuls dominate
    layer = WukongLayer(n, d, fmb_tokens=f, lcb_tokens=l, rank=k, mlp_hidden=hidden, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(layer)
    x = _rand(b, n, d)
    xla = M.xla_flops(lambda s, x: nnx.merge(graphdef, s)(x), state, x)
    analytic = M.wukong_layer_flops(b, n, d, fmb_tokens=f, lcb_tokens=l, rank=k, mlp_hidden=hidden)
    # XLA also counts norms, biases, relu: a little above the matmul count, never below
    assert analytic <= xla <= analytic * 1.12, (analytic, xla)
    # and the matmul-only count of the FMB by hand: X^T Y and X (X^T Y) are 2 B n d k each
    if f:
        assert M.wukong_layer_flops(b, n, d, fmb_tokens=f, lcb_tokens=0, rank=k, mlp_hidden=hidden) - \
            M.wukong_layer_flops(b, n, d, fmb_tokens=0, lcb_tokens=f, rank=k) == \
            4 * b * n * d * k + M.mlp_flops(b, (n * k, *hidden, f * d)) - 2 * b * f * n * d


def test_wukong_stack_sums_layers():
    kw = dict(fmb_tokens=3, lcb_tokens=2, rank=4, mlp_hidden=(16,))
    total = M.wukong_flops(8, 7, 16, num_layers=3, **kw)
    assert total == M.wukong_layer_flops(8, 7, 16, **kw) + 2 * M.wukong_layer_flops(8, 5, 16, **kw)


def test_attention_flops_match_xla_per_sample_dense():
    h, d = 2, 16
    lq, lk = [5, 0, 17, 2], [9, 3, 4, 3]  # (XLA rewrites 1x1 dots as reductions; length 1 is covered below)
    qs = [_rand(n, h, d, seed=i) for i, n in enumerate(lq)]
    ks = [_rand(n, h, d, seed=10 + i) for i, n in enumerate(lk)]

    def per_sample(qs, ks):  # each sample on its own exact-length dense attention
        outs = []
        for q, k in zip(qs, ks):
            if q.shape[0] == 0 or k.shape[0] == 0:
                continue
            s = jnp.einsum("qhd,khd->hqk", q, k)
            outs.append(jnp.einsum("hqk,khd->qhd", s, k))
        return outs

    assert M.xla_flops(per_sample, qs, ks) == M.attention_flops(lq, lk, heads=h, head_dim=d)
    assert M.attention_flops(lq, lk, heads=h, head_dim=d) == 4 * h * d * sum(a * b for a, b in zip(lq, lk))


@pytest.mark.parametrize("causal, window, block", [
    (False, None, None), (True, None, None), (True, 3, None), (False, 4, None), (False, None, 8),
    (True, None, 8), (True, 5, 8)])
def test_valid_pairs_match_brute_force_mask(causal, window, block):
    rng = np.random.default_rng(hash((causal, window, block)) % 2**32)
    lengths = [0, 1, 7, 8, 9, 16, 17] + list(rng.integers(0, 30, size=5))
    kv = lengths if (causal or block) else list(rng.integers(0, 30, size=len(lengths)))
    # brute force: explicit loops over positions, the kernels' mask convention
    brute = 0
    for a, b in zip(lengths, kv):
        for i in range(a):
            for j in range(b):
                ok = (not causal or j <= i)
                if window is not None:
                    ok &= (i - j < window) if causal else (abs(i - j) < window)
                if block is not None:
                    ok &= (i // block == j // block)
                brute += ok
    assert M.valid_pairs(lengths, kv, causal=causal, window=window, block=block) == brute
    if block is None and window is not None:  # also agrees with the kernels' own mask builder
        qo, ko = np.concatenate([[0], np.cumsum(lengths)]), np.concatenate([[0], np.cumsum(kv)])
        m = pair_mask(jnp.asarray(qo, jnp.int32), jnp.asarray(ko, jnp.int32), int(qo[-1]) + 3, int(ko[-1]) + 2,
                      causal, window)
        assert int(np.asarray(m).sum()) == brute


def test_valid_pairs_errors_and_empty():
    assert M.valid_pairs([]) == 0 and M.valid_pairs([0, 0]) == 0
    with pytest.raises(ValueError, match="must match"):
        M.valid_pairs([1, 2], [1])
    with pytest.raises(ValueError, match=">= 0"):
        M.valid_pairs([-1])
    assert M.embedding_flops(1000, 64) == 0


def test_mfu_local_mfu_scaling_ratio_by_hand():
    assert M.mfu(989e12, 2.0, 4, 989e12) == pytest.approx(0.125)
    # two layers: 3e12 FLOPs in 0.01 s (MFU 0.3033) and 1e12 in 0.01 s (0.1011); weights 3/4, 1/4
    peak = 989e12
    per = [3e12 / (0.01 * peak), 1e12 / (0.01 * peak)]
    assert M.local_mfu([3e12, 1e12], [0.01, 0.01], peak) == pytest.approx(0.75 * per[0] + 0.25 * per[1])
    assert M.scaling_ratio(0.2, 0.25) == pytest.approx(0.8)
    for bad in [(1.0, 0.0, 1, 1.0), (1.0, 1.0, 0, 1.0), (1.0, 1.0, 1, 0.0)]:
        with pytest.raises(ValueError, match="mfu"):
            M.mfu(*bad)
    with pytest.raises(ValueError, match="local_mfu"):
        M.local_mfu([1.0], [0.0], 1.0)


def test_peak_table_and_overrides():
    assert M.peak_flops("NVIDIA H200", "bf16") == 989e12
    assert M.peak_flops("NVIDIA H200", "fp8") == 1979e12
    assert M.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert M.peak_flops("cpu", override=1e11) == 1e11
    with pytest.raises(ValueError, match="no peak FLOP/s for device kind 'cpu'"):
        M.peak_flops("cpu")
    with pytest.raises(ValueError, match="no 'fp8' peak"):
        M.peak_flops("NVIDIA A100-SXM4-80GB", "fp8")
    assert M.measure_peak_flops(n=64, repeats=1) > 0


def test_time_fn_and_local_mfu_report_with_a_fake_clock():
    ticks = iter(np.arange(0.0, 100.0, 0.5))  # every clock read advances 0.5 s -> each call "takes" 0.5 s
    calls = []

    def layer(x):
        calls.append(1)  # traced once; the jitted call runs without re-tracing
        return x * 2

    assert M.time_fn(layer, jnp.ones(4), warmup=1, iters=3, clock=lambda: next(ticks)) == 0.5
    assert len(calls) == 1
    fake = {"a": 2.0, "b": 1.0}
    report = M.local_mfu_report([("a", "fa", (), 8.0), ("b", "fb", (), 2.0)], peak=10.0,
                                timer=lambda fn, *args: fake[{"fa": "a", "fb": "b"}[fn]])
    assert [r["mfu"] for r in report["layers"]] == [pytest.approx(0.4), pytest.approx(0.2)]
    assert report["local_mfu"] == pytest.approx(0.8 * 0.4 + 0.2 * 0.2)


# ----------------------------------------------------------------------------- Local MFU of the teacher

from gemjax.config import get_config  # noqa: E402
from gemjax.data.synthetic import SEQUENCES, SyntheticStream  # noqa: E402
from gemjax.perf import local_mfu as L  # noqa: E402
from gemjax.models.interformer import teacher_arch  # noqa: E402

_SMALL = ("model.kind=teacher,model.block=8,data.batch_size=8,data.seq_median=10,data.seq_cap=40")


def _recording(monkeypatch):
    """Patch the kernels the layers call: record (op, forward FLOPs from the offsets each call
    gets), in call order. Under jit the offsets reach the record through an ordered callback
    (their values at run time); _forward waits for every record."""
    import gemjax.layers.attention as A
    calls = []

    def wrap(op, fn):
        def f(q, k, v, q_off, *rest, **kw):
            kv_off = rest[0] if rest else q_off
            heads, head_dim = q.shape[1], q.shape[2]
            causal, window = kw.get("causal", False), kw.get("window")
            block = kw.get("block") if op == "block" else None

            def record(q_off, kv_off):
                lq, lk = np.diff(np.asarray(q_off)), np.diff(np.asarray(kv_off))
                calls.append((op, M.attention_flops(lq, lk, heads=heads, head_dim=head_dim,
                                                    causal=causal, window=window, block=block)))
            jax.debug.callback(record, q_off, kv_off, ordered=True)
            return fn(q, k, v, q_off, *rest, **kw)
        return f

    for op, name in (("gdpa", "gdpa"), ("softmax", "jagged_attention"), ("block", "block_attention")):
        monkeypatch.setattr(A, name, wrap(op, getattr(A, name)))
    return calls


def _forward(model, acts, batch):
    """model(acts, batch) [B, K] under one jit, traced afresh (the kernels patched now are the
    ones it calls); returns once every recording callback has run."""
    graphdef, state = nnx.split(model)
    out = jax.jit(lambda st, a, b: nnx.merge(graphdef, st)(a, b))(state, acts, batch)
    jax.effects_barrier()
    return out


def test_attention_calls_match_the_kernels_the_teacher_runs(monkeypatch):
    """The kernels the teacher's forward calls are attention_calls(cfg, lens), twice on one
    model: on CPU (pooling by the block-local einsum, no pool call) and where
    jagged_attention picks Pallas (attention_calls(backend="gpu"): each pooling level one
    kernel call over the packed buffer, tile ranges skipping other blocks). The second
    forward is teacher_taps' (the blocks' inputs recorded, where the Local-MFU blocks are
    cut): its logits equal the plain forward's, so neither the recording nor the packed
    pooling changes the forward."""
    import gemjax.layers.pyramid as P
    from gemjax.models.gem import build_model
    # every op kind: block attention (pyramid), softmax (pooling, CLS), gdpa (PMA, PFFN,
    # self-attention); a pyramid level with 0 attention layers that pools; lengths over
    # several blocks; head dim 16
    cfg = get_config("tiny", _SMALL + ",model.attention=gdpa,model.dim=32,model.seq_heads=2,"
                     "model.pyramid_levels=4:2:1/3:2:0/8:none:1,model.interformer_layers=1")
    batch, _ = SyntheticStream(cfg.data, 0).shard_batch(0, 0, 1)
    lens = {s: np.diff(batch.sequences[s].offsets) for s in SEQUENCES}
    assert max(int(v.max()) for v in lens.values()) > 2 * cfg.model.block   # several blocks per sample
    dev = jax.device_put(batch)
    model = build_model(cfg, nnx.Rngs(0))
    acts = L.random_acts(cfg, dev, jax.random.key(1))
    calls = _recording(monkeypatch)
    logits = _forward(model, acts, dev)
    assert calls == [(c.op, c.forward_flops) for c in MF.attention_calls(cfg, lens)]
    assert not any(c.name.endswith(".pool") for c in MF.attention_calls(cfg, lens, backend="cpu"))
    # where kernels run in Pallas
    monkeypatch.setattr(P, "default_impl", lambda op, head_dim, backend=None: "pallas")
    calls.clear()
    taps = L.teacher_taps(model, acts, dev)
    jax.effects_barrier()
    want = MF.attention_calls(cfg, lens, backend="gpu")
    assert calls == [(c.op, c.forward_flops) for c in want]
    pools = [c for c in want if c.name.endswith(".pool")]
    assert [c.name for c in pools] == [f"{s}.level{i}.pool" for s in SEQUENCES for i in (0, 1)]
    for c0, c1, s in zip(pools[::2], pools[1::2], SEQUENCES):
        # 2 queries per block, 4 H D = 4 x 32 FLOPs a pair: level 0 pools 4-token blocks
        # of the tokens, level 1 3-token blocks of level 0's 2 per block
        assert c0.forward_flops == 4 * 32 * 2 * int(lens[s].sum())
        assert c1.forward_flops == 4 * 32 * 2 * int((-(-lens[s] // 4) * 2).sum())
    np.testing.assert_allclose(np.asarray(taps["logits"]), np.asarray(logits), rtol=1e-5, atol=1e-6)


def test_block_lengths():
    np.testing.assert_array_equal(MF.block_lengths(np.array([0, 5, 8, 9, 1]), 4),
                                  [4, 1, 4, 4, 4, 4, 1, 1])
    assert MF.block_lengths(np.array([0, 0]), 4).shape == (0,)


def test_pallas_flops_only_for_calls_run_in_pallas():
    # the kernels' own rule (kernels.common.padded_head_dim): small head dims run padded
    assert MF.runs_in_pallas("block", 32, "gpu") and MF.runs_in_pallas("block", 16, "gpu")
    assert MF.runs_in_pallas("gdpa", 16, "gpu") and MF.runs_in_pallas("softmax", 8, "gpu")
    assert not MF.runs_in_pallas("block", 130, "gpu") and not MF.runs_in_pallas("softmax", 130, "gpu")
    assert not MF.runs_in_pallas("gdpa", 32, "cpu")
    lens = {"clicks": np.array([0, 5, 40]), "views": np.array([3, 0, 70])}
    cfg = get_config("tiny", "model.kind=teacher,model.dim=32,model.seq_heads=2")   # head dim 16
    calls = MF.attention_calls(cfg, lens, backend="gpu")
    got = L.pallas_attention_flops(calls, "gpu")
    # head dim 16: every call in Pallas (block attention with its RoPE halves padded),
    # the pyramid's pooling included
    want = {}
    for c in calls:
        want[c.block] = want.get(c.block, 0) + 3 * c.forward_flops
    pool = sum(3 * c.forward_flops for c in calls if c.name.endswith(".pool"))
    assert got == pytest.approx(want) and got["pyramid"] > pool > 0 and "interformer0.sequence" in got
    # head dim 130: past the largest padded size, nothing in Pallas
    big = get_config("tiny", "model.kind=teacher,model.dim=260,model.seq_heads=2")
    assert L.pallas_attention_flops(MF.attention_calls(big, lens, backend="gpu"), "gpu") == {}
    assert L.pallas_attention_flops(calls, "cpu") == {}
    # per shard: a 2-shard host batch counts each shard's own samples
    cfg = get_config("tiny", _SMALL + ",model.dim=32,model.seq_heads=1")
    stream = SyntheticStream(dataclasses.replace(cfg.data, batch_size=16), 0)
    shards = [stream.shard_batch(0, s, 2)[0] for s in range(2)]
    from gemjax.data.feeding import concat_shards
    total = L.step_attention_flops(cfg, concat_shards(shards), 2, backend="gpu")
    each = [sum(L.pallas_attention_flops(MF.attention_calls(cfg, {s: np.diff(b.sequences[s].offsets)
                                                                for s in SEQUENCES}, "gpu"), "gpu").values())
            for b in shards]
    assert total == pytest.approx(sum(each)) and min(each) > 0


def test_local_mfu_layer_list_on_tiny_teacher():
    cfg = get_config("tiny", _SMALL + ",model.interformer_layers=1,model.cross_layer_attention=false,"
                     "model.wukong_layers=1,model.dim=32,model.seq_heads=1,model.wukong_mlp=64")
    batch, _ = SyntheticStream(cfg.data, 0).shard_batch(0, 0, 1)
    fake = iter(np.linspace(1e-3, 2e-3, 32))
    rep = L.measure(cfg, batch, peak=1e12, timer=lambda fn, *a: float(next(fake)))
    names = [r["name"] for r in rep["layers"]]
    assert names == ["inputs", "pyramid", "interformer0.cross", "interformer0.interaction",
                     "interformer0.sequence", "final_cross", "head"]
    rows = {r["name"]: r for r in rep["layers"]}
    assert all(r["xla_flops"] > 0 and r["pallas_flops"] == 0 for r in rep["layers"])   # CPU: no Pallas
    # the numerator is the analytic model count (3 x forward), not XLA's
    lens = {s: np.diff(np.asarray(batch.sequences[s].offsets)) for s in batch.sequences}
    fwd = MF.teacher_block_flops(cfg, lens)
    assert [r["flops"] for r in rep["layers"]] == [3 * fwd[n] for n in names]
    assert rep["local_mfu"] == pytest.approx(M.local_mfu([r["flops"] for r in rep["layers"]],
                                                         [r["seconds"] for r in rep["layers"]], 1e12))
    # the interaction block is one Wukong layer on [x | s_sum]: XLA's fwd+bwd vs 3x the analytic count
    a = teacher_arch(cfg)
    analytic = M.train_step_flops(M.wukong_flops(8, a.tokens_in, a.dim, num_layers=1, fmb_tokens=a.fmb,
                                                 lcb_tokens=a.lcb, rank=a.rank, mlp_hidden=a.wukong_mlp))
    xla = rows["interformer0.interaction"]["xla_flops"]
    assert analytic <= xla <= 1.15 * analytic, (analytic, xla)
