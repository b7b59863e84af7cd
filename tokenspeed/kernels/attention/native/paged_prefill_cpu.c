/* Causal attention of one prompt chunk over its row's KV pages on the CPU (`prefill_paged_cpu.py` loads it).

Why: the paged decode kernel (`paged_decode_cpu.c`) run with every prompt token as a one-token row
does a horizontal sum per (query, key) and reloads the keys for each token: ~54 GFLOP/s on a
512-token row of the embedded model. Here a chunk's queries go in tiles of R (token, head) rows of
one kv head against the row's keys transposed once per call (K^T, 16 keys a vector), which is a
small register-blocked GEMM, R x 16 scores at a time with no horizontal sums; then an exact fp32
softmax per query (max first, 2^(s - max), the sum), then the values (R rows x head_dim in registers,
one pass over the keys a tile). A tile scores only the keys its last token sees (causal), and each
row's weights past its own position are zero.

Plain C with GCC/Clang vector extensions (16 fp32 lanes), no -ffast-math (multiply-adds may fuse).
Equal to SDPA within fp32 rounding, not bit for bit. Layouts (fp32 / int32, C-contiguous unless a
stride is given):
  q       [n, q_stride]: token i's heads at q + i*q_stride, head j at + j*head_dim
  k, v    [pages, page_size, kv_heads, head_dim] (the engine's paged pool)
  pages   int32: the row's page ids, positions 0..first + n - 1
  out     [n, out_stride]: token i's heads at out + i*out_stride
  scratch fp32, at least (2 * head_dim + TILE) * (first + n rounded up to 16) floats
Token i sits at position first + i and attends positions 0..first + i. head_dim must be 16, 32, 64
or 128 (the caller checks). Returns 0, or (nothing written) -1: head shapes it does not take,
-3: a page id outside the pool.
*/
#include <stdint.h>
#include <string.h>

#include "../../native/vec_f32.h"

#ifndef TILE
#define TILE 8 /* (token, head) query rows scored together */
#endif

/* One kv head: the rows (token i, group member jj) of flat index r0..r0+rows-1 (r = i * group + jj).
   kt: [head_dim][padded] keys transposed; vc: [len][head_dim] values; s: [TILE][padded] scratch. */
static inline __attribute__((always_inline)) void attend_tile(
    const float *q, int64_t q_stride, int64_t qh0, const float *kt, const float *vc, float *s, int64_t padded,
    int64_t first, int64_t r0, int64_t rows, int64_t group, float scale, float *out, int64_t out_stride,
    const int64_t vecs) {
    const int64_t head_dim = vecs * 16;
    int64_t lens[TILE];
    const float *qrow[TILE];
    float *orow[TILE];
    for (int64_t r = 0; r < TILE; r++) {
        const int64_t flat = r0 + (r < rows ? r : rows - 1); /* a short tile repeats its last row */
        const int64_t i = flat / group, jj = flat % group;
        lens[r] = first + i + 1;
        qrow[r] = q + i * q_stride + (qh0 + jj) * head_dim;
        orow[r] = out + i * out_stride + (qh0 + jj) * head_dim;
    }
    const int64_t len = lens[TILE - 1] > lens[0] ? lens[TILE - 1] : lens[0];
    /* 1. scores: R rows x 16 keys a step, no horizontal sums */
    for (int64_t t = 0; t < len; t += 16) {
        v16f acc[TILE];
        for (int64_t r = 0; r < TILE; r++) acc[r] = splat16(0.0f);
        for (int64_t d = 0; d < head_dim; d++) {
            const v16f kv = load16(kt + d * padded + t);
            for (int64_t r = 0; r < TILE; r++) acc[r] += splat16(qrow[r][d]) * kv;
        }
        for (int64_t r = 0; r < TILE; r++) store16(s + r * padded + t, acc[r] * splat16(scale));
    }
    /* 2. softmax weights (unnormalized) per row, zero past its own position */
    const int64_t lpad = (len + 15) & ~(int64_t)15;
    float inv_sum[TILE];
    for (int64_t r = 0; r < TILE; r++) {
        float *sr = s + r * padded;
        for (int64_t t = lens[r]; t < lpad; t++) sr[t] = -1e30f;
        v16f m16 = load16(sr);
        for (int64_t t = 16; t < lpad; t += 16) m16 = vmax16(load16(sr + t), m16);
        const v16f m = splat16(hmax16(m16));
        v16f sum = splat16(0.0f);
        for (int64_t t = 0; t < lpad; t += 16) {
            v16f e = exp2_16(load16(sr + t) - m);
            if (t + 16 > lens[r]) /* this row's keys end in (or before) this block */
                for (int64_t x = lens[r] > t ? lens[r] - t : 0; x < 16; x++) e[x] = 0.0f;
            store16(sr + t, e);
            sum += e;
        }
        inv_sum[r] = 1.0f / hsum16(sum);
    }
    /* 3. values: R rows x head_dim accumulated over the keys */
    v16f acc[TILE][8];
    for (int64_t r = 0; r < TILE; r++)
        for (int64_t c = 0; c < vecs; c++) acc[r][c] = splat16(0.0f);
    for (int64_t t = 0; t < len; t++) {
        v16f vv[8];
        for (int64_t c = 0; c < vecs; c++) vv[c] = load16(vc + t * head_dim + c * 16);
        for (int64_t r = 0; r < TILE; r++) {
            const v16f w = splat16(s[r * padded + t]);
            for (int64_t c = 0; c < vecs; c++) acc[r][c] += w * vv[c];
        }
    }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < vecs; c++) store16(orow[r] + c * 16, acc[r][c] * splat16(inv_sum[r]));
}

