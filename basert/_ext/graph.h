/* The decode step of a pre-norm attention decoder (Llama, Qwen3, Gemma 3) run as one job of the persistent
 * thread team (team.h): seven phases per layer and one for the head, each split into chunks that team
 * members claim.
 *
 *   QKV       every member first normalises the residual rows into its own buffer (input norm), then
 *             chunks of whole heads of the q|k|v projection of all tokens, each finished in the chunk:
 *             q/k norms, RoPE (the layer's tables), the K/V cache write
 *   ATTN      one chunk per (sequence, kv head, segment of BASERT_ATTN_SEGMENT positions): the segment's
 *             attention partials for every query row of the group that attends to it (a sliding-window
 *             layer skips the segments before a row's window; a unit with one segment writes its output
 *             directly)
 *   MERGE     one chunk per (sequence, kv head) with several segments: each row's partials merged in
 *             segment order from its window's first segment (no chunks when every sequence is shorter
 *             than a segment)
 *   O         chunks of o_proj output rows, each added to the residual as soon as it is computed, or kept
 *             whole when the layer norms its block outputs (Gemma 3)
 *   O_NORM    (layers with output norms; else no chunks) one chunk per token: x += norm(o_proj output)
 *   GATEUP    every member normalises the residual (post-attention norm); chunks of gate and up rows and
 *             their SwiGLU or GeGLU product
 *   DOWN      chunks of down_proj output rows, added to the residual, or kept whole as for O
 *   DOWN_NORM (layers with output norms) one chunk per token: x += norm(down_proj output)
 *   HEAD      every member normalises the rows that want logits (final norm); chunks of vocab rows
 *
 * Every value is computed by the same row kernels, in the same order, as the Python model files'
 * per-kernel path (models/layers.py, models/gemma3.py): matmul rows by basert_matmul_rows (whose rows are
 * independent of the rows computed with them; a phase whose weights take the integer path has its input rows
 * quantized by each member in the phase's prologue, as matmul.pyx quantizes them once per call), norms by basert_rmsnorm_row, RoPE by basert_rope_row,
 * attention by basert_attend_segment and basert_attend_merge (attention.h: the same bits as
 * basert_attend_rows), SwiGLU and GeGLU by their row functions over 8-aligned column ranges, residual adds
 * as single float additions. So a token's logits are the same bits whichever path, batch or thread count
 * computed them. */
#ifndef BASERT_GRAPH_H
#define BASERT_GRAPH_H

#include <stdint.h>
#include <string.h>

#include "attention.h"
#include "matmul.h"
#include "ops.h"
#include "simd.h"
#include "team.h"

enum {
    BG_QKV = 0, BG_ATTN = 1, BG_MERGE = 2, BG_O = 3, BG_O_NORM = 4, BG_GATEUP = 5, BG_DOWN = 6, BG_DOWN_NORM = 7,
    BG_PHASES_PER_LAYER = 8
};

enum { BG_SWIGLU = 0, BG_GEGLU = 1 };

typedef struct {
    const float *input_norm, *post_norm;    /* [D] */
    const float *attn_out_norm, *mlp_out_norm; /* [D], or NULL: the block outputs are added as they are */
    const float *q_norm, *k_norm;           /* [head_dim], or NULL */
    const float *bq, *bk, *bv;              /* the projections' biases [H*d], [kv*d], [kv*d], or NULL (Qwen2) */
    const float *cos, *sin;                 /* [max_pos, rope_half]: the layer's RoPE tables */
    ptrdiff_t window;                       /* sliding window in positions, 0: none */
    const basert_weight *wq, *wk, *wv, *wo; /* [H*d, D], [kv*d, D], [kv*d, D], [D, H*d] */
    const basert_weight *wgate, *wup, *wdown;
    char *k_cache, *v_cache;                /* [n_blocks, n_kv, 16] rows of the model's K and V types */
} bg_layer;

