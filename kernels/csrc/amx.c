/* Many-row kernels on CPUs with AMX (Advanced Matrix Extensions: tile registers and tile dot products).
 *
 * Projections (amx_blocks): the same function as vnni.c's, bit for bit. For 16 activation rows at a time
 * one tile product (TDPBSUD: signed int8 activations x unsigned weight codes, exact int32 sums) computes a
 * group of 32 inputs for 16 output rows and 16 activation rows; vnni.c's weight layout is already the
 * tile's B layout (4 consecutive inputs of 16 rows per 64 bytes; 4-bit codes are unpacked once per block
 * of 16 rows and call). Each group's sums are then scaled and accumulated in fp32 with exactly vnni.c's
 * operations and order, so a row's output does not depend on whether it went through a tile or vnni.c.
 * Rows past the last whole tile of 16 go through vnni.c.
 *
 * Prompt rows' projections in bf16 (amx_bf16_weights, amx_bf16_blocks): the per-group rescale above costs
 * several vector operations per tile product, so a long prompt ran the tiles at a fraction of their rate.
 * Prompt tokens instead enter as bf16 rows (amx_bf16_row, amx_swiglu_row: 16-row tiles laid out per group of
 * 32 inputs) against the weight dequantized to bf16 a panel of blocks at a time (code * d + m, rounded to
 * nearest even; a panel of ~1 MiB stays in L2 while every pair of row tiles passes over it), with fp32 sums
 * over the whole row in the tiles (TDPBF16PS): more accurate than int8 activation blocks. Which rows take
 * this path is decided by what they are (decoder.c), so each row's result still does not depend on its batch.
 *
 * Attention of a causal run of new tokens (a prefill chunk) over its paged keys (amx_attend_run):
 * flash-style, 16 queries of one head at a time against 64 keys at a time, with an online softmax in
 * fp32. Q, K, P and V enter the tile products in bf16 (as PyTorch's CPU flash attention does for a bf16
 * cache); scores, the softmax and the accumulators are fp32. Each sequence's keys of one KV head are laid
 * out once per layer for the tiles (amx_pack_keys): K as dim pairs x keys, V as key pairs x dims.
 *
 * Everything here needs AMX-TILE, AMX-INT8, AMX-BF16 and AVX512-BF16, and Linux's permission to use the
 * tile data (arch_prctl ARCH_REQ_XCOMP_PERM); `amx_configure` checks both at run time. Compilers without
 * AMX support build stubs, and `amx_configure` then reports AMX as off.
 */
#include <omp.h>
#include <stdlib.h>

#include "integer_dot.h"

#if defined(__x86_64__) && ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#define HAVE_AMX 1
#else
#define HAVE_AMX 0
#endif

static int amx_on = 0; /* set by amx_configure */

int amx_active(void) { return amx_on; }

#if HAVE_AMX
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_FN __attribute__((target("amx-tile,amx-int8,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,f16c,fma")))
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

static int amx_usable(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    const int tiles = (d >> 24) & 1, int8 = (d >> 25) & 1, bf16 = (d >> 22) & 1;
    if (!tiles || !int8 || !bf16) return 0;
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !((a >> 5) & 1)) return 0; /* AVX512-BF16 */
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
        !__builtin_cpu_supports("avx512vnni"))
        return 0;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

/* Turn the AMX kernels on (want != 0) where this CPU and OS run them, or off; returns whether they are on. */
int amx_configure(int want) {
    static int usable = -1;
    if (usable < 0) usable = amx_usable();
    amx_on = want && usable;
    return amx_on;
}

/* Tiles 0-3: int32 sums [16 rows x 16 outputs]; 4 and 6: activations [16 rows x 32 int8]; 5 and 7: weight
 * codes [8 rows x 64 bytes] (32 inputs x 16 outputs). */
static AMX_FN void config_int8(void) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = t >= 4 && t % 2 ? 8 : 16;
        cfg.colsb[t] = t >= 4 && t % 2 == 0 ? 32 : 64;
    }
    _tile_loadconfig(&cfg);
}

/* Every tile [16 rows x 64 bytes] (bf16: 16 x 32 values; fp32: 16 x 16). */
static AMX_FN void config_bf16(void) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* acc[r] += group g's sums (tile rows) scaled as vnni.c's block_rows does, for 16 activation rows. */
static inline AMX_FN __attribute__((always_inline)) void scale_group(
    const int32_t (*sums)[16], __m512 scale, __m512 minimum, const float *dx, const float *sx, int64_t groups,
    __m512 *acc) {
    for (int r = 0; r < 16; r++) {
        const __m512 s = _mm512_mul_ps(scale, _mm512_set1_ps(dx[r * groups]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512((const void *)sums[r])), s, acc[r]);
        acc[r] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(sx[r * groups]), acc[r]);
    }
}

/* Blocks [b0, b1) of out [rows, n] fp32 = activations @ W.T for a weight in vnni.c's layout: what
 * vnni_blocks computes, bit for bit (whole tiles of 16 rows here, the rest through it). */
AMX_FN void amx_blocks(const uint8_t *codes, const uint16_t *d, const uint16_t *m, int bits, int64_t n, int64_t k,
                       const int8_t *xq, const float *dx, const float *sx, int64_t rows, float *out, int64_t b0,
                       int64_t b1) {
    const int64_t groups = k / GROUP, block_bytes = 16 * k * bits / 8, whole = rows / 16 * 16;
    if (whole == 0 || b0 >= b1) {
        vnni_blocks(codes, d, m, bits, n, k, xq, dx, sx, rows, out, b0, b1);
        return;
    }
    uint8_t *unpacked = NULL;
    if (bits == 4 && posix_memalign((void **)&unpacked, 64, (size_t)groups * 512)) {
        vnni_blocks(codes, d, m, bits, n, k, xq, dx, sx, rows, out, b0, b1);
        return;
    }
    config_int8();
    int32_t sums[4][16][16] __attribute__((aligned(64)));
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int64_t b = b0; b < b1; b++) {
        const uint8_t *w = codes + b * block_bytes;
        if (bits == 4) { /* group g's 4-input steps 2p and 2p + 1 are the low and high nibbles of its 64 bytes p */
            for (int64_t g = 0; g < groups; g++)
                for (int p = 0; p < 4; p++) {
                    const __m512i packed = _mm512_loadu_si512((const void *)(w + g * 256 + 64 * p));
                    _mm512_store_si512((void *)(unpacked + g * 512 + 128 * p), _mm512_and_si512(packed, low));
                    _mm512_store_si512((void *)(unpacked + g * 512 + 128 * p + 64),
                                       _mm512_and_si512(_mm512_srli_epi16(packed, 4), low));
                }
            w = unpacked;
        }
        const uint16_t *bd = d + b * groups * 16, *bm = m + b * groups * 16;
        for (int64_t r0 = 0; r0 < whole; r0 += 16) {
            __m512 acc[16];
            for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
            const int8_t *x = xq + r0 * k;
            const float *rdx = dx + r0 * groups, *rsx = sx + r0 * groups;
            /* Pairs of groups in flight, software-pipelined: pair p's products sit in tiles 0-1 (p even) or 2-3 (odd)
             * and its sums in sums[0-1] or [2-3]; while pair p's sums are scaled, pair p + 1's tiles have been
             * stored (an iteration earlier than their use) and pair p + 2's products run. */
#define GROUP_SUMS(J, A, B, G)                                                                               \
    do {                                                                                                     \
        _tile_zero(J);                                                                                       \
        _tile_loadd(A, x + (G) * GROUP, k);                                                                  \
        _tile_loadd(B, w + (G) * 512, 64);                                                                   \
        _tile_dpbsud(J, A, B);                                                                               \
    } while (0)
#define ISSUE2(J0, J1, P)                                                                                    \
    do {                                                                                                     \
        GROUP_SUMS(J0, 4, 5, 2 * (P));                                                                       \
        GROUP_SUMS(J1, 6, 7, 2 * (P) + 1);                                                                   \
    } while (0)
#define STORE2(J0, J1)                                                                                       \
    do {                                                                                                     \
        _tile_stored(J0, sums[J0], 64);                                                                      \
        _tile_stored(J1, sums[J1], 64);                                                                      \
    } while (0)
#define SCALE(J, G)                                                                                          \
    scale_group((const int32_t (*)[16])sums[J],                                                              \
                _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(bd + (G) * 16))),                       \
                _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(bm + (G) * 16))), rdx + (G), rsx + (G),     \
                groups, acc)
            const int64_t pairs = groups / 2;
            if (pairs > 0) {
                ISSUE2(0, 1, 0);
                if (pairs > 1) ISSUE2(2, 3, 1);
                STORE2(0, 1);
            }
            for (int64_t p = 0; p < pairs; p += 2) {
                if (p + 1 < pairs) STORE2(2, 3);
                if (p + 2 < pairs) ISSUE2(0, 1, p + 2);
                SCALE(0, 2 * p);
                SCALE(1, 2 * p + 1);
                if (p + 1 >= pairs) break;
                if (p + 2 < pairs) STORE2(0, 1);
                if (p + 3 < pairs) ISSUE2(2, 3, p + 3);
                SCALE(2, 2 * p + 2);
                SCALE(3, 2 * p + 3);
            }
            if (groups % 2) {
                GROUP_SUMS(0, 4, 5, groups - 1);
                _tile_stored(0, sums[0], 64);
                SCALE(0, groups - 1);
            }
