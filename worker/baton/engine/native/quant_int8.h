/* Products on quantized weights in int8 with AVX512-VNNI (VPDPBUSD), for many input rows.
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
 * A group of 16 weight rows is unpacked once per product into a byte panel that stays in
 * L1/L2 (8 chunks of 64 bytes a block: chunk j holds values 4j..4j+3 of each row, one row
 * per 32-bit lane, then the block's 16 d_w and 16 c in float32), and every input row meets
 * it. The integer sums are exact; each row's float sums run in the same order whatever the
 * other rows of the product: results do not depend on the batch. Rounding the inputs to
 * int8 costs accuracy the bf16 engines keep (bench/quant_quality.py measures it), so this
 * engine runs only when asked for (quant/placement.py, BATON_PROMPT_PRODUCTS=int8).
 * Included by quant_product.h.
 */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define QUANT_INT8 1
#define INT8_ROWS 4            /* input rows one pass holds: 2 groups x 4 rows, int and float sums */
#define INT8_PANEL_BLOCK 640   /* bytes of one block in a panel: 8 x 64 quants, 16 d_w, 16 c */

/* x[rows, k] float32 -> int8 rows [padded, k], per block d_x and d_x * sum(x'); rows past
 * `rows` zero. */
static void int8_inputs(const float *x, int rows, int padded, int k, int8_t *q, float *d, float *dsum) {
    const int nb = k / QUANT_BLOCK;
    for (int64_t r = 0; r < padded; r++) {
        for (int b = 0; b < nb; b++) {
            int8_t *o = q + r * k + b * QUANT_BLOCK;
            if (r >= rows) {
                memset(o, 0, QUANT_BLOCK);
                d[r * nb + b] = dsum[r * nb + b] = 0.0f;
                continue;
            }
            const float *v = x + r * k + b * QUANT_BLOCK;
            const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
            const float scale = amax / 127.0f, inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
            /* round half to even (the default rounding), clamped to +-127 */
            const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inverse)));
            const __m512i i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inverse)));
            const __m512i top = _mm512_set1_epi32(127), bottom = _mm512_set1_epi32(-127);
            const __m512i c0 = _mm512_max_epi32(_mm512_min_epi32(i0, top), bottom);
            const __m512i c1 = _mm512_max_epi32(_mm512_min_epi32(i1, top), bottom);
            _mm_storeu_si128((__m128i *)o, _mm512_cvtepi32_epi8(c0));
            _mm_storeu_si128((__m128i *)(o + 16), _mm512_cvtepi32_epi8(c1));
            d[r * nb + b] = scale;
            dsum[r * nb + b] = scale * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(c0, c1));
        }
    }
}

/* One group's blocks as a byte panel (see the top of this file). */
static void int8_panel(const uint8_t *group, const QuantFormat *f, int nb, uint8_t *panel) {
    const int step = QUANT_ROWS * f->block_bytes;
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int b = 0; b < nb; b++, panel += INT8_PANEL_BLOCK) {
        const uint8_t *g = group + (int64_t)b * step;
        prefetch_block_ahead(g, step);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)g));
        const __m512 c = f->has_min ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(g + 32)))
                                    : _mm512_mul_ps(d, _mm512_set1_ps((float)-f->offset));
        _mm512_store_ps((float *)(panel + 512), d);
        _mm512_store_ps((float *)(panel + 576), c);
        const uint8_t *qs = g + QUANT_ROWS * f->header_bytes;
        if (f->nibbles) {
            /* byte i of a row's block: value i in its low nibble, value i + 16 in its high */
            for (int j = 0; j < 4; j++) {
                const __m512i v = _mm512_loadu_si512(qs + 64 * j);
                _mm512_store_si512(panel + 64 * j, _mm512_and_si512(v, low));
                _mm512_store_si512(panel + 64 * (4 + j), _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
            }
        } else {
            for (int j = 0; j < 8; j++) _mm512_store_si512(panel + 64 * j, _mm512_loadu_si512(qs + 64 * j));
        }
    }
}

/* Up to two groups' panels (32 output columns) against every input row, INT8_ROWS rows a
 * pass. valid[g]: group g's real rows (0: no second group); `next`: the pair to fetch. */
