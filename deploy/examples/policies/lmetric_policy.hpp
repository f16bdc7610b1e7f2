// An example worker-selection policy, `lmetric`, after LMetric (Zhang et al., "LMetric: Simple is
// Better – Multiplication May Be All You Need for LLM Request Scheduling", arXiv:2603.15202). The
// paper's point: instead of adding a cache term and a load term with weights that need tuning per
// workload, multiply one indicator of each. A worker's cost is
//   (the request's new prefill tokens there + the prefill tokens already queued there)
//     × (its batch size if it takes the request: active requests + 1),
// and the cheapest worker wins (CheapestPicker: ties to the lowest (worker id, rank)). Because
// the score is a product, a constant weight on either factor scales every worker's cost alike and
// cannot change the choice, which is why the policy has no weights at all. A worker without a
// load report counts as running nothing (batch size 1, nothing queued): no report is not busy.
// lmetric_policy_test.cpp runs it through the host.
#pragma once

#include <expected>
#include <string_view>

#include "cache_headroom_policy.hpp"

namespace kvr::examples {

using plugins::worker_selection::WorkerCacheInput;

/// The registered type name.
inline constexpr std::string_view kLMetricPolicyType = "lmetric";

/// The prompt blocks `cache` holds on any tier (device, host or disk): each is one the worker
/// loads rather than recomputes.
double held_blocks(const WorkerCacheInput& cache);

/// The prompt tokens a worker holding `cache` would still have to prefill: the prompt less its
/// held blocks, and at least one token of a non-empty prompt (an engine recomputes the last prompt
/// token of a fully cached prompt to produce its logits).
double new_prefill_tokens(const WorkerSelectionContext& context, const WorkerCacheInput& cache);

/// Costs (new_prefill_tokens + the worker's active_prefill_tokens when `count_queued_prefill`)
/// × (active_requests + 1); a worker without a load report counts neither queue nor batch.
class LMetricScorer final : public WorkerScorer {
 public:
  explicit LMetricScorer(bool count_queued_prefill) : count_queued_prefill_(count_queued_prefill) {}

  WorkerInputs required_worker_inputs() const override {
    return WorkerInputs::CACHE | WorkerInputs::LOAD;
  }
  PolicyResult<double> score(const WorkerSelectionContext& context,
                             const WorkerCandidate& worker) override;

 private:
  bool count_queued_prefill_;
};

/// The `lmetric` provider: reads `count_queued_prefill` (boolean, default true: the prefill
/// factor includes the prefill tokens already queued on the worker), rejects any other key.
std::expected<WorkerSelectionPolicyFactory, WorkerSelectionPolicyProviderError> lmetric_provider(
    const WorkerSelectionPolicyParameters& parameters);

}  // namespace kvr::examples
