# Finds the NATS C client. Debian 12's shipped cnats-config.cmake names files the package lacks,
# so this module replaces it. Provides cnats::nats.
include(FindPackageHandleStandardArgs)
find_package(PkgConfig QUIET)
if(PKG_CONFIG_FOUND)
  pkg_check_modules(PC_LIBNATS QUIET libnats)
endif()
find_path(CNATS_INCLUDE_DIR NAMES nats/nats.h HINTS ${PC_LIBNATS_INCLUDE_DIRS})
find_library(CNATS_LIBRARY NAMES nats HINTS ${PC_LIBNATS_LIBRARY_DIRS})
set(cnats_VERSION ${PC_LIBNATS_VERSION})
if(NOT cnats_VERSION AND CNATS_INCLUDE_DIR AND EXISTS "${CNATS_INCLUDE_DIR}/nats/version.h")
  file(STRINGS "${CNATS_INCLUDE_DIR}/nats/version.h" _cnats_version_line
       REGEX "#define NATS_VERSION_STRING")
  string(REGEX REPLACE ".*\"([0-9.]+).*" "\\1" cnats_VERSION "${_cnats_version_line}")
endif()
find_package_handle_standard_args(cnats
  REQUIRED_VARS CNATS_LIBRARY CNATS_INCLUDE_DIR VERSION_VAR cnats_VERSION)
if(cnats_FOUND AND NOT TARGET cnats::nats)
  find_package(Threads REQUIRED)
  add_library(cnats::nats SHARED IMPORTED)
  set_target_properties(cnats::nats PROPERTIES
    IMPORTED_LOCATION "${CNATS_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${CNATS_INCLUDE_DIR}"
    INTERFACE_LINK_LIBRARIES Threads::Threads)
endif()
mark_as_advanced(CNATS_INCLUDE_DIR CNATS_LIBRARY)
