# The installed package works where it lands, also after a move: installs
# the build into WORK/a, moves it to WORK/b, asks pkg-config (PKG_CONFIG_PATH
# = WORK/b's pkgconfig folder) for flags, checks that they name WORK/b, and
# compiles, links and runs a program against <tq/tq.h> with them.
#   cmake -DBUILD=<build dir> -DWORK=<scratch dir> -DCXX=<c++ compiler> -DLIBDIR=<lib dir name> -P install_check.cmake
cmake_minimum_required(VERSION 3.25)
foreach(v BUILD WORK CXX LIBDIR)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "install_check: -D${v}=... is required")
  endif()
endforeach()
find_program(PKG_CONFIG pkg-config REQUIRED)
file(REMOVE_RECURSE ${WORK})
execute_process(COMMAND ${CMAKE_COMMAND} --install ${BUILD} --prefix ${WORK}/a
                RESULT_VARIABLE rc OUTPUT_QUIET ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "install_check: cmake --install failed: ${err}")
endif()
file(RENAME ${WORK}/a ${WORK}/b)
set(ENV{PKG_CONFIG_PATH} ${WORK}/b/${LIBDIR}/pkgconfig)
execute_process(COMMAND ${PKG_CONFIG} --static --cflags --libs turboquant
                RESULT_VARIABLE rc OUTPUT_VARIABLE flags ERROR_VARIABLE err OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "install_check: pkg-config turboquant failed: ${err}")
endif()
# The -I and -L directories, resolved, must be the moved install's.
separate_arguments(flag_list UNIX_COMMAND "${flags}")
set(dirs)
foreach(f ${flag_list})
  if(f MATCHES "^-[IL](.+)$")
    get_filename_component(d "${CMAKE_MATCH_1}" REALPATH)
    list(APPEND dirs "${d}")
  endif()
endforeach()
foreach(want "${WORK}/b/include" "${WORK}/b/${LIBDIR}")
  get_filename_component(w "${want}" REALPATH)
  if(NOT w IN_LIST dirs)
    message(FATAL_ERROR "install_check: the moved install's flags do not name ${want}: ${flags}")
  endif()
endforeach()
file(WRITE ${WORK}/use.cc [=[
#include <tq/tq.h>
#include <cstdio>
#include <vector>
int main() {
  auto codec = tq::Codec::Create({.dim = 128, .bits = 3});
  if (!codec.ok()) { std::puts(codec.status().ToString().c_str()); return 1; }
  std::vector<float> x(128, 0.5f);
  std::vector<uint8_t> codes(codec->row_bytes());
  return codec->Encode(x, codes).ok() ? 0 : 2;
}
]=])
execute_process(COMMAND ${CXX} -std=c++20 ${WORK}/use.cc -o ${WORK}/use ${flag_list}
                RESULT_VARIABLE rc ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "install_check: compiling against the moved install failed (${flags}): ${err}")
endif()
execute_process(COMMAND ${WORK}/use RESULT_VARIABLE rc OUTPUT_VARIABLE out)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "install_check: the program built against the install failed (${rc}): ${out}")
endif()
file(REMOVE_RECURSE ${WORK})
message(STATUS "install_check: relocated install found by pkg-config, compiled, linked and ran")
