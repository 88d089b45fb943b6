/* R-KV's key redundancy over one sequence's cached keys, read from the pages where they lie
   (engine/kernels/redundancy.py has the definition and the torch twin this equals).

   Per (layer, KV head), with K the sequence's first `length` keys, L2-normalised:
     S = K K^T with the diagonal zeroed; for each row i, its last similar key
     last(i) = max { j : S[i, j] > threshold } is spared (S[i, last(i)] := 0) and, with
     spare_first, a row without one has S[i, 0] := 0; redundancy[j] = softmax_j(colsum_j / length
     / temperature), colsum_j = sum_i S[i, j].
   With scope > 0 (Zipage's "lightning" form, redundancy.py's `block`), S holds only the pairs
   inside each run of `scope` slots and colsum_j is divided by scope instead of length; with a
   negative threshold the zeros across runs count as similar, so a row of any run but the last
   spares nothing (its last similar key lies in a later run, where S is 0) and never lacks one.

   How: S comes from the panel kernel (panel_gemm.c), the keys packed as the "weight", a strip of
   STRIP rows at a time, so memory is O(length x STRIP), not O(length^2). Each output of that
   kernel is one FMA chain over head_dim in order, so S[i, j] and S[j, i] are the same bits: the
   column sums are the row sums, less the spared entries, and only the part of S above the
   diagonal is formed (from each strip's first panel on). Row i's entries left of the diagonal
   are column i's above it, met in earlier rows: their running sum and the last of them above
   the threshold are kept per column as the rows go down. One (layer, head) per OpenMP task,
   the panel kernel on its task's thread. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "kvarena_native.h"

/* S rows held at once per task (a strip of STRIP x length floats). */
#define STRIP 48

/* The last j in [lo, hi) with row[j] > threshold, or -1: from the end, a block of SCAN entries
   at a time (each block's test is one vector pass), so a row where it lies near the end, as
   with a real model's similar keys, stops early. */
#define SCAN 32
static inline int64_t last_similar(const float *restrict row, int64_t lo, int64_t hi,
                                   float threshold) {
    while (hi - lo >= SCAN) {
        int any = 0;
        for (int64_t j = hi - SCAN; j < hi; j++) any |= row[j] > threshold;
        if (any) break;
        hi -= SCAN;
    }
    for (int64_t j = hi - 1; j >= lo; j--)
        if (row[j] > threshold) return j;
    return -1;
}

/* unit = key / (|key| + 1e-8), R-KV's normalisation: the key of `slot` in the pages of `keys`
   (block x d each, found through table). */
static inline void unit_key(const float *keys, const int64_t *table, int64_t block, int64_t d,
                            int64_t slot, float *unit) {
    const float *k = keys + (table[slot / block] * block + slot % block) * d;
    float squares = 0.0f;
    for (int64_t i = 0; i < d; i++) squares += k[i] * k[i];
    const float norm = sqrtf(squares) + 1e-8f;
    for (int64_t i = 0; i < d; i++) unit[i] = k[i] / norm;
}

/* out[j] := softmax over the `length` slots of out[j] (the scaled column sums). */
static void softmax_slots(float *out, int64_t length) {
    float top = -3.0e38f;
    for (int64_t j = 0; j < length; j++) top = out[j] > top ? out[j] : top;
    float total = 0.0f;
    for (int64_t j = 0; j < length; j++) {
        out[j] = expf(out[j] - top);
        total += out[j];
    }
    for (int64_t j = 0; j < length; j++) out[j] /= total;
}

/* One (layer, head): the keys of `length` slots in the pages of `keys` (block x head_dim each,
   found through table) -> out[length]. */
static int redundancy_head(const float *keys, const int64_t *table, int64_t length,
                           int64_t head_dim, int64_t block, float threshold, float temperature,
                           int spare_first, float *out) {
    const int64_t d = head_dim, panels = (length + KV_PANEL - 1) / KV_PANEL;
    float *unit = malloc((size_t)(length * d) * sizeof(float));
    float *packed = malloc((size_t)(panels * d * KV_PANEL) * sizeof(float));
    float *strip = malloc((size_t)(STRIP * length) * sizeof(float));
    /* per slot j: sum of S[r, j] over the rows r < j done so far; the last such r with S[r, j]
       above the threshold (-1: none) and that entry; S[0, j] (spare_first's S[j, 0]) */
    float *restrict above = malloc((size_t)length * sizeof(float));
    int64_t *restrict last_above = malloc((size_t)length * sizeof(int64_t));
    float *restrict last_value = malloc((size_t)length * sizeof(float));
    float *first_row = malloc((size_t)length * sizeof(float));
    int64_t *spared = malloc((size_t)length * sizeof(int64_t)); /* column row i spares, or -1 */
    float *value = malloc((size_t)length * sizeof(float));      /* S[i, spared[i]] */
    int error = KV_OK;
    if (unit == 0 || packed == 0 || strip == 0 || above == 0 || last_above == 0 ||
        last_value == 0 || first_row == 0 || spared == 0 || value == 0) {
        error = KV_NO_MEMORY;
        goto done;
    }
    for (int64_t t = 0; t < length; t++) {
        unit_key(keys, table, block, d, t, unit + t * d);
        above[t] = 0.0f;
        last_above[t] = -1;
        last_value[t] = 0.0f;
    }
    kv_pack_small(unit, packed, length, d);
    first_row[0] = 0.0f; /* the diagonal */
    for (int64_t i0 = 0; i0 < length; i0 += STRIP) {
        const int64_t rows = length - i0 < STRIP ? length - i0 : STRIP;
        const int64_t c0 = i0 / KV_PANEL * KV_PANEL, width = length - c0; /* columns c0.. */
        kv_panel_small(unit + i0 * d, d, packed + c0 * d, strip, rows, d, width);
        for (int64_t r = 0; r < rows; r++) {
            const int64_t i = i0 + r;
            const float *restrict row = strip + r * width - c0; /* row[j] = S[i, j], j >= c0 */
            float total = above[i];                             /* S[i, j] for j < i */
            /* passes the compiler vectorises: a real model's keys are similar to each other
               often enough that a branch on the threshold per entry mispredicts */
            for (int64_t j = i + 1; j < length; j++) {
                total += row[j];
                above[j] += row[j];
            }
            const int64_t found = last_similar(row, i + 1, length, threshold);
            for (int64_t j = i + 1; j < length; j++) {
                const int similar = row[j] > threshold;
                last_above[j] = similar ? i : last_above[j];
                last_value[j] = similar ? row[j] : last_value[j];
            }
            if (i == 0)
                for (int64_t j = 1; j < length; j++) first_row[j] = row[j];
            out[i] = total; /* row i's sum = column i's sum before sparing (S is symmetric) */
            if (found >= 0) {                   /* the last similar key lies right of i */
                spared[i] = found;
                value[i] = row[found];
            } else if (0.0f > threshold) {      /* else the zeroed diagonal, if it counts */
                spared[i] = i;
                value[i] = 0.0f;
            } else if (last_above[i] >= 0) {    /* else the last one left of i */
                spared[i] = last_above[i];
                value[i] = last_value[i];
            } else {
                spared[i] = spare_first ? 0 : -1;
                value[i] = spare_first ? first_row[i] : 0.0f;
            }
        }
    }
    for (int64_t i = 0; i < length; i++)
        if (spared[i] >= 0) out[spared[i]] -= value[i];
    for (int64_t j = 0; j < length; j++) out[j] = out[j] / (float)length / temperature;
    softmax_slots(out, length);
done:
    free(unit), free(packed), free(strip), free(above), free(last_above), free(last_value);
    free(first_row), free(spared), free(value);
    return error;
}

