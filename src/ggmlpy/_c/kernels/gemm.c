/* A prompt's products with Q4_K weights that ggml repacked (CPU_REPACK, block_q4_Kx8), in 256-bit
   AVX2 (Context.mul_mat_rq4k): ggml's values, by a schedule that does less work per product.

   Why: on a CPU without AVX-512 a prompt of a Q4_K_M model spends about 80% of its time in ggml's
   ggml_gemm_q4_K_8x8_q8_K (perf, Llama-3.2-1B shape, 512 tokens), and both engines run that same
   kernel. It unpacks and shuffles the weights of 8 rows for every 16 tokens it passes over them,
   emulating ARM's 2x2 int8 matrix instruction, and keeps 32 accumulators in 16 registers. Here a
   thread unpacks a window of its row groups once into the form the multiply wants (nibbles as
   bytes, each row's scales beside its lanes), keeps it in L2, and passes every token over it four
   at a time: per token, 4 rows and 8 columns one vpmaddubsw, four of them summed in int16 (never
   past 15360), one vpmaddwd by the 6-bit scales per 32 columns. Measured (Zen 3, AVX2, the
   Llama-3.2-1B shape's four matrices, 512 tokens): 1.9-2.5x ggml's op on 1 and 2 threads.

   The arithmetic is ggml's AVX2 gemm's: per 64 columns (two sub-blocks) the integer sums I and
   M = mins . bsums exactly, then acc += float(I) * (d_w * d_y) and acc_min += float(M) * (dmin_w *
   d_y) as fused multiply-adds, the value acc - acc_min; the tokens are quantized to Q8_K by ggml's
   own function. The values equal ggml's mul_mat bit for bit wherever ggml runs its gemm (its
   tokens in fours; the last m % 4 it sends through its one-vector kernel, which folds per 256
   columns: those agree to float rounding). There is no portable path: where the CPU lacks AVX2,
   ggml repacks no Q4_K and the op is refused.

   Also here, for the same layout on a CPU with AVX2: a prompt's experts (Context.mul_mat_id_rq where
   gemv.c's VNNI kernel does not run), the rows times a few vectors (mul_mat_vec's and mul_mat_id_vec's
   path there), and the sort of a mul_mat_id's (token, slot) pairs by expert that the experts' ops of
   both files share. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "ggml.h"
#include "ggml-backend.h"
#include "ggmlpy_cpu.h"             /* ggml-cpu.h (a table of it in a portable build) */
#include "simd.h"
#include "kernels.h"

/* Process-wide: 0 refuses the kernel (Context.mul_mat_rq4k then raises; for tests and benchmarks). */
int ggmlpy_rq4k_gemm_allow = 1;

#define GGMLPY_Q8K_BYTES 292            /* a Q8_K block: float d, 256 int8, 16 int16 sums */
#define GGMLPY_RQ4K_BLOCK 1152          /* bytes of 8 rows x 256 columns in block_q4_Kx8 */

/* A token's super-block as the kernel reads it: float d, the 256 int8 values, then per pair of
   sub-blocks q the two sums of 32 values as int16 (low: sub-block 2q), one int32 to broadcast. */
#define GGMLPY_GQ_BYTES (4 + 256 + 16)

/* A prepared super-block of a group of 8 rows (bytes):
   [0, 2048)     the nibbles as bytes: 32-byte vector ((q * 2 + h) * 2 + half) * 4 + i holds rows
                 4 half .. 4 half + 3, 8 bytes each: columns q * 64 + h * 32 + i * 8 + 0..7
   [2048, 2560)  int16 scales: vector s * 2 + half has row 4 half + r's scale of sub-block s in lanes
                 4r .. 4r + 3 (vpmaddwd's pairs fall inside a row)
   [2560, 2688)  int16 mins: vector q has (min of sub-block 2q, of 2q + 1) of row ORDER[j] in lanes 2j, 2j + 1
   [2688, 2720)  float d of row ORDER[j] in lane j; [2720, 2752) float dmin the same.
   ORDER is where vphaddd(rows 0-3, rows 4-7) leaves the rows: 0 1 4 5 2 3 6 7. */
#define GGMLPY_GP_BYTES 2752
#define GGMLPY_GP_SCALES 2048
#define GGMLPY_GP_MINS 2560
#define GGMLPY_GP_D 2688
#define GGMLPY_GP_DMIN 2720

