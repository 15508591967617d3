/* Products on quantized weights through AMX tiles, dequantizing inside the product.
 *
 * The int16 kernels (quant_kernels.h) read each weight byte once per product but spend a
 * multiply per weight per input row: past a few rows they are compute-bound (~30 GMAC/s a
 * core on a Xeon with AMX). The dense prompt path (quant/weight.py) dequantizes the whole
 * matrix into memory on every step and hands it to the GEMM, which repacks it. Here each
 * group of 16 weight rows is dequantized once per product into bf16 tiles that stay in L1
 * (a group's 16 rows are the 16 output columns of one AMX tile), and TDPBF16PS multiplies
 * them with every input row: the weight's cost is paid once, whatever the row count.
 *
 * Values: each weight is d * q + m (or d * (q - offset)), each product and sum rounded on
 * its own, then rounded to bf16 to nearest even, the same bits quant_dequantize.h writes
 * for the dense path; the inputs are rounded to bf16 likewise; sums in float32. A tile row
 * holds 16 pairs of one block's 32 values in the order the int16 kernels pair them
 * ((0, 2), (1, 3), (4, 6), ...), so the inputs are stored as x0 x2 x1 x3 per 4 here too.
 * An output row's value does not depend on the other rows of the product.
 *
 * Linux hands out AMX state only to a process that asks (arch_prctl); without the
 * instructions or the permission `baton_quant_amx_available` is 0 and callers keep the
 * other paths. Included by quant_product.h (after quant_dequantize.h).
 */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_ARCH_REQ_XCOMP_PERM 0x1023
#define AMX_XFEATURE_XTILEDATA 18
#define AMX_TILE_VALUES 512 /* bf16 values in a tile: 16 rows of 32 (64 bytes) */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} AmxConfig;

static int amx_permission(void) {
    static int state = -1; /* -1 unknown, 0 refused, 1 granted */
    if (state < 0) state = syscall(SYS_arch_prctl, AMX_ARCH_REQ_XCOMP_PERM, AMX_XFEATURE_XTILEDATA) == 0;
    return state;
}

static void amx_configure(void) {
    AmxConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) { c.colsb[t] = 64; c.rows[t] = 16; } /* 0-3 sums, 4-5 inputs, 6-7 weights */
    _tile_loadconfig(&c);
}

/* One block of a group (16 weight rows x 32 values) as a bf16 tile: row p holds pair p of
 * every weight row, lane n = weight row n. */
static inline void amx_dequantize_block(const uint8_t *g, const QuantFormat *f, uint16_t *tile) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)g));
    const __m512 m = f->has_min ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(g + 32)))
                                : _mm512_setzero_ps();
    const uint8_t *qs = g + QUANT_ROWS * f->header_bytes;
    /* element 2n = low value of lane n, 2n + 1 = its high value (cvtne2ps puts them 16 apart) */
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                                23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i offset = _mm512_set1_epi32(f->offset), low = _mm512_set1_epi32(0xFFFF);
#define AMX_PAIR(v, shift, mask, p)                                                                      \
    {                                                                                                    \
        const __m512i w = _mm512_and_si512(_mm512_srli_epi16(v, shift), _mm512_set1_epi16(mask));       \
        __m512i lo = _mm512_and_si512(w, low), hi = _mm512_srli_epi32(w, 16);                            \
        if (f->offset) { lo = _mm512_sub_epi32(lo, offset); hi = _mm512_sub_epi32(hi, offset); }          \
        __m512 flo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(lo)), fhi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(hi)); \
        if (f->has_min) { flo = _mm512_add_ps(flo, m); fhi = _mm512_add_ps(fhi, m); }                      \
        const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(fhi, flo);                                     \
        _mm512_store_si512((__m512i *)(tile + 32 * (p)), _mm512_permutexvar_epi16(interleave, both));      \
    }
    if (f->nibbles) {
        for (int c = 0; c < 4; c++) {
            const __m512i v = _mm512_loadu_si512(qs + 64 * c);
            AMX_PAIR(v, 0, 0x000F, 2 * c);
            AMX_PAIR(v, 8, 0x000F, 2 * c + 1);
            AMX_PAIR(v, 4, 0x000F, 8 + 2 * c);
            AMX_PAIR(v, 12, 0x000F, 8 + 2 * c + 1);
        }
    } else {
        for (int c = 0; c < 8; c++) {
            const __m512i v = _mm512_loadu_si512(qs + 64 * c);
            AMX_PAIR(v, 0, 0x00FF, 2 * c);
            AMX_PAIR(v, 8, 0x00FF, 2 * c + 1);
        }
    }
