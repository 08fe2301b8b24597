/* A "budget device": a ggml device that is another device (the CPU, a GPU)
   with at most a given number of bytes, for RPC servers that advertise a
   memory size and hold to it (`ggmlpy rpc-server --mem`). Several loopback
   servers of different sizes let automatic layer placement be tested
   without a GPU.

   ggml's RPC server answers a client's memory query with
   ggml_backend_dev_memory(ggml_backend_get_device(backend)) and allocates
   with the default buffer type of that backend's device. A budget device
   forwards every call to the device it wraps, except:
   - get_memory / get_props: total = the budget, free = budget - bytes in use;
   - get_buffer_type: the budget buffer type below;
   - init_backend: the wrapped device's backend, its `device` field pointed
     at the budget device (so the server's queries come here);
   - supports_buft: the budget buffer type counts as the wrapped one.
   Its `reg` is the wrapped device's registry (the server looks up
   ggml_backend_set_n_threads there).

   The budget buffer type forwards to the wrapped buffer type, except
   alloc_buffer: it refuses (NULL, which the server sends back as a failed
   allocation) when the size exceeds what is free; else it allocates through
   the wrapped type, counts buffer->size in use, points the buffer's `buft`
   at the budget type and its free_buffer at budget_buffer_free, which
   uncounts and calls the wrapped free. A zero-size buffer is ggml's dummy
   (no free function, counted as 0).

   What that changes for the wrapped backend's own code, read in ggml 0.25:
   nothing on the RPC server's paths (alloc, get_alloc_size, set/get/copy
   tensor, graph compute) in the CPU backend, which is what this serves in
   the tests. GPU backends recognise their own buffers by their free_buffer
   (CUDA, Metal) or their type's get_name (Vulkan) in buffer cpy_tensor,
   which then returns false and the client copies through the host instead;
   their other buffer-type checks are on asynchronous or debug-only paths the
   server does not take.

   The structs live for the life of the process (ggml's server never returns
   and keeps pointers to them). */
/* ggml internals used here (check them when the ggml pin moves, ggml-backend-impl.h): the device,
   buffer type, buffer and event interfaces (struct ggml_backend_device_i, ggml_backend_buffer_type_i,
   ggml_backend_buffer_i's free_buffer), and the context, device, buft and reg fields of the device,
   buffer type, buffer and backend structs. */
#ifndef GGMLPY_BUDGET_H
#define GGMLPY_BUDGET_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "ggml-backend.h"
#include "ggml-backend-impl.h"
#include "ggml-impl.h"

typedef struct ggmlpy_budget {
    struct ggml_backend_device dev;        /* the budget device; context -> this struct */
    struct ggml_backend_buffer_type buft;  /* its buffer type; context -> this struct */
    ggml_backend_dev_t inner_dev;
    ggml_backend_buffer_type_t inner_buft;
    void (*inner_free)(ggml_backend_buffer_t);  /* the free_buffer of every buffer inner_buft makes */
    size_t budget;
    atomic_size_t in_use;                  /* bytes of live buffers, never above budget */
} ggmlpy_budget;

#define GGMLPY_BUDGET_OF_DEV(d) ((ggmlpy_budget *) (d)->context)
#define GGMLPY_BUDGET_OF_BUFT(t) ((ggmlpy_budget *) (t)->context)

/* Count n more bytes in use if they fit the budget. */
static bool ggmlpy_budget_take(ggmlpy_budget * b, size_t n) {
    size_t cur = atomic_load(&b->in_use);
    do {
        if (n > b->budget - cur) {
            return false;
        }
    } while (!atomic_compare_exchange_weak(&b->in_use, &cur, cur + n));
    return true;
}

static void ggmlpy_budget_give(ggmlpy_budget * b, size_t n) {
    atomic_fetch_sub(&b->in_use, n);
}

static size_t ggmlpy_budget_free_bytes(ggmlpy_budget * b) {
    return b->budget - atomic_load(&b->in_use);
}

/* -- the buffer type ------------------------------------------------------------ */

static void ggmlpy_budget_buffer_free(ggml_backend_buffer_t buffer) {
    ggmlpy_budget * b = GGMLPY_BUDGET_OF_BUFT(buffer->buft);
    size_t n = buffer->size;
    /* the wrapped free sees its own type, as when it allocated */
    buffer->buft = b->inner_buft;
    if (b->inner_free != NULL) {
        b->inner_free(buffer);
    }
    ggmlpy_budget_give(b, n);
}

static const char * ggmlpy_budget_buft_name(ggml_backend_buffer_type_t buft) {
    return ggml_backend_buft_name(GGMLPY_BUDGET_OF_BUFT(buft)->inner_buft);
}