#undef ISSUE2
#undef STORE2
#undef GROUP_SUMS
#undef SCALE
            for (int r = 0; r < 16; r++) _mm512_storeu_ps(out + (r0 + r) * n + 16 * b, acc[r]);
        }
    }
    _tile_release();
    free(unpacked);
    if (whole < rows)
        vnni_blocks(codes, d, m, bits, n, k, xq + whole * k, dx + whole * groups, sx + whole * groups, rows - whole,
                    out + whole * n, b0, b1);
}

/* Weight blocks [b0, b1) of an interleaved weight (vnni.c's layout) as bf16 tiles for amx_bf16_blocks: wb holds,
 * per block and group of 32 inputs, [16 input pairs][16 outputs][2] bf16 (TDPBF16PS's B layout), each value
 * code * d + m rounded to nearest even. In vnni.c's layout each 4-input step of a block is 16 dwords, dword r
 * holding inputs 4s .. 4s + 3 of output row r: its bytes 0-1 are tile row 2s, bytes 2-3 tile row 2s + 1. */
AMX_FN void amx_bf16_weights(const uint8_t *codes, const uint16_t *d, const uint16_t *m, int bits, int64_t k, int64_t b0,
                             int64_t b1, uint16_t *wb) {
    const int64_t groups = k / GROUP, block_bytes = 16 * k * bits / 8;
    const __m512i low = _mm512_set1_epi8(0x0f), byte = _mm512_set1_epi32(0xff);
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                           21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int64_t b = b0; b < b1; b++) {
        const uint8_t *w = codes + b * block_bytes;
        for (int64_t g = 0; g < groups; g++) {
            const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + (b * groups + g) * 16)));
            const __m512 minimum = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(m + (b * groups + g) * 16)));
            uint16_t *tile = wb + ((b - b0) * groups + g) * 512;
            for (int s = 0; s < 8; s++) {
                __m512i step;
                if (bits == 4) { /* steps 2p and 2p + 1: the low and high nibbles of the group's 64 bytes p */
                    const __m512i packed = _mm512_loadu_si512((const void *)(w + g * 256 + 64 * (s / 2)));
                    step = s % 2 ? _mm512_and_si512(_mm512_srli_epi16(packed, 4), low) : _mm512_and_si512(packed, low);
                } else {
                    step = _mm512_loadu_si512((const void *)(w + g * 512 + 64 * s));
                }
                __m512 v[4];
                for (int i = 0; i < 4; i++) {
                    const __m512i c = _mm512_and_si512(_mm512_srli_epi32(step, 8 * i), byte);
                    v[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c), scale, minimum);
                }
                _mm512_store_si512((void *)(tile + 64 * s), _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(v[1], v[0])));
                _mm512_store_si512((void *)(tile + 64 * s + 32),
                                   _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(v[3], v[2])));
            }
        }
    }
}

/* Row t of x [.., k] fp32 rounded to bf16 (to nearest even) into the tile layout amx_bf16_blocks reads: per 16
 * rows and group of 32 inputs, a [16 rows][32] tile of 1 KiB (row t, group g at xb + (t / 16) 16 k + 512 g +
 * 32 (t % 16)). */
AMX_FN void amx_bf16_row(const float *x, int64_t k, int64_t t, uint16_t *xb) {
    uint16_t *row = xb + (t / 16) * 16 * k + (t % 16) * 32;
    for (int64_t g = 0; g < k / GROUP; g++)
        _mm512_store_si512((void *)(row + 512 * g),
                           (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 32 * g + 16), _mm512_loadu_ps(x + 32 * g)));
}

/* 2^x, about 1.3 ulp (a minimax polynomial on [-0.5, 0.5]); x = -inf gives NaN, which callers mask to 0. */
static inline AMX_FN __m512 exp2_16(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n); /* [-0.5, 0.5] */
    __m512 p = _mm512_set1_ps(1.326697994954884e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.675469249486923e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550742521882057e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402212172746658e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931469440460205e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000001192092896f));
    return _mm512_scalef_ps(p, n);
}

/* SwiGLU = gate sigmoid(gate) up of 16 values (sigmoid through 2^x and a refined reciprocal: about fp32's accuracy
 * before the rounding to bf16). */
static inline AMX_FN __m512 swiglu_16(__m512 gate, __m512 up) {
    const __m512 one = _mm512_set1_ps(1.0f), two = _mm512_set1_ps(2.0f), minus_log2e = _mm512_set1_ps(-1.44269504088896341f);
    const __m512 x = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(gate, minus_log2e), _mm512_set1_ps(-150.0f)),
                                   _mm512_set1_ps(126.0f)); /* 1 + 2^x stays finite */
    const __m512 d = _mm512_add_ps(one, exp2_16(x)); /* 1 + e^-gate */
    __m512 inv = _mm512_rcp14_ps(d);
    inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(d, inv, two)); /* one Newton step */
    return _mm512_mul_ps(_mm512_mul_ps(gate, inv), up);
}

/* Row t of SwiGLU(gate, up) (gate_up: the row's gate then up, inter values each) in amx_bf16_row's layout, from fp32
 * sums. */
AMX_FN void amx_swiglu_row(const float *gate_up, int64_t inter, int64_t t, uint16_t *xb) {
    uint16_t *row = xb + (t / 16) * 16 * inter + (t % 16) * 32;
    for (int64_t g = 0; g < inter / GROUP; g++) {
        const __m512 y0 = swiglu_16(_mm512_loadu_ps(gate_up + 32 * g), _mm512_loadu_ps(gate_up + inter + 32 * g));
        const __m512 y1 = swiglu_16(_mm512_loadu_ps(gate_up + 32 * g + 16), _mm512_loadu_ps(gate_up + inter + 32 * g + 16));
        _mm512_store_si512((void *)(row + 512 * g), (__m512i)_mm512_cvtne2ps_pbh(y1, y0));
    }
}

/* Tiles 0-3 = the fp32 sums over `groups` groups of 32 inputs of 16 rows x0 against block w0 (tile 0) and w1 (1),
 * and of 16 rows x1 against w0 (2) and w1 (3), rows and blocks as amx_bf16_row and amx_bf16_weights lay them out;
 * with `two` 0, w1 is not read and tiles 1 and 3 stay zero. */
