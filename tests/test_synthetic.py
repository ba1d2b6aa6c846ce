"""Synthetic planted-teacher stream: purity, distributions, and the labels' model."""

import dataclasses

import numpy as np
import pytest

from gemjax.config import DataConfig, get_config
from gemjax.data.synthetic import PlantedTeacher, SyntheticStream, zipf_ranks
from gemjax.train.metrics import ne

CFG = get_config("small").data


def _leaves(batch):
    import jax
    return jax.tree.leaves(batch)


def test_batch_is_pure_function_of_seed_step_shard():
    a = SyntheticStream(CFG, seed=3).shard_batch(5, 1, 4)[0]
    b = SyntheticStream(CFG, seed=3).shard_batch(5, 1, 4)[0]
    for x, y in zip(_leaves(a), _leaves(b)):
        np.testing.assert_array_equal(x, y)
    for other in (SyntheticStream(CFG, seed=3).shard_batch(6, 1, 4)[0],
                  SyntheticStream(CFG, seed=3).shard_batch(5, 2, 4)[0],
                  SyntheticStream(CFG, seed=4).shard_batch(5, 1, 4)[0],
                  SyntheticStream(CFG, seed=3, stream="eval").shard_batch(5, 1, 4)[0]):
        assert not np.array_equal(a.sparse["user"], other.sparse["user"])


def test_zipf_ranks_follow_the_power_law():
    rng = np.random.default_rng(0)
    v, a, n = 1000, 1.05, 400_000
    r = zipf_ranks(rng, v, a, n)
    assert r.min() >= 0 and r.max() < v
    # P(rank < m) of the continuous power law on [1, v + 1), floored
    for m in (1, 10, 100):
        expect = ((m + 1) ** (1 - a) - 1) / ((v + 1) ** (1 - a) - 1)
        assert abs((r < m).mean() - expect) < 4e-3
    counts = np.bincount(r, minlength=v)
    assert (np.diff(counts[:5]) < 0).all()       # the head is strictly decreasing


@pytest.mark.parametrize("vocab", [10, 10**8])
def test_cardinalities_from_10_to_1e8(vocab):
    cfg = dataclasses.replace(CFG, batch_size=256,
                              synthetic=dataclasses.replace(CFG.synthetic, vocab_user=vocab))
    batch, _ = SyntheticStream(cfg, 0).shard_batch(0)
    u = batch.sparse["user"]
    assert u.min() >= 0 and u.max() < vocab
    if vocab > 10**6:
        assert u.max() > 10**6        # the bijective hash spreads popular ranks over the range


def test_long_sequences_are_capped_and_counted():
    cfg = dataclasses.replace(CFG, batch_size=16, capacity_slack=0.5, synthetic=dataclasses.replace(
        CFG.synthetic, seq_median=6000.0, seq_sigma=0.5, seq_cap=16_384))
    batch, info = SyntheticStream(cfg, 0).shard_batch(0)
    for seq in batch.sequences.values():
        lengths = np.diff(seq.offsets)
        assert lengths.max() <= 16_384 and seq.offsets[-1] <= seq.capacity
    assert info.seq_truncated_to_cap > 0 or info.seq_truncated_to_capacity > 0
    assert info.seq_truncated_to_capacity > 0          # slack 0.5 cannot hold every event


def _teacher_probs_by_hand(stream, batch):
    """Recompute the planted model sample by sample from the packed batch."""
    t, c = stream.teacher, stream.cfg
    out = []
    for i in range(batch.batch_size):
        seg, ctx = batch.sparse["segment"][i], batch.sparse["context"][i]
        item, cat = batch.sparse["item"][i], batch.sparse["item_cat"][i]
        z = t.w_seg[seg] + t.w_ctx[ctx] + t.w_item[item]
        z += c.synthetic.fm * (t.u_seg[seg] @ t.c_ctx[ctx] + t.g_cat[cat] @ t.h_ctx[ctx])
        z += batch.dense[i].astype(np.float64) @ t.w_dense
        for name, strength in (("clicks", c.synthetic.clicks_signal), ("views", c.synthetic.views_signal)):
            seq = batch.sequences[name]
            cats = seq.values["cat"][seq.offsets[i]:seq.offsets[i + 1]][-c.recent:]
            if len(cats) == 0:
                continue
            if name == "clicks":
                z += strength * np.mean(cats == cat)
            else:
                z += strength * np.mean(t.q_cat[cats]) * t.q_cat[cat]
        s = batch.surface[i]
        out.append(1 / (1 + np.exp(-(t.base[s] + t.alpha[s] * z))))
    return np.array(out)


def test_labels_come_from_the_planted_model():
    cfg = dataclasses.replace(CFG, batch_size=64, capacity_slack=4.0)
    stream = SyntheticStream(cfg, 1)
    batch, info = stream.shard_batch(2)
    assert info.seq_truncated_to_capacity == 0
    np.testing.assert_allclose(info.true_probs, _teacher_probs_by_hand(stream, batch), rtol=1e-9)
    assert item_categories_match(batch, cfg)


def item_categories_match(batch, cfg):
    return (np.all(batch.sparse["item"] % cfg.synthetic.num_categories == batch.sparse["item_cat"])
            and all(np.all(s.values["item"] % cfg.synthetic.num_categories == s.values["cat"])
                    for s in batch.sequences.values()))


def test_sequences_and_interactions_both_carry_signal():
    """The planted model without its sequence terms, or without its pairwise terms, is
    clearly worse than the full one on the same labels (> 5% NE)."""
    stream = SyntheticStream(CFG, 0)
    no_fm = PlantedTeacher(dataclasses.replace(
        CFG, synthetic=dataclasses.replace(CFG.synthetic, fm=0.0)), 0)     # same draws, fm off
    y, p = [], {"full": [], "no_sequences": [], "no_interactions": []}
    for step in range(6):
        batch, info = stream.shard_batch(step)
        sp = batch.sparse
        args = (sp["segment"], sp["context"], sp["item"], sp["item_cat"],
                batch.dense.astype(np.float64))
        zero = np.zeros(batch.batch_size)
        full = np.log(info.true_probs / (1 - info.true_probs))
        no_seq = stream.teacher.logits(*args, zero, zero, batch.surface)
        seq_part = full - no_seq
        no_int = no_fm.logits(*args, zero, zero, batch.surface) + seq_part
        y.append(batch.labels[:, 0])
        for k, z in (("full", full), ("no_sequences", no_seq), ("no_interactions", no_int)):
            p[k].append(1 / (1 + np.exp(-z[:, 0])))
    y = np.concatenate(y)
    nes = {k: ne(y, np.concatenate(v)) for k, v in p.items()}
    assert nes["no_sequences"] > 1.05 * nes["full"]
    assert nes["no_interactions"] > 1.05 * nes["full"]


def test_bad_shards_and_streams():
    s = SyntheticStream(CFG, 0)
    with pytest.raises(ValueError, match="not divisible"):
        s.shard_batch(0, 0, 3)
    with pytest.raises(ValueError, match="shard 4 out of range"):
        s.shard_batch(0, 4, 4)
    with pytest.raises(ValueError, match="stream must be one of"):
        SyntheticStream(CFG, 0, stream="test")


def test_data_config_capacity_is_a_multiple_of_128():
    for cfg in (DataConfig(), get_config("tiny").data, get_config("h200").data):
        assert cfg.sequence_capacity % 128 == 0
