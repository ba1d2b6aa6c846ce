#!/bin/bash
# The GPU checks and benchmarks, one section per argument, each capped in time, details under $OUT.
# Run from the repository root: every program starts as `python -m <folder>.<module>`.
#
#   OUT=runs/gpu bash tools/gpu_checks.sh kernels sparse      # one H200 (sparse_mgpu: >= 2)
#   bash tools/gpu_checks.sh sweep                             # 2+ GPUs: scaling, MFU, cost model
#
# Sections (minutes on an H200, measured or estimated):
#   kernels      gpu-marked kernel tests + bench_attention with its tile sweep (~8)
#   kernel_tests_par  the same tests split over PAR parallel pytest processes sharing the GPU
#                (KT_CAP seconds, KT_MEM of its memory each; KT: other test files)
#   kernel_bench_w4   bench_attention on W4 only, with the per-block kernel's knob sweep
#                (chunked RoPE first) (~5)
#   triton_report the compiler's resource report of every kernel (tools/triton_report.py) (~1)
#   mosaic       the Mosaic GPU kernels (kernels/mosaic: GDPA and softmax, forward and
#                backward):
#                their gpu tests (with block_attention's) over 3 pytest processes (~10 min
#                serial), tools/bench_gdpa_mosaic.py's sweeps against the Triton
#                forwards on W1 (GDPA, then softmax), kernel_times.py (each kernel's device
#                time with the Mosaic backward's knobs), then bench_attention on W1 and W4
#                (Triton vs Mosaic, cuDNN, the Mosaic backward's knobs side by side) (~14);
#                its halves mosaic_tests (~5) and mosaic_bench (~9) fit one GPU each
#   mosaic_fused_dq  the Mosaic backward's fused_dq knob (one kernel for dQ, dK, dV): its gpu
#                tests over 3 processes, then W1 softmax and GDPA with and without it,
#                interleaved (tools/ab_attention.py) (~5)
#   fused_bwd    the Triton fused backwards (kernels/triton/backward.py fused_bwd "k_rows" /
#                "q_rows", dkv_split, dkv_split_tiles, rest_group): their gpu tests, then bench_attention on W2 and W3 with
#                the settings side by side (~4)
#   teacher_h200 the full teacher (4 experts, top 2) at the h200 preset through
#                experiments/train.py, TEACHER_STEPS steps, TEACHER_OVERRIDE more overrides (~4)
#   sparse       bench_sparse on one GPU: SPARSE_VARIANTS (default the fused Pallas update with
#                buckets, without (looped short rows / one program per group), the XLA update
#                with buckets, scatter) (~2)
#   sparse_mgpu  gpu-marked sparse tests over all GPUs + bench sharded over them (~3)
#   sweep        sweep_mesh: weak scaling 1 -> all GPUs, Local/E2E MFU, calibrated cost model (~7);
#                SWEEP_OVERRIDE adds overrides, e.g. train.sparse_sync_buckets=false;
#                SWEEP_PROFILE=N traces N steps per mesh and prints where device time goes
#   movielens    MovieLens-1M retrieval through the trainer, ML_EPOCHS epochs (default 100) (~5)
#   teacher_small  the `small` teacher (the ablation's model) on one device: step time and
#                each block timed alone, to see where its step goes (~2)
#   feed         the host input pipeline (bench_feed) with 1-8 Feeder threads, h200 preset (~1)
#   ncu_attention  Nsight Compute on the W1 softmax / GDPA Mosaic forwards and the W4
#                per-block forward (NCU_VARIANTS), stall samples per region (~3)
#   ablate       the teacher ablation, one process per variant sharing the GPU; ABLATE_STEPS
#                (default 2000), ABLATE_OVERRIDE (e.g. data.batch_size=2048) and ABLATE_SEEDS
#                scale it, ABLATE_CAP caps each process, ABLATE_WORKDIR may hold finished runs
#                of an earlier call (reused); the table holds the runs finished so far
# Each section prints its table last and keeps its full log in $OUT/<section>.log.
set -u
OUT=${OUT:-runs/gpu_checks}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

