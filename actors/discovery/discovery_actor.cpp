#include "actors/discovery/discovery_actor.hpp"

#include <caf/spawn_options.hpp>
#include <caf/typed_event_based_actor.hpp>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "actors/actor_types.hpp"
#include "messages/metrics/node_metrics.hpp"
#include "selection/cluster/placement.hpp"
#include "selection/cluster/sharding.hpp"

namespace kvr::actors {
namespace {

using Self = discovery_actor::stateful_pointer<DiscoveryActorState>;
using PartitionKey = std::pair<std::string, std::string>;

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
  const auto partition = state.worker_partition.find(worker);
  if (partition != state.worker_partition.end()) {
    const auto selector = state.selectors.find(partition->second);
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
  auto& state = self->state;
  if (!state.config.cluster) return nullptr;
  const auto it = state.config.sharding.find(model);
  return it == state.config.sharding.end() || it->second.shards <= 1 ? nullptr : &it->second;
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
  for (const auto& [worker, worker_key] : state.worker_partition) {
    if (worker_key != key) continue;
    if (follow) {
      state.config.feed->follow(partition, worker, label);
    } else {
      state.config.feed->unfollow(partition, worker);
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

// The workers of sharded model `key` (model, routing group) as registered.
ShardFleet shard_fleet_of(Self self, const PartitionKey& key) {
  ShardFleet fleet{key.first, key.second, 0, {}};
  for (const auto& [id, registration] : self->state.registrations) {
    if (registration.model != key.first || registration.routing_group != key.second) continue;
    fleet.workers.push_back({id, static_cast<std::uint8_t>(registration.role)});
    fleet.block_size = registration.block_size;
  }
  return fleet;
}

// The fleet of sharded model `key` changed: its workers are assigned to shards again, a worker
// whose shard changed moves (from the old shard's selector to the new one's, each if served
// here), and the shard watchers learn the fleet.
void reshard(Self self, const PartitionKey& key) {
  auto& state = self->state;
  const cluster::ShardingConfig* sharding = sharding_of(self, key.first);
  if (sharding == nullptr) return;
  ShardFleet fleet = shard_fleet_of(self, key);
  cluster::ShardMap& map = state.shard_maps.try_emplace(key, sharding->shards).first->second;
  for (const WorkerId worker : map.assign(fleet.workers)) {
    const discovery::WorkerRegistration& registration = state.registrations.at(worker);
    PartitionKey to{key.first, cluster::shard_group(key.second, *map.shard_of(worker))};
    if (const auto from = state.worker_partition.find(worker);
        from != state.worker_partition.end() && from->second != to) {
      if (auto old = selector_of_partition(self, from->second)) {
        self->send(old, worker_down_atom::value, WorkerLiveness{worker, registration.incarnation});
      }
    }
    if (auto selector = selector_of_partition(self, to)) {
      self->send(selector, worker_up_atom::value, registration);
    }
    follow_shard_worker(self, worker, to);
    state.worker_partition[worker] = std::move(to);
  }
  for (const shard_watcher_actor& watcher : state.shard_watchers) {
    self->send(watcher, shard_atom::value, fleet);
  }
}

// A registration of a sharded model's worker: it joins its shard's partition (its selector when
// served here), and a change of the model's fleet reassigns the shards.
void register_sharded(Self self, discovery::WorkerRegistration registration) {
  auto& state = self->state;
  const PartitionKey key{registration.model, registration.routing_group};
  const WorkerId id = registration.worker_id;
  state.last_heard[id] = state.config.selector.clock->now();
  announce_partition(self, key);
  std::optional<PartitionKey> left;
  bool changed = true;
  if (const auto previous = state.registrations.find(id); previous != state.registrations.end()) {
    const discovery::WorkerRegistration& before = previous->second;
    const PartitionKey before_key{before.model, before.routing_group};
    changed = before_key != key || before.role != registration.role ||
              before.block_size != registration.block_size;
    if (before_key != key) left = before_key;
  }
  state.registrations.insert_or_assign(id, registration);
  if (changed) reshard(self, key);
  if (left) reshard(self, *left);
  PartitionKey shard{key.first,
                     cluster::shard_group(key.second, *state.shard_maps.at(key).shard_of(id))};
  if (auto selector = selector_of_partition(self, shard)) {
    self->send(selector, worker_up_atom::value, std::move(registration));
  }
  follow_shard_worker(self, id, shard);
  state.worker_partition[id] = std::move(shard);
}

// A worker of a sharded model left (deregistered, expired): the model's shards are reassigned.
void forget_sharded(Self self, WorkerId worker, const PartitionKey& key) {
  self->state.last_heard.erase(worker);
  if (self->state.config.feed) {
    self->state.config.feed->unfollow(cluster::partition_key(key.first, key.second), worker);
  }
  reshard(self, key);
}

// Sharded models' workers whose liveness ran out (no heartbeat within their TTL) leave this
// node's view of the fleet: their shard's owner, another node, expires them too. A worker of a
// shard served here is left to its selector, which expires it and reports it removed, so that no
// selector keeps a worker the fleet view has dropped (and reassigned when it registers again).
// Nothing expires while the node is cut off from NATS.
void expire_sharded(Self self) {
  auto& state = self->state;
  if (!state.nats_connected) return;
  const auto now = state.config.selector.clock->now();
  const auto default_ttl = state.config.selector.options.registration.default_liveness_ttl;
  std::set<PartitionKey> changed;
  for (auto it = state.last_heard.begin(); it != state.last_heard.end();) {
    if (const auto partition = state.worker_partition.find(it->first);
        partition != state.worker_partition.end() && state.selectors.contains(partition->second)) {
      ++it;
      continue;
    }
    const auto registration = state.registrations.find(it->first);
    if (registration != state.registrations.end()) {
      const auto ttl = registration->second.liveness_ttl.count() > 0
                           ? registration->second.liveness_ttl
                           : default_ttl;
      if (now - it->second <= ttl) {
        ++it;
        continue;
      }
      changed.insert({registration->second.model, registration->second.routing_group});
      if (state.config.feed) {
        state.config.feed->unfollow(
            cluster::partition_key(registration->second.model, registration->second.routing_group),
            it->first);
      }
      state.registrations.erase(registration);
      state.worker_partition.erase(it->first);
    }
    state.last_heard.erase(it++);
  }
  for (const PartitionKey& key : changed) reshard(self, key);
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
  return {
      [self](worker_up_atom, discovery::WorkerRegistration& registration) {
        auto& state = self->state;
        if (sharding_of(self, registration.model) != nullptr) {
          return register_sharded(self, std::move(registration));
        }
        PartitionKey key{registration.model, registration.routing_group};
        // A worker that moved to another partition (restarted with a new model or group) stops
        // renewing its old registration there, which then expires with its liveness.
        selector_actor selector = selector_of_partition(self, key);
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
        if (const auto heard = state.last_heard.find(heartbeat.worker_id);
            heard != state.last_heard.end()) {
          heard->second = state.config.selector.clock->now();
        }
        if (auto selector = selector_of_worker(self, heartbeat.worker_id)) {
          self->send(selector, heartbeat_atom::value, heartbeat);
        }
      },
      [self](worker_down_atom, const WorkerLiveness& deregistration) {
        auto& state = self->state;
        std::optional<PartitionKey> sharded;
        if (const auto known = state.registrations.find(deregistration.worker_id);
            known != state.registrations.end() &&
            known->second.incarnation == deregistration.incarnation) {
          if (sharding_of(self, known->second.model) != nullptr) {
            sharded.emplace(known->second.model, known->second.routing_group);
          }
          state.registrations.erase(known);
        }
        if (auto selector = selector_of_worker(self, deregistration.worker_id)) {
          self->send(selector, worker_down_atom::value, deregistration);
          state.worker_partition.erase(deregistration.worker_id);
        }
        if (sharded) {
          state.worker_partition.erase(deregistration.worker_id);
          forget_sharded(self, deregistration.worker_id, *sharded);
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
        // Back after an outage: sharded models' workers get one TTL from now, as selectors do.
        if (connected) {
          const auto now = state.config.selector.clock->now();
          for (auto& [worker, heard] : state.last_heard) heard = now;
        }
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
        // A worker that moved to another shard left the sender's partition but not the fleet:
        // its requests in flight go on.
        std::vector<WorkerId> gone;
        std::set<PartitionKey> resharded;
        for (WorkerId id : removed) {
          const auto it = state.worker_partition.find(id);
          if (it == state.worker_partition.end()) {
            gone.push_back(id);
            continue;
          }
          if (selector_of_partition(self, it->second) != sender) {
            if (!state.last_heard.contains(id)) gone.push_back(id);
            continue;
          }
          gone.push_back(id);
          state.worker_partition.erase(it);
          if (const auto known = state.registrations.find(id); known != state.registrations.end()) {
            if (sharding_of(self, known->second.model) != nullptr) {
              resharded.insert({known->second.model, known->second.routing_group});
              state.last_heard.erase(id);
              if (state.config.feed) {
                state.config.feed->unfollow(
                    cluster::partition_key(known->second.model, known->second.routing_group), id);
              }
            }
            state.registrations.erase(known);
          }
        }
        for (const PartitionKey& key : resharded) reshard(self, key);
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
        for (const auto& [key, map] : self->state.shard_maps) {
          self->send(watcher, shard_atom::value, shard_fleet_of(self, key));
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
