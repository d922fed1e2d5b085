#!/usr/bin/env bash
# Packs the GPU binaries (and the shared libraries they need) into
# .devcarry/pack.tgz for a run on a machine with a GPU:
#   tar xzf .devcarry/pack.tgz -C .devcarry && CARRY=.devcarry bench/cuda/device_run.sh extend
set -euo pipefail
cd "$(dirname "$0")/../.."
b=build/release
rm -rf .devcarry && mkdir -p .devcarry/pack/bin .devcarry/pack/lib
cp $b/tests/cuda_test $b/tests/cuda_extend_test $b/tests/cuda_pages_test $b/bench/tq_cuda_bench .devcarry/pack/bin/
strip .devcarry/pack/bin/*
cp -L /lib/x86_64-linux-gnu/libhwy.so.1 /lib/x86_64-linux-gnu/libxxhash.so.0 .devcarry/pack/lib/
tar czf .devcarry/pack.tgz -C .devcarry/pack bin lib
rm -rf .devcarry/pack
du -h .devcarry/pack.tgz