/* Bytes of prepared super-blocks a thread keeps at once (its share of L2) */
#define GGMLPY_GP_WINDOW (192 * 1024)

#define GGMLPY_GEMM_TILE 4              /* tokens per pass over a prepared group */

/* One float32 row of k into the kernel's token form (ggml's Q8_K values: quantize_row_q8_K) */
static void ggmlpy_gq_row(const float * x, int64_t k, char * out) {
    char blk[GGMLPY_Q8K_BYTES];
    for (int64_t b = 0; b < k / 256; b++, out += GGMLPY_GQ_BYTES) {
        memset(blk + 260, 0, 32);       /* ggml leaves an all-zero block's sums unwritten (its d is 0) */
        ggml_get_type_traits_cpu(GGML_TYPE_Q8_K)->from_float(x + b * 256, blk, 256);
        memcpy(out, blk, 4 + 256);
        int16_t bs[16], pairs[8];
        memcpy(bs, blk + 260, 32);
        for (int s = 0; s < 8; s++) pairs[s] = (int16_t) (bs[2 * s] + bs[2 * s + 1]);
        memcpy(out + 260, pairs, 16);
    }
}

/* The (token, slot) pairs of ids (n_used, n_tokens) sorted by expert by a counting pass: (*start)[e] the first
   sorted pair of expert e, for e up to n_expert + 1 (ids out of range sort last, as expert n_expert), and
   *pairs the pairs (token * n_used + slot). Returns 0, both freed and NULL, where memory ran out. */
int ggmlpy_rq_id_sort(const struct ggml_tensor * ids, int64_t n_expert, int64_t ** start_out, int64_t ** pairs_out) {
    const int64_t n_used = ids->ne[0], n_pairs = ids->ne[0] * ids->ne[1];
    int64_t * start = (int64_t *) calloc((size_t) n_expert + 2, sizeof(int64_t));
    int64_t * pairs = (int64_t *) malloc(sizeof(int64_t) * (size_t) (n_pairs ? n_pairs : 1));
    *start_out = *pairs_out = NULL;
    if (start == NULL || pairs == NULL) {
        free(start); free(pairs);
        return 0;
    }
    for (int64_t p = 0; p < n_pairs; p++) {
        const int32_t e = *(const int32_t *) ((const char *) ids->data + (p % n_used) * ids->nb[0] + (p / n_used) * ids->nb[1]);
        start[(e >= 0 && e < n_expert ? e : n_expert) + 1]++;
    }
    for (int64_t e = 0; e <= n_expert; e++) start[e + 1] += start[e];
    for (int64_t p = 0; p < n_pairs; p++) {         /* start[e] advances to the next expert's start */
        const int32_t e = *(const int32_t *) ((const char *) ids->data + (p % n_used) * ids->nb[0] + (p / n_used) * ids->nb[1]);
        pairs[start[e >= 0 && e < n_expert ? e : n_expert]++] = p;
    }
    for (int64_t e = n_expert; e > 0; e--) start[e] = start[e - 1];
    start[0] = 0;
    *start_out = start;
    *pairs_out = pairs;
    return 1;
}

/* The most pairs of one expert among the sorted pairs [j0, j1) */
int64_t ggmlpy_rq_id_most(const int64_t * start, int64_t n_expert, int64_t j0, int64_t j1) {
    int64_t most = 0;
    for (int64_t e = 0; e < n_expert; e++) {
        const int64_t lo = start[e] > j0 ? start[e] : j0, hi = start[e + 1] < j1 ? start[e + 1] : j1;
        most = hi - lo > most ? hi - lo : most;
    }
    return most;
}

#if GGMLPY_X86
static const int ggmlpy_gp_order[8] = {0, 1, 4, 5, 2, 3, 6, 7};

/* ggml's unpacking of one sub-block's 12 bytes of 6-bit values into 8 scales then 8 mins (bytes) */
static inline void ggmlpy_gp_unpack(const uint8_t * packed, uint8_t out[16]) {
    const uint32_t kmask1 = 0x3f3f3f3f, kmask2 = 0x0f0f0f0f, kmask3 = 0x03030303;
    uint32_t u[4];
    memcpy(u, packed, 12);
    u[3] = ((u[2] >> 4) & kmask2) | (((u[1] >> 6) & kmask3) << 4);
    const uint32_t aux = u[1] & kmask1;
    u[1] = (u[2] & kmask2) | (((u[0] >> 6) & kmask3) << 4);
    u[2] = aux;
    u[0] &= kmask1;
    memcpy(out, u, 16);
}

