/* Quantized weight rows back to float32 or bfloat16, for the prompt products that run as
 * dequantized tiles through the dense GEMM (quant/weight.py) and for embedding rows.
 *
 * Values are ggml's: d * q + m for Q4_1, d * (q - offset) otherwise, each product and sum
 * rounded on its own (-ffp-contract=off), so every variant gives the same bits. bfloat16
 * output rounds those float32 values to nearest even, as torch's conversion does; writing
 * it here saves a pass over the tile. A prompt chunk dequantizes the whole matrix for each
 * product, so this runs on every prefill step: vectorized where the CPU allows.
 * Included by quant_product.h (after quant_kernels.h); f32_to_bf16 is decode_step.c's.
 */

/* One block's scales for one row (lane `lane` of its 16-row group): d, and m (0 without). */
static inline void block_scales(const uint8_t *g, const QuantFormat *f, int lane, float *d, float *m) {
    uint16_t bits;
    memcpy(&bits, g + 2 * lane, 2);
    *d = half_to_float(bits);
    *m = 0.0f;
    if (f->has_min) { memcpy(&bits, g + 32 + 2 * lane, 2); *m = half_to_float(bits); }
}

static inline const uint8_t *block_quants(const uint8_t *g, const QuantFormat *f, int lane) {
    return g + QUANT_ROWS * f->header_bytes + 4 * lane;
}

/* A 5-bit row's fifth-bit word in its group block, or NULL. */
static inline const uint8_t *block_fifths(const uint8_t *g, const QuantFormat *f, int lane) {
    return f->fifth ? fifth_words(g, f) + 4 * lane : NULL;
}

#if (defined(__AVX512F__) && defined(__AVX512BW__)) || (defined(__AVX2__) && defined(__F16C__))
/* A row's 16 bytes of chunks c0..c0+3 (4 bytes each, 64 apart) in value order. */
static inline __m128i row_bytes(const uint8_t *qs) {
    return _mm_setr_epi32(load_i32(qs), load_i32(qs + 64), load_i32(qs + 128), load_i32(qs + 192));
}

/* A block's 32 quants of one row as unsigned bytes in value order: values 0-15, 16-31.
 * `fifths`: a 5-bit row's fifth-bit word (quant/interleave.py's order: value 4c + b's bit is
 * bit c of byte b, value 16 + 4c + b's bit 4 + c), else NULL. */
static inline void block_bytes(const uint8_t *qs, const QuantFormat *f, const uint8_t *fifths, __m128i halves[2]) {
    if (f->nibbles) {
        const __m128i bytes = row_bytes(qs), mask = _mm_set1_epi8(0x0F);
        halves[0] = _mm_and_si128(bytes, mask);
        halves[1] = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
        if (fifths) { /* the word in each 32-bit lane c, shifted right by c (+ 4), its bytes' bit 0 to bit 4 */
            const __m128i word = _mm_set1_epi32(load_i32(fifths)), bit4 = _mm_set1_epi8(0x10);
            const __m128i low = _mm_srlv_epi32(word, _mm_setr_epi32(0, 1, 2, 3));
            const __m128i high = _mm_srlv_epi32(word, _mm_setr_epi32(4, 5, 6, 7));
            halves[0] = _mm_or_si128(halves[0], _mm_and_si128(_mm_slli_epi32(low, 4), bit4));
            halves[1] = _mm_or_si128(halves[1], _mm_and_si128(_mm_slli_epi32(high, 4), bit4));
        }
        if (f->lookup) { /* IQ4_NL: each nibble's u */
            const __m128i table = _mm_loadu_si128((const __m128i *)IQ4_NL_U);
            halves[0] = _mm_shuffle_epi8(table, halves[0]);
            halves[1] = _mm_shuffle_epi8(table, halves[1]);
        }
    } else {
        halves[0] = row_bytes(qs);
        halves[1] = row_bytes(qs + 256);
    }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define QUANT_DEQUANTIZE "avx512"
/* 16 unsigned bytes -> (q - offset) * d (+ m) as 16 floats */
static inline __m512 scaled16(__m128i q, int offset, __m512 d, __m512 m, int has_min) {
    __m512i v = _mm512_cvtepu8_epi32(q);
    if (offset) v = _mm512_sub_epi32(v, _mm512_set1_epi32(offset));
    const __m512 product = _mm512_mul_ps(d, _mm512_cvtepi32_ps(v));
    return has_min ? _mm512_add_ps(product, m) : product;
}

/* f32_to_bf16 on 16 lanes */
static inline void store16(__m512 v, void *out, int at, int bf16) {
    if (!bf16) { _mm512_storeu_ps((float *)out + at, v); return; }
    __m512i bits = _mm512_castps_si512(v);
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)),
                                                              _mm512_and_si512(_mm512_srli_epi32(bits, 16),
                                                                               _mm512_set1_epi32(1))), 16);
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x0040));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    _mm256_storeu_si256((__m256i *)((uint16_t *)out + at),
                        _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet)));
}

