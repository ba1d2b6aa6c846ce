"""Base Batch Shuffling over a Parquet source (gemjax.data.balance with data.source=parquet),
on a small log whose sequence lengths are skewed (most rows short, a few near the cap):

- the balanced shards hold the step's rows (SourceInfo.rows) and counters of the source
  without BBS, moved only within each process's block of devices, and they even out the
  devices' tokens (max / mean over the devices) that the plain shards leave uneven;
- on 4 simulated CPU devices the trainer's step on the balanced batch equals its step on the
  plain batch (loss, weight sums, gradient norm, updated parameters and tables) up to float
  rounding: BBS only moves samples between devices;
- a data.bbs=true run on the files trains, and a run stopped and resumed equals the
  uninterrupted one row for row;
- with 2 processes each reads only its own devices' source shards and serves the rows
  the one-process simulation (processes=2) serves."""

import collections
import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from gemjax.config import apply_overrides, get_config
from gemjax.data import balance
from gemjax.data.source import make_source
from gemjax.features import EventField, SequenceFeature
from test_own_data import SCHEMA as OWN_SCHEMA, _write_log, whole_and_resumed

# test_own_data's log with histories of up to 64 events
SCHEMA = dataclasses.replace(OWN_SCHEMA, sequences=(
    SequenceFeature("history", (EventField("item", "item"),), max_len=64),))
ROWS = 256


def _skewed(rng, n):
    """[n] history lengths: 85 % in 0-3 events, the rest 32-64 (the cap)."""
    long = rng.random(n) < 0.15
    return np.where(long, rng.integers(32, 65, n), rng.integers(0, 4, n))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bbs_parquet")
    _write_log(d / "train.parquet", ROWS, 0, lengths=_skewed, row_group_size=32)
    _write_log(d / "eval.parquet", 64, 1, lengths=_skewed, row_group_size=32)
    return d


def _config(files, bbs: bool, **more):
    """tiny on the files: 32 rows a step; capacity_slack 8 packs any 8 rows whole (no cut)."""
    cfg = dataclasses.replace(get_config("tiny"), features=SCHEMA)
    return apply_overrides(cfg, {
        "data.source": "parquet", "data.train_path": str(files / "train.parquet"),
        "data.eval_path": str(files / "eval.parquet"), "data.shuffle_window": "64",
        "data.batch_size": "32", "data.eval_batches": "0", "data.capacity_slack": "8",
        "data.bbs": str(bbs).lower(), "data.bbs_sub_batch": "2", "train.steps": "4",
        "train.log_every": "2", "train.eval_every": "2", "train.checkpoint_every": "2",
        "train.tensorboard": "false", **more})


@pytest.mark.parametrize("processes", [1, 2])
def test_balanced_shards_keep_each_blocks_rows_and_even_out_tokens(files, processes):
    n = 8
    big = {"data.batch_size": "128"}              # 16 rows a device: 8 sub-batches to deal
    plain = make_source(_config(files, False, **big), "train")
    src = balance.train_source(_config(files, True, **big), processes=processes)
    assert isinstance(src, balance.BalancedSource) and src.groups == processes
    block = n // processes
    spread = {"with": [], "without": []}
    for step in (0, 1, 2, 5):                     # 2, 5: later epochs (2 steps of 8 lanes x 16 rows)
        mine = [src.shard_batch(step, r, n) for r in range(n)]
        theirs = [plain.shard_batch(step, r, n) for r in range(n)]
        for lo in range(0, n, block):             # a process's devices: the same rows, moved
            got = collections.Counter(np.concatenate([i.rows for _, i in mine[lo:lo + block]]).tolist())
            want = collections.Counter(np.concatenate([i.rows for _, i in theirs[lo:lo + block]]).tolist())
            assert got == want and sum(got.values()) == 16 * block
        # the repair counters of the step, each counted once (history cut to its cap: none)
        for key in ("seq_truncated_to_cap", "seq_truncated_to_capacity", "ids_clamped"):
            assert sum(i.counters[key] for _, i in mine) == sum(i.counters[key] for _, i in theirs), key
        # every sample's history on its rank: as many events as the plain row's
        events = {int(r): int(x) for b, i in theirs
                  for r, x in zip(i.rows, np.diff(b.sequences["history"].offsets))}
        for batch, info in mine:
            assert np.diff(batch.sequences["history"].offsets).tolist() == \
                [events[r] for r in info.rows.tolist()]
        for name, shards in (("with", mine), ("without", theirs)):
            tokens = [balance.shard_load(b)[0] for b, _ in shards]
            spread[name].append(max(balance.load_ratio(tokens[lo:lo + block])
                                    for lo in range(0, n, block)))
    # without BBS the skewed rows leave the most loaded device 1.5-1.8 x the mean; BBS
    # brings every step closer to even, and its excess over the mean to less than half
    assert all(w < wo for w, wo in zip(spread["with"], spread["without"]))
    assert np.mean(spread["with"]) - 1 < 0.5 * (np.mean(spread["without"]) - 1)


