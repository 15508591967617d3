/* The decode step for one pair of element types; decode_step.c includes this once per pair
 * with ELEM (the weights' storage type), LOAD (to fp32), ROUND (to the activations'
 * precision, kept in fp32), LINEAR (the products in that dtype), KV_ELEM (the KV cache's
 * storage type), KV_LOAD/KV_LOAD16/KV_STORE (one or 16 cache values to fp32 and one back)
 * and FN (name suffix) defined. */

/* HF Llama RMSNorm: x * (1 / sqrt(mean(x^2) + eps)) in fp32, rounded, then * weight. */
static void FN(rms_norm_row)(const float *x, const ELEM *weight, int n, float eps, float *out) {
    /* exact-ish mean (each square exact in double; torch's cascade sum is within an ulp of
     * it), in 8 running sums: one sum is a chain of dependent adds, ~1 us a row */
    double sums[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) sums[j] += (double)x[i + j] * x[i + j];
    for (; i < n; i++) sums[0] += (double)x[i] * x[i];
    const double sum = ((sums[0] + sums[1]) + (sums[2] + sums[3])) + ((sums[4] + sums[5]) + (sums[6] + sums[7]));
    const float inv = 1.0f / sqrtf((float)(sum / n) + eps);
    for (i = 0; i < n; i++) out[i] = ROUND(ROUND(x[i] * inv) * LOAD(weight[i]));
}

/* Rotate-half RoPE on `heads` heads of one token in place; cos and sin in the dtype. */
static void FN(rope_heads)(float *x, int heads, int head_dim, const float *cos_sin,
                           int64_t position) {
    const int half = head_dim / 2;
    const float *cos = cos_sin + position * head_dim, *sin = cos + half;
    for (int h = 0; h < heads; h++, x += head_dim) {
        for (int i = 0; i < half; i++) {
            const float a = x[i], b = x[i + half], c = ROUND(cos[i]), s = ROUND(sin[i]);
            x[i] = ROUND(ROUND(a * c) - ROUND(b * s));
            x[i + half] = ROUND(ROUND(b * c) + ROUND(a * s));
        }
    }
}

/* rows[i]: the K/V row offset of token start + i for one KV head, for i < n; and a request to
 * load those rows, made a block ahead of their use: one KV head's rows are a few hundred
 * bytes apart and its blocks scattered over the pool, so without it the attention loops
 * wait on memory for each row in turn. The rows are asked for into L2, not L1: a block's
 * 128 lines are more misses than L1 keeps in flight. Asked for into L1, the attention of 8
 * rows over contexts of 300 (SmolLM2's 30 layers, each its own bf16 cache) took 12.9-14.1 ms
 * on a Zen 4 core, into L2 7.7-10.2 (median 8.0), 3.9 with the rows already in cache
 * (bench/decode_attention.py; bench/results/decode_attention.zen4.json). */
static void FN(locate_rows)(const KV_ELEM *k_cache, const KV_ELEM *v_cache, const int32_t *table,
                            int block_size, int start, int n, int kv_head, int num_kv_heads,
                            int head_dim, int64_t *rows) {
    const int row_bytes = head_dim * (int)sizeof(KV_ELEM);
    /* the tokens are consecutive: one division, then a walk along the table (a division a
     * token was a tenth of a decode step's attention) */
    int block = start / block_size, offset = start % block_size;
    for (int i = 0; i < n; i++, offset++) {
        if (offset == block_size) block++, offset = 0;
        rows[i] = (((int64_t)table[block] * block_size + offset) * num_kv_heads + kv_head) * head_dim;
        for (int byte = 0; byte < row_bytes; byte += 64) {
            __builtin_prefetch((const char *)(k_cache + rows[i]) + byte, 0, 2);
            __builtin_prefetch((const char *)(v_cache + rows[i]) + byte, 0, 2);
        }
    }
}

#if defined(__AVX512F__)
/* The two products of a block of tokens with the head's values in registers: 16 floats a
 * register, `chunks` registers a head (a constant at each call, so the loops unroll and the
 * accumulators stay in registers). Each score's 16 partial sums are added as a tree; the
 * portable loops below leave the compiler a running sum it turns into a chain of scalar
 * adds, which was half of a decode step's attention time. These sums use fused multiply-adds
 * and their own order: float32 results a few ulps from the portable loops' (the attention
 * never matched torch's bits; the tests compare it within float32 tolerance). */
