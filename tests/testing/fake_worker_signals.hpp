// A WorkerSignalSource over fixed per-worker values, for selection tests and benchmarks.
// It also counts which signal groups the host asked for, so tests can check laziness.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "selection/selection_host.hpp"

namespace kvr::testing {

/// One simulated (worker, rank) with the signals the fake reports for it.
struct FakeWorker {
  WorkerWithDpRank worker;
  WorkerType type = WorkerType::Aggregated;
  std::vector<std::string> taints;
  bool available = true;
  std::optional<double> kv_usage;
  std::uint64_t active_prefill_tokens = 0;
  selection::WorkerCacheInput cache;
  /// Empty: the worker has no load observation (WorkerLoadInput::is_available() is false).
  std::optional<selection::WorkerLoadInput::Values> load;
};

/// Serves FakeWorkers to the selection host.
class FakeWorkerSignals final : public selection::WorkerSignalSource {
 public:
  FakeWorkerSignals() = default;
  explicit FakeWorkerSignals(std::vector<FakeWorker> workers) { set_workers(std::move(workers)); }

  /// Replaces the fleet.
  void set_workers(std::vector<FakeWorker> workers);
  /// The fleet, for changing signals between selections; call refresh() after editing.
  std::vector<FakeWorker>& mutable_workers() { return workers_; }
  /// Rebuilds the descriptors after mutable_workers() edits.
  void refresh();

  std::span<const selection::WorkerDescriptor> workers(WorkerType worker_type) const override;
  void compute_signals(const selection::SelectionRequest& request, WorkerType worker_type,
                       std::span<const std::uint32_t> rows,
                       std::span<selection::WorkerCacheInput> cache_out,
                       std::span<selection::WorkerLoadInput> load_out) override;

  /// How many compute_signals calls asked for each group.
  int cache_requests() const { return cache_requests_; }
  int load_requests() const { return load_requests_; }

 private:
  std::vector<FakeWorker> workers_;
  // Per worker type, aligned with the descriptors: the signals to hand out, precomputed so that
  // compute_signals is a plain gather (benchmarks then measure the host, not the fake).
  std::array<std::vector<selection::WorkerDescriptor>, 4> descriptors_;
  std::array<std::vector<selection::WorkerCacheInput>, 4> cache_inputs_;
  std::array<std::vector<selection::WorkerLoadInput>, 4> load_inputs_;
  int cache_requests_ = 0;
  int load_requests_ = 0;
};

}  // namespace kvr::testing
