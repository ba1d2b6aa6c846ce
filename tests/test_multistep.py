"""train.steps_per_call (gemjax.train.multistep): K steps per jitted call train what K calls
of one step train, the stacked feed equals the per-step feed, a K-step run killed (kill -9)
and stopped (SIGTERM) resumes to the uninterrupted K-step run's bits, and the settings it
cannot honour are refused by name; with sparse branch plans per batch a call runs its K
steps on one plan covering each."""

import dataclasses
import os
import re
import sys

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from gemjax.config import apply_overrides, get_config
from gemjax.data.feeding import Feeder
from gemjax.data.source import make_source
from gemjax.train import layout, multistep, runtime
from gemjax.train.loop import train
from gemjax.train.step import Trainer
from test_faults import (Run, assert_same_checkpoint, host, kill_once_saved, restored, rows,
                         sigterm_at_pause, steps_in)

# the tiny preset's logistic regression: every sparse feature and sequence field looked up
# in its table, the dense features through its dense weights (the dense optimizer), the
# same train step around it; its programs compile in about half the time of the GEM model's
OVERRIDES = ("model.kind=lr,train.log_every=4,train.eval_every=8,train.checkpoint_every=4,"
             "data.eval_batches=1,train.tensorboard=false")


def tiny(k, steps=16, extra=""):
    over = f"{OVERRIDES},train.steps={steps},train.steps_per_call={k}" + (f",{extra}" if extra else "")
    return apply_overrides(get_config("tiny"), over)


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


K_DEVICES = 2       # the CPU devices of the experiments/train.py children (k_runs)


def k_args(k):
    """experiments/train.py's flags for tiny(k)."""
    return ["--config=tiny", "--steps=16", f"--override={OVERRIDES},train.steps_per_call={k}"]


@pytest.fixture(scope="module")
def k_runs(tmp_path_factory):
    """experiments/train.py at K=4 on K_DEVICES CPU devices (the default layout), 16 steps,
    in two children: kill -9 after checkpoint 4 is on disk and step 8 ran; then in one
    child the resume, SIGTERM after step 12 (the child prints the stopped command's exit
    code and goes on), the resume to 16, an uninterrupted K=4 run and an uninterrupted
    K=1 run of the same config (the imports and the K=4 programs paid once).
    {"cut", "k4", "k1": workdir, "out": the second child's output}."""
    root = tmp_path_factory.mktemp("k_runs")
    dirs = {name: str(root / name) for name in ("cut", "k4", "k1")}
    checkpoints = os.path.join(dirs["cut"], "checkpoints")
    run = Run(dirs["cut"], pause="step:8", args=k_args(4), devices=K_DEVICES)
    run.wait_for("test pause at step 8")
    kill_once_saved(run, checkpoints, 4)
    assert steps_in(checkpoints) == [4]

    run = Run(dirs["cut"], pause="step:12", args=k_args(4), devices=K_DEVICES,
              then=[dirs["cut"], dirs["k4"], (dirs["k1"], k_args(1))])   # the resume, the references
    sigterm_at_pause(run, 12, 4, goes_on=True)
    assert run.finish() == 0, run.out[-3000:]
    return {**dirs, "out": run.out}


def k_trainer(cfg):
    """cfg's Trainer on K_DEVICES devices of this process (to restore k_runs' checkpoints)."""
    return Trainer.create(cfg, Mesh(np.array(jax.devices()[:K_DEVICES]), ("batch",)))


