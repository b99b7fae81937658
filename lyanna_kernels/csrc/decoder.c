/* The decoder layers of a Llama-family model for a few rows at a time (decode tokens, draft trees, short
 * prefill chunks), in one call on x86 CPUs with AVX2, FMA and F16C.
 *
 * Eager PyTorch spends several microseconds in each of the ~10 small operators of a layer (norms, casts,
 * RoPE, cache writes, attention set-up, SwiGLU); at a few rows that costs as much as the weights. Here a
 * whole forward is one OpenMP region: per layer, RMSNorm -> int8 activation blocks -> fused QKV
 * (integer_dot.h) -> its bias (Qwen2's q/k/v biases, fp32; none for Llama) -> RoPE -> K/V written to their cache slots -> paged attention over the block table and
 * the token's ancestors among the new tokens -> o_proj -> residual -> RMSNorm -> gate/up -> SwiGLU ->
 * down -> residual. The residual stream, norms, RoPE and softmax are fp32; the cache is fp32, bf16, or int8 codes
 * with a bf16 scale per 32 values (Decoder.cache_int8; store_row).
 *
 * Every row is computed the same way whatever else is in the batch: the projections row by row
 * (integer_dot.h; amx.c's tiles give the same numbers), and attention over a token's keys in their sequence
 * order (cached tokens, then its ancestors root first) in tiles fixed by key position (attend_tile, fold_tile), so
 * a token's result does not depend on its batch, on how its prompt was chunked, on whether its keys came from the
 * prefix cache, or on whether it was read in a prompt, decoded or verified as a draft tree's node. A sequence's lead
 * prompt tokens (Batch.runs) attend as a run, several rows sharing each block of keys they read (attend_run_rows):
 * the same numbers as one by one.
 *
 * Only where the engine is not deterministic (Decoder.prompt_bf16, on AMX CPUs) do a run's projections take bf16
 * tiles (amx.c): faster prompts, but a prompt token's result then differs from the same token decoded.
 *
 * On a tensor-parallel rank (Decoder.reduce set) the layers hold this rank's heads and MLP channels, and the
 * o_proj and down outputs are summed across the node's ranks in shared memory (all_reduce: the protocol of
 * engines/shm_all_reduce.py, in rank order, so every rank gets the same bits) before the residual: still
 * one call a forward, and each row still computed the same way whatever else is in the batch.
 */
#include <errno.h>
#include <omp.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <time.h>

#include "integer_dot.h"
#include "decoder.h"

/* Activations of `rows` rows of width k as int8 blocks. */
typedef struct {
    int8_t *xq;
    float *dx, *sx;
} Blocks;

/* How a step's rows enter the projections: as int8 blocks (every row, unless bf16 rows are marked), or, for
 * prompt runs on AMX CPUs (Decoder.prompt_bf16), in bf16 (amx_bf16_blocks). Each row takes one of the two
 * paths by what it is (a prompt token or not), never by what else is in the step, so its output does not
 * depend on its batch. Rows are cut into segments of consecutive rows of one kind. */
typedef struct {
    int64_t count;           /* segments */
    int64_t *start, *length; /* [count] */
    uint8_t *bf16;           /* [count] 1: the segment's rows go in bf16 */
    uint8_t *row_bf16;       /* [T] */
    uint16_t *xb;            /* [T rounded up to 16, + 32][widest] bf16 rows (amx_bf16_row); NULL: every row is int8 */
    uint16_t *xo;            /* the same size: the bf16 rows' SwiGLU for the down projection (gate_up_swiglu) */
    uint16_t *wb;            /* per thread, wb_size values: a panel of weight blocks as bf16 tiles (amx_bf16_weights) */
    int64_t wb_size;
} Rows;

/* Row t of x [.., k] as int8 blocks in `a`. */
static inline void quantize_row(const float *x, int64_t t, int64_t groups, Blocks *a) {
    for (int64_t b = t * groups; b < (t + 1) * groups; b++) quantize_block(x + b * GROUP, a->xq + b * GROUP, a->dx + b, a->sx + b);
}

/* x [rows, k] as the projections take it: int8 blocks in `a`, and bf16 rows in r->xb. */
static void prepare_rows(const float *x, int64_t rows, int64_t k, Blocks *a, const Rows *r) {
    const int64_t groups = k / GROUP;
    if (!r->xb) {
#pragma omp for schedule(static)
        for (int64_t b = 0; b < rows * groups; b++) quantize_block(x + b * GROUP, a->xq + b * GROUP, a->dx + b, a->sx + b);
        return;
    }
#pragma omp for schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        if (r->row_bf16[t])
            amx_bf16_row(x + t * k, k, t, r->xb);
        else
            quantize_row(x, t, groups, a);
    }
}

/* out [rows, n] fp32 = activations @ W.T, output rows split across the team (ends with a barrier). */
static void project(const QWeight *w, const Blocks *a, const Rows *r, int64_t rows, float *out) {
    const int64_t groups = w->k / GROUP, k = w->k, n = w->n;
    if (w->interleaved) {
        const int64_t t = omp_get_thread_num(), teams = omp_get_num_threads(), blocks = n / 16;
        const int64_t b0 = blocks * t / teams, b1 = blocks * (t + 1) / teams;
        const int bits = (int)w->bits;
        if (!r->xb) { /* the path measured fastest for this many rows (vnni.c's kernel_path): the same numbers */
            interleaved_blocks(w->codes, w->scales, w->mins, bits, n, k, a->xq, a->dx, a->sx, rows, out, b0, b1);
        } else {
            uint16_t *wb = r->wb + t * r->wb_size;
            const int64_t most = r->wb_size / (groups * 512) / 2 * 2; /* blocks of a panel (even, >= 2) */
            for (int64_t c0 = b0; c0 < b1; c0 += most) { /* a panel of blocks at a time, dequantized into L2 */
                const int64_t c1 = c0 + most < b1 ? c0 + most : b1;
                amx_bf16_weights(w->codes, w->scales, w->mins, bits, k, c0, c1, wb);
                for (int64_t s = 0; s < r->count; s++) {
                    const int64_t at = r->start[s], length = r->length[s];
                    if (r->bf16[s])
                        amx_bf16_blocks(wb, n, k, r->xb, at, at + length, out, c0, c1);
                    else
                        (length >= 16 ? amx_blocks : vnni_blocks)(w->codes, w->scales, w->mins, bits, n, k, a->xq + at * k,
                                                                  a->dx + at * groups, a->sx + at * groups, length,
                                                                  out + at * n, c0, c1);
                }
            }
        }
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

/* One slot's K or V row (kv_heads rows of dim values) into the cache: fp32, bf16 (to nearest even), or per group of
 * 32 values the scale s = max |x| / 127 rounded up to bf16 and int8 codes round(x * (1 / s)) (all zero for a zero
 * group; engines/kv_cache.py's quantize_rows). */
static inline void store_row(const Decoder *m, void *cache, uint16_t *scales, int64_t slot, const float *src) {
    const int64_t dim = m->head_dim, n = m->num_kv_heads * dim, index = slot * n;
    if (m->cache_int8) {
        int8_t *dst = (int8_t *)cache + index;
        uint16_t *group_scale = scales + slot * (n / 32);
        const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
        for (int64_t g = 0; g < n / 32; g++) { /* groups of 32 never straddle two heads: dim is a multiple of 32 */
            const float *x = src + 32 * g;
            __m256 most8 = _mm256_setzero_ps();
            for (int64_t i = 0; i < 32; i += 8) most8 = _mm256_max_ps(most8, _mm256_and_ps(_mm256_loadu_ps(x + i), magnitude));
            float lanes[8], most = 0.0f;
            _mm256_storeu_ps(lanes, most8);
            for (int i = 0; i < 8; i++) most = fmaxf(most, lanes[i]);
            uint32_t bits;
            const float step = most / 127.0f;
            memcpy(&bits, &step, 4);
            bits = ((bits & 0xffffu) ? bits + 0x10000u : bits) & 0xffff0000u; /* rounded up to bf16 */
            const float s = bf16_to_float((uint16_t)(bits >> 16));
            const __m256 inv = _mm256_set1_ps(s > 0.0f ? 1.0f / s : 0.0f);
            for (int64_t i = 0; i < 32; i += 8) { /* |x * inv| <= 127 (to rounding): no saturation below */
                const __m256 c = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                const __m256i w = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(c, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f)));
                const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
                _mm_storel_epi64((__m128i *)(dst + 32 * g + i), _mm_packs_epi16(words, words));
            }
            group_scale[g] = (uint16_t)(bits >> 16);
        }
    } else if (m->cache_bf16) {
        uint16_t *dst = (uint16_t *)cache + index;
        for (int64_t i = 0; i < n; i++) dst[i] = float_to_bf16(src[i]);
    } else {
        memcpy((float *)cache + index, src, n * sizeof(float));
    }
}