static inline AMX_FN __attribute__((always_inline)) void bf16_tiles(const uint16_t *x0, const uint16_t *x1, const uint16_t *w0,
                                                                   const uint16_t *w1, int64_t groups, int two) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t g = 0; g < groups; g++) {
        _tile_loadd(4, x0 + g * 512, 64);
        _tile_loadd(6, w0 + g * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(5, x1 + g * 512, 64);
        _tile_dpbf16ps(2, 5, 6);
        if (two) {
            _tile_loadd(7, w1 + g * 512, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
}

/* Rows [r0, r1) of out [.., n] fp32, blocks [b0, b1) = x @ W.T for bf16 activations x in amx_bf16_row's layout
 * (whole tiles of 16 rows are read from r0 / 16: rows outside [r0, r1) are computed and dropped, and must be
 * readable up to a whole pair of tiles) and the blocks' bf16 tiles wb (amx_bf16_weights). Sums are fp32 in the
 * tiles over all of k; each row's result depends on its own activations only. Two tiles of rows at a time
 * (in L1) against every pair of blocks (wb, which should fit in L2). */
AMX_FN void amx_bf16_blocks(const uint16_t *wb, int64_t n, int64_t k, const uint16_t *x, int64_t r0, int64_t r1,
                            float *out, int64_t b0, int64_t b1) {
    const int64_t groups = k / GROUP;
    float part[4][16][16] __attribute__((aligned(64)));
    config_bf16();
    for (int64_t t0 = r0 / 16 * 16; t0 < r1; t0 += 32) {
        const uint16_t *x0 = x + t0 * k, *x1 = x0 + 16 * k;
        const int whole = t0 >= r0 && t0 + 32 <= r1;
        for (int64_t b = b0; b < b1; b += 2) {
            const int two = b + 1 < b1;
            const uint16_t *w0 = wb + (b - b0) * groups * 512, *w1 = w0 + groups * 512;
            bf16_tiles(x0, x1, w0, w1, groups, two);
            if (whole) {
                _tile_stored(0, out + t0 * n + 16 * b, 4 * n);
                _tile_stored(2, out + (t0 + 16) * n + 16 * b, 4 * n);
                if (two) {
                    _tile_stored(1, out + t0 * n + 16 * (b + 1), 4 * n);
                    _tile_stored(3, out + (t0 + 16) * n + 16 * (b + 1), 4 * n);
                }
                continue;
            }
            _tile_stored(0, part[0], 64);
            _tile_stored(1, part[1], 64);
            _tile_stored(2, part[2], 64);
            _tile_stored(3, part[3], 64);
            for (int64_t r = 0; r < 32; r++)
                if (t0 + r >= r0 && t0 + r < r1)
                    for (int j = 0; j <= two; j++)
                        memcpy(out + (t0 + r) * n + 16 * (b + j), part[2 * (r / 16) + j][r % 16], 64);
        }
    }
    _tile_release();
}

/* Rows [r0, r1) of SwiGLU(x @ W_gate.T, x @ W_up.T), output groups [p0, p1) of 32 values, into xo in amx_swiglu_row's
 * layout (rows of `inter` values), bit for bit what amx_bf16_blocks then amx_swiglu_row give: x as amx_bf16_blocks
 * reads it (whole pairs of tiles of 16 rows from r0 / 16, rows outside [r0, r1) computed and dropped); wb the gate
 * blocks 2 p0 .. 2 p1 then the up blocks 2 p0 .. 2 p1 of the same outputs, as amx_bf16_weights lays them out. Two
 * tiles of rows against a gate block and its up block at a time: their sums never leave L1 (the two passes wrote
 * and read all of them, 8 bytes a value, through memory). */
AMX_FN void amx_bf16_swiglu_blocks(const uint16_t *wb, int64_t k, const uint16_t *x, int64_t r0, int64_t r1,
                                   int64_t inter, int64_t p0, int64_t p1, uint16_t *xo) {
    const int64_t groups = k / GROUP, block = groups * 512, blocks = 2 * (p1 - p0);
    float part[4][16][16] __attribute__((aligned(64))); /* gate rows 0-15, up rows 0-15, gate rows 16-31, up 16-31 */
    config_bf16();
    for (int64_t t0 = r0 / 16 * 16; t0 < r1; t0 += 32) {
        const uint16_t *x0 = x + t0 * k, *x1 = x0 + 16 * k;
        for (int64_t j = 0; j < blocks; j++) {
            const uint16_t *gate = wb + j * block, *up = wb + (blocks + j) * block;
            bf16_tiles(x0, x1, gate, up, groups, 1);
            _tile_stored(0, part[0], 64);
            _tile_stored(1, part[1], 64);
            _tile_stored(2, part[2], 64);
            _tile_stored(3, part[3], 64);
            const int64_t column = 512 * (p0 + j / 2) + 16 * (j % 2); /* the block's 16 values in its group's tile rows */
            for (int64_t r = 0; r < 32; r++) {
                const int64_t t = t0 + r;
                if (t < r0 || t >= r1) continue;
                const __m512 y = swiglu_16(_mm512_load_ps(part[2 * (r / 16)][r % 16]), _mm512_load_ps(part[2 * (r / 16) + 1][r % 16]));
                _mm256_store_si256((__m256i *)(xo + (t / 16) * 16 * inter + column + 32 * (t % 16)), (__m256i)_mm512_cvtneps_pbh(y));
            }
        }
    }
    _tile_release();
}

/* r [16 rows][16 x 32 bits] becomes its transpose (a, b: scratch). */
static inline AMX_FN __attribute__((always_inline)) void transpose16(__m512i *r, __m512i *a, __m512i *b) {
    for (int k = 0; k < 8; k++) {
        a[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
        a[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
    }
    for (int k = 0; k < 4; k++) { /* b[4k + m], 128-bit lane L: column 4L + m of rows 4k..4k + 3 */
        b[4 * k] = _mm512_unpacklo_epi64(a[4 * k], a[4 * k + 2]);
        b[4 * k + 1] = _mm512_unpackhi_epi64(a[4 * k], a[4 * k + 2]);
        b[4 * k + 2] = _mm512_unpacklo_epi64(a[4 * k + 1], a[4 * k + 3]);
        b[4 * k + 3] = _mm512_unpackhi_epi64(a[4 * k + 1], a[4 * k + 3]);
    }
    for (int m = 0; m < 4; m++) {
        const __m512i s0 = _mm512_shuffle_i32x4(b[m], b[4 + m], 0x44), s1 = _mm512_shuffle_i32x4(b[8 + m], b[12 + m], 0x44);
        const __m512i s2 = _mm512_shuffle_i32x4(b[m], b[4 + m], 0xee), s3 = _mm512_shuffle_i32x4(b[8 + m], b[12 + m], 0xee);
        r[m] = _mm512_shuffle_i32x4(s0, s1, 0x88);
        r[4 + m] = _mm512_shuffle_i32x4(s0, s1, 0xdd);
        r[8 + m] = _mm512_shuffle_i32x4(s2, s3, 0x88);
        r[12 + m] = _mm512_shuffle_i32x4(s2, s3, 0xdd);
    }
}

#define PACK_AHEAD 16 /* keys whose rows amx_pack_keys requests ahead of laying them out */

static const uint16_t zero_row[128] = {0}; /* the values of padding keys (dim <= 128) */

/* Requests the rows of keys [from, to) (those below n) of KV heads [h0, h0 + heads) of `cache` (and their scales)
 * into L1, or into L2 where `to_l2`. */
static inline void prefetch_rows(const void *cache, const uint16_t *scale, const KVRows *kv, int64_t h0, int64_t heads,
                                 int64_t dim, const int64_t *slots, int64_t from, int64_t to, int64_t n, int to_l2) {
    const int64_t size = scale ? 1 : 2, bytes = heads * dim * size;
    for (int64_t j = from; j < to && j < n; j++) {
        const char *row = (const char *)cache + (slots[j] * kv->row + h0 * dim) * size;
        const char *scales = scale ? (const char *)(scale + (slots[j] * kv->kv_heads + h0) * (dim / 32)) : NULL;
        if (to_l2) {
            for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(row + b, _MM_HINT_T1);
            if (scales) _mm_prefetch(scales, _MM_HINT_T1);
        } else {
            for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(row + b, _MM_HINT_T0);
            if (scales) _mm_prefetch(scales, _MM_HINT_T0);
        }
    }
}

/* The row of one KV head at `slot` of `cache` (kv's K or V) as `dim` bf16 values: the cache's own row where it holds
 * bf16; for int8 codes, code * its group's scale rounded to nearest even, written to buf (dim a multiple of 32). */
static inline AMX_FN const uint16_t *bf16_row_of(const void *cache, const uint16_t *scale, const KVRows *kv,
                                                int64_t slot, int64_t kv_head, int64_t dim, uint16_t *buf) {
    const int64_t at = slot * kv->row + kv_head * dim;
    if (!scale) return (const uint16_t *)cache + at;
    const int8_t *codes = (const int8_t *)cache + at;
    const uint16_t *scales = scale + (slot * kv->kv_heads + kv_head) * (dim / 32);
    for (int64_t d = 0; d < dim; d += 32) {
        const __m512 s = _mm512_set1_ps(bf16_to_float(scales[d / 32]));
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(codes + d))));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(codes + d + 16))));
        _mm512_storeu_si512((void *)(buf + d), (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, s), _mm512_mul_ps(lo, s)));
    }
    return buf;
}

