/* The RPC entry points ggmlpy uses, or stubs when ggml was built without
   GGML_RPC (CMake defines GGMLPY_HAVE_RPC to 0 or 1).

   GGMLPY_RPC_ERRORS is 1 when ggml carries our patch
   vendor/ggml/patches/0001-rpc-client-errors-instead-of-abort.patch: its client
   then records a failed call (ggml_backend_rpc_take_error) instead of aborting,
   and bounds socket calls by a timeout. A ggml tree without it (built with
   GGMLPY_GGML_DIR) still works, with the stubs below and upstream's aborts. */
#pragma once
#include <stddef.h>
#include <stdint.h>
#include "ggml-backend.h"
#if GGMLPY_HAVE_RPC
#include "ggml-rpc.h"
#else
static ggml_backend_reg_t ggml_backend_rpc_add_server(const char * endpoint) { (void) endpoint; return NULL; }
static void ggml_backend_rpc_start_server(const char * endpoint, const char * cache_dir, size_t n_threads,
                                          size_t n_devices, ggml_backend_dev_t * devices) {
    (void) endpoint; (void) cache_dir; (void) n_threads; (void) n_devices; (void) devices;
}
#define RPC_PROTO_MAJOR_VERSION 0
#define RPC_PROTO_MINOR_VERSION 0
#endif

#if GGMLPY_HAVE_RPC && defined(GGML_RPC_CLIENT_ERRORS)
#define GGMLPY_RPC_ERRORS 1
#else
#define GGMLPY_RPC_ERRORS 0
static void ggml_backend_rpc_set_timeout_ms(uint32_t timeout_ms) { (void) timeout_ms; }
static int ggml_backend_rpc_take_error(char * endpoint, size_t n) { if (n) endpoint[0] = 0; return 0; }
#endif