/* Values index..index + 7 of a cache as fp32 (an int8 cache's codes times their group's `scale`). */
static inline __m256 load8(const void *base, int64_t index, const Decoder *m, float scale) {
    if (m->cache_int8) {
        const __m128i c = _mm_loadl_epi64((const __m128i *)((const int8_t *)base + index));
        return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)), _mm256_set1_ps(scale));
    }
    if (m->cache_bf16) {
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + index));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)base + index);
}

/* Bytes per value of the decoder's cache. */
static inline int64_t cache_value_size(const Decoder *m) { return m->cache_int8 ? 1 : m->cache_bf16 ? 2 : 4; }

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

#define ATTEND_AHEAD 16 /* keys whose rows attend_tile requests ahead of use */

/* Requests one KV head's rows of keys [from, to) of `cache` into L1 (rows `row` values of `size` bytes apart). */
static inline void prefetch_head(const void *cache, const int64_t *slots, int64_t from, int64_t to, int64_t row,
                                 int64_t kv_head, int64_t dim, int64_t size) {
    for (int64_t j = from; j < to; j++)
        for (int64_t b = 0; b < dim * size; b += 64)
            _mm_prefetch((const char *)cache + (slots[j] * row + kv_head * dim) * size + b, _MM_HINT_T0);
}

/* The 8 sums of 8 vectors' lanes (a[j]'s sum in lane j), added in a fixed order. */
static inline __m256 sum8(const __m256 *a) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* Attention, the same for every query row. A token's keys, in sequence order (its cached keys, then its ancestors
 * among the new tokens, root first: key j is the token at position j), are cut into tiles of KEY_TILE keys from key 0,
 * whatever the token is (a prompt token of a run, a decode, a draft tree's node) and whatever shares its call. Per
 * tile and query head: the scores (each a dot product summed over 8 lanes of head_dim in a fixed order, sum8), their
 * maximum, p = exp(score - maximum), their sum (8 lanes over the tile's blocks of 8 keys, then hsum) and the sum of p V
 * (per block of 8 keys in key order, the blocks added in order): attend_tile. The tiles are then folded in order
 * (fold_tile) and the sum divided by the total. Keys a query does not see (past its own, in a run's tile) have
 * probability exactly 0 and add exactly nothing. So a token's attention output depends on its query and its keys
 * alone: read in a prompt (of any chunking, from cached blocks or not), decoded, or verified as a tree node, it is
 * the same bit for bit. */
#define KEY_TILE 256   /* keys of an attention tile */
#define ATTEND_KEYS 8  /* keys of a block: one vector of scores per query */
#define MAX_QUERIES 64 /* query rows x heads one attend_tile call takes at most */

static inline int64_t key_tiles(int64_t n) { return (n + KEY_TILE - 1) / KEY_TILE; }

/* Query rows of a run's task (one KV head's query heads each): at most MAX_QUERIES queries, at most 16 rows. */
static inline int64_t run_rows(int64_t group) {
    const int64_t rows = MAX_QUERIES / group;
    return rows < 1 ? 1 : rows > 16 ? 16 : rows;
}

/* e^x of one value, as exp8 computes it (the same bits in every caller). */
static inline float exp1(float x) { return _mm_cvtss_f32(_mm256_castps256_ps128(exp8(_mm256_set1_ps(x)))); }

/* out[h][8 i .. 8 (i + W)) += sum over the block's ATTEND_KEYS keys j of p[h stride + j] block[j][i ..] for the HS
 * queries h (HS, W constants at each call: the sums stay in registers). */
static inline __attribute__((always_inline)) void add_values(const float *p, int64_t stride, const __m256 (*block)[16],
                                                             int64_t i, int HS, int W, float *out, int64_t dim) {
    __m256 acc[4][2];
    for (int h = 0; h < HS; h++)
        for (int w = 0; w < W; w++) acc[h][w] = _mm256_setzero_ps();
    for (int64_t j = 0; j < ATTEND_KEYS; j++)
        for (int h = 0; h < HS; h++) {
            const __m256 weight = _mm256_broadcast_ss(p + h * stride + j);
            for (int w = 0; w < W; w++) acc[h][w] = _mm256_fmadd_ps(weight, block[j][i + w], acc[h][w]);
        }
    for (int h = 0; h < HS; h++)
        for (int w = 0; w < W; w++) {
            float *o = out + h * dim + 8 * w;
            _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), acc[h][w]));
        }
}

/* Rows j0 .. j0 + ATTEND_KEYS of one KV head's K or V (`cache`, with `scale` for an int8 cache) as fp32 in block;
 * rows past `count` are zeros. */
static inline void load_block(const Decoder *m, const void *cache, const uint16_t *scale, int64_t kv_head,
                              const int64_t *slots, int64_t j0, int64_t count, int64_t n, __m256 (*block)[16]) {
    const int64_t dim = m->head_dim, row = m->num_kv_heads * dim, vecs = dim / 8, groups = dim / 32;
    const int64_t size = cache_value_size(m);
    for (int64_t j = 0; j < ATTEND_KEYS; j++) {
        if (j >= count) { /* past the tile's last key: zeros (their probabilities are 0) */
            for (int64_t i = 0; i < vecs; i++) block[j][i] = _mm256_setzero_ps();
            continue;
        }
        const int64_t slot = slots[j0 + j], at = slot * row + kv_head * dim;
        if (j0 + j + ATTEND_AHEAD < n) prefetch_head(cache, slots, j0 + j + ATTEND_AHEAD, j0 + j + ATTEND_AHEAD + 1, row, kv_head, dim, size);
        const uint16_t *s = scale ? scale + (slot * m->num_kv_heads + kv_head) * groups : NULL;
        for (int64_t i = 0; i < vecs; i++) block[j][i] = load8(cache, at + 8 * i, m, s ? bf16_to_float(s[i / 4]) : 1.0f);
    }
}

/* Rows of one sequence whose keys differ past a shared prefix (a draft tree's nodes, each with its own ancestors):
 * row r's keys of the tile are slots[r][0 .. count[r]), the first `shared` the same for every row (read once). */
typedef struct {
    const int64_t *const *slots;
    const int64_t *count;
    int64_t shared;
} RowKeys;

