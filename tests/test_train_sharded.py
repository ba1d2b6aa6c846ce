"""The real train step on multi-axis meshes (8 simulated CPU devices) equals one device.

Same samples on every mesh (`feeding.regroup` packs the stream's 8 shards into
each device's buffer), same logical table rows at the start, 3 steps of the
`tiny` preset: loss, dense params and embedding tables match the 1-device run
within 1e-5 relative, while the params / Adam state really are FSDP-sharded and
the compiled step really all-gathers, reduce-scatters and exchanges ids.

The bucket tests (sync / exchange buckets, fixed branches) are about the sparse
tables: they run the preset without its sequence features (model.use_sequences=
false; the collection-level tests run the buckets on Jagged / unpooled features)
against their own one-device reference, on a data seed whose first batch's branch
plan covers the next two (one compiled train step per test).
"""

import dataclasses
import re

import jax
import numpy as np
import pytest

from gemjax.config import get_config
from gemjax.data.feeding import merge_shards
from gemjax.data.synthetic import SyntheticStream
from gemjax.train.equivalence import KEY_BIAS, global_rel_diff, max_rel_diff, train_steps
from gemjax.parallel.mesh import build_mesh
from gemjax.sparse import plans as plans_lib
from gemjax.train import optim
from gemjax.train.step import Trainer

CFG = get_config("tiny")
# tiny tables would be replicated by the planner: force sharded plans, never drop ids
SPARSE = dict(replicate_below_bytes=0, capacity_factor=None)
PLANNER = {  # mesh spec -> (table replica axes, device budget, the plan the planner picks)
    "fsdp=8": ((), 1 << 40, "row_wise"),
    "replica=2,fsdp=4": (("replica",), 1 << 40, "2d"),
    "replica=2,fsdp=2,expert=2": (("replica", "expert"), 0, "fs2d"),
}
# one mesh holding every sharded plan: row_wise mod over all 8 devices, 2d and fs2d over
# the fsdp (model) axis with two replica axes; each plan has a sequence table (event,
# category, item) and every table a sequence or a plain feature
MIXED_MESH, MIXED_REPLICA = "replica=2,fsdp=2,expert=2", ("replica", "expert")
MIXED = {"user": "row_wise", "event": "row_wise", "segment": "2d", "category": "2d",
         "item": "fs2d", "context": "fs2d"}


# the bucket tests' preset and data seed (see the module docstring)
FLAT, FLAT_SEED = "model.use_sequences=false", 9


@pytest.fixture(scope="module")
def single():
    return train_steps(None, 3, evaluate=False, **SPARSE)


@pytest.fixture(scope="module")
def flat():
    """The one-device reference of the bucket tests, with its eval probabilities."""
    return train_steps(None, 3, overrides=FLAT, seed=FLAT_SEED, **SPARSE)


@pytest.mark.parametrize("spec", list(PLANNER))
def test_planner_picks_the_sharded_plans(spec):
    """The trainer's planner (what train_steps uses without a plan) on each mesh."""
    replica_axes, budget, plan = PLANNER[spec]
    trainer = Trainer.create(CFG, build_mesh(spec), table_replica_axes=replica_axes,
                             device_budget_bytes=budget, **SPARSE)
    assert {p.kind for p in trainer.coll.plans.values()} == {plan}
    assert all(p.capacity_factor is None for p in trainer.coll.plans.values())


def test_mesh_matches_one_device(single):
    """Every sharded table plan on one 3-axis mesh, FSDP dense params: trains as one device."""
    mesh = build_mesh(MIXED_MESH)
    plans = {n: dataclasses.replace(p, capacity_factor=None) for n, p in plans_lib.resolve(
        MIXED, optim.table_specs(CFG), mesh, MIXED_REPLICA).items()}
    res = train_steps(MIXED_MESH, 3, table_replica_axes=MIXED_REPLICA, table_plan=plans,
                      tables0=single["init_tables"], hlo=True, evaluate=False)
    assert res["devices"] == 8 and res["plans"] == MIXED
    assert res["ids_overflow"] == 0 and single["ids_overflow"] == 0
    # the steps change params and tables, so a frozen or skipped update would fail below
    assert max_rel_diff(single["init_params"], single["params"]) > 1e-3
    assert max_rel_diff(single["init_tables"], single["tables"]) > 1e-3
    assert max_rel_diff(res["init_params"], single["init_params"]) == 0.0  # dense init: mesh-free
    np.testing.assert_allclose(res["losses"], single["losses"], rtol=1e-5)
    assert max_rel_diff(res["params"], single["params"], skip=KEY_BIAS) < 1e-5
    assert global_rel_diff(res["params"], single["params"]) < 1e-5
    for name in MIXED:     # every table, so every plan
        assert max_rel_diff(res["tables"][name], single["tables"][name]) < 1e-5, name
    text = res["hlo"]
    for op in ("all-gather", "reduce-scatter", "all-to-all"):   # FSDP in, FSDP grads out, ids
        assert re.search(rf"{op}(-start)?\(", text), op
    sh = res["shardings"]
    assert "fsdp" in sh["params"]["head"]["linears"][0]["kernel"]
    adam = sh["opt_state"][1][0]   # chain(clip, adam): adam's (count, mu, nu)
    same = jax.tree.map(lambda p, m, v: p == m == v, sh["params"], adam.mu, adam.nu)
    assert all(jax.tree.leaves(same))   # moments sharded exactly like their params


