# CI check of `tq eval` on a real model (the tests/CMakeLists.txt "eval_*"
# tests): runs it with --json and fails unless
#   - every requested preset produced a result,
#   - the fp16 run's mean KL against dense fp32 is below 1e-4,
#   - mean KL strictly falls as bits rise across the TurboQuant presets given
#     in CHECK_ORDER (highest bits first).
# Prints "SKIP: ..." (the test's SKIP_REGULAR_EXPRESSION) and stops when the
# model file is absent (a fresh clone has no ../shared/data). Results are
# named by their KEY field (default preset; `weights` for --weights runs) and
# the fp16 run is the one named FP16 (default dense-f16). Usage:
#   cmake -DTQ=<tq binary> -DMODEL=<file> -DARGS="a;b;..." -DCHECK_ORDER="k4_v4;k2_v2" [-DKEY=weights -DFP16=f16] -P eval_check.cmake
if(NOT DEFINED KEY)
  set(KEY preset)
endif()
if(NOT DEFINED FP16)
  set(FP16 dense-f16)
endif()
if(NOT EXISTS "${MODEL}")
  message("SKIP: ${MODEL} not present")
  return()
endif()
execute_process(COMMAND "${TQ}" eval --model "${MODEL}" ${ARGS} --json
                OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "tq eval failed (${rc}):\n${err}")
endif()
string(JSON n LENGTH "${out}" results)
string(JSON skipped LENGTH "${out}" skipped)
if(NOT skipped EQUAL 0)
  message(FATAL_ERROR "tq eval skipped presets:\n${out}")
endif()
set(prev_kl "")
set(prev_name "")
math(EXPR last "${n} - 1")
foreach(i RANGE ${last})
  string(JSON name GET "${out}" results ${i} ${KEY})
  string(JSON kl GET "${out}" results ${i} kl_mean)
  string(JSON top1 GET "${out}" results ${i} top1_agree)
  message("${name}: kl_mean ${kl}, top1_agree ${top1}")
  set(kl_${name} "${kl}")
endforeach()
if(NOT DEFINED kl_${FP16})
  message(FATAL_ERROR "no ${FP16} result")
endif()
# CMake compares numbers as floating point with LESS; 1e-4 is written out.
if(NOT kl_${FP16} LESS 0.0001)
  message(FATAL_ERROR "${FP16} mean KL ${kl_${FP16}} is not below 1e-4")
endif()
foreach(name IN LISTS CHECK_ORDER)
  if(NOT DEFINED kl_${name})
    message(FATAL_ERROR "no result for ${name}")
  endif()
  if(prev_name AND NOT prev_kl LESS kl_${name})
    message(FATAL_ERROR "KL does not fall with bits: ${prev_name} ${prev_kl} vs ${name} ${kl_${name}}")
  endif()
  set(prev_name ${name})
  set(prev_kl ${kl_${name}})
endforeach()
