/* Products on quantized weights (quant/ in Python): x[rows, k] @ W^T where W's rows are a
 * GGUF checkpoint's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 or IQ4_NL blocks (quant/formats.py) in the 16-row
 * layout of quant/interleave.py.
 * The input rows are quantized to int16 per block of 32, the integer sums
 * come from quant_kernels.h, and no weight is ever dequantized into memory, except by
 * quant_dequantize.h (prefill's tiles, embedding rows). Included by decode_step.c.
 */
#include "quant_kernels.h"

typedef struct {
    const uint8_t *data; /* the layout of quant/interleave.py */
    int format;          /* FORMAT_Q4_0 ... FORMAT_Q8_0 (quant_kernels.h) */
    int rows;
} QuantPart;

#define QUANT_MAX_PARTS 3

typedef struct { /* one matrix: parts stacked on the output axis (Q, K, V of a fused QKV) */
    int k, count;
    QuantPart parts[QUANT_MAX_PARTS];
} QuantMatrix;

const char *baton_quant_kernel(void) { return QUANT_KERNEL; }

static QuantFormat quant_format(int format) {
    switch (format) { /* nibbles, has_min, offset, block_bytes, header_bytes, fifth, lookup */
        case FORMAT_Q4_0: return (QuantFormat){1, 0, 8, 18, 2, 0, 0};
        case FORMAT_Q4_1: return (QuantFormat){1, 1, 0, 20, 4, 0, 0};
        case FORMAT_Q5_0: return (QuantFormat){1, 0, 16, 22, 6, 1, 0};
        case FORMAT_Q5_1: return (QuantFormat){1, 1, 0, 24, 8, 1, 0};
        case FORMAT_IQ4_NL: return (QuantFormat){1, 0, 128, 18, 2, 0, 1};
        default: return (QuantFormat){0, 0, 128, 34, 2, 0, 0}; /* FORMAT_Q8_0 */
    }
}

/* Bytes of scratch a QuantInput of `rows` rows of `k` values needs. */
int64_t baton_quant_input_bytes(int rows, int k) {
    return (int64_t)rows * k * 2 + (int64_t)rows * (k / QUANT_BLOCK) * 8 + 64;
}

static QuantInput quant_input_at(void *scratch, int rows, int k) {
    QuantInput in;
    const int64_t blocks = (int64_t)rows * (k / QUANT_BLOCK);
    in.d = (float *)scratch;
    in.sums = (int32_t *)(in.d + blocks);
    in.q = (int16_t *)(in.sums + blocks);
    return in;
}

/* Each block of 32 values: d = max|x| / 32767, q = round-half-even(x / d) (as
 * quant/activations.py), each 4 stored as q0 q2 q1 q3 (quant_kernels.h). */
static void quantize_input(const float *x, int rows, int k, const QuantInput *in) {
    const int nb = k / QUANT_BLOCK;
#if defined(__AVX512BW__) && QUANT_BLOCK == 32
    /* the same steps on two registers a block (the same values: one product, one rint, one
     * clamp each), stored in that order by a permutation of the 16-bit lanes */
    const __m512i order = _mm512_set_epi16(31, 29, 30, 28, 27, 25, 26, 24, 23, 21, 22, 20, 19, 17, 18, 16,
                                           15, 13, 14, 12, 11, 9, 10, 8, 7, 5, 6, 4, 3, 1, 2, 0);
    const __m512 top = _mm512_set1_ps(32767.0f), bottom = _mm512_set1_ps(-32767.0f);
    for (int64_t blk = 0; blk < (int64_t)rows * nb; blk++) {
        const float *v = x + blk * QUANT_BLOCK;
        const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const float d = amax / 32767.0f, inverse = d != 0.0f ? 1.0f / d : 0.0f;
        const __m512 scale = _mm512_set1_ps(inverse);
        const int rint = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        const __m512 r0 = _mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(_mm512_mul_ps(v0, scale), rint), bottom), top);
        const __m512 r1 = _mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(_mm512_mul_ps(v1, scale), rint), bottom), top);
        const __m512i i0 = _mm512_cvtps_epi32(r0), i1 = _mm512_cvtps_epi32(r1);
        const __m512i packed = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(i0)),
                                                  _mm512_cvtepi32_epi16(i1), 1);
        _mm512_storeu_si512(in->q + blk * QUANT_BLOCK, _mm512_permutexvar_epi16(order, packed));
        in->d[blk] = d;
        in->sums[blk] = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
    }
