/* Paged decode attention on the CPU, reading K/V pages in place (`decode_paged_cpu.py` loads it).

Why: the torch path gathers every decode row's pages into a padded [rows, span, kv_heads, head_dim]
copy (`index_select`) before SDPA; at 4-16 rows that copy is about a quarter of the decode step. Here
each (row, kv head) walks its own pages straight out of the pool:

  1. scores: one pass over the row's keys serves the whole GQA group (the `group` query heads that
     share the kv head), s[j][t] = (q_j . k_t) * scale * log2(e), kept in a small scratch row;
  2. softmax: exact (max first, then 2^(s - max) and the sum), in fp32, as SDPA;
  3. values: one pass over the row's values, accumulating every group query's weighted sum.

Plain C with GCC/Clang vector extensions (8 fp32 lanes: one AVX2 register, half an AVX-512 one) so
that no -ffast-math is needed: every reduction keeps 8 independent lane sums, and exp2 is a
polynomial of ~1 ulp rather than libm's scalar call. head_dim must be a multiple of 8 (the caller
checks). Layouts (all fp32 / int32 / int64, C-contiguous unless a stride is given):
  q      [rows, q_stride]: row r's heads at q + r*q_stride, head h at + h*head_dim
  k, v   [pages, page_size, kv_heads, head_dim] (the engine's paged pool, `PagedKVStorage`)
  table  int32 [rows, table_stride]: row r's page ids
  lens   int64 [rows]: row r attends positions 0..lens[r]-1 (1 <= lens[r] <= max_len)
  out    [rows, heads, head_dim]
  scratch fp32, at least group * (max_len rounded up to 8) floats
Returns 0, or (nothing written) -1: head shapes it does not take, -2: a length out of range, -3: a
page id outside the pool.
*/
#include <stdint.h>
#include <string.h>

#include "../../native/vec_f32.h"
#ifdef __AVX__
#include <immintrin.h>
#endif

#define MAX_GROUP 16
#define MAX_VECS 32 /* head_dim up to 256 */
#ifndef PREFETCH_PAGES
#define PREFETCH_PAGES 2 /* how many pages ahead a row's pages are asked for */
#endif

/* out[0..3] = the lane sums of a, b, c, d (AVX: three horizontal adds instead of four reductions) */
static inline void hsum8x4(v8f a, v8f b, v8f c, v8f d, float *out) {
#ifdef __AVX__
    __m256 ab = _mm256_hadd_ps((__m256)a, (__m256)b), cd = _mm256_hadd_ps((__m256)c, (__m256)d);
    __m256 abcd = _mm256_hadd_ps(ab, cd); /* a0123 b0123 c0123 d0123 | a4567 b4567 c4567 d4567 */
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
#else
    out[0] = hsum8(a), out[1] = hsum8(b), out[2] = hsum8(c), out[3] = hsum8(d);
#endif
}

/* Ask for lines PREFETCH_PAGES pages ahead of their use: pages are scattered over the pool, so the
   hardware prefetchers see a new stream every page_size positions, and at 4-16 rows the K/V read
   (MBs a layer) comes from DRAM. Measured on the embedded model, 16 rows of 540 positions: the
   forward's attention 2.7 -> 1.6-1.8 ms (whole pages at once: 2.4; distance 1, 2, 4 alike). */
static inline void prefetch_lines(const float *page, int64_t floats) {
    for (int64_t f = 0; f < floats; f += 16) {
#if defined(__x86_64__) || defined(__i386__)
        __asm__ volatile("prefetcht0 %0" : : "m"(page[f])); /* GCC 12 at -O1+ drops __builtin_prefetch here */
#else
        __builtin_prefetch(page + f, 0, 3);
#endif
    }
}

/* One (row, kv head): `group` queries at qh, positions 0..len-1 on `pages`, results at oh. Always
   inlined into `paged_decode_attention`'s dispatch with constant group and vecs, so that the loops
   unroll and the queries and accumulators live in registers. */
