/* quant_int8.h's int8 products on AVX2, for CPUs without AVX512-VNNI (AMD's Zen 1-3, Intel's
 * cores before Ice Lake, Skylake-X's AVX-512 without VNNI): the same inputs (each row's
 * INT8_OUTLIERS largest values in float, the rest rounded to int8 per block of 32), the same
 * panels and the same exact integer sums, so the same values up to float rounding.
 *
 * VPMADDUBSW multiplies 32 unsigned weight bytes by 32 signed input bytes and adds the
 * products in pairs into 16-bit lanes, with signed saturation; VPMADDWD by ones then adds
 * those pairs into the 32-bit lane of their row. A 4- or 5-bit quant (u <= 31) against an
 * input of at most 127 keeps a pair below 2 * 31 * 127 = 7,874, so pairs of several chunks
 * add in 16 bits before one VPMADDWD widens them: 2.25 multiply instructions per 64
 * products of 4-bit quants, against the int16 kernels' 4. SmolLM2's products on one Zen 3 core
 * (bench/quant_products.py): 26.3 ms at 8 rows against the int16 kernels' 32.5, 86.1
 * against 125.9 at 32, 723 against 1,143 at 256. An 8-bit quant or an IQ4_NL level (u up to 255) would saturate:
 * those weights are taken signed (u - 128) and multiplied as |w| against the input with w's
 * sign (VPSIGNB), a pair at most 2 * 128 * 127 = 32,512; their blocks then add 128 d_w to c,
 * as sum u x = sum (u - 128) x + 128 sum x.
 *
 * A group of 16 weight rows is two halves of 8, one 256-bit register each (a row's 4 bytes a
 * 32-bit lane, as in quant_int8.h's chunks); a pass takes one half against INT8_ROWS input
 * rows, so its sums stay in the 16 registers (both halves a pass, each input broadcast
 * feeding twice the products, measured no faster: 64-68 against 68-73 ms at 32 rows, 525-553
 * against 517-549 at 256, alternating). Included by quant_int8.h.
 */
#define INT8_ROWS 4            /* input rows one pass holds */
#define INT8_IN_PLACE_ROWS 16  /* up to this many input rows, the weights are read in place */

static inline float int8_block_max(const float *v) { /* max |v[0..31]| */
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 a = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(v)), _mm256_andnot_ps(sign, _mm256_loadu_ps(v + 8)));
    const __m256 b = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(v + 16)), _mm256_andnot_ps(sign, _mm256_loadu_ps(v + 24)));
    const __m256 m = _mm256_max_ps(a, b);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
}

/* As quant_int8.h's: row[k]'s INT8_OUTLIERS largest |values| (the first of equals first)
 * into `taken`, zeros in their place; each block's max |value| of the rest in amax[nb]. */
static void int8_take_outliers(float *row, int k, Int8Outlier *taken, float *amax) {
    const int nb = k / QUANT_BLOCK;
    for (int b = 0; b < nb; b++) amax[b] = int8_block_max(row + b * QUANT_BLOCK);
    for (int o = 0; o < INT8_OUTLIERS; o++) {
        int top = 0;
        for (int b = 1; b < nb; b++) top = amax[b] > amax[top] ? b : top;
        float *v = row + top * QUANT_BLOCK;
        int within = 0;
        while (within < QUANT_BLOCK && fabsf(v[within]) != amax[top]) within++;
        within = within < QUANT_BLOCK ? within : 0;
        taken[o] = (Int8Outlier){top, within, v[within]};
        v[within] = 0.0f;
        amax[top] = int8_block_max(v);
    }
}

/* x[rows, k] float32 -> each row's outliers and the rest as int8 rows (round half to even,
 * clamped to +-127), per block d_x and d_x * sum(x'), as quant_int8.h's. `rest`: k floats,
 * `amax`: k / 32. */
