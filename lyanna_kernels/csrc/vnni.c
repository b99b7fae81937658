/* Integer-dot matrix products for weights interleaved 16 output rows at a time: vpdpbusd on CPUs with AVX512-VNNI,
 * vpmaddubsw on the others (AVX2).
 *
 * The row layout of int4_gemm.c takes one weight row at a time, and each of its groups costs several
 * instructions per activation row (widening products, horizontal sums, scaling), so a few activation
 * rows (a verified draft tree, a short prefill chunk, a batch of decodes) cost several times one. Here
 * one vpdpbusd multiplies 4 consecutive inputs of 16 output rows with 4 int8 activations broadcast to
 * every lane (64 products), so the weights of a block of 16 rows are unpacked once and used for up to
 * 8 activation rows held in registers.
 *
 * Layout of an [n, k] weight (n a multiple of 16, k of 32), block b = rows 16 b .. 16 b + 15:
 *   4-bit: per block and pair of 4-input steps p (inputs 8 p .. 8 p + 7), 64 bytes: byte 4 r + i holds
 *          input 8 p + i of row r in its low nibble and input 8 p + 4 + i in its high nibble;
 *   8-bit: per block and 4-input step s, 64 bytes: byte 4 r + i holds input 4 s + i of row r, as q + 128;
 *   scales d and minimums m: per block and group of 32 inputs, 16 fp16 values (w = code * d + m; an 8-bit
 *          weight's m is -128 d).
 * Activations are the same int8 blocks as int4_gemm.c's. A group's product is exact in int32 and scaled
 * once per group and activation row; every activation row is computed in the same order whatever the
 * other rows are.
 *
 * Without VNNI (avx2_blocks) each half of a block (8 output rows, 32 bytes of each 64) is one AVX2 register:
 * vpmaddubsw multiplies 4 inputs of 8 rows with 4 broadcast activations into pairs of int16 sums. A 4-bit group's
 * 16 such products add up in int16 without overflow (|sum| <= 32 * 15 * 127 < 32767), so they take one vpmaddwd
 * per group; every float operation is vnni.c's, so 4-bit products are the same numbers on both kinds of CPU. An
 * 8-bit weight's codes are taken back to signed q (|q| <= 127 keeps each pair within int16), and the group's sum
 * q . x plus 128 times the activations' integer sum is VNNI's (q + 128) . x exactly: then scaled with VNNI's float
 * operations, 8-bit products are the same numbers on both kinds too. A replica's answers do not depend on its CPU.
 */
#include <omp.h>
#include <stdlib.h>

#include "integer_dot.h"

#define VNNI __attribute__((target("avx512f,avx512bw,avx512vnni,f16c,fma")))
#define ROWS 8 /* activation rows per register tile */

static inline VNNI __m512i dot4(__m512i acc, __m512i w, const int8_t *x) {
    int32_t four;
    memcpy(&four, x, 4);
    return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(four));
}

/* One block of 16 output rows against R activation rows (R a constant at each call). */
static inline VNNI __attribute__((always_inline)) void block_rows(
    const uint8_t *codes, const uint16_t *d, const uint16_t *m, int bits, int64_t groups, const int8_t *xq,
    const float *dx, const float *sx, int64_t k, int R, float *out, int64_t out_stride) {
    __m512 acc[ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int64_t g = 0; g < groups; g++) {
        __m512i dots[ROWS];
        for (int r = 0; r < R; r++) dots[r] = _mm512_setzero_si512();
        if (bits == 4) {
            const uint8_t *w = codes + g * 256;
            for (int p = 0; p < 4; p++) {
                const __m512i packed = _mm512_loadu_si512((const void *)(w + 64 * p));
                const __m512i lo = _mm512_and_si512(packed, low);
                const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
                for (int r = 0; r < R; r++) {
                    const int8_t *x = xq + r * k + g * GROUP + 8 * p;
                    dots[r] = dot4(dot4(dots[r], lo, x), hi, x + 4);
                }
            }
        } else {
            const uint8_t *w = codes + g * 512;
            for (int s = 0; s < 8; s++) {
                const __m512i wv = _mm512_loadu_si512((const void *)(w + 64 * s));
                for (int r = 0; r < R; r++) dots[r] = dot4(dots[r], wv, xq + r * k + g * GROUP + 4 * s);
            }
        }
        const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + g * 16)));
        const __m512 minimum = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(m + g * 16)));
        for (int r = 0; r < R; r++) {
            const __m512 s = _mm512_mul_ps(scale, _mm512_set1_ps(dx[r * groups + g]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[r]), s, acc[r]);
            acc[r] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(sx[r * groups + g]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + r * out_stride, acc[r]);
}

