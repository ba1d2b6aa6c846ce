#!/bin/bash
# The GPU checks and benchmarks, one section per argument, each capped in time, details under $OUT.
#
#   OUT=runs/gpu bash experiments/gpu_checks.sh kernels sparse      # one H200 (sparse_mgpu: >= 2)
#   bash experiments/gpu_checks.sh sweep                             # 2+ GPUs: scaling, MFU, cost model
#
# Sections (minutes on an H200, measured or estimated):
#   kernels      gpu-marked kernel tests + bench_attention with its tile sweep (~8)
#   sparse       bench_sparse on one GPU, every variant incl. the fused Pallas update (~2)
#   sparse_mgpu  gpu-marked sparse tests over all GPUs + bench sharded over them (~3)
#   sweep        sweep_mesh: weak scaling 1 -> all GPUs, Local/E2E MFU, calibrated cost model (~7);
#                SWEEP_OVERRIDE adds overrides, e.g. train.sparse_exchange_buckets=true
#   movielens    MovieLens-1M with the defaults (~4)
#   teacher_small  the `small` teacher (the ablation's model) on one device: step time and
#                each block timed alone, to see where its step goes (~2)
#   feed         the host input pipeline (bench_feed) with 1-8 Feeder threads, h200 preset (~1)
#   ablate       the teacher ablation, one process per variant sharing the GPU; ABLATE_STEPS
#                (default 2000) and ABLATE_OVERRIDE (e.g. data.batch_size=1024) scale it. Slow: on
#                `small` the teacher ran ~3 steps/s per process with 6 sharing one H200, so 2,000
#                steps x 3 seeds is more than one 10-minute device call
# Each section prints its table last and keeps its full log in $OUT/<section>.log.
set -u
OUT=${OUT:-runs/gpu_checks}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-}:. PYTHONUNBUFFERED=1
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

for s in "$@"; do
    case $s in
    kernels)
        section kernel_tests 180 $PY -m pytest -m gpu -q -rfE tests/test_kernels_block_attention.py \
            tests/test_kernels_gdpa.py tests/test_kernels_jagged_attention.py
        section kernel_bench 300 $PY experiments/bench_attention.py --workloads=W4,W1,W2,W3 --sweep \
            --sweep_budget_s=40 --sweep_deadline_s=160 --out "$OUT/bench_attention.json" ;;
    sparse)
        section sparse_bench 150 $PY experiments/bench_sparse.py --naive_rows=25000000 --probe_rows= \
            --out="$OUT/bench_sparse.json" ;;
    sparse_mgpu)
        section sparse_tests 150 $PY -m pytest -m gpu -q -rfE tests/test_sparse_gpu.py tests/test_sparse_fused.py
        section sparse_bench_sharded 60 $PY experiments/bench_sparse.py --shard --probe_rows= \
            --variants=sort_buckets,sort_buckets_xb,sort_buckets_bf16_xb \
            --out="$OUT/bench_sparse_sharded.json" ;;
    sweep)
        section sweep_mesh 540 $PY experiments/sweep_mesh.py --config=h200 \
            --override=model.kind=teacher,model.num_experts=4,model.top_k=2${SWEEP_OVERRIDE:+,$SWEEP_OVERRIDE} \
            --workdir="$OUT/sweep" ;;
    teacher_small)
        section teacher_small 240 $PY experiments/sweep_mesh.py --config=small \
            --override=model.kind=teacher,model.num_experts=4,model.attention=block \
            --shapes="replica=1" --workdir="$OUT/teacher_small" ;;
    feed)
        section feed 120 $PY experiments/bench_feed.py --config=h200 --workers=1,2,4,8 --step_ms=190 \
            --out="$OUT/bench_feed.json" ;;
    movielens)
        section movielens 300 $PY experiments/movielens.py --time_limit_s=240 --out="$OUT/movielens.json" ;;
    ablate)
        for v in full no_sequences no_pma no_cross_layer no_experts softmax_attention gdpa_attention; do
            f=--nowith_full; [ "$v" = full ] && f=
            XLA_PYTHON_CLIENT_MEM_FRACTION=0.12 timeout 3000 $PY experiments/ablate.py --config=small \
                --steps=${ABLATE_STEPS:-2000} --override="${ABLATE_OVERRIDE:-}" $f --variants=$v \
                --seeds=0,1,2 --workdir="$OUT/ablate" \
                --out="$OUT/ablate/$v.json" > "$OUT/ablate_$v.log" 2>&1 &
        done
        wait
        section ablate_table 120 $PY experiments/ablate.py --config=small --steps=${ABLATE_STEPS:-2000} \
            --override="${ABLATE_OVERRIDE:-}" --seeds=0,1,2 --workdir="$OUT/ablate" ;;
    *)
        echo "unknown section $s (kernels sparse sparse_mgpu sweep teacher_small feed movielens ablate)"; exit 2 ;;
    esac
done
