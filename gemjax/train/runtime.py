"""Process-wide XLA runtime defaults, set before the JAX backend starts.

CUDA graphs on GPU: a small train step is launch-bound (the host launches thousands
of small kernels per step), and XLA:GPU's command buffers replay them as CUDA
graphs. ``enable_gpu_graphs`` adds GRAPH_FLAGS to $XLA_FLAGS when the run is on GPU;
a key the user's $XLA_FLAGS already sets is left as the user set it. XLA reads
$XLA_FLAGS once, when the backend initialises (the first device use; importing jax
is not one), so call it before any device use: experiments/train.py and the
benchmarks call it right after parsing their flags, gemjax.train.loop.train at its
entry (where it only acts if no device was used yet). GEMJAX_GPU_GRAPHS=0 turns it
off (an environment variable, not a Config field: the flags hold for the whole
process and must be set before a config reaches any code that starts the backend).

On GPU means: jax_platforms ($JAX_PLATFORMS) names cuda or gpu, or, when it is not
set, a CUDA PJRT plugin is installed. On CPU it does nothing.

cuBLAS GEMMs for FP8 (``enable_fp8_gemm_flags``): by default XLA:GPU autotunes every GEMM
fusion over Triton tilings (20-27 candidate kernels each, compiled one by one) against
cuBLAS. gem1b's FP8 step, 186 FP8 GEMMs around their quantize fusions, was still compiling
after 570 s on one H200; with Triton GEMMs off it compiles in 58.5 s and runs at 270.6 ms
a step. The BF16 step: 37.9 s and 190.9 ms with them off, 59.3 s and 189.7 ms on. So runs
with model.precision.format=fp8 add FP8_GEMM_FLAGS on GPU (experiments/train.py, the train
loop's entry; benchmarks/bench_fp8.py for both of its precisions), unless $XLA_FLAGS sets
the key.

The GIL switch interval during training (``short_gil_switch``): the train loop's thread
launches each step with the GIL released (jax's dispatch releases it while it enqueues
the program's kernels) and must take it back afterwards; while a Feeder thread is running
Python code, the loop's thread waits until the interpreter asks that thread to drop the
GIL, which it does after the switch interval (Python's default: 5 ms, as long as a small
step). The train loop lowers it to $GEMJAX_GIL_SWITCH_US microseconds (default
GIL_SWITCH_US) and restores it on exit; it changes when threads switch, no value.

The persistent compilation cache (``enable_compile_cache``): JAX's on-disk cache of compiled
programs, keyed by the program, the compile options and the jax / XLA versions and device
kind, so a rerun or a resume of the same step loads it instead of compiling; on GPU JAX
also keeps XLA's per-fusion autotuning results under it (DIR/xla_gpu_per_fusion_autotune_cache_dir;
process 0 writes, the others read), so a changed program autotunes only its new fusions.
Autotuning dominates large GPU compiles (gem1b's BF16 step: 59 s to compile, 38 s without
Triton GEMMs). experiments/train.py and experiments/distill.py turn it on
(--compile_cache; default $JAX_COMPILATION_CACHE_DIR, else DEFAULT_COMPILE_CACHE); programs
that compile in under min_compile_s (JAX's default: 1 s) are not stored.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import pkgutil
import sys
import tempfile
from typing import Callable

ENV_GRAPHS = "GEMJAX_GPU_GRAPHS"
ENV_GIL_SWITCH = "GEMJAX_GIL_SWITCH_US"
GIL_SWITCH_US = 500
ENV_COMPILE_CACHE = "JAX_COMPILATION_CACHE_DIR"        # JAX's own variable
DEFAULT_COMPILE_CACHE = os.path.join(tempfile.gettempdir(), "gemjax-jax-cache")

# command buffers for every kind of thunk that supports them, and a graph even for a
# single kernel (the default minimum of 5 leaves many small steps' kernels ungraphed)
GRAPH_FLAGS = {
    "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,COLLECTIVES,WHILE,"
                                     "CONDITIONAL,DYNAMIC_SLICE_FUSION",
    "xla_gpu_graph_min_graph_size": "1",
}

# FP8 programs on GPU: every GEMM through cuBLAS / cuBLASLt, none as an autotuned Triton
# GEMM fusion (module docstring)
FP8_GEMM_FLAGS = {"xla_gpu_enable_triton_gemm": "false"}

_done = False


def flag_keys(xla_flags: str) -> set[str]:
    """The keys an XLA_FLAGS string sets ("--a=1 --b" -> {"a", "b"})."""
    return {tok.lstrip("-").split("=", 1)[0] for tok in xla_flags.split() if tok.startswith("--")}


def missing_flags(xla_flags: str, want: dict[str, str]) -> list[str]:
    """The flags of `want` ("--key=value") whose key xla_flags does not set."""
    have = flag_keys(xla_flags)
    return [f"--{k}={v}" for k, v in want.items() if k not in have]


def with_flags(xla_flags: str, want: dict[str, str]) -> str:
    """xla_flags plus each key of `want` it does not set already."""
    return " ".join([xla_flags.strip()] * bool(xla_flags.strip()) + missing_flags(xla_flags, want))


def missing_graph_flags(xla_flags: str) -> list[str]:
    """The GRAPH_FLAGS ("--key=value") whose key xla_flags does not set."""
    return missing_flags(xla_flags, GRAPH_FLAGS)


def with_graph_flags(xla_flags: str) -> str:
    """xla_flags plus each GRAPH_FLAGS key it does not set already."""
    return with_flags(xla_flags, GRAPH_FLAGS)


def graphs_enabled() -> bool:
    """$GEMJAX_GPU_GRAPHS: "1" or unset: on, "0": off."""
    v = os.environ.get(ENV_GRAPHS, "1").strip()
    if v not in ("0", "1"):
        raise ValueError(f"${ENV_GRAPHS}={v!r}: expected 1 (CUDA graphs on GPU) or 0 (XLA's defaults)")
    return v == "1"


def _cuda_plugin_installed() -> bool:
    names = []
    if importlib.util.find_spec("jax_plugins") is not None:
        import jax_plugins
        names += [m.name for m in pkgutil.iter_modules(jax_plugins.__path__)]
    names += [e.name for e in importlib.metadata.entry_points(group="jax_plugins")]
    return any("cuda" in n for n in names)


def on_gpu() -> bool:
    """Whether this process's JAX backend is (or will be) a GPU, without starting it
    when it has not started."""
    import jax
    from jax._src import xla_bridge
    if xla_bridge.backends_are_initialized():
        return jax.default_backend() == "gpu"
    platforms = jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return any(p.strip() in ("cuda", "gpu") for p in platforms.split(","))
    return _cuda_plugin_installed()


def enable_gpu_graphs(log: Callable[[str], None] = print) -> str:
    """Add GRAPH_FLAGS to $XLA_FLAGS on GPU (once per process); returns what it added ("" when
    nothing: off, not on GPU, the user set every key, or the backend already started, which
    is logged since the flags could no longer take effect)."""
    global _done
    if _done or not graphs_enabled():
        return ""
    _done = True
    if not on_gpu():
        return ""
    return _add_xla_flags(GRAPH_FLAGS, "CUDA graphs", "enable_gpu_graphs",
                          f"{ENV_GRAPHS}=0 turns this off", log)


def _add_xla_flags(want: dict[str, str], what: str, caller: str, note: str,
                   log: Callable[[str], None]) -> str:
    """Add each of `want`'s keys that $XLA_FLAGS does not set; returns what it added."""
    old = os.environ.get("XLA_FLAGS", "")
    added = " ".join(missing_flags(old, want))
    if not added:
        return ""
    from jax._src import xla_bridge
    if xla_bridge.backends_are_initialized():
        log(f"[gemjax] {what} not enabled: the JAX backend started before "
            f"gemjax.train.runtime.{caller} ran (set {added} in XLA_FLAGS yourself)")
        return ""
    os.environ["XLA_FLAGS"] = with_flags(old, want)
    log(f"[gemjax] {what} on GPU: XLA_FLAGS += {added} ({note})")
    return added


