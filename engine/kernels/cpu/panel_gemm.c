/* Float32 projections, y = x W^T (+ bias), over a weight packed once into column panels.

   engine/kernels/cpu_native.py builds this file with the others into one library;
   engine/kernels/linear.py has why the weights are packed.

     w       [N, K] contiguous, the dense nn.Linear weight (out_features x in_features)
     panels  [P, K, 16], P = ceil(N / 16): panel p holds output columns 16p .. 16p + 15, one
             64-byte line per k (zeros past N), so a panel is read front to back
     x       [T, K], row t at x + t * x_stride (the K values contiguous)
     bias    [N] or NULL
     y       [T, N] contiguous

   The micro-kernel keeps a tile of x rows by the 16 columns of one or two panels in vector
   accumulators; per k, it loads the tile's panel lines, broadcasts each row's x value and
   issues one FMA per accumulator. Its size is the instruction set's (-march=native decides):
     AVX2     16 registers of 8 floats: up to 6 rows x one panel (12 accumulators, 2 panel
              loads, 1 broadcast);
     AVX-512  32 registers of 16 floats: up to 12 rows x two panels (24 accumulators, 2 panel
              loads, 1 broadcast), so that even a short row group keeps enough FMAs in flight.
   Each thread takes a contiguous share of the tiles' panels; a panel stays in L1/L2 while every
   row group of the block meets it, so the weight comes from memory once per block of
   BLOCK_ROWS rows. Row groups are as even as possible (32 rows on AVX2: 6,6,5,5,5,5, not
   6 x 5 + 2), since a short group does the same loads for fewer FMAs. Each output is one
   accumulator lane summed over k in order from zero, whatever the group, the batch or the
   instruction set, so a row's result does not depend on the rows beside it, and both builds
   give the same bits.

   A tile's first row group waits for its panel from memory, where the groups after it find it
   in cache: those later groups request the next tile's panels, line by line, so that they
   arrive while the groups compute (into KV_PREFETCH_LOCALITY's cache level: on AVX-512 a
   tile's two panels are larger than the L1 data cache). In a block of at most FIRST_REQUESTS
   groups (one on AVX2, two on AVX-512) the first group requests them too: with so few rows the
   weight's reads set the pace, so the requests start as early as they can; with more groups
   they would only take load slots from arithmetic on panels already in cache
   (results/benchmarks/cpu-kernels-notes.md, "Packed projections"). */

#include <stdint.h>
#include <string.h>

#include "kvarena_native.h"

#if defined(__AVX512F__)
typedef float vec __attribute__((vector_size(64)));
#define TILE_ROWS 12
#define TILE_PANELS 2
#define FIRST_REQUESTS 2 /* row groups in a block up to which the first one requests too */
#else
typedef kv_v8 vec;
#define TILE_ROWS 6
#define TILE_PANELS 1
#define FIRST_REQUESTS 1
#endif
#define LANES ((int)(sizeof(vec) / sizeof(float)))
#define LINE_VECS (KV_PANEL / LANES) /* vectors per panel line */
#define TILE_VECS (TILE_PANELS * LINE_VECS)
/* x rows per pass over the weight: 192 x K floats (442 KB at K = 576, 1.2 MB at K = 1536) stay
   in L2/L3 while each panel meets them (untuned beyond "prefill chunks were not slower"). */
#define BLOCK_ROWS 192

static inline vec load(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v); /* unaligned load */
    return v;
}

static inline void store(float *p, vec v) { memcpy(p, &v, sizeof v); }

/* Panel p of w: rows 16p .. 16p + 15 of w, one line per k. */
static inline void pack_panel(const float *w, float *panels, int64_t N, int64_t K, int64_t p) {
    for (int64_t k = 0; k < K; k++)
        for (int c = 0; c < KV_PANEL; c++) {
            const int64_t n = p * KV_PANEL + c;
            panels[(p * K + k) * KV_PANEL + c] = n < N ? w[n * K + k] : 0.0f;
        }
}

void kv_pack_panels(const float *w, float *panels, int64_t N, int64_t K) {
    const int64_t P = (N + KV_PANEL - 1) / KV_PANEL;
#pragma omp parallel for schedule(static) if (N * K > KV_PARALLEL_MIN)
    for (int64_t p = 0; p < P; p++) pack_panel(w, panels, N, K, p);
}

/* y[m, n0 .. n0 + 16 * panels - 1] for m < rows (1 .. TILE_ROWS) of x, against `panels`
   (1 .. TILE_PANELS) consecutive panels from `panel`; line k of the panel at `ahead` (or none)
   is requested with step k. */
static inline __attribute__((always_inline)) void
tile(const float *restrict x, int64_t x_stride, const float *restrict panel, int64_t K,
     const float *bias, float *restrict y, int64_t N, int64_t n0, const int rows,
     const int panels, const float *ahead) {
    const int vecs = panels * LINE_VECS;
    vec acc[TILE_ROWS][TILE_VECS];
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < vecs; j++) acc[m][j] = (vec){0};
    for (int64_t k = 0; k < K; k++) {
        if (ahead != 0)
            for (int q = 0; q < TILE_PANELS; q++)
                __builtin_prefetch(ahead + (q * K + k) * KV_PANEL, 0, KV_PREFETCH_LOCALITY);
        vec w[TILE_VECS];
        for (int j = 0; j < vecs; j++)
            w[j] = load(panel + ((j / LINE_VECS) * K + k) * KV_PANEL + (j % LINE_VECS) * LANES);
        for (int m = 0; m < rows; m++) {
            const vec b = (vec){0} + x[m * x_stride + k];
            for (int j = 0; j < vecs; j++) acc[m][j] += b * w[j];
        }
    }
    for (int q = 0; q < panels; q++) {
        const int64_t nq = n0 + q * KV_PANEL;
        for (int m = 0; m < rows; m++) {
            float out[KV_PANEL];
            for (int v = 0; v < LINE_VECS; v++) {
                vec a = acc[m][q * LINE_VECS + v];
                if (bias != 0 && nq + KV_PANEL <= N) a += load(bias + nq + v * LANES);
                store(out + v * LANES, a);
            }
            if (nq + KV_PANEL <= N) {
                memcpy(y + m * N + nq, out, sizeof out);
                continue;
            }
            for (int c = 0; nq + c < N; c++) /* the last panel of an N that 16 does not divide */
                y[m * N + nq + c] = out[c] + (bias != 0 ? bias[nq + c] : 0.0f);
        }
    }
}

