// Plain C++ form of KV cache events, shared by the indexer (discovery/), the simulated engine and
// the NATS codec. The wire form is kvr.v1.KvEventBatch (messages/kvr/v1/kv_events.proto).
#pragma once

#include <optional>
#include <variant>
#include <vector>

#include "messages/ids.hpp"

namespace kvr {

/// Blocks newly stored on one tier, continuing the chain at parent_hash (none: a prompt's start).
struct KvStoredEvent {
  std::optional<BlockHash> parent_hash;
  std::vector<BlockHash> block_hashes;
  StorageTier tier = StorageTier::Device;

  friend bool operator==(const KvStoredEvent&, const KvStoredEvent&) = default;
};

/// Blocks evicted from one tier.
struct KvRemovedEvent {
  std::vector<BlockHash> block_hashes;
  StorageTier tier = StorageTier::Device;

  friend bool operator==(const KvRemovedEvent&, const KvRemovedEvent&) = default;
};

/// Every block of the rank is gone.
struct KvClearedEvent {
  friend bool operator==(const KvClearedEvent&, const KvClearedEvent&) = default;
};

using KvEvent = std::variant<KvStoredEvent, KvRemovedEvent, KvClearedEvent>;

/// The events of one (worker, rank), applied in order; event_id grows by one per batch.
struct KvEventBatch {
  WorkerWithDpRank worker;
  Incarnation incarnation = 0;
  EventId event_id = 0;
  std::vector<KvEvent> events;

  friend bool operator==(const KvEventBatch&, const KvEventBatch&) = default;
};

/// The whole cache of one (worker, rank) as Stored chains, consistent as of last_event_id; the
/// plain form of kvr.v1.KvDumpReply, produced by KvIndexer::dump and by workers.
struct KvDump {
  WorkerWithDpRank worker;
  Incarnation incarnation = 0;
  EventId last_event_id = 0;  ///< events after this id apply on top of the dump
  std::vector<KvStoredEvent> stored;

  friend bool operator==(const KvDump&, const KvDump&) = default;
};

}  // namespace kvr
