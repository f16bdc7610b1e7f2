// An engine's msgpack KVEventBatch as `kvr bridge` reads it from the engine's ZMQ publisher
// (bridge::decode_kv_event_batch): a decoded batch is within the limits, and packed again, in
// both layouts the engines use (every struct a map, as current vLLM sends; every struct an array,
// as SGLang does), it decodes to the same batch.
#include <bit>
#include <cstdint>
#include <string_view>

#include <msgpack.hpp>

#include "deploy/bridge/kv_event_decoder.hpp"
#include "tests/fuzz/harness.hpp"

namespace kvr::fuzz {
namespace {

using Packer = msgpack::packer<msgpack::sbuffer>;

enum class Layout : std::uint8_t { maps, arrays };

void pack_string(Packer& packer, std::string_view text) {
  packer.pack_str(static_cast<std::uint32_t>(text.size()));
  packer.pack_str_body(text.data(), static_cast<std::uint32_t>(text.size()));
}

void pack_optional_string(Packer& packer, const std::optional<std::string>& text) {
  if (text) {
    pack_string(packer, *text);
  } else {
    packer.pack_nil();
  }
}

void pack_hashes(Packer& packer, const std::vector<bridge::EngineBlockHash>& hashes) {
  packer.pack_array(static_cast<std::uint32_t>(hashes.size()));
  for (const bridge::EngineBlockHash hash : hashes) packer.pack_uint64(hash);
}

// A field's key in the map layout; nothing in the array layout, where position names it.
void key(Packer& packer, Layout layout, std::string_view name) {
  if (layout == Layout::maps) pack_string(packer, name);
}

void pack_event(Packer& packer, Layout layout, const bridge::EngineKvEvent& event) {
  const auto open = [&](std::string_view tag, std::uint32_t fields) {
    if (layout == Layout::maps) {
      packer.pack_map(fields + 1);
      pack_string(packer, "type");
    } else {
      packer.pack_array(fields + 1);
    }
    pack_string(packer, tag);
  };
  if (const auto* stored = std::get_if<bridge::EngineBlockStored>(&event)) {
    open("BlockStored", 7);
    key(packer, layout, "block_hashes");
    pack_hashes(packer, stored->block_hashes);
    key(packer, layout, "parent_block_hash");
    if (stored->parent_block_hash) {
      packer.pack_uint64(*stored->parent_block_hash);
    } else {
      packer.pack_nil();
    }
    key(packer, layout, "token_ids");
    packer.pack_array(static_cast<std::uint32_t>(stored->token_ids.size()));
    for (const std::uint32_t token : stored->token_ids) packer.pack_uint32(token);
    key(packer, layout, "block_size");
    packer.pack_uint32(stored->block_size);
    key(packer, layout, "lora_id");
    if (stored->lora_id) {
      packer.pack_int64(*stored->lora_id);
    } else {
      packer.pack_nil();
    }
    key(packer, layout, "medium");
    pack_optional_string(packer,
                         stored->medium.empty() ? std::nullopt : std::optional{stored->medium});
    key(packer, layout, "lora_name");
    pack_optional_string(packer, stored->lora_name);
  } else if (const auto* removed = std::get_if<bridge::EngineBlockRemoved>(&event)) {
    open("BlockRemoved", 2);
    key(packer, layout, "block_hashes");
    pack_hashes(packer, removed->block_hashes);
    key(packer, layout, "medium");
    pack_optional_string(packer,
                         removed->medium.empty() ? std::nullopt : std::optional{removed->medium});
  } else {
    open("AllBlocksCleared", 0);
  }
}

std::string pack(const bridge::EngineKvEventBatch& batch, Layout layout) {
  msgpack::sbuffer buffer;
  Packer packer{&buffer};
  if (layout == Layout::maps) {
    packer.pack_map(3);
  } else {
    packer.pack_array(3);
  }
  key(packer, layout, "ts");
  // Not pack_double, which packs an integral double as an integer (losing -0.0) and converts
  // doubles beyond int64 to one first; the engines send ts as a float64.
  const auto bits = std::bit_cast<std::uint64_t>(batch.ts);
  char float64[9] = {static_cast<char>(0xcb)};
  for (int i = 0; i < 8; ++i) float64[1 + i] = static_cast<char>(bits >> (56 - 8 * i));
  buffer.write(float64, sizeof float64);
  key(packer, layout, "events");
  packer.pack_array(static_cast<std::uint32_t>(batch.events.size()));
  for (const bridge::EngineKvEvent& event : batch.events) pack_event(packer, layout, event);
  key(packer, layout, "data_parallel_rank");
  if (batch.data_parallel_rank) {
    packer.pack_uint32(*batch.data_parallel_rank);
  } else {
    packer.pack_nil();
  }
  return {buffer.data(), buffer.size()};
}

// Equal, with ts compared bit for bit (a NaN timestamp is still the same timestamp).
bool same(bridge::EngineKvEventBatch a, bridge::EngineKvEventBatch b) {
  if (std::bit_cast<std::uint64_t>(a.ts) != std::bit_cast<std::uint64_t>(b.ts)) return false;
  a.ts = b.ts = 0;
  return a == b;
}

}  // namespace

void engine_kv_events(Input input) {
  const bridge::DecoderLimits limits;
  auto batch = bridge::decode_kv_event_batch(as_text(input), limits);
  if (!batch) {
    KVR_FUZZ_CHECK(!batch.error().message().empty());
    return;
  }
  KVR_FUZZ_CHECK(batch->events.size() <= limits.max_events);
  for (const bridge::EngineKvEvent& event : batch->events) {
    if (const auto* stored = std::get_if<bridge::EngineBlockStored>(&event)) {
      KVR_FUZZ_CHECK(stored->block_hashes.size() <= limits.max_blocks_per_event);
      KVR_FUZZ_CHECK(stored->token_ids.size() <= limits.max_tokens_per_event);
      KVR_FUZZ_CHECK(stored->block_size > 0);
    } else if (const auto* removed = std::get_if<bridge::EngineBlockRemoved>(&event)) {
      KVR_FUZZ_CHECK(removed->block_hashes.size() <= limits.max_blocks_per_event);
    }
  }
  // Dropped events are not packed again, so the re-decoded batch counts none.
  bridge::EngineKvEventBatch kept = *batch;
  kept.other_group_events = 0;
  kept.unknown_events = 0;
  for (const Layout layout : {Layout::maps, Layout::arrays}) {
    auto again = bridge::decode_kv_event_batch(pack(kept, layout), limits);
    KVR_FUZZ_CHECK(again.has_value() && same(*again, kept));
  }
}

}  // namespace kvr::fuzz
