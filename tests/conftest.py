"""Test setup: 8 simulated CPU devices so mesh tests run anywhere (GPU runs unaffected), and a
persistent compilation cache so the many small programs the suite builds compile once."""

import os
import tempfile

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_compilation_cache_dir",
                  os.environ.get("GEMJAX_TEST_CACHE", os.path.join(tempfile.gettempdir(), "gemjax-jax-cache")))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
