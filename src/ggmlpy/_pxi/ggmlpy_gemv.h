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

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define GGMLPY_GEMV_X86 1
#define GGMLPY_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#else
#define GGMLPY_GEMV_X86 0
#endif

/* 1 where the CPU runs ggmlpy's VNNI kernels (AVX-512 F/BW/VL with VNNI) and the portable path is
   not forced (ggmlpy_kernels_portable: Q8_0 rows then go to ggml's vec_dot, and repacked Q4_0
   weights, which have no portable kernel of ours, are refused as on a CPU without VNNI) */
static int ggmlpy_gemv_vnni(void) {
#if GGMLPY_GEMV_X86
    static int has = -1;
    if (has < 0) {
        __builtin_cpu_init();
        has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
              && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    }
    return has && !ggmlpy_kernels_portable;
#else
    return 0;
#endif
}

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

/* ---- Q8_0 rows: two at a time in 512-bit VNNI registers ---------------------------------------
   ggml's Q8_0 dot (one row, 256-bit) computes slower than one core reads (bench/matvec.py, one
   thread: 28 GB/s of 55), so on one thread the schedule alone gains little. This kernel does two
   rows per 512-bit register with ggml's own arithmetic: per block of 32 columns, 8 int32 lanes of
   four products each (here the weights biased to unsigned, XOR 0x80, for vpdpbusd, and 128 times
   the vector's four bytes per lane subtracted after), times d_w * d_y into 8 float lanes, summed at
   the end as ggml's hsum_float_8 does: ggml's values exactly. */

/* Process-wide: 0 keeps Q8_0 weights on ggml's vec_dot (for tests and benchmarks). */
static int ggmlpy_q8_allow = 1;

/* Bytes ahead of the row pair being read that this kernel prefetches (0: none). bench/matvec.py,
   110M Q8_0 matrices, 1 / 2 threads against ggml's mul_mat: none 0.41x / 0.68x (the two rows'
   streams alone defeat the hardware prefetchers), 4 KiB 1.12x / 1.41x, 8 KiB 1.26x / 1.42x,
   16 KiB 1.24x / 1.35x. */
static int64_t ggmlpy_q8_pfd = 8192;

#define GGMLPY_Q8_0_BYTES 34            /* a Q8_0 block: float16 scale, 32 int8 */

#if GGMLPY_GEMV_X86
/* ggml's hsum_float_8 */
GGMLPY_VNNI static inline float ggmlpy_hsum8(__m256 x) {
    __m128 r = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

/* Rows [r0, r1) of the Q8_0 weight w (rows nb1 bytes apart, k columns) against m Q8_0 vectors xq
   (xrow bytes apart; corr[(c * nb + b) * 8 + j] = 128 * the sum of vector c's bytes 4j..4j+3 in
   block b, dy[c * nb + b] its block scale) into dst's columns (dnb1 bytes apart). */
GGMLPY_VNNI static void ggmlpy_q8_rows(const char * w, size_t nb1, int64_t k, int64_t r0, int64_t r1, const char * xq,
                                       size_t xrow, const int32_t * corr, const float * dy, int m, char * dst,
                                       size_t dnb1) {
    const int64_t nb = k / 32, pfd = ggmlpy_q8_pfd;
    const __m512i bias = _mm512_set1_epi8((char) 0x80);
    for (int64_t r = r0; r < r1; r += 2) {
        const int two = r + 1 < r1;                     /* a lone last row is read twice, stored once */
        const char * wa = w + r * nb1, * wb = two ? wa + nb1 : wa;
        if (pfd) {
            for (size_t o = 0; o < (two ? 2 : 1) * nb1; o += 64) __builtin_prefetch(wa + pfd + o);
        }
        __m512 acc[GGMLPY_GEMV_MAX_COLS];
        for (int c = 0; c < m; c++) acc[c] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const char * ba = wa + b * GGMLPY_Q8_0_BYTES, * bb = wb + b * GGMLPY_Q8_0_BYTES;
            const __m512i q = _mm512_xor_si512(_mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *) (ba + 2))),
                _mm256_loadu_si256((const __m256i *) (bb + 2)), 1), bias);
            uint16_t ha, hb;
            memcpy(&ha, ba, 2);
            memcpy(&hb, bb, 2);
            const float da = _cvtsh_ss(ha), db = _cvtsh_ss(hb);
            for (int c = 0; c < m; c++) {
                const int64_t cb = c * nb + b;
                const __m512i y = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *) (xq + c * xrow + b * GGMLPY_Q8_0_BYTES + 2)));
                const __m512i s = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), q, y),
                                                   _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *) (corr + cb * 8))));
                const __m512 d = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_set1_ps(da * dy[cb])),
                                                                     _mm256_castps_pd(_mm256_set1_ps(db * dy[cb])), 1));
                acc[c] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(s), acc[c]);
            }
        }
        for (int c = 0; c < m; c++) {
            float * y = (float *) (dst + c * dnb1);
            y[r] = ggmlpy_hsum8(_mm512_castps512_ps256(acc[c]));
            if (two) y[r + 1] = ggmlpy_hsum8(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[c]), 1)));
        }
    }
}

