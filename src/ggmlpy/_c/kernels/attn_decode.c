/* Attention of a few query rows over a float16 or float32 KV cache, the generation step's
   attention, as a ggml custom op (Context.attn_decode).

   Why: ggml's CPU flash attention walks the cache one position at a time (a 64-wide dot, an
   online-softmax update with a scalar expf, a 64-wide multiply-add into float16 accumulators), and
   one head at a time, so at depth a generated token spends more time there than its K/V bytes take
   to read. Here positions go in blocks: the block's scores, one max, a vectorised exp, then the
   weighted V rows summed in float32. The positions a row sees are cut into chunks, one per
   thread, whose partial results (max, sum, weighted V) a second op merges; in a cache (a cell holds
   every head side by side) a thread reads its chunk cell by cell over all heads, one sequential
   stream, which is what the memory system serves fastest (measured: 110M model, 12 layers at
   depth 576, 2 threads, cold caches: 0.65 ms against 1.0 ms one head at a time, 1.5 ms for ggml's).

   On AVX-512 CPUs a cache with grouped-query heads is read by a path that converts each K and V row
   once for all the query heads of its kv head, below.

   Semantics are flash_attn_ext's without ALiBi, soft-capping or sinks: out = softmax(scale q.k +
   mask) v, grouped-query heads broadcast, a fully masked row gives zeros, and a cell the mask hides
   never enters the result whatever its K and V hold (ggml skips such cells too). */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "ggml.h"
#include "simd.h"
#include "kernels.h"


#define GGMLPY_ATTN_BLOCK 128        /* positions scored before their V rows are summed */
#define GGMLPY_ATTN_STACK 16384     /* floats of per-head state and scores on the stack (64 KiB: 32 heads of 128) */


/* ---- portable path ---------------------------------------------------------------------- */

static void ggmlpy_attn_scores_ref(const float * q, const char * k, size_t nb, int f16, int64_t dk,
                                   int64_t b0, int64_t n, float * out) {
    for (int64_t i = 0; i < n; i++) {
        const char * row = k + (size_t) (b0 + i) * nb;
        float acc = 0.0f;
        if (f16) {
            for (int64_t d = 0; d < dk; d++) acc += q[d] * ggmlpy_attn_h2f(((const ggml_fp16_t *) row)[d]);
        } else {
            for (int64_t d = 0; d < dk; d++) acc += q[d] * ((const float *) row)[d];
        }
        out[i] = acc;
    }
}

static void ggmlpy_attn_vsum_ref(const float * w, const char * v, size_t nb, int f16, int64_t dv,
                                 int64_t b0, int64_t n, float * acc) {
    for (int64_t i = 0; i < n; i++) {
        if (w[i] == 0.0f) continue;
        const char * row = v + (size_t) (b0 + i) * nb;
        if (f16) {
            for (int64_t d = 0; d < dv; d++) acc[d] += w[i] * ggmlpy_attn_h2f(((const ggml_fp16_t *) row)[d]);
        } else {
            for (int64_t d = 0; d < dv; d++) acc[d] += w[i] * ((const float *) row)[d];
        }
    }
}

static void ggmlpy_attn_exp_ref(float * x, int64_t n, float m) {
    for (int64_t i = 0; i < n; i++) x[i] = x[i] == -INFINITY ? 0.0f : expf(x[i] - m);
}

/* How many cells ahead the rows path prefetches the K and V it reads next (0: none); a variable so
   bench/attention.py can compare distances in one process. */
int64_t ggmlpy_attn_pfd = 8;

/* ---- AVX2 + FMA + F16C path ------------------------------------------------------------- */
#if GGMLPY_X86

GGMLPY_AVX2 static inline __m256 ggmlpy_attn_load8(const char * p, int f16) {
    return f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) p)) : _mm256_loadu_ps((const float *) p);
}

GGMLPY_AVX2 static inline float ggmlpy_attn_hsum8(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

/* out[i] = q.k_i for positions b0..b0+n of one head (rows nb apart), four rows at a time (their sums
   reduced together); dk % 8 == 0. */
GGMLPY_AVX2 static void ggmlpy_attn_scores_avx2(const float * q, const char * k, size_t nb, int f16, int64_t dk,
                                                int64_t b0, int64_t n, float * out) {
    const size_t es = f16 ? 2 : 4;
    const char * r = k + (size_t) b0 * nb;
    int64_t i = 0;
    for (; i + 4 <= n; i += 4, r += 4 * nb) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t d = 0; d < dk; d += 8) {
            const __m256 qv = _mm256_loadu_ps(q + d);
            a0 = _mm256_fmadd_ps(qv, ggmlpy_attn_load8(r + d * es, f16), a0);
            a1 = _mm256_fmadd_ps(qv, ggmlpy_attn_load8(r + nb + d * es, f16), a1);
            a2 = _mm256_fmadd_ps(qv, ggmlpy_attn_load8(r + 2 * nb + d * es, f16), a2);
            a3 = _mm256_fmadd_ps(qv, ggmlpy_attn_load8(r + 3 * nb + d * es, f16), a3);
        }
        /* (a0 a1 a2 a3) -> four sums */
        const __m256 h01 = _mm256_hadd_ps(a0, a1), h23 = _mm256_hadd_ps(a2, a3), h = _mm256_hadd_ps(h01, h23);
        _mm_storeu_ps(out + i, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    }
    for (; i < n; i++, r += nb) {
        __m256 a = _mm256_setzero_ps();
        for (int64_t d = 0; d < dk; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), ggmlpy_attn_load8(r + d * es, f16), a);
        out[i] = ggmlpy_attn_hsum8(a);
    }
}

/* acc[0:dv] += sum_i w[i] v_i over positions b0..b0+n of one head; dv % 8 == 0. 32 columns at a
   time stay in registers over the block. */
