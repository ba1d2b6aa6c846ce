"""Mesh specs: parsing, -1 inference, host-tier placement, clear errors (8 simulated CPU devices)."""

from types import SimpleNamespace

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

from gemjax.parallel import mesh as pm


def test_parse_defaults_and_explicit_tiers():
    spec = pm.parse_mesh_spec("replica=2,fsdp=-1,expert=2")
    assert spec.names == ("replica", "fsdp", "expert")
    assert spec.shape == (2, -1, 2)
    assert spec.tiers == ("cross_zone", "zone", "host")
    spec = pm.parse_mesh_spec("data=4@cross_zone, seq=2@host")
    assert spec.tiers == ("cross_zone", "host")


@pytest.mark.parametrize("text, needle", [
    ("", "empty"),
    ("replica", "cannot parse"),
    ("replica=0", "size must be"),
    ("fsdp=-1,expert=-1", "at most one"),
    ("fsdp=2,fsdp=2", "repeated"),
    ("foo=2", "no default tier"),
    ("foo=2@rack", "unknown tier"),
    ("expert=2,fsdp=4", "slow to fast"),
])
def test_parse_errors_name_the_problem(text, needle):
    with pytest.raises(ValueError, match=needle):
        pm.parse_mesh_spec(text)


def test_factorizations_match_brute_force():
    for n in (1, 6, 8, 12):
        for k in (1, 2, 3):
            brute = sorted(t for t in np.ndindex(*(n + 1,) * k)
                           if all(x > 0 for x in t) and np.prod(t) == n)
            assert sorted(pm._factorizations(n, k)) == brute


def test_resolve_infers_and_lists_working_shapes():
    assert pm.resolve_mesh_spec("replica=2,fsdp=-1,expert=2", 8).shape == (2, 2, 2)
    with pytest.raises(ValueError, match=r"product 12 != 8.*replica=1,fsdp=4,expert=2"):
        pm.resolve_mesh_spec("replica=2,fsdp=3,expert=2", 8)
    with pytest.raises(ValueError, match="do not divide 8"):
        pm.resolve_mesh_spec("fsdp=3,expert=-1", 8)
    # an NVLink axis of 8 on hosts of 4 would cross hosts
    with pytest.raises(ValueError, match=r"'expert' has tier 'host'.*span 2 hosts.*replica=2,expert=4"):
        pm.resolve_mesh_spec("replica=1,expert=8", 8, devices_per_host=4)
    # a zone axis may span hosts
    assert pm.resolve_mesh_spec("fsdp=8", 8, devices_per_host=4).shape == (8,)


def test_split_over_hosts_and_valid_shapes():
    spec = pm.parse_mesh_spec("replica=2,fsdp=4,expert=2")
    ici, dcn = pm.split_over_hosts(spec, 8)
    assert ici == (1, 4, 2) and dcn == (2, 1, 1)
    ici, dcn = pm.split_over_hosts(pm.parse_mesh_spec("replica=4,fsdp=2,expert=2"), 8)
    assert ici == (2, 2, 2) and dcn == (2, 1, 1)
    shapes = pm.valid_shapes(pm.parse_mesh_spec("replica=1,fsdp=1,expert=1"), 16, devices_per_host=8)
    # every shape multiplies to 16 and its expert axis fits in a host of 8
    assert shapes and all(np.prod(s) == 16 and 8 % s[2] == 0 for s in shapes)
    assert (1, 1, 16) not in shapes and (2, 1, 8) in shapes and (1, 16, 1) in shapes


@pytest.mark.parametrize("axis_types, kind", [("auto", AxisType.Auto), ("explicit", AxisType.Explicit)])
def test_build_mesh_on_cpu_devices(axis_types, kind):
    mesh = pm.build_mesh("replica=2,fsdp=-1,expert=2", axis_types=axis_types)
    assert dict(mesh.shape) == {"replica": 2, "fsdp": 2, "expert": 2}
    assert mesh.axis_types == (kind,) * 3
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    assert sorted(ids.ravel().tolist()) == sorted(d.id for d in jax.devices())


def test_multi_process_layout_keeps_inner_axes_in_a_process():
    # fake devices of 2 processes x 4, shuffled: inner axes must stay within one process
    rng = np.random.default_rng(0)
    devs = [SimpleNamespace(id=i, process_index=i // 4, platform="cpu", device_kind="cpu") for i in range(8)]
    devs = [devs[i] for i in rng.permutation(8)]
    for text in ("replica=2,fsdp=2,expert=2", "replica=2,fsdp=4", "fsdp=4,expert=2"):
        spec = pm.resolve_mesh_spec(text, 8, 4)
        arr = pm.device_array(spec, devs)
        proc = np.vectorize(lambda d: d.process_index)(arr)
        assert arr.shape == spec.shape
        # all devices used once
        assert sorted(np.vectorize(lambda d: d.id)(arr).ravel()) == list(range(8))
        # devices with the same cross-host coordinates (index // in-host size) share a process,
        # and each process holds exactly one such block
        ici, _ = pm.split_over_hosts(spec, 4)
        blocks = {}
        for idx in np.ndindex(*spec.shape):
            key = tuple(i // c for i, c in zip(idx, ici))
            blocks.setdefault(key, set()).add(int(proc[idx]))
        assert all(len(p) == 1 for p in blocks.values()) and len(blocks) == 2
        if spec.tiers[-1] == "host":  # innermost NVLink axis never crosses processes
            assert (proc == proc[..., :1]).all()


@pytest.mark.parametrize("n_proc, per_proc, per_host", [(2, 4, 4), (4, 2, 4), (1, 8, 4), (8, 1, 2)])
def test_hosts_from_processes_keep_host_axes_inside(n_proc, per_proc, per_host):
    # one process per host (hybrid mesh), several per host, or hosts simulated in one process
    rng = np.random.default_rng(1)
    devs = [SimpleNamespace(id=i, process_index=i // per_proc, platform="cpu", device_kind="cpu")
            for i in range(n_proc * per_proc)]
    devs = [devs[i] for i in rng.permutation(len(devs))]
    host_of = lambda d: (d.process_index * per_proc + d.id % per_proc) // per_host  # noqa: E731
    spec = pm.resolve_mesh_spec("replica=-1,fsdp=2,expert=2" if per_host == 4 else "replica=-1,expert=2",
                                len(devs), per_host)
    arr = pm.device_array(spec, devs, per_host)
    assert sorted(np.vectorize(lambda d: d.id)(arr).ravel()) == list(range(len(devs)))
    ici, _ = pm.split_over_hosts(spec, per_host)
    blocks = {}
    for idx in np.ndindex(*spec.shape):
        blocks.setdefault(tuple(i // c for i, c in zip(idx, ici)), set()).add(host_of(arr[idx]))
    assert all(len(h) == 1 for h in blocks.values()) and len(blocks) == len(devs) // per_host


def test_device_array_rejects_uneven_processes():
    devs = [SimpleNamespace(id=i, process_index=int(i >= 3), platform="cpu") for i in range(4)]
    with pytest.raises(ValueError, match="different device counts"):
        pm.device_array(pm.resolve_mesh_spec("fsdp=4", 4), devs)