typedef struct {
    /* Shape */
    int n_layers, n_heads, n_kv, head_dim, rope_half, interleaved, k_type, v_type, max_tokens, n_members, activation;
    ptrdiff_t dim, ffn, vocab, max_pos;
    float eps, scale;
    const float *final_norm;
    const basert_weight *head;
    bg_layer *layers;
    /* Buffers (max_tokens rows each) */
    float *x;       /* [T, D] residual stream, embedded tokens on entry */
    float *normed;  /* [n_members][max_tokens, D] each member's normalised rows */
    uint8_t *quantized; /* [n_members][max_tokens records of basert_qrow_bytes(max_k)]: the phase's input rows quantized
                           by each member, for the weights on the integer path */
    ptrdiff_t max_k;    /* the widest matmul input: max(D, n_heads * head_dim, ffn) */
    float *q, *k, *v, *attn, *delta, *gate, *up;
    float *logits;  /* [n_logits, vocab] */
    /* Attention: unit u = (item u / n_kv, kv head u % n_kv) has rows (token, query head of the group) */
    int unit_rows, max_segments;   /* rows per unit at most (max_tokens * group); ceil(max_pos / S) */
    float *scores;                 /* [n_members][unit_rows * S] */
    float *part_top, *part_sum;    /* [max_tokens * n_heads][max_segments] */
    float *part_acc;               /* [max_tokens * n_heads][max_segments][head_dim] */
    int32_t *attn_chunks;          /* [max units * max_segments][2]: (unit, segment) of each ATTN chunk */
    int32_t *merge_units;          /* [max units]: the units with more than one segment */
    int n_attn_chunks, n_merge_units;
    /* Chunking: rows per chunk of each matmul phase */
    ptrdiff_t qkv_rows, o_rows, ffn_rows, head_rows;
    int qkv_chunks, o_chunks, ffn_chunks, head_chunks;
    /* The step */
    int T, n_items, n_logits, table_stride;
    const int32_t *positions, *item_rows, *item_lengths, *item_starts, *tables, *logit_rows;
    const int32_t *window_tables;           /* the sliding-window layers' block tables (their own pool's blocks) */
} bg_model;

static inline float *bg_member_normed(const bg_model *m, int member) { return m->normed + (ptrdiff_t)member * m->max_tokens * m->dim; }

static inline uint8_t *bg_member_quantized(const bg_model *m, int member) {
    return m->quantized + (ptrdiff_t)member * m->max_tokens * basert_qrow_bytes(m->max_k);
}

/* Rows [r0, r1) of out[T, ldo] = x[T, ldx] @ W^T (on the integer path from qx, x quantized). */
static inline void bg_rows(const basert_weight *w, const float *x, ptrdiff_t ldx, const uint8_t *qx, int T, ptrdiff_t r0,
                           ptrdiff_t r1, float *out, ptrdiff_t ldo) {
    if (r1 > w->n) r1 = w->n;
    if (r0 < r1) basert_matmul_rows(w, x, ldx, qx, T, r0, r1, out, ldo);
}

/* The first of the weights (c may be NULL) that takes the integer path, or NULL. */
static inline const basert_weight *bg_integer_of(const basert_weight *a, const basert_weight *b, const basert_weight *c) {
    return a->integer ? a : b->integer ? b : c && c->integer ? c : NULL;
}

/* A phase's input rows, normalised first where the phase starts with a norm, and quantized into the member's buffer
 * when its weight takes the integer path: once per member and phase, for every chunk the member claims. */
static void bg_prologue(void *ctx, int phase, int member) {
    bg_model *m = (bg_model *)ctx;
    float *h = bg_member_normed(m, member);
    uint8_t *qh = bg_member_quantized(m, member);
    if (phase == m->n_layers * BG_PHASES_PER_LAYER) {
        for (int i = 0; i < m->n_logits; i++)
            basert_rmsnorm_row(m->x + (ptrdiff_t)m->logit_rows[i] * m->dim, m->final_norm, m->eps, h + i * m->dim, m->dim);
        if (m->head->integer) basert_quantize_rows(h, m->dim, m->n_logits, m->dim, m->head->act_max, qh);
        return;
    }
    const bg_layer *l = &m->layers[phase / BG_PHASES_PER_LAYER];
    switch (phase % BG_PHASES_PER_LAYER) {
    case BG_QKV:
    case BG_GATEUP: {
        const int qkv = phase % BG_PHASES_PER_LAYER == BG_QKV;
        for (int t = 0; t < m->T; t++)
            basert_rmsnorm_row(m->x + t * m->dim, qkv ? l->input_norm : l->post_norm, m->eps, h + t * m->dim, m->dim);
        /* The weights that share an input share its act_max (DecodeGraph checks it). */
        const basert_weight *integer = qkv ? bg_integer_of(l->wq, l->wk, l->wv) : bg_integer_of(l->wgate, l->wup, NULL);
        if (integer) basert_quantize_rows(h, m->dim, m->T, m->dim, integer->act_max, qh);
        break;
    }
    case BG_O:
        if (l->wo->integer) basert_quantize_rows(m->attn, l->wo->k, m->T, l->wo->k, l->wo->act_max, qh);
        break;
    case BG_DOWN:
        if (l->wdown->integer) basert_quantize_rows(m->gate, m->ffn, m->T, m->ffn, l->wdown->act_max, qh);
        break;
    default:
        break;
    }
}