static void int8_groups(const uint8_t *panels[2], const int valid[2], int nb, const int8_t *q, const float *d,
                        const float *dsum, int rows, int k, float *out[2], int n, const NextGroups *next) {
    const __mmask16 keep[2] = {(__mmask16)((1u << valid[0]) - 1), (__mmask16)((1u << valid[1]) - 1)};
    const uint8_t *second = valid[1] ? panels[1] : panels[0];
    for (int r0 = 0; r0 < rows; r0 += INT8_ROWS) {
        __m512 sums[2][INT8_ROWS];
        for (int r = 0; r < INT8_ROWS; r++) sums[0][r] = sums[1][r] = _mm512_setzero_ps();
        for (int b = 0; b < nb; b++) {
            const uint8_t *w0 = panels[0] + (int64_t)b * INT8_PANEL_BLOCK;
            const uint8_t *w1 = second + (int64_t)b * INT8_PANEL_BLOCK;
            const int8_t *xb = q + (int64_t)r0 * k + b * QUANT_BLOCK;
            if (r0 == 0) prefetch_next_block(next, b);
            __m512i dots[2][INT8_ROWS];
            for (int r = 0; r < INT8_ROWS; r++) dots[0][r] = dots[1][r] = _mm512_setzero_si512();
            for (int j = 0; j < 8; j++) {
                const __m512i wa = _mm512_load_si512(w0 + 64 * j), wb = _mm512_load_si512(w1 + 64 * j);
                for (int r = 0; r < INT8_ROWS; r++) {
                    const __m512i xv = _mm512_set1_epi32(load_i32(xb + (int64_t)r * k + 4 * j));
                    dots[0][r] = _mm512_dpbusd_epi32(dots[0][r], wa, xv);
                    dots[1][r] = _mm512_dpbusd_epi32(dots[1][r], wb, xv);
                }
            }
            const __m512 dw[2] = {_mm512_load_ps((const float *)(w0 + 512)), _mm512_load_ps((const float *)(w1 + 512))};
            const __m512 cw[2] = {_mm512_load_ps((const float *)(w0 + 576)), _mm512_load_ps((const float *)(w1 + 576))};
            for (int r = 0; r < INT8_ROWS; r++) {
                const int64_t at = (int64_t)(r0 + r) * nb + b;
                const __m512 dx = _mm512_set1_ps(d[at]), sx = _mm512_set1_ps(dsum[at]);
                for (int g = 0; g < 2; g++) {
                    sums[g][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[g][r]), _mm512_mul_ps(dw[g], dx), sums[g][r]);
                    sums[g][r] = _mm512_fmadd_ps(cw[g], sx, sums[g][r]);
                }
            }
        }
        for (int r = 0; r < INT8_ROWS && r0 + r < rows; r++)
            for (int g = 0; g < 2; g++)
                if (valid[g]) _mm512_mask_storeu_ps(out[g] + (int64_t)(r0 + r) * n, keep[g], sums[g][r]);
    }
}

static int64_t int8_scratch_bytes(int rows, int k) {
    const int64_t padded = (rows + INT8_ROWS - 1) / INT8_ROWS * INT8_ROWS;
    return padded * k + padded * (k / QUANT_BLOCK) * 8 + 64;
}

/* out[rows, n] = x[rows, k] @ W^T from int8 products. Returns 0; -2 out of memory (nothing
 * written then or partly: the caller falls back). Threads take pairs of groups. */
static int int8_product(const QuantMatrix *w, const float *x, int rows, float *out, void *scratch) {
    const int k = w->k, nb = k / QUANT_BLOCK, padded = (rows + INT8_ROWS - 1) / INT8_ROWS * INT8_ROWS;
    float *d = (float *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    float *dsum = d + (int64_t)padded * nb;
    int8_t *q = (int8_t *)(dsum + (int64_t)padded * nb);
    int8_inputs(x, rows, padded, k, q, d, dsum);
    const QuantLayout l = quant_layout(w);
    const int n = l.first_row[w->count], groups = l.first_group[w->count];
    int failed = 0;
#pragma omp parallel
    {
        uint8_t *space = aligned_alloc(64, (size_t)2 * nb * INT8_PANEL_BLOCK);
        if (!space) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int pi = 0; pi < (groups + 1) / 2; pi++) {
            if (!space) continue;
            const uint8_t *panels[2] = {space, space + (int64_t)nb * INT8_PANEL_BLOCK};
            GroupPair pair = group_pair(w, &l, pi, groups, out);
            for (int h = 0; h < pair.count; h++)
                int8_panel(pair.group[h].data, &pair.group[h].format, nb, (uint8_t *)panels[h]);
            const NextGroups next = next_groups(w, &l, pi, groups);
            int8_groups(panels, pair.valid, nb, q, d, dsum, rows, k, pair.out, n, &next);
        }
        free(space);
    }
    return failed ? -2 : 0;
}
#else
#define QUANT_INT8 0
static int64_t int8_scratch_bytes(int rows, int k) { (void)rows, (void)k; return 64; }
static int int8_product(const QuantMatrix *w, const float *x, int rows, float *out, void *scratch) {
    (void)w, (void)x, (void)rows, (void)out, (void)scratch;
    return -1;
}
#endif

/* The engines of the many-row products: quant_bf16.h's and this file's. */
#define QUANT_INT8_VNNI 3

/* A bit (1 << engine) for each engine this library and this process can use. */
int baton_quant_panel_engines(void) { return bf16_engines() | (QUANT_INT8 ? 1 << QUANT_INT8_VNNI : 0); }

/* Bytes of scratch baton_quant_product_panels needs for `rows` input rows of `k` values, on any engine. */
int64_t baton_quant_panel_scratch_bytes(int rows, int k) {
    const int64_t bf16 = bf16_scratch_bytes(rows, k), int8 = int8_scratch_bytes(rows, k);
    return bf16 > int8 ? bf16 : int8;
}

/* out[rows, n] = x[rows, k] @ W^T on `engine` (QUANT_BF16_ANY: a bf16 engine, AMX where
 * allowed). Returns 0; -1 (nothing written) where the engine is unavailable; -2 out of memory. */
int baton_quant_product_panels(const QuantMatrix *w, const float *x, int rows, float *out, void *scratch, int engine) {
    if (engine == QUANT_INT8_VNNI) return QUANT_INT8 ? int8_product(w, x, rows, out, scratch) : -1;
    return bf16_product(w, x, rows, out, scratch, engine);
}
