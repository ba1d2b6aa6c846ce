"""experiments/sweep_mesh.py end to end on 2 CPU devices: weak-scaling batches, every column, the
1-device calibration of the cost model, the predicted table."""

import json
import os
import subprocess
import sys

import pytest
from suite_cache import with_suite_cache   # tests/suite_cache.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLUMNS = ("mesh", "devices", "local_batch", "global_batch", "step_s", "samples_per_s", "e2e_mfu", "local_mfu",
           "scaling_ratio", "weak_scaling_efficiency", "compiled_bytes_per_device", "predicted_step_s",
           "predicted_rel_error", "step_flops", "xla_flops_per_device", "pallas_attention_flops")


def test_sweep_tiny_on_two_cpu_devices(tmp_path):
    # model v0 without its sequence arch: the sweep's columns, cost model and traces are the
    # same, and each mesh's step compiles in half the time
    env = with_suite_cache(dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"))
    r = subprocess.run(
        [sys.executable, "-m", "experiments.sweep_mesh", "--config=tiny",
         "--override=data.batch_size=8,data.seq_median=4,data.seq_cap=8,model.wukong_layers=1,"
         "model.use_sequences=false",
         "--cpu_devices=2", "--shapes=replica=2,fsdp=1,expert=1", "--steps=1", "--batches=1",
         "--peak_flops=1e11", "--predict_gpus=64,1024", "--profile_steps=1", f"--workdir={tmp_path}"],
        capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.load(open(tmp_path / "sweep_mesh.json"))
    rows = out["rows"]
    # the 1-device base is added in front of the requested shape, on a sub-mesh of one device
    assert [(x["mesh"], x["devices"]) for x in rows] == [("replica=1,fsdp=1,expert=1", 1),
                                                         ("replica=2,fsdp=1,expert=1", 2)]
    for x in rows:
        assert set(COLUMNS) <= set(x), set(COLUMNS) - set(x)
        # weak scaling: the preset batch (8) per device
        assert x["local_batch"] == 8 and x["global_batch"] == 8 * x["devices"]
        assert x["samples_per_s"] == pytest.approx(x["global_batch"] / x["step_s"])
        assert x["e2e_mfu"] == pytest.approx(x["step_flops"] / (x["step_s"] * x["devices"] * 1e11))
        assert x["local_mfu"] is None and x["scaling_ratio"] is None   # model v0: no teacher blocks
        assert x["pallas_attention_flops"] == 0                         # counted for a teacher only
        assert x["flops_source"] == "xla" and x["step_flops"] == x["xla_step_flops"]  # not a teacher
    base, two = rows
    # from the step times: per-device samples/s vs one device (not FLOP counts, which drift)
    assert two["weak_scaling_efficiency"] == pytest.approx(base["step_s"] / two["step_s"])
    # calibrated on the 1-device step alone: it is reproduced exactly, the other mesh adds comm only
    assert base["predicted_step_s"] == pytest.approx(base["step_s"]) and abs(base["predicted_rel_error"]) < 1e-9
    assert two["predicted_step_s"] > base["step_s"] and two["predicted_collectives"]
    assert two["predicted_rel_error"] == pytest.approx(two["predicted_step_s"] / two["step_s"] - 1)
    cm = out["cost_model"]
    assert [p["devices"] for p in cm["predicted"]] == [64, 1024]
    assert [p["devices"] for p in cm["predicted_best_mesh"]] == [64, 1024]
    for best, default in zip(cm["predicted_best_mesh"], cm["predicted"]):
        assert best["step_s"] <= default["step_s"] * (1 + 1e-9)
    assert cm["max_abs_rel_error_multi_device"] == pytest.approx(abs(two["predicted_rel_error"]))
    assert cm["workload"]["local_batch"] == 8 and cm["workload"]["emb_dim"] == 8
    assert "best:" in r.stdout.splitlines()[-1] and "pred err" in r.stdout
    # --profile_steps: a perfetto trace per mesh, summarised (host-only on CPU)
    for x in rows:
        assert x["profile"].startswith(str(tmp_path))
        assert any(f == "perfetto_trace.json.gz" for _, _, fs in os.walk(x["profile"]) for f in fs)
    assert r.stdout.count("no device events in the trace") == 2
    # --save_hlo (default): each mesh's optimized program, the 2-device one with its collectives
    import gzip
    texts = [gzip.open(x["hlo"], "rt").read() for x in rows]
    assert all("ENTRY" in t for t in texts) and "'replica'=2" in texts[1] and "'replica'=2" not in texts[0]


def test_cost_model_expert_tokens_follow_the_built_experts():
    """topology.workload_for's EP exchange: per MoE layer the [E, C, n_in, d] dispatch out and
    [E, C, n_out, d] back, with n_in / n_out read from the model the trainer builds."""
    from flax import nnx

    from gemjax.config import get_config
    from gemjax.layers.experts import expert_capacity
    from gemjax.models.gem import build_model
    from gemjax.perf.topology import workload_for
    cfg = get_config("tiny", "model.kind=teacher,model.num_experts=4,model.top_k=2,"
                     "model.capacity_factor=1.5")
    experts = build_model(cfg, nnx.Rngs(0)).interformer.layers[0].interaction
    b, m = 64, cfg.model.teacher
    work = workload_for(cfg, dense_params=10, expert_params=10, local_batch=b, seq_tokens_per_sample=5.0,
                        forward_flops_per_sample=1.0)
    slots = m.num_experts * expert_capacity(b, m.num_experts, m.top_k, m.capacity_factor)
    want = m.interformer_layers * slots * (experts.num_tokens + experts.out_tokens) / 2 / b
    assert work.expert_tokens_per_sample == round(want) > 0
    assert workload_for(cfg, dense_params=10, expert_params=0, local_batch=b, seq_tokens_per_sample=5.0,
                        forward_flops_per_sample=1.0).expert_tokens_per_sample == 0
