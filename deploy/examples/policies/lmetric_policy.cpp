#include "lmetric_policy.hpp"

#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

namespace kvr::examples {

using plugins::worker_selection::ParameterReader;
using plugins::worker_selection::RouterConfig;
using plugins::worker_selection::RoutingPartition;
using plugins::worker_selection::WorkerLoadInput;
using plugins::worker_selection::WorkerSelectionPolicy;

double held_blocks(const WorkerCacheInput& cache) {
  return cache.device_overlap_blocks() + cache.host_overlap_blocks() + cache.disk_overlap_blocks();
}

double new_prefill_tokens(const WorkerSelectionContext& context, const WorkerCacheInput& cache) {
  const auto prompt = static_cast<double>(context.prompt_tokens());
  const double cached = held_blocks(cache) * static_cast<double>(context.block_size());
  // Without the one-token floor a fully cached prompt would cost 0 whatever the worker's batch,
  // and every repeat of it would pile onto the same worker.
  const double at_least = context.prompt_tokens() > 0 ? 1.0 : 0.0;
  return std::max(at_least, prompt - cached);
}

PolicyResult<double> LMetricScorer::score(const WorkerSelectionContext& context,
                                          const WorkerCandidate& worker) {
  const WorkerLoadInput& load = *worker.load();  // never null: the scorer declared LOAD
  double prefill = new_prefill_tokens(context, *worker.cache());
  double batch = 1.0;  // the request itself
  if (load.is_available()) {
    if (count_queued_prefill_) prefill += static_cast<double>(load.active_prefill_tokens());
    batch += static_cast<double>(load.active_requests());
  }
  return prefill * batch;
}

std::expected<WorkerSelectionPolicyFactory, WorkerSelectionPolicyProviderError> lmetric_provider(
    const WorkerSelectionPolicyParameters& parameters) {
  // Read every parameter, then finish(): a misspelled key stops startup instead of being ignored.
  ParameterReader reader = parameters.reader();
  auto count_queued_prefill = reader.optional<bool>("count_queued_prefill", true);
  if (!count_queued_prefill) return std::unexpected(count_queued_prefill.error());
  if (auto finished = reader.finish(); !finished) return std::unexpected(finished.error());

  // The scorer keeps no state, but the factory still builds fresh components for each partition
  // and role, as the contract asks.
  return [count_queued = *count_queued_prefill](const RouterConfig& config, WorkerType worker_type,
                                                const RoutingPartition&) {
    std::vector<std::unique_ptr<WorkerScorer>> scorers;
    scorers.push_back(std::make_unique<LMetricScorer>(count_queued));
    return WorkerSelectionPolicy(config, worker_type, std::move(scorers),
                                 std::make_unique<CheapestPicker>());
  };
}

}  // namespace kvr::examples
