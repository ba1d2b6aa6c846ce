"""Base Batch Shuffling (gemjax.data.balance): the snake deal, the rank loads on the gem1b
length distribution over 8 simulated shards (with and without BBS), the same samples per
step whatever the plan, the packing of a rank's sub-batches, the per-step load log."""

import collections

import numpy as np
import pytest

from gemjax.config import get_config
from gemjax.data import balance
from gemjax.data.batch import Batch
from gemjax.data.jagged import Jagged, layout_from_lengths


def test_snake_plan_deals_sorted_sub_batches_back_and_forth():
    keys = np.array([5, 90, 40, 70, 10, 60, 20, 80])          # order by load: 1 7 3 5 2 6 4 0
    plan = balance.snake_plan(keys, 2)
    assert plan.tolist() == [[1, 5, 2, 0], [7, 3, 6, 4]]
    plan = balance.snake_plan(keys, 4)
    assert plan.tolist() == [[1, 0], [7, 4], [3, 6], [5, 2]]
    assert sorted(plan.ravel().tolist()) == list(range(8))
    with pytest.raises(ValueError, match="8 sub-batches cannot be dealt evenly to 3 ranks"):
        balance.snake_plan(keys, 3)


def _fingerprints(batch: Batch) -> list[tuple]:
    """One hashable tuple per sample: its scalar features and every sequence's events."""
    out = []
    for i in range(batch.batch_size):
        seqs = []
        for name, jag in sorted(batch.sequences.items()):
            a, b = np.asarray(jag.offsets)[i:i + 2]
            seqs.append(tuple(tuple(np.asarray(v)[a:b].tolist()) for _, v in sorted(jag.values.items())))
        out.append((tuple(int(batch.sparse[f][i]) for f in sorted(batch.sparse)),
                    batch.dense[i].tobytes(), batch.labels[i].tobytes(), int(batch.surface[i]),
                    tuple(seqs)))
    return out


def test_gem1b_rank_loads_on_8_shards_with_and_without_bbs(capsys):
    """The gem1b preset's lengths (one step: 128 sub-batches of 8 samples) on 8 ranks."""
    cfg = get_config("gem1b", "data.bbs=true")
    src = balance.train_source(cfg)
    ratios = {}
    for step in (0, 1):
        loads = src.sub_batch_loads(step, 8)
        for name, plan in (("without", balance.identity_plan(128, 8)), ("with", src.plan(step, 8))):
            ratios[name, step] = [balance.load_ratio(loads[:, k][plan].sum(1)) for k in (0, 1)]
    # the ranks' batches themselves: without BBS the stream's own 8 shards; with, the plan's sums
    plain = [balance.shard_load(src.inner.shard_batch(1, r, 8)[0]) for r in range(8)]
    got = [balance.shard_load(src.shard_batch(1, r, 8)[0]) for r in range(8)]
    assert [balance.load_ratio([x[k] for x in plain]) for k in (0, 1)] == pytest.approx(ratios["without", 1])
    assert [balance.load_ratio([x[k] for x in got]) for k in (0, 1)] == pytest.approx(ratios["with", 1])
    assert sum(t for t, _ in got) == sum(t for t, _ in plain)
    with capsys.disabled():
        for (name, step), (tok, pairs) in sorted(ratios.items()):
            print(f"\n[bbs] gem1b step {step}, 8 ranks, {name} BBS: max/mean tokens {tok:.4f}, "
                  f"attention pairs {pairs:.4f}", end="")
    for step in (0, 1):
        assert ratios["with", step][0] <= 1.03 < ratios["without", step][0]
        assert ratios["with", step][1] < ratios["without", step][1]


def test_bbs_keeps_the_step_samples_and_only_moves_them():
    # room for every event on every rank (a rank cut to its capacity loses events, counted)
    cfg = get_config("tiny", "data.bbs=true,data.bbs_sub_batch=4,data.capacity_slack=4")
    src = balance.train_source(cfg)
    for step in (0, 3):
        for n in (8, 2):
            plan = src.plan(step, n)
            assert plan.tolist() != balance.identity_plan(16, n).tolist()     # it does move them
            shards = [src.shard_batch(step, r, n) for r in range(n)]
            assert sum(i.seq_truncated_to_capacity for _, i in shards) == 0
            with_bbs = collections.Counter(f for b, _ in shards for f in _fingerprints(b))
            without = collections.Counter(f for r in range(n)
                                          for f in _fingerprints(src.inner.shard_batch(step, r, n)[0]))
            assert with_bbs == without and sum(with_bbs.values()) == 64
            # a rank holds exactly its sub-batches' samples, in plan order, with their true_probs
            flat = [f for r in range(n) for f in _fingerprints(src.inner.shard_batch(step, r, n)[0])]
            want = [f for j in plan[1] for f in flat[4 * j:4 * j + 4]]
            assert _fingerprints(shards[1][0]) == want
            probs = np.concatenate([src.inner.shard_batch(step, r, n)[1].true_probs for r in range(n)])
            np.testing.assert_array_equal(shards[1][1].true_probs,
                                          np.concatenate([probs[4 * j:4 * j + 4] for j in plan[1]]))


