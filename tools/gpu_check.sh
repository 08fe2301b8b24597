#!/usr/bin/env bash
# The GPU check: build ggmlpy with CUDA on an NVIDIA machine, run the device suite on CUDA0 and a bench
# with every layer on the GPU, and write a report. One command, no network:
#
#     bash tools/gpu_check.sh REPORT_DIR
#
# What the machine needs: nvcc (CUDA 12 or 13) and cuBLAS (in the toolkit, or NVIDIA's pip wheels in the
# Python environment: nvidia/cu13 or nvidia/cublas), a GPU of compute capability ARCH (default 90,
# Hopper: H100/H200), Python 3.9+ with numpy, cython, scikit-build-core, cmake, ninja, pytest, hypothesis,
# tokenizers and jinja2; ggml's source in vendor/ggml/src (python vendor/ggml/fetch.py puts it there on a
# machine with network). ggmlpy is installed into that Python's environment (a throwaway machine's).
#
# Environment: PYTHON (default python3), ARCH (default 90), BUILD_DIR (default build/gpu-check; kept, so a
# second run on the same machine rebuilds only what changed), BENCH_PRESET (default llama3.2-1B),
# BENCH_TYPE (default Q4_K_M), BENCH_REPS (default 3), DEVICE (default CUDA0), STEPS (default
# "build info tests bench": the steps to run, e.g. "build" alone to check the build on a machine without a
# GPU), and the time limits of each step in seconds: BUILD_LIMIT (330), TEST_LIMIT (180), BENCH_LIMIT
# (80): together inside a 600 s call (measured on an H200 with 16 cores: build 290 s, suite 140 s; the
# bench's model is written in the background during the suite).
#
# REPORT_DIR gets at most 7 files (the device tool brings back 8): report.md (the summary: GPU, build
# time, test counts, the bench table), log.txt (everything), info.txt (ggmlpy info), tests.txt and
# junit.xml (the device suite), bench.md and bench.jsonl. Each step runs even when one before it failed
# where it can; the exit status is that of the first step that failed.
set -u -o pipefail

