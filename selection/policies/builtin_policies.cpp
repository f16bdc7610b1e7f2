#include "selection/policies/builtin_policies.hpp"

#include <array>
#include <string>

#include "selection/classifiers_registration.hpp"
#include "selection/policies/bounded_load_hash/bounded_load_hash_policy.hpp"
#include "selection/policies/kv_cost/kv_cost_policy.hpp"
#include "selection/policies/least_loaded/least_loaded_policy.hpp"
#include "selection/policies/power_of_two/power_of_two_policy.hpp"
#include "selection/policies/predicted_ttft/predicted_ttft_policy.hpp"
#include "selection/policies/random/random_policy.hpp"
#include "selection/policies/round_robin/round_robin_policy.hpp"
#include "selection/policies/soft_affinity_load_guard/soft_affinity_load_guard_policy.hpp"
#include "selection/policies/two_tier/two_tier_policy.hpp"

namespace kvr::selection {
namespace {

struct BuiltinPolicy {
  std::string_view type;
  policies::ProviderResult<policies::WorkerSelectionPolicyFactory> (*provider)(
      const policies::WorkerSelectionPolicyParameters&);
};

constexpr std::array<BuiltinPolicy, 9> kBuiltinPolicies{{
    {policies::kKvCostPolicyType, &policies::kv_cost_policy_provider},
    {policies::kLeastLoadedPolicyType, &policies::least_loaded_policy_provider},
    {policies::kRoundRobinPolicyType, &policies::round_robin_policy_provider},
    {policies::kRandomPolicyType, &policies::random_policy_provider},
    {policies::kPowerOfTwoPolicyType, &policies::power_of_two_policy_provider},
    {policies::kTwoTierPolicyType, &policies::two_tier_policy_provider},
    {policies::kSoftAffinityLoadGuardPolicyType,
     &policies::soft_affinity_load_guard_policy_provider},
    {policies::kBoundedLoadHashPolicyType, &policies::bounded_load_hash_policy_provider},
    {policies::kPredictedTtftPolicyType, &policies::predicted_ttft_policy_provider},
}};

constexpr std::array<std::string_view, kBuiltinPolicies.size()> kBuiltinPolicyTypes = [] {
  std::array<std::string_view, kBuiltinPolicies.size()> types{};
  for (std::size_t i = 0; i < kBuiltinPolicies.size(); ++i) types[i] = kBuiltinPolicies[i].type;
  return types;
}();

static_assert(kBuiltinPolicyTypes[0] == plugins::kBuiltinDefaultPolicyType,
              "the registry's default type must be registered first");

}  // namespace

std::span<const std::string_view> builtin_policy_types() { return kBuiltinPolicyTypes; }

std::expected<void, plugins::RegistryError> register_builtin_policies(
    plugins::RouterPluginRegistry& registry) {
  for (const BuiltinPolicy& policy : kBuiltinPolicies) {
    auto registered = registry.register_worker_selection(std::string{policy.type}, policy.provider);
    if (!registered) return registered;
  }
  return register_builtin_classifiers(registry);
}

}  // namespace kvr::selection
