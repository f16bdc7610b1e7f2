# What `cmake --install` puts under the prefix, in two components:
#   runtime  the kvr binary
#   sdk      the public plugin API headers under include/kvr/ (each compiles on its own, std only:
#            no CAF, NATS or protobuf type), <kvr/plugin.hpp> and <kvr/version.hpp>, and the CMake
#            package (find_package(kvr CONFIG), target kvr::plugin_sdk); and for actor clients,
#            <kvr/actors/client/ingress_protocol.hpp>, kvr's protobuf messages (headers under
#            include/kvr/kvr/v1/, generated sources under share/kvr/protocol/) and the package's
#            actor_client component (target kvr::actor_client, with CAF and protobuf)
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(TARGETS kvr RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT runtime)

set(KVR_PUBLIC_HEADERS
  classifiers/plugin_parameters.hpp
  classifiers/queue/policy_class_config.hpp
  classifiers/request_classifier.hpp
  messages/ids.hpp
  messages/session_context.hpp
  selection/config/model_config.hpp
  selection/config/worker_health_config.hpp
  selection/plugin_registry.hpp
  selection/router_config.hpp
  selection/worker_selection.hpp)
foreach(header IN LISTS KVR_PUBLIC_HEADERS)
  get_filename_component(folder "${header}" DIRECTORY)
  install(FILES "${PROJECT_SOURCE_DIR}/${header}"
    DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}/kvr/${folder}" COMPONENT sdk)
endforeach()
install(FILES "${PROJECT_SOURCE_DIR}/selection/sdk/kvr/plugin.hpp"
              "${PROJECT_BINARY_DIR}/sdk/kvr/version.hpp"
  DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}/kvr" COMPONENT sdk)

install(FILES "${PROJECT_SOURCE_DIR}/actors/client/ingress_protocol.hpp"
  DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}/kvr/actors/client" COMPONENT sdk)
foreach(proto worker routing)
  install(FILES "${PROJECT_BINARY_DIR}/messages/generated/kvr/v1/${proto}.pb.h"
    DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}/kvr/kvr/v1" COMPONENT sdk)
  install(FILES "${PROJECT_BINARY_DIR}/messages/generated/kvr/v1/${proto}.pb.cc"
    DESTINATION "${CMAKE_INSTALL_DATADIR}/kvr/protocol/kvr/v1" COMPONENT sdk)
endforeach()

install(TARGETS kvr_plugin_sdk EXPORT kvrTargets COMPONENT sdk)
# A separate export: a plugin's find_package(kvr) needs neither CAF nor protobuf.
install(TARGETS kvr_actor_client EXPORT kvrActorClientTargets COMPONENT sdk)
install(EXPORT kvrActorClientTargets NAMESPACE kvr::
  DESTINATION "${CMAKE_INSTALL_LIBDIR}/cmake/kvr" COMPONENT sdk)
install(FILES "${PROJECT_SOURCE_DIR}/cmake/FindCAF.cmake"
  DESTINATION "${CMAKE_INSTALL_LIBDIR}/cmake/kvr" COMPONENT sdk)
install(EXPORT kvrTargets NAMESPACE kvr::
  DESTINATION "${CMAKE_INSTALL_LIBDIR}/cmake/kvr" COMPONENT sdk)
configure_package_config_file("${PROJECT_SOURCE_DIR}/cmake/kvrConfig.cmake.in"
  "${PROJECT_BINARY_DIR}/kvrConfig.cmake"
  INSTALL_DESTINATION "${CMAKE_INSTALL_LIBDIR}/cmake/kvr")
# A plugin must be built against the very version that loads it (its stamp is checked).
write_basic_package_version_file("${PROJECT_BINARY_DIR}/kvrConfigVersion.cmake"
  COMPATIBILITY ExactVersion)
install(FILES "${PROJECT_BINARY_DIR}/kvrConfig.cmake" "${PROJECT_BINARY_DIR}/kvrConfigVersion.cmake"
  DESTINATION "${CMAKE_INSTALL_LIBDIR}/cmake/kvr" COMPONENT sdk)

# The node's systemd unit and its settings, for the Debian package's /usr/bin/kvr.
file(READ "${PROJECT_SOURCE_DIR}/deploy/cluster/systemd/kvr-node.service" KVR_NODE_UNIT)
string(REPLACE "/usr/local/bin/kvr" "/usr/bin/kvr" KVR_NODE_UNIT "${KVR_NODE_UNIT}")
string(REPLACE "# Install: copy kvr to /usr/local/bin, this file to /etc/systemd/system/ and the env file to\n# /etc/kvr/"
  "# Installed by the kvr Debian package; copy the env file (in /usr/share/doc/kvr/) to\n# /etc/kvr/"
  KVR_NODE_UNIT "${KVR_NODE_UNIT}")
file(WRITE "${PROJECT_BINARY_DIR}/packaging/kvr-node.service" "${KVR_NODE_UNIT}")
install(FILES "${PROJECT_BINARY_DIR}/packaging/kvr-node.service"
  DESTINATION lib/systemd/system COMPONENT runtime)
install(FILES "${PROJECT_SOURCE_DIR}/deploy/cluster/systemd/kvr-node.env"
  DESTINATION "${CMAKE_INSTALL_DOCDIR}" COMPONENT runtime)

# `cpack -G DEB` in a build folder: kvr_<version>_amd64.deb with the binary, the SDK and the
# unit, its library dependencies found by dpkg-shlibdeps.
set(CPACK_PACKAGE_NAME kvr)
set(CPACK_PACKAGE_VENDOR "kvr")
set(CPACK_PACKAGE_CONTACT "kvr maintainers <kvr@localhost>")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "KV-cache-aware request router for LLM inference fleets")
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_STRIP_FILES ON)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_SECTION net)
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
# nats-server is what a node talks to (a fleet usually runs it elsewhere); CAF and protobuf are
# what an actor client built against the SDK compiles with.
set(CPACK_DEBIAN_PACKAGE_SUGGESTS "nats-server, libcaf-dev, libprotobuf-dev")
include(CPack)