static void int8_inputs(const float *x, int rows, int k, float *rest, float *amax, Int8Inputs *in) {
    const int nb = k / QUANT_BLOCK;
    const __m256i top = _mm256_set1_epi32(127), bottom = _mm256_set1_epi32(-127);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* undoes the packs' lane interleave */
    for (int64_t r = 0; r < rows; r++) {
        memcpy(rest, x + r * k, sizeof(float) * k);
        int8_take_outliers(rest, k, in->outliers + r * INT8_OUTLIERS, amax);
        for (int b = 0; b < nb; b++) {
            const float *v = rest + b * QUANT_BLOCK;
            const float scale = amax[b] / 127.0f, inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
            __m256i q[4], total = _mm256_setzero_si256();
            for (int i = 0; i < 4; i++) {
                const __m256i rounded = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 8 * i), _mm256_set1_ps(inverse)));
                q[i] = _mm256_max_epi32(_mm256_min_epi32(rounded, top), bottom);
                total = _mm256_add_epi32(total, q[i]);
            }
            const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            _mm256_storeu_si256((__m256i *)(in->q + r * k + b * QUANT_BLOCK), _mm256_permutevar8x32_epi32(bytes, order));
            __m128i s = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
            s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
            s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
            in->d[r * nb + b] = scale;
            in->dsum[r * nb + b] = scale * (float)_mm_cvtsi128_si32(s);
        }
    }
}

#define INT8_TABLE256 _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_NL_U))

/* Chunks j and j + 4 of half `half` of a block (rows 8 half .. 8 half + 7), as quant_int8.h's
 * int8_chunks reads the whole block. */
static inline __attribute__((always_inline)) void int8_chunks(const uint8_t *quants, const int nibbles, int j,
                                                              const uint8_t *fifths, const int lookup, int half,
                                                              __m256i *lo, __m256i *hi) {
    if (!nibbles) {
        *lo = _mm256_loadu_si256((const __m256i *)(quants + 64 * j + 32 * half));
        *hi = _mm256_loadu_si256((const __m256i *)(quants + 64 * (4 + j) + 32 * half));
        return;
    }
    const __m256i v = _mm256_loadu_si256((const __m256i *)(quants + 64 * j + 32 * half)), low = _mm256_set1_epi8(0x0F);
    *lo = _mm256_and_si256(v, low);
    *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    if (lookup) {
        *lo = _mm256_shuffle_epi8(INT8_TABLE256, *lo);
        *hi = _mm256_shuffle_epi8(INT8_TABLE256, *hi);
    }
    if (fifths) {
        const __m256i words = _mm256_loadu_si256((const __m256i *)(fifths + 32 * half)), bit4 = _mm256_set1_epi8(0x10);
        *lo = _mm256_or_si256(*lo, _mm256_and_si256(_mm256_sll_epi16(words, _mm_cvtsi32_si128(4 - j)), bit4));
        *hi = _mm256_or_si256(*hi, _mm256_and_si256(_mm256_srl_epi16(words, _mm_cvtsi32_si128(j)), bit4));
    }
}

/* Half `half` of a block's d_w and c (w = d_w u + c): a panel's, or converted in place. */
static inline __attribute__((always_inline)) void int8_block_scales(const uint8_t *g, const QuantFormat *f,
                                                                    const int panel, int half, __m256 *d, __m256 *c) {
    if (panel) {
        *d = _mm256_load_ps((const float *)(g + 512 + 32 * half));
        *c = _mm256_load_ps((const float *)(g + 576 + 32 * half));
        return;
    }
    *d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 16 * half)));
    *c = f->has_min ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 32 + 16 * half)))
                    : _mm256_mul_ps(*d, _mm256_set1_ps((float)-f->offset));
}

