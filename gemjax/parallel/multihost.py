"""Per-process entry point for JAX's multi-controller runtime, and host-to-mesh batch feeding.

Every process runs the same program. ``initialize`` decides how the process joins:

- explicit: a coordinator address, process count and process id from arguments or the
  environment (``GEMJAX_COORDINATOR``, ``GEMJAX_NUM_PROCESSES``, ``GEMJAX_PROCESS_ID``)
  go to ``jax.distributed.initialize`` (torchrun-style manual launch);
- cluster: with none of them given, a cluster environment that JAX's own
  ``jax.distributed.initialize()`` bootstraps from (SLURM, Open MPI's mpirun,
  Kubernetes with the ``kubernetes`` package, Cloud TPU; found by JAX's own detection,
  ``detect_cluster``) and more than one process in it: ``jax.distributed.initialize()``
  with no arguments. Values that are given override the cluster's;
- single: otherwise the process runs alone (also in a 1-task SLURM job, where JAX's
  bootstrap would restrict the process to one GPU).

Under SLURM and Open MPI, JAX gives each process the single GPU of its local rank
(``SLURM_LOCALID``): launch one task per GPU, or set ``JAX_LOCAL_DEVICE_IDS=0,1,...``
for one task per host. On CPU ``cpu_devices`` selects gloo collectives and that many
simulated devices per process; on GPU NCCL is JAX's default. ``describe()`` is the
one-line process layout each process prints at start.

Feeding: each process loads only the batch rows its devices hold
(``process_rows``) and hands them to ``put_process_local``, which assembles the
global array without any cross-process copy.

    python -m gemjax.parallel.multihost [--coordinator=H:P --num_processes=N --process_id=I] [--cpu_devices=N]

joins the job the same way, prints every process's layout line and checks that a
cross-process all-gather sees each process once (a launch check before a long job).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

ENV_COORDINATOR = "GEMJAX_COORDINATOR"
ENV_NUM_PROCESSES = "GEMJAX_NUM_PROCESSES"
ENV_PROCESS_ID = "GEMJAX_PROCESS_ID"
ENV_CPU_DEVICES = "GEMJAX_CPU_DEVICES"

_joined = {"via": "single", "coordinator": None}


def detect_cluster() -> Any | None:
    """The cluster environment JAX's ``jax.distributed.initialize()`` would bootstrap from, or None.

    Asks JAX's own cluster classes (``is_env_present``, in JAX's order; opt-in
    methods such as mpi4py excluded, as JAX's default detection does), so the
    conditions are exactly JAX's: SLURM needs SLURM_JOB_ID, SLURM_STEP_NODELIST,
    SLURM_NTASKS, SLURM_PROCID and SLURM_LOCALID (set by ``srun``, not by a bare
    ``sbatch`` script); Open MPI needs mpirun's OMPI_* variables.
    """
    from jax._src import clusters     # JAX's detection; no public API exposes it
    for env in clusters.ClusterEnv._cluster_types:
        if not env.opt_in_only_method and env.is_env_present():
            return env
    return None


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, cpu_devices: int | None = None) -> str:
    """Join the multi-process job; returns how: "explicit", the cluster's name ("slurm", ...) or "single".

    Must run before any jax computation in the process. Arguments fall back to the
    GEMJAX_* environment variables; ``cpu_devices`` > 0 forces the CPU platform with
    that many simulated devices and gloo collectives. num_processes == 1 is always
    single; a partial set of coordinator / count / id outside a cluster is an error.
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
    if num_processes == 1:
        return _set("single")
    if process_id is not None and num_processes is not None and not 0 <= process_id < num_processes:
        raise ValueError(f"process_id {process_id} out of range for {num_processes} processes")
    given = {"coordinator": coordinator, "num_processes": num_processes, "process_id": process_id}
    if all(v is not None for v in given.values()):
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id)
        return _set("explicit", coordinator)
    cluster = detect_cluster()
    if cluster is None:
        if any(v is not None for v in given.values()):
            missing = [k for k, v in given.items() if v is None]
            raise ValueError(
                f"multi-process run: {', '.join(missing)} missing and no cluster environment "
                f"(SLURM, Open MPI, ...) to take them from: give --coordinator, --num_processes and "
                f"--process_id (or ${ENV_COORDINATOR} / ${ENV_NUM_PROCESSES} / ${ENV_PROCESS_ID})")
        return _set("single")
    if num_processes is None and cluster.get_process_count() <= 1:
        return _set("single")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id)
    from jax._src import distributed
    return _set(cluster.name or cluster.__name__, getattr(distributed.global_state, "coordinator_address", None))


def _set(via: str, coordinator: str | None = None) -> str:
    _joined.update(via=via, coordinator=coordinator)
    return via


def layout() -> dict[str, Any]:
    """This process's place in the job: index, count, local / global devices, how it joined."""
    local = jax.local_devices()
    return {"process_index": jax.process_index(), "process_count": jax.process_count(),
            "local_devices": len(local), "global_devices": jax.device_count(),
            "platform": local[0].platform, "via": _joined["via"], "coordinator": _joined["coordinator"]}


def describe() -> str:
    """One line: "process 0 of 2 (slurm, coordinator node01:61440): 4 local of 8 gpu devices"."""
    lay = layout()
    how = lay["via"] + (f", coordinator {lay['coordinator']}" if lay["coordinator"] else "")
    return (f"process {lay['process_index']} of {lay['process_count']} ({how}): "
            f"{lay['local_devices']} local of {lay['global_devices']} {lay['platform']} devices")


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


def _check(argv=None) -> None:
    import argparse
    import json
    ap = argparse.ArgumentParser(description="join the job as train.py does, print the layout, "
                                             "check a cross-process all-gather")
    ap.add_argument("--coordinator", default=None, help=f"host:port of process 0 (${ENV_COORDINATOR})")
    ap.add_argument("--num_processes", type=int, default=None, help=f"process count (${ENV_NUM_PROCESSES})")
    ap.add_argument("--process_id", type=int, default=None, help=f"this process's id (${ENV_PROCESS_ID})")
    ap.add_argument("--cpu_devices", type=int, default=None, help="simulated CPU devices per process")
    args = ap.parse_args(argv)
    try:
        initialize(args.coordinator, args.num_processes, args.process_id, args.cpu_devices)
    except ValueError as e:
        ap.error(str(e))
    lay = layout()
    seen = np.asarray(multihost_utils.process_allgather(np.array([lay["process_index"]], np.int32),
                                                        tiled=True))
    lay["allgather"] = seen.tolist()
    print(f"[gemjax] {describe()}; all-gather saw processes {seen.tolist()}", flush=True)
    print("LAYOUT " + json.dumps(lay), flush=True)
    ok = sorted(seen.tolist()) == list(range(lay["process_count"]))
    if not ok:
        print(f"all-gather saw processes {seen.tolist()}, expected 0..{lay['process_count'] - 1}",
              file=sys.stderr, flush=True)
    if lay["process_count"] > 1:
        # Leave the job together (the coordination service's shutdown barrier), then exit
        # without interpreter teardown: the CPU collectives' transport can block at exit
        # on a peer process that has already gone.
        jax.distributed.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0 if ok else 1)
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    _check()
