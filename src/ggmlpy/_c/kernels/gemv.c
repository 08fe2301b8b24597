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
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "ggml.h"
#include "ggml-backend.h"
#include "ggmlpy_cpu.h"             /* ggml-cpu.h (a table of it in a portable build) */
#include "simd.h"
#include "kernels.h"

#if GGMLPY_X86
#define GGMLPY_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#endif

/* 1 where the CPU runs ggmlpy's VNNI kernels (AVX-512 F/BW/VL with VNNI) and the portable path is
   not forced (ggmlpy_kernels_portable: Q8_0 rows then go to ggml's vec_dot, and repacked Q4_0
   weights, which have no portable kernel of ours, are refused as on a CPU without VNNI) */
int ggmlpy_gemv_vnni(void) {
    return ggmlpy_cpu_has(GGMLPY_CPU_VNNI512) && !ggmlpy_kernels_portable;
}


/* Bytes ahead of the row being read that the kernel prefetches (0: none); process-wide, for
   benchmarks. 1-8 KiB measured alike here; none was slower than ggml (0.94x), 32 KiB no gain. */
int64_t ggmlpy_gemv_pfd = 4096;

/* The cache level the kernels' prefetches fill: 0 L1 (T0), 1 L2 (T1); process-wide, for benchmarks. */
int ggmlpy_gemv_pf_level = 0;

static inline void ggmlpy_pf(const char * p) {
    if (ggmlpy_gemv_pf_level) __builtin_prefetch(p, 0, 2);
    else __builtin_prefetch(p, 0, 3);
}

/* 1 where w's bytes are plain rows this op can read: in its context's memory or a host buffer (not
   a device's, nor one of the CPU's repacked buffers, which ggml rearranges for its own kernels and
   whose tensors the CPU backend runs only in the ops those kernels implement). */
int ggmlpy_gemv_readable(const struct ggml_tensor * w) {
    const struct ggml_backend_buffer * b = w->buffer ? w->buffer : (w->view_src ? w->view_src->buffer : NULL);
    return b == NULL || ggml_backend_buffer_is_host((ggml_backend_buffer_t) b);
}

/* Bytes m vectors of k take in the dot type of w's type, or (size_t) -1 where the type has no CPU
   dot kernel (or no conversion into its dot type). */
size_t ggmlpy_gemv_scratch(enum ggml_type type, int64_t k, int64_t m) {
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
        for (size_t o = 0; o < span; o += 64) ggmlpy_pf(wr + pfd + o);
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
int ggmlpy_q8_allow = 1;

/* Bytes ahead of the row pair being read that this kernel prefetches (0: none). bench/matvec.py,
   110M Q8_0 matrices, 1 / 2 threads against ggml's mul_mat: none 0.41x / 0.68x (the two rows'
   streams alone defeat the hardware prefetchers), 4 KiB 1.12x / 1.41x, 8 KiB 1.26x / 1.42x,
   16 KiB 1.24x / 1.35x. */
int64_t ggmlpy_q8_pfd = 8192;

#define GGMLPY_Q8_0_BYTES 34            /* a Q8_0 block: float16 scale, 32 int8 */

#if GGMLPY_X86
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
            for (size_t o = 0; o < (two ? 2 : 1) * nb1; o += 64) ggmlpy_pf(wa + pfd + o);
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

/* ---- Q6_K rows: two at a time in 512-bit VNNI registers ---------------------------------------
   A Q6_K block (210 bytes per 256 columns: 128 bytes of low nibbles ql, 64 of 2-bit highs qh, 16
   int8 scales of 16 columns each, a float16 d) times a Q8_K vector. ggml's dot (AVX2, one row)
   computes slower than memory delivers: it read the Q6_K head of a Llama-3.2-1B-shaped Q4_K_M model
   (128k rows) at 11 GB/s on 2 threads (13 under ggmlpy's schedule), this kernel at 14-15 GB/s. This
   kernel does rows r and r + 1 in the two halves of each register with ggml's
   own arithmetic: per 256 columns, 8 chunks of 32 bytes (the 6-bit values as ggml assembles them,
   unsigned: value + 32), each 32-bit lane L of a chunk the dot of its bytes 4L..4L+3 (vpdpbusd)
   times the scale of its 16 bytes, summed over the chunks, minus 32 x (sums of 16 vector bytes x
   scale) in ggml's lanes; into 8 float lanes as fmadd(d_y * d_w, float(lane), acc), summed at the end
   as hsum_float_8: ggml's values exactly (its int16 products cannot saturate: 63 x 127 x 2). */

#define GGMLPY_Q6K_BYTES 210
#define GGMLPY_Q8K_BYTES 292            /* a Q8_K block: float d, 256 int8, 16 int16 sums */

/* Process-wide: 0 keeps Q6_K weights on ggml's vec_dot under the schedule (tests, benchmarks). */
int ggmlpy_q6k_allow = 1;

/* Bytes ahead of the row pair being read that the Q6_K kernel prefetches (0: none). */
int64_t ggmlpy_q6k_pfd = 8192;

#if GGMLPY_X86
/* 32 bytes of row a and 32 of row b in one register */
GGMLPY_VNNI static inline __m512i ggmlpy_pair(const char * a, const char * b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *) a)),
                              _mm256_loadu_si256((const __m256i *) b), 1);
}

