"""Bounds modes, bf16 storage, bad-input errors and the planner (one device unless noted)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh

from gemjax.data.jagged import pack
from gemjax.sparse import SGD, EmbeddingCollection, TableSpec, format_plan, plan_tables
from gemjax.sparse import plans as plans_lib


def test_strict_bounds_error_names_the_feature_and_ignores_padding():
    specs = [TableSpec("t", 10, 4, features=("a",)),
             TableSpec("b", 10, 4, features=("bag",), pooling="sum")]
    coll = EmbeddingCollection(specs)
    coll.check_ids({"a": np.array([0, 9]), "bag": pack([np.array([1, 2])], capacity=8)})
    with pytest.raises(ValueError, match=r"feature 'a'.*\[0, 10\)"):
        coll.check_ids({"a": np.array([0, 10])})
    with pytest.raises(ValueError, match="feature 'bag'"):
        coll.check_ids({"bag": pack([np.array([-1])], capacity=8)})
    bag = pack([np.array([3])], capacity=8)
    bag = bag.replace(values=np.where(np.arange(8) > 0, 99, bag.values))   # junk on padding only
    coll.check_ids({"bag": bag})
    with pytest.raises(KeyError, match="'nope'"):
        coll.check_ids({"nope": np.array([1])})


def test_clamp_and_hash_modes_count_and_bf16_sgd_matches_reference():
    rng = np.random.default_rng(0)
    specs = [TableSpec("c", 10, 4, features=("c",), bounds="clamp", optimizer=SGD(0.5)),
             TableSpec("h", 10, 4, features=("h",), bounds="hash", optimizer=SGD(0.5),
                       dtype=jnp.bfloat16)]
    coll = EmbeddingCollection(specs)
    w = {n: rng.integers(-8, 9, (10, 4)) / 16.0 for n in ("c", "h")}
    state = coll.from_logical({n: {"weights": v} for n, v in w.items()})
    ids = np.array([-3, 0, 4, 10, 25, 4, 9], np.int32)
    acts, res = jax.jit(coll.lookup)(state, {"c": ids, "h": ids})
    np.testing.assert_array_equal(np.asarray(acts["c"], np.float64), w["c"][np.clip(ids, 0, 9)])
    np.testing.assert_array_equal(np.asarray(acts["h"], np.float64), w["h"][ids % 10])
    assert acts["h"].dtype == jnp.bfloat16
    assert int(res["stats"]["ids_out_of_range"]) == 2 * 3
    g = rng.integers(-8, 9, (7, 4)) / 8.0
    state = jax.jit(coll.apply_gradients)(state, res, {"c": jnp.asarray(g, jnp.float32),
                                                      "h": jnp.asarray(g, jnp.bfloat16)})
    got = coll.to_logical(state)
    for n, idx in (("c", np.clip(ids, 0, 9)), ("h", ids % 10)):
        want = w[n].copy()
        np.add.at(want, idx, -0.5 * g)
        want = want.astype(ml_dtypes.bfloat16 if n == "h" else np.float32).astype(np.float64)
        np.testing.assert_array_equal(got[n]["weights"].astype(np.float64), want, err_msg=n)


def test_bad_specs_and_plans_are_named():
    with pytest.raises(ValueError, match="table 'x'.*bounds"):
        TableSpec("x", 10, 4, features=("a",), bounds="wrap")
    with pytest.raises(ValueError, match="table 'x'.*dtype"):
        TableSpec("x", 10, 4, features=("a",), dtype=jnp.int8)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("replica", "model"))
    spec = [TableSpec("x", 10, 4, features=("a",))]
    with pytest.raises(ValueError, match="table 'x'.*replica_axes"):
        EmbeddingCollection(spec, "2d", mesh)
    with pytest.raises(ValueError, match="table 'x'.*unknown plan"):
        EmbeddingCollection(spec, "column_wise", mesh)
    with pytest.raises(ValueError, match="'nope' is not a mesh axis"):
        EmbeddingCollection(spec, "2d", mesh, replica_axes=("nope",))
    with pytest.raises(TypeError, match="feature 'a'.*Jagged"):
        EmbeddingCollection(spec).lookup(None, {"a": pack([np.array([1])], capacity=8)})


def test_planner_picks_by_size_and_prints_bytes_per_device():
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("replica", "model"))
    specs = [TableSpec("small", 1000, 16, features=("s",)),                 # 68 KB
             TableSpec("mid", 1 << 20, 64, features=("m",)),                # 260 MiB
             TableSpec("huge", 1 << 24, 128, features=("h",))]              # 8.1 GiB
    plans = plan_tables(specs, mesh, replica_axes=("replica",), device_budget_bytes=1 << 30)
    assert {n: p.kind for n, p in plans.items()} == {"small": "replicated", "mid": "2d", "huge": "fs2d"}
    # bytes per device: rows held x (dim * 4 + 4 accumulator bytes)
    assert plans_lib.bytes_per_device(specs[0], plans["small"], mesh) == 1000 * 68
    assert plans_lib.bytes_per_device(specs[1], plans["mid"], mesh) == (1 << 20) // 4 * 260
    assert plans_lib.bytes_per_device(specs[2], plans["huge"], mesh) == (1 << 24) // 8 * 516
    text = format_plan(specs, plans, mesh)
    print(text)
    assert "fs2d/mod" in text and "65.0 MiB" in text and "1.0 GiB" in text and "max per device" in text
    one_d = plan_tables(specs, Mesh(np.array(jax.devices()[:8]), ("x",)))
    assert [p.kind for p in one_d.values()] == ["replicated", "row_wise", "row_wise"]
    tw = plan_tables(specs * 1 + [TableSpec("mid2", 1 << 19, 64, features=("m2",))],
                     Mesh(np.array(jax.devices()[:8]), ("x",)), table_wise_below_bytes=1 << 30)
    assert [p.kind for p in tw.values()] == ["replicated", "table_wise", "row_wise", "table_wise"]
    assert tw["mid"].shard != tw["mid2"].shard              # least-loaded device for the second
