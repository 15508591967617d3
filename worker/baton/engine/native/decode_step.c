/* One step of a Llama-family model on CPU, in one call, in fp32 or bf16: its decodes, and the
 * prompt chunks beside them (native/prompt_steps.py).
 *
 * Why native: at batch 1 the step is ~450 small tensor ops between ~120 weight-streaming
 * matrix products, and each product evicts the op dispatcher from the core's caches, so a
 * one-microsecond `x + x` takes 14 us right after one (an RMSNorm 56-90 us instead of 10). Here the work between products is
 * a few plain loops over vectors of a few KB, and the products are BLAS calls into the MKL
 * inside torch: in fp32 the very sgemm_ call torch makes for F.linear (bit-identical
 * results); in bf16 oneDNN's batch-reduce GEMM on weights packed once for it (AMX where the
 * CPU has it), else MKL's bf16 x bf16 -> fp32 product (both matched the oneDNN linear of the
 * torch path bit for bit where compared). Values are rounded at the points where the torch
 * path (kernels/ref.py) rounds; the tests compare the two.
 *
 * Row-major tensors throughout. K/V caches: [num_blocks, block_size, n_kv_heads, head_dim].
 * Activations live in fp32 buffers; in bf16 they only ever hold bf16 values.
 * Built with -ffp-contract=off: every product and sum rounds on its own, as torch's do.
 */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

/* BLAS inside libtorch_cpu */
void sgemm_(const char *transa, const char *transb, const int *m, const int *n, const int *k,
            const float *alpha, const float *a, const int *lda, const float *b, const int *ldb,
            const float *beta, float *c, const int *ldc);
void cblas_gemm_bf16bf16f32(int layout, int transa, int transb, int m, int n, int k, float alpha,
                            const uint16_t *a, int lda, const uint16_t *b, int ldb, float beta,
                            float *c, int ldc);
enum { CBLAS_ROW_MAJOR = 101, CBLAS_NO_TRANS = 111, CBLAS_TRANS = 112 };

/* oneDNN's batch-reduce GEMM and its weight packing, as libtorch_cpu exports them
 * (at::native::cpublas::brgemm, pack, brgemm_release, could_pack; C++ names). Weak: a torch
 * without them leaves them NULL, and the bf16 products stay with MKL. */
#define BRGEMM_BF16 _ZN2at6native7cpublas6brgemmEllllllbPKN3c108BFloat16ES5_Pfb
#define BRGEMM_PACK _ZN2at6native7cpublas4packEllllN3c1010ScalarTypeES3_PKvPv
#define BRGEMM_RELEASE _ZN2at6native7cpublas14brgemm_releaseEb
#define BRGEMM_COULD_PACK _ZN2at6native7cpublas10could_packEN3c1010ScalarTypeE
void BRGEMM_BF16(int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb, int64_t ldc,
                 bool add_c, const uint16_t *a, const uint16_t *b, float *c, bool vnni)
    __attribute__((weak));
void BRGEMM_PACK(int64_t k, int64_t n, int64_t ld_in, int64_t ld_out, int8_t type_in,
                 int8_t type_out, const void *in, void *out) __attribute__((weak));
void BRGEMM_RELEASE(bool vnni) __attribute__((weak));
bool BRGEMM_COULD_PACK(int8_t type) __attribute__((weak));
enum { TORCH_BFLOAT16 = 15 }; /* c10::ScalarType::BFloat16 */

