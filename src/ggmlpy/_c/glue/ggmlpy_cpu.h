/* ggml-cpu.h as _core sees it, in both kinds of build (CMake defines GGMLPY_BACKEND_DL).

   Native build (GGMLPY_BACKEND_DL=0): _core links libggml-cpu and calls it directly;
   this header only includes ggml-cpu.h.

   Portable build (GGMLPY_BACKEND_DL=1, GGML_NATIVE=OFF): ggml builds one CPU backend
   per CPU generation (libggml-cpu-<variant>.so, MODULE libraries that nothing may link)
   and its registry dlopens the best-scoring one. The ggml-cpu.h functions _core calls
   are then reached through a table of pointers that ggmlpy_cpu_load() fills from the
   module the registry kept; the macros below send ggml's names to the table, so the
   Cython code is the same in both builds. Nothing may call them before the table is
   filled: _core fills it first thing at import (_install_hooks in errors.pxi). The table's storage
   and the loader are in ggmlpy_cpu.c (in libggmlpy_c), so _core and the kernels share one table. */
#pragma once
#include <stddef.h>
#include "ggml-backend.h"
#include "ggml-cpu.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Load every backend in dir (a portable build: ggml scores the CPU variants and keeps the best) and
   fill the table from the CPU module. 0 on success, else -1 with a message in err. Native: 0. */
int ggmlpy_cpu_load(const char * dir, char * err, size_t err_size);
/* Where the chosen CPU variant was found; "" in a native build or before loading. */
const char * ggmlpy_cpu_path(void);

#if GGMLPY_BACKEND_DL
/* The module holding a registered backend (ggmlpy_rpc.h finds libggml-rpc with it). */
void * ggmlpy_dl_module_of(ggml_backend_reg_t reg, char * path, size_t path_size);

/* Every ggml-cpu.h function _ggml.pxd and the kernels call (ggml_threadpool_params_default lives in
   ggml-base). */
#define GGMLPY_CPU_FUNCS(X) \
    X(ggml_threadpool_new) X(ggml_threadpool_free) X(ggml_graph_plan) X(ggml_graph_compute) \
    X(ggml_backend_cpu_init) X(ggml_backend_is_cpu) X(ggml_backend_cpu_set_n_threads) X(ggml_backend_cpu_set_threadpool) \
    X(ggml_backend_cpu_set_abort_callback) \
    X(ggml_cpu_has_sse3) X(ggml_cpu_has_avx) X(ggml_cpu_has_avx2) X(ggml_cpu_has_avx_vnni) \
    X(ggml_cpu_has_f16c) X(ggml_cpu_has_fma) X(ggml_cpu_has_avx512) X(ggml_cpu_has_avx512_vbmi) \
    X(ggml_cpu_has_avx512_vnni) X(ggml_cpu_has_avx512_bf16) X(ggml_cpu_has_amx_int8) \
    X(ggml_cpu_has_neon) X(ggml_cpu_has_dotprod) X(ggml_cpu_has_sve) X(ggml_cpu_has_llamafile) \
    X(ggml_get_type_traits_cpu)

/* __typeof__ takes each pointer's type from ggml's own declaration: no signature is restated. */
#define GGMLPY_FIELD(name) __typeof__(&name) name;
struct ggmlpy_cpu_fns_t { GGMLPY_CPU_FUNCS(GGMLPY_FIELD) };
extern struct ggmlpy_cpu_fns_t ggmlpy_cpu_fns;

#define ggml_threadpool_new (ggmlpy_cpu_fns.ggml_threadpool_new)
#define ggml_threadpool_free (ggmlpy_cpu_fns.ggml_threadpool_free)
#define ggml_graph_plan (ggmlpy_cpu_fns.ggml_graph_plan)
#define ggml_graph_compute (ggmlpy_cpu_fns.ggml_graph_compute)
#define ggml_backend_cpu_init (ggmlpy_cpu_fns.ggml_backend_cpu_init)
#define ggml_backend_is_cpu (ggmlpy_cpu_fns.ggml_backend_is_cpu)
#define ggml_backend_cpu_set_n_threads (ggmlpy_cpu_fns.ggml_backend_cpu_set_n_threads)
#define ggml_backend_cpu_set_threadpool (ggmlpy_cpu_fns.ggml_backend_cpu_set_threadpool)
#define ggml_backend_cpu_set_abort_callback (ggmlpy_cpu_fns.ggml_backend_cpu_set_abort_callback)
#define ggml_cpu_has_sse3 (ggmlpy_cpu_fns.ggml_cpu_has_sse3)
#define ggml_cpu_has_avx (ggmlpy_cpu_fns.ggml_cpu_has_avx)
#define ggml_cpu_has_avx2 (ggmlpy_cpu_fns.ggml_cpu_has_avx2)
#define ggml_cpu_has_avx_vnni (ggmlpy_cpu_fns.ggml_cpu_has_avx_vnni)
#define ggml_cpu_has_f16c (ggmlpy_cpu_fns.ggml_cpu_has_f16c)
#define ggml_cpu_has_fma (ggmlpy_cpu_fns.ggml_cpu_has_fma)
#define ggml_cpu_has_avx512 (ggmlpy_cpu_fns.ggml_cpu_has_avx512)
#define ggml_cpu_has_avx512_vbmi (ggmlpy_cpu_fns.ggml_cpu_has_avx512_vbmi)
#define ggml_cpu_has_avx512_vnni (ggmlpy_cpu_fns.ggml_cpu_has_avx512_vnni)
#define ggml_cpu_has_avx512_bf16 (ggmlpy_cpu_fns.ggml_cpu_has_avx512_bf16)
#define ggml_cpu_has_amx_int8 (ggmlpy_cpu_fns.ggml_cpu_has_amx_int8)
#define ggml_cpu_has_neon (ggmlpy_cpu_fns.ggml_cpu_has_neon)
#define ggml_cpu_has_dotprod (ggmlpy_cpu_fns.ggml_cpu_has_dotprod)
#define ggml_cpu_has_sve (ggmlpy_cpu_fns.ggml_cpu_has_sve)
#define ggml_cpu_has_llamafile (ggmlpy_cpu_fns.ggml_cpu_has_llamafile)
#define ggml_get_type_traits_cpu (ggmlpy_cpu_fns.ggml_get_type_traits_cpu)

#endif

#ifdef __cplusplus
}
#endif
