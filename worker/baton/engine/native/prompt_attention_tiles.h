/* The AMX engine of the prompt attention (prompt_attention.h): bf16 products on tiles, the
 * softmax across 16 query rows at once.
 *
 * A tile of 16 task rows meets each block of 32 keys as scores transposed, a key per tile
 * row and a query row per column (keys x queries^T), so that one AVX-512 register holds one
 * key's scores for all 16 rows. The online softmax is then a maximum, exponentials and a
 * sum down 32 registers, as on the AVX-512 engine (prompt_attention_lanes.h). The value
 * sums come out transposed too (values^T x probabilities^T, a
 * head dimension a tile row) and stay in tiles 4-7 from block to block for heads up to 64;
 * wider heads add each block's sums in memory. A row's sums are taken against a reference
 * that moves only where its scores pass it by PROMPT_RESCALE_ABOVE, so the sums are rarely
 * stored, rescaled and reloaded; the final division takes the common factor out.
 *
 * Roundings are the AVX-512 engine's bf16 products': queries, keys, values and
 * probabilities in bf16, sums in float32, the scores scaled after. Products, masks and
 * references are each row's own, so a row's result does not depend on its chunk. Layout
 * (prompt_pack_block_tiles): per KV head and block of 32 keys, the keys as rows ([32][dim])
 * and the values transposed ([dim][32]). Head size a multiple of 32 (a tile row holds 32
 * bf16 values). Tiles configured 16 rows x 64 bytes (quant_amx.h's amx_configure): 0-1
 * scores, 2 keys or values, 3 queries or probabilities, 4-7 value sums.
 * Included by prompt_attention.h inside its AMX section.
 */

/* prompt_pack_block_tiles from a bf16 cache, its values moved as they are (the float32 round
 * trip gives back the same bits): each key's row copied; for each pair of head dimensions,
 * the 32 keys' pairs gathered as dwords (two gathers of 16) and split into their even words
 * (the first dimension's row) and odd words (the second's). 0 where prompt_bf16_block
 * declines the block. */
static int prompt_pack_block_tiles_bf16(const PromptAttention *a, int kvh, int64_t block) {
    PromptBf16Block b;
    if (!prompt_bf16_block(a, kvh, block, &b)) return 0;
    const int dim = a->dim;
    const uint16_t *k = (const uint16_t *)a->k;
    for (int j = 0; j < ATTENTION_TOKENS; j++)
        for (int d = 0; d < dim; d += 32)
            _mm512_storeu_si512(b.keys + j * dim + d, b.live >> j & 1
                                                          ? _mm512_loadu_si512(k + 2 * (int64_t)b.pairs_at[j] + d)
                                                          : _mm512_setzero_si512());
    const __m512i even = _mm512_set_epi16(62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40, 38, 36, 34, 32, 30, 28, 26,
                                          24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi16(even, _mm512_set1_epi16(1));
    for (int i = 0; i < dim / 2; i++) { /* dimensions 2i and 2i + 1 */
        __m512i low, high;
        prompt_gather_pairs(a->v, &b, i, &low, &high);
        _mm512_store_si512(b.values + 2 * i * ATTENTION_TOKENS, _mm512_permutex2var_epi16(low, even, high));
        _mm512_store_si512(b.values + (2 * i + 1) * ATTENTION_TOKENS, _mm512_permutex2var_epi16(low, odd, high));
    }
    return 1;
}

/* Block `block` of KV head kvh into a->keys ([32][dim]) and a->values ([dim][32]) in bf16
 * (rounded to nearest even by VCVTNE2PS2BF16, as the bf16 products' other operands are). */
static void prompt_pack_block_tiles(const PromptAttention *a, int kvh, int64_t block) {
    if (a->kv_bf16 && prompt_pack_block_tiles_bf16(a, kvh, block)) return;
    float kr[ATTENTION_TOKENS][PROMPT_MAX_DIM] __attribute__((aligned(64)));
    float vr[ATTENTION_TOKENS][PROMPT_MAX_DIM] __attribute__((aligned(64)));
    const int dim = a->dim;
    const int64_t at = prompt_block_at(a, kvh, block);
    uint16_t *kp = (uint16_t *)a->keys + at, *vp = (uint16_t *)a->values + at;
    prompt_load_block(a, kvh, block, kr[0], vr[0], PROMPT_MAX_DIM);
    for (int j = 0; j < ATTENTION_TOKENS; j++)
        for (int d = 0; d < dim; d += 32)
            _mm512_storeu_si512(kp + j * dim + d, (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(kr[j] + d + 16),
                                                                               _mm512_load_ps(kr[j] + d)));
    const __m512i down = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(PROMPT_MAX_DIM)); /* key j's row in vr */
    for (int d = 0; d < dim; d++) /* column d of the values: keys 0-15, 16-31 */
        _mm512_store_si512(vp + d * ATTENTION_TOKENS,
                           (__m512i)_mm512_cvtne2ps_pbh(_mm512_i32gather_ps(down, vr[16] + d, 4),
                                                        _mm512_i32gather_ps(down, vr[0] + d, 4)));
}