/* fp32 <-> bf16, round to nearest even (as torch's .to(torch.bfloat16)) */
static inline uint32_t f32_bits(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }
static inline float bits_f32(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }
static inline uint16_t f32_to_bf16(float x) {
    uint32_t u = f32_bits(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static inline float bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }
static inline float bf16_round(float x) { return bf16_to_f32(f32_to_bf16(x)); }

#include "quant_product.h"

typedef struct { /* every tensor in the model's dtype (fp32 or bf16) */
    const void *input_norm, *qkv, *qkv_bias, *o_proj, *post_norm, *gate_up, *down;
    void *k_cache, *v_cache;
    /* bf16: the four products' weights packed by baton_pack_bf16, or NULL (MKL instead) */
    const void *qkv_packed, *o_proj_packed, *gate_up_packed, *down_packed;
    /* the four products' quantized weights, or NULL (then the weights above) */
    const QuantMatrix *qkv_quant, *o_proj_quant, *gate_up_quant, *down_quant;
} Layer;

typedef struct {
    int hidden, num_heads, num_kv_heads, head_dim, intermediate, vocab, num_layers;
    int block_size, max_positions;
    float eps, scale;
    const void *embed, *final_norm, *lm_head, *lm_head_packed;
    const float *cos_sin; /* fp32 [max_positions, head_dim]: cos, then sin */
    const Layer *layers;
    int bf16_dot; /* bf16 without packed weights: 1 = the CPU's dot products, 0 = MKL's */
    const QuantMatrix *embed_quant, *lm_head_quant; /* or NULL */
    /* tensor parallelism (NULL otherwise): sums a buffer over the ranks, in place; this
     * rank holds vocabulary rows [vocab_start, vocab_start + vocab) of embed and lm_head */
    void (*all_reduce)(float *buffer, int64_t count);
    int vocab_start;
    /* called after each layer, its K/V in the caches (a prefill worker streams them), or NULL */
    void (*layer_done)(int layer);
} Model;

typedef struct { /* scratch, each [rows, width] */
    float *residual, *normed, *qkv, *attn, *gate_up, *act, *out;
    uint16_t *matmul_input; /* bf16 only: a product's input rows */
    /* quantized weights only: baton_quant_input_bytes(rows, widest), and
     * baton_quant_panel_scratch_bytes(rows, widest) where quant_engine is set */
    void *quant_input;
    /* this step's products on quantized weights of quant_min_rows rows or more: on
     * a panel engine (quant_bf16.h's bf16 products or quant_int8.h's int8 ones), or with -1 on the
     * int16 kernels; those of few_min_rows rows up to quant_min_rows on few_engine where it is
     * set (int8 beside AMX tiles), and the rest on the int16 kernels (which read each weight
     * byte once) */
    int quant_engine, quant_min_rows, few_engine, few_min_rows;
} Workspace;

typedef struct { /* a step's prompt chunks: its first rows, chunk c being rows starts[c] ..
                  * starts[c + 1] - 1, consecutive positions of one sequence (one block
                  * table); every later row is a decode */
    int chunks;
    const int64_t *starts; /* chunks + 1 entries, starts[0] = 0 */
    int bf16_products;     /* the chunks' attention on bf16 products (prompt_attention.h) */
} Prompts;

static inline int64_t cache_slot(const int32_t *table, int block_size, int64_t position) {
    return (int64_t)table[position / block_size] * block_size + position % block_size;
}

/* Rows rows[0..count) (increasing) of x [.., width] moved to its first count rows, in order
 * (each moves down or stays). */
static void rows_to_front(float *x, int64_t width, const int64_t *rows, int count) {
    for (int i = 0; i < count; i++)
        if (rows[i] != i) memmove(x + i * width, x + rows[i] * width, sizeof(float) * width);
}

/* Attention works on up to this many query heads of one KV head, this many tokens at a time. */
#define ATTENTION_HEADS 16
#define ATTENTION_TOKENS 32
#define ATTENTION_CHUNKS 8 /* registers of 16 floats a head holds, at most (head_dim 128) */
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
/* The sums of four vectors' 16 lanes each, as lanes 0-3: pairs interleaved and added within
 * each 128-bit quarter, then the quarters added (13 instructions for four sums, where one
 * _mm512_reduce_add_ps each is about eight). */
static inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    const __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
    /* each quarter: a's, b's, c's, d's sum over that quarter */
    const __m512 quarters = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                                          _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));
    const __m512 halves = _mm512_add_ps(quarters, _mm512_shuffle_f32x4(quarters, quarters, 0x4E));
    const __m512 whole = _mm512_add_ps(halves, _mm512_shuffle_f32x4(halves, halves, 0xB1));
    return _mm512_castps512_ps128(whole);
}
#endif

/* e^x as 2^n * e^r, |r| <= ln2 / 2: ln 2 in two parts (r exact in float32) and Cephes' expf
 * coefficients; exp_in_place and prompt_attention*.h's vector forms all use these. */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HIGH 0.693359375f
#define EXP_LN2_LOW -2.12194440e-4f
#define EXP_C0 1.9875691500e-4f
#define EXP_C1 1.3981999507e-3f
#define EXP_C2 8.3334519073e-3f
#define EXP_C3 4.1665795894e-2f
#define EXP_C4 1.6666665459e-1f
#define EXP_C5 5.0000001201e-1f

