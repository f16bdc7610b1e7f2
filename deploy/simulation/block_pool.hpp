// The simulated engine's KV block pool: fixed-size blocks, prefix reuse by chained block hash,
// LRU eviction of unreferenced cached blocks, and the Stored/Removed/Cleared events that result.
// Owned by one simulation::Engine; plain C++, single-threaded.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include <absl/container/flat_hash_set.h>

#include "messages/ids.hpp"
#include "messages/kv_event.hpp"

namespace kvr::simulation {

/// A block's slot in the pool, 0 .. total_blocks() - 1.
using BlockIndex = std::uint32_t;

/// The result of looking a prompt's block hashes up in the pool.
struct PrefixMatch {
  /// How many leading hashes are in the pool (referenced or cached).
  std::size_t blocks = 0;
  /// How many of those are unreferenced: acquiring them takes them out of the evictable set.
  std::size_t unreferenced = 0;
};

/// A fixed pool of KV blocks. A block is in exactly one of three states:
/// free (no reusable content), active (referenced by at least one request; may carry a hash),
/// or cached (hashed, unreferenced, reusable, and evictable in least-recently-released order).
/// Changes that the router must learn about are queued as KvEvents, merged where adjacent, and
/// handed out by take_events().
class BlockPool {
 public:
  /// A pool of total_blocks empty blocks; total_blocks must be below UINT32_MAX.
  explicit BlockPool(std::uint32_t total_blocks);

  /// Every block in the pool.
  std::uint32_t total_blocks() const { return total_blocks_; }
  /// Blocks referenced by at least one request.
  std::uint32_t active_blocks() const { return active_blocks_; }
  /// Hashed blocks that no request references: reusable, and evicted when space is needed.
  std::uint32_t cached_blocks() const { return lru_size_; }
  /// Blocks without content.
  std::uint32_t free_blocks() const { return static_cast<std::uint32_t>(free_.size()); }
  /// Blocks allocate() can still hand out: free plus cached.
  std::uint32_t available_blocks() const { return free_blocks() + cached_blocks(); }

  /// Whether a block with this hash is in the pool (active or cached).
  bool contains(BlockHash hash) const { return by_hash_.contains(hash); }

  /// The longest prefix of hashes present in the pool; touches nothing.
  PrefixMatch match_prefix(std::span<const BlockHash> hashes) const;

  /// As above, and replaces the contents of `found` with the matched blocks, in prompt order,
  /// for acquire_block.
  PrefixMatch match_prefix(std::span<const BlockHash> hashes, std::vector<BlockIndex>& found) const;

  /// Takes a reference on the block holding hash, which must be present; a cached block becomes
  /// active and leaves the eviction order.
  BlockIndex acquire(BlockHash hash);

  /// As acquire, for a block match_prefix just found (no allocation since), without looking
  /// its hash up again.
  void acquire_block(BlockIndex block);

  /// Takes an empty block with one reference: a free one if any, else evicts the least recently
  /// released cached block (queuing a Removed event); nullopt when every block is active.
  std::optional<BlockIndex> allocate();

  /// Allocates up to `count` blocks as that many allocate() calls would, appending them to `out`;
  /// returns how many it got (fewer only when every block is active).
  std::size_t allocate_run(std::size_t count, std::vector<BlockIndex>& out);

  /// Records that an active block now holds the full block hash, continuing the chain at parent
  /// (none: the first block of a prompt), and queues a Stored event. Returns false, and leaves
  /// the block anonymous, when another block already holds hash (no duplicate announcements).
  bool commit(BlockIndex block, BlockHash hash, std::optional<BlockHash> parent);

  /// Commits blocks[i] under hashes[i] for every i, each chained to the hash before it (the
  /// first to parent): the same as calling commit() in order, with the hash-map misses overlapped.
  void commit_run(std::span<const BlockIndex> blocks, std::span<const BlockHash> hashes,
                  std::optional<BlockHash> parent);

  /// Drops one reference; at zero a hashed block becomes cached (most recently released) and an
  /// anonymous one becomes free.
  void release(BlockIndex block);

  /// Empties the pool: every block becomes free and a Cleared event is queued. The caller must
  /// drop every BlockIndex it holds.
  void clear();

  /// The events queued since the last call, in the order they happened.
  std::vector<KvEvent> take_events();

  /// As above, into `out` (its previous contents are dropped); the pool keeps out's memory for
  /// the next events.
  void take_events(std::vector<KvEvent>& out);

  /// Every hashed block (active and cached) as Stored chains that rebuild an index when applied
  /// in order: each chain's parent is either none or a block earlier in the dump, unless that
  /// parent is no longer in the pool. Deterministic for a given history.
  std::vector<KvStoredEvent> dump() const;

  /// The cached blocks' hashes, next to be evicted first.
  std::vector<BlockHash> eviction_order() const;

 private:
  static constexpr BlockIndex kNoBlock = UINT32_MAX;

  struct Block {
    BlockHash hash = 0;
    BlockHash parent_hash = 0;
    std::uint32_t ref_count = 0;
    BlockIndex lru_prev = kNoBlock;
    BlockIndex lru_next = kNoBlock;
    bool has_hash = false;
    bool has_parent = false;
  };

  // The hash index stores block indices and finds them by hash through the blocks, so that an
  // entry is four bytes and a probe group one cache line: evictions and commits probe it cold.
  struct BlockRef {
    BlockIndex index;
  };
  struct BlockRefHash {
    using is_transparent = void;
    const Block* blocks;
    std::size_t operator()(BlockHash hash) const { return absl::Hash<BlockHash>{}(hash); }
    std::size_t operator()(BlockRef ref) const { return (*this)(blocks[ref.index].hash); }
  };
  struct BlockRefEq {
    using is_transparent = void;
    const Block* blocks;
    bool operator()(BlockRef a, BlockRef b) const {
      return blocks[a.index].hash == blocks[b.index].hash;
    }
    bool operator()(BlockRef a, BlockHash b) const { return blocks[a.index].hash == b; }
    bool operator()(BlockHash a, BlockRef b) const { return blocks[b.index].hash == a; }
  };

  void lru_push_back(BlockIndex block);
  void lru_unlink(BlockIndex block);
  void queue_removed(BlockHash hash);
  void queue_stored(std::optional<BlockHash> parent, BlockHash hash);

  // On the heap, so the hash index's functors keep a valid pointer when the pool moves.
  std::unique_ptr<Block[]> blocks_;
  std::uint32_t total_blocks_ = 0;
  // A stack, so that recently freed blocks are reused first; the order carries no meaning.
  std::vector<BlockIndex> free_;
  // Hashed blocks (active and cached) by hash.
  absl::flat_hash_set<BlockRef, BlockRefHash, BlockRefEq> by_hash_;
  BlockIndex lru_head_ = kNoBlock;
  BlockIndex lru_tail_ = kNoBlock;
  std::uint32_t lru_size_ = 0;
  std::uint32_t active_blocks_ = 0;
  std::vector<KvEvent> events_;
};

}  // namespace kvr::simulation
