/* Products on quantized weights in int8 with AVX512-VNNI (VPDPBUSD), from a decode step's rows to a prompt's;
 * on CPUs with AVX2 and no VNNI, the same products with VPMADDUBSW (quant_int8_avx2.h).
 *
 * The bf16 engines (quant_bf16.h) turn every weight into a bf16 value before multiplying:
 * a float conversion and FMA per weight per step, ~11 ms of SmolLM2's products on a Zen 4
 * core whatever the row count, and 32 products a VDPBF16PS. Here the weights stay integers:
 * a 4-bit quant is already an unsigned byte once its nibble is masked out (an 8-bit quant
 * with its sign bit flipped is one too, as quant/interleave.py stores it), and the inputs
 * are rounded to int8 per block of 32 (d = max|x| / 127), so one VPDPBUSD multiplies 64
 * byte pairs. Each block's integer sums are then scaled once per output row:
 *
 *     sum_j w_j x_j = d_w d_x sum_j q_j x'_j + c d_x sum_j x'_j,   c = m (Q4_1), else -offset d_w
 *
 * A transformer's activations carry a few values far larger than the rest, and one in a
 * block leaves its 31 neighbours a step of max|x| / 127: most of int8's error on SmolLM2.
 * So each row's INT8_OUTLIERS largest values are taken out before rounding and multiplied
 * in float with their weights from the panel (w = d_w u + c) after the blocks. Rows share
 * their outliers' channels (a 256-token prompt's 1,024 fell on a median of 47 of SmolLM2's
 * 576 input channels), but taking each channel's weights from a group pair's panels once,
 * into a table the rows read, measured no faster (the same bits; SmolLM2's products at 256
 * rows on a Xeon core, three runs each alternating: 196-208 ms before, 208-212 ms with it).
 *
 * Past INT8_IN_PLACE_ROWS input rows, a group of 16 weight rows is unpacked once per product
 * into a byte panel that stays in L1/L2 (8 chunks of 64 bytes a block: chunk j holds values
 * 4j..4j+3 of each row, one row per 32-bit lane, then the block's 16 d_w and 16 c in
 * float32), and every input row meets it. Up to that many rows (a decode step's), the passes
 * read the weights where they lie and unmask the nibbles in registers: the panel's stores,
 * and its wait on weights streaming from memory, cost more than a few passes save. SmolLM2's
 * products on a Zen 4 core, one thread, in place against from panels: 7.0 / 9.2 ms at 4 rows,
 * 11.5 / 13.1 at 8, 20.9 / 21.1 at 16, but 39.6 / 37.1 at 32 (bench/quant_products.py;
 * results/quant_products.zen4.int8_in_place.json, int8_panels.json, and int8_in_place_to_32.json
 * from a build that read 32 rows in place). The bits are the same.
 * The integer sums are exact; each row's float sums, outliers chosen from the row alone,
 * run in the same order whatever the other rows of the product: results do not depend on
 * the batch. Rounding the inputs to int8 still costs some of the accuracy the bf16 engines
 * keep (bench/quant_quality.py measures it); quant/placement.py runs this engine where no
 * AMX tiles are, or when asked for (--prompt-products int8). Included by quant_product.h.
 */
/* The engines of the many-row products: quant_bf16.h's and this file's. */
#define QUANT_INT8_VNNI 3
#define QUANT_INT8_AVX2 4
#define INT8_OUTLIERS 4        /* each input row's largest values, multiplied in float */
#define INT8_PANEL_BLOCK 640   /* bytes of one block in a panel: 8 x 64 quants, 16 d_w, 16 c */

typedef struct { /* a value taken out of an input row, and where its weights lie */
    int32_t block; /* its block of 32 */
    int32_t index; /* its place in the block */
    float value;
} Int8Outlier;

typedef struct { /* the input rows as int8_inputs leaves them */
    int8_t *q;             /* [rows, k] */
    float *d, *dsum;       /* [rows, nb]: d_x, d_x * sum(x') */
    Int8Outlier *outliers; /* [rows, INT8_OUTLIERS] */
} Int8Inputs;

typedef struct { /* where a pass reads a group's blocks: its panel, or the weights in place */
    const uint8_t *data;
    int64_t step;          /* bytes a block */
    int quants;            /* bytes from a block's start to its quants (chunks) */
    const QuantFormat *f;  /* in place: how to read the block's scales */
    int fifths;            /* in place, 5-bit quants: bytes from a block's start to its fifth bits; else -1 */
} Int8Source;