static inline __attribute__((always_inline)) void FN(block_scores_avx512)(
    const float *q, int heads, const KV_ELEM *k_cache, const int64_t *rows, int n, const int chunks,
    float scale, float p[][ATTENTION_TOKENS]) {
    for (int t = 0; t < n; t++) {
        const KV_ELEM *k = k_cache + rows[t];
        __m512 kc[ATTENTION_CHUNKS];
        for (int c = 0; c < chunks; c++) kc[c] = KV_LOAD16(k + 16 * c);
        for (int g = 0; g < heads; g++) {
            const float *qg = q + g * chunks * 16;
            __m512 s = _mm512_mul_ps(_mm512_loadu_ps(qg), kc[0]);
            for (int c = 1; c < chunks; c++) s = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), kc[c], s);
            p[g][t] = _mm512_reduce_add_ps(s) * scale;
        }
    }
}

/* block_scores_avx512 for head_dim 64 and a group of up to 4 heads, four tokens at a time:
 * their K rows widened once for the group, and each head's four scores summed across lanes
 * together (sum4) rather than with a reduction each. */
static inline __attribute__((always_inline)) void FN(group_scores_avx512)(
    const float *q, const int heads, const KV_ELEM *k_cache, const int64_t *rows, int n, float scale,
    float p[][ATTENTION_TOKENS]) {
    const __m128 scaled = _mm_set1_ps(scale);
    int t = 0;
    for (; t + 4 <= n; t += 4) {
        __m512 kc[4][4];
        for (int i = 0; i < 4; i++)
            for (int c = 0; c < 4; c++) kc[i][c] = KV_LOAD16(k_cache + rows[t + i] + 16 * c);
        for (int g = 0; g < heads; g++) {
            const float *qg = q + g * 64;
            __m512 s[4];
            for (int i = 0; i < 4; i++) s[i] = _mm512_mul_ps(_mm512_loadu_ps(qg), kc[i][0]);
            for (int c = 1; c < 4; c++) {
                const __m512 qc = _mm512_loadu_ps(qg + 16 * c);
                for (int i = 0; i < 4; i++) s[i] = _mm512_fmadd_ps(qc, kc[i][c], s[i]);
            }
            _mm_storeu_ps(&p[g][t], _mm_mul_ps(sum4(s[0], s[1], s[2], s[3]), scaled));
        }
    }
    if (t < n) FN(block_scores_avx512)(q, heads, k_cache, rows + t, n - t, 4, scale, (float (*)[ATTENTION_TOKENS])&p[0][t]);
}

static inline __attribute__((always_inline)) void FN(block_values_avx512)(
    float p[][ATTENTION_TOKENS], int heads, const KV_ELEM *v_cache, const int64_t *rows, int n,
    const int chunks, float *out) {
    for (int g = 0; g < heads; g++) {
        float *og = out + g * chunks * 16;
        __m512 acc[ATTENTION_CHUNKS];
        for (int c = 0; c < chunks; c++) acc[c] = _mm512_loadu_ps(og + 16 * c);
        for (int t = 0; t < n; t++) {
            const __m512 weight = _mm512_set1_ps(p[g][t]);
            const KV_ELEM *v = v_cache + rows[t];
            for (int c = 0; c < chunks; c++) acc[c] = _mm512_fmadd_ps(weight, KV_LOAD16(v + 16 * c), acc[c]);
        }
        for (int c = 0; c < chunks; c++) _mm512_storeu_ps(og + 16 * c, acc[c]);
    }
}

/* block_values_avx512 for a group small enough that all its heads' sums stay in registers
 * (heads x chunks <= 16): each V row is loaded and widened once for the whole group, not
 * once a head. `heads` and `chunks` are constants at each call, so the loops unroll. */
