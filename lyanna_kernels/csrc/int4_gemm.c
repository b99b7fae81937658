/* Integer-dot matrix products for 4-bit and 8-bit weights on x86 CPUs with AVX2, FMA and F16C.
 *
 * Activations are quantized per row in blocks of 32 to int8 (x ~ xq * dx, dx = max|x| / 127), and each
 * block of 32 weights is multiplied with them as integers (vpmaddubsw, vpmaddwd), so a weight byte is
 * read once and never widened to float. Weights:
 *   q4: per (row, group of 32) 16 bytes of codes q in [0, 15] (byte j holds element j in its low nibble
 *       and element j + 16 in its high nibble), an fp16 scale d and an fp16 minimum m: w = q * d + m
 *       (GGUF's Q4_1 block, 20 bytes per 32 weights);
 *   q8: per (row, group of 32) 32 signed bytes q and an fp16 scale d: w = q * d (GGUF's Q8_0).
 * A group's dot product is d * dx * sum(q * xq) (+ m * dx * sum(xq) for q4). Rows of the output are
 * split across OpenMP threads; bf16 activations in, bf16 or fp32 out.
 */
#include "integer_dot.h"

/* x [rows, k] bf16 -> xq [rows, k] int8, dx and sx [rows, k / 32]: block scale and dx * sum(xq). */
void quantize_activations(const uint16_t *x, int64_t rows, int64_t k, int8_t *xq, float *dx, float *sx) {
    const int64_t groups = k / GROUP;
    for (int64_t b = 0; b < rows * groups; b++) {
        float v[GROUP];
        for (int i = 0; i < GROUP; i++) v[i] = bf16_to_float(x[b * GROUP + i]);
        quantize_block(v, xq + b * GROUP, dx + b, sx + b);
    }
}

/* Row r of the output takes dots[r]: out is bf16, or fp32 when out_fp32. */
static inline void store(void *out, int out_fp32, int64_t index, float value) {
    if (out_fp32)
        ((float *)out)[index] = value;
    else
        ((uint16_t *)out)[index] = float_to_bf16(value);
}

/* out [rows, n] = x @ W.T for a q4 weight W [n, k] (qs [n, k / 2], d and m [n, k / 32] fp16). */
void q4_gemm(const uint8_t *qs, const uint16_t *d, const uint16_t *m, int64_t n, int64_t k, const int8_t *xq,
             const float *dx, const float *sx, int64_t rows, void *out, int out_fp32, int threads) {
    const int64_t groups = k / GROUP;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t j = 0; j < n; j++) {
        for (int64_t r0 = 0; r0 < rows; r0 += 4) {
            const int R = rows - r0 < 4 ? (int)(rows - r0) : 4;
            float dots[4];
#define Q4(C) q4_row(qs + j * groups * 16, d + j * groups, m + j * groups, groups, xq + r0 * k, \
                     dx + r0 * groups, sx + r0 * groups, k, C, dots)
            ROW_TILE(Q4)
#undef Q4
            for (int r = 0; r < R; r++) store(out, out_fp32, (r0 + r) * n + j, dots[r]);
        }
    }
}

/* out [rows, n] = x @ W.T for a q8 weight W [n, k] (qs [n, k] int8, d [n, k / 32] fp16). */
void q8_gemm(const int8_t *qs, const uint16_t *d, int64_t n, int64_t k, const int8_t *xq, const float *dx,
             int64_t rows, void *out, int out_fp32, int threads) {
    const int64_t groups = k / GROUP;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t j = 0; j < n; j++) {
        for (int64_t r0 = 0; r0 < rows; r0 += 4) {
            const int R = rows - r0 < 4 ? (int)(rows - r0) : 4;
            float dots[4];
#define Q8(C) q8_row(qs + j * k, d + j * groups, groups, xq + r0 * k, dx + r0 * groups, k, C, dots)
            ROW_TILE(Q8)
#undef Q8
            for (int r = 0; r < R; r++) store(out, out_fp32, (r0 + r) * n + j, dots[r]);
        }
    }
}