static inline Int8Source int8_source(const QuantGroup *group, const uint8_t *panel) {
    const QuantFormat *f = &group->format;
    if (panel) return (Int8Source){panel, INT8_PANEL_BLOCK, 0, f, -1};
    return (Int8Source){group->data, QUANT_ROWS * f->block_bytes, QUANT_ROWS * f->header_bytes, f,
                        f->fifth ? QUANT_ROWS * (f->header_bytes - 4) : -1};
}

/* How a pass reads a format's blocks in place: 0 bytes, 1 plain nibbles, 2 nibbles with
 * fifth bits or a lookup (constants of int8_pass_rows, so 4-bit blocks' loops test neither). */
static inline int int8_nibbles(const QuantFormat *f) {
    return !f->nibbles ? 0 : (f->fifth || f->lookup) ? 2 : 1;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define QUANT_INT8 QUANT_INT8_VNNI
#define INT8_ROWS 4            /* input rows one pass holds: 2 groups x 4 rows, int and float sums */
#define INT8_IN_PLACE_ROWS 16  /* up to this many input rows, the weights are read in place */

static inline float int8_block_max(const float *v) {
    return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(v)), _mm512_abs_ps(_mm512_loadu_ps(v + 16))));
}

/* Moves row[k]'s INT8_OUTLIERS largest |values| (the first of equals first) into `taken`,
 * leaving zeros in their place (a zero row gives zeros at 0), and leaves each block's
 * max |value| of the rest in amax[nb]. */
static void int8_take_outliers(float *row, int k, Int8Outlier *taken, float *amax) {
    const int nb = k / QUANT_BLOCK;
    for (int b = 0; b < nb; b++) amax[b] = int8_block_max(row + b * QUANT_BLOCK);
    for (int o = 0; o < INT8_OUTLIERS; o++) {
        int top = 0;
        for (int b = 1; b < nb; b++) top = amax[b] > amax[top] ? b : top;
        float *v = row + top * QUANT_BLOCK;
        const __m512 largest = _mm512_set1_ps(amax[top]);
        const uint32_t hits = (uint32_t)_mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_loadu_ps(v)), largest, _CMP_EQ_OQ) |
                              (uint32_t)_mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_loadu_ps(v + 16)), largest, _CMP_EQ_OQ) << 16;
        const int within = hits ? __builtin_ctz(hits) : 0;
        taken[o] = (Int8Outlier){top, within, v[within]};
        v[within] = 0.0f;
        amax[top] = int8_block_max(v);
    }
}

/* x[rows, k] float32 -> each row's outliers (int8_take_outliers) and the rest as int8 rows
 * [rows, k], per block d_x and d_x * sum(x'). `rest`: k floats, `amax`: k / 32. */
static void int8_inputs(const float *x, int rows, int k, float *rest, float *amax, Int8Inputs *in) {
    const int nb = k / QUANT_BLOCK;
    for (int64_t r = 0; r < rows; r++) {
        Int8Outlier *taken = in->outliers + r * INT8_OUTLIERS;
        memcpy(rest, x + r * k, sizeof(float) * k);
        int8_take_outliers(rest, k, taken, amax);
        for (int b = 0; b < nb; b++) {
            int8_t *o = in->q + r * k + b * QUANT_BLOCK;
            const float *v = rest + b * QUANT_BLOCK;
            const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
            const float scale = amax[b] / 127.0f, inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
            /* round half to even (the default rounding), clamped to +-127 */
            const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inverse)));
            const __m512i i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inverse)));
            const __m512i top = _mm512_set1_epi32(127), bottom = _mm512_set1_epi32(-127);
            const __m512i c0 = _mm512_max_epi32(_mm512_min_epi32(i0, top), bottom);
            const __m512i c1 = _mm512_max_epi32(_mm512_min_epi32(i1, top), bottom);
            _mm_storeu_si128((__m128i *)o, _mm512_cvtepi32_epi8(c0));
            _mm_storeu_si128((__m128i *)(o + 16), _mm512_cvtepi32_epi8(c1));
            in->d[r * nb + b] = scale;
            in->dsum[r * nb + b] = scale * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(c0, c1));
        }
    }
}

