#include "deploy/bridge/kv_event_decoder.hpp"

#include <array>
#include <limits>

#include <fmt/format.h>
#include <msgpack.hpp>

namespace kvr::bridge {
namespace {

using Object = msgpack::object;

// First pass: walks the payload without building anything, so that the second pass (which
// allocates a node per value) only ever sees complete, shallow, honestly sized input.
class BoundsVisitor : public msgpack::null_visitor {
 public:
  BoundsVisitor(std::size_t payload_bytes, std::size_t max_depth)
      : budget_(payload_bytes), max_depth_(max_depth) {}

  bool start_array(std::uint32_t elements) { return open(elements); }
  bool end_array() { return close(); }
  // Each pair needs a key and a value: two bytes at least.
  bool start_map(std::uint32_t pairs) { return open(std::uint64_t{pairs} * 2); }
  bool end_map() { return close(); }

  bool too_deep() const { return too_deep_; }
  bool bad_length() const { return bad_length_; }

 private:
  bool open(std::uint64_t elements) {
    if (++depth_ > max_depth_) {
      too_deep_ = true;
      return false;
    }
    // Every element of every container is a distinct value of at least one byte.
    declared_ += elements;
    if (declared_ > budget_) {
      bad_length_ = true;
      return false;
    }
    return true;
  }
  bool close() {
    --depth_;
    return true;
  }

  std::uint64_t budget_;
  std::size_t max_depth_;
  std::size_t depth_ = 0;
  std::uint64_t declared_ = 0;
  bool too_deep_ = false;
  bool bad_length_ = false;
};

std::unexpected<DecodeError> fail(DecodeErrorCode code, std::string detail) {
  return std::unexpected(DecodeError{code, std::move(detail)});
}

std::string_view as_string(const Object& object) {
  return {object.via.str.ptr, object.via.str.size};
}

bool is_nil(const Object* object) {
  return object == nullptr || object->type == msgpack::type::NIL;
}

// A struct's fields by declaration index, whichever encoding carried it.
class FieldReader {
 public:
  // `names` in declaration order; `skip` leading array elements (the tag of a tagged struct).
  FieldReader(const Object& object, std::span<const std::string_view> names, std::size_t skip)
      : fields_(names.size(), nullptr) {
    if (object.type == msgpack::type::ARRAY) {
      const auto& array = object.via.array;
      for (std::size_t i = 0; i < names.size() && skip + i < array.size; ++i) {
        fields_[i] = &array.ptr[skip + i];
      }
      return;
    }
    const auto& map = object.via.map;
    for (std::uint32_t i = 0; i < map.size; ++i) {
      const Object& key = map.ptr[i].key;
      if (key.type != msgpack::type::STR) continue;
      const std::string_view name = as_string(key);
      for (std::size_t f = 0; f < names.size(); ++f) {
        // The first occurrence of a repeated key wins.
        if (names[f] == name && fields_[f] == nullptr) fields_[f] = &map.ptr[i].val;
      }
    }
  }

  const Object* get(std::size_t index) const { return fields_[index]; }

