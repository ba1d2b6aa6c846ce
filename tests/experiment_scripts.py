"""Load a script of experiments/ as a module (they are scripts, not a package)."""

import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(name: str):
    """experiments/<name>.py as module `experiments_<name>`, loaded once per process (the
    scripts define absl flags at import, which may be defined only once)."""
    key = f"experiments_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, os.path.join(ROOT, "experiments", f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[key]
            raise
    return sys.modules[key]
