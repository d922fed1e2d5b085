#!/usr/bin/env bash
# Runs the libFuzzer targets of fuzz/ (built by `cmake --preset fuzz`), each
# for SECONDS on a corpus seeded with the valid files the target writes
# itself (TQ_FUZZ_WRITE_SEEDS), and prints each run's executions.
#   scripts/fuzz.sh 30                     every target, 30 s each (CI)
#   scripts/fuzz.sh 600 tokenizer_fuzz     one target, 10 minutes
# Exits non-zero at the first crash, leak, UB report, timeout or
# out-of-memory; libFuzzer leaves the input as build/fuzz/artifacts/<target>/.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds="${1:-30}"
shift || true
build="${TQ_FUZZ_BUILD:-build/fuzz}"
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=(kv_load_fuzz index_load_fuzz llama2c_load_fuzz hf_load_fuzz tokenizer_fuzz token_file_fuzz
           kv_capture_fuzz vecs_fuzz)
fi

for t in "${targets[@]}"; do
  bin="$build/fuzz/$t"
  corpus="$build/corpus/$t"
  artifacts="$build/artifacts/$t"
  mkdir -p "$corpus" "$artifacts"
  # Seeds: the valid files the target writes (-runs=0 only loads them).
  if ! TQ_FUZZ_WRITE_SEEDS="$corpus" "$bin" -runs=0 -artifact_prefix="$artifacts/" "$corpus" \
       >"$build/artifacts/$t.seed.log" 2>&1; then
    tail -n 40 "$build/artifacts/$t.seed.log" >&2
    echo "fuzz: $t failed while writing or loading its seeds" >&2
    exit 1
  fi
  log="$build/artifacts/$t.log"
  # -timeout: one input running 30 s is a finding (a hang), as is RSS above 2 GiB.
  if ! "$bin" -max_total_time="$seconds" -timeout=30 -rss_limit_mb=2048 -print_final_stats=1 \
       -artifact_prefix="$artifacts/" "$corpus" >"$log" 2>&1; then
    tail -n 60 "$log" >&2
    echo "fuzz: $t FAILED (input and log under $artifacts/)" >&2
    exit 1
  fi
  runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo '?')
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -n 1 | grep -o '[0-9]*' || echo '?')
  echo "fuzz: $t clean: $runs inputs in ${seconds} s, coverage $cov edges, corpus $(ls "$corpus" | wc -l) files"
done
