# SPDX-License-Identifier: Apache-2.0
# find_package that stops with the Debian package to install when the dependency is missing.
macro(kvcache_require_package name debian_package)
  find_package(${name} ${ARGN})
  if(NOT ${name}_FOUND)
    message(FATAL_ERROR "kvcache needs ${name}, which was not found. On Debian or Ubuntu install it with:\n"
                        "  apt-get install ${debian_package}")
  endif()
endmacro()
