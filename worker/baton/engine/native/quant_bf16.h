/* Products on quantized weights in bf16, dequantizing inside the product.
 *
 * The int16 kernels (quant_kernels.h) read each weight byte once per product but spend a
 * multiply per weight per input row: past a few rows they are compute-bound (~30 GMAC/s a
 * core). The dense prompt path (quant/weight.py) dequantizes the whole matrix into memory
 * on every step and hands it to the GEMM, which repacks it. Here each group of 16 weight
 * rows is dequantized once per product into a bf16 panel that stays in L1/L2, and every
 * input row is multiplied with it: the weight's cost is paid once, whatever the row count.
 * Two engines multiply the panels:
 *   - AMX tiles (TDPBF16PS, quant_amx.h), where the CPU has them and the OS allows them;
 *   - AVX512-BF16 (VDPBF16PS): 16 lanes = the group's 16 weight rows, each input pair
 *     broadcast to all of them; for CPUs with bf16 dot products but no tiles (AMD Zen 4/5,
 *     Intel Cooper Lake).
 *
 * Values: each weight is d * q + m (or d * (q - offset)), each product and sum rounded on
 * its own, then rounded to bf16 to nearest even, the same bits quant_dequantize.h writes
 * for the dense path; the inputs are rounded to bf16 likewise; sums in float32. A panel
 * block (one tile) holds 16 pairs of one block's 32 values in the order the int16 kernels
 * pair them ((0, 2), (1, 3), (4, 6), ...), row p = pair p of the 16 weight rows, so the
 * inputs are stored as x0 x2 x1 x3 per 4 here too. Each output row is summed in the same
 * order whatever the other rows of the product: results do not depend on the batch.
 * Included by quant_product.h (after quant_dequantize.h).
 */
#define QUANT_BF16_ANY 0  /* the fastest engine here */
#define QUANT_BF16_AVX512 1
#define QUANT_BF16_AMX 2

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <stdlib.h>

#define BF16_TILE_VALUES 512 /* bf16 values in a tile: 16 rows of 32 (64 bytes) */

/* element 2n = low value of lane n, 2n + 1 = its high value (cvtne2ps puts them 16 apart) */
#define BF16_INTERLEAVE                                                                                  \
    _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, \
                     4, 19, 3, 18, 2, 17, 1, 16, 0)

/* A 4-bit q placed in a float's top mantissa bits reads 1 + q/16, so one FMA turns it into
 * (1 + q/16)·16d + (m - 16d) = d·q + m: no int-to-float conversion, no separate multiply and
 * add. The product is exact and the FMA rounds once, so the value is the general path's
 * (d·q exact, + m rounded once) wherever m - 16d is exact in float32, which TwoSum checks for
 * the block's 16 rows at once (its error is zero; a non-finite scale fails the check). Q4_0
 * has m = -8d, always exact. Returns 0 where the block needs the general path. */
static inline int bf16_nibble_terms(__m512 d, __m512 m, __m512 *scale, __m512 *base) {
    const __m512 b = _mm512_mul_ps(d, _mm512_set1_ps(-16.0f));
    const __m512 sum = _mm512_add_ps(m, b);
    const __m512 bb = _mm512_sub_ps(sum, m);
    const __m512 error = _mm512_add_ps(_mm512_sub_ps(m, _mm512_sub_ps(sum, bb)), _mm512_sub_ps(b, bb));
    *scale = _mm512_mul_ps(d, _mm512_set1_ps(16.0f));
    *base = sum;
    return _mm512_cmp_ps_mask(error, _mm512_setzero_ps(), _CMP_EQ_OQ) == 0xFFFF; /* NaN where d or m is not finite */
}

/* The 4-bit block of bf16_dequantize_block by bf16_nibble_terms: per pair, each half's nibble
 * shifted to bits 19-22 of its lane, 1.0f's bits or-ed in, one FMA. */
