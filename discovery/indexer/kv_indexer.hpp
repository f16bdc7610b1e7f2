// The KV indexer: which (worker, rank) holds which chained block on which tier, built from KV
// events (or, for workers without events, from routing decisions). Owned by a selector actor's
// partition state; answers find_matches on the selection hot path.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <expected>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <absl/container/flat_hash_map.h>
#include <absl/container/flat_hash_set.h>

#include "discovery/indexer/holder_set.hpp"
#include "discovery/indexer/index_error.hpp"
#include "discovery/indexer/match_result.hpp"
#include "messages/ids.hpp"
#include "messages/kv_event.hpp"

namespace kvr::discovery {

/// Bounds and approximate-mode settings of an index.
struct IndexerConfig {
  /// A rank may hold up to capacity × (1 + margin) + slack blocks per tier, so a publisher that
  /// reports a Stored before the matching Removed is not refused, but a rogue one is bounded.
  double capacity_margin = 0.25;
  std::uint64_t capacity_slack_blocks = 64;
  /// Host and disk tiers may hold this many times the advertised (device) capacity.
  double offload_capacity_factor = 4.0;
  /// Approximate mode: how long a routed request's blocks are assumed cached.
  std::chrono::milliseconds approximate_ttl{120'000};
  /// Approximate mode: at most this many (block, rank) residencies over all approximate ranks;
  /// the oldest are pruned first.
  std::size_t approximate_max_blocks = 1'000'000;
};

/// How one (worker, rank) is indexed.
struct RankIndexOptions {
  std::uint64_t capacity_blocks = 0;  ///< advertised KV capacity of the rank (device tier)
  Incarnation incarnation = 0;        ///< the worker process start that events must come from
  bool approximate = false;           ///< publishes no events: routing decisions fill the index
};

/// A batch skipped event ids: the runtime should ask the worker for a dump.
struct EventGap {
  EventId expected = 0;  ///< the id that should have come next
  EventId received = 0;  ///< the id that came

  friend bool operator==(const EventGap&, const EventGap&) = default;
};

/// What applying a batch (or loading a dump) did. Rejected events are counted in IndexerStats.
struct ApplyOutcome {
  std::uint32_t applied_events = 0;
  std::uint32_t rejected_events = 0;
  std::optional<IndexError> first_error;  ///< reason of the first rejected event
  std::optional<EventGap> gap;            ///< set when the batch skipped ids (it is still applied)
};

/// A radix tree over chained block hashes. Each node is one block, keyed by its sequence hash in
/// a flat hash set, linked to its parent and children, and holding a sorted set of the slots
/// (interned (worker, rank)) that hold it, with tier bits.
///
/// Invariants, kept by every operation (check_consistency verifies them):
///  - every node has at least one holder;
///  - a slot holding a node also holds the node's parent (prefix closure). Stored chains must
///    continue a block the rank holds, and removing a block from a rank's last tier also removes
///    the rank's descendants of it, which could never be matched again anyway;
///  - per-slot tier counts equal the residencies in the tree and stay under the capacity bound.
/// Prefix closure is what lets find_matches skip whole levels: when a node and its parent have
/// equally many holders, they have the same holders.
class KvIndexer {
 public:
  explicit KvIndexer(IndexerConfig config = {});
  ~KvIndexer();
  KvIndexer(KvIndexer&&) noexcept;
  KvIndexer& operator=(KvIndexer&&) noexcept;
  KvIndexer(const KvIndexer&) = delete;
  KvIndexer& operator=(const KvIndexer&) = delete;

  /// Registers a (worker, rank) with an empty cache.
  std::expected<SlotId, IndexError> add_worker(WorkerWithDpRank worker, RankIndexOptions options);

  /// Drops one rank and everything it holds; false when it was not registered.
  bool remove_rank(WorkerWithDpRank worker);

  /// Drops every rank of a worker; returns how many ranks were removed.
  std::size_t remove_worker(WorkerId worker_id);

  /// The slot of a registered (worker, rank).
  std::optional<SlotId> slot_of(WorkerWithDpRank worker) const;

  /// The (worker, rank) of a slot in use.
  WorkerWithDpRank worker_of(SlotId slot) const { return slots_[slot].worker; }

  /// Applies a batch after checking worker, incarnation and event id. A duplicate or older id
  /// rejects the whole batch; a gap is reported and the batch applied. Bad events inside the
  /// batch are rejected one by one and leave the index as it was before them.
  std::expected<ApplyOutcome, IndexError> apply(const KvEventBatch& batch);

