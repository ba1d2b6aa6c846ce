"""Faults under the readers of a run (gemjax.serve): an export killed while it replaces
an earlier one, a damaged export, and a damaged, unverified or vanishing newest
checkpoint under load_for_inference / export_model / restore.

One tiny run (6 steps, checkpoints 3 and 6) is trained once; each test damages a copy.
The references are independent: the files of the earlier export byte for byte, and
the arrays of checkpoint 3 read straight from a Checkpointer of the intact copy.
"""

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from gemjax.config import apply_overrides, get_config
from gemjax.serve.export import FILES, ExportDamaged, export_model, load_exported
from gemjax.serve.inference import load_for_inference
from gemjax.serve.restore import restore
from gemjax.train.checkpoint import (CheckpointDamaged, Checkpointer, newest_intact,
                                     restore_train_state)
from gemjax.train.loop import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = apply_overrides(get_config("tiny"), "train.steps=6,train.log_every=3,train.eval_every=6,"
                                          "train.checkpoint_every=3,data.eval_batches=1")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("fault_serve") / "run")
    train(CFG, workdir, log=lambda s: None, mesh=Mesh(np.array(jax.devices()[:1]), ("batch",)))
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["3", "6"]
    return workdir


def _copy(run, tmp_path) -> str:
    workdir = str(tmp_path / "run")
    shutil.copytree(run, workdir)
    return workdir


def _files(d):
    return {n: open(os.path.join(d, n), "rb").read() for n in sorted(os.listdir(d))}


@functools.cache
def _params_of(workdir, step):
    """The dense params of checkpoint `step`, read without the serve code (once per step of
    the intact run: the tests read them, never write)."""
    from gemjax.train.step import Trainer
    trainer = Trainer.create(CFG, Mesh(np.array(jax.devices()[:1]), ("batch",)))
    with Checkpointer(os.path.join(workdir, "checkpoints"), read_only=True) as ckpt:
        _, state, _ = restore_train_state(ckpt, trainer.coll, trainer.init_state(0), step)
    return [np.asarray(x) for x in jax.tree.leaves(state["params"])]


def test_export_killed_mid_replace_leaves_the_earlier_export_whole(run, tmp_path):
    out = str(tmp_path / "export")
    export_model(run, out, step=3, log=lambda s: None)
    before = _files(out)
    assert "checksums.sha256" in before and set(FILES.values()) < set(before)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               GEMJAX_TEST_PAUSE="export:swap")
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from gemjax.serve.export import export_model; "
                               "export_model(sys.argv[1], sys.argv[2], step=6)", run, out],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:                  # every file of step 6 written, not yet in place
        lines.append(line)
        if "test pause at export swap" in line:
            break
    proc.kill()
    assert proc.wait(60) == -signal.SIGKILL, "".join(lines)[-3000:]
    assert _files(out) == before             # the earlier export, byte for byte
    assert load_exported(out).manifest["step"] == 3
    leftover = [n for n in os.listdir(tmp_path) if n.startswith(".export.tmp-")]
    assert len(leftover) == 1                # the killed export's own directory, beside it

    export_model(run, out, step=6, log=lambda s: None)   # replaces it whole, cleans up
    assert load_exported(out).manifest["step"] == 6
    assert sorted(os.listdir(tmp_path)) == ["export"]
    want = _params_of(run, 6)
    got = load_exported(out).params
    assert len(got) == len(want) and sum(a.size for a in got.values()) == sum(a.size for a in want)


