/* fp32 GEMMs of few rows (decode steps) on the CPU (`kernels/cpu_small_gemm.py` loads it;
`executor/cpu_linear.py` calls it).

Why: at 1-16 rows the CPU forward's GEMMs are small (K = 256-576 on the embedded model), and both
MKL's sgemm on the [out, in] weight and oneDNN's JIT kernel on its blocked weight spend most of their
time outside the multiply-adds: 16 rows x 576 -> 256 took 59-61 us in either, 4 rows x 256 -> 1152
40-61 us. Here the weight is packed once as [out / 16][in][16] (16 output columns a vector, streamed
in order) and a tile of up to 16 rows keeps its 16 x 16 outputs in registers: per input column one
weight vector load and one broadcast multiply-add per row. 16 x 576 -> 256: 42 us; 4 x 256 -> 1152:
22 us; the 4 MB LM head at one row 62 against 106 us (MKL).

y[m, n] = sum_k x[m, k] * w[n, k]; x rows at x_stride (m rows, any m: tiles of 16, 8, 4, 2, 1); wp the
packed weight; y contiguous [m, n]. n must be a multiple of 16 (the caller checks). Plain C vector
extensions (16 fp32 lanes), no -ffast-math; each output sums its k products in order (as one chain),
so it equals MKL's result within fp32 rounding, not bit for bit.
*/
#include <stdint.h>
#include <string.h>

#include "vec_f32.h"

/* R rows (a constant after inlining) of x against every 16-column block; the first `rows` are stored */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t x_stride, int64_t rows,
                                                       const float *wp, int64_t k, int64_t n, float *y,
                                                       const int64_t R) {
    for (int64_t nb = 0; nb < n; nb += 16) {
        const float *wb = wp + nb * k;
        v16f acc[16];
        for (int64_t r = 0; r < R; r++) acc[r] = splat16(0.0f);
        for (int64_t i = 0; i < k; i++) {
            const v16f w = load16(wb + i * 16);
            for (int64_t r = 0; r < R; r++) acc[r] += splat16(x[(r < rows ? r : 0) * x_stride + i]) * w;
        }
        for (int64_t r = 0; r < R && r < rows; r++) store16(y + r * n + nb, acc[r]);
    }
}

void small_gemm(const float *x, int64_t x_stride, int64_t m, const float *wp, int64_t k, int64_t n, float *y) {
    while (m > 0) {
        const int64_t rows = m >= 16 ? 16 : m;
        if (rows == 16) tile(x, x_stride, 16, wp, k, n, y, 16);
        else if (rows > 8) tile(x, x_stride, 8, wp, k, n, y, 8);
        else if (rows > 4) tile(x, x_stride, rows, wp, k, n, y, 8);
        else if (rows > 2) tile(x, x_stride, rows, wp, k, n, y, 4);
        else if (rows == 2) tile(x, x_stride, 2, wp, k, n, y, 2);
        else tile(x, x_stride, 1, wp, k, n, y, 1);
        const int64_t done = rows == 16 ? 16 : rows > 8 ? 8 : rows;
        x += done * x_stride, y += done * n, m -= done;
    }
}