/* The K and V rows of keys [j0, j0 + 32) of one KV head as bf16 (bf16_row_of; int8 rows go to kbuf and vbuf,
 * [32][dim] each), keys n.. the zero row. */
static inline AMX_FN void key_rows(const KVRows *kv, int64_t kv_head, int64_t dim, const int64_t *slots, int64_t j0,
                                   int64_t n, uint16_t *kbuf, uint16_t *vbuf, const uint16_t **keys,
                                   const uint16_t **values) {
    for (int64_t j = 0; j < 32; j++) {
        if (j0 + j >= n) {
            keys[j] = values[j] = zero_row;
            continue;
        }
        keys[j] = bf16_row_of(kv->k, kv->k_scale, kv, slots[j0 + j], kv_head, dim, kbuf + j * dim);
        values[j] = bf16_row_of(kv->v, kv->v_scale, kv, slots[j0 + j], kv_head, dim, vbuf + j * dim);
    }
}

/* One sequence's keys and values 0..n of one KV head (slots[i]: the cache slot of key i) laid out for
 * amx_attend_run's tiles, keys n.. zero: kr [keys / 16][dim / 32][16][32] (a tile of 16 keys x 32 dims is 1 KiB in
 * a row), vt [keys / 32][dim][32] (V transposed per 32 keys). Keys [k0, k1) only, multiples of 32. */
AMX_FN void amx_pack_keys(const KVRows *kv, int64_t kv_head, int64_t dim, const int64_t *slots, int64_t n, uint16_t *kr,
                          uint16_t *vt, int64_t k0, int64_t k1) {
    /* The keys' rows are scattered over the cache's blocks, and cold: requested PACK_AHEAD keys ahead of their
     * use, they arrive while earlier keys are laid out (32 decodes attended in 8.9 against 11.9 ms a step). */
    const int64_t last = k1 < n ? k1 : n;
    uint16_t kbuf[32 * 128], vbuf[32 * 128]; /* int8 rows as bf16 */
    prefetch_rows(kv->k, kv->k_scale, kv, kv_head, 1, dim, slots, k0, k0 + PACK_AHEAD, last, 0);
    prefetch_rows(kv->v, kv->v_scale, kv, kv_head, 1, dim, slots, k0, k0 + PACK_AHEAD, last, 0);
    for (int64_t j0 = k0; j0 < k1; j0 += 32) {
        const uint16_t *keys[32], *values[32];
        const int64_t ahead = j0 + 32 + PACK_AHEAD < last ? j0 + 32 + PACK_AHEAD : last;
        prefetch_rows(kv->k, kv->k_scale, kv, kv_head, 1, dim, slots, j0 + PACK_AHEAD, ahead, last, 0);
        prefetch_rows(kv->v, kv->v_scale, kv, kv_head, 1, dim, slots, j0 + PACK_AHEAD, ahead, last, 0);
        key_rows(kv, kv_head, dim, slots, j0, n, kbuf, vbuf, keys, values);
        uint32_t *block = (uint32_t *)(vt + j0 * dim); /* [dim][16 key pairs]: key 2i in the low half of pair i */
        for (int64_t d0 = 0; d0 < dim; d0 += 16) {
            __m512i r[16], a[16], b[16];
            for (int i = 0; i < 16; i++) /* r[i]: dims d0.. of keys 2i and 2i + 1 as pairs */
                r[i] = _mm512_or_si512(
                    _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(values[2 * i] + d0))),
                    _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(values[2 * i + 1] + d0))), 16));
            transpose16(r, a, b);
            for (int i = 0; i < 16; i++) _mm512_storeu_si512((void *)(block + (d0 + i) * 16), r[i]);
        }
        for (int64_t j = j0; j < j0 + 32; j++) {
            uint16_t *tile = kr + (j / 16) * 16 * dim + (j % 16) * 32;
            for (int64_t h = 0; h < dim / 32; h++) memcpy(tile + h * 512, keys[j - j0] + 32 * h, 32 * sizeof(uint16_t));
        }
    }
}

/* S^T of key tile kt + T (16 keys x 16 queries): K rows (A: tile K) times Q^T (B: tile 4). */
#define S_TILE(T, K)                                                                                         \
    _tile_loadd(K, kr + (kt + (T)) * 16 * dim + 512 * h, 64);                                                \
    _tile_dpbf16ps(T, K, 4);

/* Scores S^T of key tiles t0 .. t0 + 3 (those below `tiles`; 16 keys x 16 queries each) of keys kr into st + 256 t,
 * from the queries' tiles qt (dim / 32 of them, loaded one at a time into tile 4); uses tiles 0-4, 6 and 7. */
static inline AMX_FN __attribute__((always_inline)) void score_tiles(const uint32_t (*qt)[16][16], const uint16_t *kr,
                                                                     int64_t dim, int64_t t0, int64_t tiles, float *st) {
    const int64_t kt = t0;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t h = 0; h < dim / 32; h++) {
        _tile_loadd(4, qt[h], 64);
        S_TILE(0, 6)
        if (t0 + 1 < tiles) { S_TILE(1, 7) }
        if (t0 + 2 < tiles) { S_TILE(2, 6) }
        if (t0 + 3 < tiles) { S_TILE(3, 7) }
    }
    _tile_stored(0, st + t0 * 256, 64);
    if (t0 + 1 < tiles) _tile_stored(1, st + (t0 + 1) * 256, 64);
    if (t0 + 2 < tiles) _tile_stored(2, st + (t0 + 2) * 256, 64);
    if (t0 + 3 < tiles) _tile_stored(3, st + (t0 + 3) * 256, 64);
}

/* Step s of scoring `tiles` key tiles of keys kr (dim 64) a tile at a time, in the background of vector work: store
 * key tile s - 4's scores (tile A = s % 4, whose products were issued four steps ago and are done) into st, then
 * start key tile s in tile A. The queries' two dim halves sit in tiles 4 and 5, the keys go through 6 and 7. */
