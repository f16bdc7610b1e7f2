#include "messages/metrics/hit_rate_ceilings.hpp"

#include <algorithm>

namespace kvr::metrics {

// ---- LruBlockSet ------------------------------------------------------------------------------

void LruBlockSet::touch(BlockHash hash, std::uint32_t blocks, BlockHash last,
                        std::uint64_t capacity) {
  if (capacity == 0) return;
  if (const auto found = where_.find(hash); found != where_.end()) {
    Node& node = nodes_[found->second];
    if (blocks > node.held) {
      blocks_ += blocks - node.held;
      node.held = blocks;
    }
    if (blocks >= node.known) {
      node.known = blocks;
      node.last = last;
    }
    if (found->second != newest_) {
      unlink(found->second);
      link_newest(found->second);
    }
    return shrink_to(capacity);
  }
  std::uint32_t at;
  if (free_.empty()) {
    at = static_cast<std::uint32_t>(nodes_.size());
    nodes_.emplace_back();
  } else {
    at = free_.back();
    free_.pop_back();
  }
  nodes_[at].hash = hash;
  nodes_[at].held = nodes_[at].known = blocks;
  nodes_[at].last = last;
  blocks_ += blocks;
  link_newest(at);
  where_.emplace(hash, at);
  shrink_to(capacity);
}

void LruBlockSet::shrink_to(std::uint64_t capacity) {
  while (blocks_ > capacity && oldest_ != kNone) {
    Node& oldest = nodes_[oldest_];
    const std::uint64_t excess = blocks_ - capacity;
    if (oldest.held > excess) {
      oldest.held -= static_cast<std::uint32_t>(excess);
      blocks_ -= excess;
      return;
    }
    remove(oldest_);
  }
}

void LruBlockSet::unlink(std::uint32_t at) {
  Node& node = nodes_[at];
  if (node.newer != kNone) {
    nodes_[node.newer].older = node.older;
  } else {
    newest_ = node.older;
  }
  if (node.older != kNone) {
    nodes_[node.older].newer = node.newer;
  } else {
    oldest_ = node.newer;
  }
  node.newer = node.older = kNone;
}

void LruBlockSet::link_newest(std::uint32_t at) {
  nodes_[at].older = newest_;
  nodes_[at].newer = kNone;
  if (newest_ != kNone) nodes_[newest_].newer = at;
  newest_ = at;
  if (oldest_ == kNone) oldest_ = at;
}

void LruBlockSet::remove(std::uint32_t at) {
  unlink(at);
  blocks_ -= nodes_[at].held;
  where_.erase(nodes_[at].hash);
  free_.push_back(at);
}

// ---- HitRateCeilings --------------------------------------------------------------------------

namespace {

// The cached prefix of a prompt with `reusable` reusable blocks, in tokens, from runs of up to
// `stride` blocks tracked by their first (exact when the stride is 1). A chained hash stands for
// its whole prefix, so finding a run's first block proves every block before it. Where the
// proof stops (the next run is not found, or lies past the reusable blocks), the run in hand
// tells the rest: a run whose tail was evicted holds the prefix up to its held blocks; a prompt
// that matches the run's last block holds the whole run; otherwise the prompt leaves the run
// somewhere inside it, estimated at the middle.
std::uint64_t cached_prefix_tokens(const LruBlockSet& cache, std::span<const BlockHash> hashes,
                                   std::size_t reusable, std::size_t stride,
                                   std::uint32_t block_size) {
  if (reusable == 0) return 0;
  auto run = cache.find(hashes[0]);
  if (!run) return 0;
  std::size_t at = 0;
  for (;;) {
    if (run->held < run->known)
      return std::min(at + run->held, reusable) * std::uint64_t{block_size};
    const std::size_t next = at + stride;
    if (next < reusable) {
      if (auto next_run = cache.find(hashes[next])) {
        run = next_run;
        at = next;
        continue;
      }
    }
    const std::size_t end = at + run->known;  // one past the run's last block
    if (end <= hashes.size() && hashes[end - 1] == run->last) {
      return std::min(end, reusable) * std::uint64_t{block_size};
    }
    const std::size_t bound = std::min(end - 1, reusable);
    return (std::uint64_t{at} + 1 + bound) * block_size / 2;
  }
}

}  // namespace

HitRateCeilings::Cached HitRateCeilings::record(std::span<const BlockHash> block_hashes,
                                                std::uint64_t prompt_tokens,
                                                std::uint32_t block_size,
                                                std::uint64_t capacity_blocks) {
  if (block_size == 0 || prompt_tokens == 0) return {};
  const std::size_t stride = std::max<std::size_t>(1, options_.resolution_tokens / block_size);
  const std::uint64_t workload_blocks =
      std::max(options_.workload_tokens / block_size, capacity_blocks);
  workload_.shrink_to(workload_blocks);
  capacity_.shrink_to(capacity_blocks);
  const std::size_t reusable =
      std::min<std::size_t>(block_hashes.size(), (prompt_tokens - 1) / block_size);
  const Cached cached{.workload_tokens = cached_prefix_tokens(workload_, block_hashes, reusable,
                                                              stride, block_size),
                      .capacity_tokens = cached_prefix_tokens(capacity_, block_hashes, reusable,
                                                              stride, block_size)};
  if (block_hashes.empty()) return cached;
  // Each tracked block stands for its run: itself and the untracked ones after it.
  for (std::size_t at = (block_hashes.size() - 1) / stride * stride;; at -= stride) {
    const std::size_t blocks = std::min(stride, block_hashes.size() - at);
    const BlockHash last = block_hashes[at + blocks - 1];
    workload_.touch(block_hashes[at], static_cast<std::uint32_t>(blocks), last, workload_blocks);
    capacity_.touch(block_hashes[at], static_cast<std::uint32_t>(blocks), last, capacity_blocks);
    if (at == 0) break;
  }
  return cached;
}

}  // namespace kvr::metrics
