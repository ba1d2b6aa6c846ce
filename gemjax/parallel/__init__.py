"""Parallel layout: mesh (axes + network tiers), logical-axis rules, multi-process runs, cost model.

  mesh.py       --mesh=replica=2,fsdp=2,expert=2 -> jax Mesh (Auto axes), host-aware device order
  rules.py      logical names -> PartitionSpec / NamedSharding, with_logical_constraint, shard_params
  multihost.py  jax.distributed entry point (GEMJAX_* env), process-local batch feeding
  launch.py     start N local processes (CPU tests, single-host runs)
  topology.py   bytes and time of each collective per step, predicted scaling ratio
  toy_step.py   toy DP + FSDP training job (layout tests against a float64 numpy reference)
  equivalence.py  the real train step for a few steps on any mesh / process count, host copies back
"""
