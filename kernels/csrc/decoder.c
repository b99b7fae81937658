/* The decoder layers of a Llama-family model for a few rows at a time (decode tokens, draft trees, short
 * prefill chunks), in one call on x86 CPUs with AVX2, FMA and F16C.
 *
 * Eager PyTorch spends several microseconds in each of the ~10 small operators of a layer (norms, casts,
 * RoPE, cache writes, attention set-up, SwiGLU); at a few rows that costs as much as the weights. Here a
 * whole forward is one OpenMP region: per layer, RMSNorm -> int8 activation blocks -> fused QKV
 * (integer_dot.h) -> its bias (Qwen2's q/k/v biases, fp32; none for Llama) -> RoPE -> K/V written to their cache slots -> paged attention over the block table and
 * the token's ancestors among the new tokens -> o_proj -> residual -> RMSNorm -> gate/up -> SwiGLU ->
 * down -> residual. The residual stream, norms, RoPE and softmax are fp32; the cache is fp32 or bf16.
 *
 * Every row is computed the same way whatever else is in the batch: the projections row by row
 * (integer_dot.h), and attention over a token's keys in their sequence order (cached tokens, then its
 * ancestors root first), so a draft token accepted at depth d produces exactly what decoding it would.
 */
#include <omp.h>
#include <stdlib.h>

#include "integer_dot.h"

/* A weight-only quantized [n, k] matrix in the row layout (int4_gemm.c) or interleaved (vnni.c). */
typedef struct {
    const void *codes;      /* rows: q4 [n, k / 2] uint8 (pack_q4), q8 [n, k] int8; interleaved: vnni.c */
    const uint16_t *scales; /* [n, k / 32] fp16 (interleaved: per block of 16 rows and group) */
    const uint16_t *mins;   /* [n, k / 32] fp16 (w = q * d + m); NULL for a q8 weight in the row layout */
    int64_t n, k, bits;     /* bits: 4 or 8 */
    int64_t interleaved;    /* 1: vnni.c's layout (AVX512-VNNI) */
} QWeight;

typedef struct {
    const float *input_norm, *post_norm; /* [hidden] fp32 */
    QWeight qkv, o, gate_up, down;       /* qkv rows: q heads, k heads, v heads; gate_up rows: gate, up */
    void *k_cache, *v_cache;             /* [slots, kv_heads, head_dim] fp32 or bf16 */
    const float *qkv_bias;               /* [(num_heads + 2 num_kv_heads) head_dim] fp32, or NULL for none */
} Layer;

typedef struct {
    int64_t num_layers, hidden, intermediate, num_heads, num_kv_heads, head_dim, block_size;
    int64_t cache_bf16; /* 1: the cache holds bf16, 0: fp32 */
    float eps, scale;   /* RMSNorm epsilon; attention's 1 / sqrt(head_dim) */
    const float *cos, *sin; /* [max_positions, head_dim] rotary tables (rotate-half layout) */
    const Layer *layers;
    int64_t max_positions, num_slots; /* rows of cos and sin; slots of each layer's cache */
} Decoder;

/* The step's new tokens: B sequences, T tokens; sequence b owns tokens query_start[b]..query_start[b+1]. */
typedef struct {
    int64_t num_tokens, num_seqs, table_stride, table_width; /* block_tables: [B, table_width], rows stride apart */
    int64_t bad; /* out: the element a failed check (check_batch) points at */
    const int64_t *positions;    /* [T] */
    const int64_t *slots;        /* [T] cache slot each token's K/V go to */
    const int32_t *query_start;  /* [B + 1] */
    const int32_t *seq_lens;     /* [B] cached + new tokens */
    const int32_t *block_tables; /* [B, table_stride] */
    const int32_t *parents;      /* [T] parent among its sequence's new tokens, -1 for none (a chain: i - 1) */
} Batch;

/* Activations of `rows` rows of width k as int8 blocks. */
typedef struct {
    int8_t *xq;
    float *dx, *sx;
} Blocks;

static void quantize_rows(const float *x, int64_t rows, int64_t k, Blocks *a) {
    const int64_t groups = k / GROUP;
#pragma omp for schedule(static)
    for (int64_t b = 0; b < rows * groups; b++) quantize_block(x + b * GROUP, a->xq + b * GROUP, a->dx + b, a->sx + b);
}

