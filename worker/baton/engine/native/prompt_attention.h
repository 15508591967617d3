/* Causal attention of a prompt chunk over its context, for the torch path's prompt steps
 * (native/prompt_attention.py) and the native step's prompt chunks.
 *
 * torch's CPU flash attention multiplies its blocks with MKL's sgemm (bf16 inputs are
 * widened first), and on CPUs where MKL takes its generic code path (AMD EPYC) a 2,000-token
 * prompt of SmolLM2 spent 2.7 s of 4.3 s there on one core. Here each task takes one KV head
 * and up to 64 query rows (chunk rows x the query heads that share it), and walks the keys
 * in blocks of 32 with an online softmax; the context is laid out once for all tasks
 * (PromptAttention). A row sees the keys up to its own position; rows are independent of
 * each other. Two engines, each with the softmax across 16 query rows at once:
 *   - AVX-512 (prompt_attention_lanes.h): float32 FMAs (bf16 keys and values widened
 *     exactly) or, with `bf16_products`, VDPBF16PS on bf16 pairs (the query, keys, values
 *     and probabilities rounded to bf16, as torch's bf16 attention rounds them);
 *   - AMX tiles (prompt_attention_tiles.h), for bf16 products where the CPU has them and the
 *     OS grants them: the same roundings, each row's sums in the tiles' order.
 * Sums in float32 either way. Without AVX-512, a portable form in C (float32 products).
 * Included by decode_step.c (after exp_in_place and quant_product.h's AMX helpers).
 */
#define PROMPT_TASK_ROWS 64 /* query rows a task holds: (chunk rows) x (query heads of one KV head) */
#define PROMPT_MAX_DIM 128
#define PROMPT_LANES 16 /* query rows the softmax takes at once: an AVX-512 register's lanes */
/* `bf16_products`: which products (baton_prompt_attention's argument) */
#define PROMPT_FLOAT32 0
#define PROMPT_BF16_ANY 1    /* AMX tiles where they run this head size, else VDPBF16PS */
#define PROMPT_BF16_AVX512 2 /* VDPBF16PS */
#define PROMPT_BF16_AMX 3    /* AMX tiles (head size a multiple of 32) */

#if defined(__AVX512F__)
#include <stdlib.h>

/* dim values of a key or value row, widened to float32 */
static inline void prompt_row(const void *base, int bf16, int64_t at, int dim, float *out) {
    for (int c = 0; c < dim; c += 16) {
        if (bf16) {
            const __m256i half = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + at + c));
            _mm512_store_ps(out + c, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16)));
        } else {
            _mm512_store_ps(out + c, _mm512_loadu_ps((const float *)base + at + c));
        }
    }
}

/* exp_in_place's formula on 16 lanes, step for step (the same values) */
static inline __m512 prompt_exp(__m512 x) {
    const __m512 v = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 whole = _mm512_roundscale_ps(_mm512_add_ps(_mm512_mul_ps(v, _mm512_set1_ps(EXP_LOG2E)),
                                                            _mm512_set1_ps(0.5f)),
                                              _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_sub_ps(v, _mm512_mul_ps(whole, _mm512_set1_ps(EXP_LN2_HIGH)));
    r = _mm512_sub_ps(r, _mm512_mul_ps(whole, _mm512_set1_ps(EXP_LN2_LOW)));
    __m512 poly = _mm512_set1_ps(EXP_C0);
    poly = _mm512_add_ps(_mm512_mul_ps(poly, r), _mm512_set1_ps(EXP_C1));
    poly = _mm512_add_ps(_mm512_mul_ps(poly, r), _mm512_set1_ps(EXP_C2));
    poly = _mm512_add_ps(_mm512_mul_ps(poly, r), _mm512_set1_ps(EXP_C3));
    poly = _mm512_add_ps(_mm512_mul_ps(poly, r), _mm512_set1_ps(EXP_C4));
    poly = _mm512_add_ps(_mm512_mul_ps(poly, r), _mm512_set1_ps(EXP_C5));
    const __m512 y = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(poly, r), r), r), _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(whole), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
}