static inline __attribute__((always_inline)) void FN(group_values_avx512)(
    float p[][ATTENTION_TOKENS], const int heads, const KV_ELEM *v_cache, const int64_t *rows, int n,
    const int chunks, float *out) {
    __m512 acc[16];
    for (int i = 0; i < heads * chunks; i++) acc[i] = _mm512_loadu_ps(out + 16 * i);
    for (int t = 0; t < n; t++) {
        const KV_ELEM *v = v_cache + rows[t];
        __m512 vc[ATTENTION_CHUNKS];
        for (int c = 0; c < chunks; c++) vc[c] = KV_LOAD16(v + 16 * c);
        for (int g = 0; g < heads; g++) {
            const __m512 weight = _mm512_set1_ps(p[g][t]);
            for (int c = 0; c < chunks; c++) acc[g * chunks + c] = _mm512_fmadd_ps(weight, vc[c], acc[g * chunks + c]);
        }
    }
    for (int i = 0; i < heads * chunks; i++) _mm512_storeu_ps(out + 16 * i, acc[i]);
}
#endif

/* p[g][t] = q_g . k_t * scale for the block's n tokens. */
static void FN(block_scores)(const float *q, int heads, const KV_ELEM *k_cache, const int64_t *rows,
                             int n, int head_dim, float scale, float p[][ATTENTION_TOKENS]) {
#if defined(__AVX512F__)
    if (head_dim == 64) {
        switch (heads) {
        case 1: FN(group_scores_avx512)(q, 1, k_cache, rows, n, scale, p); return;
        case 2: FN(group_scores_avx512)(q, 2, k_cache, rows, n, scale, p); return;
        case 3: FN(group_scores_avx512)(q, 3, k_cache, rows, n, scale, p); return;
        case 4: FN(group_scores_avx512)(q, 4, k_cache, rows, n, scale, p); return;
        }
        FN(block_scores_avx512)(q, heads, k_cache, rows, n, 4, scale, p);
        return;
    }
    if (head_dim == 128) { FN(block_scores_avx512)(q, heads, k_cache, rows, n, 8, scale, p); return; }
#endif
    for (int t = 0; t < n; t++) {
        const KV_ELEM *k = k_cache + rows[t];
        for (int g = 0; g < heads; g++) {
            const float *qg = q + g * head_dim;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int d = 0; d < head_dim; d++) dot += qg[d] * KV_LOAD(k[d]);
            p[g][t] = dot * scale;
        }
    }
}

/* out_g += sum over the block's tokens of p[g][t] * v_t. */
static void FN(block_values)(float p[][ATTENTION_TOKENS], int heads, const KV_ELEM *v_cache,
                             const int64_t *rows, int n, int head_dim, float *out) {
#if defined(__AVX512F__)
    if (head_dim == 64) {
        switch (heads) { /* GQA groups of up to 4 heads: one widened V row for all */
        case 1: FN(group_values_avx512)(p, 1, v_cache, rows, n, 4, out); return;
        case 2: FN(group_values_avx512)(p, 2, v_cache, rows, n, 4, out); return;
        case 3: FN(group_values_avx512)(p, 3, v_cache, rows, n, 4, out); return;
        case 4: FN(group_values_avx512)(p, 4, v_cache, rows, n, 4, out); return;
        }
        FN(block_values_avx512)(p, heads, v_cache, rows, n, 4, out);
        return;
    }
    if (head_dim == 128) {
        switch (heads) { /* groups of up to 2 heads keep their sums in registers */
        case 1: FN(group_values_avx512)(p, 1, v_cache, rows, n, 8, out); return;
        case 2: FN(group_values_avx512)(p, 2, v_cache, rows, n, 8, out); return;
        }
        FN(block_values_avx512)(p, heads, v_cache, rows, n, 8, out);
        return;
    }
#endif
    for (int t = 0; t < n; t++) {
        const KV_ELEM *v = v_cache + rows[t];
        for (int g = 0; g < heads; g++) {
            float *og = out + g * head_dim;
            const float pt = p[g][t];
            for (int d = 0; d < head_dim; d++) og[d] += pt * KV_LOAD(v[d]);
        }
    }
}

/* The query heads sharing one KV head (GQA) over their sequence's paged context:
 * softmax(q k^T * scale) v in fp32, online over blocks of tokens (a running max and sum per
 * head), so each K and V row is read once for the whole group and no buffer grows with
 * the context. q and out: [heads, head_dim], heads <= ATTENTION_HEADS. */