#define VNNI_TILE(call)                                                                 \
    switch (R) {                                                                        \
    case 1: call(1); break;                                                             \
    case 2: call(2); break;                                                             \
    case 3: call(3); break;                                                             \
    case 4: call(4); break;                                                             \
    case 5: call(5); break;                                                             \
    case 6: call(6); break;                                                             \
    case 7: call(7); break;                                                             \
    default: call(8); break;                                                            \
    }

/* Blocks [b0, b1) of out [rows, n] fp32 = activations @ W.T (W interleaved, `bits` 4 or 8). */
VNNI void vnni_blocks(const uint8_t *codes, const uint16_t *d, const uint16_t *m, int bits, int64_t n, int64_t k,
                      const int8_t *xq, const float *dx, const float *sx, int64_t rows, float *out, int64_t b0,
                      int64_t b1) {
    const int64_t groups = k / GROUP, block_bytes = 16 * k * bits / 8;
    const int64_t tiles = (rows + ROWS - 1) / ROWS; /* rows split evenly: 9 rows as 5 + 4, not 8 + 1 */
    for (int64_t b = b0; b < b1; b++) {
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t r0 = rows * t / tiles;
            const int R = (int)(rows * (t + 1) / tiles - r0);
#define BLOCK(C) block_rows(codes + b * block_bytes, d + b * groups * 16, m + b * groups * 16, bits, groups, \
                            xq + r0 * k, dx + r0 * groups, sx + r0 * groups, k, C, out + r0 * n + 16 * b, n)
            VNNI_TILE(BLOCK)
#undef BLOCK
        }
    }
}

#define AVX2_ROWS 4 /* activation rows per register tile without VNNI */

/* Half h (output rows 8 h .. 8 h + 7) of one block against R activation rows (R a constant at each call). */
static inline __attribute__((always_inline)) void half_rows(
    const uint8_t *codes, const uint16_t *d, const uint16_t *m, int bits, int64_t groups, const int8_t *xq,
    const float *dx, const float *sx, const int32_t *xsum, int64_t k, int R, int h, float *out, int64_t out_stride) {
    __m256 acc[AVX2_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    for (int64_t g = 0; g < groups; g++) {
        __m256i dots[AVX2_ROWS];
        if (bits == 4) {
            __m256i pairs[AVX2_ROWS];
            const uint8_t *w = codes + g * 256 + 32 * h;
            for (int p = 0; p < 4; p++) {
                const __m256i packed = _mm256_loadu_si256((const __m256i *)(w + 64 * p));
                const __m256i lo = _mm256_and_si256(packed, low);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
                for (int r = 0; r < R; r++) {
                    int32_t x0, x1;
                    memcpy(&x0, xq + r * k + g * GROUP + 8 * p, 4);
                    memcpy(&x1, xq + r * k + g * GROUP + 8 * p + 4, 4);
                    const __m256i two = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(x0)),
                                                         _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x1)));
                    pairs[r] = p ? _mm256_add_epi16(pairs[r], two) : two;
                }
            }
            for (int r = 0; r < R; r++) dots[r] = _mm256_madd_epi16(pairs[r], ones);
        } else {
            const uint8_t *w = codes + g * 512 + 32 * h;
            for (int r = 0; r < R; r++) dots[r] = _mm256_setzero_si256();
            for (int s = 0; s < 8; s++) {
                const __m256i q = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w + 64 * s)), flip);
                const __m256i magnitude = _mm256_sign_epi8(q, q);
                for (int r = 0; r < R; r++) {
                    int32_t x0;
                    memcpy(&x0, xq + r * k + g * GROUP + 4 * s, 4);
                    const __m256i signed_x = _mm256_sign_epi8(_mm256_set1_epi32(x0), q);
                    dots[r] = _mm256_add_epi32(dots[r], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_x), ones));
                }
            }
            for (int r = 0; r < R; r++) /* (q + 128) . x, as vpdpbusd sums it */
                dots[r] = _mm256_add_epi32(dots[r], _mm256_set1_epi32(128 * xsum[r * groups + g]));
        }
        const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + g * 16 + 8 * h)));
        const __m256 minimum = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m + g * 16 + 8 * h)));
        for (int r = 0; r < R; r++) {
            const __m256 s = _mm256_mul_ps(scale, _mm256_set1_ps(dx[r * groups + g]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[r]), s, acc[r]);
            acc[r] = _mm256_fmadd_ps(minimum, _mm256_set1_ps(sx[r * groups + g]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + r * out_stride + 8 * h, acc[r]);
}

#define AVX2_TILE(call)                                                                 \
    switch (R) {                                                                        \
    case 1: call(1); break;                                                             \
    case 2: call(2); break;                                                             \
    case 3: call(3); break;                                                             \
    default: call(4); break;                                                            \
    }

/* vnni_blocks without VNNI: blocks [b0, b1) of out [rows, n] fp32 = activations @ W.T. */
static void avx2_blocks(const uint8_t *codes, const uint16_t *d, const uint16_t *m, int bits, int64_t n, int64_t k,
                        const int8_t *xq, const float *dx, const float *sx, int64_t rows, float *out, int64_t b0,
                        int64_t b1) {
    const int64_t groups = k / GROUP, block_bytes = 16 * k * bits / 8;
    int32_t *xsum = NULL; /* an 8-bit weight's: each activation group's integer sum */
    if (bits == 8) {
        xsum = malloc(sizeof(int32_t) * (size_t)(rows * groups));
        if (!xsum) abort(); /* a few KiB: only a machine out of memory gets here */
        for (int64_t i = 0; i < rows * groups; i++) {
            int32_t sum = 0;
            for (int64_t j = 0; j < GROUP; j++) sum += xq[i * GROUP + j];
            xsum[i] = sum;
        }
    }
    const int64_t tiles = (rows + AVX2_ROWS - 1) / AVX2_ROWS; /* rows split evenly, as vnni_blocks does */
    for (int64_t b = b0; b < b1; b++) {
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t r0 = rows * t / tiles;
            const int R = (int)(rows * (t + 1) / tiles - r0);
            for (int h = 0; h < 2; h++) {
#define HALF(C) half_rows(codes + b * block_bytes, d + b * groups * 16, m + b * groups * 16, bits, groups, xq + r0 * k, \
                          dx + r0 * groups, sx + r0 * groups, xsum ? xsum + r0 * groups : NULL, k, C, h, out + r0 * n + 16 * b, n)
                AVX2_TILE(HALF)
#undef HALF
            }
        }
    }
    free(xsum);
}

