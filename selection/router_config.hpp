// The router's own settings that every worker-selection factory receives (plugin API RouterConfig).
// Filled from the command line and environment by the node, and by replay from its flags.
// The contract: docs/plugin-api.md.
#pragma once

#include <cstdint>
#include <expected>
#include <optional>
#include <string>

namespace kvr::plugins::worker_selection {

/// Router-wide settings handed to every policy factory call.
struct RouterConfig {
  /// Tokens per KV block; every worker of a partition must use the same size.
  std::uint32_t block_size = 16;

  // Defaults of the built-in `kv-cost` policy (its YAML parameters override them per instance).
  /// Share of a device-tier overlap block credited against the prefill cost.
  double device_overlap_credit = 1.0;
  /// Share of a host-tier overlap block credited (a host→device copy costs a quarter of a prefill).
  double host_overlap_credit = 0.75;
  /// Share of a disk-tier overlap block credited.
  double disk_overlap_credit = 0.25;
  /// Weight of prefill blocks against decode blocks in the kv-cost sum.
  double prefill_load_scale = 1.0;
  /// Cost added per active request on the worker, in blocks.
  double active_request_weight = 0.0;
  /// Softmax temperature over range-normalised costs; 0 picks the lowest cost.
  double temperature = 0.0;
  /// Seed for the pickers' random tie-breaks and sampling; none: seeded from the partition name.
  std::optional<std::uint64_t> seed;

  // Busy thresholds of the host's eligibility step; a busy worker is not a candidate.
  /// A (worker, rank) whose KV usage fraction (bookings included) exceeds this is busy; one
  /// that registered no capacity has no usage and is never busy by KV.
  std::optional<double> busy_kv_usage_threshold;
  /// A (worker, rank) with more active prefill tokens (bookings included) than this is busy.
  std::optional<std::uint64_t> busy_prefill_tokens_threshold;

  /// Checks ranges; the error names the offending setting.
  std::expected<void, std::string> validate() const;
};

}  // namespace kvr::plugins::worker_selection
