/* Attention of a prompt's query rows over a float16 or float32 KV cache, as a ggml custom op
   (Context.attn_prefill): the prompt's attention, where attn_decode.c does the generation step's.

   Why: ggml's CPU flash attention does a prompt row by row (a 64-wide dot per position, an
   online-softmax step, a multiply-add per position), so a 512-token prompt of a 110M model spends
   a fifth of its time there (measured: 12 layers, 12 heads of 64, 512 causal rows, 2 threads,
   57 ms of ~290 ms). Here a tile of 64 query rows of one head meets a block of 64 cache positions
   at a time, as two small matrix products in float32 registers:

       S^T (positions x rows) = K_block . Q_tile^T      then an online softmax down each column,
       O^T (dims x rows)     += V_block^T . P^T

   Both are one kernel: rows of C (4 at a time) += a broadcast element of A times a 64-wide row
   of B, 16 accumulators over 4 query-row vectors. Q is transposed and scaled once per tile; each
   block of K and V is converted to float32 once and used by the tile's 64 rows. Blocks the mask
   hides for every row of the tile (a causal prompt's upper triangle) are skipped, blocks it leaves
   whole need no mask, and only the blocks on its edges add it element by element.

   Semantics are flash_attn_ext's without ALiBi or sinks, in float32 throughout (ggml rounds q to
   float16 and sums V in float16 when the cache is float16): out = softmax(s + mask) v with s =
   scale q.k, or softcap * tanh(scale q.k / softcap) (gemma2), grouped-query heads broadcast, a
   fully masked row gives zeros. */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "ggml.h"
#include "simd.h"
#include "kernels.h"

#define GGMLPY_PF_BQ 64            /* query rows of a tile (the B rows of the kernel: 4 vectors of 16) */
#define GGMLPY_PF_BK 64            /* cache positions of a block */

/* A thread's tiles, in floats: Qt (dk x BQ), Kf (BK x dk), Vf (BK x dv4), ST (BK x BQ), Ot (dv4 x BQ),
   and per row m, l, the correction f; dv4 is dv rounded up to 4, the rows the product kernel writes
   at a time (GGMLPY_PF_MAX_D is a multiple of 4). At the largest head size 272 KiB. */
#define GGMLPY_PF_WORK (GGMLPY_PF_MAX_D * GGMLPY_PF_BQ + 2 * GGMLPY_PF_BK * GGMLPY_PF_MAX_D \
                        + GGMLPY_PF_BK * GGMLPY_PF_BQ + GGMLPY_PF_MAX_D * GGMLPY_PF_BQ + 3 * GGMLPY_PF_BQ)

/* Process-wide: 0 forces the portable kernel where the vectorised one would run (for tests). */
int ggmlpy_pf_allow_vector = 1;

#if GGMLPY_X86
#define GGMLPY_AVX512 __attribute__((target("avx512f,fma,f16c")))
#endif

/* 1 where the AVX-512 kernel runs: the CPU has AVX-512F and both head sizes are multiples of 16, at
   most GGMLPY_PF_MAX_D, and neither switch forces the portable kernel */
int ggmlpy_pf_vectorized(int64_t dk, int64_t dv) {
    return ggmlpy_cpu_has(GGMLPY_CPU_AVX512_FMA) && ggmlpy_pf_allow_vector && !ggmlpy_kernels_portable
           && dk % 16 == 0 && dv % 16 == 0 && dk <= GGMLPY_PF_MAX_D && dv <= GGMLPY_PF_MAX_D;
}

/* ---- the product kernel ------------------------------------------------------------------
   C[r][0:BQ] (= or +=) sum_t a[r * ars + t * ats] * B[t][0:BQ], for r = 0..3; C rows ldc floats
   apart, B rows BQ floats. */

static inline void ggmlpy_pf_mk_ref(float * C, int64_t ldc, int acc, const float * a, int64_t ars, int64_t ats,
                             const float * B, int64_t T) {
    for (int r = 0; r < 4; r++) {
        float * c = C + r * ldc;
        if (!acc) memset(c, 0, GGMLPY_PF_BQ * sizeof(float));
        for (int64_t t = 0; t < T; t++) {
            const float x = a[r * ars + t * ats];
            const float * b = B + t * GGMLPY_PF_BQ;
            for (int i = 0; i < GGMLPY_PF_BQ; i++) c[i] += x * b[i];
        }
    }
}