def test_init_state_is_placed_on_its_shardings():
    trainer = Trainer.create(CFG, build_mesh("replica=2,fsdp=4"), table_replica_axes=("replica",))
    state = trainer.init_state(0)
    want = jax.tree.leaves(trainer.state_shardings())
    leaves = jax.tree.leaves(state)
    assert len(want) == len(leaves)
    for w, x in zip(want, leaves):
        assert x.sharding.is_equivalent_to(w, x.ndim), (x.sharding, w)
    n_params = sum("fsdp" in str(x.sharding.spec) for x in jax.tree.leaves(state["params"]))
    n_opt = sum("fsdp" in str(x.sharding.spec) for x in jax.tree.leaves(state["opt_state"]))
    assert n_params > 0 and n_opt == 2 * n_params   # Adam mu and nu of every sharded param


def test_merge_shards_keeps_every_sample():
    stream = SyntheticStream(CFG.data, 0)
    parts = [stream.shard_batch(0, s, 4)[0] for s in range(4)]
    merged = merge_shards(parts)
    assert merged.labels.shape[0] == sum(p.labels.shape[0] for p in parts)
    np.testing.assert_array_equal(merged.dense, np.concatenate([p.dense for p in parts]))
    for name, seq in merged.sequences.items():
        off = np.asarray(seq.offsets)
        fields = list(seq.values) if isinstance(seq.values, dict) else [None]
        i = 0
        for p in parts:
            po = np.asarray(p.sequences[name].offsets)
            for b in range(len(po) - 1):
                for f in fields:
                    mv = seq.values[f] if f else seq.values
                    pv = p.sequences[name].values[f] if f else p.sequences[name].values
                    np.testing.assert_array_equal(mv[off[i]:off[i + 1]], pv[po[b]:po[b + 1]])
                i += 1
        assert i == len(off) - 1 and (np.asarray(seq.segment_ids)[off[-1]:] == i).all()
        assert seq.capacity == sum(p.sequences[name].capacity for p in parts)


def test_replica_sync_buckets_match_one_device(flat):
    """train.sparse_sync_buckets on 8 replicas of every table (a one-device model group):
    the replicas all-gather unique rows only, and training equals one device."""
    single = flat
    res = train_steps("replica=8", 3, overrides=f"{FLAT},train.sparse_sync_buckets=true",
                      table_replica_axes=("replica",), seed=FLAT_SEED,
                      tables0=single["init_tables"], evaluate=False, **SPARSE)
    assert res["devices"] == 8 and set(res["plans"].values()) <= {"2d", "replicated"}
    np.testing.assert_allclose(res["losses"], single["losses"], rtol=1e-5)
    assert max_rel_diff(res["params"], single["params"], skip=KEY_BIAS) < 1e-5
    assert max_rel_diff(res["tables"], single["tables"]) < 1e-5


def collectives_in_conditionals(hlo: str) -> int:
    """all-to-all / all-gather / all-reduce ops reachable from a conditional's branches
    in compiled HLO text."""
    bodies, name = {}, None
    for line in hlo.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if m:
            name, bodies[m.group(1)] = m.group(1), []
        elif name:
            bodies[name].append(line)
    called = lambda body: {c for ln in body for c in re.findall(r"%([\w.\-]+)", ln) if c in bodies}
    branches = set()
    for body in bodies.values():
        for ln in body:
            if " conditional(" in ln:
                branches |= {c for c in re.findall(r"%([\w.\-]+)", ln.split("conditional(")[1])
                             if c in bodies}
    seen, todo, n = set(), list(branches), 0
    while todo:
        c = todo.pop()
        if c in seen:
            continue
        seen.add(c)
        n += sum(bool(re.search(r"\b(all-to-all|all-gather|all-reduce)(-start)?\(", ln))
                 for ln in bodies[c])
        todo += list(called(bodies[c]))
    return n


@pytest.mark.parametrize("fixed", [True, False])
def test_exchange_and_sync_buckets_match_one_device(flat, fixed):
    """train.sparse_exchange_buckets + sparse_sync_buckets on 2d tables over replica=2,
    fsdp=4 (the exchange buckets switch all_to_alls): by default the step runs with its
    branches fixed from each batch ahead of time (PlannedStep), no collective inside a
    cond; with train.sparse_fixed_branches=false the switches stay in the step. Both
    train as one device."""
    single = flat
    res = train_steps("replica=2,fsdp=4", 3, hlo=True, table_replica_axes=("replica",),
                      overrides=f"{FLAT},train.sparse_exchange_buckets=true,"
                                "train.sparse_sync_buckets=true,"
                                f"train.sparse_fixed_branches={str(fixed).lower()}",
                      seed=FLAT_SEED, tables0=single["init_tables"], device_budget_bytes=1 << 40,
                      **SPARSE)
    assert set(res["plans"].values()) == {"2d"}
    if fixed:   # the eval step too
        assert res["branch_plans"] and all(x >= 0 for p in res["branch_plans"] for _, x, _ in p)
        assert collectives_in_conditionals(res["hlo"]) == 0
        assert collectives_in_conditionals(res["eval_hlo"]) == 0
    else:
        assert res["branch_plans"] == [()] and collectives_in_conditionals(res["hlo"]) > 0
        assert collectives_in_conditionals(res["eval_hlo"]) > 0
    np.testing.assert_allclose(res["eval_probs"], single["eval_probs"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(res["losses"], single["losses"], rtol=1e-5)
    assert max_rel_diff(res["params"], single["params"], skip=KEY_BIAS) < 1e-5
    assert max_rel_diff(res["tables"], single["tables"]) < 1e-5