/* Chunks j and j + 4 of a block (chunk c: values 4c..4c+3 of each of the 16 rows, one row per
 * 32-bit lane, as unsigned bytes). A panel and an 8-bit block (its sign bits flipped) hold
 * chunk c at quants + 64 c; a 4-bit block in place holds chunk j in the low nibbles of its 64
 * bytes at quants + 64 j, and chunk j + 4 in their high ones. A 5-bit block's `fifths` (its
 * 64 bytes of fifth bits, quant/interleave.py's order) give byte b of each lane bit j for the
 * low nibbles and bit 4 + j for the high ones, moved to bit 4 here; `lookup` (IQ4_NL) swaps
 * each nibble for its u. */
static inline __attribute__((always_inline)) void int8_chunks(const uint8_t *quants, const int nibbles, int j,
                                                              const uint8_t *fifths, const int lookup,
                                                              __m512i *lo, __m512i *hi) {
    if (nibbles) {
        const __m512i v = _mm512_loadu_si512(quants + 64 * j), low = _mm512_set1_epi8(0x0F);
        *lo = _mm512_and_si512(v, low);
        *hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        if (lookup) { /* IQ4_NL: each nibble's u */
            const __m512i table = TABLE512;
            *lo = _mm512_shuffle_epi8(table, *lo);
            *hi = _mm512_shuffle_epi8(table, *hi);
        }
        if (fifths) {
            const __m512i words = _mm512_loadu_si512(fifths), bit4 = _mm512_set1_epi8(0x10);
            *lo = _mm512_or_si512(*lo, _mm512_and_si512(_mm512_sll_epi16(words, _mm_cvtsi32_si128(4 - j)), bit4));
            *hi = _mm512_or_si512(*hi, _mm512_and_si512(_mm512_srl_epi16(words, _mm_cvtsi32_si128(j)), bit4));
        }
    } else {
        *lo = _mm512_loadu_si512(quants + 64 * j);
        *hi = _mm512_loadu_si512(quants + 64 * (4 + j));
    }
}

/* A block's 16 d_w and 16 c (w = d_w u + c) as floats: a panel's, or converted in place. */
static inline __attribute__((always_inline)) void int8_block_scales(const uint8_t *g, const QuantFormat *f,
                                                                    const int panel, __m512 *d, __m512 *c) {
    if (panel) {
        *d = _mm512_load_ps((const float *)(g + 512));
        *c = _mm512_load_ps((const float *)(g + 576));
        return;
    }
    *d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)g));
    *c = f->has_min ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(g + 32)))
                    : _mm512_mul_ps(*d, _mm512_set1_ps((float)-f->offset));
}

/* One group's blocks as a byte panel (see the top of this file): the chunks and scales a
 * pass would read in place, stored once. */
static void int8_panel(const uint8_t *group, const QuantFormat *f, int nb, uint8_t *panel) {
    const int step = QUANT_ROWS * f->block_bytes;
    for (int b = 0; b < nb; b++, panel += INT8_PANEL_BLOCK) {
        const uint8_t *g = group + (int64_t)b * step, *qs = g + QUANT_ROWS * f->header_bytes;
        prefetch_block_ahead(g, step);
        __m512 d, c;
        int8_block_scales(g, f, 0, &d, &c);
        _mm512_store_ps((float *)(panel + 512), d);
        _mm512_store_ps((float *)(panel + 576), c);
        for (int j = 0; j < 4; j++) {
            __m512i lo, hi;
            int8_chunks(qs, f->nibbles, j, fifth_words(g, f), f->lookup, &lo, &hi);
            _mm512_store_si512(panel + 64 * j, lo);
            _mm512_store_si512(panel + 64 * (4 + j), hi);
        }
    }
}

/* An outlier's 16 weights in a group as floats, w = d_w u + c (Q4: u its nibble, Q5: with its fifth bit, IQ4_NL: the nibble's u; Q8_0: its
 * byte with the sign flipped). pick[byte]: VPSHUFB's control that takes that byte of each
 * 32-bit lane and zeros the rest. */
