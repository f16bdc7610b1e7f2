#include "discovery/catalog/worker_catalog.hpp"

namespace kvr::discovery {

std::string_view as_str(CatalogError error) {
  switch (error) {
    case CatalogError::unknown_worker:
      return "unknown_worker";
    case CatalogError::stale_incarnation:
      return "stale_incarnation";
  }
  return "unknown";
}

std::expected<RegistrationChange, RegistrationError> WorkerCatalog::register_worker(
    WorkerRegistration registration, std::chrono::steady_clock::time_point now) {
  auto validated = validate_registration(std::move(registration), limits_);
  if (!validated) return std::unexpected(validated.error());
  const auto expires_at = now + validated->liveness_ttl;
  const auto it = entries_.find(validated->worker_id);
  if (it == entries_.end()) {
    const WorkerId id = validated->worker_id;
    entries_.emplace(id, CatalogEntry{std::move(*validated), expires_at});
    return RegistrationChange::added;
  }
  CatalogEntry& entry = it->second;
  // Same process and same shape: a repeated announcement only renews the liveness. Anything that
  // changes what the index and load state were built for resets the worker.
  const WorkerRegistration& known = entry.registration;
  const bool same_shape = known.incarnation == validated->incarnation &&
                          known.total_kv_blocks == validated->total_kv_blocks &&
                          known.data_parallel_size == validated->data_parallel_size &&
                          known.block_size == validated->block_size &&
                          known.publishes_kv_events == validated->publishes_kv_events;
  entry.registration = std::move(*validated);
  entry.liveness_expires_at = expires_at;
  return same_shape ? RegistrationChange::refreshed : RegistrationChange::restarted;
}

std::expected<void, CatalogError> WorkerCatalog::heartbeat(
    WorkerId worker_id, Incarnation incarnation, std::chrono::steady_clock::time_point now) {
  const auto it = entries_.find(worker_id);
  if (it == entries_.end()) return std::unexpected(CatalogError::unknown_worker);
  if (it->second.registration.incarnation != incarnation) {
    return std::unexpected(CatalogError::stale_incarnation);
  }
  it->second.liveness_expires_at = now + it->second.registration.liveness_ttl;
  return {};
}

std::expected<void, CatalogError> WorkerCatalog::deregister(WorkerId worker_id,
                                                            Incarnation incarnation) {
  const auto it = entries_.find(worker_id);
  if (it == entries_.end()) return std::unexpected(CatalogError::unknown_worker);
  if (it->second.registration.incarnation != incarnation) {
    return std::unexpected(CatalogError::stale_incarnation);
  }
  entries_.erase(it);
  return {};
}

void WorkerCatalog::expire(std::chrono::steady_clock::time_point now,
                           std::vector<WorkerId>& expired) {
  if (liveness_held_) {
    for (auto& [id, entry] : entries_) {
      if (entry.liveness_expires_at <= now) entry.liveness_held_over = true;
    }
    return;
  }
  // Linear in the fleet; it runs on a timer a few times per liveness TTL, not per request.
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (it->second.liveness_expires_at <= now) {
      expired.push_back(it->first);
      entries_.erase(it++);
    } else {
      ++it;
    }
  }
}

LivenessGrace WorkerCatalog::resume_liveness(std::chrono::steady_clock::time_point now) {
  liveness_held_ = false;
  LivenessGrace grace;
  for (auto& [id, entry] : entries_) {
    // A heartbeat that raced ahead of the reconnect's news does not hide that the liveness ran out.
    if (entry.liveness_held_over || entry.liveness_expires_at <= now) ++grace.held_over;
    entry.liveness_held_over = false;
    const auto renewed_until = now + entry.registration.liveness_ttl;
    if (entry.liveness_expires_at >= renewed_until) continue;
    entry.liveness_expires_at = renewed_until;
    ++grace.renewed;
  }
  return grace;
}

const CatalogEntry* WorkerCatalog::find(WorkerId worker_id) const {
  const auto it = entries_.find(worker_id);
  return it == entries_.end() ? nullptr : &it->second;
}

}  // namespace kvr::discovery
