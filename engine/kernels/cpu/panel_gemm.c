/* Float32 projections, y = x W^T (+ bias), over a weight packed once into column panels.

   engine/kernels/cpu_native.py builds this file with the others into one library;
   engine/models/packed_linear.py has why (oneDNN's packed kernel ran these thin matmuls at
   55-67% of the two cores' fp32 peak; figures in results/benchmarks/cpu-kernels-notes.md).

     w       [N, K] contiguous, the dense nn.Linear weight (out_features x in_features)
     panels  [P, K, 16], P = ceil(N / 16): panel p holds output columns 16p .. 16p + 15, one
             64-byte line per k (zeros past N), so a panel is read front to back
     x       [T, K], row t at x + t * x_stride (the K values contiguous)
     bias    [N] or NULL
     y       [T, N] contiguous

   The micro-kernel keeps a tile of up to 6 x rows by one panel's 16 columns in 12 vector
   accumulators (AVX2 has 16 registers: 12 + 2 panel loads + 1 broadcast): per k, two loads of
   the panel line, one broadcast per x row, two FMAs per row. Each thread takes a contiguous
   share of the panels; a panel stays in L1/L2 while every row group of the block meets it, so
   the weight comes from memory once per block of BLOCK_ROWS rows. Row groups are as even as
   possible (32 rows: 6,6,5,5,5,5, not 6 x 5 + 2), since a short group does the same loads for
   fewer FMAs. Each output is one accumulator lane summed over k in order, whatever the group or
   the batch, so a row's result does not depend on the rows beside it. */

#include <stdint.h>
#include <string.h>

#include "kvarena_native.h"

#define TILE_ROWS 6
/* x rows per pass over the weight: 192 x K floats (442 KB at K = 576, 1.2 MB at K = 1536) stay
   in L2/L3 while each panel meets them (untuned beyond "prefill chunks were not slower"). */
#define BLOCK_ROWS 192

static inline void store8(float *p, kv_v8 v) { memcpy(p, &v, sizeof v); }

void kv_pack_panels(const float *w, float *panels, int64_t N, int64_t K) {
    const int64_t P = (N + KV_PANEL - 1) / KV_PANEL;
#pragma omp parallel for schedule(static) if (N * K > KV_PARALLEL_MIN)
    for (int64_t p = 0; p < P; p++)
        for (int64_t k = 0; k < K; k++)
            for (int c = 0; c < KV_PANEL; c++) {
                const int64_t n = p * KV_PANEL + c;
                panels[(p * K + k) * KV_PANEL + c] = n < N ? w[n * K + k] : 0.0f;
            }
}

/* y[m, n0 .. n0 + 15] for m < rows (1 .. TILE_ROWS) of x, against one panel. */
static inline __attribute__((always_inline)) void
tile(const float *restrict x, int64_t x_stride, const float *restrict panel, int64_t K,
     const float *bias, float *restrict y, int64_t N, int64_t n0, const int rows) {
    kv_v8 acc[TILE_ROWS][2];
    for (int m = 0; m < rows; m++) acc[m][0] = acc[m][1] = (kv_v8){0};
    for (int64_t k = 0; k < K; k++) {
        const kv_v8 w0 = kv_load8(panel + k * KV_PANEL), w1 = kv_load8(panel + k * KV_PANEL + 8);
        for (int m = 0; m < rows; m++) {
            const kv_v8 b = (kv_v8){0} + x[m * x_stride + k];
            acc[m][0] += b * w0;
            acc[m][1] += b * w1;
        }
    }
    if (n0 + KV_PANEL <= N) {
        for (int m = 0; m < rows; m++) {
            if (bias != 0) {
                acc[m][0] += kv_load8(bias + n0);
                acc[m][1] += kv_load8(bias + n0 + 8);
            }
            store8(y + m * N + n0, acc[m][0]);
            store8(y + m * N + n0 + 8, acc[m][1]);
        }
        return;
    }
    for (int m = 0; m < rows; m++) { /* the last panel of an N that 16 does not divide */
        float out[KV_PANEL];
        store8(out, acc[m][0]);
        store8(out + 8, acc[m][1]);
        for (int c = 0; n0 + c < N; c++)
            y[m * N + n0 + c] = out[c] + (bias != 0 ? bias[n0 + c] : 0.0f);
    }
}

static void group(const float *x, int64_t x_stride, const float *panel, int64_t K,
                  const float *bias, float *y, int64_t N, int64_t n0, int rows) {
    switch (rows) { /* constant row counts, so each tile's loops unroll into registers */
    case 6: tile(x, x_stride, panel, K, bias, y, N, n0, 6); break;
    case 5: tile(x, x_stride, panel, K, bias, y, N, n0, 5); break;
    case 4: tile(x, x_stride, panel, K, bias, y, N, n0, 4); break;
    case 3: tile(x, x_stride, panel, K, bias, y, N, n0, 3); break;
    case 2: tile(x, x_stride, panel, K, bias, y, N, n0, 2); break;
    default: tile(x, x_stride, panel, K, bias, y, N, n0, 1); break;
    }
}

void kv_panel_linear(const float *x, int64_t x_stride, const float *panels, const float *bias,
                     float *y, int64_t T, int64_t K, int64_t N) {
    const int64_t P = (N + KV_PANEL - 1) / KV_PANEL;
    for (int64_t t0 = 0; t0 < T; t0 += BLOCK_ROWS) {
        const int64_t rows = T - t0 < BLOCK_ROWS ? T - t0 : BLOCK_ROWS;
        const int64_t groups = (rows + TILE_ROWS - 1) / TILE_ROWS;
#pragma omp parallel for schedule(static) if (N * K > KV_PARALLEL_MIN)
        for (int64_t p = 0; p < P; p++) {
            int64_t t = t0;
            for (int64_t g = 0; g < groups; g++) {
                /* the first rows % groups groups take one row more */
                const int take = (int)(rows / groups + (g < rows % groups));
                group(x + t * x_stride, x_stride, panels + p * K * KV_PANEL, K, bias, y + t * N, N,
                      p * KV_PANEL, take);
                t += take;
            }
        }
    }
}
