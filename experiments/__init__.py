"""What users run: training (`train`), the teacher ablation (`ablate`), the mesh-shape
sweep (`sweep_mesh`), the public-dataset experiments (`frappe`, `movielens`,
`movielens_table`), their converters to Parquet (`convert_frappe`, `convert_movielens`)
and the training-curve plot (`plot_metrics`).

Each module is a program run from the repository root as `python -m experiments.<name>`
(`./run train` is `python -m experiments.train`); tests import them as
`experiments.<name>`. Benchmarks live in `benchmarks/`, kernel-lab tools in `tools/`.
"""
