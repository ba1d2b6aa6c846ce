"""Checkpointer: round trips (1 and 8 devices, resharded onto 4), keep-N, crash safety, errors."""

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from gemjax.train.checkpoint import Checkpointer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_state(seed=0):
    """A small train state shaped like the lead's: params, optax state, tables, step, rng."""
    k = jax.random.key(seed)
    params = {"dense": {"kernel": jax.random.normal(k, (4, 3)), "bias": jnp.zeros(3)},
              "head.click": {"w": jnp.arange(6.0, dtype=jnp.bfloat16).reshape(2, 3)}}
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    opt_state = tx.init(params)
    # make the optimizer moments non-trivial
    grads = jax.tree.map(lambda x: jnp.ones_like(x) * 0.5, params)
    _, opt_state = tx.update(grads, opt_state, params)
    tables = {"items": {"weights": jax.random.normal(jax.random.fold_in(k, 1), (16, 4)),
                        "accum": jnp.full((16,), 0.1 + seed)}}
    return {"params": params, "opt_state": opt_state, "tables": tables,
            "step": jnp.asarray(7 + seed, jnp.int32), "rng": jax.random.fold_in(k, 3),
            "rng_data": jax.random.key_data(jax.random.key(seed + 1)),
            "epoch": 2 + seed, "lr_scale": 0.5, "host": np.arange(3) + seed}


def assert_tree_equal(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        if hasattr(b, "dtype") and jax.dtypes.issubdtype(b.dtype, jax.dtypes.prng_key):
            assert a.dtype == b.dtype
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        assert type(a) is type(b) or (isinstance(a, jax.Array) and isinstance(b, jax.Array))
        assert np.asarray(a).dtype == np.asarray(b).dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_round_trip_one_device_with_optax_and_keys(tmp_path):
    state = make_state()
    want = make_state()  # deterministic: an independent copy of the values
    with Checkpointer(tmp_path, keep=2) as ckpt:
        assert ckpt.latest_step() is None
        assert ckpt.save(10, state, {"data_position": 123, "config": "tiny"})
        # save copied to host: donating / deleting the buffers afterwards is safe
        for leaf in jax.tree.leaves(state):
            if isinstance(leaf, jax.Array):
                leaf.delete()
        ckpt.wait()
        assert ckpt.latest_step() == 10
        target = make_state(seed=5)  # same structure, different values
        step, got, meta = ckpt.restore(target)
    assert step == 10 and meta == {"data_position": 123, "config": "tiny"}
    assert_tree_equal(got, want)
    # optax namedtuples come back as namedtuples and keep working
    assert type(got["opt_state"][1][0]).__name__ == "ScaleByAdamState"
    # abstract target from eval_shape (+ device shardings)
    dev = NamedSharding(jax.make_mesh((1,), ("d",), devices=jax.devices()[:1]), P())
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=dev) if isinstance(x, jax.Array)
        else x, make_state(seed=5))
    _, got2, _ = Checkpointer(tmp_path).restore(abstract)
    assert_tree_equal(got2, want)