/* out [rows, n] fp32 = activations @ W.T, output rows split across the team (ends with a barrier). */
static void project(const QWeight *w, const Blocks *a, int64_t rows, float *out) {
    const int64_t groups = w->k / GROUP, k = w->k, n = w->n;
    if (w->interleaved) {
        const int64_t t = omp_get_thread_num(), teams = omp_get_num_threads(), blocks = n / 16;
        vnni_blocks(w->codes, w->scales, w->mins, (int)w->bits, n, k, a->xq, a->dx, a->sx, rows, out,
                    blocks * t / teams, blocks * (t + 1) / teams);
#pragma omp barrier
        return;
    }
#pragma omp for schedule(static)
    for (int64_t j = 0; j < n; j++) {
        for (int64_t r0 = 0; r0 < rows; r0 += 4) {
            const int R = rows - r0 < 4 ? (int)(rows - r0) : 4;
            float dots[4];
            if (w->bits == 4) {
                const uint8_t *q = (const uint8_t *)w->codes + j * groups * 16;
#define Q4(C) q4_row(q, w->scales + j * groups, w->mins + j * groups, groups, a->xq + r0 * k, a->dx + r0 * groups, \
                     a->sx + r0 * groups, k, C, dots)
                ROW_TILE(Q4)
#undef Q4
            } else {
                const int8_t *q = (const int8_t *)w->codes + j * k;
#define Q8(C) q8_row(q, w->scales + j * groups, groups, a->xq + r0 * k, a->dx + r0 * groups, k, C, dots)
                ROW_TILE(Q8)
#undef Q8
            }
            for (int r = 0; r < R; r++) out[(r0 + r) * n + j] = dots[r];
        }
    }
}

/* y = x / rms(x) * w for each row (dim a multiple of 8), rows split across the team. */
static void rms_norm(const float *x, const float *w, int64_t rows, int64_t dim, float eps, float *y) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        __m256 squares = _mm256_setzero_ps();
        for (int64_t i = 0; i < dim; i += 8) squares = _mm256_fmadd_ps(_mm256_loadu_ps(xr + i), _mm256_loadu_ps(xr + i), squares);
        const __m256 inv = _mm256_set1_ps(1.0f / sqrtf(hsum(squares) / (float)dim + eps));
        for (int64_t i = 0; i < dim; i += 8)
            _mm256_storeu_ps(y + r * dim + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), inv), _mm256_loadu_ps(w + i)));
    }
}

/* x += y over rows * dim values, split across the team. */
static void add_rows(float *x, const float *y, int64_t rows, int64_t dim) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < dim; i++) x[r * dim + i] += y[r * dim + i];
}

/* Rotate one head in place: x[i] = x[i] cos[i] - x[i + h] sin[i], x[i + h] = x[i + h] cos[i + h] + x[i] sin[i + h]. */
static void rope(float *x, const float *cos, const float *sin, int64_t dim) {
    const int64_t half = dim / 2;
    for (int64_t i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

static inline void store_row(void *cache, int64_t index, const float *src, int64_t n, int bf16) {
    if (bf16) {
        uint16_t *dst = (uint16_t *)cache + index;
        for (int64_t i = 0; i < n; i++) dst[i] = float_to_bf16(src[i]);
    } else {
        memcpy((float *)cache + index, src, n * sizeof(float));
    }
}

static inline __m256 load8(const void *base, int64_t index, int bf16) {
    if (bf16) {
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + index));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)base + index);
}

/* exp(x), about 1 ulp over [-87, 88] (clamped outside): 2^n p(r) with x = n ln2 + r, |r| <= ln2 / 2. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x); /* ln2 in two parts: exact n * hi */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    /* 2^n in two factors, so n = 128 (x near 88) does not overflow the exponent field. */
    const __m256i half = _mm256_srai_epi32(_mm256_cvtps_epi32(n), 1);
    const __m256i rest = _mm256_sub_epi32(_mm256_cvtps_epi32(n), half);
    const __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(127)), 23));
    const __m256 b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(rest, _mm256_set1_epi32(127)), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, a), b);
}

