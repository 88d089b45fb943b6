#!/usr/bin/env bash
# The long-document reference run (results/longdoc/README.md): 16 documents x 4096 tokens of the
# NIAH essays, teacher-forced under each policy at the cpu-paper preset (block 16, the papers'
# budget 4096 / 16 = 256 and 512), FullKV first (every policy's reference). Run from the
# repository root with the data root reached through a relative path (a `data` link, ignored by
# git), so no machine path is recorded:
#     DATA=data bash results/run_longdoc.sh
# TASK=longdoc-needle runs the decode-time needle instead (results/needle/README.md): the needle
# in the forced part of 1024-, 2048- and 4096-token documents at depths 25% and 75%, asked at the
# end (256 to 3072 tokens after it was decoded); LENGTHS and DEPTHS override the grid
# (results/needle-grid/README.md has the 15-cell run's commands).
# Re-running resumes. POLICIES / BUDGETS2 / DOCS override the sets below; an entry may carry
# policy arguments after "+" (pyramidkv+decode_compress=true).
set -euo pipefail
DATA=${DATA:?set DATA to the benchmark data root (niah/ inside)}
TASK=${TASK:-longdoc}
KV=${KV:-.venv/bin/kvarena}
DOCS=${DOCS:-16}
case $TASK in
    longdoc) OUT=${OUT:-results/longdoc}
             TASK_ARGS=(--task-arg lengths=4096 --task-arg "documents=$DOCS")
             POOL=$((DOCS * 4096 + 1024)) ;;
    longdoc-needle) OUT=${OUT:-results/needle}
             LENGTHS=${LENGTHS:-1024,2048,4096} DEPTHS=${DEPTHS:-25.0,75.0}
             TASK_ARGS=(--task-arg "lengths=$LENGTHS" --task-arg "depths=$DEPTHS")
             # every cell at once: each length plus its 64-token prompt, once per depth
             IFS=, read -ra lens <<< "$LENGTHS"
             IFS=, read -ra deps <<< "$DEPTHS"
             POOL=0
             for n in "${lens[@]}"; do POOL=$((POOL + n + 64)); done
             POOL=$((POOL * ${#deps[@]})) ;;
    *) echo "TASK must be longdoc or longdoc-needle, got $TASK" >&2; exit 2 ;;
esac
COMMON=(--task "$TASK" --data "$DATA/niah" --preset cpu-paper "${TASK_ARGS[@]}"
        --kv-cache-tokens "$POOL" --threads 2 --out "$OUT" --no-leaderboard)
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
# Kara's comparison protocol (its Fig. 5): each document's budget is the length Kara kept on it
# (--match-budget-to its run); PyramidKV and Ada-KV in their decode-time mode.
KARA_MATCHED=${KARA_MATCHED:-"snapkv chunkkv streamingllm pyramidkv+decode_compress=true adakv+decode_compress=true"}
if [[ $TASK == longdoc ]]; then
    for p in $KARA_MATCHED; do
        mapfile -t args < <(policy_args "$p")
        "$KV" eval "${COMMON[@]}" "${args[@]}" \
            --match-budget-to "$OUT/smollm2-135m-instruct/longdoc/kara"
    done
    # The same at Kara's average KV instead of its final length: 1088 = its avg_kv_budget on
    # these documents (metrics.json), 68 pages.
    for p in ${KARA_AVERAGE:-"snapkv"}; do
        mapfile -t args < <(policy_args "$p")
        "$KV" eval "${COMMON[@]}" "${args[@]}" --kv-budget 1088
    done
    # GrowPage's equal-memory comparison: Zipage at GrowPage's average KV, 1744 = its avg_kv_kept
    # (1740) rounded up to a page, 109 pages.
    for p in ${GROWPAGE_AVERAGE:-"zipage"}; do
        mapfile -t args < <(policy_args "$p")
        "$KV" eval "${COMMON[@]}" "${args[@]}" --kv-budget 1744
    done
fi
"$KV" leaderboard "$OUT" --out "$OUT/leaderboard"
"$KV" report "$OUT" --out "$OUT/report.html"
