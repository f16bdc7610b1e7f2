// What shard choice (selection/cluster/sharding.hpp) reads of a route request: its prompt's block
// hashes at the model's block size, its session, pin and allow-list. The view borrows from the
// request, which must outlive it.
#pragma once

#include <cstdint>

#include "selection/cluster/sharding.hpp"
#include "selection/partition/route_request.hpp"

namespace kvr {

inline cluster::ShardRequest shard_request_of(const RouteRequest& request,
                                              std::uint32_t block_size) {
  const selection::SelectionRequest& selection = request.selection;
  cluster::ShardRequest view{.block_hashes = selection.block_hashes,
                             .block_size = block_size,
                             .prompt_tokens = selection.prompt_tokens,
                             .allowed_workers = selection.allowed_workers,
                             .request_id = selection.request_id};
  if (selection.session) view.session_id = selection.session->session_id();
  if (selection.pinned_worker) view.pinned_worker = selection.pinned_worker->worker_id;
  return view;
}

}  // namespace kvr