/* out = W x rows [r0, r1), then x[t, r] += out[t, r] for those rows, unless the output is normed first
 * (out_norm: the *_NORM phase adds it). */
static void bg_rows_residual(bg_model *m, const basert_weight *w, const float *out_norm, const float *in, ptrdiff_t ldin,
                             const uint8_t *qin, ptrdiff_t r0, ptrdiff_t r1) {
    if (r1 > m->dim) r1 = m->dim;
    if (r0 >= r1) return;
    basert_matmul_rows(w, in, ldin, qin, m->T, r0, r1, m->delta, m->dim);
    if (out_norm) return;
    for (int t = 0; t < m->T; t++) {
        float *x = m->x + t * m->dim, *d = m->delta + t * m->dim;
        for (ptrdiff_t r = r0; r < r1; r++) x[r] = x[r] + d[r];
    }
}

/* *_NORM chunk: x[t] += norm(delta[t]) for token t, the member's normed rows as scratch. */
static void bg_add_normed(bg_model *m, const float *out_norm, int t, int member) {
    float *normed = bg_member_normed(m, member), *x = m->x + t * m->dim;
    basert_rmsnorm_row(m->delta + t * m->dim, out_norm, m->eps, normed, m->dim);
    for (ptrdiff_t r = 0; r < m->dim; r++) x[r] = x[r] + normed[r];
}

/* Byte offset of position p of kv head g in a layer's cache of `type` rows. */
static inline ptrdiff_t bg_cache_offset(const bg_model *m, int type, const int32_t *table, ptrdiff_t p, int g) {
    return ((ptrdiff_t)table[p / BASERT_KV_BLOCK] * m->n_kv * BASERT_KV_BLOCK + g * BASERT_KV_BLOCK + p % BASERT_KV_BLOCK) *
           basert_kv_row_bytes(type, m->head_dim);
}

/* row[i] + bias[i] for i < d (no bias: nothing), the float additions the per-kernel path makes. */
static inline void bg_add_bias(float *row, const float *bias, ptrdiff_t d) {
    if (bias) for (ptrdiff_t i = 0; i < d; i++) row[i] = row[i] + bias[i];
}

/* What follows the projection of one head row of token t: the bias is added, q and k get their norm and RoPE,
 * k and v go into the cache at the token's position. `part` 0, 1, 2 is q, k, v. */
static void bg_finish_head(const bg_model *m, const bg_layer *l, int t, int part, int head) {
    const ptrdiff_t d = m->head_dim, p = m->positions[t];
    int item = 0;
    while (t >= m->item_rows[item] + m->item_lengths[item]) item++;
    const float *c = l->cos + p * m->rope_half, *s = l->sin + p * m->rope_half;
    if (part == 0) {
        float *q = m->q + (t * (ptrdiff_t)m->n_heads + head) * d;
        bg_add_bias(q, l->bq ? l->bq + head * d : NULL, d);
        if (l->q_norm) basert_rmsnorm_row(q, l->q_norm, m->eps, q, d);
        basert_rope_row(q, c, s, m->rope_half, m->interleaved);
        return;
    }
    const int32_t *table = (l->window ? m->window_tables : m->tables) + (ptrdiff_t)item * m->table_stride;
    if (part == 1) {
        float *k = m->k + (t * (ptrdiff_t)m->n_kv + head) * d;
        bg_add_bias(k, l->bk ? l->bk + head * d : NULL, d);
        if (l->k_norm) basert_rmsnorm_row(k, l->k_norm, m->eps, k, d);
        basert_rope_row(k, c, s, m->rope_half, m->interleaved);
        basert_kv_store(m->k_type, k, l->k_cache + bg_cache_offset(m, m->k_type, table, p, head), d);
    } else {
        float *v = m->v + (t * (ptrdiff_t)m->n_kv + head) * d;
        bg_add_bias(v, l->bv ? l->bv + head * d : NULL, d);
        basert_kv_store(m->v_type, v, l->v_cache + bg_cache_offset(m, m->v_type, table, p, head), d);
    }
}

