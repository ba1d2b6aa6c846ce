"""Config.parallel records a run's layout: experiments/train.py's flags fill it, train()
builds the mesh, rules and table plans from it, and the run's config.json alone rebuilds
the same mesh, parameter shardings and table plans (gemjax.train.layout)."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from gemjax.config import ParallelConfig, config_from_dict, get_config
from gemjax.parallel.mesh import build_mesh
from gemjax.parallel.rules import parse_rules
from gemjax.sparse.plans import TablePlan
from gemjax.train import layout
from gemjax.train.step import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESH = "replica=2,fsdp=-1,expert=2"
RULES = "embed=,mlp=fsdp+expert"
PLAN = ("user:2d_range/segment:replicated/context:row_wise@none/item:fs2d@1.5/"
        "category:row_wise_range/event:2d")


def _shardings(trainer) -> dict:
    """Everything the layout decides, as comparable values."""
    flat = jax.tree_util.tree_flatten_with_path(trainer.state_shardings())[0]
    return {"mesh": (tuple(trainer.mesh.axis_names), [d.id for d in trainer.mesh.devices.flat]),
            "state": {jax.tree_util.keystr(p): s.spec for p, s in flat},
            "plans": dict(trainer.coll.plans)}


def _by_hand(cfg):
    """The same layout built without gemjax.train.layout: Trainer.create's own arguments."""
    mesh = build_mesh("replica=2,fsdp=2,expert=2")
    m, r = ("fsdp", "expert"), ("replica",)
    plans = {"user": TablePlan("2d", "range", m, r), "segment": TablePlan("replicated", "mod", (), r + m),
             "context": TablePlan("row_wise", "mod", r + m, (), capacity_factor=None),
             "item": TablePlan("fs2d", "mod", m, r, capacity_factor=1.5),
             "category": TablePlan("row_wise", "range", r + m, ()), "event": TablePlan("2d", "mod", m, r)}
    return Trainer.create(cfg, mesh, rules=parse_rules(RULES), table_replica_axes=r, table_plan=plans)


def test_train_cli_records_the_layout_and_config_json_rebuilds_it(tmp_path):
    wd = str(tmp_path / "run")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "train.py"), "--config=tiny",
                        f"--workdir={wd}", "--steps=0", "--cpu_devices=8",   # builds, evaluates once
                        f"--mesh={MESH}", f"--logical_rules={RULES}", "--table_replica_axes=replica",
                        f"--table_plan={PLAN}"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    with open(os.path.join(wd, "config.json")) as f:
        saved = json.load(f)
    # the -1 resolved and every tier written out; rules as overrides of the defaults
    assert saved["parallel"] == {"mesh": "replica=2@cross_zone,fsdp=2@zone,expert=2@host",
                                 "logical_rules": RULES, "table_replica_axes": "replica",
                                 "table_plan": PLAN}
    cfg = config_from_dict(saved)
    rebuilt = _rebuilt(cfg)
    want = _by_hand(get_config("tiny"))
    assert _shardings(rebuilt) == _shardings(want)
    # and the rules do shard something differently from the defaults
    plain = Trainer.create(cfg, rebuilt.mesh, table_replica_axes=("replica",), table_plan=dict(want.coll.plans))
    assert _shardings(plain)["state"] != _shardings(want)["state"]


def test_record_of_an_explicit_layout_and_the_default():
    cfg = get_config("tiny")
    mesh = build_mesh("fsdp=4,expert=2")
    trainer = Trainer.create(cfg, mesh, table_plan="row_wise")
    rec = layout.record(cfg, trainer, {"table_plan": "row_wise"})
    assert rec.parallel.mesh == "fsdp=4@zone,expert=2@host" and rec.parallel.logical_rules == ""
    assert rec.parallel.table_plan == "row_wise"
    assert _shardings(_rebuilt(rec)) == _shardings(trainer)
    # planner arguments: the plans it picked, per table
    picky = Trainer.create(cfg, mesh, replicate_below_bytes=0, capacity_factor=None)
    rec = layout.record(cfg, picky, {"replicate_below_bytes": 0, "capacity_factor": None})
    assert rec.parallel.table_plan == "/".join(f"{t}:row_wise@none" for t in picky.coll.plans)
    assert _shardings(_rebuilt(rec)) == _shardings(picky)
    # the default layout: one "batch" axis, the planner
    plain = Trainer.create(cfg)
    rec = layout.record(cfg, plain, {})
    assert rec.parallel.mesh == "" and rec.parallel.table_replica_axes == ""
    assert _shardings(_rebuilt(rec)) == _shardings(plain)


def _rebuilt(cfg) -> Trainer:
    mesh, kw = layout.build(cfg)
    return Trainer.create(cfg, mesh, **kw)


@pytest.mark.parametrize("field,value,match", [
    ("mesh", "fsdp=3", r"parallel.mesh='fsdp=3'"),
    ("logical_rules", "mlp", r"parallel.logical_rules='mlp'"),
    ("table_replica_axes", "replica", r"parallel.table_replica_axes='replica': \['replica'\] not among"),
    ("table_plan", "user:row_wise", r"parallel.table_plan='user:row_wise'.*no entry for tables"),
    ("table_plan", "user:row_wise@x", r"capacity factor 'x' of table 'user'"),
    ("table_plan", "user:2d", r"parallel.table_plan='user:2d'"),
    ("table_plan", "nope", r"parallel.table_plan='nope'.*unknown plan"),
])
def test_bad_parallel_fields_name_the_field(field, value, match):
    cfg = dataclasses.replace(get_config("tiny"), parallel=ParallelConfig(**{field: value}))
    with pytest.raises(ValueError, match=match):
        layout.build(cfg)


def test_a_plan_without_a_config_form_is_refused():
    cfg = get_config("tiny")
    mesh = build_mesh("fsdp=8")
    odd = {t: TablePlan("row_wise", "mod", ("fsdp",), (), min_capacity=8) for t in ("user", "segment",
           "context", "item", "category", "event")}
    trainer = Trainer.create(cfg, mesh, table_plan=odd)
    with pytest.raises(ValueError, match="has no parallel.table_plan form"):
        layout.record(cfg, trainer, {"table_plan": odd})
    assert np.all(np.asarray([p.min_capacity for p in trainer.coll.plans.values()]) == 8)