static inline __attribute__((always_inline)) void attend_head(
    const float *qh, const float *k, const float *v, const int32_t *pages, int64_t len, int64_t page_size,
    int64_t pos_stride, int64_t page_stride, float scale, float *scratch, float *oh, const int64_t group,
    const int64_t vecs) {
    const int64_t head_dim = vecs * 8;
    const int64_t padded = (len + 7) & ~(int64_t)7;
    v8f qv[MAX_GROUP][MAX_VECS];
    for (int64_t j = 0; j < group; j++)
        for (int64_t c = 0; c < vecs; c++) qv[j][c] = load8(qh + j * head_dim + c * 8) * splat8(scale);
    /* 1. scores, one pass over the keys for the whole group, four positions at a time (a page
       holds whole fours; positions past len in the last one are scored and then masked) */
    const int64_t num = (len + page_size - 1) / page_size;
    for (int64_t t0 = 0, p = 0; t0 < len; t0 += page_size, p++) {
        const float *kp = k + (int64_t)pages[p] * page_stride;
        const int64_t n = len - t0 < page_size ? len - t0 : page_size;
        /* the same positions PREFETCH_PAGES pages ahead, a slice at a time (a burst would overflow the
           misses the core can track) */
        const float *ahead = p + PREFETCH_PAGES < num ? k + (int64_t)pages[p + PREFETCH_PAGES] * page_stride : NULL;
        int64_t i = 0;
        if (page_size % 4 == 0)
            for (; i < n; i += 4, kp += 4 * pos_stride) {
                if (ahead) prefetch_lines(ahead + i * pos_stride, 4 * pos_stride);
                v8f k0[MAX_VECS], k1[MAX_VECS], k2[MAX_VECS], k3[MAX_VECS]; /* the 4 keys, loaded once */
                for (int64_t c = 0; c < vecs; c++) {
                    k0[c] = load8(kp + c * 8), k1[c] = load8(kp + pos_stride + c * 8);
                    k2[c] = load8(kp + 2 * pos_stride + c * 8), k3[c] = load8(kp + 3 * pos_stride + c * 8);
                }
                for (int64_t j = 0; j < group; j++) {
                    const v8f q0 = qv[j][0];
                    v8f a0 = q0 * k0[0], a1 = q0 * k1[0], a2 = q0 * k2[0], a3 = q0 * k3[0];
                    for (int64_t c = 1; c < vecs; c++) {
                        const v8f qc = qv[j][c];
                        a0 += qc * k0[c], a1 += qc * k1[c], a2 += qc * k2[c], a3 += qc * k3[c];
                    }
                    hsum8x4(a0, a1, a2, a3, scratch + j * padded + t0 + i);
                }
            }
        for (; i < n; i++, kp += pos_stride)
            for (int64_t j = 0; j < group; j++) {
                v8f acc = qv[j][0] * load8(kp);
                for (int64_t c = 1; c < vecs; c++) acc += qv[j][c] * load8(kp + c * 8);
                scratch[j * padded + t0 + i] = hsum8(acc);
            }
    }
    /* 2. softmax weights (unnormalized) and their sums */
    float inv_sum[MAX_GROUP];
    for (int64_t j = 0; j < group; j++) {
        float *s = scratch + j * padded;
        for (int64_t t = len; t < padded; t++) s[t] = -1e30f;
        v8f m8 = load8(s);
        for (int64_t t = 8; t < padded; t += 8) m8 = vmax8(load8(s + t), m8);
        const v8f m = splat8(hmax8(m8));
        v8f sum8 = splat8(0.0f);
        for (int64_t t = 0; t < padded; t += 8) {
            v8f e = exp2_8(load8(s + t) - m);
            if (t + 8 > len) /* the padding's lanes weigh nothing */
                for (int64_t i = len - t; i < 8; i++) e[i] = 0.0f;
            store8(s + t, e);
            sum8 += e;
        }
        inv_sum[j] = 1.0f / hsum8(sum8);
    }
    /* 3. values, one pass for the whole group */
    v8f acc[MAX_GROUP][MAX_VECS];
    for (int64_t j = 0; j < group; j++)
        for (int64_t c = 0; c < vecs; c++) acc[j][c] = splat8(0.0f);
    for (int64_t t0 = 0, p = 0; t0 < len; t0 += page_size, p++) {
        const float *vp = v + (int64_t)pages[p] * page_stride;
        const int64_t n = len - t0 < page_size ? len - t0 : page_size;
        const float *ahead = p + PREFETCH_PAGES < num ? v + (int64_t)pages[p + PREFETCH_PAGES] * page_stride : NULL;
        for (int64_t i = 0; i < n; i++, vp += pos_stride) {
            if (ahead) prefetch_lines(ahead + i * pos_stride, pos_stride);
            v8f vv[MAX_VECS];
            for (int64_t c = 0; c < vecs; c++) vv[c] = load8(vp + c * 8);
            for (int64_t j = 0; j < group; j++) {
                const v8f w = splat8(scratch[j * padded + t0 + i]);
                for (int64_t c = 0; c < vecs; c++) acc[j][c] += w * vv[c];
            }
        }
    }
    for (int64_t j = 0; j < group; j++)
        for (int64_t c = 0; c < vecs; c++) store8(oh + j * head_dim + c * 8, acc[j][c] * splat8(inv_sum[j]));
}

