/* One group of 16 quantized weight rows (quant/interleave.py's layout) against up to
 * QUANT_INPUT_ROWS int16 input rows: the integer dot products of every block, then each
 * block's scales. Which instructions compute the integer sums is chosen when the library is
 * compiled for this CPU (-march=native), from the best it has:
 *
 *   vnni512  AVX512-VNNI: VPDPWSSD, 32 s16 x s16 products summed into 16 int32 a step
 *   avx512   AVX512BW:    VPMADDWD + VPADDD on 512-bit registers
 *   avx2     AVX2 + FMA + F16C: the same on 256-bit registers, two per group
 *   scalar   portable C
 *
 * Each 32-bit lane holds two weights of one row (its row's lane in the group), taken from
 * the stored bytes with one shift and one mask, and meets a pair of inputs broadcast to
 * every lane; quantize_input stores each 4 inputs as x0 x2 x1 x3 so that the pairs the
 * lanes hold, (0, 2) and (1, 3), are adjacent. The integer sums are exact in each variant;
 * only the float scaling rounds, the same way for any number of input rows, so a row's
 * output does not depend on what it is batched with. Included by quant_product.h.
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define QUANT_ROWS 16       /* weight rows in one group (quant/interleave.py ROWS) */
/* input rows sharing one pass over a group's weights: as many as keep their accumulators in
 * registers (32 vector registers with AVX-512, 16 otherwise) */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define QUANT_INPUT_ROWS 8
#else
#define QUANT_INPUT_ROWS 4
#endif
#define QUANT_BLOCK 32

/* ggml's type ids */
enum { FORMAT_Q4_0 = 2, FORMAT_Q4_1 = 3, FORMAT_Q5_0 = 6, FORMAT_Q5_1 = 7, FORMAT_Q8_0 = 8, FORMAT_IQ4_NL = 20 };

/* IQ4_NL's 16 levels + 128 (quant/formats.py IQ4_NL_LEVELS): the u a nibble stands for, with
 * offset 128; also the byte-shuffle tables' 16 entries. */
static const uint8_t IQ4_NL_U[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};

typedef struct { /* a product's input rows in int16 (quant/activations.py) */
    int16_t *q;    /* [rows, k], each 4 values stored as x0 x2 x1 x3 */
    float *d;      /* [rows, k / 32]: scales */
    int32_t *sums; /* [rows, k / 32]: quant sums */
} QuantInput;

typedef struct {
    int nibbles, has_min, offset, block_bytes;
    int header_bytes; /* a row's bytes before its quants: scales, then fifth bits where there are */
    int fifth;        /* 5-bit quants: 4 bytes of fifth bits a row, after the scales */
    int lookup;       /* nibbles stand for IQ4_NL_U's values, not themselves */
} QuantFormat;

static inline int32_t load_i32(const void *p) { int32_t v; memcpy(&v, p, 4); return v; }

/* How a block's nibbles are read: as they are, with fifth bits, or through IQ4_NL_U. A
 * constant argument of group_dot, so each kind's loop carries no test of the others. */
enum { QUANT_PLAIN = 0, QUANT_FIFTH = 1, QUANT_LOOKUP = 2 };
static inline int quant_kind(const QuantFormat *f) {
    return f->lookup ? QUANT_LOOKUP : f->fifth ? QUANT_FIFTH : QUANT_PLAIN;
}

/* A group block's fifth-bit words (16 rows x 4 bytes, quant/interleave.py's order: byte b of
 * a row's word holds in bit j the fifth bit of byte b of chunk j's low nibbles, in bit 4 + j
 * that of its high nibbles), or NULL for formats without. */
static inline const uint8_t *fifth_words(const uint8_t *g, const QuantFormat *f) {
    return f->fifth ? g + QUANT_ROWS * (f->header_bytes - 4) : NULL;
}

/* The u of the two values a nibble byte of chunk c holds, low and high nibble: with their
 * fifth bits from `high`, the byte of the row's fifth-bit word beside it (bit c, bit 4 + c;
 * 0 without), and through IQ4_NL_U where the format looks them up. The scalar paths' form. */
static inline void nibble_pair_u(const QuantFormat *f, uint8_t byte, uint8_t high, int c, int *lo, int *hi) {
    *lo = (byte & 0x0F) | ((high >> c) & 1) << 4;
    *hi = (byte >> 4) | ((high >> (4 + c)) & 1) << 4;
    if (f->lookup) { *lo = IQ4_NL_U[*lo]; *hi = IQ4_NL_U[*hi]; }
}