#else
    for (int64_t blk = 0; blk < (int64_t)rows * nb; blk++) {
        const float *v = x + blk * QUANT_BLOCK;
        float amax = 0.0f;
        for (int j = 0; j < QUANT_BLOCK; j++) amax = fabsf(v[j]) > amax ? fabsf(v[j]) : amax;
        const float d = amax / 32767.0f, inverse = d != 0.0f ? 1.0f / d : 0.0f;
        int32_t sum = 0;
        int16_t *q = in->q + blk * QUANT_BLOCK;
        for (int j = 0; j < QUANT_BLOCK; j++) {
            float r = rintf(v[j] * inverse);
            r = r > 32767.0f ? 32767.0f : (r < -32767.0f ? -32767.0f : r);
            q[(j & ~3) | (j & 1) << 1 | (j >> 1 & 1)] = (int16_t)r;
            sum += (int32_t)r;
        }
        in->d[blk] = d;
        in->sums[blk] = sum;
    }
#endif
}

typedef struct { /* where a matrix's groups of 16 weight rows and its output columns start, part by part */
    int first_group[QUANT_MAX_PARTS + 1], first_row[QUANT_MAX_PARTS + 1];
} QuantLayout;

static QuantLayout quant_layout(const QuantMatrix *w) {
    QuantLayout l;
    l.first_group[0] = l.first_row[0] = 0;
    for (int p = 0; p < w->count; p++) {
        l.first_group[p + 1] = l.first_group[p] + (w->parts[p].rows + QUANT_ROWS - 1) / QUANT_ROWS;
        l.first_row[p + 1] = l.first_row[p] + w->parts[p].rows;
    }
    return l;
}

typedef struct { /* one group of weight rows */
    const uint8_t *data; /* its blocks */
    QuantFormat format;
    int valid;  /* its real rows: a part's last group may hold fewer than QUANT_ROWS */
    int column; /* its first output column */
} QuantGroup;

/* Group gi of the matrix (counted over all parts). */
static inline QuantGroup quant_group(const QuantMatrix *w, const QuantLayout *l, int gi) {
    int p = 0;
    while (gi >= l->first_group[p + 1]) p++;
    const QuantPart *part = &w->parts[p];
    const QuantFormat f = quant_format(part->format);
    const int g = gi - l->first_group[p], left = part->rows - g * QUANT_ROWS;
    return (QuantGroup){part->data + (int64_t)g * (w->k / QUANT_BLOCK) * QUANT_ROWS * f.block_bytes, f,
                        left < QUANT_ROWS ? left : QUANT_ROWS, l->first_row[p] + g * QUANT_ROWS};
}

/* Pair `pair` of a matrix's groups, as the panel products (quant_bf16.h, quant_int8.h) take
 * them: `count` groups (1 for a last odd one), each one's real rows (0: none) and where its
 * output columns start in `out` (out itself for none). */
typedef struct {
    QuantGroup group[2];
    int count, valid[2];
    float *out[2];
} GroupPair;

static inline GroupPair group_pair(const QuantMatrix *w, const QuantLayout *l, int pair, int groups, float *out) {
    GroupPair p = {.count = 0, .valid = {0, 0}, .out = {out, out}};
    for (int h = 0; h < 2 && 2 * pair + h < groups; h++, p.count++) {
        p.group[h] = quant_group(w, l, 2 * pair + h);
        p.valid[h] = p.group[h].valid;
        p.out[h] = out + p.group[h].column;
    }
    return p;
}

/* The pair of groups a thread of the panel products unpacks after pair `pair`: its blocks,
 * and their bytes a block (NULL, 0: none). */
typedef struct {
    const uint8_t *data[2];
    int step[2];
} NextGroups;

static inline NextGroups next_groups(const QuantMatrix *w, const QuantLayout *l, int pair, int groups) {
    NextGroups next = {{NULL, NULL}, {0, 0}};
    for (int h = 0; h < 2 && 2 * pair + 2 + h < groups; h++) {
        const QuantGroup grp = quant_group(w, l, 2 * pair + 2 + h);
        next.data[h] = grp.data;
        next.step[h] = QUANT_ROWS * grp.format.block_bytes;
    }
    return next;
}

/* Ask for block b of the next pair into L2 while this pair is multiplied (its first pass of
 * input rows calls this once a block). A panel product unpacks a pair, then multiplies it:
 * fetched only when unpacked, the weights (streaming from memory once a step) left the core
 * waiting as long again as a pass takes: SmolLM2's int8 products at 16 rows on a Zen 4 core
 * went from 27.6 to 23.4 ms with this, at 4 rows from 16.3 to 11.6 (bench/quant_products.py). */
