#include "selection/wire/shard_messages.hpp"

#include <fmt/format.h>

#include "kvr/v1/cluster.pb.h"

namespace kvr {

std::string encode_shard_load(const ShardLoadData& load) {
  v1::ShardLoad wire;
  wire.set_model(load.model);
  wire.set_routing_group(load.routing_group);
  wire.set_shard(load.shard);
  wire.set_shards(load.shards);
  wire.mutable_worker_tokens()->Add(load.worker_tokens.begin(), load.worker_tokens.end());
  return wire.SerializeAsString();
}

std::expected<ShardLoadData, std::string> decode_shard_load(std::string_view bytes,
                                                            const ShardLoadLimits& limits) {
  v1::ShardLoad wire;
  if (!wire.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    return std::unexpected("ShardLoad: not a valid protobuf message");
  }
  if (wire.model().empty()) return std::unexpected("ShardLoad: model is empty");
  if (wire.model().size() > limits.max_string_length ||
      wire.routing_group().size() > limits.max_string_length) {
    return std::unexpected(fmt::format("ShardLoad: model or routing_group longer than {} bytes",
                                       limits.max_string_length));
  }
  if (wire.shards() == 0 || wire.shards() > limits.max_shards || wire.shard() >= wire.shards()) {
    return std::unexpected(fmt::format("ShardLoad: shard {} of {} shards (at most {})",
                                       wire.shard(), wire.shards(), limits.max_shards));
  }
  if (static_cast<std::size_t>(wire.worker_tokens_size()) > limits.max_workers) {
    return std::unexpected(fmt::format("ShardLoad: {} workers exceed {}", wire.worker_tokens_size(),
                                       limits.max_workers));
  }
  ShardLoadData load{
      .model = wire.model(),
      .routing_group = wire.routing_group().empty() ? "default" : wire.routing_group(),
      .shard = wire.shard(),
      .shards = wire.shards(),
      .worker_tokens = {wire.worker_tokens().begin(), wire.worker_tokens().end()}};
  return load;
}

}  // namespace kvr
