/*
 * Pure-C reference timings for the ggmlpy overhead benchmarks.
 *
 * This program is the "floor": it performs the same two workloads that
 * bench/bench_overhead.py runs through ggmlpy and through ctypes, but calls
 * ggml directly, so the difference between these numbers and the Python ones
 * is the cost of the binding layer.
 *
 *   graph_build  create a no_alloc context, two F32[64] tensors x and y, then
 *                N_OPS times: x = ggml_add(ctx, x, y); ggml_build_forward_expand(gf, x)
 *                ns_per_op : loop time / N_OPS (context setup/teardown excluded)
 *                ns_total  : ggml_init .. ggml_free, everything included
 *
 *   round_trip   one allocating context set up once with a, b (F32[64]),
 *                c = a + b, a graph and a cplan (work buffer malloc'd once).
 *                Per iteration: memcpy host -> a, b; ggml_graph_compute;
 *                memcpy c -> host.
 *                ns_per_iter : time per round trip
 *
 * Usage: _baseline_c [reps=20] [round_trip_iters=10000]
 *
 * Each repetition is timed with clock_gettime(CLOCK_MONOTONIC); the minimum
 * and the median over repetitions are printed, one JSON object per line:
 *   {"workload":"graph_build","ns_per_op":<min>,"ns_per_op_median":...,
 *    "ns_total":<min>,"ns_total_median":...,...}
 *   {"workload":"round_trip","ns_per_iter":<min>,"ns_per_iter_median":...,...}
 */

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ggml.h"
#include "ggml-cpu.h"

#define N_OPS       10000
#define GRAPH_SIZE  16384
#define N_ELEM      64

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t) ts.tv_sec * 1000000000LL + (int64_t) ts.tv_nsec;
}

static int cmp_double(const void * a, const void * b) {
    const double x = *(const double *) a;
    const double y = *(const double *) b;
    return (x > y) - (x < y);
}

/* Sorts v in place; returns the median. */
static double median(double * v, int n) {
    qsort(v, (size_t) n, sizeof(double), cmp_double);
    return (n % 2) ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static double minimum(const double * v, int n) {
    double m = v[0];
    for (int i = 1; i < n; i++) {
        if (v[i] < m) {
            m = v[i];
        }
    }
    return m;
}

/* One repetition of workload 1. Returns the graph's node count. */
static int graph_build_once(double * ns_loop, double * ns_total) {
    const int64_t t0 = now_ns();

    struct ggml_init_params params = {
        /* .mem_size   = */ ggml_tensor_overhead() * (N_OPS + 2)
                            + ggml_graph_overhead_custom(GRAPH_SIZE, false),
        /* .mem_buffer = */ NULL,
        /* .no_alloc   = */ true,
    };
    struct ggml_context * ctx = ggml_init(params);
    if (ctx == NULL) {
        fprintf(stderr, "ggml_init failed\n");
        exit(1);
    }
    struct ggml_tensor * x  = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, N_ELEM);
    struct ggml_tensor * y  = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, N_ELEM);
    struct ggml_cgraph * gf = ggml_new_graph_custom(ctx, GRAPH_SIZE, false);

    const int64_t t1 = now_ns();
    for (int i = 0; i < N_OPS; i++) {
        x = ggml_add(ctx, x, y);
        ggml_build_forward_expand(gf, x);
    }
    const int64_t t2 = now_ns();

    const int n_nodes = ggml_graph_n_nodes(gf);
    ggml_free(ctx);
    const int64_t t3 = now_ns();

    *ns_loop  = (double) (t2 - t1);
    *ns_total = (double) (t3 - t0);
    return n_nodes;
}

