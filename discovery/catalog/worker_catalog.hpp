// The worker catalog: registered workers and their liveness (heartbeats, TTL expiry). Plain state
// owned by a selector actor's partition (through PartitionWorkers) or by the discovery actor.
#pragma once

#include <chrono>
#include <cstdint>
#include <expected>
#include <string_view>
#include <vector>

#include <absl/container/flat_hash_map.h>

#include "discovery/catalog/worker_registration.hpp"
#include "messages/ids.hpp"

namespace kvr::discovery {

/// Why a catalog operation was refused.
enum class CatalogError : std::uint8_t {
  unknown_worker,     ///< no registration for this worker id
  stale_incarnation,  ///< the message comes from another process start than the registered one
};

/// The snake_case name of a catalog error.
std::string_view as_str(CatalogError error);

/// What a registration did to the catalog.
enum class RegistrationChange : std::uint8_t {
  added,      ///< a worker not known before
  restarted,  ///< a known worker with a new incarnation (or a new shape): its state was reset
  refreshed,  ///< the same registration again: the liveness was renewed
};

/// What WorkerCatalog::resume_liveness() did.
struct LivenessGrace {
  /// Workers whose liveness ran out while it was held (seen by an expire() during the hold, or
  /// overdue at the release): each of these workers would have been expired.
  std::size_t held_over = 0;
  /// Workers whose liveness was pushed to the reconnect time plus their TTL (the held-over ones
  /// included).
  std::size_t renewed = 0;
};

/// One registered worker and its liveness.
struct CatalogEntry {
  WorkerRegistration registration;
  std::chrono::steady_clock::time_point liveness_expires_at;
  /// The liveness ran out while it was held (seen by expire()): the worker would have been
  /// expired. Cleared by resume_liveness().
  bool liveness_held_over = false;
};

/// Registered workers keyed by id, with their liveness renewed by heartbeats.
class WorkerCatalog {
 public:
  explicit WorkerCatalog(RegistrationLimits limits = {}) : limits_(std::move(limits)) {}

  /// Validates and records a registration; its liveness runs from `now`.
  std::expected<RegistrationChange, RegistrationError> register_worker(
      WorkerRegistration registration, std::chrono::steady_clock::time_point now);

  /// Renews a worker's liveness.
  std::expected<void, CatalogError> heartbeat(WorkerId worker_id, Incarnation incarnation,
                                              std::chrono::steady_clock::time_point now);

  /// Removes a worker (clean shutdown); refuses another incarnation's deregistration.
  std::expected<void, CatalogError> deregister(WorkerId worker_id, Incarnation incarnation);

  /// Removes every worker whose liveness ended at or before `now`, appending their ids to
  /// `expired`; while liveness is held it removes nobody and only marks the workers whose TTL ran
  /// out.
  void expire(std::chrono::steady_clock::time_point now, std::vector<WorkerId>& expired);

  /// The owner lost its own link to the workers (the node's NATS connection is down): their
  /// missing heartbeats say nothing about them, so until resume_liveness() no liveness is expired.
  /// Heartbeats and registrations that still arrive renew liveness as usual.
  void hold_liveness() { liveness_held_ = true; }
  /// The link is back at `now`: every liveness ending before `now` + its TTL is pushed to that
  /// time, so each worker has one full TTL from the reconnect to be heard from again (a worker that
  /// died during the outage expires one TTL after it), and expiry resumes.
  LivenessGrace resume_liveness(std::chrono::steady_clock::time_point now);
  bool liveness_held() const { return liveness_held_; }

  /// The entry of a worker, or nullptr.
  const CatalogEntry* find(WorkerId worker_id) const;

  std::size_t size() const { return entries_.size(); }
  const absl::flat_hash_map<WorkerId, CatalogEntry>& entries() const { return entries_; }
  const RegistrationLimits& limits() const { return limits_; }

 private:
  RegistrationLimits limits_;
  absl::flat_hash_map<WorkerId, CatalogEntry> entries_;
  bool liveness_held_ = false;
};

}  // namespace kvr::discovery
