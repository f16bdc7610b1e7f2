// The built-in policy `soft-affinity-load-guard`: honours the request's affinity target (a soft
// session binding or a classifier's choice) until the target is overloaded, and then moves only
// to a clearly lighter worker. No scorers (reported cost 0). With a = active requests (0 without
// a load observation):
//   - the target is the least-loaded candidate matching affinity_target() (a target without a
//     rank matches every rank of its worker);
//   - keep the target while a(target) <= max_active_requests;
//   - above that, take the least-loaded candidate L when a(L) + margin <= a(target), else keep
//     the target;
//   - without a target, or when no candidate matches it, take the least-loaded candidate.
// "Least loaded" is the least-loaded order (fewer active requests, then prefill tokens, then
// decode blocks); remaining ties are broken uniformly at random. Rebinding the session to the
// worker picked is the host's business (it commits once the response starts).
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

#include "selection/policies/common/parameters.hpp"
#include "selection/policies/common/plugin_api.hpp"
#include "selection/policies/common/policy_rng.hpp"

namespace kvr::selection::policies {

/// The registered type name.
inline constexpr std::string_view kSoftAffinityLoadGuardPolicyType = "soft-affinity-load-guard";

/// `soft-affinity-load-guard` YAML parameters.
struct SoftAffinityLoadGuardParameters {
  /// The target is kept while its active requests are at most this; an integer >= 0; default 8.
  std::int64_t max_active_requests = 8;
  /// How many fewer active requests a worker needs for the request to leave an overloaded
  /// target; an integer >= 1; default 2.
  std::int64_t margin = 2;
  /// Seed of the tie-break draws; default as resolve_seed.
  std::optional<std::uint64_t> seed;

  /// Reads the keys above; the caller rejects any other key.
  static ProviderResult<SoftAffinityLoadGuardParameters> read(ParameterReader& reader);
  /// Fails naming the first parameter outside its range.
  ProviderResult<void> validate() const;
};

/// Keeps the affinity target unless it is overloaded and a lighter worker exists (file comment).
/// Needs LOAD.
class SoftAffinityLoadGuardPicker final : public WorkerPicker {
 public:
  SoftAffinityLoadGuardPicker(const SoftAffinityLoadGuardParameters& parameters, std::uint64_t seed)
      : max_active_requests_(static_cast<std::size_t>(parameters.max_active_requests)),
        margin_(static_cast<std::size_t>(parameters.margin)),
        rng_(seed) {}

  WorkerInputs required_worker_inputs() const override { return WorkerInputs::LOAD; }
  PolicyResult<std::size_t> pick(const WorkerSelectionContext& context,
                                 const WorkerInputView& view) override;

 private:
  std::size_t max_active_requests_;
  std::size_t margin_;
  PolicyRng rng_;
};

/// A `soft-affinity-load-guard` policy: one SoftAffinityLoadGuardPicker.
WorkerSelectionPolicy make_soft_affinity_load_guard_policy(
    const SoftAffinityLoadGuardParameters& parameters, const RouterConfig& config,
    WorkerType worker_type, const RoutingPartition& partition);

/// The registered provider of `soft-affinity-load-guard`.
ProviderResult<WorkerSelectionPolicyFactory> soft_affinity_load_guard_policy_provider(
    const WorkerSelectionPolicyParameters& parameters);

}  // namespace kvr::selection::policies
