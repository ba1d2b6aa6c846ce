"""Kernel-lab and profiling tools: programs that inspect what the GPU runs.

`kernel_fingerprints` (hashes of the exported GPU programs, to show a refactor leaves them
unchanged), `triton_report` (the Triton compiler's resource report per kernel),
`sass_stalls` (Nsight Compute stall samples by reason and code region), `kernel_times`
(device time per kernel launch), `call_gaps` (a call's host and device timeline),
`ab_attention` (interleaved A/B timing of kernel variants), `bench_gdpa_mosaic` (the Mosaic
GPU forwards' knob sweeps against the Triton ones), `profile_summary` (device time per op
from a jax.profiler trace) and `gpu_checks.sh` (the GPU test and benchmark sections).
Each runs from the repository root as `python -m tools.<name>`; tests import them as
`tools.<name>`.
"""