static inline __attribute__((always_inline)) __m512 int8_outlier_weights(const Int8Source *src, const int panel,
                                                                         const Int8Outlier *o, const __m512i pick[4]) {
    const uint8_t *g = src->data + o->block * src->step;
    const int i = o->index, nibbles = !panel && src->f->nibbles, chunk = nibbles ? (i % 16) / 4 : i / 4;
    __m512i u = _mm512_shuffle_epi8(_mm512_loadu_si512(g + src->quants + 64 * chunk), pick[i % 4]);
    if (nibbles) u = _mm512_and_si512(_mm512_srli_epi32(u, i >= 16 ? 4 : 0), _mm512_set1_epi32(0x0F));
    if (nibbles && src->fifths >= 0) { /* byte i % 4 of the fifth words, bit chunk (+ 4 past value 15) */
        const __m512i high = _mm512_shuffle_epi8(_mm512_loadu_si512(g + src->fifths), pick[i % 4]);
        const __m512i bit = _mm512_and_si512(_mm512_srli_epi32(high, chunk + (i >= 16 ? 4 : 0)), _mm512_set1_epi32(1));
        u = _mm512_or_si512(u, _mm512_slli_epi32(bit, 4));
    }
    if (nibbles && src->f->lookup) /* IQ4_NL: the nibble's u, in the lane's low byte */
        u = _mm512_and_si512(_mm512_shuffle_epi8(TABLE512, u), _mm512_set1_epi32(0xFF));
    __m512 d, c;
    int8_block_scales(g, src->f, panel, &d, &c);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(u), d, c);
}

/* Two groups (32 output columns; the second may repeat the first) against input rows
 * first..last, R (<= INT8_ROWS) rows a pass: the int8 blocks, then the outliers. nibbles0/1
 * (4-bit blocks read in place: 1, or 2 where they carry fifth bits or a lookup, int8_nibbles),
 * `panel` and R are constants at each call, so the loop is built once for each case. valid[h]: group h's real rows (0: none); `next`: the pair to
 * fetch (asked for in the pass from row 0). */
static inline __attribute__((always_inline)) void int8_pass_rows(const Int8Source src[2], const int nibbles0,
                                                                 const int nibbles1, const int panel, const int R,
                                                                 int first, int last, const int valid[2], int nb,
                                                                 const Int8Inputs *in, int k, float *const out[2],
                                                                 int n, const NextGroups *next) {
    const __mmask16 keep[2] = {(__mmask16)((1u << valid[0]) - 1), (__mmask16)((1u << valid[1]) - 1)};
    __m512i pick[4];
    for (int byte = 0; byte < 4; byte++) /* byte `byte` of each lane of a 128-bit quarter; 0x80: zero */
        pick[byte] = _mm512_set4_epi32(0x80808000 | (12 + byte), 0x80808000 | (8 + byte), 0x80808000 | (4 + byte),
                                       0x80808000 | byte);
    for (int r0 = first; r0 < last; r0 += R) {
        __m512 sums[2][INT8_ROWS];
        for (int r = 0; r < R; r++) sums[0][r] = sums[1][r] = _mm512_setzero_ps();
        for (int b = 0; b < nb; b++) {
            const uint8_t *g0 = src[0].data + b * src[0].step, *g1 = src[1].data + b * src[1].step;
            const int8_t *xb = in->q + (int64_t)r0 * k + b * QUANT_BLOCK;
            if (r0 == 0) prefetch_next_block(next, b);
            __m512i dots[2][INT8_ROWS];
            for (int r = 0; r < R; r++) dots[0][r] = dots[1][r] = _mm512_setzero_si512();
            for (int j = 0; j < 4; j++) {
                __m512i a_lo, a_hi, b_lo, b_hi;
                const uint8_t *f0 = nibbles0 == 2 && src[0].fifths >= 0 ? g0 + src[0].fifths : NULL;
                const uint8_t *f1 = nibbles1 == 2 && src[1].fifths >= 0 ? g1 + src[1].fifths : NULL;
                int8_chunks(g0 + src[0].quants, nibbles0, j, f0, nibbles0 == 2 && src[0].f->lookup, &a_lo, &a_hi);
                int8_chunks(g1 + src[1].quants, nibbles1, j, f1, nibbles1 == 2 && src[1].f->lookup, &b_lo, &b_hi);
                for (int r = 0; r < R; r++) {
                    const __m512i x_lo = _mm512_set1_epi32(load_i32(xb + (int64_t)r * k + 4 * j));
                    const __m512i x_hi = _mm512_set1_epi32(load_i32(xb + (int64_t)r * k + 16 + 4 * j));
                    dots[0][r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dots[0][r], a_lo, x_lo), a_hi, x_hi);
                    dots[1][r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dots[1][r], b_lo, x_lo), b_hi, x_hi);
                }
            }
            __m512 dw[2], cw[2];
            int8_block_scales(g0, src[0].f, panel, &dw[0], &cw[0]);
            int8_block_scales(g1, src[1].f, panel, &dw[1], &cw[1]);
            for (int r = 0; r < R; r++) {
                const int64_t at = (int64_t)(r0 + r) * nb + b;
                const __m512 dx = _mm512_set1_ps(in->d[at]), sx = _mm512_set1_ps(in->dsum[at]);
                for (int h = 0; h < 2; h++) {
                    sums[h][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[h][r]), _mm512_mul_ps(dw[h], dx), sums[h][r]);
                    sums[h][r] = _mm512_fmadd_ps(cw[h], sx, sums[h][r]);
                }
            }
        }
        /* the outliers, after the blocks: 2 R independent sums at a time */
        for (int o = 0; o < INT8_OUTLIERS; o++)
            for (int r = 0; r < R; r++) {
                const Int8Outlier *taken = in->outliers + (int64_t)(r0 + r) * INT8_OUTLIERS + o;
                const __m512 v = _mm512_set1_ps(taken->value);
                sums[0][r] = _mm512_fmadd_ps(int8_outlier_weights(&src[0], panel, taken, pick), v, sums[0][r]);
                sums[1][r] = _mm512_fmadd_ps(int8_outlier_weights(&src[1], panel, taken, pick), v, sums[1][r]);
            }
        for (int r = 0; r < R; r++)
            for (int h = 0; h < 2; h++)
                if (valid[h]) _mm512_mask_storeu_ps(out[h] + (int64_t)(r0 + r) * n, keep[h], sums[h][r]);
    }
}

