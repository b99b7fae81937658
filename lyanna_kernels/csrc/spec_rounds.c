/* Rounds of Lyanna's width-1 speculation beside the fused decoder, several in one call (lyanna_kernels/spec_rounds.py).
 *
 * A round of a sequence whose last token (the root, not yet computed) sits at position T - 1:
 *   draft:   the trajectory h_1 = the drafter's output at T - 2 (`last_out`), h_i = norm(layer(h_{i-1})) at
 *            position T - 2 + i (its keys in the sequence's scratch blocks past its context), then the chain of
 *            `depth` tokens over it (draft_chains: the hot-vocabulary head and token-info sampling);
 *   verify:  the target's layers over [root, d_1 .. d_depth] as a chain at T - 1 .., its final norm, LM head and
 *            every row's argmax (what decoder_greedy computes for such a batch);
 *   accept:  the drafts the argmax confirms in order, then the bonus token (the argmax after them): a + 1 tokens;
 *   catch up: the drafter's layer over fuse(H_j, E(t_{j+1})) at the a + 1 positions just committed (draft_fuse_rows,
 *            the target's normed rows rounded to bf16 as H_j), its keys in the target's blocks, the last row's norm
 *            the next round's h_1.
 * Every sequence of the call runs each phase in one batch, and each row is computed as the engine's step-by-step
 * path computes it (LyannaDrafter's catch-up and trajectories through the fused layer, DraftChains, the fused
 * decoder's argmax rows), but for the drafter's output norm, whose sum runs in another order than PyTorch's (a
 * draft may then differ where two tokens nearly tie), and for Algorithm 2's re-sampled trees, which chains of width 1
 * do not merge here: greedy answers are the target's, whatever the drafts. A sequence stops drafting when its
 * next round would write past the `rooms[b]` positions it was granted from T - 1 on. */
#include <stdlib.h>
#include <time.h>

#include "integer_dot.h"
#include "decoder.h"
#include "draft_native.h"

typedef struct {
    const Decoder *target; /* the model's layers and final norm (one rank) over the engine's KV cache */
    const Head *head;      /* its LM head and token embeddings */
    const Decoder *draft;  /* the drafter's layer over its own cache, addressed by the target's block tables */
    const DraftFuse *fuse;
    const ChainHead *chain;
    const uint16_t *norm; /* [hidden] bf16: the drafter's output norm */
    float eps;
    int64_t scratch_first, scratch_per_seq; /* sequence b's scratch blocks: scratch_first + b * scratch_per_seq .. */
} Rounds;

/* Seconds spent in each phase of the rounds since start: the trajectory, the chains, the target's forward, its LM
 * head and argmax, acceptance, the drafter's catch-up (spec_rounds_profile). */
enum { ROUND_TRAJECTORY, ROUND_CHAINS, ROUND_FORWARD, ROUND_HEAD, ROUND_ACCEPT, ROUND_CATCH_UP, ROUND_PHASES };
static double round_seconds[ROUND_PHASES];

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Adds `round_seconds` to out [ROUND_PHASES]; returns how many phases there are. */
int spec_rounds_profile(double *out) {
    for (int i = 0; i < ROUND_PHASES; i++) out[i] += round_seconds[i];
    return ROUND_PHASES;
}

static inline void lap(int phase, double *mark) {
    const double t = now_seconds();
    round_seconds[phase] += t - *mark;
    *mark = t;
}

/* The buffers of a call. */
typedef struct {
    float *x, *logits, *chain_logits, *scores;
    uint16_t *xb, *traj, *rows;
    int8_t *xq;
    float *dx, *sx;
    int64_t *positions, *slots, *argmax, *drafts, *steps, *roots, *next, *lengths, *active;
    int32_t *query_start, *seq_lens, *parents, *traj_tables;
} Buffers;

static void free_buffers(Buffers *f) {
    void *all[] = {f->x,     f->logits,    f->chain_logits, f->scores,    f->xb,        f->traj,     f->rows,
                   f->xq,    f->dx,        f->sx,           f->positions, f->slots,     f->argmax,   f->drafts,
                   f->steps, f->roots,     f->next,         f->lengths,   f->active,    f->query_start,
                   f->seq_lens, f->parents, f->traj_tables};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++) free(all[i]);
}