GGMLPY_AVX2 static void ggmlpy_attn_vsum_avx2(const float * w, const char * v, size_t nb, int f16, int64_t dv,
                                              int64_t b0, int64_t n, float * acc) {
    const size_t es = f16 ? 2 : 4;
    const char * base = v + (size_t) b0 * nb;
    int64_t d = 0;
    for (; d + 32 <= dv; d += 32) {
        __m256 a0 = _mm256_loadu_ps(acc + d), a1 = _mm256_loadu_ps(acc + d + 8);
        __m256 a2 = _mm256_loadu_ps(acc + d + 16), a3 = _mm256_loadu_ps(acc + d + 24);
        const char * r = base + d * es;
        for (int64_t i = 0; i < n; i++, r += nb) {
            if (w[i] == 0.0f) continue;
            const __m256 wi = _mm256_set1_ps(w[i]);
            a0 = _mm256_fmadd_ps(wi, ggmlpy_attn_load8(r, f16), a0);
            a1 = _mm256_fmadd_ps(wi, ggmlpy_attn_load8(r + 8 * es, f16), a1);
            a2 = _mm256_fmadd_ps(wi, ggmlpy_attn_load8(r + 16 * es, f16), a2);
            a3 = _mm256_fmadd_ps(wi, ggmlpy_attn_load8(r + 24 * es, f16), a3);
        }
        _mm256_storeu_ps(acc + d, a0); _mm256_storeu_ps(acc + d + 8, a1);
        _mm256_storeu_ps(acc + d + 16, a2); _mm256_storeu_ps(acc + d + 24, a3);
    }
    for (; d < dv; d += 8) {
        __m256 a = _mm256_loadu_ps(acc + d);
        const char * r = base + d * es;
        for (int64_t i = 0; i < n; i++, r += nb) {
            if (w[i] != 0.0f) a = _mm256_fmadd_ps(_mm256_set1_ps(w[i]), ggmlpy_attn_load8(r, f16), a);
        }
        _mm256_storeu_ps(acc + d, a);
    }
}


#endif

/* 0: the AVX-512 path is never taken (process-wide; tests and benchmarks compare the paths) */
int ggmlpy_attn_allow_512 = 1;

/* 1 where the AVX2 path runs: the CPU has it, the head sizes are multiples of 8 and the portable
   path is not forced */
int ggmlpy_attn_use_avx2(int64_t dk, int64_t dv) {
    return ggmlpy_cpu_has(GGMLPY_CPU_AVX2) && !ggmlpy_kernels_portable && dk % 8 == 0 && dv % 8 == 0;
}

/* 1 where the cache layout's AVX-512 path runs: the CPU has AVX-512F, the head sizes are multiples
   of 16, the AVX2 path may run and the switch above allows it */
int ggmlpy_attn_use_avx512(int64_t dk, int64_t dv) {
    return ggmlpy_cpu_has(GGMLPY_CPU_AVX512F) && ggmlpy_attn_allow_512 && ggmlpy_attn_use_avx2(dk, dv)
           && dk % 16 == 0 && dv % 16 == 0;
}

/* The running softmax of one (row, head): m the largest score so far, l the sum of exp(score - m),
   acc (dv floats, after the struct's owner) the exp-weighted sum of V rows. */
typedef struct { float m, l; } ggmlpy_attn_state;

/* The softmax step's middle, given the block's maximum bm (its scores x[0:n] already masked): 0,
   with x all zeros, when the whole block is masked; else 1 with the running maximum moved to bm
   where bm is larger, and what was summed so far (acc[0:dv], l) rescaled to it. */
static inline int ggmlpy_attn_new_max(float * x, int64_t n, float bm, ggmlpy_attn_state * st, float * acc,
                                      int64_t dv) {
    if (bm == -INFINITY) {
        memset(x, 0, (size_t) n * sizeof(float));
        return 0;
    }
    if (bm > st->m) {                  /* a new maximum: what was summed so far shrinks */
        const float f = st->m == -INFINITY ? 0.0f : expf(st->m - bm);
        for (int64_t d = 0; d < dv; d++) acc[d] *= f;
        st->l *= f;
        st->m = bm;
    }
    return 1;
}

/* The block's scores x[0:n] (of positions b0..) into one head's running softmax: the mask added,
   the running maximum moved (what was summed so far rescaled), x replaced by the weights
   exp(x - m) and their sum added to l. Returns 0, with x all zeros, when the whole block is masked. */
static int ggmlpy_attn_softmax_step(float * x, int64_t n, const ggml_fp16_t * mask, int64_t b0,
                                    ggmlpy_attn_state * st, float * acc, int64_t dv, int avx2) {
    float bm = -INFINITY;
    for (int64_t i = 0; i < n; i++) {
        if (mask) {                    /* a masked cell's score is -inf whatever its K holds */
            const float mv = ggmlpy_attn_h2f(mask[b0 + i]);
            x[i] = mv == -INFINITY ? -INFINITY : x[i] + mv;
        }
        bm = x[i] > bm ? x[i] : bm;
    }
    if (!ggmlpy_attn_new_max(x, n, bm, st, acc, dv)) return 0;
#if GGMLPY_X86
    if (avx2) ggmlpy_attn_exp_avx2(x, n, st->m); else
#endif
    ggmlpy_attn_exp_ref(x, n, st->m);
    (void) avx2;
    for (int64_t i = 0; i < n; i++) st->l += x[i];
    return 1;
}

/* Where a thread's heads read: the cache, the running state of each head (scaled q, acc, m, l). */
typedef struct {
    const char * k; size_t k_nb1, k_nb2; int k_f16;
    const char * v; size_t v_nb1, v_nb2; int v_f16;
    const ggml_fp16_t * mask;          /* the query row's mask, or NULL */
    int64_t dk, dv, group, h0, nh, stride;
    int avx2;
} ggmlpy_attn_group;

/* Positions [b0, b0 + n) into the running state of each head of the group in turn (the heads' slices
   of a block of cells are read close together in time); sc is scratch of GGMLPY_ATTN_BLOCK floats. */