/* The first n (< 8) floats of p, the rest of the vector `fill`. */
static inline __m256 load_partial(const float *p, int64_t n, float fill) {
    float v[8];
    for (int i = 0; i < 8; i++) v[i] = i < n ? p[i] : fill;
    return _mm256_loadu_ps(v);
}

static inline void store_partial(float *p, int64_t n, __m256 x) {
    float v[8];
    _mm256_storeu_ps(v, x);
    for (int i = 0; i < n; i++) p[i] = v[i];
}

/* The query heads q[0..heads) (head_dim apart) that share one KV head, of one token, over its keys
 * (slots[0..n) in sequence order): out[h] = softmax(q[h].K * scale) V. K and V rows are read once for
 * all the heads; each head's arithmetic is the same whatever the number of heads. scores: [heads, n]. */
static void attend(const float *q, int64_t heads, const Decoder *m, const Layer *layer, int64_t kv_head,
                   const int64_t *slots, int64_t n, float *scores, float *out) {
    const int64_t dim = m->head_dim, row = m->num_kv_heads * dim;
    const int bf16 = (int)m->cache_bf16;
    float best[16]; /* heads per KV head <= 16 */
    for (int64_t h = 0; h < heads; h++) best[h] = -INFINITY;
    for (int64_t j = 0; j < n; j++) {
        __m256 key[16]; /* head_dim <= 128 */
        const int64_t at = slots[j] * row + kv_head * dim;
        for (int64_t i = 0; i < dim / 8; i++) key[i] = load8(layer->k_cache, at + 8 * i, bf16);
        for (int64_t h = 0; h < heads; h++) {
            __m256 acc = _mm256_setzero_ps();
            for (int64_t i = 0; i < dim / 8; i++) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * dim + 8 * i), key[i], acc);
            const float s = hsum(acc) * m->scale;
            scores[h * n + j] = s;
            best[h] = fmaxf(best[h], s);
        }
    }
    float total[16];
    for (int64_t h = 0; h < heads; h++) {
        float *sc = scores + h * n;
        __m256 sums = _mm256_setzero_ps();
        for (int64_t j = 0; j < n; j += 8) {
            const int64_t left = n - j;
            const __m256 s = left >= 8 ? _mm256_loadu_ps(sc + j) : load_partial(sc + j, left, -INFINITY);
            const __m256 p = _mm256_and_ps(exp8(_mm256_sub_ps(s, _mm256_set1_ps(best[h]))),
                                           _mm256_cmp_ps(s, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ));
            if (left >= 8)
                _mm256_storeu_ps(sc + j, p);
            else
                store_partial(sc + j, left, p);
            sums = _mm256_add_ps(sums, p);
        }
        total[h] = hsum(sums);
        for (int64_t i = 0; i < dim; i++) out[h * dim + i] = 0.0f;
    }
    for (int64_t j = 0; j < n; j++) {
        __m256 value[16];
        const int64_t at = slots[j] * row + kv_head * dim;
        for (int64_t i = 0; i < dim / 8; i++) value[i] = load8(layer->v_cache, at + 8 * i, bf16);
        for (int64_t h = 0; h < heads; h++) {
            const __m256 p = _mm256_set1_ps(scores[h * n + j]);
            float *o = out + h * dim;
            for (int64_t i = 0; i < dim / 8; i++) _mm256_storeu_ps(o + 8 * i, _mm256_fmadd_ps(p, value[i], _mm256_loadu_ps(o + 8 * i)));
        }
    }
    for (int64_t h = 0; h < heads; h++) {
        const __m256 inv = _mm256_set1_ps(1.0f / total[h]);
        for (int64_t i = 0; i < dim; i += 8) _mm256_storeu_ps(out + h * dim + i, _mm256_mul_ps(_mm256_loadu_ps(out + h * dim + i), inv));
    }
}

/* The sequence of token t and its keys' cache slots, in sequence order; returns how many. */
static int64_t token_keys(const Decoder *m, const Batch *b, int64_t t, int64_t *slots) {
    int64_t s = 0;
    while (b->query_start[s + 1] <= t) s++;
    const int64_t first = b->query_start[s], num_new = b->query_start[s + 1] - first;
    const int64_t cached = b->seq_lens[s] - num_new;
    const int32_t *table = b->block_tables + s * b->table_stride;
    for (int64_t c = 0; c < cached; c++) slots[c] = (int64_t)table[c / m->block_size] * m->block_size + c % m->block_size;
    int64_t depth = 0;
    for (int64_t i = t - first; i >= 0; i = b->parents[first + i]) depth++;
    int64_t at = cached + depth;
    for (int64_t i = t - first; i >= 0; i = b->parents[first + i]) slots[--at] = b->slots[first + i];
    return cached + depth;
}