/* One (layer, head) in the per-run form (scope > 0): each run of `scope` slots is a small
   S of its own, formed directly (a run is a page: too small for the panel kernel to pay). */
static int run_redundancy_head(const float *keys, const int64_t *table, int64_t length,
                               int64_t head_dim, int64_t block, int64_t scope, float threshold,
                               float temperature, int spare_first, float *out) {
    const int64_t d = head_dim, runs = (length + scope - 1) / scope;
    float *unit = malloc((size_t)(scope * d) * sizeof(float));
    float *sim = malloc((size_t)(scope * scope) * sizeof(float));
    if (unit == 0 || sim == 0) {
        free(unit), free(sim);
        return KV_NO_MEMORY;
    }
    const int across = threshold < 0.0f && runs > 1; /* zeros across runs count as similar */
    for (int64_t g = 0; g < runs; g++) {
        const int64_t first = g * scope, n = length - first < scope ? length - first : scope;
        for (int64_t t = 0; t < n; t++) unit_key(keys, table, block, d, first + t, unit + t * d);
        for (int64_t i = 0; i < n; i++)
            for (int64_t j = 0; j < n; j++) {
                float dot = 0.0f;
                for (int64_t c = 0; c < d; c++) dot += unit[i * d + c] * unit[j * d + c];
                sim[i * n + j] = i == j ? 0.0f : dot;
            }
        const int spares = !(across && g < runs - 1);
        for (int64_t i = 0; i < n; i++) {
            float *row = sim + i * n;
            int64_t found = -1;
            for (int64_t j = 0; j < n; j++) found = row[j] > threshold ? j : found;
            if (!spares) continue;
            if (found >= 0)
                row[found] = 0.0f;
            else if (spare_first && !across && g == 0)
                row[0] = 0.0f; /* S[i, 0] is 0 outside the first run */
        }
        for (int64_t j = 0; j < n; j++) {
            float total = 0.0f;
            for (int64_t i = 0; i < n; i++) total += sim[i * n + j];
            out[first + j] = total / (float)scope / temperature;
        }
    }
    free(unit), free(sim);
    softmax_slots(out, length);
    return KV_OK;
}

int kv_key_redundancy(const float *k_cache, int64_t layer_stride, const int64_t *table,
                      int64_t length, float *out, int64_t layers, int64_t kv_heads,
                      int64_t head_dim, int64_t block, int64_t num_pages, float threshold,
                      float temperature, int spare_first, int64_t scope) {
    if (length < 0 || kv_heads < 1 || head_dim < 1 || block < 1 || scope < 0 ||
        !(temperature > 0.0f))
        return KV_BAD_SHAPE;
    const int64_t pages = (length + block - 1) / block;
    for (int64_t p = 0; p < pages; p++)
        if (table[p] < 0 || table[p] >= num_pages) return KV_BAD_PAGE;
    if (length == 0) return KV_OK; /* an empty output */
    const int64_t slots = num_pages * block;
    int error = KV_OK;
#pragma omp parallel for collapse(2) schedule(dynamic)
    for (int64_t l = 0; l < layers; l++)
        for (int64_t h = 0; h < kv_heads; h++) {
            const float *keys = k_cache + l * layer_stride + h * slots * head_dim;
            float *row = out + (l * kv_heads + h) * length;
            const int rc = scope > 0 ? run_redundancy_head(keys, table, length, head_dim, block,
                                                           scope, threshold, temperature,
                                                           spare_first, row)
                                     : redundancy_head(keys, table, length, head_dim, block,
                                                       threshold, temperature, spare_first, row);
            if (rc != KV_OK) {
#pragma omp atomic write
                error = rc;
            }
        }
    return error;
}
