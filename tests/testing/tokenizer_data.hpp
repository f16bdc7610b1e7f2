// Where the tests find the bundled tokenizers (deploy/data/tokenizers, unpacked at configure):
// KVR_TOKENIZERS_DIR from the environment, else the build's folder compiled in (suites that use
// this header define KVR_TOKENIZERS_DIR).
#pragma once

#include <cstdlib>

namespace kvr::testing {

/// The folder with one sub-folder per bundled tokenizer family.
inline const char* bundled_tokenizers_dir() {
  const char* dir = std::getenv("KVR_TOKENIZERS_DIR");
  return dir != nullptr ? dir : KVR_TOKENIZERS_DIR;
}

}  // namespace kvr::testing