static void ggmlpy_attn_block(const ggmlpy_attn_group * g, float * work, int64_t b0, int64_t n, float * sc) {
    for (int64_t j = 0; j < g->nh; j++) {
        const int64_t kvh = (g->h0 + j) / g->group;
        const char * k = g->k + (size_t) kvh * g->k_nb2, * v = g->v + (size_t) kvh * g->v_nb2;
        const float * q = work + j * g->stride;
        float * acc = work + j * g->stride + g->dk;
        ggmlpy_attn_state * st = (ggmlpy_attn_state *) (acc + g->dv);
#if GGMLPY_X86
        if (g->avx2) ggmlpy_attn_scores_avx2(q, k, g->k_nb1, g->k_f16, g->dk, b0, n, sc); else
#endif
        ggmlpy_attn_scores_ref(q, k, g->k_nb1, g->k_f16, g->dk, b0, n, sc);
        if (!ggmlpy_attn_softmax_step(sc, n, g->mask, b0, st, acc, g->dv, g->avx2)) continue;
#if GGMLPY_X86
        if (g->avx2) ggmlpy_attn_vsum_avx2(sc, v, g->v_nb1, g->v_f16, g->dv, b0, n, acc); else
#endif
        ggmlpy_attn_vsum_ref(sc, v, g->v_nb1, g->v_f16, g->dv, b0, n, acc);
    }
}

#if GGMLPY_X86
/* ggmlpy_attn_softmax_step for the rows path: the block's mask already in float32 (mf, converted
   once for all the heads; NULL: none), the add, the maximum and the sum vectorised. The same
   arithmetic per value; l's sum in another order. */
GGMLPY_AVX2 static int ggmlpy_attn_softmax_step_avx2(float * x, int64_t n, const float * mf, ggmlpy_attn_state * st,
                                                     float * acc, int64_t dv) {
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        if (mf) {                      /* a masked cell's score is -inf whatever its K holds */
            const __m256 mv = _mm256_loadu_ps(mf + i), ninf = _mm256_set1_ps(-INFINITY);
            v = _mm256_blendv_ps(_mm256_add_ps(v, mv), ninf, _mm256_cmp_ps(mv, ninf, _CMP_EQ_OQ));
        }
        _mm256_storeu_ps(x + i, v);
        vmax = _mm256_max_ps(vmax, v);
    }
    float bm = -INFINITY;
    {
        float t[8];
        _mm256_storeu_ps(t, vmax);
        for (int j = 0; j < 8; j++) bm = t[j] > bm ? t[j] : bm;
    }
    for (; i < n; i++) {
        if (mf) x[i] = mf[i] == -INFINITY ? -INFINITY : x[i] + mf[i];
        bm = x[i] > bm ? x[i] : bm;
    }
    if (!ggmlpy_attn_new_max(x, n, bm, st, acc, dv)) return 0;
    ggmlpy_attn_exp_avx2(x, n, st->m);
    __m256 vs = _mm256_setzero_ps();
    for (i = 0; i + 8 <= n; i += 8) vs = _mm256_add_ps(vs, _mm256_loadu_ps(x + i));
    float l = ggmlpy_attn_hsum8(vs);
    for (; i < n; i++) l += x[i];
    st->l += l;
    return 1;
}

/* acc[0:64] += w * v[0:64]: the common head size with the loop unrolled */
GGMLPY_AVX2 static inline void ggmlpy_attn_axpy64(float * acc, __m256 wv, const char * vh, int f16) {
    for (int d = 0; d < 64; d += 8) {
        _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(wv, ggmlpy_attn_load8(vh + d * (f16 ? 2 : 4), f16), _mm256_loadu_ps(acc + d)));
    }
}

/* ggmlpy_attn_block for AVX2, position by position over the group's heads: the cache is then read
   in address order (a cell's heads lie side by side), and the scores and V sums of every head are
   done in one function (no call per head and position). */
GGMLPY_AVX2 static void ggmlpy_attn_block_rows_avx2(const ggmlpy_attn_group * g, float * work, int64_t b0, int64_t n,
                                                    float * sc) {
    const size_t kes = g->k_f16 ? 2 : 4, ves = g->v_f16 ? 2 : 4;
    const int64_t dk = g->dk, dv = g->dv, nh = g->nh;
    /* bytes of a cell the group's heads span; prefetched ggmlpy_attn_pfd cells ahead (bench/attention.py,
       12 layers at 576 cells: one chunk 1.59 -> 0.71 ms, two chunks 0.53 -> 0.49 ms) */
    const size_t k_span = (size_t) nh * g->k_nb2 / g->group, v_span = (size_t) nh * g->v_nb2 / g->group;
    /* each head's slice of a cell, in bytes (a division per position and head: 4 layers hot, 0.21 ->
       0.185 ms without it); the op gives a call fewer than GGMLPY_ATTN_STACK / GGMLPY_ATTN_BLOCK heads */
    size_t kof[GGMLPY_ATTN_STACK / GGMLPY_ATTN_BLOCK], vof[GGMLPY_ATTN_STACK / GGMLPY_ATTN_BLOCK];
    for (int64_t j = 0; j < nh; j++) {
        kof[j] = (size_t) ((g->h0 + j) / g->group) * g->k_nb2;
        vof[j] = (size_t) ((g->h0 + j) / g->group) * g->v_nb2;
    }
    for (int64_t i = 0; i < n; i++) {
        const char * row = g->k + (size_t) (b0 + i) * g->k_nb1;
        if (ggmlpy_attn_pfd) {              /* the group's heads in the cell pfd ahead (a hint: never faults) */
            const char * pr = row + ggmlpy_attn_pfd * g->k_nb1 + kof[0];
            for (size_t o = 0; o < k_span; o += 64) _mm_prefetch(pr + o, _MM_HINT_T0);
        }
        for (int64_t j = 0; j < nh; j++) {
            const char * kh = row + kof[j];
            const float * q = work + j * g->stride;
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
            int64_t d = 0;
            for (; d + 16 <= dk; d += 16) {
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), ggmlpy_attn_load8(kh + d * kes, g->k_f16), a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), ggmlpy_attn_load8(kh + (d + 8) * kes, g->k_f16), a1);
            }
            if (d < dk) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), ggmlpy_attn_load8(kh + d * kes, g->k_f16), a0);
            sc[j * GGMLPY_ATTN_BLOCK + i] = ggmlpy_attn_hsum8(_mm256_add_ps(a0, a1));
        }
    }
    /* the block's mask, once for every head (it is the row's, not the head's) */
    float mf[GGMLPY_ATTN_BLOCK];
    if (g->mask) {
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps(mf + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (g->mask + b0 + i))));
        for (; i < n; i++) mf[i] = ggmlpy_attn_h2f(g->mask[b0 + i]);
    }
    int live = 0;
    for (int64_t j = 0; j < nh; j++) {
        float * x = sc + j * GGMLPY_ATTN_BLOCK, * acc = work + j * g->stride + dk;
        ggmlpy_attn_state * st = (ggmlpy_attn_state *) (acc + dv);
        live |= ggmlpy_attn_softmax_step_avx2(x, n, g->mask ? mf : NULL, st, acc, dv);
    }
    if (!live) return;
    for (int64_t i = 0; i < n; i++) {
        const char * row = g->v + (size_t) (b0 + i) * g->v_nb1;
        if (ggmlpy_attn_pfd) {
            const char * pr = row + ggmlpy_attn_pfd * g->v_nb1 + vof[0];
            for (size_t o = 0; o < v_span; o += 64) _mm_prefetch(pr + o, _MM_HINT_T0);
        }
        for (int64_t j = 0; j < nh; j++) {
            const float w = sc[j * GGMLPY_ATTN_BLOCK + i];
            if (w == 0.0f) continue;
            const char * vh = row + vof[j];
            float * acc = work + j * g->stride + dk;
            const __m256 wv = _mm256_set1_ps(w);
            if (dv == 64) {
                if (g->v_f16) ggmlpy_attn_axpy64(acc, wv, vh, 1); else ggmlpy_attn_axpy64(acc, wv, vh, 0);
                continue;
            }
            for (int64_t d = 0; d < dv; d += 8) {
                _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(wv, ggmlpy_attn_load8(vh + d * ves, g->v_f16),
                                                          _mm256_loadu_ps(acc + d)));
            }
        }
    }
}

