"""benchmarks/bench_sparse.py on CPU (tiny table): every row kind comes out, and the
bandwidth figures follow the byte accounting of its docstring."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_rows_and_bandwidth_accounting(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "benchmarks.bench_sparse",
                        "--vocab=20000", "--batch=64", "--ids_per_sample=5", "--dim=16",
                        "--variants=sort_buckets", "--naive_rows=5000", "--probe_rows=",
                        "--steps=2", f"--out={out}"], capture_output=True, text=True,
                       timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.load(open(out))["rows"]
    kinds = {x["kind"] for x in rows}
    assert {"step", "step_pipe", "lookup", "apply", "naive"} <= kinds
    n, d, acts = 64 * 5, 16, 64 * 16
    for x in rows:
        if x["kind"] not in ("step", "step_pipe", "naive"):
            continue
        u, t = x["unique_ids"], x["ms"] * 1e-3
        assert 0 < u <= n and x["ids"] == n
        per_id = 4 * n * d + 4 * acts + 2 * n * (4 * d + 4) + 4 * acts
        unique = 4 * u * d + 2 * u * (4 * d + 4)
        assert x["per_id_TBps"] == pytest.approx(per_id / t / 1e12, rel=1e-9)
        assert x["unique_TBps"] == pytest.approx(unique / t / 1e12, rel=1e-9)
        assert x["per_id_frac_hbm"] == pytest.approx(x["per_id_TBps"] / 3.6, rel=1e-9)
    assert "step_pipe" in r.stdout and "per-id TB/s" in r.stdout