 private:
  std::vector<const Object*> fields_;
};

std::expected<std::uint64_t, DecodeError> read_hash(const Object& object,
                                                    const std::string& where) {
  switch (object.type) {
    case msgpack::type::POSITIVE_INTEGER:
      return object.via.u64;
    case msgpack::type::NEGATIVE_INTEGER:
      return static_cast<std::uint64_t>(object.via.i64);
    case msgpack::type::BIN: {
      const auto& bin = object.via.bin;
      if (bin.size == 0 || bin.size > 64) {
        return fail(DecodeErrorCode::bad_field, where + " (bin hash of bad size)");
      }
      std::uint64_t value = 0;
      const std::size_t start = bin.size > 8 ? bin.size - 8 : 0;
      for (std::size_t i = start; i < bin.size; ++i) {
        value = (value << 8) | static_cast<std::uint8_t>(bin.ptr[i]);
      }
      return value;
    }
    default:
      return fail(DecodeErrorCode::bad_field, where + " (not an integer or bytes hash)");
  }
}

std::expected<std::vector<std::uint64_t>, DecodeError> read_hashes(const Object* object,
                                                                   const std::string& where,
                                                                   const DecoderLimits& limits) {
  if (object == nullptr) return fail(DecodeErrorCode::missing_field, where);
  if (object->type != msgpack::type::ARRAY) {
    return fail(DecodeErrorCode::bad_field, where + " (not an array)");
  }
  const auto& array = object->via.array;
  if (array.size > limits.max_blocks_per_event) return fail(DecodeErrorCode::too_many, where);
  std::vector<std::uint64_t> hashes;
  hashes.reserve(array.size);
  for (std::uint32_t i = 0; i < array.size; ++i) {
    auto hash = read_hash(array.ptr[i], fmt::format("{}[{}]", where, i));
    if (!hash) return std::unexpected(hash.error());
    hashes.push_back(*hash);
  }
  return hashes;
}

std::expected<std::optional<std::int64_t>, DecodeError> read_optional_int(
    const Object* object, const std::string& where) {
  if (is_nil(object)) return std::optional<std::int64_t>{};
  if (object->type == msgpack::type::POSITIVE_INTEGER) {
    if (object->via.u64 > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
      return fail(DecodeErrorCode::bad_field, where + " (out of range)");
    }
    return std::optional<std::int64_t>{static_cast<std::int64_t>(object->via.u64)};
  }
  if (object->type == msgpack::type::NEGATIVE_INTEGER) {
    return std::optional<std::int64_t>{object->via.i64};
  }
  return fail(DecodeErrorCode::bad_field, where + " (not an integer)");
}

std::expected<std::optional<std::string>, DecodeError> read_optional_string(
    const Object* object, const std::string& where) {
  if (is_nil(object)) return std::optional<std::string>{};
  if (object->type != msgpack::type::STR) {
    return fail(DecodeErrorCode::bad_field, where + " (not a string)");
  }
  return std::optional<std::string>{std::string{as_string(*object)}};
}

// True when the event belongs to the main attention group (group 0, or no group given).
std::expected<bool, DecodeError> in_main_group(const Object* group, const std::string& where) {
  auto index = read_optional_int(group, where + ".group_idx");
  if (!index) return std::unexpected(index.error());
  return !index->has_value() || **index == 0;
}

constexpr std::array<std::string_view, 11> kStoredFields = {"block_hashes",
                                                            "parent_block_hash",
                                                            "token_ids",
                                                            "block_size",
                                                            "lora_id",
                                                            "medium",
                                                            "lora_name",
                                                            "extra_keys",
                                                            "group_idx",
                                                            "kv_cache_spec_kind",
                                                            "kv_cache_spec_sliding_window"};
constexpr std::array<std::string_view, 3> kRemovedFields = {"block_hashes", "medium", "group_idx"};
constexpr std::array<std::string_view, 3> kBatchFields = {"ts", "events", "data_parallel_rank"};

enum StoredField : std::size_t {
  kStoredHashes,
  kStoredParent,
  kStoredTokens,
  kStoredBlockSize,
  kStoredLoraId,
  kStoredMedium,
  kStoredLoraName,
  kStoredExtraKeys,
  kStoredGroup,
};

enum RemovedField : std::size_t { kRemovedHashes, kRemovedMedium, kRemovedGroup };

// Decodes one event into `out`; returns false (no error) when the event is to be skipped.
std::expected<std::optional<EngineKvEvent>, DecodeError> decode_event(const Object& object,
                                                                      const std::string& where,
                                                                      const DecoderLimits& limits,
                                                                      EngineKvEventBatch& batch) {
  std::string_view tag;
  std::size_t skip = 0;
  if (object.type == msgpack::type::ARRAY) {
    if (object.via.array.size == 0 || object.via.array.ptr[0].type != msgpack::type::STR) {
      return fail(DecodeErrorCode::bad_event, where + " (array without a string tag)");
    }
    tag = as_string(object.via.array.ptr[0]);
    skip = 1;
  } else if (object.type == msgpack::type::MAP) {
    constexpr std::array<std::string_view, 1> kTag = {"type"};
    const FieldReader reader{object, kTag, 0};
    const Object* type = reader.get(0);
    if (type == nullptr || type->type != msgpack::type::STR) {
      return fail(DecodeErrorCode::bad_event, where + " (map without a string \"type\")");
    }
    tag = as_string(*type);
  } else {
    return fail(DecodeErrorCode::bad_event, where + " (neither an array nor a map)");
  }

  if (tag == "BlockStored") {
    const FieldReader fields{object, kStoredFields, skip};
    auto group = in_main_group(fields.get(kStoredGroup), where);
    if (!group) return std::unexpected(group.error());
    EngineBlockStored stored;
    auto hashes = read_hashes(fields.get(kStoredHashes), where + ".block_hashes", limits);
    if (!hashes) return std::unexpected(hashes.error());
    stored.block_hashes = std::move(*hashes);
    if (const Object* parent = fields.get(kStoredParent); !is_nil(parent)) {
      auto hash = read_hash(*parent, where + ".parent_block_hash");
      if (!hash) return std::unexpected(hash.error());
      stored.parent_block_hash = *hash;
    }
    const Object* tokens = fields.get(kStoredTokens);
    if (tokens == nullptr) return fail(DecodeErrorCode::missing_field, where + ".token_ids");
    if (tokens->type != msgpack::type::ARRAY) {
      return fail(DecodeErrorCode::bad_field, where + ".token_ids (not an array)");
    }
    if (tokens->via.array.size > limits.max_tokens_per_event) {
      return fail(DecodeErrorCode::too_many, where + ".token_ids");
    }
    stored.token_ids.reserve(tokens->via.array.size);
    for (std::uint32_t i = 0; i < tokens->via.array.size; ++i) {
      const Object& token = tokens->via.array.ptr[i];
      if (token.type != msgpack::type::POSITIVE_INTEGER ||
          token.via.u64 > std::numeric_limits<std::uint32_t>::max()) {
        return fail(DecodeErrorCode::bad_field, fmt::format("{}.token_ids[{}]", where, i));
      }
      stored.token_ids.push_back(static_cast<std::uint32_t>(token.via.u64));
    }
    const Object* block_size = fields.get(kStoredBlockSize);
    if (block_size == nullptr) return fail(DecodeErrorCode::missing_field, where + ".block_size");
    if (block_size->type != msgpack::type::POSITIVE_INTEGER || block_size->via.u64 == 0 ||
        block_size->via.u64 > (1U << 20)) {
      return fail(DecodeErrorCode::bad_field, where + ".block_size");
    }
    stored.block_size = static_cast<std::uint32_t>(block_size->via.u64);
    auto lora_id = read_optional_int(fields.get(kStoredLoraId), where + ".lora_id");
    if (!lora_id) return std::unexpected(lora_id.error());
    stored.lora_id = *lora_id;
    auto medium = read_optional_string(fields.get(kStoredMedium), where + ".medium");
    if (!medium) return std::unexpected(medium.error());
    stored.medium = medium->value_or("");
    auto lora_name = read_optional_string(fields.get(kStoredLoraName), where + ".lora_name");
    if (!lora_name) return std::unexpected(lora_name.error());
    stored.lora_name = std::move(*lora_name);
    if (!*group) {
      ++batch.other_group_events;
      return std::optional<EngineKvEvent>{};
    }
    return std::optional<EngineKvEvent>{std::move(stored)};
  }
  if (tag == "BlockRemoved") {
    const FieldReader fields{object, kRemovedFields, skip};
    auto group = in_main_group(fields.get(kRemovedGroup), where);
    if (!group) return std::unexpected(group.error());
    EngineBlockRemoved removed;
    auto hashes = read_hashes(fields.get(kRemovedHashes), where + ".block_hashes", limits);
    if (!hashes) return std::unexpected(hashes.error());
    removed.block_hashes = std::move(*hashes);
    auto medium = read_optional_string(fields.get(kRemovedMedium), where + ".medium");
    if (!medium) return std::unexpected(medium.error());
    removed.medium = medium->value_or("");
    if (!*group) {
      ++batch.other_group_events;
      return std::optional<EngineKvEvent>{};
    }
    return std::optional<EngineKvEvent>{std::move(removed)};
  }
  if (tag == "AllBlocksCleared") return std::optional<EngineKvEvent>{EngineAllBlocksCleared{}};
  ++batch.unknown_events;
  return std::optional<EngineKvEvent>{};
}

std::expected<EngineKvEventBatch, DecodeError> decode_batch(const Object& root,
                                                            const DecoderLimits& limits) {
  if (root.type != msgpack::type::ARRAY && root.type != msgpack::type::MAP) {
    return fail(DecodeErrorCode::not_a_batch, "top level is neither an array nor a map");
  }
  const FieldReader fields{root, kBatchFields, 0};
  EngineKvEventBatch batch;
  const Object* ts = fields.get(0);
  if (ts == nullptr) return fail(DecodeErrorCode::missing_field, "ts");
  switch (ts->type) {
    case msgpack::type::FLOAT32:
    case msgpack::type::FLOAT64:
      batch.ts = ts->via.f64;
      break;
    case msgpack::type::POSITIVE_INTEGER:
      batch.ts = static_cast<double>(ts->via.u64);
      break;
    case msgpack::type::NEGATIVE_INTEGER:
      batch.ts = static_cast<double>(ts->via.i64);
      break;
    default:
      return fail(DecodeErrorCode::bad_field, "ts (not a number)");
  }
  const Object* events = fields.get(1);
  if (events == nullptr) return fail(DecodeErrorCode::missing_field, "events");
  if (events->type != msgpack::type::ARRAY) {
    return fail(DecodeErrorCode::bad_field, "events (not an array)");
  }
  if (events->via.array.size > limits.max_events) return fail(DecodeErrorCode::too_many, "events");
  auto rank = read_optional_int(fields.get(2), "data_parallel_rank");
  if (!rank) return std::unexpected(rank.error());
  if (rank->has_value()) {
    if (**rank < 0 || **rank > std::numeric_limits<std::uint32_t>::max()) {
      return fail(DecodeErrorCode::bad_field, "data_parallel_rank (out of range)");
    }
    batch.data_parallel_rank = static_cast<std::uint32_t>(**rank);
  }
  batch.events.reserve(events->via.array.size);
  for (std::uint32_t i = 0; i < events->via.array.size; ++i) {
    auto event =
        decode_event(events->via.array.ptr[i], fmt::format("events[{}]", i), limits, batch);
    if (!event) return std::unexpected(event.error());
    if (event->has_value()) batch.events.push_back(std::move(**event));
  }
  return batch;
}

}  // namespace

std::string_view as_str(DecodeErrorCode code) {
  switch (code) {
    case DecodeErrorCode::too_large:
      return "too_large";
    case DecodeErrorCode::malformed:
      return "malformed";
    case DecodeErrorCode::too_deep:
      return "too_deep";
    case DecodeErrorCode::bad_length:
      return "bad_length";
    case DecodeErrorCode::not_a_batch:
      return "not_a_batch";
    case DecodeErrorCode::missing_field:
      return "missing_field";
    case DecodeErrorCode::bad_field:
      return "bad_field";
    case DecodeErrorCode::bad_event:
      return "bad_event";
    case DecodeErrorCode::too_many:
      return "too_many";
  }
  return "unknown";
}

std::string DecodeError::message() const {
  if (detail.empty()) return std::string{as_str(code)};
  return fmt::format("{}: {}", as_str(code), detail);
}

std::expected<EngineKvEventBatch, DecodeError> decode_kv_event_batch(
    std::span<const std::byte> payload, const DecoderLimits& limits) {
  return decode_kv_event_batch(
      std::string_view{reinterpret_cast<const char*>(payload.data()), payload.size()}, limits);
}

std::expected<EngineKvEventBatch, DecodeError> decode_kv_event_batch(std::string_view payload,
                                                                     const DecoderLimits& limits) {
  if (payload.size() > limits.max_payload_bytes) {
    return fail(DecodeErrorCode::too_large, fmt::format("{} bytes", payload.size()));
  }
  if (payload.empty()) return fail(DecodeErrorCode::malformed, "empty payload");
  try {
    BoundsVisitor bounds{payload.size(), limits.max_depth};
    std::size_t offset = 0;
    const bool parsed = msgpack::parse(payload.data(), payload.size(), offset, bounds);
    if (bounds.too_deep()) return fail(DecodeErrorCode::too_deep, "nesting");
    if (bounds.bad_length()) return fail(DecodeErrorCode::bad_length, "container length");
    if (!parsed) return fail(DecodeErrorCode::malformed, "truncated or invalid msgpack");
    if (offset != payload.size()) {
      return fail(DecodeErrorCode::malformed,
                  fmt::format("{} bytes after the value", payload.size() - offset));
    }
    const msgpack::object_handle handle = msgpack::unpack(payload.data(), payload.size());
    return decode_batch(handle.get(), limits);
  } catch (const std::exception& error) {
    // The first pass accepted the payload, so msgpack-c has nothing left to complain about; this
    // is only a guard that keeps its exceptions from leaving the decoder.
    return fail(DecodeErrorCode::malformed, error.what());
  }
}

}  // namespace kvr::bridge