static ggml_backend_buffer_t ggmlpy_budget_buft_alloc(ggml_backend_buffer_type_t buft, size_t size) {
    ggmlpy_budget * b = GGMLPY_BUDGET_OF_BUFT(buft);
    ggml_backend_buffer_t buffer;
    if (size == 0) {
        /* what ggml_backend_buft_alloc_buffer makes of 0 bytes (it never calls here with 0) */
        struct ggml_backend_buffer_i none;
        memset(&none, 0, sizeof none);
        return ggml_backend_buffer_init(buft, none, NULL, 0);
    }
    if (!ggmlpy_budget_take(b, size)) {
        GGML_LOG_WARN("ggmlpy budget: %s refuses %zu bytes: %zu of its %zu bytes are free\n",
                      ggml_backend_dev_name(&b->dev), size, ggmlpy_budget_free_bytes(b), b->budget);
        return NULL;
    }
    buffer = ggml_backend_buft_alloc_buffer(b->inner_buft, size);
    if (buffer == NULL) {
        ggmlpy_budget_give(b, size);
        return NULL;
    }
    if (buffer->iface.free_buffer != b->inner_free || buffer->size < size ||
        (buffer->size > size && !ggmlpy_budget_take(b, buffer->size - size))) {
        /* not a buffer this wrapper can account for (not seen with ggml's backends) */
        GGML_LOG_WARN("ggmlpy budget: %s: the wrapped buffer type returned a buffer it cannot count\n",
                      ggml_backend_dev_name(&b->dev));
        ggml_backend_buffer_free(buffer);
        ggmlpy_budget_give(b, size);
        return NULL;
    }
    buffer->buft = buft;
    buffer->iface.free_buffer = ggmlpy_budget_buffer_free;
    return buffer;
}

static size_t ggmlpy_budget_buft_alignment(ggml_backend_buffer_type_t buft) {
    return ggml_backend_buft_get_alignment(GGMLPY_BUDGET_OF_BUFT(buft)->inner_buft);
}

static size_t ggmlpy_budget_buft_max_size(ggml_backend_buffer_type_t buft) {
    return ggml_backend_buft_get_max_size(GGMLPY_BUDGET_OF_BUFT(buft)->inner_buft);
}

static size_t ggmlpy_budget_buft_alloc_size(ggml_backend_buffer_type_t buft, const struct ggml_tensor * tensor) {
    ggml_backend_buffer_type_t in = GGMLPY_BUDGET_OF_BUFT(buft)->inner_buft;
    return in->iface.get_alloc_size(in, tensor);
}

static bool ggmlpy_budget_buft_is_host(ggml_backend_buffer_type_t buft) {
    return ggml_backend_buft_is_host(GGMLPY_BUDGET_OF_BUFT(buft)->inner_buft);
}

/* -- the device ------------------------------------------------------------------ */

static const char * ggmlpy_budget_dev_name(ggml_backend_dev_t dev) {
    return ggml_backend_dev_name(GGMLPY_BUDGET_OF_DEV(dev)->inner_dev);
}

static const char * ggmlpy_budget_dev_description(ggml_backend_dev_t dev) {
    return ggml_backend_dev_description(GGMLPY_BUDGET_OF_DEV(dev)->inner_dev);
}

static void ggmlpy_budget_dev_memory(ggml_backend_dev_t dev, size_t * free, size_t * total) {
    ggmlpy_budget * b = GGMLPY_BUDGET_OF_DEV(dev);
    *free = ggmlpy_budget_free_bytes(b);
    *total = b->budget;
}

static enum ggml_backend_dev_type ggmlpy_budget_dev_type(ggml_backend_dev_t dev) {
    return ggml_backend_dev_type(GGMLPY_BUDGET_OF_DEV(dev)->inner_dev);
}

static void ggmlpy_budget_dev_props(ggml_backend_dev_t dev, struct ggml_backend_dev_props * props) {
    ggmlpy_budget * b = GGMLPY_BUDGET_OF_DEV(dev);
    ggml_backend_dev_get_props(b->inner_dev, props);
    ggmlpy_budget_dev_memory(dev, &props->memory_free, &props->memory_total);
}

static ggml_backend_t ggmlpy_budget_dev_init(ggml_backend_dev_t dev, const char * params) {
    ggml_backend_t backend = ggml_backend_dev_init(GGMLPY_BUDGET_OF_DEV(dev)->inner_dev, params);
    if (backend != NULL) {
        backend->device = dev;
    }
    return backend;
}

static ggml_backend_buffer_type_t ggmlpy_budget_dev_buft(ggml_backend_dev_t dev) {
    return &GGMLPY_BUDGET_OF_DEV(dev)->buft;
}

static ggml_backend_buffer_type_t ggmlpy_budget_dev_host_buft(ggml_backend_dev_t dev) {
    return ggml_backend_dev_host_buffer_type(GGMLPY_BUDGET_OF_DEV(dev)->inner_dev);
}

static ggml_backend_buffer_t ggmlpy_budget_dev_from_host_ptr(ggml_backend_dev_t dev, void * ptr, size_t size,
                                                              size_t max_tensor_size) {
    /* host memory the caller owns: not the device's to count */
    return ggml_backend_dev_buffer_from_host_ptr(GGMLPY_BUDGET_OF_DEV(dev)->inner_dev, ptr, size, max_tensor_size);
}

static bool ggmlpy_budget_dev_supports_op(ggml_backend_dev_t dev, const struct ggml_tensor * op) {
    return ggml_backend_dev_supports_op(GGMLPY_BUDGET_OF_DEV(dev)->inner_dev, op);
}

