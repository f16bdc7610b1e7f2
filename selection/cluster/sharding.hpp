// Sharded partitions: one model (or routing group) split into S shards, each owning a disjoint,
// balanced share of the model's workers and routed by its own partition core, so that several
// nodes can decide one model's requests. Which shard owns a worker, and which shard a request goes
// to, are pure functions of what every node sees (the registrations, the prompt), so no node has
// to ask another. Plain C++; the node, the ingress and `kvr replay` share it.
//
// A request goes to the shard its prompt prefix hashes to (rendezvous hashing over the shards, so
// every request sharing that prefix, a conversation's turns among them, meets the same shard and
// its cache), unless that shard is the slower way: its least loaded worker has more work ahead than
// another shard's least loaded worker plus the cost of computing the prompt there without its cache
// (miss_cost × the prompt's tokens). Then the request spills to the first such shard in the
// prefix's rendezvous order (the "next shard on the ring"), so a hot prefix spreads to a few shards
// rather than melting one. A pin goes to the pinned worker's shard; an allow-list keeps to shards
// owning an allowed worker; a session goes by its id; a prompt shorter than one block goes to the
// shard with the least loaded worker.
//
// Each shard's load is what its owner last published (per worker: queued prefill tokens and the
// tokens of KV its running requests hold), plus what the choosing node sent it since: a node that
// only read published loads would send every request of the interval to the same idle shard.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "messages/ids.hpp"

namespace kvr::cluster {

/// How one model is split.
struct ShardingConfig {
  /// 1: the model is one partition, as without sharding.
  std::uint32_t shards = 1;
  /// A request's shard key is its prompt's chained block hash at this many tokens (at its last full
  /// block when the prompt is shorter): past a shared system prompt, so that conversations spread,
  /// and short enough that a conversation's first turn already carries it.
  std::uint32_t prefix_tokens = 1024;
  /// A request leaves its prefix's shard when that shard's least loaded worker has more work
  /// ahead, in tokens, than another shard's plus this many times the request's prompt tokens (the
  /// prefill it would repeat without the prefix's cache there). 0: go wherever the least loaded
  /// worker is.
  double miss_cost = 2.0;
  /// A shard's owner publishes its load this often.
  std::uint32_t load_interval_ms = 100;

  friend bool operator==(const ShardingConfig&, const ShardingConfig&) = default;
};

/// Why `config` cannot be used, naming the field ("shards", "prefix_tokens", "miss_cost",
/// "load_interval_ms");
/// empty when it can.
std::optional<std::string> validate(const ShardingConfig& config);

/// A shard's name in a partition key and a lease: "<model>/<routing group>#<shard>"; shard 0 of an
/// unsharded model keeps the plain partition key.
std::string shard_key(std::string_view partition_key, std::uint32_t shard, std::uint32_t shards);

/// Inside a node a shard is a partition of its own, whose routing group names the shard:
/// "<routing group>#<shard>" (workers register, and clients route, with the plain group).
inline constexpr char kShardSeparator = '#';
std::string shard_group(std::string_view routing_group, std::uint32_t shard);
/// A partition's routing group without its shard, and the shard (none for an unsharded group).
struct ShardedGroup {
  std::string_view routing_group;
  std::optional<std::uint32_t> shard;
};
ShardedGroup split_shard_group(std::string_view group);

/// A worker as shard assignment sees it: its id and the group it is balanced within (its role:
/// prefill and decode workers are spread over the shards separately, so that every shard of a
/// disaggregated model has both).
struct ShardedWorker {
  WorkerId id = 0;
  std::uint8_t group = 0;
};

/// Which shard owns each worker of one model. The assignment is a bounded-load rendezvous
/// assignment (placement.hpp's assign(), with no slack): each group's workers are spread over the
/// shards as evenly as whole numbers allow, it depends only on the set of workers, and a worker
/// that joins or leaves moves few others.
class ShardMap {
 public:
  explicit ShardMap(std::uint32_t shards = 1);

  /// Assigns `workers` (the model's whole fleet, replacing the previous one). Returns the workers
  /// present before and after whose shard changed.
  std::vector<WorkerId> assign(std::span<const ShardedWorker> workers);

  std::uint32_t shards() const { return static_cast<std::uint32_t>(workers_per_shard_.size()); }
  /// The shard owning `worker`; empty when the worker is not in the fleet.
  std::optional<std::uint32_t> shard_of(WorkerId worker) const;
  /// Workers the shard owns.
  std::size_t workers_in(std::uint32_t shard) const { return workers_per_shard_.at(shard); }
  /// Workers of the whole model.
  std::size_t workers() const { return owner_.size(); }

 private:
  // (worker, shard), sorted by worker.
  std::vector<std::pair<WorkerId, std::uint32_t>> owner_;
  std::vector<std::size_t> workers_per_shard_;
};

/// Why a request went where it did.
enum class ShardReason : std::uint8_t {
  prefix,   ///< its prompt prefix's shard (or the next with room)
  session,  ///< its session's shard (or the next with room)
  pinned,   ///< the pinned worker's shard
  spread,   ///< no usable prefix: the least loaded shard
};
std::string_view as_str(ShardReason reason);

/// What shard choice reads of a request.
struct ShardRequest {
  /// Chained block hashes of the prompt's full blocks, at `block_size` tokens each.
  std::span<const BlockHash> block_hashes;
  std::uint32_t block_size = 0;
  std::uint64_t prompt_tokens = 0;
  /// Empty: no session.
  std::string_view session_id;
  std::optional<WorkerId> pinned_worker;
  /// Non-empty: only these workers may serve it.
  std::span<const WorkerId> allowed_workers;
  /// Breaks ties between equally loaded shards for a request without a key.
  std::string_view request_id;
};

/// Where a request goes.
struct ShardChoice {
  std::uint32_t shard = 0;
  /// Where its key hashes to; shard != home when it spilled.
  std::uint32_t home = 0;
  ShardReason reason = ShardReason::spread;

  bool spilled() const { return shard != home; }
};

/// One node's view of a sharded model's load, and its choice of shard for each request (file
/// comment). Single-threaded.
class ShardBalancer {
 public:
  explicit ShardBalancer(std::uint32_t shards = 1);

  /// A shard's published load: the work ahead of each of its workers, in tokens (queued prefill
  /// plus the KV its running requests hold). Replaces the shard's previous load and what this node
  /// added to it since.
  void set_load(std::uint32_t shard, std::vector<std::uint64_t> worker_tokens);

  /// The shard for `request` (file comment), whose load then counts the request's prompt on its
  /// least loaded worker until the shard next publishes. Shards owning no worker take nothing.
  /// When no shard may serve the request (no workers, a pin on an unknown worker, no allowed
  /// worker assigned), its home shard is chosen, whose core then refuses it with the usual reason.
  ShardChoice choose(const ShardMap& map, const ShardingConfig& config,
                     const ShardRequest& request);

  /// The least work ahead of a worker of `shard`, in tokens, as this node sees it; 0 before the
  /// shard published.
  std::uint64_t least_worker_tokens(std::uint32_t shard) const;

 private:
  // Per shard, per worker: the work ahead, in tokens, kept as a min-heap.
  std::vector<std::vector<std::uint64_t>> worker_tokens_;
};

}  // namespace kvr::cluster
