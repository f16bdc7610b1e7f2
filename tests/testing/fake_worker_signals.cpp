#include "tests/testing/fake_worker_signals.hpp"

namespace kvr::testing {

void FakeWorkerSignals::set_workers(std::vector<FakeWorker> workers) {
  workers_ = std::move(workers);
  refresh();
}

void FakeWorkerSignals::refresh() {
  for (std::size_t type = 0; type < descriptors_.size(); ++type) {
    descriptors_[type].clear();
    cache_inputs_[type].clear();
    load_inputs_[type].clear();
  }
  for (const FakeWorker& fake : workers_) {
    const auto type = static_cast<std::size_t>(fake.type);
    descriptors_[type].push_back(selection::WorkerDescriptor{
        .worker = fake.worker,
        .taints = fake.taints,
        .available = fake.available,
        .kv_usage = fake.kv_usage,
        .active_prefill_tokens = fake.active_prefill_tokens,
    });
    cache_inputs_[type].push_back(fake.cache);
    load_inputs_[type].push_back(fake.load ? selection::WorkerLoadInput{*fake.load}
                                           : selection::WorkerLoadInput{});
  }
}

std::span<const selection::WorkerDescriptor> FakeWorkerSignals::workers(
    WorkerType worker_type) const {
  return descriptors_[static_cast<std::size_t>(worker_type)];
}

void FakeWorkerSignals::compute_signals(const selection::SelectionRequest& /*request*/,
                                        WorkerType worker_type, std::span<const std::uint32_t> rows,
                                        std::span<selection::WorkerCacheInput> cache_out,
                                        std::span<selection::WorkerLoadInput> load_out) {
  const auto type = static_cast<std::size_t>(worker_type);
  if (!cache_out.empty()) {
    ++cache_requests_;
    const auto& cache = cache_inputs_[type];
    for (std::size_t i = 0; i < rows.size(); ++i) cache_out[i] = cache[rows[i]];
  }
  if (!load_out.empty()) {
    ++load_requests_;
    const auto& load = load_inputs_[type];
    for (std::size_t i = 0; i < rows.size(); ++i) load_out[i] = load[rows[i]];
  }
}

}  // namespace kvr::testing
