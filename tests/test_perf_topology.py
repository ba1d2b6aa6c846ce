"""Topology cost model: ring byte formulas, effective tiers and a whole step's collectives by hand."""

import pytest

from gemjax.perf import topology as T
from gemjax.parallel.mesh import resolve_mesh_spec


def test_ring_bytes_and_steps_by_hand():
    assert T.ring_bytes("all_gather", 4, 1000) == 750
    assert T.ring_bytes("reduce_scatter", 4, 1000) == 750
    assert T.ring_bytes("all_to_all", 8, 800) == 700
    assert T.ring_bytes("all_reduce", 4, 1000) == 1500
    assert T.ring_bytes("all_reduce", 1, 1000) == 0
    assert T.ring_steps("all_reduce", 4) == 6 and T.ring_steps("all_gather", 4) == 3
    with pytest.raises(ValueError, match="unknown collective"):
        T.ring_bytes("broadcast", 2, 1)


def test_effective_tiers_from_span():
    net = T.Network(gpus_per_host=8, gpus_per_zone=16)
    spec = resolve_mesh_spec("replica=2,fsdp=8,expert=2", 32)
    assert T.axis_tiers(spec, net) == {"expert": "host", "fsdp": "zone", "replica": "cross_zone"}
    spec = resolve_mesh_spec("replica=4,fsdp=4,expert=2", 32)  # fsdp spans 8 GPUs: one host
    assert T.axis_tiers(spec, net) == {"expert": "host", "fsdp": "host", "replica": "cross_zone"}
    assert T.group(spec, ("fsdp", "expert"), net) == (8, "host")
    assert T.group(spec, ("replica", "fsdp"), net) == (16, "cross_zone")
    assert T.group(spec, ("nonexistent",), net) == (1, "host")


def test_step_collectives_by_hand():
    spec = resolve_mesh_spec("replica=2,fsdp=4,expert=2", 16)
    net = T.Network(bandwidth={"host": 1000.0, "zone": 100.0, "cross_zone": 10.0},
                    latency={"host": 0.0, "zone": 1.0, "cross_zone": 0.0}, gpus_per_host=8, gpus_per_zone=256)
    work = T.Workload(dense_params=1000, expert_params=600, param_bytes=2, grad_bytes=4, local_batch=10,
                      lookups_per_sample=5, emb_dim=8, emb_bytes=2, id_bytes=4, expert_tokens_per_sample=3,
                      d_model=16, act_bytes=2, forward_flops_per_sample=100.0)
    got = {c.name: c for c in T.step_collectives(spec, work, net=net)}
    expect_bytes = {
        "dense param all-gather": 2 * 3 / 4 * 1000 * 2,        # twice (fwd + bwd), 3/4 of 2,000 B
        "dense grad reduce-scatter": 3 / 4 * 1000 * 4,
        "dense grad all-reduce": 2 * 1 / 2 * (1000 * 4 / 4),    # shard of 1,000 B across 2 replicas
        "expert param all-gather": 2 * 3 / 4 * 300 * 2,        # 600 params / 2 expert ranks
        "expert grad reduce-scatter": 3 / 4 * 300 * 4,
        "expert grad all-reduce": 2 * 1 / 2 * (300 * 4 / 4),
        "expert token all-to-all": 4 * 1 / 2 * (10 * 3 * 16 * 2),
        "sparse id all-to-all": 3 / 4 * (50 * 4),
        "embedding all-to-all": 2 * 3 / 4 * (50 * 8 * 2),
        "sparse copy all-gather": 1 / 2 * 800,
        "sparse copy reduce-scatter": 1 / 2 * 800,
    }
    assert set(got) == set(expect_bytes)
    for name, b in expect_bytes.items():
        assert got[name].bytes == pytest.approx(b), name
    # replica spans 16 GPUs (> one host) -> zone: 2 steps x 1 s latency + 1,000 B / 100 B/s
    assert got["dense grad all-reduce"].tier == "zone"
    assert got["dense grad all-reduce"].seconds == pytest.approx(2 * 1.0 + 1000 / 100)
    # fsdp spans 8 GPUs -> NVLink rates, zero latency
    assert got["dense param all-gather"].seconds == pytest.approx(3000 / 1000)
    res = T.predict(spec, work, peak=1000.0, local_mfu=0.5, overlap=0.0, net=net)
    compute = 3 * 100.0 * 10 / (1000.0 * 0.5)
    comm = sum(c.seconds for c in got.values())
    assert res["compute_s"] == pytest.approx(compute) and res["comm_s"] == pytest.approx(comm)
    assert res["scaling_ratio"] == pytest.approx(compute / (compute + comm))
    full = T.predict(spec, work, peak=1000.0, local_mfu=0.5, overlap=1.0, net=net)
    assert full["scaling_ratio"] == 1.0


def test_predicted_table_for_gem_scales():
    rows = [T.predict(T.default_mesh(n), T.GEM_LIKE) for n in (64, 1024, 4096)]
    assert [r["devices"] for r in rows] == [64, 1024, 4096]
    assert rows[2]["mesh"] == "replica=16,fsdp=128,expert=2"
    # weak scaling: compute per GPU is constant, communication never shrinks with more replicas
    assert rows[0]["compute_s"] == rows[2]["compute_s"]
    assert rows[0]["comm_s"] <= rows[1]["comm_s"] <= rows[2]["comm_s"]
    assert "4096" in T.format_table(rows)
    with pytest.raises(ValueError, match="overlap"):
        T.predict(T.default_mesh(64), T.GEM_LIKE, overlap=2.0)


