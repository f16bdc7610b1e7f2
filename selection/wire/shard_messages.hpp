// The ShardLoad message of sharded partitions (messages/kvr/v1/cluster.proto): the node owning a
// shard encodes its load, every node decodes and validates what it receives. Plain C++.
#pragma once

#include <cstdint>
#include <expected>
#include <string>
#include <string_view>
#include <vector>

namespace kvr {

/// One shard's published load (selection/cluster/sharding.hpp, ShardBalancer::set_load).
struct ShardLoadData {
  std::string model;
  /// The model's routing group, without the shard.
  std::string routing_group = "default";
  std::uint32_t shard = 0;
  std::uint32_t shards = 1;
  std::vector<std::uint64_t> worker_tokens;
};

/// Bounds of the decoder.
struct ShardLoadLimits {
  std::size_t max_string_length = 256;
  std::size_t max_workers = 65'536;
  std::uint32_t max_shards = 1024;
};

std::string encode_shard_load(const ShardLoadData& load);
/// Fails with a one-line reason naming the field.
std::expected<ShardLoadData, std::string> decode_shard_load(std::string_view bytes,
                                                            const ShardLoadLimits& limits = {});

}  // namespace kvr