/* Rows [r0, r1) of the Q6_K weight w (rows nb1 bytes apart, k columns) against m Q8_K vectors xq (xrow
   bytes apart) into dst's columns (dnb1 bytes apart). */
GGMLPY_VNNI static void ggmlpy_q6k_rows(const char * w, size_t nb1, int64_t k, int64_t r0, int64_t r1, const char * xq,
                                        size_t xrow, int m, char * dst, size_t dnb1) {
    const int64_t nb = k / 256, pfd = ggmlpy_q6k_pfd;
    const __m512i m3 = _mm512_set1_epi8(3), m12 = _mm512_set1_epi8(12), m15 = _mm512_set1_epi8(15);
    const __m512i m48 = _mm512_set1_epi8(48), mc0 = _mm512_set1_epi8((char) 0xC0);
    /* chunk c's scales for lanes 0-3 and 4-7 of each half: row a's 2c and 2c + 1, then row b's */
    __m512i sidx[8];
    for (int c = 0; c < 8; c++) {
        int32_t idx[16];
        for (int l = 0; l < 16; l++) idx[l] = (l >= 8 ? 16 : 0) + 2 * c + ((l % 8) >= 4);
        sidx[c] = _mm512_loadu_si512(idx);
    }
    for (int64_t r = r0; r < r1; r += 2) {
        const int two = r + 1 < r1;                     /* a lone last row is read twice, stored once */
        const char * wa = w + r * nb1, * wb = two ? wa + nb1 : wa;
        if (pfd) {
            for (size_t o = 0; o < (two ? 2 : 1) * nb1; o += 64) ggmlpy_pf(wa + pfd + o);
        }
        __m512 acc[GGMLPY_GEMV_MAX_COLS];
        for (int c = 0; c < m; c++) acc[c] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const char * ba = wa + b * GGMLPY_Q6K_BYTES, * bb = wb + b * GGMLPY_Q6K_BYTES;
            const __m128i sa = _mm_loadu_si128((const __m128i *) (ba + 192)), sb = _mm_loadu_si128((const __m128i *) (bb + 192));
            const __m512i sa32 = _mm512_cvtepi8_epi32(sa), sb32 = _mm512_cvtepi8_epi32(sb);
            const __m512i sc16 = _mm512_cvtepi8_epi16(_mm256_inserti128_si256(_mm256_castsi128_si256(sa), sb, 1));
            __m512i q6[8], sc[8];
            for (int j = 0; j < 2; j++) {
                const __m512i l1 = ggmlpy_pair(ba + j * 64, bb + j * 64), l2 = ggmlpy_pair(ba + j * 64 + 32, bb + j * 64 + 32);
                const __m512i h = ggmlpy_pair(ba + 128 + j * 32, bb + 128 + j * 32);
                q6[4 * j + 0] = _mm512_or_si512(_mm512_and_si512(l1, m15), _mm512_slli_epi16(_mm512_and_si512(h, m3), 4));
                q6[4 * j + 1] = _mm512_or_si512(_mm512_and_si512(l2, m15), _mm512_slli_epi16(_mm512_and_si512(h, m12), 2));
                q6[4 * j + 2] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l1, 4), m15), _mm512_and_si512(h, m48));
                q6[4 * j + 3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l2, 4), m15),
                                                _mm512_srli_epi16(_mm512_and_si512(h, mc0), 2));
            }
            for (int c = 0; c < 8; c++) sc[c] = _mm512_permutex2var_epi32(sa32, sidx[c], sb32);
            uint16_t ha, hb;
            memcpy(&ha, ba + 208, 2);
            memcpy(&hb, bb + 208, 2);
            const float da = _cvtsh_ss(ha), db = _cvtsh_ss(hb);
            for (int c = 0; c < m; c++) {
                const char * y = xq + c * xrow + b * GGMLPY_Q8K_BYTES;
                float dy;
                memcpy(&dy, y, 4);
                __m512i sumi = _mm512_setzero_si512();
                for (int q = 0; q < 8; q++) {
                    const __m512i yv = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *) (y + 4 + q * 32)));
                    sumi = _mm512_add_epi32(sumi, _mm512_mullo_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), q6[q], yv),
                                                                     sc[q]));
                }
                const __m512i bs = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *) (y + 260)));
                sumi = _mm512_sub_epi32(sumi, _mm512_slli_epi32(_mm512_madd_epi16(bs, sc16), 5));
                const __m512 d = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_set1_ps(dy * da)),
                                                                     _mm256_castps_pd(_mm256_set1_ps(dy * db)), 1));
                acc[c] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(sumi), acc[c]);
            }
        }
        for (int c = 0; c < m; c++) {
            float * y = (float *) (dst + c * dnb1);
            y[r] = ggmlpy_hsum8(_mm512_castps512_ps256(acc[c]));
            if (two) y[r + 1] = ggmlpy_hsum8(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[c]), 1)));
        }
    }
}
#endif

