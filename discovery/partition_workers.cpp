#include "discovery/partition_workers.hpp"

namespace kvr::discovery {

PartitionWorkers::PartitionWorkers(RegistrationLimits limits, IndexerConfig index_config)
    : catalog_(std::move(limits)), index_(index_config), text_index_(index_config) {}

std::expected<RegistrationChange, RegistrationError> PartitionWorkers::register_worker(
    WorkerRegistration registration, std::chrono::steady_clock::time_point now) {
  const WorkerId worker_id = registration.worker_id;
  auto change = catalog_.register_worker(std::move(registration), now);
  if (!change) return change;
  if (*change == RegistrationChange::refreshed) return change;
  if (*change == RegistrationChange::restarted) drop_worker(worker_id);
  add_ranks(catalog_.find(worker_id)->registration);
  return change;
}

std::expected<void, CatalogError> PartitionWorkers::heartbeat(
    WorkerId worker_id, Incarnation incarnation, std::chrono::steady_clock::time_point now) {
  return catalog_.heartbeat(worker_id, incarnation, now);
}

std::expected<void, CatalogError> PartitionWorkers::deregister(WorkerId worker_id,
                                                               Incarnation incarnation) {
  auto result = catalog_.deregister(worker_id, incarnation);
  if (result) drop_worker(worker_id);
  return result;
}

void PartitionWorkers::expire(std::chrono::steady_clock::time_point now,
                              std::vector<WorkerId>& removed) {
  const std::size_t first = removed.size();
  catalog_.expire(now, removed);
  for (std::size_t i = first; i < removed.size(); ++i) drop_worker(removed[i]);
  load_.expire(now);
  index_.expire(now);
  text_index_.expire(now);
}

void PartitionWorkers::add_ranks(const WorkerRegistration& registration) {
  // The index bounds what a rank may hold by its capacity; a rank that announced none is bounded
  // as the largest capacity a registration may announce, so it costs no more than such a one.
  const std::uint64_t index_capacity =
      registration.total_kv_blocks.value_or(catalog_.limits().max_kv_blocks_per_rank);
  for (DpRank rank = 0; rank < registration.data_parallel_size; ++rank) {
    const WorkerWithDpRank worker{registration.worker_id, rank};
    // Validation guarantees a positive bound and drop_worker a fresh (worker, rank).
    (void)index_.add_worker(
        worker, {index_capacity, registration.incarnation, !registration.publishes_kv_events});
    (void)text_index_.add_worker(worker,
                                 {index_capacity, registration.incarnation, /*approximate=*/true});
    (void)load_.add_rank(worker, registration.total_kv_blocks);
  }
}

void PartitionWorkers::drop_worker(WorkerId worker_id) {
  index_.remove_worker(worker_id);
  text_index_.remove_worker(worker_id);
  load_.remove_worker(worker_id);
}

}  // namespace kvr::discovery
