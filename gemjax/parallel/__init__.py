"""Parallel layout: mesh (axes + network tiers), logical-axis rules, multi-process runs.

The base layer of gemjax: it imports no other gemjax package (tests/test_import_graph.py).

  mesh.py       --mesh=replica=2,fsdp=2,expert=2 -> jax Mesh (Auto axes), host-aware device order
  rules.py      logical names -> PartitionSpec / NamedSharding, with_logical_constraint, shard_params
  multihost.py  jax.distributed entry point (GEMJAX_* env), process-local batch feeding
  launch.py     start N local processes (CPU tests, single-host runs)
"""