#define SCORE_STEP(A)                                                                                        \
    do {                                                                                                     \
        if (s >= 4) _tile_stored(A, st + (s - 4) * 256, 64);                                                 \
        if (s < tiles) {                                                                                     \
            _tile_zero(A);                                                                                   \
            _tile_loadd(6, kr + s * 16 * 64, 64);                                                            \
            _tile_loadd(7, kr + s * 16 * 64 + 512, 64);                                                      \
            _tile_dpbf16ps(A, 6, 4);                                                                         \
            _tile_dpbf16ps(A, 7, 5);                                                                         \
        }                                                                                                    \
    } while (0)
static inline AMX_FN __attribute__((always_inline)) void score_step(const uint16_t *kr, int64_t s, int64_t tiles, float *st) {
    switch (s & 3) { /* tile numbers are immediates */
    case 0: SCORE_STEP(0); break;
    case 1: SCORE_STEP(1); break;
    case 2: SCORE_STEP(2); break;
    default: SCORE_STEP(3); break;
    }
}
#undef SCORE_STEP

/* O^T dims 16 (j0 + T).. += V^T (A: tile V) times P^T (B: tile 4), over the 32 keys from 32 i. */
#define PV_TILE(T, V)                                                                                        \
    if (j0 + (T) < dim / 16) {                                                                               \
        _tile_loadd(V, vt + 32 * i * dim + 16 * (j0 + (T)) * 32, 64);                                        \
        _tile_dpbf16ps(T, V, 4);                                                                             \
    }

/* Attention of `rows` (<= 16) consecutive tokens of a causal run for one query head: row r (q + r q_stride,
 * fp32, dim values) sees keys [0, limit + r) of its sequence; out + r out_stride = softmax(q K^T scale) V,
 * fp32. Keys and values: kr and vt (amx_pack_keys, covering the keys). The queries sit in vector lanes, so the
 * softmax's maxima and sums run down the key rows. Keys go RUN_CHUNK at a time: all their scores (st:
 * [2][RUN_CHUNK][16] fp32, chunks alternating), their maximum, their probabilities (pt: [RUN_CHUNK / 2][16]
 * pairs of bf16), P V; the sums so far are rescaled when the maximum grows (an online softmax over chunks).
 * dim: 32, 64, 96 or 128. */
AMX_FN void amx_attend_run(const float *q, int64_t q_stride, int64_t rows, int64_t limit, const uint16_t *kr,
                           const uint16_t *vt, int64_t dim, float scale, float *out, int64_t out_stride, float *st,
                           uint32_t *pt) {
    uint32_t qt[4][16][16] __attribute__((aligned(64))); /* per 32 dims: [dim pair][query] bf16 pairs */
    float part[4][16][16] __attribute__((aligned(64)));  /* a chunk's O^T tiles: [dim][query] */
    float acc[128][16] __attribute__((aligned(64)));     /* O^T: [dim][query] */
    const float c = scale * 1.44269504088896341f;       /* scores in base 2 */
    {   /* per row its dim pairs as bf16 pairs (32 at a time), then turned to [dim pair][query] */
        uint32_t rowpairs[16][64] __attribute__((aligned(64)));
        const __m512 cv = _mm512_set1_ps(c);
        const __m512i evens = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
        const __m512i odds = _mm512_add_epi32(evens, _mm512_set1_epi32(1));
        for (int r = 0; r < 16; r++)
            for (int64_t p0 = 0; p0 < dim / 2; p0 += 16) {
                __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
                if (r < rows) {
                    const __m512 lo = _mm512_mul_ps(_mm512_loadu_ps(q + r * q_stride + 2 * p0), cv);
                    const __m512 hi = _mm512_mul_ps(_mm512_loadu_ps(q + r * q_stride + 2 * p0 + 16), cv);
                    a = _mm512_permutex2var_ps(lo, evens, hi); /* dims 2p */
                    b = _mm512_permutex2var_ps(lo, odds, hi);  /* dims 2p + 1 */
                }
                /* 16-bit lanes 2i, 2i + 1: bf16 of a_i, b_i */
                const __m512i ab = _mm512_permutexvar_epi16(
                    _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20,
                                     4, 19, 3, 18, 2, 17, 1, 16, 0),
                    (__m512i)_mm512_cvtne2ps_pbh(b, a));
                _mm512_store_si512((void *)&rowpairs[r][p0], ab);
            }
        for (int64_t p0 = 0; p0 < dim / 2; p0 += 16) {
            __m512i t[16], a[16], b[16];
            for (int r = 0; r < 16; r++) t[r] = _mm512_load_si512((const void *)&rowpairs[r][p0]);
            transpose16(t, a, b);
            for (int i = 0; i < 16; i++) _mm512_store_si512((void *)qt[p0 / 16][i], t[i]);
        }
    }
    for (int64_t d = 0; d < dim; d++) _mm512_store_ps(acc[d], _mm512_setzero_ps());
    const int64_t end = limit + rows - 1; /* keys the last row sees */
    /* key j is visible to lanes r with r < rows and r >= j - limit + 1: every lane for j < limit */
    const __mmask16 lanes = (__mmask16)((1u << rows) - 1);