#define PROMPT_SUM_TILES 4 /* tiles 4-7: value sums held in tiles across key blocks for heads up to 64 */

/* Tile 4 + c (tile numbers are the instructions' immediates) */
#define PROMPT_ON_SUM_TILE(c, op) \
    switch (c) { case 0: op(4); break; case 1: op(5); break; case 2: op(6); break; default: op(7); break; }
#define PROMPT_ZERO(t) _tile_zero(t)
static inline void prompt_sum_tile_zero(int c) { PROMPT_ON_SUM_TILE(c, PROMPT_ZERO) }
static inline void prompt_sum_tile_store(int c, float *to) {
#define PROMPT_STORE(t) _tile_stored(t, to, 64)
    PROMPT_ON_SUM_TILE(c, PROMPT_STORE)
#undef PROMPT_STORE
}
static inline void prompt_sum_tile_load(int c, const float *from) {
#define PROMPT_LOAD(t) _tile_loadd(t, from, 64)
    PROMPT_ON_SUM_TILE(c, PROMPT_LOAD)
#undef PROMPT_LOAD
}
/* tile 4 + c += tile 2 x tile 3 */
static inline void prompt_sum_tile_add(int c) {
#define PROMPT_ADD(t) _tile_dpbf16ps(t, 2, 3)
    PROMPT_ON_SUM_TILE(c, PROMPT_ADD)
#undef PROMPT_ADD
}
#undef PROMPT_ZERO

/* The value sums of one tile of rows, each row's scaled by its lane of `keep`: in `acc`, or
 * (`resident`) in tiles 4 on, through `acc`. */
static inline void prompt_rescale_sums(float acc[][PROMPT_LANES], int dim, __m512 keep, int resident) {
    if (resident)
        for (int c = 0; c < dim / 16; c++) prompt_sum_tile_store(c, acc[16 * c]);
    for (int d = 0; d < dim; d++) _mm512_store_ps(acc[d], _mm512_mul_ps(_mm512_load_ps(acc[d]), keep));
    if (resident)
        for (int c = 0; c < dim / 16; c++) prompt_sum_tile_load(c, acc[16 * c]);
}

/* One task (prompt_attention_task's): KV head kvh, chunk rows r0..r0 + rows - 1 of each of its
 * query heads, 16 task rows a tile. */