#if GGMLPY_X86
GGMLPY_AVX512 static inline void ggmlpy_pf_mk_avx512(float * C, int64_t ldc, int acc, const float * a, int64_t ars,
                                              int64_t ats, const float * B, int64_t T) {
    __m512 c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32, c33;
    if (acc) {
        c00 = _mm512_loadu_ps(C);           c01 = _mm512_loadu_ps(C + 16);
        c02 = _mm512_loadu_ps(C + 32);      c03 = _mm512_loadu_ps(C + 48);
        c10 = _mm512_loadu_ps(C + ldc);     c11 = _mm512_loadu_ps(C + ldc + 16);
        c12 = _mm512_loadu_ps(C + ldc + 32); c13 = _mm512_loadu_ps(C + ldc + 48);
        c20 = _mm512_loadu_ps(C + 2 * ldc); c21 = _mm512_loadu_ps(C + 2 * ldc + 16);
        c22 = _mm512_loadu_ps(C + 2 * ldc + 32); c23 = _mm512_loadu_ps(C + 2 * ldc + 48);
        c30 = _mm512_loadu_ps(C + 3 * ldc); c31 = _mm512_loadu_ps(C + 3 * ldc + 16);
        c32 = _mm512_loadu_ps(C + 3 * ldc + 32); c33 = _mm512_loadu_ps(C + 3 * ldc + 48);
    } else {
        c00 = c01 = c02 = c03 = c10 = c11 = c12 = c13 = _mm512_setzero_ps();
        c20 = c21 = c22 = c23 = c30 = c31 = c32 = c33 = _mm512_setzero_ps();
    }
    const float * a0 = a, * a1 = a + ars, * a2 = a + 2 * ars, * a3 = a + 3 * ars;
    for (int64_t t = 0; t < T; t++, B += GGMLPY_PF_BQ) {
        const __m512 b0 = _mm512_loadu_ps(B), b1 = _mm512_loadu_ps(B + 16);
        const __m512 b2 = _mm512_loadu_ps(B + 32), b3 = _mm512_loadu_ps(B + 48);
        __m512 x = _mm512_set1_ps(a0[t * ats]);
        c00 = _mm512_fmadd_ps(x, b0, c00); c01 = _mm512_fmadd_ps(x, b1, c01);
        c02 = _mm512_fmadd_ps(x, b2, c02); c03 = _mm512_fmadd_ps(x, b3, c03);
        x = _mm512_set1_ps(a1[t * ats]);
        c10 = _mm512_fmadd_ps(x, b0, c10); c11 = _mm512_fmadd_ps(x, b1, c11);
        c12 = _mm512_fmadd_ps(x, b2, c12); c13 = _mm512_fmadd_ps(x, b3, c13);
        x = _mm512_set1_ps(a2[t * ats]);
        c20 = _mm512_fmadd_ps(x, b0, c20); c21 = _mm512_fmadd_ps(x, b1, c21);
        c22 = _mm512_fmadd_ps(x, b2, c22); c23 = _mm512_fmadd_ps(x, b3, c23);
        x = _mm512_set1_ps(a3[t * ats]);
        c30 = _mm512_fmadd_ps(x, b0, c30); c31 = _mm512_fmadd_ps(x, b1, c31);
        c32 = _mm512_fmadd_ps(x, b2, c32); c33 = _mm512_fmadd_ps(x, b3, c33);
    }
    _mm512_storeu_ps(C, c00);           _mm512_storeu_ps(C + 16, c01);
    _mm512_storeu_ps(C + 32, c02);      _mm512_storeu_ps(C + 48, c03);
    _mm512_storeu_ps(C + ldc, c10);     _mm512_storeu_ps(C + ldc + 16, c11);
    _mm512_storeu_ps(C + ldc + 32, c12); _mm512_storeu_ps(C + ldc + 48, c13);
    _mm512_storeu_ps(C + 2 * ldc, c20); _mm512_storeu_ps(C + 2 * ldc + 16, c21);
    _mm512_storeu_ps(C + 2 * ldc + 32, c22); _mm512_storeu_ps(C + 2 * ldc + 48, c23);
    _mm512_storeu_ps(C + 3 * ldc, c30); _mm512_storeu_ps(C + 3 * ldc + 16, c31);
    _mm512_storeu_ps(C + 3 * ldc + 32, c32); _mm512_storeu_ps(C + 3 * ldc + 48, c33);
}

