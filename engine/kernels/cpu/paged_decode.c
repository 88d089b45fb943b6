/* The CPU decode step's paged kernels for float32, reading the KV pages in place.

   engine/kernels/cpu_native.py builds this file once per machine and calls it through ctypes;
   its docstring has the shapes and why it exists (figures: results/benchmarks/cpu-kernels-notes.md).
   Layouts (all float32, C order):

     cache (one layer):  [kv_heads, num_pages * block_size, head_dim]   (flat slot = page * bs + off)
     key, value rows:    row t, head h at  key + t * key_stride + h * head_dim
     q:                  row b, head h at  q + b * q_stride + h * head_dim
     out:                [B, q_heads, head_dim], contiguous
     tables:             [B, table_stride] int64 page ids (-1 past a row's pages)
     lens:               [B] int64 slots each row attends (0: a padded row, zero output)
     holes:              [B, kv_heads, 2] int64 (start, end) of skipped slots, or NULL

   Every index read from the tables, lengths, holes and slot mapping is checked before it is
   used; a bad one stops the kernel with an error code (KV_*, kvarena_native.h) instead of
   reading or writing out of bounds, and the caller raises. Compiled with OpenMP: built by gcc
   beside a pip torch, the runtime it links is torch's own (same soname, already loaded), so the
   threads are torch's, set by torch.set_num_threads; cpu_native.py refuses a build that loads
   another runtime (clang's libomp). */

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvarena_native.h"

/* Scores of masked slots: finite (the file is built with -ffast-math, which assumes no
   infinities), far below any real score, so exp() of it relative to a real maximum is 0. */
#define MASKED (-1.0e30f)
#define MAX_BLOCK 1024
#define MAX_GROUP 64
#define MAX_GROUP_DIM 8192

/* Pages lie anywhere in the cache, and the hardware prefetcher, which follows a stream, stops
   at a page's end: the kernels that walk a sequence's pages request the next page's keys (and
   its values, where they read them in the same walk) PREFETCH_PAGES pages ahead, so that they
   arrive while the current page is computed (into KV_PREFETCH_LOCALITY's cache level). */
#define PREFETCH_PAGES 1

static inline void prefetch_page(const float *p, int64_t floats) {
    for (int64_t i = 0; i < floats; i += 16) __builtin_prefetch(p + i, 0, KV_PREFETCH_LOCALITY);
}

/* prefetch_page of a key page and a value page, their lines requested in turn */
static inline void prefetch_pages(const float *k, const float *v, int64_t floats) {
    for (int64_t i = 0; i < floats; i += 16) {
        __builtin_prefetch(k + i, 0, KV_PREFETCH_LOCALITY);
        __builtin_prefetch(v + i, 0, KV_PREFETCH_LOCALITY);
    }
}

int kv_store(const float *key, const float *value, int64_t key_stride, int64_t value_stride,
             float *k_cache, float *v_cache, const int64_t *slots, int64_t rows,
             int64_t kv_heads, int64_t head_dim, int64_t num_slots) {
    for (int64_t t = 0; t < rows; t++) {
        int64_t s = slots[t];
        if (s < -1 || s >= num_slots) return KV_BAD_SLOT;
    }
    for (int64_t t = 0; t < rows; t++) {
        int64_t s = slots[t];
        if (s < 0) continue;
        for (int64_t h = 0; h < kv_heads; h++) {
            float *kd = k_cache + (h * num_slots + s) * head_dim;
            float *vd = v_cache + (h * num_slots + s) * head_dim;
            const float *ks = key + t * key_stride + h * head_dim;
            const float *vs = value + t * value_stride + h * head_dim;
            for (int64_t d = 0; d < head_dim; d++) {
                kd[d] = ks[d];
                vd[d] = vs[d];
            }
        }
    }
    return KV_OK;
}

/* Compaction in place (engine/kernels/compact.py): for every (layer, KV head) h and i in order,
   row dst[i] <- row src[h, i] of `cache` [heads, num_slots, width] (and of `other`, if given).
   The caller guarantees the ordering precondition (no target is a later element's source), so
   no row is read after it is overwritten and no temporary copy is needed; a row already in
   place is not copied. One task per head. */
int kv_compact(float *cache, float *other, const int64_t *src, const int64_t *dst,
               int64_t heads, int64_t count, int64_t num_slots, int64_t width) {
    for (int64_t i = 0; i < count; i++)
        if (dst[i] < 0 || dst[i] >= num_slots) return KV_BAD_SLOT;
    for (int64_t j = 0; j < heads * count; j++)
        if (src[j] < 0 || src[j] >= num_slots) return KV_BAD_SLOT;
    const size_t bytes = (size_t)width * sizeof(float);
#pragma omp parallel for schedule(static) if (heads * count * width > 65536)
    for (int64_t h = 0; h < heads; h++) {
        const int64_t *s = src + h * count;
        for (int64_t i = 0; i < count; i++) {
            if (s[i] == dst[i]) continue;
            const int64_t to = (h * num_slots + dst[i]) * width, from = (h * num_slots + s[i]) * width;
            memcpy(cache + to, cache + from, bytes);
            if (other != 0) memcpy(other + to, other + from, bytes);
        }
    }
    return KV_OK;
}

/* One (row, kv head): the group's query heads against that head's visible slots, page by page
   with a running maximum (online softmax), so no buffer grows with the context. The hole's
   slots are neither read nor computed: each page is two ranges, [0, a) and [b, n) (a == b where
   the hole misses the page), and a page inside the hole is skipped; the loops over a range have
   no branches and vectorize (expf through glibc's vector variants under -ffast-math). */