typedef struct {
    const float *q;
    int64_t q_stride; /* floats from one query row to the next (num_heads * dim when packed) */
    const void *k, *v;
    /* the context's block table (k and v then being the paged cache, [blocks, block_size,
     * num_kv_heads, dim]), or NULL (k and v then [ctx, num_kv_heads, dim]) */
    const int32_t *table;
    int block_size;
    int kv_bf16, n, ctx, num_heads, num_kv_heads, dim;
    float scale;
    float *out;
    int bf16_products; /* PROMPT_*: bf16 queries, keys, values and probabilities, on VDPBF16PS or tiles */
    /* the context laid out once for every task, zero past ctx, per KV head and block of 32
     * keys: in float32 the keys transposed ([dim][32]) and the values as rows ([32][dim]);
     * in bf16 pairs for VDPBF16PS, the keys' along the head dimension ([dim / 2][32][2])
     * and the values' along the keys ([16][dim][2]) */
    void *keys, *values;
    int64_t blocks;
} PromptAttention;

static inline int64_t prompt_block_at(const PromptAttention *a, int kvh, int64_t block) {
    return ((int64_t)kvh * a->blocks + block) * ATTENTION_TOKENS * a->dim;
}

/* The keys and values of block `block` of KV head kvh widened to float32, as rows `stride`
 * floats apart: keys + j * stride, values + j * stride; zero past ctx. */
static void prompt_load_block(const PromptAttention *a, int kvh, int64_t block, float *keys, float *values,
                              int stride) {
    const int dim = a->dim;
    for (int j = 0; j < ATTENTION_TOKENS; j++) {
        const int64_t key = block * ATTENTION_TOKENS + j;
        float *key_row = keys + (int64_t)j * stride, *value = values + (int64_t)j * stride;
        if (key < a->ctx) {
            const int64_t row = a->table ? cache_slot(a->table, a->block_size, key) : key;
            const int64_t at = (row * a->num_kv_heads + kvh) * dim;
            prompt_row(a->k, a->kv_bf16, at, dim, key_row);
            prompt_row(a->v, a->kv_bf16, at, dim, value);
        } else {
            memset(key_row, 0, sizeof(float) * dim);
            memset(value, 0, sizeof(float) * dim);
        }
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* For the bf16 products' layouts of a block from a bf16 cache as it is (no float32 round
 * trip, which gives back the same bits). The context is laid out afresh on every step with
 * prompt tokens, so this cost grows with the context whatever the chunk: widened to float32,
 * rounded back and the values gathered a float at a time, a chunk of 13 tokens over 1,500
 * spent as long laying it out as attending (a Xeon core with AMX). */
typedef struct {
    int32_t pairs_at[ATTENTION_TOKENS] __attribute__((aligned(64))); /* each key's row in the cache, in dwords */
    uint32_t live;                                                      /* bit j: key j lies within the context */
    uint16_t *keys, *values;                                            /* the block's place in the layout */
} PromptBf16Block;

/* Block `block` of KV head kvh: where its keys start in the cache (pairs of values), which
 * lie within the context, and where the block goes in a->keys and a->values. Returns 0 (the
 * caller takes the float32 path) where an offset passes int32. */
static int prompt_bf16_block(const PromptAttention *a, int kvh, int64_t block, PromptBf16Block *b) {
    b->live = 0;
    const int64_t first = block * ATTENTION_TOKENS, bs = a->table ? a->block_size : 1;
    /* the keys' rows walked block by block of the table: one division a block, not one a key */
    int64_t entry = first / bs, within = first % bs;
    for (int j = 0; j < ATTENTION_TOKENS; j++) {
        b->pairs_at[j] = 0;
        if (first + j < a->ctx) {
            const int64_t row = a->table ? (int64_t)a->table[entry] * bs + within : first + j;
            const int64_t pair = (row * a->num_kv_heads + kvh) * a->dim / 2;
            if (pair > INT32_MAX - a->dim) return 0;
            b->pairs_at[j] = (int32_t)pair;
            b->live |= 1u << j;
        }
        if (++within == bs) within = 0, entry++;
    }
    const int64_t at = prompt_block_at(a, kvh, block);
    b->keys = (uint16_t *)a->keys + at;
    b->values = (uint16_t *)a->values + at;
    return 1;
}

/* Pair i (values 2i and 2i + 1) of each key's row in a bf16 cache, as a dword: keys 0-15 in
 * `low`, 16-31 in `high`, zero past the context. */
static inline void prompt_gather_pairs(const void *cache, const PromptBf16Block *b, int i, __m512i *low,
                                       __m512i *high) {
    const int32_t *base = (const int32_t *)cache + i;
    *low = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), (__mmask16)b->live, _mm512_load_si512(b->pairs_at),
                                       base, 4);
    *high = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), (__mmask16)(b->live >> 16),
                                        _mm512_load_si512(b->pairs_at + 16), base, 4);
}
#endif