/* n floats (n % 16 == 0) from a float16 or float32 row */
GGMLPY_AVX512 static inline void ggmlpy_pf_row_avx512(float * dst, const char * src, int f16, int64_t n) {
    for (int64_t d = 0; d < n; d += 16) {
        _mm512_storeu_ps(dst + d, f16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (src + 2 * d)))
                                      : _mm512_loadu_ps((const float *) src + d));
    }
}

/* The block's softmax step, vectorised over the tile's rows (columns of ST): the block maximum, the
   running maximum moved, P = exp(S - m) in place (a masked -inf gives exactly 0), l and the
   correction f = exp(m_old - m_new) by which the caller scales O. exp is ggmlpy_attn_exp_avx2's
   (Cody-Waite, degree 6; within 2 ulp of expf for x - m <= 0) with AVX-512's scalef. */

/* Soft-capping of the block's scores, in place: s -> cap * tanh(s) (the scores were scaled by 1/cap
   with q), tanh from exp(-2|s|), which keeps the exp in its accurate range (x <= 0). */
GGMLPY_AVX512 static inline void ggmlpy_pf_softcap_avx512(float * ST, int64_t n, float cap) {
    const __m512 one = _mm512_set1_ps(1.0f), vcap = _mm512_set1_ps(cap);
    const __m512i sign = _mm512_set1_epi32((int) 0x80000000u);
    for (int64_t i = 0; i < n * GGMLPY_PF_BQ; i += 16) {
        const __m512 s = _mm512_loadu_ps(ST + i);
        const __m512 a = _mm512_castsi512_ps(_mm512_andnot_si512(sign, _mm512_castps_si512(s)));
        const __m512 e = ggmlpy_pf_exp512(_mm512_mul_ps(a, _mm512_set1_ps(-2.0f)));
        const __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
        const __m512i sb = _mm512_and_si512(sign, _mm512_castps_si512(s));
        _mm512_storeu_ps(ST + i, _mm512_mul_ps(vcap, _mm512_castsi512_ps(_mm512_or_si512(sb, _mm512_castps_si512(t)))));
    }
}

GGMLPY_AVX512 static inline void ggmlpy_pf_softmax_avx512(float * ST, int64_t n, float * m, float * l, float * f) {
    for (int q = 0; q < GGMLPY_PF_BQ; q += 16) {
        __m512 bm = _mm512_set1_ps(-INFINITY);
        for (int64_t j = 0; j < n; j++) bm = _mm512_max_ps(bm, _mm512_loadu_ps(ST + j * GGMLPY_PF_BQ + q));
        const __m512 mo = _mm512_loadu_ps(m + q), mn = _mm512_max_ps(mo, bm);
        const __m512 ninf = _mm512_set1_ps(-INFINITY);
        /* rows with nothing visible yet keep m = -inf: subtract 0 there so -inf stays -inf, not NaN */
        const __mmask16 dead = _mm512_cmp_ps_mask(mn, ninf, _CMP_EQ_OQ);
        const __m512 mu = _mm512_mask_mov_ps(mn, dead, _mm512_setzero_ps());
        const __m512 fc = _mm512_mask_mov_ps(ggmlpy_pf_exp512(_mm512_sub_ps(mo, mu)), dead, _mm512_set1_ps(1.0f));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; j++) {
            float * s = ST + j * GGMLPY_PF_BQ + q;
            const __m512 p = ggmlpy_pf_exp512(_mm512_sub_ps(_mm512_loadu_ps(s), mu));
            _mm512_storeu_ps(s, p);
            sum = _mm512_add_ps(sum, p);
        }
        _mm512_storeu_ps(m + q, mn);
        _mm512_storeu_ps(l + q, _mm512_fmadd_ps(_mm512_loadu_ps(l + q), fc, sum));
        _mm512_storeu_ps(f + q, fc);
    }
}