def test_sharded_8_devices_restore_onto_4_devices_other_layout(tmp_path):
    mesh8 = jax.make_mesh((4, 2), ("data", "model"))
    rng = np.random.default_rng(0)
    table = rng.normal(size=(32, 8)).astype(np.float32)
    dense = rng.normal(size=(8, 12)).astype(np.float32)
    keys = jax.random.split(jax.random.key(1), 8)
    state = {
        "tables": {"t": {"weights": jax.device_put(table, NamedSharding(mesh8, P(("data", "model")))),
                         "accum": jax.device_put(table[:, 0], NamedSharding(mesh8, P("data")))}},
        "params": {"w": jax.device_put(dense, NamedSharding(mesh8, P("model", "data")))},
        "rng": jax.device_put(keys, NamedSharding(mesh8, P("data"))),
        "step": 3,
    }
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(3, state, {})
    mesh4 = jax.make_mesh((2, 2), ("x", "y"), devices=jax.devices()[4:])
    spec = {"tables": {"t": {"weights": P(None, "x"), "accum": P(("y", "x"))}},
            "params": {"w": P("y")}, "rng": P("x"), "step": None}
    target = jax.tree.map(
        lambda x, s: x if s is None else jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                              sharding=NamedSharding(mesh4, s)),
        state, spec, is_leaf=lambda x: x is None)
    step, got, _ = Checkpointer(tmp_path).restore(target)
    np.testing.assert_array_equal(np.asarray(got["tables"]["t"]["weights"]), table)
    np.testing.assert_array_equal(np.asarray(got["tables"]["t"]["accum"]), table[:, 0])
    np.testing.assert_array_equal(np.asarray(got["params"]["w"]), dense)
    np.testing.assert_array_equal(jax.random.key_data(got["rng"]), jax.random.key_data(keys))
    assert got["step"] == 3 and isinstance(got["step"], int)
    assert got["tables"]["t"]["weights"].sharding == NamedSharding(mesh4, P(None, "x"))
    assert got["rng"].sharding.mesh == mesh4
    assert {d.id for d in got["params"]["w"].sharding.device_set} == {4, 5, 6, 7}


def test_steps_listed_include_a_save_still_in_flight(tmp_path, monkeypatch):
    """all_steps / latest_step wait for an async save whose commit is slow (a NaN error
    names the checkpoints kept: the one being written is among them)."""
    from orbax.checkpoint._src.path import atomicity
    finalize = atomicity.AtomicRenameTemporaryPath.finalize

    async def slow(self, *a, **k):
        await asyncio.sleep(0.5)
        return await finalize(self, *a, **k)
    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", slow)
    with Checkpointer(tmp_path, keep=3) as ckpt:
        ckpt.save(1, {"w": jnp.ones(3)})
        assert ckpt.all_steps() == [1]
        ckpt.save(2, {"w": jnp.ones(3)})
        assert ckpt.latest_step() == 2


def test_keep_n_deletes_old_steps_and_skips_old_saves(tmp_path):
    with Checkpointer(tmp_path, keep=2, async_save=False) as ckpt:
        for step in range(1, 6):
            assert ckpt.save(step, {"w": jnp.full(3, float(step))}, {"step": step})
        assert ckpt.all_steps() == [4, 5]
        assert not ckpt.save(5, {"w": jnp.zeros(3)})  # not newer: skipped
        assert not ckpt.save(2, {"w": jnp.zeros(3)})
    assert sorted(p for p in os.listdir(tmp_path) if p.isdigit()) == ["4", "5"]
    ckpt = Checkpointer(tmp_path)
    step, got, meta = ckpt.restore({"w": jnp.zeros(3)}, step=4)
    assert step == 4 and meta == {"step": 4}
    np.testing.assert_array_equal(got["w"], np.full(3, 4.0))
    with pytest.raises(FileNotFoundError, match="step 2"):
        ckpt.restore({"w": jnp.zeros(3)}, step=2)


CHILD = textwrap.dedent("""
    import asyncio, sys
    import jax, jax.numpy as jnp, numpy as np
    from gemjax.train.checkpoint import Checkpointer
    directory, mode, marker = sys.argv[1:4]
    ckpt = Checkpointer(directory, keep=3)
    ckpt.save(1, {"w": jnp.full((4,), 1.0), "big": jnp.zeros((8,))}, {"pos": 1})
    ckpt.wait()
    if mode == "hang":  # everything written, killed before the commit rename
        from orbax.checkpoint._src.path import atomicity
        async def hang(self):
            open(marker, "w").write("ready")
            while True:
                await asyncio.sleep(1)
        atomicity.AtomicRenameTemporaryPath.finalize = hang
        big = np.zeros((8,), np.float32)
    else:  # killed while a large array is being written
        big = np.random.default_rng(0).random(48 * 2**20 // 4, dtype=np.float32)
        open(marker, "w").write("ready")
    ckpt.save(2, {"w": jnp.full((4,), 2.0), "big": jnp.asarray(big)}, {"pos": 2})
    ckpt.wait()
    print("save 2 finished")
""")