/* The nb super-blocks of one group of block_q4_Kx8 at p into the prepared form at out (32 bytes of a
   chunk, 4 rows x 8, give a vector of low nibbles and one of high) */
GGMLPY_AVX2 static void ggmlpy_gp_prepare(const char * p, int64_t nb, char * out) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; b++, p += GGMLPY_RQ4K_BLOCK, out += GGMLPY_GP_BYTES) {
        const char * qs = p + 128;
        __m256i * w = (__m256i *) out;
        for (int q = 0; q < 4; q++) {
            for (int i = 0; i < 4; i++) {
                for (int half = 0; half < 2; half++) {
                    const __m256i raw = _mm256_loadu_si256((const __m256i *) (qs + (4 * q + i) * 64 + half * 32));
                    _mm256_store_si256(w + ((q * 2 + 0) * 2 + half) * 4 + i, _mm256_and_si256(raw, low));
                    _mm256_store_si256(w + ((q * 2 + 1) * 2 + half) * 4 + i,
                                       _mm256_and_si256(_mm256_srli_epi16(raw, 4), low));
                }
            }
        }
        uint8_t sm[8][16];                                           /* [sub-block][scale of row r, then min] */
        for (int s = 0; s < 8; s++) ggmlpy_gp_unpack((const uint8_t *) p + 32 + 12 * s, sm[s]);
        int16_t * sc = (int16_t *) (out + GGMLPY_GP_SCALES);
        for (int s = 0; s < 8; s++) {
            for (int half = 0; half < 2; half++) {
                for (int l = 0; l < 16; l++) sc[(s * 2 + half) * 16 + l] = sm[s][half * 4 + l / 4];
            }
        }
        int16_t * mn = (int16_t *) (out + GGMLPY_GP_MINS);
        float * d = (float *) (out + GGMLPY_GP_D), * dmin = (float *) (out + GGMLPY_GP_DMIN);
        for (int j = 0; j < 8; j++) {
            const int r = ggmlpy_gp_order[j];
            for (int q = 0; q < 4; q++) {
                mn[q * 16 + 2 * j] = sm[2 * q][8 + r];
                mn[q * 16 + 2 * j + 1] = sm[2 * q + 1][8 + r];
            }
            ggml_fp16_t h, hm;
            memcpy(&h, p + 2 * r, 2);
            memcpy(&hm, p + 16 + 2 * r, 2);
            d[j] = ggml_fp16_to_fp32(h);
            dmin[j] = ggml_fp16_to_fp32(hm);
        }
    }
}

/* T tokens (rows of xq, xrow bytes apart) against one prepared group of nb super-blocks: the 8 rows'
   values for each token into dst[t] (8 floats, row order). */
