/* C helpers of Graph (graph.pxi). They read a ggml_cgraph's counts, nodes,
   leafs and visited set, which only ggml's internal ggml-impl.h shows.

   Why ours: ggml asserts (aborts) when an expand overflows the graph, and
   visits the new part recursively (a deep chain overflows the C stack), so
   graph.pxi counts what an expand would add, and how deep, before calling it;
   the common expand (one new node) needs a fast path; and the checks made
   before an allocation or a compute look at every node or every index, a loop
   too slow through Python objects. */
/* ggml internals read here (check them when the ggml pin moves): struct ggml_cgraph's size, n_nodes,
   n_leafs, nodes, leafs, use_counts and visited_hash_set (.size, .used, .keys); ggml_hash_find,
   ggml_hash_contains, ggml_bitset_get/set (ggml-impl.h). */
#ifndef GGMLPY_GRAPH_H
#define GGMLPY_GRAPH_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "ggml.h"
#include "ggml-impl.h"

/* One level of ggmlpy_count_new's explicit stack: a tensor and the next of its
   sources to visit. */
typedef struct { struct ggml_tensor * t; int next; } ggmlpy_frame;

/* Insert t into an open-addressing set of tensor pointers (keys, capacity cap,
   a power of two, n used), growing it past half full; the first storage is
   the caller's inline_keys. 1 if added, 0 if present, -1 out of memory. */
static inline int ggmlpy_set_add(struct ggml_tensor *** keys, size_t * cap, size_t * n,
                                 struct ggml_tensor * t, struct ggml_tensor ** inline_keys) {
    if ((*n + 1) * 2 > *cap) {
        size_t ncap = *cap * 4, i;
        struct ggml_tensor ** nk = (struct ggml_tensor **) calloc(ncap, sizeof(*nk));
        if (!nk) return -1;
        for (i = 0; i < *cap; i++) {
            struct ggml_tensor * k = (*keys)[i];
            if (k) {
                size_t h = (((uintptr_t) k) >> 4) * 11400714819323198485ull & (ncap - 1);
                while (nk[h]) h = (h + 1) & (ncap - 1);
                nk[h] = k;
            }
        }
        if (*keys != inline_keys) free(*keys);
        *keys = nk; *cap = ncap;
    }
    size_t h = (((uintptr_t) t) >> 4) * 11400714819323198485ull & (*cap - 1);
    while ((*keys)[h]) {
        if ((*keys)[h] == t) return 0;
        h = (h + 1) & (*cap - 1);
    }
    (*keys)[h] = t; (*n)++;
    return 1;
}

/* Count the nodes and leafs ggml_build_forward_expand(g, root) would add,
   mirroring ggml_visit_parents_graph: a tensor not yet in the graph is a
   leaf if it has no op and is not a parameter, else a node. Also reports
   the depth of the new part, since ggml visits it recursively. 0, or -1 out
   of memory. */