/* e^x for x <= 0 on 16 lanes, within an ulp or two: prompt_exp's polynomial in fused
 * multiply-adds, and 2^n applied by VSCALEFPS, in half its instructions. The exponentials are
 * much of the softmax's work, and its probabilities are rounded to bf16 on the bf16 paths. */
static inline __m512 prompt_exp_fused(__m512 x) {
    const __m512 v = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 whole = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(EXP_LOG2E)),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(whole, _mm512_set1_ps(EXP_LN2_HIGH), v);
    r = _mm512_fnmadd_ps(whole, _mm512_set1_ps(EXP_LN2_LOW), r);
    __m512 poly = _mm512_fmadd_ps(_mm512_set1_ps(EXP_C0), r, _mm512_set1_ps(EXP_C1));
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(EXP_C2));
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(EXP_C3));
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(EXP_C4));
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(EXP_C5));
    const __m512 y = _mm512_fmadd_ps(_mm512_mul_ps(poly, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(y, whole);
}

/* How far past its running maximum a row's scores may go before its sums are rescaled
 * (natural log units): e^8 is ~3,000, well inside float32 and bf16 ranges. Rescaling every
 * time a maximum rose took a multiply of every value sum (on the tiles a store and a reload
 * too); a maximum that rose by less is kept as the reference, the sums and the total then a
 * common factor larger, which the final division takes out. */
#define PROMPT_RESCALE_ABOVE 8.0f

/* The online softmax's step for one block of `keys` keys (from key kb) over 16 rows, a row a
 * lane, whose scores st[j] are to be multiplied by `scale`: which rows see key kb + j
 * (seen_by[j]: the rows at or past it; every row where the whole block lies at or below
 * `everyone`, the earliest row's position), and each row's reference, raised where its
 * scores pass it by PROMPT_RESCALE_ABOVE (or it had none). Returns the rows whose reference
 * rose, with `keep` the factor their sums so far are to be scaled by (0 where there were
 * none; 1 in the other lanes). */
static inline __mmask16 prompt_block_reference(const float st[][PROMPT_LANES], int keys, int64_t kb, int64_t everyone,
                                               __mmask16 rows_here, __m512i positions, __m512 scale,
                                               __mmask16 seen_by[], __m512 *reference, __m512 *keep) {
    const __m512 none = _mm512_set1_ps(-INFINITY);
    const int whole = kb + ATTENTION_TOKENS - 1 <= everyone;
    __m512 high = none;
    for (int j = 0; j < keys; j++) {
        seen_by[j] = whole ? rows_here : _mm512_cmpge_epi32_mask(positions, _mm512_set1_epi32((int)(kb + j)));
        high = _mm512_mask_max_ps(high, seen_by[j], high, _mm512_load_ps(st[j]));
    }
    high = _mm512_mul_ps(high, scale); /* the scale is positive: the maximum's place holds */
    const __mmask16 rise =
        _mm512_cmp_ps_mask(high, _mm512_add_ps(*reference, _mm512_set1_ps(PROMPT_RESCALE_ABOVE)), _CMP_GT_OQ);
    if (rise) {
        const __m512 raised = _mm512_mask_mov_ps(*reference, rise, high);
        *keep = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(*reference, none, _CMP_NEQ_OQ),
                                    prompt_exp_fused(_mm512_sub_ps(*reference, raised)));
        *reference = raised;
    }
    return rise;
}

/* The block's probabilities e^(scale st[j] - reference), zero where a row does not see key j,
 * for its first `keys` keys: as bf16 pairs of keys into pt (pair j / 2, each lane a row's
 * two) where pt is given, else as float32 over the scores in st (a pair past `keys` zero
 * either way). Returns their sums by row. */
