/* fp32 vector helpers shared by the CPU kernels (the C files of `native/` and `attention/native/`), one copy.

Plain GCC/Clang vector extensions, so that no -ffast-math and no ISA-specific code is needed: v8f is
one AVX2 register (half an AVX-512 one), v16f one AVX-512 register (two AVX2 ones). Loads and stores
go through memcpy (unaligned, no aliasing questions). exp2 is a polynomial of ~1 ulp rather than
libm's scalar call. `native_build.build_library` keys a build on this header too.
*/
#ifndef TOKENSPEED_VEC_F32_H
#define TOKENSPEED_VEC_F32_H

#include <stdint.h>
#include <string.h>
#ifdef __AVX__
#include <immintrin.h>
#endif

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

/* For W = 8 and 16 lanes: loadW / storeW, splatW, hmaxW, selectW(take_a, a, b) (C has no vector `?:`:
   through the compare's mask) and exp2_W_unclamped(x); after it vmaxW (no NaNs here) and exp2_W(x) = 2^x for x <= 127, to a few ulp
   for x >= -126 (below, clamped there: such a weight is < 1e-37; exp2_W_unclamped: x in [-126, 127]). exp2: adding 1.5 * 2^23 rounds x
   to the nearest integer n (the fraction leaves the mantissa), f = x - n is in [-0.5, 0.5], 2^f is
   its Taylor series to degree 7 (relative error < 1e-8), and 2^n goes straight into the exponent. */
#define TOKENSPEED_VEC_F32(W)                                                                      \
    static inline v##W##f load##W(const float *p) {                                               \
        v##W##f x;                                                                                 \
        memcpy(&x, p, sizeof x);                                                                   \
        return x;                                                                                  \
    }                                                                                              \
    static inline void store##W(float *p, v##W##f x) { memcpy(p, &x, sizeof x); }                 \
    static inline v##W##f splat##W(float x) { return x - (v##W##f){}; }                            \
    static inline float hmax##W(v##W##f x) {                                                       \
        float m = x[0];                                                                            \
        for (int i = 1; i < W; i++) m = x[i] > m ? x[i] : m;                                       \
        return m;                                                                                  \
    }                                                                                              \
    static inline v##W##f select##W(v##W##i take_a, v##W##f a, v##W##f b) {                       \
        v##W##i ai, bi;                                                                            \
        memcpy(&ai, &a, sizeof ai);                                                                \
        memcpy(&bi, &b, sizeof bi);                                                                \
        v##W##i r = (ai & take_a) | (bi & ~take_a);                                                \
        v##W##f out;                                                                               \
        memcpy(&out, &r, sizeof out);                                                              \
        return out;                                                                                \
    }                                                                                              \
    static inline v##W##f exp2_##W##_unclamped(v##W##f x) {                                        \
        v##W##f n = (x + splat##W(12582912.0f)) - splat##W(12582912.0f);                           \
        v##W##f f = x - n;                                                                         \
        v##W##f p = splat##W(1.5252733804059840e-5f);                                              \
        p = p * f + splat##W(1.5403530393381608e-4f);                                              \
        p = p * f + splat##W(1.3333558146428443e-3f);                                              \
        p = p * f + splat##W(9.6181291076284770e-3f);                                              \
        p = p * f + splat##W(5.5504108664821580e-2f);                                              \
        p = p * f + splat##W(2.4022650695910071e-1f);                                              \
        p = p * f + splat##W(6.9314718055994531e-1f);                                              \
        p = p * f + splat##W(1.0f);                                                                \
        v##W##i bits = (__builtin_convertvector(n, v##W##i) + 127) << 23;                          \
        v##W##f scale;                                                                             \
        memcpy(&scale, &bits, sizeof scale);                                                       \
        return p * scale;                                                                          \
    }

TOKENSPEED_VEC_F32(8)
TOKENSPEED_VEC_F32(16)

static inline v8f vmax8(v8f a, v8f b) {
#ifdef __AVX__
    return (v8f)_mm256_max_ps((__m256)a, (__m256)b); /* one instruction, not a compare and a blend */
#else
    return select8(a > b, a, b);
#endif
}

static inline v16f vmax16(v16f a, v16f b) { return select16(a > b, a, b); }

static inline v8f exp2_8(v8f x) { return exp2_8_unclamped(vmax8(x, splat8(-126.0f))); }

static inline v16f exp2_16(v16f x) { return exp2_16_unclamped(vmax16(x, splat16(-126.0f))); }

/* Lane sums: 8 lanes pairwise (the decode kernel's order), 16 in lane order. */
static inline float hsum8(v8f x) { return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7])); }

static inline float hsum16(v16f x) {
    float s = 0.0f;
    for (int i = 0; i < 16; i++) s += x[i];
    return s;
}

#endif