def test_calibrate_recovers_known_scales():
    preds = [T.predict(T.default_mesh(n), T.GEM_LIKE) for n in (8, 16, 64, 1024)]
    preds[0] = dict(preds[0], comm_s=0.1)  # make the system well conditioned
    measured = [1.25 * p["compute_s"] + 0.3 * p["comm_s"] for p in preds]
    fit = T.calibrate(preds, measured)
    assert fit["compute_scale"] == pytest.approx(1.25) and fit["comm_scale"] == pytest.approx(0.3)
    assert fit["max_rel_error"] < 1e-9
    one_gpu = T.calibrate([{"compute_s": 2.0, "comm_s": 0.0}], [3.0])
    assert one_gpu["compute_scale"] == pytest.approx(1.5) and one_gpu["comm_scale"] == 0.0
    with pytest.raises(ValueError, match="one measured"):
        T.calibrate(preds, [1.0])


def test_calibrate_compute_reproduces_one_device_and_adds_only_comm():
    work = T.Workload(dense_params=1e6, local_batch=100, lookups_per_sample=10, emb_dim=8,
                      forward_flops_per_sample=2e9)
    # 3 x 2e9 x 100 = 6e11 FLOPs in 1.5 s at peak 1e12: MFU 0.4
    eff = T.calibrate_compute(work, 1.5, 1e12)
    assert eff == pytest.approx(0.4)
    one = T.predict(resolve_mesh_spec("replica=1,fsdp=1,expert=1", 1), work, peak=1e12, local_mfu=eff)
    assert one["step_s"] == pytest.approx(1.5) and one["comm_s"] == 0
    two = T.predict(resolve_mesh_spec("replica=1,fsdp=2,expert=1", 2), work, peak=1e12, local_mfu=eff)
    assert two["step_s"] == pytest.approx(1.5 + two["comm_s"]) and two["comm_s"] > 0
    assert T.relative_error(1.2, 1.0) == pytest.approx(0.2) and T.relative_error(0.9, 1.0) == pytest.approx(-0.1)
    with pytest.raises(ValueError, match="implied MFU"):
        T.calibrate_compute(work, 0.1, 1e12)
    with pytest.raises(ValueError, match="measured_step_s"):
        T.calibrate_compute(work, 0.0, 1e12)


def test_layout_for_follows_the_trainer():
    lay = T.layout_for(("replica", "fsdp", "expert"), ("fsdp",), ("replica",))
    assert lay.fsdp == ("fsdp",) and lay.replica == ("replica", "expert") and lay.expert == ("expert",)
    assert lay.sparse_mp == ("fsdp", "expert") and lay.sparse_copy == ("replica",)
    # dense params are replicated over the expert axis too (gradients all-reduced there), experts are not
    spec = resolve_mesh_spec("replica=1,fsdp=1,expert=2", 2)
    net = T.Network(bandwidth={"host": 100.0, "zone": 1.0, "cross_zone": 1.0},
                    latency={"host": 0.0, "zone": 0.0, "cross_zone": 0.0})
    work = T.Workload(dense_params=50, expert_params=40, grad_bytes=4)
    got = {c.name: c for c in T.step_collectives(spec, work, lay, net)}
    assert got["dense grad all-reduce"].bytes == pytest.approx(2 * 0.5 * 50 * 4)
    assert got["expert grad all-reduce"].ranks == 1 and got["expert grad all-reduce"].bytes == 0


def test_best_mesh_searches_every_valid_shape():
    """best_mesh beats or ties GEM's default layout, its shape respects hosts and zones,
    and it follows the traffic: a sparse-heavy workload keeps its embedding all-to-all
    (over fsdp x expert) inside one NVLink host, a dense-heavy one shards its
    parameters (fsdp > 1)."""
    net = T.Network(gpus_per_host=8, gpus_per_zone=64)
    for work in (T.GEM_LIKE,
                 T.Workload(dense_params=1e6, lookups_per_sample=4000, local_batch=1024,
                            forward_flops_per_sample=1e9),
                 T.Workload(dense_params=8e9, local_batch=64, forward_flops_per_sample=1e9)):
        best, tried = T.best_mesh(256, work, net=net, peak=989e12, local_mfu=0.4)
        default = T.default_mesh(256, fsdp_max=64)
        ref = T.predict(default, work, net=net, peak=989e12, local_mfu=0.4,
                        layout=T.layout_for(default.names))
        assert tried > 5 and best["step_s"] <= ref["step_s"] * (1 + 1e-12)
        sizes = dict(p.split("=") for p in best["mesh"].split(","))
        assert int(sizes["expert"]) <= 8 and int(sizes["fsdp"]) * int(sizes["expert"]) <= 64
        if work.lookups_per_sample == 4000:
            assert int(sizes["fsdp"]) * int(sizes["expert"]) <= 8, best["mesh"]
        if work.dense_params == 8e9:
            assert int(sizes["fsdp"]) > 1, best["mesh"]
    with pytest.raises(ValueError, match="no shape"):
        T.best_mesh(12, T.GEM_LIKE, axes="expert", net=T.Network(gpus_per_host=8))