usage() { echo "usage: bash tools/gpu_check.sh REPORT_DIR" >&2; exit 2; }
[ $# -eq 1 ] || usage
OUT=$1
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.." || exit 2
REPO=$(pwd)

PY=${PYTHON:-python3}
ARCH=${ARCH:-90}
BUILD_DIR=${BUILD_DIR:-build/gpu-check}
DEVICE=${DEVICE:-CUDA0}
BENCH_PRESET=${BENCH_PRESET:-llama3.2-1B}
BENCH_TYPE=${BENCH_TYPE:-Q4_K_M}
BENCH_REPS=${BENCH_REPS:-3}
BUILD_LIMIT=${BUILD_LIMIT:-330}
TEST_LIMIT=${TEST_LIMIT:-180}
BENCH_LIMIT=${BENCH_LIMIT:-80}
STEPS=" ${STEPS:-build info tests bench} "
want() { [[ $STEPS == *" $1 "* ]]; }

exec > >(tee "$OUT/log.txt") 2>&1
TEE=$!
T0=$(date +%s)
STATUS=0
REPORT=$OUT/report.md
since() { echo $(( $(date +%s) - T0 )); }
note() { echo "$*" >> "$REPORT"; }
step() { echo; echo "=== [$(since) s] $*"; }
fail() { echo "FAILED: $1"; note "- **failed**: $1"; [ "$STATUS" -ne 0 ] || STATUS=$2; }
CAN_BUILD=1

echo "# GPU check, $(date -u '+%Y-%m-%d %H:%M UTC'), $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet HEAD 2>/dev/null || echo ' (with uncommitted changes)')" > "$REPORT"
note ""

# --------------------------------------------------------------------------- the machine
step "machine"
SMI=$(nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader 2>&1) \
    || fail "nvidia-smi: $SMI" 3
echo "$SMI"
NVCC=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
NVCC_V=$("$NVCC" --version 2>&1 | grep -o 'release [0-9.]*' || echo "no nvcc at $NVCC")
echo "nvcc: $NVCC ($NVCC_V); python: $($PY -VV 2>&1); $(nproc) cores"
note "- GPU: $SMI"
note "- host: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
note "- nvcc: $NVCC_V; $($PY -VV 2>&1 | head -1)"

# --------------------------------------------------------------------------- cuBLAS
# FindCUDAToolkit looks for cuBLAS beside nvcc. Where the toolkit has none (a compiler-only install),
# take NVIDIA's pip wheels in this Python's environment: the library by full path (so CMake's
# find_library is skipped) and the headers through CPATH (after nvcc's own include folder).
step "cuBLAS"
CUDA_ROOT=$(dirname "$(dirname "$(readlink -f "$NVCC")")")
CMAKE_EXTRA=()
if ls "$CUDA_ROOT"/lib64/libcublas.so* "$CUDA_ROOT"/lib/libcublas.so* >/dev/null 2>&1 \
        && [ -f "$CUDA_ROOT/include/cublas_v2.h" ]; then
    echo "cuBLAS in the toolkit: $CUDA_ROOT"
    note "- cuBLAS: the toolkit's ($CUDA_ROOT)"
else
    WHEEL_DIR=$($PY - <<'EOF'
import glob, os, sys
for p in sys.path:
    for sub in ("nvidia/cu13", "nvidia/cu12", "nvidia/cublas"):
        d = os.path.join(p, sub)
        if os.path.isfile(os.path.join(d, "include", "cublas_v2.h")) and glob.glob(os.path.join(d, "lib", "libcublas.so*")):
            print(d)
            raise SystemExit
EOF
)
    if [ -z "$WHEEL_DIR" ]; then
        fail "no cuBLAS: not beside nvcc ($CUDA_ROOT) nor in $PY's nvidia wheels" 4
        CAN_BUILD=0
    else
        lib() { ls "$WHEEL_DIR"/lib/"$1".so* | sort | head -1; }
        CMAKE_EXTRA+=(-C "cmake.define.CUDA_cublas_LIBRARY=$(lib libcublas)"
                      -C "cmake.define.CUDA_cublasLt_LIBRARY=$(lib libcublasLt)")
        export CPATH=$WHEEL_DIR/include${CPATH:+:$CPATH}
        echo "cuBLAS from the wheels in $WHEEL_DIR"
        note "- cuBLAS: NVIDIA's wheels ($WHEEL_DIR)"
    fi
fi

# --------------------------------------------------------------------------- build
step "build (CUDA, sm_$ARCH)"
if [ ! -f vendor/ggml/src/CMakeLists.txt ]; then
    fail "vendor/ggml/src is missing: run python vendor/ggml/fetch.py where there is network, and bring it" 5
    CAN_BUILD=0
fi
B0=$(date +%s)
if want build && [ "$CAN_BUILD" -eq 1 ]; then
    CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} CUDACXX=$NVCC timeout "$BUILD_LIMIT" \
        "$PY" -m pip install --no-build-isolation --no-deps --no-index --no-cache-dir -v \
        -C build-dir="$BUILD_DIR" \
        -C cmake.define.GGML_CUDA=ON -C cmake.define.CMAKE_CUDA_ARCHITECTURES="$ARCH" \
        -C cmake.define.GGML_CUDA_FA_ALL_QUANTS=OFF "${CMAKE_EXTRA[@]}" . > "$OUT/build.tmp" 2>&1
    rc=$?
    grep -E '^-- |error|Error|warning: no|Successfully' "$OUT/build.tmp" | grep -v -- '-Werror' | tail -40
    [ $rc -eq 0 ] || { tail -60 "$OUT/build.tmp"; fail "the build (exit $rc; 124: over BUILD_LIMIT=$BUILD_LIMIT s)" 6; }
fi
B1=$(date +%s)
note "- build: $((B1 - B0)) s (pip install, ${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} jobs, -DCMAKE_CUDA_ARCHITECTURES=$ARCH, FA kernels for f16/q8_0/q4_0 K/V)"
NINJA_LOG=$(ls "$BUILD_DIR"/.ninja_log 2>/dev/null || true)
if [ -n "$NINJA_LOG" ]; then
    # the slowest compile steps (start, end in ms)
    echo "slowest steps:"
    awk 'NR > 1 {printf "%6.1f s  %s\n", ($2 - $1) / 1000, $4}' "$NINJA_LOG" | sort -rn | head -8 | tee -a "$OUT/slowest.tmp"
    note "- slowest compile steps: $(head -3 "$OUT/slowest.tmp" | sed 's/  */ /g' | paste -sd ';' -)"
