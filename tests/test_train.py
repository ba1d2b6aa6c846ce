"""Train loop: resume exactness, sparse-only embedding gradients, bad input, CLI errors."""

import dataclasses
import functools
import json
import os
import subprocess
import sys

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from gemjax.config import apply_overrides, get_config
from gemjax.data.feeding import Feeder, validate_batch
from gemjax.data.synthetic import SyntheticStream
from gemjax.train.loop import train
from gemjax.train.step import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = apply_overrides(get_config("tiny"), "train.steps=8,train.log_every=2,train.eval_every=4,"
                                           "train.checkpoint_every=2")


def _rows(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _final_state(trainer, workdir):
    from gemjax.train.checkpoint import Checkpointer
    with Checkpointer(os.path.join(workdir, "checkpoints")) as ck:
        return ck.restore(trainer.init_state(0))


def _one_device_mesh():
    return Mesh(np.array(jax.devices()[:1]), ("batch",))


# one config for the run that trains toward the Bayes NE and the resume of it (the same
# train and eval programs): 60 steps, evals and checkpoints at 20, 40 and 60
RUN = apply_overrides(get_config("tiny"), "train.steps=60,train.eval_every=20,train.log_every=20,"
                                          "train.checkpoint_every=20")


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """RUN trained uninterrupted on one device: (workdir, summary)."""
    workdir = str(tmp_path_factory.mktemp("full"))
    return workdir, train(RUN, workdir, log=lambda s: None, mesh=_one_device_mesh())


def test_resume_equals_uninterrupted_run(full_run, tmp_path):
    """RUN interrupted after 40 steps (evals at 20 and 40 before it), resumed to 60: the
    metrics rows, the final checkpoint and its metadata equal the uninterrupted run's."""
    full, _ = full_run
    run = functools.partial(train, RUN, log=lambda s: None, mesh=_one_device_mesh())
    parts = str(tmp_path / "parts")
    run(parts, stop_after=40)                             # interrupted after k = 40 steps
    assert _rows(parts)[-1]["step"] == 40
    assert [r["step"] for r in _rows(parts) if r["kind"] == "eval"] == [20, 40]
    summary = run(parts)                                  # resumed to 60 steps
    keys = ("step", "kind", "loss", "ne", "auc", "seq_truncated_to_capacity", "ids_out_of_range")
    strip = lambda rows: [{k: r.get(k) for k in keys} for r in rows]  # noqa: E731
    assert strip(_rows(parts)) == strip(_rows(full))
    trainer = Trainer.create(RUN, _one_device_mesh())
    step_a, state_a, meta_a = _final_state(trainer, full)
    step_b, state_b, meta_b = _final_state(trainer, parts)
    assert step_a == step_b == 60 and meta_a == meta_b
    assert meta_a["data_step"] == 60 and meta_a["config"] == "tiny" and "item" in meta_a["table_layouts"]
    for a, b in zip(jax.tree.leaves(state_a), jax.tree.leaves(state_b)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert summary["steps"] == 60 and np.isfinite(summary["eval_ne"]) and "bayes_ne" in summary


def test_training_moves_toward_bayes_ne(full_run):
    _, s = full_run
    first_eval_ne = 1.0                                   # an untrained model sits near NE 1
    assert s["bayes_ne"] < s["eval_ne"] < first_eval_ne
    assert s["samples_per_sec"] > 0


def _walk_shapes(jaxpr, found):
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            found.append((eqn.primitive.name, tuple(getattr(v.aval, "shape", ()))))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            _walk_shapes(sub, found)


def test_no_dense_embedding_gradient_in_train_step():
    """The only [vocab, dim] values in the step are the tables' in-place row updates."""
    cfg = apply_overrides(get_config("tiny"), "data.vocab_user=200003,model.dim=8")
    trainer = Trainer.create(cfg)
    state = trainer.init_state(0)
    stream = SyntheticStream(cfg.data, 0)
    feeder = Feeder(stream.shard_batch, trainer.mesh)
    batch = feeder.to_device(feeder.host_batch(0)[0])
    step = trainer.make_train_step()
    jaxpr = jax.make_jaxpr(step)(state, batch)
    shapes = []
    _walk_shapes(jaxpr.jaxpr, shapes)
    table = (200003, 8)
    producers = {name for name, shape in shapes if shape == table}
    # scatter = the touched-row update of the table itself (cond: the unique-count bucket
    # switch returning it); a dense gradient would show up as broadcast/zeros, add, or a
    # scatter-add into a fresh [vocab, dim] buffer
    allowed = {"scatter", "pjit", "jit", "shard_map", "cond"}
    assert producers <= allowed, producers
    # the check can fail: a naive jnp.take gradient builds a dense [vocab, dim] buffer
    naive = jax.make_jaxpr(jax.grad(lambda t, i: jnp.take(t, i, axis=0).sum()))(
        jnp.zeros(table), jnp.zeros((5,), jnp.int32))
    naive_shapes = []
    _walk_shapes(naive.jaxpr, naive_shapes)
    assert {name for name, shape in naive_shapes if shape == table} - allowed
    compiled = step.lower(state, batch).compile()
    mem = compiled.memory_analysis()
    table_bytes = 200003 * 8 * 4
    assert mem.temp_size_in_bytes < table_bytes / 4, (mem.temp_size_in_bytes, table_bytes)


def test_bad_input_is_named():
    stream = SyntheticStream(TINY.data, 0)
    trainer = Trainer.create(TINY)
    batch, _ = stream.shard_batch(0)
    dense = batch.dense.copy()
    dense[3, 1] = np.nan
    with pytest.raises(ValueError, match="dense feature 1 of sample 3 is nan"):
        validate_batch(batch.replace(dense=dense))
    sparse = dict(batch.sparse, context=batch.sparse["context"].copy())
    sparse["context"][0] = -1
    with pytest.raises(ValueError, match="feature 'context'"):
        validate_batch(batch.replace(sparse=sparse), trainer.coll.check_ids, trainer.id_fields)
    seqs = dict(batch.sequences)
    seqs["clicks"] = seqs["clicks"].replace(values=dict(seqs["clicks"].values))
    seqs["clicks"].values["item"] = seqs["clicks"].values["item"].copy()
    seqs["clicks"].values["item"][0] = TINY.data.synthetic.vocab_item + 5
    with pytest.raises(ValueError, match="feature 'clicks.item'"):
        validate_batch(batch.replace(sequences=seqs), trainer.coll.check_ids, trainer.id_fields)
    labels = batch.labels.copy()
    labels[0, 0] = 0.5
    with pytest.raises(ValueError, match="labels must be 0 or 1"):
        validate_batch(batch.replace(labels=labels))


def test_config_errors():
    with pytest.raises(ValueError, match="unknown config preset 'huge'"):
        get_config("huge")
    with pytest.raises(ValueError, match="model has no field 'width'"):
        get_config("tiny", "model.width=3")
    with pytest.raises(ValueError, match="not a valid int"):
        get_config("tiny", "data.batch_size=abc")
    with pytest.raises(ValueError, match="seq_cap must be in"):
        get_config("tiny", "data.seq_cap=20000")
    cfg = get_config("tiny", "model.head_mlp=32:16,model.use_sequences=false,data.vocab_user=1e6")
    assert cfg.model.head_mlp == (32, 16) and not cfg.model.use_sequences
    assert cfg.data.synthetic.vocab_user == 10**6


def test_cli_rejects_unknown_preset_with_a_clear_message():
    r = subprocess.run([sys.executable, "-m", "experiments.train",
                        "--config=nope", "--workdir=/tmp/unused"], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode != 0
    assert "unknown config preset 'nope'" in r.stderr + r.stdout


def test_batch_not_divisible_by_devices_is_an_error():
    cfg = dataclasses.replace(TINY.data, batch_size=63)
    with pytest.raises(ValueError, match="not divisible by the 2 batch shards"):
        SyntheticStream(cfg, 0).shard_batch(0, 0, 2)


def test_restore_refuses_a_permuted_table_layout():
    """Mod-split tables change row order with the shard count: the loop must refuse."""
    from gemjax.train.checkpoint import check_table_layouts
    base = dict(vocab=10, padded_vocab=16, num_model=8, num_fs=1, rows_per_shard=2, split="mod",
                fixed_shard=-1, base=0)
    four = dict(base, num_model=4, rows_per_shard=4)
    check_table_layouts({"item": base}, {"item": dict(base)})
    with pytest.raises(ValueError, match=r"checkpoint tables \['item'\]"):
        check_table_layouts({"item": base}, {"item": four})
    rng = dict(base, split="range")
    check_table_layouts({"item": rng}, {"item": dict(rng, num_model=4, rows_per_shard=4)})


@pytest.mark.parametrize("over,devices", [("", 1), ("", 2),
                                          ("model.kind=teacher,model.precision.format=fp8,"
                                           "model.precision.scaling=delayed", 2)])
def test_abstract_state_is_init_states_tree_of_shapes(over, devices):
    """Trainer.abstract_state (the restore target of gemjax.serve.restore, the lowering
    input of bench_fp8) holds init_state's tree leaf for leaf: shape, dtype and sharding,
    with the FP8 amax histories of an FP8 teacher; nothing in it is an array."""
    cfg = apply_overrides(TINY, over) if over else TINY
    trainer = Trainer.create(cfg, Mesh(np.array(jax.devices()[:devices]), ("batch",)))
    abstract, real = trainer.abstract_state(), trainer.init_state(0)
    assert jax.tree.structure(abstract) == jax.tree.structure(real)
    assert ("fp8_meta" in real) == bool(over)
    leaves = zip(jax.tree_util.tree_leaves_with_path(abstract), jax.tree.leaves(real))
    for (path, a), r in leaves:
        assert isinstance(a, jax.ShapeDtypeStruct), path
        assert (a.shape, a.dtype) == (r.shape, r.dtype), path
        assert a.sharding.is_equivalent_to(r.sharding, r.ndim), path
