/* A matrix times a few float32 vectors, as a ggml custom op (Context.mul_mat_vec): the generation
   step's products, with ggml's own dot kernels under a schedule of ggmlpy's.

   Why: a generated token reads every weight once, and ggml's CPU mul_mat spends that time in its
   dot kernels waiting on memory (perf, 110M F16 model: 84% of a token in ggml_vec_dot_f16, the
   stalls on its loads). Its threads take small chunks of rows from a shared counter, so each
   thread's reads jump around and the hardware prefetchers restart at every chunk. Here each thread
   reads one contiguous run of rows, and asks for the lines a fixed distance ahead of the row it is
   on, so the memory system always has the next ones in flight. The products are ggml's: the
   vectors converted to the kernel's type as mul_mat converts them (float16 for F16 weights, Q8_0
   for Q8_0 and Q4_0, Q8_K for the K-quants), each row's dot by the type's vec_dot: mul_mat's values.

   Measured (bench: 110M model's 49 matrices, 2 threads, caches flushed): F16 1.12-1.15x ggml's
   mul_mat, Q8_0 1.31x, Q6_K 1.47x; one thread 1.02-1.16x. Also tried: ggmlpy's own AVX-512 F16 and
   Q8_0 dots on float32 vectors, four rows at a time. As fast for F16, slower for Q8_0 on one thread
   (converting int8 weights to float costs more than ggml's integer dot), and with other values than
   mul_mat's; dropped. */
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "ggml.h"
#include "ggml-backend.h"
#include "ggmlpy_cpu.h"

#define GGMLPY_GEMV_MAX_COLS 4          /* vectors per call: a batch of up to 4 tokens */
#define GGMLPY_GEMV_SCRATCH 65536       /* bytes of a thread's copy of the vectors in the dot type */

/* Bytes ahead of the row being read that the kernel prefetches (0: none); process-wide, for
   benchmarks. 1-8 KiB measured alike here; none was slower than ggml (0.94x), 32 KiB no gain. */
static int64_t ggmlpy_gemv_pfd = 4096;

/* 1 where w's bytes are plain rows this op can read: in its context's memory or a host buffer (not
   a device's, nor one of the CPU's repacked buffers, which ggml rearranges for its own kernels and
   whose tensors the CPU backend runs only in the ops those kernels implement). */
static int ggmlpy_gemv_readable(const struct ggml_tensor * w) {
    const struct ggml_backend_buffer * b = w->buffer ? w->buffer : (w->view_src ? w->view_src->buffer : NULL);
    return b == NULL || ggml_backend_buffer_is_host((ggml_backend_buffer_t) b);
}

/* Bytes m vectors of k take in the dot type of w's type, or (size_t) -1 where the type has no CPU
   dot kernel (or no conversion into its dot type). */
static size_t ggmlpy_gemv_scratch(enum ggml_type type, int64_t k, int64_t m) {
    const struct ggml_type_traits_cpu * tt = ggml_get_type_traits_cpu(type);
    if (tt == NULL || tt->vec_dot == NULL) return (size_t) -1;
    if (tt->vec_dot_type != GGML_TYPE_F32 && ggml_get_type_traits_cpu(tt->vec_dot_type)->from_float == NULL) {
        return (size_t) -1;
    }
    return ggml_row_size(tt->vec_dot_type, k) * (size_t) m;
}

/* One float32 vector of k into the dot type vt, as mul_mat converts it. */
static inline void ggmlpy_gemv_convert(enum ggml_type vt, const float * x, char * q, int64_t k, size_t row) {
    if (vt == GGML_TYPE_F32) memcpy(q, x, row);
    else ggml_get_type_traits_cpu(vt)->from_float(x, q, k);
}

/* The lines pfd bytes past the row asked for, span bytes of them (a hint: never faults; 0 for a
   later column of the same row), then the row's dot with the converted vector q by the type's
   kernel. */
static inline void ggmlpy_gemv_dot(const struct ggml_type_traits_cpu * tt, const char * wr, size_t span, int64_t k,
                                   const char * q, float * y) {
    const int64_t pfd = ggmlpy_gemv_pfd;
    if (pfd) {
        for (size_t o = 0; o < span; o += 64) __builtin_prefetch(wr + pfd + o);
    }
    tt->vec_dot((int) k, y, 0, wr, 0, q, 0, 1);
}

/* src[0] w (k, n) rows contiguous, readable (ggmlpy_gemv_readable); src[1] x F32 (k, m) rows
   contiguous, m <= MAX_COLS; dst F32 (n, m). Thread ith takes rows [n * ith / nth, n * (ith + 1) /
   nth) and converts its own copy of the vectors (no barrier needed; k values, against the n * k
   weights it reads). */
