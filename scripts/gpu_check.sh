#!/usr/bin/env bash
# The prepared GPU check (issue 22): the CUDA tests, the GPU benchmark, the device, in one go.
#
#   bash scripts/gpu_check.sh            # on a GPU machine: within 8 minutes on one GPU
#   bash scripts/gpu_check.sh --dry-run  # without a GPU: the same stages on the CPU, small sizes (< 2 minutes)
#
# Runs from the checkout (PYTHONPATH=src, `python3 -m ...`: distrib need not be installed). Everything
# goes to $OUT when set (the GPU machine returns that folder), else ./gpu-check/: gpu_check.log (this
# output, every stage's included), env.txt, cuda-tests.xml (junit), benchmark.json (benchmarks/gpu.py),
# function-table.jsonl (ds.function against eager, per strategy x feature: tests/cuda/test_cuda_function.py),
# capture-probe.json (benchmarks/capture_probe.py) and function-benchmark.json (benchmarks/function_step.py):
# 7 files, within what the GPU machine sends back (8).
# The mesh tests that fit one GPU (tests/cuda/test_cuda_mesh.py): MeshStrategy on one-worker meshes over NCCL
# (FSDP x TP 1x1, hybrid 1x1, hybrid x TP 1x1x1) against plain PyTorch; the meshes of several workers (hybrid 2x2,
# FSDP x TP 2x2, TP 4, the checkpoint matrix) need 4 GPUs, since NCCL refuses two ranks on one GPU (docs/mesh.md).
# Each stage is bounded by `timeout`; a failing stage does not stop the next; the exit status is non-zero
# when any stage failed. DISTRIB_CHECK_DEVICE=cpu is how the dry run runs the CUDA tests on the CPU.
# GPU_CHECK_STAGES=tests,benchmark,probe,function picks stages (the default: all but the probe), for a rerun in the
# time left.
set -u
cd "$(dirname "$0")/.."
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
OUTDIR="${OUT:-./gpu-check}"
mkdir -p "$OUTDIR"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
exec > >(tee "$OUTDIR/gpu_check.log") 2>&1
START=$(date +%s)
declare -a RESULTS=()
FAILED=0

stage() {  # stage NAME SECONDS LOGFILE COMMAND...: run bounded, its output also into LOGFILE; record its outcome
    local name=$1 limit=$2 logfile=$3; shift 3
    echo; echo "=== $name (limit ${limit}s) ==="
    local t0=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$logfile"
    local rc=${PIPESTATUS[0]}
    local took=$(( $(date +%s) - t0 ))
    if [ $rc -eq 0 ]; then RESULTS+=("PASS  $name (${took}s)")
    else RESULTS+=("FAIL  $name (exit $rc$([ $rc -eq 124 ] && echo ', timed out'), ${took}s)"); FAILED=1; fi
}

if [ $DRY -eq 1 ]; then
    export DISTRIB_CHECK_DEVICE=cpu
    DEVICE=cpu TESTS_LIMIT=200 PER_TEST=90 BENCH_LIMIT=150 FUNCTION_LIMIT=90  # 2 shared cores: ~60 s each when idle
    BENCH_ARGS=(--device cpu --batch 8 --rounds 1 --steps 2 --warmup 1 --large-batch 32 --large-steps 1
                --compile-precisions fp32 --compile-backend eager --mw-steps 2 --mw-timeout 60 --dispatch-calls 200)
    FUNCTION_ARGS=(--device cpu --rounds 1 --steps 4 --batch 8 --large-batch 0 --gpt 1,32,16,2 --gpt-steps 1)
else
    export DISTRIB_CHECK_DEVICE=cuda
    DEVICE=cuda TESTS_LIMIT=200 PER_TEST=150 BENCH_LIMIT=150 FUNCTION_LIMIT=240  # + set-up: within 8 minutes
    BENCH_ARGS=(--device cuda --budget-s 40 --rounds 3 --compile-precisions fp32)
    FUNCTION_ARGS=(--device cuda --rounds 7 --steps 300 --compile)  # --compile: torch.compile of the model too
fi

echo "=== environment ($( [ $DRY -eq 1 ] && echo 'DRY RUN on the CPU' || echo 'GPU check' ), $(date -u +%FT%TZ)) ==="
{
    git rev-parse HEAD 2>/dev/null | sed 's/^/commit /'
    if command -v nvidia-smi >/dev/null 2>&1; then nvidia-smi; else echo "nvidia-smi: not found"; fi
    "$PY" - <<'PY'
import platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| CUDA", torch.version.cuda,
      "| cuDNN", torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None)
print("cuda available:", torch.cuda.is_available(), "| devices:",
      [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else [])
print("nccl:", torch.distributed.is_nccl_available() if torch.distributed.is_available() else False,
      "| cpu threads:", torch.get_num_threads())
PY
} 2>&1 | tee "$OUTDIR/env.txt"
if [ $DRY -eq 0 ] && ! "$PY" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())'; then
    echo "CUDA is not available: the CUDA tests would all skip (use --dry-run to check the script on a CPU)"
    RESULTS+=("FAIL  environment (no CUDA)"); FAILED=1
fi

TIMEOUT_ARGS=()
"$PY" -c 'import pytest_timeout' 2>/dev/null && TIMEOUT_ARGS=(--timeout "$PER_TEST")
# the probe (benchmarks/capture_probe.py: 17 scenarios, each in its own process, 4 at once) runs when asked for
STAGES=",${GPU_CHECK_STAGES:-tests,benchmark,function},"
# addopts='': not the suite's --doctest-modules and -m 'not faults_full'; -m cuda selects these tests alone
rm -f "$OUTDIR/function-table.jsonl"
[[ $STAGES == *,tests,* ]] && DISTRIB_FUNCTION_TABLE="$OUTDIR/function-table.jsonl" \
stage "CUDA tests (DISTRIB_CHECK_DEVICE=$DISTRIB_CHECK_DEVICE)" "$TESTS_LIMIT" /dev/null \
    "$PY" -m pytest -m cuda ${GPU_CHECK_TESTS:-tests/cuda} -p no:cacheprovider -o addopts='' --import-mode=importlib -ra -v \
    "${TIMEOUT_ARGS[@]}" --junitxml="$OUTDIR/cuda-tests.xml"

[[ $STAGES == *,benchmark,* ]] && stage "benchmark (benchmarks/gpu.py ${BENCH_ARGS[*]})" "$BENCH_LIMIT" /dev/null \
    "$PY" benchmarks/gpu.py "${BENCH_ARGS[@]}" --json "$OUTDIR/benchmark.json"

[[ $STAGES == *,probe,* && $DRY -eq 0 ]] && stage "capture probe (benchmarks/capture_probe.py)" 300 /dev/null \
    "$PY" benchmarks/capture_probe.py --scenario all --parallel 4 --steps 300 --json "$OUTDIR/capture-probe.json"

[[ $STAGES == *,function,* ]] && stage "ds.function benchmark (benchmarks/function_step.py ${FUNCTION_ARGS[*]})" \
    "$FUNCTION_LIMIT" /dev/null "$PY" benchmarks/function_step.py "${FUNCTION_ARGS[@]}" \
    --json "$OUTDIR/function-benchmark.json"

echo; echo "=== summary ($(( $(date +%s) - START ))s, output in $OUTDIR) ==="
printf '%s\n' "${RESULTS[@]}"
exit $FAILED
