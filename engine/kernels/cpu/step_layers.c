/* A step's whole decoder stack in one call: every layer's norms, projections, RoPE, KV store
   and paged attention for rows that are one-token items and short chunks (per-head holes
   allowed), then the final norm and, when given, the LM head, float32 on the CPU.

   engine/kernels/cpu_native.py (`step_layers`) calls it through ctypes; its docstring has
   why, results/benchmarks/cpu-kernels-notes.md the figures. It runs the same C kernels, in the
   same order and on the same operands, as an eager layer with the C kernels on
   (engine/models/llama.py, DecoderLayer._forward_native), so the residual stream it leaves
   equals that path's bit for bit; only the Python between the kernels is gone.

     x:        [T, hidden], the embedded tokens; on return the residual stream after the last
               layer (before the final norm), written in place
     final_norm: [hidden], the final RMSNorm's weight; normed [T, hidden] takes RMSNorm(x)
     head:     NULL, or the LM head's column panels [ceil(vocab / 16), hidden, 16]; then logits
               [T, vocab] takes normed @ head^T (the model's compute_logits, same kernel)
     cos, sin: [T, head_dim], the rows' rotary tables (rope.py's RopeRows, sign in sin)
     weights:  [layers, KV_LAYER_FIELDS] int64 addresses, in kvarena_native.h's order: RMSNorm
               weights [hidden], column panels [ceil(out / 16), in, 16] (panel_gemm.c), the
               q/k/v bias or 0
     k_cache, v_cache: [layers, kv_heads, num_pages * block, head_dim]
     slots [T]: kv_store's, every row's
     rows [0, decode_rows): one-token items; tables [decode_rows, table_stride], lens
               [decode_rows]: kv_decode's (paged_decode.c); decode_holes: NULL, or their
               per-head holes [layers, decode_rows, kv_heads, 2] (start, end), layer l's
               those of kv_decode
     rows [decode_rows, T): `chunks` chunks, their rows in order; chunk_tables [chunks,
               chunk_stride], chunk_base, chunk_rows [chunks]: kv_chunk_rows' (paged_decode.c);
               chunk_holes: NULL, or [layers, chunks, kv_heads, 2], layer l's holes
     signal_rows: NULL, or [T, 3] per row (entry, slot, init): the policies' query signals
               (engine/query_state.py's pools) written from each layer's pre-RoPE queries while
               they are in cache, rows in order: the recent-query ring's flat entry `entry`
               (-1: none) of recent [entries, layers, q_heads * head_dim] takes the query; the
               summaries of `slot` (-1: none) in ema [slots, layers, num_betas, q_heads *
               head_dim] take one step of the EMA rule, ema + (1 - beta) (q - ema), each set to
               the query instead where `init` is 1 (query_state.ema_update)

   queries: NULL, or [layers, T, q_heads * head_dim]: a recomputation (PolicyView's
               recompute_queries), which stores nothing, reads every row's keys and values
               from the cache (slots are not read), and takes each layer's post-RoPE queries
               here; it projects only the queries and stops after the last layer's, so neither
               the final norm nor the head runs

   The final norm and the head run here, not as torch calls after this one, because a step's
   first ops after streaming 0.54 GB of weights run cold (engine/kernels/cpu_native.py has the
   figures); inside the call they reuse the layers' hot code and data.

   Returns KV_OK or the first error code of kv_store / kv_decode / kv_chunk_rows (nothing past
   that layer ran; a bad hole is their KV_BAD_HOLE); KV_BAD_LENGTH when the chunks' rows do not
   add up to T - decode_rows; KV_BAD_SLOT, before any layer runs, when a signal row names an
   entry or slot outside its pool. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvarena_native.h"

#define FIELD(layer, f) ((const float *)(intptr_t)weights[(layer) * KV_LAYER_FIELDS + (f)])

/* Whether every signal row's entry and slot lie inside their pools (-1 allowed). */
static int signal_rows_fit(const int64_t *signal_rows, int64_t rows, int64_t entries,
                           int64_t slots) {
    for (int64_t t = 0; t < rows; t++) {
        const int64_t entry = signal_rows[3 * t], slot = signal_rows[3 * t + 1];
        if (entry < -1 || entry >= entries || slot < -1 || slot >= slots) return 0;
    }
    return 1;
}

/* Layer l's signal writes (the header comment above): row t's query is qkv + t * qkv_width.
   The EMA step is torch.lerp's formula, so it rounds as query_state.ema_update does. */
