# What `kvr bridge` (deploy/bridge) and `kvr mocker` (deploy/mocker) both need to speak an
# inference engine's protocols: libzmq, cpp-httplib, OpenSSL, nlohmann_json, and the headers of
# cppzmq and msgpack-cxx.
#   kvr_find_engine_io()                      finds them. The imported targets it makes
#                                             (PkgConfig::LIBZMQ, PkgConfig::CPP_HTTPLIB, …) are
#                                             visible in the calling directory only: each folder
#                                             that links them calls it.
#   kvr_use_engine_headers(<target> <scope>)  gives <target> cppzmq's and msgpack-cxx's headers
#                                             (as system headers) with <scope> (PUBLIC, PRIVATE).

function(kvr_find_engine_io)
  find_package(PkgConfig REQUIRED)
  pkg_check_modules(LIBZMQ REQUIRED IMPORTED_TARGET libzmq)
  pkg_check_modules(CPP_HTTPLIB REQUIRED IMPORTED_TARGET cpp-httplib)
  find_package(OpenSSL REQUIRED)
  find_package(nlohmann_json CONFIG REQUIRED)
  # cppzmq and msgpack-cxx are header-only; their CMake configs pull in more than kvr needs (a
  # static libzmq target, Boost), so only their headers are located.
  find_path(KVR_CPPZMQ_INCLUDE_DIR zmq.hpp REQUIRED)
  find_path(KVR_MSGPACK_INCLUDE_DIR msgpack.hpp REQUIRED)
endfunction()

function(kvr_use_engine_headers target scope)
  target_include_directories(${target} SYSTEM ${scope} "${KVR_CPPZMQ_INCLUDE_DIR}"
    "${KVR_MSGPACK_INCLUDE_DIR}")
  # msgpack-cxx without Boost (its optional Boost adaptors are not used).
  target_compile_definitions(${target} ${scope} MSGPACK_NO_BOOST)
endfunction()