def _jag_batch(lengths, start=0):
    lengths = np.asarray(lengths)
    cap = int(lengths.sum()) + 3
    off, seg, pos = layout_from_lengths(lengths, cap)
    ev = np.zeros(cap, np.int32)
    ev[:lengths.sum()] = start + np.arange(lengths.sum())
    b = len(lengths)
    return Batch(sparse={"user": np.arange(start, start + b, dtype=np.int32)},
                 dense=np.zeros((b, 1), np.float32), sequences={"s": Jagged({"item": ev}, off, seg, pos)},
                 labels=np.zeros((b, 1), np.float32), label_mask=np.ones((b, 1), np.float32),
                 surface=np.zeros(b, np.int32), weights=np.ones(b, np.float32))


def test_pack_shards_keeps_the_newest_events_when_a_rank_overflows():
    a, b = _jag_batch([3, 0, 6]), _jag_batch([2, 5], start=100)
    packed, n_cut = balance.pack_shards([(a, 0, 3), (b, 0, 2)], capacity=12)
    # 16 events into 12: the common cap is 3 (3 + 0 + 3 + 2 + 3 = 11 <= 12; 4 would give 14)
    assert n_cut == 2
    jag = packed.sequences["s"]
    assert np.diff(jag.offsets).tolist() == [3, 0, 3, 2, 3] and jag.capacity == 12
    items = np.asarray(jag.values["item"])
    want = [0, 1, 2, 6, 7, 8, 100, 101, 104, 105, 106]     # newest 3 of the 6 and of the 5
    assert items[:11].tolist() == want and items[11:].tolist() == [0]
    assert packed.sparse["user"].tolist() == [0, 1, 2, 100, 101]
    packed, n_cut = balance.pack_shards([(a, 0, 3), (b, 0, 2)], capacity=128)
    assert n_cut == 0 and np.asarray(packed.sequences["s"].values["item"])[:16].tolist() == \
        [0, 1, 2, 3, 4, 5, 6, 7, 8, 100, 101, 102, 103, 104, 105, 106]
    # a sample range from the middle of a shard: its samples' events only
    packed, n_cut = balance.pack_shards([(a, 2, 3), (b, 1, 2)], capacity=128)
    assert np.diff(packed.sequences["s"].offsets).tolist() == [6, 5] and n_cut == 0
    assert np.asarray(packed.sequences["s"].values["item"])[:11].tolist() == \
        [3, 4, 5, 6, 7, 8, 102, 103, 104, 105, 106]
    assert packed.sparse["user"].tolist() == [2, 101]


def test_load_log_ratios_per_step():
    sizes = {(0, 0): [4, 4], (0, 1): [1, 1], (1, 0): [3], (1, 1): [3]}
    log = balance.LoadLog(2)
    make = log.wrap(lambda step, shard, n: (_jag_batch(sizes[step, shard]), None))
    for step in (0, 1):
        for shard in (1, 0):
            make(step, shard, 2)
        log.step_done(step)
    row = log.row()
    # step 0: tokens 8 vs 2 (max/mean 1.6), pairs 32 vs 2 (1.882...); step 1: balanced
    assert row["load_tokens_max_over_mean"] == pytest.approx((1.6 + 1.0) / 2)
    assert row["load_pairs_max_over_mean"] == pytest.approx((32 / 17 + 1.0) / 2)
    assert row["load_tokens_max_over_mean_worst"] == pytest.approx(1.6)
    assert row["load_tokens_per_rank"] == [(8 + 3) / 2, (2 + 3) / 2]     # shard order
    assert log.row() == {}


def test_threads_share_a_step_each_inner_shard_built_once():
    import threading
    from concurrent.futures import ThreadPoolExecutor

    cfg = get_config("tiny", "data.bbs=true,data.bbs_sub_batch=4,data.capacity_slack=4")
    plain = balance.train_source(cfg).inner
    calls = collections.Counter()
    lock = threading.Lock()

    class Counting:
        def __getattr__(self, name):
            return getattr(plain, name)

        def shard_batch(self, step, shard, n):
            with lock:
                calls[step, shard] += 1
            return plain.shard_batch(step, shard, n)

    cap = balance.train_source(cfg).sequence_capacity
    src = balance.BalancedSource(Counting(), cap, 64, 4)
    serial = balance.BalancedSource(plain, cap, 64, 4)
    with ThreadPoolExecutor(8) as pool:       # as the Feeder: every rank of a step at once
        got = list(pool.map(lambda k: src.shard_batch(k // 8, k % 8, 8), range(24)))
    assert set(calls.values()) == {1} and len(calls) == 24
    for k, (batch, _) in enumerate(got):
        assert _fingerprints(batch) == _fingerprints(serial.shard_batch(k // 8, k % 8, 8)[0])
    assert not src._steps                     # every step's shards dropped once its ranks were built


def test_bbs_refused_where_it_cannot_balance(tmp_path):
    """A source BBS does not know, and online training (the drifting stream), name data.bbs."""
    import dataclasses

    from gemjax.train.online import OnlineRun, OnlineSpec
    cfg = get_config("tiny", "data.bbs=true")
    other = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, source="kafka"))
    with pytest.raises(ValueError, match="data.bbs=true: .*not data.source='kafka'"):
        balance.train_source(other)
    with pytest.raises(ValueError, match="data.bbs=true: online training"):
        OnlineRun(cfg, str(tmp_path), OnlineSpec(windows=1))
