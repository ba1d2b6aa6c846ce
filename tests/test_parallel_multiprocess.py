"""2 processes x 4 CPU devices (gloo) train the toy sharded step exactly like 1 process x 8 devices,
and both match a float64 numpy implementation of the same SGD-momentum run.

The 2-process runs (the toy on every mesh, the real train step on fs2d tables, the
fixed sparse branches on 2d tables) are one launch: its 2 processes start once and
run the three jobs in turn (tests/job_list.py); each test checks its own job.
"""

import numpy as np
import pytest

from gemjax.parallel import launch
from toy_step import toy_data, train_toy   # tests/toy_step.py

SPECS = ["replica=2,fsdp=4", "replica=-1,fsdp=2,expert=2", "fsdp=8"]
KW = dict(steps=3, seed=0, batch=32, dim=16, hidden=24, lr=0.1, momentum=0.9)


def numpy_reference(steps, seed, batch, dim, hidden, lr, momentum):
    params, x, y = toy_data(seed, batch, dim, hidden)
    p = {k: v.astype(np.float64) for k, v in params.items()}
    x, y = x.astype(np.float64), y.astype(np.float64)
    trace = {k: np.zeros_like(v) for k, v in p.items()}
    losses = []
    for _ in range(steps):
        h = np.tanh(x @ p["w1"] + p["b1"])
        r = h @ p["w2"][:, 0] + p["b2"][0] - y
        losses.append(np.mean(r ** 2))
        dpred = 2 * r / batch
        dz = np.outer(dpred, p["w2"][:, 0]) * (1 - h ** 2)
        g = {"w1": x.T @ dz, "b1": dz.sum(0), "w2": (h.T @ dpred)[:, None], "b2": np.array([dpred.sum()])}
        for k in p:
            trace[k] = g[k] + momentum * trace[k]
            p[k] = p[k] - lr * trace[k]
    return losses, p


@pytest.fixture(scope="module")
def single():
    return train_toy(SPECS, **KW)


# ---------------------------------------------------------------- the real train step
# replica crosses the 2 processes, fsdp / expert inside; fs2d tables (test_train_sharded's
# mesh and replica axes; its one-process run mixes the three plans)
REAL_MESH = "replica=2,fsdp=2,expert=2"
REAL_KW = dict(steps=3, table_replica_axes=["replica", "expert"], replicate_below_bytes=0,
               capacity_factor=None, device_budget_bytes=0, evaluate=False)   # train steps only
# exchange + sync buckets on 2d tables, replica crossing the processes. Without sequence
# features (model.use_sequences=false halves the two train-step compiles in each of the three
# processes): the REAL job above feeds sequence features across the processes, and sequence
# tables in fixed branches run on one process (tests/test_sparse_fixed_branches.py, and
# test_train_sharded's exchange + sync buckets run); this job checks that the processes agree
# on every branch plan, the one compiled mid-run included, and train like one process.
FIXED_MESH = "replica=2,fsdp=4"
FIXED_KW = dict(steps=3, table_replica_axes=["replica"], replicate_below_bytes=0, capacity_factor=None,
                device_budget_bytes=1 << 40, evaluate=False,
                overrides="train.sparse_exchange_buckets=true,train.sparse_sync_buckets=true,"
                          "model.use_sequences=false")


@pytest.fixture(scope="module")
def two():
    """Each process's results of the three 2-process jobs: {"toy", "real", "fixed"}: [2 dicts]."""
    import jax
    cache = {"JAX_COMPILATION_CACHE_DIR": jax.config.jax_compilation_cache_dir or "",
             "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5"} if jax.config.jax_compilation_cache_dir else {}
    jobs = [["tests.toy_step:train_toy", dict(mesh_specs=SPECS, **KW)],
            ["gemjax.train.equivalence:train_steps", dict(mesh_spec=REAL_MESH, **REAL_KW)],
            ["gemjax.train.equivalence:train_steps", dict(mesh_spec=FIXED_MESH, **FIXED_KW)]]
    results = launch.launch("tests.job_list:run_jobs", 2, cpu_devices=4, kwargs=dict(jobs=jobs),
                            timeout_s=900, env=cache)
    assert len(results) == 2
    return {name: [res[i] for res in results] for i, name in enumerate(("toy", "real", "fixed"))}


def test_single_process_matches_numpy(single):
    ref_losses, ref_params = numpy_reference(**KW)
    assert ref_losses[-1] < ref_losses[0]  # the run learns, so a frozen step would fail
    for spec in SPECS:
        np.testing.assert_allclose(single[spec]["losses"], ref_losses, rtol=1e-5)
        for k, v in ref_params.items():
            np.testing.assert_allclose(single[spec]["params"][k], v, rtol=1e-5, atol=1e-6, err_msg=f"{spec} {k}")
    assert single["replica=2,fsdp=4"]["specs"]["w1"] == "P(None, 'fsdp')"  # FSDP really applied


def test_two_processes_match_one(single, two):
    for res in two["toy"]:
        for spec in SPECS:
            assert res[spec]["processes"] == 2
            np.testing.assert_allclose(res[spec]["losses"], single[spec]["losses"], rtol=1e-5)
            for k, v in single[spec]["params"].items():
                np.testing.assert_allclose(res[spec]["params"][k], v, rtol=1e-5, atol=1e-7, err_msg=f"{spec} {k}")


def test_launch_reports_child_failure():
    with pytest.raises(RuntimeError, match=r"(?s)process 0 exit 1.*has no attribute 'nope'"):
        launch.launch("tests.toy_step:nope", 1, cpu_devices=1, timeout_s=120)
    with pytest.raises(ValueError, match="num_processes"):
        launch.launch("tests.toy_step:train_toy", 0)


def test_real_train_step_two_processes_match_one(two):
    from gemjax.train.equivalence import KEY_BIAS, global_rel_diff, max_rel_diff, train_steps
    one = train_steps(REAL_MESH, **REAL_KW)
    assert one["processes"] == 1 and one["devices"] == 8 and set(one["plans"].values()) == {"fs2d"}
    assert max_rel_diff(one["init_params"], one["params"]) > 1e-3   # the steps do update
    for res in two["real"]:
        assert res["processes"] == 2 and res["devices"] == 8 and res["ids_overflow"] == 0
        np.testing.assert_allclose(res["losses"], one["losses"], rtol=1e-5)
        assert max_rel_diff(res["params"], one["params"], skip=KEY_BIAS) < 1e-5
        assert global_rel_diff(res["params"], one["params"]) < 1e-5
        assert max_rel_diff(res["tables"], one["tables"]) < 1e-5


@pytest.mark.slow
def test_fixed_sparse_branches_two_processes_match_one(two):
    """Exchange + sync buckets on 2d tables (replica crossing the processes): every
    process reads the same replicated branch needs, so both compile the same plan,
    and the run equals one process."""
    from gemjax.train.equivalence import KEY_BIAS, max_rel_diff, train_steps
    one = train_steps(FIXED_MESH, **FIXED_KW)
    assert set(one["plans"].values()) == {"2d"} and len(one["branch_plans"]) >= 2   # a plan compiled mid-run
    for res in two["fixed"]:
        assert res["processes"] == 2 and res["ids_overflow"] == 0
        assert res["branch_plans"] == one["branch_plans"]
        np.testing.assert_allclose(res["losses"], one["losses"], rtol=1e-5)
        assert max_rel_diff(res["params"], one["params"], skip=KEY_BIAS) < 1e-5
        assert max_rel_diff(res["tables"], one["tables"]) < 1e-5
