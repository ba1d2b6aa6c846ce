"""The suite's persistent compilation cache (tests/conftest.py) for a child process.

A benchmark a test runs as a subprocess compiles in a fresh process. Given the suite's cache
(every program written, however fast it compiled), a later child or test that builds the
same program reads it back: the benchmark tests of the tiny teacher build it as
smoke_teacher_override() gives it (the same parameter initializers; bench_remat's baseline
step is bench_saved_ne's "none" step), and a warm rerun of the suite skips every compile.
"""

import ast
import os

import jax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def with_suite_cache(env: dict) -> dict:
    """env plus JAX_COMPILATION_CACHE_DIR (the suite's cache) and no minimum compile time
    for writing; env as it is when the suite runs without a cache."""
    cache = jax.config.jax_compilation_cache_dir
    if not cache:
        return env
    return {**env, "JAX_COMPILATION_CACHE_DIR": cache,
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


def smoke_teacher_override() -> str:
    """benchmarks/bench_saved_ne.py's SMOKE_OVERRIDE (its smoke run's tiny teacher), read
    from the source: importing the module would define its absl flags in this process."""
    tree = ast.parse(open(os.path.join(ROOT, "benchmarks", "bench_saved_ne.py")).read())
    return next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                and [getattr(t, "id", None) for t in node.targets] == ["SMOKE_OVERRIDE"])