static inline void bf16_dequantize_nibbles(const uint8_t *qs, __m512 scale, __m512 base, uint16_t *tile) {
    const __m512i interleave = BF16_INTERLEAVE, nibble = _mm512_set1_epi32(0x00780000),
                  one = _mm512_set1_epi32(0x3F800000);
    /* (x & nibble) | one */
#define BF16_ONE_PLUS(x) _mm512_castsi512_ps(_mm512_ternarylogic_epi32((x), nibble, one, 0xEA))
#define BF16_FAST_PAIR(lo_bits, hi_bits, p)                                                              \
    {                                                                                                    \
        const __m512 flo = _mm512_fmadd_ps(BF16_ONE_PLUS(lo_bits), scale, base);                         \
        const __m512 fhi = _mm512_fmadd_ps(BF16_ONE_PLUS(hi_bits), scale, base);                         \
        const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(fhi, flo);                                     \
        _mm512_store_si512((__m512i *)(tile + 32 * (p)), _mm512_permutexvar_epi16(interleave, both));      \
    }
    for (int c = 0; c < 4; c++) {
        const __m512i v = _mm512_loadu_si512(qs + 64 * c);
        /* the pairs of the general path: lane bits s..s+3 and 16+s..19+s, s = 0, 8, 4, 12 */
        BF16_FAST_PAIR(_mm512_slli_epi32(v, 19), _mm512_slli_epi32(v, 3), 2 * c);
        BF16_FAST_PAIR(_mm512_slli_epi32(v, 11), _mm512_srli_epi32(v, 5), 2 * c + 1);
        BF16_FAST_PAIR(_mm512_slli_epi32(v, 15), _mm512_srli_epi32(v, 1), 8 + 2 * c);
        BF16_FAST_PAIR(_mm512_slli_epi32(v, 7), _mm512_srli_epi32(v, 9), 8 + 2 * c + 1);
    }
#undef BF16_FAST_PAIR
#undef BF16_ONE_PLUS
}

/* One block of a group (16 weight rows x 32 values) as a bf16 tile: row p holds pair p of
 * every weight row, lane n = weight row n. */
static inline void bf16_dequantize_block(const uint8_t *g, const QuantFormat *f, uint16_t *tile) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)g));
    const __m512 m = f->has_min ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(g + 32)))
                                : _mm512_setzero_ps();
    const uint8_t *qs = g + QUANT_ROWS * f->header_bytes, *fifths = fifth_words(g, f);
    if (f->nibbles && !fifths && !f->lookup) {
        __m512 scale, base;
        const __m512 least = f->has_min ? m : _mm512_mul_ps(d, _mm512_set1_ps((float)-f->offset));
        if (bf16_nibble_terms(d, least, &scale, &base)) {
            bf16_dequantize_nibbles(qs, scale, base, tile);
            return;
        }
    }
    const __m512i interleave = BF16_INTERLEAVE;
    const __m512i offset = _mm512_set1_epi32(f->offset), low = _mm512_set1_epi32(0xFFFF), table = TABLE512;
#define BF16_PAIR(v, shift, mask, p)                                                                     \
    {                                                                                                    \
        __m512i w = _mm512_and_si512(_mm512_srli_epi16(v, shift), _mm512_set1_epi16(mask));             \
        if (fifths) w = FIFTH512(w, fh, shift); /* quant_kernels.h */                                   \
        if (f->lookup) w = LOOKUP512(w, table);                                                          \
        __m512i lo = _mm512_and_si512(w, low), hi = _mm512_srli_epi32(w, 16);                            \
        if (f->offset) { lo = _mm512_sub_epi32(lo, offset); hi = _mm512_sub_epi32(hi, offset); }          \
        __m512 flo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(lo)), fhi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(hi)); \
        if (f->has_min) { flo = _mm512_add_ps(flo, m); fhi = _mm512_add_ps(fhi, m); }                      \
        const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(fhi, flo);                                     \
        _mm512_store_si512((__m512i *)(tile + 32 * (p)), _mm512_permutexvar_epi16(interleave, both));      \
    }
    if (f->nibbles) {
        const __m512i fw = fifths ? _mm512_loadu_si512(fifths) : _mm512_setzero_si512();
        for (int c = 0; c < 4; c++) {
            const __m512i v = _mm512_loadu_si512(qs + 64 * c), fh = SHIFT_RIGHT512(fw, c);
            BF16_PAIR(v, 0, 0x000F, 2 * c);
            BF16_PAIR(v, 8, 0x000F, 2 * c + 1);
            BF16_PAIR(v, 4, 0x000F, 8 + 2 * c);
            BF16_PAIR(v, 12, 0x000F, 8 + 2 * c + 1);
        }
    } else {
        const __m512i fh = _mm512_setzero_si512(); /* no fifth bits: unused */
        for (int c = 0; c < 8; c++) {
            const __m512i v = _mm512_loadu_si512(qs + 64 * c);
            BF16_PAIR(v, 0, 0x00FF, 2 * c);
            BF16_PAIR(v, 8, 0x00FF, 2 * c + 1);
        }
    }
