# SPDX-License-Identifier: Apache-2.0
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(KVCACHE_INSTALL_CMAKEDIR "${CMAKE_INSTALL_DATADIR}/cmake/kvcache" CACHE STRING "Where kvcacheConfig.cmake is installed")

install(TARGETS kvcache EXPORT kvcacheTargets FILE_SET HEADERS)
if(TARGET kvcache_redis)
  install(TARGETS kvcache_redis EXPORT kvcacheTargets FILE_SET HEADERS)
endif()
install(EXPORT kvcacheTargets NAMESPACE kvcache:: DESTINATION "${KVCACHE_INSTALL_CMAKEDIR}")
configure_package_config_file("${CMAKE_CURRENT_LIST_DIR}/kvcacheConfig.cmake.in"
                              "${PROJECT_BINARY_DIR}/kvcacheConfig.cmake"
                              INSTALL_DESTINATION "${KVCACHE_INSTALL_CMAKEDIR}")
write_basic_package_version_file("${PROJECT_BINARY_DIR}/kvcacheConfigVersion.cmake"
                                 COMPATIBILITY SameMinorVersion ARCH_INDEPENDENT)
install(FILES "${PROJECT_BINARY_DIR}/kvcacheConfig.cmake" "${PROJECT_BINARY_DIR}/kvcacheConfigVersion.cmake"
        DESTINATION "${KVCACHE_INSTALL_CMAKEDIR}")