@pytest.fixture(scope="module")
def trainer4(files):
    from gemjax.train.step import Trainer
    trainer = Trainer.create(_config(files, False), Mesh(np.array(jax.devices()[:4]), ("batch",)))
    return trainer, trainer.make_train_step()


def _two_steps(trainer, train_step, src):
    """(metrics of steps 0 and 1, state after them, infos of step 0) on batches 0-1 of src."""
    from gemjax.data.feeding import Feeder
    feeder = Feeder(src.shard_batch, trainer.mesh, check_ids=trainer.coll.check_ids,
                    id_fields=trainer.id_fields)
    state, out, first = trainer.init_state(0), [], None
    for step, batch, infos, _ in feeder.batches(0, 2):
        state, m = train_step(state, batch)
        out.append(jax.device_get(m))
        first = infos if first is None else first
    return out, jax.device_get({"params": state["params"], "tables": state["tables"]}), first


@pytest.fixture(scope="module")
def plain_steps(files, trainer4):
    """The plain source and _two_steps on it: the reference of every balanced step."""
    plain = make_source(_config(files, False), "train")
    return plain, _two_steps(*trainer4, plain)


@pytest.mark.parametrize("processes", [1, 2])
def test_the_balanced_step_equals_the_plain_step(files, trainer4, plain_steps, processes):
    trainer, train_step = trainer4
    plain, (want, want_state, infos) = plain_steps
    src = balance.train_source(_config(files, True), processes=processes)
    assert src.sequence_capacity(4) == plain.sequence_capacity(4)     # one compiled step for both
    got, got_state, bbs_infos = _two_steps(trainer, train_step, src)
    # the step really moved rows between devices, and dropped no event
    assert [i.rows.tolist() for i in bbs_infos] != [i.rows.tolist() for i in infos]
    assert sorted(np.concatenate([i.rows for i in bbs_infos]).tolist()) == \
        sorted(np.concatenate([i.rows for i in infos]).tolist())
    assert sum(i.counters["seq_truncated_to_capacity"] for i in infos + bbs_infos) == 0
    for g, w in zip(got, want):
        for k in ("loss", "loss_sum", "weight_sum", "positive_sum", "grad_norm"):
            np.testing.assert_allclose(g[k], w[k], rtol=2e-5, err_msg=k)
    assert want[0]["grad_norm"] > 0 and want[1]["loss"] != want[0]["loss"]   # the steps did update
    flat_got = jax.tree_util.tree_leaves_with_path(got_state)
    for (path, a), b in zip(flat_got, jax.tree.leaves(want_state)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))


def test_a_bbs_run_on_parquet_trains_and_resumes_exactly(files, tmp_path):
    cfg = _config(files, True)
    mesh = Mesh(np.array(jax.devices()[:4]), ("batch",))    # trainer4's mesh: the same compiled step
    whole, resumed, a, b = whole_and_resumed(cfg, tmp_path, mesh, stop_after=2)
    assert [(r["step"], r["kind"]) for r in a] == [(2, "train"), (2, "eval"), (4, "train"), (4, "eval")]
    assert a == b                                  # every loss, NE, load ratio and counter, bit for bit
    assert whole["eval_ne"] == resumed["eval_ne"] and np.isfinite(whole["eval_ne"])
    train_rows = [r for r in a if r["kind"] == "train"]
    assert all(np.isfinite(r["loss"]) and r["load_tokens_max_over_mean"] >= 1.0 for r in train_rows)


def test_two_processes_each_balance_the_rows_they_read(files):
    """2 processes x 2 CPU devices: each process reads only its own devices' source shards
    and serves the rows one process serves with processes=2 (the same blocks, same plan)."""
    import json

    from gemjax.parallel import launch
    cfg = _config(files, True)
    results = launch.launch("tests.bbs_feed:feed_rows", 2, cpu_devices=2, timeout_s=240,
                            kwargs=dict(config=json.loads(json.dumps(dataclasses.asdict(cfg))), steps=3))
    src = balance.train_source(cfg, processes=2)
    plain = make_source(_config(files, False), "train")
    for res in results:
        mine = res["shards"]
        assert mine == [2 * res["process"], 2 * res["process"] + 1] and res["built"] == mine
        for step, rows in enumerate(res["rows"]):
            assert rows == [src.shard_batch(step, s, 4)[1].rows.tolist() for s in mine]
            assert sorted(sum(rows, [])) == sorted(sum((plain.shard_batch(step, s, 4)[1].rows.tolist()
                                                        for s in mine), []))
        assert any(rows != [plain.shard_batch(step, s, 4)[1].rows.tolist() for s in mine]
                   for step, rows in enumerate(res["rows"]))       # BBS moved some rows