#undef AMX_PAIR
}

/* x[rows, k] float32 -> bf16 tiles (round to nearest even): the tile of rows 16t..16t+15
 * and block b at out + (t * nb + b) * AMX_TILE_VALUES, 16 rows of 32 values, each 4 as x0 x2 x1 x3;
 * rows past `rows` zero. Contiguous tiles stream from L2 in order, where rows of the
 * matrix would be 16 strided streams. */
static void amx_inputs(const float *x, int rows, int padded, int k, uint16_t *out) {
    const __m512i order = _mm512_set_epi16(31, 29, 30, 28, 27, 25, 26, 24, 23, 21, 22, 20, 19, 17, 18, 16,
                                           15, 13, 14, 12, 11, 9, 10, 8, 7, 5, 6, 4, 3, 1, 2, 0);
    const int nb = k / QUANT_BLOCK;
    for (int64_t r = 0; r < padded; r++) {
        uint16_t *o = out + (r / 16) * nb * AMX_TILE_VALUES + (r % 16) * QUANT_BLOCK;
        const float *v = x + r * k;
        for (int b = 0; b < nb; b++, o += AMX_TILE_VALUES) {
            if (r >= rows) { memset(o, 0, sizeof(uint16_t) * QUANT_BLOCK); continue; }
            const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(v + b * QUANT_BLOCK + 16),
                                                              _mm512_loadu_ps(v + b * QUANT_BLOCK));
            _mm512_storeu_si512(o, _mm512_permutexvar_epi16(order, both));
        }
    }
}

/* Sums of one 16-row output tile, its `valid` columns copied to out (row stride n). */
static inline void amx_emit(const float *sums, int rows, int valid, float *out, int n) {
    for (int r = 0; r < rows; r++) memcpy(out + (int64_t)r * n, sums + 16 * r, sizeof(float) * valid);
}

/* One group's weights as bf16 tiles: block b at panel + b * AMX_TILE_VALUES. */
static void amx_panel(const uint8_t *group, const QuantFormat *f, int nb, uint16_t *panel) {
    const int step = QUANT_ROWS * f->block_bytes;
    for (int b = 0; b < nb; b++)
        amx_dequantize_block(group + (int64_t)b * step, f, panel + (int64_t)b * AMX_TILE_VALUES);
}

/* Sums tile t (group g, row tile rt of this pass) to the output: whole tiles straight
 * into it, partial ones (the last rows, a part's last group) through `sums`. */
#define AMX_SAVE(t, g, rt)                                                                        \
    {                                                                                             \
        const int first = r0 + 16 * (rt), count = rows - first < 16 ? rows - first : 16;          \
        if (count == 16 && valid[g] == 16) {                                                      \
            _tile_stored(t, out[g] + (int64_t)first * n, n * 4);                                  \
        } else if (count > 0) {                                                                   \
            _tile_stored(t, sums, 64);                                                            \
            amx_emit(sums, count, valid[g], out[g] + (int64_t)first * n, n);                      \
        }                                                                                         \
    }

/* Up to two groups (32 output columns) against every input row, two row tiles at a time:
 * sums in tiles 0-3 (row tile r, group g at 2r + g), inputs in 4-5, weights in 6-7; each
 * tile loaded feeds two products. valid[g]: group g's real rows (0: no second group). */