def tmp_bytes(directory):
    """Bytes under orbax temporary step directories; -1 if there is none."""
    total = -1
    for name in os.listdir(directory) if os.path.isdir(directory) else []:
        if ".orbax-checkpoint-tmp" in name:
            total = max(total, 0)
            for root, _, files in os.walk(os.path.join(directory, name)):
                for f in files:
                    try:
                        total += os.path.getsize(os.path.join(root, f))
                    except FileNotFoundError:
                        pass
    return total


def run_and_kill(directory, mode):
    marker = os.path.join(os.path.dirname(directory), f"marker-{mode}")
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen([sys.executable, "-c", CHILD, directory, mode, marker], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    written = -1
    # "hang" writes the marker inside the commit step (all data written, not renamed);
    # "midwrite" writes it before the save: kill once part of the big array is on disk.
    while time.monotonic() < deadline and proc.poll() is None:
        written = tmp_bytes(directory)
        if os.path.exists(marker) and written >= (0 if mode == "hang" else 2**20):
            break
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    out = proc.communicate()[0].decode()
    written = tmp_bytes(directory)
    assert written >= 0, f"child never started writing step 2:\n{out[-3000:]}"
    assert "save 2 finished" not in out
    if mode == "midwrite":  # part, not all, of the 48 MiB array reached the disk
        assert 2**20 <= written < 48 * 2**20, written


@pytest.mark.parametrize("mode", ["hang", "midwrite"])
def test_killed_save_leaves_previous_checkpoint_restorable(tmp_path, mode):
    directory = str(tmp_path / "ckpt")
    run_and_kill(directory, mode)
    names = os.listdir(directory)
    assert any(".orbax-checkpoint-tmp" in n for n in names), names  # the partial step is there
    assert "2" not in names
    target = {"w": jnp.zeros(4), "big": jnp.zeros((8,))}
    ckpt = Checkpointer(directory)
    assert ckpt.latest_step() == 1
    step, got, meta = ckpt.restore(target)
    assert step == 1 and meta == {"pos": 1}
    np.testing.assert_array_equal(got["w"], np.ones(4))
    # the leftover partial directory neither blocks re-saving step 2 nor restoring it
    assert ckpt.save(2, {"w": jnp.full((4,), 3.0), "big": jnp.ones(8)}, {"pos": 2})
    ckpt.close()
    assert not any(".orbax-checkpoint-tmp" in n for n in os.listdir(directory))
    step, got, meta = Checkpointer(directory).restore(target)
    assert step == 2 and meta == {"pos": 2}
    np.testing.assert_array_equal(got["w"], np.full(4, 3.0))


def test_stray_partial_directories_are_ignored(tmp_path):
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(5, {"w": jnp.ones(2)})
    os.makedirs(tmp_path / "9.orbax-checkpoint-tmp-1234" / "state")
    (tmp_path / "9.orbax-checkpoint-tmp-1234" / "state" / "junk").write_text("partial")
    ckpt = Checkpointer(tmp_path)
    assert ckpt.latest_step() == 5
    assert ckpt.restore({"w": jnp.zeros(2)})[0] == 5


def test_read_only_leaves_a_save_in_flight_alone_and_refuses_to_save(tmp_path):
    """An eval / export process opens a training's checkpoints read-only: it restores,
    refuses to save, and leaves the temporary directory of a save in flight alone."""
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(5, {"w": jnp.ones(2)})
    inflight = tmp_path / "7.orbax-checkpoint-tmp-99"
    os.makedirs(inflight / "state")
    (inflight / "state" / "chunk").write_text("being written")
    with Checkpointer(tmp_path, read_only=True) as ro:
        assert ro.latest_step() == 5 and ro.restore({"w": jnp.zeros(2)})[0] == 5
        with pytest.raises(ValueError, match="read-only: save refused"):
            ro.save(6, {"w": jnp.ones(2)})
    assert (inflight / "state" / "chunk").read_text() == "being written"


def test_wrong_structure_or_shape_gives_clear_error(tmp_path):
    state = {"params": {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}, "rng": jax.random.key(0)}
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(FileNotFoundError, match="no finished checkpoint"):
            ckpt.restore(state)
        ckpt.save(1, state)
        with pytest.raises(TypeError, match="meta"):
            ckpt.save(2, state, {"bad": object()})
    ckpt = Checkpointer(tmp_path)
    cases = [
        ({"params": {"w": jnp.ones((2, 3))}, "rng": jax.random.key(0)}, r"params/b"),
        ({**state, "extra": jnp.ones(1)}, r"not in the checkpoint: \['extra'\]"),
        ({"params": {"w": jnp.ones((3, 2)), "b": jnp.zeros(3)}, "rng": jax.random.key(0)},
         r"params/w: checkpoint shape \(2, 3\), target shape \(3, 2\)"),
        ({**state, "rng": jnp.zeros((), jnp.uint32)}, r"rng: checkpoint holds a key"),
    ]
    for target, match in cases:
        with pytest.raises(ValueError, match=match):
            ckpt.restore(target)


def test_nnx_state_with_optimizer_and_rngs_round_trips(tmp_path):
    from flax import nnx

    def build(seed):
        model = nnx.Linear(3, 2, rngs=nnx.Rngs(seed))
        opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
        return {"model": nnx.state(model), "opt": nnx.state(opt), "rngs": nnx.state(nnx.Rngs(seed))}

    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, build(0))
    _, got, _ = Checkpointer(tmp_path).restore(build(9))
    assert type(got["model"]).__name__ == "State"
    assert_tree_equal(got, build(0))


