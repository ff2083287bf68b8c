# SPDX-License-Identifier: Apache-2.0
# Runs COMMAND (a ;-list) and fails unless it exits EXPECT_STATUS (default 0) and its output
# matches EXPECT (standard output; for a non-zero status, standard error too): ctest's
# PASS_REGULAR_EXPRESSION alone would ignore the exit status.
if(NOT DEFINED EXPECT_STATUS)
  set(EXPECT_STATUS 0)
endif()
separate_arguments(command NATIVE_COMMAND "${COMMAND}")
execute_process(COMMAND ${command} RESULT_VARIABLE status OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}${err}")
if(NOT status EQUAL EXPECT_STATUS)
  message(FATAL_ERROR "exited with ${status}, expected ${EXPECT_STATUS}")
endif()
if(NOT EXPECT_STATUS EQUAL 0)
  set(out "${out}${err}")
endif()
if(NOT out MATCHES "${EXPECT}")
  message(FATAL_ERROR "output does not match '${EXPECT}'")
endif()
