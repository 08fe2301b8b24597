/* A matrix times a few float32 vectors, as a ggml custom op (Context.mul_mat_vec): the generation
   step's products.

   Why: a generated token reads every weight once, and ggml's CPU mul_mat spends that time in
   ggml_vec_dot_f16 waiting on memory (perf: 84% of a 110M F16 token, the stalls on the loads). Its
   threads take small chunks of rows from a shared counter, so each thread's reads jump around and
   the hardware prefetchers restart at every chunk. Here each thread reads one contiguous run of
   rows, four rows at a time, with software prefetches a fixed distance ahead in that run, so the
   memory system always has the next lines in flight. For float16 and Q8_0 weights the products are
   ggmlpy's, with the vector kept float32 (ggml rounds it to float16, or quantizes it to Q8_0,
   first): a more exact product, and for float16 one conversion per 16 weights instead of two. For
   every other type they are ggml's own dot kernels, on the vector converted as ggml converts it. */
#pragma once
#include <stdint.h>
#include <string.h>
#include "ggml.h"
#include "ggmlpy_attn.h"
#include "ggmlpy_cpu.h"

#define GGMLPY_GEMV_MAX_COLS 4          /* vectors per call: a batch of up to 4 tokens */
#define GGMLPY_GEMV_SCRATCH 65536       /* bytes of a thread's copy of the vectors in ggml's dot type */

/* Bytes ahead of the rows being read that the kernel prefetches (0: none); process-wide, for
   benchmarks. */
static int64_t ggmlpy_gemv_pfd = 4096;
/* Process-wide: 0 forces the portable kernel (for tests). */
static int ggmlpy_gemv_allow_vector = 1;

#if GGMLPY_ATTN_X86
#define GGMLPY_GEMV_AVX512 __attribute__((target("avx512f,fma,f16c")))

/* y_c[r..r+R) = w_row . x_c for R rows (4, or 1 for the last few) and the m columns (m <= 4: all
   read in one pass over the rows). Float16 rows: 16 weights per step, k % 16 == 0. Q8_0 rows: a
   block of 32 int8 weights and its float16 scale per step, the block's 32 products summed before
   the scale multiplies them. Inlined per (R, m, type) so the accumulators stay in registers. */
GGMLPY_GEMV_AVX512 static inline __attribute__((always_inline)) void
ggmlpy_gemv_group_avx512(const char * w, size_t nb1, const float * const * x, int m, int64_t k, int64_t r, int R,
                         int q8, float * const * y) {
    __m512 acc[4][GGMLPY_GEMV_MAX_COLS];
    for (int i = 0; i < R; i++) for (int c = 0; c < m; c++) acc[i][c] = _mm512_setzero_ps();
    const char * w0 = w + r * nb1;
    if (!q8) {
        for (int64_t d = 0; d < k; d += 16) {
            __m512 wv[4];
            for (int i = 0; i < R; i++) wv[i] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (w0 + i * nb1 + 2 * d)));
            for (int c = 0; c < m; c++) {
                const __m512 xv = _mm512_loadu_ps(x[c] + d);
                for (int i = 0; i < R; i++) acc[i][c] = _mm512_fmadd_ps(wv[i], xv, acc[i][c]);
            }
        }
    } else {
        for (int64_t b = 0; b < k / 32; b++) {
            __m512 lo[4], hi[4], sc[4];
            for (int i = 0; i < R; i++) {
                const char * blk = w0 + i * nb1 + b * 34;           /* block_q8_0: float16 d, int8 qs[32] */
                uint16_t d16;
                memcpy(&d16, blk, 2);
                sc[i] = _mm512_set1_ps(_cvtsh_ss(d16));
                lo[i] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *) (blk + 2))));
                hi[i] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *) (blk + 18))));
            }
            for (int c = 0; c < m; c++) {
                const __m512 x0 = _mm512_loadu_ps(x[c] + 32 * b), x1 = _mm512_loadu_ps(x[c] + 32 * b + 16);
                for (int i = 0; i < R; i++) {
                    const __m512 t = _mm512_fmadd_ps(hi[i], x1, _mm512_mul_ps(lo[i], x0));
                    acc[i][c] = _mm512_fmadd_ps(t, sc[i], acc[i][c]);
                }
            }
        }
    }
    for (int i = 0; i < R; i++) for (int c = 0; c < m; c++) y[c][r + i] = _mm512_reduce_add_ps(acc[i][c]);
}