/* One tile of keys (slots[0..n), n <= KEY_TILE, of KV head kv_head) for `rows` query rows of `heads` query heads each
 * (query (r, h) at q + r q_row + h dim): row r sees the tile's first min(n, first + r) keys (none where that is not
 * positive), or, with `own` (n then the most keys of a row), its own keys (RowKeys). Writes each query's sum of p V,
 * not normalised, to out + r out_row + h dim, and its maximum score and sum of p to stats[2 (r heads + h)], [.. + 1]
 * (-inf and 0 for a row that sees no key). scores: [rows heads][KEY_TILE] scratch. Every query's arithmetic depends
 * on its own query and keys alone (attention, above): a block of keys past `shared` is read row by row. */
static inline __attribute__((always_inline)) void attend_tile(const float *q, int64_t q_row, int64_t rows, int64_t heads, int64_t first, const Decoder *m,
                        const Layer *layer, int64_t kv_head, const int64_t *slots, int64_t n, float *out, int64_t out_row,
                        float *stats, float *scores, const RowKeys *own) {
    const int64_t dim = m->head_dim, vecs = dim / 8, stride = KEY_TILE;
    const int64_t size = cache_value_size(m), ahead = n < ATTEND_AHEAD ? n : ATTEND_AHEAD;
    const uint16_t *k_scale = m->cache_int8 ? layer->k_scale : NULL, *v_scale = m->cache_int8 ? layer->v_scale : NULL;
    const int64_t row_len = m->num_kv_heads * dim;
    __m256 block[ATTEND_KEYS][16]; /* a block's K rows, then V rows (head_dim <= 128) */
    __m256 best[MAX_QUERIES];
    for (int64_t u = 0; u < rows * heads; u++) best[u] = _mm256_set1_ps(-INFINITY);
    prefetch_head(layer->k_cache, slots, 0, ahead, row_len, kv_head, dim, size);
    const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), minus_inf = _mm256_set1_ps(-INFINITY);
    for (int64_t j0 = 0; j0 < n; j0 += ATTEND_KEYS) {
        const int shared = !own || j0 + ATTEND_KEYS <= own->shared;
        if (shared) load_block(m, layer->k_cache, k_scale, kv_head, slots, j0, n - j0, n, block);
        for (int64_t r = 0; r < rows; r++) {
            const int64_t sees = own ? own->count[r] : first + r < n ? first + r : n;
            const int64_t seen = sees - j0; /* this row's keys in the block, from its start */
            if (seen <= 0) {
                for (int64_t h = 0; h < heads; h++) _mm256_storeu_ps(scores + (r * heads + h) * stride + j0, minus_inf);
                continue;
            }
            if (!shared) load_block(m, layer->k_cache, k_scale, kv_head, own->slots[r], j0, sees - j0, sees, block);
            const __m256 valid = _mm256_cmp_ps(lane, _mm256_set1_ps((float)seen), _CMP_LT_OQ);
            for (int64_t h = 0; h < heads; h++) {
                const float *qh = q + r * q_row + h * dim;
                __m256 acc[ATTEND_KEYS];
                for (int64_t j = 0; j < ATTEND_KEYS; j++) acc[j] = _mm256_setzero_ps();
                for (int64_t i = 0; i < vecs; i++) {
                    const __m256 qv = _mm256_loadu_ps(qh + 8 * i);
                    for (int64_t j = 0; j < ATTEND_KEYS; j++) acc[j] = _mm256_fmadd_ps(qv, block[j][i], acc[j]);
                }
                const __m256 s = _mm256_blendv_ps(minus_inf, _mm256_mul_ps(sum8(acc), _mm256_set1_ps(m->scale)), valid);
                _mm256_storeu_ps(scores + (r * heads + h) * stride + j0, s);
                best[r * heads + h] = _mm256_max_ps(best[r * heads + h], s);
            }
        }
    }
    const int64_t width = (n + ATTEND_KEYS - 1) / ATTEND_KEYS * ATTEND_KEYS;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < heads; h++) {
            const int64_t u = r * heads + h;
            const __m128 b4 = _mm_max_ps(_mm256_castps256_ps128(best[u]), _mm256_extractf128_ps(best[u], 1));
            const __m128 b2 = _mm_max_ps(b4, _mm_movehl_ps(b4, b4));
            const float most = _mm_cvtss_f32(_mm_max_ss(b2, _mm_movehdup_ps(b2)));
            float *sc = scores + u * stride, *o = out + r * out_row + h * dim;
            __m256 sums = _mm256_setzero_ps();
            const __m256 high = _mm256_set1_ps(most == -INFINITY ? 0.0f : most); /* a row of no key: every p is 0 */
            for (int64_t j = 0; j < width; j += 8) {
                const __m256 s = _mm256_loadu_ps(sc + j);
                const __m256 p = _mm256_and_ps(exp8(_mm256_sub_ps(s, high)), _mm256_cmp_ps(s, minus_inf, _CMP_NEQ_OQ));
                _mm256_storeu_ps(sc + j, p);
                sums = _mm256_add_ps(sums, p);
            }
            stats[2 * u] = most, stats[2 * u + 1] = hsum(sums);
            for (int64_t i = 0; i < dim; i++) o[i] = 0.0f;
        }
    prefetch_head(layer->v_cache, slots, 0, ahead, row_len, kv_head, dim, size);
    for (int64_t j0 = 0; j0 < n; j0 += ATTEND_KEYS) {
        const int shared = !own || j0 + ATTEND_KEYS <= own->shared;
        if (shared) load_block(m, layer->v_cache, v_scale, kv_head, slots, j0, n - j0, n, block);
        for (int64_t r = 0; r < rows; r++) {
            const int64_t sees = own ? own->count[r] : first + r < n ? first + r : n;
            if (sees <= j0) continue; /* none of this row's keys: its p are all 0 */
            if (!shared) load_block(m, layer->v_cache, v_scale, kv_head, own->slots[r], j0, sees - j0, sees, block);
            for (int64_t h0 = 0; h0 < heads; h0 += 4) { /* up to 4 heads x 16 values of sums in registers */
                const int64_t hs = heads - h0 < 4 ? heads - h0 : 4;
                for (int64_t i = 0; i < vecs; i += 2) {
                    const float *p = scores + (r * heads + h0) * stride + j0;
                    float *o = out + r * out_row + h0 * dim + 8 * i;
#define PV(HS, W) add_values(p, stride, block, i, HS, W, o, dim)
                    if (i + 1 < vecs) {
                        switch (hs) {
                        case 1: PV(1, 2); break;
                        case 2: PV(2, 2); break;
                        case 3: PV(3, 2); break;
                        default: PV(4, 2); break;
                        }
                    } else {
                        switch (hs) {
                        case 1: PV(1, 1); break;
                        case 2: PV(2, 1); break;
                        case 3: PV(3, 1); break;
                        default: PV(4, 1); break;
                        }
                    }
#undef PV
                }
            }
        }
    }
}

/* Fold one query's tile (its sum of p V `o`, maximum `most` and sum `total`, from attend_tile) into its running
 * result (acc, *run_most, *run_total); the first tile (`first`) is taken as it is. Tiles fold in key order. */
static inline void fold_tile(float *acc, float *run_most, float *run_total, const float *o, float most, float total,
                             int first, int64_t dim) {
    if (first) {
        if (acc != o) memcpy(acc, o, sizeof(float) * dim);
        *run_most = most, *run_total = total;
        return;
    }
    if (most == -INFINITY) return; /* a tile this query sees no key of */
    const float high = most > *run_most ? most : *run_most;
    const float keep = exp1(*run_most - high), take = exp1(most - high);
    *run_total = _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(total), _mm_set_ss(take), _mm_set_ss(*run_total * keep)));
    *run_most = high;
    const __m256 k = _mm256_set1_ps(keep), t = _mm256_set1_ps(take);
    for (int64_t i = 0; i < dim; i += 8)
        _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(_mm256_loadu_ps(o + i), t, _mm256_mul_ps(_mm256_loadu_ps(acc + i), k)));
}

