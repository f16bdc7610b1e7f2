#include "deploy/simulation/mooncake_trace.hpp"

#include <fstream>

#include <gtest/gtest.h>

#include "discovery/block_hash.hpp"

namespace kvr::simulation {
namespace {

class MooncakeTraceTest : public ::testing::Test {
 protected:
  std::filesystem::path write(const std::string& text) {
    const auto path =
        std::filesystem::path{::testing::TempDir()} /
        (std::string{::testing::UnitTest::GetInstance()->current_test_info()->name()} + ".jsonl");
    std::ofstream{path} << text;
    return path;
  }
};

TEST_F(MooncakeTraceTest, ReadsRecordsAndHonoursLimit) {
  const auto path =
      write(R"({"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]})"
            "\n"
            R"({"timestamp": 10, "input_length": 100, "output_length": 3, "hash_ids": [0]})"
            "\n");
  auto all = load_mooncake_trace(path);
  ASSERT_TRUE(all.has_value()) << all.error();
  ASSERT_EQ(all->size(), 2U);
  EXPECT_EQ((*all)[0].input_length, 600U);
  EXPECT_EQ((*all)[1].timestamp_ms, 10U);
  EXPECT_EQ((*all)[0].hash_ids, (std::vector<std::uint64_t>{0, 1}));
  auto first = load_mooncake_trace(path, 1);
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(first->size(), 1U);
}

TEST_F(MooncakeTraceTest, RejectsHashIdsThatDoNotCoverThePrompt) {
  const auto path =
      write(R"({"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0]})");
  auto trace = load_mooncake_trace(path);
  ASSERT_FALSE(trace.has_value());
  EXPECT_NE(trace.error().find("line 1"), std::string::npos);
  EXPECT_NE(trace.error().find("hash_ids"), std::string::npos);
}

TEST_F(MooncakeTraceTest, RejectsMalformedLinesNamingTheLine) {
  const auto path =
      write(R"({"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [0]})"
            "\n{not json\n");
  auto trace = load_mooncake_trace(path);
  ASSERT_FALSE(trace.has_value());
  EXPECT_NE(trace.error().find("line 2"), std::string::npos);
}

TEST_F(MooncakeTraceTest, RejectsMissingFieldsAndBackwardTime) {
  EXPECT_FALSE(load_mooncake_trace(write(R"({"input_length": 10, "output_length": 1,
      "hash_ids": [0]})"))
                   .has_value());
  EXPECT_FALSE(
      load_mooncake_trace(
          write(R"({"timestamp": 5, "input_length": 10, "output_length": 1, "hash_ids": [0]})"
                "\n"
                R"({"timestamp": 4, "input_length": 10, "output_length": 1, "hash_ids": [0]})"))
          .has_value());
  EXPECT_FALSE(load_mooncake_trace(write("")).has_value());
}

TEST_F(MooncakeTraceTest, ExpandedHashesEqualHashingTheSynthesizedTokens) {
  TraceRequest request{
      .timestamp_ms = 0, .input_length = 1100, .output_length = 1, .hash_ids = {0, 7, 9}};
  for (std::uint32_t block_size : {16U, 64U, 100U, 512U}) {
    const auto tokens = synthesize_prompt_tokens(request);
    EXPECT_EQ(expand_to_block_hashes(request, block_size),
              discovery::BlockHasher{block_size}.sequence_hashes(tokens))
        << block_size;
    EXPECT_EQ(expand_to_block_hashes(request, block_size).size(), 1100U / block_size);
  }
}

TEST_F(MooncakeTraceTest, SharedHashIdPrefixGivesSharedBlockHashes) {
  TraceRequest a{.timestamp_ms = 0, .input_length = 1024, .output_length = 1, .hash_ids = {0, 1}};
  TraceRequest b{.timestamp_ms = 0, .input_length = 1024, .output_length = 1, .hash_ids = {0, 2}};
  const auto hashes_a = expand_to_block_hashes(a, 64);
  const auto hashes_b = expand_to_block_hashes(b, 64);
  ASSERT_EQ(hashes_a.size(), 16U);
  for (std::size_t i = 0; i < 8; ++i) EXPECT_EQ(hashes_a[i], hashes_b[i]) << i;
  for (std::size_t i = 8; i < 16; ++i) EXPECT_NE(hashes_a[i], hashes_b[i]) << i;
}

}  // namespace
}  // namespace kvr::simulation