static void prompt_attention_task_amx(const PromptAttention *a, int kvh, int r0, int rows) {
    /* queries as bf16 pairs, transposed: part p (32 values), pair i, task row n */
    uint32_t qt[PROMPT_MAX_DIM / 32][16][PROMPT_LANES] __attribute__((aligned(64)));
    float acc[PROMPT_MAX_DIM][PROMPT_LANES] __attribute__((aligned(64))); /* value sums: dim d, row n */
    float st[ATTENTION_TOKENS][PROMPT_LANES] __attribute__((aligned(64))); /* scores: key j, row n */
    uint32_t pt[ATTENTION_TOKENS / 2][PROMPT_LANES] __attribute__((aligned(64))); /* probability pairs */
    const int dim = a->dim, group = a->num_heads / a->num_kv_heads, all = group * rows;
    const int64_t first = (int64_t)a->ctx - a->n + r0;
    const __m512 scale = _mm512_set1_ps(a->scale), none = _mm512_set1_ps(-INFINITY);
    /* 16 lanes a tile row apart: down one column of a [..][16] array of 4-byte values */
    const __m512i across = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                              _mm512_set1_epi32(PROMPT_LANES));
    const int resident = dim / 16 <= PROMPT_SUM_TILES; /* else the sums of each block added in memory */
    float pv[16][PROMPT_LANES] __attribute__((aligned(64)));
    for (int t0 = 0; t0 < all; t0 += PROMPT_LANES) {
        const int count = all - t0 < PROMPT_LANES ? all - t0 : PROMPT_LANES;
        const __mmask16 rows_here = (__mmask16)((1u << count) - 1);
        int32_t position[PROMPT_LANES] __attribute__((aligned(64)));
        int64_t seen = 0, everyone = INT64_MAX; /* the last key any row sees; all rows see keys up to `everyone` */
        if (count < PROMPT_LANES) memset(qt, 0, sizeof(qt[0]) * (dim / 32));
        for (int n = 0; n < PROMPT_LANES; n++) {
            position[n] = -1; /* rows past the task's: no key, zero queries, dropped */
            if (n >= count) continue;
            const int t = t0 + n, h = kvh * group + t / rows, r = t % rows;
            const float *row = a->q + (int64_t)(r0 + r) * a->q_stride + (int64_t)h * dim;
            for (int part = 0; part < dim / 32; part++) /* 16 pairs, down column n of the part */
                _mm512_i32scatter_epi32(&qt[part][0][n], across,
                                        (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(row + 32 * part + 16),
                                                                     _mm512_loadu_ps(row + 32 * part)), 4);
            position[n] = (int32_t)(first + r);
            seen = first + r > seen ? first + r : seen;
            everyone = first + r < everyone ? first + r : everyone;
        }
        const __m512i positions = _mm512_load_si512(position);
        __m512 reference = none, total = _mm512_setzero_ps(); /* each row's exponent reference, sum */
        if (resident)
            for (int c = 0; c < dim / 16; c++) prompt_sum_tile_zero(c);
        else
            memset(acc, 0, sizeof(float) * PROMPT_LANES * dim);
        for (int64_t kb = 0; kb <= seen; kb += ATTENTION_TOKENS) {
            const int64_t at = prompt_block_at(a, kvh, kb / ATTENTION_TOKENS);
            const uint16_t *keys = (const uint16_t *)a->keys + at, *values = (const uint16_t *)a->values + at;
            _tile_zero(0);
            _tile_zero(1);
            for (int part = 0; part < dim / 32; part++) {
                _tile_loadd(3, qt[part], 64);
                _tile_loadd(2, keys + 32 * part, 2 * dim);
                _tile_dpbf16ps(0, 2, 3);
                _tile_loadd(2, keys + 16 * dim + 32 * part, 2 * dim);
                _tile_dpbf16ps(1, 2, 3);
            }
            _tile_stored(0, st[0], 64);
            _tile_stored(1, st[16], 64);
            __mmask16 seen_by[ATTENTION_TOKENS];
            __m512 keep;
            if (prompt_block_reference(st, ATTENTION_TOKENS, kb, everyone, rows_here, positions, scale, seen_by,
                                       &reference, &keep)) {
                total = _mm512_mul_ps(total, keep);
                if (kb) prompt_rescale_sums(acc, dim, keep, resident); /* before the first block they are zero */
            }
            total = _mm512_add_ps(total, prompt_block_probabilities(st, ATTENTION_TOKENS, seen_by, scale, reference, pt));
            _tile_loadd(3, pt[0], 64);
            for (int c = 0; c < dim / 16; c++) { /* head values 16c..16c + 15 */
                _tile_loadd(2, values + 16 * c * ATTENTION_TOKENS, 2 * ATTENTION_TOKENS);
                if (resident) {
                    prompt_sum_tile_add(c);
                    continue;
                }
                _tile_zero(4);
                _tile_dpbf16ps(4, 2, 3);
                _tile_stored(4, pv[0], 64);
                for (int d = 0; d < 16; d++)
                    _mm512_store_ps(acc[16 * c + d], _mm512_add_ps(_mm512_load_ps(acc[16 * c + d]), _mm512_load_ps(pv[d])));
            }
        }
        if (resident)
            for (int c = 0; c < dim / 16; c++) prompt_sum_tile_store(c, acc[16 * c]);
        float inverse[PROMPT_LANES] __attribute__((aligned(64)));
        _mm512_store_ps(inverse, _mm512_div_ps(_mm512_set1_ps(1.0f), total));
        for (int n = 0; n < count; n++) { /* row n's sums, down column n of acc */
            const int t = t0 + n, h = kvh * group + t / rows, r = t % rows;
            float *o = a->out + ((int64_t)(r0 + r) * a->num_heads + h) * dim;
            const __m512 times = _mm512_set1_ps(inverse[n]);
            for (int d = 0; d < dim; d += 16)
                _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_i32gather_ps(across, &acc[d][n], 4), times));
        }
    }
}
