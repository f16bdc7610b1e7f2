// A route request as the router's actors carry it, from the decoder to the partition's selector:
// the partition and worker role it is for, and the selection request itself. Plain C++; the
// decoders (actors/wire) produce it, the selector's state consumes it.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "messages/ids.hpp"
#include "selection/selection_request.hpp"
#include "selection/worker_selection.hpp"

namespace kvr::actors {

/// One request to route.
struct RouteRequest {
  plugins::worker_selection::RoutingPartition partition;
  WorkerType worker_type = WorkerType::Aggregated;
  selection::SelectionRequest selection;
  /// The prompt's token ids when the client sent tokens instead of block hashes. A block size is
  /// a property of a partition's workers, so the partition's selector hashes them into
  /// selection.block_hashes at its block size, and then clears them.
  std::vector<std::uint32_t> prompt_token_ids;
  /// The cache namespace the token ids are hashed in.
  std::string cache_namespace;
  /// Who the request is for, as the client named it (per-tenant admission); empty: none.
  std::string tenant;
  /// What admission decided (the request classifier, when the node runs one), carried for the
  /// policy-class queue: the class it is queued and accounted under, when it should be served by,
  /// and what it costs the queue in tokens (empty: its uncached tokens).
  std::string policy_class = "default";
  std::optional<std::chrono::steady_clock::time_point> due_at;
  std::optional<std::uint64_t> scheduling_cost_tokens;

  const std::string& id() const { return selection.request_id; }
};

}  // namespace kvr::actors
