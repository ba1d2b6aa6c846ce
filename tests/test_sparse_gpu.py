"""Sparse plans on real GPUs (>= 2): lookups and updates vs the numpy reference.

Run on a GPU machine: `python -m pytest -m gpu tests/test_sparse_gpu.py`.

1. The CPU suite's checks (tests/test_sparse_sharded.py: duplicate ids, empty
   bags, Jagged padding, capacity overflow, several optimizer steps against the
   independent float64 reference of tests/test_sparse_reference.py) rerun on
   every local GPU for every plan and each dedup configuration (sort + unique
   buckets, sort_scatter, scatter), with 4 steps: a 1-D mesh
   of all GPUs (replicated, row-wise mod / range, table-wise) and 2-D
   (replica, model) meshes (2d, fs2d, mod / range).
2. At scale: Zipf ids (hot rows repeated thousands of times, so the GPU's
   sorted scatter-add and large sorts run their real code paths), a row-wise
   table over all GPUs and over one, 3 row-wise Adagrad steps, compared with a
   vectorised numpy reference (np.unique + np.add.at in float64). Gradients are
   multiples of 1/64 with small numerators, so every duplicate sum is exact in
   float32 whatever the summation order.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gemjax.sparse import EmbeddingCollection, RowWiseAdagrad, TableSpec, routing
import test_sparse_sharded as sharded

pytestmark = pytest.mark.gpu


def gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


needs_2 = pytest.mark.skipif(len(gpus()) < 2, reason="needs >= 2 GPUs")
# (dedup, unique_buckets) configurations of the duplicate summing
DEDUPS = {"sort_buckets": dict(dedup="sort", unique_buckets=routing.DEFAULT_BUCKETS),
          "sort_scatter": dict(dedup="sort_scatter"), "scatter": dict(dedup="scatter")}


@pytest.fixture(autouse=True)
def four_steps(monkeypatch):
    monkeypatch.setattr(sharded, "STEPS", 4)


def mesh_1d():
    g = gpus()
    return Mesh(np.array(g), ("x",))


def meshes_2d():
    """(replica, model) meshes over every GPU: 2 x n/2, plus 1 x n and n x 1 when n == 2."""
    g, n = gpus(), len(gpus())
    shapes = [(2, n // 2)] if n >= 4 and n % 2 == 0 else [(1, n), (n, 1)]
    return [Mesh(np.array(g[: r * m]).reshape(r, m), ("replica", "model")) for r, m in shapes]


@needs_2
@pytest.mark.parametrize("dedup", list(DEDUPS))
@pytest.mark.parametrize("plan", ["replicated", "row_wise", "row_wise_range", "table_wise"])
def test_1d_plans_sgd_exact(plan, dedup):
    mesh = mesh_1d()
    coll, state, over = sharded.run_case(mesh, plan, (), *sharded.SGD_EXACT, exact=True, **DEDUPS[dedup])
    sharded.check_memory_matches_plan(coll, state, mesh)
    assert list(mesh.devices.flat) == list(gpus()) and mesh.size >= 2
    if plan != "replicated":
        assert over > 0


@needs_2
@pytest.mark.parametrize("dedup", list(DEDUPS))
@pytest.mark.parametrize("plan", ["row_wise", "2d", "2d_range", "fs2d", "fs2d_range"])
def test_2d_plans_sgd_exact(plan, dedup):
    for mesh in meshes_2d():
        coll, state, _ = sharded.run_case(mesh, plan, ("replica",), *sharded.SGD_EXACT, exact=True,
                                          **DEDUPS[dedup])
        sharded.check_memory_matches_plan(coll, state, mesh)


@needs_2
@pytest.mark.parametrize("plan,opt,update", sharded.OPTIMIZER_CASES)
def test_optimizers_match_reference(plan, opt, update):
    for mesh in meshes_2d():
        sharded.run_case(mesh, plan, ("replica",), opt, update, exact=False)


@needs_2
def test_bf16_tables_and_grads_fs2d_exact():
    for mesh in meshes_2d():
        sharded.run_case(mesh, "fs2d", ("replica",), *sharded.SGD_EXACT, exact=True,
                         dtype=jnp.bfloat16, grad_dtype=jnp.bfloat16)


# ------------------------------------------------------------------ at scale
VOCAB, DIM, IDS_PER_DEV, LR, EPS = 200_003, 32, 1 << 16, 0.05, 1e-6


def zipf(rng, n, vocab, a=1.05):
    z = rng.zipf(a, 4 * n)
    z = z[z <= vocab][:n] - 1
    return ((z * 2654435761) % vocab).astype(np.int32)


def reference_rowwise_adagrad(w, acc, ids, g):
    """float64: duplicate sums by np.add.at, then row-wise Adagrad on the touched rows."""
    uniq, inv = np.unique(ids, return_inverse=True)
    gs = np.zeros((uniq.size, w.shape[1]))
    np.add.at(gs, inv, g)
    acc = acc.copy()
    w = w.copy()
    acc[uniq] += np.mean(gs * gs, axis=1)
    w[uniq] -= LR * gs / (np.sqrt(acc[uniq])[:, None] + EPS)
    return w, acc


@needs_2
@pytest.mark.parametrize("dedup", list(DEDUPS))
@pytest.mark.parametrize("devices", ["all", "one"])
def test_zipf_scale_rowwise_adagrad(dedup, devices):
    g_all = gpus()
    devs = g_all if devices == "all" else g_all[:1]
    mesh = Mesh(np.array(devs), ("x",))
    spec = TableSpec("t", VOCAB, DIM, features=("f",), optimizer=RowWiseAdagrad(lr=LR, eps=EPS))
    coll = EmbeddingCollection([spec], "row_wise", mesh, **DEDUPS[dedup])
    rng = np.random.default_rng(7)
    w = (rng.integers(-64, 65, (VOCAB, DIM)) / 256.0)
    acc = np.zeros(VOCAB)
    state = coll.from_logical({"t": {"weights": w, "accum": acc}})
    sh = NamedSharding(mesh, P("x"))
    lookup = jax.jit(coll.lookup)
    apply = jax.jit(coll.apply_gradients, donate_argnums=0)
    n = IDS_PER_DEV * len(devs)
    for step in range(3):
        ids = zipf(rng, n, VOCAB)
        assert np.bincount(ids).max() > n // 50, "the batch should hold hot rows"
        acts, res = lookup(state, {"f": jax.device_put(ids, sh)})
        assert int(res["stats"]["ids_overflow"]) == 0
        np.testing.assert_allclose(np.asarray(acts["f"], np.float64), w[ids], rtol=1e-6,
                                   atol=1e-7 if step else 0, err_msg=f"lookup step {step}")
        g = rng.integers(-8, 9, (n, DIM)) / 64.0
        state = apply(state, res, {"f": jax.device_put(g.astype(np.float32), sh)})
        w, acc = reference_rowwise_adagrad(w, acc, ids, g)
        w = w.astype(np.float32).astype(np.float64)          # float32 storage
    got = coll.to_logical(state)["t"]
    np.testing.assert_allclose(got["accum"], acc, rtol=2e-6, atol=0)
    np.testing.assert_allclose(got["weights"], w, rtol=1e-5, atol=1e-6)