  /// Applies one event without event-id tracking (tests, approximate feeds, the load tracker).
  std::expected<void, IndexError> apply_event(WorkerWithDpRank worker, const KvEvent& event);

  /// Fills `out` with every (worker, rank) holding a non-empty prefix of `blocks` (chained
  /// sequence hashes in prompt order). Allocates only when `out` must grow.
  void find_matches(std::span<const BlockHash> blocks, MatchResult& out) const;

  /// The contents of one rank as Stored chains, parents before children.
  std::expected<KvDump, IndexError> dump(WorkerWithDpRank worker) const;

  /// The contents of every rank (the whole index as a stream of Stored events).
  std::vector<KvDump> dump_all() const;

  /// Replaces a rank's contents with a dump and continues its event ids after last_event_id.
  std::expected<ApplyOutcome, IndexError> load_dump(const KvDump& dump);

  /// Approximate mode: records that `blocks` were routed to `worker` at `now`; they stay indexed
  /// (device tier) until now + approximate_ttl, refreshed by later routings.
  std::expected<void, IndexError> record_routing(WorkerWithDpRank worker,
                                                 std::span<const BlockHash> blocks,
                                                 std::chrono::steady_clock::time_point now);

  /// Approximate mode: drops residencies whose TTL ended at or before `now`; returns how many.
  std::size_t expire(std::chrono::steady_clock::time_point now);

  /// The tier bits (1 device, 2 host, 4 disk) `worker` holds `block` on; 0 when not held.
  std::uint32_t tiers_held(WorkerWithDpRank worker, BlockHash block) const;

  /// Blocks a rank holds on one tier.
  std::uint64_t blocks_held(WorkerWithDpRank worker, StorageTier tier) const;

  /// The last applied event id of a rank (0 before the first batch).
  std::optional<EventId> last_event_id(WorkerWithDpRank worker) const;

  std::size_t node_count() const { return node_set_.size(); }
  std::size_t rank_count() const { return slot_by_worker_.size(); }
  /// (block, rank) residencies, whatever the tiers.
  std::size_t residency_count() const;
  /// Bytes held by the tree: node slab, hash set, holder arrays (not slots or scratch).
  std::size_t memory_bytes() const;

  const IndexerStats& stats() const { return stats_; }
  const IndexerConfig& config() const { return config_; }

  /// Verifies every invariant; the message names the first violation. For tests; O(index).
  std::expected<void, std::string> check_consistency() const;

 private:
  using NodeId = std::uint32_t;
  static constexpr NodeId kNoNode = 0xFFFFFFFFU;

  struct Node {
    BlockHash hash = 0;
    NodeId parent = kNoNode;
    NodeId first_child = kNoNode;
    NodeId next_sibling = kNoNode;  // also links the free list
    NodeId prev_sibling = kNoNode;
    HolderSet holders;
  };

  // Nodes in fixed-size chunks: addresses stay put as the tree grows, and the slack is at most
  // one chunk instead of the up-to-half of a doubling vector.
  class NodeSlab {
   public:
    static constexpr std::uint32_t kChunkBits = 12;
    static constexpr std::uint32_t kChunkSize = 1U << kChunkBits;
    Node& operator[](NodeId id) { return chunks_[id >> kChunkBits][id & (kChunkSize - 1)]; }
    const Node& operator[](NodeId id) const {
      return chunks_[id >> kChunkBits][id & (kChunkSize - 1)];
    }
    std::size_t size() const { return size_; }
    std::size_t capacity() const { return chunks_.size() * kChunkSize; }
    void emplace_back() {
      if (size_ == capacity()) chunks_.push_back(std::make_unique<Node[]>(kChunkSize));
      ++size_;
    }

   private:
    std::vector<std::unique_ptr<Node[]>> chunks_;
    std::size_t size_ = 0;
  };

  // The hash set stores node ids and finds them by block hash through the slab.
  struct NodeRef {
    NodeId id;
  };
  struct NodeHash {
    using is_transparent = void;
    const NodeSlab* nodes;
    std::size_t operator()(BlockHash hash) const { return absl::Hash<std::uint64_t>{}(hash); }
    std::size_t operator()(NodeRef ref) const { return (*this)((*nodes)[ref.id].hash); }
  };
  struct NodeEq {
    using is_transparent = void;
    const NodeSlab* nodes;
    bool operator()(NodeRef a, NodeRef b) const {
      return (*nodes)[a.id].hash == (*nodes)[b.id].hash;
    }
    bool operator()(NodeRef a, BlockHash b) const { return (*nodes)[a.id].hash == b; }
    bool operator()(BlockHash a, NodeRef b) const { return (*nodes)[b.id].hash == a; }
  };
  using NodeSet = absl::flat_hash_set<NodeRef, NodeHash, NodeEq>;

