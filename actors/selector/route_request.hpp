// A route request as the router's actors carry it, from the decoder to the partition's selector:
// the partition and worker role it is for, and the selection request itself. Plain C++; the
// decoders (actors/wire) produce it, the selector's state consumes it.
#pragma once

#include <cstdint>
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

  const std::string& id() const { return selection.request_id; }
};

}  // namespace kvr::actors