static inline __attribute__((always_inline)) int
attend_head(const float *restrict q, int64_t group, const int64_t head_dim,
            const float *restrict keys, const float *restrict values,
            const int64_t *restrict table, int64_t len, int64_t block, int64_t num_pages,
            int64_t hole_start, int64_t hole_end, float scale, float *restrict out) {
    float acc[MAX_GROUP_DIM], top[MAX_GROUP], total[MAX_GROUP], scores[MAX_BLOCK];
    for (int64_t i = 0; i < group * head_dim; i++) acc[i] = 0.0f;
    for (int64_t g = 0; g < group; g++) {
        top[g] = MASKED;
        total[g] = 0.0f;
    }
    int64_t pages = (len + block - 1) / block;
    for (int64_t p = 0; p < pages; p++) {
        int64_t page = table[p];
        if (page < 0 || page >= num_pages) return KV_BAD_PAGE;
        int64_t first = p * block;
        int64_t n = len - first < block ? len - first : block;
        /* the page's slots outside the hole: [0, a) and [b, n) */
        int64_t a = hole_start - first, b = hole_end - first;
        a = a < 0 ? 0 : (a > n ? n : a);
        b = b < a ? a : (b > n ? n : b);
        if (a == 0 && b == n) continue; /* every slot of the page is in the hole */
        const float *kp = keys + page * block * head_dim;
        const float *vp = values + page * block * head_dim;
        if (p + PREFETCH_PAGES < pages) {
            const int64_t next = table[p + PREFETCH_PAGES]; /* checked when its turn comes */
            if (next >= 0 && next < num_pages)
                prefetch_pages(keys + next * block * head_dim, values + next * block * head_dim,
                               block * head_dim);
        }
        for (int64_t g = 0; g < group; g++) {
            const float *qg = q + g * head_dim;
            float page_top = MASKED;
            for (int r = 0; r < 2; r++) {
                const int64_t lo = r ? b : 0, hi = r ? n : a;
                for (int64_t j = lo; j < hi; j++) {
                    const float *kj = kp + j * head_dim;
                    float dot = 0.0f;
                    for (int64_t d = 0; d < head_dim; d++) dot += qg[d] * kj[d];
                    scores[j] = dot * scale; /* consumed below, before the group's next head */
                    page_top = scores[j] > page_top ? scores[j] : page_top;
                }
            }
            float new_top = page_top > top[g] ? page_top : top[g];
            float keep = expf(top[g] - new_top);
            float page_total = 0.0f;
            float *ag = acc + g * head_dim;
            for (int64_t d = 0; d < head_dim; d++) ag[d] *= keep;
            for (int r = 0; r < 2; r++) {
                const int64_t lo = r ? b : 0, hi = r ? n : a;
                for (int64_t j = lo; j < hi; j++) {
                    scores[j] = expf(scores[j] - new_top);
                    page_total += scores[j];
                }
                for (int64_t j = lo; j < hi; j++) {
                    const float *vj = vp + j * head_dim;
                    float w = scores[j];
                    for (int64_t d = 0; d < head_dim; d++) ag[d] += w * vj[d];
                }
            }
            total[g] = total[g] * keep + page_total;
            top[g] = new_top;
        }
    }
    for (int64_t g = 0; g < group; g++) {
        /* Nothing visible (a padded row, or a head whose hole covers every slot): zeros. */
        float inv = total[g] > 0.0f ? 1.0f / total[g] : 0.0f;
        for (int64_t d = 0; d < head_dim; d++) out[g * head_dim + d] = acc[g * head_dim + d] * inv;
    }
    return KV_OK;
}

/* attend_head with head_dim a constant for the common sizes, so its loops unroll fully. */
static int attend_head_any(const float *q, int64_t group, int64_t head_dim, const float *keys,
                           const float *values, const int64_t *table, int64_t len, int64_t block,
                           int64_t num_pages, int64_t hole_start, int64_t hole_end, float scale,
                           float *out) {
#define ATTEND(D) attend_head(q, group, D, keys, values, table, len, block, num_pages, \
                              hole_start, hole_end, scale, out)
    switch (head_dim) {
    case 64: return ATTEND(64);
    case 128: return ATTEND(128);
    default: return ATTEND(head_dim);
    }
#undef ATTEND
}

int kv_decode(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
              const int64_t *tables, int64_t table_stride, const int64_t *lens,
              const int64_t *holes, float *out, int64_t batch, int64_t q_heads, int64_t kv_heads,
              int64_t head_dim, int64_t block, int64_t num_pages, float scale) {
    int64_t group = q_heads / kv_heads;
    if (group > MAX_GROUP || group * head_dim > MAX_GROUP_DIM || block > MAX_BLOCK)
        return KV_BAD_SHAPE;
    int64_t work = 0;
    for (int64_t b = 0; b < batch; b++) {
        if (lens[b] < 0 || lens[b] > table_stride * block) return KV_BAD_LENGTH;
        work += lens[b];
        if (holes == 0) continue;
        for (int64_t h = 0; h < kv_heads; h++) {
            const int64_t *hole = holes + (b * kv_heads + h) * 2;
            /* As the twins check: a hole covers stored slots only, never the newest one. */
            if (hole[0] < 0 || hole[1] < hole[0] || (hole[1] > hole[0] && hole[1] > lens[b] - 1))
                return KV_BAD_HOLE;
        }
    }
    int64_t slots = num_pages * block;
    int error = KV_OK;
    /* A tiny batch stays on one thread: its attention is microseconds of work, the order of a
       fork-join. The 256 slot-heads bound is a guess, not tuned: batch 1 at 300 slots (900)
       measured the same with the bound at 256 and at 4096. */
#pragma omp parallel for collapse(2) schedule(dynamic, 1) if (work * kv_heads > 256)
    for (int64_t b = 0; b < batch; b++) {
        for (int64_t h = 0; h < kv_heads; h++) {
            int64_t start = 0, end = 0;
            if (holes != 0) {
                start = holes[(b * kv_heads + h) * 2];
                end = holes[(b * kv_heads + h) * 2 + 1];
            }
            int rc = attend_head_any(q + b * q_stride + h * group * head_dim, group, head_dim,
                                     k_cache + h * slots * head_dim,
                                     v_cache + h * slots * head_dim, tables + b * table_stride,
                                     lens[b], block, num_pages, start, end, scale,
                                     out + (b * q_heads + h * group) * head_dim);
            if (rc != KV_OK) {
#pragma omp atomic write
                error = rc;
            }
        }
    }
    return error;
}

/* ------------------------------------------------------------------------------------------
   A chunk step's paged attention (cpu_native.prefill_rows' contract): row i of sequence b sees
   slots [0, base_lens[b] + i] of its pages, less its per-head hole.

     q       [batch, lq_max, q_heads, head_dim] contiguous; rows past q_lens[b] are padding
     tables  [batch, table_stride] page ids; base_lens, q_lens [batch]
     holes   [batch, kv_heads, 2] int64 (start, end) or NULL; a hole ends at or below the base
     out     [batch, lq_max, q_heads, head_dim]; padded rows are left as they are

   kv_chunk_rows is the same without padding (the whole stack's, step_layers.c): the chunks'
   rows one after another, q's rows q_stride floats apart, out [rows, q_heads, head_dim].

   One task per (sequence, KV head, tile of up to CHUNK_ROWS rows, part of up to PART_SLOTS
   slots). The tile's rows x the group's query heads are V query vectors, times the scale,
   packed into panels (panel_gemm.c's layout) once for all the tile's parts before they
   start, so each page's keys are read once for all V as the rows of one small product, [n, V]
   logits, where the decode kernel reads and reduces every key once per row and head. Each
   part then takes its vectors' softmax over the slots they see outside the hole and their
   weighted values (chunk_tile), and the parts' sums are merged after. A forced run's page at
   b = 16 is one tile per KV head: with 3 KV heads a single sequence gave two threads three
   tasks, and the parts split them finer (8-row tiles instead read every page twice as often,
   and measured slower). */
#define CHUNK_ROWS 16
/* The most slots one task of a tile reads (chunk_tiles): 256 beat 128 and 64 on the forced
   runs' contexts (cpu-kernels-notes.md). */
#define PART_SLOTS 256

#if defined(__AVX512F__)
typedef float pv_vec __attribute__((vector_size(64)));
#define PV_REGS 24 /* of 32 vector registers, for accumulators */
#else
typedef kv_v8 pv_vec;
#define PV_REGS 12 /* of 16 */
#endif
#define PV_LANES ((int64_t)(sizeof(pv_vec) / sizeof(float)))
/* weigh_pages' block: PV_TAKE weight vectors by up to PV_REGS / PV_TAKE value vectors (a slice
   of head_dim) in accumulators, as panel_gemm.c's tile keeps rows by panel lines, so that per
   slot a few value loads and PV_TAKE broadcasts feed PV_REGS FMAs: at head_dim 64 on AVX2 the
   whole row (8 vectors) beside 8 accumulators and a broadcast needs 17 of 16 registers. */