/* src[0] w (k, n) rows contiguous, readable (ggmlpy_gemv_readable); src[1] x F32 (k, m) rows
   contiguous, m <= MAX_COLS; dst F32 (n, m); userdata non-NULL: every row through ggml's vec_dot, not
   the VNNI row kernels (a path of its own, chosen per site by measurement). Thread ith takes rows
   [n * ith / nth, n * (ith + 1) / nth) and converts its own copy of the vectors (no barrier needed;
   k values, against the n * k weights it reads). */
static void ggmlpy_gemv_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    const int own_rows = userdata == NULL;
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
#if GGMLPY_X86
    if (own_rows && w->type == GGML_TYPE_Q8_0 && ggmlpy_q8_allow && ggmlpy_gemv_vnni()) {
        ggmlpy_q8_run(w, r0, r1, xq, xrow, (int) m, dst);
        return;
    }
    if (own_rows && w->type == GGML_TYPE_Q6_K && ggmlpy_q6k_allow && ggmlpy_gemv_vnni() && xrow == (size_t) (k / 256) * GGMLPY_Q8K_BYTES) {
        ggmlpy_q6k_rows((const char *) w->data, nb1, k, r0, r1, xq, xrow, (int) m, (char *) dst->data, dst->nb[1]);
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

struct ggml_tensor * ggmlpy_mul_mat_id_vec(struct ggml_context * ctx, struct ggml_tensor * w,
                                                  struct ggml_tensor * x, struct ggml_tensor * ids) {
    struct ggml_tensor * args[3] = {w, x, ids};
    return ggml_custom_4d(ctx, GGML_TYPE_F32, w->ne[1], ids->ne[0], x->ne[2], 1, args, 3, ggmlpy_gemv_id_op,
                          GGML_N_TASKS_MAX, NULL);
}

struct ggml_tensor * ggmlpy_mul_mat_vec(struct ggml_context * ctx, struct ggml_tensor * w,
                                               struct ggml_tensor * x, int own_rows) {
    struct ggml_tensor * args[2] = {w, x};
    return ggml_custom_4d(ctx, GGML_TYPE_F32, w->ne[1], x->ne[1], 1, 1, args, 2, ggmlpy_gemv_op, GGML_N_TASKS_MAX,
                          own_rows ? NULL : (void *) 1);
}

/* The path of mul_mat_vec's op t: 1 ggmlpy's row kernels where w's type has one, 0 ggml's vec_dot
   (own_rows 0), -1 where t is no such op. Reads the custom op's parameters as ggml_custom_4d stored
   them (ggml-impl.h's struct ggml_custom_op_params, mirrored: that header is ggml's private one). */
int ggmlpy_gemv_path(const struct ggml_tensor * t) {
    struct { ggml_custom_op_t fun; int n_tasks; void * userdata; } p;
    if (t->op != GGML_OP_CUSTOM) return -1;
    memcpy(&p, t->op_params, sizeof p);
    return p.fun != ggmlpy_gemv_op ? -1 : p.userdata == NULL;
}

/* 1 where mul_mat_vec runs w (plain rows) through one of ggmlpy's own row kernels (Q8_0, Q6_K on a CPU
   with AVX-512 VNNI) unless told not to: the sites with two paths to measure */
int ggmlpy_gemv_own_rows(const struct ggml_tensor * w) {
#if GGMLPY_X86
    if (!ggmlpy_gemv_vnni() || ggmlpy_gemv_repacked(w)) return 0;
    return (w->type == GGML_TYPE_Q8_0 && ggmlpy_q8_allow) || (w->type == GGML_TYPE_Q6_K && ggmlpy_q6k_allow);
#else
    (void) w;
    return 0;
#endif
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

#define GGMLPY_RQ4_BLOCK 144            /* bytes of 8 rows x 32 columns */


/* Process-wide: 0 keeps repacked weights on ggml's mul_mat (for tests and benchmarks). */
int ggmlpy_rq4_allow = 1;

/* Bytes ahead of the block being read that this kernel prefetches (0: none). It reads faster than
   the dot kernels above, so it wants the lines further ahead: 110M Q4_0 model, tokens per second on
   1 / 2 threads: none 478 / 735, 4 KiB 569 / 845, 16 KiB 715 / 851, 32-48 KiB no further gain. */
int64_t ggmlpy_rq4_pfd = 16384;


/* ---- Q4_K weights in ggml's CPU_REPACK buffer -------------------------------------------------
   ggml 0.25.3 stores Q4_K weights whose row count is a multiple of 8 (on x86 with AVX2) as
   block_q4_Kx8: per 8 rows and 256 columns 1152 bytes: the 8 rows' float16 d, then their float16
   dmin, 96 bytes of 6-bit scales and mins (12 bytes per 32-column sub-block s, packed as a Q4_K block
   packs its 8, here for the 8 rows), then 1024 nibble bytes: chunk k (0-15) of 64 bytes holds 8 bytes
   per row, whose low nibbles are columns (k / 4) * 64 + (k % 4) * 8 + 0..7 (sub-block 2 (k / 4)) and
   high nibbles the same + 32 (sub-block 2 (k / 4) + 1). The vector is Q8_K (float d, 256 int8, 16
   int16 sums of 16). ggml's one-vector kernel (ggml_gemv_q4_K_8x8_q8_K) is 256-bit AVX2 and computes
   slower than memory delivers; this one does a chunk's 8 rows in 512-bit registers with VNNI
   (nibbles are unsigned, vpdpbusd takes them as they are). Its sums are ggml's integers exactly (no
   int16 saturation in ggml's maddubs path at these sizes), folded into floats as ggml does: per
   256 columns acc += float(I) * (d_row * d_y) and acc_min += float(M) * (dmin_row * d_y), both
   fused multiply-adds, the row's value acc - acc_min: ggml's values exactly. */

#define GGMLPY_RQ4K_BLOCK 1152          /* bytes of 8 rows x 256 columns */

/* Process-wide: 0 keeps repacked Q4_K weights on ggml's mul_mat (for tests and benchmarks). */
int ggmlpy_rq4k_allow = 1;

/* Bytes ahead of the super-block being read that the Q4_K kernel prefetches (0: none). */
int64_t ggmlpy_rq4k_pfd = 16384;

/* 1 where w is a whole Q4_0 or Q4_K weight (a matrix, or a stack of experts' matrices) ggml repacked
   into the layout above (CPU_REPACK, 8-row groups: the only layout ggml has for these types on an x86
   CPU with AVX2) and this CPU runs a kernel for it: Q4_0 and Q4_K with AVX-512 VNNI, Q4_K with AVX2 alone
   (gemm.c's ggmlpy_rq4k_rows_avx2) */
int ggmlpy_gemv_repacked(const struct ggml_tensor * w) {
    if (w->type == GGML_TYPE_Q4_0 ? !ggmlpy_rq4_allow
        : w->type == GGML_TYPE_Q4_K ? !ggmlpy_rq4k_allow || ggml_type_size(GGML_TYPE_Q8_K) != GGMLPY_Q8K_BYTES
        : 1) {
        return 0;
    }
    if (w->view_src != NULL || w->buffer == NULL || w->extra == NULL || w->ne[1] % 8 != 0 || w->ne[3] != 1) {
        return 0;
    }
    if (!ggmlpy_gemv_vnni()             /* Q4_K has gemm.c's AVX2 kernel besides */
        && !(w->type == GGML_TYPE_Q4_K && ggmlpy_cpu_has(GGMLPY_CPU_AVX2) && !ggmlpy_kernels_portable)) {
        return 0;
    }
    return strcmp(ggml_backend_buft_name(ggml_backend_buffer_get_type(w->buffer)), "CPU_REPACK") == 0
           && ggml_cpu_has_avx2();
}

#if GGMLPY_X86
/* Row groups [g0, g1) of the repacked weight w (nb blocks of 32 columns per group) against m Q8_0
   vectors xq (xrow bytes apart; ys8[c * nb + b] = 8 * the sum of vector c's bytes in block b), into
   the output columns dst[c]. */
GGMLPY_VNNI static void ggmlpy_rq4_rows(const char * w, int64_t nb, int64_t g0, int64_t g1, const char * xq,
                                        size_t xrow, const int32_t * ys8, int m, char * const * dst) {
    const __m512i low = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(0x08);
    const int64_t pfd = ggmlpy_rq4_pfd;
    for (int64_t gi = g0; gi < g1; gi++) {
        const char * p = w + gi * nb * GGMLPY_RQ4_BLOCK;
        __m256 acc[GGMLPY_RQ4_MAX_COLS];
        for (int c = 0; c < m; c++) acc[c] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++, p += GGMLPY_RQ4_BLOCK) {
            if (pfd) {
                ggmlpy_pf(p + pfd);
                ggmlpy_pf(p + pfd + 64);
                ggmlpy_pf(p + pfd + 128);
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
        for (int c = 0; c < m; c++) _mm256_storeu_ps((float *) dst[c] + gi * 8, acc[c]);
    }
}
#endif

/* One float32 vector of k into Q8_0 at q, as ggml's mul_mat quantizes it (quantize_row_q8_0), and
   ys8[b] = 8 * the sum of its bytes in block b (the kernel's correction for unsigned nibbles). */
#if GGMLPY_X86
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

#if GGMLPY_X86
/* ggml's unpacking of one sub-block's 12 bytes of 6-bit values into 8 scales then 8 mins (bytes) */
static inline void ggmlpy_q4k_unpack(const uint8_t * packed, uint32_t utmp[4]) {
    const uint32_t kmask1 = 0x3f3f3f3f, kmask2 = 0x0f0f0f0f, kmask3 = 0x03030303;
    memcpy(utmp, packed, 12);
    utmp[3] = ((utmp[2] >> 4) & kmask2) | (((utmp[1] >> 6) & kmask3) << 4);
    const uint32_t uaux = utmp[1] & kmask1;
    utmp[1] = (utmp[2] & kmask2) | (((utmp[0] >> 6) & kmask3) << 4);
    utmp[2] = uaux;
    utmp[0] &= kmask1;
}

/* Row groups [g0, g1) of the repacked Q4_K weight w (nb super-blocks of 256 columns per group) against
   m Q8_K vectors xq (xrow bytes apart; bs32[(c * nb + b) * 8 + s] = the sum of vector c's 32 bytes of
   sub-block s in super-block b), into the output columns dst[c]. */
GGMLPY_VNNI static void ggmlpy_rq4k_rows(const char * w, int64_t nb, int64_t g0, int64_t g1, const char * xq,
                                         size_t xrow, const int32_t * bs32, int m, char * const * dst) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    const __m128i dup = _mm_set_epi8(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const int64_t pfd = ggmlpy_rq4k_pfd;
    for (int64_t gi = g0; gi < g1; gi++) {
        const char * p = w + gi * nb * GGMLPY_RQ4K_BLOCK;
        __m256 acc[GGMLPY_RQ4_MAX_COLS], accm[GGMLPY_RQ4_MAX_COLS];
        for (int c = 0; c < m; c++) acc[c] = accm[c] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++, p += GGMLPY_RQ4K_BLOCK) {
            if (pfd) {
                for (int o = 0; o < GGMLPY_RQ4K_BLOCK; o += 64) ggmlpy_pf(p + pfd + o);
            }
            uint32_t utmp[8][4];
            for (int s = 0; s < 8; s++) ggmlpy_q4k_unpack((const uint8_t *) p + 32 + 12 * s, utmp[s]);
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) p));
            const __m256 dmw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (p + 16)));
            __m512i iacc[GGMLPY_RQ4_MAX_COLS];
            for (int c = 0; c < m; c++) iacc[c] = _mm512_setzero_si512();
            const char * qs = p + 128;
            for (int q = 0; q < 4; q++) {
                /* row r's scale of sub-blocks 2q (low nibbles) and 2q + 1 (high), in lanes 2r, 2r + 1 */
                const __m512i sc_lo = _mm512_cvtepu8_epi32(_mm_shuffle_epi8(_mm_loadl_epi64((const __m128i *) utmp[2 * q]), dup));
                const __m512i sc_hi = _mm512_cvtepu8_epi32(_mm_shuffle_epi8(_mm_loadl_epi64((const __m128i *) utmp[2 * q + 1]), dup));
                __m512i l[4], h[4];
                for (int r = 0; r < 4; r++) {
                    const __m512i raw = _mm512_loadu_si512(qs + (4 * q + r) * 64);
                    l[r] = _mm512_and_si512(raw, low);
                    h[r] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
                }
                for (int c = 0; c < m; c++) {
                    const char * y = xq + c * xrow + b * GGMLPY_Q8K_BYTES + 4 + q * 64;
                    __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
                    for (int r = 0; r < 4; r++) {
                        int64_t yl, yh;
                        memcpy(&yl, y + r * 8, 8);
                        memcpy(&yh, y + 32 + r * 8, 8);
                        lo = _mm512_dpbusd_epi32(lo, l[r], _mm512_set1_epi64(yl));
                        hi = _mm512_dpbusd_epi32(hi, h[r], _mm512_set1_epi64(yh));
                    }
                    iacc[c] = _mm512_add_epi32(iacc[c], _mm512_add_epi32(_mm512_mullo_epi32(lo, sc_lo),
                                                                         _mm512_mullo_epi32(hi, sc_hi)));
                }
            }
            for (int c = 0; c < m; c++) {
                const __m512i s = _mm512_add_epi32(iacc[c], _mm512_srli_epi64(iacc[c], 32));
                const __m256i dot = _mm512_cvtepi64_epi32(s);
                const int32_t * bs = bs32 + (c * nb + b) * 8;
                __m256i mins = _mm256_setzero_si256();
                for (int sb = 0; sb < 8; sb++) {
                    const __m256i mn = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *) ((const uint8_t *) utmp[sb] + 8)));
                    mins = _mm256_add_epi32(mins, _mm256_mullo_epi32(mn, _mm256_set1_epi32(bs[sb])));
                }
                float dy;
                memcpy(&dy, xq + c * xrow + b * GGMLPY_Q8K_BYTES, 4);
                const __m256 vdy = _mm256_set1_ps(dy);
                acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dw, vdy), acc[c]);
                accm[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_mul_ps(dmw, vdy), accm[c]);
            }
        }
        for (int c = 0; c < m; c++) _mm256_storeu_ps((float *) dst[c] + gi * 8, _mm256_sub_ps(acc[c], accm[c]));
    }
}