GGMLPY_AVX512 static inline void ggmlpy_pf_rescale_avx512(float * Ot, int64_t dv, const float * f) {
    const __m512 f0 = _mm512_loadu_ps(f), f1 = _mm512_loadu_ps(f + 16);
    const __m512 f2 = _mm512_loadu_ps(f + 32), f3 = _mm512_loadu_ps(f + 48);
    for (int64_t d = 0; d < dv; d++) {
        float * o = Ot + d * GGMLPY_PF_BQ;
        _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_loadu_ps(o), f0));
        _mm512_storeu_ps(o + 16, _mm512_mul_ps(_mm512_loadu_ps(o + 16), f1));
        _mm512_storeu_ps(o + 32, _mm512_mul_ps(_mm512_loadu_ps(o + 32), f2));
        _mm512_storeu_ps(o + 48, _mm512_mul_ps(_mm512_loadu_ps(o + 48), f3));
    }
}

/* Whether 64 float16 mask values are all +-0 (*zero) and all -inf (*dead) */
GGMLPY_AVX512 static inline void ggmlpy_pf_mask64_avx512(const ggml_fp16_t * p, int * zero, int * dead) {
    const __m512i a = _mm512_loadu_si512((const void *) p), b = _mm512_loadu_si512((const void *) (p + 32));
    const __m512i abs = _mm512_set1_epi32(0x7fff7fff), ninf = _mm512_set1_epi32((int) 0xfc00fc00u);
    *zero = _mm512_test_epi32_mask(_mm512_and_si512(_mm512_or_si512(a, b), abs), abs) == 0;
    *dead = _mm512_cmpeq_epi32_mask(a, ninf) == 0xffff && _mm512_cmpeq_epi32_mask(b, ninf) == 0xffff;
}
#endif

static inline void ggmlpy_pf_softmax_ref(float * ST, int64_t n, float * m, float * l, float * f) {
    for (int i = 0; i < GGMLPY_PF_BQ; i++) {
        float bm = -INFINITY;
        for (int64_t j = 0; j < n; j++) bm = ST[j * GGMLPY_PF_BQ + i] > bm ? ST[j * GGMLPY_PF_BQ + i] : bm;
        const float mn = m[i] > bm ? m[i] : bm, mu = mn == -INFINITY ? 0.0f : mn;
        f[i] = mn == -INFINITY ? 1.0f : expf(m[i] - mu);
        float sum = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            float * s = ST + j * GGMLPY_PF_BQ + i;
            *s = *s == -INFINITY ? 0.0f : expf(*s - mu);
            sum += *s;
        }
        m[i] = mn;
        l[i] = l[i] * f[i] + sum;
    }
}

static inline void ggmlpy_pf_softcap_ref(float * ST, int64_t n, float cap) {
    for (int64_t i = 0; i < n * GGMLPY_PF_BQ; i++) ST[i] = cap * tanhf(ST[i]);
}

static inline void ggmlpy_pf_rescale_ref(float * Ot, int64_t dv, const float * f) {
    for (int64_t d = 0; d < dv; d++) {
        for (int i = 0; i < GGMLPY_PF_BQ; i++) Ot[d * GGMLPY_PF_BQ + i] *= f[i];
    }
}

static inline void ggmlpy_pf_row_ref(float * dst, const char * src, int f16, int64_t n) {
    for (int64_t d = 0; d < n; d++) {
        dst[d] = f16 ? ggmlpy_attn_h2f(((const ggml_fp16_t *) src)[d]) : ((const float *) src)[d];
    }
}

static inline void ggmlpy_pf_mask64_ref(const ggml_fp16_t * p, int * zero, int * dead) {
    int z = 1, x = 1;
    for (int j = 0; j < GGMLPY_PF_BK; j++) {
        z &= (p[j] & 0x7fff) == 0;
        x &= p[j] == 0xFC00;
    }
    *zero = z; *dead = x;
}

/* [*lo, *hi): a mask row's span between its leading and trailing float16 -inf (*hi = 0 when the row
   is all -inf); *hi starts as the row's length. Four values per step where they are aligned. */
