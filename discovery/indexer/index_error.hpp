// Why the KV indexer refused an event or a request, and the counters it keeps per reason.
// Used by the indexer, the discovery actor (metrics, dump requests) and tests.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace kvr::discovery {

/// A rejected KV event or index operation. Every rejection leaves the index consistent.
enum class IndexError : std::uint8_t {
  unknown_worker,         ///< no such (worker, rank) is registered with the index
  duplicate_worker,       ///< the (worker, rank) is already registered
  invalid_capacity,       ///< a rank advertised zero KV blocks
  incarnation_mismatch,   ///< the batch comes from another process start of the worker
  duplicate_event_id,     ///< the batch id equals the last applied id
  out_of_order_event_id,  ///< the batch id is older than the last applied id
  unknown_parent,         ///< a Stored chain continues a block the rank does not hold
  parent_mismatch,        ///< a Stored chain links a known block under another parent
  duplicate_block,        ///< a Stored chain names the same new block twice
  chain_too_long,         ///< a Stored chain is longer than the rank's advertised capacity
  capacity_exceeded,      ///< storing would take the rank past its capacity and margin
  unknown_block,          ///< a Removed event names a block the rank does not hold on that tier
};

/// Number of IndexError values.
inline constexpr std::size_t kIndexErrorCount = 12;

/// The snake_case name of an index error, e.g. "unknown_parent".
std::string_view as_str(IndexError error);

/// Counters the indexer keeps; read by the runtime for metrics.
struct IndexerStats {
  std::uint64_t batches_applied = 0;  ///< batches accepted (including those after a gap)
  std::uint64_t events_applied = 0;   ///< events applied without error
  std::uint64_t blocks_stored = 0;    ///< (block, rank, tier) residencies added
  std::uint64_t blocks_removed = 0;   ///< residencies removed by events, cascades and expiry
  std::uint64_t event_id_gaps = 0;    ///< batches that skipped event ids
  std::uint64_t dumps_loaded = 0;     ///< dumps that replaced a rank's contents
  std::array<std::uint64_t, kIndexErrorCount> errors{};  ///< rejections, by IndexError value

  /// Rejections counted for one reason.
  std::uint64_t error_count(IndexError error) const {
    return errors[static_cast<std::size_t>(error)];
  }
};

}  // namespace kvr::discovery