GGMLPY_AVX2 static inline __attribute__((always_inline)) void
ggmlpy_gp_tile_t(const char * gp, int64_t nb, const char * xq, size_t xrow, float * const * dst, const int T,
                 const int fold256) {
    const __m256i unorder = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);   /* ORDER is its own inverse */
    __m256 acc[GGMLPY_GEMM_TILE], accm[GGMLPY_GEMM_TILE];
    for (int t = 0; t < T; t++) acc[t] = accm[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, gp += GGMLPY_GP_BYTES) {
        const __m256i * w = (const __m256i *) gp;
        const __m256i * sc = (const __m256i *) (gp + GGMLPY_GP_SCALES);
        const __m256i * mn = (const __m256i *) (gp + GGMLPY_GP_MINS);
        const __m256 dw = _mm256_load_ps((const float *) (gp + GGMLPY_GP_D));
        const __m256 dmw = _mm256_load_ps((const float *) (gp + GGMLPY_GP_DMIN));
        const char * y[GGMLPY_GEMM_TILE];
        __m256 dd[GGMLPY_GEMM_TILE], ddm[GGMLPY_GEMM_TILE];
        for (int t = 0; t < T; t++) {
            y[t] = xq + t * xrow + b * GGMLPY_GQ_BYTES;
            float dy;
            memcpy(&dy, y[t], 4);
            dd[t] = _mm256_mul_ps(dw, _mm256_set1_ps(dy));
            ddm[t] = _mm256_mul_ps(dmw, _mm256_set1_ps(dy));
        }
        __m256i isb[GGMLPY_GEMM_TILE], msb[GGMLPY_GEMM_TILE];     /* fold256: the super-block's sums */
        for (int t = 0; t < T; t++) isb[t] = msb[t] = _mm256_setzero_si256();
        for (int q = 0; q < 4; q++) {
            __m256i ia[GGMLPY_GEMM_TILE], ib[GGMLPY_GEMM_TILE];
            for (int h = 0; h < 2; h++) {
                const __m256i * wq = w + (q * 2 + h) * 8;
                const __m256i sa = _mm256_load_si256(sc + (2 * q + h) * 2), sb = _mm256_load_si256(sc + (2 * q + h) * 2 + 1);
                for (int t = 0; t < T; t++) {
                    const char * a = y[t] + 4 + q * 64 + h * 32;
                    int64_t v0, v1, v2, v3;
                    memcpy(&v0, a, 8); memcpy(&v1, a + 8, 8); memcpy(&v2, a + 16, 8); memcpy(&v3, a + 24, 8);
                    const __m256i a0 = _mm256_set1_epi64x(v0), a1 = _mm256_set1_epi64x(v1);
                    const __m256i a2 = _mm256_set1_epi64x(v2), a3 = _mm256_set1_epi64x(v3);
                    __m256i ta = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_load_si256(wq + 0), a0),
                                                  _mm256_maddubs_epi16(_mm256_load_si256(wq + 1), a1));
                    ta = _mm256_add_epi16(ta, _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_load_si256(wq + 2), a2),
                                                               _mm256_maddubs_epi16(_mm256_load_si256(wq + 3), a3)));
                    __m256i tb = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_load_si256(wq + 4), a0),
                                                  _mm256_maddubs_epi16(_mm256_load_si256(wq + 5), a1));
                    tb = _mm256_add_epi16(tb, _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_load_si256(wq + 6), a2),
                                                               _mm256_maddubs_epi16(_mm256_load_si256(wq + 7), a3)));
                    if (h == 0) {
                        ia[t] = _mm256_madd_epi16(ta, sa);
                        ib[t] = _mm256_madd_epi16(tb, sb);
                    } else {
                        ia[t] = _mm256_add_epi32(ia[t], _mm256_madd_epi16(ta, sa));
                        ib[t] = _mm256_add_epi32(ib[t], _mm256_madd_epi16(tb, sb));
                    }
                }
            }
            const __m256i mq = _mm256_load_si256(mn + q);
            for (int t = 0; t < T; t++) {
                int32_t pair;
                memcpy(&pair, y[t] + 260 + 4 * q, 4);
                const __m256i isum = _mm256_hadd_epi32(ia[t], ib[t]);
                const __m256i imin = _mm256_madd_epi16(mq, _mm256_set1_epi32(pair));
                if (fold256) {
                    isb[t] = _mm256_add_epi32(isb[t], isum);
                    msb[t] = _mm256_add_epi32(msb[t], imin);
                } else {
                    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), dd[t], acc[t]);
                    accm[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(imin), ddm[t], accm[t]);
                }
            }
        }
        for (int t = 0; fold256 && t < T; t++) {
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isb[t]), dd[t], acc[t]);
            accm[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msb[t]), ddm[t], accm[t]);
        }
    }
    for (int t = 0; t < T; t++) {
        _mm256_storeu_ps(dst[t], _mm256_permutevar8x32_ps(_mm256_sub_ps(acc[t], accm[t]), unorder));
    }
}

/* fold256: per 256 columns, as ggml's one-vector kernel (ggml_gemv_q4_K_8x8_q8_K) folds, which its
   repacked mul_mat_id runs for every (token, slot); else per 64, as its gemm */
