/* Fused elementwise ops of the CPU forward (`kernels/cpu_fused.py` loads it; `executor/cpu_decode.py`
calls it).

Why: between its GEMMs a layer of the CPU forward ran ~20 torch ops over its rows (residual add,
RMSNorm as 5 ops, q/k RMSNorm, RoPE as 4, the K/V writes, SiLU and the gate product): on a 512-token
prefill of the embedded model ~4.7 ms of ~31 (each op a pass over memory), on a few-row decode step
~5 us of dispatch each. Here each group is one pass per row:

  add_rms_norm    a += b (b may be NULL), out = w * (a * 1/sqrt(mean(a^2) + eps))
  qk_norm_rope_store  on the fused QKV rows in place: q and k heads RMS-normed (optional weight per
                  head), rotated (rotate-half RoPE at each token's position), then the token's k and v
                  written to its KV slot
  silu_mul        out = silu(gate) * up from the fused [gate | up] rows

Plain C with GCC/Clang vector extensions (8 fp32 lanes) and no -ffast-math (multiply-adds may fuse:
on a 512-row SiLU that was 137 against 205 us). Results equal torch's within fp32 rounding (the RMS
sum is in another order, fused multiply-adds, exp a ~1 ulp polynomial), not bit for bit.
Every dimension must be a multiple of 8 (the caller checks). Returns 0, or (before anything is
written) -1: a position outside the RoPE table, -2: a slot outside the KV pool.
*/
#include <stdint.h>
#include <string.h>

#include "vec_f32.h"
#include <math.h>

/* 1 / sqrt(mean(x^2) + eps) of n floats (n % 8 == 0) */
static inline float inv_rms(const float *x, int64_t n, float eps) {
    v8f acc0 = splat8(0.0f), acc1 = splat8(0.0f);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        v8f a = load8(x + i), b = load8(x + i + 8);
        acc0 += a * a;
        acc1 += b * b;
    }
    for (; i < n; i += 8) {
        v8f a = load8(x + i);
        acc0 += a * a;
    }
    float mean = hsum8(acc0 + acc1) / (float)n;
    return 1.0f / sqrtf(mean + eps);
}

int add_rms_norm(float *a, int64_t a_stride, const float *b, int64_t b_stride, const float *w, float *out,
                 int64_t out_stride, int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        float *x = a + r * a_stride;
        if (b != NULL) {
            const float *y = b + r * b_stride;
            for (int64_t i = 0; i < dim; i += 8) store8(x + i, load8(x + i) + load8(y + i));
        }
        v8f scale = splat8(inv_rms(x, dim, eps));
        float *o = out + r * out_stride;
        for (int64_t i = 0; i < dim; i += 8) store8(o + i, load8(w + i) * (load8(x + i) * scale));
    }
    return 0;
}

int qk_norm_rope_store(float *qkv, int64_t stride, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t head_dim,
                       const float *norm_w, float eps, const int64_t *positions, const float *cos_cache,
                       const float *sin_cache, int64_t max_pos, const int64_t *slots, float *k_flat, float *v_flat,
                       int64_t num_slots) {
    const int64_t half = head_dim / 2, qk_heads = heads + kv_heads, kv_width = kv_heads * head_dim;
    for (int64_t t = 0; t < tokens; t++) {
        if (positions[t] < 0 || positions[t] >= max_pos) return -1;
        if (slots != NULL && (slots[t] < 0 || slots[t] >= num_slots)) return -2;
    }
    for (int64_t t = 0; t < tokens; t++) {
        float *row = qkv + t * stride;
        const float *cos = cos_cache + positions[t] * half, *sin = sin_cache + positions[t] * half;
        for (int64_t h = 0; h < qk_heads; h++) {
            float *x = row + h * head_dim;
            if (norm_w != NULL) {
                v8f scale = splat8(inv_rms(x, head_dim, eps));
                const float *wh = norm_w + h * head_dim;
                for (int64_t i = 0; i < head_dim; i += 8) store8(x + i, load8(wh + i) * (load8(x + i) * scale));
            }
            for (int64_t i = 0; i < half; i += 8) {
                v8f x1 = load8(x + i), x2 = load8(x + half + i), c = load8(cos + i), s = load8(sin + i);
                store8(x + i, x1 * c + x2 * -s);
                store8(x + half + i, x2 * c + x1 * s);
            }
        }
        if (slots != NULL) {
            memcpy(k_flat + slots[t] * kv_width, row + heads * head_dim, kv_width * sizeof(float));
            memcpy(v_flat + slots[t] * kv_width, row + qk_heads * head_dim, kv_width * sizeof(float));
        }
    }
    return 0;
}

/* e^x, x clamped to [-87, 88] (beyond, silu is x or -0 to fp32 precision anyway) */
static inline v8f exp8(v8f x) {
    x = select8(x < splat8(-87.0f), splat8(-87.0f), x);
    x = select8(x > splat8(88.0f), splat8(88.0f), x);
    return exp2_8_unclamped(x * splat8(1.4426950408889634f)); /* to base 2: in [-125.5, 127] */
}

int silu_mul(const float *gate_up, int64_t stride, float *out, int64_t out_stride, int64_t rows, int64_t dim) {
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * stride, *u = g + dim;
        float *o = out + r * out_stride;
        for (int64_t i = 0; i < dim; i += 8) {
            v8f x = load8(g + i);
            store8(o + i, x / (splat8(1.0f) + exp8(-x)) * load8(u + i));
        }
    }
    return 0;
}
