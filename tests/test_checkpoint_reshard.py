"""Checkpoints of sharded tables restore onto another mesh shape and plan (issue 3, deliverable 6).

Tables are saved in logical row order (`save_train_state`) and permuted into the new
mesh's storage order on restore (`restore_train_state`). The reference for "the saved
tables" is the live state before the save, brought to logical order on the host by
`Layout.storage_index` (numpy), a different path from the on-device all_to_all.
"""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gemjax.config import apply_overrides, get_config
from gemjax.data.feeding import Feeder
from gemjax.data.synthetic import SyntheticStream
from gemjax.sparse import EmbeddingCollection, TableSpec
from gemjax.sparse.optimizers import RowWiseAdagrad
from gemjax.train.checkpoint import (Checkpointer, restore_train_state, save_train_state,
                                     table_layouts)
from gemjax.train.loop import train
from gemjax.train.step import Trainer

CFG = apply_overrides(get_config("tiny"), "train.steps=5,train.log_every=1,train.eval_every=100,"
                                          "train.checkpoint_every=100,data.eval_batches=1,"
                                          "model.use_sequences=false")   # smaller programs
SAVED_AT = 3


def mesh_of(shape, names, first=0):
    n = int(np.prod(shape))
    return Mesh(np.array(jax.devices()[first:first + n]).reshape(shape), names)


def host(tree):
    return jax.tree.map(lambda x: np.array(x), jax.device_get(tree))


def run_steps(trainer, state, start, end):
    feeder = Feeder(SyntheticStream(CFG.data, CFG.train.seed, "train").shard_batch, trainer.mesh,
                    id_fields=trainer.id_fields, workers=0)
    step_fn, losses = trainer.make_train_step(), []
    for _, batch, _, _ in feeder.batches(start, end):
        state, m = step_fn(state, batch)
        losses.append(float(m["loss"]))
    return state, losses


