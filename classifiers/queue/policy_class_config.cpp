#include "classifiers/queue/policy_class_config.hpp"

#include <algorithm>
#include <cmath>
#include <utility>

#include <fmt/format.h>

namespace kvr::classifiers {

std::string_view as_str(QueueOrder order) {
  switch (order) {
    case QueueOrder::Fcfs:
      return "fcfs";
    case QueueOrder::Wspt:
      return "wspt";
  }
  return "fcfs";
}

std::optional<QueueOrder> parse_queue_order(std::string_view text) {
  if (text == "fcfs") return QueueOrder::Fcfs;
  if (text == "wspt") return QueueOrder::Wspt;
  return std::nullopt;
}

std::expected<void, PolicyClassConfigError> validate_policy_class(const PolicyClassConfig& config) {
  if (config.name.empty())
    return std::unexpected(PolicyClassConfigError{"name", "must not be empty"});
  if (config.quantum == 0) {
    return std::unexpected(PolicyClassConfigError{"quantum", "must be greater than 0"});
  }
  if (const auto& frac = config.prefill_busy_threshold_frac) {
    if (!std::isfinite(*frac) || *frac <= 0.0 || *frac > 1.0) {
      return std::unexpected(PolicyClassConfigError{
          "prefill_busy_threshold_frac",
          fmt::format("must be a fraction in (0, 1] of the worker's max batched tokens, got {}",
                      *frac)});
    }
  }
  if (const auto& frac = config.kv_busy_threshold) {
    if (!std::isfinite(*frac) || *frac <= 0.0 || *frac > 1.0) {
      return std::unexpected(PolicyClassConfigError{
          "kv_busy_threshold",
          fmt::format("must be a fraction in (0, 1] of the worker's KV blocks, got {}", *frac)});
    }
  }
  constexpr std::string_view kNoLimitHint = "must be greater than 0 (omit the key for no limit)";
  if (config.request_queue_limit_per_worker == 0U) {
    return std::unexpected(
        PolicyClassConfigError{"request_queue_limit_per_worker", std::string{kNoLimitHint}});
  }
  if (config.uncached_token_queue_limit_per_worker == 0U) {
    return std::unexpected(
        PolicyClassConfigError{"uncached_token_queue_limit_per_worker", std::string{kNoLimitHint}});
  }
  return {};
}

PolicyClassConfig default_policy_class(std::optional<double> prefill_busy_threshold_frac) {
  PolicyClassConfig config;
  config.name = std::string{kDefaultPolicyClass};
  config.prefill_busy_threshold_frac = prefill_busy_threshold_frac;
  return config;
}

std::vector<PolicyClassConfig> resolve_policy_classes(std::span<const PolicyClassConfig> configured,
                                                      PolicyClassConfig fallback_default) {
  std::vector<PolicyClassConfig> classes(configured.begin(), configured.end());
  if (std::ranges::find(classes, kDefaultPolicyClass, &PolicyClassConfig::name) == classes.end()) {
    fallback_default.name = std::string{kDefaultPolicyClass};
    classes.push_back(std::move(fallback_default));
  }
  return classes;
}

bool is_worker_busy(const PolicyClassConfig& config, const WorkerPrefillLoad& worker) {
  if (config.prefill_busy_threshold &&
      worker.active_prefill_tokens > *config.prefill_busy_threshold) {
    return true;
  }
  if (config.prefill_busy_threshold_frac && worker.max_batched_tokens > 0) {
    const double limit =
        *config.prefill_busy_threshold_frac * static_cast<double>(worker.max_batched_tokens);
    if (static_cast<double>(worker.active_prefill_tokens) > limit) return true;
  }
  return config.kv_busy_threshold && worker.kv_usage &&
         *worker.kv_usage > *config.kv_busy_threshold;
}

bool should_queue(const PolicyClassConfig& config,
                  std::span<const WorkerPrefillLoad> eligible_workers) {
  if (eligible_workers.empty()) return false;
  return std::ranges::all_of(eligible_workers, [&config](const WorkerPrefillLoad& worker) {
    return is_worker_busy(config, worker);
  });
}

}  // namespace kvr::classifiers