#undef BF16_PAIR
}

/* One group's weights as bf16 tiles: block b at panel + b * BF16_TILE_VALUES. */
static void bf16_panel(const uint8_t *group, const QuantFormat *f, int nb, uint16_t *panel) {
    const int step = QUANT_ROWS * f->block_bytes;
    for (int b = 0; b < nb; b++) {
        prefetch_block_ahead(group + (int64_t)b * step, step);
        bf16_dequantize_block(group + (int64_t)b * step, f, panel + (int64_t)b * BF16_TILE_VALUES);
    }
}

/* x[rows, k] float32 -> bf16 tiles (round to nearest even): the tile of rows 16t..16t+15
 * and block b at out + (t * nb + b) * BF16_TILE_VALUES, 16 rows of 32 values, each 4 as
 * x0 x2 x1 x3; rows past `rows` zero. Contiguous tiles stream from L2 in order, where rows
 * of the matrix would be 16 strided streams. This is row r's part. */
static void bf16_input_row(const float *x, int rows, int64_t r, int k, uint16_t *out) {
    const __m512i order = _mm512_set_epi16(31, 29, 30, 28, 27, 25, 26, 24, 23, 21, 22, 20, 19, 17, 18, 16,
                                           15, 13, 14, 12, 11, 9, 10, 8, 7, 5, 6, 4, 3, 1, 2, 0);
    const int nb = k / QUANT_BLOCK;
    uint16_t *o = out + (r / 16) * nb * BF16_TILE_VALUES + (r % 16) * QUANT_BLOCK;
    const float *v = x + r * k;
    for (int b = 0; b < nb; b++, o += BF16_TILE_VALUES) {
        if (r >= rows) { memset(o, 0, sizeof(uint16_t) * QUANT_BLOCK); continue; }
        const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(v + b * QUANT_BLOCK + 16),
                                                          _mm512_loadu_ps(v + b * QUANT_BLOCK));
        _mm512_storeu_si512(o, _mm512_permutexvar_epi16(order, both));
    }
}

/* Every row to `padded` (a multiple of 16); bit for bit the same on any thread count. */
static void bf16_inputs(const float *x, int rows, int padded, int k, uint16_t *out) {
#pragma omp parallel for schedule(static) if (rows >= SHARED_INPUT_ROWS)
    for (int64_t r = 0; r < padded; r++) bf16_input_row(x, rows, r, k, out);
}

/* Sums of one 16-row output tile, its `valid` columns copied to out (row stride n). */
static inline void bf16_emit(const float *sums, int rows, int valid, float *out, int n) {
    for (int r = 0; r < rows; r++) memcpy(out + (int64_t)r * n, sums + 16 * r, sizeof(float) * valid);
}

#define BF16_ROWS 8 /* input rows a VDPBF16PS pass holds: 2 groups x 8 rows = 16 sums */

/* Up to two groups (32 output columns) against every input row with VDPBF16PS, BF16_ROWS
 * rows at a time (the zero rows of the last tile too: they cost a few products and keep
 * every row's order of sums the same). valid[g]: group g's real rows (0: no second). */
static void avx512_groups(const uint16_t *panels[2], const int valid[2], int nb, const uint16_t *in, int rows,
                          float *out[2], int n, const NextGroups *next) {
    const __mmask16 keep[2] = {(__mmask16)((1u << valid[0]) - 1), (__mmask16)((1u << valid[1]) - 1)};
    const uint16_t *second = valid[1] ? panels[1] : panels[0]; /* never an unwritten panel */
    for (int r0 = 0; r0 < rows; r0 += BF16_ROWS) {
        __m512 sums[2][BF16_ROWS];
        for (int r = 0; r < BF16_ROWS; r++) sums[0][r] = sums[1][r] = _mm512_setzero_ps();
        /* row r0 + r, block b, pair p: 32 bits at a + b * BF16_TILE_VALUES + 32 * r + 2 * p */
        const uint16_t *a = in + (int64_t)(r0 / 16) * nb * BF16_TILE_VALUES + (r0 % 16) * QUANT_BLOCK;
        for (int b = 0; b < nb; b++) {
            if (r0 == 0) prefetch_next_block(next, b);
            const uint16_t *w0 = panels[0] + (int64_t)b * BF16_TILE_VALUES;
            const uint16_t *w1 = second + (int64_t)b * BF16_TILE_VALUES;
            const uint16_t *ab = a + (int64_t)b * BF16_TILE_VALUES;
            for (int p = 0; p < 16; p++) {
                const __m512bh wa = (__m512bh)_mm512_load_si512(w0 + 32 * p);
                const __m512bh wb = (__m512bh)_mm512_load_si512(w1 + 32 * p);
                for (int r = 0; r < BF16_ROWS; r++) {
                    const __m512bh x = (__m512bh)_mm512_set1_epi32(load_i32(ab + 32 * r + 2 * p));
                    sums[0][r] = _mm512_dpbf16_ps(sums[0][r], wa, x);
                    sums[1][r] = _mm512_dpbf16_ps(sums[1][r], wb, x);
                }
            }
        }
        for (int r = 0; r < BF16_ROWS && r0 + r < rows; r++)
            for (int g = 0; g < 2; g++)
                if (valid[g]) _mm512_mask_storeu_ps(out[g] + (int64_t)(r0 + r) * n, keep[g], sums[g][r]);
    }
}

