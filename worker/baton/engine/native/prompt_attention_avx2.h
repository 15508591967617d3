/* prompt_attention.h's portable form on AVX2 + FMA (CPUs without AVX-512): float32 products,
 * the context's keys laid out once per KV head, transposed in tiles of 8 ([dim][8]), so a
 * query's scores come 8 keys a register with no horizontal sums, and the values read as rows.
 * Each row's softmax is whole (scores, max, exponentials, then the value sums), in float32.
 * SmolLM2's attention on a Zen 3 core, one layer, one thread, bf16 cache (bench/prompt_attention.py,
 * results/prompt_attention.zen3.avx2.json): a 256-token prompt 6.1 ms in the scalar form, 4.0
 * here, 3.6 in torch's; 512 rows over 2,000 tokens 628, 71 and 45 ms (torch's attention keeps
 * such chunks: native/prompt_steps.py's TORCH_ATTENTION_WORK).
 * Included by prompt_attention.h where the CPU has no AVX-512.
 */
#define PROMPT_TILE 8 /* keys a score register holds */

/* exp_in_place's formula on 8 lanes, step for step (the same values) */
static inline __m256 prompt_exp8(__m256 x) {
    const __m256 v = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 whole = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(v, _mm256_set1_ps(EXP_LOG2E)), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_sub_ps(v, _mm256_mul_ps(whole, _mm256_set1_ps(EXP_LN2_HIGH)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(whole, _mm256_set1_ps(EXP_LN2_LOW)));
    __m256 poly = _mm256_set1_ps(EXP_C0);
    poly = _mm256_add_ps(_mm256_mul_ps(poly, r), _mm256_set1_ps(EXP_C1));
    poly = _mm256_add_ps(_mm256_mul_ps(poly, r), _mm256_set1_ps(EXP_C2));
    poly = _mm256_add_ps(_mm256_mul_ps(poly, r), _mm256_set1_ps(EXP_C3));
    poly = _mm256_add_ps(_mm256_mul_ps(poly, r), _mm256_set1_ps(EXP_C4));
    poly = _mm256_add_ps(_mm256_mul_ps(poly, r), _mm256_set1_ps(EXP_C5));
    const __m256 y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(poly, r), r), r), _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(whole), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

/* 8 values of a key or value row from `at`, widened to float32 */
static inline __m256 prompt_load8(const void *base, int bf16, int64_t at) {
    if (!bf16) return _mm256_loadu_ps((const float *)base + at);
    const __m128i half = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + at));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

/* KV head kvh's keys 0..ctx-1 as tiles [ctx / 8 rounded up][dim][8] (zeros past ctx), and
 * each key's row in k and v (`at`). */
static void prompt_lay_out_keys(const void *k, int kv_bf16, const int32_t *table, int block_size, int64_t ctx,
                                int kvh, int num_kv_heads, int dim, float *tiles, int64_t *at) {
    const int64_t count = (ctx + PROMPT_TILE - 1) / PROMPT_TILE;
    memset(tiles, 0, sizeof(float) * (size_t)(count * dim * PROMPT_TILE));
    for (int64_t j = 0; j < ctx; j++) {
        at[j] = ((table ? cache_slot(table, block_size, j) : j) * num_kv_heads + kvh) * dim;
        float *tile = tiles + j / PROMPT_TILE * dim * PROMPT_TILE + j % PROMPT_TILE;
        for (int d = 0; d < dim; d += 8) {
            float row[8];
            _mm256_storeu_ps(row, prompt_load8(k, kv_bf16, at[j] + d));
            for (int e = 0; e < 8; e++) tile[(d + e) * PROMPT_TILE] = row[e];
        }
    }
}

/* One query row's attention over keys 0..seen-1: its scores 4 tiles at a time (32 keys,
 * independent sums), the softmax, then the value rows. `scores`: seen rounded up to 32 floats. */