/* One group's blocks as quant_int8.h's byte panel. */
static void int8_panel(const uint8_t *group, const QuantFormat *f, int nb, uint8_t *panel) {
    const int step = QUANT_ROWS * f->block_bytes;
    for (int b = 0; b < nb; b++, panel += INT8_PANEL_BLOCK) {
        const uint8_t *g = group + (int64_t)b * step, *qs = g + QUANT_ROWS * f->header_bytes;
        prefetch_block_ahead(g, step);
        for (int half = 0; half < 2; half++) {
            __m256 d, c;
            int8_block_scales(g, f, 0, half, &d, &c);
            _mm256_store_ps((float *)(panel + 512 + 32 * half), d);
            _mm256_store_ps((float *)(panel + 576 + 32 * half), c);
            for (int j = 0; j < 4; j++) {
                __m256i lo, hi;
                int8_chunks(qs, f->nibbles, j, fifth_words(g, f), f->lookup, half, &lo, &hi);
                _mm256_store_si256((__m256i *)(panel + 64 * j + 32 * half), lo);
                _mm256_store_si256((__m256i *)(panel + 64 * (4 + j) + 32 * half), hi);
            }
        }
    }
}

/* An outlier's 8 weights in half `half` of a group as floats, w = d_w u + c, as quant_int8.h's
 * int8_outlier_weights. */
static inline __attribute__((always_inline)) __m256 int8_outlier_weights(const Int8Source *src, const int panel,
                                                                         const Int8Outlier *o, int half,
                                                                         const __m256i pick[4]) {
    const uint8_t *g = src->data + o->block * src->step;
    const int i = o->index, nibbles = !panel && src->f->nibbles, chunk = nibbles ? (i % 16) / 4 : i / 4;
    const __m256i *chunk_at = (const __m256i *)(g + src->quants + 64 * chunk + 32 * half);
    __m256i u = _mm256_shuffle_epi8(_mm256_loadu_si256(chunk_at), pick[i % 4]);
    if (nibbles) u = _mm256_and_si256(_mm256_srl_epi32(u, _mm_cvtsi32_si128(i >= 16 ? 4 : 0)), _mm256_set1_epi32(0x0F));
    if (nibbles && src->fifths >= 0) {
        const __m256i high = _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)(g + src->fifths + 32 * half)), pick[i % 4]);
        const __m256i bit = _mm256_and_si256(_mm256_srl_epi32(high, _mm_cvtsi32_si128(chunk + (i >= 16 ? 4 : 0))),
                                             _mm256_set1_epi32(1));
        u = _mm256_or_si256(u, _mm256_slli_epi32(bit, 4));
    }
    if (nibbles && src->f->lookup) u = _mm256_and_si256(_mm256_shuffle_epi8(INT8_TABLE256, u), _mm256_set1_epi32(0xFF));
    __m256 d, c;
    int8_block_scales(g, src->f, panel, half, &d, &c);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(u), d, c);
}

/* A block's integer sums, half `half` against R input rows (`xb`, k apart), for weights
 * below 32: all 4 chunk pairs unpacked first and kept in registers, then each row in turn, its
 * pairs added in 16 bits over `span` chunks before one widening. */
static inline __attribute__((always_inline)) void int8_unsigned_dots(const uint8_t *quants, const int nibbles,
                                                                     const uint8_t *fifths, const int span, int half,
                                                                     const int8_t *xb, int k, const int R,
                                                                     __m256i dots[]) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i lo[4], hi[4];
    for (int j = 0; j < 4; j++) int8_chunks(quants, nibbles, j, fifths, 0, half, &lo[j], &hi[j]);
    for (int r = 0; r < R; r++) {
        const int8_t *x = xb + (int64_t)r * k;
        __m256i pairs = _mm256_setzero_si256(), dot = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            const __m256i both = _mm256_add_epi16(_mm256_maddubs_epi16(lo[j], _mm256_set1_epi32(load_i32(x + 4 * j))),
                                                  _mm256_maddubs_epi16(hi[j], _mm256_set1_epi32(load_i32(x + 16 + 4 * j))));
            pairs = j % span ? _mm256_add_epi16(pairs, both) : both;
            if (j % span == span - 1) dot = _mm256_add_epi32(dot, _mm256_madd_epi16(pairs, ones));
        }
        dots[r] = dot;
    }
}

/* The same for weights past 31 (8-bit quants, IQ4_NL's levels), taken signed, w = u - 128,
 * and multiplied as |w| by the input with w's sign: each product pair widened on its own. */