#define SEEN(j) ((j) < limit ? lanes : (j) - limit + 1 >= 16 || (j) >= end ? (__mmask16)0 : (__mmask16)(lanes & (0xffffu << ((j) - limit + 1))))
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                           21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    __m512 best = _mm512_set1_ps(-INFINITY), total = _mm512_setzero_ps();
    config_bf16();
    /* Chunk c's scores sit in st + (c % 2) RUN_CHUNK 16. The next chunk's are computed inside this chunk's softmax
     * loop (a key tile every 16 keys at dim 64, four every 64 keys otherwise), so the tile unit works beside the
     * vector units; the arithmetic is the same as scoring each chunk before its softmax. */
    {
        const int64_t k1 = RUN_CHUNK < end ? RUN_CHUNK : end;
        for (int64_t t0 = 0; t0 < (k1 + 15) / 16; t0 += 4) score_tiles(qt, kr, dim, t0, (k1 + 15) / 16, st);
    }
    for (int64_t k0 = 0, c = 0; k0 < end; k0 += RUN_CHUNK, c++) {
        const int64_t k1 = k0 + RUN_CHUNK < end ? k0 + RUN_CHUNK : end; /* keys [k0, k1) */
        const int64_t padded = (k1 - k0 + 31) / 32 * 32;
        const float *cur = st + (c % 2) * RUN_CHUNK * 16;
        float *next = st + ((c + 1) % 2) * RUN_CHUNK * 16;
        const int64_t n0 = k0 + RUN_CHUNK, n1 = n0 + RUN_CHUNK < end ? n0 + RUN_CHUNK : end; /* the next chunk */
        const int64_t next_tiles = n0 < end ? (n1 - n0 + 15) / 16 : 0;
        int64_t issued = 0; /* score steps (dim 64) or key tiles (otherwise) of the next chunk issued so far */
        const int stepwise = dim == 64;
        if (stepwise && next_tiles) {
            _tile_loadd(4, qt[0], 64);
            _tile_loadd(5, qt[1], 64);
        }
        const int64_t open = (limit < k1 ? limit : k1) - k0; /* keys of the chunk every lane sees */
        __m512 m0 = best, m1 = best, m2 = best, m3 = best;
        int64_t j = 0;
        for (; j + 4 <= open; j += 4) {
            m0 = _mm512_max_ps(m0, _mm512_load_ps(cur + 16 * j));
            m1 = _mm512_max_ps(m1, _mm512_load_ps(cur + 16 * (j + 1)));
            m2 = _mm512_max_ps(m2, _mm512_load_ps(cur + 16 * (j + 2)));
            m3 = _mm512_max_ps(m3, _mm512_load_ps(cur + 16 * (j + 3)));
        }
        for (; j < k1 - k0; j++) m0 = _mm512_mask_max_ps(m0, SEEN(k0 + j), m0, _mm512_load_ps(cur + 16 * j));
        const __m512 most = _mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3));
        /* 2^(old max - new max): 0 for the first chunk (old = -inf) and lanes of no row, exactly 1 where the
         * maximum stays (a row's result must not depend on chunks of keys it does not see) */
        const __mmask16 grew = _mm512_cmp_ps_mask(best, most, _CMP_NEQ_OQ);
        const __m512 alpha = _mm512_mask_mov_ps(
            _mm512_set1_ps(1.0f), grew,
            _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(best, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ) & lanes,
                                exp2_16(_mm512_sub_ps(best, most))));
        best = most;
        __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
        for (j = 0; j < padded; j += 2) {
            __m512 p0, p1;
            if (stepwise && j % 16 == 0 && issued < next_tiles + 4) score_step(kr + n0 * dim, issued++, next_tiles, next);
            if (!stepwise && j % 64 == 0 && issued < next_tiles) {
                score_tiles(qt, kr + n0 * dim, dim, issued, next_tiles, next);
                issued += 4;
            }
            if (j + 2 <= open) {
                p0 = exp2_16(_mm512_sub_ps(_mm512_load_ps(cur + 16 * j), most));
                p1 = exp2_16(_mm512_sub_ps(_mm512_load_ps(cur + 16 * (j + 1)), most));
            } else {
                p0 = k0 + j < end ? _mm512_maskz_mov_ps(SEEN(k0 + j), exp2_16(_mm512_sub_ps(_mm512_load_ps(cur + 16 * j), most)))
                                  : _mm512_setzero_ps();
                p1 = k0 + j + 1 < end
                         ? _mm512_maskz_mov_ps(SEEN(k0 + j + 1), exp2_16(_mm512_sub_ps(_mm512_load_ps(cur + 16 * (j + 1)), most)))
                         : _mm512_setzero_ps();
            }
            sum0 = _mm512_add_ps(sum0, p0);
            sum1 = _mm512_add_ps(sum1, p1);
            _mm512_store_si512((void *)(pt + 8 * j), _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(p1, p0)));
        }
        if (stepwise)
            for (; issued < next_tiles + 4; issued++) score_step(kr + n0 * dim, issued, next_tiles, next);
        else
            for (; issued < next_tiles; issued += 4) score_tiles(qt, kr + n0 * dim, dim, issued, next_tiles, next);
        total = _mm512_fmadd_ps(total, alpha, _mm512_add_ps(sum0, sum1));
        for (int64_t j0 = 0; j0 < dim / 16; j0 += 4) { /* O^T += V^T P^T, four tiles of 16 dims at a time */
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t i = k0 / 32; i < k0 / 32 + padded / 32; i++) {
                _tile_loadd(4, pt + 16 * 16 * (i - k0 / 32), 64);
                PV_TILE(0, 6)
                PV_TILE(1, 7)
                PV_TILE(2, 6)
                PV_TILE(3, 7)
            }
            _tile_stored(0, part[0], 64);
            _tile_stored(1, part[1], 64);
            _tile_stored(2, part[2], 64);
            _tile_stored(3, part[3], 64);
            const int64_t width = (dim / 16 - j0 < 4 ? dim / 16 - j0 : 4) * 16;
            for (int64_t d = 0; d < width; d++)
                _mm512_store_ps(acc[16 * j0 + d], _mm512_fmadd_ps(_mm512_load_ps(acc[16 * j0 + d]), alpha,
                                                                  _mm512_load_ps(part[d / 16][d % 16])));
        }
    }
#undef SEEN
    _tile_release();
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), total);
    for (int64_t d0 = 0; d0 < dim; d0 += 16) { /* O^T [dim][query] scaled, turned to rows 16 dims at a time */
        __m512i t[16], a[16], b[16];
        for (int i = 0; i < 16; i++) t[i] = _mm512_castps_si512(_mm512_mul_ps(_mm512_load_ps(acc[d0 + i]), inv));
        transpose16(t, a, b);
        for (int64_t r = 0; r < rows; r++) _mm512_storeu_ps(out + r * out_stride + d0, _mm512_castsi512_ps(t[r]));
    }
}

/* Whether keys slots[0..16) are 16 consecutive cache slots. */
static inline AMX_FN int consecutive16(const int64_t *slots) {
    const __m512i first = _mm512_set1_epi64(slots[0]);
    const __m512i lo = _mm512_add_epi64(first, _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0));
    const __m512i hi = _mm512_add_epi64(first, _mm512_set_epi64(15, 14, 13, 12, 11, 10, 9, 8));
    return _mm512_cmpeq_epi64_mask(_mm512_loadu_si512((const void *)slots), lo) == 0xff &&
           _mm512_cmpeq_epi64_mask(_mm512_loadu_si512((const void *)(slots + 8)), hi) == 0xff;
}

/* Where tile loads find the rows of keys [j, j + 16) of KV heads [h0, h0 + heads) in `cache` (kv's K or V; `scale`
 * its scales), head h's `dim` values at h * dim, and the distance between rows in bytes (*stride): the cache's own
 * rows where a bf16 cache holds the 16 keys in consecutive slots, else buf ([16][heads * dim] bf16) filled with them
 * (bf16_row_of) and zero rows for keys n.. (whose cache rows may hold anything, NaN included, which a zero
 * probability would not cancel in the tiles). */
static inline AMX_FN const uint16_t *tile_rows(const void *cache, const uint16_t *scale, const KVRows *kv, int64_t h0,
                                               int64_t heads, int64_t dim, const int64_t *slots, int64_t j, int64_t n,
                                               uint16_t *buf, int64_t *stride) {
    if (!scale && j + 16 <= n && consecutive16(slots + j)) {
        *stride = kv->row * (int64_t)sizeof(uint16_t);
        return (const uint16_t *)cache + slots[j] * kv->row + h0 * dim;
    }
    const int64_t width = heads * dim;
    for (int64_t i = 0; i < 16; i++) {
        uint16_t *to = buf + i * width;
        if (j + i >= n)
            memset(to, 0, width * sizeof(uint16_t));
        else if (!scale)
            memcpy(to, (const uint16_t *)cache + slots[j + i] * kv->row + h0 * dim, width * sizeof(uint16_t));
        else
            for (int64_t h = 0; h < heads; h++) bf16_row_of(cache, scale, kv, slots[j + i], h0 + h, dim, to + h * dim);
    }
    *stride = width * (int64_t)sizeof(uint16_t);
    return buf;
}

/* Tiles of 16 rows x 64 bytes. */
static AMX_FN void config_full(void) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}

/* The scores of `tiles` key tiles st ([16 * tiles][16]: per key its 16 columns, S^T's layout) as rows: column r
 * (r < rows) to sr[r]. Up to four columns come out of each 16 keys' first 16 bytes by permutes, more by gathers. */