def test_join_background_threads_waits_for_writers_not_daemons():
    """A command exiting on a signal first lets non-daemon threads (Orbax's writes)
    finish, and does not wait on daemon threads."""
    import threading
    import time

    from gemjax.train.checkpoint import join_background_threads
    done = []
    writer = threading.Thread(target=lambda: (time.sleep(0.3), done.append(1)))
    writer.start()
    join_background_threads(5)
    assert done == [1]
    threading.Thread(target=lambda: time.sleep(30), daemon=True).start()
    t0 = time.time()
    join_background_threads(5)
    assert time.time() - t0 < 2


def test_small_replicated_arrays_are_copied_from_one_replica(tmp_path, monkeypatch):
    """Orbax would split each replicated array's copy over its 8 replicas, slicing it with a
    program compiled per shape; under REPLICA_PARALLEL_MIN_BYTES per replica no slice runs,
    and the arrays read back equal."""
    import gemjax.train.checkpoint as checkpoint
    mesh = jax.make_mesh((8,), ("data",))
    rng = np.random.default_rng(0)
    host = {"w": rng.normal(size=(16, 24)).astype(np.float32),
            "b": rng.normal(size=(24,)).astype(np.float32)}
    assert host["w"].nbytes // 8 < checkpoint.REPLICA_PARALLEL_MIN_BYTES
    state = {"params": jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P())), host)}
    sliced = []
    slice_in_dim = jax.lax.slice_in_dim
    monkeypatch.setattr(jax.lax, "slice_in_dim",
                        lambda x, *a, **k: sliced.append(x.shape) or slice_in_dim(x, *a, **k))
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state, {})
    assert sliced == []
    _, got, _ = Checkpointer(tmp_path).restore(state)
    for k in host:
        np.testing.assert_array_equal(np.asarray(got["params"][k]), host[k])
