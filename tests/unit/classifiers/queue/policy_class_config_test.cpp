#include "classifiers/queue/policy_class_config.hpp"

#include <limits>
#include <vector>

#include <gtest/gtest.h>

namespace kvr::classifiers {
namespace {

PolicyClassConfig named(std::string name) {
  PolicyClassConfig config;
  config.name = std::move(name);
  return config;
}

std::string invalid_key(const PolicyClassConfig& config) {
  auto checked = validate_policy_class(config);
  EXPECT_FALSE(checked.has_value()) << "valid";
  return checked.has_value() ? std::string{} : checked.error().key;
}

TEST(PolicyClassConfigTest, TheDefaultsAreValid) {
  const PolicyClassConfig config = named("batch");
  EXPECT_TRUE(validate_policy_class(config).has_value());
  EXPECT_EQ(config.quantum, kDefaultQuantum);
  EXPECT_EQ(config.order, QueueOrder::Fcfs);
  EXPECT_EQ(config.prefill_busy_threshold, std::nullopt);
  EXPECT_EQ(config.prefill_busy_threshold_frac, std::nullopt);
  EXPECT_EQ(config.request_queue_limit_per_worker, std::nullopt);
  EXPECT_EQ(config.uncached_token_queue_limit_per_worker, std::nullopt);
}

TEST(PolicyClassConfigTest, NamesTheInvalidField) {
  EXPECT_EQ(invalid_key(named("")), "name");
  PolicyClassConfig config = named("a");
  config.quantum = 0;
  EXPECT_EQ(invalid_key(config), "quantum");
  for (double frac : {0.0, -0.5, 1.01, std::numeric_limits<double>::quiet_NaN(),
                      std::numeric_limits<double>::infinity()}) {
    config = named("a");
    config.prefill_busy_threshold_frac = frac;
    EXPECT_EQ(invalid_key(config), "prefill_busy_threshold_frac") << frac;
    config = named("a");
    config.kv_busy_threshold = frac;
    EXPECT_EQ(invalid_key(config), "kv_busy_threshold") << frac;
  }
  config = named("a");
  config.request_queue_limit_per_worker = 0;
  EXPECT_EQ(invalid_key(config), "request_queue_limit_per_worker");
  config = named("a");
  config.uncached_token_queue_limit_per_worker = 0;
  EXPECT_EQ(invalid_key(config), "uncached_token_queue_limit_per_worker");
}

TEST(PolicyClassConfigTest, AcceptsAFractionOfOneAndAZeroAbsoluteThreshold) {
  PolicyClassConfig config = named("a");
  config.prefill_busy_threshold_frac = 1.0;
  config.prefill_busy_threshold = 0;
  EXPECT_TRUE(validate_policy_class(config).has_value());
}

TEST(PolicyClassConfigTest, ParsesTheOrders) {
  EXPECT_EQ(parse_queue_order("fcfs"), QueueOrder::Fcfs);
  EXPECT_EQ(parse_queue_order("wspt"), QueueOrder::Wspt);
  EXPECT_EQ(parse_queue_order("FCFS"), std::nullopt);
  EXPECT_EQ(parse_queue_order("sjf"), std::nullopt);
  EXPECT_EQ(as_str(QueueOrder::Wspt), "wspt");
}

TEST(PolicyClassConfigTest, ResolveAddsTheDefaultClassWhenNotConfigured) {
  const std::vector<PolicyClassConfig> configured{named("interactive"), named("batch")};
  const auto classes = resolve_policy_classes(configured, default_policy_class(0.5));
  ASSERT_EQ(classes.size(), 3U);
  EXPECT_EQ(classes[0].name, "interactive");
  EXPECT_EQ(classes[1].name, "batch");
  EXPECT_EQ(classes[2].name, "default");
  EXPECT_EQ(classes[2].prefill_busy_threshold_frac, 0.5);
}

TEST(PolicyClassConfigTest, ResolveKeepsAConfiguredDefaultClass) {
  PolicyClassConfig configured_default = named("default");
  configured_default.quantum = 7;
  const std::vector<PolicyClassConfig> configured{configured_default};
  const auto classes = resolve_policy_classes(configured, default_policy_class(0.5));
  ASSERT_EQ(classes.size(), 1U);
  EXPECT_EQ(classes[0], configured_default);
}

TEST(PolicyClassConfigTest, WithoutPolicyClassesOnlyDefaultApplies) {
  const auto classes = resolve_policy_classes({}, default_policy_class());
  ASSERT_EQ(classes.size(), 1U);
  EXPECT_EQ(classes[0].name, kDefaultPolicyClass);
  EXPECT_FALSE(
      is_worker_busy(classes[0], {.active_prefill_tokens = 1'000'000, .max_batched_tokens = 8192}));
}

TEST(ShouldQueueTest, AbsoluteThresholdIsExceededStrictly) {
  PolicyClassConfig config = named("a");
  config.prefill_busy_threshold = 1000;
  EXPECT_FALSE(is_worker_busy(config, {.active_prefill_tokens = 1000}));
  EXPECT_TRUE(is_worker_busy(config, {.active_prefill_tokens = 1001}));
}

TEST(ShouldQueueTest, FractionThresholdUsesTheWorkersMaxBatchedTokens) {
  PolicyClassConfig config = named("a");
  config.prefill_busy_threshold_frac = 0.5;
  EXPECT_FALSE(is_worker_busy(config, {.active_prefill_tokens = 4096, .max_batched_tokens = 8192}));
  EXPECT_TRUE(is_worker_busy(config, {.active_prefill_tokens = 4097, .max_batched_tokens = 8192}));
  EXPECT_FALSE(
      is_worker_busy(config, {.active_prefill_tokens = 4097, .max_batched_tokens = 16384}));
  // Unknown max batched tokens: the fraction cannot judge the worker.
  EXPECT_FALSE(is_worker_busy(config, {.active_prefill_tokens = 1'000'000}));
}

TEST(ShouldQueueTest, KvThresholdReadsTheWorkersKvUsageWhenKnown) {
  PolicyClassConfig config = named("a");
  config.kv_busy_threshold = 0.8;
  EXPECT_FALSE(is_worker_busy(config, {.kv_usage = 0.8}));
  EXPECT_TRUE(is_worker_busy(config, {.kv_usage = 0.81}));
  // No load observation yet: the KV threshold cannot judge the worker.
  EXPECT_FALSE(is_worker_busy(config, {}));
  // Either threshold exceeded makes it busy.
  config.prefill_busy_threshold = 1000;
  EXPECT_TRUE(is_worker_busy(config, {.active_prefill_tokens = 1001, .kv_usage = 0.1}));
  EXPECT_FALSE(is_worker_busy(config, {.active_prefill_tokens = 10, .kv_usage = 0.1}));
}

TEST(ShouldQueueTest, WithBothThresholdsTheLowerCounts) {
  PolicyClassConfig config = named("a");
  config.prefill_busy_threshold = 1000;
  config.prefill_busy_threshold_frac = 0.5;
  // Fraction 2048 of 4096, absolute 1000: busy above 1000.
  EXPECT_TRUE(is_worker_busy(config, {.active_prefill_tokens = 1500, .max_batched_tokens = 4096}));
  // Fraction 500 of 1000, absolute 1000: busy above 500.
  EXPECT_TRUE(is_worker_busy(config, {.active_prefill_tokens = 600, .max_batched_tokens = 1000}));
  EXPECT_FALSE(is_worker_busy(config, {.active_prefill_tokens = 500, .max_batched_tokens = 1000}));
}

TEST(ShouldQueueTest, QueuesOnlyWhenEveryEligibleWorkerIsBusy) {
  PolicyClassConfig config = named("a");
  config.prefill_busy_threshold_frac = 0.75;
  const std::vector<WorkerPrefillLoad> one_free{
      {.active_prefill_tokens = 8000, .max_batched_tokens = 8192},
      {.active_prefill_tokens = 100, .max_batched_tokens = 8192}};
  EXPECT_FALSE(should_queue(config, one_free));
  const std::vector<WorkerPrefillLoad> all_busy{
      {.active_prefill_tokens = 8000, .max_batched_tokens = 8192},
      {.active_prefill_tokens = 6145, .max_batched_tokens = 8192}};
  EXPECT_TRUE(should_queue(config, all_busy));
}

TEST(ShouldQueueTest, NeverQueuesWithoutThresholdsOrWithoutWorkers) {
  const PolicyClassConfig no_thresholds = named("a");
  const std::vector<WorkerPrefillLoad> loaded{
      {.active_prefill_tokens = 1'000'000, .max_batched_tokens = 8192}};
  EXPECT_FALSE(should_queue(no_thresholds, loaded));
  PolicyClassConfig config = named("a");
  config.prefill_busy_threshold = 0;
  EXPECT_TRUE(should_queue(config, loaded));
  EXPECT_FALSE(should_queue(config, {}));
}

}  // namespace
}  // namespace kvr::classifiers
