// Replays every committed fuzz corpus file (tests/fuzz/corpus/<harness>/) through its harness
// body, so GCC builds run the same checks as the clang libFuzzer binaries, and every regression
// seed of a fixed finding stays fixed.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <google/protobuf/stubs/logging.h>
#include <gtest/gtest.h>

#include "tests/fuzz/harness.hpp"

namespace kvr::fuzz {

void fail(std::string_view condition, std::string_view file, int line) {
  throw std::logic_error(fmt::format("{}:{}: fuzz property broken: {}", file, line, condition));
}

namespace {

struct NamedHarness {
  const char* name;
  Harness body;
};

constexpr NamedHarness kHarnesses[] = {
    {"route_request", route_request},
    {"generate_request", generate_request},
    {"lifecycle_report", lifecycle_report},
    {"worker_registration", worker_registration},
    {"worker_heartbeat", worker_heartbeat},
    {"load_metrics", load_metrics},
    {"shard_load", shard_load},
    {"kv_event_batch", kv_event_batch},
    {"router_policy_yaml", router_policy_yaml},
    {"engine_kv_events", engine_kv_events},
    {"peer_port_handshake", peer_port_handshake},
    {"openai_request", openai_request},
    {"epp_request", epp_request},
    {"engine_answer", engine_answer},
    {"chat_request", chat_request},
    {"chat_template_source", chat_template_source},
    {"tokenizer_bytes", tokenizer_bytes},
};

const std::filesystem::path kCorpus{KVR_FUZZ_CORPUS_DIR};

std::vector<std::uint8_t> read_bytes(const std::filesystem::path& path) {
  std::ifstream file{path, std::ios::binary};
  return {std::istreambuf_iterator<char>{file}, std::istreambuf_iterator<char>{}};
}

// libprotobuf logs every string field that is not UTF-8, which truncated seeds are full of.
[[maybe_unused]] const bool kQuietProtobuf = [] {
  google::protobuf::SetLogHandler(nullptr);
  return true;
}();

class CorpusReplay : public ::testing::TestWithParam<NamedHarness> {};

TEST_P(CorpusReplay, EveryCorpusFilePassesItsHarness) {
  const std::filesystem::path folder = kCorpus / GetParam().name;
  ASSERT_TRUE(std::filesystem::is_directory(folder)) << folder;
  std::vector<std::filesystem::path> files;
  for (const auto& entry : std::filesystem::directory_iterator{folder}) {
    if (entry.is_regular_file()) files.push_back(entry.path());
  }
  std::ranges::sort(files);
  // Seeds are meant to reach the decoders' success paths, not only their refusals.
  ASSERT_GE(files.size(), 3U) << folder;
  for (const auto& file : files) {
    const std::vector<std::uint8_t> bytes = read_bytes(file);
    try {
      GetParam().body(Input{bytes.data(), bytes.size()});
    } catch (const std::logic_error& broken) {
      ADD_FAILURE() << file.filename() << ": " << broken.what();
    }
  }
}

// Truncations of each seed (every prefix of the first 64 bytes) reach the refusal paths.
TEST_P(CorpusReplay, TruncatedCorpusFilesPassTheirHarness) {
  const std::filesystem::path folder = kCorpus / GetParam().name;
  for (const auto& entry : std::filesystem::directory_iterator{folder}) {
    if (!entry.is_regular_file()) continue;
    const std::vector<std::uint8_t> bytes = read_bytes(entry.path());
    for (std::size_t size = 0; size < std::min<std::size_t>(bytes.size(), 64); ++size) {
      try {
        GetParam().body(Input{bytes.data(), size});
      } catch (const std::logic_error& broken) {
        ADD_FAILURE() << entry.path().filename() << " cut to " << size
                      << " bytes: " << broken.what();
      }
    }
  }
}

TEST(CorpusReplay, EveryCorpusFolderHasAHarness) {
  for (const auto& entry : std::filesystem::directory_iterator{kCorpus}) {
    if (!entry.is_directory()) continue;
    const std::string name = entry.path().filename().string();
    EXPECT_TRUE(std::ranges::any_of(kHarnesses, [&](const auto& h) { return name == h.name; }))
        << name;
  }
}

INSTANTIATE_TEST_SUITE_P(Harnesses, CorpusReplay, ::testing::ValuesIn(kHarnesses),
                         [](const auto& param_info) { return std::string{param_info.param.name}; });

}  // namespace
}  // namespace kvr::fuzz