static void dequantize_row(const uint8_t *g, const QuantFormat *f, int nb, int lane, void *out, int bf16) {
    const int step = QUANT_ROWS * f->block_bytes;
    for (int b = 0; b < nb; b++, g += step) {
        float d, m;
        block_scales(g, f, lane, &d, &m);
        __m128i halves[2];
        block_bytes(block_quants(g, f, lane), f, block_fifths(g, f, lane), halves);
        const __m512 scale = _mm512_set1_ps(d), min = _mm512_set1_ps(m);
        for (int h = 0; h < 2; h++)
            store16(scaled16(halves[h], f->offset, scale, min, f->has_min), out, b * QUANT_BLOCK + 16 * h, bf16);
    }
}
#elif defined(__AVX2__) && defined(__F16C__)
#define QUANT_DEQUANTIZE "avx2"
/* 8 unsigned bytes (the low half of q) -> (q - offset) * d (+ m) as 8 floats */
static inline __m256 scaled8(__m128i q, int offset, __m256 d, __m256 m, int has_min) {
    __m256i v = _mm256_cvtepu8_epi32(q);
    if (offset) v = _mm256_sub_epi32(v, _mm256_set1_epi32(offset));
    const __m256 product = _mm256_mul_ps(d, _mm256_cvtepi32_ps(v));
    return has_min ? _mm256_add_ps(product, m) : product;
}

/* f32_to_bf16 on 8 lanes */
static inline void store8(__m256 v, void *out, int at, int bf16) {
    if (!bf16) { _mm256_storeu_ps((float *)out + at, v); return; }
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)),
                                                              _mm256_and_si256(_mm256_srli_epi32(bits, 16),
                                                                               _mm256_set1_epi32(1))), 16);
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x0040));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256i chosen = _mm256_blendv_epi8(rounded, quiet, nan);
    /* 8 x 32-bit (each < 2^16) -> 8 x 16-bit: pack within lanes, then gather the halves */
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(chosen, chosen), 0x08);
    _mm_storeu_si128((__m128i *)((uint16_t *)out + at), _mm256_castsi256_si128(packed));
}

static void dequantize_row(const uint8_t *g, const QuantFormat *f, int nb, int lane, void *out, int bf16) {
    const int step = QUANT_ROWS * f->block_bytes;
    for (int b = 0; b < nb; b++, g += step) {
        float d, m;
        block_scales(g, f, lane, &d, &m);
        __m128i halves[2];
        block_bytes(block_quants(g, f, lane), f, block_fifths(g, f, lane), halves);
        const __m256 scale = _mm256_set1_ps(d), min = _mm256_set1_ps(m);
        for (int h = 0; h < 2; h++) {
            const int at = b * QUANT_BLOCK + 16 * h;
            store8(scaled8(halves[h], f->offset, scale, min, f->has_min), out, at, bf16);
            store8(scaled8(_mm_srli_si128(halves[h], 8), f->offset, scale, min, f->has_min), out, at + 8, bf16);
        }
    }
}
#else
#define QUANT_DEQUANTIZE "scalar"
static void dequantize_row(const uint8_t *g, const QuantFormat *f, int nb, int lane, void *out, int bf16) {
    const int step = QUANT_ROWS * f->block_bytes;
    for (int b = 0; b < nb; b++, g += step) {
        float d, m, values[QUANT_BLOCK];
        block_scales(g, f, lane, &d, &m);
        const uint8_t *qs = block_quants(g, f, lane), *fifths = block_fifths(g, f, lane);
        for (int c = 0; c < (f->nibbles ? 4 : 8); c++)
            for (int j = 0; j < 4; j++) {
                const uint8_t byte = qs[64 * c + j];
                if (!f->nibbles) {
                    values[4 * c + j] = f->has_min ? d * (float)byte + m : d * (float)((int)byte - f->offset);
                    continue;
                }
                int lo, hi; /* values 4c + j and 16 + 4c + j */
                nibble_pair_u(f, byte, fifths ? fifths[j] : 0, c, &lo, &hi);
                if (f->has_min) {
                    values[4 * c + j] = d * (float)lo + m;
                    values[16 + 4 * c + j] = d * (float)hi + m;
                } else {
                    values[4 * c + j] = d * (float)(lo - f->offset);
                    values[16 + 4 * c + j] = d * (float)(hi - f->offset);
                }
            }
        if (!bf16) { memcpy((float *)out + b * QUANT_BLOCK, values, sizeof values); continue; }
        for (int i = 0; i < QUANT_BLOCK; i++) ((uint16_t *)out)[b * QUANT_BLOCK + i] = f32_to_bf16(values[i]);
    }
}
#endif

const char *baton_quant_dequantize_kernel(void) { return QUANT_DEQUANTIZE; }

/* out[count, k] = rows first..first+count-1 of W, float32 (bf16 = 0) or bfloat16 (1). */
void baton_quant_dequantize_to(const QuantMatrix *w, int first, int count, void *out, int bf16) {
    const int nb = w->k / QUANT_BLOCK, size = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) if (count > 1)
    for (int i = 0; i < count; i++) {
        int row = first + i, p = 0;
        while (row >= w->parts[p].rows) row -= w->parts[p++].rows;
        const QuantFormat f = quant_format(w->parts[p].format);
        const uint8_t *g = w->parts[p].data + (int64_t)(row / QUANT_ROWS) * nb * QUANT_ROWS * f.block_bytes;
        dequantize_row(g, &f, nb, row % QUANT_ROWS, (char *)out + (int64_t)i * w->k * size, bf16);
    }
}