#define PV_TAKE 6

/* Value vectors per block of weigh_pages: the largest divisor of head_dim's vectors up to
   PV_REGS / PV_TAKE (0: head_dim is not a multiple of the vector, the scalar path). */
static inline int64_t value_slice(int64_t head_dim) {
    if (head_dim % PV_LANES) return 0;
    int64_t dv = PV_REGS / PV_TAKE;
    while (head_dim / PV_LANES % dv) dv--;
    return dv;
}

/* The register block of weigh_pages: vectors are padded to a multiple of it. */
static inline int64_t value_block(int64_t head_dim) {
    const int64_t dv = value_slice(head_dim);
    return dv ? PV_REGS / dv : 1;
}

/* The vectors of a tile: its rows x the group's heads, padded to whole register blocks. */
static inline int64_t tile_width(int64_t rows, int64_t group, int64_t head_dim) {
    const int64_t vb = value_block(head_dim);
    return (rows * group + vb - 1) / vb * vb;
}

/* The fields of a page's entry in chunk_tile's span: its id, its first row of the weights, and
   its slots outside the hole, [0, a) and [b, n). */
enum { SPAN_PAGE, SPAN_ROW, SPAN_A, SPAN_B, SPAN_N, SPAN_FIELDS };

/* acc[v] = sum over the part's pages and the slots each sees of w[row, v] * value[slot], for
   v < width: w [rows, width] (one row per slot of the part's pages, in order), acc [width,
   head_dim], span [pages, SPAN_FIELDS]. A block of `take` vectors by `dv` value vectors of
   head_dim keeps its accumulators in registers over every slot of the part; each lane is summed
   over the slots in order, whatever the block. */
static inline __attribute__((always_inline)) void
weigh_pages(float *restrict acc, const int64_t head_dim, const float *restrict w, int64_t width,
            const float *restrict values, int64_t block, const int64_t *span, int64_t pages) {
    const int64_t dv = value_slice(head_dim);
    if (dv == 0) {
        memset(acc, 0, (size_t)(width * head_dim) * sizeof(float));
        for (int64_t v = 0; v < width; v++)
            for (int64_t p = 0; p < pages; p++) {
                const int64_t *sp = span + p * SPAN_FIELDS;
                const float *vp = values + sp[SPAN_PAGE] * block * head_dim;
                const float *wp = w + sp[SPAN_ROW] * width;
                for (int r = 0; r < 2; r++)
                    for (int64_t j = r ? sp[SPAN_B] : 0; j < (r ? sp[SPAN_N] : sp[SPAN_A]); j++)
                        for (int64_t d = 0; d < head_dim; d++)
                            acc[v * head_dim + d] += wp[j * width + v] * vp[j * head_dim + d];
            }
        return;
    }
    const int64_t take = PV_REGS / dv; /* vectors per block; width is a multiple */
    for (int64_t v0 = 0; v0 < width; v0 += take) {
        for (int64_t d0 = 0; d0 < head_dim; d0 += dv * PV_LANES) {
            pv_vec a[PV_REGS];
            for (int64_t u = 0; u < take * dv; u++) a[u] = (pv_vec){0};
            for (int64_t p = 0; p < pages; p++) {
                const int64_t *sp = span + p * SPAN_FIELDS;
                const float *vp = values + sp[SPAN_PAGE] * block * head_dim + d0;
                const float *wp = w + sp[SPAN_ROW] * width + v0;
                for (int r = 0; r < 2; r++) {
                    const int64_t lo = r ? sp[SPAN_B] : 0, hi = r ? sp[SPAN_N] : sp[SPAN_A];
                    for (int64_t j = lo; j < hi; j++) {
                        pv_vec x[PV_REGS / PV_TAKE];
                        for (int64_t d = 0; d < dv; d++)
                            memcpy(&x[d], vp + j * head_dim + d * PV_LANES, sizeof(pv_vec));
                        for (int64_t u = 0; u < take; u++) {
                            const pv_vec b = (pv_vec){0} + wp[j * width + u];
                            for (int64_t d = 0; d < dv; d++) a[u * dv + d] += b * x[d];
                        }
                    }
                }
            }
            for (int64_t u = 0; u < take; u++)
                for (int64_t d = 0; d < dv; d++)
                    memcpy(acc + (v0 + u) * head_dim + d0 + d * PV_LANES, &a[u * dv + d],
                           sizeof(pv_vec));
        }
    }
}

/* A tile's softmax over its pages [p0, p1), from its query vectors `packed` (pack_queries,
   the scale applied), left unnormalized in `state`: top [width] (the largest logit a vector
   sees, MASKED where it sees none), total [width] and acc [width, head_dim], the sums of
   exp(logit - top) and of those weights times the values (chunk_finish merges the parts of a
   tile). Two passes over the part: every page's logits into one buffer (at most PART_SLOTS
   rows of the tile's width), then one maximum, one exponential and one pass over the values
   with the accumulators in registers, where an online softmax page by page would rescale and
   reload them at every page. */
static inline __attribute__((always_inline)) int
chunk_tile(const float *packed, const float *keys, const float *values, const int64_t *table,
           int64_t base, int64_t rows, int64_t group, const int64_t head_dim, int64_t block,
           int64_t hole_start, int64_t hole_end, int64_t p0, int64_t p1, float *state) {
    const int64_t vecs = rows * group, width = tile_width(rows, group, head_dim);
    const int64_t pages = p1 - p0;
    float *s = malloc((size_t)(pages * block * width + width) * sizeof(float) +
                      (size_t)(pages * SPAN_FIELDS) * sizeof(int64_t));
    if (s == 0) return KV_NO_MEMORY;
    float *shift = s + pages * block * width;
    int64_t *span = (int64_t *)(shift + width);
    float *top = state, *total = top + width, *acc = total + width;
    for (int64_t v = 0; v < width; v++) {
        top[v] = MASKED;
        total[v] = 0.0f;
    }
    const int64_t len = base + rows; /* the last row's slots */
    int64_t used = 0, filled = 0; /* pages with a slot outside the hole, rows of s */
    for (int64_t p = p0; p < p1; p++) {
        const int64_t first = p * block, n = len - first < block ? len - first : block;
        int64_t a = hole_start - first, b = hole_end - first; /* outside the hole: [0, a), [b, n) */
        a = a < 0 ? 0 : (a > n ? n : a);
        b = b < a ? a : (b > n ? n : b);
        if (a == 0 && b == n) continue; /* every slot of the page is in the hole */
        float *sp = s + filled * width;
        /* the next page's keys for this loop, and this page's values for weigh_pages below
           (the part's values, at most PART_SLOTS slots, wait in L2) */
        if (p + PREFETCH_PAGES < p1)
            prefetch_page(keys + table[p + PREFETCH_PAGES] * block * head_dim, block * head_dim);
        prefetch_page(values + table[p] * block * head_dim, n * head_dim);
        kv_panel_small(keys + table[p] * block * head_dim, head_dim, packed, sp, n, head_dim,
                       width); /* [n, width] */
        /* Row v / group sees slots up to base + v / group: only pages past base hide some. */
        const int causal = first + n - 1 > base;
        for (int64_t j = 0; j < n; j++) {
            float *sj = sp + j * width;
            if (j >= a && j < b) { /* in the hole: weight 0, never read below */
                for (int64_t v = 0; v < width; v++) sj[v] = MASKED;
                continue;
            }
            if (causal)
                for (int64_t v = 0; v < vecs; v++)
                    if (first + j > base + v / group) sj[v] = MASKED;
            for (int64_t v = 0; v < width; v++) top[v] = sj[v] > top[v] ? sj[v] : top[v];
        }
        int64_t *e = span + used * SPAN_FIELDS;
        e[SPAN_PAGE] = table[p];
        e[SPAN_ROW] = filled;
        e[SPAN_A] = a;
        e[SPAN_B] = b;
        e[SPAN_N] = n;
        used++;
        filled += n;
    }
    /* a vector that sees no slot keeps its weights at exactly 0: its shift is 0, not MASKED */
    for (int64_t v = 0; v < width; v++) shift[v] = top[v] > 0.5f * MASKED ? top[v] : 0.0f;
    for (int64_t j = 0; j < filled; j++) {
        float *sj = s + j * width;
        for (int64_t v = 0; v < width; v++) {
            sj[v] = expf(sj[v] - shift[v]);
            total[v] += sj[v];
        }
    }
    weigh_pages(acc, head_dim, s, width, values, block, span, used);
    free(s);
    return KV_OK;
}

