/* The AVX-512 engines of the prompt attention (prompt_attention.h), float32 FMAs or bf16
 * products on VDPBF16PS: a query row per lane, the softmax across 16 rows at once.
 *
 * A task's rows go 16 at a time (a register's lanes). Each block of 32 keys is scored as
 * keys x queries^T, one register per key holding that key's score for the 16 rows (each of
 * a key's values broadcast from memory into the products), so the online softmax is a
 * maximum, exponentials and a sum down 32 registers. With a key per lane instead, each row
 * and block took two horizontal reductions and a scalar exponential, and on a Zen 4 core
 * those were a third of the time of a 2,000-token prompt's attention. The value sums are
 * kept transposed (a head dimension per row of `acc`, the 16 rows across it) and grow by
 * values^T x probabilities^T, 16 head dimensions in registers at a time. A row's sums are
 * taken against a reference that moves only where its scores pass it by
 * PROMPT_RESCALE_ABOVE; the final division takes the common factor out (as on the tiles).
 *
 * Roundings: float32 products of the scaled queries; or, with `bf16_products`, the queries,
 * keys, values and probabilities rounded to bf16 and the scores scaled after, as torch's bf16
 * attention rounds them. Sums in float32 either way. Products, masks and references are each
 * lane's own, so a row's result does not depend on its chunk or its neighbours.
 * Layout (prompt_lay_out_block), per KV head and block of 32 keys: in float32 the keys
 * transposed ([dim][32]) and the values as rows ([32][dim]); in bf16 the keys' pairs along
 * the head dimension transposed ([dim / 2][32][2]) and the values in pairs along the keys
 * ([16][dim][2]). Either way the 16 values a loop broadcasts lie at fixed offsets from one
 * address.
 * Included by prompt_attention.h inside its AVX-512 section.
 */
#define PROMPT_LANE_KEYS 16 /* keys scored at once: one accumulator each */

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* prompt_lay_out_block's bf16 layout from a bf16 cache as it is (prompt_bf16_block): the
 * keys' pairs along the head dimension are the cache's dwords, gathered a pair of dimensions
 * at a time; the values' pairs along the keys interleave two keys' rows. 0 where
 * prompt_bf16_block declines the block. */
static int prompt_lay_out_block_bf16(const PromptAttention *a, int kvh, int64_t block) {
    PromptBf16Block b;
    if (!prompt_bf16_block(a, kvh, block, &b)) return 0;
    const int dim = a->dim;
    for (int i = 0; i < dim / 2; i++) {
        __m512i low, high;
        prompt_gather_pairs(a->k, &b, i, &low, &high);
        _mm512_storeu_si512(b.keys + 2 * i * ATTENTION_TOKENS, low);
        _mm512_storeu_si512(b.keys + 2 * i * ATTENTION_TOKENS + 32, high);
    }
    /* word 2n: the first key's value n, word 2n + 1: the second's */
    const __m512i interleave = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38,
                                                6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const uint16_t *v = (const uint16_t *)a->v;
    for (int jp = 0; jp < ATTENTION_TOKENS / 2; jp++) {
        const int first = 2 * jp, second = 2 * jp + 1;
        for (int d = 0; d < dim; d += 16) {
            const __m512i x = b.live >> first & 1
                                  ? _mm512_zextsi256_si512(_mm256_loadu_si256(
                                        (const __m256i *)(v + 2 * (int64_t)b.pairs_at[first] + d)))
                                  : _mm512_setzero_si512();
            const __m512i y = b.live >> second & 1
                                  ? _mm512_zextsi256_si512(_mm256_loadu_si256(
                                        (const __m256i *)(v + 2 * (int64_t)b.pairs_at[second] + d)))
                                  : _mm512_setzero_si512();
            _mm512_storeu_si512(b.values + ((int64_t)jp * dim + d) * 2, _mm512_permutex2var_epi16(x, interleave, y));
        }
    }
    return 1;
}
#endif