/* acc [dim] divided by the query's total: its attention output, into out. */
static inline void finish_query(const float *acc, float total, int64_t dim, float *out) {
    const __m256 inv = _mm256_set1_ps(1.0f / total);
    for (int64_t i = 0; i < dim; i += 8) _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(acc + i), inv));
}

/* Floats of attend_run_rows' scratch: scores, a tile's and the running sums of P V, statistics. */
static inline int64_t run_scratch_floats(int64_t dim) { return MAX_QUERIES * (KEY_TILE + 2 * dim + 4); }

/* Rows i0 .. i0 + rows of a run of consecutive new tokens of one sequence (row i's keys: slots[0 .. limit + i), in
 * sequence order) for one KV head's `group` query heads: their attention outputs, tile after tile, each query folded
 * as it goes (the same folds a one-by-one token's tiles get). q: the first row's first query head of the KV head,
 * q_row apart; out likewise, out_row apart. scratch: per thread, run_scratch_floats(dim). */
static void attend_run_rows(const float *q, int64_t q_row, int64_t rows, int64_t limit, int64_t group, const Decoder *m,
                            const Layer *layer, int64_t kv_head, const int64_t *slots, float *out, int64_t out_row,
                            float *scratch) {
    const int64_t dim = m->head_dim, queries = rows * group, last = limit + rows - 1; /* the last row's keys */
    float *scores = scratch, *tile_out = scores + MAX_QUERIES * KEY_TILE, *acc = tile_out + MAX_QUERIES * dim;
    float *stats = acc + MAX_QUERIES * dim, *run = stats + 2 * MAX_QUERIES; /* run: per query its maximum and total */
    for (int64_t c = 0; c * KEY_TILE < last; c++) {
        const int64_t k0 = c * KEY_TILE, n = last - k0 < KEY_TILE ? last - k0 : KEY_TILE;
        attend_tile(q, q_row, rows, group, limit - k0, m, layer, kv_head, slots + k0, n, tile_out, group * dim, stats, scores, NULL);
        for (int64_t u = 0; u < queries; u++)
            fold_tile(acc + u * dim, run + 2 * u, run + 2 * u + 1, tile_out + u * dim, stats[2 * u], stats[2 * u + 1], c == 0, dim);
    }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < group; h++) finish_query(acc + (r * group + h) * dim, run[2 * (r * group + h) + 1], dim, out + r * out_row + h * dim);
}

/* Keys whose next-layer K and V rows are prefetched toward L2 while a layer's down projection streams its weights
 * (the first keys of each sequence's first one-by-one token, in batch order): a decode's keys come back from
 * memory cold after the weights went through the cache, and attention waited for them. More than this, the
 * prefetches fill the line buffers that the projection's weights need. */
#define PREFETCH_KEYS 512


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

/* silu(gate) * up for one row of gate_up [2 inter] (gate first) into out [inter]. */
static void swiglu_row(const float *gate_up, int64_t inter, float *out) {
    const float *gate = gate_up, *up = gate + inter;
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

/* gate_up (w: the gate's blocks, then the up's, `inter` outputs each) of the bf16 rows and their SwiGLU in one pass:
 * into r->xo, as amx_swiglu_row lays rows out for the down projection, bit for bit what project then swiglu
 * write; int8 rows' gate_up into out [rows, 2 inter] as project computes it (swiglu finishes them). The output
 * groups of 32 are split across the team, a panel of their gate and up blocks dequantized at a time (ends with a
 * barrier). */
static void gate_up_swiglu(const QWeight *w, const Blocks *a, const Rows *r, int64_t inter, float *out) {
    const int64_t k = w->k, n = w->n, groups = k / GROUP, half = inter / 16, pairs = inter / GROUP;
    const int64_t t = omp_get_thread_num(), teams = omp_get_num_threads();
    const int64_t p0 = pairs * t / teams, p1 = pairs * (t + 1) / teams;
    const int64_t most = r->wb_size / (groups * 512) / 4; /* output groups of a panel: four blocks each */
    const int bits = (int)w->bits;
    uint16_t *wb = r->wb + t * r->wb_size;
    for (int64_t c0 = p0; c0 < p1; c0 += most) {
        const int64_t c1 = c0 + most < p1 ? c0 + most : p1;
        amx_bf16_weights(w->codes, w->scales, w->mins, bits, k, 2 * c0, 2 * c1, wb);
        amx_bf16_weights(w->codes, w->scales, w->mins, bits, k, half + 2 * c0, half + 2 * c1, wb + 2 * (c1 - c0) * groups * 512);
        for (int64_t s = 0; s < r->count; s++)
            if (r->bf16[s]) amx_bf16_swiglu_blocks(wb, k, r->xb, r->start[s], r->start[s] + r->length[s], inter, c0, c1, r->xo);
    }
    for (int64_t s = 0; s < r->count; s++) {
        if (r->bf16[s]) continue;
        const int64_t at = r->start[s], length = r->length[s];
        for (int64_t u = 0; u < 2; u++) /* the thread's gate blocks, then the same outputs' up blocks */
            (length >= 16 ? amx_blocks : vnni_blocks)(w->codes, w->scales, w->mins, bits, n, k, a->xq + at * k,
                                                      a->dx + at * groups, a->sx + at * groups, length, out + at * n,
                                                      u * half + 2 * p0, u * half + 2 * p1);
    }
#pragma omp barrier
}

/* SwiGLU of gate_up [rows, 2 inter] (gate, up) as the down projection takes it (prepare_rows): int8 rows
 * through act [rows, inter] fp32 into int8 blocks, bf16 rows straight into their tiles (amx_swiglu_row), unless
 * `bf16_done` (gate_up_swiglu wrote theirs). */
static void swiglu(const float *gate_up, int64_t rows, int64_t inter, float *act, Blocks *a, const Rows *r, int bf16_done) {
    const int64_t groups = inter / GROUP;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        if (r->xb && r->row_bf16[t]) {
            if (!bf16_done) amx_swiglu_row(gate_up + t * 2 * inter, inter, t, r->xb);
            continue;
        }
        swiglu_row(gate_up + t * 2 * inter, inter, act + t * inter);
        quantize_row(act, t, groups, a);
    }
}


static double seconds_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static inline float *reduce_slot(const Reducer *r, int64_t half, int64_t rank) {
    return (float *)(r->data + (half * r->world + rank) * r->slot_bytes);
}

/* Spin until every rank has published call `seq`: 0, or RANK_DIED / RANK_TIMEOUT with the late rank in *late. */
static int wait_ranks(const Reducer *r, int64_t seq, int64_t *late) {
    double began = 0.0;
    for (int64_t spins = 0;; spins++) {
        int64_t behind = -1;
        for (int64_t k = 0; k < r->world && behind < 0; k++)
            if (__atomic_load_n(&r->seqs[k], __ATOMIC_ACQUIRE) < seq) behind = k;
        if (behind < 0) break;
        if (spins == 0) began = seconds_now();
        if (spins % 64 != 63) {
            _mm_pause();
            continue;
        }
        sched_yield(); /* let this process's other threads (the server's event loop) run */
        if (spins % 8192 != 8191) continue;
        if (kill((pid_t)r->pids[behind], 0) != 0 && errno == ESRCH) return *late = behind, RANK_DIED;
        if (seconds_now() - began > r->timeout_s) return *late = behind, RANK_TIMEOUT;
    }
    if (began > 0.0) *r->wait_seconds += seconds_now() - began;
    return 0;
}

