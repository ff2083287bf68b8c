# SPDX-License-Identifier: Apache-2.0
# cmake -DMODE=find_package|add_subdirectory|fetch_content -DKVCACHE_SOURCE_DIR=... -DCONSUMER_DIR=...
#       -DWORK_DIR=... -DGENERATOR=... -DCXX=... -P run_consumer.cmake
include("${CMAKE_CURRENT_LIST_DIR}/run_step.cmake")

file(REMOVE_RECURSE "${WORK_DIR}")
set(consumer_options "")
if(MODE STREQUAL "find_package")
  # Install into a private prefix, then let the consumer find it there and nowhere else.
  # The headers alone: the C API's package is packaging_c's (run_c_consumer.cmake).
  run("${CMAKE_COMMAND}" -S "${KVCACHE_SOURCE_DIR}" -B "${WORK_DIR}/kvcache-build" -G "${GENERATOR}"
      -DKVCACHE_BUILD_TESTS=OFF -DKVCACHE_BUILD_BENCHMARKS=OFF -DKVCACHE_BUILD_EXAMPLES=OFF -DKVCACHE_BUILD_C_API=OFF
      -DKVCACHE_BUILD_TOOLS=OFF -DKVCACHE_INSTALL=ON
      "-DCMAKE_INSTALL_PREFIX=${WORK_DIR}/prefix")
  run("${CMAKE_COMMAND}" --build "${WORK_DIR}/kvcache-build")
  run("${CMAKE_COMMAND}" --install "${WORK_DIR}/kvcache-build")
  if(NOT EXISTS "${WORK_DIR}/prefix/include/kvcache/kvcache.hpp")
    message(FATAL_ERROR "packaging test: the install did not put kvcache/kvcache.hpp under include/")
  endif()
  list(APPEND consumer_options "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix")
endif()
run("${CMAKE_COMMAND}" -S "${CONSUMER_DIR}" -B "${WORK_DIR}/consumer-build" -G "${GENERATOR}"
    "-DCMAKE_CXX_COMPILER=${CXX}" -DMODE=${MODE} "-DKVCACHE_SOURCE_DIR=${KVCACHE_SOURCE_DIR}" ${consumer_options})
run("${CMAKE_COMMAND}" --build "${WORK_DIR}/consumer-build")
run("${WORK_DIR}/consumer-build/consumer")
