#!/usr/bin/env bash
# The prepared check for a machine with one CUDA GPU, in under 8 minutes. Run it from the
# repository root with the machine's own python3 (no venv, no install step):
#
#   OUT=gpu_out tools/gpu_check.sh            # on the GPU machine
#   PYTHON=.venv/bin/python tools/gpu_check.sh --dry-run   # here: the same parts on the CPU
#
# Parts, each under `timeout`, each logged to $OUT/<part>.log; a failing part does not stop the
# others:
#   env      python, torch, CUDA and nvidia-smi
#   gpu      python3 -m pytest -q -rs tests/gpu                              (skipped in --dry-run)
#   bench    torchrun --standalone --nproc-per-node 1 -m measure.gpu_bench --json $OUT/bench_gpu.json
#            (--dry-run: --model tiny --device cpu, gloo)
#   verify   torchrun --standalone --nproc-per-node 1 -m verify --quick --world-sizes 1
#   hostwork python3 -m measure.hostwork --device cuda: one step's host work at two widths
#            (--dry-run: on the CPU)
#   fast     torchrun ... -m verify --world-sizes 1 --precisions fp32 bf16 fp16
#            --optimizers adam adamw --mode fast --steps 3: lock-step cells on NCCL
#            (--dry-run: the MLP alone, stages 0 and 3, on the CPU)
#   gloo2x   python3 -m verify --quick --device cuda --backend gloo --world-sizes 1 2 4: the
#            cells and world-size invariance at N = 1, 2, 4 on one GPU, gloo ranks sharing it
#            (--dry-run: --device cpu, a few cells at N = 1 and 2 and their invariance)
#   figures  python3 -m paper_figures --profile smoke --only simulated_ranks --out $OUT/figures:
#            a simulated rank and its control measured with the CUDA allocator (--dry-run: on
#            the CPU)
# Then the bench's table (from its JSON) and, last, a summary: part | exit code | seconds | log.
#
#   OUT=gpu_out tools/gpu_check.sh --offload  # instead: the largest models with host offload
#   largest25  python3 -m measure.largest --shape 32 2560 --tiers memory --device cuda: the 2.5B
#              GPT (stage 3, bf16, N = 1) with ZeRO-Offload: host RSS per parameter, GPU peak,
#              seconds per step, construction seconds per billion (at most 180 s)
#   largest7b  the same at --shape 36 4096: 7.3B parameters on one GPU (at most 300 s)
#   (--dry-run --offload: the same parts on the CPU at --shape 4 512 and 6 512)
# torchrun is run as `$PYTHON -m torch.distributed.run`, so that it uses the same interpreter.
set -u

DRY=0
OFFLOAD=0
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY=1 ;;
        --offload) OFFLOAD=1 ;;
        -h | --help) sed -n '2,34p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "tools/gpu_check.sh: unknown argument: $arg (allowed: --dry-run, --offload)" >&2
           exit 2 ;;
    esac
done

if [ ! -f measure/gpu_bench.py ]; then
    echo "tools/gpu_check.sh: run it from the repository root" >&2
    exit 2
fi
OUT="${OUT:-gpu_out}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc-per-node 1)

# seconds per part: 10 + 110 + 120 + 50 + 30 + 45 + 85 + 30 = 480 at most, and most finish well
# before (the budgets of fast, gloo2x and figures are estimates: no GPU has run them yet)
declare -a ROWS=()
START_ALL=$SECONDS

part() { # part NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    local log="$OUT/$name.log" t0=$SECONDS rc
    echo "== $name (at most ${limit} s): $*" | tee "$log"
    timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1
    rc=$?
    [ $rc -eq 124 ] && echo "== $name: timed out after ${limit} s" >>"$log"
    ROWS+=("| $name | $rc | $((SECONDS - t0)) | $log |")
    echo "   exit $rc in $((SECONDS - t0)) s; last lines:"
    tail -n 3 "$log" | sed 's/^/   /'
}

skip() { # skip NAME WHY
    ROWS+=("| $1 | skipped: $2 | 0 | – |")
    echo "== $1: skipped ($2)"
}

