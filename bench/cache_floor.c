/* The memory floor of a generated token's attention at depth: how long one core (or a few, with
   OpenMP) takes just to read the K and V cells a token's attention reads, with the CPU caches
   flushed first, as bench/attention.py times the kernels. No arithmetic beyond an integer add per
   32 bytes, so this is the time no attention kernel can beat on this machine.

   Layout as the runner's cache: per layer a K and a V tensor, each cell a row of every head side by
   side (cell bytes = n_head_kv * head_dim * 2 for F16), read in blocks of 128 cells, K then V, as
   ggmlpy's decode attention reads them.

       cc -O2 -march=native -fopenmp bench/cache_floor.c -o /tmp/cache_floor
       /tmp/cache_floor 12 576 1536 1        # layers, visible cells, bytes per cell, threads
*/
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* the 32-bit sums of n bytes (n % 128 == 0), four independent accumulators */
static int read_all(const char * p, size_t n) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i < n; i += 128) {
        a0 = _mm256_add_epi32(a0, _mm256_load_si256((const __m256i *) (p + i)));
        a1 = _mm256_add_epi32(a1, _mm256_load_si256((const __m256i *) (p + i + 32)));
        a2 = _mm256_add_epi32(a2, _mm256_load_si256((const __m256i *) (p + i + 64)));
        a3 = _mm256_add_epi32(a3, _mm256_load_si256((const __m256i *) (p + i + 96)));
    }
    int out[8], s = 0;
    _mm256_storeu_si256((__m256i *) out, _mm256_add_epi32(_mm256_add_epi32(a0, a1), _mm256_add_epi32(a2, a3)));
    for (int i = 0; i < 8; i++) s += out[i];
    return s;
}

int main(int argc, char ** argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s layers visible_cells bytes_per_cell threads\n", argv[0]);
        return 2;
    }
    const size_t layers = strtoul(argv[1], NULL, 10), cells = strtoul(argv[2], NULL, 10);
    const size_t cell = strtoul(argv[3], NULL, 10);
    const int threads = atoi(argv[4]), reps = 30, block = 128;
    if (!layers || !cells || !cell || cell % 128 || threads < 1) {
        fprintf(stderr, "layers, cells and threads > 0; bytes per cell a multiple of 128\n");
        return 2;
    }
    const size_t flush_n = (size_t) 256 << 20;
    char * flush = aligned_alloc(64, flush_n), ** kv = calloc(2 * layers, sizeof(char *));
    if (!flush || !kv) {
        fprintf(stderr, "out of memory\n");
        return 1;
    }
    memset(flush, 1, flush_n);
    for (size_t i = 0; i < 2 * layers; i++) {
        if (!(kv[i] = aligned_alloc(64, cells * cell))) {
            fprintf(stderr, "out of memory\n");
            return 1;
        }
        memset(kv[i], (int) i, cells * cell);
    }
    double total = 0, best = 1e9;
    int sink = 0;
    for (int r = 0; r < reps; r++) {
        sink += read_all(flush, flush_n);                 /* evict the cache from every level */
        const double t0 = now();
        for (size_t l = 0; l < layers; l++) {
#pragma omp parallel num_threads(threads) reduction(+ : sink)
            {
                const size_t t = (size_t) omp_get_thread_num(), nt = (size_t) omp_get_num_threads();
                const size_t c0 = cells * t / nt, c1 = cells * (t + 1) / nt;
                for (size_t b = c0; b < c1; b += block) {
                    const size_t n = (c1 - b < (size_t) block ? c1 - b : (size_t) block) * cell;
                    sink += read_all(kv[2 * l] + b * cell, n);
                    sink += read_all(kv[2 * l + 1] + b * cell, n);
                }
            }
        }
        const double t = now() - t0;
        total += t;
        best = t < best ? t : best;
    }
    const double bytes = 2.0 * layers * cells * cell;
    printf("%zu layers x %zu cells x %zu B (K and V: %.1f MiB), %d thread(s), cold: mean %.3f ms, best %.3f ms "
           "(%.1f GB/s at the mean) [%d]\n", layers, cells, cell, bytes / (1 << 20), threads, total / reps * 1e3,
           best * 1e3, bytes / (total / reps) / 1e9, sink & 1);
    return 0;
}