static inline __m512 prompt_block_probabilities(float st[][PROMPT_LANES], int keys, const __mmask16 seen_by[],
                                                __m512 scale, __m512 reference, uint32_t pt[][PROMPT_LANES]) {
    const __m512 shift = _mm512_sub_ps(_mm512_setzero_ps(), reference);
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < keys; j += 2) {
        const __m512 e0 = _mm512_maskz_mov_ps(
            seen_by[j], prompt_exp_fused(_mm512_fmadd_ps(_mm512_load_ps(st[j]), scale, shift)));
        const __m512 e1 = j + 1 < keys ? _mm512_maskz_mov_ps(seen_by[j + 1], prompt_exp_fused(_mm512_fmadd_ps(
                                                                 _mm512_load_ps(st[j + 1]), scale, shift)))
                                       : _mm512_setzero_ps();
        sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
        if (pt) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
            _mm512_store_si512(pt[j / 2], _mm512_permutexvar_epi16(BF16_INTERLEAVE, (__m512i)_mm512_cvtne2ps_pbh(e1, e0)));
#endif
        } else {
            _mm512_store_ps(st[j], e0);
            _mm512_store_ps(st[j + 1], e1);
        }
    }
    return sum;
}

#include "prompt_attention_lanes.h"

/* the tiles' helpers (amx_permission, amx_configure) exist where quant_bf16.h includes quant_amx.h */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include "prompt_attention_tiles.h"
#else
#if !(defined(__AVX512BF16__) && defined(__AVX512BW__)) /* no quant_amx.h here, not even its stand-ins */
static int amx_permission(void) { return 0; }
static void amx_configure(void) {}
static void amx_release(void) {}
#endif
static void prompt_attention_task_amx(const PromptAttention *a, int kvh, int r0, int rows) {
    (void)a, (void)kvh, (void)r0, (void)rows;
}
static void prompt_pack_block_tiles(const PromptAttention *a, int kvh, int64_t block) {
    (void)a, (void)kvh, (void)block;
}
#endif

/* Runs a filled PromptAttention (its keys and values laid out here): 0, -1 for a shape the
 * kernel does not take (dim a multiple of 16 up to PROMPT_MAX_DIM, query heads a multiple
 * of the KV heads and at most PROMPT_TASK_ROWS of them to one, 1 <= n <= ctx), -2 out of
 * memory (for the laid-out context: 8 * ctx * num_kv_heads * dim bytes). */
static int prompt_attention_run(PromptAttention *a) {
    const int dim = a->dim, num_heads = a->num_heads, num_kv_heads = a->num_kv_heads, n = a->n;
    if (dim % 16 || dim > PROMPT_MAX_DIM || num_kv_heads <= 0 || num_heads % num_kv_heads ||
        num_heads / num_kv_heads > PROMPT_TASK_ROWS || n < 1 || n > a->ctx)
        return -1;
    if (a->bf16_products < PROMPT_FLOAT32 || a->bf16_products > PROMPT_BF16_AMX) return -1;
#if !(defined(__AVX512BF16__) && defined(__AVX512BW__))
    if (a->bf16_products) return -1;
#endif
    const int tiles_fit = dim % 32 == 0 && amx_permission();
    if (a->bf16_products == PROMPT_BF16_AMX && !tiles_fit) return -1;
    const int amx = tiles_fit && (a->bf16_products == PROMPT_BF16_AMX || a->bf16_products == PROMPT_BF16_ANY);
    a->blocks = ((int64_t)a->ctx + ATTENTION_TOKENS - 1) / ATTENTION_TOKENS;
    const size_t bytes = (size_t)num_kv_heads * a->blocks * ATTENTION_TOKENS * dim * (a->bf16_products ? 2 : 4);
    a->keys = aligned_alloc(64, bytes);
    a->values = aligned_alloc(64, bytes);
    if (!a->keys || !a->values) {
        free(a->keys);
        free(a->values);
        return -2;
    }
    const int rows = PROMPT_TASK_ROWS / (num_heads / num_kv_heads), blocks = (n + rows - 1) / rows;
    const int64_t key_blocks = a->blocks;
#pragma omp parallel
    {
        /* a block's KV heads one after another: they share the cache's rows */
#pragma omp for collapse(2) schedule(static)
        for (int64_t b = 0; b < key_blocks; b++)
            for (int kvh = 0; kvh < num_kv_heads; kvh++) {
                if (amx) prompt_pack_block_tiles(a, kvh, b);
                else prompt_lay_out_block(a, kvh, b);
            }
        if (amx) amx_configure(); /* per thread */
        /* later row blocks see more keys: dynamic scheduling evens the threads out */
#pragma omp for collapse(2) schedule(dynamic)
        for (int kvh = 0; kvh < num_kv_heads; kvh++)
            for (int b = 0; b < blocks; b++) {
                const int count = n - b * rows < rows ? n - b * rows : rows;
                if (amx) prompt_attention_task_amx(a, kvh, b * rows, count);
                else prompt_attention_task(a, kvh, b * rows, count);
            }
        if (amx) amx_release();
    }
    free(a->keys);
    free(a->values);
    return 0;
}

