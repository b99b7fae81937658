/* Shared helpers of the integer-dot CPU kernels (int4_gemm.c, decoder.c): bf16/fp16 conversions, int8
 * activation blocks, and one weight row's dot products with up to four activation rows (q4 and q8).
 * Each activation row's result is computed in the same order whatever the other rows are, so a row's
 * output does not depend on the batch it is in. */
#ifndef LYANNA_INTEGER_DOT_H
#define LYANNA_INTEGER_DOT_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define GROUP 32

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}

/* One block of 32 values -> int8 codes xq = round(v / d) (to nearest even, as nearbyintf), its scale
 * d = max|v| / 127 and d * sum(xq). */
static inline void quantize_block(const float *v, int8_t *xq, float *dx, float *sx) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 x[4], amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        x[i] = _mm256_loadu_ps(v + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, x[i]));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float d = _mm_cvtss_f32(m) / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
    __m256i q[4], sum = _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) {
        q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(x[i], _mm256_set1_ps(inv))); /* MXCSR: nearest even */
        sum = _mm256_add_epi32(sum, q[i]);
    }
    /* int32 -> int8 (values within [-127, 127]); the packs interleave 128-bit lanes, the permute undoes it. */
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256((__m256i *)xq, _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s = _mm_hadd_epi32(s, s);
    s = _mm_hadd_epi32(s, s);
    *dx = d;
    *sx = d * (float)_mm_cvtsi128_si32(s);
}

static inline __m128 load_half4(const uint16_t *p) { return _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)p)); }

static inline __m256i unpack_q4(const uint8_t *p) {
    const __m128i packed = _mm_loadu_si128((const __m128i *)p);
    const __m128i low = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), low), _mm_and_si128(packed, low));
}

/* The sums of four groups' int32 lanes (p0..p3, 8 lanes each), one group per lane. */
static inline __m128 group_sums(__m256i p0, __m256i p1, __m256i p2, __m256i p3) {
    const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(p0, p1), _mm256_hadd_epi32(p2, p3));
    return _mm_cvtepi32_ps(_mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
}

static inline __m256i q4_dot(__m256i w, const int8_t *x) {
    const __m256i xv = _mm256_loadu_si256((const __m256i *)x);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), _mm256_set1_epi16(1));
}

static inline __m256i q8_dot(__m256i magnitude, __m256i w, const int8_t *x) {
    const __m256i xv = _mm256_loadu_si256((const __m256i *)x);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(xv, w)), _mm256_set1_epi16(1));
}

/* One output row against R activation rows (R a constant at each call, so the accumulators live in
 * registers). Groups go four at a time: their weights are unpacked once for all R rows, and their four
 * scales multiply the four integer sums in one vector. */
static inline __attribute__((always_inline)) void q4_row(
    const uint8_t *wq, const uint16_t *wd, const uint16_t *wm, int64_t groups, const int8_t *xq, const float *dx,
    const float *sx, int64_t k, int R, float *dots) {
    __m128 acc[4];
    for (int r = 0; r < R; r++) acc[r] = _mm_setzero_ps();
    int64_t g = 0;
    for (; g + 4 <= groups; g += 4) {
        const __m256i w0 = unpack_q4(wq + g * 16), w1 = unpack_q4(wq + g * 16 + 16);
        const __m256i w2 = unpack_q4(wq + g * 16 + 32), w3 = unpack_q4(wq + g * 16 + 48);
        const __m128 d = load_half4(wd + g), m = load_half4(wm + g);
        for (int r = 0; r < R; r++) {
            const int8_t *x = xq + r * k + g * GROUP;
            const __m128 sums = group_sums(q4_dot(w0, x), q4_dot(w1, x + 32), q4_dot(w2, x + 64),
                                           q4_dot(w3, x + 96));
            const __m128 scale = _mm_mul_ps(d, _mm_loadu_ps(dx + r * groups + g));
            acc[r] = _mm_fmadd_ps(sums, scale, _mm_fmadd_ps(m, _mm_loadu_ps(sx + r * groups + g), acc[r]));
        }
    }
    for (int r = 0; r < R; r++) {
        __m128 s = _mm_hadd_ps(acc[r], acc[r]);
        s = _mm_hadd_ps(s, s);
        dots[r] = _mm_cvtss_f32(s);
    }
    for (; g < groups; g++) {
        const __m256i w = unpack_q4(wq + g * 16);
        for (int r = 0; r < R; r++) {
            const __m256i p = q4_dot(w, xq + r * k + g * GROUP);
            dots[r] += hsum(_mm256_cvtepi32_ps(p)) * _cvtsh_ss(wd[g]) * dx[r * groups + g] + _cvtsh_ss(wm[g]) * sx[r * groups + g];
        }
    }
}