static inline __attribute__((always_inline)) void int8_signed_dots(const uint8_t *quants, const int nibbles, int half,
                                                                   const int8_t *xb, int k, const int R,
                                                                   __m256i dots[]) {
    const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    for (int r = 0; r < R; r++) dots[r] = _mm256_setzero_si256();
    for (int j = 0; j < 4; j++) {
        __m256i lo, hi;
        int8_chunks(quants, nibbles, j, NULL, nibbles == 2, half, &lo, &hi);
        lo = _mm256_xor_si256(lo, flip);
        hi = _mm256_xor_si256(hi, flip);
        const __m256i abs_lo = _mm256_abs_epi8(lo), abs_hi = _mm256_abs_epi8(hi);
        for (int r = 0; r < R; r++) {
            const int8_t *x = xb + (int64_t)r * k;
            const __m256i x_lo = _mm256_set1_epi32(load_i32(x + 4 * j)), x_hi = _mm256_set1_epi32(load_i32(x + 16 + 4 * j));
            const __m256i p_lo = _mm256_madd_epi16(_mm256_maddubs_epi16(abs_lo, _mm256_sign_epi8(x_lo, lo)), ones);
            const __m256i p_hi = _mm256_madd_epi16(_mm256_maddubs_epi16(abs_hi, _mm256_sign_epi8(x_hi, hi)), ones);
            dots[r] = _mm256_add_epi32(dots[r], _mm256_add_epi32(p_lo, p_hi));
        }
    }
}

/* Half `half` of a group against input rows first..last, R (<= INT8_ROWS) a pass: the int8
 * blocks, then the outliers. `nibbles` (0 bytes, 1 plain nibbles, 2 nibbles with fifth bits
 * or, signed, a lookup), `is_signed`, `panel` and R are constants at each call. `next`: the
 * pair to fetch while reading (NULL: none). */
static inline __attribute__((always_inline)) void int8_half_pass(const Int8Source *src, const int nibbles,
                                                                 const int is_signed, const int span, const int panel,
                                                                 const int R,
                                                                 int half, int first, int last, int valid, int nb,
                                                                 const Int8Inputs *in, int k, float *out, int n,
                                                                 const NextGroups *next) {
    const int columns = valid - 8 * half;
    const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(columns), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256i pick[4];
    for (int byte = 0; byte < 4; byte++) { /* byte `byte` of each 32-bit lane; 0x80: zero */
        const int lane = (int)(0x80808000u | (unsigned)byte);
        pick[byte] = _mm256_setr_epi32(lane, lane + 4, lane + 8, lane + 12, lane, lane + 4, lane + 8, lane + 12);
    }
    for (int r0 = first; r0 < last; r0 += R) {
        __m256 sums[INT8_ROWS];
        for (int r = 0; r < R; r++) sums[r] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            const uint8_t *g = src->data + b * src->step;
            const int8_t *xb = in->q + (int64_t)r0 * k + b * QUANT_BLOCK;
            if (next && r0 == first) prefetch_next_block(next, b);
            __m256i dots[INT8_ROWS];
            const uint8_t *fifths = nibbles == 2 && !is_signed ? g + src->fifths : NULL;
            if (is_signed)
                int8_signed_dots(g + src->quants, nibbles, half, xb, k, R, dots);
            else
                int8_unsigned_dots(g + src->quants, nibbles, fifths, span, half, xb, k, R, dots);
            __m256 dw, cw;
            int8_block_scales(g, src->f, panel, half, &dw, &cw);
            if (is_signed) cw = _mm256_fmadd_ps(dw, _mm256_set1_ps(128.0f), cw);
            for (int r = 0; r < R; r++) {
                const int64_t at = (int64_t)(r0 + r) * nb + b;
                sums[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[r]), _mm256_mul_ps(dw, _mm256_set1_ps(in->d[at])), sums[r]);
                sums[r] = _mm256_fmadd_ps(cw, _mm256_set1_ps(in->dsum[at]), sums[r]);
            }
        }
        for (int o = 0; o < INT8_OUTLIERS; o++)
            for (int r = 0; r < R; r++) {
                const Int8Outlier *taken = in->outliers + (int64_t)(r0 + r) * INT8_OUTLIERS + o;
                sums[r] = _mm256_fmadd_ps(int8_outlier_weights(src, panel, taken, half, pick),
                                          _mm256_set1_ps(taken->value), sums[r]);
            }
        for (int r = 0; r < R; r++) {
            float *to = out + (int64_t)(r0 + r) * n + 8 * half;
            if (columns >= 8) _mm256_storeu_ps(to, sums[r]);
            else _mm256_maskstore_ps(to, keep, sums[r]);
        }
    }
}