/* ggmlpy_q8_rows for the vectors xq (m of k, Q8_0): their corrections and scales first */
static void ggmlpy_q8_run(const struct ggml_tensor * w, int64_t r0, int64_t r1, const char * xq, size_t xrow, int m,
                          struct ggml_tensor * dst) {
    const int64_t nb = w->ne[0] / 32;
    int32_t corr[GGMLPY_GEMV_SCRATCH / GGMLPY_Q8_0_BYTES * 8 + 8] __attribute__((aligned(64)));
    float dy[GGMLPY_GEMV_SCRATCH / GGMLPY_Q8_0_BYTES + 1];
    for (int c = 0; c < m; c++) {
        for (int64_t b = 0; b < nb; b++) {
            const char * blk = xq + c * xrow + b * GGMLPY_Q8_0_BYTES;
            const int8_t * qs = (const int8_t *) (blk + 2);
            uint16_t h;
            memcpy(&h, blk, 2);
            dy[c * nb + b] = ggml_fp16_to_fp32(h);
            for (int j = 0; j < 8; j++) corr[(c * nb + b) * 8 + j] = 128 * (qs[4 * j] + qs[4 * j + 1] + qs[4 * j + 2] + qs[4 * j + 3]);
        }
    }
    ggmlpy_q8_rows((const char *) w->data, w->nb[1], w->ne[0], r0, r1, xq, xrow, corr, dy, m, (char *) dst->data,
                   dst->nb[1]);
}
#endif

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
#if GGMLPY_GEMV_X86
    if (w->type == GGML_TYPE_Q8_0 && ggmlpy_q8_allow && ggmlpy_gemv_vnni()) {
        ggmlpy_q8_run(w, r0, r1, xq, xrow, (int) m, dst);
        return;
    }
#endif
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


/* ---- Q4_0 weights in ggml's CPU_REPACK buffer -------------------------------------------------
   On an x86 CPU with AVX2 ggml stores Q4_0 weights whose row count is a multiple of 8 rearranged:
   each group of 8 rows and 32 columns is one 144-byte block, the 8 rows' float16 scales, then 16
   chunks of 8 bytes: chunk i holds bytes (i / 8) * 8 .. + 8 of row i % 8's 16 nibble bytes (low
   nibbles columns 0-15, high ones 16-31), XOR 0x88 (the nibbles become signed). ggml's one-vector
   kernel for them is 256-bit AVX2 and computes more than it reads: measured 26 GB/s on a Zen 5 core
   that streams 55 GB/s, so its speed is its arithmetic's. This one does a block's 8 rows in 512-bit
   registers with VNNI: the nibbles back to unsigned (XOR 8), four vpdpbusd against the vector's
   bytes (which makes each row's dot 8 * sum(y) too large, subtracted after), and the block's sum
   folded into the float accumulator as ggml does it (acc += float(dot) * (d_row * d_y), in block
   order), so the values are ggml's exactly. Only for up to 3 vectors: from 4 on, ggml's mul_mat
   quantizes the vectors in another layout (its 4-row GEMM) and its values would differ.

   The CPU backend refuses custom ops on tensors in its repack buffer (supports_op), so the weight is
   not one of the op's sources: the op gets it as its userdata and reads its bytes at compute time
   (the weights do not change while graphs run, and ggmlpy keeps the Tensor alive with the result). */

