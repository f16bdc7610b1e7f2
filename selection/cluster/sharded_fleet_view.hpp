// One node's view of its sharded models' fleets (cluster mode): every registration of their
// workers, whichever node serves their shards, the shard each worker is assigned to, and their
// liveness, which a node tracks itself since it may serve none of their shards. Plain C++; the
// discovery actor feeds it the worker messages and carries out the changes each input returns.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <absl/container/flat_hash_map.h>

#include "discovery/catalog/worker_registration.hpp"
#include "selection/cluster/sharding.hpp"

namespace kvr::cluster {

/// A partition inside a node: (model, routing group). A shard's routing group names its shard
/// (shard_group()); a sharded model is named by its plain routing group.
using PartitionKey = std::pair<std::string, std::string>;

/// The workers of one sharded model as shard assignment sees them.
struct ShardedFleet {
  /// (model, plain routing group).
  PartitionKey model;
  /// The block size its workers register with (a prompt's shard key is hashed at it).
  std::uint32_t block_size = 0;
  std::vector<ShardedWorker> workers;
};

/// A worker that joined a shard, registered again in it, or moved to it from another.
struct ShardMove {
  discovery::WorkerRegistration registration;
  /// The shard it moved from; empty when it joined or registered again.
  std::optional<PartitionKey> from;
  PartitionKey to;
};

/// A worker that left the view (expired, deregistered, removed by its shard's selector).
struct ShardLeave {
  WorkerId worker = 0;
  /// Its (model, plain routing group): the partition whose worker messages it published under.
  PartitionKey model;
};

/// What one input changed, to be carried out in this order.
struct ShardedFleetChanges {
  /// Workers no longer in the fleet (in input order, or by id when they expired): their worker
  /// messages are no longer followed.
  std::vector<ShardLeave> left;
  /// In input order: `from`'s selector (where it runs) forgets the worker, `to`'s learns it.
  std::vector<ShardMove> moved;
  /// The new fleet of every sharded model whose workers changed, for the shard watchers.
  std::vector<ShardedFleet> fleets;
};

/// The sharded models' fleets as this node sees them (file comment). Every worker it holds belongs
/// to a model sharded into more than one shard. Single-threaded: one owner.
class ShardedFleetView {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;

  /// A view of no sharded model.
  ShardedFleetView() = default;
  /// `sharding`: the models split into shards (a model with one shard is not sharded);
  /// `default_liveness_ttl`: a worker's liveness when its registration states none.
  ShardedFleetView(std::map<std::string, ShardingConfig, std::less<>> sharding,
                   std::chrono::milliseconds default_liveness_ttl);

  /// How `model` is split; null when it is not sharded.
  const ShardingConfig* sharding(std::string_view model) const;

  /// A registration of a sharded model's worker, heard at `now` (another model's changes
  /// nothing): it joins or renews its shard (the last move), and a change of its model, role or
  /// block size reassigns the shards of the models it left and joined.
  ShardedFleetChanges register_worker(discovery::WorkerRegistration registration, TimePoint now);

  /// A heartbeat at `now` renews a known worker's liveness.
  void heartbeat(WorkerId worker, TimePoint now);

  /// These workers leave the fleet (deregistered, removed by their shard's selector, registered
  /// for an unsharded model); the shards of each model they left are reassigned once.
  ShardedFleetChanges remove(std::span<const WorkerId> workers);

  /// Workers whose liveness ran out by `now` (no registration or heartbeat within their TTL)
  /// leave the fleet, except those of a shard `served` here: that shard's selector expires them
  /// and then removes them, so that no selector keeps a worker the view has dropped. Nothing
  /// expires while the link is down.
  ShardedFleetChanges expire(TimePoint now,
                             const std::function<bool(const PartitionKey& shard)>& served);

  /// The NATS link went down (liveness held) or came back at `now` (every worker gets one TTL
  /// from then, as selectors give theirs).
  void set_link(bool connected, TimePoint now);

  /// The worker's registration; null when it is not in the fleet.
  const discovery::WorkerRegistration* registration(WorkerId worker) const;
  /// The shard the worker is assigned to; null when it is not in the fleet.
  const PartitionKey* shard_of(WorkerId worker) const;
  /// The registrations of the workers assigned to `shard`, by worker id.
  std::vector<discovery::WorkerRegistration> registrations_in(const PartitionKey& shard) const;
  /// The fleet of every sharded model seen so far, an empty one included.
  std::vector<ShardedFleet> fleets() const;

 private:
  struct Worker {
    discovery::WorkerRegistration registration;
    TimePoint last_heard;
    PartitionKey shard;
  };
  struct Model {
    explicit Model(std::uint32_t shards) : map(shards) {}
    ShardMap map;
    std::set<WorkerId> members;
  };

  ShardedFleet fleet_of(const PartitionKey& model) const;
  // Assigns `model`'s workers to its shards again: moves and the new fleet go to `out`.
  void reshard(const PartitionKey& model, ShardedFleetChanges& out);
  // Drops a worker of the fleet; its model is to be resharded.
  void forget(absl::flat_hash_map<WorkerId, Worker>::iterator worker, ShardedFleetChanges& out);

  std::map<std::string, ShardingConfig, std::less<>> sharding_;
  std::chrono::milliseconds default_liveness_ttl_ =
      discovery::RegistrationLimits{}.default_liveness_ttl;
  bool connected_ = true;
  absl::flat_hash_map<WorkerId, Worker> workers_;
  std::map<PartitionKey, Model> models_;
};

}  // namespace kvr::cluster
