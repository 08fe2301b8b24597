/* C helpers of Context's op methods (ops.pxi): preconditions checked before
   the ggml call, so that a bad argument raises instead of reaching ggml. */
#ifndef GGMLPY_OPS_H
#define GGMLPY_OPS_H

#include "ggml.h"

/* Context.permute's precondition: 1 when every ne[i] and nb[i] of a fits in a
   32-bit int, else 0 (ops.pxi raises, naming that limit). */
static inline int ggmlpy_permute_ok(const struct ggml_tensor * a) {
    int i;
    for (i = 0; i < 4; i++) {
        if (a->ne[i] > 2147483647LL || a->nb[i] > 2147483647ULL) return 0;
    }
    return 1;
}

#endif /* GGMLPY_OPS_H */
