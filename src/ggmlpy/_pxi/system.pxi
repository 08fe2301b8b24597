# system.pxi: what this build of ggml is and what it found on the machine.


def _cpu_variant():
    """(variant, library path) of the CPU backend ggml chose in a portable build; None in a native build.

    The variant is the file's name between ``libggml-cpu-`` and the extension
    (``'zen4'`` for ``libggml-cpu-zen4.so``).
    """
    if not g.GGMLPY_BACKEND_DL:
        return None
    path = os.fsdecode(<bytes> g.ggmlpy_cpu_path())
    name = os.path.basename(path)
    stem = name.split(".", 1)[0]
    for prefix in ("libggml-cpu-", "ggml-cpu-"):
        if stem.startswith(prefix):
            return stem[len(prefix):], path
    return stem, path


def _ggml_version():
    return g.ggml_version().decode(), g.ggml_commit().decode()


def _cpu_features():
    """CPU features ggml's CPU backend was compiled with (and found)."""
    feats = {
        "SSE3": g.ggml_cpu_has_sse3(), "AVX": g.ggml_cpu_has_avx(), "AVX2": g.ggml_cpu_has_avx2(),
        "AVX_VNNI": g.ggml_cpu_has_avx_vnni(), "F16C": g.ggml_cpu_has_f16c(), "FMA": g.ggml_cpu_has_fma(),
        "AVX512": g.ggml_cpu_has_avx512(), "AVX512_VBMI": g.ggml_cpu_has_avx512_vbmi(),
        "AVX512_VNNI": g.ggml_cpu_has_avx512_vnni(), "AVX512_BF16": g.ggml_cpu_has_avx512_bf16(),
        "AMX_INT8": g.ggml_cpu_has_amx_int8(), "NEON": g.ggml_cpu_has_neon(), "DOTPROD": g.ggml_cpu_has_dotprod(),
        "SVE": g.ggml_cpu_has_sve(), "LLAMAFILE": g.ggml_cpu_has_llamafile(),
    }
    return [k for k, v in feats.items() if v]


_DEV_TYPES = {g.GGML_BACKEND_DEVICE_TYPE_CPU: "CPU", g.GGML_BACKEND_DEVICE_TYPE_GPU: "GPU",
              g.GGML_BACKEND_DEVICE_TYPE_IGPU: "IGPU", g.GGML_BACKEND_DEVICE_TYPE_ACCEL: "ACCEL",
              g.GGML_BACKEND_DEVICE_TYPE_META: "META"}


def _backends():
    """Names of the backends compiled into this build (registered in ggml)."""
    return [g.ggml_backend_reg_name(g.ggml_backend_reg_get(i)).decode() for i in range(g.ggml_backend_reg_count())]


def _devices():
    """Every device ggml found: dicts of name, description, type, backend, free and total memory."""
    cdef size_t free_b, total_b
    cdef g.ggml_backend_dev_t d
    out = []
    for i in range(g.ggml_backend_dev_count()):
        d = g.ggml_backend_dev_get(i)
        g.ggml_backend_dev_memory(d, &free_b, &total_b)
        out.append({
            "index": i,
            "name": g.ggml_backend_dev_name(d).decode(),
            "description": g.ggml_backend_dev_description(d).decode(),
            "type": _DEV_TYPES.get(g.ggml_backend_dev_type_of(d), "?"),
            "backend": g.ggml_backend_reg_name(g.ggml_backend_dev_backend_reg(d)).decode(),
            "memory_free": free_b,
            "memory_total": total_b,
        })
    return out
