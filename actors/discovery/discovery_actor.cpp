#include "actors/discovery/discovery_actor.hpp"

#include <span>

#include <caf/spawn_options.hpp>
#include <caf/typed_event_based_actor.hpp>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "actors/actor_types.hpp"
#include "messages/metrics/node_metrics.hpp"
#include "selection/cluster/placement.hpp"
#include "selection/cluster/sharded_fleet_view.hpp"
#include "selection/cluster/sharding.hpp"

namespace kvr::actors {
namespace {

using Self = discovery_actor::stateful_pointer<DiscoveryActorState>;
using PartitionKey = cluster::PartitionKey;

// Asks every worker to register again, at most once per throttle period.
void request_reregistration(Self self, bool force) {
  auto& state = self->state;
  const auto now = state.config.selector.clock->now();
  if (!force && now - state.last_reregistration_request < state.config.reregistration_throttle)
    return;
  state.last_reregistration_request = now;
  metrics::NodeMetrics{*state.config.selector.metrics}.discovery_requests().add();
  state.config.selector.publisher->request_reregistration();
}

// The selector of a known worker, or an invalid handle (and a discovery request).
selector_actor selector_of_worker(Self self, WorkerId worker) {
  auto& state = self->state;
  const PartitionKey* partition = state.fleet.shard_of(worker);
  if (const auto unsharded = state.worker_partition.find(worker);
      partition == nullptr && unsharded != state.worker_partition.end()) {
    partition = &unsharded->second;
  }
  if (partition != nullptr) {
    const auto selector = state.selectors.find(*partition);
    if (selector != state.selectors.end()) return selector->second;
    // Cluster mode: a worker of a partition another node owns.
    if (state.config.cluster) return {};
  }
  // A worker we never heard register (this node started after it, or the registration was lost).
  request_reregistration(self, false);
  return {};
}

selector_actor selector_of_partition(Self self, const PartitionKey& key) {
  const auto it = self->state.selectors.find(key);
  return it == self->state.selectors.end() ? selector_actor{} : it->second;
}

// The sharding of `model`, when it is split into shards (cluster mode only); else null.
const cluster::ShardingConfig* sharding_of(Self self, std::string_view model) {
  return self->state.fleet.sharding(model);
}

// The partition key the workers of `key` publish under: a shard's workers publish under their
// model's plain routing group.
std::string feed_partition(const PartitionKey& key) {
  return cluster::partition_key(key.first, cluster::split_shard_group(key.second).routing_group);
}

// Follows the worker messages of a partition served here: all its workers, or for a shard each of
// its workers.
void follow_partition(Self self, const PartitionKey& key, bool follow) {
  auto& state = self->state;
  if (!state.config.feed) return;
  const std::string label = cluster::partition_key(key.first, key.second);
  if (!cluster::split_shard_group(key.second).shard) {
    if (follow) {
      state.config.feed->follow(label, std::nullopt, label);
    } else {
      state.config.feed->unfollow(label, std::nullopt);
    }
    return;
  }
  const std::string partition = feed_partition(key);
  for (const discovery::WorkerRegistration& worker : state.fleet.registrations_in(key)) {
    if (follow) {
      state.config.feed->follow(partition, worker.worker_id, label);
    } else {
      state.config.feed->unfollow(partition, worker.worker_id);
    }
  }
}

// A sharded model's worker now belongs to shard `key`: followed when the shard is served here,
// else no longer.
void follow_shard_worker(Self self, WorkerId worker, const PartitionKey& key) {
  auto& state = self->state;
  if (!state.config.feed) return;
  if (state.selectors.contains(key)) {
    state.config.feed->follow(feed_partition(key), worker,
                              cluster::partition_key(key.first, key.second));
  } else {
    state.config.feed->unfollow(feed_partition(key), worker);
  }
}

selector_actor spawn_selector(Self self, const PartitionKey& key) {
  auto& state = self->state;
  SelectorActorConfig config = state.config.selector;
  config.options.partition = {key.first, key.second};
  config.discovery = self;
  if (cluster::split_shard_group(key.second).shard) {
    if (const cluster::ShardingConfig* sharding = sharding_of(self, key.first)) {
      config.shard_load_subject = state.config.shard_load_subject;
      config.shards = sharding->shards;
      config.shard_load_interval = std::chrono::milliseconds{sharding->load_interval_ms};
    }
  }
  // Linked: a failing selector takes the node's discovery down visibly, and discovery's exit
  // ends every selector.
  auto selector = self->spawn<caf::linked>(selector_behavior, std::move(config));
  state.selectors.emplace(key, selector);
  // Spawned while the node is cut off from NATS: its workers' liveness is held from the start.
  if (!state.nats_connected) self->send(selector, nats_link_atom::value, false);
  for (const selector_subscriber_actor& subscriber : state.selector_subscribers) {
    self->send(subscriber, selector_atom::value, key.first, key.second, selector);
  }
  follow_partition(self, key, true);
  spdlog::info("kvr node: serving partition {}/{}", key.first, key.second);
  return selector;
}

// Cluster mode: stops a selector whose partition this node no longer owns or warms up.
void retire_selector(Self self, const PartitionKey& key) {
  auto& state = self->state;
  const auto it = state.selectors.find(key);
  if (it == state.selectors.end()) return;
  follow_partition(self, key, false);
  // Unlinked first: a retired selector's exit must not take the discovery actor with it.
  self->unlink_from(it->second);
  self->send_exit(it->second, caf::exit_reason::user_shutdown);
  state.selectors.erase(it);
  for (const selector_subscriber_actor& subscriber : state.selector_subscribers) {
    self->send(subscriber, selector_atom::value, key.first, key.second, selector_actor{});
  }
  spdlog::info("kvr node: no longer serving partition {}/{}", key.first, key.second);
}

// Cluster mode: tells the cluster actor of a partition seen for the first time; a sharded
// model's routing group is its S shards' partitions.
void announce_partition(Self self, const PartitionKey& key) {
  auto& state = self->state;
  const auto announce = [&](PartitionKey partition_key) {
    std::string partition = cluster::partition_key(partition_key.first, partition_key.second);
    if (state.known_partitions.emplace(partition, std::move(partition_key)).second) {
      self->send(state.config.cluster, partition_atom::value, std::move(partition));
    }
  };
  const cluster::ShardingConfig* sharding = sharding_of(self, key.first);
  if (sharding == nullptr) return announce(key);
  for (std::uint32_t shard = 0; shard < sharding->shards; ++shard) {
    announce({key.first, cluster::shard_group(key.second, shard)});
  }
}

// What the shard watchers are told of a sharded model's fleet.
ShardFleet shard_fleet_message(cluster::ShardedFleet fleet) {
  return {std::move(fleet.model.first), std::move(fleet.model.second), fleet.block_size,
          std::move(fleet.workers)};
}

// Carries out what the sharded fleet view decided: a worker that left the fleet is no longer
// followed; a worker that moved leaves its old shard's selector and joins its new one's (each if
// served here; a move is no removal: its requests in flight go on); the shard watchers learn the
// new fleets.
void apply_fleet_changes(Self self, cluster::ShardedFleetChanges changes) {
  auto& state = self->state;
  for (const cluster::ShardLeave& leave : changes.left) {
    if (state.config.feed) {
      state.config.feed->unfollow(cluster::partition_key(leave.model.first, leave.model.second),
                                  leave.worker);
    }
  }
  for (cluster::ShardMove& move : changes.moved) {
    const WorkerLiveness worker{move.registration.worker_id, move.registration.incarnation};
    if (move.from) {
      if (auto old = selector_of_partition(self, *move.from)) {
        self->send(old, worker_down_atom::value, worker);
      }
    }
    if (auto selector = selector_of_partition(self, move.to)) {
      self->send(selector, worker_up_atom::value, std::move(move.registration));
    }
    follow_shard_worker(self, worker.worker_id, move.to);
  }
  for (cluster::ShardedFleet& fleet : changes.fleets) {
    const ShardFleet message = shard_fleet_message(std::move(fleet));
    for (const shard_watcher_actor& watcher : state.shard_watchers) {
      self->send(watcher, shard_atom::value, message);
    }
  }
}

// A sharded model's workers leave its fleet: their models' shards are reassigned.
void remove_sharded(Self self, std::span<const WorkerId> workers) {
  if (!workers.empty()) apply_fleet_changes(self, self->state.fleet.remove(workers));
}

// A registration of a sharded model's worker: it joins its shard's partition (its selector when
// served here), and a change of the model's fleet reassigns the shards.
void register_sharded(Self self, discovery::WorkerRegistration registration) {
  auto& state = self->state;
  announce_partition(self, {registration.model, registration.routing_group});
  // It served an unsharded partition before: it left that one.
  state.registrations.erase(registration.worker_id);
  state.worker_partition.erase(registration.worker_id);
  apply_fleet_changes(self, state.fleet.register_worker(std::move(registration),
                                                        state.config.selector.clock->now()));
}

// Sharded models' workers whose liveness ran out leave this node's view of the fleet: their
// shard's owner, another node, expires them too. A worker of a shard served here is left to its
// selector, which expires it and reports it removed.
void expire_sharded(Self self) {
  auto& state = self->state;
  const auto served = [&state](const PartitionKey& shard) {
    return state.selectors.contains(shard);
  };
  apply_fleet_changes(self, state.fleet.expire(state.config.selector.clock->now(), served));
}

// Cluster mode: runs a selector for every partition owned or warming up, passes each owned
// one its fence, retires the rest, and asks the workers to register again for new selectors.
void apply_ownership(Self self, const ClusterView& view) {
  auto& state = self->state;
  // The cluster steps periodically: the sharded models' liveness is checked as often.
  expire_sharded(self);
  std::map<PartitionKey, std::chrono::steady_clock::time_point> wanted;
  bool unknown = false;
  const auto key_of = [&](const std::string& partition) -> std::optional<PartitionKey> {
    const auto known = state.known_partitions.find(partition);
    if (known == state.known_partitions.end()) {
      unknown = true;
      return std::nullopt;
    }
    return known->second;
  };
  for (const cluster::OwnedPartition& owned : view.owned) {
    if (auto key = key_of(owned.partition)) wanted[*key] = owned.owned_until;
  }
  for (const std::string& partition : view.prepare) {
    if (auto key = key_of(partition)) wanted.try_emplace(*key);  // fenced: not owned yet
  }
  std::set<PartitionKey> owned_now;
  for (const cluster::OwnedPartition& owned : view.owned) {
    if (auto key = key_of(owned.partition)) owned_now.insert(*key);
  }
  // A partition no longer owned drops its state, even when this node is to take it back later:
  // what it booked as owner is not its to keep.
  std::vector<PartitionKey> retired;
  for (const auto& [key, selector] : state.selectors) {
    if (!wanted.contains(key) || (state.owned.contains(key) && !owned_now.contains(key))) {
      retired.push_back(key);
    }
  }
  state.owned = std::move(owned_now);
  for (const PartitionKey& key : retired) retire_selector(self, key);
  bool spawned = false;
  for (const auto& [key, owned_until] : wanted) {
    selector_actor selector = selector_of_partition(self, key);
    if (!selector) {
      selector = spawn_selector(self, key);
      spawned = true;
      // Warm at once: the workers this node has heard register (their KV dumps follow).
      for (const auto& [worker, registration] : state.registrations) {
        const auto partition = state.worker_partition.find(worker);
        if (partition != state.worker_partition.end() && partition->second == key) {
          self->send(selector, worker_up_atom::value, registration);
        }
      }
      for (discovery::WorkerRegistration& registration : state.fleet.registrations_in(key)) {
        self->send(selector, worker_up_atom::value, std::move(registration));
      }
    }
    self->send(selector, fence_atom::value, owned_until);
  }
  // A new selector learns its workers from their registrations (and asks for their KV dumps).
  if (spawned || unknown) request_reregistration(self, spawned);
  for (const std::string& partition : view.prepare) {
    if (state.known_partitions.contains(partition)) {
      self->send(state.config.cluster, ready_atom::value, partition);
    }
  }
}

}  // namespace

discovery_actor::behavior_type discovery_behavior(Self self, DiscoveryActorConfig config) {
  self->state.config = std::move(config);
  const DiscoveryActorConfig& configured = self->state.config;
  // Only a cluster splits models into shards.
  self->state.fleet = cluster::ShardedFleetView{
      configured.cluster ? configured.sharding : decltype(configured.sharding){},
      configured.selector.options.registration.default_liveness_ttl};
  return {
      [self](worker_up_atom, discovery::WorkerRegistration& registration) {
        auto& state = self->state;
        if (sharding_of(self, registration.model) != nullptr) {
          return register_sharded(self, std::move(registration));
        }
        PartitionKey key{registration.model, registration.routing_group};
        // A worker that moved to another partition (restarted with a new model or group) stops
        // renewing its old registration there, which then expires with its liveness; it leaves
        // a sharded model's fleet at once, so that the model's shards are reassigned.
        selector_actor selector = selector_of_partition(self, key);
        if (state.fleet.registration(registration.worker_id) != nullptr) {
          remove_sharded(self, std::span{&registration.worker_id, 1});
        }
        state.worker_partition[registration.worker_id] = key;
        if (state.config.cluster) {
          state.registrations.insert_or_assign(registration.worker_id, registration);
          announce_partition(self, key);
          // A partition another node owns: its workers' messages stop here.
          if (!selector) return;
        } else if (!selector) {
          selector = spawn_selector(self, key);
        }
        self->send(selector, worker_up_atom::value, std::move(registration));
      },
      [self](heartbeat_atom, const WorkerLiveness& heartbeat) {
        auto& state = self->state;
        state.fleet.heartbeat(heartbeat.worker_id, state.config.selector.clock->now());
        if (auto selector = selector_of_worker(self, heartbeat.worker_id)) {
          self->send(selector, heartbeat_atom::value, heartbeat);
        }
      },
      [self](worker_down_atom, const WorkerLiveness& deregistration) {
        auto& state = self->state;
        const WorkerId id = deregistration.worker_id;
        if (const discovery::WorkerRegistration* sharded = state.fleet.registration(id)) {
          const bool current = sharded->incarnation == deregistration.incarnation;
          if (auto selector = selector_of_partition(self, *state.fleet.shard_of(id))) {
            self->send(selector, worker_down_atom::value, deregistration);
          }
          if (current) remove_sharded(self, std::span{&id, 1});
          return;
        }
        if (const auto known = state.registrations.find(id);
            known != state.registrations.end() &&
            known->second.incarnation == deregistration.incarnation) {
          state.registrations.erase(known);
        }
        if (auto selector = selector_of_worker(self, id)) {
          self->send(selector, worker_down_atom::value, deregistration);
          state.worker_partition.erase(id);
        }
      },
      [self](load_atom, WorkerLoadReport& report) {
        if (auto selector = selector_of_worker(self, report.worker_id)) {
          self->send(selector, load_atom::value, std::move(report));
        }
      },
      [self](kv_events_atom, KvEventBatch& batch) {
        if (auto selector = selector_of_worker(self, batch.worker.worker_id)) {
          self->send(selector, kv_events_atom::value, std::move(batch));
        }
      },
      [self](kv_dump_atom, KvDump& dump) {
        if (auto selector = selector_of_worker(self, dump.worker.worker_id)) {
          self->send(selector, kv_dump_atom::value, std::move(dump));
        }
      },
      [self](route_atom, RouteRequest& request) -> caf::result<SelectorReply> {
        auto selector =
            selector_of_partition(self, {request.partition.model, request.partition.routing_group});
        if (!selector && self->state.config.cluster &&
            self->state.known_partitions.contains(
                cluster::partition_key(request.partition.model, request.partition.routing_group))) {
          return SelectorReply{
              std::unexpected(RouteFailure{
                  Error::unavailable,
                  fmt::format("partition {}/{} is not served by this node: another node owns "
                              "it, or it is changing hands; retry",
                              request.partition.model, request.partition.routing_group)}),
              {},
              {}};
        }
        if (!selector) {
          return SelectorReply{
              std::unexpected(RouteFailure{
                  Error::no_workers,
                  fmt::format("no worker serves model '{}' in routing group '{}'",
                              request.partition.model, request.partition.routing_group)}),
              {},
              {}};
        }
        return self->delegate(selector, route_atom::value, std::move(request));
      },
      [self](booking_atom, BookingUpdate& update) -> caf::result<BookingUpdateReply> {
        auto selector =
            selector_of_partition(self, {update.partition.model, update.partition.routing_group});
        if (!selector) return BookingUpdateReply{false, "the partition has no workers any more"};
        return self->delegate(selector, booking_atom::value, std::move(update));
      },
      [self](cancel_atom, std::string& model, std::string& group, std::string& request_id) {
        if (auto selector = selector_of_partition(self, {model, group})) {
          self->send(selector, cancel_atom::value, std::move(model), std::move(group),
                     std::move(request_id));
        }
      },
      [self](reregister_atom) { request_reregistration(self, true); },
      [self](nats_link_atom, bool connected) {
        auto& state = self->state;
        state.nats_connected = connected;
        state.fleet.set_link(connected, state.config.selector.clock->now());
        for (const auto& [key, selector] : state.selectors) {
          self->send(selector, nats_link_atom::value, connected);
        }
        if (connected) request_reregistration(self, true);
      },
      [self](ownership_atom, const ClusterView& view) { apply_ownership(self, view); },
      [self](handover_atom, const std::vector<std::string>& partitions) {
        auto& state = self->state;
        for (const std::string& partition : partitions) {
          const auto known = state.known_partitions.find(partition);
          if (known == state.known_partitions.end()) continue;
          retire_selector(self, known->second);
          state.owned.erase(known->second);
        }
        return true;
      },
      [self](removed_atom, const std::vector<WorkerId>& removed) {
        auto& state = self->state;
        const auto sender = caf::actor_cast<caf::actor>(self->current_sender());
        std::vector<WorkerId> gone;
        std::vector<WorkerId> sharded;
        for (WorkerId id : removed) {
          if (const PartitionKey* shard = state.fleet.shard_of(id)) {
            // A worker that moved to another shard left the sender's partition but not the
            // fleet: its requests in flight go on.
            if (selector_of_partition(self, *shard) != sender) continue;
            gone.push_back(id);
            sharded.push_back(id);
            continue;
          }
          gone.push_back(id);
          const auto it = state.worker_partition.find(id);
          if (it == state.worker_partition.end() ||
              selector_of_partition(self, it->second) != sender) {
            continue;
          }
          state.worker_partition.erase(it);
          state.registrations.erase(id);
        }
        remove_sharded(self, sharded);
        if (gone.empty()) return;
        for (const removal_watcher_actor& watcher : state.watchers) {
          self->send(watcher, removed_atom::value, gone);
        }
      },
      [self](watch_atom, const removal_watcher_actor& watcher) {
        if (watcher) self->state.watchers.push_back(watcher);
      },
      [self](watch_atom, const shard_watcher_actor& watcher) {
        if (!watcher) return;
        self->state.shard_watchers.push_back(watcher);
        for (cluster::ShardedFleet& fleet : self->state.fleet.fleets()) {
          self->send(watcher, shard_atom::value, shard_fleet_message(std::move(fleet)));
        }
      },
      [self](watch_atom, const selector_subscriber_actor& subscriber) {
        if (!subscriber) return;
        self->state.selector_subscribers.push_back(subscriber);
        for (const auto& [key, selector] : self->state.selectors) {
          self->send(subscriber, selector_atom::value, key.first, key.second, selector);
        }
      },
  };
}

}  // namespace kvr::actors