def all_id_lookups(coll, state):
    """{table: [V, D]}: every id of every table looked up through the sharded path (one jit)."""
    n_dev = int(np.prod([coll.mesh.shape[a] for a in coll.batch_axes]))
    feats = {}
    for spec in coll.specs.values():
        ids = np.arange(-(-spec.vocab // n_dev) * n_dev) % spec.vocab
        feats[spec.features[0]] = jax.device_put(ids.astype(np.int32),
                                                 NamedSharding(coll.mesh, P(coll.batch_axes)))
    acts, res = jax.jit(coll.lookup)(state, feats)
    assert int(res["stats"]["ids_overflow"]) == 0
    return {n: np.asarray(acts[s.features[0]])[:s.vocab] for n, s in coll.specs.items()}


def assert_tables_equal(coll, state, ref):
    """Restored state's lookups and optimizer state == ref ({table: {name: [V, ...]}})."""
    got = coll.to_logical(state)
    looked_up = all_id_lookups(coll, state)
    for n, arrays in ref.items():
        np.testing.assert_array_equal(looked_up[n], arrays["weights"], err_msg=f"lookup {n}")
        assert set(got[n]) == set(arrays)
        for k, v in arrays.items():
            np.testing.assert_array_equal(got[n][k], v, err_msg=f"{n}.{k}")


def train_and_save(tmp_path, mesh, **trainer_kw):
    """SAVED_AT steps on `mesh`, saved as the loop saves; (trainer, host ref tables, dense)."""
    trainer = Trainer.create(CFG, mesh, **trainer_kw)
    state, _ = run_steps(trainer, trainer.init_state(CFG.train.seed), 0, SAVED_AT)
    ref_tables = trainer.coll.to_logical(state["tables"])
    ref_dense = host({"params": state["params"], "opt_state": state["opt_state"]})
    with Checkpointer(tmp_path / "checkpoints") as ckpt:
        assert save_train_state(ckpt, trainer.coll, SAVED_AT, state,
                                {"data_step": SAVED_AT, "config": CFG.name})
    return trainer, ref_tables, ref_dense


def restore_on(tmp_path, mesh, **trainer_kw):
    trainer = Trainer.create(CFG, mesh, **trainer_kw)
    with Checkpointer(tmp_path / "checkpoints") as ckpt:
        step, state, meta = restore_train_state(ckpt, trainer.coll, trainer.init_state(7), SAVED_AT)
    assert step == SAVED_AT and meta["data_step"] == SAVED_AT and meta["table_order"] == "logical"
    return trainer, state


# every plan in one 8-device run on a (replica 2, model 4) mesh: "user" row_wise mod over
# all 8 devices, fs2d (mod) and 2d (range split) over the model axis, two table_wise
# tables sharing one stack
MIXED = {"user": "row_wise", "item": "fs2d", "category": "2d_range", "segment": "table_wise",
         "context": "table_wise"}


def test_8_devices_every_plan_restored_on_4_and_1_then_resumed(tmp_path):
    mesh8 = mesh_of((2, 4), ("replica", "model"))
    t8, ref, ref_dense = train_and_save(tmp_path, mesh8, table_plan=MIXED,
                                        table_replica_axes=("replica",))
    plans, lays = t8.coll.plans, t8.coll.layouts
    assert plans["user"].kind == "row_wise" and plans["user"].split == "mod"
    assert lays["user"].num_shards == 8 and lays["item"].num_fs == 2 and lays["item"].num_model == 4
    assert plans["category"].kind == "2d" and plans["category"].split == "range"
    assert any(u.startswith("@table_wise") for u in t8.coll.units)
    # the 8-device storage order is not the logical one, so a raw restore would permute rows
    assert not np.array_equal(lays["user"].storage_index(np.arange(lays["user"].vocab)),
                              np.arange(lays["user"].vocab))
    assert np.any(ref["user"]["accum"] != ref["user"]["accum"][0])    # trained, not initial
    for mesh, plan in ((mesh_of((4,), ("batch",), first=4), "row_wise"),
                       (mesh_of((1,), ("batch",)), "row_wise")):
        trainer, state = restore_on(tmp_path, mesh, table_plan=plan)
        assert trainer.coll.layouts["user"].num_shards == mesh.size
        assert set(state["tables"]) == set(trainer.coll.specs)
        assert_tables_equal(trainer.coll, state["tables"], ref)
        got_dense = host({"params": state["params"], "opt_state": state["opt_state"]})
        for a, b in zip(jax.tree.leaves(got_dense), jax.tree.leaves(ref_dense)):
            np.testing.assert_array_equal(a, b)
        assert {d.id for d in state["tables"]["user"]["weights"].sharding.device_set} == \
            {d.id for d in mesh.devices.flat}
    # resume through the loop on 4 devices (row_wise mod over 4) == the same steps run by hand
    # from the saved state built independently (host reference -> coll.from_logical)
    mesh4 = mesh_of((4,), ("batch",), first=4)
    train(CFG, str(tmp_path), log=lambda s: None, mesh=mesh4, trainer_kw={"table_plan": "row_wise"})
    t4 = Trainer.create(CFG, mesh4, table_plan="row_wise")
    start = t4.init_state(0)
    start["tables"] = t4.coll.from_logical(ref)
    for key in ("params", "opt_state"):
        start[key] = jax.tree.map(lambda a, x: jax.device_put(a, x.sharding), ref_dense[key],
                                  start[key])
    start["step"] = jax.device_put(np.int32(SAVED_AT), start["step"].sharding)
    by_hand, losses4 = run_steps(t4, start, SAVED_AT, CFG.train.steps)
    with Checkpointer(tmp_path / "checkpoints") as ckpt:
        step, looped, _ = restore_train_state(ckpt, t4.coll, t4.init_state(1))
    assert step == CFG.train.steps
    assert np.all(np.isfinite(losses4))
    got, want = host(looped), host(by_hand)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)


SPECS = [TableSpec("a", 53, 4, features=("fa",), optimizer=RowWiseAdagrad(lr=0.1)),
         TableSpec("b", 37, 3, features=("fb",), optimizer=RowWiseAdagrad(lr=0.1)),
         TableSpec("c", 5, 3, features=("fc",), optimizer=RowWiseAdagrad(lr=0.1))]
PLANS = [((8,), ("x",), "row_wise", ()), ((3,), ("x",), "row_wise", ()),
         ((2, 4), ("r", "m"), {"a": "fs2d", "b": "table_wise", "c": "replicated"}, ("r",)),
         ((4, 2), ("m", "r"), {"a": "2d", "b": "row_wise_range", "c": "table_wise"}, ("r",))]


@pytest.mark.parametrize("shape,names,plan,replica", PLANS, ids=["mod8", "mod3", "mixed2x4", "mixed4x2"])
def test_logical_arrays_match_the_host_permutation(shape, names, plan, replica):
    """On-device logical order == numpy storage_index order; round trip exact; zero padding."""
    coll = EmbeddingCollection(SPECS, plan, mesh_of(shape, names), replica_axes=replica)
    rng = np.random.default_rng(0)
    tables = {s.name: {"weights": rng.normal(size=(s.vocab, s.dim)).astype(np.float32),
                       "accum": rng.random(s.vocab).astype(np.float32)} for s in SPECS}
    state = coll.from_logical(tables)
    logical = coll.logical_arrays(state)
    targets = coll.logical_targets()
    for n, arrays in tables.items():
        for k, v in arrays.items():
            got = logical[n][k]
            assert got.shape == targets[n][k].shape and got.sharding == targets[n][k].sharding
            assert got.shape[0] >= len(v)
            np.testing.assert_array_equal(np.asarray(got)[:len(v)], v, err_msg=f"{plan} {n}.{k}")
            assert not np.asarray(got)[len(v):].any()
    back = coll.from_logical_arrays(logical)
    got = coll.to_logical(back)
    for n, arrays in tables.items():
        for k, v in arrays.items():
            np.testing.assert_array_equal(got[n][k], v)
    for u, arrays in back.items():
        for k, a in arrays.items():
            assert a.sharding == coll.state_sharding()[u][k]
            assert a.shape == state[u][k].shape
            if coll.layouts[coll.units[u][0]].fixed_shard < 0:     # padding rows come back zero
                lay = coll.layouts[coll.units[u][0]]
                pad = np.setdiff1d(np.arange(lay.padded_vocab), lay.storage_index(np.arange(lay.vocab)))
                assert not np.asarray(a)[pad].any()


def test_from_logical_arrays_names_bad_input():
    coll = EmbeddingCollection(SPECS, "row_wise", mesh_of((2,), ("x",)))
    logical = coll.logical_targets()      # checked before anything runs: shapes suffice
    with pytest.raises(ValueError, match="table 'b': expected arrays"):
        coll.from_logical_arrays({**logical, "b": {"weights": logical["b"]["weights"]}})
    short = {**logical, "a": {**logical["a"], "accum": jax.ShapeDtypeStruct((10,), np.float32)}}
    with pytest.raises(ValueError, match="table 'a' array 'accum': 10 rows < vocab 53"):
        coll.from_logical_arrays(short)


def test_checkpointer_resizes_only_the_leading_dim_of_resizable_paths(tmp_path):
    mesh = mesh_of((4,), ("x",))
    rows = np.arange(12.0, dtype=np.float32).reshape(6, 2)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"tables": {"t": jax.device_put(rows)}, "w": np.ones(3, np.float32)})
    ckpt = Checkpointer(tmp_path)
    for n in (4, 8):      # truncated, zero padded; sharded 4 ways either way
        sh = NamedSharding(mesh, P("x"))
        target = {"tables": {"t": jax.ShapeDtypeStruct((n, 2), np.float32, sharding=sh)},
                  "w": np.zeros(3, np.float32)}
        _, got, _ = ckpt.restore(target, resizable=("tables",))
        want = np.zeros((n, 2), np.float32)
        want[:min(n, 6)] = rows[:min(n, 6)]
        np.testing.assert_array_equal(np.asarray(got["tables"]["t"]), want)
        assert got["tables"]["t"].sharding == sh
    bad = [({"tables": {"t": np.zeros((8, 2), np.float32)}, "w": np.zeros(3, np.float32)}, (),
            r"tables/t: checkpoint shape \(6, 2\)"),
           ({"tables": {"t": np.zeros((6, 3), np.float32)}, "w": np.zeros(3, np.float32)},
            ("tables",), r"tables/t: checkpoint shape \(6, 2\), target shape \(6, 3\)"),
           ({"tables": {"t": np.zeros((6, 2), np.float32)}, "w": np.zeros(4, np.float32)},
            ("tables",), r"w: checkpoint shape \(3,\)")]
    for target, resizable, match in bad:
        with pytest.raises(ValueError, match=match):
            ckpt.restore(target, resizable=resizable)