#define GGMLPY_RQ4_MAX_COLS 3
#define GGMLPY_RQ4_BLOCK 144            /* bytes of 8 rows x 32 columns */


/* Process-wide: 0 keeps repacked weights on ggml's mul_mat (for tests and benchmarks). */
static int ggmlpy_rq4_allow = 1;

/* Bytes ahead of the block being read that this kernel prefetches (0: none). It reads faster than
   the dot kernels above, so it wants the lines further ahead: 110M Q4_0 model, tokens per second on
   1 / 2 threads: none 478 / 735, 4 KiB 569 / 845, 16 KiB 715 / 851, 32-48 KiB no further gain. */
static int64_t ggmlpy_rq4_pfd = 16384;


/* 1 where w is a whole Q4_0 weight (a matrix, or a stack of experts' matrices) ggml repacked into
   the layout above (CPU_REPACK, 8-row groups: the only Q4_0 layout ggml has for an x86 CPU with
   AVX2) and this CPU runs the kernel */
static int ggmlpy_gemv_repacked_q4_0(const struct ggml_tensor * w) {
    if (!ggmlpy_rq4_allow || w->type != GGML_TYPE_Q4_0 || w->view_src != NULL || w->buffer == NULL
        || w->extra == NULL || w->ne[1] % 8 != 0 || w->ne[3] != 1 || !ggmlpy_gemv_vnni()) {
        return 0;
    }
    return strcmp(ggml_backend_buft_name(ggml_backend_buffer_get_type(w->buffer)), "CPU_REPACK") == 0
           && ggml_cpu_has_avx2();
}

#if GGMLPY_GEMV_X86
/* Row groups [g0, g1) of the repacked weight w (nb blocks of 32 columns per group) against m Q8_0
   vectors xq (xrow bytes apart; ys8[c * nb + b] = 8 * the sum of vector c's bytes in block b), into
   dst's columns (dnb1 bytes apart). */