/* One float32 vector of k into Q8_K at q, as ggml's repacked mul_mat quantizes it for fewer than 4
   vectors (the type's from_float), and bs32: its 32-byte sums (the kernel's mins term). */
static void ggmlpy_rq4k_vector(const float * x, int64_t k, char * q, int32_t * bs32) {
    ggml_get_type_traits_cpu(GGML_TYPE_Q8_K)->from_float(x, q, k);
    for (int64_t b = 0; b < k / 256; b++) {
        const char * blk = q + b * GGMLPY_Q8K_BYTES;
        for (int s = 0; s < 8; s++) {
            int16_t s0, s1;
            memcpy(&s0, blk + 260 + 4 * s, 2);
            memcpy(&s1, blk + 262 + 4 * s, 2);
            bs32[b * 8 + s] = s0 + s1;
        }
    }
}

/* Either repacked layout: the vector's form for w's type (aux: k / 32 int32 for both) ... */
static void ggmlpy_rq_vector(enum ggml_type t, const float * x, int64_t k, char * q, int32_t * aux) {
    if (t == GGML_TYPE_Q4_K) ggmlpy_rq4k_vector(x, k, q, aux);
    else ggmlpy_rq4_vector(x, k, q, aux);
}

/* ... and its rows (nb: blocks of 32 columns for Q4_0, super-blocks of 256 for Q4_K) */
static void ggmlpy_rq_rows(enum ggml_type t, const char * w, int64_t k, int64_t g0, int64_t g1, const char * xq,
                           size_t xrow, const int32_t * aux, int m, char * const * dst) {
    if (t == GGML_TYPE_Q4_K && !ggmlpy_gemv_vnni()) {
        ggmlpy_rq4k_rows_avx2(w, k / 256, g0, g1, xq, xrow, aux, m, dst, ggmlpy_rq4k_pfd);
    } else if (t == GGML_TYPE_Q4_K) {
        ggmlpy_rq4k_rows(w, k / 256, g0, g1, xq, xrow, aux, m, dst);
    } else {
        ggmlpy_rq4_rows(w, k / 32, g0, g1, xq, xrow, aux, m, dst);
    }
}
#endif