/* x [n] summed across the ranks in place, a slot at a time: this rank's partial sums go to its slot, the call
 * is published, and once every rank has published, the slots are added up in rank order. Called by the whole
 * team; returns 0 or wait_ranks' error (the same on every thread), the late rank in *late. */
static int all_reduce(const Reducer *r, float *x, int64_t n, int *status, int64_t *late) {
    const int64_t per = r->slot_bytes / (int64_t)sizeof(float);
    for (int64_t at = 0; at < n; at += per) {
        const int64_t len = n - at < per ? n - at : per;
#pragma omp single
        *r->seq += 1;
        const int64_t seq = *r->seq, half = seq % 2;
        float *mine = reduce_slot(r, half, r->rank);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < len; i++) mine[i] = x[at + i];
#pragma omp single
        {
            __atomic_store_n(&r->seqs[r->rank], seq, __ATOMIC_RELEASE); /* after the copy (the barrier above) */
            *status = wait_ranks(r, seq, late);
        }
        if (*status) return *status;
        const float *first = reduce_slot(r, half, 0), *second = reduce_slot(r, half, 1);
#pragma omp for schedule(static) /* ends with a barrier: this rank reads the set before it publishes again */
        for (int64_t i = 0; i < len; i++) {
            float sum = first[i] + second[i];
            for (int64_t k = 2; k < r->world; k++) sum += reduce_slot(r, half, k)[i];
            x[at + i] = sum;
        }
    }
    return 0;
}

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
            if (b->parents[t] < -1 || b->parents[t] >= t - first || (b->runs && t < first + b->runs[s] && b->parents[t] != t - first - 1))
                return b->bad = t, BAD_PARENT;
        if (b->runs && (b->runs[s] < 0 || b->runs[s] > end - first)) return b->bad = s, BAD_RUN;
    }
    if (b->query_start[B] != T) return b->bad = B, BAD_QUERY_START;
    for (int64_t t = 0; t < T; t++) {
        if (b->positions[t] < 0 || b->positions[t] >= m->max_positions) return b->bad = t, BAD_POSITION;
        if (b->slots[t] < 0 || b->slots[t] >= m->num_slots) return b->bad = t, BAD_SLOT;
    }
    return 0;
}

static inline int64_t max3(int64_t a, int64_t b, int64_t c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }

/* Seconds each part of the forward took on thread 0, summed over calls while profiling is on
 * (decoder_profile): where a step's time goes (lyanna_kernels/fused_decoder.py's `profile`). */
enum { PHASE_NORM, PHASE_QKV, PHASE_ROPE, PHASE_ATTEND, PHASE_O, PHASE_MLP_IN, PHASE_GATE_UP, PHASE_SWIGLU,
       PHASE_DOWN, NUM_PHASES };
static int profiling = 0;
static double phase_seconds[NUM_PHASES];

/* Turn the per-phase timing on (clearing it) or off; `out` (NUM_PHASES doubles, or NULL) gets the sums so far. */
int decoder_profile(int on, double *out) {
    if (out)
        for (int i = 0; i < NUM_PHASES; i++) out[i] = phase_seconds[i];
    if (on && !profiling)
        for (int i = 0; i < NUM_PHASES; i++) phase_seconds[i] = 0.0;
    profiling = on;
    return NUM_PHASES;
}

#define MARK(phase)                                                                                          \
    if (profiling && omp_get_thread_num() == 0) {                                                            \
        const double now = omp_get_wtime();                                                                  \
        phase_seconds[phase] += now - mark;                                                                  \
        mark = now;                                                                                          \
    }

/* How many lead new tokens of sequence s attend as a run (the rest token by token): the same numbers either way
 * (attend_tile), a run's rows sharing each block of keys they read. */
static int64_t run_tokens(const Batch *b, int64_t s) { return b->runs ? b->runs[s] : 0; }

/* The runs of a batch: per run its sequence and its keys' slots; per task of attending (run, KV head, first new
 * token of its rows). */
typedef struct {
    int64_t num_runs, num_attend, rows; /* rows: of a task (run_rows) */
    int64_t *seq, *slot_at;             /* [runs] */
    int64_t *slots;                     /* every run's key slots in sequence order */
    int64_t (*attend)[3];
    float *scratch; /* per thread: run_scratch_floats(head_dim) */
} Runs;

static void free_runs(Runs *r) {
    free(r->seq);
    free(r->slot_at);
    free(r->slots);
    free(r->attend);
    free(r->scratch);
}

/* Plan the batch's runs; returns 0, or -1 when out of memory. */
static int plan_runs(const Decoder *m, const Batch *b, int threads, Runs *r) {
    memset(r, 0, sizeof *r);
    const int64_t B = b->num_seqs, bs = m->block_size, Hk = m->num_kv_heads;
    const int64_t rows = run_rows(m->num_heads / Hk);
    int64_t runs = 0, keys = 0, attend = 0;
    for (int64_t s = 0; s < B; s++)
        if (run_tokens(b, s)) {
            const int64_t num_new = b->query_start[s + 1] - b->query_start[s];
            runs++, keys += b->seq_lens[s] - num_new + run_tokens(b, s);
            attend += Hk * ((run_tokens(b, s) + rows - 1) / rows);
        }
    if (runs == 0) return 0;
    r->num_runs = runs, r->num_attend = attend, r->rows = rows;
    r->seq = malloc(sizeof(int64_t) * runs), r->slot_at = malloc(sizeof(int64_t) * runs);
    r->slots = malloc(sizeof(int64_t) * keys), r->attend = malloc(sizeof(int64_t[3]) * attend);
    r->scratch = aligned_alloc(64, sizeof(float) * run_scratch_floats(m->head_dim) * (size_t)threads);
    if (!r->seq || !r->slot_at || !r->slots || !r->attend || !r->scratch) return -1;
    int64_t i = 0, at = 0, a = 0;
    for (int64_t s = 0; s < B; s++) {
        const int64_t in_run = run_tokens(b, s);
        if (!in_run) continue;
        const int64_t first = b->query_start[s], num_new = b->query_start[s + 1] - first;
        const int64_t cached = b->seq_lens[s] - num_new;
        const int32_t *table = b->block_tables + s * b->table_stride;
        r->seq[i] = s, r->slot_at[i] = at;
        for (int64_t c = 0; c < cached; c++) r->slots[at + c] = (int64_t)table[c / bs] * bs + c % bs;
        for (int64_t j = 0; j < in_run; j++) r->slots[at + cached + j] = b->slots[first + j];
        /* one KV head at a time (the team shares its keys in cache), the longest (latest) rows first: they would
         * end the layer last */
        for (int64_t h = 0; h < Hk; h++)
            for (int64_t i0 = 0; i0 < in_run; i0 += rows)
                r->attend[a][0] = i, r->attend[a][1] = h, r->attend[a++][2] = (in_run - 1) / rows * rows - i0;
        at += cached + in_run, i++;
    }
    return 0;
}

#define PANEL_VALUES (512 * 1024) /* bf16 weight values dequantized at a time per thread (1 MiB: in L2) */

static void free_rows(Rows *r) {
    free(r->start);
    free(r->length);
    free(r->bf16);
    free(r->row_bf16);
    free(r->xb);
    free(r->xo);
    free(r->wb);
}

