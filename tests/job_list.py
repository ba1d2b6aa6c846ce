"""Several launch targets run one after another in the same processes.

``launch.launch("tests.job_list:run_jobs", 2, kwargs={"jobs": [[target, kwargs], ...]})``
starts the processes (imports, jax.distributed setup) once for all the jobs: each
process calls every ``"module:function"`` target with its kwargs, in order, and
returns the list of their values. Used by tests/test_parallel_multiprocess.py.
"""

from __future__ import annotations

import importlib
from typing import Any


def run_jobs(jobs: list[list]) -> list[Any]:
    """[[target "module:function", kwargs dict], ...] -> [value of each call], in order."""
    out = []
    for target, kwargs in jobs:
        module, _, func = target.partition(":")
        out.append(getattr(importlib.import_module(module), func)(**kwargs))
    return out