static void bench_graph_build(int reps) {
    double * per_op = malloc(sizeof(double) * (size_t) reps);
    double * total  = malloc(sizeof(double) * (size_t) reps);
    double loop_ns;
    int n_nodes = 0;

    graph_build_once(&loop_ns, &total[0]); /* warm-up, not recorded */

    for (int r = 0; r < reps; r++) {
        n_nodes = graph_build_once(&loop_ns, &total[r]);
        if (n_nodes != N_OPS) {
            fprintf(stderr, "graph_build: expected %d nodes, got %d\n", N_OPS, n_nodes);
            exit(1);
        }
        per_op[r] = loop_ns / N_OPS;
    }

    const double per_op_min = minimum(per_op, reps);
    const double total_min  = minimum(total, reps);
    const double per_op_med = median(per_op, reps);
    const double total_med  = median(total, reps);

    printf("{\"workload\":\"graph_build\",\"n_ops\":%d,\"reps\":%d,\"n_nodes\":%d,"
           "\"ns_per_op\":%.3f,\"ns_per_op_median\":%.3f,"
           "\"ns_total\":%.1f,\"ns_total_median\":%.1f}\n",
           N_OPS, reps, n_nodes, per_op_min, per_op_med, total_min, total_med);

    free(per_op);
    free(total);
}

static void bench_round_trip(int reps, int iters) {
    const size_t nbytes = N_ELEM * sizeof(float);

    struct ggml_init_params params = {
        /* .mem_size   = */ 3 * (ggml_tensor_overhead() + nbytes)
                            + ggml_graph_overhead_custom(GGML_DEFAULT_GRAPH_SIZE, false)
                            + 1024,
        /* .mem_buffer = */ NULL,
        /* .no_alloc   = */ false,
    };
    struct ggml_context * ctx = ggml_init(params);
    if (ctx == NULL) {
        fprintf(stderr, "ggml_init failed\n");
        exit(1);
    }
    struct ggml_tensor * a  = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, N_ELEM);
    struct ggml_tensor * b  = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, N_ELEM);
    struct ggml_tensor * c  = ggml_add(ctx, a, b);
    struct ggml_cgraph * gf = ggml_new_graph_custom(ctx, GGML_DEFAULT_GRAPH_SIZE, false);
    ggml_build_forward_expand(gf, c);

    struct ggml_cplan cplan = ggml_graph_plan(gf, 1, NULL);
    uint8_t * work = NULL;
    if (cplan.work_size > 0) {
        work = malloc(cplan.work_size);
        cplan.work_data = work;
    }

    float ha[N_ELEM], hb[N_ELEM], hc[N_ELEM];
    for (int i = 0; i < N_ELEM; i++) {
        ha[i] = (float) i;
        hb[i] = 0.5f * (float) i + 1.0f;
    }

    double * per_iter = malloc(sizeof(double) * (size_t) reps);

    for (int r = -1; r < reps; r++) { /* r == -1 is a warm-up */
        const int64_t t0 = now_ns();
        for (int i = 0; i < iters; i++) {
            memcpy(a->data, ha, nbytes);
            memcpy(b->data, hb, nbytes);
            if (ggml_graph_compute(gf, &cplan) != GGML_STATUS_SUCCESS) {
                fprintf(stderr, "ggml_graph_compute failed\n");
                exit(1);
            }
            memcpy(hc, c->data, nbytes);
        }
        const int64_t t1 = now_ns();
        if (r >= 0) {
            per_iter[r] = (double) (t1 - t0) / iters;
        }
    }

    for (int i = 0; i < N_ELEM; i++) {
        if (hc[i] != ha[i] + hb[i]) {
            fprintf(stderr, "round_trip: wrong result at %d\n", i);
            exit(1);
        }
    }

    const double it_min = minimum(per_iter, reps);
    const double it_med = median(per_iter, reps);
    printf("{\"workload\":\"round_trip\",\"n_elem\":%d,\"reps\":%d,\"iters\":%d,"
           "\"work_size\":%zu,\"ns_per_iter\":%.3f,\"ns_per_iter_median\":%.3f}\n",
           N_ELEM, reps, iters, cplan.work_size, it_min, it_med);

    free(per_iter);
    free(work);
    ggml_free(ctx);
}

int main(int argc, char ** argv) {
    const int reps  = argc > 1 ? atoi(argv[1]) : 20;
    const int iters = argc > 2 ? atoi(argv[2]) : 10000;
    if (reps < 1 || iters < 1) {
        fprintf(stderr, "usage: %s [reps>=1] [round_trip_iters>=1]\n", argv[0]);
        return 2;
    }

    bench_graph_build(reps);
    bench_round_trip(reps, iters);
    return 0;
}