/* Whether every projection of the decoder's layers is interleaved (vnni.c's layout, which amx_bf16_weights reads). */
static int all_interleaved(const Decoder *m) {
    for (int64_t l = 0; l < m->num_layers; l++) {
        const Layer *y = &m->layers[l];
        if (!y->qkv.interleaved || !y->o.interleaved || !y->gate_up.interleaved || !y->down.interleaved) return 0;
    }
    return 1;
}

/* The batch's rows for the projections (Rows): prompt runs in bf16 where the decoder asks for it and the tiles
 * run; returns 0, or -1 when out of memory. */
static int plan_rows(const Decoder *m, const Batch *b, int threads, int64_t widest, Rows *r) {
    memset(r, 0, sizeof *r);
    const int64_t T = b->num_tokens, B = b->num_seqs;
    int64_t marked = 0;
    if (!m->prompt_bf16 || !amx_active() || !b->runs || m->num_layers == 0 || !all_interleaved(m)) return 0;
    for (int64_t s = 0; s < B; s++) marked += b->runs[s];
    if (marked == 0) return 0;
    r->row_bf16 = calloc((size_t)T, 1);
    r->start = malloc(sizeof(int64_t) * (2 * B + 1)), r->length = malloc(sizeof(int64_t) * (2 * B + 1));
    r->bf16 = malloc(2 * B + 1);
    if (!r->row_bf16 || !r->start || !r->length || !r->bf16) return -1;
    for (int64_t s = 0; s < B; s++)
        memset(r->row_bf16 + b->query_start[s], 1, (size_t)b->runs[s]);
    for (int64_t t = 0; t < T; t++) {
        if (r->count && r->bf16[r->count - 1] == r->row_bf16[t]) {
            r->length[r->count - 1]++;
            continue;
        }
        r->start[r->count] = t, r->length[r->count] = 1, r->bf16[r->count++] = r->row_bf16[t];
    }
    /* tiles past T's up to a whole pair are read (and their results dropped): zeros */
    const size_t xb_bytes = sizeof(uint16_t) * (size_t)(((T + 15) / 16 * 16 + 32) * widest);
    r->xb = aligned_alloc(64, xb_bytes);
    r->xo = aligned_alloc(64, xb_bytes);
    int64_t widest_k = 0; /* a panel holds at least two blocks, and gate_up_swiglu's four */
    const Layer *y = &m->layers[0];
    const QWeight *ws[4] = {&y->qkv, &y->o, &y->gate_up, &y->down};
    for (int i = 0; i < 4; i++) widest_k = ws[i]->k > widest_k ? ws[i]->k : widest_k;
    r->wb_size = PANEL_VALUES > 2 * widest_k * 16 ? PANEL_VALUES : 2 * widest_k * 16;
    r->wb_size = r->wb_size > 4 * y->gate_up.k * 16 ? r->wb_size : 4 * y->gate_up.k * 16;
    r->wb = aligned_alloc(64, sizeof(uint16_t) * (size_t)(r->wb_size * threads));
    if (!r->xb || !r->xo || !r->wb) return -1;
    memset(r->xb, 0, xb_bytes);
    memset(r->xo, 0, xb_bytes);
    return 0;
}

/* x [T, hidden] fp32, the residual stream after the embedding, becomes the last layer's output (normed by
 * the final norm where the decoder has one); every layer's K/V of the new tokens are written to their slots. Returns 0, -1 when out of
 * memory, or check_batch's code for a batch that indexes outside its tables (x and the cache are then
 * unchanged). */