def enable_fp8_gemm_flags(precision: str, log: Callable[[str], None] = print) -> str:
    """Add FP8_GEMM_FLAGS to $XLA_FLAGS when precision == "fp8" and the run is on GPU (module
    docstring); a key the user's $XLA_FLAGS sets is left as set. Returns what it added."""
    if precision != "fp8" or not on_gpu():
        return ""
    return _add_xla_flags(FP8_GEMM_FLAGS, "cuBLAS GEMMs for FP8", "enable_fp8_gemm_flags",
                          "XLA_FLAGS=--xla_gpu_enable_triton_gemm=true keeps Triton GEMMs", log)


def gil_switch_us() -> int:
    """$GEMJAX_GIL_SWITCH_US (a positive integer of microseconds), or GIL_SWITCH_US unset."""
    v = os.environ.get(ENV_GIL_SWITCH, str(GIL_SWITCH_US)).strip()
    if not v.isdigit() or int(v) < 1:
        raise ValueError(f"${ENV_GIL_SWITCH}={v!r}: expected a positive integer of microseconds "
                         f"(the interpreter's thread switch interval while training; Python's "
                         f"default is 5000)")
    return int(v)


@contextlib.contextmanager
def short_gil_switch():
    """sys.setswitchinterval(gil_switch_us() microseconds) inside, the previous one restored
    after (module docstring)."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(gil_switch_us() * 1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def default_compile_cache() -> str:
    """$JAX_COMPILATION_CACHE_DIR when set, else DEFAULT_COMPILE_CACHE."""
    return os.environ.get(ENV_COMPILE_CACHE, "").strip() or DEFAULT_COMPILE_CACHE


def enable_compile_cache(path: str, min_compile_s: float | None = None,
                         log: Callable[[str], None] = print) -> str:
    """Store and load compiled programs in directory `path` (module docstring); '' leaves
    the cache as it is. min_compile_s: programs compiling faster are not stored (None: JAX's
    setting, $JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS or 1 s). Creates `path`; ValueError
    naming it when it cannot be written. Returns the directory in use ('' when none). Call
    before the programs compile."""
    if not path:
        return ""
    import jax
    path = os.path.abspath(os.path.expanduser(path))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(f"compile cache {path!r}: cannot create it ({e.strerror})") from e
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"compile cache {path!r}: not writable")
    if jax.config.jax_compilation_cache_dir not in (None, path):   # JAX opened another one
        from jax.experimental.compilation_cache import compilation_cache
        compilation_cache.reset_cache()
    jax.config.update("jax_compilation_cache_dir", path)
    if min_compile_s is not None:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_s))
    log(f"[gemjax] compilation cache: {path} (programs compiling in >= "
        f"{jax.config.jax_persistent_cache_min_compile_time_secs:g} s)")
    return path