GGMLPY_AVX2 static void ggmlpy_gp_tile(const char * gp, int64_t nb, const char * xq, size_t xrow, float * const * dst,
                                       int T, int fold256) {
    if (fold256) {
        switch (T) {
            case 4: ggmlpy_gp_tile_t(gp, nb, xq, xrow, dst, 4, 1); break;
            case 3: ggmlpy_gp_tile_t(gp, nb, xq, xrow, dst, 3, 1); break;
            case 2: ggmlpy_gp_tile_t(gp, nb, xq, xrow, dst, 2, 1); break;
            default: ggmlpy_gp_tile_t(gp, nb, xq, xrow, dst, 1, 1); break;
        }
        return;
    }
    switch (T) {
        case 4: ggmlpy_gp_tile_t(gp, nb, xq, xrow, dst, 4, 0); break;
        case 3: ggmlpy_gp_tile_t(gp, nb, xq, xrow, dst, 3, 0); break;
        case 2: ggmlpy_gp_tile_t(gp, nb, xq, xrow, dst, 2, 0); break;
        default: ggmlpy_gp_tile_t(gp, nb, xq, xrow, dst, 1, 0); break;
    }
}
/* ---- Q4_K weights ggml repacked, times a few vectors (mul_mat_vec, mul_mat_id_vec) -------------
   gemv.c's kernel for these is AVX-512 VNNI; this is its arithmetic in 256-bit AVX2, for the CPUs
   without: per super-block the integer sums I (scales . nibble dots) and M (mins . 32-value sums)
   exactly, then acc += float(I) * (d_w * d_y), acc_min += float(M) * (dmin_w * d_y): ggml's one-vector
   kernel's values. The nibbles are unpacked as they are read (a generated token reads each weight
   once; nothing to keep). */

GGMLPY_AVX2 static inline __attribute__((always_inline)) void
ggmlpy_rq4k_rows_avx2_m(const char * w, int64_t nb, int64_t g0, int64_t g1, const char * xq, size_t xrow,
                        const int32_t * bs32, char * const * dst, int64_t pfd, const int M) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i unorder = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
    /* a sub-block's scale of rows 0-3 (ia) or 4-7 (ib), each repeated over its row's 4 int16 lanes */
    const __m128i ia = _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m128i ib = _mm_setr_epi8(4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7);
    for (int64_t gi = g0; gi < g1; gi++) {
        const char * p = w + gi * nb * GGMLPY_RQ4K_BLOCK;
        __m256 acc[GGMLPY_RQ4_MAX_COLS], accm[GGMLPY_RQ4_MAX_COLS];
        for (int c = 0; c < M; c++) acc[c] = accm[c] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++, p += GGMLPY_RQ4K_BLOCK) {
            if (pfd) {
                for (int o = 0; o < GGMLPY_RQ4K_BLOCK; o += 64) __builtin_prefetch(p + pfd + o, 0, 3);
            }
            uint8_t sm[8][16];
            for (int s = 0; s < 8; s++) ggmlpy_gp_unpack((const uint8_t *) p + 32 + 12 * s, sm[s]);
            __m256i isa[GGMLPY_RQ4_MAX_COLS], isb[GGMLPY_RQ4_MAX_COLS];
            for (int c = 0; c < M; c++) isa[c] = isb[c] = _mm256_setzero_si256();
            const char * qs = p + 128;
            for (int q = 0; q < 4; q++) {
                const __m128i ulo = _mm_loadu_si128((const __m128i *) sm[2 * q]);
                const __m128i uhi = _mm_loadu_si128((const __m128i *) sm[2 * q + 1]);
                __m256i tal[GGMLPY_RQ4_MAX_COLS], tbl[GGMLPY_RQ4_MAX_COLS];
                __m256i tah[GGMLPY_RQ4_MAX_COLS], tbh[GGMLPY_RQ4_MAX_COLS];
                for (int c = 0; c < M; c++) tal[c] = tbl[c] = tah[c] = tbh[c] = _mm256_setzero_si256();
                for (int i = 0; i < 4; i++) {
                    const __m256i r0 = _mm256_loadu_si256((const __m256i *) (qs + (4 * q + i) * 64));
                    const __m256i r1 = _mm256_loadu_si256((const __m256i *) (qs + (4 * q + i) * 64 + 32));
                    const __m256i l0 = _mm256_and_si256(r0, low), h0 = _mm256_and_si256(_mm256_srli_epi16(r0, 4), low);
                    const __m256i l1 = _mm256_and_si256(r1, low), h1 = _mm256_and_si256(_mm256_srli_epi16(r1, 4), low);
                    for (int c = 0; c < M; c++) {
                        const char * y = xq + c * xrow + b * GGMLPY_Q8K_BYTES + 4 + q * 64 + i * 8;
                        int64_t vl, vh;
                        memcpy(&vl, y, 8);
                        memcpy(&vh, y + 32, 8);
                        const __m256i al = _mm256_set1_epi64x(vl), ah = _mm256_set1_epi64x(vh);
                        tal[c] = _mm256_add_epi16(tal[c], _mm256_maddubs_epi16(l0, al));
                        tbl[c] = _mm256_add_epi16(tbl[c], _mm256_maddubs_epi16(l1, al));
                        tah[c] = _mm256_add_epi16(tah[c], _mm256_maddubs_epi16(h0, ah));
                        tbh[c] = _mm256_add_epi16(tbh[c], _mm256_maddubs_epi16(h1, ah));
                    }
                }
                const __m256i sal = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(ulo, ia));
                const __m256i sbl = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(ulo, ib));
                const __m256i sah = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(uhi, ia));
                const __m256i sbh = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(uhi, ib));
                for (int c = 0; c < M; c++) {
                    isa[c] = _mm256_add_epi32(isa[c], _mm256_add_epi32(_mm256_madd_epi16(tal[c], sal),
                                                                       _mm256_madd_epi16(tah[c], sah)));
                    isb[c] = _mm256_add_epi32(isb[c], _mm256_add_epi32(_mm256_madd_epi16(tbl[c], sbl),
                                                                       _mm256_madd_epi16(tbh[c], sbh)));
                }
            }
            __m256i mp[4];                   /* rows 0-7's (min of sub-block 2j, of 2j + 1), int16 pairs */
            for (int j = 0; j < 4; j++) {
                mp[j] = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *) (sm[2 * j] + 8)),
                                                               _mm_loadl_epi64((const __m128i *) (sm[2 * j + 1] + 8))));
            }
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) p));
            const __m256 dmw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (p + 16)));
            for (int c = 0; c < M; c++) {
                const int32_t * bs = bs32 + (c * nb + b) * 8;
                __m256i imin = _mm256_setzero_si256();
                for (int j = 0; j < 4; j++) {
                    const uint32_t pair = (uint32_t) (uint16_t) bs[2 * j] | (uint32_t) (uint16_t) bs[2 * j + 1] << 16;
                    imin = _mm256_add_epi32(imin, _mm256_madd_epi16(mp[j], _mm256_set1_epi32((int32_t) pair)));
                }
                const __m256i isum = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(isa[c], isb[c]), unorder);
                float dy;
                memcpy(&dy, xq + c * xrow + b * GGMLPY_Q8K_BYTES, 4);
                const __m256 vdy = _mm256_set1_ps(dy);
                acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dw, vdy), acc[c]);
                accm[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(imin), _mm256_mul_ps(dmw, vdy), accm[c]);
            }
        }
        for (int c = 0; c < M; c++) _mm256_storeu_ps((float *) dst[c] + gi * 8, _mm256_sub_ps(acc[c], accm[c]));
    }
}

