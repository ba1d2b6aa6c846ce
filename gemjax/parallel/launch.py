"""Start N local processes of one JAX program (CPU tests, single-host experiments).

``launch("pkg.module:function", num_processes=2, cpu_devices=4, kwargs={...})``
starts ``python -m gemjax.parallel.launch`` N times with a coordinator on a free
localhost port. Each child calls ``multihost.initialize`` (gloo collectives,
``cpu_devices`` simulated devices when given), imports the target, calls
``function(**kwargs)`` and pickles the return value; ``launch`` returns the list
of values, one per process, or raises with every failing process's stderr tail.

For real clusters use the cluster's own launcher (srun, mpirun, k8s): each
process only needs the GEMJAX_* variables that ``multihost.initialize`` reads.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pickle
import socket
import subprocess
import sys
import tempfile
from typing import Any

from gemjax.parallel import multihost


def free_port() -> int:
    """A TCP port on localhost that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _resolve(target: str):
    module, _, func = target.partition(":")
    mod = importlib.import_module(module)
    if not func:
        return getattr(mod, "main")
    if not hasattr(mod, func):
        raise ValueError(f"target {target!r}: module {module!r} has no attribute {func!r}")
    return getattr(mod, func)


def launch(target: str, num_processes: int, *, cpu_devices: int | None = None,
           kwargs: dict[str, Any] | None = None, timeout_s: float = 300.0,
           env: dict[str, str] | None = None) -> list[Any]:
    """Run ``target`` ("module:function", default function ``main``) in num_processes processes.

    kwargs must be JSON-serialisable. Returns each process's return value in
    process order.
    """
    if num_processes < 1:
        raise ValueError(f"num_processes must be >= 1, got {num_processes}")
    if ":" in target and not target.split(":", 1)[1].isidentifier():
        raise ValueError(f"target {target!r}: expected 'module:function'")
    coordinator = f"localhost:{free_port()}"
    repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with tempfile.TemporaryDirectory(prefix="gemjax_launch_") as tmp:
        procs = []
        for pid in range(num_processes):
            child_env = dict(os.environ, **(env or {}))
            child_env["PYTHONPATH"] = os.pathsep.join(p for p in (repo_root, child_env.get("PYTHONPATH")) if p)
            child_env[multihost.ENV_COORDINATOR] = coordinator
            child_env[multihost.ENV_NUM_PROCESSES] = str(num_processes)
            child_env[multihost.ENV_PROCESS_ID] = str(pid)
            if cpu_devices:
                child_env[multihost.ENV_CPU_DEVICES] = str(cpu_devices)
            cmd = [sys.executable, "-m", "gemjax.parallel.launch", "--target", target,
                   "--kwargs", json.dumps(kwargs or {}), "--result", os.path.join(tmp, f"result_{pid}.pkl")]
            out = open(os.path.join(tmp, f"log_{pid}.txt"), "w")
            procs.append((subprocess.Popen(cmd, env=child_env, stdout=out, stderr=subprocess.STDOUT), out))
        failures = []
        for pid, (p, out) in enumerate(procs):
            try:
                rc = p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                for q, _ in procs:
                    q.kill()
                rc = "timeout"
            out.close()
            if rc != 0:
                with open(os.path.join(tmp, f"log_{pid}.txt")) as f:
                    failures.append(f"process {pid} exit {rc}:\n{f.read()[-3000:]}")
        if failures:
            raise RuntimeError(f"launch({target!r}, {num_processes}) failed:\n" + "\n".join(failures))
        results = []
        for pid in range(num_processes):
            with open(os.path.join(tmp, f"result_{pid}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results


def _worker(argv=None) -> None:
    parser = argparse.ArgumentParser(description="one process of gemjax.parallel.launch")
    parser.add_argument("--target", required=True)
    parser.add_argument("--kwargs", default="{}")
    parser.add_argument("--result", required=True)
    args = parser.parse_args(argv)
    multihost.initialize()
    value = _resolve(args.target)(**json.loads(args.kwargs))
    with open(args.result, "wb") as f:
        pickle.dump(value, f)


if __name__ == "__main__":
    _worker()