int decoder_forward(const Decoder *m, Batch *b, float *x, int threads) {
    const int bad = check_batch(m, b);
    if (bad) return bad;
    const int64_t T = b->num_tokens, H = m->hidden, I = m->intermediate, D = m->head_dim;
    const int64_t q_width = m->num_heads * D, kv_width = m->num_kv_heads * D, qkv_width = q_width + 2 * kv_width;
    const int64_t widest = max3(H, q_width, I), group = m->num_heads / m->num_kv_heads;
    if (threads < 1) threads = 1;
    /* tokens that attend one by one (decodes, trees, prompt tokens of no run): their keys' slots, per token */
    int64_t *key_row = malloc(sizeof(int64_t) * T), one_by_one = 0, most_keys = 1, most_parts = 0;
    if (key_row)
        for (int64_t s = 0; s < b->num_seqs; s++) {
            const int64_t first = b->query_start[s], in_run = run_tokens(b, s);
            if (first + in_run < b->query_start[s + 1] && b->seq_lens[s] > most_keys) most_keys = b->seq_lens[s];
            for (int64_t t = first; t < b->query_start[s + 1]; t++) {
                key_row[t] = t < first + in_run ? -1 : one_by_one++;
                if (t >= first + in_run) most_parts += key_tiles(b->seq_lens[s]); /* a token has at most seq_lens keys */
            }
        }
    Runs runs;
    const int runs_failed = plan_runs(m, b, threads, &runs);
    Rows row_plan;
    const int rows_failed = plan_rows(m, b, threads, widest, &row_plan);
    /* bf16 rows: gate_up and SwiGLU in one pass, whose output the down projection reads as its bf16 rows */
    const int fused_swiglu = !rows_failed && row_plan.xb && !m->split_swiglu;
    Rows down_plan = row_plan;
    if (fused_swiglu) down_plan.xb = row_plan.xo;
    float *h = malloc(sizeof(float) * T * H);                                   /* norms, o and down outputs */
    float *wide = malloc(sizeof(float) * T * (qkv_width > 2 * I ? qkv_width : 2 * I)); /* qkv, gate_up */
    float *act = malloc(sizeof(float) * T * widest);                            /* attention, SwiGLU */
    Blocks a = {malloc(T * widest), malloc(sizeof(float) * T * widest / GROUP), malloc(sizeof(float) * T * widest / GROUP)};
    int64_t *key_slots = malloc(sizeof(int64_t) * (one_by_one ? one_by_one : 1) * most_keys);
    int64_t *key_counts = malloc(sizeof(int64_t) * T);
    /* a sequence's one-by-one tokens attend up to `tree_rows` at a time, sharing the keys they have in common */
    const int64_t tree_rows = run_rows(group), scratch_floats = tree_rows * group * (KEY_TILE + D + 2);
    float *scores = malloc(sizeof(float) * threads * scratch_floats); /* attend_tile's, then a task's outputs, per thread */
    /* the tiles of one-by-one tokens' keys (key_tiles): where a token has several, each tile's results and softmax
     * statistics until they are folded; per token its first tile */
    int64_t num_parts = 0;
    const int64_t heads = m->num_heads, parts_size = most_parts ? most_parts : 1;
    /* the attention tasks: per task its first token, rows (consecutive tokens of one sequence), tile, and how many
     * leading keys its rows share */
    int64_t num_tasks = 0, (*tasks)[4] = malloc(sizeof(int64_t[4]) * parts_size);
    int64_t *first_part = malloc(sizeof(int64_t) * (T + 1)); /* token t's parts: first_part[t] .. first_part[t + 1] */
    int64_t *prefetch = malloc(sizeof(int64_t) * PREFETCH_KEYS), num_prefetch = 0; /* their cache slots */
    float *part_out = malloc(sizeof(float) * parts_size * q_width), *part_stats = malloc(sizeof(float) * parts_size * heads * 2);
    /* KV heads per attention task: all of a tile's where the tiles alone keep the team busy (fewer tasks to hand
     * out), else one (set once the tiles are known); a query's numbers are the same either way */
    int64_t head_group = 1, head_tasks = m->num_kv_heads;
    const int failed = runs_failed || rows_failed || !key_row || !h || !wide || !act || !a.xq || !a.dx || !a.sx || !key_slots ||
                       !key_counts || !scores || !first_part || !part_out || !part_stats ||
                       !prefetch || !tasks;
    int reduce_status = 0;
    int64_t late_rank = 0;
    if (!failed) {
#pragma omp parallel num_threads(threads)
        {
            float *my_scores = scores + omp_get_thread_num() * scratch_floats;
            float *my_out = my_scores + tree_rows * group * KEY_TILE, *my_stats = my_out + tree_rows * group * D;
            double mark = omp_get_wtime();
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++)
                key_counts[t] = key_row[t] < 0 ? 0 : token_keys(m, b, t, key_slots + key_row[t] * most_keys);
#pragma omp single
            {
                for (int64_t t = 0; t < T; t++) {
                    first_part[t] = num_parts;
                    if (key_row[t] < 0) continue;
                    const int64_t parts = key_tiles(key_counts[t]);
                    num_parts += parts;
                    if (b->parents[t] >= 0) continue; /* a tree node or chain token past the first: its sequence's keys are listed */
                    for (int64_t j = 0; j < key_counts[t] && num_prefetch < PREFETCH_KEYS; j++)
                        prefetch[num_prefetch++] = key_slots[key_row[t] * most_keys + j];
                }
                first_part[T] = num_parts;
                for (int64_t q = 0; q < b->num_seqs; q++) {
                    const int64_t end = b->query_start[q + 1], cached = b->seq_lens[q] - (end - b->query_start[q]);
                    for (int64_t t0 = b->query_start[q] + run_tokens(b, q); t0 < end; t0 += tree_rows) {
                        const int64_t rows = end - t0 < tree_rows ? end - t0 : tree_rows;
                        int64_t least = key_counts[t0], most = key_counts[t0], shared = cached;
                        for (int64_t r = 1; r < rows; r++) {
                            if (key_counts[t0 + r] < least) least = key_counts[t0 + r];
                            if (key_counts[t0 + r] > most) most = key_counts[t0 + r];
                        }
                        for (int same = 1; same && shared < least; shared += same) /* the context, and ancestors in common */
                            for (int64_t r = 1; r < rows && same; r++)
                                same = key_slots[key_row[t0 + r] * most_keys + shared] == key_slots[key_row[t0] * most_keys + shared];
                        for (int64_t c = 0; c < key_tiles(most); c++) {
                            tasks[num_tasks][0] = t0, tasks[num_tasks][1] = rows, tasks[num_tasks][2] = c;
                            tasks[num_tasks++][3] = shared;
                        }
                    }
                }
                if (num_tasks >= 8 * threads) head_group = m->num_kv_heads, head_tasks = 1;
            }
            int64_t l = 0;
            for (; l < m->num_layers; l++) {
                const Layer *layer = &m->layers[l];
                rms_norm(x, layer->input_norm, T, H, m->eps, h);
                prepare_rows(h, T, H, &a, &row_plan);
                MARK(PHASE_NORM)
                project(&layer->qkv, &a, &row_plan, T, wide);
                MARK(PHASE_QKV)
#pragma omp for schedule(static)
                for (int64_t t = 0; t < T; t++) { /* bias, RoPE on the q and k heads, then K/V to the token's slot */
                    float *row = wide + t * qkv_width;
                    if (layer->qkv_bias)
                        for (int64_t i = 0; i < qkv_width; i++) row[i] += layer->qkv_bias[i];
                    const float *c = m->cos + b->positions[t] * D, *s = m->sin + b->positions[t] * D;
                    for (int64_t head = 0; head < m->num_heads + m->num_kv_heads; head++) rope(row + head * D, c, s, D);
                    store_row(m, layer->k_cache, layer->k_scale, b->slots[t], row + q_width);
                    store_row(m, layer->v_cache, layer->v_scale, b->slots[t], row + q_width + kv_width);
                }
                MARK(PHASE_ROPE)
                if (runs.num_runs) {
#pragma omp for schedule(dynamic, 1) nowait
                    for (int64_t task = 0; task < runs.num_attend; task++) {
                        const int64_t r = runs.attend[task][0], kvh = runs.attend[task][1], i0 = runs.attend[task][2];
                        const int64_t s = runs.seq[r], first = b->query_start[s], in_run = run_tokens(b, s);
                        const int64_t num_new = b->query_start[s + 1] - first;
                        const int64_t t = first + i0, rows = in_run - i0 < runs.rows ? in_run - i0 : runs.rows;
                        const int64_t limit = b->seq_lens[s] - num_new + i0 + 1, at = kvh * group * D;
                        attend_run_rows(wide + t * qkv_width + at, qkv_width, rows, limit, group, m, layer, kvh,
                                        runs.slots + runs.slot_at[r], act + t * q_width + at, q_width,
                                        runs.scratch + omp_get_thread_num() * run_scratch_floats(D));
                    }
                }
#pragma omp for schedule(dynamic, 1) /* tasks differ in length: a long context beside short ones */
                for (int64_t task = 0; task < num_tasks * head_tasks; task++) {
                    const int64_t *which = tasks[task / head_tasks], t0 = which[0], rows = which[1], c = which[2], k0 = c * KEY_TILE;
                    const int64_t *row_slots[16], *slots = key_slots + key_row[t0] * most_keys + k0;
                    int64_t row_count[16], n = 0;
                    for (int64_t r = 0; r < rows; r++) {
                        const int64_t left = key_counts[t0 + r] - k0;
                        row_count[r] = left < 0 ? 0 : left < KEY_TILE ? left : KEY_TILE;
                        row_slots[r] = key_slots + key_row[t0 + r] * most_keys + k0;
                        if (row_count[r] > n) n = row_count[r], slots = row_slots[r];
                    }
                    const RowKeys own = {row_slots, row_count, which[3] - k0 < 0 ? 0 : which[3] - k0};
                    for (int64_t kv_head = task % head_tasks * head_group; kv_head < (task % head_tasks + 1) * head_group; kv_head++) {
                        const int64_t at = kv_head * group * D; /* the KV head's first query head, in q and out */
                        const int64_t tiles = key_tiles(key_counts[t0]), j = first_part[t0] + c;
                        if (rows == 1) { /* a decode, or a sequence's last token: straight to its output */
                            float *out = tiles == 1 ? act + t0 * q_width + at : part_out + j * q_width + at;
                            float *stats = tiles == 1 ? my_stats : part_stats + (j * heads + kv_head * group) * 2;
                            attend_tile(wide + t0 * qkv_width + at, 0, 1, group, n, m, layer, kv_head, slots, n, out, 0, stats, my_scores, NULL);
                            if (tiles == 1)
                                for (int64_t h = 0; h < group; h++) finish_query(out + h * D, stats[2 * h + 1], D, out + h * D);
                            continue;
                        }
                        attend_tile(wide + t0 * qkv_width + at, qkv_width, rows, group, 0, m, layer, kv_head, slots, n, my_out,
                                    group * D, my_stats, my_scores, &own);
                        for (int64_t r = 0; r < rows; r++) {
                            const int64_t t = t0 + r, jr = first_part[t] + c;
                            const float *o = my_out + r * group * D, *st = my_stats + r * group * 2;
                            if (row_count[r] == 0) continue; /* the row's keys end before this tile */
                            if (key_tiles(key_counts[t]) == 1) {
                                for (int64_t h = 0; h < group; h++) finish_query(o + h * D, st[2 * h + 1], D, act + t * q_width + at + h * D);
                                continue;
                            }
                            memcpy(part_out + jr * q_width + at, o, sizeof(float) * group * D);
                            memcpy(part_stats + (jr * heads + kv_head * group) * 2, st, sizeof(float) * group * 2);
                        }
                    }
                }
                if (num_parts > one_by_one) { /* some token's keys went in several tiles: fold them in key order */
#pragma omp for schedule(static)
                    for (int64_t task = 0; task < T * m->num_kv_heads; task++) {
                        const int64_t t = task / m->num_kv_heads, kv_head = task % m->num_kv_heads;
                        const int64_t j = first_part[t], count = first_part[t + 1] - j;
                        if (count < 2) continue;
                        for (int64_t head = kv_head * group; head < (kv_head + 1) * group; head++) {
                            float *acc = part_out + j * q_width + head * D, most = 0.0f, total = 0.0f;
                            for (int64_t c = 0; c < count; c++) {
                                const float *stats = part_stats + ((j + c) * heads + head) * 2;
                                fold_tile(acc, &most, &total, part_out + (j + c) * q_width + head * D, stats[0], stats[1], c == 0, D);
                            }
                            finish_query(acc, total, D, act + t * q_width + head * D);
                        }
                    }
                }
                MARK(PHASE_ATTEND)
                prepare_rows(act, T, q_width, &a, &row_plan);
                project(&layer->o, &a, &row_plan, T, h);
                if (m->reduce && all_reduce(m->reduce, h, T * H, &reduce_status, &late_rank)) break;
                add_rows(x, h, T, H);
                MARK(PHASE_O)
                rms_norm(x, layer->post_norm, T, H, m->eps, h);
                prepare_rows(h, T, H, &a, &row_plan);
                MARK(PHASE_MLP_IN)
                if (fused_swiglu)
                    gate_up_swiglu(&layer->gate_up, &a, &row_plan, I, wide);
                else
                    project(&layer->gate_up, &a, &row_plan, T, wide);
                MARK(PHASE_GATE_UP)
                swiglu(wide, T, I, act, &a, &row_plan, fused_swiglu);
                MARK(PHASE_SWIGLU)
                if (l + 1 < m->num_layers) {
                    const Layer *next = &m->layers[l + 1];
                    const int64_t bytes = kv_width * cache_value_size(m); /* the scales are left to the hardware */
#pragma omp for schedule(static) nowait
                    for (int64_t i = 0; i < num_prefetch; i++) {
                        const char *k = (const char *)next->k_cache + prefetch[i] * bytes;
                        const char *v = (const char *)next->v_cache + prefetch[i] * bytes;
                        for (int64_t at = 0; at < bytes; at += 64) {
                            _mm_prefetch(k + at, _MM_HINT_T1);
                            _mm_prefetch(v + at, _MM_HINT_T1);
                        }
                    }
                }
                project(&layer->down, &a, &down_plan, T, h);
                if (m->reduce && all_reduce(m->reduce, h, T * H, &reduce_status, &late_rank)) break;
                add_rows(x, h, T, H);
                MARK(PHASE_DOWN)
            }
            if (l == m->num_layers && m->final_norm) rms_norm(x, m->final_norm, T, H, m->eps, x); /* row by row: in place */
        }
    }
    free_runs(&runs);
    free_rows(&row_plan);
    free(key_row);
    free(h);
    free(wide);
    free(act);
    free(a.xq);
    free(a.dx);
    free(a.sx);
    free(key_slots);
    free(key_counts);
    free(scores);
    free(tasks);
    free(first_part);
    free(part_out);
    free(part_stats);
    free(prefetch);
    if (reduce_status) b->bad = late_rank;
    return failed ? -1 : reduce_status;
}



