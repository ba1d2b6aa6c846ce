"""CUDA-graph XLA flags: added on GPU only, never over a user's key, off by env var."""

import json
import os
import subprocess
import sys

import jax
import pytest

from gemjax.train import runtime

CMD_BUF = "--xla_gpu_enable_command_buffer=" + runtime.GRAPH_FLAGS["xla_gpu_enable_command_buffer"]


def test_with_graph_flags_keeps_the_users_keys():
    both = runtime.with_graph_flags("")
    assert both.split() == [CMD_BUF, "--xla_gpu_graph_min_graph_size=1"]
    mine = "--xla_gpu_graph_min_graph_size=7  --xla_dump_to=/tmp/x"
    assert runtime.with_graph_flags(mine).split() == mine.split() + [CMD_BUF]
    off = "--xla_gpu_enable_command_buffer= --xla_gpu_graph_min_graph_size"
    assert runtime.with_graph_flags(off) == off
    assert runtime.flag_keys(off) == {"xla_gpu_enable_command_buffer", "xla_gpu_graph_min_graph_size"}


def test_nothing_on_cpu(monkeypatch):
    assert jax.default_backend() == "cpu"
    monkeypatch.setattr(runtime, "_done", False)
    monkeypatch.delenv(runtime.ENV_GRAPHS, raising=False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/nonexistent")
    logged = []
    assert runtime.enable_gpu_graphs(logged.append) == ""
    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/nonexistent" and logged == []


# A fresh process, no device use: jax_platforms decides "on GPU" before the
# backend starts, so the GPU path runs here without a GPU.
_PROBE = """
import json, os, sys
import jax
from gemjax.train import runtime
out = []
for platforms, user, opt in json.loads(sys.argv[1]):
    runtime._done = False
    jax.config.update("jax_platforms", platforms or None)
    os.environ["XLA_FLAGS"] = user
    os.environ[runtime.ENV_GRAPHS] = opt
    logged = []
    added = runtime.enable_gpu_graphs(logged.append)
    runtime.enable_gpu_graphs(logged.append)           # a second call adds and logs nothing
    out.append([added, os.environ["XLA_FLAGS"], logged])
from jax._src import xla_bridge
out.append(xla_bridge.backends_are_initialized())
print(json.dumps(out))
"""


def test_added_on_gpu_before_the_backend_starts():
    cases = [("cuda", "", "1"), ("cpu", "", "1"), ("cuda", "--xla_gpu_graph_min_graph_size=3", "1"),
             ("cuda", "", "0"), ("cuda,cpu", CMD_BUF, "1"), ("", "", "1")]
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    res = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(cases)], env=env, check=True,
                         capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    out = json.loads(res.stdout.strip().splitlines()[-1])
    gpu, cpu, user, off, preset, auto = out[:6]
    assert gpu[0] and gpu[1].split() == [CMD_BUF, "--xla_gpu_graph_min_graph_size=1"]
    assert len(gpu[2]) == 1 and "GEMJAX_GPU_GRAPHS=0" in gpu[2][0] and CMD_BUF in gpu[2][0]
    assert cpu == ["", "", []]
    assert user[1].split() == ["--xla_gpu_graph_min_graph_size=3", CMD_BUF] and user[0] == CMD_BUF
    assert off == ["", "", []]
    assert preset[:2] == ["--xla_gpu_graph_min_graph_size=1", f"{CMD_BUF} --xla_gpu_graph_min_graph_size=1"]
    assert bool(auto[0]) == runtime._cuda_plugin_installed()    # platforms unset: the plugin decides
    assert out[6] is False      # deciding never started the backend


def test_bad_opt_out_value_is_named(monkeypatch):
    monkeypatch.setattr(runtime, "_done", False)
    monkeypatch.setenv(runtime.ENV_GRAPHS, "no")
    with pytest.raises(ValueError, match=runtime.ENV_GRAPHS):
        runtime.enable_gpu_graphs()


_FP8_PROBE = """
import json, os, sys
import jax
from gemjax.train import runtime
out = []
for platforms, user, precision in json.loads(sys.argv[1]):
    jax.config.update("jax_platforms", platforms or None)
    os.environ["XLA_FLAGS"] = user
    logged = []
    added = runtime.enable_fp8_gemm_flags(precision, logged.append)
    out.append([added, os.environ["XLA_FLAGS"], logged])
jax.config.update("jax_platforms", "cpu")
jax.devices()                                       # the backend starts: too late to add
os.environ["XLA_FLAGS"] = ""
logged = []
jax.config.update("jax_platforms", "cpu")
out.append([runtime.enable_fp8_gemm_flags("fp8", logged.append), logged])
print(json.dumps(out))
"""


def test_fp8_gemm_flags_on_gpu_for_fp8_only():
    """FP8 runs on GPU get Triton GEMMs off; BF16 runs, CPU runs and a user's own key do not."""
    off = "--xla_gpu_enable_triton_gemm=false"
    cases = [("cuda", "", "fp8"), ("cuda", "", "bf16"), ("cpu", "", "fp8"),
             ("cuda", "--xla_gpu_enable_triton_gemm=true", "fp8"),
             ("cuda", "--xla_dump_to=/tmp/d", "fp8")]
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    res = subprocess.run([sys.executable, "-c", _FP8_PROBE, json.dumps(cases)], env=env, check=True,
                         capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    gpu, bf16, cpu, user, other, late = json.loads(res.stdout.strip().splitlines()[-1])
    assert gpu[:2] == [off, off] and len(gpu[2]) == 1 and off in gpu[2][0]
    assert bf16 == ["", "", []] and cpu == ["", "", []]
    assert user == ["", "--xla_gpu_enable_triton_gemm=true", []]
    assert other[1].split() == ["--xla_dump_to=/tmp/d", off]
    assert late == ["", []]          # on CPU after the backend started: nothing, silently