static void FN(attend_group)(const float *q, int heads, const KV_ELEM *k_cache, const KV_ELEM *v_cache,
                             const int32_t *table, int block_size, int context_len, int kv_head,
                             int num_kv_heads, int head_dim, float scale, float *out) {
    float running_max[ATTENTION_HEADS], denominator[ATTENTION_HEADS];
    float p[ATTENTION_HEADS][ATTENTION_TOKENS];
    int64_t located[2][ATTENTION_TOKENS]; /* K/V row offsets: this block's and the next's */
    for (int g = 0; g < heads; g++) {
        running_max[g] = -INFINITY;
        denominator[g] = 0.0f;
        for (int d = 0; d < head_dim; d++) out[g * head_dim + d] = 0.0f;
    }
    FN(locate_rows)(k_cache, v_cache, table, block_size, 0,
                    context_len < ATTENTION_TOKENS ? context_len : ATTENTION_TOKENS, kv_head,
                    num_kv_heads, head_dim, located[0]);
    for (int start = 0, block = 0; start < context_len; start += ATTENTION_TOKENS, block ^= 1) {
        const int n = context_len - start < ATTENTION_TOKENS ? context_len - start : ATTENTION_TOKENS;
        const int next = start + ATTENTION_TOKENS, left = context_len - next;
        if (left > 0)
            FN(locate_rows)(k_cache, v_cache, table, block_size, next,
                            left < ATTENTION_TOKENS ? left : ATTENTION_TOKENS, kv_head,
                            num_kv_heads, head_dim, located[block ^ 1]);
        const int64_t *rows = located[block]; /* each token's K/V row offset, for both passes */
        FN(block_scores)(q, heads, k_cache, rows, n, head_dim, scale, p);
        for (int g = 0; g < heads; g++) {
            const float block_max = block_row_max(p[g], n);
            if (block_max > running_max[g]) {
                const float rescale = expf(running_max[g] - block_max); /* 0 on the first block */
                denominator[g] *= rescale;
                for (int d = 0; d < head_dim; d++) out[g * head_dim + d] *= rescale;
                running_max[g] = block_max;
            }
            exp_shifted_into(p[g], n, running_max[g], &denominator[g]);
        }
        FN(block_values)(p, heads, v_cache, rows, n, head_dim, out);
    }
    for (int g = 0; g < heads; g++) {
        const float inv = 1.0f / denominator[g];
        for (int d = 0; d < head_dim; d++) out[g * head_dim + d] = ROUND(out[g * head_dim + d] * inv);
    }
}

/* Attention of `rows` query rows (q_stride floats apart, num_heads heads each) over their
 * paged contexts, row r's context being its first ends[r] + end_offset tokens; out [rows,
 * num_heads, head_dim]. Work items are (row, KV head, up to ATTENTION_HEADS of its query
 * heads); threads share them once the step has enough tokens to pay for waking them. The
 * step's own attention and baton_decode_attention (the torch path's decode rows) both run it. */
static void FN(attend_rows)(const float *q, int64_t q_stride, int rows, const KV_ELEM *k_cache,
                            const KV_ELEM *v_cache, const int64_t *ends, int end_offset,
                            const int32_t *tables, int table_width, int block_size, int num_heads,
                            int num_kv_heads, int head_dim, float scale, float *out) {
    const int group = num_heads / num_kv_heads;
    const int parts = (group + ATTENTION_HEADS - 1) / ATTENTION_HEADS, items = num_kv_heads * parts;
    int64_t work = 0;
    for (int r = 0; r < rows; r++) work += ends[r] + end_offset;
#pragma omp parallel for collapse(2) schedule(static) if (work * num_heads > 4096)
    for (int r = 0; r < rows; r++) {
        for (int item = 0; item < items; item++) {
            const int kv_head = item / parts, first = kv_head * group + (item % parts) * ATTENTION_HEADS;
            const int heads = (kv_head + 1) * group - first < ATTENTION_HEADS
                                  ? (kv_head + 1) * group - first : ATTENTION_HEADS;
            FN(attend_group)(q + (int64_t)r * q_stride + first * head_dim, heads, k_cache, v_cache,
                             tables + (int64_t)r * table_width, block_size, (int)(ends[r] + end_offset),
                             kv_head, num_kv_heads, head_dim, scale,
                             out + ((int64_t)r * num_heads + first) * head_dim);
        }
    }
}

/* Each row's context is its tokens up to and including its own (position + 1): a decode
 * row's in attend_rows, a prompt chunk's rows together in prompt attention (a row sees the
 * keys up to its own position; every row's K/V is in the cache by now). 0, or
 * prompt_attention_run's status. */
