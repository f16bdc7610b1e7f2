// The kvr executable the integration tests start. A suite that starts kvr compiles with
// KVR_BINARY set to this build's executable; KVR_TEST_BINARY in the environment names another,
// so that the Release stage of deploy/test.sh runs the same tests against a Release build.
#pragma once

#include <cstdlib>
#include <string>

#ifndef KVR_BINARY
#error "kvr_binary.hpp is for suites compiled with KVR_BINARY (tests/integration/CMakeLists.txt)"
#endif

namespace kvr::testing {

inline std::string kvr_binary() {
  if (const char* other = std::getenv("KVR_TEST_BINARY"); other != nullptr && *other != '\0') {
    return other;
  }
  return KVR_BINARY;
}

}  // namespace kvr::testing
