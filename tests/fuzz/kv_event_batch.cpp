// KvEventBatch and KvDumpReply as the node's KV subscriptions read them (decode_kv_events,
// decode_kv_dump_reply): a decoded value is within the limits and survives encode → decode
// unchanged.
#include "selection/wire/worker_messages.hpp"
#include "tests/fuzz/harness.hpp"

namespace kvr::fuzz {
namespace {

void check_blocks(const std::vector<BlockHash>& hashes, const KvCodecLimits& limits) {
  KVR_FUZZ_CHECK(hashes.size() <= limits.max_blocks_per_event);
}

void batch(std::string_view bytes, const WorkerMessageLimits& limits) {
  auto decoded = decode_kv_events(bytes, limits);
  if (!decoded) {
    KVR_FUZZ_CHECK(!decoded.error().empty());
    return;
  }
  KVR_FUZZ_CHECK(decoded->worker.worker_id != 0 && decoded->event_id != 0);
  KVR_FUZZ_CHECK(decoded->worker.dp_rank < limits.max_ranks);
  KVR_FUZZ_CHECK(decoded->events.size() <= limits.kv.max_events_per_batch);
  for (const KvEvent& event : decoded->events) {
    if (const auto* stored = std::get_if<KvStoredEvent>(&event)) {
      check_blocks(stored->block_hashes, limits.kv);
    } else if (const auto* removed = std::get_if<KvRemovedEvent>(&event)) {
      check_blocks(removed->block_hashes, limits.kv);
    }
  }
  const std::string encoded = encode_kv_event_batch(*decoded).SerializeAsString();
  auto again = decode_kv_events(encoded, limits);
  KVR_FUZZ_CHECK(again.has_value() && *again == *decoded);
}

void dump(std::string_view bytes, const WorkerMessageLimits& limits) {
  auto decoded = decode_kv_dump_reply(bytes, limits);
  if (!decoded) {
    KVR_FUZZ_CHECK(!decoded.error().empty());
    return;
  }
  KVR_FUZZ_CHECK(decoded->worker.worker_id != 0);
  KVR_FUZZ_CHECK(decoded->worker.dp_rank < limits.max_ranks);
  std::size_t blocks = 0;
  for (const KvStoredEvent& stored : decoded->stored) {
    check_blocks(stored.block_hashes, limits.kv);
    blocks += stored.block_hashes.size();
  }
  KVR_FUZZ_CHECK(blocks <= limits.kv.max_blocks_per_dump);
  const std::string encoded = encode_kv_dump(*decoded).SerializeAsString();
  auto again = decode_kv_dump_reply(encoded, limits);
  KVR_FUZZ_CHECK(again.has_value() && *again == *decoded);
}

}  // namespace

void kv_event_batch(Input input) {
  const WorkerMessageLimits limits;
  batch(as_text(input), limits);
  dump(as_text(input), limits);
}

}  // namespace kvr::fuzz