static int alloc_buffers(Buffers *f, int64_t seqs, int64_t depth, int64_t H, int64_t V, int64_t DV, int64_t width) {
    const int64_t rows = seqs * (depth + 1), chains = seqs * depth;
    memset(f, 0, sizeof(*f));
    f->x = malloc(sizeof(float) * rows * H);
    f->logits = malloc(sizeof(float) * rows * V);
    f->chain_logits = malloc(sizeof(float) * chains * DV);
    f->scores = malloc(sizeof(float) * chains);
    f->xb = malloc(sizeof(uint16_t) * rows * H);
    f->traj = malloc(sizeof(uint16_t) * chains * H);
    f->rows = malloc(sizeof(uint16_t) * rows * H);
    f->xq = malloc(rows * 2 * H);
    f->dx = malloc(sizeof(float) * rows * 2 * H / GROUP);
    f->sx = malloc(sizeof(float) * rows * 2 * H / GROUP);
    f->positions = malloc(sizeof(int64_t) * rows);
    f->slots = malloc(sizeof(int64_t) * rows);
    f->argmax = malloc(sizeof(int64_t) * rows);
    f->drafts = malloc(sizeof(int64_t) * chains);
    f->steps = malloc(sizeof(int64_t) * 2 * seqs);
    f->roots = malloc(sizeof(int64_t) * seqs);
    f->next = malloc(sizeof(int64_t) * rows);
    f->lengths = malloc(sizeof(int64_t) * seqs);
    f->active = malloc(sizeof(int64_t) * seqs);
    f->query_start = malloc(sizeof(int32_t) * (seqs + 1));
    f->seq_lens = malloc(sizeof(int32_t) * seqs);
    f->parents = malloc(sizeof(int32_t) * rows);
    f->traj_tables = malloc(sizeof(int32_t) * seqs * width);
    return f->x && f->logits && f->chain_logits && f->scores && f->xb && f->traj && f->rows && f->xq && f->dx &&
           f->sx && f->positions && f->slots && f->argmax && f->drafts && f->steps && f->roots && f->next &&
           f->lengths && f->active && f->query_start && f->seq_lens && f->parents && f->traj_tables;
}

/* x [rows, H] fp32 -> bf16 rows, then the drafter's norm of each into out (bf16). */
static void draft_norm_rows(const Rounds *r, const float *x, int64_t H, uint16_t *tmp, uint16_t *out) {
    for (int64_t i = 0; i < H; i++) tmp[i] = float_to_bf16(x[i]);
    norm_bf16(tmp, r->norm, H, r->eps, out);
}

/* The slot of position p through a block table row. */
static inline int64_t slot_of(const int32_t *table, int64_t p, int64_t bs) { return (int64_t)table[p / bs] * bs + p % bs; }

/* The call's return value for decoder_forward's `c` in one of its phases (`base`: 100 the target's, 200 the drafter's). */
static inline int forward_code(int c, int base) { return c < 0 ? c : base + c; }

/* `rounds` rounds of `depth`-token chains for `seqs` sequences: roots[b] at position lengths[b] - 1, the drafter's
 * output at lengths[b] - 2 in last_out [seqs, hidden] bf16 (updated to the last committed position's), block tables
 * [seqs, table_width] (rows table_stride apart). A sequence runs no round past `rooms[b]` positions from its root nor
 * after it commits one of the `num_stops` tokens `stops`. Writes each sequence's committed tokens [seqs, rounds *
 * (depth + 1)] in order, the target's normed rows of their positions (bf16, [seqs, rounds * (depth + 1), hidden]),
 * the drafts each round accepted [seqs, rounds] (-1: the round did not run) and the tokens committed [seqs]. Returns
 * 0, -1 without memory, or 100 + a code of decoder_forward for the target's forward (200 +: the drafter's layer),
 * 300 where the chains or the fusion fail (a token outside the embeddings), 301 for scratch blocks too few. */
