"""Test setup: 8 simulated CPU devices so mesh tests run anywhere (GPU runs unaffected)."""

import jax

jax.config.update("jax_num_cpu_devices", 8)