/* x[i] <- exp(x[i]) for x[i] <= 0 (softmax terms after subtracting the max), in loops the
 * compiler vectorizes: 2^n * e^r with |r| <= ln2 / 2 and a degree-7 polynomial (Cephes'
 * expf coefficients), about one ulp from the exact value, as torch's vectorized exp is. */
static void exp_in_place(float *x, int n) {
    float scale[ATTENTION_TOKENS];
    int32_t bits[ATTENTION_TOKENS];
    for (int i = 0; i < n; i++) {
        const float v = x[i] < -87.0f ? -87.0f : x[i]; /* below: 2^n underflows; e^-87 ~ 0 */
        const float whole = floorf(v * EXP_LOG2E + 0.5f);
        float r = v - whole * EXP_LN2_HIGH;
        r = r - whole * EXP_LN2_LOW;
        float poly = EXP_C0;
        poly = poly * r + EXP_C1;
        poly = poly * r + EXP_C2;
        poly = poly * r + EXP_C3;
        poly = poly * r + EXP_C4;
        poly = poly * r + EXP_C5;
        x[i] = poly * r * r + r + 1.0f;
        bits[i] = ((int32_t)whole + 127) << 23;
    }
    memcpy(scale, bits, sizeof(float) * n);
    for (int i = 0; i < n; i++) x[i] *= scale[i];
}

#include "prompt_attention.h"

/* The largest of a block's n scores (a full block on two AVX-512 registers). */
static inline float block_row_max(const float *p, int n) {
#if defined(__AVX512F__) && ATTENTION_TOKENS == 32
    if (n == ATTENTION_TOKENS) return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_loadu_ps(p), _mm512_loadu_ps(p + 16)));
#endif
    float best = p[0];
    for (int t = 1; t < n; t++) best = p[t] > best ? p[t] : best;
    return best;
}

/* p[t] <- e^(p[t] - shift) for a block's n scores, each added to *total (a full block on two
 * AVX-512 registers, prompt_exp being exp_in_place's formula, and its sum added once). */
static inline void exp_shifted_into(float *p, int n, float shift, float *total) {
#if defined(__AVX512F__) && ATTENTION_TOKENS == 32
    if (n == ATTENTION_TOKENS) {
        const __m512 top = _mm512_set1_ps(shift);
        const __m512 e0 = prompt_exp(_mm512_sub_ps(_mm512_loadu_ps(p), top));
        const __m512 e1 = prompt_exp(_mm512_sub_ps(_mm512_loadu_ps(p + 16), top));
        _mm512_storeu_ps(p, e0);
        _mm512_storeu_ps(p + 16, e1);
        *total += _mm512_reduce_add_ps(_mm512_add_ps(e0, e1));
        return;
    }
#endif
    for (int t = 0; t < n; t++) p[t] -= shift;
    exp_in_place(p, n);
    for (int t = 0; t < n; t++) *total += p[t];
}

/* out = silu(gate) * up over one row of float32, silu(x) = x / (1 + e^-x) as torch computes
 * it; e^-x by prompt_exp_fused, or prompt_exp8 on AVX2 (an ulp or two from the exact value,
 * as torch's vectorized exp is). libm's expf one value at a time took 6% of a 256-token
 * prompt's step on a Zen 3 core (perf). */
static void silu_and_mul_row_f32(const float *gate, const float *up, int width, float *out) {
    int i = 0;
#if defined(__AVX512F__)
    /* 1 / (1 + e^-x) as VRCP14PS's estimate (2^-14) and one Newton step (r + r(1 - dr)),
     * within an ulp or so, not VDIVPS (one in 16 cycles on Intel cores); with the fused exp,
     * 0.35 ns an element against 0.54 on a Xeon core, where SwiGLU was 6.8% of a 256-token
     * prompt's step (perf). Past e^87 the reciprocal would leave float's normal range (past
     * e^88 the exp overflows): there it is 0, so silu is -0 (NaN at -inf) as torch gives it
     * from e^88.7. */
    const __m512 one = _mm512_set1_ps(1.0f), top = _mm512_set1_ps(87.0f);
    for (; i + 16 <= width; i += 16) {
        const __m512 g = _mm512_loadu_ps(gate + i), minus = _mm512_sub_ps(_mm512_setzero_ps(), g);
        const __mmask16 within = _mm512_cmp_ps_mask(minus, top, _CMP_LE_OQ);
        const __m512 d = _mm512_add_ps(one, prompt_exp_fused(_mm512_min_ps(minus, top)));
        const __m512 r = _mm512_rcp14_ps(d);
        const __m512 sigmoid = _mm512_maskz_fmadd_ps(within, r, _mm512_fnmadd_ps(d, r, one), r);
        _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_mul_ps(g, sigmoid), _mm512_loadu_ps(up + i)));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256 one = _mm256_set1_ps(1.0f), top = _mm256_set1_ps(88.0f), infinite = _mm256_set1_ps(INFINITY);
    for (; i + 8 <= width; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i), minus = _mm256_sub_ps(_mm256_setzero_ps(), g);
        const __m256 over = _mm256_cmp_ps(minus, top, _CMP_GT_OQ);
        const __m256 e = _mm256_blendv_ps(prompt_exp8(_mm256_min_ps(minus, top)), infinite, over);
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
    }