/* `steps` greedy decode steps of a batch of one new token per sequence (a decode token: parent -1, no run), in
 * one call; with steps = 1 the batch may be any decoder_forward takes (draft trees, several rows a sequence),
 * every row's argmax computed. Each step runs the layers and the final norm (decoder_forward; Decoder.final_norm
 * must be set),
 * rounds its rows to bf16 and takes the LM head (quantize_activations, vnni_gemm) and each row's argmax
 * (row_argmax); every step but the last then feeds its tokens back through the embeddings at the next
 * positions, their K/V going to the slots the block tables give. hidden [steps, B, hidden] gets each step's
 * normed rows and tokens [steps, B] its tokens: bit for bit what as many steps of decoder_forward, the LM
 * head's vnni_matmul and row_argmax give, without the host's work between them. The batch's arrays are read,
 * not changed. Returns decoder_forward's codes (b->bad as there; BAD_TABLE_WIDTH / BAD_BLOCK for a later
 * step's position beyond its block table, BAD_TOKEN for a token the embeddings lack), or -1 for no memory. */
int decoder_greedy(const Decoder *m, Batch *b, float *x, int threads, const Head *head, int64_t steps, float *hidden,
                   int64_t *tokens) {
    const int64_t B = b->num_tokens, S = b->num_seqs, H = m->hidden, V = head->vocab, bs = m->block_size;
    if ((steps > 1 && B != S) || m->final_norm == NULL || m->reduce) return BAD_QUERY_START;
    int64_t *positions = malloc(sizeof(int64_t) * B), *slots = malloc(sizeof(int64_t) * B);
    int32_t *seq_lens = malloc(sizeof(int32_t) * S);
    uint16_t *xb = malloc(sizeof(uint16_t) * B * H);
    int8_t *xq = malloc(B * H);
    float *dx = malloc(sizeof(float) * B * H / GROUP), *sx = malloc(sizeof(float) * B * H / GROUP);
    float *logits = malloc(sizeof(float) * B * V);
    int code = -1;
    if (!positions || !slots || !seq_lens || !xb || !xq || !dx || !sx || !logits) goto done;
    memcpy(positions, b->positions, sizeof(int64_t) * B);
    memcpy(slots, b->slots, sizeof(int64_t) * B);
    memcpy(seq_lens, b->seq_lens, sizeof(int32_t) * S);
    Batch step = *b;
    step.positions = positions, step.slots = slots, step.seq_lens = seq_lens;
    for (int64_t s = 0; s < steps; s++) {
        if (s > 0) {
            for (int64_t t = 0; t < B; t++) {
                const int64_t token = tokens[(s - 1) * B + t], at = ++positions[t], column = at / bs;
                seq_lens[t]++;
                if (column >= b->table_width) {
                    b->bad = t, code = BAD_TABLE_WIDTH;
                    goto done;
                }
                const int64_t block = b->block_tables[t * b->table_stride + column];
                if (block < 0 || block >= m->num_slots / bs) {
                    b->bad = t * b->table_width + column, code = BAD_BLOCK;
                    goto done;
                }
                if (token < 0 || token >= head->embed_rows) {
                    b->bad = t, code = BAD_TOKEN;
                    goto done;
                }
                slots[t] = block * bs + at % bs;
                float *row = x + t * H;
                if (head->embed_bf16)
                    for (int64_t i = 0; i < H; i++) row[i] = bf16_to_float(((const uint16_t *)head->embed)[token * H + i]);
                else
                    memcpy(row, (const float *)head->embed + token * H, sizeof(float) * H);
            }
        }
        code = decoder_forward(m, &step, x, threads);
        if (code) {
            b->bad = step.bad;
            goto done;
        }
        memcpy(hidden + s * B * H, x, sizeof(float) * B * H);
        for (int64_t i = 0; i < B * H; i++) xb[i] = float_to_bf16(x[i]);
        quantize_activations(xb, B, H, xq, dx, sx);
        vnni_gemm(head->codes, head->scales, head->mins, (int)head->bits, V, H, xq, dx, sx, B, logits, threads);
        row_argmax(logits, B, V, tokens + s * B, threads);
    }
done:
    free(positions);
    free(slots);
    free(seq_lens);
    free(xb);
    free(xq);
    free(dx);
    free(sx);
    free(logits);
    return code;
}
