/* The int8 products' pass over two groups' panels (worker/baton/engine/native/quant_int8.h),
 * standalone, with each block's float epilogue whole or in part, to see what each part costs
 * beside the VPDPBUSDs. Timing only: the variants that leave a part out compute nothing
 * useful. Built and run by bench/int8_loop.py. Prints one line a variant: name, ms a product
 * (best of the rounds), GMAC/s. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define BLOCK 704 /* a panel block: 8 x 64 quants, 16 d_w, 16 c, and 16 int32 for WEIGHTS_FROM_MEMORY */
#define R 4       /* input rows a pass */

enum { WHOLE, NO_MULTIPLY, NO_MINIMUM_TERM, CONVERT_AND_FMA, NO_EPILOGUE, WEIGHTS_FROM_MEMORY, VARIANTS };
static const char *NAMES[VARIANTS] = {"whole epilogue", "without d_w*d_x", "without c*s_x", "convert and one FMA",
                                      "no epilogue", "weights as the memory operand"};

static inline int32_t load_i32(const int8_t *p) { int32_t v; memcpy(&v, p, 4); return v; }

static inline __attribute__((always_inline)) void pass(const int mode, const uint8_t *p0, const uint8_t *p1, int nb,
                                                       const int8_t *x, int k, const float *d, const float *ds,
                                                       float *out) {
    __m512 sums[2][R];
    __m512i dots[2][R];
    for (int r = 0; r < R; r++) sums[0][r] = sums[1][r] = _mm512_setzero_ps(), dots[0][r] = dots[1][r] = _mm512_setzero_si512();
    for (int b = 0; b < nb; b++) {
        const uint8_t *g0 = p0 + (int64_t)b * BLOCK, *g1 = p1 + (int64_t)b * BLOCK;
        const int8_t *xb = x + b * 32;
        if (mode == WEIGHTS_FROM_MEMORY) { /* inputs unsigned, accumulators start at -128 sum(w) */
            const __m512i c0 = _mm512_load_si512(g0 + 640), c1 = _mm512_load_si512(g1 + 640);
            for (int r = 0; r < R; r++) dots[0][r] = c0, dots[1][r] = c1;
        } else if (mode != NO_EPILOGUE) {
            for (int r = 0; r < R; r++) dots[0][r] = dots[1][r] = _mm512_setzero_si512();
        }
        for (int j = 0; j < 4; j++) {
            const __m512i alo = _mm512_loadu_si512(g0 + 64 * j), ahi = _mm512_loadu_si512(g0 + 64 * (4 + j));
            const __m512i blo = _mm512_loadu_si512(g1 + 64 * j), bhi = _mm512_loadu_si512(g1 + 64 * (4 + j));
            for (int r = 0; r < R; r++) {
                const __m512i lo = _mm512_set1_epi32(load_i32(xb + (int64_t)r * k + 4 * j));
                const __m512i hi = _mm512_set1_epi32(load_i32(xb + (int64_t)r * k + 16 + 4 * j));
                if (mode == WEIGHTS_FROM_MEMORY) {
                    dots[0][r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dots[0][r], lo, alo), hi, ahi);
                    dots[1][r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dots[1][r], lo, blo), hi, bhi);
                } else {
                    dots[0][r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dots[0][r], alo, lo), ahi, hi);
                    dots[1][r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dots[1][r], blo, lo), bhi, hi);
                }
            }
        }
        if (mode == NO_EPILOGUE) continue;
        const __m512 dw[2] = {_mm512_load_ps((const float *)(g0 + 512)), _mm512_load_ps((const float *)(g1 + 512))};
        const __m512 cw[2] = {_mm512_load_ps((const float *)(g0 + 576)), _mm512_load_ps((const float *)(g1 + 576))};
        for (int r = 0; r < R; r++) {
            const __m512 dx = _mm512_set1_ps(d[r * nb + b]), sx = _mm512_set1_ps(ds[r * nb + b]);
            for (int h = 0; h < 2; h++) {
                const __m512 scale = mode == NO_MULTIPLY || mode == CONVERT_AND_FMA ? dw[h] : _mm512_mul_ps(dw[h], dx);
                sums[h][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[h][r]), scale, sums[h][r]);
                if (mode != NO_MINIMUM_TERM && mode != CONVERT_AND_FMA) sums[h][r] = _mm512_fmadd_ps(cw[h], sx, sums[h][r]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int h = 0; h < 2; h++)
            _mm512_storeu_ps(out + r * 32 + 16 * h,
                             mode == NO_EPILOGUE ? _mm512_castsi512_ps(dots[h][r]) : sums[h][r]);
}