static bool ggmlpy_budget_dev_supports_buft(ggml_backend_dev_t dev, ggml_backend_buffer_type_t buft) {
    ggmlpy_budget * b = GGMLPY_BUDGET_OF_DEV(dev);
    return ggml_backend_dev_supports_buft(b->inner_dev, buft == &b->buft ? b->inner_buft : buft);
}

static bool ggmlpy_budget_dev_offload_op(ggml_backend_dev_t dev, const struct ggml_tensor * op) {
    return ggml_backend_dev_offload_op(GGMLPY_BUDGET_OF_DEV(dev)->inner_dev, op);
}

static ggml_backend_event_t ggmlpy_budget_dev_event_new(ggml_backend_dev_t dev) {
    ggml_backend_dev_t in = GGMLPY_BUDGET_OF_DEV(dev)->inner_dev;
    return in->iface.event_new(in);
}

static void ggmlpy_budget_dev_event_free(ggml_backend_dev_t dev, ggml_backend_event_t event) {
    ggml_backend_dev_t in = GGMLPY_BUDGET_OF_DEV(dev)->inner_dev;
    in->iface.event_free(in, event);
}

static void ggmlpy_budget_dev_event_synchronize(ggml_backend_dev_t dev, ggml_backend_event_t event) {
    ggml_backend_dev_t in = GGMLPY_BUDGET_OF_DEV(dev)->inner_dev;
    in->iface.event_synchronize(in, event);
}

/* A device that is `dev` holding at most `budget` bytes (> 0), or NULL when
   out of memory or when `dev` cannot allocate one byte (a probe that learns
   its buffers' free function). Never freed. */
static ggml_backend_dev_t ggmlpy_budget_device_new(ggml_backend_dev_t dev, size_t budget) {
    ggmlpy_budget * b;
    ggml_backend_buffer_type_t inner_buft;
    ggml_backend_buffer_t probe;
    const struct ggml_backend_device_i * in;
    if (dev == NULL || budget == 0) {
        return NULL;
    }
    inner_buft = ggml_backend_dev_buffer_type(dev);
    if (inner_buft == NULL) {
        return NULL;
    }
    probe = ggml_backend_buft_alloc_buffer(inner_buft, 1);
    if (probe == NULL) {
        return NULL;
    }
    b = (ggmlpy_budget *) calloc(1, sizeof *b);
    if (b == NULL) {
        ggml_backend_buffer_free(probe);
        return NULL;
    }
    b->inner_free = probe->iface.free_buffer;
    ggml_backend_buffer_free(probe);
    b->inner_dev = dev;
    b->inner_buft = inner_buft;
    b->budget = budget;
    atomic_init(&b->in_use, 0);

    /* optional entries stay NULL where the wrapped ones are, so ggml's defaults apply alike */
    b->buft.iface.get_name = ggmlpy_budget_buft_name;
    b->buft.iface.alloc_buffer = ggmlpy_budget_buft_alloc;
    b->buft.iface.get_alignment = ggmlpy_budget_buft_alignment;
    b->buft.iface.get_max_size = inner_buft->iface.get_max_size ? ggmlpy_budget_buft_max_size : NULL;
    b->buft.iface.get_alloc_size = inner_buft->iface.get_alloc_size ? ggmlpy_budget_buft_alloc_size : NULL;
    b->buft.iface.is_host = inner_buft->iface.is_host ? ggmlpy_budget_buft_is_host : NULL;
    b->buft.device = &b->dev;
    b->buft.context = b;

    in = &dev->iface;
    b->dev.iface.get_name = ggmlpy_budget_dev_name;
    b->dev.iface.get_description = ggmlpy_budget_dev_description;
    b->dev.iface.get_memory = ggmlpy_budget_dev_memory;
    b->dev.iface.get_type = ggmlpy_budget_dev_type;
    b->dev.iface.get_props = ggmlpy_budget_dev_props;
    b->dev.iface.init_backend = ggmlpy_budget_dev_init;
    b->dev.iface.get_buffer_type = ggmlpy_budget_dev_buft;
    b->dev.iface.get_host_buffer_type = in->get_host_buffer_type ? ggmlpy_budget_dev_host_buft : NULL;
    b->dev.iface.buffer_from_host_ptr = in->buffer_from_host_ptr ? ggmlpy_budget_dev_from_host_ptr : NULL;
    b->dev.iface.supports_op = ggmlpy_budget_dev_supports_op;
    b->dev.iface.supports_buft = ggmlpy_budget_dev_supports_buft;
    b->dev.iface.offload_op = in->offload_op ? ggmlpy_budget_dev_offload_op : NULL;
    b->dev.iface.event_new = in->event_new ? ggmlpy_budget_dev_event_new : NULL;
    b->dev.iface.event_free = in->event_free ? ggmlpy_budget_dev_event_free : NULL;
    b->dev.iface.event_synchronize = in->event_synchronize ? ggmlpy_budget_dev_event_synchronize : NULL;
    b->dev.reg = dev->reg;
    b->dev.context = b;
    return &b->dev;
}

#endif
