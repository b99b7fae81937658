/* A drafter's host-heavy pieces in native calls (lyanna_kernels/draft_native.py): Lyanna's input fusion, and its draft
 * chains (the LM head over every request's trajectory and token-info tree sampling at width 1, paper Algorithm 1
 * with one child a node).
 *
 * In Python each is some tens of tensor operations a step, each paying for an interpreter the target's forward has
 * just pushed out of the caches; here they cost what their arithmetic and weights do. Both compute what the Python
 * code computes: the fusion the same bf16 roundings and the same integer-dot projection (up to the order of the
 * norms' sums), the chains the same logits bit for bit (the same activation quantization and interleaved int8
 * head), with tokens that differ only where token information's sums round differently and two candidates tie
 * within that rounding. Every draft is verified, so no answer depends on either.
 *
 * Input fusion (LyannaDraftModel._fuse): x = W_fuse [norm_h(h); norm_e(e)], each norm RMSNorm as engines/model.py
 * computes it in bf16 (the normalised row rounded to bf16, then times the bf16 weight, rounded), the projection's
 * output rounded to bf16 as a quantized PackableLinear returns it.
 *
 * Chains, per depth s of a request: z = logits_s + r(t_{s-1}) (t_0 the root), where token information r(t) is
 * RMSNorm(W_E[t] W1 W2) computed as DenseTokenInfo does (p = (W_E W1)[t], mean square p G p with the Gram matrix
 * G = W2 W2^T / vocab, then (p / rms) (W2 with the norm's weight folded in)); the depth's token is z's first
 * maximum (mapped to a target token through d2t when the head is restricted to hot tokens), its score the chain's
 * running product of softmax(z) at it. */
#include <omp.h>
#include <stdlib.h>

#include "integer_dot.h"
#include "decoder.h"
#include "draft_native.h"

/* out = RMSNorm(x) * w in bf16, as engines/model.py's RMSNorm computes it for bf16 rows. */
void norm_bf16(const uint16_t *x, const uint16_t *w, int64_t n, float eps, uint16_t *out) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        const float v = bf16_to_float(x[i]);
        sum += v * v;
    }
    const float inv = 1.0f / sqrtf(sum / (float)n + eps);
    for (int64_t i = 0; i < n; i++)
        out[i] = float_to_bf16(bf16_to_float(w[i]) * bf16_to_float(float_to_bf16(bf16_to_float(x[i]) * inv)));
}

/* x [rows, hidden] fp32 = W_fuse [norm_h(h_r); norm_e(E[tokens[r]])] for h [rows, hidden] bf16. Returns 0, -1
 * without memory, or 1 + r for row r whose token has no embedding. */
int draft_fuse_rows(const DraftFuse *f, const uint16_t *h, const int64_t *tokens, int64_t rows, float *x,
                    int threads) {
    const int64_t H = f->hidden, k = 2 * H, groups = k / GROUP;
    for (int64_t r = 0; r < rows; r++)
        if (tokens[r] < 0 || tokens[r] >= f->vocab) return (int)(1 + r);
    if (rows == 0) return 0;
    uint16_t *cat = malloc(sizeof(uint16_t) * (size_t)(rows * k));
    int8_t *xq = malloc((size_t)(rows * k));
    float *dx = malloc(sizeof(float) * (size_t)(rows * groups)), *sx = malloc(sizeof(float) * (size_t)(rows * groups));
    int status = -1;
    if (cat && xq && dx && sx) {
        for (int64_t r = 0; r < rows; r++) {
            norm_bf16(h + r * H, f->hidden_norm, H, f->eps, cat + r * k);
            norm_bf16(f->embed + tokens[r] * H, f->embed_norm, H, f->eps, cat + r * k + H);
        }
        quantize_activations(cat, rows, k, xq, dx, sx);
        vnni_gemm(f->codes, f->scales, f->mins, (int)f->bits, H, k, xq, dx, sx, rows, x, threads);
        for (int64_t i = 0; i < rows * H; i++) x[i] = bf16_to_float(float_to_bf16(x[i]));
        status = 0;
    }
    free(cat), free(xq), free(dx), free(sx);
    return status;
}


