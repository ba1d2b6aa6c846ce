"""gemjax.train.runtime.enable_compile_cache: a program compiled once is loaded from the
directory by the next compile, in this process (after jax.clear_caches) and in a new one."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.compilation_cache import compilation_cache

from gemjax.train import runtime

HITS = "/jax/compilation_cache/cache_hits"


@pytest.fixture
def restore_cache():
    """Put JAX's cache settings back as they were after the test."""
    old = (jax.config.jax_compilation_cache_dir,
           jax.config.jax_persistent_cache_min_compile_time_secs)
    yield
    compilation_cache.reset_cache()
    jax.config.update("jax_compilation_cache_dir", old[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", old[1])


@pytest.fixture
def hits():
    """The cache-hit events JAX records during the test (the listener removed after)."""
    seen = []

    def listener(event, **_):
        if event == HITS:
            seen.append(event)

    jax.monitoring.register_event_listener(listener)
    yield seen
    jax.monitoring.unregister_event_listener(listener)


def _program(x):
    return jnp.sin(x) @ jnp.cos(x).T + 3.25


def test_second_compile_loads_the_stored_program(tmp_path, restore_cache, hits):
    path = runtime.enable_compile_cache(str(tmp_path / "cache"), min_compile_s=0, log=lambda s: None)
    assert path == str(tmp_path / "cache")
    x = jnp.arange(12.0).reshape(3, 4)
    want = jax.jit(_program)(x)
    stored = [f for f in os.listdir(path) if f.endswith("-cache")]
    assert stored, os.listdir(path)
    assert not hits
    jax.clear_caches()                            # drop the in-memory executables
    got = jax.jit(_program)(x)
    assert hits, "the second compile did not read the cache"
    assert jnp.array_equal(got, want)


def test_empty_path_leaves_the_cache_alone(restore_cache):
    before = jax.config.jax_compilation_cache_dir
    assert runtime.enable_compile_cache("", log=lambda s: None) == ""
    assert jax.config.jax_compilation_cache_dir == before


def test_unwritable_path_is_refused_naming_it(tmp_path, restore_cache):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="compile cache .*file"):
        runtime.enable_compile_cache(str(blocker / "cache"), log=lambda s: None)


def test_default_follows_jax_variable(monkeypatch):
    monkeypatch.delenv(runtime.ENV_COMPILE_CACHE, raising=False)
    assert runtime.default_compile_cache() == runtime.DEFAULT_COMPILE_CACHE
    monkeypatch.setenv(runtime.ENV_COMPILE_CACHE, "/some/dir")
    assert runtime.default_compile_cache() == "/some/dir"


_CHILD = """
import sys, jax, jax.numpy as jnp
from gemjax.train import runtime
runtime.enable_compile_cache(sys.argv[1], min_compile_s=0, log=lambda s: None)
hits = []
jax.monitoring.register_event_listener(lambda e, **_: hits.append(e) if e.endswith("cache_hits") else None)
y = jax.jit(lambda x: jnp.tanh(x) @ x.T - 1.5)(jnp.arange(20.0).reshape(4, 5))
print(len(hits), float(y.sum()))
"""


def test_a_new_process_loads_what_the_first_stored(tmp_path):
    cache = str(tmp_path / "cache")
    out = [subprocess.run([sys.executable, "-c", _CHILD, cache], capture_output=True, text=True,
                          check=True, env=dict(os.environ, JAX_PLATFORMS="cpu")).stdout.split()
           for _ in range(2)]
    assert out[0][0] == "0" and out[1][0] != "0", out
    assert out[0][1] == out[1][1]
