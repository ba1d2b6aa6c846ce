"""python -m experiments.movielens, the MovieLens-1M retrieval wrapper over the trainer, on the
fake MovieLens of tests/test_converters.py: conversion reused only when it holds the
same data, the step count from the epochs, and one whole run (convert, train, table)
whose printed figures are the run's summary.json. The script's commands run one after
another in one child process (tests/script_commands.py), each with the flags of its own
command line."""

import json
import os

import pyarrow.parquet as pq
import pytest

from tests.script_commands import run_commands
from tests.test_converters import write_ml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from experiments import movielens as mlx  # noqa: E402


def test_conversion_is_reused_only_for_the_same_users_and_steps_follow_epochs(tmp_path):
    src = tmp_path / "ml-1m"
    src.mkdir()
    write_ml(src)
    out, lines = tmp_path / "conv", []
    d = mlx.ensure_converted(str(src), str(out), log=lines.append)
    assert mlx.ensure_converted(str(src), str(out), log=lines.append) == d
    mlx.ensure_converted(str(src), str(out), max_users=3, log=lines.append)     # other users
    assert [ln.split()[1] for ln in lines] == ["converting", "reusing", "converting"]
    assert json.load(open(os.path.join(d, "counts.json")))["users"] == 3
    cfg = mlx.build_config(d, epochs=5, eval_epochs=2, seed=4,
                           override="data.batch_size=2,model.dim=8")
    rows = json.load(open(os.path.join(d, "counts.json")))["splits"]["train"]["rows"]
    per_epoch = -(-rows // 2)
    assert (cfg.train.steps, cfg.train.eval_every, cfg.train.log_every, cfg.train.seed) == \
        (5 * per_epoch, 2 * per_epoch, per_epoch, 4)
    assert cfg.model.kind == "retrieval" and cfg.model.dim == 8
    assert cfg.data.train_path == os.path.join(d, "train.parquet")
    assert cfg.train.steps_per_call == 1
    one_epoch = mlx.build_config(d, epochs=5, eval_epochs=2, seed=4, steps_per_call=0,
                                 override="data.batch_size=2,model.dim=8")
    assert one_epoch.train.steps_per_call == per_epoch
    with pytest.raises(ValueError, match=rf"--steps_per_call={per_epoch + 1} must divide the "
                                         rf"{per_epoch} steps of an epoch"):
        mlx.build_config(d, epochs=5, eval_epochs=2, seed=4, steps_per_call=per_epoch + 1,
                         override="data.batch_size=2,model.dim=8")


COMMANDS = {   # name -> the command's flags but --data_dir, --data_out and --workdir
    "novalid": ["--epochs=2", "--eval_epochs=1", "--novalid",
                "--override=data.batch_size=4,model.dim=8,train.tensorboard=false"],
    "seeds": ["--epochs=2", "--eval_epochs=1", "--seeds=0,1", "--patience=2", "--refit",
              "--steps_per_call=0",
              "--preset=movielens_hstu_large",
              "--override=data.batch_size=4,model.dim=8,model.seq_layers=1,"
              "model.retrieval_negatives=8,train.tensorboard=false"],
}

class Command:
    """One command of the shared child: its temporary directory, the child's exit code and
    stderr, and the command's own stdout."""

    def __init__(self, tmp_path, returncode, stdout, stderr):
        self.tmp_path, self.returncode = tmp_path, returncode
        self.stdout, self.stderr = stdout, stderr


@pytest.fixture(scope="module")
def commands(tmp_path_factory):
    """{name: Command} of COMMANDS (the last only where the trainer selects), run in order
    in one child process, each on its own fake MovieLens (TMP/ml-1m) into TMP/conv, TMP/run."""
    names = [n for n in COMMANDS if n != "seeds" or mlx.has_selection()]
    tmp, spec = {}, []
    for name in names:
        tmp[name] = tmp_path_factory.mktemp(name)
        src = tmp[name] / "ml-1m"
        src.mkdir()
        write_ml(src)
        spec.append([name, [f"--data_dir={src}", f"--data_out={tmp[name] / 'conv'}",
                            f"--workdir={tmp[name] / 'run'}", *COMMANDS[name]]])
    code, said, stderr = run_commands("movielens", "main", spec, cwd=ROOT)
    return {name: Command(tmp[name], code, said.get(name, ""), stderr) for name in names}


def test_movielens_script_converts_trains_and_prints_the_summary_figures(commands):
    r = commands["novalid"]
    wd = r.tmp_path / "run"
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.load(open(wd / "summary.json"))
    evals = [json.loads(ln) for ln in open(wd / "metrics.jsonl") if '"eval"' in ln]
    assert len(evals) == 2 and evals[-1]["rows"] == 5
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("gemjax (history excluded)")]
    figures = [float(x) for x in line.split()[3:6]]
    want = [summary["eval_hr@10"], summary["eval_ndcg@10"], summary["eval_hr@50"]]
    assert figures == [round(x, 4) for x in want]
    assert want == [evals[-1]["hr@10"], evals[-1]["ndcg@10"], evals[-1]["hr@50"]]
    assert "HSTU (published)" in r.stdout and "[movielens] converting" in r.stdout
    assert summary["eval_hr@10"] <= summary["eval_hr@50"] <= summary["eval_hr@200"]
    assert 0 < summary["eval_mrr"] <= 1


@pytest.mark.skipif(not mlx.has_selection(), reason="the trainer has no model selection yet")
def test_movielens_selects_on_validation_over_two_seeds_and_refits(commands):
    """--valid (the default): valid.parquet written, validation rows every epoch, the test
    figures of each seed's best step, mean +- std over --seeds, and the refit run on the
    valid rows."""
    r = commands["seeds"]
    wd = r.tmp_path / "run"
    assert r.returncode == 0, r.stderr[-3000:]
    assert os.path.exists(r.tmp_path / "conv" / "retrieval" / "valid.parquet")
    for s in (0, 1):
        summary = json.load(open(wd / f"seed{s}" / "summary.json"))
        sel = summary["selection"]
        assert sel["metric"] == "ndcg@10" and sel["best_step"] >= 1
        rows = [json.loads(ln) for ln in open(wd / f"seed{s}" / "metrics.jsonl")]
        valid = [x for x in rows if x.get("split") == "valid"]
        assert valid and max(x["ndcg@10"] for x in valid) == sel["best_value"]
        assert os.path.exists(wd / f"seed{s}" / "refit" / "summary.json")
        # --refit_rows=valid (the default): the valid rows alone, which are the --novalid
        # command's train rows (the same fake MovieLens): each train row extended by item L-1
        refit_data = wd / f"seed{s}" / "refit" / "data"
        assert os.listdir(refit_data) == ["valid-00000.parquet"]
        novalid_train = commands["novalid"].tmp_path / "conv" / "retrieval" / "train.parquet"
        assert pq.read_table(refit_data / "valid-00000.parquet").equals(
            pq.read_table(novalid_train))
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("gemjax mean +- std (2)")]
    assert len(lines) == 2 and "refit over seeds" in r.stdout          # the runs, the refits
    assert all(ln.count("+-") == 1 + len(mlx.COLUMNS) for ln in lines)
