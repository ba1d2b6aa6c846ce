"""gemjax: a JAX/XLA training system for GEM-style recommendation models.

Importing the package is cheap (no jax): it registers the named presets
(gemjax.presets, into gemjax.config.PRESETS); `gemjax.load_for_inference` (see
gemjax.serve.inference) is imported on first use.
"""

from gemjax import presets as _presets  # noqa: F401  (fills gemjax.config.PRESETS)


def __getattr__(name: str):
    if name == "load_for_inference":
        from gemjax.serve.inference import load_for_inference
        return load_for_inference
    raise AttributeError(f"module 'gemjax' has no attribute {name!r}")