#endif
    for (; i < width; i++) out[i] = (gate[i] / (1.0f + expf(-gate[i]))) * up[i];
}

/* A product on quantized weights: out = x @ W^T (+ bias, of the model's dtype). */
static void linear_quant(const QuantMatrix *w, const float *x, int rows, int n, const void *bias,
                         int bias_bf16, float *out, const Workspace *ws) {
    /* the engine was checked when chosen; a failure (out of memory for its panels) falls
     * back to the int16 kernels */
    const int engine = rows >= ws->quant_min_rows ? ws->quant_engine
                       : rows >= ws->few_min_rows ? ws->few_engine : -1;
    if (engine < 0 || baton_quant_product_panels(w, x, rows, out, ws->quant_input, engine))
        baton_quant_product(w, x, rows, out, ws->quant_input);
    if (!bias) return;
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < n; j++)
            out[(int64_t)r * n + j] += bias_bf16 ? bf16_to_f32(((const uint16_t *)bias)[j])
                                                 : ((const float *)bias)[j];
}

/* out[rows, n] = x[rows, k] @ w[n, k]^T (+ bias): torch's addmm call for F.linear. */
static void linear_f32(const Model *m, const Workspace *ws, const float *x, int rows, int k,
                       const void *weight, const void *unused_packed, const QuantMatrix *quant,
                       int n, const void *bias, float *out) {
    (void)m, (void)unused_packed;
    if (quant) {
        linear_quant(quant, x, rows, n, bias, 0, out, ws);
        return;
    }
    const float one = 1.0f;
    float beta = 0.0f;
    if (bias) {
        for (int r = 0; r < rows; r++) memcpy(out + (int64_t)r * n, bias, sizeof(float) * n);
        beta = 1.0f;
    }
    sgemm_("T", "N", &n, &rows, &k, &one, (const float *)weight, &k, x, &k, &beta, out, &n);
}

#include "dot_bf16.h"

int baton_bf16_dot_available(void) { return DOT_BF16_AVAILABLE; }

/* Packed weights: column blocks of this many output features, each in brgemm's layout. */
#define PACK_COLUMNS 64
#define PACK_ROWS 32 /* rows per brgemm call */

int baton_bf16_packing_available(void) {
    return BRGEMM_BF16 && BRGEMM_PACK && BRGEMM_RELEASE && BRGEMM_COULD_PACK &&
           BRGEMM_COULD_PACK(TORCH_BFLOAT16);
}

/* w[n, k] (a linear layer's weight) -> out[n * k]: w^T in blocks of PACK_COLUMNS columns,
 * block b at out + b * PACK_COLUMNS * k, each packed for brgemm. scratch: k * PACK_COLUMNS.
 * Returns 0, or -1 when k is odd (brgemm pairs up the k dimension). */
int baton_pack_bf16(const uint16_t *w, int n, int k, uint16_t *out, uint16_t *scratch) {
    if (k % 2 != 0 || !baton_bf16_packing_available()) return -1;
    for (int start = 0; start < n; start += PACK_COLUMNS) {
        const int cols = n - start < PACK_COLUMNS ? n - start : PACK_COLUMNS;
        for (int j = 0; j < k; j++)
            for (int c = 0; c < cols; c++) scratch[j * cols + c] = w[(int64_t)(start + c) * k + j];
        BRGEMM_PACK(k, cols, cols, cols, TORCH_BFLOAT16, TORCH_BFLOAT16, scratch,
                    out + (int64_t)start * k);
    }
    return 0;
}