/* Rows [r0, r1) of the concatenated q | k | v projection (whole heads), then each head's norm, RoPE and
 * cache write. */
static void bg_qkv_rows(const bg_model *m, const bg_layer *l, const float *h, const uint8_t *qh, ptrdiff_t r0, ptrdiff_t r1) {
    const ptrdiff_t nq = l->wq->n, nk = l->wk->n, d = m->head_dim;
    const int T = m->T;
    bg_rows(l->wq, h, m->dim, qh, T, r0, r1, m->q, nq);
    bg_rows(l->wk, h, m->dim, qh, T, r0 > nq ? r0 - nq : 0, r1 - nq, m->k, nk);
    bg_rows(l->wv, h, m->dim, qh, T, r0 > nq + nk ? r0 - nq - nk : 0, r1 - nq - nk, m->v, nk);
    if (r1 > nq + 2 * nk) r1 = nq + 2 * nk;
    for (ptrdiff_t r = r0; r < r1; r += d) {
        const int part = r < nq ? 0 : r < nq + nk ? 1 : 2;
        const int head = (int)((part == 0 ? r : part == 1 ? r - nq : r - nq - nk) / d);
        for (int t = 0; t < T; t++) bg_finish_head(m, l, t, part, head);
    }
}

/* The rows of a unit in order (token-major), with their query, output and visible positions. */
typedef struct {
    int n;
    const float **q;
    float **out;
    ptrdiff_t *n_pos;
    int *index; /* t * n_heads + h: the row's place among the partials */
} bg_unit_rows;

static inline int bg_unit_segments(const bg_model *m, int unit) {
    const int item = unit / m->n_kv;
    const ptrdiff_t n_max = (ptrdiff_t)m->item_starts[item] + m->item_lengths[item];
    return (int)((n_max + BASERT_ATTN_SEGMENT - 1) / BASERT_ATTN_SEGMENT);
}

/* Each member's pointer arrays for one unit's rows live after its scores. */
static void bg_unit_rows_of(const bg_model *m, int unit, int member, bg_unit_rows *rows) {
    const ptrdiff_t d = m->head_dim, qdim = (ptrdiff_t)m->n_heads * d;
    const int item = unit / m->n_kv, g = unit % m->n_kv, group = m->n_heads / m->n_kv;
    const int row0 = m->item_rows[item], len = m->item_lengths[item], start = m->item_starts[item];
    char *base = (char *)(m->scores + (ptrdiff_t)member * m->unit_rows * (BASERT_ATTN_SEGMENT + 8));
    base += (ptrdiff_t)m->unit_rows * BASERT_ATTN_SEGMENT * sizeof(float);
    rows->q = (const float **)base;
    rows->out = (float **)(base + m->unit_rows * sizeof(float *));
    rows->n_pos = (ptrdiff_t *)(base + 2 * m->unit_rows * sizeof(float *));
    rows->index = (int *)(base + 3 * m->unit_rows * sizeof(float *));
    int n = 0;
    for (int t = row0; t < row0 + len; t++)
        for (int h = g * group; h < (g + 1) * group; h++, n++) {
            rows->q[n] = m->q + t * qdim + h * d;
            rows->out[n] = m->attn + t * qdim + h * d;
            rows->n_pos[n] = start + (t - row0) + 1;
            rows->index[n] = t * m->n_heads + h;
        }
    rows->n = n;
}