/* Ask for the block QUANT_PREFETCH_BLOCKS ahead of block `g` (`step` bytes each) while this
 * one is multiplied. The weights stream from memory once a step and the hardware's own
 * prefetch left one core waiting on them: on a Xeon with AMX this took SmolLM2's products at
 * 8 rows from 21.7 to 13.3 ms (int16) and 22.9 to 16.1 ms (AMX tiles), one thread
 * (bench/quant_products.py). A prefetch past the matrix's end is harmless: it never faults. */
#define QUANT_PREFETCH_BLOCKS 8
static inline __attribute__((always_inline)) void prefetch_block_ahead(const uint8_t *g, int step) {
    const uint8_t *ahead = g + (int64_t)QUANT_PREFETCH_BLOCKS * step;
    for (int line = 0; line < step; line += 64) __builtin_prefetch(ahead + line, 0, 3);
}

/* IEEE half -> float, exact (subnormals included), without F16C */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
    uint32_t bits;
    if (exponent == 0x1F) bits = sign | 0x7F800000u | (mantissa << 13);
    else if (exponent) bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    else if (!mantissa) bits = sign;
    else { /* subnormal: normalize */
        int e = -1;
        uint32_t mm = mantissa;
        do { e++; mm <<= 1; } while (!(mm & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((mm & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* The (weights, input pair offset) of one block: for 4-bit quants, chunk c's 16-bit halves
 * hold bytes 4c..4c+3 of each row; a byte's low nibble is value j, its high nibble j + 16.
 * For 8-bit quants, chunk c holds values 4c..4c+3. `EXTRACT(v, shift, mask)` makes a
 * register of 16-bit weights; DOT adds their products with the input pair at `offset`.
 * 5-bit quants: the nibbles EXTRACT(v, s) takes have their fifth bits at bit s + c of each
 * 16-bit half of the fifth words (`fh`, quant/interleave.py's order); FIFTH(w, fh, s) moves
 * them, shifted right by c, to bit 4 and ors them in. IQ4_NL: LOOKUP(w, table) swaps each
 * 16-bit nibble for its u, a byte shuffle (the zero high byte's lookup masked off). */
#define BLOCK_PRODUCTS(LOAD, EXTRACT, DOT, FIFTH, SHIFT_RIGHT, LOOKUP, TABLE)                  \
    if (kind == QUANT_LOOKUP) {                                                                \
        const VEC table = TABLE;                                                               \
        for (int c = 0; c < 4; c++) {                                                          \
            const VEC v = LOAD(qs + 64 * c);                                                   \
            DOT(LOOKUP(EXTRACT(v, 0, 0x000F), table), 4 * c);                                  \
            DOT(LOOKUP(EXTRACT(v, 8, 0x000F), table), 4 * c + 2);                              \
            DOT(LOOKUP(EXTRACT(v, 4, 0x000F), table), 16 + 4 * c);                             \
            DOT(LOOKUP(EXTRACT(v, 12, 0x000F), table), 16 + 4 * c + 2);                        \
        }                                                                                      \
    } else if (kind == QUANT_FIFTH) {                                                          \
        const VEC fw = LOAD(fifths);                                                           \
        for (int c = 0; c < 4; c++) {                                                          \
            const VEC v = LOAD(qs + 64 * c), fh = SHIFT_RIGHT(fw, c);                          \
            DOT(FIFTH(EXTRACT(v, 0, 0x000F), fh, 0), 4 * c);                                   \
            DOT(FIFTH(EXTRACT(v, 8, 0x000F), fh, 8), 4 * c + 2);                               \
            DOT(FIFTH(EXTRACT(v, 4, 0x000F), fh, 4), 16 + 4 * c);                              \
            DOT(FIFTH(EXTRACT(v, 12, 0x000F), fh, 12), 16 + 4 * c + 2);                        \
        }                                                                                      \
    } else if (f->nibbles) {                                                                   \
        for (int c = 0; c < 4; c++) {                                                          \
            const VEC v = LOAD(qs + 64 * c);                                                   \
            DOT(EXTRACT(v, 0, 0x000F), 4 * c);                                                 \
            DOT(EXTRACT(v, 8, 0x000F), 4 * c + 2);                                             \
            DOT(EXTRACT(v, 4, 0x000F), 16 + 4 * c);                                            \
            DOT(EXTRACT(v, 12, 0x000F), 16 + 4 * c + 2);                                       \
        }                                                                                      \
    } else {                                                                                   \
        for (int c = 0; c < 8; c++) {                                                          \
            const VEC v = LOAD(qs + 64 * c);                                                   \
            DOT(EXTRACT(v, 0, 0x00FF), 4 * c);                                                 \
            DOT(EXTRACT(v, 8, 0x00FF), 4 * c + 2);                                             \
        }                                                                                      \
    }

#if defined(__AVX512F__) && defined(__AVX512BW__)
#if defined(__AVX512VNNI__)
#define QUANT_KERNEL "vnni512"
#define DOT2(acc, w, x) _mm512_dpwssd_epi32(acc, w, x)
#else
#define QUANT_KERNEL "avx512"
#define DOT2(acc, w, x) _mm512_add_epi32(acc, _mm512_madd_epi16(w, x))
#endif
#define VEC __m512i
#define LOAD512(p) _mm512_loadu_si512(p)
#define EXTRACT512(v, shift, mask) _mm512_and_si512(_mm512_srli_epi16(v, shift), _mm512_set1_epi16(mask))
#define SHIFT_RIGHT512(v, c) _mm512_srl_epi16(v, _mm_cvtsi32_si128(c))
#define TABLE512 _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)IQ4_NL_U))
#define LOOKUP512(w, table) _mm512_and_si512(_mm512_shuffle_epi8(table, w), _mm512_set1_epi16(0x00FF))
/* s = 0: the fifth bits sit below bit 4 (left by 4); else right by s - 4. w | (bits & 0x10)
 * in one ternary-logic instruction (0xF8: a | (b & c)). */
#define FIFTH512(w, fh, s)                                                                     \
    _mm512_ternarylogic_epi32(w, (s) ? _mm512_srli_epi16(fh, (s) ? (s) - 4 : 0) : _mm512_slli_epi16(fh, 4), \
                              _mm512_set1_epi16(0x0010), 0xF8)

static inline __attribute__((always_inline)) void group_dot(
    const uint8_t *g, const QuantFormat *f, int nb, const QuantInput *x, int k, int r0,
    const int nr, const int kind, float *out) {
    __m512 acc[QUANT_INPUT_ROWS];
    for (int r = 0; r < nr; r++) acc[r] = _mm512_setzero_ps();
    const int nbk = k / QUANT_BLOCK, step = QUANT_ROWS * f->block_bytes;
    for (int b = 0; b < nb; b++, g += step) {
        prefetch_block_ahead(g, step);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)g));
        const __m512 m = f->has_min ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(g + 32)))
                                    : _mm512_setzero_ps();
        const uint8_t *qs = g + QUANT_ROWS * f->header_bytes;
        const uint8_t *fifths = kind == QUANT_FIFTH ? fifth_words(g, f) : NULL;
        __m512i s[QUANT_INPUT_ROWS];
        for (int r = 0; r < nr; r++) s[r] = _mm512_setzero_si512();
        const int16_t *xq = x->q + (int64_t)r0 * k + b * QUANT_BLOCK;
#define DOT_ROWS512(w, offset)                                                                 \
    {                                                                                          \
        const __m512i weights = (w);                                                           \
        for (int r = 0; r < nr; r++)                                                           \
            s[r] = DOT2(s[r], weights, _mm512_set1_epi32(load_i32(xq + (int64_t)r * k + (offset)))); \
    }
        BLOCK_PRODUCTS(LOAD512, EXTRACT512, DOT_ROWS512, FIFTH512, SHIFT_RIGHT512, LOOKUP512, TABLE512)
#undef DOT_ROWS512
        for (int r = 0; r < nr; r++) {
            const int64_t at = (int64_t)(r0 + r) * nbk + b;
            const int32_t sum = x->sums[at];
            if (f->offset) s[r] = _mm512_sub_epi32(s[r], _mm512_set1_epi32(f->offset * sum));
            const float dx = x->d[at];
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(dx)), _mm512_cvtepi32_ps(s[r]), acc[r]);
            if (f->has_min) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(dx * (float)sum), acc[r]);
        }
    }
    for (int r = 0; r < nr; r++) _mm512_storeu_ps(out + r * QUANT_ROWS, acc[r]);
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QUANT_KERNEL "avx2"
#define VEC __m256i
#define EXTRACT256(v, shift, mask) _mm256_and_si256(_mm256_srli_epi16(v, shift), _mm256_set1_epi16(mask))
#define SHIFT_RIGHT256(v, c) _mm256_srl_epi16(v, _mm_cvtsi32_si128(c))
#define TABLE256 _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_NL_U))
#define LOOKUP256(w, table) _mm256_and_si256(_mm256_shuffle_epi8(table, w), _mm256_set1_epi16(0x00FF))
#define FIFTH256(w, fh, s)                                                                     \
    _mm256_or_si256(w, _mm256_and_si256((s) ? _mm256_srli_epi16(fh, (s) ? (s) - 4 : 0) : _mm256_slli_epi16(fh, 4), \
                                        _mm256_set1_epi16(0x0010)))

