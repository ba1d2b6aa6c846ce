"""The commands of the README and docs/ run as written, and `./run` picks the jax build the README says.

Every command of README.md and docs/*.md (each line or loop of a ```bash block, and each
inline code span that starts like a command) must be in RUN or in SKIP (with the reason);
a new command in neither fails the test, so none goes untested unnoticed. The RUN
commands are executed as written, with three substitutions only: `./run train` is
the `.venv/bin/python -m experiments.train` it execs, `python` / `.venv/bin/python`
is this interpreter, and a `--workdir=` (the plot's `--workdirs=` and `--out=`) moves under a
temporary directory.
"""

import glob
import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys

import jax
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DOCS = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
PERFORMANCE = os.path.join(ROOT, "docs", "performance.md")     # holds the FLOPS command's figure
COMMAND_STARTS = ("./run", "python ", "python3 ", ".venv/bin/python", "srun ", "mpirun ", "bash ", "for ")
GPU_TEACHER = "--override=model.kind=teacher,model.teacher.num_experts=4,model.teacher.top_k=2"

TINY = "./run train --config=tiny --workdir=runs/tiny --steps=50"
FLOPS = "python -m gemjax.perf.model_flops --config=h200 --override=model.teacher.num_experts=4,model.teacher.top_k=2"
REHEARSE_SLURM = ("for i in 0 1; do SLURM_JOB_ID=4242 SLURM_NTASKS=2 SLURM_PROCID=$i SLURM_LOCALID=$i "
                  "SLURM_STEP_NODELIST=localhost .venv/bin/python -m gemjax.parallel.multihost --cpu_devices=2 & "
                  "done; wait")
REHEARSE_FLAGS = ("for i in 0 1; do .venv/bin/python -m gemjax.parallel.multihost --cpu_devices=2 "
                  "--coordinator=localhost:12355 --num_processes=2 --process_id=$i & done; wait")
# run after TINY, on its workdir
AFTER_TINY = ("./run train --mode=eval --workdir=runs/tiny",
              "./run train --mode=eval --workdir=runs/tiny --checkpoint_step=30",
              ".venv/bin/python -m experiments.plot_metrics --workdirs=runs/tiny --out=runs/tiny/curves.png")
# "Train on your own data": run (after the section's Python writes its files) by
# tests/test_own_data.py
OWN_DATA = ("./run train --config=tiny --workdir=runs/own --steps=200 --eval_every=100 "
            "--features=data/own/schema.json --override=data.source=parquet,"
            "data.train_path=data/own/train.parquet,data.eval_path=data/own/eval.parquet,"
            "data.batch_size=32,data.eval_batches=0,optim.dense.lr=0.01,optim.sparse.lr=0.5")
# the layout section's example of running a program of experiments/, benchmarks/, tools/
TOOL_HELP = "python -m tools.profile_summary --help"
RUN = {TINY, FLOPS, REHEARSE_SLURM, REHEARSE_FLAGS, "./run env", OWN_DATA, TOOL_HELP, *AFTER_TINY}

# README "Data": MovieLens-1M ranking
ML_RANK = ("python -m experiments.convert_movielens --out=/tmp/gemjax-data/ml-1m --tasks=ranking "
           "--train_positions=5 --max_history=50",
           "./run train --config=movielens_rank --workdir=runs/ml_rank_teacher_0 --seed=0 "
           "--features=/tmp/gemjax-data/ml-1m/ranking/schema.json --override=data.source=parquet,"
           "data.train_path=/tmp/gemjax-data/ml-1m/ranking/train.parquet,"
           "data.eval_path=/tmp/gemjax-data/ml-1m/ranking/test.parquet,data.eval_batches=0,"
           "model.kind=teacher")

# README "Data": MovieLens-1M retrieval