static void ggmlpy_gemv_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) userdata;
    const struct ggml_tensor * w = dst->src[0], * x = dst->src[1];
    const int64_t k = w->ne[0], n = w->ne[1], m = x->ne[1];
    const int64_t r0 = n * ith / nth, r1 = n * (ith + 1) / nth;
    const struct ggml_type_traits_cpu * tt = ggml_get_type_traits_cpu(w->type);
    const enum ggml_type vt = tt->vec_dot_type;
    const size_t xrow = ggml_row_size(vt, k), nb1 = w->nb[1];
    char xq[GGMLPY_GEMV_SCRATCH] __attribute__((aligned(64)));
    for (int64_t c = 0; c < m; c++) {
        ggmlpy_gemv_convert(vt, (const float *) ((const char *) x->data + c * x->nb[1]), xq + c * xrow, k, xrow);
    }
    for (int64_t r = r0; r < r1; r++) {
        const char * wr = (const char *) w->data + r * nb1;
        for (int64_t c = 0; c < m; c++) {
            ggmlpy_gemv_dot(tt, wr, c == 0 ? nb1 : 0, k, xq + c * xrow, (float *) ((char *) dst->data + c * dst->nb[1]) + r);
        }
    }
}

/* The experts' version (Context.mul_mat_id_vec), a token's chosen experts as mul_mat_id computes
   them: src[0] w (k, rows, n_expert) rows contiguous, readable; src[1] x F32 (k, xb, n) rows
   contiguous, xb 1 (every slot reads the token's one vector) or n_used (a vector per slot), n <=
   MAX_COLS; src[2] ids I32 (n_used, n), each token's ids contiguous (top_k's view); dst F32 (rows,
   n_used, n). The (token, slot, row) units are cut into one contiguous run per thread, so a thread
   streams through the rows of the experts it has. An id outside [0, n_expert) gives NaN rows
   (mul_mat_id would abort the process). */
static void ggmlpy_gemv_id_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) userdata;
    const struct ggml_tensor * w = dst->src[0], * x = dst->src[1], * ids = dst->src[2];
    const int64_t k = w->ne[0], rows = w->ne[1], n_expert = w->ne[2], xb = x->ne[1], n = x->ne[2];
    const int64_t n_used = ids->ne[0], per_token = n_used * rows, units = n * per_token;
    const int64_t u0 = units * ith / nth, u1 = units * (ith + 1) / nth;
    const struct ggml_type_traits_cpu * tt = ggml_get_type_traits_cpu(w->type);
    const enum ggml_type vt = tt->vec_dot_type;
    const size_t xrow = ggml_row_size(vt, k), nb1 = w->nb[1];
    char xq[GGMLPY_GEMV_SCRATCH] __attribute__((aligned(64)));
    for (int64_t t = 0; t < n; t++) {
        for (int64_t b = 0; b < xb; b++) {
            ggmlpy_gemv_convert(vt, (const float *) ((const char *) x->data + b * x->nb[1] + t * x->nb[2]),
                                xq + (t * xb + b) * xrow, k, xrow);
        }
    }
    for (int64_t u = u0; u < u1; u++) {
        const int64_t t = u / per_token, s = (u % per_token) / rows, r = u % rows;
        const int32_t e = *(const int32_t *) ((const char *) ids->data + s * ids->nb[0] + t * ids->nb[1]);
        float * y = (float *) ((char *) dst->data + s * dst->nb[1] + t * dst->nb[2]) + r;
        if (e < 0 || e >= n_expert) {
            *y = NAN;
            continue;
        }
        ggmlpy_gemv_dot(tt, (const char *) w->data + e * w->nb[2] + r * nb1, nb1, k, xq + (t * xb + s % xb) * xrow, y);
    }
}

static struct ggml_tensor * ggmlpy_mul_mat_id_vec(struct ggml_context * ctx, struct ggml_tensor * w,
                                                  struct ggml_tensor * x, struct ggml_tensor * ids) {
    struct ggml_tensor * args[3] = {w, x, ids};
    return ggml_custom_4d(ctx, GGML_TYPE_F32, w->ne[1], ids->ne[0], x->ne[2], 1, args, 3, ggmlpy_gemv_id_op,
                          GGML_N_TASKS_MAX, NULL);
}

static struct ggml_tensor * ggmlpy_mul_mat_vec(struct ggml_context * ctx, struct ggml_tensor * w,
                                               struct ggml_tensor * x) {
    struct ggml_tensor * args[2] = {w, x};
    return ggml_custom_4d(ctx, GGML_TYPE_F32, w->ne[1], x->ne[1], 1, 1, args, 2, ggmlpy_gemv_op, GGML_N_TASKS_MAX, NULL);
}
