/* GeGLU with GELU's tanh form evaluated for every value, as a ggml custom op (Context.geglu_tanh).

   Why: ggml's CPU geglu reads GELU from a float16 table, one value at a time (rounding x to
   float16 first: relative errors up to ~5e-4), and is ten times slower than its vectorised swiglu
   (a 512 x 2048 gemma3 prompt: 2.1 against 0.2 ms on one thread; 4% of a 110M gemma3 prompt).
   Here gelu_tanh(x) = x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3) (the same function as
   0.5 x (1 + tanh u), transformers' gelu_pytorch_tanh), with the sigmoid from exp(-|2u|) so the
   exponential stays in its accurate range; in float32 throughout, 16 values at a time with AVX-512. */
#include <math.h>
#include <stdint.h>
#include "ggml.h"
#include "simd.h"
#include "kernels.h"

#if GGMLPY_X86
#define GGMLPY_AVX512 GGMLPY_AVX512_FMA
#endif

#define GGMLPY_GLU_CHUNK 256          /* values a unit of work holds */

/* Process-wide: 0 forces the portable loop where the vectorised one would run (for tests). */
int ggmlpy_glu_allow_vector = 1;

int ggmlpy_glu_vectorized(void) {
    return ggmlpy_cpu_has(GGMLPY_CPU_AVX512_FMA) && ggmlpy_glu_allow_vector && !ggmlpy_kernels_portable;
}

static inline float ggmlpy_gelu_tanh(float x) {
    const float z = 1.5957691216057308f * (x + 0.044715f * x * x * x);     /* 2u */
    const float e = expf(-fabsf(z));
    return x * (z >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e));
}

static void ggmlpy_geglu_ref(const float * x, const float * g, float * y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = ggmlpy_gelu_tanh(x[i]) * g[i];
}

#if GGMLPY_X86
GGMLPY_AVX512 static void ggmlpy_geglu_avx512(const float * x, const float * g, float * y, int64_t n) {
    const __m512 c = _mm512_set1_ps(1.5957691216057308f), c3 = _mm512_set1_ps(0.044715f), one = _mm512_set1_ps(1.0f);
    const __m512i sign = _mm512_set1_epi32((int) 0x80000000u);
    int64_t i = 0;
    for (; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? (__mmask16) 0xFFFF : (__mmask16) ((1u << (n - i)) - 1);
        const __m512 v = _mm512_maskz_loadu_ps(m, x + i);
        const __m512 z = _mm512_mul_ps(c, _mm512_fmadd_ps(_mm512_mul_ps(c3, v), _mm512_mul_ps(v, v), v));
        const __m512 nabs = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(z), sign));     /* -|z| */
        const __m512 e = ggmlpy_pf_exp512(nabs);
        const __m512 inv = _mm512_div_ps(one, _mm512_add_ps(one, e));
        const __mmask16 neg = _mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_LT_OQ);
        const __m512 s = _mm512_mask_mul_ps(inv, neg, e, inv);          /* z < 0: e / (1 + e) */
        _mm512_mask_storeu_ps(y + i, m, _mm512_mul_ps(_mm512_mul_ps(v, s), _mm512_maskz_loadu_ps(m, g + i)));
    }
}
#endif

/* src[0] a F32: with one source, rows of 2n (x then g); with two, x = src[0] and g = src[1], rows of
   n; both contiguous. dst F32 rows of n, contiguous. Work: (row, chunk of GGMLPY_GLU_CHUNK) units,
   one contiguous run per thread (a token's row alone still splits across the threads). */
static void ggmlpy_geglu_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) userdata;
    const struct ggml_tensor * a = dst->src[0], * b = dst->src[1];
    const int64_t n = dst->ne[0], rows = ggml_nrows(dst), per_row = (n + GGMLPY_GLU_CHUNK - 1) / GGMLPY_GLU_CHUNK;
    const int64_t units = rows * per_row, u0 = units * ith / nth, u1 = units * (ith + 1) / nth;
    const int vec = ggmlpy_glu_vectorized();
    for (int64_t u = u0; u < u1; u++) {
        const int64_t r = u / per_row, c0 = (u % per_row) * GGMLPY_GLU_CHUNK;
        const int64_t len = n - c0 < GGMLPY_GLU_CHUNK ? n - c0 : GGMLPY_GLU_CHUNK;
        const float * x = b ? (const float *) a->data + r * n + c0 : (const float *) a->data + r * 2 * n + c0;
        const float * g = b ? (const float *) b->data + r * n + c0 : x + n;
        float * y = (float *) dst->data + r * n + c0;
#if GGMLPY_X86
        if (vec) { ggmlpy_geglu_avx512(x, g, y, len); continue; }
#endif
        (void) vec;
        ggmlpy_geglu_ref(x, g, y, len);
    }
}

struct ggml_tensor * ggmlpy_geglu_tanh(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b) {
    struct ggml_tensor * args[2] = {a, b};
    const int64_t n = b ? a->ne[0] : a->ne[0] / 2;
    return ggml_custom_4d(ctx, GGML_TYPE_F32, n, a->ne[1], a->ne[2], a->ne[3], args, b ? 2 : 1, ggmlpy_geglu_op,
                          GGML_N_TASKS_MAX, NULL);
}
