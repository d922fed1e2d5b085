#!/usr/bin/env bash
# Builds turboquant and runs the whole test suite (the README's second command;
# .ci/run calls exactly this). Installs missing Debian packages first (root).
#   TQ_TEST_LABELS=unit ./scripts/test.sh   runs only tests with that label.
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