/* ATTN chunk: segment j of unit u. */
static void bg_attention_segment(bg_model *m, const bg_layer *l, int unit, int j, int member) {
    const ptrdiff_t d = m->head_dim, block_rows = (ptrdiff_t)m->n_kv * BASERT_KV_BLOCK;
    const int item = unit / m->n_kv, g = unit % m->n_kv, n_segments = bg_unit_segments(m, unit);
    const int32_t *table = (l->window ? m->window_tables : m->tables) + (ptrdiff_t)item * m->table_stride;
    const ptrdiff_t k_offset = (ptrdiff_t)g * BASERT_KV_BLOCK * basert_kv_row_bytes(m->k_type, d);
    const ptrdiff_t v_offset = (ptrdiff_t)g * BASERT_KV_BLOCK * basert_kv_row_bytes(m->v_type, d);
    float *scores = m->scores + (ptrdiff_t)member * m->unit_rows * (BASERT_ATTN_SEGMENT + 8);
    bg_unit_rows rows;
    bg_unit_rows_of(m, unit, member, &rows);
    const ptrdiff_t p0 = (ptrdiff_t)j * BASERT_ATTN_SEGMENT;
    const ptrdiff_t n_max = (ptrdiff_t)m->item_starts[item] + m->item_lengths[item];
    const ptrdiff_t p1 = p0 + BASERT_ATTN_SEGMENT < n_max ? p0 + BASERT_ATTN_SEGMENT : n_max;
    /* top, sum and acc pointers of every row for this segment (in the member's scratch, after the rows). */
    float top[BASERT_ATTN_MAX_ROWS], sum[BASERT_ATTN_MAX_ROWS];
    float *acc[BASERT_ATTN_MAX_ROWS];
    for (int r0 = 0; r0 < rows.n; r0 += BASERT_ATTN_MAX_ROWS) {
        const int n = rows.n - r0 < BASERT_ATTN_MAX_ROWS ? rows.n - r0 : BASERT_ATTN_MAX_ROWS;
        for (int r = 0; r < n; r++)
            acc[r] = n_segments == 1 ? rows.out[r0 + r] : m->part_acc + ((ptrdiff_t)rows.index[r0 + r] * m->max_segments + j) * d;
        basert_attend_segment(n, rows.q + r0, rows.n_pos + r0, l->window, p0, p1, l->k_cache + k_offset, l->v_cache + v_offset,
                              m->k_type, m->v_type, table, block_rows, d, m->scale, scores, top, sum, acc);
        for (int r = 0; r < n; r++) {
            if (!basert_attn_takes_part(rows.n_pos[r0 + r], l->window, p0)) continue;
            if (n_segments == 1) {
                basert_scale(1.0f / sum[r], acc[r], d);   /* one segment: the output itself */
            } else {
                const ptrdiff_t at = (ptrdiff_t)rows.index[r0 + r] * m->max_segments + j;
                m->part_top[at] = top[r];
                m->part_sum[at] = sum[r];
            }
        }
    }
}

/* MERGE chunk: every row of a unit with several segments, from its partials (those of the segments from the
 * one holding the row's first visible position). */
static void bg_attention_merge(bg_model *m, const bg_layer *l, int unit, int member) {
    const ptrdiff_t d = m->head_dim;
    bg_unit_rows rows;
    bg_unit_rows_of(m, unit, member, &rows);
    for (int r = 0; r < rows.n; r++) {
        const int first = (int)(basert_attn_first(rows.n_pos[r], l->window) / BASERT_ATTN_SEGMENT);
        const int end = (int)((rows.n_pos[r] + BASERT_ATTN_SEGMENT - 1) / BASERT_ATTN_SEGMENT);
        const ptrdiff_t at = (ptrdiff_t)rows.index[r] * m->max_segments + first;
        basert_attend_merge(end - first, m->part_top + at, m->part_sum + at, m->part_acc + at * d, d, d, rows.out[r]);
    }
}

static void bg_chunk(void *ctx, int phase, int chunk, int member) {
    bg_model *m = (bg_model *)ctx;
    const int T = m->T;
    if (phase == m->n_layers * BG_PHASES_PER_LAYER) {
        const ptrdiff_t r0 = chunk * m->head_rows;
        bg_rows(m->head, bg_member_normed(m, member), m->dim, bg_member_quantized(m, member), m->n_logits, r0,
                r0 + m->head_rows, m->logits, m->vocab);
        return;
    }
    const bg_layer *l = &m->layers[phase / BG_PHASES_PER_LAYER];
    const float *h = bg_member_normed(m, member);
    const uint8_t *qh = bg_member_quantized(m, member);
    switch (phase % BG_PHASES_PER_LAYER) {
    case BG_QKV:
        bg_qkv_rows(m, l, h, qh, chunk * m->qkv_rows, (chunk + 1) * m->qkv_rows);
        break;
    case BG_ATTN:
        bg_attention_segment(m, l, m->attn_chunks[2 * chunk], m->attn_chunks[2 * chunk + 1], member);
        break;
    case BG_MERGE:
        bg_attention_merge(m, l, m->merge_units[chunk], member);
        break;
    case BG_O:
        bg_rows_residual(m, l->wo, l->attn_out_norm, m->attn, (ptrdiff_t)m->n_heads * m->head_dim, qh, chunk * m->o_rows,
                         (chunk + 1) * m->o_rows);
        break;
    case BG_O_NORM:
        bg_add_normed(m, l->attn_out_norm, chunk, member);
        break;
    case BG_GATEUP: {
        ptrdiff_t r0 = chunk * m->ffn_rows, r1 = r0 + m->ffn_rows;
        if (r1 > m->ffn) r1 = m->ffn;
        bg_rows(l->wgate, h, m->dim, qh, T, r0, r1, m->gate, m->ffn);
        bg_rows(l->wup, h, m->dim, qh, T, r0, r1, m->up, m->ffn);
        for (int t = 0; t < T; t++) {
            float *gate = m->gate + t * m->ffn + r0;
            const float *up = m->up + t * m->ffn + r0;
            if (m->activation == BG_GEGLU) basert_gelu_tanh_mul_row(gate, up, gate, r1 - r0);
            else basert_silu_mul_row(gate, up, gate, r1 - r0);
        }
        break;
    }
    case BG_DOWN:
        bg_rows_residual(m, l->wdown, l->mlp_out_norm, m->gate, m->ffn, qh, chunk * m->o_rows, (chunk + 1) * m->o_rows);
        break;
    default:
        bg_add_normed(m, l->mlp_out_norm, chunk, member);
        break;
    }
}