/* out[rows, n] = input[rows, k] @ w^T from packed w; threads take column blocks. */
static void product_packed(const uint16_t *input, int rows, int k, const uint16_t *packed, int n,
                           float *out) {
    const int blocks = (n + PACK_COLUMNS - 1) / PACK_COLUMNS;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int b = 0; b < blocks; b++) {
            const int start = b * PACK_COLUMNS;
            const int cols = n - start < PACK_COLUMNS ? n - start : PACK_COLUMNS;
            for (int r = 0; r < rows; r += PACK_ROWS)
                BRGEMM_BF16(rows - r < PACK_ROWS ? rows - r : PACK_ROWS, cols, k, k, cols, n, false,
                            input + (int64_t)r * k, packed + (int64_t)start * k,
                            out + (int64_t)r * n + start, true);
        }
        BRGEMM_RELEASE(true); /* each thread's tile configuration */
    }
}

/* The same in bf16: fp32 accumulation, the bias added before the one rounding. */
static void linear_bf16(const Model *m, const Workspace *ws, const float *x, int rows, int k,
                        const void *weight, const void *packed, const QuantMatrix *quant, int n,
                        const void *bias, float *out) {
    const int64_t in_count = (int64_t)rows * k, out_count = (int64_t)rows * n;
    if (quant) {
        linear_quant(quant, x, rows, n, bias, 1, out, ws);
        for (int64_t i = 0; i < out_count; i++) out[i] = bf16_round(out[i]);
        return;
    }
    uint16_t *input = ws->matmul_input;
    for (int64_t i = 0; i < in_count; i++) input[i] = f32_to_bf16(x[i]);
    if (packed) {
        product_packed(input, rows, k, (const uint16_t *)packed, n, out);
        if (bias) {
            const uint16_t *b = (const uint16_t *)bias;
            for (int r = 0; r < rows; r++)
                for (int j = 0; j < n; j++) out[(int64_t)r * n + j] += bf16_to_f32(b[j]);
        }
        for (int64_t i = 0; i < out_count; i++) out[i] = bf16_round(out[i]);
        return;
    }
    float beta = 0.0f;
    if (bias) {
        const uint16_t *b = (const uint16_t *)bias;
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < n; j++) out[(int64_t)r * n + j] = bf16_to_f32(b[j]);
        beta = 1.0f;
    }
#if DOT_BF16_AVAILABLE
    if (m->bf16_dot) {
        product_dot_bf16(input, rows, k, (const uint16_t *)weight, n, out, bias != NULL);
        for (int64_t i = 0; i < out_count; i++) out[i] = bf16_round(out[i]);
        return;
    }
#else
    (void)m;
#endif
    cblas_gemm_bf16bf16f32(CBLAS_ROW_MAJOR, CBLAS_NO_TRANS, CBLAS_TRANS, rows, n, k, 1.0f, input,
                           k, (const uint16_t *)weight, k, beta, out, n);
    for (int64_t i = 0; i < out_count; i++) out[i] = bf16_round(out[i]);
}

#define LOAD16_F32(p) _mm512_loadu_ps(p)
#define LOAD16_BF16(p) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))

/* float32 throughout */
#define ELEM float
#define LOAD(x) (x)
#define ROUND(x) (x)
#define LINEAR linear_f32
#define KV_ELEM float
#define KV_LOAD(x) (x)
#define KV_LOAD16(p) LOAD16_F32(p)
#define KV_STORE(x) (x)
#define KV_BF16 0
#define ROUNDS 0
#define FN(name) name##_f32
#include "decode_step_body.h"
#undef KV_ELEM
#undef KV_LOAD
#undef KV_LOAD16
#undef KV_STORE
#undef KV_BF16
#undef FN

/* float32 activations over a bf16 KV cache: half the cache's bytes to hold, read and send;
 * a value is rounded once, when it is written */
#define KV_ELEM uint16_t
#define KV_LOAD(x) bf16_to_f32(x)
#define KV_LOAD16(p) LOAD16_BF16(p)
#define KV_STORE(x) f32_to_bf16(x)
#define KV_BF16 1
#define FN(name) name##_f32_kvbf16
#include "decode_step_body.h"
#undef ELEM
#undef LOAD
#undef ROUND
#undef ROUNDS
#undef LINEAR
#undef FN