/* Every input row, INT8_ROWS a pass and the last pass as many as are left: 9 rows cost two
 * passes of 4 and one of 1, not three of 4 (on the LM head's 49,152 output rows, a
 * difference). */
_Static_assert(INT8_ROWS == 4, "int8_passes' last pass takes 1 to 3 rows");
static inline __attribute__((always_inline)) void int8_passes(const Int8Source src[2], const int nibbles0,
                                                              const int nibbles1, const int panel, const int valid[2],
                                                              int nb, const Int8Inputs *in, int rows, int k,
                                                              float *const out[2], int n, const NextGroups *next) {
    const int whole = rows / INT8_ROWS * INT8_ROWS;
    int8_pass_rows(src, nibbles0, nibbles1, panel, INT8_ROWS, 0, whole, valid, nb, in, k, out, n, next);
    switch (rows - whole) {
    case 1: int8_pass_rows(src, nibbles0, nibbles1, panel, 1, whole, rows, valid, nb, in, k, out, n, next); break;
    case 2: int8_pass_rows(src, nibbles0, nibbles1, panel, 2, whole, rows, valid, nb, in, k, out, n, next); break;
    case 3: int8_pass_rows(src, nibbles0, nibbles1, panel, 3, whole, rows, valid, nb, in, k, out, n, next); break;
    }
}

/* A pair of groups (`count` of them) against every input row: unpacked into `panels` first
 * where given (2 * nb * INT8_PANEL_BLOCK bytes), else read in place. */
