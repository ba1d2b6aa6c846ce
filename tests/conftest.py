"""Test setup: 8 simulated CPU devices so mesh tests run anywhere (GPU runs unaffected), and a
persistent compilation cache so the many small programs the suite builds compile once.

The cache settings and XLA's CPU code generation level go into the environment too, so every
process a test starts (`python -m experiments.train ...`, multi-process jobs) reads and fills
the same cache and compiles the same way. Every program is stored, however fast it compiled:
the processes and workers of a run build many of the same small ones. The suite's programs
are tiny: compiling them costs far more than running them, so XLA's CPU backend generates
code at LLVM -O0 (float semantics are the same at every level; only the machine code's speed
differs). A level the caller's $XLA_FLAGS sets is kept.

Python's cyclic garbage collector runs rarely here: tracing makes and drops millions of
small objects, and each full pass walks every object a long-lived test process holds (its
modules, JAX's caches), which cost a few percent of the suite's time at the default
thresholds. Memory still comes back: young cycles are collected every 100,000 allocations,
older ones every 2 million (tests/script_commands.py's children collect the same way).
"""

import gc
import os
import tempfile

CACHE = os.environ.get("GEMJAX_TEST_CACHE", os.path.join(tempfile.gettempdir(), "gemjax-jax-cache"))
os.environ["JAX_COMPILATION_CACHE_DIR"] = CACHE
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = " ".join(
        f for f in (os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0") if f)

import jax  # noqa: E402  (after the environment: JAX reads it at import and backend start)

gc.collect()
gc.freeze()                         # what was imported so far is never scanned again
gc.set_threshold(100_000, 20, 10)

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_compilation_cache_dir", CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def pytest_collection_modifyitems(config, items):
    """Files holding a test marked `slow` first (in collection order otherwise): pytest-xdist
    hands out whole files (`./run test`: --dist loadfile, --no-loadscope-reorder), so the long
    ones start early and the short ones fill the workers' ends."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)


def _cached_programs() -> int:
    try:
        return sum(1 for name in os.listdir(CACHE) if not name.startswith("."))
    except FileNotFoundError:
        return 0


def pytest_configure(config):
    if not hasattr(config, "workerinput"):      # the run's main process (not an xdist worker)
        config._gemjax_cache_at_start = _cached_programs()


def pytest_terminal_summary(terminalreporter, config):
    """One line after the durations: how many compiled programs the cache held when the run
    started (0: a cold-cache run, whose time is the suite's full cost) and at its end, and
    the allocator the processes ran on (./run test preloads jemalloc where installed)."""
    start = getattr(config, "_gemjax_cache_at_start", None)
    if start is not None:
        terminalreporter.write_line(
            f"compilation cache {CACHE}: {start} entries at start "
            f"({'cold' if start == 0 else 'warm'}), {_cached_programs()} at the end; "
            f"allocator {os.environ.get('LD_PRELOAD') or 'system malloc'}")