/* bf16 throughout */
#define ELEM uint16_t
#define LOAD(x) bf16_to_f32(x)
#define ROUND(x) bf16_round(x)
#define ROUNDS 1
#define LINEAR linear_bf16
#define FN(name) name##_bf16
#include "decode_step_body.h"

/* The decode step's attention on its own, for the torch path's decode rows (a step that also
 * carries prompt tokens; native/decode_attention.py): row r's query (q + r * q_stride,
 * [num_heads, dim], float32) over the first context_lens[r] tokens of its paged context
 * (block table row r), into out[r] in float32; `round_bf16` rounds each result to bf16, as
 * bf16 activations hold it. The decode step's own loops (attend_rows), so a decode row gets
 * the same values whether or not a prompt shares its step. kv_bf16: the cache holds bf16
 * values, else float32. 0, or -1 for a shape the loops do not take or a block table that
 * reaches outside the cache's num_blocks (checked before anything is read). */
int baton_decode_attention(const float *q, int64_t q_stride, int rows, const void *k_cache, const void *v_cache,
                           int kv_bf16, int num_blocks, const int32_t *tables, int table_width,
                           const int64_t *context_lens, int block_size, int num_heads, int num_kv_heads,
                           int head_dim, float scale, int round_bf16, float *out) {
    if (rows < 0 || num_kv_heads <= 0 || num_heads % num_kv_heads || head_dim <= 0 || block_size <= 0 ||
        (round_bf16 && !kv_bf16))
        return -1;
    for (int r = 0; r < rows; r++) { /* every block a row reads lies in the cache */
        if (context_lens[r] < 1 || context_lens[r] > (int64_t)table_width * block_size) return -1;
        for (int64_t b = 0; b < (context_lens[r] + block_size - 1) / block_size; b++) {
            const int32_t id = tables[(int64_t)r * table_width + b];
            if (id < 0 || id >= num_blocks) return -1;
        }
    }
    if (round_bf16)
        attend_rows_bf16(q, q_stride, rows, (const uint16_t *)k_cache, (const uint16_t *)v_cache, context_lens, 0,
                         tables, table_width, block_size, num_heads, num_kv_heads, head_dim, scale, out);
    else if (kv_bf16)
        attend_rows_f32_kvbf16(q, q_stride, rows, (const uint16_t *)k_cache, (const uint16_t *)v_cache, context_lens,
                               0, tables, table_width, block_size, num_heads, num_kv_heads, head_dim, scale, out);
    else
        attend_rows_f32(q, q_stride, rows, (const float *)k_cache, (const float *)v_cache, context_lens, 0, tables,
                        table_width, block_size, num_heads, num_kv_heads, head_dim, scale, out);
    return 0;
}

/* Rotate-half RoPE in place for the torch path's steps (native/rope.py): the first `heads`
 * heads of each row, rows `row_stride` floats apart, row r at positions[r]; float32 with
 * the same products and sums as ref.rotary_embedding's, so the same bits, without the
 * tensor ops' temporaries (a 256-token prompt's RoPE took torch ~0.25 ms a layer). 0, or -1
 * (nothing rotated) where a position is outside the cos/sin table's max_positions rows. */
int baton_rope_f32(float *x, int64_t rows, int64_t row_stride, int heads, int head_dim, const float *cos_sin,
                   int64_t max_positions, const int64_t *positions) {
    for (int64_t r = 0; r < rows; r++)
        if (positions[r] < 0 || positions[r] >= max_positions) return -1;
#pragma omp parallel for schedule(static) if (rows * heads * head_dim > 65536)
    for (int64_t r = 0; r < rows; r++) rope_heads_f32(x + r * row_stride, heads, head_dim, cos_sin, positions[r]);
    return 0;
}

/* silu(gate) * up on float32 rows for the torch path's steps (native/swiglu.py): gate_up
 * [rows, 2 * width], the fused gate/up projection's output; out [rows, width]; the native
 * step's own rows (silu_and_mul_row_f32). */
void baton_silu_and_mul_f32(const float *gate_up, int64_t rows, int width, float *out) {
#pragma omp parallel for schedule(static) if (rows * width > 262144)
    for (int64_t r = 0; r < rows; r++)
        silu_and_mul_row_f32(gate_up + r * 2 * width, gate_up + r * 2 * width + width, width, out + r * width);
}
