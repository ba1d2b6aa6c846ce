"""Activation-checkpointing regions (gemjax.layers.regions) on the tiny teacher and the
planner (gemjax.train.remat): plans parse or fail naming the flag, "none" traces the
unwrapped program, recompute / offload give the same gradients, quantize stays within
E4M3's rounding, the planner's choices shrink with the budget and fit it."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gemjax.config import get_config
from gemjax.layers import regions
from gemjax.layers.interformer import InterFormer
from gemjax.layers.mlp import MLP
from gemjax.layers.regions import REGIONS, format_plan, parse_plan
from gemjax.models.interformer import GEMTeacher
from gemjax.precision.saved import REL_BOUND
from gemjax.train import remat
from suite_cache import smoke_teacher_override, with_suite_cache   # tests/suite_cache.py
from tiny_teacher import one_program, teacher_config, teacher_inputs   # tests/tiny_teacher.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_parse_plan_round_trip_and_errors_name_the_flag():
    assert parse_plan("none") == () and parse_plan("") == ()
    plan = parse_plan("seq:recompute,attention:save,interaction:offload/heads:quantize")
    assert plan == (("seq", "recompute"), ("interaction", "offload"), ("heads", "quantize"))
    assert parse_plan(format_plan(plan)) == plan
    assert dict(parse_plan("all:recompute/heads:save")) == {r: "recompute" for r in REGIONS if r != "heads"}
    for bad in ("seq:sometimes", "mlp:save", "seq", "auto"):
        with pytest.raises(ValueError, match="train.remat"):
            parse_plan(bad)
    with pytest.raises(ValueError, match="train.memory_budget_gb"):
        get_config("tiny", "model.kind=teacher,train.remat=auto")
    with pytest.raises(ValueError, match="model.kind=teacher"):
        get_config("tiny", "train.remat=seq:recompute")


def test_plan_and_offload_tags_are_module_attributes():
    """set_plan reaches every module that runs regions; under "offload" only the copy of
    the block's module merged inside the checkpoint tags (checkpoint_name), the model's
    own modules keep offload_tags False, and the other policies name nothing."""
    m = InterFormer(3, 8, num_layers=2, num_heads=2, summary_tokens=2, cls_tokens=1,
                    pma_tokens=1, recent_tokens=1, rngs=nnx.Rngs(0))
    plan = parse_plan("cross:offload/seq:recompute")
    assert regions.set_plan(m, plan) is m
    holders = [mod for _, mod in nnx.iter_modules(m) if hasattr(mod, "remat_plan")]
    assert len(holders) == 3 and all(h.remat_plan == plan for h in holders)   # stack + 2 layers
    mlp = MLP(4, (6, 5), 3, rngs=nnx.Rngs(0))
    x = jnp.ones((2, 4))

    def jaxpr(plan):
        return str(jax.make_jaxpr(lambda x: regions.run(plan, "heads", mlp, x))(x))
    assert jaxpr(()).count("name=mlp.hidden") == 0
    assert jaxpr({"heads": "recompute"}).count("name=mlp.hidden") == 0
    assert jaxpr({"heads": "offload"}).count("name=mlp.hidden") == 2        # two hidden layers
    assert jaxpr({"cross": "offload"}).count("name=mlp.hidden") == 0        # another region's policy
    assert mlp.offload_tags is False
    assert str(jax.make_jaxpr(lambda x: regions.tag(x, "attn.out", True))(x)).count("name=attn.out") == 1


MIXED = "pyramid:recompute/cross:offload/seq:recompute/attention:offload/interaction:recompute/heads:offload"


def _teacher_grads(plans: tuple[str, ...]):
    """[(jaxpr text, gradient leaves)] per plan: the gradient of a squared-logits loss of a
    tiny teacher with two experts and one sequence (the pyramid region wraps every
    sequence's encoder at once: one is enough), w.r.t. params and looked-up activations,
    under train.remat=plan. One model (set_plan per plan: the same parameters), each plan's
    gradient its own jitted function, all traced and compiled as one program (the
    forwards, the same under every plan, compiled once); each plan's jaxpr is its own
    inner jit's."""
    cfg = teacher_config(batch_size=16, num_experts=2, sequences=1)
    model = GEMTeacher(cfg, rngs=nnx.Rngs(0))
    batch, acts = teacher_inputs(cfg)
    grads = []
    for plan in plans:
        graphdef, params = nnx.split(regions.set_plan(model, parse_plan(plan)), nnx.Param)

        def loss(p, a, graphdef=graphdef):
            return jnp.sum(nnx.merge(graphdef, p)(a, batch) ** 2)
        grads.append(jax.jit(jax.grad(loss, argnums=(0, 1))))
    traced, inner = one_program(grads, params, acts)
    outs = traced.lower().compile()(params, acts)
    return [(str(j), jax.tree.leaves(o)) for j, o in zip(inner, outs)]


@pytest.mark.slow
def test_policies_on_the_teacher_gradients():
    (ref_text, ref), (text, got), (_, quant) = _teacher_grads(("none", MIXED, "all:quantize"))
    # "none" wraps nothing: no checkpoint names, only the kernels' own checkpoints
    assert "name[" not in ref_text
    # every region under recompute or offload (MIXED), each policy on three regions
    assert text.count("remat") > ref_text.count("remat") and "name[" in text
    for a, b in zip(ref, got):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-5, atol=2e-6)
    # quantize everywhere: each kept input within REL_BOUND = 2**-4 of itself (E4M3, saved.py);
    # the gradient, a smooth function of those inputs, moves by at most a small multiple of
    # that: relative L2 error <= 2 * 2**-4 here, and not zero (8 bits were kept)
    num = sum(float(jnp.sum((a - b) ** 2)) for a, b in zip(ref, quant))
    den = sum(float(jnp.sum(a ** 2)) for a in ref)
    rel = (num / den) ** 0.5
    assert 1e-4 < rel <= 2 * REL_BOUND, rel