  struct SlotState {
    WorkerWithDpRank worker;
    Incarnation incarnation = 0;
    EventId last_event_id = 0;
    std::array<std::uint64_t, kStorageTierCount> advertised{};  // per tier, without margin
    std::array<std::uint64_t, kStorageTierCount> limit{};       // per tier, with margin
    std::array<std::uint64_t, kStorageTierCount> held{};        // residencies per tier
    bool in_use = false;
    bool approximate = false;
  };

  struct ApproximateKey {
    SlotId slot;
    BlockHash hash;
    friend bool operator==(const ApproximateKey&, const ApproximateKey&) = default;
    template <typename H>
    friend H AbslHashValue(H state, const ApproximateKey& key) {
      return H::combine(std::move(state), key.slot, key.hash);
    }
  };
  struct ApproximateEntry {
    SlotId slot;
    BlockHash hash;
    std::chrono::steady_clock::time_point expires_at;
  };

  NodeId find_node(BlockHash hash) const;
  NodeId create_node(BlockHash hash, NodeId parent);
  // Removes a node from the hash set and unlinks it; it must hold nobody and have no children.
  void erase_node(NodeId id);
  // Unlinks a node from its parent and returns it to the free list, without the hash set.
  void unlink_node(NodeId id);
  std::unexpected<IndexError> reject(IndexError error);

  std::expected<void, IndexError> apply_to_slot(SlotId slot, const KvEvent& event);
  std::expected<void, IndexError> store_chain(SlotId slot, const KvStoredEvent& event);
  std::expected<void, IndexError> remove_blocks(SlotId slot, const KvRemovedEvent& event);
  void clear_slot(SlotId slot);
  void release_slot(SlotId slot);
  // Adds tier bits of one residency; the node must not lose prefix closure (parent held).
  void add_holder(NodeId id, SlotId slot, std::uint32_t tier_bits);
  // Removes `slot` from `id` and from all of its descendants that `slot` holds.
  void drop_subtree(NodeId id, SlotId slot);
  // Removes one residency entirely; erases the node when it has no holders left.
  void drop_residency(NodeId id, SlotId slot);
  void dump_slot(SlotId slot, KvDump& out) const;
  void prune_approximate(std::size_t max_entries, std::chrono::steady_clock::time_point now,
                         bool by_time);

  void finalize(MatchResult& out, SlotId slot, std::uint32_t depth) const;
  void finalize_entries(MatchResult& out, std::span<const std::uint32_t> entries,
                        std::uint32_t depth) const;
  void finalize_dropouts(MatchResult& out, const HolderSet& parent, const HolderSet& child,
                         std::uint32_t depth) const;
  void count_offload(MatchResult& out, const HolderSet& holders) const;
  // Counts one off-device block of `slot` (nothing for a block held on the device).
  static void count_offload_block(MatchResult& out, SlotId slot, std::uint32_t tier_bits);
  void find_matches_explicit(std::span<const BlockHash> blocks, std::size_t depth, NodeId prev,
                             MatchResult& out) const;

  IndexerConfig config_;
  // Behind a pointer so the hash set's functors keep a stable address when the index moves.
  std::unique_ptr<NodeSlab> nodes_;
  NodeId free_nodes_ = kNoNode;
  NodeSet node_set_;
  std::vector<SlotState> slots_;
  // The (worker, rank) of each slot, apart from SlotState so that lookups touch 16 bytes a slot.
  std::vector<WorkerWithDpRank> slot_workers_;
  std::vector<SlotId> free_slots_;
  absl::flat_hash_map<WorkerWithDpRank, SlotId> slot_by_worker_;
  absl::flat_hash_map<ApproximateKey, std::chrono::steady_clock::time_point> approximate_expiry_;
  std::deque<ApproximateEntry> approximate_order_;
  IndexerStats stats_;
  // Scratch reused by mutations so that steady-state event application does not allocate.
  std::vector<NodeId> chain_scratch_;
  std::vector<NodeId> walk_scratch_;
};

}  // namespace kvr::discovery