/* Row groups [g0, g1) of the repacked Q4_K weight w against m <= GGMLPY_RQ4_MAX_COLS Q8_K vectors: gemv.c's
   ggmlpy_rq4k_rows' arguments and values (pfd: bytes ahead to prefetch, 0 none) */
GGMLPY_AVX2 void ggmlpy_rq4k_rows_avx2(const char * w, int64_t nb, int64_t g0, int64_t g1, const char * xq,
                                       size_t xrow, const int32_t * bs32, int m, char * const * dst, int64_t pfd) {
    switch (m) {
        case 3: ggmlpy_rq4k_rows_avx2_m(w, nb, g0, g1, xq, xrow, bs32, dst, pfd, 3); break;
        case 2: ggmlpy_rq4k_rows_avx2_m(w, nb, g0, g1, xq, xrow, bs32, dst, pfd, 2); break;
        default: ggmlpy_rq4k_rows_avx2_m(w, nb, g0, g1, xq, xrow, bs32, dst, pfd, 1); break;
    }
}

#endif

/* 1 where this file's kernel takes w: a whole Q4_K matrix or expert stack ggml repacked (CPU_REPACK,
   8-row groups), on a CPU with AVX2 and FMA, the kernel allowed and the portable path not forced
   (Context.mul_mat_rq4k asks a matrix, ne[2] == 1). */
int ggmlpy_rq4k_gemm_ok(const struct ggml_tensor * w) {
    if (!ggmlpy_rq4k_gemm_allow || ggmlpy_kernels_portable || !ggmlpy_cpu_has(GGMLPY_CPU_AVX2)
        || w->type != GGML_TYPE_Q4_K || ggml_type_size(GGML_TYPE_Q8_K) != GGMLPY_Q8K_BYTES) {
        return 0;
    }
    if (w->view_src != NULL || w->buffer == NULL || w->extra == NULL || w->ne[1] % 8 != 0 || w->ne[3] != 1) {
        return 0;
    }
    return strcmp(ggml_backend_buft_name(ggml_backend_buffer_get_type(w->buffer)), "CPU_REPACK") == 0;
}

