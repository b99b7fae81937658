/* Lyanna's native drafting (draft_native.c): its input fusion and its width-1 draft chains, for the drafter's own
 * calls (lyanna_kernels/draft_native.py) and for the speculative rounds that run it beside the target (spec_rounds.c). */
#ifndef LYANNA_DRAFT_NATIVE_H
#define LYANNA_DRAFT_NATIVE_H
#include <stdint.h>

typedef struct {
    const uint16_t *hidden_norm, *embed_norm; /* [hidden] bf16 norm weights */
    const uint16_t *embed;                    /* [vocab, hidden] bf16: the token embeddings */
    int64_t vocab, hidden;
    float eps;
    const uint8_t *codes; /* W_fuse [hidden, 2 hidden], interleaved (vnni.c), with its scales and mins */
    const uint16_t *scales, *mins;
    int64_t bits;
} DraftFuse;

typedef struct {
    const uint8_t *codes; /* the drafter's LM head [vocab, hidden], interleaved (vnni.c), with its scales, mins */
    const uint16_t *scales, *mins;
    int64_t bits, vocab, hidden;
    const float *projected; /* [target_vocab, rank] W_E W1, or NULL: no token information */
    const float *gram;      /* [rank, rank] */
    const float *w2;        /* [rank, vocab], the norm's weight folded in */
    int64_t rank, target_vocab;
    float eps;
    const int64_t *d2t; /* [vocab] target token of each head row, or NULL: row i is token i */
} ChainHead;

/* out = RMSNorm(x) * w in bf16, as engines/model.py's RMSNorm computes it for bf16 rows. */
void norm_bf16(const uint16_t *x, const uint16_t *w, int64_t n, float eps, uint16_t *out);

int draft_fuse_rows(const DraftFuse *f, const uint16_t *h, const int64_t *tokens, int64_t rows, float *x,
                    int threads);
int draft_chains(const ChainHead *h, const uint16_t *hidden, int64_t requests, const int64_t *steps,
                 const int64_t *roots, float *logits, int64_t *tokens, float *scores, int threads);

#endif
