// A deliberately simple model of the KV indexer's semantics (per-rank maps, no tree, no tricks),
// against which the property tests compare the real index.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <vector>

#include "discovery/indexer/kv_indexer.hpp"

namespace kvr::discovery::testing {

/// Reference semantics: a rank holds a set of (block, tier bits); a block exists while some rank
/// holds it and keeps the parent it was first stored under.
class ReferenceKvIndex {
 public:
  struct Rank {
    std::uint64_t capacity = 0;
    std::array<std::uint64_t, kStorageTierCount> limit{};
    std::map<BlockHash, std::uint32_t> blocks;  // hash -> tier bits
  };

  explicit ReferenceKvIndex(IndexerConfig config = {}) : config_(config) {}

  void add_worker(WorkerWithDpRank worker, std::uint64_t capacity) {
    Rank rank;
    rank.capacity = capacity;
    const std::uint64_t offload = scaled(capacity, config_.offload_capacity_factor);
    const std::array<std::uint64_t, kStorageTierCount> advertised{capacity, offload, offload};
    for (std::size_t tier = 0; tier < kStorageTierCount; ++tier) {
      rank.limit[tier] = advertised[tier] + scaled(advertised[tier], config_.capacity_margin) +
                         config_.capacity_slack_blocks;
    }
    ranks_[worker] = rank;
  }

  void remove_rank(WorkerWithDpRank worker) {
    clear(worker);
    ranks_.erase(worker);
  }

  std::optional<IndexError> apply(WorkerWithDpRank worker, const KvEvent& event) {
    if (!ranks_.contains(worker)) return IndexError::unknown_worker;
    if (const auto* stored = std::get_if<KvStoredEvent>(&event)) return store(worker, *stored);
    if (const auto* removed = std::get_if<KvRemovedEvent>(&event)) return remove(worker, *removed);
    clear(worker);
    return std::nullopt;
  }

  /// Exact semantics: longest prefix the rank holds, each block counted on its cheapest tier.
  std::map<WorkerWithDpRank, std::array<std::uint32_t, 3>> find_matches(
      std::span<const BlockHash> blocks) const {
    std::map<WorkerWithDpRank, std::array<std::uint32_t, 3>> result;
    for (const auto& [worker, rank] : ranks_) {
      std::array<std::uint32_t, 3> counts{};
      for (const BlockHash hash : blocks) {
        const auto it = rank.blocks.find(hash);
        if (it == rank.blocks.end()) break;
        ++counts[static_cast<std::size_t>(std::countr_zero(it->second))];
      }
      if (counts[0] + counts[1] + counts[2] > 0) result[worker] = counts;
    }
    return result;
  }

  std::uint32_t tiers_held(WorkerWithDpRank worker, BlockHash hash) const {
    const auto rank = ranks_.find(worker);
    if (rank == ranks_.end()) return 0;
    const auto it = rank->second.blocks.find(hash);
    return it == rank->second.blocks.end() ? 0 : it->second;
  }

  bool holds(WorkerWithDpRank worker, BlockHash hash) const {
    return tiers_held(worker, hash) != 0;
  }

  const std::map<WorkerWithDpRank, Rank>& ranks() const { return ranks_; }

 private:
  static std::uint64_t scaled(std::uint64_t blocks, double factor) {
    return static_cast<std::uint64_t>(std::ceil(static_cast<double>(blocks) * factor));
  }

  bool exists(BlockHash hash) const {
    for (const auto& [worker, rank] : ranks_) {
      if (rank.blocks.contains(hash)) return true;
    }
    return false;
  }

  std::optional<IndexError> store(WorkerWithDpRank worker, const KvStoredEvent& event) {
    Rank& rank = ranks_[worker];
    const auto tier = static_cast<std::size_t>(event.tier);
    const std::uint32_t bit = 1U << tier;
    const std::uint64_t advertised =
        tier == 0 ? rank.capacity : scaled(rank.capacity, config_.offload_capacity_factor);
    if (event.block_hashes.size() > advertised) return IndexError::chain_too_long;
    if (event.parent_hash && !holds(worker, *event.parent_hash)) return IndexError::unknown_parent;
    std::optional<BlockHash> cursor = event.parent_hash;
    std::uint64_t added = 0;
    for (const BlockHash hash : event.block_hashes) {
      if (exists(hash) && parent_.at(hash) != cursor) return IndexError::parent_mismatch;
      if ((tiers_held(worker, hash) & bit) == 0) ++added;
      cursor = hash;
    }
    // Counted like the index: a repeated new block counts twice before being refused.
    if (rank.limit[tier] < held(worker, tier) + added) return IndexError::capacity_exceeded;
    std::set<BlockHash> seen;
    for (const BlockHash hash : event.block_hashes) {
      if (!exists(hash) && !seen.insert(hash).second) return IndexError::duplicate_block;
    }
    cursor = event.parent_hash;
    for (const BlockHash hash : event.block_hashes) {
      if (!exists(hash)) parent_[hash] = cursor;
      rank.blocks[hash] |= bit;
      cursor = hash;
    }
    return std::nullopt;
  }

  std::uint64_t held(WorkerWithDpRank worker, std::size_t tier) const {
    std::uint64_t count = 0;
    for (const auto& [hash, bits] : ranks_.at(worker).blocks) count += (bits >> tier) & 1U;
    return count;
  }

  std::optional<IndexError> remove(WorkerWithDpRank worker, const KvRemovedEvent& event) {
    Rank& rank = ranks_[worker];
    const std::uint32_t bit = 1U << static_cast<std::uint32_t>(event.tier);
    bool unknown = false;
    for (const BlockHash hash : event.block_hashes) {
      auto it = rank.blocks.find(hash);
      if (it == rank.blocks.end() || (it->second & bit) == 0) {
        unknown = true;
        continue;
      }
      it->second &= ~bit;
      if (it->second == 0) {
        rank.blocks.erase(it);
        // Blocks whose parent the rank no longer holds can never match again: drop them.
        bool changed = true;
        while (changed) {
          changed = false;
          for (auto block = rank.blocks.begin(); block != rank.blocks.end();) {
            const auto parent = parent_.at(block->first);
            if (parent && !rank.blocks.contains(*parent)) {
              block = rank.blocks.erase(block);
              changed = true;
            } else {
              ++block;
            }
          }
        }
      }
    }
    forget_unheld();
    return unknown ? std::optional(IndexError::unknown_block) : std::nullopt;
  }

  void clear(WorkerWithDpRank worker) {
    ranks_[worker].blocks.clear();
    forget_unheld();
  }

  void forget_unheld() {
    for (auto it = parent_.begin(); it != parent_.end();) {
      it = exists(it->first) ? std::next(it) : parent_.erase(it);
    }
  }

  IndexerConfig config_;
  std::map<WorkerWithDpRank, Rank> ranks_;
  std::map<BlockHash, std::optional<BlockHash>> parent_;
};

}  // namespace kvr::discovery::testing
