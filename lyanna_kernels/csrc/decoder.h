/* The fused decoder's C view (decoder.c): a model's layers over a paged cache, a step's batch of new tokens, and
 * the LM head greedy calls take; shared by the calls that run the decoder (decoder.c, spec_rounds.c). */
#ifndef LYANNA_DECODER_H
#define LYANNA_DECODER_H
#include <stdint.h>

/* A weight-only quantized [n, k] matrix in the row layout (int4_gemm.c) or interleaved (vnni.c). */
typedef struct {
    const void *codes;      /* rows: q4 [n, k / 2] uint8 (pack_q4), q8 [n, k] int8; interleaved: vnni.c */
    const uint16_t *scales; /* [n, k / 32] fp16 (interleaved: per block of 16 rows and group) */
    const uint16_t *mins;   /* [n, k / 32] fp16 (w = q * d + m); NULL for a q8 weight in the row layout */
    int64_t n, k, bits;     /* bits: 4 or 8 */
    int64_t interleaved;    /* 1: vnni.c's layout (16 output rows interleaved) */
} QWeight;

typedef struct {
    const float *input_norm, *post_norm; /* [hidden] fp32 */
    QWeight qkv, o, gate_up, down;       /* qkv rows: q heads, k heads, v heads; gate_up rows: gate, up */
    void *k_cache, *v_cache;             /* [slots, kv_heads, head_dim] fp32, bf16 or int8 codes */
    const float *qkv_bias;               /* [(num_heads + 2 num_kv_heads) head_dim] fp32, or NULL for none */
    uint16_t *k_scale, *v_scale;         /* [slots, kv_heads, head_dim / 32] bf16: an int8 cache's scales (code * scale) */
} Layer;

/* The shared-memory all-reduce of one rank (engines/shm_all_reduce.py's segment and counters). */
typedef struct {
    int64_t *seqs;        /* [world] the call each rank last published (shared) */
    const int64_t *pids;  /* [world] each rank's process (shared) */
    uint8_t *data;        /* [2 * world][slot_bytes]: two sets of slots, alternating between calls (shared) */
    int64_t *seq;         /* this rank's call counter (its Python side's too) */
    double *wait_seconds; /* time spent waiting for the other ranks, added to */
    int64_t rank, world, slot_bytes;
    double timeout_s;     /* a rank silent for this long fails the call */
} Reducer;

typedef struct {
    int64_t num_layers, hidden, intermediate, num_heads, num_kv_heads, head_dim, block_size;
    int64_t cache_bf16; /* 1: the cache holds bf16, 0: fp32 */
    float eps, scale;   /* RMSNorm epsilon; attention's 1 / sqrt(head_dim) */
    const float *cos, *sin; /* [max_positions, head_dim] rotary tables (rotate-half layout) */
    const Layer *layers;
    int64_t max_positions, num_slots; /* rows of cos and sin; slots of each layer's cache */
    const Reducer *reduce; /* a tensor-parallel rank's sums (intermediate and heads are this rank's); NULL: one rank */
    const float *final_norm; /* [hidden] fp32: the model's final norm, applied to the last layer's output; NULL: none */
    int64_t prompt_bf16;     /* 1: prompt runs' projections in bf16 tiles where AMX runs (amx_bf16_blocks) */
    int64_t split_swiglu;    /* 1: those rows' gate_up and SwiGLU in two passes, not one (the one pass's reference) */
    int64_t cache_int8;      /* 1: the cache holds int8 codes and the layers' k_scale / v_scale (head_dim a multiple of
                              * 32; cache_bf16 is 0) */
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
    const int32_t *runs;         /* [B] how many lead new tokens of the sequence are a causal run of prompt tokens
                                  * (parents i - 1), which attend as a run (attend_run_rows); NULL: none */
} Batch;

/* The LM head in vnni_gemm's interleaved layout and the token embeddings, for decoder_greedy. */
typedef struct {
    const uint8_t *codes;
    const uint16_t *scales, *mins; /* fp16 */
    int64_t bits, vocab;           /* the head's output rows */
    const void *embed;             /* [embed_rows, hidden]: bf16 where embed_bf16, else fp32 */
    int64_t embed_rows, embed_bf16;
} Head;

/* What check_batch finds wrong, or what stopped the all-reduce (decoder_forward's return value). */
enum { BAD_QUERY_START = 1, BAD_SEQ_LEN, BAD_TABLE_WIDTH, BAD_BLOCK, BAD_POSITION, BAD_SLOT, BAD_PARENT, BAD_RUN,
       RANK_DIED, RANK_TIMEOUT, BAD_TOKEN };

/* The layers over a batch's new tokens x [T, hidden] fp32, in place (decoder.c). */
int decoder_forward(const Decoder *m, Batch *b, float *x, int threads);

/* int4_gemm.c, vnni.c, argmax.c: an LM head's activations, its product and each row's argmax. */
void quantize_activations(const uint16_t *x, int64_t rows, int64_t k, int8_t *xq, float *dx, float *sx);
void vnni_gemm(const uint8_t *codes, const uint16_t *d, const uint16_t *m, int bits, int64_t n, int64_t k,
               const int8_t *xq, const float *dx, const float *sx, int64_t rows, float *out, int threads);
void row_argmax(const float *x, int64_t rows, int64_t n, int64_t *out, int threads);

#endif