static void ggmlpy_pf_span(const ggml_fp16_t * mr, int64_t * lo, int64_t * hi) {
    const uint64_t ninf4 = 0xFC00FC00FC00FC00ull;
    int64_t b = *hi, a = 0;
    while (b > 0 && (b & 3)) { if (mr[b - 1] != 0xFC00) goto found_hi; b--; }
    while (b >= 4) {
        uint64_t w;
        memcpy(&w, mr + b - 4, 8);
        if (w != ninf4) break;
        b -= 4;
    }
    while (b > 0 && mr[b - 1] == 0xFC00) b--;
found_hi:
    while (a + 4 <= b) {
        uint64_t w;
        memcpy(&w, mr + a, 8);
        if (w != ninf4) break;
        a += 4;
    }
    while (a < b && mr[a] == 0xFC00) a++;
    *lo = a; *hi = b;
}

/* One unit of work: a tile of query rows of one head, its cache rows and its part of the mask. */
typedef struct {
    float * Qt, * Kf, * Vf, * ST, * Ot, * m, * l, * f;    /* the thread's tiles (GGMLPY_PF_WORK) */
    const char * q; size_t q_nb2;          /* the head's q at the tile's first row; rows q_nb2 apart */
    const char * k, * v; size_t k_nb1, v_nb1; int k16, v16;   /* the head's K and V, cells nb1 apart */
    const char * mask; size_t mask_nb1;    /* the tile's first mask row, or NULL */
    const int64_t * lo, * hi;              /* each row's visible span */
    int64_t nr, dk, dv, dv4, span_lo, span_hi;   /* dv4: Vf's row stride and Ot's rows */
    float scale, softcap;                  /* q's scale (divided by softcap where there is one) */
    float * out; size_t out_nb2;           /* the tile's first output row of the head */
} ggmlpy_pf_tile;

/* the tile function, once portable and once with AVX-512 (the helpers then inline into it) */
#define GGMLPY_PF_NAME ggmlpy_pf_tile_ref
#define GGMLPY_PF_ATTR
#define GGMLPY_PF_FN(name) ggmlpy_pf_##name##_ref
#define GGMLPY_PF_ANY_DV 1
#include "attn_prefill_tile.inc"
#if GGMLPY_X86
#define GGMLPY_PF_NAME ggmlpy_pf_tile_avx512
#define GGMLPY_PF_ATTR GGMLPY_AVX512
#define GGMLPY_PF_FN(name) ggmlpy_pf_##name##_avx512
#define GGMLPY_PF_ANY_DV 0          /* ggmlpy_pf_vectorized: dv % 16 == 0 */
#include "attn_prefill_tile.inc"
#endif

/* The op's tensors are attn_decode's: src[0] q (dk, n_head, n_rows) F32, rows contiguous; src[1] k
   (dk, n_kv, n_head_kv), src[2] v (dv, n_kv, n_head_kv), F16 or F32, rows contiguous; src[3] the
   F16 mask (>= n_kv, >= n_rows) or absent. dst (dv, n_head, n_rows). The scale and the soft cap (0:
   none) travel in the userdata pointer's bits. Work is (tile of rows, head) units dealt to the threads in turn, heads
   fastest, so a causal prompt's long and short tiles spread evenly. */
