#!/usr/bin/env bash
# One call on the GPU machine: the gpu-labelled tests, compute-sanitizer
# (memcheck, racecheck) on a subset, our benchmark, torch SDPA on fp16 KV,
# and the joined report. Binaries are built elsewhere (nvcc on the
# development machine) and carried in $CARRY/bin with the shared libraries
# they need in $CARRY/lib.
#   CARRY=.devcarry OUT=/tmp/out bench/cuda/device_run.sh [quick|full|bench|profile|extend|extend-bench]
# profile: ncu of one write and one staged decode launch only.
# extend: the gpu-labelled tests (cuda_test, cuda_extend_test, cuda_pages_test), compute-
# sanitizer on an extend subset, and the extend grid of the acceptance bars
# (q_len 4 and 16 at B 16, N 32K; q_len 512 at B 1 and 8, N 32K; q_len 2,048
# at B 1, N 128K) for ours and SDPA, joined (SANITIZERS="" skips the
# sanitizer runs; PROFILE=1 adds ncu of two extend launches). extend-bench:
# the grid only.
set -uo pipefail
CARRY=${CARRY:-.devcarry}
OUT=${OUT:-/tmp/tq-gpu-out}
MODE=${1:-full}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$CARRY/lib:${LD_LIBRARY_PATH:-}"
export PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv
  python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda)'
} > "$OUT/tq.log" 2>&1
if [ "$MODE" = "extend" ] || [ "$MODE" = "extend-bench" ]; then
  if [ "$MODE" = "extend" ]; then
    # Eight gtest shards a binary in parallel: the fp64 oracles run on the
    # host's cores while the GPU is shared.
    for t in cuda_test cuda_extend_test cuda_pages_test; do
      echo "== $t (8 shards)"
      for i in 0 1 2 3 4 5 6 7; do
        GTEST_TOTAL_SHARDS=8 GTEST_SHARD_INDEX=$i "$CARRY/bin/$t" --gtest_brief=1 > "$OUT/$t.$i.log" 2>&1 &
      done
      rc=0
      for job in $(jobs -p); do wait "$job" || rc=1; done
      cat "$OUT/$t".?.log > "$OUT/$t.log"; rm -f "$OUT/$t".?.log
      echo "$t rc=$rc passed=$(grep -h '^\[  PASSED  \]' "$OUT/$t.log" | awk '{s+=$4} END {print s}')" \
           "failed: $(grep -c '^\[  FAILED  \]' "$OUT/$t.log")"
      grep -h '^\[  FAILED  \]\|k3_v3 attention-output' "$OUT/$t.log" | head -5
    done
  fi
  P=${PRESETS:-k3_v3,k4_v4}
  cases=("--batch 16 --context 32768 --q-len 4,8,16,32" "--batch 1,8 --context 32768 --q-len 512"
         "--batch 1 --context 131072 --q-len 2048")
  # The kernels timed a case: the plan's choice (auto) and each kernel forced
  # (auto repeats one of them: the repeat shows the run's noise).
  kernels=("auto,narrow,tile" "auto,narrow" "auto,narrow")
  i=0
  for c in "${cases[@]}"; do
    echo "== extend $c"
    # shellcheck disable=SC2086
    "$CARRY/bin/tq_cuda_bench" --presets "$P" $c --extend-kernel "${kernels[$i]}" --reps 7 \
      > "$OUT/tq_ext$i.json" 2>> "$OUT/tq.log"; echo "bench rc=$?"
    # shellcheck disable=SC2086
    python3 bench/cuda/sdpa_bench.py $c > "$OUT/sdpa_ext$i.json" 2>> "$OUT/sdpa.log"; echo "sdpa rc=$?"
    i=$((i + 1))
  done
  python3 - "$OUT" <<'PY'
import glob, json, sys
out = sys.argv[1]
for kind in ("tq", "sdpa"):
    parts = [json.load(open(f)) for f in sorted(glob.glob(f"{out}/{kind}_ext*.json"))]
    merged = dict(parts[0], results=[r for p in parts for r in p["results"]])
    json.dump(merged, open(f"{out}/{kind}_extend.json", "w"))