static int64_t max_keys(const Batch *b) {
    int64_t most = 0;
    for (int64_t s = 0; s < b->num_seqs; s++) most = b->seq_lens[s] > most ? b->seq_lens[s] : most;
    return most;
}

/* silu(gate) * up for each row of gate_up [T, 2 I] (gate first) into act [T, I]. */
static void swiglu(const float *gate_up, int64_t rows, int64_t inter, float *act) {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        const float *gate = gate_up + t * 2 * inter, *up = gate + inter;
        float *out = act + t * inter;
        for (int64_t i = 0; i < inter; i += 8) {
            const int64_t left = inter - i;
            const __m256 g = left >= 8 ? _mm256_loadu_ps(gate + i) : load_partial(gate + i, left, 0.0f);
            const __m256 u = left >= 8 ? _mm256_loadu_ps(up + i) : load_partial(up + i, left, 0.0f);
            const __m256 sig = _mm256_div_ps(_mm256_set1_ps(1.0f),
                                             _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
            const __m256 y = _mm256_mul_ps(_mm256_mul_ps(g, sig), u);
            if (left >= 8)
                _mm256_storeu_ps(out + i, y);
            else
                store_partial(out + i, left, y);
        }
    }
}

/* What check_batch finds wrong (decoder_forward's return value). */
enum { BAD_QUERY_START = 1, BAD_SEQ_LEN, BAD_TABLE_WIDTH, BAD_BLOCK, BAD_POSITION, BAD_SLOT, BAD_PARENT };

/* Every index the forward reads is checked against what it addresses before anything is read or written,
 * so no batch can drive it outside its tables and cache: query_start starts at 0, never decreases and ends
 * at T; each sequence has at least its new tokens as keys, its cached keys fit its block-table row, whose
 * entries it reads are blocks of the cache; positions index the rotary tables; slots index the cache; a
 * token's parent is -1 or an earlier token of its sequence (so the ancestor walk ends). Returns 0, or the
 * first failed check with the offending element in b->bad (a table entry as row * table_width + column). */
static int check_batch(const Decoder *m, Batch *b) {
    const int64_t T = b->num_tokens, B = b->num_seqs, bs = m->block_size, blocks = m->num_slots / m->block_size;
    b->bad = 0;
    if (b->query_start[0] != 0) return BAD_QUERY_START;
    for (int64_t s = 0; s < B; s++) {
        const int64_t first = b->query_start[s], end = b->query_start[s + 1];
        if (end < first || end > T) return b->bad = s + 1, BAD_QUERY_START;
        if (b->seq_lens[s] < end - first) return b->bad = s, BAD_SEQ_LEN;
        const int64_t cached = b->seq_lens[s] - (end - first), used = (cached + bs - 1) / bs;
        if (used > b->table_width) return b->bad = s, BAD_TABLE_WIDTH;
        for (int64_t j = 0; j < used; j++) {
            const int64_t block = b->block_tables[s * b->table_stride + j];
            if (block < 0 || block >= blocks) return b->bad = s * b->table_width + j, BAD_BLOCK;
        }
        for (int64_t t = first; t < end; t++)
            if (b->parents[t] < -1 || b->parents[t] >= t - first) return b->bad = t, BAD_PARENT;
    }
    if (b->query_start[B] != T) return b->bad = B, BAD_QUERY_START;
    for (int64_t t = 0; t < T; t++) {
        if (b->positions[t] < 0 || b->positions[t] >= m->max_positions) return b->bad = t, BAD_POSITION;
        if (b->slots[t] < 0 || b->slots[t] >= m->num_slots) return b->bad = t, BAD_SLOT;
    }
    return 0;
}

static inline int64_t max3(int64_t a, int64_t b, int64_t c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }

