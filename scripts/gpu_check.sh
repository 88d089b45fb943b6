#!/usr/bin/env bash
# GPU check: the engine's CUDA paths on a CUDA machine, in under 10 minutes, into one folder.
#
#   bash scripts/gpu_check.sh [OUT_DIR]        (default: runs/gpu_check/<UTC time>)
#
# Installs nothing. Set the machine up as the README's "GPU users" section says (a venv with the
# CUDA build of torch, then `pip install -e '.[dev]'`); PYTHON picks another interpreter
# (default .venv/bin/python). Steps, each under its own time limit, each with a log in OUT_DIR:
#   env            nvidia-smi, torch/triton/CUDA versions, the GPU torch sees
#   kernels_cuda   tests/test_kernels_cuda.py: the compiled Triton kernels at the papers' scale
#                  (TRITON_INTERPRET removed from the environment)
#   engine_cuda    tests/test_engine_cuda.py: fp32 parity with transformers on CUDA, every policy in
#                  bf16 (TRITON_INTERPRET removed too)
#   bench          `kvarena bench throughput` at a small scale on the embedded default model
# tests/test_kernels.py is not run: it pins TRITON_INTERPRET=1 with CPU tensors by design (the
# interpreter check on machines without a GPU); its kernels are the ones the two test files above
# run compiled on the GPU. OUT_DIR/summary.txt lists each step's status and seconds; the exit code
# is non-zero when any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-.venv/bin/python}
OUT=${1:-runs/gpu_check/$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
FAILED=0
unset TRITON_INTERPRET

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to OUT/NAME.log, record status
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS status
    echo "== $name (limit ${limit}s): $*"
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    status=$?
    local took=$((SECONDS - start)) verdict=ok
    if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then verdict="TIMEOUT"; FAILED=1
    elif [ "$status" -ne 0 ]; then verdict="FAILED (exit $status)"; FAILED=1; fi
    printf '%-13s %-18s %4ss  %s\n' "$name" "$verdict" "$took" "$OUT/$name.log" | tee -a "$SUMMARY"
    tail -n 3 "$OUT/$name.log" | sed 's/^/    /'
}

if ! "$PYTHON" -c "import torch, triton, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
        > "$OUT/preflight.log" 2>&1; then
    echo "error: $PYTHON has no CUDA torch with triton (see $OUT/preflight.log). Set the machine up" \
         "as the README's 'GPU users' section says, or point PYTHON at that interpreter." | tee "$SUMMARY"
    exit 2
fi

step env 60 bash -c "nvidia-smi; $PYTHON - <<'EOF'
import torch, triton, transformers
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__,
      'transformers', transformers.__version__)
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f'gpu {i}: {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}')
EOF"
step kernels_cuda 240 "$PYTHON" -m pytest -q -rs -p no:cacheprovider tests/test_kernels_cuda.py \
    --junitxml="$OUT/kernels_cuda.xml"
step engine_cuda 150 "$PYTHON" -m pytest -q -rs -p no:cacheprovider tests/test_engine_cuda.py \
    --junitxml="$OUT/engine_cuda.xml"
step bench 150 "$PYTHON" -m cli bench throughput --model default --threads 8 \
    --uniform-requests 16 --uniform-tokens 64 --mixed-requests 32 --hf-batch-size 8 \
    --out-dir "$OUT/bench"

# On a GPU nothing here may skip: a skip means the GPU or the compiled kernels were not used.
for name in kernels_cuda engine_cuda; do
    if grep -q " skipped" "$OUT/$name.log"; then
        echo "$name: tests SKIPPED on a GPU machine (see the SKIPPED lines in $OUT/$name.log)" \
            | tee -a "$SUMMARY"
        FAILED=1
    fi
done
echo "summary: $SUMMARY"
exit $FAILED
