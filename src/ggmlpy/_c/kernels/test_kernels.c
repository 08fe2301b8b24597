/* ggmlpy's kernels against a plain double-precision reference on random inputs, on the portable path
   (ggmlpy_kernels_portable) and on the vector path this CPU has: attention of a few rows and of a
   prompt (float16 and float32 caches, grouped heads, random masks with fully masked rows, soft-capping),
   the matrix-vector products (F16 and Q8_0 weights; Q8_0's VNNI kernel must equal ggml's vec_dot
   exactly) and GeGLU. Built by CMake as test_kernels in a native build; exit status 0 when all pass. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "ggml.h"
#include "ggml-cpu.h"
#include "kernels.h"

static int failures = 0;
static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static float uniform(void) {          /* in [-1, 1) */
    rng_state ^= rng_state << 13; rng_state ^= rng_state >> 7; rng_state ^= rng_state << 17;
    return (float) ((rng_state >> 40) * (1.0 / (1ull << 23))) - 1.0f;
}

static void fill(struct ggml_tensor * t, float amp) {
    const int64_t n = ggml_nelements(t);
    for (int64_t i = 0; i < n; i++) {
        const float x = amp * uniform();
        if (t->type == GGML_TYPE_F16) ((ggml_fp16_t *) t->data)[i] = ggml_fp32_to_fp16(x);
        else ((float *) t->data)[i] = x;
    }
}

static double get(const struct ggml_tensor * t, int64_t i0, int64_t i1, int64_t i2) {
    const char * p = (const char *) t->data + i0 * t->nb[0] + i1 * t->nb[1] + i2 * t->nb[2];
    return t->type == GGML_TYPE_F16 ? ggml_fp16_to_fp32(*(const ggml_fp16_t *) p) : *(const float *) p;
}

static void compute(struct ggml_context * ctx, struct ggml_tensor * out, int n_threads) {
    struct ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);
    ggml_graph_compute_with_ctx(ctx, gf, n_threads);
}

/* max |got - want| / max(max |want|, floor) */
static double rel_err(const float * got, const double * want, int64_t n) {
    double err = 0.0, scale = 1e-6;
    for (int64_t i = 0; i < n; i++) {
        const double d = fabs((double) got[i] - want[i]);
        err = d > err || isnan(d) ? d : err;
        scale = fabs(want[i]) > scale ? fabs(want[i]) : scale;
    }
    return err / scale;
}

static void check(const char * what, double err, double tol) {
    const int ok = err <= tol;
    printf("%-58s %s  (%.2e <= %.0e)\n", what, ok ? "ok  " : "FAIL", err, tol);
    failures += !ok;
}

/* ---- attention: decode and prefill share the reference */

static void attn_reference(const struct ggml_tensor * q, const struct ggml_tensor * k, const struct ggml_tensor * v,
                           const struct ggml_tensor * mask, float scale, float softcap, double * out) {
    const int64_t dk = q->ne[0], nh = q->ne[1], nr = q->ne[2], dv = v->ne[0], nkv = k->ne[1];
    const int64_t group = nh / k->ne[2];
    double * s = malloc(sizeof(double) * nkv);
    for (int64_t r = 0; r < nr; r++) {
        for (int64_t h = 0; h < nh; h++) {
            double m = -INFINITY, l = 0.0;
            for (int64_t j = 0; j < nkv; j++) {
                double x = 0.0;
                for (int64_t d = 0; d < dk; d++) x += get(q, d, h, r) * get(k, d, j, h / group);
                x *= scale;
                if (softcap > 0.0f) x = softcap * tanh(x / softcap);
                s[j] = x + (mask ? get(mask, j, r, 0) : 0.0);
                m = s[j] > m ? s[j] : m;
            }
            double * o = out + (r * nh + h) * dv;
            memset(o, 0, sizeof(double) * dv);
            if (m == -INFINITY) continue;                 /* a fully masked row: zeros */
            for (int64_t j = 0; j < nkv; j++) {
                const double p = exp(s[j] - m);
                l += p;
                for (int64_t d = 0; d < dv; d++) o[d] += p * get(v, d, j, h / group);
            }
            for (int64_t d = 0; d < dv; d++) o[d] /= l;
        }
    }
    free(s);
}