/* src[0] x F32 (k, m), rows contiguous; dst I8 (k / 256 * GQ_BYTES, m): each thread its share of rows. */
static void ggmlpy_gq_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) userdata;
    const struct ggml_tensor * x = dst->src[0];
    const int64_t m = x->ne[1];
    for (int64_t r = m * ith / nth; r < m * (ith + 1) / nth; r++) {
        ggmlpy_gq_row((const float *) ((const char *) x->data + r * x->nb[1]), x->ne[0],
                      (char *) dst->data + r * dst->nb[1]);
    }
}

/* src[0] the tokens in the kernel's form (ggmlpy_gq_op's dst), userdata the repacked weight w (k, n);
   dst F32 (n, m). Thread ith takes the row groups [G * ith / nth, G * (ith + 1) / nth) of G = n / 8,
   prepares them a window at a time and passes every token over each window. A thread that cannot
   get its window's memory writes NaN in its rows. */
static void ggmlpy_rq4k_gemm_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
#if GGMLPY_X86
    const struct ggml_tensor * w = (const struct ggml_tensor *) userdata, * xq = dst->src[0];
    const int64_t k = w->ne[0], nb = k / 256, groups = w->ne[1] / 8, m = xq->ne[1];
    const int64_t g0 = groups * ith / nth, g1 = groups * (ith + 1) / nth;
    const size_t gbytes = (size_t) nb * GGMLPY_GP_BYTES;
    const int64_t window = gbytes < GGMLPY_GP_WINDOW ? GGMLPY_GP_WINDOW / (int64_t) gbytes : 1;
    if (g0 >= g1) return;
    const int64_t span = g1 - g0 < window ? g1 - g0 : window;
    char * gp = (char *) aligned_alloc(64, gbytes * (size_t) span);
    if (gp == NULL) {
        for (int64_t t = 0; t < m; t++) {
            for (int64_t r = g0 * 8; r < g1 * 8; r++) ((float *) ((char *) dst->data + t * dst->nb[1]))[r] = NAN;
        }
        return;
    }
    for (int64_t w0 = g0; w0 < g1; w0 += window) {
        const int64_t w1 = w0 + window < g1 ? w0 + window : g1;
        for (int64_t g = w0; g < w1; g++) {
            ggmlpy_gp_prepare((const char *) w->data + g * nb * GGMLPY_RQ4K_BLOCK, nb, gp + (g - w0) * gbytes);
        }
        for (int64_t t = 0; t < m; t += GGMLPY_GEMM_TILE) {
            const int T = (int) (m - t < GGMLPY_GEMM_TILE ? m - t : GGMLPY_GEMM_TILE);
            for (int64_t g = w0; g < w1; g++) {
                float * out[GGMLPY_GEMM_TILE];
                for (int j = 0; j < T; j++) out[j] = (float *) ((char *) dst->data + (t + j) * dst->nb[1]) + g * 8;
                ggmlpy_gp_tile(gp + (g - w0) * gbytes, nb, (const char *) xq->data + t * xq->nb[1], xq->nb[1], out, T, 0);
            }
        }
    }
    free(gp);
#else
    (void) dst; (void) ith; (void) nth; (void) userdata;
#endif
}

/* The experts' product for many tokens on a repacked Q4_K stack (Context.mul_mat_id_rq where the VNNI
   kernel of gemv.c does not run): src[0] x F32 (k, xb, n), rows contiguous, xb 1 or n_used; src[1] ids
   I32 (n_used, n); userdata w (k, rows, n_expert); dst F32 (rows, n_used, n). gemv.c's schedule: every
   thread sorts the (token, slot) pairs by expert and takes its run of the sorted pairs; per expert it
   quantizes its pairs' tokens, then prepares a window of the expert's rows at a time and passes those
   tokens over it four at a time. Folded per 256 columns as ggml's one-vector kernel, which ggml's
   repacked mul_mat_id runs for every pair: mul_mat_id's values. An id out of range gives NaN rows, and
   so does a thread that cannot get its memory. */
