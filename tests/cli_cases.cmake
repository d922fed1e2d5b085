# The tq command line under hostile numbers (the tests/CMakeLists.txt
# "cli_cases" test). For every numeric option of every subcommand, each of
#   0, -1, 2^64 (overflows uint64), hi + 1 (just past the bound), abc, 1e3, 0x10
# is given on top of a quick base command line; a value outside the option's
# range must be refused with an error naming the option and the range, a
# value inside it must run the base command to its usual end. Every case
# must exit by itself (no signal, no abort) within CASE_TIMEOUT seconds.
# Then a few in-range sizes whose product is more than any machine's memory
# must be refused before anything is allocated. Prints the number of cases.
# Usage: cmake -DTQ=<tq binary> -DWORK=<scratch dir> [-DCASE_TIMEOUT=s] [-DMODEL=<llama2.c file>]
#        -P cli_cases.cmake
cmake_policy(VERSION 3.20)
if(NOT DEFINED CASE_TIMEOUT)
  set(CASE_TIMEOUT 60)
endif()
set(U64_OVERFLOW 18446744073709551616)
set(U64_MAX 18446744073709551615)
file(REMOVE_RECURSE "${WORK}")
file(MAKE_DIRECTORY "${WORK}")

set(cases 0)
set(failures "")

# run_case(<expect> <regex> args...): <expect> is "ok" (exit 0) or "error"
# (a nonzero exit code whose stderr matches <regex>).
function(run_case expect regex)
  set(args ${ARGN})
  execute_process(COMMAND "${TQ}" ${args} OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc
                  TIMEOUT ${CASE_TIMEOUT} WORKING_DIRECTORY "${WORK}")
  math(EXPR n "${cases} + 1")
  set(cases ${n} PARENT_SCOPE)
  string(REPLACE ";" " " shown "${args}")
  if(NOT rc MATCHES "^[0-9]+$")
    # A signal ("Child aborted", "Segmentation fault", ...) or the timeout.
    set(failures "${failures}\n  tq ${shown}: ${rc}\n${err}" PARENT_SCOPE)
  elseif(expect STREQUAL "ok" AND NOT rc EQUAL 0)
    set(failures "${failures}\n  tq ${shown}: exit ${rc} for an accepted value:\n${err}" PARENT_SCOPE)
  elseif(expect STREQUAL "error" AND rc EQUAL 0)
    set(failures "${failures}\n  tq ${shown}: accepted (exit 0), expected an error matching '${regex}'" PARENT_SCOPE)
  elseif(expect STREQUAL "error" AND NOT err MATCHES "${regex}")
    set(failures "${failures}\n  tq ${shown}: exit ${rc}, stderr does not match '${regex}':\n${err}" PARENT_SCOPE)
  elseif(expect STREQUAL "error" AND err MATCHES "terminate called|Aborted|what\\(\\)")
    set(failures "${failures}\n  tq ${shown}: an uncaught exception:\n${err}" PARENT_SCOPE)
  endif()
endfunction()

# A subcommand: its words, its quick base options (option;value;...), and
# what an accepted value leads to: "ok" or a regex of the expected error
# (commands whose inputs are files given as missing paths here).
macro(command name words base accepted)
  set(${name}_words ${words})
  set(${name}_base ${base})
  set(${name}_accepted "${accepted}")
endmacro()

# The base options without `opt` (and its value): single-value options may
# be given once.
function(base_without cmd opt outvar)
  set(result "")
  set(skip FALSE)
  foreach(item IN LISTS ${cmd}_base)
    if(skip)
      set(skip FALSE)
    elseif(item STREQUAL opt)
      set(skip TRUE)
    else()
      list(APPEND result "${item}")
    endif()
  endforeach()
  set(${outvar} ${result} PARENT_SCOPE)
endfunction()

# An integer option (or a comma-list option of integers) in [lo, hi].
function(int_option cmd opt lo hi)
  base_without(${cmd} ${opt} base)
  set(values 0 -1 ${U64_OVERFLOW} abc 1e3 0x10)
  if(NOT "${hi}" STREQUAL "${U64_MAX}")
    math(EXPR above "${hi} + 1")
    list(APPEND values ${above})
  endif()
  foreach(v IN LISTS values)
    set(inside FALSE)
    if(v MATCHES "^[0-9]+$" AND NOT "${v}" STREQUAL "${U64_OVERFLOW}")
      if(NOT v LESS lo AND NOT v GREATER hi)
        set(inside TRUE)
      endif()
    endif()
    if(inside)
      if(${cmd}_accepted STREQUAL "ok")
        run_case(ok "" ${${cmd}_words} ${base} ${opt} ${v})
      else()
        run_case(error "${${cmd}_accepted}" ${${cmd}_words} ${base} ${opt} ${v})
      endif()
    else()
      run_case(error "${opt}[^\n]*${lo}\\.\\.${hi}" ${${cmd}_words} ${base} ${opt} ${v})
    endif()
  endforeach()
  set(cases ${cases} PARENT_SCOPE)
  set(failures "${failures}" PARENT_SCOPE)
endfunction()

set(NOFILE "${WORK}/missing")
command(distortion "distortion" "--samples;200;--bits;1;--dim;8;--threads;1" ok)
int_option(distortion --dim 1 4096)
int_option(distortion --samples 2 100000000)
int_option(distortion --bits 1 8)
int_option(distortion --seed 0 ${U64_MAX})
int_option(distortion --threads 0 1024)