static inline __attribute__((always_inline)) void prefetch_next_block(const NextGroups *next, int b) {
    for (int h = 0; h < 2; h++)
        if (next->data[h])
            for (int line = 0; line < next->step[h]; line += 64)
                __builtin_prefetch(next->data[h] + (int64_t)b * next->step[h] + line, 0, 2);
}

/* group_dot on `nr` (1..QUANT_INPUT_ROWS) rows from r0, of a constant `KIND` */
#if QUANT_INPUT_ROWS > 4
#define GROUP_DOT_WIDE_ROWS(KIND)                                                              \
    case 4: group_dot(group, &f, nb, x, w->k, r0, 4, KIND, sums); break;                       \
    case 5: group_dot(group, &f, nb, x, w->k, r0, 5, KIND, sums); break;                       \
    case 6: group_dot(group, &f, nb, x, w->k, r0, 6, KIND, sums); break;                       \
    case 7: group_dot(group, &f, nb, x, w->k, r0, 7, KIND, sums); break;
#else
#define GROUP_DOT_WIDE_ROWS(KIND)
#endif
#define GROUP_DOT_ROWS(KIND)                                                                   \
    switch (nr) {                                                                              \
        case 1: group_dot(group, &f, nb, x, w->k, r0, 1, KIND, sums); break;                   \
        case 2: group_dot(group, &f, nb, x, w->k, r0, 2, KIND, sums); break;                   \
        case 3: group_dot(group, &f, nb, x, w->k, r0, 3, KIND, sums); break;                   \
        GROUP_DOT_WIDE_ROWS(KIND)                                                              \
        default: group_dot(group, &f, nb, x, w->k, r0, QUANT_INPUT_ROWS, KIND, sums); break;   \
    }

/* out[rows, n] = the quantized input rows @ W^T (n: all parts' rows). Threads take groups. */
static void quant_product(const QuantMatrix *w, const QuantInput *x, int rows, float *out) {
    const QuantLayout l = quant_layout(w);
    const int n = l.first_row[w->count], nb = w->k / QUANT_BLOCK;
#pragma omp parallel for schedule(static)
    for (int gi = 0; gi < l.first_group[w->count]; gi++) {
        const QuantGroup grp = quant_group(w, &l, gi);
        const uint8_t *group = grp.data;
        const QuantFormat f = grp.format;
        const int valid = grp.valid;
        float sums[QUANT_INPUT_ROWS * QUANT_ROWS];
        const int kind = quant_kind(&f);
        for (int r0 = 0; r0 < rows; r0 += QUANT_INPUT_ROWS) {
            const int nr = rows - r0 < QUANT_INPUT_ROWS ? rows - r0 : QUANT_INPUT_ROWS;
            /* constant row counts keep the accumulators in registers; a constant kind keeps
             * the other formats' tests out of the loop */
            switch (kind) {
                case QUANT_FIFTH: GROUP_DOT_ROWS(QUANT_FIFTH); break;
                case QUANT_LOOKUP: GROUP_DOT_ROWS(QUANT_LOOKUP); break;
                default: GROUP_DOT_ROWS(QUANT_PLAIN); break;
            }
            for (int r = 0; r < nr; r++)
                memcpy(out + (int64_t)(r0 + r) * n + grp.column, sums + r * QUANT_ROWS,
                       sizeof(float) * valid);
        }
    }
}

/* For ctypes (the torch path, tests): quantize x, then the product. scratch:
 * baton_quant_input_bytes(rows, w->k) bytes. */
void baton_quant_product(const QuantMatrix *w, const float *x, int rows, float *out, void *scratch) {
    const QuantInput in = quant_input_at(scratch, rows, w->k);
    quantize_input(x, rows, w->k, &in);
    quant_product(w, &in, rows, out);
}

/* The int16 form of x (in its stored order), for tests against quant/activations.py. */
void baton_quant_quantize_input(const float *x, int rows, int k, int16_t *q, float *d, int32_t *sums) {
    const QuantInput in = {q, d, sums};
    quantize_input(x, rows, k, &in);
}

/* From this many input rows, the products' engines convert them (to bf16 tiles, or to int8
 * with their outliers) on every thread: serial before the products' threads start, a
 * 256-token prompt's took 6.5% of its step on a Zen 5 core (int8) and 3.9% on a Xeon's
 * (bf16 for AMX; perf); a decode step's few rows are not worth starting the threads for. */
#define SHARED_INPUT_ROWS 32

#include "quant_dequantize.h"
#include "quant_bf16.h"
#include "quant_int8.h"