LONG = "small preset, minutes on CPU; the tiny command runs the same train.py path"
SKIP = {
    "python -m benchmarks.bench_fp8 --smoke --limit --override=model.use_sequences=false "
    "--shapes=32x64x48:2,16x32x32:3":
        "tests/test_fp8_bench.py runs the --limit smoke and checks every figure of its table",
    "python -m benchmarks.bench_fp8 --config=gem1b --override= --limit --gemm_share=0.41 --iters=10 "
    "--compile_cache=/tmp/gemjax_cc --out=fp8_limit.json":
        "gem1b on a GPU; tests/test_fp8_bench.py runs the same flags at smoke size",
    "python -m experiments.ranking --models=teacher --seeds=0 --positives=512 --patience=2 "
    "--override=train.dense_lr=3e-3,model.pyramid_levels=32:none:1 --workdir=runs/tdiag/nopool_lr3":
        "ML-1M (not in CI), GPU minutes; tests/test_ranking.py runs the script on a fake MovieLens",
    "python -m experiments.ranking --models=teacher,gem,wukong,dlrm,lr --seeds=0 --hparams= "
    "--override=train.dense_lr=3e-3 --workdir=runs/ranking_lr3e-3":
        "ML-1M (not in CI), GPU minutes; tests/test_ranking.py runs the script on a fake MovieLens",
    "python -m experiments.distill --dataset=synthetic --seeds=0 --rows=all --nohierarchical":
        "minutes on CPU; tests/test_distill_experiment.py runs the script at a smaller size",
    "python -m benchmarks.bench_serve":
        "needs trained runs; tests/test_distill_runs.py::test_bench_serve_smoke runs it on tiny ones",
    "./run train": LONG,
    "./run": "the script named in prose, no command",
    "./run test": "the suite itself (CI runs it; this test is part of it)",
    "python -m experiments.online --workdir=runs/online":
        "minutes on CPU; tests/test_online_resume.py runs the same script on a 4-window stream",
    "python -m experiments.online --config=tiny --workdir=runs/online_ml "
    "--movielens=/tmp/gemjax-data/ml-1m-time-100k --max_rows=100000 --models=teacher,student "
    "--admit_tables=user,item --override=data.batch_size=256":
        "ML-1M (not in CI), 3 min on CPU; tests/test_online_parquet.py runs the same script on a "
        "tiny Parquet stream",
    "python -m experiments.online --config=tiny --workdir=runs/online_ml_full "
    "--movielens=/tmp/gemjax-data/ml-1m-time --models=teacher,student --admit_tables=user,item "
    "--override=data.batch_size=1024": "the whole ML-1M stream, a GPU machine",
    "python -m experiments.convert_movielens_time --ratings=ml-1m/ratings.dat "
    "--out=/tmp/gemjax-data/ml-1m-rated": "GroupLens' ratings.dat (not in the shared datasets); "
                                          "tests/test_convert_movielens_time.py converts a small one",
    "python -m experiments.online --workdir=runs/online_ml_rated "
    "--movielens=/tmp/gemjax-data/ml-1m-rated --window_seconds=2592000 --models=teacher,student "
    "--admit_tables=user,item": "needs the converted ratings.dat above",
    "python -m experiments.sweep --config=frappe --workdir=runs/frappe_sweep --trials=10 --seeds=0,1,2 "
    "--seed=2 --metric=ne --space='train.dense_lr=loguniform(5e-4,6e-3);train.sparse_lr=loguniform(0.1,0.4);"
    "model.wukong_mlp=choice(128,128:128);train.steps=choice(180,360)' --override=model.dim=32,model.wukong_layers=3":
        "30 CPU-minutes on the converted Frappe; tests/test_sweep.py runs a sweep through the trainer",
    "python -m experiments.frappe --models=gem,lr --seeds=0,1,2":
        "Frappe (not in CI); tests/test_frappe_trainer.py runs the script on fake Frappe files",
    "python -m experiments.frappe --models=gem":
        "FP8 against BF16 on Frappe (not in CI); tests/test_frappe_trainer.py runs the script "
        "on fake Frappe files",
    "python -m experiments.distill --dataset=synthetic --seeds=0,1,2 --out=runs/distill":
        "minutes on CPU; tests/test_distill_experiment.py runs the script at a toy size",
    "python -m experiments.distill --dataset=frappe --seeds=0,1,2 --teacher_steps=180 "
    "--student_steps=60 --out=runs/distill":
        "needs the converted Frappe; tests/test_distill_experiment.py runs the synthetic table",
    "python -m experiments.distill --dataset=drift --seeds=0,1,2 --out=runs/distill":
        "minutes on CPU; tests/test_distill_experiment.py runs the drift mode at a toy size",
    "python -m experiments.distill --dataset=drift --seeds=0,1,2 --teacher_steps=550 "
    "--student_steps=50 --out=runs/distill":
        "minutes on CPU; tests/test_distill_experiment.py runs the drift mode at a toy size",
    "python -m experiments.distill --dataset=drift --seeds=0,1,2 --adapter=features "
    "--adapter_features=dense,student --adapter_window=8192 --adapter_refresh=5 --out=runs/distill":
        "minutes on CPU; tests/test_distill_experiment.py runs the drift mode at a toy size",
    "python -m experiments.distill --dataset=drift --seeds=0,1,2 --teacher_steps=550 "
    "--student_steps=50 --adapter=features --adapter_features=dense,student --adapter_window=8192 "
    "--adapter_refresh=5 --out=runs/distill":
        "minutes on CPU; tests/test_distill_experiment.py runs the drift mode at a toy size",
    "export JAX_LOCAL_DEVICE_IDS=0,1,2,3,4,5,6,7": "environment of the SLURM example below",
    "python -m benchmarks.bench_train_feed": "GPU benchmark (minutes); tests/test_bench_train_feed.py "
                                             "runs it on CPU with a small model",
    "python -m experiments.train --config=frappe --workdir=runs/frappe/gem_s0 --seed=0":
        "needs the converted Frappe files; tests/test_frappe_trainer.py trains the preset on fake ones",
    "python -m benchmarks.bench_feed --config=movielens_rank --features=DIR/schema.json "
    "--override=data.source=parquet,...":
        "a template (DIR); tests/test_bench_train_feed.py runs the Feeder on a MovieLens-shaped set",
    "./run setup": "installs into .venv; CI's `./run test` runs the same setup",
    "./run train --config=gem1b --steps=60 --eval_every=60 --workdir=runs/gem1b": "GPU (gem1b preset)",
    "python -m benchmarks.bench_segment_sum": "GPU (2.6M x 512 rows)",
    "python -m benchmarks.bench_layer_norm": "GPU ([1.32M, 512] rows); "
                                             "tests/test_kernels_layer_norm.py runs its --smoke",
    "python -m benchmarks.bench_segment_sum --smoke":
        "tests/test_segment_sum.py runs the benchmark's smoke mode",
    "python -m gemjax.perf.model_size --config=gem1b": "tests/test_gem1b.py runs its main() and "
                                                       "pins the figures docs/performance.md quotes",
    f"./run train --config=h200 {GPU_TEACHER} --workdir=runs/h200": "GPU (h200 preset)",
    f"./run train --config=h200 {GPU_TEACHER} --mesh=replica=-1 --table_replica_axes=replica "
    "--batch_size=32768 --workdir=runs/h200x8": "8 GPUs",
    "python -m pytest -m gpu": "GPU tests",
    "python -m tools.roofline WORKDIR/profile DUMP/STEP_MODULE.txt --steps=N": (
        "placeholder paths of a GPU run's trace and HLO dump; tests/test_roofline.py runs it"),
    "python -m tools.profile_summary WORKDIR/profile --steps=N": ("a run's placeholder path; "
        "tests/test_tracking.py finds the trace it reads, tests/test_profile_summary.py runs it"),
    "python -m experiments.train --config=gem1b --steps=40 --eval_every=40 "
    "--override=train.log_every=10,data.eval_batches=1": "one H200 (the gem1b preset: 94 GB of device memory)",
    "python -m gemjax.perf.local_mfu --config=gem1b --iters=3": ("one H200 (the gem1b preset); "
                                                       "tests/test_gem1b_mfu.py runs its main()"),
    "python -m benchmarks.bench_remat --config=h200 --override=model.kind=teacher --regions=pyramid,seq,"
    "attention,interaction --policies=recompute,quantize --out=remat.json":
        "GPU (h200 preset); tests/test_remat.py runs its --smoke",
    "python -m benchmarks.bench_saved_ne --out=saved_ne.json":
        "25 minutes of CPU (15 training runs); tests/test_saved_ne.py runs its --smoke",
    "XLA_FLAGS=--xla_gpu_deterministic_ops=true python -m benchmarks.bench_saved_ne "
    "--override=data.batch_size=1024,model.dim=32 --plans=none,all:recompute,pyramid:quantize,"
    "all:quantize --out=saved_ne_h200.json": "one H200",
    "python -m benchmarks.bench_fp8 --config=h200 --override=model.kind=teacher,model.dim=512,"
    "model.wukong_mlp=4096,data.batch_size=1024 --out=fp8.json":
        "GPU benchmark; tests/test_fp8_bench.py runs it with --smoke on CPU",
    "python -m benchmarks.bench_fp8 --config=gem1b --override= --nogemms --iters=10":
        "one H200 (gem1b); tests/test_fp8_bench.py runs --nogemms with --smoke on CPU",
    "python -m gemjax.parallel.multihost": "a description; its rehearsals below run",
    "srun --nodes=2 --ntasks-per-node=1 --gpus-per-node=8 .venv/bin/python -m gemjax.parallel.multihost":
        "SLURM cluster; tests/test_multihost_env.py starts 2 processes with srun's environment",
    "srun --nodes=2 --ntasks-per-node=1 --gpus-per-node=8 .venv/bin/python -m experiments.train "
    f"--config=h200 {GPU_TEACHER} --mesh=replica=2,fsdp=8 --table_replica_axes=replica "
    "--batch_size=65536 --workdir=runs/h200x16": "SLURM cluster of GPUs",
    ".venv/bin/python -m experiments.train --config=h200 --override=model.kind=teacher --mesh=replica=2,fsdp=8 "
    "--coordinator=host0:12355 --num_processes=2 --process_id=0": "2 GPU hosts; the CPU rehearsal runs",
    ".venv/bin/python -m experiments.train --config=h200 --override=model.kind=teacher --mesh=replica=2,fsdp=8 "
    "--coordinator=host0:12355 --num_processes=2 --process_id=1": "2 GPU hosts; the CPU rehearsal runs",
    "python -m experiments.ablate --config=small --steps=1000 --seeds=0,1,2 "
    "--override=data.batch_size=1024,model.dim=32,model.seq_heads=1": "one H200, 7 variants x 1000 steps",
    # docs/ pages
    "python -m benchmarks.bench_parquet --rows=1000000 --mean_len=100 --threads=1,4,8 --grain":
        "minutes over a 1M-row file, grain beside it; tests/test_parquet.py checks the reader",
    "python -m benchmarks.bench_feed --config=h200 --workers=1,2,4,8":
        "the h200 preset's Feeder at up to 8 workers (minutes); tests/test_bench_train_feed.py runs "
        "the Feeder on a MovieLens-shaped set",
    "python -m benchmarks.bench_attention --sweep": "GPU knob sweep; tests/test_bench_attention.py runs "
                                                    "the benchmark on CPU",
    "python -m benchmarks.bench_attention --workloads=W1,W4": "GPU; tests/test_bench_attention.py runs "
                                                              "the benchmark on CPU",
    "python -m tools.bench_gdpa_mosaic --sweep": "Hopper GPU (the Mosaic kernels)",
    "python -m benchmarks.bench_layer_norm --smoke": "tests/test_kernels_layer_norm.py runs the "
                                                     "benchmark's smoke mode",
    "python -m tools.triton_report": "needs ptxas (a CUDA toolkit); tests/test_triton_report.py runs "
                                     "its lowering step on CPU",
    "python -m tools.kernel_fingerprints --out=after.json": "exports every kernel for cuda (minutes); "
                                                           "tests/test_kernel_fingerprints.py runs it",
    "python -m pytest -m gpu tests/test_kernels_*.py": "GPU tests",
    "bash tools/gpu_checks.sh kernels mosaic": "GPU checks",
    "python -m experiments.ablate": "the program named in prose; its full command is skipped above",
    "python -m experiments.sweep_mesh": "GPU mesh sweep; tests/test_sweep_mesh.py runs it on 2 CPU devices",
    "python -m benchmarks.bench_sparse": "GPU (a 1e8-row table); tests/test_bench_sparse.py runs it "
                                         "with a tiny table",
    "python -m experiments.train": "the module named in prose (`./run train` runs it; its commands "
                                   "are listed here)",
    **{cmd: "MovieLens-1M (not in CI); tests/test_movielens_trainer.py runs it on a fake MovieLens"
       for cmd in ML_RANK},
    # real data, selection, sweeps, benchmarks of this wave
    "python -m experiments.datasets --name=ml-1m --out=/tmp/gemjax-data":
        "downloads from the internet; tests/test_datasets.py runs the command on a loopback server",
    "python -m experiments.movielens --preset=movielens_hstu_large --seeds=0,1,2 --epochs=200 "
    "--eval_epochs=4 --patience=4 --refit --refit_rows=train+valid --workdir=runs/ml_hstu":
        "minutes a seed on a GPU; tests/test_movielens.py runs the script on a fake MovieLens",
    "python -m experiments.movielens --preset=movielens_hstu_large --seeds=0,1,2 --epochs=200 "
    "--eval_epochs=2 --patience=8 --select_metric=hr@10 --steps_per_call=0 "
    "--override=model.dim=64 --workdir=runs/ml_hstu_d64":
        "minutes a seed on a GPU; tests/test_movielens.py runs the script on a fake MovieLens",
    "python -m experiments.movielens --preset=movielens_hstu_large --seeds=0,1,2 --epochs=200 "
    "--eval_epochs=2 --patience=8 --select_metric=hr@10 --steps_per_call=0 "
    "--override=model.dim=96 --refit --workdir=runs/ml_hstu_d96":
        "minutes a seed on a GPU; tests/test_movielens.py runs the script and its refit on a "
        "fake MovieLens",
    "./run train --config=tiny --workdir=runs/sel --override=data.valid_path=synthetic,"
    "train.select_metric=auc,train.valid_every=10,train.patience=2":
        "tests/test_validation.py trains the same selection on the tiny preset",
    "python -m experiments.sweep --config=tiny --workdir=runs/sweep --trials=8 "
    "--space='optim.dense.lr=loguniform(1e-4,3e-2);model.dim=choice(8,16)'":
        "8 trials of training; tests/test_sweep.py runs sweeps of the tiny preset (and a fake trainer)",
    "python -m experiments.sweep": "the program named in prose",
    "python -m experiments.ranking --models=teacher,gem,wukong,dlrm,lr --seeds=0,1,2 "
    "--workdir=runs/ranking": "hours on CPU (a GPU run); tests/test_ranking.py smokes it",
    "python -m experiments.ranking --models=teacher,gem,wukong,dlrm,lr --seeds=0,1,2 "
    "--workdir=runs/ranking --table_only": "reads the GPU run's results",
    "python -m experiments.ranking --data_out=/tmp/gemjax-data/ml-1m-200 --max_users=200 "
    "--models=lr,wukong --seeds=0 --max_epochs=2 --workdir=/tmp/ranking-quick":
        "needs ../shared/datasets/ml-1m; tests/test_ranking.py runs the same path on fake data",
    "python -m experiments.scaling --task=retrieval --out=runs/scaling_retrieval --jobs=10":
        "a GPU run",
    "python -m experiments.scaling --task=ranking --out=runs/scaling_ranking --jobs=10": "a GPU run",
    "python -m experiments.scaling --task=retrieval --seeds=3 --jobs=10 --steps_per_call=0 "
    "--out=runs/scaling_retrieval": "a GPU run (tests/test_scaling.py smokes --jobs and "
                                    "--steps_per_call)",
    "python -m experiments.scaling --task=retrieval --seeds=3 --epochs=60 "
    "--ladder=32x1,64x2,96x3,128x4,192x6": "a GPU run",
    "python -m experiments.scaling --task=retrieval --dry_run":
        "needs the converted ML-1M files; tests/test_scaling.py checks the ladder's span",
    "python -m experiments.scaling --task=retrieval --max_users=16 --families=gem_tower "
    "--ladder=8x1,16x1,32x2,64x4 --rungs=0,1 --epochs=1 --valid_epochs=1 "
    "--override=data.batch_size=16 --out=/tmp/scale_smoke":
        "needs ../shared/datasets/ml-1m; tests/test_scaling.py runs the same smoke",
    "python -m experiments.convert_frappe --out=/tmp/gemjax-data/frappe":
        "needs ../shared/datasets/frappe; tests/test_converters.py converts fake Frappe files",
    "python -m experiments.train --mode=eval": "the mode named in prose",
    "python -m experiments.train ... --refit": "the flag named in prose; tests/test_validation.py refits",
}


