#!/usr/bin/env bash
# Packs the GPU binaries (and the shared libraries they need) into
# .devcarry/pack.tgz for a run on a machine with a GPU:
#   tar xzf .devcarry/pack.tgz -C .devcarry && CARRY=.devcarry bench/cuda/device_run.sh extend
set -euo pipefail
cd "$(dirname "$0")/../.."
b=build/release
rm -rf .devcarry && mkdir -p .devcarry/pack/bin .devcarry/pack/lib
# PACK_BINS: the binaries of build/release to pack (the carry limit is 64 MiB:
# about 11 MB each compressed); EXTRA_BINS: more files packed as they are,
# e.g. an A/B variant of the bench built with other flags:
#   cmake --preset release -B build/wave -DCMAKE_CUDA_FLAGS=-DTQ_EXTEND_WAVE_SPLITS=1
#   cmake --build build/wave --target tq_cuda_bench && cp build/wave/bench/tq_cuda_bench /tmp/tq_cuda_bench_wave
#   PACK_BINS="tests/cuda_extend_test bench/tq_cuda_bench" EXTRA_BINS=/tmp/tq_cuda_bench_wave bench/cuda/pack.sh
for x in ${PACK_BINS:-tests/cuda_test tests/cuda_extend_test tests/cuda_pages_test bench/tq_cuda_bench}; do
  cp "$b/$x" .devcarry/pack/bin/
done
for x in ${EXTRA_BINS:-}; do cp "$x" .devcarry/pack/bin/; done
strip .devcarry/pack/bin/*
cp -L /lib/x86_64-linux-gnu/libhwy.so.1 /lib/x86_64-linux-gnu/libxxhash.so.0 .devcarry/pack/lib/
tar czf .devcarry/pack.tgz -C .devcarry/pack bin lib
rm -rf .devcarry/pack
du -h .devcarry/pack.tgz