static inline AMX_FN void score_rows(const float *st, int64_t rows, int64_t tiles, float (*sr)[RUN_CHUNK]) {
    if (rows > 4) {
        const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                                  _mm512_set1_epi32(16));
        for (int64_t r = 0; r < rows; r++) {
            const __m512i at = _mm512_add_epi32(column, _mm512_set1_epi32((int)r));
            for (int64_t t = 0; t < tiles; t++) _mm512_store_ps(sr[r] + 16 * t, _mm512_i32gather_ps(at, st + 256 * t, 4));
        }
        return;
    }
    __m512i pick[4]; /* column r of keys 0-3 of one vector (4 keys x 4 columns) and keys 4-7 of the next */
    for (int r = 0; r < 4; r++)
        pick[r] = _mm512_add_epi32(_mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 28, 24, 20, 16, 12, 8, 4, 0),
                                   _mm512_set1_epi32(r));
    for (int64_t t = 0; t < tiles; t++) {
        const float *s = st + 256 * t;
        __m512 z[4]; /* keys 4i .. 4i + 3, columns 0-3 */
        for (int i = 0; i < 4; i++) {
            z[i] = _mm512_castps128_ps512(_mm_load_ps(s + 64 * i));
            z[i] = _mm512_insertf32x4(z[i], _mm_load_ps(s + 64 * i + 16), 1);
            z[i] = _mm512_insertf32x4(z[i], _mm_load_ps(s + 64 * i + 32), 2);
            z[i] = _mm512_insertf32x4(z[i], _mm_load_ps(s + 64 * i + 48), 3);
        }
        for (int64_t r = 0; r < rows; r++) {
            const __m512 lo = _mm512_permutex2var_ps(z[0], pick[r], z[1]), hi = _mm512_permutex2var_ps(z[2], pick[r], z[3]);
            _mm512_store_ps(sr[r] + 16 * t, _mm512_shuffle_f32x4(lo, hi, 0x44));
        }
    }
}

/* S^T of 16 keys for KV head H of the call (tile H): its 16 keys' rows at ks + H dim (A) times its queries' Q^T
 * (B) per 32 dims, stored to st's head H at key tile t. */
#define HEAD_SCORES(H)                                                                                       \
    if ((H) < heads) {                                                                                       \
        _tile_zero(H);                                                                                       \
        for (int64_t h = 0; h < halves; h += 2) {                                                            \
            _tile_loadd(4, qt[H][h], 64);                                                                    \
            _tile_loadd(6, ks + (H) * dim + 32 * h, kstride);                                                \
            _tile_dpbf16ps(H, 6, 4);                                                                         \
            if (h + 1 < halves) {                                                                            \
                _tile_loadd(5, qt[H][h + 1], 64);                                                            \
                _tile_loadd(7, ks + (H) * dim + 32 * (h + 1), kstride);                                      \
                _tile_dpbf16ps(H, 7, 5);                                                                     \
            }                                                                                                \
        }                                                                                                    \
        _tile_stored(H, st + (H) * RUN_CHUNK * 16 + 256 * t, 64);                                            \
    }

/* Attention of one token's query heads over its keys [0, n) (cache slots slots[0..n), in sequence order) for KV heads
 * [h0, h0 + heads) (heads <= HEADS_PER_CALL), `rows` (<= 16) query heads each: query head h rows + r of the call (q +
 * (h rows + r) q_stride, fp32, dim values) reads KV head h0 + h; out + (h rows + r) out_stride = softmax(q K^T scale)
 * V, fp32. The tiles read the keys' K and V rows where the cache holds them, 16 consecutive slots (a block) at a time,
 * with nothing laid out: S^T = K Q^T (A: 16 keys' rows, B: a KV head's queries as columns), every KV head's from the
 * same K rows as they stream in, whose columns become rows for the softmax (score_rows); then O = P V per KV head, two
 * products per 16 keys (A: the probabilities in the low or the high half of each pair, zero in the other; B: the 16
 * keys' V rows as they are, dim pairs), which give the even and the odd dims. Keys that are not in consecutive slots,
 * the last partial 16 and an int8 cache's codes go through a copy (tile_rows). A head's results do not depend on which
 * other heads share its call. Keys go RUN_CHUNK at a time (st: [HEADS_PER_CALL + 1][RUN_CHUNK][16] fp32, per head the
 * scores of 16 columns, then one head's as rows [16][RUN_CHUNK]; pa: [HEADS_PER_CALL][RUN_CHUNK / 16][2][16][16] the
 * probabilities as A tiles, per 16 keys row r's bf16 probability of key i in the low half of pair i, then in the high
 * half; rows `rows`.. are never written, and only reach output rows that are dropped), the sums rescaled when a row's
 * maximum grows. dim: 32, 64, 96 or 128. With `stats` (else NULL), query head g's softmax maximum and sum go to
 * stats[2 g] and stats[2 g + 1], in natural-log units. */
