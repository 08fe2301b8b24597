/* The one CPU probe of ggmlpy's kernels, and the switch that forces their portable paths (simd.h). */
#include "simd.h"

int ggmlpy_kernels_portable = 0;

static int ggmlpy_cpu_probe(enum ggmlpy_cpu_feature feature) {
#if GGMLPY_X86
    __builtin_cpu_init();
    switch (feature) {
        case GGMLPY_CPU_AVX2:
            return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
        case GGMLPY_CPU_AVX512F:
            return __builtin_cpu_supports("avx512f");
        case GGMLPY_CPU_AVX512_FMA:
            return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
        case GGMLPY_CPU_VNNI512:
            return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
                   && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    }
#endif
    (void) feature;
    return 0;
}

int ggmlpy_cpu_has(enum ggmlpy_cpu_feature feature) {
    /* -1: not asked yet (racing threads store the same answer, one int each) */
    static int has[GGMLPY_CPU_VNNI512 + 1] = {-1, -1, -1, -1};
    if (has[feature] < 0) has[feature] = ggmlpy_cpu_probe(feature);
    return has[feature];
}