/* out[n, num_heads, dim] = softmax(q k^T * scale) v for the n query rows q[n, num_heads, dim]
 * at positions ctx - n .. ctx - 1, over keys and values [ctx, num_kv_heads, dim] (float32,
 * or bf16 with kv_bf16), each row over keys 0..its position. Returns prompt_attention_run's
 * status (nothing written unless 0). */
int baton_prompt_attention(const float *q, const void *k, const void *v, int kv_bf16, int n, int ctx, int num_heads,
                           int num_kv_heads, int dim, float scale, float *out, int bf16_products) {
    PromptAttention a = {q, (int64_t)num_heads * dim, k, v, NULL, 0, kv_bf16, n, ctx, num_heads, num_kv_heads, dim,
                         scale, out, bf16_products, NULL, NULL, 0};
    return prompt_attention_run(&a);
}

/* For the native step's prompt chunks (decode_step_body.h): n query rows, q_stride floats
 * apart, at positions ctx - n .. ctx - 1 of the context a block table holds in the paged
 * caches; out [n, num_heads, dim]. prompt_attention_run's status. */
static int prompt_attention_paged(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                                  int kv_bf16, const int32_t *table, int block_size, int n, int ctx, int num_heads,
                                  int num_kv_heads, int dim, float scale, float *out, int bf16_products) {
    PromptAttention a = {q, q_stride, k_cache, v_cache, table, block_size, kv_bf16, n, ctx, num_heads,
                         num_kv_heads, dim, scale, out, bf16_products, NULL, NULL, 0};
    return prompt_attention_run(&a);
}

#else
/* Without AVX-512: the same attention in portable C, float32 products only (a key or value
 * in bf16 widened exactly), each row's scores, softmax and value sums in turn; on AVX2 with
 * the keys laid out in tiles first (prompt_attention_avx2.h). Slower per
 * key than the lanes above, but the native step's prompt chunks are a few tokens over a
 * short context: running them here keeps a step with prompt tokens on the native step
 * (without it such a step took torch's path, ~45 ms more on a Zen 3 core). Where torch's
 * attention is the faster for a step's chunks, native/prompt_attention.py's `choose` says so
 * and the step takes torch's path. Sums in float32. */
#include <stdlib.h>
#if defined(__AVX2__) && defined(__FMA__)
#include "prompt_attention_avx2.h"
#else /* without AVX2: one key at a time */

/* Row i (position ctx - n + i), query head h: out = softmax(q k^T * scale) v over keys
 * 0..position. `scores`: ctx floats; `at`: ctx offsets, each key's row in k and v (found
 * once, for both passes). */
static void prompt_attend_row_portable(const float *q, const void *k, const void *v, int kv_bf16,
                                       const int32_t *table, int block_size, int64_t seen, int kvh,
                                       int num_kv_heads, int dim, float scale, float *scores, int64_t *at,
                                       float *out) {
    float high = -INFINITY, total = 0.0f;
    for (int64_t j = 0; j < seen; j++) {
        at[j] = ((table ? cache_slot(table, block_size, j) : j) * num_kv_heads + kvh) * dim;
        float dot = 0.0f;
        if (kv_bf16) {
            const uint16_t *key = (const uint16_t *)k + at[j];
            for (int d = 0; d < dim; d++) dot += q[d] * bf16_to_f32(key[d]);
        } else {
            const float *key = (const float *)k + at[j];
#pragma omp simd reduction(+ : dot)
            for (int d = 0; d < dim; d++) dot += q[d] * key[d];
        }
        scores[j] = dot * scale;
        high = scores[j] > high ? scores[j] : high;
    }
    for (int d = 0; d < dim; d++) out[d] = 0.0f;
    for (int64_t j = 0; j < seen; j++) {
        const float p = expf(scores[j] - high);
        total += p;
        if (kv_bf16) {
            const uint16_t *value = (const uint16_t *)v + at[j];
            for (int d = 0; d < dim; d++) out[d] += p * bf16_to_f32(value[d]);
        } else {
            const float *value = (const float *)v + at[j];
#pragma omp simd
            for (int d = 0; d < dim; d++) out[d] += p * value[d];
        }
    }
    for (int d = 0; d < dim; d++) out[d] /= total;
}