/* The decode rows' attention (rows first..rows - 1), each over its own context. */
static void FN(decode_rows_attention)(const Model *m, const Layer *layer, int first, int rows, const float *qkv,
                                      int qkv_width, const int64_t *positions, const int32_t *tables,
                                      int table_width, float *attn) {
    const int64_t attn_width = (int64_t)m->num_heads * m->head_dim;
    FN(attend_rows)(qkv + (int64_t)first * qkv_width, qkv_width, rows - first, (const KV_ELEM *)layer->k_cache,
                    (const KV_ELEM *)layer->v_cache, positions + first, 1, tables + (int64_t)first * table_width,
                    table_width, m->block_size, m->num_heads, m->num_kv_heads, m->head_dim, m->scale,
                    attn + first * attn_width);
}

static int FN(attention)(const Model *m, const Layer *layer, int rows, const float *qkv,
                         int qkv_width, const int64_t *positions, const int32_t *tables,
                         int table_width, const Prompts *prompts, float *attn) {
    const int first = (int)prompts->starts[prompts->chunks]; /* the first decode row */
    const int64_t attn_width = (int64_t)m->num_heads * m->head_dim;
    FN(decode_rows_attention)(m, layer, first, rows, qkv, qkv_width, positions, tables, table_width, attn);
    for (int c = 0; c < prompts->chunks; c++) {
        const int64_t r0 = prompts->starts[c], n = prompts->starts[c + 1] - r0;
        const int status = prompt_attention_paged(
            qkv + r0 * qkv_width, qkv_width, layer->k_cache, layer->v_cache, KV_BF16, tables + r0 * table_width,
            m->block_size, (int)n, (int)(positions[r0 + n - 1] + 1), m->num_heads, m->num_kv_heads, m->head_dim,
            m->scale, attn + r0 * attn_width, prompts->bf16_products);
        if (status) return status;
    }
    for (int64_t i = 0; ROUNDS && i < first * attn_width; i++) attn[i] = ROUND(attn[i]);
    return 0;
}

/* silu(gate) * up, silu(x) = x / (1 + exp(-x)) as torch computes it, each result rounded. */
static void FN(silu_and_mul)(const float *gate_up, int rows, int width, float *act) {
#pragma omp parallel for schedule(static) if ((int64_t)rows * width > 262144)
    for (int r = 0; r < rows; r++) {
        const float *gate = gate_up + (int64_t)r * 2 * width, *up = gate + width;
        float *out = act + (int64_t)r * width;
        if (!ROUNDS) { /* float32: nothing to round, the vectorized row */
            silu_and_mul_row_f32(gate, up, width, out);
            continue;
        }
        for (int i = 0; i < width; i++)
            out[i] = ROUND(ROUND(gate[i] / (1.0f + expf(-gate[i]))) * up[i]);
    }
}

static void FN(add_rows)(float *residual, const float *x, int64_t count) {
    for (int64_t i = 0; i < count; i++) residual[i] = ROUND(x[i] + residual[i]);
}

static void FN(norm_rows)(const Model *m, const void *weight, int rows, const Workspace *ws) {
#pragma omp parallel for schedule(static) if ((int64_t)rows * m->hidden > 65536)
    for (int r = 0; r < rows; r++)
        FN(rms_norm_row)(ws->residual + (int64_t)r * m->hidden, (const ELEM *)weight, m->hidden,
                         m->eps, ws->normed + (int64_t)r * m->hidden);
}

/* Tensor parallelism: a row-parallel product's partial sums (or the embedding's rows) added
 * up over the ranks, rounded as the torch path rounds the sum it gets back. */
static void FN(sum_over_ranks)(const Model *m, float *x, int64_t count) {
    if (!m->all_reduce) return;
    m->all_reduce(x, count);
    for (int64_t i = 0; i < count; i++) x[i] = ROUND(x[i]);
}