static int vnni_off = 0; /* vnni_configure(0): the AVX2 kernels even where VNNI runs (the same numbers) */

/* Whether this CPU runs the VNNI kernels (cached after the first call), unless turned off. */
int vnni_supported(void) {
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512vnni");
    }
    return known && !vnni_off;
}

/* Use the VNNI kernels where the CPU has them (want != 0) or the AVX2 ones; returns whether VNNI now runs. */
int vnni_configure(int want) {
    vnni_off = !want;
    return vnni_supported();
}

/* The paths a step's rows can take through an interleaved weight, all computing the same numbers: avx2_blocks,
 * vnni_blocks and amx_blocks (whole tiles of 16 rows; the rest through vnni_blocks). Which is fastest for how
 * many rows depends on the CPU (its vector units, its memory), so kernel_paths_measure times each path this
 * process may run on a scratch weight, per class of row counts, and the fastest serves that class: a decode's
 * 1 row, a verification's 2-8 and 9-15, and 16 or more (batches and prompt chunks). A class not measured, or
 * whose path was turned off since, takes the default: AMX for 16 rows or more where it runs, else VNNI where
 * it runs, else AVX2. Timing noise can only change the speed, never an answer. */
enum { PATH_AVX2, PATH_VNNI, PATH_AMX, PATHS };
#define ROW_CLASSES 4

static const int64_t class_rows[ROW_CLASSES] = {1, 4, 12, 32}; /* the row count each class is timed at */
static int chosen[ROW_CLASSES] = {-1, -1, -1, -1};

static int row_class(int64_t rows) { return rows <= 1 ? 0 : rows <= 8 ? 1 : rows < 16 ? 2 : 3; }

/* Whether `path` can serve `rows` rows now. */
static int path_runs(int path, int64_t rows) {
    return path == PATH_AVX2 || (path == PATH_VNNI && vnni_supported()) ||
           (path == PATH_AMX && rows >= 16 && amx_active());
}

/* The path `rows` rows take now: the measured choice of their class where it still runs, else the default. */
int kernel_path(int64_t rows) {
    const int path = chosen[row_class(rows)];
    if (path >= 0 && path_runs(path, rows)) return path;
    return path_runs(PATH_AMX, rows) ? PATH_AMX : vnni_supported() ? PATH_VNNI : PATH_AVX2;
}