static inline __attribute__((always_inline)) void q8_row(
    const int8_t *wq, const uint16_t *wd, int64_t groups, const int8_t *xq, const float *dx, int64_t k, int R,
    float *dots) {
    __m128 acc[4];
    for (int r = 0; r < R; r++) acc[r] = _mm_setzero_ps();
    int64_t g = 0;
    for (; g + 4 <= groups; g += 4) {
        __m256i w[4], magnitude[4];
        for (int i = 0; i < 4; i++) {
            w[i] = _mm256_loadu_si256((const __m256i *)(wq + (g + i) * GROUP));
            magnitude[i] = _mm256_sign_epi8(w[i], w[i]);
        }
        const __m128 d = load_half4(wd + g);
        for (int r = 0; r < R; r++) {
            const int8_t *x = xq + r * k + g * GROUP;
            const __m128 sums = group_sums(q8_dot(magnitude[0], w[0], x), q8_dot(magnitude[1], w[1], x + 32),
                                           q8_dot(magnitude[2], w[2], x + 64), q8_dot(magnitude[3], w[3], x + 96));
            acc[r] = _mm_fmadd_ps(sums, _mm_mul_ps(d, _mm_loadu_ps(dx + r * groups + g)), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        __m128 s = _mm_hadd_ps(acc[r], acc[r]);
        s = _mm_hadd_ps(s, s);
        dots[r] = _mm_cvtss_f32(s);
    }
    for (; g < groups; g++) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)(wq + g * GROUP));
        const __m256i magnitude = _mm256_sign_epi8(w, w);
        for (int r = 0; r < R; r++) {
            const __m256i p = q8_dot(magnitude, w, xq + r * k + g * GROUP);
            dots[r] += hsum(_mm256_cvtepi32_ps(p)) * _cvtsh_ss(wd[g]) * dx[r * groups + g];
        }
    }
}

/* Calls call(R) with R = rows left in the tile (1 to 4), a constant in each branch. */
#define ROW_TILE(call)                                                                  \
    switch (R) {                                                                        \
    case 1: call(1); break;                                                             \
    case 2: call(2); break;                                                             \
    case 3: call(3); break;                                                             \
    default: call(4); break;                                                            \
    }

/* vnni.c: blocks [b0, b1) of 16 output rows of an interleaved weight: vnni_blocks on AVX512-VNNI CPUs only,
 * interleaved_blocks on any (through the path measured fastest for that many rows: kernel_path). */
void interleaved_blocks(const uint8_t *codes, const uint16_t *d, const uint16_t *m, int bits, int64_t n, int64_t k,
                        const int8_t *xq, const float *dx, const float *sx, int64_t rows, float *out, int64_t b0,
                        int64_t b1);
void vnni_blocks(const uint8_t *codes, const uint16_t *d, const uint16_t *m, int bits, int64_t n, int64_t k,
                 const int8_t *xq, const float *dx, const float *sx, int64_t rows, float *out, int64_t b0, int64_t b1);

/* amx.c: the AMX kernels (see there); amx_active() says whether amx_configure turned them on. */
int amx_configure(int want);
int amx_active(void);
void amx_blocks(const uint8_t *codes, const uint16_t *d, const uint16_t *m, int bits, int64_t n, int64_t k,
                const int8_t *xq, const float *dx, const float *sx, int64_t rows, float *out, int64_t b0, int64_t b1);
void amx_bf16_weights(const uint8_t *codes, const uint16_t *d, const uint16_t *m, int bits, int64_t k, int64_t b0,
                      int64_t b1, uint16_t *wb);
void amx_bf16_row(const float *x, int64_t k, int64_t t, uint16_t *xb);
void amx_swiglu_row(const float *gate_up, int64_t inter, int64_t t, uint16_t *xb);
void amx_bf16_blocks(const uint16_t *wb, int64_t n, int64_t k, const uint16_t *x, int64_t r0, int64_t r1, float *out,
                     int64_t b0, int64_t b1);
void amx_bf16_swiglu_blocks(const uint16_t *wb, int64_t k, const uint16_t *x, int64_t r0, int64_t r1, int64_t inter,
                            int64_t p0, int64_t p1, uint16_t *xo);
#endif
