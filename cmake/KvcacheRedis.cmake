# SPDX-License-Identifier: Apache-2.0
# The Redis block store (include/kvcache/redis_block_store.hpp): a target of its own,
# kvcache::redis, which links hiredis (Debian: libhiredis-dev), so that kvcache::kvcache needs
# only the standard library. Without hiredis the target is not defined.
find_path(KVCACHE_HIREDIS_INCLUDE_DIR hiredis/hiredis.h)
find_library(KVCACHE_HIREDIS_LIBRARY hiredis)
if(NOT KVCACHE_HIREDIS_INCLUDE_DIR OR NOT KVCACHE_HIREDIS_LIBRARY)
  message(STATUS "kvcache: hiredis not found: kvcache::redis (the Redis block store) is not built "
                 "(apt-get install libhiredis-dev)")
  return()
endif()

add_library(kvcache_redis INTERFACE)
add_library(kvcache::redis ALIAS kvcache_redis)
target_sources(kvcache_redis INTERFACE FILE_SET HEADERS BASE_DIRS include FILES
               "${CMAKE_CURRENT_SOURCE_DIR}/include/kvcache/redis_block_store.hpp")
target_include_directories(kvcache_redis SYSTEM INTERFACE "$<BUILD_INTERFACE:${KVCACHE_HIREDIS_INCLUDE_DIR}>")
# Installed, the library is found by name where the consumer links.
target_link_libraries(kvcache_redis INTERFACE kvcache::kvcache "$<BUILD_INTERFACE:${KVCACHE_HIREDIS_LIBRARY}>"
                                              "$<INSTALL_INTERFACE:hiredis>")
set_target_properties(kvcache_redis PROPERTIES EXPORT_NAME redis VERIFY_INTERFACE_HEADER_SETS ON)