/* The group as two halves of 8 rows, one 256-bit register each. */
static inline __attribute__((always_inline)) void group_dot(
    const uint8_t *g, const QuantFormat *f, int nb, const QuantInput *x, int k, int r0,
    const int nr, const int kind, float *out) {
    __m256 acc[QUANT_INPUT_ROWS][2];
    for (int r = 0; r < nr; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const int nbk = k / QUANT_BLOCK, step = QUANT_ROWS * f->block_bytes;
    for (int b = 0; b < nb; b++, g += step) {
        prefetch_block_ahead(g, step);
        const int16_t *xq = x->q + (int64_t)r0 * k + b * QUANT_BLOCK;
        for (int half = 0; half < 2; half++) {
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 16 * half)));
            const __m256 m = f->has_min ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 32 + 16 * half)))
                                        : _mm256_setzero_ps();
            const uint8_t *qs = g + QUANT_ROWS * f->header_bytes + 32 * half;
            const uint8_t *fifths = kind == QUANT_FIFTH ? fifth_words(g, f) + 32 * half : NULL;
            __m256i s[QUANT_INPUT_ROWS];
            for (int r = 0; r < nr; r++) s[r] = _mm256_setzero_si256();
#define LOAD256(p) _mm256_loadu_si256((const __m256i *)(p))
#define DOT_ROWS256(w, offset)                                                                 \
    {                                                                                          \
        const __m256i weights = (w);                                                           \
        for (int r = 0; r < nr; r++)                                                           \
            s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(weights, _mm256_set1_epi32(        \
                                              load_i32(xq + (int64_t)r * k + (offset)))));     \
    }
            BLOCK_PRODUCTS(LOAD256, EXTRACT256, DOT_ROWS256, FIFTH256, SHIFT_RIGHT256, LOOKUP256, TABLE256)
