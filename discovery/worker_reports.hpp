// The small worker reports the router receives besides registrations and KV events: a worker's
// liveness (heartbeat, deregistration) and its load report. Plain values, decoded by the wire
// layer and consumed by a partition's router core.
#pragma once

#include <utility>
#include <vector>

#include "discovery/load/predicted_load.hpp"
#include "messages/ids.hpp"

namespace kvr::discovery {

/// A heartbeat or deregistration: which process start of which worker.
struct WorkerLiveness {
  WorkerId worker_id = 0;
  Incarnation incarnation = 0;
};

/// A validated load report: one confirmed load per reported rank.
struct WorkerLoadReport {
  WorkerId worker_id = 0;
  Incarnation incarnation = 0;
  std::vector<std::pair<DpRank, ConfirmedLoad>> ranks;
};

}  // namespace kvr::discovery
