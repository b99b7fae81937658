/* Each row's index of its largest value, as torch.argmax gives it: the first on ties, and the first NaN
 * where a row has one. Used for greedy tokens over a vocabulary of logits, where torch's row reductions
 * run at a fraction of the memory's speed: per row, an AVX2 pass for its maximum (four independent
 * chains of maxima) and one for the first index holding it (the row is then in cache), rows split
 * across OpenMP threads. */
#include "integer_dot.h"

static int64_t argmax_row(const float *x, int64_t n) {
    __m256 best[4], unordered = _mm256_setzero_ps();
    for (int c = 0; c < 4; c++) best[c] = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 32 <= n; i += 32)
        for (int c = 0; c < 4; c++) {
            const __m256 v = _mm256_loadu_ps(x + i + 8 * c);
            unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            best[c] = _mm256_max_ps(best[c], v);
        }
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        best[0] = _mm256_max_ps(best[0], v);
    }
    float lanes[8], m = -INFINITY;
    _mm256_storeu_ps(lanes, _mm256_max_ps(_mm256_max_ps(best[0], best[1]), _mm256_max_ps(best[2], best[3])));
    for (int l = 0; l < 8; l++) m = lanes[l] > m ? lanes[l] : m;
    int nan = _mm256_movemask_ps(unordered) != 0;
    for (; i < n; i++) {
        if (x[i] != x[i]) nan = 1;
        else if (x[i] > m) m = x[i];
    }
    if (nan) {
        for (int64_t j = 0; j < n; j++)
            if (x[j] != x[j]) return j;
    }
    const __m256 target = _mm256_set1_ps(m);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + j), target, _CMP_EQ_OQ));
        if (hit) return j + __builtin_ctz((unsigned)hit);
    }
    for (; j < n; j++)
        if (x[j] == m) return j;
    return 0; /* a row of n = 0 */
}

/* x [rows, n] fp32 (rows contiguous) -> out [rows] int64. */
void row_argmax(const float *x, int64_t rows, int64_t n, int64_t *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * n, n);
}
