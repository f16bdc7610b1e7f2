#include "selection/wire/kv_event_codec.hpp"

#include <optional>

namespace kvr {
namespace {

std::optional<StorageTier> decode_tier(int wire) {
  switch (wire) {
    case v1::STORAGE_TIER_DEVICE:
      return StorageTier::Device;
    case v1::STORAGE_TIER_HOST:
      return StorageTier::Host;
    case v1::STORAGE_TIER_DISK:
      return StorageTier::Disk;
    default:
      // proto3 keeps unknown enum values as integers; they must not become a tier.
      return std::nullopt;
  }
}

v1::StorageTier encode_tier(StorageTier tier) {
  switch (tier) {
    case StorageTier::Device:
      return v1::STORAGE_TIER_DEVICE;
    case StorageTier::Host:
      return v1::STORAGE_TIER_HOST;
    case StorageTier::Disk:
      return v1::STORAGE_TIER_DISK;
  }
  return v1::STORAGE_TIER_DEVICE;
}

std::expected<KvStoredEvent, KvCodecErrorCode> decode_stored(const v1::KvStored& wire,
                                                             std::size_t max_blocks) {
  if (static_cast<std::size_t>(wire.block_hashes_size()) > max_blocks) {
    return std::unexpected(KvCodecErrorCode::too_many_blocks);
  }
  const auto tier = decode_tier(wire.tier());
  if (!tier) return std::unexpected(KvCodecErrorCode::unknown_tier);
  KvStoredEvent event;
  if (wire.has_parent()) event.parent_hash = wire.parent_hash();
  event.block_hashes.assign(wire.block_hashes().begin(), wire.block_hashes().end());
  event.tier = *tier;
  return event;
}

void encode_stored(const KvStoredEvent& event, v1::KvStored& wire) {
  wire.set_has_parent(event.parent_hash.has_value());
  wire.set_parent_hash(event.parent_hash.value_or(0));
  wire.mutable_block_hashes()->Add(event.block_hashes.begin(), event.block_hashes.end());
  wire.set_tier(encode_tier(event.tier));
}

}  // namespace

std::string_view as_str(KvCodecErrorCode code) {
  switch (code) {
    case KvCodecErrorCode::missing_worker_id:
      return "missing_worker_id";
    case KvCodecErrorCode::missing_event_id:
      return "missing_event_id";
    case KvCodecErrorCode::too_many_events:
      return "too_many_events";
    case KvCodecErrorCode::too_many_blocks:
      return "too_many_blocks";
    case KvCodecErrorCode::unknown_tier:
      return "unknown_tier";
    case KvCodecErrorCode::missing_event_kind:
      return "missing_event_kind";
  }
  return "unknown";
}

std::string KvCodecError::message() const {
  return std::string(as_str(code)) + " at event " + std::to_string(event_index);
}

std::expected<KvEventBatch, KvCodecError> decode_kv_event_batch(const v1::KvEventBatch& wire,
                                                                const KvCodecLimits& limits) {
  if (wire.worker_id() == 0)
    return std::unexpected(KvCodecError{KvCodecErrorCode::missing_worker_id});
  if (wire.event_id() == 0)
    return std::unexpected(KvCodecError{KvCodecErrorCode::missing_event_id});
  if (static_cast<std::size_t>(wire.events_size()) > limits.max_events_per_batch) {
    return std::unexpected(KvCodecError{KvCodecErrorCode::too_many_events});
  }
  KvEventBatch batch;
  batch.worker = WorkerWithDpRank{wire.worker_id(), wire.dp_rank()};
  batch.incarnation = wire.incarnation();
  batch.event_id = wire.event_id();
  batch.events.reserve(static_cast<std::size_t>(wire.events_size()));
  for (int i = 0; i < wire.events_size(); ++i) {
    const v1::KvEvent& event = wire.events(i);
    const auto index = static_cast<std::size_t>(i);
    switch (event.kind_case()) {
      case v1::KvEvent::kStored: {
        auto stored = decode_stored(event.stored(), limits.max_blocks_per_event);
        if (!stored) return std::unexpected(KvCodecError{stored.error(), index});
        batch.events.emplace_back(std::move(*stored));
        break;
      }
      case v1::KvEvent::kRemoved: {
        const v1::KvRemoved& removed = event.removed();
        if (static_cast<std::size_t>(removed.block_hashes_size()) > limits.max_blocks_per_event) {
          return std::unexpected(KvCodecError{KvCodecErrorCode::too_many_blocks, index});
        }
        const auto tier = decode_tier(removed.tier());
        if (!tier) return std::unexpected(KvCodecError{KvCodecErrorCode::unknown_tier, index});
        batch.events.emplace_back(
            KvRemovedEvent{{removed.block_hashes().begin(), removed.block_hashes().end()}, *tier});
        break;
      }
      case v1::KvEvent::kCleared:
        batch.events.emplace_back(KvClearedEvent{});
        break;
      case v1::KvEvent::KIND_NOT_SET:
        return std::unexpected(KvCodecError{KvCodecErrorCode::missing_event_kind, index});
    }
  }
  return batch;
}

std::expected<KvDump, KvCodecError> decode_kv_dump(const v1::KvDumpReply& wire,
                                                   const KvCodecLimits& limits) {
  if (wire.worker_id() == 0)
    return std::unexpected(KvCodecError{KvCodecErrorCode::missing_worker_id});
  KvDump dump;
  dump.worker = WorkerWithDpRank{wire.worker_id(), wire.dp_rank()};
  dump.incarnation = wire.incarnation();
  dump.last_event_id = wire.last_event_id();
  std::size_t total_blocks = 0;
  dump.stored.reserve(static_cast<std::size_t>(wire.stored_size()));
  for (int i = 0; i < wire.stored_size(); ++i) {
    const auto index = static_cast<std::size_t>(i);
    total_blocks += static_cast<std::size_t>(wire.stored(i).block_hashes_size());
    if (total_blocks > limits.max_blocks_per_dump) {
      return std::unexpected(KvCodecError{KvCodecErrorCode::too_many_blocks, index});
    }
    auto stored = decode_stored(wire.stored(i), limits.max_blocks_per_event);
    if (!stored) return std::unexpected(KvCodecError{stored.error(), index});
    dump.stored.push_back(std::move(*stored));
  }
  return dump;
}

v1::KvEventBatch encode_kv_event_batch(const KvEventBatch& batch) {
  v1::KvEventBatch wire;
  wire.set_worker_id(batch.worker.worker_id);
  wire.set_dp_rank(batch.worker.dp_rank);
  wire.set_incarnation(batch.incarnation);
  wire.set_event_id(batch.event_id);
  for (const KvEvent& event : batch.events) {
    v1::KvEvent* out = wire.add_events();
    if (const auto* stored = std::get_if<KvStoredEvent>(&event)) {
      encode_stored(*stored, *out->mutable_stored());
    } else if (const auto* removed = std::get_if<KvRemovedEvent>(&event)) {
      v1::KvRemoved* wire_removed = out->mutable_removed();
      wire_removed->mutable_block_hashes()->Add(removed->block_hashes.begin(),
                                                removed->block_hashes.end());
      wire_removed->set_tier(encode_tier(removed->tier));
    } else {
      out->mutable_cleared();
    }
  }
  return wire;
}

v1::KvDumpReply encode_kv_dump(const KvDump& dump) {
  v1::KvDumpReply wire;
  wire.set_worker_id(dump.worker.worker_id);
  wire.set_dp_rank(dump.worker.dp_rank);
  wire.set_incarnation(dump.incarnation);
  wire.set_last_event_id(dump.last_event_id);
  for (const KvStoredEvent& stored : dump.stored) encode_stored(stored, *wire.add_stored());
  return wire;
}

}  // namespace kvr
