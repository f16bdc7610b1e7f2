#include "deploy/simulation/block_pool.hpp"

#include <algorithm>
#include <utility>

#include <absl/container/flat_hash_map.h>

#include "messages/check.hpp"

namespace kvr::simulation {
namespace {

// Runs of blocks look their hashes up this many positions ahead, so the misses overlap.
constexpr std::size_t kPrefetchDistance = 8;

}  // namespace

BlockPool::BlockPool(std::uint32_t total_blocks)
    : blocks_(std::make_unique<Block[]>(total_blocks)),
      total_blocks_(total_blocks),
      by_hash_(0, BlockRefHash{blocks_.get()}, BlockRefEq{blocks_.get()}) {
  KVR_ASSERT(total_blocks < kNoBlock);
  free_.reserve(total_blocks);
  // Reversed so that a fresh pool hands out block 0 first, which keeps dumps easy to read.
  for (BlockIndex block = total_blocks; block > 0; --block) free_.push_back(block - 1);
  by_hash_.reserve(total_blocks);
}

PrefixMatch BlockPool::match_prefix(std::span<const BlockHash> hashes) const {
  PrefixMatch match;
  for (std::size_t i = 0; i < hashes.size(); ++i) {
    if (i + kPrefetchDistance < hashes.size()) by_hash_.prefetch(hashes[i + kPrefetchDistance]);
    const auto found = by_hash_.find(hashes[i]);
    if (found == by_hash_.end()) break;
    ++match.blocks;
    if (blocks_[found->index].ref_count == 0) ++match.unreferenced;
  }
  return match;
}

PrefixMatch BlockPool::match_prefix(std::span<const BlockHash> hashes,
                                    std::vector<BlockIndex>& found) const {
  PrefixMatch match;
  found.clear();
  for (std::size_t i = 0; i < hashes.size(); ++i) {
    if (i + kPrefetchDistance < hashes.size()) by_hash_.prefetch(hashes[i + kPrefetchDistance]);
    const auto entry = by_hash_.find(hashes[i]);
    if (entry == by_hash_.end()) break;
    ++match.blocks;
    if (blocks_[entry->index].ref_count == 0) ++match.unreferenced;
    found.push_back(entry->index);
  }
  return match;
}

BlockIndex BlockPool::acquire(BlockHash hash) {
  const auto found = by_hash_.find(hash);
  KVR_ASSERT(found != by_hash_.end());
  acquire_block(found->index);
  return found->index;
}

void BlockPool::acquire_block(BlockIndex index) {
  Block& block = blocks_[index];
  KVR_ASSERT(block.has_hash);
  if (block.ref_count == 0) {
    lru_unlink(index);
    ++active_blocks_;
  }
  ++block.ref_count;
}

std::optional<BlockIndex> BlockPool::allocate() {
  BlockIndex index = kNoBlock;
  if (!free_.empty()) {
    index = free_.back();
    free_.pop_back();
  } else if (lru_head_ != kNoBlock) {
    index = lru_head_;
    lru_unlink(index);
    Block& evicted = blocks_[index];
    by_hash_.erase(evicted.hash);
    queue_removed(evicted.hash);
    evicted.has_hash = false;
    evicted.has_parent = false;
  } else {
    return std::nullopt;
  }
  blocks_[index].ref_count = 1;
  ++active_blocks_;
  return index;
}

std::size_t BlockPool::allocate_run(std::size_t count, std::vector<BlockIndex>& out) {
  const std::size_t from_free = std::min<std::size_t>(count, free_.size());
  const std::size_t evictions = std::min<std::size_t>(count - from_free, lru_size_);
  // An eviction's hash-index entry is cold. The run's victims are the next ones in LRU order, so
  // walking there first and prefetching their entries overlaps those misses; the walk also
  // brings in the blocks that unlinking them touches next.
  BlockIndex victim = lru_head_;
  for (std::size_t i = 0; i < evictions; ++i) {
    by_hash_.prefetch(blocks_[victim].hash);
    victim = blocks_[victim].lru_next;
  }
  for (std::size_t i = 0; i < from_free + evictions; ++i) out.push_back(*allocate());
  return from_free + evictions;
}

bool BlockPool::commit(BlockIndex index, BlockHash hash, std::optional<BlockHash> parent) {
  Block& block = blocks_[index];
  KVR_ASSERT(block.ref_count > 0 && !block.has_hash);
  // Two requests computing the same block in one step both hold a copy; like vLLM, only the
  // first is registered and the other stays anonymous, so the router hears of the hash once.
  block.hash = hash;  // read by the hash index's functors
  if (!by_hash_.insert(BlockRef{index}).second) {
    block.hash = 0;
    return false;
  }
  block.has_hash = true;
  block.has_parent = parent.has_value();
  block.parent_hash = parent.value_or(0);
  queue_stored(parent, hash);
  return true;
}

void BlockPool::commit_run(std::span<const BlockIndex> blocks, std::span<const BlockHash> hashes,
                           std::optional<BlockHash> parent) {
  KVR_ASSERT(blocks.size() == hashes.size());
  for (std::size_t i = 0; i < hashes.size(); ++i) {
    if (i + kPrefetchDistance < hashes.size()) by_hash_.prefetch(hashes[i + kPrefetchDistance]);
    commit(blocks[i], hashes[i], parent);
    parent = hashes[i];
  }
}

void BlockPool::release(BlockIndex index) {
  Block& block = blocks_[index];
  KVR_ASSERT(block.ref_count > 0);
  if (--block.ref_count > 0) return;
  --active_blocks_;
  if (block.has_hash) {
    lru_push_back(index);
  } else {
    free_.push_back(index);
  }
}

void BlockPool::clear() {
  const std::uint32_t total = total_blocks_;
  std::fill_n(blocks_.get(), total, Block{});
  free_.clear();
  for (BlockIndex block = total; block > 0; --block) free_.push_back(block - 1);
  by_hash_.clear();
  lru_head_ = kNoBlock;
  lru_tail_ = kNoBlock;
  lru_size_ = 0;
  active_blocks_ = 0;
  events_.emplace_back(KvClearedEvent{});
}

std::vector<KvEvent> BlockPool::take_events() { return std::exchange(events_, {}); }

void BlockPool::take_events(std::vector<KvEvent>& out) {
  out.clear();
  if (!events_.empty()) out.swap(events_);
}

std::vector<KvStoredEvent> BlockPool::dump() const {
  // Children lists in block-index order, and roots (no parent, or parent gone) likewise, so the
  // dump does not depend on the hash map's iteration order.
  absl::flat_hash_map<BlockHash, std::vector<BlockIndex>> children;
  std::vector<BlockIndex> roots;
  for (BlockIndex index = 0; index < total_blocks_; ++index) {
    const Block& block = blocks_[index];
    if (!block.has_hash) continue;
    if (block.has_parent && by_hash_.contains(block.parent_hash)) {
      children[block.parent_hash].push_back(index);
    } else {
      roots.push_back(index);
    }
  }

  std::vector<KvStoredEvent> chains;
  std::vector<BlockIndex> pending;
  std::vector<bool> visited(total_blocks_, false);
  const auto visit_from = [&](BlockIndex start) {
    pending.push_back(start);
    while (!pending.empty()) {
      const BlockIndex index = pending.back();
      pending.pop_back();
      if (visited[index]) continue;
      visited[index] = true;
      const Block& block = blocks_[index];
      const std::optional<BlockHash> parent =
          block.has_parent ? std::optional(block.parent_hash) : std::nullopt;
      // Depth-first order puts a block right after its parent whenever it is the first child
      // visited, so a linear chain becomes a single event.
      if (!chains.empty() && parent.has_value() && chains.back().block_hashes.back() == *parent) {
        chains.back().block_hashes.push_back(block.hash);
      } else {
        chains.push_back(KvStoredEvent{parent, {block.hash}, StorageTier::Device});
      }
      const auto found = children.find(block.hash);
      if (found == children.end()) continue;
      // Pushed in reverse so that the lowest-indexed child is visited first.
      for (auto child = found->second.rbegin(); child != found->second.rend(); ++child) {
        pending.push_back(*child);
      }
    }
  };
  for (BlockIndex root : roots) visit_from(root);
  // Only hashes that are not real chains (a test's small integers, say) can form a parent cycle
  // that no root reaches; those blocks are still dumped.
  for (BlockIndex index = 0; index < total_blocks_; ++index) {
    if (blocks_[index].has_hash && !visited[index]) visit_from(index);
  }
  return chains;
}

std::vector<BlockHash> BlockPool::eviction_order() const {
  std::vector<BlockHash> order;
  order.reserve(lru_size_);
  for (BlockIndex index = lru_head_; index != kNoBlock; index = blocks_[index].lru_next) {
    order.push_back(blocks_[index].hash);
  }
  return order;
}

void BlockPool::lru_push_back(BlockIndex index) {
  Block& block = blocks_[index];
  block.lru_prev = lru_tail_;
  block.lru_next = kNoBlock;
  if (lru_tail_ != kNoBlock) {
    blocks_[lru_tail_].lru_next = index;
  } else {
    lru_head_ = index;
  }
  lru_tail_ = index;
  ++lru_size_;
}

void BlockPool::lru_unlink(BlockIndex index) {
  Block& block = blocks_[index];
  if (block.lru_prev != kNoBlock) {
    blocks_[block.lru_prev].lru_next = block.lru_next;
  } else {
    lru_head_ = block.lru_next;
  }
  if (block.lru_next != kNoBlock) {
    blocks_[block.lru_next].lru_prev = block.lru_prev;
  } else {
    lru_tail_ = block.lru_prev;
  }
  block.lru_prev = kNoBlock;
  block.lru_next = kNoBlock;
  --lru_size_;
}

void BlockPool::queue_removed(BlockHash hash) {
  if (!events_.empty()) {
    if (auto* removed = std::get_if<KvRemovedEvent>(&events_.back())) {
      removed->block_hashes.push_back(hash);
      return;
    }
  }
  events_.emplace_back(KvRemovedEvent{{hash}, StorageTier::Device});
}

void BlockPool::queue_stored(std::optional<BlockHash> parent, BlockHash hash) {
  if (!events_.empty() && parent.has_value()) {
    if (auto* stored = std::get_if<KvStoredEvent>(&events_.back())) {
      if (stored->block_hashes.back() == *parent) {
        stored->block_hashes.push_back(hash);
        return;
      }
    }
  }
  events_.emplace_back(KvStoredEvent{parent, {hash}, StorageTier::Device});
}

}  // namespace kvr::simulation
