// Passive health of one partition's workers (selection/config/worker_health_config.hpp), in the
// spirit of outlier detection: failures reported against a worker (a dispatch that could not be
// sent, a first-token timeout, a client's abort that blames the worker) are counted in a row; a
// success resets the count. The consecutive_failures-th failure in a row ejects the worker from
// routing for base × n (its n-th ejection without a healthy stretch in between, capped at the
// maximum), unless max_ejection_percent of the partition's workers are ejected already: then it
// stays in routing until an ejected one returns (a fleet-wide failure never empties routing). A
// worker returns when its back-off ends; every base_ejection_time it then spends in routing
// without an ejection forgets one of its past ejections. A worker that leaves (deregisters,
// expires, restarts) drops its history.
//
// Slow start: a worker that joins while the partition has a worker that joined a whole window
// earlier is offered
// to the policy on a growing share of the selections, from slow_start_min_weight at its join to
// every selection at the end of the window, deterministically (a per-worker credit). Offering
// instead of adjusting a cost keeps it policy-agnostic: no built-in or plugin policy needs to
// know its units, and a cache-blind policy that would send it everything sends it that share.
// Workers that join within one window of the partition's first are not ramped (none of them
// is warmer than the others).
//
// Plain C++, single-threaded, the time passed in. Owned by SelectorState.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include <absl/container/flat_hash_map.h>

#include "messages/ids.hpp"
#include "selection/config/worker_health_config.hpp"
#include "selection/partition/partition_messages.hpp"

namespace kvr {

/// What a failure report did.
struct FailureVerdict {
  /// The failure ejected the worker (for `backoff`).
  bool ejected = false;
  /// The worker reached its threshold but the ejection cap kept it in routing.
  bool capped = false;
  std::chrono::milliseconds backoff{0};
};

/// One partition's passive health (file comment).
class WorkerHealth {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;

  explicit WorkerHealth(selection::WorkerHealthConfig config = {});

  /// A worker joined (or restarted: a new process, so its history is dropped). It gets slow
  /// start (returns true) when some other worker of the partition joined a whole window earlier:
  /// a fleet that registers together, or a node that starts and hears from every worker at
  /// once, ramps nobody (none of them is warmer than the others).
  bool joined(WorkerId worker, TimePoint now);
  /// A worker left: its history is dropped (an ejected worker stops counting against the cap).
  void left(WorkerId worker);

  /// A failure reported against `worker`; `partition_workers` (all of them, ejected included)
  /// sizes the ejection cap. Reports for a worker already ejected change nothing.
  FailureVerdict failure(WorkerId worker, TimePoint now, std::size_t partition_workers);
  /// A success: its consecutive failures are forgotten.
  void success(WorkerId worker);

  /// Ejected workers whose back-off ended by `now` return to routing; they are appended to
  /// `returned`. Cheap when nothing is due.
  void return_due(TimePoint now, std::vector<WorkerId>& returned) {
    if (ejected_ > 0 && now >= next_return_) return_ejected(now, returned);
  }

  bool is_ejected(WorkerId worker) const;
  std::size_t ejected() const { return ejected_; }
  /// The ejection cap for a partition of `workers` workers.
  std::size_t max_ejected(std::size_t workers) const;
  std::uint32_t consecutive_failures(WorkerId worker) const;

  /// True while some worker is in its slow-start window at `now` (ends ramps that are over).
  bool ramping(TimePoint now) { return ramping_ > 0 && end_ramps(now); }
  /// A ramping worker's weight at `now` in [min weight, 1]; 1 when it is not ramping.
  double weight(WorkerId worker, TimePoint now) const;
  /// Whether a ramping worker is offered to the next selection: its credit grows by its weight
  /// per selection, and an offer spends 1. Always true for a worker that is not ramping.
  bool offer(WorkerId worker, TimePoint now);
  /// A selection that found no worker with the ramping ones hidden offers them after all (the
  /// ramp never turns a routable request away): a hidden worker's banked credit is spent.
  void refund(WorkerId worker);

  const selection::WorkerHealthConfig& config() const { return config_; }

 private:
  struct Record {
    TimePoint joined_at{};
    std::uint32_t consecutive_failures = 0;
    /// Ejections that count towards the next back-off (decays while healthy).
    std::uint32_t ejections = 0;
    bool is_ejected = false;
    TimePoint return_at{};
    /// When it last returned (or joined): the start of its healthy stretch.
    TimePoint healthy_since{};
    /// Slow start: when the ramp started; empty: not ramping.
    std::optional<TimePoint> ramp_started;
    double credit = 0;
    bool offered_last = false;
  };

  void return_ejected(TimePoint now, std::vector<WorkerId>& returned);
  /// Ends the ramps that are over; true while one is left.
  bool end_ramps(TimePoint now);

  selection::WorkerHealthConfig config_;
  absl::flat_hash_map<WorkerId, Record> records_;
  std::size_t ejected_ = 0;
  std::size_t ramping_ = 0;
  /// The earliest return_at of the ejected workers.
  TimePoint next_return_ = TimePoint::max();
};

}  // namespace kvr
