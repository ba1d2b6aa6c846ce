"""Online members as runs (gemjax.train.online WORKDIR/members/<name>, gemjax.serve.admitted):
after an online run on the tiny Parquet stream (logistic regression, test_online_parquet's
data), each member's run directory predicts the held-out next window as the online run's
own eval of that member does (load_for_inference on raw ids mapped by the saved admission
map, which is checked against FrequencyAdmission.lookup); its export, loaded in a fresh
process, takes the raw ids and gives the same probabilities; and a run stopped by SIGTERM
and resumed leaves the member directories of an uninterrupted run."""

import dataclasses
import json
import os
import signal
import subprocess
import sys

import jax
import numpy as np
from jax.sharding import Mesh

from gemjax.data.feeding import concat_shards
from gemjax.serve.admitted import admission_maps, export_admitted, map_batch
from gemjax.serve.export import flatten_by_path
from gemjax.serve.inference import load_for_inference
from gemjax.serve.restore import restore
from gemjax.train.guards import Interrupted
from gemjax.train.online import OnlineRun, member_dir, parquet_windows, run_online
from test_online_parquet import SPEC, config, write_stream

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_FRESH = """
import sys, numpy as np
from gemjax.serve.export import load_exported
model = load_exported(sys.argv[1])
with np.load(sys.argv[2]) as z:
    batch = {k: z[k] for k in z.files}
np.save(sys.argv[3], model(batch))
"""


def _mesh():
    return Mesh(np.array(jax.devices()[:1]), ("batch",))


def _member_state(path):
    r = restore(path, log=lambda s: None)
    return r.step, jax.tree.map(np.asarray, jax.device_get({**r.state, "tables": r.trainer.coll.logical_arrays(
        r.state["tables"])})), r.meta


def test_online_members_serve_export_and_resume(tmp_path):
    data = tmp_path / "data"
    write_stream(data)
    cfg = config(data)
    assert parquet_windows(cfg, ("item",)).num_windows > 2
    held_out = 2                                 # the window served below, after 2 trained
    spec = dataclasses.replace(SPEC, windows=held_out, table_rows=(("item", 64),))
    ref_dir, stop_dir = str(tmp_path / "whole"), str(tmp_path / "stopped")
    run_online(cfg, ref_dir, spec, mesh=_mesh(), log=lambda s: None)
    assert sorted(os.listdir(os.path.join(ref_dir, "members"))) == ["fresh", "frozen"]

    # the online run's own eval of each member on the next window's raw batch
    run = OnlineRun(cfg, ref_dir, spec, lambda s: None, _mesh())
    try:
        assert run.restore() is not None
        (shards, _, real), *_ = run.stream.batches(held_out, 1)
        want = {}
        for n in ("fresh", "frozen"):
            m = run.members[n]
            batch, _ = run._device_batch(m, shards, count=False, real=real)
            want[n] = np.asarray(m.eval_step(m.state, batch))
            # the saved map is the member's admission (FrequencyAdmission's own lookup)
            raw = run.fields.raw_ids(shards, "item", real)     # item ids and history tokens
            rows, hashed = run.admission_of(m)["item"].lookup(raw, count=False)
            np.testing.assert_array_equal(admission_maps(member_dir(ref_dir, n))["item"](raw), rows)
            if n == "fresh":       # rows of ids it admitted in window 1, shared rows for new ids
                assert 0 < hashed < raw.size
    finally:
        run.close()
    assert not np.allclose(want["fresh"], want["frozen"])
    host = concat_shards(shards)
    for n in ("fresh", "frozen"):
        path = member_dir(ref_dir, n)
        pred = load_for_inference(path)
        got = pred(map_batch(host, admission_maps(path), pred.cfg))
        np.testing.assert_allclose(got, want[n], rtol=0, atol=1e-6)

    # the export takes raw ids: a fresh process reproduces the member's eval
    out = export_admitted(member_dir(ref_dir, "fresh"), str(tmp_path / "export"), batch=shards[0],
                          log=lambda s: None)
    manifest = json.load(open(os.path.join(out, "manifest.json")))
    assert manifest["features"]["item"]["bounds"] == "admitted"
    assert manifest["inputs"]["params"]["admission/item/ids"]["shape"] == [64 - 4]
    assert int(np.asarray(shards[0].sparse["item"]).max()) >= 64      # raw ids past the table
    np.savez(tmp_path / "batch.npz", **flatten_by_path(jax.tree.map(np.asarray, shards[0])))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    r = subprocess.run([sys.executable, "-c", _FRESH, out, str(tmp_path / "batch.npz"),
                        str(tmp_path / "p.npy")], capture_output=True, text=True, timeout=300,
                       cwd=ROOT, env={**env, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0, r.stderr[-3000:]
    np.testing.assert_allclose(np.load(tmp_path / "p.npy"), want["fresh"], rtol=0, atol=1e-6)

    # SIGTERM after window 0's checkpoint, then a resume: the same member runs
    def stop_after_first(line):
        if line.startswith("[online] window 0:"):
            os.kill(os.getpid(), signal.SIGTERM)
    try:
        run_online(cfg, stop_dir, spec, mesh=_mesh(), log=stop_after_first)
        raise AssertionError("the SIGTERM did not stop the run")
    except Interrupted as e:
        assert e.signum == signal.SIGTERM
    run_online(cfg, stop_dir, spec, mesh=_mesh(), log=lambda s: None)
    for n in ("fresh", "frozen"):
        a, b = member_dir(ref_dir, n), member_dir(stop_dir, n)
        assert json.load(open(os.path.join(a, "config.json"))) == json.load(open(os.path.join(b, "config.json")))
        (sa, ta, ma), (sb, tb, mb) = _member_state(a), _member_state(b)
        assert sa == sb and ma["admission"] == mb["admission"]
        assert jax.tree.structure(ta) == jax.tree.structure(tb)
        assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(ta), jax.tree.leaves(tb)))
