// Identifier and small value types shared by every kvr library and by the wire contract.
// The plugin API (selection/worker_selection.hpp) re-exports the ones a plugin sees.
// The contract: docs/plugin-api.md.
#pragma once

#include <compare>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string_view>

namespace kvr {

/// Fleet-unique worker identifier; 0 is never a valid worker.
using WorkerId = std::uint64_t;
/// Data-parallel rank within a worker (0 for workers without data parallelism).
using DpRank = std::uint32_t;
/// A chained block hash: it identifies a block together with every block before it.
using BlockHash = std::uint64_t;
/// Monotonic KV event batch id per (worker, rank, incarnation), starting at 1.
using EventId = std::uint64_t;
/// Changes each time a worker process starts; a new incarnation restarts its event ids.
using Incarnation = std::uint64_t;

/// One schedulable unit of a worker: the worker and one of its data-parallel ranks.
struct WorkerWithDpRank {
  WorkerId worker_id = 0;
  DpRank dp_rank = 0;

  friend bool operator==(const WorkerWithDpRank&, const WorkerWithDpRank&) = default;
  friend auto operator<=>(const WorkerWithDpRank&, const WorkerWithDpRank&) = default;

  template <typename H>
  friend H AbslHashValue(H state, const WorkerWithDpRank& worker) {
    return H::combine(std::move(state), worker.worker_id, worker.dp_rank);
  }
};

/// The serving phase a worker performs; selection runs for one type at a time.
enum class WorkerType : std::uint8_t { Aggregated, Prefill, Decode, Encode };

/// Every worker type, in declaration order.
inline constexpr WorkerType kAllWorkerTypes[] = {WorkerType::Aggregated, WorkerType::Prefill,
                                                 WorkerType::Decode, WorkerType::Encode};

/// The lower-case name used in YAML, on the command line and in metrics ("aggregated", ...).
std::string_view as_str(WorkerType type);

/// Parses a lower-case worker type name; nullopt for anything else.
std::optional<WorkerType> parse_worker_type(std::string_view name);

/// Where a cached KV block lives; the order is from cheapest to most expensive to reuse.
enum class StorageTier : std::uint8_t { Device = 0, Host = 1, Disk = 2 };

inline constexpr std::size_t kStorageTierCount = 3;

/// "device", "host" or "disk".
std::string_view as_str(StorageTier tier);

}  // namespace kvr

template <>
struct std::hash<kvr::WorkerWithDpRank> {
  std::size_t operator()(const kvr::WorkerWithDpRank& worker) const noexcept {
    // Worker ids are random-looking 64-bit values; the rank is small, so a multiply-mix suffices.
    return std::hash<std::uint64_t>{}(worker.worker_id * 0x9E3779B97F4A7C15ULL + worker.dp_rank);
  }
};