fi
rm -f "$OUT/build.tmp" "$OUT/slowest.tmp"

# --------------------------------------------------------------------------- info
if want info; then
step "ggmlpy info"
cd /tmp || exit 2     # the installed package, not the source tree's
"$PY" -m ggmlpy info > "$OUT/info.txt" 2>&1 || fail "ggmlpy info" 7
cat "$OUT/info.txt"
cd "$REPO" || exit 2
note "- devices: $(grep -E '^ +[0-9]+ +(CUDA|Vulkan|Metal)[0-9]' "$OUT/info.txt" | sed 's/^ *//' | paste -sd ';' -)"
fi

# --------------------------------------------------------------------------- the bench's model, meanwhile
# Writing the built-in model takes minutes (1B Q4_K_M: over 110 s on an H200's host, quantizing on the
# CPU): done in the background while the device suite runs, so the bench step only reads it.
MODEL_PID=
if want bench; then
    (cd /tmp && "$PY" -c "import sys; from ggmlpy.models.synthetic import synthetic_path; \
print(synthetic_path(sys.argv[1], sys.argv[2]))" "$BENCH_PRESET" "$BENCH_TYPE") > "$OUT/model.tmp" 2>&1 &
    MODEL_PID=$!
fi

# --------------------------------------------------------------------------- the device suite
if want tests; then
step "device suite on $DEVICE"
GGMLPY_TEST_GPU=1 PYTHONUNBUFFERED=1 timeout "$TEST_LIMIT" "$PY" -m pytest tests/device \
    -q -p no:cacheprovider -rfEs --durations=10 --junitxml="$OUT/junit.xml" > "$OUT/tests.txt" 2>&1
rc=$?
tail -40 "$OUT/tests.txt"
note "- device suite (tests/device/: test_device.py, test_cuda.py, GGMLPY_TEST_GPU=1): $(grep -E '(passed|failed|error)' "$OUT/tests.txt" | tail -1)"
[ $rc -eq 0 ] || fail "the device suite (exit $rc; 124: over TEST_LIMIT=$TEST_LIMIT s)" 8
fi

# --------------------------------------------------------------------------- the bench
if want bench; then
step "bench: $BENCH_PRESET $BENCH_TYPE, -ngl 99 on $DEVICE"
if [ -n "$MODEL_PID" ]; then
    W0=$(date +%s)
    wait "$MODEL_PID" || { cat "$OUT/model.tmp"; fail "writing the bench's model" 9; }
    echo "the model (written in the background; waited $(( $(date +%s) - W0 )) s for it): $(tail -1 "$OUT/model.tmp")"
fi
rm -f "$OUT/model.tmp"
PYTHONUNBUFFERED=1 timeout "$BENCH_LIMIT" "$PY" -m ggmlpy bench --synthetic "$BENCH_PRESET" --type "$BENCH_TYPE" \
    -ngl 99 -dev "$DEVICE" -fa 1 -p 512 -n 128 -d 0,4096 -r "$BENCH_REPS" -o jsonl > "$OUT/bench.jsonl" 2> "$OUT/bench.err"
rc=$?
cat "$OUT/bench.err"
if [ $rc -eq 0 ]; then
    "$PY" - "$OUT/bench.jsonl" > "$OUT/bench.md" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
print("| model | size | backends | ngl | fa | test | t/s |")
print("|---|---|---|---|---|---|---|")
for r in rows:
    test = (f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}") + (f" @ d{r['n_depth']}" if r["n_depth"] else "")
    print(f"| {r['model_type']} | {r['model_size'] / 2**30:.2f} GiB | {r['backends']} | {r['n_gpu_layers']} | "
          f"{int(r['flash_attn'])} | {test} | {r['avg_ts']:.1f} ± {r['stddev_ts']:.1f} |")
EOF
    cat "$OUT/bench.md" | tee -a "$REPORT"
else
    fail "the bench (exit $rc; 124: over BENCH_LIMIT=$BENCH_LIMIT s)" 9
fi
rm -f "$OUT/bench.err"
fi

note ""
note "total: $(since) s; exit $STATUS"
step "done: exit $STATUS"
exec >&- 2>&-
wait "$TEE" 2>/dev/null   # the log complete before the caller collects it
exit $STATUS