/* Block `block` of KV head kvh into a->keys and a->values (see above); zero past ctx. */
static void prompt_lay_out_block(const PromptAttention *a, int kvh, int64_t block) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    if (a->bf16_products && a->kv_bf16 && prompt_lay_out_block_bf16(a, kvh, block)) return;
#endif
    const int dim = a->dim;
    const int64_t at = prompt_block_at(a, kvh, block);
    float kr[ATTENTION_TOKENS][PROMPT_MAX_DIM] __attribute__((aligned(64)));
    float vr[ATTENTION_TOKENS][PROMPT_MAX_DIM] __attribute__((aligned(64)));
    prompt_load_block(a, kvh, block, kr[0], vr[0], PROMPT_MAX_DIM);
    if (!a->bf16_products) {
        float *kt = (float *)a->keys + at, *vb = (float *)a->values + at;
        for (int d = 0; d < dim; d++)
            for (int j = 0; j < ATTENTION_TOKENS; j++) kt[d * ATTENTION_TOKENS + j] = kr[j][d];
        for (int j = 0; j < ATTENTION_TOKENS; j++) memcpy(vb + (int64_t)j * dim, vr[j], sizeof(float) * dim);
        return;
    }
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    uint16_t *kp = (uint16_t *)a->keys + at, *vp = (uint16_t *)a->values + at;
    for (int i = 0; i < dim / 2; i++)
        for (int j = 0; j < ATTENTION_TOKENS; j++) {
            kp[(i * ATTENTION_TOKENS + j) * 2] = f32_to_bf16(kr[j][2 * i]);
            kp[(i * ATTENTION_TOKENS + j) * 2 + 1] = f32_to_bf16(kr[j][2 * i + 1]);
        }
    for (int jp = 0; jp < ATTENTION_TOKENS / 2; jp++)
        for (int d = 0; d < dim; d++) {
            vp[((int64_t)jp * dim + d) * 2] = f32_to_bf16(vr[2 * jp][d]);
            vp[((int64_t)jp * dim + d) * 2 + 1] = f32_to_bf16(vr[2 * jp + 1][d]);
        }
#endif
}

/* The scores of keys k0..k0 + 15 of a block for the 16 rows: st[k0 + j] = key j . queries.
 * qt holds the queries transposed (float32 [dim][16], scaled; bf16 pairs [dim / 2][16]). */
static inline void prompt_lane_scores(const PromptAttention *a, int64_t at, int k0, const float *qt,
                                      float st[][PROMPT_LANES]) {
    const int dim = a->dim;
    __m512 s[PROMPT_LANE_KEYS];
    for (int j = 0; j < PROMPT_LANE_KEYS; j++) s[j] = _mm512_setzero_ps();
    if (a->bf16_products) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
        const uint32_t *kp = (const uint32_t *)((const uint16_t *)a->keys + at) + k0;
        const uint32_t *qp = (const uint32_t *)qt;
        for (int i = 0; i < dim / 2; i++, kp += ATTENTION_TOKENS) {
            const __m512bh x = (__m512bh)_mm512_load_si512(qp + PROMPT_LANES * i);
            for (int j = 0; j < PROMPT_LANE_KEYS; j++)
                s[j] = _mm512_dpbf16_ps(s[j], x, (__m512bh)_mm512_set1_epi32((int)kp[j]));
        }
#endif
    } else {
        const float *kt = (const float *)a->keys + at + k0;
        for (int d = 0; d < dim; d++, kt += ATTENTION_TOKENS) {
            const __m512 x = _mm512_load_ps(qt + PROMPT_LANES * d);
            for (int j = 0; j < PROMPT_LANE_KEYS; j++) s[j] = _mm512_fmadd_ps(x, _mm512_set1_ps(kt[j]), s[j]);
        }
    }
    for (int j = 0; j < PROMPT_LANE_KEYS; j++) _mm512_store_ps(st[k0 + j], s[j]);
}

/* acc[d] += sum over the block's first `keys` keys of value[key][d] * probability[key], for
 * every head dimension d, 16 at a time in registers. Probabilities: float32 pf[key][16], or
 * bf16 pairs pp[key pair][16] (keys rounded up to a pair; a pair past the block's keys is
 * zero). */
static inline void prompt_lane_values(const PromptAttention *a, int64_t at, int keys, const float pf[][PROMPT_LANES],
                                      const uint32_t pp[][PROMPT_LANES], float acc[][PROMPT_LANES]) {
    const int dim = a->dim;
    (void)pp; /* unread where the build has no bf16 products */
    for (int c = 0; c < dim; c += 16) {
        __m512 o[16];
        for (int d = 0; d < 16; d++) o[d] = _mm512_load_ps(acc[c + d]);
        if (a->bf16_products) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
            const uint32_t *vp = (const uint32_t *)((const uint16_t *)a->values + at) + c;
            for (int jp = 0; jp < (keys + 1) / 2; jp++) {
                const __m512bh x = (__m512bh)_mm512_load_si512(pp[jp]);
                for (int d = 0; d < 16; d++)
                    o[d] = _mm512_dpbf16_ps(o[d], x, (__m512bh)_mm512_set1_epi32((int)vp[(int64_t)jp * dim + d]));
            }
#endif
        } else {
            const float *vf = (const float *)a->values + at + c;
            for (int j = 0; j < keys; j++) {
                const __m512 x = _mm512_load_ps(pf[j]);
                for (int d = 0; d < 16; d++) o[d] = _mm512_fmadd_ps(x, _mm512_set1_ps(vf[(int64_t)j * dim + d]), o[d]);
            }
        }
        for (int d = 0; d < 16; d++) _mm512_store_ps(acc[c + d], o[d]);
    }
}