/* Constant row and panel counts, so each tile's loops unroll into registers (and a constant
   `ahead` of 0, so that a tile without the prefetch has no test for it in its loop). */
#define TILE_CASE(r)                                                                          \
    case r:                                                                                   \
        if (panels == TILE_PANELS)                                                            \
            tile(x, x_stride, panel, K, bias, y, N, n0, r, TILE_PANELS, ahead);               \
        else tile(x, x_stride, panel, K, bias, y, N, n0, r, 1, ahead);                        \
        break;

static inline __attribute__((always_inline)) void
group_tiles(const float *x, int64_t x_stride, const float *panel, int64_t K, const float *bias,
            float *y, int64_t N, int64_t n0, int rows, int panels, const float *ahead) {
    switch (rows) {
#if TILE_ROWS > 6
    TILE_CASE(12) TILE_CASE(11) TILE_CASE(10) TILE_CASE(9) TILE_CASE(8) TILE_CASE(7)
#endif
    TILE_CASE(6) TILE_CASE(5) TILE_CASE(4) TILE_CASE(3) TILE_CASE(2)
    default: TILE_CASE(1)
    }
}

static void group(const float *x, int64_t x_stride, const float *panel, int64_t K,
                  const float *bias, float *y, int64_t N, int64_t n0, int rows, int panels,
                  const float *ahead) {
    if (ahead != 0) group_tiles(x, x_stride, panel, K, bias, y, N, n0, rows, panels, ahead);
    else group_tiles(x, x_stride, panel, K, bias, y, N, n0, rows, panels, 0);
}

/* Tile i (panels i * TILE_PANELS ...) against x rows [t0, t0 + rows), rows <= BLOCK_ROWS;
   `prefetch`: whether its groups request the next tile's panels (when it has all TILE_PANELS
   of them): those after the first, and the first too in a block of at most FIRST_REQUESTS
   groups (the file's comment). */
static inline void tile_rows(const float *x, int64_t x_stride, const float *panels,
                             const float *bias, float *y, int64_t K, int64_t N, int64_t i,
                             int64_t t0, int64_t rows, int prefetch) {
    const int64_t P = (N + KV_PANEL - 1) / KV_PANEL;
    const int64_t groups = (rows + TILE_ROWS - 1) / TILE_ROWS;
    const int64_t p = i * TILE_PANELS;
    const int take_panels = (int)(P - p < TILE_PANELS ? P - p : TILE_PANELS);
    const float *next = prefetch && p + 2 * TILE_PANELS <= P
                            ? panels + (p + TILE_PANELS) * K * KV_PANEL
                            : 0;
    int64_t t = t0;
    for (int64_t g = 0; g < groups; g++) {
        /* the first rows % groups groups take one row more */
        const int take = (int)(rows / groups + (g < rows % groups));
        group(x + t * x_stride, x_stride, panels + p * K * KV_PANEL, K, bias, y + t * N, N,
              p * KV_PANEL, take, take_panels, g > 0 || groups <= FIRST_REQUESTS ? next : 0);
        t += take;
    }
}

void kv_panel_linear(const float *x, int64_t x_stride, const float *panels, const float *bias,
                     float *y, int64_t T, int64_t K, int64_t N) {
    const int64_t P = (N + KV_PANEL - 1) / KV_PANEL;
    const int64_t tiles = (P + TILE_PANELS - 1) / TILE_PANELS;
    for (int64_t t0 = 0; t0 < T; t0 += BLOCK_ROWS) {
        const int64_t rows = T - t0 < BLOCK_ROWS ? T - t0 : BLOCK_ROWS;
#pragma omp parallel for schedule(static) if (N * K > KV_PARALLEL_MIN)
        for (int64_t i = 0; i < tiles; i++)
            tile_rows(x, x_stride, panels, bias, y, K, N, i, t0, rows, 1);
    }
}

void kv_pack_small(const float *w, float *panels, int64_t N, int64_t K) {
    for (int64_t p = 0; p < (N + KV_PANEL - 1) / KV_PANEL; p++) pack_panel(w, panels, N, K, p);
}

void kv_panel_small(const float *x, int64_t x_stride, const float *panels, float *y, int64_t T,
                    int64_t K, int64_t N) {
    const int64_t tiles = ((N + KV_PANEL - 1) / KV_PANEL + TILE_PANELS - 1) / TILE_PANELS;
    for (int64_t t0 = 0; t0 < T; t0 += BLOCK_ROWS) {
        const int64_t rows = T - t0 < BLOCK_ROWS ? T - t0 : BLOCK_ROWS;
        for (int64_t i = 0; i < tiles; i++)
            tile_rows(x, x_stride, panels, 0, y, K, N, i, t0, rows, 0);
    }
}
