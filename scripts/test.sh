#!/usr/bin/env bash
# Builds turboquant and runs the whole test suite (the README's second command;
# .ci/run calls exactly this). Installs missing Debian packages first (root),
# and, for step 3, missing Python packages from PyPI
# (scripts/install-python-deps.sh, idempotent).
#   TQ_TEST_LABELS=unit ./scripts/test.sh   runs only C++ tests with that label.
#   TQ_SKIP_PYTHON=1 ./scripts/test.sh      skips step 3 (the Python package).
#   TQ_SANITIZERS=1 ./scripts/test.sh       also runs step 4 (sanitizers, fuzzing);
#                                            CI does not (yet).
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/install-deps.sh

jobs=$(nproc 2>/dev/null || echo 2)

# 1. GCC build: every test (labels unit, slow; gpu tests skip without a GPU).
cmake --preset release
cmake --build --preset release -j "$jobs"
label_args=()
if [ -n "${TQ_TEST_LABELS:-}" ]; then label_args=(-L "$TQ_TEST_LABELS"); fi
ctest --preset release -j "$jobs" "${label_args[@]}"

# 2. Clang build of the byte-exactness tests: golden bytes must be identical
#    under both compilers and under every compiled Highway target.
cmake --preset clang
cmake --build --preset clang -j "$jobs" --target golden_test simd_test
ctest --test-dir build/clang --output-on-failure -R '^(golden_test|simd_test)$'

# 3. Python package (python/, docs/PYTHON.md): install numpy, torch,
#    transformers, nanobind, scikit-build-core and pytest from PyPI when
#    missing, build and install the extension (its CMake build directory
#    build/python-<tag> is kept, so a second run recompiles only what changed)
#    and run its tests: bindings, the HuggingFace cache and attention function
#    on small random-weight Llama/Qwen2 models, the vLLM-compatible layer.
if [ -z "${TQ_SKIP_PYTHON:-}" ]; then
  PYTHON="${PYTHON:-python3}"
  PYTHON="$PYTHON" ./scripts/install-python-deps.sh
  CMAKE_BUILD_PARALLEL_LEVEL="$jobs" "$PYTHON" -m pip install --disable-pip-version-check \
    --no-build-isolation --no-deps ./python
  "$PYTHON" -m pytest python/tests -q
fi

# 4. Sanitizers (scripts/sanitize.sh, docs/TESTING.md "Sanitizers"): the unit
#    tests under ASan+UBSan (Clang), the multi-threaded tests under TSan
#    (GCC), and 30 s of each libFuzzer target. Any report fails the run.
#    Opt-in: its two extra library builds have not yet been timed on a quiet
#    2-core machine, and CI must stay under 45 minutes.
if [ -n "${TQ_SANITIZERS:-}" ]; then
  ./scripts/sanitize.sh
fi
