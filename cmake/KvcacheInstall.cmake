# SPDX-License-Identifier: Apache-2.0
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

# The headers alone are the same on every machine; with the C API's libraries the package is
# this architecture's.
if(KVCACHE_BUILD_C_API)
  set(kvcache_cmake_default "${CMAKE_INSTALL_LIBDIR}/cmake/kvcache")
  set(kvcache_arch_independent "")
else()
  set(kvcache_cmake_default "${CMAKE_INSTALL_DATADIR}/cmake/kvcache")
  set(kvcache_arch_independent ARCH_INDEPENDENT)
endif()
set(KVCACHE_INSTALL_CMAKEDIR "${kvcache_cmake_default}" CACHE STRING "Where kvcacheConfig.cmake is installed")

install(TARGETS kvcache EXPORT kvcacheTargets FILE_SET HEADERS)
if(TARGET kvcache_redis)
  install(TARGETS kvcache_redis EXPORT kvcacheTargets FILE_SET HEADERS)
endif()
if(KVCACHE_BUILD_C_API)
  install(TARGETS kvcache_c kvcache_c_static EXPORT kvcacheTargets FILE_SET HEADERS)
  # kvcache.pc, relocatable: its prefix is found from where it lies.
  file(RELATIVE_PATH kvcache_pc_prefix "/prefix/${CMAKE_INSTALL_LIBDIR}/pkgconfig" "/prefix")
  configure_file("${CMAKE_CURRENT_LIST_DIR}/kvcache.pc.in" "${PROJECT_BINARY_DIR}/kvcache.pc" @ONLY)
  install(FILES "${PROJECT_BINARY_DIR}/kvcache.pc" DESTINATION "${CMAKE_INSTALL_LIBDIR}/pkgconfig")
endif()
if(KVCACHE_BUILD_TOOLS)
  install(TARGETS kvcache-bench RUNTIME)
endif()
install(EXPORT kvcacheTargets NAMESPACE kvcache:: DESTINATION "${KVCACHE_INSTALL_CMAKEDIR}")
configure_package_config_file("${CMAKE_CURRENT_LIST_DIR}/kvcacheConfig.cmake.in"
                              "${PROJECT_BINARY_DIR}/kvcacheConfig.cmake"
                              INSTALL_DESTINATION "${KVCACHE_INSTALL_CMAKEDIR}")
write_basic_package_version_file("${PROJECT_BINARY_DIR}/kvcacheConfigVersion.cmake"
                                 COMPATIBILITY SameMinorVersion ${kvcache_arch_independent})
install(FILES "${PROJECT_BINARY_DIR}/kvcacheConfig.cmake" "${PROJECT_BINARY_DIR}/kvcacheConfigVersion.cmake"
        DESTINATION "${KVCACHE_INSTALL_CMAKEDIR}")