/* One task: KV head kvh, chunk rows r0..r0 + rows - 1 of each of its query heads (task row
 * t = head-in-group * rows + chunk row), 16 task rows at a time. */
static void prompt_attention_task(const PromptAttention *a, int kvh, int r0, int rows) {
    float qt[PROMPT_MAX_DIM][PROMPT_LANES] __attribute__((aligned(64)));  /* queries transposed */
    float acc[PROMPT_MAX_DIM][PROMPT_LANES] __attribute__((aligned(64))); /* value sums: dim d, row n */
    float st[ATTENTION_TOKENS][PROMPT_LANES] __attribute__((aligned(64))); /* scores, float32 probabilities */
    uint32_t pt[ATTENTION_TOKENS / 2][PROMPT_LANES] __attribute__((aligned(64))); /* bf16 probability pairs */
    const int dim = a->dim, group = a->num_heads / a->num_kv_heads, all = group * rows, bf16 = a->bf16_products;
    const int64_t first = (int64_t)a->ctx - a->n + r0; /* the position of chunk row r0 */
    /* bf16 scores are scaled after their products; float32 ones come scaled (the queries are) */
    const __m512 scale = _mm512_set1_ps(bf16 ? a->scale : 1.0f);
    for (int t0 = 0; t0 < all; t0 += PROMPT_LANES) {
        const int count = all - t0 < PROMPT_LANES ? all - t0 : PROMPT_LANES;
        const __mmask16 rows_here = (__mmask16)((1u << count) - 1);
        int32_t position[PROMPT_LANES] __attribute__((aligned(64)));
        int64_t seen = 0, everyone = INT64_MAX; /* the last key any row sees; all rows see keys up to `everyone` */
        memset(qt, 0, sizeof(float) * PROMPT_LANES * dim); /* lanes past the task's: zero queries, no keys */
        for (int n = 0; n < PROMPT_LANES; n++) {
            position[n] = -1;
            if (n >= count) continue;
            const int t = t0 + n, h = kvh * group + t / rows, r = t % rows;
            const float *row = a->q + (int64_t)(r0 + r) * a->q_stride + (int64_t)h * dim;
            if (bf16)
                for (int i = 0; i < dim / 2; i++)
                    ((uint32_t *)qt)[i * PROMPT_LANES + n] =
                        (uint32_t)f32_to_bf16(row[2 * i]) | (uint32_t)f32_to_bf16(row[2 * i + 1]) << 16;
            else
                for (int d = 0; d < dim; d++) qt[d][n] = row[d] * a->scale;
            position[n] = (int32_t)(first + r);
            seen = first + r > seen ? first + r : seen;
            everyone = first + r < everyone ? first + r : everyone;
        }
        const __m512i positions = _mm512_load_si512(position);
        __m512 reference = _mm512_set1_ps(-INFINITY), total = _mm512_setzero_ps(); /* each row's exponent reference, sum */
        memset(acc, 0, sizeof(float) * PROMPT_LANES * dim);
        for (int64_t kb = 0; kb <= seen; kb += ATTENTION_TOKENS) {
            const int64_t at = prompt_block_at(a, kvh, kb / ATTENTION_TOKENS);
            /* keys past `seen` no row sees: their scores stay unread, their probabilities zero */
            const int keys = seen - kb + 1 < ATTENTION_TOKENS ? (int)(seen - kb + 1) : ATTENTION_TOKENS;
            for (int k0 = 0; k0 < keys; k0 += PROMPT_LANE_KEYS) prompt_lane_scores(a, at, k0, qt[0], st);
            __mmask16 seen_by[ATTENTION_TOKENS];
            __m512 keep;
            if (prompt_block_reference(st, keys, kb, everyone, rows_here, positions, scale, seen_by, &reference, &keep)) {
                total = _mm512_mul_ps(total, keep);
                if (kb) /* before the first block the sums are zero */
                    for (int d = 0; d < dim; d++) _mm512_store_ps(acc[d], _mm512_mul_ps(_mm512_load_ps(acc[d]), keep));
            }
            /* bf16 probabilities in pairs for VDPBF16PS; float32 ones over the scores */
            total = _mm512_add_ps(total, prompt_block_probabilities(st, keys, seen_by, scale, reference, bf16 ? pt : NULL));
            prompt_lane_values(a, at, keys, st, pt, acc);
        }
        float inverse[PROMPT_LANES] __attribute__((aligned(64)));
        _mm512_store_ps(inverse, _mm512_div_ps(_mm512_set1_ps(1.0f), total));
        for (int n = 0; n < count; n++) { /* row n's sums, down column n of acc */
            const int t = t0 + n, h = kvh * group + t / rows, r = t % rows;
            float *o = a->out + ((int64_t)(r0 + r) * a->num_heads + h) * dim;
            for (int d = 0; d < dim; d++) o[d] = acc[d][n] * inverse[n];
        }
    }
}
