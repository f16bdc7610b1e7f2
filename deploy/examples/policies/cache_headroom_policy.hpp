// An example worker-selection policy, `cache-headroom`, written against the public plugin API
// only (selection/worker_selection.hpp), as a policy outside the project would be. It shows each
// kind of component once:
//   - HeadroomFilter: drops workers that already run `max_active_requests` requests;
//   - UncachedBlocksScorer: costs the prompt blocks a worker would still have to prefill;
//   - QueueScorer: costs `queue_weight` per active request;
//   - CheapestPicker: the lowest total cost, ties to the lowest (worker id, rank).
// docs/policies.md walks through it; cache_headroom_policy_test.cpp runs it through the host.
#pragma once

#include <cstdint>
#include <expected>
#include <string_view>

#include "selection/worker_selection.hpp"

namespace kvr::examples {

using plugins::worker_selection::PolicyResult;
using plugins::worker_selection::WorkerCandidate;
using plugins::worker_selection::WorkerFilter;
using plugins::worker_selection::WorkerInputs;
using plugins::worker_selection::WorkerInputView;
using plugins::worker_selection::WorkerPicker;
using plugins::worker_selection::WorkerScorer;
using plugins::worker_selection::WorkerSelectionContext;
using plugins::worker_selection::WorkerSelectionPolicyFactory;
using plugins::worker_selection::WorkerSelectionPolicyParameters;
using plugins::worker_selection::WorkerSelectionPolicyProviderError;

/// The registered type name.
inline constexpr std::string_view kCacheHeadroomPolicyType = "cache-headroom";

/// Keeps workers with fewer than `max_active_requests` active requests. A worker that has not
/// reported its load yet is kept: no report is not the same as busy.
class HeadroomFilter final : public WorkerFilter {
 public:
  explicit HeadroomFilter(std::uint32_t max_active_requests)
      : max_active_requests_(max_active_requests) {}

  WorkerInputs required_worker_inputs() const override { return WorkerInputs::LOAD; }
  PolicyResult<bool> keep(const WorkerSelectionContext& context,
                          const WorkerCandidate& worker) override;

 private:
  std::uint32_t max_active_requests_;
};

/// Costs the request's blocks that are not on the worker's device tier, in blocks.
class UncachedBlocksScorer final : public WorkerScorer {
 public:
  WorkerInputs required_worker_inputs() const override { return WorkerInputs::CACHE; }
  PolicyResult<double> score(const WorkerSelectionContext& context,
                             const WorkerCandidate& worker) override;
};

/// Costs `weight` per active request (0 for a worker without a load report).
class QueueScorer final : public WorkerScorer {
 public:
  explicit QueueScorer(double weight) : weight_(weight) {}

  WorkerInputs required_worker_inputs() const override { return WorkerInputs::LOAD; }
  PolicyResult<double> score(const WorkerSelectionContext& context,
                             const WorkerCandidate& worker) override;

 private:
  double weight_;
};

/// The row of lowest total cost; among equal costs the lowest (worker id, rank), so that a
/// selection never depends on the order the host lists candidates in.
class CheapestPicker final : public WorkerPicker {
 public:
  PolicyResult<std::size_t> pick(const WorkerSelectionContext& context,
                                 const WorkerInputView& view) override;
};

/// The `cache-headroom` provider: reads `max_active_requests` (integer ≥ 1, default 8) and
/// `queue_weight` (finite, ≥ 0, default 1.0), rejects any other key, and returns the factory that
/// builds fresh components for each partition and role.
std::expected<WorkerSelectionPolicyFactory, WorkerSelectionPolicyProviderError>
cache_headroom_provider(const WorkerSelectionPolicyParameters& parameters);

}  // namespace kvr::examples