/* src[0] x F32 (k, m) rows contiguous, m <= RQ4_MAX_COLS; userdata the repacked Q4_0 weight w (k,
   n); dst F32 (n, m). Thread ith takes the row groups [G * ith / nth, G * (ith + 1) / nth) of G =
   n / 8 and quantizes its own copy of the vectors, as ggml's mul_mat does (quantize_row_q8_0). */
static void ggmlpy_gemv_rq4_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
#if GGMLPY_X86
    const struct ggml_tensor * w = (const struct ggml_tensor *) userdata, * x = dst->src[0];
    const int64_t k = w->ne[0], nb = k / 32, groups = w->ne[1] / 8, m = x->ne[1];
    const size_t xrow = ggml_row_size(w->type == GGML_TYPE_Q4_K ? GGML_TYPE_Q8_K : GGML_TYPE_Q8_0, k);
    char xq[GGMLPY_GEMV_SCRATCH] __attribute__((aligned(64)));
    int32_t aux[GGMLPY_GEMV_SCRATCH / GGMLPY_Q8_0_BYTES + 1];
    for (int64_t c = 0; c < m; c++) {
        ggmlpy_rq_vector(w->type, (const float *) ((const char *) x->data + c * x->nb[1]), k, xq + c * xrow,
                         aux + c * nb);
    }
    char * cols[GGMLPY_RQ4_MAX_COLS];
    for (int64_t c = 0; c < m; c++) cols[c] = (char *) dst->data + c * dst->nb[1];
    ggmlpy_rq_rows(w->type, (const char *) w->data, k, groups * ith / nth, groups * (ith + 1) / nth, xq, xrow, aux,
                   (int) m, cols);
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
#if GGMLPY_X86
    const struct ggml_tensor * w = (const struct ggml_tensor *) userdata, * x = dst->src[0], * ids = dst->src[1];
    const int64_t k = w->ne[0], nb = k / 32, groups = w->ne[1] / 8, n_expert = w->ne[2];
    const int64_t xb = x->ne[1], n = x->ne[2], n_used = ids->ne[0];
    const int64_t per_token = n_used * groups, units = n * per_token;
    const int64_t u1 = units * (ith + 1) / nth;
    const size_t xrow = ggml_row_size(w->type == GGML_TYPE_Q4_K ? GGML_TYPE_Q8_K : GGML_TYPE_Q8_0, k);
    char xq[GGMLPY_GEMV_SCRATCH] __attribute__((aligned(64)));
    int32_t aux[GGMLPY_GEMV_SCRATCH / GGMLPY_Q8_0_BYTES + 1];
    for (int64_t v = 0; v < n * xb; v++) {
        ggmlpy_rq_vector(w->type, (const float *) ((const char *) x->data + (v % xb) * x->nb[1] + (v / xb) * x->nb[2]),
                         k, xq + v * xrow, aux + v * nb);
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
            ggmlpy_rq_rows(w->type, (const char *) w->data + e * w->nb[2], k, g0, g1, xq + v * xrow, xrow, aux + v * nb, 1,
                           &y);
        }
        u += g1 - g0;
    }