command(demo "demo" "" ok)
int_option(demo --samples 2 10000000)

command(codec "bench;codec" "--mbytes;1;--reps;1;--dim;8;--threads;1" ok)
int_option(codec --dim 1 65536)
int_option(codec --bits 1 8)
int_option(codec --threads 0 1024)
int_option(codec --mbytes 1 1048576)
int_option(codec --reps 1 1000)

command(kv "bench;kv" "--layers;1;--kv-heads;1;--head-dim;64;--context;64" ok)
int_option(kv --layers 1 4096)
int_option(kv --kv-heads 1 4096)
int_option(kv --head-dim 1 4096)
int_option(kv --context 2 16777216)

command(kvq "bench;kv-quality" "--tokens;16" ok)
int_option(kvq --tokens 1 16777216)

command(attn "bench;attention"
        "--context;64;--preset;k4_v4;--reps;1;--warmup;0;--threads;1;--q-heads;2;--kv-heads;1;--head-dim;64;--chunk;16"
        ok)
int_option(attn --context 1 16777216)
int_option(attn --batch 1 1048576)
int_option(attn --q-heads 1 4096)
int_option(attn --kv-heads 1 4096)
int_option(attn --head-dim 1 4096)
int_option(attn --threads 0 1024)
int_option(attn --chunk 1 16777216)
int_option(attn --reps 1 100000)
int_option(attn --warmup 0 100000)
int_option(attn --sinks 0 16777216)
int_option(attn --recent 0 16777216)
int_option(attn --block-size 0 1024)
int_option(attn --seed 0 ${U64_MAX})

command(attnq "bench;attention-quality" "--preset;k4_v4;--tokens;16" ok)
int_option(attnq --tokens 1 16777216)
int_option(attnq --sinks 0 16777216)
int_option(attnq --recent 0 16777216)

command(eval "eval" "--model;${NOFILE}.bin;--generate;32" "model '[^']*missing.bin' does not exist")
int_option(eval --generate 0 16777216)
int_option(eval --context 0 16777216)
int_option(eval --max-tokens 0 4294967296)
int_option(eval --threads 0 1024)
int_option(eval --sinks 0 16777216)
int_option(eval --recent 0 16777216)
int_option(eval --compress-chunk 1 65536)
int_option(eval --continuations 0 100000)
int_option(eval --continuation-length 0 16777216)
int_option(eval --passkeys 0 100000)
int_option(eval --seed 0 ${U64_MAX})

command(fetch "search;fetch-glove" "--out;${WORK}/glove;--tarball;${NOFILE}.tgz" "cannot read --tarball")
int_option(fetch --queries 1 1073741824)
int_option(fetch --seed 0 ${U64_MAX})
int_option(fetch --gt-k 1 100000)
int_option(fetch --threads 0 1024)

command(search "search;bench" "--base;${NOFILE}.fvecs;--queries;${NOFILE}.fvecs;--gt;${NOFILE}.ivecs"
        "cannot open[^\n]*missing.fvecs")
int_option(search --bits 1 8)
int_option(search --threads 0 1024)
int_option(search --seed 0 ${U64_MAX})
int_option(search --rescore 0 1048576)
int_option(search --reps 1 100)
int_option(search --qps-queries 1 1073741824)
int_option(search --recall-queries 0 1073741824)
int_option(search --nlist 1 1048576)
int_option(search --nprobe 1 1048576)

# A real-valued option: NaN, infinity, negative, zero and past the bound.
foreach(v 0 -1 nan inf 1e999 2e9 abc)
  run_case(error "--budget-gib: must be a number in 1e-06\\.\\.1000000000" bench kv --layers 1 --kv-heads 1
           --head-dim 64 --context 64 --budget-gib ${v})
endforeach()
run_case(ok "" bench kv --layers 1 --kv-heads 1 --head-dim 64 --context 64 --budget-gib 0.5)

# Each size in range, their product beyond any machine: refused up front.
set(mem "more than this machine's [0-9.]+ GiB of memory")
run_case(error "--samples x --dim would need about [0-9.e+]+ GiB.*${mem}" distortion --samples 100000000 --dim 4096)
run_case(error "--mbytes would need about.*${mem}" bench codec --mbytes 1048576)
run_case(error "--context x --kv-heads x --head-dim would need about.*${mem}" bench kv --context 16777216
         --kv-heads 4096 --head-dim 4096)
run_case(error "--batch x --context x --kv-heads x --head-dim would need about.*${mem}" bench attention
         --batch 1048576 --context 16777216 --kv-heads 4096 --q-heads 4096 --head-dim 128)
# tq eval sizes its memory from the model: with a real model (when
# ../shared/data is present), a context no machine holds is refused.
if(DEFINED MODEL AND EXISTS "${MODEL}")
  run_case(error "--context would need about.*${mem}" eval --model ${MODEL} --generate 64 --context 16777216)
endif()

if(failures)
  message(FATAL_ERROR "${cases} cases run; these failed:${failures}")
endif()
message("all ${cases} CLI cases passed (no signal, no abort, each within ${CASE_TIMEOUT} s)")