static inline int bg_chunks_for(ptrdiff_t rows, ptrdiff_t per) { return (int)((rows + per - 1) / per); }

/* Rows per chunk: about `target` chunks per member, a multiple of 16 rows (SwiGLU's 8-column groups and
 * the 4-row blocks of the streaming kernel stay whole). */
static inline ptrdiff_t bg_rows_per_chunk(ptrdiff_t rows, int members, int target) {
    ptrdiff_t chunks = (ptrdiff_t)members * target;
    ptrdiff_t per = (rows + chunks - 1) / chunks;
    per = (per + 15) & ~(ptrdiff_t)15;
    return per < 16 ? 16 : per;
}

/* Fills the chunk counts of every phase for the step described in m; returns the phase count. */
static int bg_plan_step(bg_model *m, int32_t *chunks) {
    m->n_attn_chunks = m->n_merge_units = 0;
    for (int u = 0; u < m->n_items * m->n_kv; u++) {
        const int n_segments = bg_unit_segments(m, u);
        for (int j = 0; j < n_segments; j++) {
            m->attn_chunks[2 * m->n_attn_chunks] = u;
            m->attn_chunks[2 * m->n_attn_chunks + 1] = j;
            m->n_attn_chunks++;
        }
        if (n_segments > 1) m->merge_units[m->n_merge_units++] = u;
    }
    int p = 0;
    for (int i = 0; i < m->n_layers; i++) {
        chunks[p++] = m->qkv_chunks;
        chunks[p++] = m->n_attn_chunks;
        chunks[p++] = m->n_merge_units;
        chunks[p++] = m->o_chunks;
        chunks[p++] = m->layers[i].attn_out_norm ? m->T : 0;
        chunks[p++] = m->ffn_chunks;
        chunks[p++] = m->o_chunks;
        chunks[p++] = m->layers[i].mlp_out_norm ? m->T : 0;
    }
    chunks[p++] = m->n_logits > 0 ? m->head_chunks : 0;
    return p;
}

/* Sets the chunk sizes for the model's shapes and the team's member count. */
static void bg_plan_chunks(bg_model *m) {
    const bg_layer *l = &m->layers[0];
    const ptrdiff_t qkv = l->wq->n + l->wk->n + l->wv->n;
    /* Whole heads per chunk, so a chunk can finish the heads it projects. */
    m->qkv_rows = bg_rows_per_chunk(qkv, m->n_members, 4);
    m->qkv_rows = (m->qkv_rows + m->head_dim - 1) / m->head_dim * m->head_dim;
    m->qkv_chunks = bg_chunks_for(qkv, m->qkv_rows);
    m->o_rows = bg_rows_per_chunk(m->dim, m->n_members, 4);
    m->o_chunks = bg_chunks_for(m->dim, m->o_rows);
    m->ffn_rows = bg_rows_per_chunk(m->ffn, m->n_members, 4);
    m->ffn_chunks = bg_chunks_for(m->ffn, m->ffn_rows);
    /* The head is the longest phase (Gemma 3's 262,144 x 640 rows): small chunks, so a member that another
     * process delays holds the step up by little (Gemma 3 tg128 on a busy 2-core Zen 3: 29.9 -> 31.1 tok/s
     * with 32 chunks per member instead of 8, three alternations). */
    m->head_rows = bg_rows_per_chunk(m->vocab, m->n_members, 32);
    m->head_chunks = bg_chunks_for(m->vocab, m->head_rows);
}

#endif
