"""The nested config tree (gemjax.config) against the flat tree it replaced.

tests/fixtures/config_flat_presets.json is every preset as the flat tree wrote it
(dataclasses.asdict, one level of fields per section), and config_flat_tiny_run.json a
run's WORKDIR/config.json written by the flat tree (`experiments.train --config=tiny
--steps=50`). Each old path maps to its new one through ALIASES, read here by plain dict
lookups; overrides by an old path must equal overrides by its new path.
"""

import dataclasses
import json
import os

import pytest

from gemjax.config import (ALIASES, PRESETS, SECTIONS, apply_overrides, config_from_dict,
                           field_paths, get_config, nest_flat_fields)
from gemjax.train.guards import ResumeMismatch, check_resume, run_fields

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
FLAT_SECTIONS = ("data", "model", "train", "parallel", "optim")


def _load(name):
    with open(os.path.join(FIXTURES, name)) as f:
        return json.load(f)


def _flat_by_new_path(old: dict) -> dict:
    """{new path: value} of a flat config dict: each "section.field" through ALIASES."""
    flat = {f"{s}.{k}": v for s in FLAT_SECTIONS for k, v in old.get(s, {}).items()}
    return {ALIASES.get(k, k): v for k, v in flat.items()}


def test_every_preset_keeps_its_values():
    old = _load("config_flat_presets.json")
    assert set(old) == set(PRESETS)
    for name, cfg in PRESETS.items():
        now = json.loads(json.dumps(field_paths(cfg)))
        assert now == _flat_by_new_path(old[name]), name


def test_alias_table_is_one_to_one_onto_leaf_fields():
    leaves = set(field_paths())
    assert set(ALIASES.values()) <= leaves and len(set(ALIASES.values())) == len(ALIASES)
    assert not set(ALIASES) & leaves           # no old path is a field path now
    assert set(SECTIONS) == set(FLAT_SECTIONS) | {"sparse"}
    with pytest.raises(ValueError, match="model.teacher is a record of fields"):
        get_config("tiny", "model.teacher=3")


def test_old_config_json_loads_to_the_equal_nested_config():
    old = _load("config_flat_presets.json")
    for name, cfg in PRESETS.items():
        assert config_from_dict(old[name]) == cfg, name
        assert nest_flat_fields(old[name]) == json.loads(json.dumps(dataclasses.asdict(cfg))), name
    run = _load("config_flat_tiny_run.json")
    assert config_from_dict(run) == apply_overrides(get_config("tiny"), "train.steps=50")
    # the nested form round-trips, and a flat file with moved fields set reads them back
    cfg = get_config("gem1b", "model.precision.format=fp8,data.drift.every=7")
    assert config_from_dict(json.loads(json.dumps(dataclasses.asdict(cfg)))) == cfg
    legacy = {"name": "tiny", "model": {"kind": "teacher", "pyramid_levels": [[16, 4, 1], [16, None, 1]],
                                        "precision": "fp8", "fp8_scaling": "tensor",
                                        "retrieval_negatives": 3, "student_arch": "wukong"},
              "train": {"dense_lr": 0.003, "warmup_steps": 2, "sparse_act_dtype": "model"},
              "data": {"drift_every": 4, "vocab_item": 500},
              "optim": {"dense": "adamw", "sparse": "sgd", "clip_norm": 1.0}}
    got = config_from_dict(legacy)
    m, o = got.model, got.optim
    assert m.teacher.pyramid_levels == ((16, 4, 1), (16, None, 1))
    assert (m.precision.format, m.precision.scaling) == ("fp8", "tensor")
    assert (m.retrieval.negatives, m.student.arch, got.sparse.act_dtype) == (3, "wukong", "model")
    assert (o.dense.name, o.dense.lr, o.dense.warmup_steps, o.dense.clip_norm) == ("adamw", 0.003, 2, 1.0)
    assert (o.sparse.name, got.data.drift.every, got.data.synthetic.vocab_item) == ("sgd", 4, 500)
    with pytest.raises(ValueError, match="model has no fields \\['fp8_nonsense'\\]"):
        config_from_dict({"model": {"fp8_nonsense": 1}})


# a valid value other than tiny's for each string field reached by an alias (by new path)
_STRINGS = {"model.precision.format": "fp8", "model.precision.regions": "wukong",
            "model.precision.exclude": "heads", "model.precision.scaling": "tensor",
            "model.precision.grad_fmt": "e4m3", "model.precision.wgrad_dtype": "bf16",
            "model.precision.fast_accum": "forward", "model.precision.gather": "always",
            "model.teacher.head_towers": "shared", "model.teacher.ffn_activation": "relu",
            "model.retrieval.encoder": "hstu", "model.retrieval.hstu_rel_bias": "position",
            "model.student.arch": "wukong", "sparse.segment_sum": "xla", "sparse.act_dtype": "model",
            "optim.dense.name": "adamw", "optim.dense.schedule": "constant", "optim.sparse.name": "sgd",
            "model.teacher.pyramid_levels": "16:2:1/16:none:1", "model.teacher.capacity_factor": "1.5"}


def _other_value(path, value):
    if path in _STRINGS:
        return _STRINGS[path]
    if isinstance(value, bool):
        return str(not value).lower()
    if isinstance(value, int):
        return str(value + 1)
    return repr(value / 2 + 0.07)


@pytest.mark.parametrize("old", sorted(ALIASES))
def test_legacy_override_equals_new_override(old):
    base = get_config("tiny")
    new = ALIASES[old]
    value = _other_value(new, field_paths(base)[new])
    by_old, by_new = apply_overrides(base, {old: value}), apply_overrides(base, {new: value})
    assert by_old == by_new != base
    changed = {k for k, v in field_paths(by_new).items() if field_paths(base)[k] != v}
    assert changed == {new}


def test_resume_reads_a_flat_checkpoints_run_fields():
    """A checkpoint of the flat tree records run fields by old paths: the same config
    resumes, a changed moved field is refused under its new path."""
    old = _load("config_flat_tiny_run.json")
    free = {"data.eval_batches", "data.host_workers", "data.accept_changed_files", "model.norm_impl"}
    saved = {f"{s}.{k}": v for s in ("data", "model") for k, v in old[s].items()
             if f"{s}.{k}" not in free}
    meta = {"run": {**saved, "train.seed": 0}}
    cfg = config_from_dict(old)
    assert set(run_fields(cfg)) == {ALIASES.get(k, k) for k in meta["run"]}
    check_resume(meta, cfg, 10, "w")
    with pytest.raises(ResumeMismatch, match="data.synthetic.vocab_item is 401, the checkpoint's is 400"):
        check_resume(meta, apply_overrides(cfg, "data.vocab_item=401"), 10, "w")


def test_an_old_run_directory_is_the_same_run(tmp_path):
    """experiments/ablate.py reuses a workdir only for the config it holds: a flat
    config.json is the same config, a changed moved field is another."""
    from experiments import ablate
    with open(tmp_path / "config.json", "w") as f:
        json.dump(_load("config_flat_tiny_run.json"), f)
    cfg = apply_overrides(get_config("tiny"), "train.steps=50")
    assert ablate.finished(cfg, str(tmp_path)) is None          # the same run, not finished
    with pytest.raises(ValueError, match="another config"):
        ablate.finished(apply_overrides(cfg, "model.precision.format=fp8"), str(tmp_path))