/* A tile's output from its `parts` states (chunk_tile's, `stride` floats apart): each part's
   sums rescaled to the largest top, then acc / total; a vector that saw no slot in any part
   gets zeros. One part is written as it stands (its scale is exp(0) = 1). */
static void chunk_finish(const float *states, int64_t parts, int64_t stride, int64_t rows,
                         int64_t group, int64_t head_dim, float *out, int64_t out_row) {
    const int64_t width = tile_width(rows, group, head_dim);
    for (int64_t v = 0; v < rows * group; v++) {
        float top = MASKED, total = 0.0f;
        for (int64_t k = 0; k < parts; k++) {
            const float t = states[k * stride + v];
            top = t > top ? t : top;
        }
        float *o = out + (v / group) * out_row + (v % group) * head_dim;
        for (int64_t d = 0; d < head_dim; d++) o[d] = 0.0f;
        for (int64_t k = 0; k < parts; k++) {
            const float *part = states + k * stride;
            const float w = expf(part[v] - top);
            total += part[width + v] * w;
            const float *acc = part + 2 * width + v * head_dim;
            for (int64_t d = 0; d < head_dim; d++) o[d] += acc[d] * w;
        }
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;
        for (int64_t d = 0; d < head_dim; d++) o[d] *= inv;
    }
}

/* chunk_tile with head_dim a constant for the common sizes. */
static int chunk_tile_any(const float *packed, const float *keys, const float *values,
                          const int64_t *table, int64_t base, int64_t rows, int64_t group,
                          int64_t head_dim, int64_t block, int64_t hole_start, int64_t hole_end,
                          int64_t p0, int64_t p1, float *state) {
#define TILE(D) chunk_tile(packed, keys, values, table, base, rows, group, D, block, \
                           hole_start, hole_end, p0, p1, state)
    switch (head_dim) {
    case 64: return TILE(64);
    case 128: return TILE(128);
    default: return TILE(head_dim);
    }
#undef TILE
}

/* A tile's query vectors times `scale`, packed by kv_pack_small into `packed`: the [width,
   head_dim] matrix (built in `rows_out`) whose vector v is row v / group's head v % group (q's
   rows q_row floats apart), zeros past rows x group. chunk_tile's operand, packed once for all
   parts of the tile. */
static void pack_queries(const float *q, int64_t q_row, int64_t rows, int64_t group,
                         int64_t head_dim, float scale, float *rows_out, float *packed) {
    const int64_t vecs = rows * group, width = tile_width(rows, group, head_dim);
    for (int64_t v = 0; v < width; v++) {
        float *out = rows_out + v * head_dim;
        const float *qv = v < vecs ? q + (v / group) * q_row + (v % group) * head_dim : 0;
        for (int64_t k = 0; k < head_dim; k++) out[k] = qv != 0 ? qv[k] * scale : 0.0f;
    }
    kv_pack_small(rows_out, packed, width, head_dim);
}

/* The chunks' metadata checks of kv_prefill_chunks and kv_chunk_rows: each sequence's rows fit
   lq_max (0: no bound), its pages exist, its holes end at or below its base. */
static int check_chunks(const int64_t *tables, int64_t table_stride, const int64_t *base_lens,
                        const int64_t *q_lens, const int64_t *holes, int64_t batch,
                        int64_t lq_max, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                        int64_t block, int64_t num_pages) {
    if (kv_heads < 1 || q_heads % kv_heads || block < 1 || head_dim < 1) return KV_BAD_SHAPE;
    for (int64_t b = 0; b < batch; b++) {
        if (q_lens[b] < 0 || (lq_max && q_lens[b] > lq_max) || base_lens[b] < 0)
            return KV_BAD_LENGTH;
        if (q_lens[b] == 0) continue;
        const int64_t pages = (base_lens[b] + q_lens[b] + block - 1) / block;
        if (pages > table_stride) return KV_BAD_LENGTH;
        for (int64_t p = 0; p < pages; p++) {
            const int64_t page = tables[b * table_stride + p];
            if (page < 0 || page >= num_pages) return KV_BAD_PAGE;
        }
        for (int64_t h = 0; holes != 0 && h < kv_heads; h++) {
            const int64_t *hole = holes + (b * kv_heads + h) * 2;
            if (hole[0] < 0 || hole[1] < hole[0] || (hole[1] > hole[0] && hole[1] > base_lens[b]))
                return KV_BAD_HOLE;
        }
    }
    return KV_OK;
}

/* The tiles of every chunk, sequence b's first row at row starts[b] of q (row stride q_row)
   and of out (out_row), or at b * lq_max when starts is NULL (the padded layout). A tile's
   pages are split into parts of up to PART_SLOTS slots, one task each, merged by chunk_finish
   after: a single sequence's 3 KV heads alone would give two threads three equal tasks. The
   split depends on the shapes only, so the result does not change with the thread count. */
/* Tile t of sequence b in chunk_tiles: its first row in q and out, its rows (0: past the
   sequence's chunk), and the pages its last row sees (at least 1 when it has rows). */
struct tile_span {
    int64_t row, rows, pages;
};

static inline struct tile_span tile_at(int64_t b, int64_t t, const int64_t *starts,
                                       int64_t lq_max, const int64_t *base_lens,
                                       const int64_t *q_lens, int64_t block) {
    const int64_t i0 = t * CHUNK_ROWS, left = q_lens[b] - i0;
    struct tile_span span = {(starts != 0 ? starts[b] : b * lq_max) + i0, 0, 0};
    if (left <= 0) return span;
    span.rows = left < CHUNK_ROWS ? left : CHUNK_ROWS;
    span.pages = (base_lens[b] + i0 + span.rows + block - 1) / block;
    return span;
}

