# SPDX-License-Identifier: Apache-2.0
# cmake -DBUILD_DIR=... -DKVCACHE_SOURCE_DIR=... -DWORK_DIR=... -DGENERATOR=... -DCC=... -P run_c_consumer.cmake
#
# The C API as an engine gets it: the build installed into a private prefix, then the C example
# (examples/c/decode.c) built with `cc -std=c99 $(pkg-config --cflags --libs kvcache)` against the
# shared library and against the static one, and by a CMake project through find_package, each
# run; and the installed kvcache-bench run on a Qwen3 config.json.
set(MODE "C API")
include("${CMAKE_CURRENT_LIST_DIR}/run_step.cmake")

file(REMOVE_RECURSE "${WORK_DIR}")
set(prefix "${WORK_DIR}/prefix")
run("${CMAKE_COMMAND}" --install "${BUILD_DIR}" --prefix "${prefix}")
file(GLOB_RECURSE pc_file "${prefix}/*/kvcache.pc")
if(NOT pc_file)
  message(FATAL_ERROR "packaging test (C API): the install put no kvcache.pc under ${prefix}")
endif()
get_filename_component(pc_dir "${pc_file}" DIRECTORY)
get_filename_component(libdir "${pc_dir}" DIRECTORY)

function(pkg_config out)
  execute_process(COMMAND "${CMAKE_COMMAND}" -E env "PKG_CONFIG_PATH=${pc_dir}" pkg-config ${ARGN} kvcache
                  OUTPUT_VARIABLE flags OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "packaging test (C API): pkg-config ${ARGN} kvcache failed")
  endif()
  separate_arguments(flags UNIX_COMMAND "${flags}")
  set(${out} ${flags} PARENT_SCOPE)
endfunction()

set(example "${KVCACHE_SOURCE_DIR}/examples/c/decode.c")
set(warnings -std=c99 -Wall -Wextra -Wpedantic -Werror)
pkg_config(shared --cflags --libs)
run("${CC}" ${warnings} "${example}" ${shared} -lm -o "${WORK_DIR}/decode_shared")
run("${CMAKE_COMMAND}" -E env "LD_LIBRARY_PATH=${libdir}" "${WORK_DIR}/decode_shared" "${WORK_DIR}/shared.kvstate")

# Static: the archive itself, then what it needs (pkg-config's Libs.private).
pkg_config(cflags --cflags)
pkg_config(static_libs --static --libs-only-l)
list(REMOVE_ITEM static_libs -lkvcache_c)
run("${CC}" ${warnings} ${cflags} "${example}" "${libdir}/libkvcache_c.a" ${static_libs} -lm -o "${WORK_DIR}/decode_static")
run("${WORK_DIR}/decode_static" "${WORK_DIR}/static.kvstate")

run("${CMAKE_COMMAND}" -S "${CMAKE_CURRENT_LIST_DIR}/c_consumer" -B "${WORK_DIR}/c-consumer-build" -G "${GENERATOR}"
    "-DCMAKE_C_COMPILER=${CC}" "-DCMAKE_PREFIX_PATH=${prefix}" "-DEXAMPLE=${example}")
run("${CMAKE_COMMAND}" --build "${WORK_DIR}/c-consumer-build")
run("${WORK_DIR}/c-consumer-build/decode" "${WORK_DIR}/cmake.kvstate")

execute_process(COMMAND "${prefix}/bin/kvcache-bench" --config "${KVCACHE_SOURCE_DIR}/tests/data/qwen3-0.6b/config.json"
                        --context 64 --decode 2 --quiet
                RESULT_VARIABLE rc OUTPUT_VARIABLE table)
message("${table}")
if(NOT rc EQUAL 0 OR NOT table MATCHES "28 layers, 16 query heads, 8 kv heads x 128")
  message(FATAL_ERROR "packaging test (C API): the installed kvcache-bench did not print the Qwen3 model's table")
endif()
