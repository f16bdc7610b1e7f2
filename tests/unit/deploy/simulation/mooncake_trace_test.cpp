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

// ---- the capacity-bound ceiling --------------------------------------------------------------

// A hand-made trace at block size 4, with its block hashes given directly (hash ids are not
// expanded). Worked by hand, most recently used first, capacity 4:
//   r0 {1,2,3}, 12 tokens: reuses at most 2 blocks (the last token is computed); hits 0.
//      Touched 3, 2, 1: [1 2 3].
//   r1 {4,5}, 8 tokens: hits 0. Touched 5, 4: [4 5 1 2 3] evicts 3: [4 5 1 2].
//   r2 {1,2,3}, 13 tokens: up to 3 blocks; 1, 2 cached, 3 evicted: 8 tokens (infinite: 12).
//      Touched 3, 2, 1: [1 2 3 4 5] evicts 5: [1 2 3 4].
//   r3 {4,5}, 9 tokens: up to 2 blocks; 4 cached, 5 evicted: 4 tokens (infinite: 8).
// Prompt tokens 42: capacity-bound 12/42, infinite 20/42.
struct HandMadeTrace {
  std::vector<TraceRequest> requests{
      {.input_length = 12}, {.input_length = 8}, {.input_length = 13}, {.input_length = 9}};
  std::vector<std::vector<BlockHash>> hashes{{1, 2, 3}, {4, 5}, {1, 2, 3}, {4, 5}};
};

TEST_F(MooncakeTraceTest, CapacityBoundHitRateOfAHandMadeTrace) {
  const HandMadeTrace trace;
  EXPECT_DOUBLE_EQ(capacity_bound_hit_rate(trace.requests, trace.hashes, 4, 4), 12.0 / 42.0);
  EXPECT_DOUBLE_EQ(infinite_cache_hit_rate(trace.requests, trace.hashes, 4), 20.0 / 42.0);
}

TEST_F(MooncakeTraceTest, CapacityBoundHitRateWithRoomForEveryBlockIsTheInfiniteCaches) {
  const HandMadeTrace trace;
  EXPECT_DOUBLE_EQ(capacity_bound_hit_rate(trace.requests, trace.hashes, 4, 5),
                   infinite_cache_hit_rate(trace.requests, trace.hashes, 4));
  EXPECT_DOUBLE_EQ(capacity_bound_hit_rate(trace.requests, trace.hashes, 4, 0), 0.0);
  EXPECT_DOUBLE_EQ(capacity_bound_hit_rate({}, {}, 4, 4), 0.0);
}

TEST_F(MooncakeTraceTest, CapacityBoundCacheKeepsAPromptsHeadWhenItsTailIsEvicted) {
  // Three blocks into a cache of two: the tail block goes, the first two stay and are reused.
  const std::vector<TraceRequest> requests{{.input_length = 13}, {.input_length = 13}};
  const std::vector<std::vector<BlockHash>> hashes{{1, 2, 3}, {1, 2, 3}};
  EXPECT_DOUBLE_EQ(capacity_bound_hit_rate(requests, hashes, 4, 2), 8.0 / 26.0);
}

}  // namespace
}  // namespace kvr::simulation