#undef DOT_ROWS256
            for (int r = 0; r < nr; r++) {
                const int64_t at = (int64_t)(r0 + r) * nbk + b;
                const int32_t sum = x->sums[at];
                if (f->offset) s[r] = _mm256_sub_epi32(s[r], _mm256_set1_epi32(f->offset * sum));
                const float dx = x->d[at];
                acc[r][half] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(dx)), _mm256_cvtepi32_ps(s[r]),
                                               acc[r][half]);
                if (f->has_min) acc[r][half] = _mm256_fmadd_ps(m, _mm256_set1_ps(dx * (float)sum), acc[r][half]);
            }
        }
    }
    for (int r = 0; r < nr; r++) {
        _mm256_storeu_ps(out + r * QUANT_ROWS, acc[r][0]);
        _mm256_storeu_ps(out + r * QUANT_ROWS + 8, acc[r][1]);
    }
}

#else
#define QUANT_KERNEL "scalar"

static void group_dot(const uint8_t *g, const QuantFormat *f, int nb, const QuantInput *x, int k,
                      int r0, const int nr, const int kind, float *out) {
    (void)kind; /* the format says */
    const int nbk = k / QUANT_BLOCK, step = QUANT_ROWS * f->block_bytes;
    for (int i = 0; i < nr * QUANT_ROWS; i++) out[i] = 0.0f;
    for (int b = 0; b < nb; b++, g += step) {
        const uint8_t *qs = g + QUANT_ROWS * f->header_bytes;
        for (int lane = 0; lane < QUANT_ROWS; lane++) {
            uint16_t bits;
            memcpy(&bits, g + 2 * lane, 2);
            const float d = half_to_float(bits);
            float m = 0.0f;
            if (f->has_min) { memcpy(&bits, g + 32 + 2 * lane, 2); m = half_to_float(bits); }
            int32_t u[QUANT_BLOCK]; /* in the inputs' stored order (x0 x2 x1 x3) */
            const uint8_t *fifths = fifth_words(g, f);
            for (int c = 0; c < (f->nibbles ? 4 : 8); c++)
                for (int j = 0; j < 4; j++) {
                    const uint8_t byte = qs[64 * c + 4 * lane + j];
                    const int at = 4 * c + ((j & 1) << 1 | j >> 1);
                    if (f->nibbles) nibble_pair_u(f, byte, fifths ? fifths[4 * lane + j] : 0, c, &u[at], &u[16 + at]);
                    else u[at] = byte;
                }
            for (int r = 0; r < nr; r++) {
                const int row = r0 + r;
                const int16_t *xq = x->q + (int64_t)row * k + b * QUANT_BLOCK;
                int32_t s = 0;
                for (int j = 0; j < QUANT_BLOCK; j++) s += u[j] * xq[j];
                const int32_t sum = x->sums[(int64_t)row * nbk + b];
                s -= f->offset * sum;
                const float dx = x->d[(int64_t)row * nbk + b];
                float *o = out + r * QUANT_ROWS + lane;
                *o += (d * dx) * (float)s;
                if (f->has_min) *o += m * (dx * (float)sum);
            }
        }
    }
}
#endif
