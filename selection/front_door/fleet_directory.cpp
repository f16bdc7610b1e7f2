#include "selection/front_door/fleet_directory.hpp"

#include <algorithm>
#include <set>
#include <utility>

namespace kvr::front_door {

FleetDirectory::FleetDirectory(std::shared_ptr<const Clock> clock) : clock_(std::move(clock)) {}

bool FleetDirectory::live(const Entry& entry, std::chrono::steady_clock::time_point now) const {
  return held_ || now < entry.expires_at;
}

void FleetDirectory::prune(std::chrono::steady_clock::time_point now) {
  if (held_ || now < next_prune_) return;
  next_prune_ = now + std::chrono::seconds(1);
  std::erase_if(workers_, [&](const auto& item) { return !live(item.second, now); });
}

void FleetDirectory::registered(const discovery::WorkerRegistration& registration) {
  const auto now = clock_->now();
  std::lock_guard lock{mutex_};
  prune(now);
  Entry& entry = workers_[registration.worker_id];
  entry.worker = DirectoryWorker{.worker_id = registration.worker_id,
                                 .routing_group = registration.routing_group,
                                 .role = registration.role,
                                 .block_size = registration.block_size,
                                 .http_url = registration.http_url,
                                 .lora_adapters = registration.lora_adapters};
  entry.model = registration.model;
  entry.incarnation = registration.incarnation;
  entry.liveness_ttl = registration.liveness_ttl;
  entry.expires_at = now + registration.liveness_ttl;
}

void FleetDirectory::heartbeat(const discovery::WorkerLiveness& liveness) {
  const auto now = clock_->now();
  std::lock_guard lock{mutex_};
  const auto found = workers_.find(liveness.worker_id);
  // A heartbeat of another incarnation waits for that incarnation's registration.
  if (found == workers_.end() || found->second.incarnation != liveness.incarnation) return;
  found->second.expires_at = now + found->second.liveness_ttl;
}

void FleetDirectory::deregistered(const discovery::WorkerLiveness& liveness) {
  std::lock_guard lock{mutex_};
  const auto found = workers_.find(liveness.worker_id);
  if (found != workers_.end() && found->second.incarnation == liveness.incarnation) {
    workers_.erase(found);
  }
}

void FleetDirectory::nats_link(bool connected) {
  const auto now = clock_->now();
  std::lock_guard lock{mutex_};
  if (connected && held_) {
    for (auto& [id, entry] : workers_) entry.expires_at = now + entry.liveness_ttl;
  }
  held_ = !connected;
}

std::vector<std::string> FleetDirectory::models() const {
  const auto now = clock_->now();
  std::set<std::string> models;
  std::lock_guard lock{mutex_};
  for (const auto& [id, entry] : workers_) {
    if (live(entry, now)) models.insert(entry.model);
  }
  return {models.begin(), models.end()};
}

std::vector<DirectoryWorker> FleetDirectory::workers(const std::string& model) const {
  const auto now = clock_->now();
  std::vector<DirectoryWorker> found;
  std::lock_guard lock{mutex_};
  for (const auto& [id, entry] : workers_) {
    if (entry.model == model && live(entry, now)) found.push_back(entry.worker);
  }
  return found;
}

std::vector<ServedAdapter> FleetDirectory::adapters() const {
  const auto now = clock_->now();
  std::set<std::pair<std::string, std::string>> adapters;
  std::lock_guard lock{mutex_};
  for (const auto& [id, entry] : workers_) {
    if (!live(entry, now)) continue;
    for (const std::string& adapter : entry.worker.lora_adapters) {
      adapters.emplace(adapter, entry.model);
    }
  }
  std::vector<ServedAdapter> served;
  for (const auto& [name, model] : adapters) served.push_back({name, model});
  return served;
}

ModelTarget FleetDirectory::target(const std::string& name) const {
  ModelTarget target{.model = name, .workers = workers(name)};
  if (!target.workers.empty()) return target;
  const auto now = clock_->now();
  std::lock_guard lock{mutex_};
  for (const auto& [id, entry] : workers_) {
    if (!live(entry, now) ||
        std::ranges::find(entry.worker.lora_adapters, name) == entry.worker.lora_adapters.end()) {
      continue;
    }
    // Two base models listing one adapter name: the first (by worker id) is the target.
    if (target.adapter.empty()) {
      target.model = entry.model;
      target.adapter = name;
    }
    if (entry.model == target.model) target.workers.push_back(entry.worker);
  }
  return target;
}

bool FleetDirectory::any_live() const {
  const auto now = clock_->now();
  std::lock_guard lock{mutex_};
  for (const auto& [id, entry] : workers_) {
    if (live(entry, now)) return true;
  }
  return false;
}

}  // namespace kvr::front_door