@pytest.mark.slow
def test_k_steps_per_call_train_what_one_step_per_call_trains(k_runs):
    """K_DEVICES devices, 16 steps (k_runs' uninterrupted runs): K=4 writes the K=1 run's
    metrics.jsonl rows (every train and eval figure, the fallback counters) and ends in
    its state, to float32 rounding."""
    for kind in ("train", "eval"):
        one, four = rows(k_runs["k1"], kind), rows(k_runs["k4"], kind)
        assert [r["step"] for r in one] == [r["step"] for r in four]
        assert [r["step"] for r in one] == ([4, 8, 12, 16] if kind == "train" else [8, 16])
        for a, b in zip(one, four):
            assert a.keys() == b.keys()
            for key in a:
                if isinstance(a[key], float):
                    np.testing.assert_allclose(b[key], a[key], rtol=2e-6, err_msg=f"{kind} {key}")
                else:
                    assert a[key] == b[key], (kind, key)
    trainer = k_trainer(tiny(1))
    got = restored(trainer, os.path.join(k_runs["k4"], "checkpoints"), 16)
    want = restored(trainer, os.path.join(k_runs["k1"], "checkpoints"), 16)
    assert got[0] == want[0] == 16
    for a, b in zip(host(got[1]), host(want[1])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def feed_trainer():
    """The K=3 config and its Trainer on 8 devices (built once for both feeds)."""
    cfg = tiny(3, steps=12, extra="data.batch_size=32,train.log_every=3,train.eval_every=12,"
                                  "train.checkpoint_every=12")
    return cfg, Trainer.create(cfg)


@pytest.mark.parametrize("pack", [True, False])
def test_stacked_feed_is_the_per_step_feed(pack, feed_trainer):
    """StackedFeeder items on 8 devices: [K, B, ...] arrays, sharded over the batch axis on
    their second dim, holding steps first .. first + K - 1 of the plain Feeder; the infos
    and tokens of those steps, step by step."""
    cfg, trainer = feed_trainer
    source = make_source(cfg, "train")
    kw = dict(check_ids=trainer.coll.check_ids, id_fields=trainer.id_fields, pack=pack)
    plain = Feeder(source.shard_batch, trainer.mesh, **kw)
    stacked = multistep.feeder(3, source.shard_batch, trainer.mesh, workers=2, **kw)
    items = list(stacked.batches(3, 9))
    assert [i[0] for i in items] == [3, 6]
    for first, batch, infos, tokens in items:
        want = [plain.host_batch(s) for s in range(first, first + 3)]
        for leaf, *per_step in zip(jax.tree.leaves(batch), *[jax.tree.leaves(w[0]) for w in want]):
            assert leaf.shape == (3,) + per_step[0].shape
            assert leaf.sharding.spec == multistep.stacked_sharding(trainer.mesh, ("batch",)).spec
            np.testing.assert_array_equal(np.asarray(leaf), np.stack(per_step))
        assert tokens == sum(w[2] for w in want)
        want_infos = [i for w in want for i in w[1]]
        assert len(infos) == len(want_infos) == 3 * 8
        for a, b in zip(infos, want_infos):
            for x, y in zip(_leaves(dataclasses.asdict(a)), _leaves(dataclasses.asdict(b))):
                np.testing.assert_array_equal(x, y)
    with pytest.raises(ValueError, match=r"steps \[2, 9\) must start and end at multiples of "
                                         r"train.steps_per_call=3"):
        next(stacked.batches(2, 9))


@pytest.mark.slow
def test_kill_and_sigterm_at_k4_resume_exactly(k_runs):
    """k_runs' K=4 run killed (kill -9 after checkpoint 4, step 8 ran) and stopped
    (SIGTERM after step 12), resumed to 16: the eval rows, the train rows and the final
    checkpoint equal the uninterrupted K=4 run's (the same command, run in the last
    resume's process after it), bit for bit."""
    workdir, reference = k_runs["cut"], k_runs["k4"]
    assert "resumed from step 12" in k_runs["out"]
    assert rows(workdir, "eval") == rows(reference, "eval")           # every digit
    assert rows(workdir, "train") == rows(reference, "train")
    assert [r["step"] for r in rows(reference, "train")] == [4, 8, 12, 16]
    assert_same_checkpoint(k_trainer(tiny(4)), os.path.join(workdir, "checkpoints"), reference, 16)


def test_what_k_steps_per_call_cannot_do_is_refused_by_name(tmp_path):
    for over, field in (("train.log_every=6", "train.log_every (6)"),
                        ("train.eval_every=10", "train.eval_every (10)"),
                        ("train.checkpoint_every=2", "train.checkpoint_every (2)"),
                        ("train.steps=18", "train.steps (18)")):
        with pytest.raises(ValueError, match=re.escape(f"{field} must be a multiple of "
                                                       f"train.steps_per_call (4)")):
            tiny(4, extra=over)
    with pytest.raises(ValueError, match=r"train.steps_per_call must be >= 1, got 0"):
        tiny(0)
    # a stop or resume between two calls of 4 steps
    with pytest.raises(ValueError, match=r"train.steps_per_call=4: the last step \(stop_after\) "
                                         r"is 6, not a multiple of 4"):
        train(tiny(4), str(tmp_path / "stop"), log=lambda s: None, stop_after=6)


def test_switched_tables_run_k_steps_on_one_plan_covering_each_batch():
    """Model-parallel tables with exchange buckets on 2 devices (a plan per batch; the 4
    batches' own plans differ): the call's plan covers each of its 4 batches' own plans,
    and the 4 steps equal 4 one-step calls on that plan, bit for bit (losses and state).
    The sparse features alone (model.use_sequences=false): their per-batch unique counts
    already pick different branches, and the programs compile in about half the time."""
    cfg = tiny(4, steps=8, extra="train.sparse_exchange_buckets=true,"
                                 "train.sparse_sync_buckets=true,parallel.table_plan=row_wise,"
                                 "data.batch_size=32,model.use_sequences=false")
    mesh, kw = layout.build(cfg, jax.devices()[:2])
    trainer = Trainer.create(cfg, mesh, **kw)
    assert trainer.coll.has_switches()
    source = make_source(cfg, "train")
    fkw = dict(check_ids=trainer.coll.check_ids, id_fields=trainer.id_fields)
    _, stacked, _, _ = next(iter(multistep.feeder(4, source.shard_batch, mesh, **fkw).batches(0, 4)))
    plain = Feeder(source.shard_batch, mesh, **fkw)
    singles = [plain.to_device(plain.host_batch(i)[0]) for i in range(4)]
    four, one = multistep.MultiStep(trainer, 4), trainer.make_train_step()
    plan = four.plan(stacked)
    owns = [one.plan(b) for b in singles]
    assert len(set(owns)) > 1, owns
    for own in owns:
        assert [t for t, _, _ in own] == [t for t, _, _ in plan]
        assert all(x >= a and y >= b for (_, x, y), (_, a, b) in zip(plan, own)), (plan, own)
    state4, m4 = four(trainer.init_state(0), stacked)
    assert four.plans == [plan]
    state, losses = trainer.init_state(0), []
    for batch in singles:
        state, m = one._fn(plan)(state, batch)
        losses.append(np.asarray(m["loss"]))
    np.testing.assert_array_equal(np.asarray(m4["loss"]), np.stack(losses))
    for a, b in zip(_leaves(state4), _leaves(state)):
        np.testing.assert_array_equal(a, b)


def test_gil_switch_interval_is_short_inside_the_loop_and_restored(monkeypatch):
    before = sys.getswitchinterval()
    monkeypatch.delenv(runtime.ENV_GIL_SWITCH, raising=False)
    with runtime.short_gil_switch():
        assert sys.getswitchinterval() == pytest.approx(runtime.GIL_SWITCH_US * 1e-6)
    assert sys.getswitchinterval() == before
    monkeypatch.setenv(runtime.ENV_GIL_SWITCH, "2000")
    with runtime.short_gil_switch():
        assert sys.getswitchinterval() == pytest.approx(2e-3)
    assert sys.getswitchinterval() == before
    for bad in ("0", "0.5", "fast"):
        monkeypatch.setenv(runtime.ENV_GIL_SWITCH, bad)
        with pytest.raises(ValueError, match=rf"\$GEMJAX_GIL_SWITCH_US='{re.escape(bad)}': expected a "
                                             r"positive integer of microseconds"):
            with runtime.short_gil_switch():
                pass
    assert sys.getswitchinterval() == before