/* ---- AVX-512 path for the cache layout, grouped-query heads read once ------------------- */
/* In a cache, each of a kv head's query heads (4 in Llama-3.2-1B, 3 in 3B) reads the same K and V
   rows. The AVX2 path above converts a row from float16 once per query head, reduces every score on
   its own and loads and stores its V sums per cell; at the real-size presets' depths it ran at ~3x
   the time the bytes take to read. Here a K row is converted once, 16 floats at a time, for up to
   GGMLPY_ATTN_NQ query heads, four cells at a time, and their 16 scores are reduced together; the
   V sums keep a batch's columns in registers over the whole block.
   bench/attention.py against bench/cache_floor.c, Llama-3.2-1B shapes (8 kv heads of 128, group
   4), 16 layers at depth 4096, 2 threads, cold caches: 52.7 ms (AVX2 path) -> 20.3-22.5 ms here,
   the floor 14-17 ms; at depth 512 6.9 -> 3.3 ms. Without groups (the 110M model's 12 heads of 64)
   attention alone 2.0-2.5 -> 1.8-2.0 ms, but its tokens 0.98x: there the AVX2 path stays. Tried
   and slower here: V prefetched into L2 only, and V of the next block
   spread over the V sums (a prefetch per cell in their inner loop). */
#define GGMLPY_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))
#define GGMLPY_ATTN_NQ 4                  /* query heads a K or V row is read for at once */
#define GGMLPY_INLINE512 GGMLPY_AVX512 static inline __attribute__((always_inline))

GGMLPY_INLINE512 __m512 ggmlpy_attn_load16(const char * p, const int f16) {
    return f16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) p)) : _mm512_loadu_ps((const float *) p);
}

/* r[k] = the sum of v[k]'s 16 lanes, k < 16: a transposing tree (unpack, shuffle, two 128-bit
   shuffles), 45 instructions for 16 sums */