static void int8_groups(const QuantGroup group[2], int count, uint8_t *panels, const int valid[2], int nb,
                        const Int8Inputs *in, int rows, int k, float *const out[2], int n, const NextGroups *next) {
    Int8Source src[2];
    for (int h = 0; h < count; h++) {
        uint8_t *panel = panels ? panels + (int64_t)h * nb * INT8_PANEL_BLOCK : NULL;
        if (panel) int8_panel(group[h].data, &group[h].format, nb, panel);
        src[h] = int8_source(&group[h], panel);
    }
    if (count < 2) src[1] = src[0]; /* never an unwritten panel */
    if (panels) {
        int8_passes(src, 0, 0, 1, valid, nb, in, rows, k, out, n, next);
        return;
    }
#define INT8_IN_PLACE(A, B) int8_passes(src, A, B, 0, valid, nb, in, rows, k, out, n, next)
    switch (3 * int8_nibbles(src[0].f) + int8_nibbles(src[1].f)) {
    case 0: INT8_IN_PLACE(0, 0); break;
    case 1: INT8_IN_PLACE(0, 1); break;
    case 2: INT8_IN_PLACE(0, 2); break;
    case 3: INT8_IN_PLACE(1, 0); break;
    case 4: INT8_IN_PLACE(1, 1); break;
    case 5: INT8_IN_PLACE(1, 2); break;
    case 6: INT8_IN_PLACE(2, 0); break;
    case 7: INT8_IN_PLACE(2, 1); break;
    default: INT8_IN_PLACE(2, 2); break;
    }
#undef INT8_IN_PLACE
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QUANT_INT8 QUANT_INT8_AVX2
#include "quant_int8_avx2.h"
#else
#define QUANT_INT8 0
#endif

#if QUANT_INT8
static int64_t int8_scratch_bytes(int rows, int k) {
    return (int64_t)rows * k + (int64_t)rows * (k / QUANT_BLOCK) * 8 + (int64_t)rows * INT8_OUTLIERS * (int64_t)sizeof(Int8Outlier) +
           (int64_t)k * 4 + (int64_t)(k / QUANT_BLOCK) * 4 + 64;
}

/* out[rows, n] = x[rows, k] @ W^T from int8 products. Returns 0; -2 out of memory (nothing
 * written then or partly: the caller falls back). Threads take pairs of groups. */
static int int8_product(const QuantMatrix *w, const float *x, int rows, float *out, void *scratch) {
    const int k = w->k, nb = k / QUANT_BLOCK;
    Int8Inputs in;
    in.d = (float *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    in.dsum = in.d + (int64_t)rows * nb;
    in.outliers = (Int8Outlier *)(in.dsum + (int64_t)rows * nb);
    float *rest = (float *)(in.outliers + (int64_t)rows * INT8_OUTLIERS);
    float *amax = rest + k;
    in.q = (int8_t *)(amax + nb);
    int failed = 0;
    if (rows < SHARED_INPUT_ROWS) {
        int8_inputs(x, rows, k, rest, amax, &in);
    } else { /* the rows rounded by every thread, each into its own rest and amax */
        const size_t own_bytes = ((size_t)(k + nb) * sizeof(float) + 63) & ~(size_t)63;
#pragma omp parallel
        {
            float *own = aligned_alloc(64, own_bytes);
            if (!own) {
#pragma omp atomic write
                failed = 1;
            }
#pragma omp for schedule(static)
            for (int r = 0; r < rows; r++) {
                if (!own) continue;
                Int8Inputs row = {in.q + (int64_t)r * k, in.d + (int64_t)r * nb, in.dsum + (int64_t)r * nb,
                                  in.outliers + (int64_t)r * INT8_OUTLIERS};
                int8_inputs(x + (int64_t)r * k, 1, k, own, own + k, &row);
            }
            free(own);
        }
        if (failed) return -2;
    }
    const QuantLayout l = quant_layout(w);
    const int n = l.first_row[w->count], groups = l.first_group[w->count], in_place = rows <= INT8_IN_PLACE_ROWS;
#pragma omp parallel
    {
        uint8_t *panels = in_place ? NULL : aligned_alloc(64, (size_t)2 * nb * INT8_PANEL_BLOCK);
        if (!in_place && !panels) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int pi = 0; pi < (groups + 1) / 2; pi++) {
            if (!in_place && !panels) continue;
            const GroupPair pair = group_pair(w, &l, pi, groups, out);
            const NextGroups next = next_groups(w, &l, pi, groups);
            int8_groups(pair.group, pair.count, panels, pair.valid, nb, &in, rows, k, pair.out, n, &next);
        }
        free(panels);
    }
    return failed ? -2 : 0;
}
#else
static int64_t int8_scratch_bytes(int rows, int k) { (void)rows, (void)k; return 64; }
static int int8_product(const QuantMatrix *w, const float *x, int rows, float *out, void *scratch) {
    (void)w, (void)x, (void)rows, (void)out, (void)scratch;
    return -1;
}
#endif

/* A bit (1 << engine) for each engine this library and this process can use. */
int baton_quant_panel_engines(void) { return bf16_engines() | (QUANT_INT8 ? 1 << QUANT_INT8 : 0); }

/* Bytes of scratch baton_quant_product_panels needs for `rows` input rows of `k` values, on any engine. */
int64_t baton_quant_panel_scratch_bytes(int rows, int k) {
    const int64_t bf16 = bf16_scratch_bytes(rows, k), int8 = int8_scratch_bytes(rows, k);
    return bf16 > int8 ? bf16 : int8;
}

/* out[rows, n] = x[rows, k] @ W^T on `engine` (QUANT_BF16_ANY: a bf16 engine, AMX where
 * allowed). Returns 0; -1 (nothing written) where the engine is unavailable; -2 out of memory. */
int baton_quant_product_panels(const QuantMatrix *w, const float *x, int rows, float *out, void *scratch, int engine) {
    if (engine == QUANT_INT8_VNNI || engine == QUANT_INT8_AVX2)
        return QUANT_INT8 && engine == QUANT_INT8 ? int8_product(w, x, rows, out, scratch) : -1;
    return bf16_product(w, x, rows, out, scratch, engine);
}
