// An example worker-selection policy, `sticky-until-saturated`, after the way the llm-d inference
// scheduler pairs its prefix-cache scorer with its load-aware scorers (llm-d.ai, the inference
// scheduler's architecture and "optimized baseline" guides): prefer the worker that already holds
// the prompt's prefix, but only while that worker is not overloaded, and balance by load once it
// is. Here the two are a rule rather than weights:
//   - a holder is a worker holding at least `sticky_fraction` of the prompt's blocks, counting the
//     device, host and disk tiers;
//   - a holder is saturated when the prefill tokens queued on it are `saturation_tokens` or more
//     (its decode footprint is left out: a worker's running requests hold far more KV than a
//     queue that delays a first token, and counting it would drop every busy holder);
//   - the request goes to the unsaturated holder with the least uncached work (its new prefill
//     tokens plus the prefill tokens queued there); with no such holder stickiness is dropped and
//     the least uncached work over every worker wins. Ties go to fewer active requests, then the
//     lowest (worker id, rank).
// It has no filter: UncachedWorkScorer costs the uncached work, StickyUntilSaturatedPicker applies
// the rule. sticky_until_saturated_policy_test.cpp runs it through the host.
#pragma once

#include <cstddef>
#include <cstdint>
#include <expected>
#include <string_view>

#include "lmetric_policy.hpp"

namespace kvr::examples {

/// The registered type name.
inline constexpr std::string_view kStickyUntilSaturatedPolicyType = "sticky-until-saturated";

/// Costs the prefill work ahead of the request's first token on the worker, in tokens: its new
/// prefill tokens (new_prefill_tokens) plus the worker's active_prefill_tokens (none for a worker
/// without a load report).
class UncachedWorkScorer final : public WorkerScorer {
 public:
  WorkerInputs required_worker_inputs() const override {
    return WorkerInputs::CACHE | WorkerInputs::LOAD;
  }
  PolicyResult<double> score(const WorkerSelectionContext& context,
                             const WorkerCandidate& worker) override;
};

/// The unsaturated holder of lowest cost (the file comment's rule); without one, the row of lowest
/// cost. Ties to fewer active requests, then the lowest (worker id, rank). A worker without a load
/// report is never saturated.
class StickyUntilSaturatedPicker final : public WorkerPicker {
 public:
  StickyUntilSaturatedPicker(double sticky_fraction, std::uint64_t saturation_tokens)
      : sticky_fraction_(sticky_fraction), saturation_tokens_(saturation_tokens) {}

  // CACHE for the held fraction, LOAD for saturation: both are read from the view.
  WorkerInputs required_worker_inputs() const override {
    return WorkerInputs::CACHE | WorkerInputs::LOAD;
  }
  PolicyResult<std::size_t> pick(const WorkerSelectionContext& context,
                                 const WorkerInputView& view) override;

 private:
  double sticky_fraction_;
  std::uint64_t saturation_tokens_;
};

/// The `sticky-until-saturated` provider: reads `sticky_fraction` (in (0, 1], default 0.8) and
/// `saturation_tokens` (integer ≥ 1, default 16384), rejects any other key.
std::expected<WorkerSelectionPolicyFactory, WorkerSelectionPolicyProviderError>
sticky_until_saturated_provider(const WorkerSelectionPolicyParameters& parameters);

}  // namespace kvr::examples
