/* The AMX engine of the bf16 products (quant_bf16.h): TDPBF16PS on tiles of the panels.
 * A group's 16 weight rows are the 16 output columns of one tile; two row tiles by two
 * groups at a time, each tile loaded feeding two products.
 *
 * Linux hands out AMX state only to a process that asks (arch_prctl); without the
 * instructions or the permission `amx_permission` is 0 and the AVX512-BF16 engine runs.
 * Included by quant_bf16.h (inside its AVX512-BF16 section).
 */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_ARCH_REQ_XCOMP_PERM 0x1023
#define AMX_XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} AmxConfig;

static int amx_permission(void) {
    static int state = -1; /* -1 unknown, 0 refused, 1 granted */
    if (state < 0) state = syscall(SYS_arch_prctl, AMX_ARCH_REQ_XCOMP_PERM, AMX_XFEATURE_XTILEDATA) == 0;
    return state;
}

static void amx_configure(void) {
    AmxConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) { c.colsb[t] = 64; c.rows[t] = 16; } /* 0-3 sums, 4-5 inputs, 6-7 weights */
    _tile_loadconfig(&c);
}

static void amx_release(void) { _tile_release(); }

/* Sums tile t (group g, row tile rt of this pass) to the output: whole tiles straight
 * into it, partial ones (the last rows, a part's last group) through `sums`. */
#define AMX_SAVE(t, g, rt)                                                                        \
    {                                                                                             \
        const int first = r0 + 16 * (rt), count = rows - first < 16 ? rows - first : 16;          \
        if (count == 16 && valid[g] == 16) {                                                      \
            _tile_stored(t, out[g] + (int64_t)first * n, n * 4);                                  \
        } else if (count > 0) {                                                                   \
            _tile_stored(t, sums, 64);                                                            \
            bf16_emit(sums, count, valid[g], out[g] + (int64_t)first * n, n);                     \
        }                                                                                         \
    }

/* Up to two groups (32 output columns) against every input row, two row tiles at a time:
 * sums in tiles 0-3 (row tile r, group g at 2r + g), inputs in 4-5, weights in 6-7.
 * valid[g]: group g's real rows (0: no second group). */
static void amx_groups(const uint16_t *panels[2], const int valid[2], int nb, const uint16_t *in, int rows,
                       int padded, float *out[2], int n) {
    float sums[256] __attribute__((aligned(64)));
    const int two = valid[1] > 0;
    for (int r0 = 0; r0 < padded; r0 += 32) {
        const int pair = padded - r0 >= 32;
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        const uint16_t *a = in + (int64_t)(r0 / 16) * nb * BF16_TILE_VALUES; /* row tile r0 / 16, block 0 */
        for (int b = 0; b < nb; b++) {
            const uint16_t *at = a + (int64_t)b * BF16_TILE_VALUES;
            _tile_loadd(6, panels[0] + (int64_t)b * BF16_TILE_VALUES, 64);
            _tile_loadd(4, at, 64);
            _tile_dpbf16ps(0, 4, 6);
            if (two) {
                _tile_loadd(7, panels[1] + (int64_t)b * BF16_TILE_VALUES, 64);
                _tile_dpbf16ps(1, 4, 7);
            }
            if (pair) {
                _tile_loadd(5, at + (int64_t)nb * BF16_TILE_VALUES, 64);
                _tile_dpbf16ps(2, 5, 6);
                if (two) _tile_dpbf16ps(3, 5, 7);
            }
        }
        AMX_SAVE(0, 0, 0);
        if (two) AMX_SAVE(1, 1, 0);
        if (pair) AMX_SAVE(2, 0, 1);
        if (pair && two) AMX_SAVE(3, 1, 1);
    }
}
#undef AMX_SAVE
#else
static int amx_permission(void) { return 0; }
static void amx_configure(void) {}
static void amx_release(void) {}
static void amx_groups(const uint16_t *panels[2], const int valid[2], int nb, const uint16_t *in, int rows,
                       int padded, float *out[2], int n) {
    (void)panels, (void)valid, (void)nb, (void)in, (void)rows, (void)padded, (void)out, (void)n;
}
#endif
