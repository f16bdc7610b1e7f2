// Everything kvr knows about the workers of one routing partition: catalog, KV index, text index
// and predicted load, kept in step (a removal cascades to the indexes and to the bookings). Owned
// by the partition's selector actor; plain C++ with an injected clock.
#pragma once

#include <chrono>
#include <expected>
#include <vector>

#include "discovery/catalog/worker_catalog.hpp"
#include "discovery/indexer/kv_indexer.hpp"
#include "discovery/load/predicted_load.hpp"

namespace kvr::discovery {

/// Catalog, KV index, text index and predicted load of one partition.
class PartitionWorkers {
 public:
  explicit PartitionWorkers(RegistrationLimits limits = {}, IndexerConfig index_config = {});

  /// Registers a worker, or resets it when it restarted (new incarnation or shape): its index
  /// contents and bookings are dropped and its ranks re-added empty.
  std::expected<RegistrationChange, RegistrationError> register_worker(
      WorkerRegistration registration, std::chrono::steady_clock::time_point now);

  /// Renews a worker's liveness.
  std::expected<void, CatalogError> heartbeat(WorkerId worker_id, Incarnation incarnation,
                                              std::chrono::steady_clock::time_point now);

  /// Removes a worker that shut down cleanly, with its index contents and bookings.
  std::expected<void, CatalogError> deregister(WorkerId worker_id, Incarnation incarnation);

  /// Removes workers whose liveness ended, releases expired bookings and approximate blocks;
  /// appends the removed worker ids to `removed`.
  void expire(std::chrono::steady_clock::time_point now, std::vector<WorkerId>& removed);

  /// While the owner's own link to the workers is down, no liveness expires (WorkerCatalog); the
  /// bookings and approximate blocks still do.
  void hold_liveness() { catalog_.hold_liveness(); }
  /// The link is back: each worker's liveness runs at least one TTL from `now`, and expiry resumes.
  LivenessGrace resume_liveness(std::chrono::steady_clock::time_point now) {
    return catalog_.resume_liveness(now);
  }

  const WorkerCatalog& catalog() const { return catalog_; }
  KvIndexer& index() { return index_; }
  const KvIndexer& index() const { return index_; }
  /// Text blocks (the `estimate` tokenizer mode) routed to each rank: filled only by routing
  /// decisions and expired by TTL, every rank approximate, apart from the engines' KV events.
  KvIndexer& text_index() { return text_index_; }
  const KvIndexer& text_index() const { return text_index_; }
  PredictedLoad& load() { return load_; }
  const PredictedLoad& load() const { return load_; }

 private:
  void add_ranks(const WorkerRegistration& registration);
  void drop_worker(WorkerId worker_id);

  WorkerCatalog catalog_;
  KvIndexer index_;
  KvIndexer text_index_;
  PredictedLoad load_;
};

}  // namespace kvr::discovery