int paged_prefill_attention(const float *q, int64_t q_stride, const float *k, const float *v, int64_t num_pages,
                            const int32_t *pages, int64_t first, int64_t n, int64_t heads, int64_t kv_heads,
                            int64_t head_dim, int64_t page_size, float scale, float *scratch, float *out,
                            int64_t out_stride) {
    if (heads % kv_heads || !(head_dim == 16 || head_dim == 32 || head_dim == 64 || head_dim == 128)) return -1;
    const int64_t len = first + n, num = (len + page_size - 1) / page_size;
    for (int64_t p = 0; p < num; p++)
        if (pages[p] < 0 || pages[p] >= num_pages) return -3;
    const int64_t group = heads / kv_heads, vecs = head_dim / 16;
    const int64_t pos_stride = kv_heads * head_dim, page_stride = page_size * pos_stride;
    const int64_t padded = (len + 15) & ~(int64_t)15;
    float *kt = scratch, *vc = scratch + head_dim * padded, *s = vc + head_dim * padded;
    scale *= 1.4426950408889634f; /* exp(x) = 2^(x log2 e) */
    for (int64_t h = 0; h < kv_heads; h++) {
        /* the row's keys of this head transposed, its values gathered contiguous; padding keys zero */
        for (int64_t t = 0; t < len; t++) {
            const float *kp = k + (int64_t)pages[t / page_size] * page_stride + (t % page_size) * pos_stride + h * head_dim;
            const float *vp = v + (kp - k);
            for (int64_t d = 0; d < head_dim; d++) kt[d * padded + t] = kp[d];
            memcpy(vc + t * head_dim, vp, head_dim * sizeof(float));
        }
        for (int64_t d = 0; d < head_dim; d++)
            for (int64_t t = len; t < padded; t++) kt[d * padded + t] = 0.0f;
        const int64_t rows = n * group;
        for (int64_t r0 = 0; r0 < rows; r0 += TILE) {
            const int64_t m = rows - r0 < TILE ? rows - r0 : TILE;
            if (vecs == 2) attend_tile(q, q_stride, h * group, kt, vc, s, padded, first, r0, m, group, scale, out, out_stride, 2);
            else if (vecs == 1) attend_tile(q, q_stride, h * group, kt, vc, s, padded, first, r0, m, group, scale, out, out_stride, 1);
            else if (vecs == 4) attend_tile(q, q_stride, h * group, kt, vc, s, padded, first, r0, m, group, scale, out, out_stride, 4);
            else attend_tile(q, q_stride, h * group, kt, vc, s, padded, first, r0, m, group, scale, out, out_stride, 8);
        }
    }
    return 0;
}
