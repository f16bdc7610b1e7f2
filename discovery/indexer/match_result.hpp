// The answer of KvIndexer::find_matches: per (worker, rank), how many leading blocks of a prompt
// it holds, by tier. Reused across calls so that a warm lookup allocates nothing.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "discovery/indexer/holder_set.hpp"
#include "messages/ids.hpp"

namespace kvr::discovery {

/// How much of a prompt's leading blocks one (worker, rank) holds; each matched block counted on
/// the cheapest tier holding it.
struct WorkerMatch {
  WorkerWithDpRank worker;
  SlotId slot = 0;  ///< the index's slot for `worker` (see KvIndexer::slot_of)
  std::uint32_t device_blocks = 0;
  std::uint32_t host_blocks = 0;
  std::uint32_t disk_blocks = 0;

  /// Length of the matched prefix, in blocks.
  std::uint32_t matched_blocks() const { return device_blocks + host_blocks + disk_blocks; }

  friend bool operator==(const WorkerMatch&, const WorkerMatch&) = default;
};

/// Output buffer and scratch space of find_matches. Keep one per caller and pass it to every
/// lookup; its storage grows to the largest fleet seen and is then reused.
class MatchResult {
 public:
  /// Every (worker, rank) with a non-empty match, in no particular order.
  std::span<const WorkerMatch> matches() const { return {matches_.get(), match_count_}; }

  /// The longest matched prefix over all workers, in blocks.
  std::uint32_t longest_match() const { return longest_match_; }

  /// The match of one slot, or nullptr when it matched nothing. O(1) after the first call
  /// following a lookup, which indexes the matches (lookups themselves skip that work).
  const WorkerMatch* find(SlotId slot) const {
    if (indexed_epoch_ != epoch_) {
      for (std::uint32_t i = 0; i < match_count_; ++i) {
        slots_[matches_[i].slot].final_epoch = epoch_;
        slots_[matches_[i].slot].match_index = i;
      }
      indexed_epoch_ = epoch_;
    }
    if (slot >= slots_.size() || slots_[slot].final_epoch != epoch_) return nullptr;
    return &matches_[slots_[slot].match_index];
  }

 private:
  friend class KvIndexer;

  // Per-slot scratch; an entry is valid only when its epoch equals the current lookup's, so
  // starting a lookup never touches the whole array.
  struct SlotScratch {
    std::uint32_t offload_epoch = 0;  // host/disk counters valid for this epoch
    std::uint32_t host_blocks = 0;
    std::uint32_t disk_blocks = 0;
    std::uint32_t final_epoch = 0;  // match_index valid for this epoch
    std::uint32_t match_index = 0;
  };

  // Sized to the index's slot count before a lookup, so filling it needs no capacity checks.
  std::unique_ptr<WorkerMatch[]> matches_;
  std::uint32_t match_count_ = 0;
  std::size_t match_capacity_ = 0;
  mutable std::vector<SlotScratch> slots_;
  std::vector<SlotId> active_;
  std::vector<SlotId> next_active_;
  std::uint32_t epoch_ = 0;
  mutable std::uint32_t indexed_epoch_ = 0;
  std::uint32_t longest_match_ = 0;
  bool any_offload_ = false;  // some matched block was counted off-device in this lookup
};

}  // namespace kvr::discovery
