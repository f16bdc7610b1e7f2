#include "tests/testing/fake_worker_signals.hpp"

namespace kvr::testing {

void FakeWorkerSignals::set_workers(std::vector<FakeWorker> workers) {
  workers_ = std::move(workers);
  refresh();
}

void FakeWorkerSignals::refresh() {
  for (auto& descriptors : descriptors_) descriptors.clear();
  for (auto& index : worker_index_) index.clear();
  for (std::size_t i = 0; i < workers_.size(); ++i) {
    const FakeWorker& fake = workers_[i];
    const auto type = static_cast<std::size_t>(fake.type);
    descriptors_[type].push_back(selection::WorkerDescriptor{
        .worker = fake.worker,
        .taints = fake.taints,
        .available = fake.available,
        .kv_usage = fake.kv_usage,
        .active_prefill_tokens = fake.active_prefill_tokens,
    });
    worker_index_[type].push_back(i);
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
  const auto& index = worker_index_[static_cast<std::size_t>(worker_type)];
  if (!cache_out.empty()) ++cache_requests_;
  if (!load_out.empty()) ++load_requests_;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const FakeWorker& fake = workers_[index[rows[i]]];
    if (!cache_out.empty()) cache_out[i] = fake.cache;
    if (!load_out.empty()) {
      load_out[i] =
          fake.load ? selection::WorkerLoadInput{*fake.load} : selection::WorkerLoadInput{};
    }
  }
}

}  // namespace kvr::testing