static void prompt_attend_row_avx2(const float *q, const float *tiles, const void *v, int kv_bf16,
                                   const int64_t *at, int64_t seen, int dim, float scale, float *scores,
                                   float *out) {
    const int64_t count = (seen + PROMPT_TILE - 1) / PROMPT_TILE;
    const int64_t span = dim * PROMPT_TILE;
    for (int64_t t = 0; t < count; t += 4) {
        const int64_t in_step = count - t < 4 ? count - t : 4;
        __m256 sum[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        const float *tile = tiles + t * span;
        if (in_step == 4) {
            for (int d = 0; d < dim; d++) {
                const __m256 qd = _mm256_set1_ps(q[d]);
                for (int u = 0; u < 4; u++) sum[u] = _mm256_fmadd_ps(qd, _mm256_load_ps(tile + u * span + d * PROMPT_TILE), sum[u]);
            }
        } else {
            for (int d = 0; d < dim; d++)
                for (int u = 0; u < in_step; u++)
                    sum[u] = _mm256_fmadd_ps(_mm256_set1_ps(q[d]), _mm256_load_ps(tile + u * span + d * PROMPT_TILE), sum[u]);
        }
        for (int u = 0; u < in_step; u++) _mm256_storeu_ps(scores + (t + u) * PROMPT_TILE, _mm256_mul_ps(sum[u], _mm256_set1_ps(scale)));
    }
    for (int64_t j = seen; j < count * PROMPT_TILE; j++) scores[j] = -INFINITY; /* the causal mask */
    __m256 high8 = _mm256_set1_ps(-INFINITY);
    for (int64_t t = 0; t < count; t++) high8 = _mm256_max_ps(high8, _mm256_loadu_ps(scores + t * PROMPT_TILE));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(high8), _mm256_extractf128_ps(high8, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    const __m256 high = _mm256_set1_ps(_mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1))));
    __m256 total8 = _mm256_setzero_ps();
    for (int64_t t = 0; t < count; t++) {
        const __m256 p = prompt_exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + t * PROMPT_TILE), high));
        total8 = _mm256_add_ps(total8, p);
        _mm256_storeu_ps(scores + t * PROMPT_TILE, p);
    }
    float lanes[8], total = 0.0f;
    _mm256_storeu_ps(lanes, total8);
    for (int e = 0; e < 8; e++) total += lanes[e];
    __m256 acc[PROMPT_MAX_DIM / 8];
    for (int c = 0; c < dim / 8; c++) acc[c] = _mm256_setzero_ps();
    for (int64_t j = 0; j < seen; j++) {
        const __m256 p = _mm256_set1_ps(scores[j]);
        for (int c = 0; c < dim / 8; c++) acc[c] = _mm256_fmadd_ps(p, prompt_load8(v, kv_bf16, at[j] + 8 * c), acc[c]);
    }
    const __m256 inverse = _mm256_set1_ps(1.0f / total);
    for (int c = 0; c < dim / 8; c++) _mm256_storeu_ps(out + 8 * c, _mm256_mul_ps(acc[c], inverse));
}

/* prompt_attention_portable on AVX2: every KV head's keys laid out first, then the rows. */
static int prompt_attention_avx2(const float *q, int64_t q_stride, const void *k, const void *v, int kv_bf16,
                                 const int32_t *table, int block_size, int n, int ctx, int num_heads,
                                 int num_kv_heads, int dim, float scale, float *out) {
    const int group = num_heads / num_kv_heads;
    const int64_t count = (ctx + PROMPT_TILE - 1) / PROMPT_TILE, padded = count * PROMPT_TILE;
    float *tiles = aligned_alloc(32, sizeof(float) * (size_t)(num_kv_heads * count * dim * PROMPT_TILE));
    int64_t *at = malloc(sizeof(int64_t) * (size_t)(num_kv_heads * ctx));
    int failed = !tiles || !at;
#pragma omp parallel if ((int64_t)n * ctx * num_heads > 65536)
    {
        if (!failed) {
#pragma omp for schedule(static)
            for (int kvh = 0; kvh < num_kv_heads; kvh++)
                prompt_lay_out_keys(k, kv_bf16, table, block_size, ctx, kvh, num_kv_heads, dim,
                                    tiles + kvh * count * dim * PROMPT_TILE, at + (int64_t)kvh * ctx);
        }
        float *scores = failed ? NULL : malloc(sizeof(float) * (size_t)(padded + 32));
        if (!failed && !scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
#pragma omp for collapse(2) schedule(dynamic)
        for (int i = 0; i < n; i++)
            for (int h = 0; h < num_heads; h++)
                if (!failed) {
                    const int kvh = h / group;
                    prompt_attend_row_avx2(q + (int64_t)i * q_stride + (int64_t)h * dim,
                                           tiles + kvh * count * dim * PROMPT_TILE, v, kv_bf16,
                                           at + (int64_t)kvh * ctx, (int64_t)ctx - n + i + 1, dim, scale, scores,
                                           out + ((int64_t)i * num_heads + h) * dim);
                }
        free(scores);
    }
    free(tiles);
    free(at);
    return failed ? -2 : 0;
}