PY
  grep -E "extend|q_len" "$OUT/tq.log" "$OUT/sdpa.log" | tail -20
  python3 bench/cuda/report.py "$OUT/tq_extend.json" "$OUT/sdpa_extend.json" --json "$OUT/report_extend.json" \
    > "$OUT/report_extend.md"
  cat "$OUT/report_extend.md"
  if [ -n "${PROFILE:-}" ]; then
    echo "== ncu (one extend launch: q_len 512 at B 1, then q_len 16 at B 16; N 32K, k3_v3)"
    for c in "--batch 1 --q-len 512" "--batch 16 --q-len 16"; do
      # shellcheck disable=SC2086
      ncu --clock-control none --section SpeedOfLight --section Occupancy --section WarpStateStats \
          --section SchedulerStats --section InstructionStats --section LaunchStats -k regex:Extend -c 1 \
          "$CARRY/bin/tq_cuda_bench" --presets k3_v3 --context 32768 $c --reps 1 > "$OUT/ncu_extend.txt" 2>&1
      echo "ncu $c rc=$?"
      grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Theoretical Occ|Warp Cycles Per Issued|Issue Slots Busy|No Eligible|Stall|Executed Ipc A|Dynamic Shared|stalled|spends" "$OUT/ncu_extend.txt" | cut -c1-400 | head -40
    done
  fi
  if [ "$MODE" = "extend" ]; then
    # compute-sanitizer on an extend subset, after the benchmark (the
    # slowest part: a run cut short still brings the timings back).
    subset='*CudaExtend.*k3_v3_d128*:*CudaExtend.*k8_v4_d64*:*CudaExtend.*k2_v8_d256*:*CudaExtend.*q8_d128*:*CudaExtendGraph*:*CudaExtendArgs*'
    for tool in ${SANITIZERS-memcheck racecheck}; do
      compute-sanitizer --tool $tool --error-exitcode 9 "$CARRY/bin/cuda_extend_test" --gtest_brief=1 \
        --gtest_filter="$subset" > "$OUT/sanitizer_$tool.log" 2>&1
      echo "$tool rc=$?"; tail -2 "$OUT/sanitizer_$tool.log"
    done
  fi
  exit 0
fi
if [ "$MODE" != "profile" ]; then
  echo "== cuda_test"
  "$CARRY/bin/cuda_test" --gtest_brief=1 > "$OUT/cuda_test.log" 2>&1
  echo "cuda_test rc=$?"; tail -4 "$OUT/cuda_test.log"
fi
if [ "$MODE" != "bench" ] && [ "$MODE" != "profile" ]; then
  echo "== compute-sanitizer"
  subset='*CudaWrite*k3_v3_d128*:*CudaWrite*q8_d64*:*CudaWrite*turboquant_4bit_nc_d256*:*CudaDecode*k3_v3_d128_g4_bs16*:*CudaDecode*k8_v4_d128*:*CudaDecode*k4_v8_d64*:*CudaDecode*k2_v2_d64*:*CudaWriteErrors*'
  for tool in memcheck racecheck; do
    compute-sanitizer --tool $tool --error-exitcode 9 "$CARRY/bin/cuda_test" --gtest_brief=1 \
      --gtest_filter="$subset" >> "$OUT/cuda_test.log" 2>&1
    echo "$tool rc=$?"; tail -2 "$OUT/cuda_test.log"
  done
fi
if [ "$MODE" = "profile" ]; then
  echo "== ncu (one launch of the write kernel, one of the staged decode kernel)"
  for k in WriteKernel DecodeKernelStaged; do
    ncu --clock-control none --section SpeedOfLight --section Occupancy --section WarpStateStats \
        --section LaunchStats --section MemoryWorkloadAnalysis --section InstructionStats \
        -k regex:$k -c 1 \
        "$CARRY/bin/tq_cuda_bench" --presets k3_v3 --batch 16 --context 32768 --reps 2 > "$OUT/ncu_$k.txt" 2>&1
    echo "ncu $k rc=$?"
    grep -E "Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)|Achieved Occupancy|Registers Per|Theoretical Occ|Warp Cycles Per Issued|Issue Slots|Eligible|Executed Ipc|Block Size|Grid Size|L1/TEX Hit|L2 Hit" "$OUT/ncu_$k.txt" | head -30
  done
  exit 0
fi
if [ "$MODE" = "quick" ]; then
  args=(--presets k3_v3,k4_v4,k8_v4 --batch 1,16 --context 4096,32768)
  pargs=(--batch 1,16 --context 4096,32768)
else
  args=(--presets k3_v3,k4_v3,k4_v4,k8_v4 --batch 1,8,16,32 --context 4096,32768,131072 --reps 7)
  pargs=(--batch 1,8,16,32 --context 4096,32768,131072)
fi
echo "== tq_cuda_bench ${args[*]}"
"$CARRY/bin/tq_cuda_bench" "${args[@]}" > "$OUT/tq.json" 2>> "$OUT/tq.log"; echo "bench rc=$?"
echo "== sdpa_bench"
python3 bench/cuda/sdpa_bench.py "${pargs[@]}" > "$OUT/sdpa.json" 2> "$OUT/sdpa.log"; echo "sdpa rc=$?"
tail -3 "$OUT/sdpa.log"
python3 bench/cuda/report.py "$OUT/tq.json" "$OUT/sdpa.json" --json "$OUT/report.json" > "$OUT/report.md"
cat "$OUT/report.md"
