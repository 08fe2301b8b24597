/* What ggmlpy's kernels share: the x86 test and target attributes, the one CPU probe, the switch
   that forces every kernel onto its portable path, and the conversion and exps that more than one
   kernel uses. Internal to libggmlpy_c (kernels.h is what _core sees). */
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "ggml.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define GGMLPY_X86 1
#define GGMLPY_AVX2 __attribute__((target("avx2,fma,f16c")))
#else
#define GGMLPY_X86 0
#endif

/* What a kernel asks of the CPU before taking its vector path (the answer is cached; the portable
   switch below is the caller's to check). */
enum ggmlpy_cpu_feature {
    GGMLPY_CPU_AVX2,        /* AVX2 and FMA (F16C comes with both) */
    GGMLPY_CPU_AVX512F,     /* AVX-512 F */
    GGMLPY_CPU_AVX512_FMA,  /* AVX-512 F and FMA */
    GGMLPY_CPU_VNNI512,     /* AVX-512 F, BW, VL and VNNI */
};
int ggmlpy_cpu_has(enum ggmlpy_cpu_feature feature);

/* Process-wide, for tests and benchmarks (_core._kernels_force_portable; test_kernels.c): 1 sends
   every kernel down its portable path, as on a CPU without AVX2/AVX-512/VNNI, so one machine tests
   both paths. Their checks of the CPU (what the models ask before choosing a kernel)
   then say no. Defined in cpu.c. */
extern int ggmlpy_kernels_portable;

/* The sort of a mul_mat_id's (token, slot) pairs by expert that the experts' ops of gemv.c and gemm.c
   share: the sort (0 where memory ran out) and the most pairs of one expert in a run of sorted pairs
   (gemm.c), NaN rows for pairs that cannot be computed (gemv.c). */
int ggmlpy_rq_id_sort(const struct ggml_tensor * ids, int64_t n_expert, int64_t ** start, int64_t ** pairs);
int64_t ggmlpy_rq_id_most(const int64_t * start, int64_t n_expert, int64_t j0, int64_t j1);
void ggmlpy_rq_id_nan(struct ggml_tensor * dst, const int64_t * p, int64_t n, int64_t n_used, int64_t r0, int64_t r1);

#if GGMLPY_X86
/* gemm.c's AVX2 rows of a repacked Q4_K weight times a few Q8_K vectors, which gemv.c's repacked path
   takes on a CPU without AVX-512 VNNI (ggmlpy_rq4k_rows' arguments, and the prefetch distance) */
void ggmlpy_rq4k_rows_avx2(const char * w, int64_t nb, int64_t g0, int64_t g1, const char * xq, size_t xrow,
                           const int32_t * bs32, int m, char * const * dst, int64_t pfd);
#endif

/* IEEE half to float by bits: no dependence on the CPU's conversion instructions */
static inline float ggmlpy_attn_h2f(ggml_fp16_t h) {
    uint32_t sign = (uint32_t) (h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {                                   /* subnormal half: normalise */
        int e = -1;
        do { man <<= 1; e++; } while (!(man & 0x400));
        bits = sign | ((uint32_t) (112 - e) << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

#if GGMLPY_X86
/* exp(x - m) in place; -inf (masked) gives exactly 0. A Cody-Waite reduction and a degree-6
   polynomial: within 2 ulp of expf over the range a softmax sees (x - m <= 0). */
GGMLPY_AVX2 static inline void ggmlpy_attn_exp_avx2(float * x, int64_t n, float m) {
    const __m256 vm = _mm256_set1_ps(m), log2e = _mm256_set1_ps(1.44269504088896341f);
    const __m256 ln2hi = _mm256_set1_ps(0.693359375f), ln2lo = _mm256_set1_ps(-2.12194440e-4f);
    const __m256 lo = _mm256_set1_ps(-87.3f);
    const __m256 c2 = _mm256_set1_ps(0.5f), c3 = _mm256_set1_ps(1.6666667e-1f), c4 = _mm256_set1_ps(4.1666579e-2f);
    const __m256 c5 = _mm256_set1_ps(8.3333477e-3f), c6 = _mm256_set1_ps(1.3888949e-3f), c7 = _mm256_set1_ps(1.9841261e-4f);
    const __m256 one = _mm256_set1_ps(1.0f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 t = _mm256_sub_ps(_mm256_loadu_ps(x + i), vm);
        const __m256 dead = _mm256_cmp_ps(t, lo, _CMP_LT_OQ);      /* masked, or too small for a float */
        t = _mm256_max_ps(t, lo);
        const __m256 k = _mm256_round_ps(_mm256_mul_ps(t, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m256 r = _mm256_fnmadd_ps(k, ln2hi, t);
        r = _mm256_fnmadd_ps(k, ln2lo, r);
        __m256 p = _mm256_fmadd_ps(c7, r, c6);
        p = _mm256_fmadd_ps(p, r, c5);
        p = _mm256_fmadd_ps(p, r, c4);
        p = _mm256_fmadd_ps(p, r, c3);
        p = _mm256_fmadd_ps(p, r, c2);
        p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, one));
        const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
        p = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
        _mm256_storeu_ps(x + i, _mm256_andnot_ps(dead, p));
    }
    for (; i < n; i++) x[i] = x[i] == -INFINITY ? 0.0f : expf(x[i] - m);
}

#define GGMLPY_AVX512_FMA __attribute__((target("avx512f,fma,f16c")))

/* exp(t) for t <= 0 (a softmax's x - max; exp(-|2u|) in GELU), 16 lanes: ggmlpy_attn_exp_avx2's
   arithmetic (Cody-Waite, degree 6; within 2 ulp of expf) with AVX-512's scalef; -inf and values
   below the float range give exactly 0. */
GGMLPY_AVX512_FMA static inline __m512 ggmlpy_pf_exp512(__m512 t) {
    const __m512 lo = _mm512_set1_ps(-87.3f);
    const __mmask16 live = _mm512_cmp_ps_mask(t, lo, _CMP_GE_OQ);     /* -inf and NaN-free underflow die */
    t = _mm512_max_ps(t, lo);
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(t, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), t);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(1.9841261e-4f), r, _mm512_set1_ps(1.3888949e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3333477e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1666579e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666667e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, k));
}
#endif
