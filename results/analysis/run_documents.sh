#!/usr/bin/env bash
# GrowPage's analysis studies on long documents (results/analysis/README.md): the demand study
# (Fig. 6) at the paper's geometry, its controls at the same length and block, and the
# counterfactual replay (Fig. 7). Demand: 16 documents x 4096 tokens of the NIAH essays,
# teacher-forced (a 64-token prompt), block 256 so a boundary is the paper's page and the
# horizon and exclusion are one page (256 tokens), the paper's betas (0.9, 0.999), decisions
# from 1024 tokens (summarised again from GrowPage's own 9-page start, 2304); then the synthetic
# controls with 16 requests of 4096 tokens at block 256 (the negative one at four seeds).
# Replay: the same documents and block, GrowPage's own start (9 pages) and protected window
# (16), the 256 tokens after each forced decision scored, the first and last usable demand
# boundary of each document. Run from the repository root:
#     DATA=data bash results/analysis/run_documents.sh
set -euo pipefail
DATA=${DATA:?set DATA to the benchmark data root (niah/ inside)}
KV=${KV:-.venv/bin/kvarena}
GEOMETRY=(--block-size 256 --initial-capacity 1024)
"$KV" analyze demand --documents 16 --doc-tokens 4096 --data "$DATA" "${GEOMETRY[@]}" \
    --per-query --threads 2
for control in positive negative nuisance nuisance-signal; do
    "$KV" analyze demand --control "$control" --control-tokens 4096 "${GEOMETRY[@]}" --threads 1
done
for seed in 1 2 3; do  # the negative control's null level on other draws of the process
    "$KV" analyze demand --control negative --control-tokens 4096 --seed "$seed" \
        "${GEOMETRY[@]}" --threads 1
done
for period in 4096 2048; do  # faster demand changes than the default 8 x (tau_L + horizon)
    "$KV" analyze demand --control positive --control-tokens 4096 --control-period "$period" \
        "${GEOMETRY[@]}" --threads 1
done
"$KV" analyze replay --documents 16 --doc-tokens 4096 --data "$DATA" --block-size 256 \
    --window 256 --max-boundaries 2 -a protected_recent=16 --threads 2