static void amx_groups(const uint16_t *panels[2], const int valid[2], int nb, const uint16_t *in, int rows,
                       int padded, float *out[2], int n) {
    float sums[256] __attribute__((aligned(64)));
    const int two = valid[1] > 0;
    for (int r0 = 0; r0 < padded; r0 += 32) {
        const int pair = padded - r0 >= 32;
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        const uint16_t *a = in + (int64_t)(r0 / 16) * nb * AMX_TILE_VALUES; /* row tile r0 / 16, block 0 */
        for (int b = 0; b < nb; b++) {
            const uint16_t *at = a + (int64_t)b * AMX_TILE_VALUES;
            _tile_loadd(6, panels[0] + (int64_t)b * AMX_TILE_VALUES, 64);
            _tile_loadd(4, at, 64);
            _tile_dpbf16ps(0, 4, 6);
            if (two) {
                _tile_loadd(7, panels[1] + (int64_t)b * AMX_TILE_VALUES, 64);
                _tile_dpbf16ps(1, 4, 7);
            }
            if (pair) {
                _tile_loadd(5, at + (int64_t)nb * AMX_TILE_VALUES, 64);
                _tile_dpbf16ps(2, 5, 6);
                if (two) _tile_dpbf16ps(3, 5, 7);
            }
        }
        AMX_SAVE(0, 0, 0);
        if (two) AMX_SAVE(1, 1, 0);
        if (pair) AMX_SAVE(2, 0, 1);
        if (pair && two) AMX_SAVE(3, 1, 1);
    }
}
#undef AMX_SAVE

int baton_quant_amx_available(void) { return amx_permission(); }

/* Bytes of scratch baton_quant_product_amx needs for `rows` input rows of `k` values. */
int64_t baton_quant_amx_scratch_bytes(int rows, int k) {
    return (int64_t)((rows + 15) / 16 * 16) * k * 2 + 64;
}

/* out[rows, n] = x[rows, k] @ W^T in float32 sums of bf16 products. Returns 0, or -1
 * (nothing written) where AMX is unavailable. Threads take groups of 16 weight rows. */
int baton_quant_product_amx(const QuantMatrix *w, const float *x, int rows, float *out, void *scratch) {
    if (!amx_permission()) return -1;
    const int k = w->k, nb = k / QUANT_BLOCK, padded = (rows + 15) / 16 * 16;
    uint16_t *in = (uint16_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    amx_inputs(x, rows, padded, k, in);
    const QuantLayout l = quant_layout(w);
    const int n = l.first_row[w->count], groups = l.first_group[w->count];
    int failed = 0;
#pragma omp parallel
    {
        uint16_t *space = aligned_alloc(64, (size_t)2 * nb * AMX_TILE_VALUES * sizeof(uint16_t));
        if (!space) {
#pragma omp atomic write
            failed = 1;
        }
        if (space) amx_configure();
#pragma omp for schedule(static)
        for (int pi = 0; pi < (groups + 1) / 2; pi++) {
            if (!space) continue;
            const uint16_t *panels[2] = {space, space + (int64_t)nb * AMX_TILE_VALUES};
            int valid[2] = {0, 0};
            float *outs[2] = {out, out};
            for (int h = 0; h < 2 && 2 * pi + h < groups; h++) {
                const QuantGroup grp = quant_group(w, &l, 2 * pi + h);
                valid[h] = grp.valid;
                outs[h] = out + grp.column;
                amx_panel(grp.data, &grp.format, nb, (uint16_t *)panels[h]);
            }
            amx_groups(panels, valid, nb, in, rows, padded, outs, n);
        }
        if (space) _tile_release();
        free(space);
    }
    return failed ? -2 : 0;
}
#else
int baton_quant_amx_available(void) { return 0; }
int64_t baton_quant_amx_scratch_bytes(int rows, int k) { return (int64_t)rows * k * 2 + 64; }
int baton_quant_product_amx(const QuantMatrix *w, const float *x, int rows, float *out, void *scratch) {
    (void)w, (void)x, (void)rows, (void)out, (void)scratch;
    return -1;
}
#endif