static int chunk_tiles(const float *q, int64_t q_row, const int64_t *starts,
                       const float *k_cache, const float *v_cache, const int64_t *tables,
                       int64_t table_stride, const int64_t *base_lens, const int64_t *q_lens,
                       const int64_t *holes, float *out, int64_t out_row, int64_t batch,
                       int64_t lq_max, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                       int64_t block, int64_t num_pages, float scale) {
    const int64_t group = q_heads / kv_heads, slots = num_pages * block;
    const int64_t tiles = (lq_max + CHUNK_ROWS - 1) / CHUNK_ROWS;
    const int64_t part_pages = (PART_SLOTS + block - 1) / block;
    int64_t parts = 1; /* the most parts of any tile */
    for (int64_t b = 0; b < batch; b++) {
        const int64_t pages = (base_lens[b] + q_lens[b] + block - 1) / block;
        const int64_t n = (pages + part_pages - 1) / part_pages;
        parts = n > parts ? n : parts;
    }
    const int64_t width = tile_width(CHUNK_ROWS, group, head_dim), stride = width * (head_dim + 2);
    /* each tile's packed queries, and the rows they are packed from */
    const int64_t pack = (width + KV_PANEL - 1) / KV_PANEL * KV_PANEL * head_dim;
    float *states = malloc((size_t)(batch * kv_heads * tiles * (parts * stride + 2 * pack)) *
                           sizeof(float));
    if (states == 0) return KV_NO_MEMORY;
    float *packs = states + batch * kv_heads * tiles * parts * stride;
    float *query_rows = packs + batch * kv_heads * tiles * pack;
    int error = KV_OK;
#pragma omp parallel
    {
#pragma omp for collapse(3) schedule(static)
        for (int64_t b = 0; b < batch; b++) {
            for (int64_t h = 0; h < kv_heads; h++) {
                for (int64_t t = 0; t < tiles; t++) {
                    const struct tile_span tile =
                        tile_at(b, t, starts, lq_max, base_lens, q_lens, block);
                    const int64_t i = (b * kv_heads + h) * tiles + t;
                    if (tile.rows > 0)
                        pack_queries(q + tile.row * q_row + h * group * head_dim, q_row,
                                     tile.rows, group, head_dim, scale, query_rows + i * pack,
                                     packs + i * pack);
                }
            }
        }
#pragma omp for collapse(4) schedule(dynamic, 1)
        for (int64_t b = 0; b < batch; b++) {
            for (int64_t h = 0; h < kv_heads; h++) {
                for (int64_t t = 0; t < tiles; t++) {
                    for (int64_t k = 0; k < parts; k++) {
                        const struct tile_span tile =
                            tile_at(b, t, starts, lq_max, base_lens, q_lens, block);
                        const int64_t p0 = k * part_pages;
                        if (p0 >= tile.pages) continue; /* no rows, or fewer parts */
                        const int64_t p1 =
                            p0 + part_pages < tile.pages ? p0 + part_pages : tile.pages;
                        const int64_t hs = holes != 0 ? holes[(b * kv_heads + h) * 2] : 0;
                        const int64_t he = holes != 0 ? holes[(b * kv_heads + h) * 2 + 1] : 0;
                        int rc = chunk_tile_any(
                            packs + ((b * kv_heads + h) * tiles + t) * pack,
                            k_cache + h * slots * head_dim, v_cache + h * slots * head_dim,
                            tables + b * table_stride, base_lens[b] + t * CHUNK_ROWS, tile.rows,
                            group, head_dim, block, hs, he, p0, p1,
                            states + (((b * kv_heads + h) * tiles + t) * parts + k) * stride);
                        if (rc != KV_OK) {
#pragma omp atomic write
                            error = rc;
                        }
                    }
                }
            }
        }
#pragma omp for collapse(3) schedule(dynamic, 1)
        for (int64_t b = 0; b < batch; b++) {
            for (int64_t h = 0; h < kv_heads; h++) {
                for (int64_t t = 0; t < tiles; t++) {
                    const struct tile_span tile =
                        tile_at(b, t, starts, lq_max, base_lens, q_lens, block);
                    if (tile.rows == 0 || error != KV_OK) continue;
                    chunk_finish(states + ((b * kv_heads + h) * tiles + t) * parts * stride,
                                 (tile.pages + part_pages - 1) / part_pages, stride, tile.rows,
                                 group, head_dim, out + tile.row * out_row + h * group * head_dim,
                                 out_row);
                }
            }
        }
    }
    free(states);
    return error;
}

int kv_prefill_chunks(const float *q, const float *k_cache, const float *v_cache,
                      const int64_t *tables, int64_t table_stride, const int64_t *base_lens,
                      const int64_t *q_lens, const int64_t *holes, float *out, int64_t batch,
                      int64_t lq_max, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                      int64_t block, int64_t num_pages, float scale) {
    int rc = check_chunks(tables, table_stride, base_lens, q_lens, holes, batch, lq_max, q_heads,
                          kv_heads, head_dim, block, num_pages);
    if (rc != KV_OK) return rc;
    if (lq_max < 1) return KV_OK;
    return chunk_tiles(q, q_heads * head_dim, 0, k_cache, v_cache, tables, table_stride,
                       base_lens, q_lens, holes, out, q_heads * head_dim, batch, lq_max, q_heads,
                       kv_heads, head_dim, block, num_pages, scale);
}

int kv_chunk_rows(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                  const int64_t *tables, int64_t table_stride, const int64_t *base_lens,
                  const int64_t *q_lens, const int64_t *holes, float *out, int64_t batch,
                  int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t block,
                  int64_t num_pages, float scale) {
    int rc = check_chunks(tables, table_stride, base_lens, q_lens, holes, batch, 0, q_heads,
                          kv_heads, head_dim, block, num_pages);
    if (rc != KV_OK) return rc;
    int64_t *starts = malloc((size_t)(batch > 0 ? batch : 1) * sizeof(int64_t));
    if (starts == 0) return KV_NO_MEMORY;
    int64_t lq_max = 0, row = 0;
    for (int64_t b = 0; b < batch; b++) {
        starts[b] = row;
        row += q_lens[b];
        lq_max = q_lens[b] > lq_max ? q_lens[b] : lq_max;
    }
    rc = lq_max < 1 ? KV_OK
                    : chunk_tiles(q, q_stride, starts, k_cache, v_cache, tables, table_stride,
                                  base_lens, q_lens, holes, out, q_heads * head_dim, batch, lq_max,
                                  q_heads, kv_heads, head_dim, block, num_pages, scale);
    free(starts);
    return rc;
}