/* prompt_attention_portable without AVX2: row by row, query head by query head. */
static int prompt_attention_scalar(const float *q, int64_t q_stride, const void *k, const void *v, int kv_bf16,
                                   const int32_t *table, int block_size, int n, int ctx, int num_heads,
                                   int num_kv_heads, int dim, float scale, float *out) {
    const int group = num_heads / num_kv_heads;
    int failed = 0;
#pragma omp parallel if ((int64_t)n * ctx * num_heads > 65536)
    {
        float *scores = malloc(sizeof(float) * (size_t)ctx);
        int64_t *at = malloc(sizeof(int64_t) * (size_t)ctx);
        if (!scores || !at) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for collapse(2) schedule(dynamic)
        for (int i = 0; i < n; i++)
            for (int h = 0; h < num_heads; h++)
                if (scores && at)
                    prompt_attend_row_portable(q + (int64_t)i * q_stride + (int64_t)h * dim, k, v, kv_bf16, table,
                                               block_size, (int64_t)ctx - n + i + 1, h / group, num_kv_heads, dim,
                                               scale, scores, at, out + ((int64_t)i * num_heads + h) * dim);
        free(scores);
        free(at);
    }
    return failed ? -2 : 0;
}
#endif

/* prompt_attention_run's contract on the portable kernel: 0, -1 for a shape or product it
 * does not take (bf16 products), -2 out of memory. */
static int prompt_attention_portable(const float *q, int64_t q_stride, const void *k, const void *v, int kv_bf16,
                                     const int32_t *table, int block_size, int n, int ctx, int num_heads,
                                     int num_kv_heads, int dim, float scale, float *out, int bf16_products) {
    if (dim % 16 || dim > PROMPT_MAX_DIM || num_kv_heads <= 0 || num_heads % num_kv_heads ||
        num_heads / num_kv_heads > PROMPT_TASK_ROWS || n < 1 || n > ctx || bf16_products != PROMPT_FLOAT32)
        return -1; /* the AVX-512 form's shapes, so a model runs natively on both or neither */
#if defined(__AVX2__) && defined(__FMA__)
    return prompt_attention_avx2(q, q_stride, k, v, kv_bf16, table, block_size, n, ctx, num_heads, num_kv_heads,
                                 dim, scale, out);
#else
    return prompt_attention_scalar(q, q_stride, k, v, kv_bf16, table, block_size, n, ctx, num_heads, num_kv_heads,
                                   dim, scale, out);
#endif
}

int baton_prompt_attention(const float *q, const void *k, const void *v, int kv_bf16, int n, int ctx, int num_heads,
                           int num_kv_heads, int dim, float scale, float *out, int bf16_products) {
    return prompt_attention_portable(q, (int64_t)num_heads * dim, k, v, kv_bf16, NULL, 0, n, ctx, num_heads,
                                     num_kv_heads, dim, scale, out, bf16_products);
}

static int prompt_attention_paged(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                                  int kv_bf16, const int32_t *table, int block_size, int n, int ctx, int num_heads,
                                  int num_kv_heads, int dim, float scale, float *out, int bf16_products) {
    return prompt_attention_portable(q, q_stride, k_cache, v_cache, kv_bf16, table, block_size, n, ctx, num_heads,
                                     num_kv_heads, dim, scale, out, bf16_products);
}

#endif

/* The native step's prompt attention for one chunk, its context read through the block table
 * from the paged caches [blocks, block_size, num_kv_heads, dim] as the step reads it (for
 * tests and benchmarks): q and out [n, num_heads, dim]. prompt_attention_run's status. */
int baton_prompt_attention_paged(const float *q, const void *k_cache, const void *v_cache, int kv_bf16,
                                 const int32_t *table, int block_size, int n, int ctx, int num_heads, int num_kv_heads,
                                 int dim, float scale, float *out, int bf16_products) {
    return prompt_attention_paged(q, (int64_t)num_heads * dim, k_cache, v_cache, kv_bf16, table, block_size, n, ctx,
                                  num_heads, num_kv_heads, dim, scale, out, bf16_products);
}
