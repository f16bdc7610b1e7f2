// The outcome of routing one request: the booked decision (RouteOutcome) or why there is none
// (RouteFailure). Shared by the selector's state, the actors and the wire encoders, so that
// encoding a decision needs neither the selector nor the selection host.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "messages/error.hpp"
#include "messages/ids.hpp"

namespace kvr {

using TimePoint = std::chrono::steady_clock::time_point;

/// A routing decision that has been booked.
struct RouteOutcome {
  WorkerWithDpRank worker;
  /// The chosen worker's matched prefix, by tier, in blocks.
  std::uint32_t device_overlap_blocks = 0;
  std::uint32_t host_overlap_blocks = 0;
  std::uint32_t disk_overlap_blocks = 0;
  /// Prompt tokens the worker has to compute.
  std::uint64_t uncached_prefill_tokens = 0;
  double total_cost = 0;
  absl::InlinedVector<double, 4> scorer_costs;
  /// The scorers' names, index-aligned with scorer_costs (shared, built once per policy).
  std::shared_ptr<const std::vector<std::string>> scorer_names;
  /// The booking is released at this time unless reported earlier.
  TimePoint booking_expires_at;
  std::size_t eligible_workers = 0;
};

/// Why a request could not be routed; `code` maps onto the wire's RouteErrorCode.
struct RouteFailure {
  Error code = Error::policy_failed;
  std::string message;
};

}  // namespace kvr
