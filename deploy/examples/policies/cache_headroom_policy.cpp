#include "cache_headroom_policy.hpp"

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace kvr::examples {

using plugins::worker_selection::ParameterReader;
using plugins::worker_selection::RouterConfig;
using plugins::worker_selection::RoutingPartition;
using plugins::worker_selection::WorkerLoadInput;
using plugins::worker_selection::WorkerSelectionPolicy;
using plugins::worker_selection::WorkerSelectionPolicyError;

PolicyResult<bool> HeadroomFilter::keep(const WorkerSelectionContext& /*context*/,
                                        const WorkerCandidate& worker) {
  const WorkerLoadInput& load = *worker.load();  // never null: the filter declared LOAD
  return !load.is_available() || load.active_requests() < max_active_requests_;
}

PolicyResult<double> UncachedBlocksScorer::score(const WorkerSelectionContext& context,
                                                 const WorkerCandidate& worker) {
  const double cached = worker.cache()->device_overlap_blocks();
  return std::max(0.0, static_cast<double>(context.request_blocks()) - cached);
}

PolicyResult<double> QueueScorer::score(const WorkerSelectionContext& /*context*/,
                                        const WorkerCandidate& worker) {
  const WorkerLoadInput& load = *worker.load();
  return load.is_available() ? weight_ * static_cast<double>(load.active_requests()) : 0.0;
}

PolicyResult<std::size_t> CheapestPicker::pick(const WorkerSelectionContext& /*context*/,
                                               const WorkerInputView& view) {
  const auto rows = view.candidates();
  if (rows.empty()) return std::unexpected(WorkerSelectionPolicyError::failed("no candidates"));
  std::size_t best = 0;
  for (std::size_t row = 1; row < rows.size(); ++row) {
    const auto key = [&](std::size_t i) { return std::pair{rows[i].cost(), rows[i].worker()}; };
    if (key(row) < key(best)) best = row;
  }
  return best;
}

std::expected<WorkerSelectionPolicyFactory, WorkerSelectionPolicyProviderError>
cache_headroom_provider(const WorkerSelectionPolicyParameters& parameters) {
  // Read every parameter, then finish(): a misspelled key stops startup instead of being ignored.
  ParameterReader reader = parameters.reader();
  auto max_active_requests = reader.optional<std::uint32_t>("max_active_requests", 8);
  if (!max_active_requests) return std::unexpected(max_active_requests.error());
  auto queue_weight = reader.optional<double>("queue_weight", 1.0);
  if (!queue_weight) return std::unexpected(queue_weight.error());
  if (auto finished = reader.finish(); !finished) return std::unexpected(finished.error());
  if (*max_active_requests == 0) {
    return std::unexpected(
        WorkerSelectionPolicyProviderError{"max_active_requests: must be at least 1"});
  }
  if (!std::isfinite(*queue_weight) || *queue_weight < 0) {
    return std::unexpected(
        WorkerSelectionPolicyProviderError{"queue_weight: must be finite and not negative"});
  }

  // The factory runs once per partition and role; fresh components keep state partition-local.
  return [limit = *max_active_requests, weight = *queue_weight](
             const RouterConfig& config, WorkerType worker_type, const RoutingPartition&) {
    std::vector<std::unique_ptr<WorkerFilter>> filters;
    filters.push_back(std::make_unique<HeadroomFilter>(limit));
    std::vector<std::unique_ptr<WorkerScorer>> scorers;
    scorers.push_back(std::make_unique<UncachedBlocksScorer>());
    scorers.push_back(std::make_unique<QueueScorer>(weight));
    return WorkerSelectionPolicy(config, worker_type, std::move(filters), std::move(scorers),
                                 std::make_unique<CheapestPicker>());
  };
}

}  // namespace kvr::examples
