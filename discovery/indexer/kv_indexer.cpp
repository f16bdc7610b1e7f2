#include "discovery/indexer/kv_indexer.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <utility>

namespace kvr::discovery {
namespace {

std::uint32_t tier_bit(StorageTier tier) { return 1U << static_cast<std::uint32_t>(tier); }

std::size_t tier_index(StorageTier tier) { return static_cast<std::size_t>(tier); }

// Runs of blocks (event chains, evictions) look hashes up this many positions ahead: their
// hash-set entries are cold, and prefetching overlaps the misses instead of paying them in turn.
constexpr std::size_t kPrefetchDistance = 8;

std::uint64_t scaled(std::uint64_t blocks, double factor) {
  const double value = std::ceil(static_cast<double>(blocks) * factor);
  // Saturate rather than overflow for absurd advertised capacities.
  if (value >= static_cast<double>(std::numeric_limits<std::uint64_t>::max() / 4)) {
    return std::numeric_limits<std::uint64_t>::max() / 4;
  }
  return static_cast<std::uint64_t>(value);
}

}  // namespace

KvIndexer::KvIndexer(IndexerConfig config)
    : config_(config),
      nodes_(std::make_unique<NodeSlab>()),
      node_set_(0, NodeHash{nodes_.get()}, NodeEq{nodes_.get()}) {}

KvIndexer::~KvIndexer() {
  if (!nodes_) return;
  for (NodeId id = 0; id < nodes_->size(); ++id) (*nodes_)[id].holders.release();
}

KvIndexer::KvIndexer(KvIndexer&&) noexcept = default;

KvIndexer& KvIndexer::operator=(KvIndexer&& other) noexcept {
  if (this != &other) {
    if (nodes_) {
      for (NodeId id = 0; id < nodes_->size(); ++id) (*nodes_)[id].holders.release();
    }
    config_ = other.config_;
    nodes_ = std::move(other.nodes_);
    free_nodes_ = other.free_nodes_;
    node_set_ = std::move(other.node_set_);
    slots_ = std::move(other.slots_);
    slot_workers_ = std::move(other.slot_workers_);
    free_slots_ = std::move(other.free_slots_);
    slot_by_worker_ = std::move(other.slot_by_worker_);
    approximate_expiry_ = std::move(other.approximate_expiry_);
    approximate_order_ = std::move(other.approximate_order_);
    stats_ = other.stats_;
  }
  return *this;
}

std::unexpected<IndexError> KvIndexer::reject(IndexError error) {
  ++stats_.errors[static_cast<std::size_t>(error)];
  return std::unexpected(error);
}

// ---- workers -----------------------------------------------------------------------------------

std::expected<SlotId, IndexError> KvIndexer::add_worker(WorkerWithDpRank worker,
                                                        RankIndexOptions options) {
  if (slot_by_worker_.contains(worker)) return reject(IndexError::duplicate_worker);
  if (options.capacity_blocks == 0) return reject(IndexError::invalid_capacity);
  SlotId slot = 0;
  if (!free_slots_.empty()) {
    slot = free_slots_.back();
    free_slots_.pop_back();
  } else {
    if (slots_.size() > kMaxSlot) return reject(IndexError::invalid_capacity);
    slot = static_cast<SlotId>(slots_.size());
    slots_.emplace_back();
  }
  SlotState& state = slots_[slot];
  state = SlotState{};
  state.worker = worker;
  state.incarnation = options.incarnation;
  state.in_use = true;
  state.approximate = options.approximate;
  const std::uint64_t offload = scaled(options.capacity_blocks, config_.offload_capacity_factor);
  state.advertised = {options.capacity_blocks, offload, offload};
  for (std::size_t tier = 0; tier < kStorageTierCount; ++tier) {
    state.limit[tier] = state.advertised[tier] +
                        scaled(state.advertised[tier], config_.capacity_margin) +
                        config_.capacity_slack_blocks;
  }
  if (slot_workers_.size() <= slot) slot_workers_.resize(slot + 1);
  slot_workers_[slot] = worker;
  slot_by_worker_.emplace(worker, slot);
  return slot;
}

bool KvIndexer::remove_rank(WorkerWithDpRank worker) {
  const auto it = slot_by_worker_.find(worker);
  if (it == slot_by_worker_.end()) return false;
  const SlotId slot = it->second;
  clear_slot(slot);
  release_slot(slot);
  return true;
}

std::size_t KvIndexer::remove_worker(WorkerId worker_id) {
  std::vector<WorkerWithDpRank> ranks;
  for (const auto& [worker, slot] : slot_by_worker_) {
    if (worker.worker_id == worker_id) ranks.push_back(worker);
  }
  for (const WorkerWithDpRank& worker : ranks) remove_rank(worker);
  return ranks.size();
}

void KvIndexer::release_slot(SlotId slot) {
  slot_by_worker_.erase(slots_[slot].worker);
  slots_[slot] = SlotState{};
  free_slots_.push_back(slot);
}

std::optional<SlotId> KvIndexer::slot_of(WorkerWithDpRank worker) const {
  const auto it = slot_by_worker_.find(worker);
  if (it == slot_by_worker_.end()) return std::nullopt;
  return it->second;
}

// ---- nodes -------------------------------------------------------------------------------------

KvIndexer::NodeId KvIndexer::find_node(BlockHash hash) const {
  const auto it = node_set_.find(hash);
  return it == node_set_.end() ? kNoNode : it->id;
}

KvIndexer::NodeId KvIndexer::create_node(BlockHash hash, NodeId parent) {
  NodeSlab& nodes = *nodes_;
  NodeId id = 0;
  if (free_nodes_ != kNoNode) {
    id = free_nodes_;
    free_nodes_ = nodes[id].next_sibling;
    // Freed nodes are scattered over the slab; the next one is likely wanted soon (a chain
    // creates one node per block), so start loading it now.
    if (free_nodes_ != kNoNode) __builtin_prefetch(&nodes[free_nodes_]);
  } else {
    id = static_cast<NodeId>(nodes.size());
    nodes.emplace_back();
  }
  Node& node = nodes[id];
  node = Node{};
  node.hash = hash;
  node.parent = parent;
  if (parent != kNoNode) {
    Node& parent_node = nodes[parent];
    node.next_sibling = parent_node.first_child;
    if (parent_node.first_child != kNoNode) nodes[parent_node.first_child].prev_sibling = id;
    parent_node.first_child = id;
  }
  return id;
}

void KvIndexer::erase_node(NodeId id) {
  node_set_.erase((*nodes_)[id].hash);
  unlink_node(id);
}

void KvIndexer::unlink_node(NodeId id) {
  NodeSlab& nodes = *nodes_;
  Node& node = nodes[id];
  if (node.parent != kNoNode) {
    if (node.prev_sibling != kNoNode) {
      nodes[node.prev_sibling].next_sibling = node.next_sibling;
    } else {
      nodes[node.parent].first_child = node.next_sibling;
    }
    if (node.next_sibling != kNoNode) nodes[node.next_sibling].prev_sibling = node.prev_sibling;
  }
  node.holders.release();
  node.parent = kNoNode;
  node.first_child = kNoNode;
  node.prev_sibling = kNoNode;
  node.next_sibling = free_nodes_;
  free_nodes_ = id;
}

void KvIndexer::add_holder(NodeId id, SlotId slot, std::uint32_t tier_bits) {
  HolderSet& holders = (*nodes_)[id].holders;
  SlotState& state = slots_[slot];
  const std::uint32_t position = holders.lower_bound(slot);
  std::uint32_t old_bits = 0;
  if (position < holders.size() && holder_slot(holders.entry(position)) == slot) {
    old_bits = holder_tiers(holders.entry(position));
    holders.set_tiers(position, old_bits | tier_bits);
  } else {
    holders.insert(position, make_holder_entry(slot, tier_bits));
  }
  const std::uint32_t added = tier_bits & ~old_bits;
  for (std::size_t tier = 0; tier < kStorageTierCount; ++tier) {
    if ((added >> tier) & 1U) {
      ++state.held[tier];
      ++stats_.blocks_stored;
    }
  }
}

void KvIndexer::drop_residency(NodeId id, SlotId slot) {
  Node& node = (*nodes_)[id];
  const std::uint32_t position = node.holders.find(slot);
  if (position == node.holders.size()) return;
  SlotState& state = slots_[slot];
  const std::uint32_t bits = holder_tiers(node.holders.entry(position));
  for (std::size_t tier = 0; tier < kStorageTierCount; ++tier) {
    if ((bits >> tier) & 1U) {
      --state.held[tier];
      ++stats_.blocks_removed;
    }
  }
  if (state.approximate) approximate_expiry_.erase(ApproximateKey{slot, node.hash});
  node.holders.erase(position);
  if (node.holders.empty()) erase_node(id);
}

void KvIndexer::drop_subtree(NodeId id, SlotId slot) {
  // Preorder collection, then removal in reverse, so children go before their parents and a
  // node that loses its last holder never has children left.
  NodeSlab& nodes = *nodes_;
  walk_scratch_.clear();
  chain_scratch_.clear();
  walk_scratch_.push_back(id);
  while (!walk_scratch_.empty()) {
    const NodeId current = walk_scratch_.back();
    walk_scratch_.pop_back();
    chain_scratch_.push_back(current);
    for (NodeId child = nodes[current].first_child; child != kNoNode;
         child = nodes[child].next_sibling) {
      if (nodes[child].holders.find(slot) != nodes[child].holders.size()) {
        walk_scratch_.push_back(child);
      }
    }
  }
  for (auto it = chain_scratch_.rbegin(); it != chain_scratch_.rend(); ++it) {
    drop_residency(*it, slot);
  }
  chain_scratch_.clear();
}

void KvIndexer::clear_slot(SlotId slot) {
  // Prefix closure: every block of the slot lies under one of its root blocks.
  const NodeSlab& nodes = *nodes_;
  std::vector<NodeId> roots;
  for (NodeRef ref : node_set_) {
    const Node& node = nodes[ref.id];
    if (node.parent == kNoNode && node.holders.find(slot) != node.holders.size()) {
      roots.push_back(ref.id);
    }
  }
  for (NodeId root : roots) drop_subtree(root, slot);
}

// ---- events ------------------------------------------------------------------------------------

std::expected<ApplyOutcome, IndexError> KvIndexer::apply(const KvEventBatch& batch) {
  const auto it = slot_by_worker_.find(batch.worker);
  if (it == slot_by_worker_.end()) return reject(IndexError::unknown_worker);
  const SlotId slot = it->second;
  SlotState& state = slots_[slot];
  if (batch.incarnation != state.incarnation) return reject(IndexError::incarnation_mismatch);
  // Ids start at 1, so 0 is older than any batch.
  if (batch.event_id == 0 || batch.event_id < state.last_event_id) {
    return reject(IndexError::out_of_order_event_id);
  }
  if (batch.event_id == state.last_event_id) return reject(IndexError::duplicate_event_id);
  ApplyOutcome outcome;
  if (batch.event_id != state.last_event_id + 1) {
    outcome.gap = EventGap{state.last_event_id + 1, batch.event_id};
    ++stats_.event_id_gaps;
  }
  state.last_event_id = batch.event_id;
  ++stats_.batches_applied;
  for (const KvEvent& event : batch.events) {
    auto result = apply_to_slot(slot, event);
    if (result) {
      ++outcome.applied_events;
    } else {
      ++outcome.rejected_events;
      if (!outcome.first_error) outcome.first_error = result.error();
    }
  }
  return outcome;
}

std::expected<void, IndexError> KvIndexer::apply_event(WorkerWithDpRank worker,
                                                       const KvEvent& event) {
  const auto it = slot_by_worker_.find(worker);
  if (it == slot_by_worker_.end()) return reject(IndexError::unknown_worker);
  return apply_to_slot(it->second, event);
}

std::expected<void, IndexError> KvIndexer::apply_to_slot(SlotId slot, const KvEvent& event) {
  std::expected<void, IndexError> result;
  if (const auto* stored = std::get_if<KvStoredEvent>(&event)) {
    result = store_chain(slot, *stored);
  } else if (const auto* removed = std::get_if<KvRemovedEvent>(&event)) {
    result = remove_blocks(slot, *removed);
  } else {
    clear_slot(slot);
  }
  if (result) ++stats_.events_applied;
  return result;
}

std::expected<void, IndexError> KvIndexer::store_chain(SlotId slot, const KvStoredEvent& event) {
  const NodeSlab& nodes = *nodes_;
  SlotState& state = slots_[slot];
  const std::size_t tier = tier_index(event.tier);
  const std::uint32_t bit = tier_bit(event.tier);
  const std::span<const BlockHash> blocks = event.block_hashes;
  if (blocks.size() > state.advertised[tier]) return reject(IndexError::chain_too_long);

  NodeId parent = kNoNode;
  if (event.parent_hash) {
    parent = find_node(*event.parent_hash);
    if (parent == kNoNode || nodes[parent].holders.find(slot) == nodes[parent].holders.size()) {
      return reject(IndexError::unknown_parent);
    }
  }
  // Validate before mutating, so a rejected chain leaves no trace. Known blocks come first:
  // a known block can never follow a new one, since its parent would be the new block.
  const auto prefetch = [&](std::size_t i) {
    if (i < blocks.size()) node_set_.prefetch(blocks[i]);
  };
  for (std::size_t i = 0; i < kPrefetchDistance; ++i) prefetch(i);
  chain_scratch_.clear();
  std::uint64_t added = 0;
  NodeId cursor = parent;
  std::size_t known = 0;
  for (; known < blocks.size(); ++known) {
    prefetch(known + kPrefetchDistance);
    const NodeId id = find_node(blocks[known]);
    if (id == kNoNode) break;
    if (nodes[id].parent != cursor) return reject(IndexError::parent_mismatch);
    const HolderSet& holders = nodes[id].holders;
    const std::uint32_t position = holders.find(slot);
    if (position == holders.size() || (holder_tiers(holders.entry(position)) & bit) == 0) ++added;
    chain_scratch_.push_back(id);
    cursor = id;
  }
  // A block after the known ones that is indexed already continues another parent; that fault
  // is reported before capacity and repeats.
  const auto indexed_after = [&](std::size_t first) {
    for (std::size_t i = first; i < blocks.size(); ++i) {
      if (find_node(blocks[i]) != kNoNode) return true;
    }
    return false;
  };
  added += blocks.size() - known;
  if (state.held[tier] + added > state.limit[tier]) {
    return reject(indexed_after(known) ? IndexError::parent_mismatch
                                       : IndexError::capacity_exceeded);
  }

  // New blocks are created and inserted with one probe each. An insert that finds the block
  // indexed refuses the chain: the nodes created so far (they hold only this slot) are undone.
  // The block was indexed before this chain (parent_mismatch), or repeats a block of it
  // (duplicate_block, unless a later block was indexed before, which is reported first).
  const std::size_t first_new = chain_scratch_.size();
  for (std::size_t i = known; i < blocks.size(); ++i) {
    prefetch(i + kPrefetchDistance);
    const NodeId id = create_node(blocks[i], cursor);
    const auto [existing, inserted] = node_set_.insert(NodeRef{id});
    if (!inserted) {
      const bool repeated =
          std::find(chain_scratch_.begin() + static_cast<std::ptrdiff_t>(first_new),
                    chain_scratch_.end(), existing->id) != chain_scratch_.end();
      // The just-created duplicate is not in the set (the original is): only unlink it.
      unlink_node(id);
      for (std::size_t j = chain_scratch_.size(); j > first_new; --j) {
        erase_node(chain_scratch_[j - 1]);
      }
      chain_scratch_.clear();
      return reject(!repeated || indexed_after(i + 1) ? IndexError::parent_mismatch
                                                      : IndexError::duplicate_block);
    }
    chain_scratch_.push_back(id);
    cursor = id;
  }
  for (const NodeId id : chain_scratch_) add_holder(id, slot, bit);
  chain_scratch_.clear();
  return {};
}

std::expected<void, IndexError> KvIndexer::remove_blocks(SlotId slot, const KvRemovedEvent& event) {
  const std::uint32_t bit = tier_bit(event.tier);
  SlotState& state = slots_[slot];
  bool unknown = false;
  // Evicted blocks are cold: their hash-set slots and nodes are cache misses. The set is
  // prefetched kPrefetchDistance blocks ahead, and each block is looked up kLookahead blocks
  // before it is removed: a lookup reads its node (the other miss), and lookups that do not wait
  // on each other overlap. A removal may drop a block looked up in advance (a descendant, or a
  // hash repeated in the event). Such a node no longer lists this slot (a freed node lists
  // nobody, and nothing is created here, so it is not reused), so it reads as not held, just as
  // a fresh lookup would; its stale set iterator is never used.
  constexpr std::size_t kLookahead = 4;
  struct Lookup {
    NodeSet::iterator found;
    NodeId id = kNoNode;
  };
  const auto& hashes = event.block_hashes;
  const auto look_up = [&](std::size_t i) {
    const auto found = node_set_.find(hashes[i]);
    return Lookup{found, found == node_set_.end() ? kNoNode : found->id};
  };
  for (std::size_t i = 0; i < std::min(kPrefetchDistance, hashes.size()); ++i) {
    node_set_.prefetch(hashes[i]);
  }
  std::array<Lookup, kLookahead> ahead;
  for (std::size_t i = 0; i < std::min(kLookahead, hashes.size()); ++i) ahead[i] = look_up(i);
  for (std::size_t i = 0; i < hashes.size(); ++i) {
    if (i + kPrefetchDistance < hashes.size()) node_set_.prefetch(hashes[i + kPrefetchDistance]);
    const BlockHash hash = hashes[i];
    const Lookup current = ahead[i % kLookahead];
    if (i + kLookahead < hashes.size()) ahead[i % kLookahead] = look_up(i + kLookahead);
    if (current.id == kNoNode) {
      unknown = true;
      continue;
    }
    const auto found = current.found;
    const NodeId id = current.id;
    Node& node = (*nodes_)[id];
    HolderSet& holders = node.holders;
    const std::uint32_t position = holders.find(slot);
    if (position == holders.size() || (holder_tiers(holders.entry(position)) & bit) == 0) {
      unknown = true;
      continue;
    }
    const std::uint32_t remaining = holder_tiers(holders.entry(position)) & ~bit;
    --state.held[tier_index(event.tier)];
    ++stats_.blocks_removed;
    if (remaining != 0) {
      holders.set_tiers(position, remaining);
    } else if (node.first_child == kNoNode) {
      // A leaf, as most evicted blocks are (engines evict a prompt's tail first): nothing below
      // it to drop, so its residency goes here, and the node through the iterator at hand.
      if (state.approximate) approximate_expiry_.erase(ApproximateKey{slot, hash});
      holders.erase(position);
      if (holders.empty()) {
        node_set_.erase(found);
        unlink_node(id);
      }
    } else {
      holders.set_tiers(position, 0);
      drop_subtree(id, slot);
    }
  }
  // Known blocks are removed even when others are unknown: under-reporting a cache is safe,
  // over-reporting it sends requests to workers that lost the blocks.
  if (unknown) return reject(IndexError::unknown_block);
  return {};
}

// ---- lookups -----------------------------------------------------------------------------------

void KvIndexer::finalize(MatchResult& out, SlotId slot, std::uint32_t depth) const {
  WorkerMatch& match = out.matches_[out.match_count_++];
  match.worker = slot_workers_[slot];
  match.slot = slot;
  match.device_blocks = depth;
  match.host_blocks = 0;
  match.disk_blocks = 0;
  if (out.any_offload_) {
    const MatchResult::SlotScratch& scratch = out.slots_[slot];
    if (scratch.offload_epoch == out.epoch_) {
      match.host_blocks = scratch.host_blocks;
      match.disk_blocks = scratch.disk_blocks;
      match.device_blocks = depth - match.host_blocks - match.disk_blocks;
    }
  }
}

void KvIndexer::finalize_entries(MatchResult& out, std::span<const std::uint32_t> entries,
                                 std::uint32_t depth) const {
  if (out.any_offload_) {
    for (const std::uint32_t entry : entries) finalize(out, holder_slot(entry), depth);
    return;
  }
  // The common case, every block on device: a straight copy loop.
  WorkerMatch* match = out.matches_.get() + out.match_count_;
  for (const std::uint32_t entry : entries) {
    const SlotId slot = holder_slot(entry);
    match->worker = slot_workers_[slot];
    match->slot = slot;
    match->device_blocks = depth;
    match->host_blocks = 0;
    match->disk_blocks = 0;
    ++match;
  }
  out.match_count_ += static_cast<std::uint32_t>(entries.size());
}

void KvIndexer::finalize_dropouts(MatchResult& out, const HolderSet& parent, const HolderSet& child,
                                  std::uint32_t depth) const {
  // child ⊆ parent, both sorted by slot.
  const auto parent_entries = parent.entries();
  const auto child_entries = child.entries();
  std::size_t i = 0;
  std::size_t j = 0;
  if ((parent_entries.size() - child_entries.size()) * 16 > child_entries.size()) {
    // Many stop here: one linear merge.
    for (; i < parent_entries.size(); ++i) {
      if (j < child_entries.size() &&
          holder_slot(parent_entries[i]) == holder_slot(child_entries[j])) {
        ++j;
      } else {
        finalize(out, holder_slot(parent_entries[i]), depth);
      }
    }
    return;
  }
  // Few stop here: skip runs of equal entries by binary search, so the cost grows with the
  // number of ranks that stop rather than with the parent's holder count.
  while (j < child_entries.size()) {
    std::size_t low = 0;
    std::size_t high = child_entries.size() - j;
    while (low < high) {
      const std::size_t mid = (low + high) / 2;
      if (holder_slot(parent_entries[i + mid]) == holder_slot(child_entries[j + mid])) {
        low = mid + 1;
      } else {
        high = mid;
      }
    }
    i += low;
    j += low;
    if (j == child_entries.size()) break;
    finalize(out, holder_slot(parent_entries[i]), depth);
    ++i;
  }
  for (; i < parent_entries.size(); ++i) finalize(out, holder_slot(parent_entries[i]), depth);
}

void KvIndexer::count_offload(MatchResult& out, const HolderSet& holders) const {
  for (const std::uint32_t entry : holders.entries()) {
    count_offload_block(out, holder_slot(entry), holder_tiers(entry));
  }
}

void KvIndexer::count_offload_block(MatchResult& out, SlotId slot, std::uint32_t tier_bits) {
  if (tier_bits & kDeviceBit) return;
  out.any_offload_ = true;
  MatchResult::SlotScratch& scratch = out.slots_[slot];
  // The first off-device block of this slot in this lookup: its counts from earlier lookups are
  // stale.
  if (scratch.offload_epoch != out.epoch_) {
    scratch.offload_epoch = out.epoch_;
    scratch.host_blocks = 0;
    scratch.disk_blocks = 0;
  }
  if (tier_bits & tier_bit(StorageTier::Host)) {
    ++scratch.host_blocks;
  } else {
    ++scratch.disk_blocks;
  }
}

void KvIndexer::find_matches(std::span<const BlockHash> blocks, MatchResult& out) const {
  out.match_count_ = 0;
  out.longest_match_ = 0;
  out.any_offload_ = false;
  if (out.slots_.size() < slots_.size()) out.slots_.resize(slots_.size());
  if (out.match_capacity_ < slots_.size()) {
    // Every slot matches at most once per lookup.
    out.matches_ = std::make_unique<WorkerMatch[]>(slots_.size());
    out.match_capacity_ = slots_.size();
  }
  if (++out.epoch_ == 0) {
    // Epoch wrapped: stale stamps could look current, so reset them once every 2^32 lookups.
    for (MatchResult::SlotScratch& scratch : out.slots_) scratch = {};
    out.epoch_ = 1;
  }
  const NodeSlab& nodes = *nodes_;
  // Fast path: while each block's node is the child of the previous one, prefix closure makes
  // the active set exactly the node's holders, so a level costs one lookup unless holders drop
  // out (a merge against the parent's holders) or some hold the block off-device.
  NodeId prev = kNoNode;
  std::size_t depth = 0;
  for (; depth < blocks.size(); ++depth) {
    const NodeId id = find_node(blocks[depth]);
    if (id == kNoNode) break;
    const Node& node = nodes[id];
    if (node.parent != prev) {
      find_matches_explicit(blocks, depth, prev, out);
      return;
    }
    if (prev != kNoNode && node.holders.size() != nodes[prev].holders.size()) {
      finalize_dropouts(out, nodes[prev].holders, node.holders, static_cast<std::uint32_t>(depth));
    }
    if (node.holders.device_holders() != node.holders.size()) count_offload(out, node.holders);
    prev = id;
  }
  if (prev == kNoNode) return;
  finalize_entries(out, nodes[prev].holders.entries(), static_cast<std::uint32_t>(depth));
  out.longest_match_ = static_cast<std::uint32_t>(depth);
}

void KvIndexer::find_matches_explicit(std::span<const BlockHash> blocks, std::size_t depth,
                                      NodeId prev, MatchResult& out) const {
  // The prompt's chain departs from the tree's links (hashes not chained the way workers chain
  // them), so intersect holder sets level by level.
  const NodeSlab& nodes = *nodes_;
  out.active_.clear();
  bool first = prev == kNoNode;
  if (!first) {
    for (const std::uint32_t entry : nodes[prev].holders.entries()) {
      out.active_.push_back(holder_slot(entry));
    }
  }
  for (; depth < blocks.size(); ++depth) {
    const NodeId id = find_node(blocks[depth]);
    if (id == kNoNode) break;
    const HolderSet& holders = nodes[id].holders;
    out.next_active_.clear();
    if (first) {
      for (const std::uint32_t entry : holders.entries()) {
        out.next_active_.push_back(holder_slot(entry));
      }
      first = false;
    } else {
      const auto entries = holders.entries();
      std::size_t j = 0;
      for (const SlotId slot : out.active_) {
        while (j < entries.size() && holder_slot(entries[j]) < slot) ++j;
        if (j < entries.size() && holder_slot(entries[j]) == slot) {
          out.next_active_.push_back(slot);
        } else {
          finalize(out, slot, static_cast<std::uint32_t>(depth));
          out.longest_match_ = static_cast<std::uint32_t>(depth);
        }
      }
    }
    // Offload tiers only for the slots still active at this level.
    for (const SlotId slot : out.next_active_) {
      count_offload_block(out, slot, holder_tiers(holders.entry(holders.find(slot))));
    }
    out.active_.swap(out.next_active_);
    if (out.active_.empty()) return;
  }
  for (const SlotId slot : out.active_) finalize(out, slot, static_cast<std::uint32_t>(depth));
  if (!out.active_.empty()) out.longest_match_ = static_cast<std::uint32_t>(depth);
}

std::uint32_t KvIndexer::tiers_held(WorkerWithDpRank worker, BlockHash block) const {
  const auto slot = slot_of(worker);
  const NodeId id = find_node(block);
  if (!slot || id == kNoNode) return 0;
  const HolderSet& holders = (*nodes_)[id].holders;
  const std::uint32_t position = holders.find(*slot);
  return position == holders.size() ? 0 : holder_tiers(holders.entry(position));
}

std::uint64_t KvIndexer::blocks_held(WorkerWithDpRank worker, StorageTier tier) const {
  const auto slot = slot_of(worker);
  return slot ? slots_[*slot].held[tier_index(tier)] : 0;
}

std::optional<EventId> KvIndexer::last_event_id(WorkerWithDpRank worker) const {
  const auto slot = slot_of(worker);
  if (!slot) return std::nullopt;
  return slots_[*slot].last_event_id;
}

std::size_t KvIndexer::residency_count() const {
  std::size_t total = 0;
  for (const NodeRef ref : node_set_) total += (*nodes_)[ref.id].holders.size();
  return total;
}

std::size_t KvIndexer::memory_bytes() const {
  std::size_t bytes = nodes_->capacity() * sizeof(Node);
  // A flat hash set spends one control byte per slot next to each stored element.
  bytes += node_set_.capacity() * (sizeof(NodeRef) + 1);
  for (const NodeRef ref : node_set_) {
    bytes += HolderSet::heap_bytes_for((*nodes_)[ref.id].holders.size());
  }
  return bytes;
}

// ---- dumps -------------------------------------------------------------------------------------

void KvIndexer::dump_slot(SlotId slot, KvDump& out) const {
  const NodeSlab& nodes = *nodes_;
  const SlotState& state = slots_[slot];
  out.worker = state.worker;
  out.incarnation = state.incarnation;
  out.last_event_id = state.last_event_id;
  out.stored.clear();
  // Depth-first from the slot's roots, so every block follows its parent; consecutive blocks
  // of one chain on the same tier share one Stored event.
  std::vector<NodeId> stack;
  for (const NodeRef ref : node_set_) {
    const Node& node = nodes[ref.id];
    if (node.parent == kNoNode && node.holders.find(slot) != node.holders.size()) {
      stack.push_back(ref.id);
    }
  }
  while (!stack.empty()) {
    const NodeId id = stack.back();
    stack.pop_back();
    const Node& node = nodes[id];
    const std::uint32_t bits = holder_tiers(node.holders.entry(node.holders.find(slot)));
    for (std::uint32_t tier = 0; tier < kStorageTierCount; ++tier) {
      if (((bits >> tier) & 1U) == 0) continue;
      const auto storage_tier = static_cast<StorageTier>(tier);
      const std::optional<BlockHash> parent =
          node.parent == kNoNode ? std::nullopt : std::optional<BlockHash>(nodes[node.parent].hash);
      if (!out.stored.empty()) {
        KvStoredEvent& last = out.stored.back();
        if (last.tier == storage_tier && parent && last.block_hashes.back() == *parent) {
          last.block_hashes.push_back(node.hash);
          continue;
        }
      }
      out.stored.push_back(KvStoredEvent{parent, {node.hash}, storage_tier});
    }
    for (NodeId child = node.first_child; child != kNoNode; child = nodes[child].next_sibling) {
      if (nodes[child].holders.find(slot) != nodes[child].holders.size()) stack.push_back(child);
    }
  }
}

std::expected<KvDump, IndexError> KvIndexer::dump(WorkerWithDpRank worker) const {
  const auto slot = slot_of(worker);
  if (!slot) return std::unexpected(IndexError::unknown_worker);
  KvDump out;
  dump_slot(*slot, out);
  return out;
}

std::vector<KvDump> KvIndexer::dump_all() const {
  std::vector<KvDump> dumps;
  for (SlotId slot = 0; slot < slots_.size(); ++slot) {
    if (!slots_[slot].in_use) continue;
    dump_slot(slot, dumps.emplace_back());
  }
  return dumps;
}

std::expected<ApplyOutcome, IndexError> KvIndexer::load_dump(const KvDump& dump) {
  const auto it = slot_by_worker_.find(dump.worker);
  if (it == slot_by_worker_.end()) return reject(IndexError::unknown_worker);
  const SlotId slot = it->second;
  if (dump.incarnation != slots_[slot].incarnation) {
    return reject(IndexError::incarnation_mismatch);
  }
  clear_slot(slot);
  // A dump older than the events already applied loses those events; the next batch then shows
  // a gap and the runtime asks again, so the index converges instead of refusing the dump.
  slots_[slot].last_event_id = dump.last_event_id;
  ++stats_.dumps_loaded;
  ApplyOutcome outcome;
  for (const KvStoredEvent& stored : dump.stored) {
    auto result = store_chain(slot, stored);
    if (result) {
      ++outcome.applied_events;
      ++stats_.events_applied;
    } else {
      ++outcome.rejected_events;
      if (!outcome.first_error) outcome.first_error = result.error();
    }
  }
  return outcome;
}

// ---- approximate mode --------------------------------------------------------------------------

std::expected<void, IndexError> KvIndexer::record_routing(
    WorkerWithDpRank worker, std::span<const BlockHash> blocks,
    std::chrono::steady_clock::time_point now) {
  const auto it = slot_by_worker_.find(worker);
  if (it == slot_by_worker_.end()) return reject(IndexError::unknown_worker);
  const SlotId slot = it->second;
  const auto expires_at = now + config_.approximate_ttl;
  // The whole request is assumed cached; keep the prefix that fits the rank's bound.
  const std::size_t limit =
      static_cast<std::size_t>(std::min<std::uint64_t>(blocks.size(), slots_[slot].advertised[0]));
  NodeId cursor = kNoNode;
  for (std::size_t i = 0; i < limit; ++i) {
    NodeId id = find_node(blocks[i]);
    if (id == kNoNode) {
      id = create_node(blocks[i], cursor);
      node_set_.insert(NodeRef{id});
    } else if ((*nodes_)[id].parent != cursor) {
      break;  // the prompt's chain departs from the tree: keep what is consistent
    }
    if (slots_[slot].held[0] >= slots_[slot].limit[0] &&
        (*nodes_)[id].holders.find(slot) == (*nodes_)[id].holders.size()) {
      if ((*nodes_)[id].holders.empty()) erase_node(id);
      break;
    }
    add_holder(id, slot, kDeviceBit);
    approximate_expiry_[ApproximateKey{slot, blocks[i]}] = expires_at;
    approximate_order_.push_back(ApproximateEntry{slot, blocks[i], expires_at});
    cursor = id;
  }
  prune_approximate(config_.approximate_max_blocks, now, /*by_time=*/false);
  return {};
}

std::size_t KvIndexer::expire(std::chrono::steady_clock::time_point now) {
  const std::uint64_t before = stats_.blocks_removed;
  prune_approximate(config_.approximate_max_blocks, now, /*by_time=*/true);
  return static_cast<std::size_t>(stats_.blocks_removed - before);
}

void KvIndexer::prune_approximate(std::size_t max_entries,
                                  std::chrono::steady_clock::time_point now, bool by_time) {
  // Entries are queued in routing order with one TTL, so the front is the oldest. An entry is
  // stale when its residency was refreshed (a later entry exists) or already dropped.
  while (!approximate_order_.empty()) {
    const ApproximateEntry& front = approximate_order_.front();
    const auto it = approximate_expiry_.find(ApproximateKey{front.slot, front.hash});
    const bool live = it != approximate_expiry_.end() && it->second == front.expires_at;
    if (live) {
      const bool due = by_time ? front.expires_at <= now : false;
      if (!due && approximate_expiry_.size() <= max_entries) break;
      const SlotId slot = front.slot;
      const BlockHash hash = front.hash;
      approximate_order_.pop_front();
      approximate_expiry_.erase(it);
      const NodeId id = find_node(hash);
      if (id != kNoNode) drop_subtree(id, slot);
    } else {
      approximate_order_.pop_front();
    }
  }
}

// ---- consistency -------------------------------------------------------------------------------

std::expected<void, std::string> KvIndexer::check_consistency() const {
  const NodeSlab& nodes = *nodes_;
  std::vector<std::array<std::uint64_t, kStorageTierCount>> held(slots_.size());
  std::size_t in_set = 0;
  for (const NodeRef ref : node_set_) {
    ++in_set;
    const Node& node = nodes[ref.id];
    const std::string where = "node " + std::to_string(node.hash) + ": ";
    if (find_node(node.hash) != ref.id) return std::unexpected(where + "not found by its hash");
    if (node.holders.empty()) return std::unexpected(where + "has no holders");
    std::uint32_t device = 0;
    SlotId previous = 0;
    bool first = true;
    for (const std::uint32_t entry : node.holders.entries()) {
      const SlotId slot = holder_slot(entry);
      if (!first && slot <= previous) return std::unexpected(where + "holders not sorted");
      first = false;
      previous = slot;
      if (slot >= slots_.size() || !slots_[slot].in_use) {
        return std::unexpected(where + "held by a free slot");
      }
      if (holder_tiers(entry) == 0) return std::unexpected(where + "holder without tiers");
      if (entry & kDeviceBit) ++device;
      for (std::size_t tier = 0; tier < kStorageTierCount; ++tier) {
        if ((holder_tiers(entry) >> tier) & 1U) ++held[slot][tier];
      }
      if (node.parent != kNoNode &&
          nodes[node.parent].holders.find(slot) == nodes[node.parent].holders.size()) {
        return std::unexpected(where + "holder does not hold the parent");
      }
    }
    if (device != node.holders.device_holders()) {
      return std::unexpected(where + "device holder count wrong");
    }
    if (node.parent != kNoNode) {
      bool linked = false;
      for (NodeId child = nodes[node.parent].first_child; child != kNoNode;
           child = nodes[child].next_sibling) {
        if (child == ref.id) linked = true;
      }
      if (!linked) return std::unexpected(where + "missing from its parent's children");
    }
    NodeId previous_child = kNoNode;
    for (NodeId child = node.first_child; child != kNoNode; child = nodes[child].next_sibling) {
      if (nodes[child].parent != ref.id) return std::unexpected(where + "child with other parent");
      if (nodes[child].prev_sibling != previous_child) {
        return std::unexpected(where + "sibling links broken");
      }
      previous_child = child;
    }
  }
  std::size_t free_count = 0;
  for (NodeId id = free_nodes_; id != kNoNode; id = nodes[id].next_sibling) ++free_count;
  if (in_set + free_count != nodes.size()) {
    return std::unexpected("node slab and hash set disagree");
  }
  for (SlotId slot = 0; slot < slots_.size(); ++slot) {
    const SlotState& state = slots_[slot];
    if (!state.in_use) continue;
    if (state.held != held[slot]) {
      return std::unexpected("slot " + std::to_string(slot) + ": tier counts wrong");
    }
    for (std::size_t tier = 0; tier < kStorageTierCount; ++tier) {
      if (state.held[tier] > state.limit[tier]) {
        return std::unexpected("slot " + std::to_string(slot) + ": over capacity");
      }
    }
  }
  for (const auto& [key, expires_at] : approximate_expiry_) {
    const NodeId id = find_node(key.hash);
    if (id == kNoNode || nodes[id].holders.find(key.slot) == nodes[id].holders.size()) {
      return std::unexpected("approximate entry without residency");
    }
  }
  return {};
}

}  // namespace kvr::discovery
