#include "selection/cluster/sharded_fleet_view.hpp"

#include <algorithm>

namespace kvr::cluster {

ShardedFleetView::ShardedFleetView(std::map<std::string, ShardingConfig, std::less<>> sharding,
                                   std::chrono::milliseconds default_liveness_ttl)
    : sharding_(std::move(sharding)), default_liveness_ttl_(default_liveness_ttl) {}

const ShardingConfig* ShardedFleetView::sharding(std::string_view model) const {
  const auto it = sharding_.find(model);
  return it == sharding_.end() || it->second.shards <= 1 ? nullptr : &it->second;
}

ShardedFleetChanges ShardedFleetView::register_worker(discovery::WorkerRegistration registration,
                                                      TimePoint now) {
  ShardedFleetChanges out;
  const ShardingConfig* config = sharding(registration.model);
  // An unsharded model's worker is not this view's to track.
  if (config == nullptr) return out;
  const PartitionKey model{registration.model, registration.routing_group};
  const WorkerId id = registration.worker_id;
  std::optional<PartitionKey> left;
  bool changed = true;
  auto [it, new_worker] = workers_.try_emplace(id);
  Worker& worker = it->second;
  if (!new_worker) {
    const discovery::WorkerRegistration& before = worker.registration;
    PartitionKey before_model{before.model, before.routing_group};
    changed = before_model != model || before.role != registration.role ||
              before.block_size != registration.block_size;
    if (before_model != model) left = std::move(before_model);
  }
  worker.registration = registration;
  worker.last_heard = now;
  if (left) models_.at(*left).members.erase(id);
  Model& joined_model = models_.try_emplace(model, config->shards).first->second;
  joined_model.members.insert(id);
  if (changed) reshard(model, out);
  if (left) reshard(*left, out);
  worker.shard = {model.first, shard_group(model.second, *joined_model.map.shard_of(id))};
  // A worker that moved leaves its old model's shard without a word: it stops renewing its
  // registration there, which then expires there.
  out.moved.push_back({std::move(registration), std::nullopt, worker.shard});
  return out;
}

void ShardedFleetView::heartbeat(WorkerId worker, TimePoint now) {
  if (const auto it = workers_.find(worker); it != workers_.end()) it->second.last_heard = now;
}

ShardedFleetChanges ShardedFleetView::remove(std::span<const WorkerId> workers) {
  ShardedFleetChanges out;
  for (const WorkerId id : workers) {
    if (const auto it = workers_.find(id); it != workers_.end()) forget(it, out);
  }
  std::set<PartitionKey> changed;
  for (const ShardLeave& leave : out.left) changed.insert(leave.model);
  for (const PartitionKey& model : changed) reshard(model, out);
  return out;
}

ShardedFleetChanges ShardedFleetView::expire(
    TimePoint now, const std::function<bool(const PartitionKey& shard)>& served) {
  ShardedFleetChanges out;
  if (!connected_) return out;
  for (auto it = workers_.begin(); it != workers_.end();) {
    const Worker& worker = it->second;
    const auto ttl = worker.registration.liveness_ttl.count() > 0 ? worker.registration.liveness_ttl
                                                                  : default_liveness_ttl_;
    if (served(worker.shard) || now - worker.last_heard <= ttl) {
      ++it;
      continue;
    }
    forget(it++, out);
  }
  // By worker id, whatever the hash map's order: the same inputs make the same changes.
  std::ranges::sort(out.left, {}, &ShardLeave::worker);
  std::set<PartitionKey> changed;
  for (const ShardLeave& leave : out.left) changed.insert(leave.model);
  for (const PartitionKey& model : changed) reshard(model, out);
  return out;
}

void ShardedFleetView::set_link(bool connected, TimePoint now) {
  connected_ = connected;
  if (!connected) return;
  for (auto& [id, worker] : workers_) worker.last_heard = now;
}

const discovery::WorkerRegistration* ShardedFleetView::registration(WorkerId worker) const {
  const auto it = workers_.find(worker);
  return it == workers_.end() ? nullptr : &it->second.registration;
}

const PartitionKey* ShardedFleetView::shard_of(WorkerId worker) const {
  const auto it = workers_.find(worker);
  return it == workers_.end() ? nullptr : &it->second.shard;
}

std::vector<discovery::WorkerRegistration> ShardedFleetView::registrations_in(
    const PartitionKey& shard) const {
  std::vector<discovery::WorkerRegistration> registrations;
  const auto model =
      models_.find({shard.first, std::string{split_shard_group(shard.second).routing_group}});
  if (model == models_.end()) return registrations;
  for (const WorkerId id : model->second.members) {
    const Worker& worker = workers_.at(id);
    if (worker.shard == shard) registrations.push_back(worker.registration);
  }
  return registrations;
}

std::vector<ShardedFleet> ShardedFleetView::fleets() const {
  std::vector<ShardedFleet> fleets;
  fleets.reserve(models_.size());
  for (const auto& entry : models_) fleets.push_back(fleet_of(entry.first));
  return fleets;
}

ShardedFleet ShardedFleetView::fleet_of(const PartitionKey& model) const {
  ShardedFleet fleet{model, 0, {}};
  for (const WorkerId id : models_.at(model).members) {
    const discovery::WorkerRegistration& registration = workers_.at(id).registration;
    fleet.workers.push_back({id, static_cast<std::uint8_t>(registration.role)});
    fleet.block_size = registration.block_size;
  }
  return fleet;
}

void ShardedFleetView::reshard(const PartitionKey& model, ShardedFleetChanges& out) {
  ShardedFleet fleet = fleet_of(model);
  ShardMap& map = models_.at(model).map;
  for (const WorkerId id : map.assign(fleet.workers)) {
    Worker& worker = workers_.at(id);
    PartitionKey to{model.first, shard_group(model.second, *map.shard_of(id))};
    std::optional<PartitionKey> from;
    if (worker.shard != to) from = std::exchange(worker.shard, to);
    out.moved.push_back({worker.registration, std::move(from), std::move(to)});
  }
  out.fleets.push_back(std::move(fleet));
}

void ShardedFleetView::forget(absl::flat_hash_map<WorkerId, Worker>::iterator worker,
                              ShardedFleetChanges& out) {
  const discovery::WorkerRegistration& registration = worker->second.registration;
  PartitionKey model{registration.model, registration.routing_group};
  models_.at(model).members.erase(worker->first);
  out.left.push_back({worker->first, std::move(model)});
  workers_.erase(worker);
}

}  // namespace kvr::cluster