/* ------------------------------------------------------------------------------------------
   Attention probabilities of one sequence's queries over its cached keys, read in place
   (attention_scores.py's paged_query_probs contract; the policies' scores, GrowPage's demand):

     q        [layers, n, q_heads, head_dim] contiguous (post-RoPE)
     k_cache  layer l's keys at k_cache + l * layer_stride: [kv_heads, num_pages * block, head_dim]
     table    [ceil(length / block)] the sequence's page ids
     slots    0, or [layers, kv_heads, length]: column j of (l, h) is slot slots[l, h, j] read
              through table (< 0: hidden, probability 0 and no share of the softmax)
     limits   [n] query i sees keys j < limits[i] (0 <= limits[i] <= length)
     out      [layers, q_heads, n, length] contiguous: softmax over the visible keys, 0 past them
              (a row that sees nothing is all zeros); with group_mean, [layers, kv_heads, n,
              length]: the mean of the group's query heads' rows. With query_reduce SUM or
              MEAN the n axis is reduced: [layers, q_heads or kv_heads, length].

   One task per (layer, KV head): the logits of every query and head of its group, page by
   page, so each key is read from memory once for all of them (a gather of the pages followed
   by a matmul reads them three times); then each row's exponentials in place, and the
   probabilities written out, reduced to the group's mean and/or the queries' sum or mean as
   whole-row multiply-adds. Reducing the queries here spares the caller (SnapKV's sum over its
   window, Ada-KV's mean) an [n, length] row per head written to memory and read back. */

enum { QUERY_KEEP, QUERY_SUM, QUERY_MEAN };