#define ATTEND(G, V)                                                                                     \
    attend_head(qh, kh, vh, pages, len, page_size, pos_stride, page_stride, scale, scratch, oh, G, V)

int paged_decode_attention(const float *q, int64_t q_stride, const float *k, const float *v, int64_t num_pages,
                           const int32_t *table, int64_t table_stride, const int64_t *lens, int64_t rows,
                           int64_t max_len, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t page_size,
                           float scale, float *scratch, float *out) {
    const int64_t group = heads / kv_heads;
    const int64_t vecs = head_dim / 8;
    const int64_t pos_stride = kv_heads * head_dim;      /* floats between positions of a page */
    const int64_t page_stride = page_size * pos_stride; /* floats between pages */
    if (group > MAX_GROUP || vecs > MAX_VECS || head_dim % 8 || heads % kv_heads) return -1;
    for (int64_t r = 0; r < rows; r++) { /* checked up front: out of range would read or write astray */
        if (lens[r] < 1 || lens[r] > max_len) return -2;
        for (int64_t p = 0; p < (lens[r] + page_size - 1) / page_size; p++)
            if (table[r * table_stride + p] < 0 || table[r * table_stride + p] >= num_pages) return -3;
    }
    scale *= 1.4426950408889634f; /* exp(x) = 2^(x log2 e) */
    for (int64_t r = 0; r < rows; r++) {
        const int64_t len = lens[r];
        const int32_t *pages = table + r * table_stride;
        for (int64_t h = 0; h < kv_heads; h++) {
            const float *qh = q + r * q_stride + h * group * head_dim;
            const float *kh = k + h * head_dim, *vh = v + h * head_dim;
            float *oh = out + (r * heads + h * group) * head_dim;
            /* the common shapes with constant loop bounds; the rest generic */
            if (group == 4 && vecs == 4) ATTEND(4, 4);
            else if (group == 2 && vecs == 4) ATTEND(2, 4);
            else if (group == 1 && vecs == 4) ATTEND(1, 4);
            else if (group == 8 && vecs == 4) ATTEND(8, 4);
            else if (group == 4 && vecs == 8) ATTEND(4, 8);
            else if (group == 2 && vecs == 8) ATTEND(2, 8);
            else if (group == 1 && vecs == 8) ATTEND(1, 8);
            else if (group == 8 && vecs == 8) ATTEND(8, 8);
            else if (group == 4 && vecs == 16) ATTEND(4, 16);
            else if (group == 2 && vecs == 16) ATTEND(2, 16);
            else if (group == 1 && vecs == 16) ATTEND(1, 16);
            else if (group == 8 && vecs == 16) ATTEND(8, 16);
            else ATTEND(group, vecs);
        }
    }
    return 0;
}
