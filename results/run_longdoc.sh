#!/usr/bin/env bash
# The long-document reference run (results/longdoc/README.md): 16 documents x 4096 tokens of the
# NIAH essays, teacher-forced under each policy at the cpu-paper preset (block 16, the papers'
# budget 4096 / 16 = 256 and 512), FullKV first (every policy's reference). Run from the
# repository root with the data root reached through a relative path (a `data` link, ignored by
# git), so no machine path is recorded:
#     DATA=data bash results/run_longdoc.sh
# Re-running resumes. POLICIES / BUDGETS2 / DOCS override the sets below; an entry may carry
# policy arguments after "+" (pyramidkv+decode_compress=true).
set -euo pipefail
DATA=${DATA:?set DATA to the benchmark data root (niah/ inside)}
OUT=${OUT:-results/longdoc}
KV=${KV:-.venv/bin/kvarena}
DOCS=${DOCS:-16}
COMMON=(--task longdoc --data "$DATA/niah" --preset cpu-paper --task-arg lengths=4096
        --task-arg "documents=$DOCS" --kv-cache-tokens $((DOCS * 4096 + 1024)) --threads 2
        --out "$OUT" --no-leaderboard)
# At the preset's budget (256); GrowPage runs at its own start (9 pages) and capacity.
POLICIES=${POLICIES:-"full snapkv growpage streamingllm h2o zipage growpage-fixed tova rkv"}
# The second budget (512) for the fixed-budget policies named here.
BUDGETS2=${BUDGETS2:-"snapkv"}
# "name+k=v+k=v" -> --policy name -a k=v -a k=v
policy_args() {
    local name=${1%%+*} rest=${1#*+} out
    out=(--policy "$name")
    if [[ $rest != "$1" ]]; then
        IFS=+ read -ra kvs <<< "$rest"
        for kv in "${kvs[@]}"; do out+=(-a "$kv"); done
    fi
    printf '%s\n' "${out[@]}"
}
for p in $POLICIES; do
    mapfile -t args < <(policy_args "$p")
    "$KV" eval "${COMMON[@]}" "${args[@]}"
done
for p in $BUDGETS2; do
    mapfile -t args < <(policy_args "$p")
    "$KV" eval "${COMMON[@]}" "${args[@]}" --kv-budget 512
done
"$KV" leaderboard "$OUT" --out "$OUT/leaderboard"
"$KV" report "$OUT" --out "$OUT/report.html"
