"""gemjax.train.optim: every optimizer of a run from cfg.optim, one override away."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from gemjax.config import OptimConfig, apply_overrides, config_from_dict, get_config
from gemjax.sparse import Adagrad, LazyAdam, RowWiseAdagrad
from gemjax.train import optim
from gemjax.train.loop import train
from gemjax.train.step import Trainer


def _tiny(overrides=""):
    return get_config("tiny", "train.steps=1,train.log_every=1,train.eval_every=1,"
                              "train.checkpoint_every=1,train.baselines=false,"
                              "train.tensorboard=false" + ("," + overrides if overrides else ""))


def _one_step(overrides, tmp_path):
    # model v0 without its sequence arch: the same optimizers over the same tables in half
    # the compile time
    summary = train(_tiny("model.use_sequences=false," + overrides), str(tmp_path), log=lambda s: None)
    assert summary["steps"] == 1
    assert np.isfinite(summary["eval_ne"])
    return summary


@pytest.mark.parametrize("name", ["adamw", "adagrad"])
def test_dense_optimizer_is_one_override(name, tmp_path):
    cfg = _tiny(f"optim.dense.name={name}")
    assert cfg == _tiny(f"optim.dense={name}")          # the flat path is an alias of it
    assert cfg.optim.dense.name == name
    tx = Trainer.create(cfg).tx
    params = {"w": jnp.ones((3,)), "b": jnp.zeros((2,))}
    grads = {"w": jnp.array([0.5, -1.0, 2.0]), "b": jnp.array([1.0, -1.0])}
    ref = optax.chain(optax.clip_by_global_norm(cfg.optim.dense.clip_norm),
                      getattr(optax, name)(optim.lr_schedule(cfg)))
    got, _ = tx.update(grads, tx.init(params), params)
    want, _ = ref.update(grads, ref.init(params), params)
    for k in params:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6)
    # a run trains one step with it, its tables with the sparse adagrad (not the default
    # rowwise_adagrad)
    _one_step(f"optim.dense.name={name},optim.dense.lr=3e-3,optim.sparse=adagrad", tmp_path)


def test_schedules_against_formulas():
    cfg = _tiny("train.steps=100,train.warmup_steps=10,train.dense_lr=0.01")
    cosine = optim.lr_schedule(cfg)
    assert float(cosine(0)) == 0.0
    np.testing.assert_allclose(float(cosine(10)), 0.01, rtol=1e-6)
    np.testing.assert_allclose(float(cosine(100)), 0.01 * cfg.optim.dense.final_lr_scale, rtol=1e-5)
    const = optim.lr_schedule(cfg, "warmup_constant")
    np.testing.assert_allclose([float(const(s)) for s in (5, 10, 90)], [0.005, 0.01, 0.01],
                               rtol=1e-6)
    assert float(optim.lr_schedule(cfg, "constant")(0)) == pytest.approx(0.01)


def test_clip_off_and_weight_decay():
    cfg = _tiny("optim.dense=adamw,optim.clip_norm=0,optim.weight_decay=0.1,"
                "optim.schedule=constant,train.dense_lr=0.1")
    tx = optim.dense_transform(cfg)
    params = {"w": jnp.full((2,), 2.0)}
    grads = {"w": jnp.array([100.0, -100.0])}      # would be clipped at 10 with clip on
    got, _ = tx.update(grads, tx.init(params), params)
    ref = optax.adamw(0.1, weight_decay=0.1)
    want, _ = ref.update(grads, ref.init(params), params)
    np.testing.assert_allclose(got["w"], want["w"], rtol=1e-6)


@pytest.mark.parametrize("name,cls", [("rowwise_adagrad", RowWiseAdagrad), ("adagrad", Adagrad),
                                      ("lazy_adam", LazyAdam)])
def test_sparse_optimizer_reaches_every_table(name, cls):
    cfg = _tiny(f"optim.sparse={name},train.sparse_lr=0.3")
    assert cfg == _tiny(f"optim.sparse.name={name},optim.sparse.lr=0.3")   # the flat paths are aliases
    specs = optim.table_specs(cfg)
    assert specs and all(type(s.optimizer) is cls and s.optimizer.lr == 0.3 for s in specs)
    coll = Trainer.create(cfg).coll
    assert all(type(s.optimizer) is cls for s in coll.specs.values())


@pytest.mark.parametrize("override,needle", [
    ("optim.dense=nosuch", "optim.dense.name='nosuch'"),
    ("optim.dense=global_norm", "optim.dense.name='global_norm'"),
    ("optim.dense=adam,optim.weight_decay=0.1", "takes no weight_decay"),
])
def test_bad_dense_optimizer_named(override, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        optim.dense_transform(_tiny(override))


@pytest.mark.parametrize("override,field", [("optim.schedule=linear", "optim.dense.schedule"),
                                            ("optim.sparse=adam", "optim.sparse.name"),
                                            ("optim.clip_norm=-1", "optim.dense.clip_norm"),
                                            ("optim.final_lr_scale=2", "optim.dense.final_lr_scale")])
def test_config_refuses_bad_optim_fields(override, field):
    with pytest.raises(ValueError, match=field):
        _tiny(override)


def test_optim_section_round_trips_through_config_json():
    cfg = _tiny("optim.dense=lamb,optim.weight_decay=0.01,optim.sparse=sgd")
    back = config_from_dict(dataclasses.asdict(cfg))
    assert back.optim == cfg.optim
    assert config_from_dict({k: v for k, v in dataclasses.asdict(cfg).items()
                             if k != "optim"}).optim == optim_default()


def optim_default():
    return OptimConfig()


def test_helpconfig_lists_every_field_with_its_comment():
    import subprocess
    import sys
    from gemjax.config import ALIASES, SECTIONS, field_help
    helps = field_help()
    cfg = get_config("tiny")

    def leaves(record, prefix):       # every leaf field path, walked here independently
        out = []
        for f in dataclasses.fields(record):
            v = getattr(record, f.name)
            out += (leaves(v, f"{prefix}{f.name}.") if dataclasses.is_dataclass(v)
                    else [f"{prefix}{f.name}"])
        return out

    names = [p for s in SECTIONS for p in leaves(getattr(cfg, s), f"{s}.")]
    assert sorted(helps) == sorted(names) and all(helps.values())
    assert {"optim.dense.name", "model.teacher.pyramid_levels", "data.synthetic.vocab_user",
            "model.precision.format", "sparse.act_dtype", "data.drift.every"} <= set(names)
    # comments read from the source: the trailing one and the block above a field
    assert helps["data.batch_size"] == "global samples per step"
    assert helps["optim.dense.weight_decay"].startswith("for optimizers that take one")
    assert "any optax optimizer taking a learning_rate" in helps["optim.dense.name"]
    out = subprocess.run([sys.executable, "-m", "experiments.train", "--config=tiny",
                          "--override=optim.dense=adamw", "--helpconfig"],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    lines = out.strip().splitlines()
    fields = [ln for ln in lines if " = " in ln]
    assert [ln.split(" = ")[0] for ln in fields] == names
    assert "optim.dense.name = 'adamw'  (str)  any optax optimizer" in out
    assert all(f"{old} -> {new}" in lines for old, new in ALIASES.items())