#include "quant_amx.h"

/* Bit QUANT_BF16_AVX512 | QUANT_BF16_AMX for each engine this library and this process can use. */
static int bf16_engines(void) { return 1 << QUANT_BF16_AVX512 | (amx_permission() ? 1 << QUANT_BF16_AMX : 0); }

/* Bytes of scratch bf16_product needs for `rows` input rows of `k` values. */
static int64_t bf16_scratch_bytes(int rows, int k) {
    return (int64_t)((rows + 15) / 16 * 16) * k * 2 + 64;
}

/* out[rows, n] = x[rows, k] @ W^T in float32 sums of bf16 products, on `engine`
 * (QUANT_BF16_ANY: AMX where allowed, else AVX512-BF16). Returns 0; -1 (nothing written)
 * where the engine is unavailable; -2 out of memory. Threads take pairs of groups. */
static int bf16_product(const QuantMatrix *w, const float *x, int rows, float *out, void *scratch, int engine) {
    const int amx = engine == QUANT_BF16_AMX || (engine == QUANT_BF16_ANY && amx_permission());
    if ((amx && !amx_permission()) || engine < QUANT_BF16_ANY || engine > QUANT_BF16_AMX) return -1;
    const int k = w->k, nb = k / QUANT_BLOCK, padded = (rows + 15) / 16 * 16;
    uint16_t *in = (uint16_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    bf16_inputs(x, rows, padded, k, in);
    const QuantLayout l = quant_layout(w);
    const int n = l.first_row[w->count], groups = l.first_group[w->count];
    int failed = 0;
#pragma omp parallel
    {
        uint16_t *space = aligned_alloc(64, (size_t)2 * nb * BF16_TILE_VALUES * sizeof(uint16_t));
        if (!space) {
#pragma omp atomic write
            failed = 1;
        }
        if (space && amx) amx_configure();
#pragma omp for schedule(static)
        for (int pi = 0; pi < (groups + 1) / 2; pi++) {
            if (!space) continue;
            const uint16_t *panels[2] = {space, space + (int64_t)nb * BF16_TILE_VALUES};
            GroupPair pair = group_pair(w, &l, pi, groups, out);
            for (int h = 0; h < pair.count; h++)
                bf16_panel(pair.group[h].data, &pair.group[h].format, nb, (uint16_t *)panels[h]);
            /* AMX takes no prefetch of the next pair: tried on a Xeon, its products went from
             * 15.5-17.5 to 18.2-19.3 ms at 1-16 rows and were even from 32 rows on
             * (bench/results/quant_products.xeon.amx_*.json) */
            if (amx) {
                amx_groups(panels, pair.valid, nb, in, rows, padded, pair.out, n);
            } else {
                const NextGroups next = next_groups(w, &l, pi, groups);
                avx512_groups(panels, pair.valid, nb, in, rows, pair.out, n, &next);
            }
        }
        if (space && amx) amx_release();
        free(space);
    }
    return failed ? -2 : 0;
}
#else
static int bf16_engines(void) { return 0; }
static int64_t bf16_scratch_bytes(int rows, int k) { return (int64_t)rows * k * 2 + 64; }
static int bf16_product(const QuantMatrix *w, const float *x, int rows, float *out, void *scratch, int engine) {
    (void)w, (void)x, (void)rows, (void)out, (void)scratch, (void)engine;
    return -1;
}
#endif
