// ShardLoad as every node's subscription to kvr.<ns>.router.shard_load reads it
// (decode_shard_load).
#include "selection/wire/shard_messages.hpp"
#include "tests/fuzz/harness.hpp"

namespace kvr::fuzz {

void shard_load(Input input) {
  const ShardLoadLimits limits;
  auto load = decode_shard_load(as_text(input), limits);
  if (!load) {
    KVR_FUZZ_CHECK(!load.error().empty());
    return;
  }
  KVR_FUZZ_CHECK(!load->model.empty() && load->model.size() <= limits.max_string_length);
  KVR_FUZZ_CHECK(!load->routing_group.empty());
  KVR_FUZZ_CHECK(load->routing_group.size() <= limits.max_string_length);
  KVR_FUZZ_CHECK(load->shards >= 1 && load->shards <= limits.max_shards);
  KVR_FUZZ_CHECK(load->shard < load->shards);
  KVR_FUZZ_CHECK(load->worker_tokens.size() <= limits.max_workers);
  // What a node publishes of the decoded load decodes to the same load.
  const auto again = decode_shard_load(encode_shard_load(*load), limits);
  KVR_FUZZ_CHECK(again.has_value());
  KVR_FUZZ_CHECK(again->model == load->model && again->routing_group == load->routing_group);
  KVR_FUZZ_CHECK(again->shard == load->shard && again->shards == load->shards);
  KVR_FUZZ_CHECK(again->worker_tokens == load->worker_tokens);
}

}  // namespace kvr::fuzz
