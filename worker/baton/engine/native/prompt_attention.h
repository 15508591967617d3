/* Causal attention of a prompt chunk over its context, for the torch path's prompt steps
 * (native/prompt_attention.py).
 *
 * torch's CPU flash attention multiplies its blocks with MKL's sgemm (bf16 inputs are
 * widened first), and on CPUs where MKL takes its generic code path (AMD EPYC) a 2,000-token
 * prompt of SmolLM2 spent 2.7 s of 4.3 s there on one core. Here each task takes one KV head
 * and up to 64 query rows (chunk rows x the query heads that share it), and walks the keys
 * in blocks of 32 with an online softmax; the context is laid out once for all tasks
 * (PromptAttention). Scores are 8 rows x 32 keys at a time, the values' sums 8 rows x 16
 * values, either as float32 FMAs (bf16 keys and values widened exactly) or, with
 * `bf16_products`, as VDPBF16PS on bf16 pairs (the query, keys, values and probabilities
 * rounded to bf16, as torch's bf16 attention rounds them); sums in float32 either way. A
 * row sees the keys up to its own position; rows are independent of each other.
 * Where the CPU has AMX tiles (and the OS grants them), bf16 products run on the tiles
 * instead, 16 rows at a time and the softmax across them (prompt_attention_tiles.h): the
 * same roundings, each row's sums in the tiles' order.
 * Included by decode_step.c (after exp_in_place and quant_product.h's AMX helpers).
 */
#define PROMPT_TASK_ROWS 64 /* query rows a task holds: (chunk rows) x (query heads of one KV head) */
#define PROMPT_GROUP 8       /* rows multiplied together */
#define PROMPT_MAX_DIM 128
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

/* One row's online softmax over a key block: its scores s0 (keys 0-15) and s1 (16-31), of
 * which it sees the first `valid` (>= 1), into probabilities e0, e1 (zero past valid); its
 * running maximum and sum updated, and its value sums acc (chunks x 16) shrunk where the
 * maximum rose. */
static inline void prompt_softmax_row(__m512 s0, __m512 s1, int valid, float *best, float *total, float *acc,
                                      int chunks, __m512 *e0, __m512 *e1) {
    const __mmask16 m0 = (__mmask16)(valid >= 16 ? 0xFFFF : (1u << valid) - 1);
    const __mmask16 m1 = (__mmask16)(valid >= 32 ? 0xFFFF : valid <= 16 ? 0 : (1u << (valid - 16)) - 1);
    const float high = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), m0, s0),
                                                          _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), m1, s1)));
    const float top = high > *best ? high : *best;
    const __m512 shift = _mm512_set1_ps(top);
    *e0 = _mm512_maskz_mov_ps(m0, prompt_exp(_mm512_sub_ps(s0, shift)));
    *e1 = _mm512_maskz_mov_ps(m1, prompt_exp(_mm512_sub_ps(s1, shift)));
    const float sum = _mm512_reduce_add_ps(_mm512_add_ps(*e0, *e1));
    if (top != *best) { /* a new maximum: what was summed so far shrinks */
        const float keep = *best == -INFINITY ? 0.0f : expf(*best - top);
        *total *= keep;
        const __m512 factor = _mm512_set1_ps(keep);
        for (int c = 0; c < chunks; c++) _mm512_store_ps(acc + 16 * c, _mm512_mul_ps(_mm512_load_ps(acc + 16 * c), factor));
        *best = top;
    }
    *total += sum;
}