def _norm(cmd):
    return " ".join(cmd.split())


def _strip_comment(line):
    return re.sub(r"(^|\s)#.*$", "", line).rstrip()


def readme_commands(text):
    """Commands of the README: logical lines / loops of ```bash blocks and command-like inline spans."""
    cmds = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        lines = [_strip_comment(ln) for ln in block.replace("\\\n", " ").splitlines()]
        loop = []
        for ln in lines:
            if not ln.strip():
                continue
            if loop or ln.lstrip().startswith(("for ", "while ", "if ")):
                loop.append(ln.strip())
                if re.search(r"\b(done|fi)\b", ln):
                    cmds.append(_norm(" ".join(loop)))
                    loop = []
                continue
            cmds.append(_norm(ln))
        assert not loop, f"unterminated loop in a README bash block: {loop}"
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    for span in re.findall(r"`([^`]+)`", prose):
        span = _norm(span)
        if span.startswith(COMMAND_STARTS):
            cmds.append(span)
    return list(dict.fromkeys(cmds))


def all_commands():
    """The commands of README.md and of every docs/*.md page, each once."""
    cmds = []
    for path in [README] + DOCS:
        cmds += readme_commands(open(path).read())
    return list(dict.fromkeys(cmds))


def _env():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "PMI_", "GEMJAX_", "JAX_COORDINATOR"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    if jax.config.jax_compilation_cache_dir:     # the suite's cache: a warm rerun skips compiles
        env["JAX_COMPILATION_CACHE_DIR"] = jax.config.jax_compilation_cache_dir
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.5"
    return env