static void attn_case(int prefill, int64_t dk, int64_t nh, int64_t nh_kv, int64_t nr, int64_t nkv,
                      enum ggml_type kv_type, float softcap) {
    struct ggml_init_params ip = {(size_t) 256 << 20, NULL, false};
    struct ggml_context * ctx = ggml_init(ip);
    struct ggml_tensor * q = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, dk, nh, nr);
    struct ggml_tensor * k = ggml_new_tensor_3d(ctx, kv_type, dk, nkv, nh_kv);
    struct ggml_tensor * v = ggml_new_tensor_3d(ctx, kv_type, dk, nkv, nh_kv);
    struct ggml_tensor * mask = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, GGML_PAD(nkv, 64), GGML_PAD(nr, 64));
    fill(q, 1.0f); fill(k, 1.0f); fill(v, 1.0f);
    for (int64_t r = 0; r < mask->ne[1]; r++) {       /* causal from the end, some cells hidden, row 1 wholly */
        for (int64_t j = 0; j < mask->ne[0]; j++) {
            const int hide = j > nkv - nr + r || uniform() > 0.8f || r == 1;
            ((ggml_fp16_t *) mask->data)[r * mask->ne[0] + j] = ggml_fp32_to_fp16(hide ? -INFINITY : 0.0f);
        }
    }
    const float scale = 1.0f / sqrtf((float) dk);
    double * want = malloc(sizeof(double) * dk * nh * nr);
    attn_reference(q, k, v, mask, scale, softcap, want);
    float * got[2];
    for (int portable = 1; portable >= 0; portable--) {
        ggmlpy_kernels_portable = portable;
        struct ggml_tensor * out = prefill
            ? ggmlpy_attn_prefill(ctx, q, k, v, mask, scale, softcap)
            : ggmlpy_attn_decode(ctx, q, k, v, mask, scale, 2, !portable && ggmlpy_attn_use_avx512(dk, dk));
        compute(ctx, out, 2);
        got[portable] = out->data;
        char what[160];
        snprintf(what, sizeof what, "%s %s d%lld h%lld/%lld rows %lld kv %lld%s: %s",
                 prefill ? "attn_prefill" : "attn_decode", kv_type == GGML_TYPE_F16 ? "f16" : "f32", (long long) dk,
                 (long long) nh, (long long) nh_kv, (long long) nr, (long long) nkv, softcap > 0 ? " softcap" : "",
                 portable ? "portable" : (prefill ? (ggmlpy_pf_vectorized(dk, dk) ? "avx512" : "portable")
                                                  : ggmlpy_attn_use_avx512(dk, dk) ? "avx512"
                                                  : ggmlpy_attn_use_avx2(dk, dk) ? "avx2" : "portable"));
        check(what, rel_err(got[portable], want, dk * nh * nr), 2e-5);
    }
    ggmlpy_kernels_portable = 0;
    free(want);
    ggml_free(ctx);
}

/* ---- matrix times a few vectors */

