#!/usr/bin/env bash
# The sanitizer steps of ./scripts/test.sh (docs/TESTING.md, "Sanitizers"):
#   1. Clang, AddressSanitizer + UndefinedBehaviorSanitizer (preset fuzz,
#      -fno-sanitize-recover=all: any report fails the test): every unit
#      test binary but the install and docs checks, which run no library
#      code.
#   2. GCC, ThreadSanitizer (preset tsan): the tests that run library code
#      on several threads (the thread pool, the codebook cache, batch
#      encoding, attention with 2 threads, index builds, searches and IVF
#      training), plus any test named *Concurrent* or *Thread*.
#   3. Each libFuzzer target for TQ_FUZZ_SECONDS (default 30) seconds,
#      built in step 1's directory (scripts/fuzz.sh).
# Prints the wall time of each step.
set -euo pipefail
cd "$(dirname "$0")/.."

jobs=$(nproc 2>/dev/null || echo 2)
step_start=$SECONDS
step_done() { echo "sanitize: $1 took $((SECONDS - step_start)) s"; step_start=$SECONDS; }

asan_tests=(status_test thread_pool_test codebook_test random_test pack_test rotation_test codec_test golden_test
            simd_test kv_cache_test paged_kv_cache_test index_test index_fastscan_test attention_ref_test
            attention_test metrics_test model_test kv_capture_test)
fuzzers=(kv_load_fuzz index_load_fuzz llama2c_load_fuzz hf_load_fuzz tokenizer_fuzz token_file_fuzz
         kv_capture_fuzz vecs_fuzz)

# 1. ASan + UBSan. Leaks are reported (LeakSanitizer is on with ASan).
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
cmake --preset fuzz >/dev/null
cmake --build --preset fuzz -j "$jobs" --target "${asan_tests[@]}" "${fuzzers[@]}"
step_done "ASan+UBSan build"
regex="^($(IFS='|'; echo "${asan_tests[*]}"))\$"
ctest --test-dir build/fuzz -j "$jobs" --output-on-failure --timeout 900 -R "$regex"
step_done "ASan+UBSan tests"

# 2. ThreadSanitizer: binary and gtest filter.
tsan_cases=(
  "thread_pool_test:*"
  "codebook_test:*ThreadSafe*"
  "codec_test:*MultiThreaded*"
  "simd_test:*Concurrent*"
  "index_test:FlatIndex.ThreadsAndBatching*:IvfIndex.*:*Concurrent*:*Thread*"
  "index_fastscan_test:FusedBuild.*"
  "attention_test:DecodeAttention.HeadDimsAndGqaRatios:DecodeAttention.LongerSequencesAndLargeWindows:PrefillAttention.*:PagedDecodeAttention.*:*Concurrent*"
  "kv_cache_test:*Concurrent*:*Thread*"
  "paged_kv_cache_test:*Concurrent*:*Thread*"
)
tsan_bins=()
for c in "${tsan_cases[@]}"; do tsan_bins+=("${c%%:*}"); done
cmake --preset tsan >/dev/null
cmake --build --preset tsan -j "$jobs" --target "${tsan_bins[@]}"
step_done "TSan build"
export TSAN_OPTIONS="${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1}"
for c in "${tsan_cases[@]}"; do
  bin="${c%%:*}"
  filter="${c#*:}"
  echo "tsan: $bin --gtest_filter=$filter"
  TQ_SHARED_DATA="$PWD/../shared/data" "build/tsan/tests/$bin" --gtest_filter="$filter" --gtest_brief=1
done
step_done "TSan tests"

# 3. Fuzzing.
./scripts/fuzz.sh "${TQ_FUZZ_SECONDS:-30}" "${fuzzers[@]}"
step_done "fuzzing"
