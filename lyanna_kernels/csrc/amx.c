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
 * this path is decided by what they are (decoder.c), so each row's result still does not depend on its batch; but a
 * prompt token's then differs from the same token decoded, so decoder.c takes them only where the engine is not
 * deterministic (Decoder.prompt_bf16).
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
    if (whole < rows) /* fewer than 16 rows: the path measured for them (never AMX again) */
        interleaved_blocks(codes, d, m, bits, n, k, xq + whole * k, dx + whole * groups, sx + whole * groups,
                           rows - whole, out + whole * n, b0, b1);
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
#endif