AMX_FN void amx_attend_heads(const float *q, int64_t q_stride, int64_t rows, int64_t n, const KVRows *kv, int64_t h0,
                             int64_t heads, const int64_t *slots, int64_t dim, float scale, float *out,
                             int64_t out_stride, float *st, uint32_t *pa, float *stats) {
    uint32_t qt[HEADS_PER_CALL][4][16][16] __attribute__((aligned(64))); /* per head, 32 dims: Q^T (B), dim pairs */
    uint16_t kbuf[16 * HEADS_PER_CALL * 128] __attribute__((aligned(64))); /* tile_rows' copies: 16 keys of K (all heads) */
    uint16_t vbuf[16 * 128] __attribute__((aligned(64))); /* and of V (one head) */
    float part[4][16][16] __attribute__((aligned(64))); /* a chunk's P V: even and odd dims of two 32-dim halves */
    float acc[HEADS_PER_CALL][16][128] __attribute__((aligned(64))); /* O: per 32 dims the even dims, then the odd */
    float best[HEADS_PER_CALL][16], total[HEADS_PER_CALL][16];
    const int64_t halves = dim / 32, tile_keys = RUN_CHUNK / 16 * 512; /* pa's values per head */
    float(*sr)[RUN_CHUNK] = (float(*)[RUN_CHUNK])(st + HEADS_PER_CALL * RUN_CHUNK * 16); /* one head's, as rows */
    const __m512 c = _mm512_set1_ps(scale * 1.44269504088896341f);
    for (int64_t h = 0; h < heads; h++) /* columns rows.. zero */
        memset(qt[h], 0, sizeof qt[h][0] * (size_t)halves);
    for (int64_t h = 0; h < heads; h++)
        for (int64_t r = 0; r < rows; r++) {
            const float *qr = q + (h * rows + r) * q_stride;
            for (int64_t i = 0; i < halves; i++) {
                uint32_t pairs[16] __attribute__((aligned(64)));
                _mm512_store_si512((void *)pairs, (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(qr + 32 * i + 16), c),
                                                                              _mm512_mul_ps(_mm512_loadu_ps(qr + 32 * i), c)));
                for (int p = 0; p < 16; p++) qt[h][i][p][r] = pairs[p];
            }
            for (int64_t d = 0; d < dim; d += 16) _mm512_store_ps(acc[h][r] + d, _mm512_setzero_ps());
            best[h][r] = -INFINITY, total[h][r] = 0.0f;
        }
    config_full();
    prefetch_rows(kv->k, kv->k_scale, kv, h0, heads, dim, slots, 0, 32, n, 0);
    for (int64_t k0 = 0; k0 < n; k0 += RUN_CHUNK) {
        const int64_t w = (k0 + RUN_CHUNK < n ? k0 + RUN_CHUNK : n) - k0; /* keys [k0, k0 + w) */
        const int64_t tiles = (w + 15) / 16;
        for (int64_t t = 0; t < tiles; t++) { /* S^T of every KV head, 16 keys at a time */
            const int64_t j = k0 + 16 * t;
            prefetch_rows(kv->k, kv->k_scale, kv, h0, heads, dim, slots, j + 32, j + 48, n, 0);
            prefetch_rows(kv->v, kv->v_scale, kv, h0, heads, dim, slots, j, j + 16, n, 1);
            int64_t kstride;
            const uint16_t *ks = tile_rows(kv->k, kv->k_scale, kv, h0, heads, dim, slots, j, n, kbuf, &kstride);
            HEAD_SCORES(0)
            HEAD_SCORES(1)
            HEAD_SCORES(2)
            HEAD_SCORES(3)
        }
        for (int64_t h = 0; h < heads; h++) {
            const float *sh = st + h * RUN_CHUNK * 16;
            uint32_t *ph = pa + h * tile_keys;
            float alpha[16];
            score_rows(sh, rows, tiles, sr);
            for (int64_t r = 0; r < rows; r++) { /* row r's maximum, probabilities (keys w.. zero) and sum */
                __m512 m = _mm512_set1_ps(-INFINITY);
                for (int64_t j = 0; j < w; j += 16) {
                    const __mmask16 live = j + 16 <= w ? (__mmask16)0xffff : (__mmask16)((1u << (w - j)) - 1);
                    m = _mm512_mask_max_ps(m, live, m, _mm512_load_ps(sr[r] + j));
                }
                const float most = fmaxf(best[h][r], _mm512_reduce_max_ps(m));
                /* 2^(old max - new max): 0 for the first chunk, exactly 1 where the maximum stays */
                alpha[r] = best[h][r] == -INFINITY ? 0.0f : best[h][r] == most ? 1.0f : exp2f(best[h][r] - most);
                best[h][r] = most;
                const __m512 mv = _mm512_set1_ps(most);
                __m512 sum = _mm512_setzero_ps();
                for (int64_t j = 0; j < 16 * tiles; j += 16) {
                    const __mmask16 live = j + 16 <= w ? (__mmask16)0xffff : (__mmask16)((1u << (w - j)) - 1);
                    const __m512 p = _mm512_maskz_mov_ps(live, exp2_16(_mm512_sub_ps(_mm512_load_ps(sr[r] + j), mv)));
                    sum = _mm512_add_ps(sum, p);
                    const __m512i low = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(p));
                    _mm512_store_si512((void *)(ph + (j / 16) * 512 + 16 * r), low);
                    _mm512_store_si512((void *)(ph + (j / 16) * 512 + 256 + 16 * r), _mm512_slli_epi32(low, 16));
                }
                total[h][r] = total[h][r] * alpha[r] + _mm512_reduce_add_ps(sum);
            }
            for (int64_t i0 = 0; i0 < halves; i0 += 2) { /* O += P V for dims 32 i0 .. 32 i0 + 63 */
                const int two = i0 + 1 < halves;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t t = 0; t < tiles; t++) {
                    const int64_t j = k0 + 16 * t;
                    prefetch_rows(kv->v, kv->v_scale, kv, h0 + h, 1, dim, slots, j + 32, j + 48, n, 0);
                    int64_t vstride;
                    const uint16_t *vs = tile_rows(kv->v, kv->v_scale, kv, h0 + h, 1, dim, slots, j, n, vbuf, &vstride);
                    _tile_loadd(4, ph + t * 512, 64);
                    _tile_loadd(5, ph + t * 512 + 256, 64);
                    _tile_loadd(6, vs + 32 * i0, vstride);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 5, 6);
                    if (two) {
                        _tile_loadd(7, vs + 32 * (i0 + 1), vstride);
                        _tile_dpbf16ps(2, 4, 7);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                }
                _tile_stored(0, part[0], 64);
                _tile_stored(1, part[1], 64);
                if (two) {
                    _tile_stored(2, part[2], 64);
                    _tile_stored(3, part[3], 64);
                }
                for (int64_t r = 0; r < rows; r++) {
                    const __m512 a = _mm512_set1_ps(alpha[r]);
                    for (int64_t i = 0; i < (two ? 4 : 2); i++) {
                        float *to = acc[h][r] + 32 * i0 + 16 * i;
                        _mm512_store_ps(to, _mm512_fmadd_ps(_mm512_load_ps(to), a, _mm512_load_ps(part[i][r])));
                    }
                }
            }
        }
    }
    _tile_release();
    /* acc's 32 values of each 32 dims: the even dims, then the odd */
    const __m512i first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i second = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    for (int64_t h = 0; h < heads; h++)
        for (int64_t r = 0; r < rows; r++) {
            const int64_t g = h * rows + r;
            if (stats) stats[2 * g] = best[h][r] * 0.693147180559945309f, stats[2 * g + 1] = total[h][r];
            const __m512 inv = _mm512_set1_ps(1.0f / total[h][r]);
            for (int64_t d = 0; d < dim; d += 32) {
                const __m512 a = _mm512_load_ps(acc[h][r] + d), b = _mm512_load_ps(acc[h][r] + d + 16);
                _mm512_storeu_ps(out + g * out_stride + d, _mm512_mul_ps(_mm512_permutex2var_ps(a, first, b), inv));
                _mm512_storeu_ps(out + g * out_stride + d + 16, _mm512_mul_ps(_mm512_permutex2var_ps(a, second, b), inv));
            }
        }
}
#undef HEAD_SCORES

#else /* no AMX in this compiler: never on */
int amx_configure(int want) {
    (void)want;
    amx_on = 0;
    return 0;
}
void amx_blocks(const uint8_t *codes, const uint16_t *d, const uint16_t *m, int bits, int64_t n, int64_t k,
                const int8_t *xq, const float *dx, const float *sx, int64_t rows, float *out, int64_t b0, int64_t b1) {
    vnni_blocks(codes, d, m, bits, n, k, xq, dx, sx, rows, out, b0, b1);
}
void amx_bf16_weights(const uint8_t *codes, const uint16_t *d, const uint16_t *m, int bits, int64_t k, int64_t b0,
                      int64_t b1, uint16_t *wb) {
    (void)codes, (void)d, (void)m, (void)bits, (void)k, (void)b0, (void)b1, (void)wb;
}
void amx_bf16_row(const float *x, int64_t k, int64_t t, uint16_t *xb) { (void)x, (void)k, (void)t, (void)xb; }
void amx_swiglu_row(const float *gate_up, int64_t inter, int64_t t, uint16_t *xb) {
    (void)gate_up, (void)inter, (void)t, (void)xb;
}
void amx_bf16_blocks(const uint16_t *wb, int64_t n, int64_t k, const uint16_t *x, int64_t r0, int64_t r1, float *out,
                     int64_t b0, int64_t b1) {
    (void)wb, (void)n, (void)k, (void)x, (void)r0, (void)r1, (void)out, (void)b0, (void)b1;
}
void amx_bf16_swiglu_blocks(const uint16_t *wb, int64_t k, const uint16_t *x, int64_t r0, int64_t r1, int64_t inter,
                            int64_t p0, int64_t p1, uint16_t *xo) {
    (void)wb, (void)k, (void)x, (void)r0, (void)r1, (void)inter, (void)p0, (void)p1, (void)xo;
}
void amx_pack_keys(const KVRows *kv, int64_t kv_head, int64_t dim, const int64_t *slots, int64_t n, uint16_t *kr,
                   uint16_t *vt, int64_t k0, int64_t k1) {
    (void)kv, (void)kv_head, (void)dim, (void)slots, (void)n, (void)kr, (void)vt, (void)k0, (void)k1;
}
void amx_attend_heads(const float *q, int64_t q_stride, int64_t rows, int64_t n, const KVRows *kv, int64_t h0,
                      int64_t heads, const int64_t *slots, int64_t dim, float scale, float *out, int64_t out_stride,
                      float *st, uint32_t *pa, float *stats) {
    (void)q, (void)q_stride, (void)rows, (void)n, (void)kv, (void)h0, (void)heads, (void)slots, (void)dim, (void)scale;
    (void)out, (void)out_stride, (void)st, (void)pa, (void)stats;
}
void amx_attend_run(const float *q, int64_t q_stride, int64_t rows, int64_t limit, const uint16_t *kr,
                    const uint16_t *vt, int64_t dim, float scale, float *out, int64_t out_stride, float *st,
                    uint32_t *pt) {
    (void)q, (void)q_stride, (void)rows, (void)limit, (void)kr, (void)vt, (void)dim, (void)scale, (void)out;
    (void)out_stride, (void)st, (void)pt;
}
#endif
