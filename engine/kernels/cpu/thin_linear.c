/* Thin float32 projections, y = x W^T (+ bias), for the few rows of a small decode batch.

   engine/kernels/cpu_native.py builds this file with paged_decode.c into one library. Why: a
   batch-1 step streams every weight once, and oneDNN's packed kernel streamed the small
   per-layer matrices well below the memory's rate (figures in
   results/benchmarks/cpu-kernels-notes.md).

     x     [T, K], row t at x + t * x_stride (the K values contiguous)
     w     [N, K] contiguous, the dense nn.Linear weight (out_features x in_features)
     bias  [N] or NULL
     y     [T, N] contiguous

   Each thread takes a contiguous share of the weight's rows and reads each row once from
   memory. One x row (batch 1): row after row, one sequential stream per thread, four
   accumulators per row so the FMAs do not wait on each other; that read the step's weights as
   fast as a plain sum of them, where the tiles below were 5-10% slower (median of 10 chains of
   SmolLM2's 121 projections, 2 threads). More x rows: ROWS weight rows at a time, held in L1
   while every x row meets them, two x rows at a time: 8 + ROWS + 1 vector registers (x86-64
   AVX2 has 16). Each output is one dot product summed in eight lanes, then across them (the
   summation order differs from MKL's and oneDNN's; built with -ffast-math). */

#include <stdint.h>

#include "kvarena_native.h"

#define ROWS 4

/* y[t0 + t, n + r] for t < xr (1 or 2) and r < wr (1 or ROWS). */
static inline __attribute__((always_inline)) void
tile(const float *restrict x, int64_t x_stride, const float *restrict w, int64_t K,
     const float *bias, float *restrict y, int64_t N, int64_t n, int64_t t0, const int xr,
     const int wr) {
    kv_v8 acc[2][ROWS];
    for (int t = 0; t < xr; t++)
        for (int r = 0; r < wr; r++) acc[t][r] = (kv_v8){0};
    const int64_t k8 = K & ~(int64_t)7;
    for (int64_t k = 0; k < k8; k += 8) {
        kv_v8 wv[ROWS];
        for (int r = 0; r < wr; r++) wv[r] = kv_load8(w + (n + r) * K + k);
        for (int t = 0; t < xr; t++) {
            kv_v8 xv = kv_load8(x + (t0 + t) * x_stride + k);
            for (int r = 0; r < wr; r++) acc[t][r] += wv[r] * xv;
        }
    }
    for (int t = 0; t < xr; t++) {
        const float *xt = x + (t0 + t) * x_stride;
        for (int r = 0; r < wr; r++) {
            float s = 0.0f;
            for (int i = 0; i < 8; i++) s += acc[t][r][i];
            for (int64_t k = k8; k < K; k++) s += w[(n + r) * K + k] * xt[k];
            y[(t0 + t) * N + n + r] = bias != 0 ? s + bias[n + r] : s;
        }
    }
}

/* Weight rows n .. n + wr - 1 against every x row. */
static inline __attribute__((always_inline)) void
weight_rows(const float *x, int64_t x_stride, const float *w, int64_t K, const float *bias,
            float *y, int64_t T, int64_t N, int64_t n, const int wr) {
    int64_t t = 0;
    for (; t + 2 <= T; t += 2) tile(x, x_stride, w, K, bias, y, N, n, t, 2, wr);
    if (t < T) tile(x, x_stride, w, K, bias, y, N, n, t, 1, wr);
}

/* One weight row against one x row: a single sequential read of the row. */
static inline float row_dot(const float *restrict w, const float *restrict x, int64_t K) {
    kv_v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        a0 += kv_load8(w + k) * kv_load8(x + k);
        a1 += kv_load8(w + k + 8) * kv_load8(x + k + 8);
        a2 += kv_load8(w + k + 16) * kv_load8(x + k + 16);
        a3 += kv_load8(w + k + 24) * kv_load8(x + k + 24);
    }
    for (; k + 8 <= K; k += 8) a0 += kv_load8(w + k) * kv_load8(x + k);
    kv_v8 a = (a0 + a1) + (a2 + a3);
    float s = 0.0f;
    for (int i = 0; i < 8; i++) s += a[i];
    for (; k < K; k++) s += w[k] * x[k];
    return s;
}

void kv_linear(const float *x, int64_t x_stride, const float *w, const float *bias, float *y,
               int64_t T, int64_t K, int64_t N) {
    if (T == 1) {
#pragma omp parallel for schedule(static) if (N * K > KV_PARALLEL_MIN)
        for (int64_t n = 0; n < N; n++) {
            float s = row_dot(w + n * K, x, K);
            y[n] = bias != 0 ? s + bias[n] : s;
        }
        return;
    }
    const int64_t tiles = N / ROWS;
#pragma omp parallel for schedule(static) if (N * K > KV_PARALLEL_MIN)
    for (int64_t i = 0; i < tiles; i++)
        weight_rows(x, x_stride, w, K, bias, y, T, N, i * ROWS, ROWS);
    for (int64_t n = tiles * ROWS; n < N; n++) weight_rows(x, x_stride, w, K, bias, y, T, N, n, 1);
}