static void write_signals(const float *qkv, int64_t qkv_width, int64_t rows, int64_t l,
                          int64_t layers, int64_t q_width, const int64_t *signal_rows,
                          float *recent, float *ema, const float *betas, int64_t num_betas) {
    for (int64_t t = 0; t < rows; t++) {
        const float *q = qkv + t * qkv_width;
        const int64_t entry = signal_rows[3 * t], slot = signal_rows[3 * t + 1];
        if (entry >= 0)
            memcpy(recent + (entry * layers + l) * q_width, q, (size_t)q_width * sizeof(float));
        if (slot < 0) continue;
        float *summary = ema + (slot * layers + l) * num_betas * q_width;
        for (int64_t b = 0; b < num_betas; b++, summary += q_width) {
            if (signal_rows[3 * t + 2]) {
                memcpy(summary, q, (size_t)q_width * sizeof(float));
                continue;
            }
            const float w = 1.0f - betas[b];
            if (w < 0.5f)
                for (int64_t i = 0; i < q_width; i++)
                    summary[i] = summary[i] + w * (q[i] - summary[i]);
            else
                for (int64_t i = 0; i < q_width; i++)
                    summary[i] = q[i] - (q[i] - summary[i]) * (1.0f - w);
        }
    }
}

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
                   int64_t vocab, float *logits, float *queries) {
    int64_t chunked = 0;
    for (int64_t c = 0; c < chunks; c++) chunked += chunk_rows[c];
    if (decode_rows < 0 || chunks < 0 || decode_rows + chunked != rows) return KV_BAD_LENGTH;
    if (signal_rows != 0 && !signal_rows_fit(signal_rows, rows, recent ? recent_entries : 0,
                                             ema ? ema_slots : 0))
        return KV_BAD_SLOT;
    const int64_t q_width = q_heads * head_dim, kv_width = kv_heads * head_dim;
    const int64_t qkv_width = q_width + 2 * kv_width;
    /* a recomputation projects and rotates the queries only: its keys are in the cache */
    const int64_t qk_width = queries ? q_width : q_width + kv_width;
    const int64_t projected = queries ? q_width : qkv_width;
    const int64_t layer_slots = kv_heads * num_pages * block * head_dim;
    /* One scratch block for the step: h, qkv, rotated q|k, attention, o, gate|up, act, down. */
    const int64_t widths[] = {hidden, qkv_width, qk_width, q_width, hidden, 2 * inter, inter,
                              hidden};
    int64_t total = 0;
    for (size_t i = 0; i < sizeof widths / sizeof *widths; i++) total += rows * widths[i];
    float *scratch = malloc((size_t)total * sizeof(float));
    if (scratch == 0) return KV_NO_MEMORY;
    float *h = scratch, *qkv = h + rows * hidden, *qk = qkv + rows * qkv_width;
    float *attn = qk + rows * qk_width, *o = attn + rows * q_width, *gate_up = o + rows * hidden;
    float *act = gate_up + rows * 2 * inter, *down = act + rows * inter;
    int rc = 0;
    for (int64_t l = 0; l < layers; l++) {
        float *k_layer = k_cache + l * layer_slots, *v_layer = v_cache + l * layer_slots;
        /* The previous layer's MLP residual is added here, fused into this layer's first norm,
           as the eager layer adds it before its norm. */
        kv_add_rms_norm(x, l ? down : 0, FIELD(l, KV_INPUT_NORM), h, rows, hidden, eps);
        kv_panel_linear(h, hidden, FIELD(l, KV_QKV), FIELD(l, KV_QKV_BIAS), qkv, rows, hidden,
                        projected);
        if (signal_rows != 0)
            write_signals(qkv, projected, rows, l, layers, q_width, signal_rows, recent, ema,
                          betas, num_betas);
        /* q and k (q alone in a recomputation) rotated in one pass over their adjacent heads;
           v is read from qkv in place */
        kv_rope(qkv, projected, cos, sin, qk, rows, qk_width / head_dim, head_dim);
        if (queries) {
            memcpy(queries + l * rows * q_width, qk, (size_t)(rows * q_width) * sizeof(float));
            if (l == layers - 1) break; /* the last layer's queries are all it needs */
        } else {
            rc = kv_store(qk + q_width, qkv + q_width + kv_width, qk_width, qkv_width, k_layer,
                          v_layer, slots, rows, kv_heads, head_dim, num_pages * block);
        }
        if (rc) break;
        if (decode_rows)
            rc = kv_decode(qk, qk_width, k_layer, v_layer, tables, table_stride, lens,
                           decode_holes ? decode_holes + l * decode_rows * kv_heads * 2 : 0,
                           attn, decode_rows, q_heads, kv_heads, head_dim, block, num_pages,
                           scale);
        if (rc == 0 && chunks)
            rc = kv_chunk_rows(qk + decode_rows * qk_width, qk_width, k_layer, v_layer,
                               chunk_tables, chunk_stride, chunk_base, chunk_rows,
                               chunk_holes ? chunk_holes + l * chunks * kv_heads * 2 : 0,
                               attn + decode_rows * q_width, chunks, q_heads, kv_heads, head_dim,
                               block, num_pages, scale);
        if (rc) break;
        kv_panel_linear(attn, q_width, FIELD(l, KV_O), 0, o, rows, q_width, hidden);
        kv_add_rms_norm(x, o, FIELD(l, KV_POST_NORM), h, rows, hidden, eps);
        kv_panel_linear(h, hidden, FIELD(l, KV_GATE_UP), 0, gate_up, rows, hidden, 2 * inter);
        kv_silu_mul(gate_up, act, rows, inter);
        kv_panel_linear(act, inter, FIELD(l, KV_DOWN), 0, down, rows, inter, hidden);
    }
    if (rc == 0 && layers > 0 && queries == 0) {
        /* the last layer's MLP residual, fused into the final norm as into every layer's */
        kv_add_rms_norm(x, down, final_norm, normed, rows, hidden, eps);
        if (head != 0) kv_panel_linear(normed, hidden, head, 0, logits, rows, hidden, vocab);
    }
    free(scratch);
    return rc;
}
