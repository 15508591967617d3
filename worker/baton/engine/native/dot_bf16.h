/* bf16 products on the CPU's own bf16 dot-product instruction (AVX512-BF16, VDPBF16PS), for
 * CPUs that have it but cannot pack weights for oneDNN's brgemm (no AMX: AMD Zen 4 and 5,
 * Intel Cooper Lake). There MKL's bf16 product ran a batch-1 decode step at 0.59x the fp32
 * step's speed; a decode step's products are weight-streaming matrix-vector products, so one
 * pass over each weight row for every input row is what they need.
 *
 * Each product of two bf16 values is exact in fp32; the instruction adds them in fp32 (with
 * denormals flushed to zero), so results differ from MKL's only in the order of the additions.
 * Included by decode_step.c, which the library builds with -march=native: on a CPU without
 * the instruction this compiles to nothing and the bf16 products stay with MKL.
 */
#if defined(__AVX512BF16__)
#include <immintrin.h>

#define DOT_BF16_AVAILABLE 1
#define DOT_ROWS 4 /* input rows sharing one pass over a weight row */

/* sums[r] = dot(x[r], w) for `nr` (a constant after inlining) rows of length k. */
static inline __attribute__((always_inline)) void dot_rows_bf16(const uint16_t *x, int64_t row_stride,
                                                                const uint16_t *w, int k,
                                                                const int nr, float *sums) {
    __m512 acc[DOT_ROWS];
    for (int r = 0; r < nr; r++) acc[r] = _mm512_setzero_ps();
    int i = 0;
    for (; i + 32 <= k; i += 32) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + i);
        for (int r = 0; r < nr; r++)
            acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(x + r * row_stride + i), wv);
    }
    if (i < k) { /* the last k % 32 values; masked lanes load as zeros and add nothing */
        const __mmask32 tail = (__mmask32)((1ull << (k - i)) - 1);
        const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(tail, w + i);
        for (int r = 0; r < nr; r++)
            acc[r] = _mm512_dpbf16_ps(
                acc[r], (__m512bh)_mm512_maskz_loadu_epi16(tail, x + r * row_stride + i), wv);
    }
    for (int r = 0; r < nr; r++) sums[r] = _mm512_reduce_add_ps(acc[r]);
}

/* out[rows, n] = x[rows, k] @ w[n, k]^T, added to out when `add` (a bias already there).
 * Threads take output columns: each weight row is read once, for every input row. */
static void product_dot_bf16(const uint16_t *x, int rows, int k, const uint16_t *w, int n,
                             float *out, bool add) {
#pragma omp parallel for schedule(static)
    for (int j = 0; j < n; j++) {
        const uint16_t *wj = w + (int64_t)j * k;
        for (int r0 = 0; r0 < rows; r0 += DOT_ROWS) {
            float sums[DOT_ROWS];
            const uint16_t *xr = x + (int64_t)r0 * k;
            switch (rows - r0 < DOT_ROWS ? rows - r0 : DOT_ROWS) {
                case 1: dot_rows_bf16(xr, k, wj, k, 1, sums); break;
                case 2: dot_rows_bf16(xr, k, wj, k, 2, sums); break;
                case 3: dot_rows_bf16(xr, k, wj, k, 3, sums); break;
                default: dot_rows_bf16(xr, k, wj, k, DOT_ROWS, sums); break;
            }
            for (int r = 0; r < DOT_ROWS && r0 + r < rows; r++) {
                float *o = out + (int64_t)(r0 + r) * n + j;
                *o = add ? *o + sums[r] : sums[r];
            }
        }
    }
}
#else
#define DOT_BF16_AVAILABLE 0
#endif
