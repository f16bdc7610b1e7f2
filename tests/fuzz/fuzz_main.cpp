// The libFuzzer entry point of one harness; KVR_FUZZ_HARNESS names its body (harness.hpp).
#include <cstdio>
#include <cstdlib>

#include <google/protobuf/stubs/logging.h>

#include "tests/fuzz/harness.hpp"

#ifndef KVR_FUZZ_HARNESS
#error "define KVR_FUZZ_HARNESS as the harness body to run"
#endif

namespace kvr::fuzz {

void fail(std::string_view condition, std::string_view file, int line) {
  std::fprintf(stderr, "%.*s:%d: fuzz property broken: %.*s\n", static_cast<int>(file.size()),
               file.data(), line, static_cast<int>(condition.size()), condition.data());
  // An abort is a crash to libFuzzer: it saves the input as a reproducer.
  std::abort();
}

}  // namespace kvr::fuzz

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  // libprotobuf logs every string field that is not UTF-8; at fuzzing rates that is only noise.
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  kvr::fuzz::KVR_FUZZ_HARNESS(kvr::fuzz::Input{data, size});
  return 0;
}
