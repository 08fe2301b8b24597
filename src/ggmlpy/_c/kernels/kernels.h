/* ggmlpy's own CPU kernels as _core sees them (kernels.pxi): each builds a ggml custom op, with the
   checks the models ask before choosing one, their limits, and the process-wide switches and
   prefetch distances tests and benchmarks turn. One family per file: attn_decode.c (the generation
   step's attention), attn_prefill.c (a prompt's), gemv.c (matrix times a few vectors), gemm.c (repacked
   Q4_K weights in AVX2: a prompt's products and experts, a few vectors' rows), glu.c (GeGLU);
   simd.h and cpu.c hold what they share. Preconditions are the Context methods' (checked there). */
#pragma once
#include <stddef.h>
#include <stdint.h>
#include "ggml.h"

#ifdef __cplusplus
extern "C" {
#endif

/* every kernel on its portable path (simd.h) */
extern int ggmlpy_kernels_portable;

/* ---- attn_decode.c */
#define GGMLPY_ATTN_MAX_DV 1024     /* largest head size: the per-head state lives on the stack */
struct ggml_tensor * ggmlpy_attn_decode(struct ggml_context * ctx, struct ggml_tensor * q, struct ggml_tensor * k,
                                        struct ggml_tensor * v, struct ggml_tensor * mask, float scale, int n_chunks,
                                        int avx512);
int ggmlpy_attn_use_avx2(int64_t dk, int64_t dv);
int ggmlpy_attn_use_avx512(int64_t dk, int64_t dv);
extern int ggmlpy_attn_allow_512;
extern int64_t ggmlpy_attn_pfd;

/* ---- attn_prefill.c */
#define GGMLPY_PF_MAX_D 256         /* largest head size: a thread's tiles live on its stack */
struct ggml_tensor * ggmlpy_attn_prefill(struct ggml_context * ctx, struct ggml_tensor * q, struct ggml_tensor * k,
                                         struct ggml_tensor * v, struct ggml_tensor * mask, float scale, float softcap);
int ggmlpy_pf_vectorized(int64_t dk, int64_t dv);
extern int ggmlpy_pf_allow_vector;

/* ---- gemv.c */
#define GGMLPY_GEMV_MAX_COLS 4      /* vectors per call: a batch of up to 4 tokens */
#define GGMLPY_GEMV_SCRATCH 65536   /* bytes of a thread's copy of the vectors in the dot type */
#define GGMLPY_RQ4_MAX_COLS 3       /* vectors per call against a repacked Q4_0/Q4_K weight */
struct ggml_tensor * ggmlpy_mul_mat_vec(struct ggml_context * ctx, struct ggml_tensor * w, struct ggml_tensor * x,
                                        int own_rows);
int ggmlpy_gemv_own_rows(const struct ggml_tensor * w);
int ggmlpy_gemv_path(const struct ggml_tensor * t);
struct ggml_tensor * ggmlpy_mul_mat_id_vec(struct ggml_context * ctx, struct ggml_tensor * w, struct ggml_tensor * x,
                                           struct ggml_tensor * ids);
struct ggml_tensor * ggmlpy_mul_mat_vec_rq4(struct ggml_context * ctx, struct ggml_tensor * w, struct ggml_tensor * x);
struct ggml_tensor * ggmlpy_mul_mat_id_vec_rq4(struct ggml_context * ctx, struct ggml_tensor * w,
                                               struct ggml_tensor * x, struct ggml_tensor * ids);
struct ggml_tensor * ggmlpy_mul_mat_id_rq(struct ggml_context * ctx, struct ggml_tensor * w, struct ggml_tensor * x,
                                          struct ggml_tensor * ids);
size_t ggmlpy_gemv_scratch(enum ggml_type type, int64_t k, int64_t m);
int ggmlpy_gemv_readable(const struct ggml_tensor * w);
int ggmlpy_gemv_repacked(const struct ggml_tensor * w);
int ggmlpy_gemv_vnni(void);
extern int64_t ggmlpy_gemv_pfd;
extern int ggmlpy_gemv_pf_level;
extern int ggmlpy_q8_allow;
extern int64_t ggmlpy_q8_pfd;
extern int ggmlpy_q6k_allow;
extern int64_t ggmlpy_q6k_pfd;
extern int ggmlpy_rq4_allow;
extern int64_t ggmlpy_rq4_pfd;
extern int ggmlpy_rq4k_allow;
extern int64_t ggmlpy_rq4k_pfd;

/* ---- gemm.c */
struct ggml_tensor * ggmlpy_mul_mat_rq4k(struct ggml_context * ctx, struct ggml_tensor * w, struct ggml_tensor * x);
struct ggml_tensor * ggmlpy_mul_mat_id_rq4k(struct ggml_context * ctx, struct ggml_tensor * w, struct ggml_tensor * x,
                                            struct ggml_tensor * ids);
int ggmlpy_rq4k_gemm_ok(const struct ggml_tensor * w);
extern int ggmlpy_rq4k_gemm_allow;

/* ---- glu.c */
struct ggml_tensor * ggmlpy_geglu_tanh(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b);
int ggmlpy_glu_vectorized(void);
extern int ggmlpy_glu_allow_vector;

#ifdef __cplusplus
}
#endif