GGMLPY_VNNI static void ggmlpy_rq4_rows(const char * w, int64_t nb, int64_t g0, int64_t g1, const char * xq,
                                        size_t xrow, const int32_t * ys8, int m, char * dst, size_t dnb1) {
    const __m512i low = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(0x08);
    const int64_t pfd = ggmlpy_rq4_pfd;
    for (int64_t gi = g0; gi < g1; gi++) {
        const char * p = w + gi * nb * GGMLPY_RQ4_BLOCK;
        __m256 acc[GGMLPY_RQ4_MAX_COLS];
        for (int c = 0; c < m; c++) acc[c] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++, p += GGMLPY_RQ4_BLOCK) {
            if (pfd) {
                _mm_prefetch(p + pfd, _MM_HINT_T0);
                _mm_prefetch(p + pfd + 64, _MM_HINT_T0);
                _mm_prefetch(p + pfd + 128, _MM_HINT_T0);
            }
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) p));
            const __m512i q0 = _mm512_loadu_si512(p + 16), q1 = _mm512_loadu_si512(p + 80);
            /* (x & 0x0F) ^ 0x08: a nibble as ggml stored it, back to its unsigned value */
            const __m512i l0 = _mm512_ternarylogic_epi32(q0, low, eight, 0x6A);
            const __m512i h0 = _mm512_ternarylogic_epi32(_mm512_srli_epi16(q0, 4), low, eight, 0x6A);
            const __m512i l1 = _mm512_ternarylogic_epi32(q1, low, eight, 0x6A);
            const __m512i h1 = _mm512_ternarylogic_epi32(_mm512_srli_epi16(q1, 4), low, eight, 0x6A);
            for (int c = 0; c < m; c++) {
                const char * y = xq + c * xrow + b * GGMLPY_Q8_0_BYTES;
                int64_t y0, y8, y16, y24;
                uint16_t yd;
                memcpy(&yd, y, 2);
                memcpy(&y0, y + 2, 8); memcpy(&y8, y + 10, 8); memcpy(&y16, y + 18, 8); memcpy(&y24, y + 26, 8);
                /* lanes 2r, 2r + 1: row r's columns 0-3 and 4-7 of each chunk */
                __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), l0, _mm512_set1_epi64(y0));
                s = _mm512_dpbusd_epi32(s, h0, _mm512_set1_epi64(y16));
                s = _mm512_dpbusd_epi32(s, l1, _mm512_set1_epi64(y8));
                s = _mm512_dpbusd_epi32(s, h1, _mm512_set1_epi64(y24));
                s = _mm512_add_epi32(s, _mm512_srli_epi64(s, 32));
                const __m256i dot = _mm256_sub_epi32(_mm512_cvtepi64_epi32(s), _mm256_set1_epi32(ys8[c * nb + b]));
                acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dw, _mm256_set1_ps(_cvtsh_ss(yd))), acc[c]);
            }
        }
        for (int c = 0; c < m; c++) _mm256_storeu_ps((float *) (dst + c * dnb1) + gi * 8, acc[c]);
    }
}
#endif

/* One float32 vector of k into Q8_0 at q, as ggml's mul_mat quantizes it (quantize_row_q8_0), and
   ys8[b] = 8 * the sum of its bytes in block b (the kernel's correction for unsigned nibbles). */
#if GGMLPY_GEMV_X86
static void ggmlpy_rq4_vector(const float * x, int64_t k, char * q, int32_t * ys8) {
    ggml_get_type_traits_cpu(GGML_TYPE_Q8_0)->from_float(x, q, k);
    for (int64_t b = 0; b < k / 32; b++) {
        const int8_t * qs = (const int8_t *) (q + b * GGMLPY_Q8_0_BYTES + 2);
        int32_t sum = 0;
        for (int j = 0; j < 32; j++) sum += qs[j];
        ys8[b] = 8 * sum;
    }
}
#endif

/* src[0] x F32 (k, m) rows contiguous, m <= RQ4_MAX_COLS; userdata the repacked Q4_0 weight w (k,
   n); dst F32 (n, m). Thread ith takes the row groups [G * ith / nth, G * (ith + 1) / nth) of G =
   n / 8 and quantizes its own copy of the vectors, as ggml's mul_mat does (quantize_row_q8_0). */
static void ggmlpy_gemv_rq4_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
#if GGMLPY_GEMV_X86
    const struct ggml_tensor * w = (const struct ggml_tensor *) userdata, * x = dst->src[0];
    const int64_t k = w->ne[0], nb = k / 32, groups = w->ne[1] / 8, m = x->ne[1];
    const size_t xrow = ggml_row_size(GGML_TYPE_Q8_0, k);
    char xq[GGMLPY_GEMV_SCRATCH] __attribute__((aligned(64)));
    int32_t ys8[GGMLPY_GEMV_SCRATCH / GGMLPY_Q8_0_BYTES + 1];
    for (int64_t c = 0; c < m; c++) {
        ggmlpy_rq4_vector((const float *) ((const char *) x->data + c * x->nb[1]), k, xq + c * xrow, ys8 + c * nb);
    }
    ggmlpy_rq4_rows((const char *) w->data, nb, groups * ith / nth, groups * (ith + 1) / nth, xq, xrow, ys8, (int) m,
                    (char *) dst->data, dst->nb[1]);
