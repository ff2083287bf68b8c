# SPDX-License-Identifier: Apache-2.0
# Runs COMMAND (a ;-list) and fails unless it exits 0 and its output matches EXPECT: ctest's
# PASS_REGULAR_EXPRESSION alone would ignore the exit status.
separate_arguments(command NATIVE_COMMAND "${COMMAND}")
execute_process(COMMAND ${command} RESULT_VARIABLE status OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}${err}")
if(NOT status EQUAL 0)
  message(FATAL_ERROR "exited with ${status}, expected 0")
endif()
if(NOT out MATCHES "${EXPECT}")
  message(FATAL_ERROR "output does not match '${EXPECT}'")
endif()
