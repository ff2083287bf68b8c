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
  if(KVCACHE_NATIVE AND CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    # GCC 12's AVX-512 intrinsics (_mm512_undefined_ps) trip -Wmaybe-uninitialized inside Eigen's
    # matrix-product kernels, reported at our call sites wherever the inliner happens to take
    # them: a false positive in the compiler's own headers that -Werror would turn into a failed
    # build under -march=native.
    target_compile_options(${target} PRIVATE -Wno-maybe-uninitialized)
  endif()
endfunction()

# A static library holding the attention kernel of every storage format, a file per format so that
# a parallel build shares them out; the programs that link it include
# tests/attention_instances.hpp first (kvcache_use_attention_instances), which declares the same
# kernels extern, so none compiles them again. Its flags must be the programs' own.
set(kvcache_instance_formats float double kvcache::half kvcache::bfloat16 Eigen::half Eigen::bfloat16 kvcache::fp8_e4m3
                             kvcache::fp8_e4m3_heads kvcache::int8_rows kvcache::int4_groups kvcache::int4_rotated
                             kvcache::int8_heads)
function(kvcache_attention_instances library)
  set(sources "")
  foreach(format IN LISTS kvcache_instance_formats)
    string(REPLACE "::" "_" file "${format}")
    set(file "${CMAKE_CURRENT_BINARY_DIR}/${library}/${file}.cpp")
    file(CONFIGURE OUTPUT "${file}" CONTENT "#include \"attention_instances.hpp\"\nKVCACHE_INSTANTIATE_ATTENTION(${format});\n")
    list(APPEND sources "${file}")
  endforeach()
  add_library(${library} STATIC ${sources})
  target_include_directories(${library} PRIVATE "${PROJECT_SOURCE_DIR}/tests")
  target_link_libraries(${library} PRIVATE Eigen3::Eigen)
endfunction()

# Links `target` to the kernels of `library` (kvcache_attention_instances) instead of compiling
# them in each of its files.
function(kvcache_use_attention_instances target library)
  target_link_libraries(${target} PRIVATE ${library})
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-include>
                                           "$<$<COMPILE_LANGUAGE:CXX>:${PROJECT_SOURCE_DIR}/tests/attention_instances.hpp>")
endfunction()
