#!/usr/bin/env bash
# GPU check: the engine's CUDA paths on a CUDA machine, in under 10 minutes, into one folder.
#
#   bash scripts/gpu_check.sh [--dry-run] [OUT_DIR]     (default: runs/gpu_check/<UTC time>)
#
# Installs nothing and needs no checkpoint and no network: every model is built from a config with
# random weights (`kvarena bench step`). PYTHON picks the interpreter: default .venv/bin/python where
# the project's venv exists, else python3 (a GPU machine's own torch, triton and transformers; the
# project's other dependencies are not needed). Steps, each under its own time limit, each with a
# log in OUT_DIR:
#   env            nvidia-smi, torch/triton/CUDA versions, the GPU torch sees
#   kernels_cuda   tests/test_kernels_cuda.py: the compiled Triton kernels at the papers' scale
#                  (TRITON_INTERPRET removed from the environment)
#   engine_cuda    tests/test_engine_cuda.py: fp32 parity with transformers on CUDA, sampling at
#                  temperature 0.6, every policy in bf16 (TRITON_INTERPRET removed too)
#   step           `kvarena bench step`: ms per decode step at batch 1 and 64 (2k context) for FullKV
#                  and GrowPage on random Llama-3.1-8B / Qwen3-8B shapes, against transformers on the
#                  same GPU and the measured bandwidth floor; kernels, host syncs and GPU idle share
#                  per step from a profiler trace; bf16 agreement with transformers, sampling,
#                  every registered policy compressing, async compaction equal to sync
# --dry-run runs on the CPU instead (no GPU needed; CI runs it): env without nvidia-smi, the two
# CUDA test files collected only, and `bench step --dry-run` (tiny shape, fp32), so the script and
# the benchmark's code paths are checked where no GPU exists.
# tests/test_kernels.py is not run: it pins TRITON_INTERPRET=1 with CPU tensors by design (the
# interpreter check on machines without a GPU); its kernels are the ones the two test files above
# run compiled on the GPU. OUT_DIR/summary.txt lists each step's status and seconds; the exit code
# is non-zero when any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."

DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then DRY_RUN=1; shift; fi
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
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

if [ "$DRY_RUN" -eq 1 ]; then
    step env 60 "$PYTHON" -c "import torch, transformers; print('torch', torch.__version__, \
'transformers', transformers.__version__, 'cuda available', torch.cuda.is_available())"
    for name in kernels_cuda engine_cuda; do
        step "$name" 120 "$PYTHON" -m pytest -q --collect-only -p no:cacheprovider "tests/test_$name.py"
    done
    step step 300 "$PYTHON" -m cli bench step --dry-run ${STEP_ARGS:-} --out-dir "$OUT/step"
    echo "summary: $SUMMARY"
    exit $FAILED
fi

if ! "$PYTHON" -c "import torch, triton, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
        > "$OUT/preflight.log" 2>&1; then
    echo "error: $PYTHON has no CUDA torch with triton (see $OUT/preflight.log). Set the machine up" \
         "as docs/guide.md's 'GPUs' section says, or point PYTHON at that interpreter." | tee "$SUMMARY"
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
step kernels_cuda 150 "$PYTHON" -m pytest -q -rs -p no:cacheprovider tests/test_kernels_cuda.py \
    --junitxml="$OUT/kernels_cuda.xml"
step engine_cuda 150 "$PYTHON" -m pytest -q -rs -p no:cacheprovider tests/test_engine_cuda.py \
    --junitxml="$OUT/engine_cuda.xml"
step step 240 "$PYTHON" -m cli bench step --device cuda ${STEP_ARGS:-} --out-dir "$OUT/step"

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