GGMLPY_GEMV_AVX512 static inline __attribute__((always_inline)) void
ggmlpy_gemv_rows_avx512(const char * w, size_t nb1, const float * const * x, int m, int64_t k, int64_t r0, int64_t r1,
                        int q8, float * const * y) {
    const int64_t pfd = ggmlpy_gemv_pfd;
    int64_t r = r0;
    for (; r + 4 <= r1; r += 4) {
        if (pfd) {
            /* the rows pfd bytes past these four: one line per 64 bytes of the four rows */
            const char * p = w + r * nb1 + pfd;
            for (int64_t o = 0; o < 4 * (int64_t) nb1; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
        }
        ggmlpy_gemv_group_avx512(w, nb1, x, m, k, r, 4, q8, y);
    }
    for (; r < r1; r++) ggmlpy_gemv_group_avx512(w, nb1, x, m, k, r, 1, q8, y);
}

GGMLPY_GEMV_AVX512 static void ggmlpy_gemv_avx512(const char * w, size_t nb1, const float * const * x, int m, int64_t k,
                                                  int64_t r0, int64_t r1, int q8, float * const * y) {
    switch (m * 2 + q8) {
        case 2: ggmlpy_gemv_rows_avx512(w, nb1, x, 1, k, r0, r1, 0, y); break;
        case 3: ggmlpy_gemv_rows_avx512(w, nb1, x, 1, k, r0, r1, 1, y); break;
        case 4: ggmlpy_gemv_rows_avx512(w, nb1, x, 2, k, r0, r1, 0, y); break;
        case 5: ggmlpy_gemv_rows_avx512(w, nb1, x, 2, k, r0, r1, 1, y); break;
        case 6: ggmlpy_gemv_rows_avx512(w, nb1, x, 3, k, r0, r1, 0, y); break;
        case 7: ggmlpy_gemv_rows_avx512(w, nb1, x, 3, k, r0, r1, 1, y); break;
        case 8: ggmlpy_gemv_rows_avx512(w, nb1, x, 4, k, r0, r1, 0, y); break;
        default: ggmlpy_gemv_rows_avx512(w, nb1, x, 4, k, r0, r1, 1, y); break;
    }
}
#endif

static void ggmlpy_gemv_ref(const char * w, size_t nb1, const float * const * x, int m, int64_t k, int64_t r0,
                            int64_t r1, int q8, float * const * y) {
    for (int64_t r = r0; r < r1; r++) {
        const char * wr = w + r * nb1;
        for (int c = 0; c < m; c++) {
            float acc = 0.0f;
            if (!q8) {
                for (int64_t d = 0; d < k; d++) acc += ggmlpy_attn_h2f(((const ggml_fp16_t *) wr)[d]) * x[c][d];
            } else {
                for (int64_t b = 0; b < k / 32; b++) {
                    const char * blk = wr + b * 34;
                    ggml_fp16_t d16;
                    memcpy(&d16, blk, 2);
                    float t = 0.0f;
                    for (int j = 0; j < 32; j++) t += (float) ((const int8_t *) (blk + 2))[j] * x[c][32 * b + j];
                    acc += t * ggmlpy_attn_h2f(d16);
                }
            }
            y[c][r] = acc;
        }
    }
}

static inline int ggmlpy_gemv_vectorized(int64_t k) {
#if GGMLPY_ATTN_X86
    static int has = -1;
    if (has < 0) {
        __builtin_cpu_init();
        has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
    }
    return has && ggmlpy_gemv_allow_vector && k % 16 == 0;
#else
    (void) k;
    return 0;
#endif
}

/* Any other type: ggml's own dot kernel (the one its mul_mat uses, on the vectors converted to the
   kernel's type as mul_mat converts them), row by row over the thread's run of rows, prefetched. */
static void ggmlpy_gemv_traits(const struct ggml_tensor * w, const float * const * x, int m, int64_t r0, int64_t r1,
                               float * const * y) {
    const struct ggml_type_traits_cpu * tt = ggml_get_type_traits_cpu(w->type);
    const enum ggml_type vt = tt->vec_dot_type;
    const int64_t k = w->ne[0];
    const size_t xrow = ggml_row_size(vt, k), nb1 = w->nb[1];
    char xq[GGMLPY_GEMV_SCRATCH] __attribute__((aligned(64)));
    for (int c = 0; c < m; c++) {          /* each thread converts its own copy: no barrier needed */
        if (vt == GGML_TYPE_F32) memcpy(xq + c * xrow, x[c], xrow);
        else ggml_get_type_traits_cpu(vt)->from_float(x[c], xq + c * xrow, k);
    }
    const int64_t pfd = ggmlpy_gemv_pfd;
    for (int64_t r = r0; r < r1; r++) {
        const char * wr = (const char *) w->data + r * nb1;
        if (pfd) {
            for (size_t o = 0; o < nb1; o += 64) __builtin_prefetch(wr + pfd + o);
        }
        for (int c = 0; c < m; c++) tt->vec_dot((int) k, &y[c][r], 0, wr, 0, xq + c * xrow, 0, 1);
    }
}

/* src[0] w (k, n) rows contiguous, not repacked; src[1] x F32 (k, m) rows contiguous, m <= MAX_COLS;
   dst F32 (n, m). Thread ith takes rows [n * ith / nth, n * (ith + 1) / nth), aligned to 4. */
static void ggmlpy_gemv_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) userdata;
    const struct ggml_tensor * w = dst->src[0], * x = dst->src[1];
    const int64_t k = w->ne[0], n = w->ne[1], m = x->ne[1];
    const int q8 = w->type == GGML_TYPE_Q8_0;
    int64_t r0 = (n * ith / nth) & ~(int64_t) 3, r1 = ith == nth - 1 ? n : (n * (ith + 1) / nth) & ~(int64_t) 3;
    const float * xs[GGMLPY_GEMV_MAX_COLS];
    float * ys[GGMLPY_GEMV_MAX_COLS];
    for (int64_t c = 0; c < m; c++) {
        xs[c] = (const float *) ((const char *) x->data + c * x->nb[1]);
        ys[c] = (float *) ((char *) dst->data + c * dst->nb[1]);
    }
    if (w->type != GGML_TYPE_F16 && !q8) {
        ggmlpy_gemv_traits(w, xs, (int) m, r0, r1, ys);
        return;
    }