static inline int ggmlpy_count_new(struct ggml_cgraph * g, struct ggml_tensor * root,
                                   int * n_nodes, int * n_leafs, int * depth) {
    struct ggml_tensor * inline_keys[64] = {0};
    ggmlpy_frame inline_stack[32];
    struct ggml_tensor ** keys = inline_keys;
    size_t cap = 64, n = 0, sp = 0, scap = 32;
    ggmlpy_frame * stack = inline_stack;
    int rc = 0, maxd = 0, i;
    *n_nodes = 0; *n_leafs = 0; *depth = 0;
    if (ggml_hash_contains(&g->visited_hash_set, root)) return 0;
    /* Common case: every input is already in the graph, only root is new. */
    for (i = 0; i < GGML_MAX_SRC; i++) {
        if (root->src[i] && !ggml_hash_contains(&g->visited_hash_set, root->src[i])) break;
    }
    if (i == GGML_MAX_SRC) {
        if (root->op == GGML_OP_NONE && !(root->flags & GGML_TENSOR_FLAG_PARAM)) *n_leafs = 1;
        else *n_nodes = 1;
        *depth = 1;
        return 0;
    }
    ggmlpy_set_add(&keys, &cap, &n, root, inline_keys);
    stack[sp].t = root; stack[sp].next = 0; sp++;
    while (sp > 0) {
        ggmlpy_frame * f = &stack[sp - 1];
        if (f->next < GGML_MAX_SRC) {
            struct ggml_tensor * s = f->t->src[f->next++];
            if (!s || ggml_hash_contains(&g->visited_hash_set, s)) continue;
            int added = ggmlpy_set_add(&keys, &cap, &n, s, inline_keys);
            if (added < 0) { rc = -1; break; }
            if (added == 0) continue;
            if (sp == scap) {
                ggmlpy_frame * ns = (ggmlpy_frame *) malloc(scap * 2 * sizeof(*ns));
                if (!ns) { rc = -1; break; }
                memcpy(ns, stack, scap * sizeof(*ns));
                if (stack != inline_stack) free(stack);
                stack = ns; scap *= 2;
            }
            stack[sp].t = s; stack[sp].next = 0; sp++;
            if ((int) sp > maxd) maxd = (int) sp;
        } else {
            struct ggml_tensor * t = f->t;
            if (t->op == GGML_OP_NONE && !(t->flags & GGML_TENSOR_FLAG_PARAM)) (*n_leafs)++;
            else (*n_nodes)++;
            sp--;
        }
    }
    if (keys != inline_keys) free(keys);
    if (stack != inline_stack) free(stack);
    *depth = maxd;
    return rc;
}

/* ggml's rule for where an expand files a new tensor: a leaf has no op and is
   not a parameter. */
static inline int ggmlpy_is_leaf(const struct ggml_tensor * t) {
    return t->op == GGML_OP_NONE && !(t->flags & GGML_TENSOR_FLAG_PARAM);
}
static inline void ggmlpy_name_new(const struct ggml_cgraph * g, struct ggml_tensor * t);

/* The common expand, op by op, done here in one pass over the visited set
   (ggml's expand would probe it again for root and every source, and each
   probe divides by the set's size): root is new, and every source is in the
   graph already and either marked for compute or without sources of its own,
   so ggml's revisit of it would change nothing. Does what
   ggml_visit_parents_graph does for such a root: marks it for compute, files
   it in the set with a zero use count, counts one use of every source slot,
   names and appends it. 1 if added, 0 if root is in the graph already, -1
   when the general path must decide (a source not yet in the graph, or one a
   revisit would mark, a full graph or set). */
static inline int ggmlpy_expand_one(struct ggml_cgraph * g, struct ggml_tensor * root) {
    struct ggml_hash_set * hs = &g->visited_hash_set;
    size_t pos = ggml_hash_find(hs, root), spos[GGML_MAX_SRC];
    int i, j, leaf;
    if (pos == GGML_HASHSET_FULL) return -1;
    if (ggml_bitset_get(hs->used, pos)) return 0;
    for (i = 0; i < GGML_MAX_SRC; i++) {
        const struct ggml_tensor * s = root->src[i];
        if (!s) continue;
        spos[i] = ggml_hash_find(hs, s);
        if (spos[i] == GGML_HASHSET_FULL || !ggml_bitset_get(hs->used, spos[i])) return -1;
        if (!(s->flags & GGML_TENSOR_FLAG_COMPUTE)) {
            if (s->op != GGML_OP_NONE) return -1;
            for (j = 0; j < GGML_MAX_SRC; j++) if (s->src[j]) return -1;
        }
    }
    leaf = ggmlpy_is_leaf(root);
    if ((leaf ? g->n_leafs : g->n_nodes) >= g->size) return -1;
    if (root->op != GGML_OP_NONE) root->flags |= GGML_TENSOR_FLAG_COMPUTE;
    hs->keys[pos] = root;
    ggml_bitset_set(hs->used, pos);
    g->use_counts[pos] = 0;
    for (i = 0; i < GGML_MAX_SRC; i++) {
        if (root->src[i]) g->use_counts[spos[i]]++;
    }
    ggmlpy_name_new(g, root);
    if (leaf) g->leafs[g->n_leafs++] = root;
    else g->nodes[g->n_nodes++] = root;
    return 1;
}
/* What ggml's visit recorded for t: its use count (how many source slots of
   later nodes read it), or -1 if t is not in the graph. */