static void ggmlpy_pf_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    const uint32_t bits = (uint32_t) (uintptr_t) userdata;
    const struct ggml_tensor * q = dst->src[0], * k = dst->src[1], * v = dst->src[2], * mask = dst->src[3];
    const int64_t dk = q->ne[0], n_head = q->ne[1], n_rows = q->ne[2], dv = v->ne[0], n_kv = k->ne[1];
    const int64_t group = n_head / k->ne[2], dv4 = (dv + 3) & ~(int64_t) 3;
    const int vec = ggmlpy_pf_vectorized(dk, dv);
    const int64_t n_tiles = (n_rows + GGMLPY_PF_BQ - 1) / GGMLPY_PF_BQ, units = n_tiles * n_head;
    float work[GGMLPY_PF_WORK] __attribute__((aligned(64)));
    int64_t lo[GGMLPY_PF_BQ], hi[GGMLPY_PF_BQ], span_r0 = -1;
    ggmlpy_pf_tile t;
    memset(&t, 0, sizeof t);
    const uint32_t cap_bits = (uint32_t) ((uint64_t) (uintptr_t) userdata >> 32);
    memcpy(&t.scale, &bits, 4);
    memcpy(&t.softcap, &cap_bits, 4);
    if (t.softcap != 0.0f) t.scale /= t.softcap;
    t.Qt = work; t.Kf = t.Qt + dk * GGMLPY_PF_BQ; t.Vf = t.Kf + GGMLPY_PF_BK * dk; t.ST = t.Vf + GGMLPY_PF_BK * dv4;
    t.Ot = t.ST + GGMLPY_PF_BK * GGMLPY_PF_BQ; t.m = t.Ot + dv4 * GGMLPY_PF_BQ; t.l = t.m + GGMLPY_PF_BQ;
    t.f = t.l + GGMLPY_PF_BQ;
    t.lo = lo; t.hi = hi; t.dk = dk; t.dv = dv; t.dv4 = dv4;
    /* the columns of Vf past dv: zeros the row conversions never overwrite, so the product's last
       4 rows of O^T sum finite values into rows that are never written out */
    if (dv4 != dv) memset(t.Vf, 0, (size_t) GGMLPY_PF_BK * dv4 * sizeof(float));
    t.q_nb2 = q->nb[2]; t.k_nb1 = k->nb[1]; t.v_nb1 = v->nb[1];
    t.k16 = k->type == GGML_TYPE_F16; t.v16 = v->type == GGML_TYPE_F16;
    t.mask_nb1 = mask ? mask->nb[1] : 0; t.out_nb2 = dst->nb[2];
    for (int64_t u = ith; u < units; u += nth) {
        const int64_t h = u % n_head, r0 = (u / n_head) * GGMLPY_PF_BQ;
        t.nr = n_rows - r0 < GGMLPY_PF_BQ ? n_rows - r0 : GGMLPY_PF_BQ;
        t.q = (const char *) q->data + h * q->nb[1] + r0 * q->nb[2];
        t.k = (const char *) k->data + (h / group) * k->nb[2];
        t.v = (const char *) v->data + (h / group) * v->nb[2];
        t.mask = mask ? (const char *) mask->data + r0 * mask->nb[1] : NULL;
        t.out = (float *) ((char *) dst->data + h * dst->nb[1] + r0 * dst->nb[2]);
        /* each row's visible span from its mask (the heads share it: found once per tile); the
           tile's blocks run over their union */
        if (r0 != span_r0) {
            span_r0 = r0;
            t.span_lo = n_kv; t.span_hi = 0;
            for (int64_t i = 0; i < t.nr; i++) {
                int64_t a = 0, b = n_kv;
                if (mask) ggmlpy_pf_span((const ggml_fp16_t *) (t.mask + i * t.mask_nb1), &a, &b);
                lo[i] = a; hi[i] = b;
                if (a < b) {
                    t.span_lo = a < t.span_lo ? a : t.span_lo;
                    t.span_hi = b > t.span_hi ? b : t.span_hi;
                }
            }
        }
#if GGMLPY_X86
        if (vec) { ggmlpy_pf_tile_avx512(&t); continue; }
#endif
        (void) vec;
        ggmlpy_pf_tile_ref(&t);
    }
}

/* The graph node; preconditions are Context.attn_prefill's (checked there). NULL when the context
   is full. */
struct ggml_tensor * ggmlpy_attn_prefill(struct ggml_context * ctx, struct ggml_tensor * q,
                                                struct ggml_tensor * k, struct ggml_tensor * v,
                                                struct ggml_tensor * mask, float scale, float softcap) {
    struct ggml_tensor * args[4] = {q, k, v, mask};
    uint32_t s_bits, c_bits;
    memcpy(&s_bits, &scale, 4);
    memcpy(&c_bits, &softcap, 4);
    /* both floats in the userdata pointer's bits: nothing has to outlive the graph */
    void * packed = (void *) (uintptr_t) (((uint64_t) c_bits << 32) | s_bits);
    return ggml_custom_4d(ctx, GGML_TYPE_F32, v->ne[0], q->ne[1], q->ne[2], 1, args, mask ? 4 : 3, ggmlpy_pf_op,
                          GGML_N_TASKS_MAX, packed);
}