#else
    (void) dst; (void) ith; (void) nth; (void) userdata;
#endif
}

/* The experts' version (Context.mul_mat_id_vec on a repacked Q4_0 expert stack): src[0] x F32 (k,
   xb, n) rows contiguous, xb 1 or n_used, n <= MAX_COLS; src[1] ids I32 (n_used, n), each token's
   ids contiguous; userdata w (k, rows, n_expert), each expert's matrix repacked on its own; dst F32
   (rows, n_used, n). The (token, slot, group of 8 rows) units are cut into one contiguous run per
   thread. ggml's repacked mul_mat_id runs its one-vector kernel for every (token, slot) whatever
   the count, on vectors quantized as here: the same values for any n. An id outside [0, n_expert)
   gives NaN rows. */
static void ggmlpy_gemv_rq4_id_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
#if GGMLPY_GEMV_X86
    const struct ggml_tensor * w = (const struct ggml_tensor *) userdata, * x = dst->src[0], * ids = dst->src[1];
    const int64_t k = w->ne[0], nb = k / 32, groups = w->ne[1] / 8, n_expert = w->ne[2];
    const int64_t xb = x->ne[1], n = x->ne[2], n_used = ids->ne[0];
    const int64_t per_token = n_used * groups, units = n * per_token;
    const int64_t u1 = units * (ith + 1) / nth;
    const size_t xrow = ggml_row_size(GGML_TYPE_Q8_0, k);
    char xq[GGMLPY_GEMV_SCRATCH] __attribute__((aligned(64)));
    int32_t ys8[GGMLPY_GEMV_SCRATCH / GGMLPY_Q8_0_BYTES + 1];
    for (int64_t v = 0; v < n * xb; v++) {
        ggmlpy_rq4_vector((const float *) ((const char *) x->data + (v % xb) * x->nb[1] + (v / xb) * x->nb[2]), k,
                          xq + v * xrow, ys8 + v * nb);
    }
    for (int64_t u = units * ith / nth; u < u1;) {
        const int64_t t = u / per_token, s = (u % per_token) / groups, g0 = u % groups;
        const int64_t g1 = groups - g0 < u1 - u ? groups : g0 + (u1 - u);
        const int32_t e = *(const int32_t *) ((const char *) ids->data + s * ids->nb[0] + t * ids->nb[1]);
        char * y = (char *) dst->data + s * dst->nb[1] + t * dst->nb[2];
        const int64_t v = t * xb + s % xb;
        if (e < 0 || e >= n_expert) {
            for (int64_t r = g0 * 8; r < g1 * 8; r++) ((float *) y)[r] = NAN;
        } else {
            ggmlpy_rq4_rows((const char *) w->data + e * w->nb[2], nb, g0, g1, xq + v * xrow, xrow, ys8 + v * nb, 1, y, 0);
        }
        u += g1 - g0;
    }
#else
    (void) dst; (void) ith; (void) nth; (void) userdata;
#endif
}

static struct ggml_tensor * ggmlpy_mul_mat_id_vec_rq4(struct ggml_context * ctx, struct ggml_tensor * w,
                                                      struct ggml_tensor * x, struct ggml_tensor * ids) {
    struct ggml_tensor * args[2] = {x, ids};
    return ggml_custom_4d(ctx, GGML_TYPE_F32, w->ne[1], ids->ne[0], x->ne[2], 1, args, 2, ggmlpy_gemv_rq4_id_op,
                          GGML_N_TASKS_MAX, w);
}

static struct ggml_tensor * ggmlpy_mul_mat_vec_rq4(struct ggml_context * ctx, struct ggml_tensor * w,
                                                   struct ggml_tensor * x) {
    struct ggml_tensor * args[1] = {x};
    return ggml_custom_4d(ctx, GGML_TYPE_F32, w->ne[1], x->ne[1], 1, 1, args, 1, ggmlpy_gemv_rq4_op, GGML_N_TASKS_MAX,
                          w);
}