/* A layer's norm, QKV product, RoPE and cache write, for every row (into ws->qkv). */
static void FN(qkv_into_cache)(const Model *m, const Layer *layer, int rows, const int64_t *positions,
                               const int32_t *tables, int table_width, const Workspace *ws) {
    const int h = m->hidden, d = m->head_dim, hq = m->num_heads, hkv = m->num_kv_heads;
    const int qkv_width = (hq + 2 * hkv) * d, kv_width = hkv * d;
    KV_ELEM *k_cache = (KV_ELEM *)layer->k_cache, *v_cache = (KV_ELEM *)layer->v_cache;
    FN(norm_rows)(m, layer->input_norm, rows, ws);
    LINEAR(m, ws, ws->normed, rows, h, layer->qkv, layer->qkv_packed, layer->qkv_quant, qkv_width,
           layer->qkv_bias, ws->qkv);
    for (int r = 0; r < rows; r++) {
        float *row = ws->qkv + (int64_t)r * qkv_width;
        FN(rope_heads)(row, hq + hkv, d, m->cos_sin, positions[r]); /* K's heads follow Q's */
        const int64_t slot = cache_slot(tables + (int64_t)r * table_width, m->block_size, positions[r]);
        for (int i = 0; i < kv_width; i++) {
            k_cache[slot * kv_width + i] = KV_STORE(row[hq * d + i]);
            v_cache[slot * kv_width + i] = KV_STORE(row[(hq + hkv) * d + i]);
        }
    }
}

/* The attention's output projection of the first `rows` rows of ws->attn (into ws->out). */
static void FN(output_projection)(const Model *m, const Layer *layer, int rows, const Workspace *ws) {
    LINEAR(m, ws, ws->attn, rows, m->num_heads * m->head_dim, layer->o_proj, layer->o_proj_packed,
           layer->o_proj_quant, m->hidden, NULL, ws->out);
    FN(sum_over_ranks)(m, ws->out, (int64_t)rows * m->hidden);
}

/* Attention half of a layer: norm, QKV, RoPE, cache write, attention, output projection
 * (into ws->out). 0, or FN(attention)'s status. */
static int FN(attention_block)(const Model *m, const Layer *layer, int rows,
                               const int64_t *positions, const int32_t *tables, int table_width,
                               const Prompts *prompts, const Workspace *ws) {
    const int d = m->head_dim, hq = m->num_heads, hkv = m->num_kv_heads;
    FN(qkv_into_cache)(m, layer, rows, positions, tables, table_width, ws);
    const int status = FN(attention)(m, layer, rows, ws->qkv, (hq + 2 * hkv) * d, positions, tables, table_width,
                                     prompts, ws->attn);
    if (status) return status;
    FN(output_projection)(m, layer, rows, ws);
    return 0;
}

/* The last layer's attention half where fewer rows are sampled than the step has: every row's
 * K/V is written (later steps attend over it), but only the sampled rows (logit_rows,
 * increasing) go on through attention and the output projection, moved to the front of
 * ws->attn and ws->residual as they go; the MLP then takes only them. A prompt chunk's other
 * rows need nothing past their K/V here: of a 256-token prompt's step that is 255 rows of
 * the last layer's attention, output projection and MLP (on a Zen 4 core 240.6-250.2 ms
 * became 235.3-240.9, a 512-token prompt's 526-558 ms 509-520: results/last_layer_zen4/).
 * A row's attention sees the keys up to its position whatever rows share its chunk; its
 * products, taken at fewer rows, may run on another engine (the int16 kernels below 8). 0,
 * or prompt attention's status. */
static int FN(sampled_attention_block)(const Model *m, const Layer *layer, int rows, const int64_t *positions,
                                       const int32_t *tables, int table_width, const Prompts *prompts,
                                       const int64_t *logit_rows, int logit_count, const Workspace *ws) {
    const int h = m->hidden, d = m->head_dim, hq = m->num_heads, hkv = m->num_kv_heads;
    const int qkv_width = (hq + 2 * hkv) * d, first = (int)prompts->starts[prompts->chunks];
    const int64_t attn_width = (int64_t)hq * d;
    FN(qkv_into_cache)(m, layer, rows, positions, tables, table_width, ws);
    FN(decode_rows_attention)(m, layer, first, rows, ws->qkv, qkv_width, positions, tables, table_width, ws->attn);
    for (int i = 0; i < logit_count; i++) {
        const int64_t r = logit_rows[i];
        if (r >= first) continue; /* a decode row: above */
        const int status = prompt_attention_paged(
            ws->qkv + r * qkv_width, qkv_width, layer->k_cache, layer->v_cache, KV_BF16, tables + r * table_width,
            m->block_size, 1, (int)(positions[r] + 1), hq, hkv, d, m->scale, ws->attn + r * attn_width,
            prompts->bf16_products);
        if (status) return status;
        for (int64_t j = 0; ROUNDS && j < attn_width; j++) ws->attn[r * attn_width + j] = ROUND(ws->attn[r * attn_width + j]);
    }
    rows_to_front(ws->attn, attn_width, logit_rows, logit_count); /* the sampled rows to the front */
    rows_to_front(ws->residual, h, logit_rows, logit_count);
    if (logit_count) FN(output_projection)(m, layer, logit_count, ws);
    return 0;
}

