// The ShardLoad codec: what one node publishes another decodes unchanged, and a message that is
// not a shard's load is refused naming what is wrong.
#include "selection/wire/shard_messages.hpp"

#include <gtest/gtest.h>

#include "kvr/v1/cluster.pb.h"

namespace kvr {
namespace {

TEST(ShardLoadCodecTest, ALoadDecodesAsItWasPublished) {
  const ShardLoadData load{.model = "llama",
                           .routing_group = "blue",
                           .shard = 2,
                           .shards = 4,
                           .worker_tokens = {0, 12'000, 1ULL << 40}};
  const auto decoded = decode_shard_load(encode_shard_load(load));
  ASSERT_TRUE(decoded) << decoded.error();
  EXPECT_EQ(decoded->model, "llama");
  EXPECT_EQ(decoded->routing_group, "blue");
  EXPECT_EQ(decoded->shard, 2U);
  EXPECT_EQ(decoded->shards, 4U);
  EXPECT_EQ(decoded->worker_tokens, load.worker_tokens);
}

TEST(ShardLoadCodecTest, AnInvalidLoadIsRefusedNamingWhy) {
  EXPECT_NE(decode_shard_load("\xff\xff").error().find("protobuf"), std::string::npos);
  EXPECT_NE(decode_shard_load(encode_shard_load({.model = ""})).error().find("model"),
            std::string::npos);
  EXPECT_NE(decode_shard_load(encode_shard_load({.model = "m", .shard = 4, .shards = 4}))
                .error()
                .find("shard 4 of 4"),
            std::string::npos);
  const ShardLoadData crowded{.model = "m", .worker_tokens = std::vector<std::uint64_t>(9, 1)};
  EXPECT_NE(decode_shard_load(encode_shard_load(crowded), {.max_workers = 8}).error().find("9"),
            std::string::npos);
}

}  // namespace
}  // namespace kvr