#define HALVE(a, b, ...) (__builtin_shufflevector(a, b, __VA_ARGS__))
#if defined(__AVX512F__)
static const int64_t BITREV[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
/* Lane j of the result: the sum of the lanes of v[BITREV[j]]. A transpose-and-add in four
   levels, each adding two vectors' halves side by side, where summing one vector's lanes alone
   takes as many steps for one number. */
static inline __attribute__((always_inline)) pv_vec sum_lanes(pv_vec *v) {
    for (int i = 0; i < 8; i++)
        v[i] = HALVE(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22,
                     23) +
               HALVE(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28,
                     29, 30, 31);
    for (int i = 0; i < 4; i++)
        v[i] = HALVE(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25,
                     26, 27) +
               HALVE(v[2 * i], v[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29,
                     30, 31);
    for (int i = 0; i < 2; i++)
        v[i] = HALVE(v[2 * i], v[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13,
                     28, 29) +
               HALVE(v[2 * i], v[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15,
                     30, 31);
    return HALVE(v[0], v[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
           HALVE(v[0], v[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}
#else
static const int64_t BITREV[8] = {0, 4, 2, 6, 1, 5, 3, 7};
/* The same in three levels for 8 lanes. */
static inline __attribute__((always_inline)) pv_vec sum_lanes(pv_vec *v) {
    for (int i = 0; i < 4; i++)
        v[i] = HALVE(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
               HALVE(v[2 * i], v[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; i++)
        v[i] = HALVE(v[2 * i], v[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               HALVE(v[2 * i], v[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return HALVE(v[0], v[1], 0, 8, 2, 10, 4, 12, 6, 14) +
           HALVE(v[0], v[1], 1, 9, 3, 11, 5, 13, 7, 15);
}
#endif

/* logits[r, j] = scale * q[r] . keys[j] for r < rows, j < count. With head_dim a small
   multiple of the vector, PV_LANES keys at a time: each key's products stay one vector, and
   sum_lanes turns PV_LANES of them into PV_LANES dots at once (keys fed in BITREV order so the
   dots come out in order); the rest one dot at a time. */
static inline __attribute__((always_inline)) void
page_logits(const float *restrict q, int64_t rows, int64_t q_stride, const int64_t head_dim,
            const float *restrict keys, int64_t count, float scale, float *restrict logits,
            int64_t out_stride) {
    const int64_t nv = head_dim / PV_LANES;
    const int64_t whole = head_dim % PV_LANES == 0 && nv <= 8 ? count / PV_LANES * PV_LANES : 0;
    for (int64_t r = 0; r < rows; r++) {
        const float *qr = q + r * q_stride;
        float *lr = logits + r * out_stride;
        if (whole > 0) {
            pv_vec qv[8];
            for (int64_t d = 0; d < nv; d++) memcpy(&qv[d], qr + d * PV_LANES, sizeof(pv_vec));
            for (int64_t j0 = 0; j0 < whole; j0 += PV_LANES) {
                pv_vec acc[PV_LANES];
                for (int64_t i = 0; i < PV_LANES; i++) {
                    const float *kj = keys + (j0 + BITREV[i]) * head_dim;
                    pv_vec k;
                    memcpy(&k, kj, sizeof k);
                    acc[i] = qv[0] * k;
                    for (int64_t d = 1; d < nv; d++) {
                        memcpy(&k, kj + d * PV_LANES, sizeof k);
                        acc[i] += qv[d] * k;
                    }
                }
                const pv_vec dots = sum_lanes(acc) * scale;
                memcpy(lr + j0, &dots, sizeof dots);
            }
        }
        for (int64_t j = whole; j < count; j++) {
            const float *kj = keys + j * head_dim;
            float dot = 0.0f;
            for (int64_t d = 0; d < head_dim; d++) dot += qr[d] * kj[d];
            lr[j] = dot * scale;
        }
    }
}

/* Columns of a slot map whose keys head_logits gathers at once for the dots: a tile the size of
   a vector's dots in page_logits, which stays in L1 while every query vector reads it. */
#define SLOT_TILE 16

/* `length` columns of a slot map's keys, [length, head_dim], into `dense`: the key
   of slot s lies in page table[s / block] at s % block; a hidden column (s < 0) gets zeros. */
static inline __attribute__((always_inline)) void
gather_held(const float *keys, const int64_t *table, const int64_t *slot, int64_t length,
            const int64_t head_dim, int64_t block, int shift, float *dense) {
    for (int64_t j = 0; j < length; j++) {
        float *dj = dense + j * head_dim;
        if (slot[j] < 0) {
            memset(dj, 0, (size_t)head_dim * sizeof(float));
            continue;
        }
        const int64_t s = slot[j];
        /* a power-of-two page (every engine's) takes a shift and a mask, not a division */
        const int64_t page = shift >= 0 ? s >> shift : s / block;
        const int64_t offset = shift >= 0 ? s & (block - 1) : s % block;
        memcpy(dj, keys + (table[page] * block + offset) * head_dim,
               (size_t)head_dim * sizeof(float));
    }
}

static void gather_tile(const float *keys, const int64_t *table, const int64_t *slot,
                        int64_t length, int64_t head_dim, int64_t block, float *dense) {
    const int shift = (block & (block - 1)) == 0 ? __builtin_ctzll((unsigned long long)block) : -1;
    switch (head_dim) { /* a constant row size for the common sizes: each copy inlines */
    case 64:
        gather_held(keys, table, slot, length, 64, block, shift, dense);
        break;
    case 128:
        gather_held(keys, table, slot, length, 128, block, shift, dense);
        break;
    default:
        gather_held(keys, table, slot, length, head_dim, block, shift, dense);
        break;
    }
}

/* Query vectors from which head_logits forms a page's logits as one small product (up to 16 of
   its keys packed into a panel, panel_gemm.c's tile over the vectors) instead of page_logits'
   dots. On AVX2 the dots of 8 keys with a 64-float query fill all 16 vector registers; the
   tile of 6 vectors x 16 keys keeps 12 accumulators. Packing the keys pays off from a few dozen
   vectors (SnapKV's window, 32 queries x 3 heads, is 96; GrowPage's query summaries 3-6 keep
   the dots). With AVX-512 the dots fit its 32 registers and are kept. */
#if defined(__AVX512F__)
#define PANEL_VECS INT64_MAX
#else
#define PANEL_VECS 32
#endif

/* e [vecs, length] <- the logits of the task's query vectors qt [vecs, head_dim] (scale already
   applied) over its `length` columns, a page at a time (or a gathered tile of a slot map's keys,
   `dense`), each key read once for every vector: slot j of the sequence, or slot[j] of a slot
   map. A hidden column's logits are left for exp_held to set. With PANEL_VECS or more vectors
   each page's keys go into one panel (`panel`, [head_dim, KV_PANEL]) and the product into
   `part` [vecs, KV_PANEL] first. */
static void head_logits(const float *qt, int64_t vecs, const float *keys, const int64_t *table,
                        const int64_t *slot, int64_t length, int64_t head_dim, int64_t block,
                        float *dense, float *panel, float *part, float *e) {
    const int panels = vecs >= PANEL_VECS;
    /* a page at a time, or at most a panel's keys of it for the product */
    const int64_t step = slot != 0 ? SLOT_TILE : panels && block > KV_PANEL ? KV_PANEL : block;
    for (int64_t first = 0, count; first < length; first += count) {
        /* up to `step` columns, within one page */
        count = length - first < step ? length - first : step;
        if (slot == 0 && count > block - first % block) count = block - first % block;
        const float *kp = slot == 0 ? keys + (table[first / block] * block + first % block) *
                                                 head_dim
                                    : dense;
        if (slot == 0 && first % block == 0 && first + PREFETCH_PAGES * block < length)
            prefetch_page(keys + table[first / block + PREFETCH_PAGES] * block * head_dim,
                          block * head_dim); /* the table was checked */
        if (slot != 0) {
            int64_t held = 0;
            for (int64_t j = first; j < first + count; j++) held += slot[j] >= 0;
            if (held == 0) continue; /* a padding tile: exp_held writes its columns */
            gather_tile(keys, table, slot + first, count, head_dim, block, dense);
        }
        if (panels) {
            kv_pack_small(kp, panel, count, head_dim);
            kv_panel_small(qt, head_dim, panel, part, vecs, head_dim, count);
            for (int64_t v = 0; v < vecs; v++)
                memcpy(e + v * length + first, part + v * count, (size_t)count * sizeof(float));
            continue;
        }
        switch (head_dim) { /* a constant for the common sizes: the dot unrolls */
        case 64:
            page_logits(qt, vecs, 64, 64, kp, count, 1.0f, e + first, length);
            break;
        case 128:
            page_logits(qt, vecs, 128, 128, kp, count, 1.0f, e + first, length);
            break;
        default:
            page_logits(qt, vecs, head_dim, head_dim, kp, count, 1.0f, e + first, length);
            break;
        }
    }
}

/* row[j] <- exp(row[j] - max) for j < visible, 0 past it; returns 1 / their sum, the factor
   that makes the row its softmax (0 for a row that sees nothing). */
static inline float exp_row(float *row, int64_t visible, int64_t length) {
    for (int64_t j = visible; j < length; j++) row[j] = 0.0f;
    if (visible == 0) return 0.0f;
    float top = row[0];
    for (int64_t j = 1; j < visible; j++) top = row[j] > top ? row[j] : top;
    float total = 0.0f;
    for (int64_t j = 0; j < visible; j++) {
        row[j] = expf(row[j] - top);
        total += row[j];
    }
    return 1.0f / total;
}

/* exp_row over the columns a slot map holds: the hidden columns (their indices ascending)
   before `visible` get 0 and no share, and a row with no held column before `visible` is all
   zeros (factor 0). A leading run of hidden columns (a per-head layout's padding) is left out;
   any other hidden logit is set 40 below the row's maximum, whose exponential (4e-18 of the
   maximum's) is a normal float that no sum in fp32 can see and is then overwritten by 0: a
   huge negative sends the vector exp down its special-case path, and a subnormal result costs a
   microcode assist per lane (the process keeps IEEE subnormals). */
static inline float exp_held(float *row, const int64_t *hidden, int64_t hidden_count,
                             int64_t visible, int64_t length) {
    int64_t lead = 0, seen;
    while (lead < hidden_count && hidden[lead] == lead) lead++;
    for (seen = lead; seen < hidden_count && hidden[seen] < visible; seen++) continue;
    if (visible <= lead || seen == visible) {
        memset(row, 0, (size_t)length * sizeof(float));
        return 0.0f;
    }
    memset(row, 0, (size_t)lead * sizeof(float));
    float top = -FLT_MAX;
    for (int64_t k = lead; k < seen; k++) row[hidden[k]] = top;
    for (int64_t j = lead; j < visible; j++) top = row[j] > top ? row[j] : top;
    for (int64_t k = lead; k < seen; k++) row[hidden[k]] = top - 40.0f;
    const float inv = exp_row(row + lead, visible - lead, length - lead);
    for (int64_t k = lead; k < seen; k++) row[hidden[k]] = 0.0f;
    return inv;
}

/* One task's output from its exponentials e [group * n, length] (row g * n + i: head g of the
   group, query i) and their rows' factors inv [group * n] (exp_row), at the task's first row of
   kv_query_probs' `out`: the probabilities, reduced to the group's mean and/or the queries' sum
   or mean, each a run of whole-row multiply-adds. */
static void head_output(const float *e, const float *inv, int64_t length, int64_t n,
                        int64_t group, int group_mean, int query_reduce, float *out) {
    const int64_t heads = group_mean ? 1 : group, rows = query_reduce == QUERY_KEEP ? n : 1;
    const float share = (group_mean ? 1.0f / (float)group : 1.0f) *
                        (query_reduce == QUERY_MEAN ? 1.0f / (float)n : 1.0f);
    memset(out, 0, (size_t)(heads * rows * length) * sizeof(float));
    for (int64_t g = 0; g < group; g++)
        for (int64_t i = 0; i < n; i++) {
            const float *er = e + (g * n + i) * length, w = inv[g * n + i];
            float *o = out + ((group_mean ? 0 : g) * rows + (query_reduce == QUERY_KEEP ? i : 0)) *
                                 length;
            for (int64_t j = 0; j < length; j++) o[j] += er[j] * w;
        }
    if (share != 1.0f)
        for (int64_t j = 0; j < heads * rows * length; j++) out[j] *= share;
}

int kv_query_probs(const float *q, const float *k_cache, int64_t layer_stride,
                   const int64_t *table, int64_t table_len, const int64_t *slots,
                   const int64_t *limits, int64_t length, float *out, int64_t layers, int64_t n,
                   int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t block,
                   int64_t num_pages, float scale, int group_mean, int query_reduce) {
    if (length < 0 || n < 0 || kv_heads < 1 || q_heads % kv_heads || table_len < 0 ||
        query_reduce < QUERY_KEEP || query_reduce > QUERY_MEAN)
        return KV_BAD_SHAPE;
    const int64_t group = q_heads / kv_heads, pages = (length + block - 1) / block;
    /* without a slot map, column j is slot j: the table must cover the first `length` slots */
    if (slots == 0 && pages > table_len) return KV_BAD_LENGTH;
    if (slots == 0) {
        for (int64_t p = 0; p < pages; p++)
            if (table[p] < 0 || table[p] >= num_pages) return KV_BAD_PAGE;
    } else { /* the pages of the slots read: every page of the table unless one is bad */
        const int64_t entries = layers * kv_heads * length;
        int64_t top = -1, bad_pages = 0;
        for (int64_t j = 0; j < entries; j++) top = slots[j] > top ? slots[j] : top;
        if (top >= table_len * block) return KV_BAD_SLOT;
        for (int64_t p = 0; p < table_len; p++) bad_pages += table[p] < 0 || table[p] >= num_pages;
        for (int64_t j = 0; bad_pages > 0 && j < entries; j++) {
            const int64_t page = slots[j] < 0 ? 0 : table[slots[j] / block];
            if (slots[j] >= 0 && (page < 0 || page >= num_pages)) return KV_BAD_PAGE;
        }
    }
    for (int64_t i = 0; i < n; i++)
        if (limits[i] < 0 || limits[i] > length) return KV_BAD_LENGTH;
    if (n == 0 || length == 0) return KV_OK; /* an empty output */
    const int64_t slot_count = num_pages * block, vecs = n * group;
    const int64_t rows = query_reduce == QUERY_KEEP ? n : 1; /* output rows per head */
    const int64_t heads_out = group_mean ? kv_heads : q_heads;
    /* unreduced per-head rows are the output itself: the softmax is written there in place */
    const int direct = !group_mean && query_reduce == QUERY_KEEP;
    int error = KV_OK;
#pragma omp parallel for collapse(2) schedule(static) if (layers * q_heads * n * length > 32768)
    for (int64_t l = 0; l < layers; l++) {
        for (int64_t h = 0; h < kv_heads; h++) {
            const float *keys = k_cache + l * layer_stride + h * slot_count * head_dim;
            const int64_t *slot = slots == 0 ? 0 : slots + (l * kv_heads + h) * length;
            /* the hidden columns' indices, then the group's query vectors [vecs, head_dim]
               (times scale), a gathered tile, head_logits' panel and product, the
               exponentials [vecs, length] (unless written straight to out) and their factors */
            const int64_t panel_floats = vecs >= PANEL_VECS ? (head_dim + vecs) * KV_PANEL : 0;
            int64_t *hidden = malloc((size_t)length * sizeof(int64_t) +
                                     (size_t)(vecs * head_dim + SLOT_TILE * head_dim +
                                              panel_floats + (direct ? 0 : vecs * length) +
                                              vecs) *
                                         sizeof(float));
            if (hidden == 0) {
#pragma omp atomic write
                error = KV_NO_MEMORY;
                continue;
            }
            float *qt = (float *)(hidden + length), *dense = qt + vecs * head_dim;
            float *panel = dense + SLOT_TILE * head_dim, *part = panel + head_dim * KV_PANEL;
            float *e = panel + panel_floats, *inv = e + (direct ? 0 : vecs * length);
            if (direct) e = out + (l * q_heads + h * group) * n * length;
            for (int64_t v = 0; v < vecs; v++) { /* vector v: head v / n of the group, query v % n */
                const float *qv = q + ((l * n + v % n) * q_heads + h * group + v / n) * head_dim;
                for (int64_t d = 0; d < head_dim; d++) qt[v * head_dim + d] = qv[d] * scale;
            }
            head_logits(qt, vecs, keys, table, slot, length, head_dim, block, dense, panel, part,
                        e);
            int64_t hidden_count = 0;
            for (int64_t j = 0; slot != 0 && j < length; j++)
                if (slot[j] < 0) hidden[hidden_count++] = j;
            for (int64_t v = 0; v < vecs; v++) {
                float *row = e + v * length;
                inv[v] = slot != 0 ? exp_held(row, hidden, hidden_count, limits[v % n], length)
                                   : exp_row(row, limits[v % n], length);
                for (int64_t j = 0; direct && j < length; j++) row[j] *= inv[v];
            }
            if (!direct) {
                const int64_t first = (l * heads_out + (group_mean ? h : h * group)) * rows;
                head_output(e, inv, length, n, group, group_mean, query_reduce,
                            out + first * length);
            }
            free(hidden);
        }
    }
    return error;
}

/* ------------------------------------------------------------------------------------------
   The small per-layer ops of a CPU float32 forward pass, each one call instead of several
   aten ops (cpu_native.py: why). Tensors are contiguous [rows, ...] unless a stride is given. */

static inline void norm_row(const float *restrict x, const float *restrict weight, int64_t dim,
                            float eps, float *restrict out) {
    float squares = 0.0f;
    for (int64_t i = 0; i < dim; i++) squares += x[i] * x[i];
    float inv = 1.0f / sqrtf(squares / (float)dim + eps);
    for (int64_t i = 0; i < dim; i++) out[i] = (x[i] * inv) * weight[i];
}

/* out = RMSNorm(x) * weight; with delta, first x += delta in place (the residual add). */
void kv_add_rms_norm(float *x, const float *delta, const float *weight, float *out, int64_t rows,
                     int64_t dim, float eps) {
#pragma omp parallel for schedule(static) if (rows * dim > 65536)
    for (int64_t t = 0; t < rows; t++) {
        float *xt = x + t * dim;
        if (delta != 0) {
            const float *dt = delta + t * dim;
            for (int64_t i = 0; i < dim; i++) xt[i] += dt[i];
        }
        norm_row(xt, weight, dim, eps, out + t * dim);
    }
}

/* Rotate-half RoPE: out[t, h, i] = x[t, h, i] * cos[t, i] + x[t, h, i +- d/2] * sin[t, i], where
   sin carries the pairing's sign in its first half (rope.py's RopeRows). x rows strided, heads
   contiguous; cos/sin [rows, head_dim]; out [rows, heads, head_dim] contiguous. */
void kv_rope(const float *x, int64_t x_stride, const float *cos, const float *sin, float *out,
             int64_t rows, int64_t heads, int64_t head_dim) {
    int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) if (rows * heads * head_dim > 65536)
    for (int64_t t = 0; t < rows; t++) {
        const float *c = cos + t * head_dim, *s = sin + t * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            const float *xh = x + t * x_stride + h * head_dim;
            float *oh = out + (t * heads + h) * head_dim;
            for (int64_t i = 0; i < half; i++) oh[i] = xh[i] * c[i] + xh[i + half] * s[i];
            for (int64_t i = half; i < head_dim; i++)
                oh[i] = xh[i] * c[i] + xh[i - half] * s[i];
        }
    }
}

/* out[t, i] = silu(gate_up[t, i]) * gate_up[t, inter + i]; gate_up [rows, 2 * inter]. */
void kv_silu_mul(const float *gate_up, float *out, int64_t rows, int64_t inter) {
#pragma omp parallel for schedule(static) if (rows * inter > 65536)
    for (int64_t t = 0; t < rows; t++) {
        const float *g = gate_up + t * 2 * inter, *u = g + inter;
        float *o = out + t * inter;
        for (int64_t i = 0; i < inter; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}
