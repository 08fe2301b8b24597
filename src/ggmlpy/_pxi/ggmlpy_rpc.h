/* The RPC entry points ggmlpy uses, or stubs when ggml was built without
   GGML_RPC (CMake defines GGMLPY_HAVE_RPC to 0 or 1). */
#pragma once
#include "ggml-backend.h"
#if GGMLPY_HAVE_RPC
#include "ggml-rpc.h"
#else
static ggml_backend_reg_t ggml_backend_rpc_add_server(const char * endpoint) { (void) endpoint; return NULL; }
static void ggml_backend_rpc_start_server(const char * endpoint, const char * cache_dir, size_t n_threads,
                                          size_t n_devices, ggml_backend_dev_t * devices) {
    (void) endpoint; (void) cache_dir; (void) n_threads; (void) n_devices; (void) devices;
}
#endif
