#!/usr/bin/env bash
# Device run of the Python package with the CUDA backend (docs/BENCHMARKS.md,
# "Python package on CUDA").
#
# The GPU machine has python3, torch, transformers, nanobind, pytest, cmake,
# ninja and nvcc, but not our C++ Debian dependencies and no network. They
# travel as a sysroot unpacked from the Debian 12 packages (dpkg -x), made on
# the development machine in the repository root:
#
#   echo /.pydev/ >> .git/info/exclude; mkdir -p .pydev/debs; cd .pydev/debs
#   apt-get download libhwy-dev libhwy1 libeigen3-dev libxxhash-dev libxxhash0 nlohmann-json3-dev
#   cd ..; for f in debs/*.deb; do dpkg -x $f sysroot; done; rm -rf debs sysroot/usr/share/doc \
#     sysroot/usr/lib/x86_64-linux-gnu/libhwy_test* sysroot/usr/include/hwy/tests
#   # hwy-config-none.cmake: drop the hwy::hwy_test import block (its .so is not carried)
#
# and the run carries .pydev. This script configures python/ with CMake
# (CMAKE_PREFIX_PATH = the sysroot; the hwy/Eigen/nlohmann config files locate
# themselves relative to their own path, cmake/Findxxhash.cmake searches the
# prefix), builds turboquant._core with tq_cuda (sm_90), stages the package in
# /tmp/tq-py (the working tree stays clean), then runs
#   python3 -m pytest python/tests -q   and   bench/python/bench_cuda_hf.py
# writing env.log, build.log, pytest.log, bench.log, bench_cuda_hf.json to $OUT.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
cd "$ROOT"
OUT=${OUT:-/tmp/tq-out}
mkdir -p "$OUT"
SYS=${TQ_SYSROOT:-$ROOT/.pydev/sysroot}
BUILD=${TQ_BUILD_DIR:-/tmp/tq-pybuild}
STAGE=${TQ_STAGE_DIR:-/tmp/tq-py}
PY=${PYTHON:-python3}
export LD_LIBRARY_PATH="$SYS/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONUNBUFFERED=1
STEPS=${TQ_STEPS:-build,test,bench}

{
  date -u; nvidia-smi 2>&1 | head -15
  "$PY" -c "import sys, torch, transformers, nanobind; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'nanobind', nanobind.__version__)"
  (command -v nvcc >/dev/null && nvcc --version || /usr/local/cuda/bin/nvcc --version) | tail -2
  cmake --version | head -1; command -v ninja || echo "no ninja"
  grep -m1 "model name" /proc/cpuinfo
} > "$OUT/env.log" 2>&1
cat "$OUT/env.log"

if [[ $STEPS == *build* ]]; then
  gen=(-G Ninja); command -v ninja >/dev/null || gen=()
  t0=$(date +%s)
  # A libtq_cuda.a prebuilt here from the same sources (same nvcc 13.0, sm_90)
  # saves compiling the kernels on the device; used only when the recorded
  # hashes of cuda/ and its headers still match the tree:
  #   cp build/<dir>/tq/cuda/libtq_cuda.a .pydev/prebuilt/
  #   sha256sum cuda/*.cu cuda/*.cuh cuda/CMakeLists.txt include/tq/{cuda,paged_kv_cache,kv_format,status,rotation,codec}.h src/core/plan.h \
  #     > .pydev/prebuilt/SOURCES.sha256
  cuda_args=(-DTQ_ENABLE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90)
  if [[ -f .pydev/prebuilt/libtq_cuda.a ]] && sha256sum -c --quiet .pydev/prebuilt/SOURCES.sha256 >/dev/null 2>&1; then
    cuda_args=(-DTQ_ENABLE_CUDA=OFF -DTQ_PY_PREBUILT_CUDA="$ROOT/.pydev/prebuilt/libtq_cuda.a")
    echo "using the prebuilt libtq_cuda.a (sources unchanged)"
  fi
  if ! { cmake -S python -B "$BUILD" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$SYS/usr" \
           "${cuda_args[@]}" -DPython_EXECUTABLE="$(command -v "$PY")" &&
         cmake --build "$BUILD" -j"$(nproc)" --target _core; } > "$OUT/build.log" 2>&1; then
    echo "BUILD FAILED"; grep -n -i -B2 -A8 "error" "$OUT/build.log" | head -80; exit 1
  fi
  echo "build: $(( $(date +%s) - t0 )) s"; grep "turboquant python" "$OUT/build.log"
  rm -rf "$STAGE"; mkdir -p "$STAGE"
  cp -r python/turboquant "$STAGE/"
  cp "$BUILD"/_core*.so "$STAGE/turboquant/"
fi
export PYTHONPATH="$STAGE"
"$PY" -c "import turboquant, turboquant.cuda as c; print('turboquant from', turboquant.__file__); print('cuda built', c.built(), 'available', c.available(), '|', c.device_description(), '| simd', turboquant.active_simd_target())"

rc=0
if [[ $STEPS == *test* ]]; then
  # PYTHONFAULTHANDLER: a crashing subprocess (test_vllm's CLI run) prints its Python stack
  PYTHONFAULTHANDLER=1 timeout "${TQ_TEST_TIMEOUT:-240}" "$PY" -m pytest python/tests -q -rs -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log"
  rc=$(( rc | ${PIPESTATUS[0]} ))
fi
if [[ $STEPS == *bench* ]]; then
  # -P: the script's own directory does not go first on sys.path (the staged package is used)
  timeout "${TQ_BENCH_TIMEOUT:-200}" "$PY" -P bench/python/bench_cuda_hf.py --json "$OUT/bench_cuda_hf.json" ${TQ_BENCH_ARGS:-} \
    2>&1 | tee "$OUT/bench.log"
  rc=$(( rc | ${PIPESTATUS[0]} ))
fi
echo "device_build_and_test: rc=$rc"
exit $rc
