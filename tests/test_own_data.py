"""A user's own Parquet files through the real trainer: the README's "Train on your own
data" example run as written, an exact resume on a Parquet source through train(), and
one step of every source (synthetic, Parquet shuffled, Parquet in file order) through one
Trainer, checked against the synthetic batch the files were written from."""

import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from jax.sharding import Mesh

from gemjax.config import apply_overrides, config_from_dict, get_config
from gemjax.features import EventField, FeatureSchema, SequenceFeature, SparseFeature, Table
from gemjax.data.parquet import columns_from_schema, sequence_column
from gemjax.data.source import OneEpoch, capacity_of, make_source

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTION = "## Train on your own data"


def _section() -> str:
    text = open(os.path.join(ROOT, "README.md")).read()
    start = text.index(SECTION)
    end = text.index("\n## ", start + len(SECTION))
    return text[start:end]


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "GEMJAX_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    if jax.config.jax_compilation_cache_dir:     # the suite's cache: a warm rerun skips compiles
        env["JAX_COMPILATION_CACHE_DIR"] = jax.config.jax_compilation_cache_dir
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.5"
    return env


def test_readme_example_trains_the_gem_model_on_its_parquet_files(tmp_path):
    section = _section()
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)
    (block,) = re.findall(r"```bash\n(.*?)```", section, re.S)
    cmd = " ".join(block.replace("\\\n", " ").split())
    words = shlex.split(cmd)
    assert words[:2] == ["./run", "train"]
    from tests.test_readme_commands import RUN, readme_commands
    assert cmd in RUN and cmd in readme_commands(open(os.path.join(ROOT, "README.md")).read())

    (tmp_path / "write_data.py").write_text(code)
    r = subprocess.run([sys.executable, "write_data.py"], cwd=tmp_path, env=_env(), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run([sys.executable, "-m", "experiments.train"] + words[2:],
                       cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{cmd}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    out = r.stdout
    assert "[eval] step 200: NE" in out and "Bayes" not in out and "bayes-optimal" not in out, out[-2000:]

    wd = tmp_path / "runs" / "own"
    summary = json.load(open(wd / "summary.json"))
    rows = [json.loads(ln) for ln in open(wd / "metrics.jsonl")]
    evals = [x for x in rows if x["kind"] == "eval"]
    assert summary["steps"] == 200 and summary["bayes_ne"] is None and summary["bayes_auc"] is None
    assert [x["step"] for x in evals] == [100, 200] and all(x["bayes_ne"] is None for x in evals)
    assert evals[-1]["count"] == 2000     # every eval row once: 63 batches of 32, the last one part masked

    # the README's figures: the run's, and those of the generating probabilities
    quoted = re.search(r"eval AUC ([\d.]+) and NE ([\d.]+) \(the generating\s+probabilities "
                       r"themselves score AUC ([\d.]+), NE ([\d.]+)", section)
    auc, ne, oracle_auc, oracle_ne = (float(x) for x in quoted.groups())
    assert abs(summary["eval_auc"] - auc) < 0.02 and abs(summary["eval_ne"] - ne) < 0.02, summary
    ev = pq.read_table(tmp_path / "data" / "own" / "eval.parquet").to_pydict()
    user, item, price = (np.asarray(ev[c]) for c in ("user", "item", "price"))
    logit = 2.5 * (item % 4 == user % 4) + 1.5 * (item < 50) - 1.5 - 2.0 * price
    from gemjax.train.metrics import binary_metrics
    best = binary_metrics(np.asarray(ev["click"]), 1 / (1 + np.exp(-logit)), np.ones(len(item)))
    assert round(best["auc"], 3) == oracle_auc and round(best["ne"], 3) == oracle_ne, best
    assert 0.6 < summary["eval_auc"] < best["auc"]

    # the schema file is the run's schema; histories past max_len (16 of up to 23) are counted
    schema = FeatureSchema.from_dict(json.load(open(tmp_path / "data" / "own" / "schema.json")))
    cfg = config_from_dict(json.load(open(wd / "config.json")))
    assert cfg.features == schema and cfg.data.source == "parquet" and cfg.data.eval_batches == 0
    trains = [x for x in rows if x["kind"] == "train"]
    assert trains[-1]["seq_truncated_to_cap"] > 0
    assert all(trains[-1][k] == 0 for k in ("ids_clamped", "ids_hashed", "nan_filled"))


# ------------------------------------------------------------------------- a small log of our own

SCHEMA = FeatureSchema(
    tables=(Table("user", 50), Table("item", 40, bounds="clamp")),
    sparse=(SparseFeature("user", "user"), SparseFeature("item", "item")),
    dense=("price",),
    sequences=(SequenceFeature("history", (EventField("item", "item"),), max_len=8),),
    tasks=("click",))


def _write_log(path, n, seed, bad_ids=0, lengths=None, row_group_size=25):
    """n rows of SCHEMA's columns in row groups of `row_group_size` (the first `bad_ids`
    items are 40: beyond table item, clamped); lengths: (rng, n) -> [n] history lengths
    (None: uniform in [0, 12))."""
    rng = np.random.default_rng(seed)
    user, item = rng.integers(0, 50, n), rng.integers(0, 40, n)
    item[:bad_ids] = 40
    lengths = rng.integers(0, 12, n) if lengths is None else lengths(rng, n)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    history = pa.ListArray.from_arrays(offsets, rng.integers(0, 40, offsets[-1]))
    click = (rng.random(n) < 1 / (1 + np.exp(-((item % 3 == user % 3) * 2.0 - 1.0)))).astype(np.float32)
    table = pa.table({"user": user, "item": item, "price": rng.random(n).astype(np.float32),
                      sequence_column("history", "item"): history, "click": click})
    pq.write_table(table, path, row_group_size=row_group_size)


def _own_config(tmp_path, order="shuffle"):
    os.makedirs(tmp_path / "data", exist_ok=True)
    _write_log(tmp_path / "data" / "train.parquet", 200, 0, bad_ids=3)
    _write_log(tmp_path / "data" / "eval.parquet", 70, 1)
    cfg = dataclasses.replace(get_config("tiny"), features=SCHEMA)
    return apply_overrides(cfg, {
        "data.source": "parquet", "data.train_path": str(tmp_path / "data" / "train.parquet"),
        "data.eval_path": str(tmp_path / "data" / "eval.parquet"), "data.order": order,
        "data.shuffle_window": "16", "data.batch_size": "32", "data.eval_batches": "0",
        "train.steps": "8", "train.log_every": "2", "train.eval_every": "4",
        "train.checkpoint_every": "2", "train.tensorboard": "false"})


def whole_and_resumed(cfg, tmp_path, mesh, stop_after: int):
    """train(cfg) uninterrupted in tmp_path/whole, and in tmp_path/cut stopped after step
    `stop_after` then resumed. Returns (whole summary, resumed summary, whole's
    metrics.jsonl rows, cut's rows), the rows without their timing fields."""
    from gemjax.train.loop import train
    quiet = lambda s: None  # noqa: E731
    whole = train(cfg, str(tmp_path / "whole"), log=quiet, mesh=mesh)
    assert train(cfg, str(tmp_path / "cut"), log=quiet, mesh=mesh, stop_after=stop_after)["stopped_early"]
    resumed = train(cfg, str(tmp_path / "cut"), log=quiet, mesh=mesh)
    timing = ("samples_per_sec", "tokens_per_sec")

    def rows(wd):
        return [{k: v for k, v in json.loads(ln).items() if k not in timing}
                for ln in open(tmp_path / wd / "metrics.jsonl")]

    return whole, resumed, rows("whole"), rows("cut")


def test_resume_on_a_parquet_source_equals_the_uninterrupted_run(tmp_path):
    """The logistic regression (model.kind=lr: the same loop, the same Parquet feed of every
    sparse, dense and sequence column; its programs compile in about half the GEM model's
    time) stopped after step 4 and resumed: every metrics.jsonl row, the summary's figures
    and an eval-only pass on the finished run equal the uninterrupted run's."""
    cfg = apply_overrides(_own_config(tmp_path), {"model.kind": "lr"})
    mesh = Mesh(np.array(jax.devices()[:1]), ("batch",))   # 200 rows, 32 a step: step 6 starts epoch 1
    whole, resumed, a, b = whole_and_resumed(cfg, tmp_path, mesh, stop_after=4)
    assert [(r["step"], r["kind"]) for r in a] == [(2, "train"), (4, "train"), (4, "eval"), (6, "train"),
                                                    (8, "train"), (8, "eval")]
    assert a == b                                  # every loss, NE, AUC and counter, bit for bit
    for k in ("eval_ne", "eval_auc", "eval_calibration", "seq_truncated_to_cap", "ids_clamped"):
        assert whole[k] == resumed[k], k
    assert whole["bayes_ne"] is None and a[-1]["count"] == 70
    # the repaired ids are counted: rows 0-2 hold item 40; the 256 rows served hold each
    # of them once or twice (epoch 1 serves 56 rows of another permutation)
    assert 3 <= a[-2]["ids_clamped"] <= 6
    # eval-only on the finished run (no Bayes figure for a file source) reproduces its last eval
    from gemjax.serve.evaluate import evaluate_checkpoint
    lines = []
    row = evaluate_checkpoint(str(tmp_path / "whole"), None, mesh, log=lines.append)
    assert row["step"] == 8 and row["bayes_ne"] is None and "Bayes" not in lines[-1]
    assert (row["ne"], row["auc"], row["count"]) == (a[-1]["ne"], a[-1]["auc"], a[-1]["count"])


def test_parquet_config_errors_name_the_field_or_file(tmp_path):
    cfg = _own_config(tmp_path)
    with pytest.raises(ValueError, match="data.source=parquet needs the feature schema"):
        apply_overrides(get_config("tiny"), "data.source=parquet,data.train_path=x,data.eval_path=y")
    with pytest.raises(ValueError, match="data.source=parquet needs data.eval_path"):
        apply_overrides(cfg, "data.eval_path=")
    with pytest.raises(ValueError, match="data.order must be shuffle or time, got 'random'"):
        apply_overrides(cfg, "data.order=random")
    with pytest.raises(ValueError, match="data.source must be one of synthetic, parquet, got 'csv'"):
        apply_overrides(cfg, "data.source=csv")
    missing = apply_overrides(cfg, f"data.train_path={tmp_path}/nothing/*.parquet")
    with pytest.raises(FileNotFoundError,
                       match=r"data.train_path=.*nothing/\*.parquet: parquet: no files match"):
        make_source(missing)
    renamed = dataclasses.replace(cfg, features=dataclasses.replace(SCHEMA, dense=("cost",)))
    with pytest.raises(ValueError, match=r"data.train_path=.*train.parquet: parquet: .*train.parquet: "
                                         r"column 'cost' is missing"):
        make_source(renamed)
    pooled = dataclasses.replace(SCHEMA, tables=(Table("user", 50, pooling="sum"), SCHEMA.tables[1]))
    with pytest.raises(ValueError, match=r"tables \['user'\] are pooled"):
        columns_from_schema(pooled)
    ev = make_source(cfg, "eval")
    assert isinstance(ev, OneEpoch) and ev.num_steps == 3            # 70 rows, 32 a step
    batch, _ = ev.shard_batch(2, 0, 1)
    assert batch.label_mask.sum() == 70 - 64 and batch.weights.sum() == 70 - 64


# ------------------------------------------------------- one step of every source through one Trainer

@pytest.fixture(scope="module")
def one_trainer(tmp_path_factory):
    """(cfg, Trainer, its train step, synthetic batch 0 written as a Parquet file of the
    synthetic schema's columns, the step's loss on that synthetic batch).

    data.capacity_slack=1.05 gives every source the same packed buffers (384 tokens per
    sequence: the synthetic stream's expected length, and the files' 7.9 / 11.0 mean
    events per row, each above the 254 / 351 tokens batch 0 holds), so every source
    runs the one compiled step. The model is the logistic regression (model.kind=lr): it
    looks up every sparse feature and sequence field and reads the dense features and labels,
    so the loss depends on every column a source serves."""
    from gemjax.data.synthetic import SyntheticStream, synthetic_schema
    from gemjax.train.step import Trainer
    cfg = apply_overrides(get_config("tiny"), "data.batch_size=32,data.capacity_slack=1.05,"
                                              "model.kind=lr")
    schema = synthetic_schema(cfg.data)
    ref, _ = SyntheticStream(cfg.data, cfg.train.seed).shard_batch(0, 0, 1)
    cols = columns_from_schema(schema)
    table = {c: ref.sparse[c] for c in cols.sparse}
    table.update({c: ref.dense[:, k] for k, c in enumerate(cols.dense)})
    for s in cols.sequences:
        jag = ref.sequences[s.name]
        off = np.asarray(jag.offsets, np.int32)
        for field, column in s.fields:
            table[column] = pa.ListArray.from_arrays(off - off[0], jag.values[field][off[0]:off[-1]])
    for k, c in enumerate(cols.labels):
        table[c] = pa.array(np.where(ref.label_mask[:, k] > 0, ref.labels[:, k], np.nan),
                            from_pandas=True)
    table[cols.surface] = ref.surface
    path = tmp_path_factory.mktemp("synthetic_rows") / "rows.parquet"
    pq.write_table(pa.table(table), path, row_group_size=8)
    # the same rows in two files of a directory (rows 0-19, 20-31; sorted by path)
    os.makedirs(path.parent / "parts")
    for name, lo, hi in (("a.parquet", 0, 20), ("b.parquet", 20, 32)):
        pq.write_table(pa.table(table).slice(lo, hi - lo), path.parent / "parts" / name,
                       row_group_size=8)
    mesh = Mesh(np.array(jax.devices()[:1]), ("batch",))
    trainer = Trainer.create(cfg, mesh)
    step = trainer.make_train_step()
    return cfg, trainer, step, str(path), _first_loss(trainer, step, make_source(cfg, "train"))


def _first_loss(trainer, step, src) -> tuple[float, list]:
    """(loss of the trainer's first step on batch 0 of src, the batch's shard infos)."""
    from gemjax.data.feeding import Feeder
    feeder = Feeder(src.shard_batch, trainer.mesh, check_ids=trainer.coll.check_ids,
                    id_fields=trainer.id_fields)
    (_, batch, infos, _), = feeder.batches(0, 1)
    state = trainer.init_state(0)
    # the LR tables start at zero: random rows, so the loss reads every looked-up id
    rng = np.random.default_rng(0)
    tables = {t: {k: rng.normal(size=v.shape).astype(v.dtype) if k == "weights" else v
                  for k, v in arrays.items()}
              for t, arrays in trainer.coll.to_logical(state["tables"]).items()}
    state["tables"] = trainer.coll.from_logical(tables)
    _, m = step(state, batch)
    return float(m["loss"]), infos


SOURCES = {   # name: (data.source, path: file / directory of 2 files / glob, stream, data.order)
    "synthetic": ("synthetic", None, "train", None),
    "parquet-time": ("parquet", "file", "train", "time"),
    "parquet-shuffle": ("parquet", "file", "train", "shuffle"),
    "parquet-dir-time": ("parquet", "dir", "train", "time"),
    "parquet-glob-shuffle": ("parquet", "glob", "train", "shuffle"),
    "parquet-eval-one-epoch": ("parquet", "dir", "eval", None),   # OneEpoch, file order
}


@pytest.mark.parametrize("source", list(SOURCES))
def test_one_step_of_every_source_through_one_trainer(one_trainer, source):
    """The Parquet file (and the two files of a directory) hold synthetic batch 0; read in
    file order it is that batch, and shuffled a permutation of it, through every kind of
    source make_source builds (the synthetic stream, ParquetSource over a file, a
    directory or a glob in either order, the eval stream's OneEpoch): the same Trainer's
    first step has the same loss."""
    from gemjax.data.synthetic import synthetic_schema
    cfg, trainer, step, path, (ref_loss, _) = one_trainer
    kind, where, stream, order = SOURCES[source]
    if kind == "parquet":
        parts = os.path.join(os.path.dirname(path), "parts")
        files = {"file": path, "dir": parts, "glob": os.path.join(parts, "*.parquet")}[where]
        cfg = apply_overrides(dataclasses.replace(cfg, features=synthetic_schema(cfg.data)),
                              {"data.source": "parquet", "data.train_path": files,
                               "data.eval_path": files, "data.order": order or "shuffle",
                               "data.shuffle_window": "8", "data.eval_batches": "0"})
    src = make_source(cfg, stream)
    assert [capacity_of(src, 1, s) for s in ("clicks", "views")] == [384, 384]   # one program
    assert type(src).__name__ == {"synthetic": "SyntheticStream", "train": "ParquetSource",
                                  "eval": "OneEpoch"}[stream if kind == "parquet" else kind]
    loss, infos = _first_loss(trainer, step, src)
    if kind == "parquet":
        rows = np.concatenate([i.rows for i in infos])
        assert sorted(rows.tolist()) == list(range(32))            # every written row, once
        in_order = order in ("time", None)                         # eval: file order
        assert (rows.tolist() == list(range(32))) == in_order      # in file order, or shuffled
    # the reference: the synthetic batch 0's loss, the same samples through the same step
    assert np.isfinite(loss)
    np.testing.assert_allclose(loss, ref_loss, rtol=2e-6)


def test_on_converted_files_reads_the_schema_and_names_a_bad_one(tmp_path):
    from gemjax.config import on_converted_files
    from gemjax.presets import FRAPPE_SCHEMA
    with pytest.raises(FileNotFoundError, match="schema.json"):
        on_converted_files("frappe", str(tmp_path))
    (tmp_path / "schema.json").write_text(json.dumps({"tables": "nonsense"}))
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "schema.json"))):
        on_converted_files("frappe", str(tmp_path))
    (tmp_path / "schema.json").write_text(json.dumps(FRAPPE_SCHEMA.to_dict()))
    cfg = on_converted_files("frappe", str(tmp_path), "train.seed=3")
    assert cfg.features == FRAPPE_SCHEMA and cfg.train.seed == 3
    assert (cfg.data.train_path, cfg.data.eval_path) == (str(tmp_path / "train.parquet"),
                                                         str(tmp_path / "test.parquet"))
