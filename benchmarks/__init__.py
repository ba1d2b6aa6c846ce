"""Benchmarks: timing programs for one part of the system at a time.

`bench_step` (the jitted train step), `bench_attention` (the attention kernels on the
workloads W1-W4 of `attention_workloads`, against cuDNN and plain jnp), `bench_sparse`
(sparse lookup + row-wise update), `bench_parquet` (the Parquet reader) and `bench_feed`
(the host input pipeline). Each runs from the repository root as
`python -m benchmarks.<name>`; tests and the kernel-lab tools import them as
`benchmarks.<name>`.
"""