#else
    (void) dst; (void) ith; (void) nth; (void) userdata;
#endif
}

/* Bytes of one expert's rows a thread reads for every run of vectors before it moves on (a block of row
   groups that stays in the core's L2 while the expert's runs pass over it). */
#define GGMLPY_RQ_ID_BLOCK (256 * 1024)

/* Rows [r0, r1) of the (slot, token) outputs of pairs p[0..n) set to NaN (an id out of range, or no memory). */
void ggmlpy_rq_id_nan(struct ggml_tensor * dst, const int64_t * p, int64_t n, int64_t n_used, int64_t r0,
                             int64_t r1) {
    for (int64_t j = 0; j < n; j++) {
        float * y = (float *) ((char *) dst->data + (p[j] % n_used) * dst->nb[1] + (p[j] / n_used) * dst->nb[2]);
        for (int64_t r = r0; r < r1; r++) y[r] = NAN;
    }
}

/* The experts' product for many tokens (Context.mul_mat_id_rq): ggmlpy_gemv_rq4_id_op's arguments, any token
   count. Every thread sorts the (token, slot) pairs by expert (a counting pass over ids) and takes the
   run [P * ith / nth, P * (ith + 1) / nth) of the P sorted pairs: each expert's pairs are quantized as ggml
   does, by the one thread that has them, and go GGMLPY_RQ4_MAX_COLS at a time over blocks of the expert's
   rows that stay in L2 (ggml's repacked mul_mat_id reads the expert's rows once per pair, with a 256-bit
   kernel). The arithmetic per pair is the one-vector kernel's: mul_mat_id's values. An id out of range
   gives NaN rows, and so does a thread that cannot get its scratch memory. */