/* z += r(token) (DenseTokenInfo's arithmetic, fp32). */
static void add_token_info(const ChainHead *h, int64_t token, float *z) {
    const int64_t rank = h->rank, vocab = h->vocab;
    const float *p = h->projected + token * rank;
    float mean_square = 0.0f;
    for (int64_t i = 0; i < rank; i++) {
        float pg = 0.0f;
        for (int64_t j = 0; j < rank; j++) pg += p[j] * h->gram[j * rank + i];
        mean_square += pg * p[i];
    }
    const float inv = 1.0f / sqrtf(mean_square + h->eps);
    for (int64_t i = 0; i < rank; i++) {
        const __m256 c = _mm256_set1_ps(p[i] * inv);
        const float *row = h->w2 + i * vocab;
        int64_t v = 0;
        for (; v + 8 <= vocab; v += 8)
            _mm256_storeu_ps(z + v, _mm256_fmadd_ps(c, _mm256_loadu_ps(row + v), _mm256_loadu_ps(z + v)));
        for (; v < vocab; v++) z[v] += p[i] * inv * row[v];
    }
}

/* The index of z's first maximum and log(sum(exp(z))). */
static int64_t top_and_logsumexp(const float *z, int64_t n, float *lse) {
    int64_t top = 0;
    for (int64_t v = 1; v < n; v++)
        if (z[v] > z[top]) top = v;
    const float most = z[top];
    double sum = 0.0;
    for (int64_t v = 0; v < n; v++) sum += expf(z[v] - most);
    *lse = most + (float)log(sum);
    return top;
}

/* For `requests` chains of steps[b] depths each (rows = their sum, request by request): h [rows, hidden] bf16, the
 * trajectories; roots [requests]. Writes the raw head logits [rows, vocab] fp32, each depth's token and running
 * score [rows]. Returns 0, -1 without memory, or 1 + b for the first request b whose root (or a drafted token:
 * a d2t entry) is not a target token. */
int draft_chains(const ChainHead *h, const uint16_t *hidden, int64_t requests, const int64_t *steps,
                 const int64_t *roots, float *logits, int64_t *tokens, float *scores, int threads) {
    int64_t rows = 0;
    for (int64_t b = 0; b < requests; b++) rows += steps[b];
    if (rows == 0) return 0;
    const int64_t k = h->hidden, groups = k / GROUP, vocab = h->vocab;
    int8_t *xq = malloc((size_t)(rows * k));
    float *dx = malloc(sizeof(float) * (size_t)(rows * groups)), *sx = malloc(sizeof(float) * (size_t)(rows * groups));
    const int team = (int)(requests < threads ? requests : threads);
    float *z = malloc(sizeof(float) * (size_t)(vocab * team)); /* a row of scratch per thread of the team */
    int status = 0;
    if (!xq || !dx || !sx || !z) {
        status = -1;
    } else {
        quantize_activations(hidden, rows, k, xq, dx, sx);
        vnni_gemm(h->codes, h->scales, h->mins, (int)h->bits, vocab, k, xq, dx, sx, rows, logits, threads);
        int64_t *first = malloc(sizeof(int64_t) * (size_t)requests);
        if (!first) {
            status = -1;
        } else {
            for (int64_t b = 0, at = 0; b < requests; at += steps[b++]) first[b] = at;
#pragma omp parallel for schedule(static) num_threads(team) if (team > 1)
            for (int64_t b = 0; b < requests; b++) {
                float *zb = z + vocab * omp_get_thread_num();
                int64_t token = roots[b];
                float score = 1.0f;
                for (int64_t s = 0; s < steps[b]; s++) {
                    const int64_t row = first[b] + s;
                    if (token < 0 || token >= h->target_vocab) {
#pragma omp critical
                        status = status > 0 && status <= b ? status : (int)(1 + b);
                        break;
                    }
                    memcpy(zb, logits + row * vocab, sizeof(float) * (size_t)vocab);
                    if (h->projected) add_token_info(h, token, zb);
                    float lse;
                    const int64_t top = top_and_logsumexp(zb, vocab, &lse);
                    score *= expf(zb[top] - lse);
                    token = h->d2t ? h->d2t[top] : top;
                    tokens[row] = token, scores[row] = score;
                }
            }
            free(first);
        }
    }
    free(xq), free(dx), free(sx), free(z);
    return status;
}