int spec_rounds(const Rounds *r, int64_t seqs, const int64_t *roots, const int64_t *lengths, const int64_t *rooms,
                const int32_t *tables, int64_t table_stride, int64_t table_width, uint16_t *last_out, int64_t depth,
                int64_t rounds, const int64_t *stops, int64_t num_stops, int threads, int64_t *tokens, uint16_t *hidden,
                int64_t *accepted, int64_t *committed) {
    const Decoder *t = r->target, *d = r->draft;
    const int64_t H = t->hidden, V = r->head->vocab, DV = r->chain->vocab, bs = t->block_size;
    const int64_t span = rounds * (depth + 1), traj_width = table_width + r->scratch_per_seq;
    if (depth < 1 || rounds < 1 || seqs < 1) return 0;
    Buffers f;
    int code = -1;
    if (!alloc_buffers(&f, seqs, depth, H, V, DV, traj_width)) goto done;
    code = 0;
    int64_t *stopped = f.steps + seqs; /* [seqs] 1: the sequence committed a stop token (alloc_buffers: 2 seqs) */
    for (int64_t b = 0; b < seqs; b++) {
        f.roots[b] = roots[b], f.lengths[b] = lengths[b], committed[b] = 0, stopped[b] = 0;
        for (int64_t k = 0; k < rounds; k++) accepted[b * rounds + k] = -1;
    }
    double mark = now_seconds();
    for (int64_t round = 0; round < rounds; round++) {
        int64_t A = 0;
        for (int64_t b = 0; b < seqs; b++)
            if (!stopped[b] && committed[b] + depth + 1 <= rooms[b]) f.active[A++] = b;
        if (A == 0) break;
        /* the trajectory: h_1 = last_out, then depth - 1 steps of the drafter's layer */
        for (int64_t i = 0; i < A; i++) memcpy(f.traj + i * depth * H, last_out + f.active[i] * H, sizeof(uint16_t) * H);
        for (int64_t i = 0; i < A; i++) {
            const int64_t b = f.active[i], own = (f.lengths[b] - 1 + bs - 1) / bs;
            int32_t *row = f.traj_tables + i * traj_width;
            if (depth > 1 && (f.lengths[b] - 3 + depth) / bs >= own + r->scratch_per_seq) {
                code = 301;
                goto done;
            }
            memcpy(row, tables + b * table_stride, sizeof(int32_t) * own);
            for (int64_t k = 0; k < r->scratch_per_seq; k++) row[own + k] = (int32_t)(r->scratch_first + b * r->scratch_per_seq + k);
            for (int64_t k = own + r->scratch_per_seq; k < traj_width; k++) row[k] = row[own + r->scratch_per_seq - 1];
        }
        for (int64_t level = 1; level < depth; level++) {
            for (int64_t i = 0; i < A; i++) {
                const int64_t b = f.active[i], p = f.lengths[b] - 2 + level;
                const uint16_t *h = f.traj + (i * depth + level - 1) * H;
                for (int64_t k = 0; k < H; k++) f.x[i * H + k] = bf16_to_float(h[k]);
                f.positions[i] = p, f.slots[i] = slot_of(f.traj_tables + i * traj_width, p, bs);
                f.query_start[i] = (int32_t)i, f.seq_lens[i] = (int32_t)(p + 1), f.parents[i] = -1;
            }
            f.query_start[A] = (int32_t)A;
            Batch batch = {A, A, traj_width, traj_width, 0, f.positions, f.slots, f.query_start, f.seq_lens,
                           f.traj_tables, f.parents, NULL};
            const int c = decoder_forward(d, &batch, f.x, threads);
            if (c) {
                code = forward_code(c, 200);
                goto done;
            }
            for (int64_t i = 0; i < A; i++) draft_norm_rows(r, f.x + i * H, H, f.xb, f.traj + (i * depth + level) * H);
        }
        lap(ROUND_TRAJECTORY, &mark);
        /* the chains */
        for (int64_t i = 0; i < A; i++) f.steps[i] = depth, f.next[i] = f.roots[f.active[i]];
        int c = draft_chains(r->chain, f.traj, A, f.steps, f.next, f.chain_logits, f.drafts, f.scores, threads);
        if (c) {
            code = c < 0 ? c : 300;
            goto done;
        }
        lap(ROUND_CHAINS, &mark);
        /* verification: [root, d_1 .. d_depth] a chain per sequence */
        const int64_t R = A * (depth + 1);
        for (int64_t i = 0; i < A; i++) {
            const int64_t b = f.active[i], T = f.lengths[b];
            const int32_t *table = tables + b * table_stride;
            f.query_start[i] = (int32_t)(i * (depth + 1)), f.seq_lens[i] = (int32_t)(T + depth);
            for (int64_t j = 0; j <= depth; j++) {
                const int64_t row = i * (depth + 1) + j, p = T - 1 + j;
                const int64_t token = j == 0 ? f.roots[b] : f.drafts[i * depth + j - 1];
                if (token < 0 || token >= r->head->embed_rows) {
                    code = 300;
                    goto done;
                }
                if (p / bs >= table_width) {
                    code = 100 + BAD_TABLE_WIDTH;
                    goto done;
                }
                f.positions[row] = p, f.slots[row] = slot_of(table, p, bs), f.parents[row] = (int32_t)(j - 1);
                float *x = f.x + row * H;
                if (r->head->embed_bf16)
                    for (int64_t k = 0; k < H; k++) x[k] = bf16_to_float(((const uint16_t *)r->head->embed)[token * H + k]);
                else
                    memcpy(x, (const float *)r->head->embed + token * H, sizeof(float) * H);
            }
        }
        f.query_start[A] = (int32_t)R;
        /* the sequences' own rows of the block tables: the batch reads sequence i's row at i * stride */
        int32_t *verify_tables = f.traj_tables;
        for (int64_t i = 0; i < A; i++)
            memcpy(verify_tables + i * traj_width, tables + f.active[i] * table_stride, sizeof(int32_t) * table_width);
        Batch verify = {R, A, traj_width, table_width, 0, f.positions, f.slots, f.query_start, f.seq_lens,
                        verify_tables, f.parents, NULL};
        c = decoder_forward(t, &verify, f.x, threads);
        if (c) {
            code = forward_code(c, 100);
            goto done;
        }
        lap(ROUND_FORWARD, &mark);
        for (int64_t i = 0; i < R * H; i++) f.xb[i] = float_to_bf16(f.x[i]);
        quantize_activations(f.xb, R, H, f.xq, f.dx, f.sx);
        vnni_gemm(r->head->codes, r->head->scales, r->head->mins, (int)r->head->bits, V, H, f.xq, f.dx, f.sx, R,
                  f.logits, threads);
        row_argmax(f.logits, R, V, f.argmax, threads);
        lap(ROUND_HEAD, &mark);
        /* acceptance, and the committed rows for the drafter's catch-up */
        int64_t C = 0;
        for (int64_t i = 0; i < A; i++) {
            const int64_t b = f.active[i], row0 = i * (depth + 1), T = f.lengths[b];
            int64_t a = 0;
            while (a < depth && f.argmax[row0 + a] == f.drafts[i * depth + a]) a++;
            accepted[b * rounds + round] = a;
            f.query_start[i] = (int32_t)C, f.seq_lens[i] = (int32_t)(T + a);
            for (int64_t j = 0; j <= a; j++) {
                const int64_t token = j < a ? f.drafts[i * depth + j] : f.argmax[row0 + a];
                const int64_t at = committed[b] + j;
                tokens[b * span + at] = token;
                memcpy(hidden + (b * span + at) * H, f.xb + (row0 + j) * H, sizeof(uint16_t) * H);
                memcpy(f.rows + (C + j) * H, f.xb + (row0 + j) * H, sizeof(uint16_t) * H);
                f.next[C + j] = token;
                for (int64_t s = 0; s < num_stops; s++) stopped[b] |= token == stops[s];
                f.positions[C + j] = T - 1 + j, f.slots[C + j] = slot_of(tables + b * table_stride, T - 1 + j, bs);
                f.parents[C + j] = (int32_t)(j - 1);
            }
            C += a + 1, committed[b] += a + 1;
            f.lengths[b] = T + a + 1, f.roots[b] = f.argmax[row0 + a];
        }
        f.query_start[A] = (int32_t)C;
        lap(ROUND_ACCEPT, &mark);
        /* the drafter catches up over the committed positions */
        c = draft_fuse_rows(r->fuse, f.rows, f.next, C, f.x, threads);
        if (c) {
            code = c < 0 ? c : 300;
            goto done;
        }
        Batch catch_up = {C, A, traj_width, table_width, 0, f.positions, f.slots, f.query_start, f.seq_lens,
                          verify_tables, f.parents, NULL};
        c = decoder_forward(d, &catch_up, f.x, threads);
        if (c) {
            code = forward_code(c, 200);
            goto done;
        }
        for (int64_t i = 0; i < A; i++) {
            const int64_t last = f.query_start[i + 1] - 1;
            draft_norm_rows(r, f.x + last * H, H, f.xb, last_out + f.active[i] * H);
        }
        lap(ROUND_CATCH_UP, &mark);
    }
done:
    free_buffers(&f);
    return code;
}