static inline int ggmlpy_use_count(const struct ggml_cgraph * g, const struct ggml_tensor * t) {
    size_t pos = ggml_hash_find(&g->visited_hash_set, t);
    if (pos == GGML_HASHSET_FULL || !ggml_bitset_get(g->visited_hash_set.used, pos)) return -1;
    return g->use_counts[pos];
}
/* Give an unnamed new tensor the name ggml's expand would ("node_<i>" /
   "leaf_<i>"), without the vsnprintf that dominates ggml's expand. */
static inline void ggmlpy_name_new(const struct ggml_cgraph * g, struct ggml_tensor * t) {
    char digits[16];
    int k = 0, n;
    size_t p = 5;
    if (t->name[0]) return;
    if (ggmlpy_is_leaf(t)) { memcpy(t->name, "leaf_", 5); n = g->n_leafs; }
    else { memcpy(t->name, "node_", 5); n = g->n_nodes; }
    do { digits[k++] = (char) ('0' + n % 10); n /= 10; } while (n);
    while (k) t->name[p++] = digits[--k];
    t->name[p] = 0;
}

/* Bit i set when arena i (starts[i] .. starts[i] + sizes[i]) holds a node or leaf with no data
   yet: the contexts whose tensors a graph allocator is about to point into its own buffers
   (with `written`, also every node: the contexts a compute writes). Arenas past 63 share
   bit 63. */
static inline uint64_t ggmlpy_unalloc_mask(const struct ggml_cgraph * g, char ** starts, const size_t * sizes, int n,
                                           int written) {
    uint64_t mask = 0;
    int k, i, j;
    for (k = 0; k < 2; k++) {
        int m = k == 0 ? g->n_leafs : g->n_nodes;
        for (i = 0; i < m; i++) {
            const struct ggml_tensor * t = k == 0 ? g->leafs[i] : g->nodes[i];
            /* written: every node (compute writes it) and every leaf without data (an allocator
               writes its data pointer); else only tensors without data */
            if (t->data != NULL && !(written && k == 1)) continue;
            for (j = 0; j < n; j++) {
                if ((const char *) t >= starts[j] && (const char *) t < starts[j] + sizes[j]) {
                    mask |= (uint64_t) 1 << (j < 63 ? j : 63);
                    break;
                }
            }
            /* not in the first 64 arenas: count it against bit 63, which stands for them all */
            if (j == n) mask |= (uint64_t) 1 << 63;
        }
    }
    return mask;
}

/* First out-of-range index of an i32/i64 tensor (any strides), or -1. */
static inline int64_t ggmlpy_bad_index(const struct ggml_tensor * t, int64_t bound, int64_t * value) {
    int64_t i0, i1, i2, i3;
    const char * base = (const char *) t->data;
    for (i3 = 0; i3 < t->ne[3]; i3++) for (i2 = 0; i2 < t->ne[2]; i2++) for (i1 = 0; i1 < t->ne[1]; i1++) {
        const char * row = base + i1 * t->nb[1] + i2 * t->nb[2] + i3 * t->nb[3];
        for (i0 = 0; i0 < t->ne[0]; i0++) {
            int64_t v = t->type == GGML_TYPE_I32 ? (int64_t) *(const int32_t *) (row + i0 * t->nb[0])
                                                 : *(const int64_t *) (row + i0 * t->nb[0]);
            if (v < 0 || v >= bound) {
                *value = v;
                return ((i3 * t->ne[2] + i2) * t->ne[1] + i1) * t->ne[0] + i0;
            }
        }
    }
    return -1;
}

#endif /* GGMLPY_GRAPH_H */
