/* What the CPU kernels' C files share with each other and with engine/kernels/cpu_native.py:
   every exported function's prototype, the return codes, and the constants both sides rely on.

   cpu_native.py declares the same functions through ctypes and, when it loads the library,
   compares the constants kv_abi reports with its own: on a mismatch the torch ops run instead,
   after a warning. Raise KV_ABI_VERSION with any change to a signature or to what a constant
   means, and the Python side's ABI_VERSION with it. */

#ifndef KVARENA_NATIVE_H
#define KVARENA_NATIVE_H

#include <stdint.h>
#include <string.h>

#define KV_ABI_VERSION 13

/* Return codes of kv_store, kv_decode, kv_prefill_chunks, kv_chunk_rows, kv_query_probs,
   kv_key_redundancy, kv_top_p_counts and kv_step_layers (cpu_native.ERRORS words them). */
enum { KV_OK = 0, KV_BAD_PAGE = 1, KV_BAD_LENGTH = 2, KV_BAD_SLOT = 3, KV_BAD_HOLE = 4,
       KV_BAD_SHAPE = 5, KV_NO_MEMORY = 6 };

/* Output columns per panel of kv_pack_panels / kv_panel_linear: one 64-byte line (two AVX2
   vectors, one AVX-512 vector). */
#define KV_PANEL 16

/* A layer's tensor addresses in kv_step_layers' weights table, in this order
   (cpu_native.LAYER_FIELDS). */
enum { KV_INPUT_NORM, KV_QKV, KV_QKV_BIAS, KV_O, KV_POST_NORM, KV_GATE_UP, KV_DOWN,
       KV_LAYER_FIELDS };

/* The projections run on one thread for weights under 128 KB, where a fork-join's microseconds
   are a large share (untuned; every projection of the models served is larger). */
#define KV_PARALLEL_MIN 32768

/* The cache level that the kernels' software prefetches fill (the projections' next panels,
   the attention's next pages), measured best for each instruction set (cpu-kernels-notes.md):
   L1 (locality 3) on an AVX2 machine; L2 (locality 2) on an AVX-512 one, where L1 requests
   gained less, or ran slower than none. */
#if defined(__AVX512F__)
#define KV_PREFETCH_LOCALITY 2
#else
#define KV_PREFETCH_LOCALITY 3
#endif

/* Eight floats in one AVX2 register (GCC and Clang vector extension). */
typedef float kv_v8 __attribute__((vector_size(32)));

static inline kv_v8 kv_load8(const float *p) {
    kv_v8 v;
    memcpy(&v, p, sizeof v); /* unaligned load */
    return v;
}

/* The constants above by name: writes up to capacity (name, value) pairs, returns how many
   there are (abi.c). */
int64_t kv_abi(const char **names, int64_t *values, int64_t capacity);

/* paged_decode.c */
int kv_store(const float *key, const float *value, int64_t key_stride, int64_t value_stride,
             float *k_cache, float *v_cache, const int64_t *slots, int64_t rows,
             int64_t kv_heads, int64_t head_dim, int64_t num_slots);
int kv_compact(float *cache, float *other, const int64_t *src, const int64_t *dst,
               int64_t heads, int64_t count, int64_t num_slots, int64_t width);
int kv_decode(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
              const int64_t *tables, int64_t table_stride, const int64_t *lens,
              const int64_t *holes, float *out, int64_t batch, int64_t q_heads, int64_t kv_heads,
              int64_t head_dim, int64_t block, int64_t num_pages, float scale);
int kv_prefill_chunks(const float *q, const float *k_cache, const float *v_cache,
                      const int64_t *tables, int64_t table_stride, const int64_t *base_lens,
                      const int64_t *q_lens, const int64_t *holes, float *out, int64_t batch,
                      int64_t lq_max, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                      int64_t block, int64_t num_pages, float scale);
int kv_chunk_rows(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                  const int64_t *tables, int64_t table_stride, const int64_t *base_lens,
                  const int64_t *q_lens, const int64_t *holes, float *out, int64_t batch,
                  int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t block,
                  int64_t num_pages, float scale);
int kv_query_probs(const float *q, const float *k_cache, int64_t layer_stride,
                   const int64_t *table, int64_t table_len, const int64_t *slots,
                   const int64_t *limits, int64_t length, float *out, int64_t layers, int64_t n,
                   int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t block,
                   int64_t num_pages, float scale, int group_mean,
                   int query_reduce);
void kv_add_rms_norm(float *x, const float *delta, const float *weight, float *out, int64_t rows,
                     int64_t dim, float eps);
void kv_rope(const float *x, int64_t x_stride, const float *cos, const float *sin, float *out,
             int64_t rows, int64_t heads, int64_t head_dim);
void kv_silu_mul(const float *gate_up, float *out, int64_t rows, int64_t inter);

/* thin_linear.c */
void kv_linear(const float *x, int64_t x_stride, const float *w, const float *bias, float *y,
               int64_t T, int64_t K, int64_t N);

/* panel_gemm.c */
void kv_pack_panels(const float *w, float *panels, int64_t N, int64_t K);
void kv_panel_linear(const float *x, int64_t x_stride, const float *panels, const float *bias,
                     float *y, int64_t T, int64_t K, int64_t N);
/* The two above on the calling thread, for a caller that is itself one of a thread team. */
void kv_pack_small(const float *w, float *panels, int64_t N, int64_t K);
void kv_panel_small(const float *x, int64_t x_stride, const float *panels, float *y, int64_t T,
                    int64_t K, int64_t N);

/* key_redundancy.c */
int kv_key_redundancy(const float *k_cache, int64_t layer_stride, const int64_t *table,
                      int64_t length, float *out, int64_t layers, int64_t kv_heads,
                      int64_t head_dim, int64_t block, int64_t num_pages, float threshold,
                      float temperature, int spare_first, int64_t scope);

/* top_p.c */
int kv_top_p_counts(const float *probs, int64_t rows, int64_t n, double p, int64_t *out);

/* step_layers.c */
int kv_step_layers(float *x, const float *cos, const float *sin, const int64_t *weights,
                   int64_t layers, int64_t rows, int64_t hidden, int64_t q_heads,
                   int64_t kv_heads, int64_t head_dim, int64_t inter, float eps, float *k_cache,
                   float *v_cache, int64_t num_pages, int64_t block, const int64_t *slots,
                   int64_t decode_rows, const int64_t *tables, int64_t table_stride,
                   const int64_t *lens, const int64_t *decode_holes, int64_t chunks,
                   const int64_t *chunk_tables, int64_t chunk_stride, const int64_t *chunk_base,
                   const int64_t *chunk_rows, const int64_t *chunk_holes,
                   float scale, const int64_t *signal_rows, float *recent,
                   int64_t recent_entries, float *ema, int64_t ema_slots, const float *betas,
                   int64_t num_betas, const float *final_norm, float *normed, const float *head,
                   int64_t vocab, float *logits, float *queries);

#endif