def _measured(peak: int, t: float, plan: str = "p") -> remat.Measured:
    return remat.Measured(plan, peak, 0, 0, t)


def test_choose_smaller_budget_never_more_memory_and_error_names_flag():
    rng = np.random.default_rng(0)
    for _ in range(200):            # arbitrary paths: the measured peaks need not fall
        peaks = rng.integers(1, 100, size=rng.integers(1, 8))
        path = remat.Path(_measured(int(peaks[0]), 0.0), {}, [_measured(int(p), 0.0) for p in peaks])
        budgets = np.sort(rng.integers(int(peaks.min()), 110, size=5))
        chosen = [remat.choose(path, int(b)).peak_bytes for b in budgets]
        assert all(c <= b for c, b in zip(chosen, budgets))
        assert all(small <= large for small, large in zip(chosen, chosen[1:]))
        with pytest.raises(ValueError, match="train.memory_budget_gb"):
            remat.choose(path, int(peaks.min()) - 1)


def test_plan_path_greedy_order_on_additive_measure():
    """An additive memory / time model: the path takes the changes by bytes saved per
    second added, a region moving on to a better policy by the difference."""
    saving = {("seq", "recompute"): (40, 4.0), ("seq", "quantize"): (50, 6.0),
              ("heads", "recompute"): (10, 0.5), ("heads", "quantize"): (5, 1.0),
              ("interaction", "recompute"): (30, 1.0), ("interaction", "quantize"): (20, 2.0)}
    seen = []

    def measure(plan: str) -> remat.Measured:
        seen.append(plan)
        items = dict(parse_plan(plan))
        saved = sum(saving[kv][0] for kv in items.items())
        cost = sum(saving[kv][1] for kv in items.items())
        return _measured(1000 - saved, 1.0 + cost, plan)

    path = remat.plan_path(measure, regions=("seq", "heads", "interaction"),
                           policies=("recompute", "quantize"))
    # ratios: interaction 30, heads 20, seq:recompute 10 (seq:quantize 8.3), then seq:quantize
    # over it 10/2 = 5; heads / interaction quantize over recompute save less: never taken
    assert [m.plan for m in path.steps] == [
        "none", "interaction:recompute", "interaction:recompute/heads:recompute",
        "seq:recompute/interaction:recompute/heads:recompute",
        "seq:quantize/interaction:recompute/heads:recompute"]
    assert len(seen) == len(set(seen))          # nothing measured twice


@pytest.mark.slow
def test_bench_remat_smoke_curve():
    """The curve tool on CPU: the planner's real measurements of the tiny teacher's train
    step; each budget's plan fits it, smaller budgets get no more memory, one budget
    below every plan is reported infeasible naming the flag. The teacher is
    bench_saved_ne's smoke one: its baseline step is the program of that bench's "none"
    plan, compiled once for both tests through the suite's cache."""
    out = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"remat_smoke_{os.getpid()}.json")
    env = with_suite_cache(dict(os.environ, JAX_PLATFORMS="cpu"))
    r = subprocess.run([sys.executable, "-m", "benchmarks.bench_remat", "--smoke",
                        f"--override={smoke_teacher_override()}",
                        "--fractions=1.0,0.9,0.75,0.3", f"--out={out}"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "infeasible" in r.stdout.rstrip().splitlines()[-1]         # the curve table is last
    res = json.load(open(out))
    path = res["path"]
    assert path[0]["plan"] == "none" and path[0]["peak_gib"] == res["baseline"]["peak_gib"]
    assert len(path) == 2 and path[1]["peak_gib"] < path[0]["peak_gib"]    # recompute saved memory
    rows = sorted(res["curve"], key=lambda row: row["budget_gib"])
    assert [row.get("plan") for row in rows] == [None, path[1]["plan"], path[1]["plan"], "none"]
    assert all(row["peak_gib"] <= row["budget_gib"] for row in rows[1:])
    assert "train.memory_budget_gb" in rows[0]["error"]
