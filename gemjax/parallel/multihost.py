"""Per-process entry point for JAX's multi-controller runtime, and host-to-mesh batch feeding.

Every process runs the same program. ``initialize`` joins the job through
``jax.distributed.initialize`` (coordinator address, process count and id from
arguments or the environment: ``GEMJAX_COORDINATOR``, ``GEMJAX_NUM_PROCESSES``,
``GEMJAX_PROCESS_ID``; on managed clusters JAX's own auto-detection is used when
none is given). On CPU it selects gloo collectives and ``jax_num_cpu_devices``
simulated devices per process; on GPU NCCL is JAX's default.

Feeding: each process loads only the batch rows its devices hold
(``process_rows``) and hands them to ``put_process_local``, which assembles the
global array without any cross-process copy.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

ENV_COORDINATOR = "GEMJAX_COORDINATOR"
ENV_NUM_PROCESSES = "GEMJAX_NUM_PROCESSES"
ENV_PROCESS_ID = "GEMJAX_PROCESS_ID"
ENV_CPU_DEVICES = "GEMJAX_CPU_DEVICES"


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, cpu_devices: int | None = None) -> None:
    """Join the multi-process job (no-op for a single process with nothing configured).

    Must run before any jax computation in the process. Arguments fall back to the
    GEMJAX_* environment variables; ``cpu_devices`` > 0 forces the CPU platform with
    that many simulated devices and gloo collectives.
    """
    env = os.environ
    coordinator = coordinator or env.get(ENV_COORDINATOR) or None
    num_processes = num_processes or int(env.get(ENV_NUM_PROCESSES, "0")) or None
    if process_id is None and env.get(ENV_PROCESS_ID, "") != "":
        process_id = int(env[ENV_PROCESS_ID])
    cpu_devices = cpu_devices or int(env.get(ENV_CPU_DEVICES, "0"))
    if cpu_devices:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", cpu_devices)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if num_processes is None or num_processes == 1:
        return
    if coordinator is None or process_id is None:
        raise ValueError(
            f"multi-process run with {num_processes} processes needs a coordinator address and a process id "
            f"(flags or ${ENV_COORDINATOR} / ${ENV_PROCESS_ID})")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id {process_id} out of range for {num_processes} processes")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id)


def process_rows(sharding: NamedSharding, global_rows: int) -> slice:
    """The contiguous rows (dim 0) of a global [global_rows, ...] batch this process's devices hold.

    Raises if the rows are not one contiguous block (the mesh then interleaves
    processes along the batch axes; reorder the mesh axes).
    """
    idx = sharding.addressable_devices_indices_map((global_rows,))
    starts, stops = set(), set()
    for sl in idx.values():
        s = sl[0]
        starts.add(s.start or 0)
        stops.add(global_rows if s.stop is None else s.stop)
    lo, hi = min(starts), max(stops)
    covered = np.zeros(global_rows, bool)
    for sl in idx.values():
        covered[sl[0]] = True
    if not covered[lo:hi].all():
        raise ValueError(f"process {jax.process_index()}: its batch rows are not contiguous under {sharding.spec}")
    return slice(lo, hi)


def put_process_local(local: Any, sharding: NamedSharding | Any, global_rows: int) -> Any:
    """Assemble global arrays from this process's rows (a pytree of [rows, ...] numpy arrays).

    sharding: one NamedSharding for all leaves or a matching pytree of them.
    """
    leaves, tree = jax.tree.flatten(local)
    shardings = [sharding] * len(leaves) if isinstance(sharding, NamedSharding) else jax.tree.leaves(sharding)
    out = []
    for x, s in zip(leaves, shardings):
        x = np.asarray(x)
        out.append(jax.make_array_from_process_local_data(s, x, (global_rows,) + x.shape[1:]))
    return jax.tree.unflatten(tree, out)


def to_host(tree: Any) -> Any:
    """Full numpy copies of (possibly cross-process sharded) arrays on every process."""
    if jax.process_count() == 1:
        return jax.tree.map(np.asarray, tree)
    return multihost_utils.process_allgather(tree, tiled=True)