static void gemv_case(enum ggml_type wt, int64_t k, int64_t n, int64_t m) {
    struct ggml_init_params ip = {(size_t) 64 << 20, NULL, false};
    struct ggml_context * ctx = ggml_init(ip);
    struct ggml_tensor * w = ggml_new_tensor_2d(ctx, wt, k, n);
    struct ggml_tensor * x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, k, m);
    float * wf = malloc(sizeof(float) * k * n);
    for (int64_t i = 0; i < k * n; i++) wf[i] = uniform();
    if (wt == GGML_TYPE_F16) ggml_fp32_to_fp16_row(wf, w->data, k * n);
    else ggml_quantize_chunk(wt, wf, w->data, 0, n, k, NULL);
    ggml_get_type_traits(wt)->to_float(w->data, wf, k * n);      /* the reference reads what is stored */
    fill(x, 1.0f);
    double * want = malloc(sizeof(double) * n * m);
    for (int64_t c = 0; c < m; c++) {
        for (int64_t r = 0; r < n; r++) {
            double acc = 0.0;
            for (int64_t i = 0; i < k; i++) acc += (double) wf[r * k + i] * ((const float *) x->data)[c * k + i];
            want[c * n + r] = acc;
        }
    }
    float * got[2];
    for (int portable = 1; portable >= 0; portable--) {
        ggmlpy_kernels_portable = portable;
        struct ggml_tensor * out = ggmlpy_mul_mat_vec(ctx, w, x, 1);
        compute(ctx, out, 2);
        got[portable] = out->data;
        char what[160];
        snprintf(what, sizeof what, "mul_mat_vec %s %lldx%lld, %lld vectors: %s", ggml_type_name(wt),
                 (long long) k, (long long) n, (long long) m,
                 portable ? "portable" : ggmlpy_gemv_vnni() && wt == GGML_TYPE_Q8_0 ? "vnni" : "ggml's vec_dot");
        /* the vectors are rounded to the dot type (float16, Q8_0) as mul_mat rounds them */
        check(what, rel_err(got[portable], want, n * m), wt == GGML_TYPE_F16 ? 2e-3 : 1e-2);
    }
    double * same = malloc(sizeof(double) * n * m);
    for (int64_t i = 0; i < n * m; i++) same[i] = got[1][i];
    check("  vector path equals the portable one exactly", rel_err(got[0], same, n * m), 0.0);
    ggmlpy_kernels_portable = 0;
    free(same); free(want); free(wf);
    ggml_free(ctx);
}

/* ---- GeGLU */

static void glu_case(int64_t n, int64_t rows) {
    struct ggml_init_params ip = {(size_t) 16 << 20, NULL, false};
    struct ggml_context * ctx = ggml_init(ip);
    struct ggml_tensor * a = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n, rows);
    struct ggml_tensor * b = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n, rows);
    fill(a, 6.0f); fill(b, 1.0f);
    double * want = malloc(sizeof(double) * n * rows);
    for (int64_t i = 0; i < n * rows; i++) {
        const double x = ((float *) a->data)[i];
        want[i] = 0.5 * x * (1.0 + tanh(sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x))) * ((float *) b->data)[i];
    }
    for (int portable = 1; portable >= 0; portable--) {
        ggmlpy_kernels_portable = portable;
        struct ggml_tensor * out = ggmlpy_geglu_tanh(ctx, a, b);
        compute(ctx, out, 2);
        char what[160];
        snprintf(what, sizeof what, "geglu_tanh %lldx%lld: %s", (long long) n, (long long) rows,
                 portable || !ggmlpy_glu_vectorized() ? "portable" : "avx512");
        check(what, rel_err(out->data, want, n * rows), 1e-6);
    }
    ggmlpy_kernels_portable = 0;
    free(want);
    ggml_free(ctx);
}

int main(void) {
    for (int f16 = 0; f16 < 2; f16++) {
        const enum ggml_type t = f16 ? GGML_TYPE_F16 : GGML_TYPE_F32;
        attn_case(0, 64, 4, 4, 1, 300, t, 0.0f);        /* one row, no groups */
        attn_case(0, 128, 8, 2, 3, 517, t, 0.0f);       /* grouped heads (the AVX-512 layout path) */
        attn_case(0, 36, 2, 1, 2, 77, t, 0.0f);         /* a head size no vector path takes */
        attn_case(1, 64, 4, 2, 70, 130, t, 0.0f);       /* two tiles of rows, edge blocks */
        attn_case(1, 128, 2, 1, 33, 200, t, 30.0f);     /* soft-capping (gemma2) */
        attn_case(1, 24, 2, 2, 5, 40, t, 0.0f);
    }
    gemv_case(GGML_TYPE_F16, 512, 96, 3);
    gemv_case(GGML_TYPE_Q8_0, 512, 96, 4);
    gemv_case(GGML_TYPE_Q8_0, 256, 33, 1);
    glu_case(1000, 3);
    glu_case(16, 1);
    printf("%s: %d failure(s)\n", failures ? "FAILED" : "passed", failures);
    return failures != 0;
}
