// Validating conversion between the wire KV events (kvr.v1.KvEventBatch, kvr.v1.KvDumpReply) and
// the plain types of messages/kv_event.hpp. Used by the discovery actor and the simulated worker.
#pragma once

#include <cstddef>
#include <cstdint>
#include <expected>
#include <string>
#include <string_view>
#include <vector>

#include "kvr/v1/kv_events.pb.h"
#include "messages/kv_event.hpp"

namespace kvr {

/// Bounds above which a decoded message is rejected as absurd.
struct KvCodecLimits {
  std::size_t max_events_per_batch = 4096;     ///< events in one KvEventBatch
  std::size_t max_blocks_per_event = 1 << 16;  ///< block hashes in one Stored or Removed
  std::size_t max_blocks_per_dump = 1 << 24;   ///< block hashes in one KvDumpReply, all chains
};

/// Why a wire message was rejected.
enum class KvCodecErrorCode : std::uint8_t {
  missing_worker_id,   ///< worker_id is 0
  missing_event_id,    ///< event_id is 0 (ids start at 1)
  too_many_events,     ///< more events than max_events_per_batch
  too_many_blocks,     ///< an event or a dump exceeds its block bound
  unknown_tier,        ///< a tier value outside kvr.v1.StorageTier
  missing_event_kind,  ///< a KvEvent with none of stored/removed/cleared set
};

/// The snake_case name of a codec error code, e.g. "too_many_blocks".
std::string_view as_str(KvCodecErrorCode code);

/// A rejection, with the index of the offending event (or dump chain) where there is one.
struct KvCodecError {
  KvCodecErrorCode code;
  std::size_t event_index = 0;

  /// "too_many_blocks at event 3".
  std::string message() const;

  friend bool operator==(const KvCodecError&, const KvCodecError&) = default;
};

/// Decodes and validates a wire batch.
std::expected<KvEventBatch, KvCodecError> decode_kv_event_batch(const v1::KvEventBatch& wire,
                                                                const KvCodecLimits& limits = {});

/// Decodes and validates a wire dump reply.
std::expected<KvDump, KvCodecError> decode_kv_dump(const v1::KvDumpReply& wire,
                                                   const KvCodecLimits& limits = {});

/// Encodes a batch for the wire.
v1::KvEventBatch encode_kv_event_batch(const KvEventBatch& batch);

/// Encodes a dump for the wire.
v1::KvDumpReply encode_kv_dump(const KvDump& dump);

}  // namespace kvr