#define VARIANT(mode)                                                                                         \
    static __attribute__((noinline)) void pass_##mode(const uint8_t *p0, const uint8_t *p1, int nb,           \
                                                     const int8_t *x, int k, const float *d, const float *ds, \
                                                     float *out) { pass(mode, p0, p1, nb, x, k, d, ds, out); }
VARIANT(WHOLE) VARIANT(NO_MULTIPLY) VARIANT(NO_MINIMUM_TERM) VARIANT(CONVERT_AND_FMA) VARIANT(NO_EPILOGUE)
VARIANT(WEIGHTS_FROM_MEMORY)
typedef void (*Pass)(const uint8_t *, const uint8_t *, int, const int8_t *, int, const float *, const float *, float *);
static const Pass PASSES[VARIANTS] = {pass_WHOLE, pass_NO_MULTIPLY, pass_NO_MINIMUM_TERM, pass_CONVERT_AND_FMA,
                                      pass_NO_EPILOGUE, pass_WEIGHTS_FROM_MEMORY};

int main(int argc, char **argv) {
    const int k = argc > 1 ? atoi(argv[1]) : 1536, groups = argc > 2 ? atoi(argv[2]) : 36;
    const int rows = argc > 3 ? atoi(argv[3]) : 256, rounds = argc > 4 ? atoi(argv[4]) : 5, nb = k / 32;
    if (k % 32 || groups % 2 || rows % R || k <= 0 || groups <= 0 || rows <= 0 || rounds <= 0) {
        fprintf(stderr, "usage: int8_loop K GROUPS ROWS ROUNDS (K a multiple of 32, GROUPS even, ROWS of %d)\n", R);
        return 2;
    }
    const size_t panel_bytes = (size_t)groups * nb * BLOCK;
    uint8_t *panels = aligned_alloc(64, panel_bytes);
    int8_t *x = aligned_alloc(64, (size_t)rows * k);
    float *d = malloc(sizeof(float) * rows * nb), *ds = malloc(sizeof(float) * rows * nb), out[R * 32];
    if (!panels || !x || !d || !ds) return 1;
    srand(1);
    for (size_t i = 0; i < panel_bytes; i++) panels[i] = (uint8_t)(rand() & 15);
    for (size_t b = 0; b < (size_t)groups * nb; b++) { /* real scales: no denormals in the timing */
        float *f = (float *)(panels + b * BLOCK + 512);
        for (int i = 0; i < 32; i++) f[i] = 0.01f;
    }
    for (size_t i = 0; i < (size_t)rows * k; i++) x[i] = (int8_t)(rand() % 255 - 127);
    for (int i = 0; i < rows * nb; i++) d[i] = 0.01f, ds[i] = 0.5f;
    double best[VARIANTS];
    for (int v = 0; v < VARIANTS; v++) best[v] = 1e30;
    for (int round = 0; round < rounds; round++)
        for (int v = 0; v < VARIANTS; v++) { /* variants take turns: drift hits each alike */
            struct timespec t0, t1;
            clock_gettime(CLOCK_MONOTONIC, &t0);
            for (int pair = 0; pair < groups / 2; pair++) {
                const uint8_t *p0 = panels + (size_t)(2 * pair) * nb * BLOCK, *p1 = p0 + (size_t)nb * BLOCK;
                for (int r0 = 0; r0 < rows; r0 += R)
                    PASSES[v](p0, p1, nb, x + (size_t)r0 * k, k, d + r0 * nb, ds + r0 * nb, out);
            }
            clock_gettime(CLOCK_MONOTONIC, &t1);
            const double s = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
            best[v] = s < best[v] ? s : best[v];
        }
    const double macs = (double)groups * 16 * k * rows;
    for (int v = 0; v < VARIANTS; v++) printf("%s\t%.4f\t%.2f\n", NAMES[v], best[v] * 1e3, macs / best[v] * 1e-9);
    return out[0] == 12345.0f; /* keeps the stores */
}
