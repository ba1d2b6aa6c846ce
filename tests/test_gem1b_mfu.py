"""summary.json's efficiency figures (e2e_mfu, model FLOPs per step, host wait, peak
memory) and metrics.jsonl's rank loads: present and consistent on a tiny teacher run
with BBS on 2 devices, 2 steps per call and a given peak; HostWait's arithmetic on a fake clock."""

import json
import os

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from gemjax.config import apply_overrides, get_config
from gemjax.data.feeding import concat_shards
from gemjax.data import balance
from gemjax.perf.model_flops import batch_step_flops
from gemjax.train import tracking
from gemjax.train.loop import train

CFG = apply_overrides(get_config("tiny"), ",".join((
    "model.kind=teacher,model.interformer_layers=1,model.pyramid_levels=8:none:1",
    "model.cls_tokens=0,model.pma_tokens=0,model.recent_tokens=1",
    "data.bbs=true,data.bbs_sub_batch=8,train.steps=6,train.log_every=2,train.eval_every=6",
    "train.checkpoint_every=6,train.tensorboard=false,train.steps_per_call=2")))
PEAK = 2.5e9      # a made-up per-device peak: CPU has none in the table


@pytest.fixture(scope="module")
def summary(tmp_path_factory):
    wd = str(tmp_path_factory.mktemp("mfu") / "run")
    mesh = Mesh(np.array(jax.devices()[:2]), ("batch",))
    out = train(CFG, wd, log=lambda s: None, mesh=mesh, peak_flops=PEAK)
    with open(os.path.join(wd, "summary.json")) as f:
        assert json.load(f) == json.loads(json.dumps(out))
    rows = [json.loads(line) for line in open(os.path.join(wd, "metrics.jsonl"))]
    return out, rows


def test_summary_efficiency_fields_are_consistent(summary):
    s, _ = summary
    # the analytic count, here from the stream's batches of 2 shards concatenated (another path)
    stream = balance.train_source(CFG)
    want = np.mean([batch_step_flops(CFG, concat_shards([stream.shard_batch(step, i, 2)[0]
                                                         for i in range(2)]), 2)
                    for step in (0, 1)])
    assert s["model_flops_per_step"] == pytest.approx(want, rel=1e-12) and want > 0
    assert s["peak_flops_per_device"] == PEAK
    assert s["e2e_mfu"] == pytest.approx(want / s["step_time_s"] / (2 * PEAK), rel=1e-9)
    assert 0 <= s["host_wait_s"] <= s["step_time_s"]
    assert s["host_wait_share"] == pytest.approx(s["host_wait_s"] / s["step_time_s"])
    assert s["peak_memory_bytes"] is None          # CPU keeps no memory statistics


def test_train_rows_hold_the_rank_loads_of_their_steps(summary):
    _, rows = summary
    src = balance.train_source(CFG)
    trains = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in trains] == [2, 4, 6]
    for r in trains:
        per_step = []
        for step in (r["step"] - 2, r["step"] - 1):
            loads = [balance.shard_load(src.shard_batch(step, i, 2)[0]) for i in range(2)]
            per_step.append([balance.load_ratio([x[k] for x in loads]) for k in (0, 1)])
        per_step = np.array(per_step)
        assert r["load_tokens_max_over_mean"] == pytest.approx(per_step[:, 0].mean())
        assert r["load_pairs_max_over_mean"] == pytest.approx(per_step[:, 1].mean())
        assert r["load_pairs_max_over_mean_worst"] == pytest.approx(per_step[:, 1].max())
        assert 1.0 <= r["load_tokens_max_over_mean"] < 1.2
        ranks = [[balance.shard_load(src.shard_batch(step, i, 2)[0])[0] for i in range(2)]
                 for step in (r["step"] - 2, r["step"] - 1)]
        assert r["load_tokens_per_rank"] == pytest.approx(np.mean(ranks, axis=0).tolist())


def test_without_a_peak_on_cpu_mfu_is_none():
    s = tracking.efficiency(0.5, 1e12, None, 8, 0.1, None)
    assert s["e2e_mfu"] is None and s["model_flops_per_step"] == 1e12
    assert s["host_wait_share"] == pytest.approx(0.2)
    s = tracking.efficiency(0.5, None, 989e12, 1, None, 123)   # a model the count does not cover
    assert s["e2e_mfu"] is None and s["host_wait_share"] is None and s["peak_memory_bytes"] == 123


def test_host_wait_counts_the_blocked_time_after_the_first_log_point():
    now = [0.0]
    waits = tracking.HostWait(clock=lambda: now[0])

    def feed():
        for step in range(6):
            now[0] += 3.0 if step < 2 else 0.5     # blocked this long on each next()
            yield step

    for step in waits.timed(feed()):
        now[0] += 1.0                              # the step itself
        if (step + 1) % 2 == 0:
            waits.log_point(step + 1)
    assert waits.seconds == pytest.approx(2 * 3.0 + 4 * 0.5)
    assert waits.steady_per_step == pytest.approx(0.5)     # steps 3..6, after the first log point
    assert tracking.HostWait().steady_per_step is None


def test_local_mfu_command_reports_each_block_and_the_weighted_mean(monkeypatch, capsys, tmp_path):
    """python -m gemjax.perf.local_mfu: flag errors name the flag; the printed Local MFU is the
    FLOP-weighted mean of the MFUs of the blocks `measure` returns (measure itself is stubbed: timing every
    teacher block costs a minute of CPU)."""
    import json as _json

    import pytest as _pytest

    from gemjax.perf import local_mfu, mfu

    for argv, msg in ((["--config=tiny"], "model.kind must be teacher"),
                      (["--config=tiny", "--override=model.kind=teacher", "--iters=0"], "--iters"),
                      (["--config=tiny", "--override=model.kind=teacher"], "--peak_flops")):
        with _pytest.raises(SystemExit):
            local_mfu.main(argv)
        assert msg in capsys.readouterr().err
    rows = [("a", 2e9, 1.0), ("b", 6e9, 4.0)]

    def fake_measure(cfg, batch, peak, **kw):
        assert cfg.model.kind == "teacher" and batch.batch_size == cfg.data.batch_size
        layers = [{"name": n, "flops": f, "seconds": s, "mfu": f / (s * peak)} for n, f, s in rows]
        return {"layers": layers, "local_mfu": mfu.local_mfu([f for _, f, _ in rows],
                                                             [s for _, _, s in rows], peak)}

    monkeypatch.setattr(local_mfu, "measure", fake_measure)
    out = tmp_path / "local.json"
    local_mfu.main(["--config=tiny", "--override=model.kind=teacher", "--peak_flops=1e10",
                    f"--json={out}"])
    text = capsys.readouterr().out
    # GEM's Local MFU: the blocks' MFUs weighted by their FLOPs (0.2 and 0.15 here)
    want = (2e9 * 2e9 / (1.0 * 1e10) + 6e9 * 6e9 / (4.0 * 1e10)) / (2e9 + 6e9)
    assert f"Local MFU {want:.4f} over 2 blocks" in text
    assert _json.load(open(out))["local_mfu"] == _pytest.approx(want)
