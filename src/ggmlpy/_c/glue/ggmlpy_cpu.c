/* The CPU backend's function table of a portable build, and its loader (see ggmlpy_cpu.h). */
#define _GNU_SOURCE                 /* dladdr and Dl_info (glibc declares them only then) */
#include <stdio.h>
#include "ggmlpy_cpu.h"

#if GGMLPY_BACKEND_DL
#include <dlfcn.h>

/* (the macros of ggmlpy_cpu.h send ggml's names to the table: the table itself needs the real ones) */
#undef ggml_threadpool_new
#undef ggml_threadpool_free
#undef ggml_graph_plan
#undef ggml_graph_compute
#undef ggml_backend_cpu_init
#undef ggml_backend_is_cpu
#undef ggml_backend_cpu_set_n_threads
#undef ggml_backend_cpu_set_threadpool
#undef ggml_backend_cpu_set_abort_callback
#undef ggml_cpu_has_sse3
#undef ggml_cpu_has_avx
#undef ggml_cpu_has_avx2
#undef ggml_cpu_has_avx_vnni
#undef ggml_cpu_has_f16c
#undef ggml_cpu_has_fma
#undef ggml_cpu_has_avx512
#undef ggml_cpu_has_avx512_vbmi
#undef ggml_cpu_has_avx512_vnni
#undef ggml_cpu_has_avx512_bf16
#undef ggml_cpu_has_amx_int8
#undef ggml_cpu_has_neon
#undef ggml_cpu_has_dotprod
#undef ggml_cpu_has_sve
#undef ggml_cpu_has_llamafile
#undef ggml_get_type_traits_cpu

struct ggmlpy_cpu_fns_t ggmlpy_cpu_fns;

/* Where the chosen variant was found; "" until loaded. */
static char ggmlpy_cpu_path_buf[4096];

/* The module holding a registered backend, opened again (it is loaded already: RTLD_NOLOAD
   only takes a reference) so its exported symbols can be looked up. dladdr finds the file
   from any address inside it; the reg struct is a static of that module. */
void * ggmlpy_dl_module_of(ggml_backend_reg_t reg, char * path, size_t path_size) {
    Dl_info info;
    if (reg == NULL || !dladdr((const void *) reg, &info) || info.dli_fname == NULL) {
        return NULL;
    }
    snprintf(path, path_size, "%s", info.dli_fname);
    return dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD);
}

int ggmlpy_cpu_load(const char * dir, char * err, size_t err_size) {
    void * h;
    ggml_backend_load_all_from_path(dir);
    h = ggmlpy_dl_module_of(ggml_backend_reg_by_name("CPU"), ggmlpy_cpu_path_buf, sizeof ggmlpy_cpu_path_buf);
    if (h == NULL) {
        ggmlpy_cpu_path_buf[0] = 0;
        snprintf(err, err_size, "no CPU backend could be loaded from %s: a portable build needs its "
                 "libggml-cpu-<variant>.so files there, one of which this CPU must support", dir);
        return -1;
    }
#define GGMLPY_LOOKUP(name) \
    *(void **) (&ggmlpy_cpu_fns.name) = dlsym(h, #name); \
    if (ggmlpy_cpu_fns.name == NULL) { \
        snprintf(err, err_size, "%s lacks %s: it is not a CPU backend of this ggml", ggmlpy_cpu_path_buf, #name); \
        return -1; \
    }
    GGMLPY_CPU_FUNCS(GGMLPY_LOOKUP)
#undef GGMLPY_LOOKUP
    return 0;
}

const char * ggmlpy_cpu_path(void) { return ggmlpy_cpu_path_buf; }

#else  /* native: ggml-cpu is linked */

int ggmlpy_cpu_load(const char * dir, char * err, size_t err_size) {
    (void) dir; (void) err; (void) err_size;
    return 0;
}
const char * ggmlpy_cpu_path(void) { return ""; }

#endif
