/* The RPC entry points ggmlpy uses, or stubs when ggml was built without
   GGML_RPC (CMake defines GGMLPY_HAVE_RPC to 0 or 1).

   GGMLPY_RPC_ERRORS is 1 when ggml carries our patch
   vendor/ggml/patches/0001-rpc-client-errors-instead-of-abort.patch: its client
   then records a failed call (ggml_backend_rpc_take_error) instead of aborting,
   and bounds socket calls by a timeout. A ggml tree without it (built with
   GGMLPY_GGML_DIR) still works, with the stubs below and upstream's aborts.

   GGMLPY_RPC_SERVER_LIMITS is 1 when ggml carries
   vendor/ggml/patches/0002-rpc-server-hardening.patch: its server serves each
   client on a thread of its own, bounds what a client can make it allocate,
   never aborts on what a client sends, and takes a timeout and a client limit
   (ggml_backend_rpc_server_set_limits; a stub that does nothing otherwise).

   In a portable build (GGMLPY_BACKEND_DL) libggml-rpc is a MODULE the registry
   loads, like the CPU variants: its functions are reached through a table that
   ggmlpy_rpc_load() fills at import (see ggmlpy_cpu.h). */
#pragma once
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include "ggml-backend.h"
#include "ggmlpy_cpu.h"
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

#if GGMLPY_HAVE_RPC && defined(GGML_RPC_SERVER_LIMITS)
#define GGMLPY_RPC_SERVER_LIMITS 1
#else
#define GGMLPY_RPC_SERVER_LIMITS 0
static void ggml_backend_rpc_server_set_limits(uint32_t timeout_ms, uint32_t max_clients) {
    (void) timeout_ms; (void) max_clients;
}
#endif

#if GGMLPY_HAVE_RPC && GGMLPY_BACKEND_DL
#include <dlfcn.h>     /* dlsym: undeclared, C would take it to return int and cut the pointer to 32 bits */
#if GGMLPY_RPC_ERRORS
#define GGMLPY_RPC_FUNCS_0001(X) X(ggml_backend_rpc_set_timeout_ms) X(ggml_backend_rpc_take_error)
#else
#define GGMLPY_RPC_FUNCS_0001(X)
#endif
#if GGMLPY_RPC_SERVER_LIMITS
#define GGMLPY_RPC_FUNCS_0002(X) X(ggml_backend_rpc_server_set_limits)
#else
#define GGMLPY_RPC_FUNCS_0002(X)
#endif
#define GGMLPY_RPC_FUNCS(X) X(ggml_backend_rpc_add_server) X(ggml_backend_rpc_start_server) \
    GGMLPY_RPC_FUNCS_0001(X) GGMLPY_RPC_FUNCS_0002(X)
static struct { GGMLPY_RPC_FUNCS(GGMLPY_FIELD) } ggmlpy_rpc_fns;

/* Fill the table from the RPC module ggmlpy_cpu_load() had the registry load.
   0 on success, else -1 with a message in err. */
static int ggmlpy_rpc_load(const char * dir, char * err, size_t err_size) {
    char path[4096];
    void * h = ggmlpy_dl_module_of(ggml_backend_reg_by_name("RPC"), path, sizeof path);
    if (h == NULL) {
        snprintf(err, err_size, "the RPC backend could not be loaded from %s (libggml-rpc.so)", dir);
        return -1;
    }
#define GGMLPY_LOOKUP(name) \
    *(void **) (&ggmlpy_rpc_fns.name) = dlsym(h, #name); \
    if (ggmlpy_rpc_fns.name == NULL) { \
        snprintf(err, err_size, "%s lacks %s: it is not the RPC backend of this ggml%s", path, #name, \
                 GGMLPY_RPC_ERRORS ? " (or lacks vendor/ggml/patches)" : ""); \
        return -1; \
    }
    GGMLPY_RPC_FUNCS(GGMLPY_LOOKUP)
#undef GGMLPY_LOOKUP
    return 0;
}

#define ggml_backend_rpc_add_server (ggmlpy_rpc_fns.ggml_backend_rpc_add_server)
#define ggml_backend_rpc_start_server (ggmlpy_rpc_fns.ggml_backend_rpc_start_server)
#if GGMLPY_RPC_ERRORS
#define ggml_backend_rpc_set_timeout_ms (ggmlpy_rpc_fns.ggml_backend_rpc_set_timeout_ms)
#define ggml_backend_rpc_take_error (ggmlpy_rpc_fns.ggml_backend_rpc_take_error)
#endif
#if GGMLPY_RPC_SERVER_LIMITS
#define ggml_backend_rpc_server_set_limits (ggmlpy_rpc_fns.ggml_backend_rpc_server_set_limits)
#endif

#else  /* linked, or no RPC at all */
static int ggmlpy_rpc_load(const char * dir, char * err, size_t err_size) {
    (void) dir; (void) err; (void) err_size;
    return 0;
}
#endif