static void ggmlpy_rq_id_grouped_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
#if GGMLPY_X86
    const struct ggml_tensor * w = (const struct ggml_tensor *) userdata, * x = dst->src[0], * ids = dst->src[1];
    const int64_t k = w->ne[0], nb = k / 32, groups = w->ne[1] / 8, n_expert = w->ne[2];
    const int64_t xb = x->ne[1], n_used = ids->ne[0], n_pairs = x->ne[2] * n_used;
    const int64_t j0 = n_pairs * ith / nth, j1 = n_pairs * (ith + 1) / nth;
    const size_t xrow = ggml_row_size(w->type == GGML_TYPE_Q4_K ? GGML_TYPE_Q8_K : GGML_TYPE_Q8_0, k);
    const int64_t gbytes = (int64_t) (w->nb[1] * 8), block = gbytes < GGMLPY_RQ_ID_BLOCK ? GGMLPY_RQ_ID_BLOCK / gbytes : 1;
    if (j0 >= j1) return;
    int64_t * start = NULL, * pairs = NULL;
    char * xq = NULL;
    int32_t * aux = NULL;
    if (ggmlpy_rq_id_sort(ids, n_expert, &start, &pairs)) {
        const int64_t most = ggmlpy_rq_id_most(start, n_expert, j0, j1);
        xq = most ? (char *) malloc((size_t) most * xrow) : NULL;
        aux = most ? (int32_t *) malloc(sizeof(int32_t) * (size_t) (most * nb)) : NULL;
        if (most && (xq == NULL || aux == NULL)) {
            ggmlpy_rq_id_nan(dst, pairs + j0, j1 - j0, n_used, 0, w->ne[1]);
            goto done;
        }
    } else {
        for (int64_t p = j0; p < j1; p++) ggmlpy_rq_id_nan(dst, &p, 1, n_used, 0, w->ne[1]);   /* unsorted: its share */
        goto done;
    }
    for (int64_t e = 0; e <= n_expert; e++) {
        const int64_t lo = start[e] > j0 ? start[e] : j0, hi = start[e + 1] < j1 ? start[e + 1] : j1;
        if (hi <= lo) continue;
        const int64_t * pe = pairs + lo, cnt = hi - lo;
        if (e == n_expert) {
            ggmlpy_rq_id_nan(dst, pe, cnt, n_used, 0, w->ne[1]);
            continue;
        }
        for (int64_t j = 0; j < cnt; j++) {
            const int64_t t = pe[j] / n_used, v = pe[j] % n_used % xb;
            ggmlpy_rq_vector(w->type, (const float *) ((const char *) x->data + v * x->nb[1] + t * x->nb[2]), k,
                             xq + j * xrow, aux + j * nb);
        }
        const char * we = (const char *) w->data + e * w->nb[2];
        for (int64_t b0 = 0; b0 < groups; b0 += block) {
            const int64_t b1 = b0 + block < groups ? b0 + block : groups;
            for (int64_t j = 0; j < cnt; j += GGMLPY_RQ4_MAX_COLS) {
                const int m = (int) (cnt - j < GGMLPY_RQ4_MAX_COLS ? cnt - j : GGMLPY_RQ4_MAX_COLS);
                char * cols[GGMLPY_RQ4_MAX_COLS];
                for (int c = 0; c < m; c++) {
                    cols[c] = (char *) dst->data + (pe[j + c] % n_used) * dst->nb[1] + (pe[j + c] / n_used) * dst->nb[2];
                }
                ggmlpy_rq_rows(w->type, we, k, b0, b1, xq + j * xrow, xrow, aux + j * nb, m, cols);
            }
        }
    }
