# Finds Debian's CAF 0.17 (no CMake config ships with it). Creates CAF::core, CAF::io, CAF::openssl.
include(FindPackageHandleStandardArgs)
find_package(Threads REQUIRED)

find_path(CAF_INCLUDE_DIR NAMES caf/config.hpp)
if(CAF_INCLUDE_DIR AND EXISTS "${CAF_INCLUDE_DIR}/caf/config.hpp")
  file(STRINGS "${CAF_INCLUDE_DIR}/caf/config.hpp" _caf_version_line
       REGEX "^#define CAF_VERSION [0-9]+")
  string(REGEX REPLACE ".*CAF_VERSION ([0-9]+).*" "\\1" _caf_version "${_caf_version_line}")
  math(EXPR _caf_major "${_caf_version} / 10000")
  math(EXPR _caf_minor "(${_caf_version} / 100) % 100")
  math(EXPR _caf_patch "${_caf_version} % 100")
  set(CAF_VERSION "${_caf_major}.${_caf_minor}.${_caf_patch}")
endif()

if(NOT CAF_FIND_COMPONENTS)
  set(CAF_FIND_COMPONENTS core)
endif()
# io and openssl need core.
list(APPEND CAF_FIND_COMPONENTS core)
list(REMOVE_DUPLICATES CAF_FIND_COMPONENTS)
foreach(_component IN LISTS CAF_FIND_COMPONENTS)
  find_library(CAF_${_component}_LIBRARY NAMES caf_${_component})
  if(CAF_${_component}_LIBRARY AND CAF_INCLUDE_DIR)
    set(CAF_${_component}_FOUND TRUE)
  endif()
endforeach()

find_package_handle_standard_args(CAF
  REQUIRED_VARS CAF_INCLUDE_DIR
  VERSION_VAR CAF_VERSION
  HANDLE_COMPONENTS)

if(CAF_FOUND)
  foreach(_component IN LISTS CAF_FIND_COMPONENTS)
    if(CAF_${_component}_FOUND AND NOT TARGET CAF::${_component})
      add_library(CAF::${_component} SHARED IMPORTED)
      set_target_properties(CAF::${_component} PROPERTIES
        IMPORTED_LOCATION "${CAF_${_component}_LIBRARY}"
        INTERFACE_INCLUDE_DIRECTORIES "${CAF_INCLUDE_DIR}"
        INTERFACE_LINK_LIBRARIES Threads::Threads)
      if(NOT _component STREQUAL "core")
        set_property(TARGET CAF::${_component} APPEND PROPERTY INTERFACE_LINK_LIBRARIES CAF::core)
      endif()
      if(_component STREQUAL "openssl")
        set_property(TARGET CAF::openssl APPEND PROPERTY INTERFACE_LINK_LIBRARIES CAF::io)
      endif()
    endif()
  endforeach()
endif()
mark_as_advanced(CAF_INCLUDE_DIR CAF_core_LIBRARY CAF_io_LIBRARY CAF_openssl_LIBRARY)
