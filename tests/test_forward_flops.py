"""gemjax.perf.forward_flops against the compiled forward: on a batch without padding
rows, the HLO's dot FLOPs (tests/test_model_flops.hlo_dot_flops) plus the attention
kernels' recorded valid pairs equal the analytic count, for GEM v0 with and without its
sequence encoders, the DLRM-style student and LR; the teacher's is model_flops'."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from gemjax.config import get_config
from gemjax.data.synthetic import SyntheticStream
from gemjax.perf import local_mfu as L
from gemjax.perf import model_flops as F
from gemjax.perf.forward_flops import forward_flops
from tests.test_model_flops import _stub_kernels, _tight, hlo_dot_flops

CASES = {
    "gem_block": "model.kind=gem,model.attention=block,model.block=4,model.seq_layers=2",
    "gem_softmax": "model.kind=gem,model.attention=softmax",
    "wukong": "model.kind=gem,model.use_sequences=false,model.wukong_layers=2",
    "dlrm": "model.kind=student,model.student_arch=dlrm,model.student_width=4",
    "lr": "model.kind=lr",
}


@pytest.mark.parametrize("case", list(CASES))
def test_forward_flops_match_the_compiled_forward(case, monkeypatch):
    from gemjax.models.gem import build_model
    cfg = get_config("tiny", CASES[case])
    batch = _tight(SyntheticStream(cfg.data, 0).shard_batch(0, 0, 1)[0])
    recorded = _stub_kernels(monkeypatch)
    dev = jax.device_put(batch)
    graph, state = nnx.split(build_model(cfg, nnx.Rngs(0)))
    acts = L.random_acts(cfg, dev, jax.random.key(1))
    if cfg.model.kind == "lr":                 # LR's tables hold S K weights per id
        sk = cfg.data.synthetic.num_surfaces * cfg.data.synthetic.num_tasks
        acts = {k: v[:, :sk] for k, v in acts.items()}
    fn = jax.jit(lambda st, a, b: nnx.merge(graph, st)(a, b))
    compiled = fn.lower(state, acts, dev).compile()
    jax.block_until_ready(compiled(state, acts, dev))
    jax.effects_barrier()
    got = hlo_dot_flops(compiled.as_text()) + sum(recorded)
    want = forward_flops(cfg, batch)
    assert got == want, (got, want)
    assert want > 0                            # LR: the synthetic stream's dense features
    if case == "gem_block":
        assert sum(recorded) > 0


def test_teacher_is_model_flops_forward():
    cfg = get_config("tiny", "model.kind=teacher")
    batch = SyntheticStream(cfg.data, 0).shard_batch(0, 0, 1)[0]
    assert 3 * forward_flops(cfg, batch) == F.batch_step_flops(cfg, batch)


def test_other_kinds_are_refused():
    cfg = get_config("tiny", "model.kind=gem")
    batch = SyntheticStream(cfg.data, 0).shard_batch(0, 0, 1)[0]
    bad = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, kind="retrieval"))
    with pytest.raises(ValueError, match="not a ranking model"):
        forward_flops(bad, batch)
    assert np.isfinite(forward_flops(cfg, batch))