/* The keys a row of chunk row `r` sees in the block from key kb (nk keys there). */
static inline int prompt_keys_seen(int64_t first, int r, int64_t kb, int nk) {
    const int64_t seen = first + r - kb + 1;
    return seen <= 0 ? 0 : seen < nk ? (int)seen : nk;
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

/* The keys and values of block `block` of KV head kvh widened to float32, as rows: keys[j],
 * values + j * stride; zero past ctx. */
static void prompt_load_block(const PromptAttention *a, int kvh, int64_t block, float keys[][PROMPT_MAX_DIM],
                              float *values, int stride) {
    const int dim = a->dim;
    for (int j = 0; j < ATTENTION_TOKENS; j++) {
        const int64_t key = block * ATTENTION_TOKENS + j;
        float *value = values + (int64_t)j * stride;
        if (key < a->ctx) {
            const int64_t row = a->table ? cache_slot(a->table, a->block_size, key) : key;
            const int64_t at = (row * a->num_kv_heads + kvh) * dim;
            prompt_row(a->k, a->kv_bf16, at, dim, keys[j]);
            prompt_row(a->v, a->kv_bf16, at, dim, value);
        } else {
            memset(keys[j], 0, sizeof(float) * dim);
            memset(value, 0, sizeof(float) * dim);
        }
    }
}

#if defined(__AVX512BF16__)
/* Block `block` of KV head kvh widened to float32 rows (keys kr, values vr), and where its
 * bf16 layout goes: kp in a->keys, vp in a->values. */
static void prompt_block_to_pack(const PromptAttention *a, int kvh, int64_t block, float kr[][PROMPT_MAX_DIM],
                                 float vr[][PROMPT_MAX_DIM], uint16_t **kp, uint16_t **vp) {
    *kp = (uint16_t *)a->keys + prompt_block_at(a, kvh, block);
    *vp = (uint16_t *)a->values + prompt_block_at(a, kvh, block);
    prompt_load_block(a, kvh, block, kr, vr[0], PROMPT_MAX_DIM);
}

/* Block `block` of KV head kvh into a->keys and a->values as bf16 pairs (see PromptAttention). */
static void prompt_pack_block(const PromptAttention *a, int kvh, int64_t block) {
    float kr[ATTENTION_TOKENS][PROMPT_MAX_DIM] __attribute__((aligned(64)));
    float vr[ATTENTION_TOKENS][PROMPT_MAX_DIM] __attribute__((aligned(64)));
    uint16_t *kp, *vp;
    const int dim = a->dim;
    prompt_block_to_pack(a, kvh, block, kr, vr, &kp, &vp);
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
}
#endif

/* Block `block` of KV head kvh into a->keys and a->values in float32 (see PromptAttention). */
static void prompt_widen_block(const PromptAttention *a, int kvh, int64_t block) {
    float kr[ATTENTION_TOKENS][PROMPT_MAX_DIM] __attribute__((aligned(64)));
    const int dim = a->dim;
    float *kt = (float *)a->keys + prompt_block_at(a, kvh, block), *vb = (float *)a->values + prompt_block_at(a, kvh, block);
    prompt_load_block(a, kvh, block, kr, vb, dim);
    for (int d = 0; d < dim; d++)
        for (int j = 0; j < ATTENTION_TOKENS; j++) kt[d * ATTENTION_TOKENS + j] = kr[j][d];
}

/* One task: KV head kvh, chunk rows r0..r0 + rows - 1 of each of its query heads (task row
 * t = head-in-group * rows + chunk row): each key and value block is widened once for all. */
static void prompt_attention_task(const PromptAttention *a, int kvh, int r0, int rows) {
    float qs[PROMPT_TASK_ROWS][PROMPT_MAX_DIM] __attribute__((aligned(64)));
    float acc[PROMPT_TASK_ROWS][PROMPT_MAX_DIM] __attribute__((aligned(64)));
    float p[PROMPT_TASK_ROWS][ATTENTION_TOKENS] __attribute__((aligned(64)));
    uint32_t qp[PROMPT_TASK_ROWS][PROMPT_MAX_DIM / 2] __attribute__((aligned(64))); /* bf16 pairs */
    uint32_t pp[PROMPT_TASK_ROWS][ATTENTION_TOKENS / 2] __attribute__((aligned(64)));
    float best[PROMPT_TASK_ROWS], total[PROMPT_TASK_ROWS];
    const int dim = a->dim, group = a->num_heads / a->num_kv_heads, chunks = dim / 16, all = group * rows;
    const int64_t first = (int64_t)a->ctx - a->n + r0; /* the position of chunk row r0 */
    for (int t = 0; t < all; t++) {
        const int h = kvh * group + t / rows, r = t % rows;
        const float *row = a->q + (int64_t)(r0 + r) * a->q_stride + (int64_t)h * dim;
        if (a->bf16_products) /* the query rounded, the scores scaled after */
            for (int i = 0; i < dim / 2; i++)
                qp[t][i] = (uint32_t)f32_to_bf16(row[2 * i]) | (uint32_t)f32_to_bf16(row[2 * i + 1]) << 16;
        else
            for (int d = 0; d < dim; d++) qs[t][d] = row[d] * a->scale;
        memset(acc[t], 0, sizeof(float) * dim);
        best[t] = -INFINITY;
        total[t] = 0.0f;
    }
    const int64_t last = first + rows - 1; /* the last key any row sees */
    for (int64_t kb = 0; kb <= last; kb += ATTENTION_TOKENS) {
        const int nk = last + 1 - kb < ATTENTION_TOKENS ? (int)(last + 1 - kb) : ATTENTION_TOKENS;
        const int64_t at = prompt_block_at(a, kvh, kb / ATTENTION_TOKENS);
        const float *kt = (const float *)a->keys + at, *vb = (const float *)a->values + at;
        for (int g = 0; g < all; g += PROMPT_GROUP) {
            const int count = all - g < PROMPT_GROUP ? all - g : PROMPT_GROUP;
            __m512 s[PROMPT_GROUP][2];
            for (int i = 0; i < PROMPT_GROUP; i++) s[i][0] = s[i][1] = _mm512_setzero_ps();
            if (a->bf16_products) {
#if defined(__AVX512BF16__)
                const uint32_t *kp = (const uint32_t *)((const uint16_t *)a->keys + at);
                for (int i = 0; i < dim / 2; i++) {
                    const __m512bh k0 = (__m512bh)_mm512_load_si512(kp + i * ATTENTION_TOKENS);
                    const __m512bh k1 = (__m512bh)_mm512_load_si512(kp + i * ATTENTION_TOKENS + 16);
                    for (int r = 0; r < PROMPT_GROUP; r++) {
                        const __m512bh x = (__m512bh)_mm512_set1_epi32((int)qp[r < count ? g + r : g][i]);
                        s[r][0] = _mm512_dpbf16_ps(s[r][0], k0, x);
                        s[r][1] = _mm512_dpbf16_ps(s[r][1], k1, x);
                    }
                }
                const __m512 scale = _mm512_set1_ps(a->scale);
                for (int r = 0; r < PROMPT_GROUP; r++) {
                    s[r][0] = _mm512_mul_ps(s[r][0], scale);
                    s[r][1] = _mm512_mul_ps(s[r][1], scale);
                }
#endif
            } else {
                for (int d = 0; d < dim; d++) {
                    const __m512 k0 = _mm512_load_ps(kt + d * ATTENTION_TOKENS), k1 = _mm512_load_ps(kt + d * ATTENTION_TOKENS + 16);
                    for (int i = 0; i < PROMPT_GROUP; i++) { /* rows past `count` repeat row g, unused */
                        const __m512 x = _mm512_set1_ps(qs[i < count ? g + i : g][d]);
                        s[i][0] = _mm512_fmadd_ps(x, k0, s[i][0]);
                        s[i][1] = _mm512_fmadd_ps(x, k1, s[i][1]);
                    }
                }
            }
            for (int i = 0; i < count; i++) {
                const int t = g + i;
                const int valid = prompt_keys_seen(first, t % rows, kb, nk);
                if (!valid) {
                    if (a->bf16_products) memset(pp[t], 0, sizeof pp[t]);
                    else memset(p[t], 0, sizeof p[t]);
                    continue;
                }
                __m512 e0, e1;
                prompt_softmax_row(s[i][0], s[i][1], valid, &best[t], &total[t], acc[t], chunks, &e0, &e1);
                if (a->bf16_products) { /* pair jp: keys 2jp, 2jp + 1 */
#if defined(__AVX512BF16__)
                    _mm512_store_si512(pp[t], (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
#endif
                } else {
                    _mm512_store_ps(p[t], e0);
                    _mm512_store_ps(p[t] + 16, e1);
                }
            }
            for (int c = 0; c < chunks; c++) {
                __m512 o[PROMPT_GROUP];
                for (int i = 0; i < PROMPT_GROUP; i++) o[i] = _mm512_load_ps(acc[i < count ? g + i : g] + 16 * c);
                if (a->bf16_products) {
#if defined(__AVX512BF16__)
                    const uint16_t *vp = (const uint16_t *)a->values + at;
                    for (int jp = 0; jp < (nk + 1) / 2; jp++) {
                        const __m512bh x = (__m512bh)_mm512_load_si512(vp + ((int64_t)jp * dim + 16 * c) * 2);
                        for (int i = 0; i < PROMPT_GROUP; i++)
                            o[i] = _mm512_dpbf16_ps(o[i], x, (__m512bh)_mm512_set1_epi32((int)pp[i < count ? g + i : g][jp]));
                    }
#endif
                } else {
                    for (int j = 0; j < nk; j++) {
                        const __m512 x = _mm512_load_ps(vb + j * dim + 16 * c);
                        for (int i = 0; i < PROMPT_GROUP; i++)
                            o[i] = _mm512_fmadd_ps(_mm512_set1_ps(p[i < count ? g + i : g][j]), x, o[i]);
                    }
                }
                for (int i = 0; i < count; i++) _mm512_store_ps(acc[g + i] + 16 * c, o[i]);
            }
        }
    }
    for (int t = 0; t < all; t++) {
        const int h = kvh * group + t / rows, r = t % rows;
        float *o = a->out + ((int64_t)(r0 + r) * a->num_heads + h) * dim;
        for (int d = 0; d < dim; d++) o[d] = acc[t][d] / total[t];
    }
}

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
#if !defined(__AVX512BF16__)
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
#pragma omp for collapse(2) schedule(static)
        for (int kvh = 0; kvh < num_kv_heads; kvh++)
            for (int64_t b = 0; b < key_blocks; b++) {
#if defined(__AVX512BF16__)
                if (a->bf16_products) {
                    if (amx) prompt_pack_block_tiles(a, kvh, b);
                    else prompt_pack_block(a, kvh, b);
                    continue;
                }
#endif
                prompt_widen_block(a, kvh, b);
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

int baton_step_takes_prompts(void) { return 1; }
#else
int baton_prompt_attention(const float *q, const void *k, const void *v, int kv_bf16, int n, int ctx, int num_heads,
                           int num_kv_heads, int dim, float scale, float *out, int bf16_products) {
    (void)q, (void)k, (void)v, (void)kv_bf16, (void)n, (void)ctx, (void)num_heads, (void)num_kv_heads, (void)dim;
    (void)scale, (void)out, (void)bf16_products;
    return -1;
}

static int prompt_attention_paged(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                                  int kv_bf16, const int32_t *table, int block_size, int n, int ctx, int num_heads,
                                  int num_kv_heads, int dim, float scale, float *out, int bf16_products) {
    (void)q, (void)q_stride, (void)k_cache, (void)v_cache, (void)kv_bf16, (void)table, (void)block_size, (void)n;
    (void)ctx, (void)num_heads, (void)num_kv_heads, (void)dim, (void)scale, (void)out, (void)bf16_products;
    return -1;
}

/* without AVX-512 the step has no prompt attention: steps with prompt tokens take torch's path */
int baton_step_takes_prompts(void) { return 0; }
#endif
