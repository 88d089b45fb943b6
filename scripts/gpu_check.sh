#!/usr/bin/env bash
# GPU check: the engine's CUDA paths on a CUDA machine, in at most 420 s of steps, into one folder.
#
#   bash scripts/gpu_check.sh [--dry-run] [OUT_DIR]     (default: runs/gpu_check/<UTC time>)
#
# Installs nothing and needs no checkpoint and no network: every model is built from a config with
# random weights (`kvarena bench step`). PYTHON picks the interpreter: default .venv/bin/python where
# the project's venv exists, else python3 (a GPU machine's own torch, triton and transformers; the
# project's other dependencies are not needed). Steps, most important first, each under its own
# time limit (seconds; they add up to 420), each with a log in OUT_DIR that `bench step` writes
# line by line, so a step cut short still leaves the figures it reached:
#   env            15  nvidia-smi, torch/triton/CUDA versions, the GPU torch sees
#   step_eager    100  `bench step --parts step --modes eager`, Llama-3.1-8B shape (131072
#                      positions, KV pool sized by tokens): ms per decode step of FullKV, Zipage and
#                      GrowPage at batch 1 and 64 (2k context), greedy and T=0.6, as a ratio to the
#                      reference step (nano-vLLM's shape, one CUDA graph) and to transformers, the
#                      bandwidth floor, kernels, host syncs, idle share, GrowPage's overhead share
#   step_compiled 120  the same with `--modes compiled` (EngineConfig.compile: torch.compile and
#                      CUDA graphs), no transformers
#   checks         50  `bench step --parts checks`: bf16 agreement with transformers, sampling at
#                      T=0.6, every registered policy recording compression events (FullKV none),
#                      async compaction equal to sync
#   kernels_cuda   45  tests/test_kernels_cuda.py: the compiled Triton kernels at the papers' scale
#                      (TRITON_INTERPRET removed from the environment)
#   engine_cuda    45  tests/test_engine_cuda.py: fp32 parity with transformers on CUDA, sampling at
#                      temperature 0.6, every policy in bf16 (TRITON_INTERPRET removed too)
#   e2e            45  `bench step --parts e2e`: TPS of 64 requests (512-token prompts, 128 new)
#                      per policy, eager, budgets below the prompt so compression fires
# STEP_ARGS is appended to every `bench step` command (e.g. STEP_ARGS="--shapes qwen3-8b").
# --dry-run runs on the CPU instead (no GPU needed; CI runs it): env without nvidia-smi, the two
# CUDA test files collected only, and each `bench step` part with --dry-run (tiny shape, fp32);
# step_compiled is recorded as skipped there, with the reason (inductor's C++ compile of the step
# takes minutes on a small CPU machine), so the script and the benchmark's code paths are checked
# where no GPU exists.
# tests/test_kernels.py is not run: it pins TRITON_INTERPRET=1 with CPU tensors by design (the
# interpreter check on machines without a GPU); its kernels are the ones the two test files above
# run compiled on the GPU. OUT_DIR/summary.txt lists each step's status, seconds and limit; the
# exit code is non-zero when any step failed.
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
    printf '%-13s %-18s %4ss of %4ss  %s\n' "$name" "$verdict" "$took" "$limit" "$OUT/$name.log" \
        | tee -a "$SUMMARY"
    tail -n 3 "$OUT/$name.log" | sed 's/^/    /'
}

skip() {  # skip NAME REASON: a step this run leaves out, in the summary with its reason
    printf '%-13s %-18s %4ss of %4ss  %s\n' "$1" "skipped" 0 0 "$2" | tee -a "$SUMMARY"
}

BENCH=("$PYTHON" -m cli bench step)
if [ "$DRY_RUN" -eq 1 ]; then
    # CPU limits are the GPU's scaled for a small shared machine; the order is the GPU run's.
    step env 60 "$PYTHON" -c "import torch, transformers; print('torch', torch.__version__, \
'transformers', transformers.__version__, 'cuda available', torch.cuda.is_available())"
    # shellcheck disable=SC2086
    step step_eager 240 "${BENCH[@]}" --dry-run --parts step ${STEP_ARGS:-} --out-dir "$OUT/step_eager"
    skip step_compiled "compiled on CPU: inductor's C++ compile of the step takes minutes on a small machine"
    # shellcheck disable=SC2086
    step checks 180 "${BENCH[@]}" --dry-run --parts checks ${STEP_ARGS:-} --out-dir "$OUT/checks"
    for name in kernels_cuda engine_cuda; do
        step "$name" 120 "$PYTHON" -m pytest -q --collect-only -p no:cacheprovider "tests/test_$name.py"
    done
    # shellcheck disable=SC2086
    step e2e 120 "${BENCH[@]}" --dry-run --parts e2e ${STEP_ARGS:-} --out-dir "$OUT/e2e"
    echo "summary: $SUMMARY"
    exit $FAILED
fi

if ! "$PYTHON" -c "import torch, triton, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
        > "$OUT/preflight.log" 2>&1; then
    echo "error: $PYTHON has no CUDA torch with triton (see $OUT/preflight.log). Set the machine up" \
         "as docs/guide.md's 'GPUs' section says, or point PYTHON at that interpreter." | tee "$SUMMARY"
    exit 2
fi

LLAMA=(--device cuda --shapes llama-3.1-8b)
step env 15 bash -c "nvidia-smi; $PYTHON - <<'EOF'
import torch, triton, transformers
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__,
      'transformers', transformers.__version__)
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f'gpu {i}: {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}')
EOF"
# shellcheck disable=SC2086
step step_eager 100 "${BENCH[@]}" "${LLAMA[@]}" --parts step --modes eager ${STEP_ARGS:-} \
    --out-dir "$OUT/step_eager"
# shellcheck disable=SC2086
step step_compiled 120 "${BENCH[@]}" "${LLAMA[@]}" --parts step --modes compiled --no-transformers \
    --policies full,growpage,zipage \
    ${STEP_ARGS:-} --out-dir "$OUT/step_compiled"
# shellcheck disable=SC2086
step checks 50 "${BENCH[@]}" "${LLAMA[@]}" --parts checks ${STEP_ARGS:-} --out-dir "$OUT/checks"
step kernels_cuda 45 "$PYTHON" -m pytest -q -rs -p no:cacheprovider tests/test_kernels_cuda.py \
    --junitxml="$OUT/kernels_cuda.xml"
step engine_cuda 45 "$PYTHON" -m pytest -q -rs -p no:cacheprovider tests/test_engine_cuda.py \
    --junitxml="$OUT/engine_cuda.xml"
# shellcheck disable=SC2086
step e2e 45 "${BENCH[@]}" "${LLAMA[@]}" --parts e2e --modes eager ${STEP_ARGS:-} --out-dir "$OUT/e2e"

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