static void path_blocks(int path, const uint8_t *codes, const uint16_t *d, const uint16_t *m, int bits, int64_t n,
                        int64_t k, const int8_t *xq, const float *dx, const float *sx, int64_t rows, float *out,
                        int64_t b0, int64_t b1) {
    (path == PATH_AMX ? amx_blocks : path == PATH_VNNI ? vnni_blocks : avx2_blocks)(codes, d, m, bits, n, k, xq, dx, sx,
                                                                                     rows, out, b0, b1);
}

void interleaved_blocks(const uint8_t *codes, const uint16_t *d, const uint16_t *m, int bits, int64_t n, int64_t k,
                        const int8_t *xq, const float *dx, const float *sx, int64_t rows, float *out, int64_t b0,
                        int64_t b1) {
    path_blocks(kernel_path(rows), codes, d, m, bits, n, k, xq, dx, sx, rows, out, b0, b1);
}

/* Seconds of the fastest of `reps` calls of `path` over every block of a scratch 4-bit weight, split across
 * `threads` as the decoder splits a projection. */
static double time_path(int path, const uint8_t *codes, const uint16_t *d, int64_t n, int64_t k, const int8_t *xq,
                        const float *dx, int64_t rows, float *out, int threads, int reps) {
    double best = 1e30;
    for (int rep = 0; rep < reps; rep++) {
        const double start = omp_get_wtime();
#pragma omp parallel num_threads(threads)
        {
            const int64_t t = omp_get_thread_num(), teams = omp_get_num_threads(), blocks = n / 16;
            path_blocks(path, codes, d, d, 4, n, k, xq, dx, dx, rows, out, blocks * t / teams, blocks * (t + 1) / teams);
        }
        const double took = omp_get_wtime() - start;
        if (rep > 0 && took < best) best = took; /* the first call warms the caches */
    }
    return best;
}

/* Time every path that runs now for each class of row counts and keep the fastest (see kernel_path); returns 0,
 * or -1 without memory (the defaults then stay). The weight (4-bit, 2048 x 2048: 2 MiB) is the size of a
 * decoder's projection, its values arbitrary: the time of an integer dot product does not depend on them. It is
 * timed from the caches, so the choice is the faster arithmetic (a decode that streams its weights from memory
 * runs at the memory's speed on either path), and the 16+ class at 32 rows. */
int kernel_paths_measure(int threads) {
    const int64_t n = 2048, k = 2048, most = 32, groups = k / GROUP;
    uint8_t *codes = malloc((size_t)(n * k / 2));
    uint16_t *d = malloc(sizeof(uint16_t) * (size_t)(n * groups));
    int8_t *xq = malloc((size_t)(most * k));
    float *dx = malloc(sizeof(float) * (size_t)(most * groups)), *out = malloc(sizeof(float) * (size_t)(most * n));
    int status = -1;
    if (codes && d && xq && dx && out) {
        for (int64_t i = 0; i < n * k / 2; i++) codes[i] = (uint8_t)(i * 131 + 7);
        for (int64_t i = 0; i < n * groups; i++) d[i] = 0x2000; /* fp16 2^-7 */
        for (int64_t i = 0; i < most * k; i++) xq[i] = (int8_t)((i * 29) % 255 - 127);
        for (int64_t i = 0; i < most * groups; i++) dx[i] = 0.01f;
        for (int c = 0; c < ROW_CLASSES; c++) {
            const int64_t rows = class_rows[c];
            double fastest = 1e30;
            int pick = -1;
            for (int path = 0; path < PATHS; path++) {
                if (!path_runs(path, rows)) continue;
                const double took = time_path(path, codes, d, n, k, xq, dx, rows, out, threads, 6);
                if (took < fastest) fastest = took, pick = path;
            }
            chosen[c] = pick;
        }
        status = 0;
    }
    free(codes), free(d), free(xq), free(dx), free(out);
    return status;
}

/* out [rows, n] fp32 = x @ W.T for an interleaved weight; blocks of 16 output rows split across threads, through
 * the path `rows` rows take (kernel_path). */
void vnni_gemm(const uint8_t *codes, const uint16_t *d, const uint16_t *m, int bits, int64_t n, int64_t k,
               const int8_t *xq, const float *dx, const float *sx, int64_t rows, float *out, int threads) {
    const int64_t blocks = n / 16;
#pragma omp parallel num_threads(threads)
    {
        const int64_t t = omp_get_thread_num(), teams = omp_get_num_threads();
        interleaved_blocks(codes, d, m, bits, n, k, xq, dx, sx, rows, out, blocks * t / teams, blocks * (t + 1) / teams);
    }
}
