// The two ceilings of the hit-rate ladder (docs/hit-rate.md) over requests in the order they are
// routed: the workload's (one infinite cache) and the capacity-bound one (one LRU cache of the
// fleet's KV blocks). `kvr replay` runs both exactly over a whole trace. A node runs them on every
// routed request, inside its selector, so it bounds their memory and time:
// - its "infinite" cache is an LRU cache too, of a horizon it chooses (at least the fleet's KV);
// - it tracks each prompt in runs of `resolution_tokens`, one entry per run keyed by the run's
//   first block, with the run's length and last block. A chained block hash stands for its whole
//   prefix, so a run found proves every block before it, and its last block proves the run
//   itself; only a prompt that leaves a run somewhere inside it is estimated (at the middle).
//   Eviction takes a run's blocks tail first, as an engine frees a prompt's.
// Not sampled by hash: a sample of blocks misjudges the few hot ones (a shared system prompt) that
// most hits come from. Plain C++, single-threaded.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <vector>

#include <absl/container/flat_hash_map.h>

#include "messages/ids.hpp"

namespace kvr::metrics {

/// How a node runs the ceilings by default: a workload cache of 2^24 tokens
/// (`kvr node --hit-rate-workload-tokens`), one run tracked per 128 tokens: 131,072 tracked
/// runs of about 100 bytes once the traffic has filled it: 14 MB per partition.
inline constexpr std::uint64_t kDefaultWorkloadTokens = std::uint64_t{1} << 24;
inline constexpr std::uint32_t kNodeResolutionTokens = 128;

/// A set of block hashes in recency order that evicts the least recently used. Each hash stands
/// for a run of blocks that starts with it (1 when every block is tracked); capacities are in
/// blocks, and eviction takes the oldest run's blocks tail first, as an engine frees them.
class LruBlockSet {
 public:
  /// The blocks of a hash's run: those held now, the most it ever stood for (held < known: its
  /// tail was evicted), and the hash of that longest run's last block.
  struct Run {
    std::uint32_t held = 0;
    std::uint32_t known = 0;
    BlockHash last = 0;
  };

  std::optional<Run> find(BlockHash hash) const {
    const auto found = where_.find(hash);
    if (found == where_.end()) return std::nullopt;
    const Node& node = nodes_[found->second];
    return Run{node.held, node.known, node.last};
  }
  std::size_t size() const { return where_.size(); }
  /// The blocks held.
  std::uint64_t blocks() const { return blocks_; }
  /// Makes `hash` the most recently used, holding at least the first `blocks` of its run (whose
  /// last block is `last`), then evicts down to `capacity` blocks.
  void touch(BlockHash hash, std::uint32_t blocks, BlockHash last, std::uint64_t capacity);
  /// Evicts the least recently used blocks until at most `capacity` are held.
  void shrink_to(std::uint64_t capacity);

 private:
  static constexpr std::uint32_t kNone = std::numeric_limits<std::uint32_t>::max();
  struct Node {
    BlockHash hash = 0;
    BlockHash last = 0;
    std::uint32_t newer = kNone;
    std::uint32_t older = kNone;
    std::uint32_t held = 0;
    std::uint32_t known = 0;
  };

  void unlink(std::uint32_t at);
  void link_newest(std::uint32_t at);
  void remove(std::uint32_t at);

  std::vector<Node> nodes_;
  std::vector<std::uint32_t> free_;
  absl::flat_hash_map<BlockHash, std::uint32_t> where_;
  std::uint32_t newest_ = kNone;
  std::uint32_t oldest_ = kNone;
  std::uint64_t blocks_ = 0;
};

/// How a HitRateCeilings measures; the defaults are exact.
struct HitRateCeilingsOptions {
  /// The workload cache's size in tokens (raised to the fleet's KV when that is larger, so that
  /// it never holds less than the capacity-bound one); the maximum: infinite.
  std::uint64_t workload_tokens = std::numeric_limits<std::uint64_t>::max();
  /// One block is tracked per this many tokens (at least every block); 0: every block.
  std::uint32_t resolution_tokens = 0;
};

/// Both ceilings of one request stream (file comment).
class HitRateCeilings {
 public:
  /// One request's cached prompt tokens under each ceiling.
  struct Cached {
    std::uint64_t workload_tokens = 0;
    std::uint64_t capacity_tokens = 0;
  };

  explicit HitRateCeilings(HitRateCeilingsOptions options = {}) : options_(options) {}

  /// Records the next request: `block_hashes` are its full blocks' chained hashes at `block_size`
  /// tokens, `capacity_blocks` the fleet's KV blocks now. A request reuses its longest cached
  /// prefix, never its last token (which the engine always computes); then its blocks become the
  /// most recently used, its first most recent of all (engines free a prompt's blocks tail first,
  /// so what eviction leaves of it is a reusable prefix).
  Cached record(std::span<const BlockHash> block_hashes, std::uint64_t prompt_tokens,
                std::uint32_t block_size, std::uint64_t capacity_blocks);

  /// The runs both caches track (what their memory grows with, about 100 bytes each).
  std::size_t tracked_blocks() const { return workload_.size() + capacity_.size(); }

 private:
  HitRateCeilingsOptions options_;
  LruBlockSet workload_;
  LruBlockSet capacity_;
};

}  // namespace kvr::metrics