def _argv(cmd, tmp):
    words = shlex.split(cmd)
    if words[:2] == ["./run", "train"]:
        words = [sys.executable, "-m", "experiments.train"] + words[2:]
    elif words[0] in ("python", ".venv/bin/python"):
        words = [sys.executable] + words[1:]
    return [f"--workdir={tmp}/{w.split('=', 1)[1]}" if w.startswith("--workdir=") else w for w in words]


def _bash(cmd):
    return cmd.replace(".venv/bin/python", shlex.quote(sys.executable))


def _run(argv_or_script, shell=False, timeout=300):
    r = subprocess.run(argv_or_script if not shell else ["bash", "-c", argv_or_script], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{argv_or_script}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def test_every_readme_command_is_run_or_skipped_with_a_reason():
    cmds = all_commands()
    unclassified = [c for c in cmds if c not in RUN and c not in SKIP]
    assert not unclassified, ("README / docs commands neither run nor skipped by tests/test_readme_commands.py "
                              "(add each to RUN, or to SKIP with the reason):\n" + "\n".join(unclassified))
    stale = sorted((RUN | set(SKIP)) - set(cmds))
    assert not stale, "commands listed here that neither the README nor docs/ has:\n" + "\n".join(stale)
    assert all(SKIP.values())


def test_readme_cpu_commands_run_as_written(tmp_path):
    # the tiny train (mostly compile time) runs beside the other commands
    with open(tmp_path / "tiny.out", "w") as fo, open(tmp_path / "tiny.err", "w") as fe:
        tiny = subprocess.Popen(_argv(TINY, tmp_path), cwd=ROOT, env=_env(), stdout=fo, stderr=fe)
        try:
            _other_cpu_commands(tmp_path)
            tiny.wait(timeout=600)
        finally:
            tiny.kill()
    out, err = (tmp_path / "tiny.out").read_text(), (tmp_path / "tiny.err").read_text()
    assert tiny.returncode == 0, f"{TINY}: exit {tiny.returncode}\n{out[-2000:]}\n{err[-3000:]}"
    # 50 steps, a summary, the layout line of a single process
    assert re.search(r"^\[gemjax\] process 0 of 1 \(single\): \d+ local of \d+ cpu devices$", out, re.M), out[-2000:]
    summary = json.load(open(tmp_path / "runs" / "tiny" / "summary.json"))
    assert summary["steps"] == 50 and 0 < summary["eval_ne"] < 2
    evals = [json.loads(r) for r in open(tmp_path / "runs" / "tiny" / "metrics.jsonl")]
    evals = {r["step"]: r for r in evals if r["kind"] == "eval"}
    for cmd, step in zip(AFTER_TINY[:2], (50, 30)):
        _run(_argv(cmd, tmp_path))
        got = json.load(open(tmp_path / "runs" / "tiny" / "eval" / f"step_{step}.json"))
        assert got["ne"] == evals[step]["ne"] and got["auc"] == evals[step]["auc"], (cmd, got, evals[step])
    _run(_plot_argv(tmp_path))
    assert (tmp_path / "runs" / "tiny" / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _plot_argv(tmp_path):
    """The plot command with both of its paths under the temporary directory."""
    words = _argv(AFTER_TINY[2], tmp_path)
    return [w.replace("--workdirs=runs/", f"--workdirs={tmp_path}/runs/").replace("--out=runs/", f"--out={tmp_path}/runs/")
            for w in words]


def _other_cpu_commands(tmp_path):
    # the analytic FLOPs command reproduces docs/performance.md's figure for it (1,161 MFLOP / sample)
    out = _run(_argv(FLOPS, tmp_path))
    got = float(re.search(r"\(([\d.]+) MFLOP / sample\)", out).group(1))
    page = open(PERFORMANCE).read()
    row = next(ln for ln in page.splitlines() if FLOPS.split(" ", 1)[1] in ln and ln.startswith("|"))
    quoted = float(re.search(r"([\d,]+) MFLOP per sample per train step", row).group(1).replace(",", ""))
    assert abs(got - quoted) / quoted < 0.01, f"docs say {quoted} MFLOP / sample, the command prints {got}"
    # the two launch rehearsals: each of the 2 processes reports the 2-process job
    for script, via in ((REHEARSE_SLURM, "slurm"), (REHEARSE_FLAGS, "explicit")):
        out = _run(_bash(script), shell=True, timeout=180)
        for i in (0, 1):
            assert f"process {i} of 2 ({via}" in out and "all-gather saw processes [0, 1]" in out, out[-2000:]
    assert _run(["bash", "./run", "env"]).startswith("extra=")
    assert "--steps" in _run(_argv(TOOL_HELP, tmp_path))      # the tool's own flags, run as a module


# ------------------------------------------------------------------ ./run's choice of jax build
def _fake_nvidia_smi(bin_dir, driver):
    path = bin_dir / "nvidia-smi"
    path.write_text("#!/bin/sh\ncase \"$*\" in *driver_version*) echo %s ;; *) echo 'GPU 0: NVIDIA H200' ;; esac\n"
                    % driver)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def _fake_image_python(tmp_path):
    """A Python 3.12 whose site-packages holds this suite's packages plus a jax CUDA plugin's
    metadata: the shape of a GPU image's interpreter, as far as `./run` can see."""
    image = tmp_path / "image"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(image)], check=True)
    site = next(image.glob("lib/python3.12/site-packages"))
    ours = [p for p in sys.path if p.rstrip("/").endswith("site-packages") and os.path.isdir(p)]
    (site / "suite.pth").write_text("import site; " + "; ".join(f"site.addsitedir({p!r})" for p in ours) + "\n")
    dist = site / f"jax_cuda13_plugin-{jax.__version__}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: jax-cuda13-plugin\nVersion: {jax.__version__}\n")
    return image / "bin" / "python"