static void ggmlpy_rq4k_id_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
#if GGMLPY_X86
    const struct ggml_tensor * w = (const struct ggml_tensor *) userdata, * x = dst->src[0], * ids = dst->src[1];
    const int64_t k = w->ne[0], nb = k / 256, groups = w->ne[1] / 8, n_expert = w->ne[2];
    const int64_t xb = x->ne[1], n_used = ids->ne[0], n_pairs = x->ne[2] * n_used;
    const int64_t j0 = n_pairs * ith / nth, j1 = n_pairs * (ith + 1) / nth;
    const size_t xrow = (size_t) nb * GGMLPY_GQ_BYTES, gbytes = (size_t) nb * GGMLPY_GP_BYTES;
    const int64_t window = gbytes < GGMLPY_GP_WINDOW ? GGMLPY_GP_WINDOW / (int64_t) gbytes : 1;
    const int64_t span = groups < window ? groups : window;
    if (j0 >= j1) return;
    int64_t * start = NULL, * pairs = NULL;
    char * xq = NULL, * gp = NULL;
    if (!ggmlpy_rq_id_sort(ids, n_expert, &start, &pairs)) {
        for (int64_t p = j0; p < j1; p++) ggmlpy_rq_id_nan(dst, &p, 1, n_used, 0, w->ne[1]);   /* unsorted: its share */
        return;
    }
    const int64_t most = ggmlpy_rq_id_most(start, n_expert, j0, j1);
    xq = most ? (char *) malloc((size_t) most * xrow) : NULL;
    gp = most ? (char *) aligned_alloc(64, gbytes * (size_t) span) : NULL;
    if (most && (xq == NULL || gp == NULL)) {
        ggmlpy_rq_id_nan(dst, pairs + j0, j1 - j0, n_used, 0, w->ne[1]);
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
            ggmlpy_gq_row((const float *) ((const char *) x->data + v * x->nb[1] + t * x->nb[2]), k, xq + j * xrow);
        }
        const char * we = (const char *) w->data + e * w->nb[2];
        for (int64_t w0 = 0; w0 < groups; w0 += window) {
            const int64_t w1 = w0 + window < groups ? w0 + window : groups;
            for (int64_t g = w0; g < w1; g++) {
                ggmlpy_gp_prepare(we + g * nb * GGMLPY_RQ4K_BLOCK, nb, gp + (g - w0) * gbytes);
            }
            for (int64_t j = 0; j < cnt; j += GGMLPY_GEMM_TILE) {
                const int T = (int) (cnt - j < GGMLPY_GEMM_TILE ? cnt - j : GGMLPY_GEMM_TILE);
                char * rows[GGMLPY_GEMM_TILE];
                for (int c = 0; c < T; c++) {
                    rows[c] = (char *) dst->data + (pe[j + c] % n_used) * dst->nb[1] + (pe[j + c] / n_used) * dst->nb[2];
                }
                for (int64_t g = w0; g < w1; g++) {
                    float * out[GGMLPY_GEMM_TILE];
                    for (int c = 0; c < T; c++) out[c] = (float *) rows[c] + g * 8;
                    ggmlpy_gp_tile(gp + (g - w0) * gbytes, nb, xq + j * xrow, xrow, out, T, 1);
                }
            }
        }
    }
done:
    free(start); free(pairs); free(xq); free(gp);
#else
    (void) dst; (void) ith; (void) nth; (void) userdata;
#endif
}

struct ggml_tensor * ggmlpy_mul_mat_id_rq4k(struct ggml_context * ctx, struct ggml_tensor * w, struct ggml_tensor * x,
                                            struct ggml_tensor * ids) {
    struct ggml_tensor * args[2] = {x, ids};
    return ggml_custom_4d(ctx, GGML_TYPE_F32, w->ne[1], ids->ne[0], x->ne[2], 1, args, 2, ggmlpy_rq4k_id_op,
                          GGML_N_TASKS_MAX, w);
}

struct ggml_tensor * ggmlpy_mul_mat_rq4k(struct ggml_context * ctx, struct ggml_tensor * w, struct ggml_tensor * x) {
    struct ggml_tensor * args[1] = {x};
    struct ggml_tensor * xq = ggml_custom_4d(ctx, GGML_TYPE_I8, x->ne[0] / 256 * GGMLPY_GQ_BYTES, x->ne[1], 1, 1, args,
                                             1, ggmlpy_gq_op, GGML_N_TASKS_MAX, NULL);
    args[0] = xq;
    return ggml_custom_4d(ctx, GGML_TYPE_F32, w->ne[1], x->ne[1], 1, 1, args, 1, ggmlpy_rq4k_gemm_op,
                          GGML_N_TASKS_MAX, w);
}