def test_damaged_export_is_refused_naming_the_file(run, tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    export_model(run, a, step=3, log=lambda s: None)
    export_model(run, b, step=6, log=lambda s: None)
    shutil.copy(os.path.join(b, "params.npz"), os.path.join(a, "params.npz"))  # step 6 arrays
    with pytest.raises(ExportDamaged, match=r"export .*/a is damaged: file params.npz does not "
                                            r"match its checksum"):
        load_exported(a)
    shutil.copy(os.path.join(b, "params.npz"), os.path.join(tmp_path, "params.npz"))
    os.remove(os.path.join(b, "model.stablehlo"))
    with pytest.raises(ExportDamaged, match="file model.stablehlo is missing"):
        load_exported(b)
    with open(os.path.join(b, "model.stablehlo"), "wb") as f:
        f.write(b"x")
    open(os.path.join(b, "notes.txt"), "w").write("x")
    with pytest.raises(ExportDamaged, match="does not match|unexpected files"):
        load_exported(b)
    os.remove(os.path.join(a, "checksums.sha256"))
    with pytest.raises(ExportDamaged, match=r"a/checksums.sha256: no such file"):
        load_exported(a)
    assert load_exported(a, verify=False).manifest["step"] == 3     # trusted when asked
    with pytest.raises(FileExistsError, match="is not an earlier export .*'notes.txt'"):
        export_model(run, b, log=lambda s: None)                    # never replaces other files
    assert os.path.exists(os.path.join(b, "notes.txt"))


def _damage_meta(step_dir):
    path = os.path.join(step_dir, "meta", "metadata")
    with open(path, "w") as f:
        f.write("{not json")


DAMAGE = {   # damage to checkpoint 6, what the skip line says
    "empty_step_dir": (lambda d: (shutil.rmtree(d), os.makedirs(d)), "empty step directory"),
    "garbage_meta": (_damage_meta, "file meta/metadata does not match its checksum"),
    "no_checksums": (lambda d: os.remove(os.path.join(d, "checksums.sha256")),
                     "6/checksums.sha256 is missing, so its files cannot be verified"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_readers_fall_back_past_a_damaged_newest_step(run, tmp_path, capsys, damage):
    workdir = _copy(run, tmp_path)
    hurt, says = DAMAGE[damage]
    hurt(os.path.join(workdir, "checkpoints", "6"))
    want = _params_of(run, 3)
    pred = load_for_inference(workdir)
    assert pred.step == 3
    for got, ref in zip(jax.tree.leaves(pred.state["params"]), want):
        np.testing.assert_array_equal(np.asarray(got), ref)
    out = capsys.readouterr().out
    assert f"checkpoint step 6 skipped ({workdir}/checkpoints/6): " in out and says in out, out
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["3", "6"]   # nothing moved
    if damage == "no_checksums":      # accepted when the run's config says so
        assert restore(workdir, overrides="train.trust_unverified_checkpoints=true").step == 6
    if damage == "garbage_meta":      # export: the same fallback, the step it used recorded
        out_dir = export_model(workdir, str(tmp_path / "export"), log=lambda s: None)
        assert json.load(open(os.path.join(out_dir, "manifest.json")))["step"] == 3


def test_readers_refuse_when_no_step_is_intact_naming_each(run, tmp_path):
    workdir = _copy(run, tmp_path)
    os.remove(os.path.join(workdir, "checkpoints", "6", "checksums.sha256"))
    _damage_meta(os.path.join(workdir, "checkpoints", "3"))
    with pytest.raises(CheckpointDamaged, match=r"no intact checkpoint in .*checkpoints: step 6: "
                                                r".*6/checksums.sha256 is missing.*; step 3: file "
                                                r"meta/metadata does not match its checksum"):
        load_for_inference(workdir)
    with pytest.raises(CheckpointDamaged, match=r"step 3 .*meta/metadata does not match"):
        restore(workdir, step=3)


def test_a_step_rotated_away_while_read_is_listed_again(run, tmp_path):
    """A training's keep-N rotation deletes the newest listed step while a reader reads
    it: the reader lists again and reads what is there (not a FileNotFoundError)."""
    workdir = _copy(run, tmp_path)
    checkpoints = os.path.join(workdir, "checkpoints")
    from gemjax.train.step import Trainer
    trainer = Trainer.create(CFG, Mesh(np.array(jax.devices()[:1]), ("batch",)))
    reads, logged = [], []

    def read(step):
        reads.append(step)
        if step == 6:                     # rotated away mid-read
            shutil.rmtree(os.path.join(checkpoints, "6"))
        return restore_train_state(ckpt, trainer.coll, trainer.init_state(0), step)

    with Checkpointer(checkpoints, read_only=True) as ckpt:
        step, (_, state, _) = newest_intact(ckpt, read, log=logged.append)
    assert step == 3 and reads == [6, 3], (reads, logged)
    assert any("checkpoint step 6 left" in s and "listing the steps again" in s for s in logged)
    for got, ref in zip(jax.tree.leaves(state["params"]), _params_of(run, 3)):
        np.testing.assert_array_equal(np.asarray(got), ref)