def test_old_storage_order_checkpoint_restores_on_its_layout_and_is_refused_on_another(tmp_path):
    """Checkpoints written before logical order (no meta["table_order"]) keep working where
    they are valid and get the clear layout error elsewhere."""
    coll8 = EmbeddingCollection(SPECS, "row_wise", mesh_of((8,), ("x",)))
    state = {"tables": coll8.init(jax.random.key(0)), "step": 2}
    ref = coll8.to_logical(state["tables"])
    with Checkpointer(tmp_path) as ckpt:         # the old loop's save: raw storage order
        ckpt.save(2, state, {"data_step": 2, "table_layouts": table_layouts(coll8)})
    with Checkpointer(tmp_path) as ckpt:
        target = {"tables": coll8.init(jax.random.key(1)), "step": 0}
        step, same, _ = restore_train_state(ckpt, coll8, target)
        assert step == 2 and same["step"] == 2
        got = coll8.to_logical(same["tables"])
        for n in ref:
            for k in ref[n]:
                np.testing.assert_array_equal(got[n][k], ref[n][k])
        coll4 = EmbeddingCollection(SPECS, "row_wise", mesh_of((4,), ("x",)))
        with pytest.raises(ValueError, match=r"checkpoint tables \['a', 'b', 'c'\] were stored "
                                             r"for another row layout"):
            restore_train_state(ckpt, coll4, {"tables": coll4.init(jax.random.key(1)), "step": 0})