/* Both halves of a group against every input row, INT8_ROWS a pass and the last pass as
 * many as are left. */
_Static_assert(INT8_ROWS == 4, "int8_passes' last pass takes 1 to 3 rows");
static inline __attribute__((always_inline)) void int8_passes(const Int8Source *src, const int nibbles,
                                                              const int is_signed, const int span, const int panel,
                                                              int valid, int nb,
                                                              const Int8Inputs *in, int rows, int k, float *out, int n,
                                                              const NextGroups *next) {
    const int whole = rows / INT8_ROWS * INT8_ROWS;
    for (int half = 0; half < 2 && 8 * half < valid; half++) {
        const NextGroups *fetch = half == 0 ? next : NULL;
        int8_half_pass(src, nibbles, is_signed, span, panel, INT8_ROWS, half, 0, whole, valid, nb, in, k, out, n, fetch);
        switch (rows - whole) {
        case 1: int8_half_pass(src, nibbles, is_signed, span, panel, 1, half, whole, rows, valid, nb, in, k, out, n, fetch); break;
        case 2: int8_half_pass(src, nibbles, is_signed, span, panel, 2, half, whole, rows, valid, nb, in, k, out, n, fetch); break;
        case 3: int8_half_pass(src, nibbles, is_signed, span, panel, 3, half, whole, rows, valid, nb, in, k, out, n, fetch); break;
        }
    }
}

/* A pair of groups (`count` of them) against every input row, one group after the other:
 * unpacked into `panels` first where given (2 * nb * INT8_PANEL_BLOCK bytes), else read in
 * place. The next pair is fetched while the first group is read. */
static void int8_groups(const QuantGroup group[2], int count, uint8_t *panels, const int valid[2], int nb,
                        const Int8Inputs *in, int rows, int k, float *const out[2], int n, const NextGroups *next) {
    for (int h = 0; h < count; h++) {
        uint8_t *panel = panels ? panels + (int64_t)h * nb * INT8_PANEL_BLOCK : NULL;
        const QuantFormat *f = &group[h].format;
        if (panel) int8_panel(group[h].data, f, nb, panel);
        const Int8Source src = int8_source(&group[h], panel);
        const NextGroups *fetch = h == 0 ? next : NULL;
        /* u past 31 (8-bit quants, IQ4_NL's levels) would saturate VPMADDUBSW: signed. Pairs of
         * 4-bit quants (at most 3,810) add over 4 chunks in 16 bits, of 5-bit ones over 2. */
        const int is_signed = !f->nibbles || f->lookup;
#define INT8_HALVES(NIBBLES, SIGNED, SPAN, PANEL) \
    int8_passes(&src, NIBBLES, SIGNED, SPAN, PANEL, valid[h], nb, in, rows, k, out[h], n, fetch)
        if (panel && is_signed) INT8_HALVES(0, 1, 1, 1);
        else if (panel && f->fifth) INT8_HALVES(0, 0, 2, 1);
        else if (panel) INT8_HALVES(0, 0, 4, 1);
        else if (!f->nibbles) INT8_HALVES(0, 1, 1, 0);
        else if (f->lookup) INT8_HALVES(2, 1, 1, 0);
        else if (f->fifth) INT8_HALVES(2, 0, 2, 0);
        else INT8_HALVES(1, 0, 4, 0);
#undef INT8_HALVES
    }
}