def _run_script(args, cwd, **env):
    base = {k: v for k, v in os.environ.items() if not k.startswith(("GEMJAX_", "PIP_"))}
    return subprocess.run(["bash", "./run", *args], cwd=cwd, env={**base, **env}, capture_output=True, text=True,
                          timeout=240)


@pytest.mark.skipif(os.path.exists("/dev/nvidia0"), reason="a real GPU answers here")
def test_run_picks_cuda_when_a_gpu_answers_and_reuses_an_image_without_downloading(tmp_path):
    bins = tmp_path / "bin"
    bins.mkdir()
    path = os.environ["PATH"]
    assert _run_script(["env"], ROOT, PATH=path).stdout.startswith("extra=cpu source=pypi")
    _fake_nvidia_smi(bins, "580.159.03")
    assert _run_script(["env"], ROOT, PATH=f"{bins}:{path}").stdout.startswith("extra=cuda source=pypi")
    assert _run_script(["--cpu", "env"], ROOT, PATH=f"{bins}:{path}").stdout.startswith("extra=cpu ")
    _fake_nvidia_smi(bins, "535.104.05")
    assert _run_script(["env"], ROOT, PATH=f"{bins}:{path}").stdout.startswith("extra=cuda12 ")
    bad = _run_script(["env"], ROOT, PATH=path, GEMJAX_EXTRA="rocm")
    assert bad.returncode == 2 and "GEMJAX_EXTRA must be cpu, cuda or cuda12, got 'rocm'" in bad.stderr
    refused = _run_script(["env"], ROOT, PATH=path, GEMJAX_EXTRA="cuda", GEMJAX_SYSTEM_PACKAGES="1",
                          GEMJAX_PYTHON=sys.executable)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert f"a jax CUDA plugin of jax's version {jax.__version__} (found: none)" in refused.stderr

    # an image interpreter: .venv holds gemjax alone, everything else comes from the image, and
    # no index is asked (PIP_INDEX_URL points nowhere: any download would fail the setup)
    py = _fake_image_python(tmp_path)
    clone = tmp_path / "clone"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    for f in files:
        if os.path.isfile(os.path.join(ROOT, f)):
            os.makedirs(clone / os.path.dirname(f), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, f), clone / f)
    env = dict(PATH=f"{bins}:{path}", GEMJAX_PYTHON=str(py), PIP_INDEX_URL="http://127.0.0.1:9/simple")
    r = _run_script(["env"], clone, **env)
    assert r.stdout.startswith(f"extra=cuda12 source=system python={py}"), r.stdout + r.stderr
    r = _run_script(["setup"], clone, **env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"reusing {py}'s packages: jax {jax.__version__}" in r.stderr
    venv_site = next((clone / ".venv").glob("lib/python3.12/site-packages"))
    assert not [p for p in os.listdir(venv_site) if p.startswith(("jax", "flax", "numpy"))]
    probe = subprocess.run([str(clone / ".venv" / "bin" / "python"), "-c",
                            "import gemjax, jax, flax; print(gemjax.__file__); print(jax.__file__)"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=120)
    gem_file, jax_file = probe.stdout.split()
    assert gem_file.startswith(str(clone)) and not jax_file.startswith(str(clone)), probe.stdout + probe.stderr
    assert (clone / ".venv" / ".gemjax-installed").read_text().strip() == "extra=cuda12 source=system"

    # an image flax off the pins: auto falls back to PyPI naming it; GEMJAX_SYSTEM_PACKAGES=1 reuses it
    old = py.parent.parent / "lib" / "python3.12" / "site-packages" / "flax-0.11.0.dist-info"
    old.mkdir()
    (old / "METADATA").write_text("Metadata-Version: 2.1\nName: flax\nVersion: 0.11.0\n")
    r = _run_script(["env"], clone, **env)
    assert r.stdout.startswith("extra=cuda12 source=pypi") and "flax 0.11.0 (needs <0.13,>=0.12.10)" in r.stderr
    r = _run_script(["env"], clone, GEMJAX_SYSTEM_PACKAGES="1", **env)
    assert r.stdout.startswith("extra=cuda12 source=system") and "reused anyway: flax 0.11.0" in r.stderr