static void FN(mlp_block)(const Model *m, const Layer *layer, int rows, const Workspace *ws) {
    const int h = m->hidden, i = m->intermediate;
    FN(norm_rows)(m, layer->post_norm, rows, ws);
    LINEAR(m, ws, ws->normed, rows, h, layer->gate_up, layer->gate_up_packed, layer->gate_up_quant, 2 * i,
           NULL, ws->gate_up);
    FN(silu_and_mul)(ws->gate_up, rows, i, ws->act);
    LINEAR(m, ws, ws->act, rows, i, layer->down, layer->down_packed, layer->down_quant, h, NULL, ws->out);
    FN(sum_over_ranks)(m, ws->out, (int64_t)rows * h);
}

/* One step of `rows` rows: its prompt chunks' rows first (see Prompts), then one new token
 * for each decoding sequence, at `positions` (the caches hold every earlier token of each
 * sequence). Writes every row's K/V into the caches and the fp32 logits of rows
 * logit_rows[0..logit_count) (increasing) into logits[logit_count, vocab]. Returns 0; -1
 * for a prompt chunk prompt attention does not take; -2 out of memory (prompt attention's
 * copy of a context). */
int FN(baton_decode_step)(const Model *m, int rows, const int64_t *token_ids, const int64_t *positions,
                          const int32_t *tables, int table_width, const Prompts *prompts,
                          const int64_t *logit_rows, int logit_count, const Workspace *ws, float *logits) {
    const int h = m->hidden;
    const int64_t width = (int64_t)rows * h;
    const ELEM *embed = (const ELEM *)m->embed;
    for (int r = 0; r < rows; r++) {
        /* a rank holds some vocabulary rows: the others read zero, and the sum over ranks
         * is each token's row */
        float *out = ws->residual + (int64_t)r * h;
        const int64_t row = token_ids[r] - m->vocab_start;
        const bool held = row >= 0 && row < m->vocab;
        if (held && m->embed_quant) { /* dequantized and rounded as a weight load is */
            baton_quant_dequantize_to(m->embed_quant, (int)row, 1, out, 0);
            for (int i = 0; i < h; i++) out[i] = ROUND(out[i]);
        } else {
            for (int i = 0; i < h; i++) out[i] = held ? LOAD(embed[row * h + i]) : 0.0f;
        }
    }
    FN(sum_over_ranks)(m, ws->residual, width);
    int live = rows; /* the rows the layers still carry: the last one takes only the sampled rows on */
    for (int l = 0; l < m->num_layers; l++) {
        const Layer *layer = &m->layers[l];
        if (l > 0) FN(add_rows)(ws->residual, ws->out, (int64_t)live * h);
        const int sampled_only = l == m->num_layers - 1 && logit_count < rows;
        const int status = sampled_only
            ? FN(sampled_attention_block)(m, layer, rows, positions, tables, table_width, prompts, logit_rows,
                                          logit_count, ws)
            : FN(attention_block)(m, layer, rows, positions, tables, table_width, prompts, ws);
        if (status) return status;
        if (sampled_only) live = logit_count;
        FN(add_rows)(ws->residual, ws->out, (int64_t)live * h);
        if (live) FN(mlp_block)(m, layer, live, ws);
        if (m->layer_done) m->layer_done(l);
    }
    FN(add_rows)(ws->residual, ws->out, (int64_t)live * h);
    if (live == rows) rows_to_front(ws->residual, h, logit_rows, logit_count); /* the sampled rows, where not yet */
    FN(norm_rows)(m, m->final_norm, logit_count, ws);
    LINEAR(m, ws, ws->normed, logit_count, h, m->lm_head, m->lm_head_packed, m->lm_head_quant, m->vocab, NULL,
           logits);
    return 0;
}
