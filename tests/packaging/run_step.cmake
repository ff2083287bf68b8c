# SPDX-License-Identifier: Apache-2.0
# run(command...): runs a step of a packaging test, failing the test (naming the step) if it fails.
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    string(REPLACE ";" " " command "${ARGN}")
    message(FATAL_ERROR "packaging test (${MODE}) failed at: ${command}")
  endif()
endfunction()
