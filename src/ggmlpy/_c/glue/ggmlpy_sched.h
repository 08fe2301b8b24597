/* C helpers of Scheduler (sched.pxi): loops over a graph's nodes (a struct
   only ggml's internal ggml-impl.h shows), around what ggml's scheduler does
   to the caller's graph. */
/* ggml internals read here (check them when the ggml pin moves): struct ggml_cgraph's n_nodes,
   n_leafs, nodes and leafs (ggml-impl.h). */
#ifndef GGMLPY_SCHED_H
#define GGMLPY_SCHED_H

#include <stdlib.h>
#include <string.h>
#include "ggml.h"
#include "ggml-impl.h"

/* ggml's scheduler points graph nodes' inputs at its own copies of them
   (for inputs that cross backends), and frees those copies at the next
   reset. Saving the inputs first and putting them back afterwards keeps
   the caller's graph intact and reusable. */
typedef struct { int n; struct ggml_tensor ** nodes; struct ggml_tensor ** srcs; } ggmlpy_saved_srcs;

/* The sources of every node of g, or NULL out of memory; free with ggmlpy_srcs_restore. */
static inline ggmlpy_saved_srcs * ggmlpy_srcs_save(const struct ggml_cgraph * g) {
    ggmlpy_saved_srcs * s = (ggmlpy_saved_srcs *) calloc(1, sizeof(*s));
    int i;
    if (!s) return NULL;
    s->n = g->n_nodes;
    s->nodes = (struct ggml_tensor **) malloc(sizeof(*s->nodes) * (size_t) (g->n_nodes + 1));
    s->srcs = (struct ggml_tensor **) malloc(sizeof(*s->srcs) * (size_t) (g->n_nodes + 1) * GGML_MAX_SRC);
    if (!s->nodes || !s->srcs) { free(s->nodes); free(s->srcs); free(s); return NULL; }
    for (i = 0; i < g->n_nodes; i++) {
        s->nodes[i] = g->nodes[i];
        memcpy(s->srcs + (size_t) i * GGML_MAX_SRC, g->nodes[i]->src, sizeof(g->nodes[i]->src));
    }
    return s;
}
/* Put the saved sources back (when restore) and free s; s may be NULL. */
static inline void ggmlpy_srcs_restore(ggmlpy_saved_srcs * s, int restore) {
    int i;
    if (!s) return;
    if (restore) {
        for (i = 0; i < s->n; i++) {
            memcpy(s->nodes[i]->src, s->srcs + (size_t) i * GGML_MAX_SRC, sizeof(s->nodes[i]->src));
        }
    }
    free(s->nodes); free(s->srcs); free(s);
}

/* Whether some node of g that computes reads t directly: the scheduler places a data-less
   leaf by such a consumer only (not through a view of it, nor by a view). */
static inline int ggmlpy_is_read(const struct ggml_cgraph * g, const struct ggml_tensor * t) {
    int i, j;
    for (i = 0; i < g->n_nodes; i++) {
        const struct ggml_tensor * n = g->nodes[i];
        if (n->op == GGML_OP_VIEW || n->op == GGML_OP_RESHAPE || n->op == GGML_OP_PERMUTE ||
            n->op == GGML_OP_TRANSPOSE || n->op == GGML_OP_NONE) continue;
        for (j = 0; j < GGML_MAX_SRC; j++) {
            const struct ggml_tensor * s = n->src[j];
            if (s == t) return 1;
        }
    }
    return 0;
}

/* A graph a scheduler allocated keeps its tensors' data pointers. Allocated again after another
   graph (a pooled graph reused), ggml would take those tensors as placed by someone else and plan
   only the rest, its fresh copies of split inputs among them, into memory those tensors still
   occupy: a copy overwritten before it is read (an RPC server aborting on an index read from it).
   So the tensors an allocation places are recorded (ggmlpy_unplaced, before it; their buffers
   after it) and lose their memory again before the graph is planned anew (ggmlpy_unplace). */

/* The tensors of g without memory (no data, no buffer): those an allocation places. Writes the first
   cap of them to out (out may be NULL) and returns how many there are. */
static inline size_t ggmlpy_unplaced(const struct ggml_cgraph * g, struct ggml_tensor ** out, size_t cap) {
    size_t n = 0;
    int k, i;
    for (k = 0; k < 2; k++) {
        int m = k == 0 ? g->n_leafs : g->n_nodes;
        for (i = 0; i < m; i++) {
            struct ggml_tensor * t = k == 0 ? g->leafs[i] : g->nodes[i];
            if (t->data != NULL || t->buffer != NULL) continue;
            if (out != NULL && n < cap) out[n] = t;
            n++;
        }
    }
    return n;
}
/* rec: n tensors, then the buffer each was placed in. Those still in that buffer lose their memory. */
static inline void ggmlpy_unplace(void * const * rec, size_t n) {
    size_t i;
    for (i = 0; i < n; i++) {
        struct ggml_tensor * t = (struct ggml_tensor *) rec[i];
        if (rec[n + i] != NULL && (void *) t->buffer == rec[n + i]) {
            t->data = NULL;
            t->buffer = NULL;
        }
    }
}

#endif /* GGMLPY_SCHED_H */
