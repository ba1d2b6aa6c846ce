"""The suite's persistent compilation cache (tests/conftest.py) for a child process.

A benchmark a test runs as a subprocess compiles in a fresh process. Given the suite's cache
(every program written, however fast it compiled), a later child or test that builds the
same program reads it back: the tiny teacher's parameter initializers recur across the
benchmark tests, and a warm rerun of the suite skips their train-step compiles too.
"""

import jax


def with_suite_cache(env: dict) -> dict:
    """env plus JAX_COMPILATION_CACHE_DIR (the suite's cache) and no minimum compile time
    for writing; env as it is when the suite runs without a cache."""
    cache = jax.config.jax_compilation_cache_dir
    if not cache:
        return env
    return {**env, "JAX_COMPILATION_CACHE_DIR": cache,
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
