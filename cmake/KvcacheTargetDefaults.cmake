# SPDX-License-Identifier: Apache-2.0
# Flags for kvcache's own executables only; consumers of kvcache::kvcache never see them.
function(kvcache_target_defaults target)
  target_link_libraries(${target} PRIVATE kvcache::kvcache)
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    target_compile_options(${target} PRIVATE -Wall -Wextra -Wpedantic -Wshadow -Wconversion -Wsign-conversion)
    # GCC 12 reports false -Wrestrict inside std::string's operator+ and insert wherever its
    # inliner happens to expose them (GCC bug 105651); later releases do not.
    if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND CMAKE_CXX_COMPILER_VERSION VERSION_GREATER_EQUAL 12
       AND CMAKE_CXX_COMPILER_VERSION VERSION_LESS 13)
      target_compile_options(${target} PRIVATE -Wno-restrict)
    endif()
    if(KVCACHE_WARNINGS_AS_ERRORS)
      target_compile_options(${target} PRIVATE -Werror)
    endif()
    if(KVCACHE_SANITIZE)
      target_compile_options(${target} PRIVATE -fsanitize=address,undefined -fno-sanitize-recover=all
                                               -fno-omit-frame-pointer)
      target_link_options(${target} PRIVATE -fsanitize=address,undefined -fno-sanitize-recover=all)
      target_compile_definitions(${target} PRIVATE KVCACHE_ENABLE_ASSERTS=1)
    endif()
  endif()
endfunction()

# Benchmarks and the demo measure speed: let them use this machine's vector units when asked.
function(kvcache_speed_defaults target)
  kvcache_target_defaults(${target})
  if(KVCACHE_NATIVE AND CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    target_compile_options(${target} PRIVATE -march=native)
  endif()
endfunction()