#if GGMLPY_ATTN_X86
    if (ggmlpy_gemv_vectorized(k)) {
        ggmlpy_gemv_avx512((const char *) w->data, w->nb[1], xs, (int) m, k, r0, r1, q8, ys);
        return;
    }
#endif
    ggmlpy_gemv_ref((const char *) w->data, w->nb[1], xs, (int) m, k, r0, r1, q8, ys);
}

/* Bytes the vectors take in ggml's dot type for w's type (what ggmlpy_gemv_traits converts them
   to), or 0 where this op does not convert them (F16, Q8_0). */
static size_t ggmlpy_gemv_scratch(enum ggml_type type, int64_t k, int64_t m) {
    if (type == GGML_TYPE_F16 || type == GGML_TYPE_Q8_0) return 0;
    const struct ggml_type_traits_cpu * tt = ggml_get_type_traits_cpu(type);
    if (tt == NULL || tt->vec_dot == NULL) return (size_t) -1;
    if (tt->vec_dot_type != GGML_TYPE_F32 && ggml_get_type_traits_cpu(tt->vec_dot_type)->from_float == NULL) {
        return (size_t) -1;
    }
    return ggml_row_size(tt->vec_dot_type, k) * (size_t) m;
}

static struct ggml_tensor * ggmlpy_mul_mat_vec(struct ggml_context * ctx, struct ggml_tensor * w,
                                               struct ggml_tensor * x) {
    struct ggml_tensor * args[2] = {w, x};
    return ggml_custom_4d(ctx, GGML_TYPE_F32, w->ne[1], x->ne[1], 1, 1, args, 2, ggmlpy_gemv_op, GGML_N_TASKS_MAX, NULL);
}