GGMLPY_INLINE512 __m512 ggmlpy_attn_hsum16x16(const __m512 * v) {
    __m512 s2[8], s4[4], s8[2];
    for (int k = 0; k < 8; k++) {     /* per 128-bit lane: v2k(0+2) v2k+1(0+2) v2k(1+3) v2k+1(1+3) */
        s2[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    }
    for (int k = 0; k < 4; k++) {     /* per 128-bit lane: the lane's sums of v4k .. v4k+3 */
        s4[k] = _mm512_add_ps(_mm512_shuffle_ps(s2[2 * k], s2[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_ps(s2[2 * k], s2[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    }
    for (int k = 0; k < 2; k++) {     /* lanes: v8k..8k+3 (L0+L1), (L2+L3), v8k+4..8k+7 (L0+L1), (L2+L3) */
        s8[k] = _mm512_add_ps(_mm512_shuffle_f32x4(s4[2 * k], s4[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(s4[2 * k], s4[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    }
    return _mm512_add_ps(_mm512_shuffle_f32x4(s8[0], s8[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(s8[0], s8[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Scores of NB query heads (q[0..NB), scaled, dk floats each) against the K rows of NP <= 4
   consecutive cells (k0, k0 + nb1, ...: one kv head's slice of each): sc[h * GGMLPY_ATTN_BLOCK + p].
   The dk/16 chunks go to S accumulators per (head, cell) so that NB * 4 * S = 16 independent sums
   hide the FMA latency whatever the group size. */
GGMLPY_INLINE512 void ggmlpy_attn_qk4(const float * const * q, const char * k0, size_t nb1, int64_t dk,
                                      const int NB, const int NP, const int f16, float * sc) {
    const int S = NB == 1 ? 4 : NB == 2 ? 2 : 1;
    const size_t es = f16 ? 2 : 4;
    __m512 a[16];
    for (int t = 0; t < 16; t++) a[t] = _mm512_setzero_ps();
    for (int64_t d = 0; d < dk; d += 16 * S) {
#pragma GCC unroll 4
        for (int s = 0; s < S; s++) {
            if (S > 1 && d + 16 * s >= dk) break;
            __m512 x[4];
#pragma GCC unroll 4
            for (int p = 0; p < NP; p++) x[p] = ggmlpy_attn_load16(k0 + p * nb1 + (d + 16 * s) * es, f16);
#pragma GCC unroll 4
            for (int h = 0; h < NB; h++) {
                const __m512 qv = _mm512_loadu_ps(q[h] + d + 16 * s);
#pragma GCC unroll 4
                for (int p = 0; p < NP; p++) a[(h * 4 + p) * S + s] = _mm512_fmadd_ps(qv, x[p], a[(h * 4 + p) * S + s]);
            }
        }
    }
    if (S > 1) {                      /* (h, p, s) -> (h, p) */
        for (int t = 0; t < 16 / S; t++) {
            __m512 u = a[t * S];
            for (int s = 1; s < S; s++) u = _mm512_add_ps(u, a[t * S + s]);
            a[t] = u;
        }
        for (int t = 16 / S; t < 16; t++) a[t] = _mm512_setzero_ps();
    }
    float r[16];
    _mm512_storeu_ps(r, ggmlpy_attn_hsum16x16(a));
    for (int h = 0; h < NB; h++) {
        if (NP == 4) _mm_storeu_ps(sc + h * GGMLPY_ATTN_BLOCK, _mm_loadu_ps(r + h * 4));
        else for (int p = 0; p < NP; p++) sc[h * GGMLPY_ATTN_BLOCK + p] = r[h * 4 + p];
    }
}

/* acc[h][d0:d0 + 16 C] += sum_i w[h][i] v_i[d0:d0 + 16 C] over a block's n cells for NB query
   heads, w[h] = sc + h * GGMLPY_ATTN_BLOCK, v_i = v + i * nb1 (one kv head's slice), skipping the
   cells mf marks -inf (their V may hold anything). The NB * C sums stay in registers over the whole
   block, so only V is read per cell. */
GGMLPY_INLINE512 void ggmlpy_attn_wv_cols(float * const * acc, const float * sc, const char * v, size_t nb1,
                                          int64_t n, const float * mf, int64_t d0, const int NB, const int C,
                                          const int f16) {
    const size_t es = f16 ? 2 : 4;
    __m512 a[8];
    for (int h = 0; h < NB; h++) {
        for (int c = 0; c < C; c++) a[h * C + c] = _mm512_loadu_ps(acc[h] + d0 + 16 * c);
    }
    const char * r = v + d0 * es;
    for (int64_t i = 0; i < n; i++, r += nb1) {
        if (mf && mf[i] == -INFINITY) continue;
        __m512 x[8];
#pragma GCC unroll 8
        for (int c = 0; c < C; c++) x[c] = ggmlpy_attn_load16(r + 16 * c * es, f16);
#pragma GCC unroll 4
        for (int h = 0; h < NB; h++) {
            const __m512 w = _mm512_set1_ps(sc[h * GGMLPY_ATTN_BLOCK + i]);
#pragma GCC unroll 8
            for (int c = 0; c < C; c++) a[h * C + c] = _mm512_fmadd_ps(w, x[c], a[h * C + c]);
        }
    }
    for (int h = 0; h < NB; h++) {
        for (int c = 0; c < C; c++) _mm512_storeu_ps(acc[h] + d0 + 16 * c, a[h * C + c]);
    }
}

/* All dv columns, as wide as NB * C <= 8 sums allow (at least 6 in flight where dv has the columns:
   that hides the FMA latency), then narrower for what is left */
GGMLPY_INLINE512 void ggmlpy_attn_wv_block(float * const * acc, const float * sc, const char * v, size_t nb1,
                                           int64_t n, const float * mf, int64_t dv, const int NB, const int f16) {
    const int64_t cmax = NB == 1 ? 8 : NB == 2 ? 4 : 2;
    int64_t d = 0;
    for (; d + 16 * cmax <= dv; d += 16 * cmax) {
        ggmlpy_attn_wv_cols(acc, sc, v, nb1, n, mf, d, NB, NB == 1 ? 8 : NB == 2 ? 4 : 2, f16);
    }
    if (NB == 1 && d + 64 <= dv) { ggmlpy_attn_wv_cols(acc, sc, v, nb1, n, mf, d, NB, 4, f16); d += 64; }
    if (NB <= 2 && d + 32 <= dv) { ggmlpy_attn_wv_cols(acc, sc, v, nb1, n, mf, d, NB, 2, f16); d += 32; }
    if (d < dv) ggmlpy_attn_wv_cols(acc, sc, v, nb1, n, mf, d, NB, 1, f16);
}

/* exp(x - m) in place, -inf giving exactly 0: ggmlpy_attn_exp_avx2's arithmetic 16 lanes wide */
GGMLPY_AVX512 static void ggmlpy_attn_exp_512(float * x, int64_t n, float m) {
    const __m512 vm = _mm512_set1_ps(m), log2e = _mm512_set1_ps(1.44269504088896341f);
    const __m512 ln2hi = _mm512_set1_ps(0.693359375f), ln2lo = _mm512_set1_ps(-2.12194440e-4f);
    const __m512 lo = _mm512_set1_ps(-87.3f);
    const __m512 c2 = _mm512_set1_ps(0.5f), c3 = _mm512_set1_ps(1.6666667e-1f), c4 = _mm512_set1_ps(4.1666579e-2f);
    const __m512 c5 = _mm512_set1_ps(8.3333477e-3f), c6 = _mm512_set1_ps(1.3888949e-3f), c7 = _mm512_set1_ps(1.9841261e-4f);
    const __m512 one = _mm512_set1_ps(1.0f);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 t = _mm512_sub_ps(_mm512_loadu_ps(x + i), vm);
        const __mmask16 live = _mm512_cmp_ps_mask(t, lo, _CMP_GE_OQ);   /* not masked, not below a float */
        t = _mm512_max_ps(t, lo);
        const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(t, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m512 r = _mm512_fnmadd_ps(k, ln2hi, t);
        r = _mm512_fnmadd_ps(k, ln2lo, r);
        __m512 p = _mm512_fmadd_ps(c7, r, c6);
        p = _mm512_fmadd_ps(p, r, c5);
        p = _mm512_fmadd_ps(p, r, c4);
        p = _mm512_fmadd_ps(p, r, c3);
        p = _mm512_fmadd_ps(p, r, c2);
        p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, one));
        const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
        _mm512_storeu_ps(x + i, _mm512_maskz_mul_ps(live, p, _mm512_castsi512_ps(e)));
    }
    if (i < n) ggmlpy_attn_exp_avx2(x + i, n - i, m);
}

/* One head's softmax step over the block's scores x[0:n]: the float32 mask mf added (NULL: none),
   where it is -inf the score set to -inf whatever K held, then as ggmlpy_attn_softmax_step_avx2. */
GGMLPY_AVX512 static int ggmlpy_attn_softmax_step_512(float * x, int64_t n, const float * mf, ggmlpy_attn_state * st,
                                                      float * acc, int64_t dv) {
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i);
        if (mf) {
            const __m512 mv = _mm512_loadu_ps(mf + i);
            v = _mm512_mask_mov_ps(_mm512_add_ps(v, mv), _mm512_cmp_ps_mask(mv, ninf, _CMP_EQ_OQ), ninf);
        }
        _mm512_storeu_ps(x + i, v);
        vmax = _mm512_max_ps(vmax, v);
    }
    float bm = _mm512_reduce_max_ps(vmax);
    for (; i < n; i++) {
        if (mf) x[i] = mf[i] == -INFINITY ? -INFINITY : x[i] + mf[i];
        bm = x[i] > bm ? x[i] : bm;
    }
    if (!ggmlpy_attn_new_max(x, n, bm, st, acc, dv)) return 0;
    ggmlpy_attn_exp_512(x, n, st->m);
    __m512 vs = _mm512_setzero_ps();
    for (i = 0; i + 16 <= n; i += 16) vs = _mm512_add_ps(vs, _mm512_loadu_ps(x + i));
    float l = _mm512_reduce_add_ps(vs);
    for (; i < n; i++) l += x[i];
    st->l += l;
    return 1;
}

/* The thread's heads h0.. h0 + nh cut into batches: at most GGMLPY_ATTN_NQ query heads of one kv
   head each (a group the thread's range cuts gives a shorter batch) */
typedef struct { int64_t j0, nb; size_t kof, vof; } ggmlpy_attn_batch;

static int64_t ggmlpy_attn_batches(const ggmlpy_attn_group * g, ggmlpy_attn_batch * out) {
    int64_t n = 0;
    for (int64_t j = 0; j < g->nh;) {
        const int64_t kvh = (g->h0 + j) / g->group, end = (kvh + 1) * g->group - g->h0;
        int64_t nb = (end < g->nh ? end : g->nh) - j;
        if (nb > GGMLPY_ATTN_NQ) nb = GGMLPY_ATTN_NQ;
        out[n].j0 = j;
        out[n].nb = nb;
        out[n].kof = (size_t) kvh * g->k_nb2;
        out[n].vof = (size_t) kvh * g->v_nb2;
        n++;
        j += nb;
    }
    return n;
}

/* ggmlpy_attn_qk4 with NB and NP known where it is inlined */
GGMLPY_INLINE512 void ggmlpy_attn_qk_batch(const float * const * q, const char * k0, size_t nb1, int64_t dk,
                                           const int nb, const int np, const int f16, float * sc) {
#define GGMLPY_ATTN_QK_NP(NB) \
    switch (np) { \
        case 1: ggmlpy_attn_qk4(q, k0, nb1, dk, NB, 1, f16, sc); break; \
        case 2: ggmlpy_attn_qk4(q, k0, nb1, dk, NB, 2, f16, sc); break; \
        case 3: ggmlpy_attn_qk4(q, k0, nb1, dk, NB, 3, f16, sc); break; \
        default: ggmlpy_attn_qk4(q, k0, nb1, dk, NB, 4, f16, sc); break; \
    }
    switch (nb) {
        case 1: GGMLPY_ATTN_QK_NP(1) break;
        case 2: GGMLPY_ATTN_QK_NP(2) break;
        case 3: GGMLPY_ATTN_QK_NP(3) break;
        default: GGMLPY_ATTN_QK_NP(4) break;
    }
#undef GGMLPY_ATTN_QK_NP
}

/* ggmlpy_attn_block_rows_avx2 for AVX-512 (dk, dv multiples of 16). The scores go cell by cell in
   address order, four cells at a time, each batch's query heads against its kv head's slice; the
   K and V spans of the thread's kv heads are prefetched ggmlpy_attn_pfd cells ahead, so that the V
   sums (a batch's columns over the block's cells, V read strided but from the CPU caches) find V
   close. K_F16 and V_F16 are constants where it is called: each layout gets its own loops. */
GGMLPY_INLINE512 void ggmlpy_attn_block_rows_512_t(const ggmlpy_attn_group * g, float * work, int64_t b0, int64_t n,
                                                   float * sc, const int K_F16, const int V_F16) {
    const int64_t dk = g->dk, dv = g->dv;
    ggmlpy_attn_batch bt[GGMLPY_ATTN_STACK / GGMLPY_ATTN_BLOCK];
    memset(bt, 0, sizeof bt[0]);       /* (a thread has one batch at least; gcc cannot tell) */
    const int64_t nbt = ggmlpy_attn_batches(g, bt);
    /* bytes of a cell the thread's kv heads span */
    const size_t k_span = bt[nbt - 1].kof - bt[0].kof + g->k_nb2, v_span = bt[nbt - 1].vof - bt[0].vof + g->v_nb2;
    const float * qs[GGMLPY_ATTN_STACK / GGMLPY_ATTN_BLOCK];
    float * accs[GGMLPY_ATTN_STACK / GGMLPY_ATTN_BLOCK];
    for (int64_t j = 0; j < g->nh; j++) {
        qs[j] = work + j * g->stride;
        accs[j] = work + j * g->stride + dk;
    }
    const char * kb = g->k + (size_t) b0 * g->k_nb1, * vb = g->v + (size_t) b0 * g->v_nb1;
    for (int64_t i = 0; i < n; i += 4) {
        const int np = n - i < 4 ? (int) (n - i) : 4;
        if (ggmlpy_attn_pfd) {          /* a hint: never faults, past the cache's end included */
            const char * pk = kb + (size_t) (i + ggmlpy_attn_pfd) * g->k_nb1 + bt[0].kof;
            const char * pv = vb + (size_t) (i + ggmlpy_attn_pfd) * g->v_nb1 + bt[0].vof;
            for (int p = 0; p < np; p++) {
                for (size_t o = 0; o < k_span; o += 64) _mm_prefetch(pk + p * g->k_nb1 + o, _MM_HINT_T0);
                for (size_t o = 0; o < v_span; o += 64) _mm_prefetch(pv + p * g->v_nb1 + o, _MM_HINT_T0);
            }
        }
        for (int64_t b = 0; b < nbt; b++) {
            ggmlpy_attn_qk_batch(qs + bt[b].j0, kb + (size_t) i * g->k_nb1 + bt[b].kof, g->k_nb1, dk, (int) bt[b].nb,
                                 np, K_F16, sc + bt[b].j0 * GGMLPY_ATTN_BLOCK + i);
        }
    }
    float mf[GGMLPY_ATTN_BLOCK];
    int holes = 0;                    /* masked cells inside the block: the V sums skip them */
    if (g->mask) {
        int64_t i = 0;
        for (; i + 16 <= n; i += 16) _mm512_storeu_ps(mf + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (g->mask + b0 + i))));
        for (; i < n; i++) mf[i] = ggmlpy_attn_h2f(g->mask[b0 + i]);
        for (i = 0; i < n && !holes; i++) holes = mf[i] == -INFINITY;
    }
    int live = 0;
    for (int64_t j = 0; j < g->nh; j++) {
        live |= ggmlpy_attn_softmax_step_512(sc + j * GGMLPY_ATTN_BLOCK, n, g->mask ? mf : NULL,
                                             (ggmlpy_attn_state *) (accs[j] + dv), accs[j], dv);
    }
    if (!live) return;
    for (int64_t b = 0; b < nbt; b++) {
        float * const * acc = accs + bt[b].j0;
        const float * w = sc + bt[b].j0 * GGMLPY_ATTN_BLOCK, * m = holes ? mf : NULL;
        const char * v = vb + bt[b].vof;
        switch (bt[b].nb) {
            case 1: ggmlpy_attn_wv_block(acc, w, v, g->v_nb1, n, m, dv, 1, V_F16); break;
            case 2: ggmlpy_attn_wv_block(acc, w, v, g->v_nb1, n, m, dv, 2, V_F16); break;
            case 3: ggmlpy_attn_wv_block(acc, w, v, g->v_nb1, n, m, dv, 3, V_F16); break;
            default: ggmlpy_attn_wv_block(acc, w, v, g->v_nb1, n, m, dv, 4, V_F16); break;
        }
    }
}

GGMLPY_AVX512 static void ggmlpy_attn_block_rows_512(const ggmlpy_attn_group * g, float * work, int64_t b0, int64_t n,
                                                     float * sc) {
    if (g->k_f16 && g->v_f16) ggmlpy_attn_block_rows_512_t(g, work, b0, n, sc, 1, 1);
    else if (!g->k_f16 && !g->v_f16) ggmlpy_attn_block_rows_512_t(g, work, b0, n, sc, 0, 0);
    else if (g->k_f16) ggmlpy_attn_block_rows_512_t(g, work, b0, n, sc, 1, 0);
    else ggmlpy_attn_block_rows_512_t(g, work, b0, n, sc, 0, 1);
}
#endif

/* The op's tensors: src[0] q (dk, n_head, n_rows) F32, rows contiguous; src[1] k (dk, n_kv,
   n_head_kv); src[2] v (dv, n_kv, n_head_kv), both F16 or F32 with contiguous rows; src[3] the F16
   mask (>= n_kv, >= n_rows) or absent. dst: (dv, n_head, n_rows) with one chunk; (dv + 2, n_chunks,
   n_head, n_rows) partials otherwise. The scale, the chunk count and the path travel in the
   userdata pointer's bits (scale's float bits low, n_chunks high, the top bit "AVX2 path only"),
   so nothing has to outlive the graph.

   Work is (row, chunk, head) units, heads fastest, split evenly across the threads. A thread does
   the heads it got for one (row, chunk) together, block by block of positions, so it reads each
   cache cell's slice of those heads once and in address order (the cache stores a cell's heads
   side by side: one head at a time would stride through memory). */
static inline void * ggmlpy_attn_pack(float scale, int32_t n_chunks, int avx512) {
    uint32_t bits;
    memcpy(&bits, &scale, 4);
    /* the top bit: 1 keeps this node on the AVX2 path where the AVX-512 one would run (the
       calibration measures both and the faster is built) */
    return (void *) (uintptr_t) (((uint64_t) (!avx512) << 63) | ((uint64_t) (uint32_t) n_chunks << 32) | bits);
}

static void ggmlpy_attn_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    const uint64_t packed = (uint64_t) (uintptr_t) userdata;
    const uint32_t bits = (uint32_t) packed;
    float scale;
    memcpy(&scale, &bits, 4);
    const struct ggml_tensor * q = dst->src[0], * k = dst->src[1], * v = dst->src[2], * mask = dst->src[3];
    const int64_t dk = q->ne[0], n_head = q->ne[1], n_rows = q->ne[2], dv = v->ne[0], n_kv = k->ne[1];
    const int64_t group = n_head / k->ne[2], n_chunks = (int64_t) ((packed >> 32) & 0x7fffffff);
    const int64_t units = n_rows * n_chunks * n_head;
    const int64_t u0 = units * ith / nth, u1 = units * (ith + 1) / nth;
    const int avx2 = ggmlpy_attn_use_avx2(dk, dv);
    /* a cache's cell holds its heads side by side: read it position by position over the heads */
    const int rows = avx2 && k->nb[2] < k->nb[1] && v->nb[2] < v->nb[1];
    /* grouped-query heads only: with one query head per kv head nothing is shared, and the 110M
       model's tokens measured 0.98x the AVX2 path's (2 threads, 8 rounds) */
    const int rows512 = rows && group > 1 && !(packed >> 63) && ggmlpy_attn_use_avx512(dk, dv);
    const int64_t stride = dk + dv + 2;          /* per head: scaled q, acc, state */
    float stack[GGMLPY_ATTN_STACK];
    for (int64_t u = u0; u < u1;) {
        const int64_t h0 = u % n_head, rc = u / n_head, c = rc % n_chunks, r = rc / n_chunks;
        /* heads done together: the rest of this (row, chunk) that is this thread's, as many as the
           stack holds (per head the state; then one block's scores) */
        int64_t nh = (n_head - h0 < u1 - u) ? n_head - h0 : u1 - u;
        if (nh > GGMLPY_ATTN_STACK / (stride + GGMLPY_ATTN_BLOCK)) nh = GGMLPY_ATTN_STACK / (stride + GGMLPY_ATTN_BLOCK);
        float * work = stack, * sc = work + nh * stride;   /* rows path: nh blocks of scores */
        const ggml_fp16_t * mrow = mask ? (const ggml_fp16_t *) ((const char *) mask->data + r * mask->nb[1]) : NULL;
        /* the chunks cut the row's visible span: masked cells before it (a sliding window) and after
           it (cells past the sequences, the padding) cost nothing */
        int64_t lo = 0, hi = n_kv;
        if (mrow) {
            while (hi > 0 && mrow[hi - 1] == 0xFC00) hi--;                  /* float16 -inf */
            while (lo < hi && mrow[lo] == 0xFC00) lo++;
        }
        const int64_t chunk = (hi - lo + n_chunks - 1) / n_chunks;
        const int64_t i0 = lo + c * chunk < hi ? lo + c * chunk : hi, i1 = i0 + chunk < hi ? i0 + chunk : hi;
        for (int64_t j = 0; j < nh; j++) {
            float * w = work + j * stride;
            const float * qr = (const float *) ((const char *) q->data + (h0 + j) * q->nb[1] + r * q->nb[2]);
            for (int64_t d = 0; d < dk; d++) w[d] = qr[d] * scale;
            memset(w + dk, 0, (size_t) dv * sizeof(float));
            ((ggmlpy_attn_state *) (w + dk + dv))->m = -INFINITY;
            ((ggmlpy_attn_state *) (w + dk + dv))->l = 0.0f;
        }
        const ggmlpy_attn_group grp = {
            (const char *) k->data, k->nb[1], k->nb[2], k->type == GGML_TYPE_F16,
            (const char *) v->data, v->nb[1], v->nb[2], v->type == GGML_TYPE_F16,
            mrow, dk, dv, group, h0, nh, stride, avx2};
        for (int64_t b0 = i0; b0 < i1; b0 += GGMLPY_ATTN_BLOCK) {
            const int64_t n = i1 - b0 < GGMLPY_ATTN_BLOCK ? i1 - b0 : GGMLPY_ATTN_BLOCK;
#if GGMLPY_X86
            if (rows512) { ggmlpy_attn_block_rows_512(&grp, work, b0, n, sc); continue; }
            if (rows) { ggmlpy_attn_block_rows_avx2(&grp, work, b0, n, sc); continue; }
#endif
            ggmlpy_attn_block(&grp, work, b0, n, sc);
        }
        for (int64_t j = 0; j < nh; j++) {
            const int64_t h = h0 + j;
            const float * w = work + j * stride;
            const ggmlpy_attn_state * st = (const ggmlpy_attn_state *) (w + dk + dv);
            if (n_chunks == 1) {
                float * out = (float *) ((char *) dst->data + h * dst->nb[1] + r * dst->nb[2]);
                const float inv = st->l > 0.0f ? 1.0f / st->l : 0.0f;
                for (int64_t d = 0; d < dv; d++) out[d] = w[dk + d] * inv;
            } else {
                float * out = (float *) ((char *) dst->data + c * dst->nb[1] + h * dst->nb[2] + r * dst->nb[3]);
                out[0] = st->m;
                out[1] = st->l;
                memcpy(out + 2, w + dk, (size_t) dv * sizeof(float));
            }
        }
        u += nh;
    }
}

/* Merges the chunks' partials: src[0] (dv + 2, n_chunks, n_head, n_rows) -> dst (dv, n_head, n_rows). */
static void ggmlpy_attn_merge_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) userdata;
    const struct ggml_tensor * part = dst->src[0];
    const int64_t dv = dst->ne[0], n_head = dst->ne[1], n_rows = dst->ne[2], n_chunks = part->ne[1];
    const int64_t units = n_head * n_rows, u0 = units * ith / nth, u1 = units * (ith + 1) / nth;
    for (int64_t u = u0; u < u1; u++) {
        const int64_t h = u % n_head, r = u / n_head;
        const char * base = (const char *) part->data + h * part->nb[2] + r * part->nb[3];
        float m = -INFINITY, l = 0.0f;
        for (int64_t c = 0; c < n_chunks; c++) {
            const float mc = ((const float *) (base + c * part->nb[1]))[0];
            m = mc > m ? mc : m;
        }
        float * out = (float *) ((char *) dst->data + h * dst->nb[1] + r * dst->nb[2]);
        memset(out, 0, (size_t) dv * sizeof(float));
        if (m == -INFINITY) continue;
        for (int64_t c = 0; c < n_chunks; c++) {
            const float * pc = (const float *) (base + c * part->nb[1]);
            if (pc[0] == -INFINITY) continue;
            const float f = expf(pc[0] - m);
            l += pc[1] * f;
            for (int64_t d = 0; d < dv; d++) out[d] += pc[2 + d] * f;
        }
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        for (int64_t d = 0; d < dv; d++) out[d] *= inv;
    }
}

/* The graph nodes: the attention op, and the merge when the positions are cut into chunks.
   Preconditions are Context.attn_decode's (checked there). NULL when the context is full. */
struct ggml_tensor * ggmlpy_attn_decode(struct ggml_context * ctx, struct ggml_tensor * q,
                                               struct ggml_tensor * k, struct ggml_tensor * v,
                                               struct ggml_tensor * mask, float scale, int n_chunks, int avx512) {
    struct ggml_tensor * args[4] = {q, k, v, mask};
    const int n_args = mask ? 4 : 3;
    const int64_t dv = v->ne[0], n_head = q->ne[1], n_rows = q->ne[2];
    if (n_chunks <= 1) {
        return ggml_custom_4d(ctx, GGML_TYPE_F32, dv, n_head, n_rows, 1, args, n_args, ggmlpy_attn_op,
                              GGML_N_TASKS_MAX, ggmlpy_attn_pack(scale, 1, avx512));
    }
    struct ggml_tensor * part = ggml_custom_4d(ctx, GGML_TYPE_F32, dv + 2, n_chunks, n_head, n_rows, args, n_args,
                                               ggmlpy_attn_op, GGML_N_TASKS_MAX, ggmlpy_attn_pack(scale, n_chunks, avx512));
    if (part == NULL) return NULL;
    return ggml_custom_4d(ctx, GGML_TYPE_F32, dv, n_head, n_rows, 1, &part, 1, ggmlpy_attn_merge_op,
                          GGML_N_TASKS_MAX, NULL);
}
