// Decodes the KV cache events that vLLM and SGLang publish over ZMQ (msgpack `KVEventBatch`)
// into plain C++ values. Used by the bridge's ZMQ subscriber (`kvr bridge`); never throws.
//
// The wire layout, as the engines' Python definitions (msgspec Structs) produce it:
//  - `KVEventBatch{ts: float, events: list, data_parallel_rank: int | None = None}`.
//  - Each event is a msgspec Struct with `tag=True`: its tag is the class name, "BlockStored",
//    "BlockRemoved" or "AllBlocksCleared".
//      BlockStored{block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
//                  lora_name, extra_keys, group_idx, kv_cache_spec_kind,
//                  kv_cache_spec_sliding_window, ...}
//      BlockRemoved{block_hashes, medium, group_idx, ...}
//      AllBlocksCleared{}
//  - A Struct declared `array_like=True` encodes as a msgpack array of its fields in declaration
//    order; a tagged one puts the tag first: ["BlockStored", [hashes], parent, [tokens], 16, nil,
//    "GPU"]. `omit_defaults=True` drops trailing fields that hold their default, and older
//    versions have fewer fields, so an array may end early (the missing optional fields read as
//    absent); newer versions append fields, which are ignored.
//  - A Struct without `array_like` encodes as a msgpack map from field name to value; a tagged one
//    carries its tag under the key "type" (msgspec's default tag field): {"type": "BlockStored",
//    "block_hashes": [...], ...}. Unknown keys are ignored; `omit_defaults` leaves out fields at
//    their default.
//  - Engines have shipped every combination: SGLang and older vLLM use arrays for both the batch
//    and the events; vLLM 0.11 keeps the batch an array but makes events maps; current vLLM
//    encodes both as maps. Each level is decoded by its own type (array or map).
//  - Block hashes are Python ints, encoded as msgpack uint64 or int64 (a negative hash is its
//    two's-complement uint64), or, in vLLM versions whose hashes are bytes, as msgpack bin; bin
//    hashes are folded to their last 8 bytes read big-endian, which is what vLLM's own int form
//    of a bytes hash is, so both forms of one engine give equal values.
//  - `group_idx` names the KV cache group (hybrid models: full attention, sliding window, ...);
//    only group 0, the main attention group, or an event without a group is kept.
// Bounds: the payload is first walked without building anything, rejecting truncated input,
// nesting beyond `max_depth` and containers that declare more elements than the payload has
// bytes left, so decoding allocates at most a small multiple of the payload size.
#pragma once

#include <cstddef>
#include <cstdint>
#include <expected>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace kvr::bridge {

/// An engine's own block hash (not kvr's), as a 64-bit value.
using EngineBlockHash = std::uint64_t;

/// Blocks the engine stored: a chain continuing `parent_block_hash`, with their tokens.
struct EngineBlockStored {
  std::vector<EngineBlockHash> block_hashes;
  std::optional<EngineBlockHash> parent_block_hash;
  std::vector<std::uint32_t> token_ids;  ///< the tokens of every block, in order
  std::uint32_t block_size = 0;
  std::optional<std::int64_t> lora_id;
  std::optional<std::string> lora_name;
  std::string medium;  ///< "GPU", "CPU", "DISK", ...; empty when the engine sent none

  friend bool operator==(const EngineBlockStored&, const EngineBlockStored&) = default;
};

/// Blocks the engine evicted from one medium.
struct EngineBlockRemoved {
  std::vector<EngineBlockHash> block_hashes;
  std::string medium;  ///< empty when the engine sent none

  friend bool operator==(const EngineBlockRemoved&, const EngineBlockRemoved&) = default;
};

/// Every block of the engine is gone (cache reset).
struct EngineAllBlocksCleared {
  friend bool operator==(const EngineAllBlocksCleared&, const EngineAllBlocksCleared&) = default;
};

using EngineKvEvent = std::variant<EngineBlockStored, EngineBlockRemoved, EngineAllBlocksCleared>;

/// One decoded `KVEventBatch`.
struct EngineKvEventBatch {
  double ts = 0;
  std::vector<EngineKvEvent> events;
  std::optional<std::uint32_t> data_parallel_rank;
  /// Events of another KV cache group than the main attention group: dropped, counted here.
  std::uint32_t other_group_events = 0;
  /// Events with a tag this decoder does not know (a newer engine): dropped, counted here.
  std::uint32_t unknown_events = 0;

  friend bool operator==(const EngineKvEventBatch&, const EngineKvEventBatch&) = default;
};

/// Bounds above which a payload is rejected as hostile or absurd.
struct DecoderLimits {
  std::size_t max_payload_bytes = std::size_t{64} << 20;
  std::size_t max_depth = 16;  ///< nesting of arrays and maps (a batch needs 4)
  std::size_t max_events = 1 << 16;
  std::size_t max_blocks_per_event = 1 << 16;
  std::size_t max_tokens_per_event = std::size_t{1} << 24;
};

/// Why a payload was rejected.
enum class DecodeErrorCode : std::uint8_t {
  too_large,      ///< the payload exceeds max_payload_bytes
  malformed,      ///< not one complete msgpack value (truncated, invalid byte, extra bytes)
  too_deep,       ///< nesting beyond max_depth
  bad_length,     ///< a container declares more elements than the payload can hold
  not_a_batch,    ///< the top level is neither an array nor a map
  missing_field,  ///< a required field is absent
  bad_field,      ///< a field has the wrong type or an out-of-range value
  bad_event,      ///< an event is neither an array nor a map, or has no string tag
  too_many,       ///< more events, blocks or tokens than the limits allow
};

/// The snake_case name of an error code, e.g. "missing_field".
std::string_view as_str(DecodeErrorCode code);

/// A rejection with a short description of where ("events[3].block_hashes").
struct DecodeError {
  DecodeErrorCode code;
  std::string detail;

  /// "missing_field: events[3].block_hashes".
  std::string message() const;
};

/// Decodes one msgpack payload; an error value for anything malformed, never an exception.
std::expected<EngineKvEventBatch, DecodeError> decode_kv_event_batch(
    std::span<const std::byte> payload, const DecoderLimits& limits = {});

/// The same over a string's bytes.
std::expected<EngineKvEventBatch, DecodeError> decode_kv_event_batch(
    std::string_view payload, const DecoderLimits& limits = {});

}  // namespace kvr::bridge