part env 10 bash -c "$PY -c 'import sys, torch; print(sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"available\", torch.cuda.is_available())'; (nvidia-smi || echo 'no nvidia-smi'); nproc; free -g"

if [ $OFFLOAD -eq 1 ]; then  # the largest models with host offload, then the summary
    if [ $DRY -eq 1 ]; then
        LARGE=(--tiers memory --device cpu --steps 2 --dir "$OUT"); S25=(4 512); S7=(6 512)
    else
        LARGE=(--tiers memory --device cuda --steps 2 --dir "$OUT"); S25=(32 2560); S7=(36 4096)
    fi
    part largest25 180 "$PY" -m measure.largest --shape "${S25[@]}" "${LARGE[@]}" --json "$OUT/largest25.json"
    part largest7b 300 "$PY" -m measure.largest --shape "${S7[@]}" "${LARGE[@]}" --json "$OUT/largest7b.json"
    echo
    for f in "$OUT"/largest25.json "$OUT"/largest7b.json; do
        [ -f "$f" ] && "$PY" -c "import json,sys; r=json.load(open(sys.argv[1]))['memory'][0]; print({k: r.get(k) for k in ('params', 'failed', 'construct_s_per_billion', 'step_s', 'rss_built_per_param', 'peak_rss_per_param', 'split_per_param', 'gpu_peak_bytes')})" "$f"
    done
    { echo "| part | exit code | seconds | log file |"; echo "|---|---|---|---|"
      printf '%s\n' "${ROWS[@]}"; } | tee "$OUT/summary.md"
    exit 0
fi

if [ $DRY -eq 1 ]; then
    skip gpu "--dry-run has no GPU"
    BENCH_ARGS=(--model tiny --device cpu --steps 2 --warmup 1)
else
    part gpu 110 "$PY" -m pytest -q -rs -p no:cacheprovider tests/gpu
    BENCH_ARGS=()
fi

rm -f "$OUT/bench_gpu.json"
part bench 120 "${TORCHRUN[@]}" -m measure.gpu_bench ${BENCH_ARGS[@]+"${BENCH_ARGS[@]}"} --json "$OUT/bench_gpu.json"
part verify 50 "${TORCHRUN[@]}" -m verify --quick --world-sizes 1

if [ $DRY -eq 1 ]; then
    part hostwork 30 "$PY" -m measure.hostwork --widths 64 128 --layers 2 --stages 0 3 --sites
else
    part hostwork 30 "$PY" -m measure.hostwork --device cuda --widths 64 512 --layers 2 --stages 0 3 --sites
fi

FAST=(--world-sizes 1 --precisions fp32 bf16 fp16 --optimizers adam adamw --mode fast --steps 3)
if [ $DRY -eq 1 ]; then
    FAST+=(--models mlp --stages 0 3)
    GLOO=(--device cpu --backend gloo --world-sizes 1 2 --stages 0 3 --precisions fp32
          --optimizers adamw --models mlp --steps 2 --invariance)
else
    GLOO=(--quick --device cuda --backend gloo --world-sizes 1 2 4)
fi
part fast 45 "${TORCHRUN[@]}" -m verify "${FAST[@]}"
part gloo2x 85 "$PY" -m verify "${GLOO[@]}"
part figures 30 "$PY" -m paper_figures --profile smoke --only simulated_ranks --out "$OUT/figures"

echo
if [ -f "$OUT/bench_gpu.json" ]; then
    "$PY" -m measure.gpu_bench --from-json "$OUT/bench_gpu.json" | tee "$OUT/bench_table.md"
else
    echo "no bench table: $OUT/bench_gpu.json was not written (see $OUT/bench.log)"
fi
echo
echo "gpu_check$([ $DRY -eq 1 ] && echo ' --dry-run'): $((SECONDS - START_ALL)) s in all; logs under $OUT/"
{
    echo "| part | exit code | seconds | log file |"
    echo "|---|---|---|---|"
    printf '%s\n' "${ROWS[@]}"
} | tee "$OUT/summary.md"
