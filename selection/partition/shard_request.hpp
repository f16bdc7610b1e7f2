// What shard choice (selection/cluster/sharding.hpp) reads of a route request: its prompt's block
// hashes at the model's block size, its session, pin and allow-list. The view borrows from the
// request, which must outlive it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "discovery/block_hash.hpp"
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

/// The prompt block hashes shard choice reads: the request's own, or else those of the first
/// `prefix_tokens` of its token ids or text hashed at `block_size` as its selector will hash the
/// whole prompt (held in `scratch`); none without a block size.
inline std::span<const BlockHash> shard_key_hashes(const RouteRequest& request,
                                                   std::uint32_t block_size,
                                                   std::uint32_t prefix_tokens,
                                                   std::vector<BlockHash>& scratch) {
  if (!request.selection.block_hashes.empty() || block_size == 0) {
    return request.selection.block_hashes;
  }
  scratch.clear();
  const std::size_t tokens = (prefix_tokens / block_size + 1) * std::size_t{block_size};
  if (!request.prompt_token_ids.empty()) {
    const std::span<const std::uint32_t> ids{request.prompt_token_ids};
    discovery::BlockHasher{block_size, request.cache_namespace}.append_sequence_hashes(
        ids.first(std::min(ids.size(), tokens)), scratch);
  } else if (!request.prompt_text.empty()) {
    const std::string_view text{request.prompt_text};
    discovery::TextBlockHasher{block_size, request.cache_namespace}.append_sequence_hashes(
        text.substr(0, tokens * discovery::kTextBytesPerToken), scratch);
  }
  return scratch;
}

}  // namespace kvr