section() {  # name, seconds, command...
    local name=$1 secs=$2
    shift 2
    echo "=== $name (cap ${secs}s)"
    timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    grep -v -E '^[WI][0-9]{4} ' "$OUT/$name.log" | tail -n 40
    echo "=== $name rc=$rc"
}

# ncu_attention's program: a workload's forward (argv: W1-W4, an attention_workloads
# variant) run twice, so that ncu --launch-skip 1 profiles a launch after compilation
NCU_RUN='import sys
import jax, jax.numpy as jnp, numpy as np
from benchmarks.attention_workloads import op_fn, pack_arrays, parse_variant, workload
_, ql, kl = workload(sys.argv[1])
q, k, v, _, qo, ko = pack_arrays(ql, kl, 4, 128, jnp.bfloat16, np.random.default_rng(0))
f = jax.jit(op_fn(*parse_variant(sys.argv[2]), qo, ko, 1.0 / int(kl.max())))
for _ in range(2):
    jax.block_until_ready(f(q, k, v))'

for s in "$@"; do
    case $s in
    kernels)
        section kernel_tests 180 $PY -m pytest -m gpu -q -rfE tests/test_kernels_block_attention.py \
            tests/test_kernels_gdpa.py tests/test_kernels_jagged_attention.py \
            tests/test_kernels_fused_backward.py
        section kernel_bench 300 $PY -m benchmarks.bench_attention --workloads=W4,W1,W2,W3 --sweep \
            --sweep_budget_s=40 --sweep_deadline_s=160 --out "$OUT/bench_attention.json" ;;
    kernel_tests_par)
        # the gpu-marked kernel tests split over PAR (default 3) pytest processes sharing the
        # GPU: Triton compiles are CPU-bound, so they overlap
        KT=${KT:-tests/test_kernels_block_attention.py tests/test_kernels_gdpa.py tests/test_kernels_jagged_attention.py tests/test_kernels_fused_backward.py}
        # KT_SELECT: a pytest -k expression; KT_SHARD=i/n keeps every n-th test from the
        # i-th (e.g. one shard per GPU); files
        # under $OUT/$KT_TAG* (default kernel)
        T="$OUT/${KT_TAG:-kernel}"
        $PY -m pytest -m gpu --co -q -o addopts="" $KT ${KT_SELECT:+-k "$KT_SELECT"} 2>/dev/null | grep '::' \
            | awk -v s="${KT_SHARD:-0/1}" 'BEGIN {split(s, a, "/")} (NR - 1) % a[2] == a[1]' \
            > "${T}_test_ids.txt"
        split -n r/${PAR:-3} "${T}_test_ids.txt" "${T}_ids_"
        for f in "${T}"_ids_??; do
            XLA_PYTHON_CLIENT_MEM_FRACTION=${KT_MEM:-0.25} timeout ${KT_CAP:-360} $PY -m pytest -m gpu -q -rfE --durations=5 $(cat "$f") > "$f.log" 2>&1 &
        done
        wait
        echo "=== ${KT_TAG:-kernel}_tests_par: $(wc -l < "${T}_test_ids.txt") tests"
        tail -n 12 "${T}"_ids_??.log ;;
    kernel_bench_w4)
        section kernel_bench_w4 300 $PY -m benchmarks.bench_attention --workloads=W4 ${W4_SWEEP---sweep} \
            --sweep_budget_s=200 --sweep_deadline_s=260 --out "$OUT/bench_attention_w4.json" ;;
    triton_report)
        # the compiler's resource report of every kernel (registers, spills, shared memory,
        # occupancy) with the triton package of the device image
        section triton_report 240 $PY -m tools.triton_report --out="$OUT/triton_report" ;;
    mosaic)
        OUT="$OUT" bash "$0" mosaic_tests mosaic_bench ;;
    mosaic_tests)
        KT="tests/test_kernels_mosaic_flash.py tests/test_kernels_block_attention.py" KT_TAG=mosaic \
            KT_CAP=${KT_CAP:-300} OUT="$OUT" bash "$0" kernel_tests_par ;;
    mosaic_bench)
        section mosaic_bench 90 $PY -m tools.bench_gdpa_mosaic --sweep --sweep_deadline_s=50 \
            --out="$OUT/bench_gdpa_mosaic.json"
        section mosaic_bench_softmax 90 $PY -m tools.bench_gdpa_mosaic --mode=softmax --sweep \
            --sweep_deadline_s=50 --out="$OUT/bench_gdpa_mosaic_softmax.json"
        section kernel_times 120 $PY -m tools.kernel_times --out="$OUT/kernel_times.json" \
            --variants="softmax_mosaic,softmax_mosaic[fused_dq=1],gdpa_mosaic,gdpa_mosaic[fused_dq=1]"
        section mosaic_w1_w4 240 $PY -m benchmarks.bench_attention --workloads=W1,W4 \
            --rows=mosaic,cudnn,pallas_softmax,pallas_gdpa_silu,block,softmax_W1 \
            --out="$OUT/bench_attention_w1_w4.json" ;;
    mosaic_fused_dq)
        KT="tests/test_kernels_mosaic_flash.py" KT_TAG=fused_dq KT_CAP=${KT_CAP:-200} \
            KT_SELECT="fused_dq or _fused" OUT="$OUT" bash "$0" kernel_tests_par
        section ab_fused_dq_softmax 120 $PY -m tools.ab_attention --workload=W1 --rounds=4 \
            --variants="softmax_mosaic,softmax_mosaic[fused_dq=1]" --out="$OUT/ab_fused_dq_softmax.json"
        section ab_fused_dq_gdpa 120 $PY -m tools.ab_attention --workload=W1 --rounds=4 \
            --variants="gdpa_mosaic,gdpa_mosaic[fused_dq=1]" --out="$OUT/ab_fused_dq_gdpa.json" ;;
    fused_bwd)
        section fused_bwd_tests 240 $PY -m pytest -m gpu -q -rfE tests/test_kernels_fused_backward.py
        section fused_bwd_bench 200 $PY -m benchmarks.bench_attention --workloads=W2,W3 --nobaselines \
            --out="$OUT/bench_attention_w2_w3.json" ;;
    teacher_h200)
        # the full teacher at the h200 preset through the standard train script
        section teacher_h200 330 $PY -m experiments.train --config=h200 --steps=${TEACHER_STEPS:-200} \
            --override=model.kind=teacher,model.num_experts=4,model.top_k=2,train.log_every=25,train.eval_every=100000,train.checkpoint_every=100000${TEACHER_OVERRIDE:+,$TEACHER_OVERRIDE} \
            --workdir="$OUT/teacher_h200" ;;
    sparse)
        section sparse_bench 150 $PY -m benchmarks.bench_sparse --naive_rows=25000000 --probe_rows= \
            --variants=${SPARSE_VARIANTS:-sort_buckets_pallas,sort_pallas_looped,sort_pallas,sort_buckets,scatter} \
            --out="$OUT/bench_sparse.json" ;;
    sparse_mgpu)
        section sparse_tests 150 $PY -m pytest -m gpu -q -rfE tests/test_sparse_gpu.py tests/test_sparse_fused.py
        section sparse_bench_sharded 60 $PY -m benchmarks.bench_sparse --shard --probe_rows= \
            --variants=sort_buckets,sort_buckets_xb,sort_buckets_bf16_xb \
            --out="$OUT/bench_sparse_sharded.json" ;;
    sweep)
        section sweep_mesh 540 $PY -m experiments.sweep_mesh --config=h200 \
            --override=model.kind=teacher,model.num_experts=4,model.top_k=2${SWEEP_OVERRIDE:+,$SWEEP_OVERRIDE} \
            ${SWEEP_PROFILE:+--profile_steps=$SWEEP_PROFILE} --workdir="$OUT/sweep" ;;
    teacher_small)
        section teacher_small 240 $PY -m experiments.sweep_mesh --config=small \
            --override=model.kind=teacher,model.num_experts=4,model.attention=block \
            --shapes="replica=1" --workdir="$OUT/teacher_small" ;;
    feed)
        section feed 120 $PY -m benchmarks.bench_feed --config=h200 --workers=1,2,4,8 --step_ms=190 \
            --out="$OUT/bench_feed.json" ;;
    movielens)
        section movielens 600 $PY -m experiments.movielens --epochs=${ML_EPOCHS:-100} --workdir="$OUT/movielens" ;;
    ablate)
        # ABLATE_CAP (s, default 3000) caps every variant's process; ABLATE_WORKDIR (default
        # $OUT/ablate) may hold earlier finished runs (config.json + summary.json), reused.
        AWD=${ABLATE_WORKDIR:-$OUT/ablate}
        mkdir -p "$AWD"
        export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/gemjax-ablate-cache}
        for v in full no_sequences no_pma no_cross_layer no_experts softmax_attention gdpa_attention; do
            f=--nowith_full; [ "$v" = full ] && f=
            XLA_PYTHON_CLIENT_MEM_FRACTION=0.12 timeout ${ABLATE_CAP:-3000} $PY -m experiments.ablate \
                --config=small --steps=${ABLATE_STEPS:-2000} --override="${ABLATE_OVERRIDE:-}" $f \
                --variants=$v --seeds=${ABLATE_SEEDS:-0,1,2} --workdir="$AWD" \
                --out="$AWD/$v.json" > "$OUT/ablate_$v.log" 2>&1 &
        done
        wait
        section ablate_table 120 $PY -m experiments.ablate --config=small --steps=${ABLATE_STEPS:-2000} \
            --override="${ABLATE_OVERRIDE:-}" --seeds=${ABLATE_SEEDS:-0,1,2} --workdir="$AWD" \
            --table_only --out="$OUT/ablate.json" ;;
    ncu_attention)
        # Nsight Compute on the second forward launch of each NCU_VARIANTS entry (W1; block:
        # W4), its SASS page summarized by sass_stalls.py (docs/kernels.md)
        NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
        for v in ${NCU_VARIANTS:-softmax_mosaic gdpa_mosaic block_triton}; do
            case $v in block*) k=block_attention_fwd wl=W4 ;; *) k=regex:mosaic wl=W1 ;; esac
            timeout 240 "$NCU" --clock-control none --kernel-name "$k" --launch-skip 1 \
                --launch-count 1 --set full --import-source no -o "$OUT/ncu_$v" -f \
                $PY -c "$NCU_RUN" "$wl" "$v" > "$OUT/ncu_$v.log" 2>&1
            "$NCU" -i "$OUT/ncu_$v.ncu-rep" --page details > "$OUT/ncu_${v}_details.txt"
            "$NCU" -i "$OUT/ncu_$v.ncu-rep" --page source --print-source sass --csv \
                | gzip > "$OUT/ncu_${v}_sass.csv.gz"
            echo "=== ncu $v"
            $PY -m tools.sass_stalls "$OUT/ncu_${v}_sass.csv.gz" --regions=4 --mix=1
        done ;;
    *)
        echo "unknown section $s (kernels kernel_tests_par kernel_bench_w4 triton_report mosaic mosaic_tests mosaic_bench fused_bwd teacher_h200 sparse sparse_mgpu sweep teacher_small feed movielens ablate ncu_attention)"; exit 2 ;;
    esac
done