/* x [T, hidden] fp32, the residual stream after the embedding, becomes the last layer's output (before the
 * final norm); every layer's K/V of the new tokens are written to their slots. Returns 0, -1 when out of
 * memory, or check_batch's code for a batch that indexes outside its tables (x and the cache are then
 * unchanged). */
int decoder_forward(const Decoder *m, Batch *b, float *x, int threads) {
    const int bad = check_batch(m, b);
    if (bad) return bad;
    const int64_t T = b->num_tokens, H = m->hidden, I = m->intermediate, D = m->head_dim;
    const int64_t q_width = m->num_heads * D, kv_width = m->num_kv_heads * D, qkv_width = q_width + 2 * kv_width;
    const int64_t most_keys = max_keys(b), keys = most_keys > 0 ? most_keys : 1, widest = max3(H, q_width, I);
    if (threads < 1) threads = 1;
    float *h = malloc(sizeof(float) * T * H);                                   /* norms, o and down outputs */
    float *wide = malloc(sizeof(float) * T * (qkv_width > 2 * I ? qkv_width : 2 * I)); /* qkv, gate_up */
    float *act = malloc(sizeof(float) * T * widest);                            /* attention, SwiGLU */
    Blocks a = {malloc(T * widest), malloc(sizeof(float) * T * widest / GROUP), malloc(sizeof(float) * T * widest / GROUP)};
    int64_t *key_slots = malloc(sizeof(int64_t) * T * keys), *key_counts = malloc(sizeof(int64_t) * T);
    const int64_t group = m->num_heads / m->num_kv_heads;
    float *scores = malloc(sizeof(float) * threads * group * keys);
    const int failed = !h || !wide || !act || !a.xq || !a.dx || !a.sx || !key_slots || !key_counts || !scores;
    if (!failed) {
#pragma omp parallel num_threads(threads)
        {
            float *my_scores = scores + omp_get_thread_num() * group * keys;
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++) key_counts[t] = token_keys(m, b, t, key_slots + t * keys);
            for (int64_t l = 0; l < m->num_layers; l++) {
                const Layer *layer = &m->layers[l];
                rms_norm(x, layer->input_norm, T, H, m->eps, h);
                quantize_rows(h, T, H, &a);
                project(&layer->qkv, &a, T, wide);
#pragma omp for schedule(static)
                for (int64_t t = 0; t < T; t++) { /* bias, RoPE on the q and k heads, then K/V to the token's slot */
                    float *row = wide + t * qkv_width;
                    if (layer->qkv_bias)
                        for (int64_t i = 0; i < qkv_width; i++) row[i] += layer->qkv_bias[i];
                    const float *c = m->cos + b->positions[t] * D, *s = m->sin + b->positions[t] * D;
                    for (int64_t head = 0; head < m->num_heads + m->num_kv_heads; head++) rope(row + head * D, c, s, D);
                    store_row(layer->k_cache, b->slots[t] * kv_width, row + q_width, kv_width, (int)m->cache_bf16);
                    store_row(layer->v_cache, b->slots[t] * kv_width, row + q_width + kv_width, kv_width,
                              (int)m->cache_bf16);
                }
#pragma omp for schedule(dynamic, 1) /* tasks differ in length: a long context beside short ones */
                for (int64_t task = 0; task < T * m->num_kv_heads; task++) {
                    const int64_t t = task / m->num_kv_heads, kv_head = task % m->num_kv_heads;
                    attend(wide + t * qkv_width + kv_head * group * D, group, m, layer, kv_head, key_slots + t * keys,
                           key_counts[t], my_scores, act + t * q_width + kv_head * group * D);
                }
                quantize_rows(act, T, q_width, &a);
                project(&layer->o, &a, T, h);
                add_rows(x, h, T, H);
                rms_norm(x, layer->post_norm, T, H, m->eps, h);
                quantize_rows(h, T, H, &a);
                project(&layer->gate_up, &a, T, wide);
                swiglu(wide, T, I, act);
                quantize_rows(act, T, I, &a);
                project(&layer->down, &a, T, h);
                add_rows(x, h, T, H);
            }
        }
    }
    free(h);
    free(wide);
    free(act);
    free(a.xq);
    free(a.dx);
    free(a.sx);
    free(key_slots);
    free(key_counts);
    free(scores);
    return failed ? -1 : 0;
}
