"""Test setup: 8 simulated CPU devices so mesh tests run anywhere."""

import os

os.environ.setdefault("XLA_FLAGS", "")
import jax  # noqa: E402

if jax.default_backend() == "cpu" or os.environ.get("JAX_PLATFORMS", "") == "cpu":
    jax.config.update("jax_num_cpu_devices", 8)
