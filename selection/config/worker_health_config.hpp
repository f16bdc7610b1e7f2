// Passive worker health of a partition (the router-policy YAML's `worker_health` section):
// outlier detection, which takes a worker that keeps failing requests out of routing for a
// growing back-off, and slow start, which ramps a newly joined worker's share of the traffic.
// Installed with the plugin SDK; the contract: docs/plugin-api.md.
//
//   worker_health:
//     consecutive_failures: 3        # failures in a row that eject a worker; 0: never eject
//     base_ejection_time_ms: 5000    # the n-th ejection in a row lasts n times this ...
//     max_ejection_time_ms: 60000    # ... but never longer than this
//     max_ejection_percent: 50       # at most this share of a partition's workers is ejected
//     slow_start_window_ms: 0        # a joining worker's share ramps up over this; 0: off
//     slow_start_min_weight: 0.1     # its share at the moment it joins
#pragma once

#include <chrono>
#include <cstdint>
#include <expected>
#include <string>

namespace kvr::selection {

/// A setting out of range: the YAML key and what is wrong with its value.
struct WorkerHealthConfigError {
  std::string key;
  std::string message;
};

/// The `worker_health` settings; the defaults are what a node runs without the section.
struct WorkerHealthConfig {
  /// Failures reported against a worker without a success in between that eject it (dispatch
  /// failures, first-token timeouts, aborts a client blames on the worker). 0: never eject.
  std::uint32_t consecutive_failures = 3;
  /// The n-th ejection of a worker (without a healthy stretch in between) lasts n times this.
  std::chrono::milliseconds base_ejection_time{5'000};
  /// An ejection never lasts longer than this.
  std::chrono::milliseconds max_ejection_time{60'000};
  /// At most this percentage of a partition's workers is ejected at once (rounded down, but at
  /// least one worker of a partition with two or more, and never all of them): a fleet-wide
  /// failure leaves the rest in routing. 0: never eject.
  double max_ejection_percent = 50;
  /// A worker that joins a partition where others already route gets this ramp: its share of
  /// the selections grows linearly from slow_start_min_weight to 1 over the window. 0: off.
  std::chrono::milliseconds slow_start_window{0};
  double slow_start_min_weight = 0.1;

  /// Checks ranges; the error names the key.
  std::expected<void, WorkerHealthConfigError> validate() const;
};

}  // namespace kvr::selection