done:
    free(start); free(pairs); free(xq); free(aux);
#else
    (void) dst; (void) ith; (void) nth; (void) userdata;
#endif
}

struct ggml_tensor * ggmlpy_mul_mat_id_rq(struct ggml_context * ctx, struct ggml_tensor * w, struct ggml_tensor * x,
                                          struct ggml_tensor * ids) {
    if (!ggmlpy_gemv_vnni()) return ggmlpy_mul_mat_id_rq4k(ctx, w, x, ids);   /* Q4_K without VNNI: gemm.c */
    struct ggml_tensor * args[2] = {x, ids};
    return ggml_custom_4d(ctx, GGML_TYPE_F32, w->ne[1], ids->ne[0], x->ne[2], 1, args, 2, ggmlpy_rq_id_grouped_op,
                          GGML_N_TASKS_MAX, w);
}

struct ggml_tensor * ggmlpy_mul_mat_id_vec_rq4(struct ggml_context * ctx, struct ggml_tensor * w,
                                                      struct ggml_tensor * x, struct ggml_tensor * ids) {
    struct ggml_tensor * args[2] = {x, ids};
    return ggml_custom_4d(ctx, GGML_TYPE_F32, w->ne[1], ids->ne[0], x->ne[2], 1, args, 2, ggmlpy_gemv_rq4_id_op,
                          GGML_N_TASKS_MAX, w);
}

struct ggml_tensor * ggmlpy_mul_mat_vec_rq4(struct ggml_context * ctx, struct ggml_tensor * w,
                                                   struct ggml_tensor * x) {
    struct ggml_tensor * args[1] = {x};
    return ggml_custom_4d(ctx, GGML_TYPE_F32, w->ne[1], x->ne[1], 1, 1, args, 1, ggmlpy_gemv_rq4_op, GGML_N_TASKS_MAX,
                          w);
}
