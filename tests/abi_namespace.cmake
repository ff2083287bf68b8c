# SPDX-License-Identifier: Apache-2.0
# cmake -DINCLUDE_DIR=... -P abi_namespace.cmake
#
# Every namespace kvcache a header opens holds its declarations in the inline namespace
# KVCACHE_ABI (include/kvcache/version.hpp), so that libraries built against different APIs never
# mix their types in one program: `namespace kvcache {` must be followed by
# `inline namespace KVCACHE_ABI {`, and no header may open `namespace kvcache::...` directly.
file(GLOB_RECURSE headers "${INCLUDE_DIR}/kvcache/*.hpp")
if(NOT headers)
  message(FATAL_ERROR "abi_namespace: no headers under ${INCLUDE_DIR}/kvcache")
endif()
set(bad "")
set(checked 0)
foreach(header IN LISTS headers)
  file(STRINGS "${header}" lines)
  set(expect_inline FALSE)
  foreach(line IN LISTS lines)
    if(expect_inline)
      if(NOT line STREQUAL "inline namespace KVCACHE_ABI {")
        list(APPEND bad "${header}: namespace kvcache { followed by '${line}'")
      endif()
      set(expect_inline FALSE)
    endif()
    if(line STREQUAL "namespace kvcache {")
      set(expect_inline TRUE)
      math(EXPR checked "${checked} + 1")
    elseif(line MATCHES "^namespace kvcache::")
      list(APPEND bad "${header}: '${line}' opens a namespace outside KVCACHE_ABI")
    endif()
  endforeach()
endforeach()
if(bad)
  list(JOIN bad "\n" message)
  message(FATAL_ERROR "declarations outside the inline namespace KVCACHE_ABI:\n${message}")
endif()
if(checked EQUAL 0)
  message(FATAL_ERROR "abi_namespace: no header opens namespace kvcache")
endif()
message(STATUS "abi_namespace: ${checked} namespace kvcache blocks, each in KVCACHE_ABI")
