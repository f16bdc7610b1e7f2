// The cache-mismatch detector on an injected clock: it warns when one side's hit rate is near
// zero while the other's is substantial (naming the model and the likely causes), not before the
// window holds enough requests, at most once a minute per model, and it forgets requests older
// than its window. record_cache_outcome feeds the node's metrics and the detector together.
#include "messages/metrics/cache_mismatch_detector.hpp"

#include <memory>

#include <gtest/gtest.h>

#include "messages/metrics/node_metrics.hpp"
#include "messages/metrics/rate_limited_log.hpp"

namespace kvr::metrics {
namespace {

using namespace std::chrono_literals;

class CacheMismatchDetectorTest : public ::testing::Test {
 protected:
  // Observes `count` requests of `model`, each of 1000 prompt tokens; returns the last answer.
  std::optional<CacheMismatchWarning> observe(std::string_view model, int count,
                                              std::uint64_t predicted, std::uint64_t engine) {
    std::optional<CacheMismatchWarning> last;
    for (int i = 0; i < count; ++i) {
      last = detector_.observe(model, CacheOutcome::of(1000, predicted, engine));
    }
    return last;
  }

  std::shared_ptr<ManualClock> clock_ = std::make_shared<ManualClock>();
  CacheMismatchDetector detector_{clock_};
};

TEST_F(CacheMismatchDetectorTest, WarnsWhenTheRouterPredictsNothingWhileEnginesReportCached) {
  // One request short of the minimum: too few to judge.
  EXPECT_FALSE(observe("llama", 19, 0, 500));
  const auto warning = observe("llama", 1, 0, 500);
  ASSERT_TRUE(warning);
  EXPECT_EQ(warning->model, "llama");
  EXPECT_EQ(warning->kind, CacheMismatch::router_sees_no_cache);
  EXPECT_EQ(warning->window.requests, 20U);
  EXPECT_DOUBLE_EQ(warning->window.delivered_hit_rate(), 0.5);
  const std::string message = warning->message();
  EXPECT_NE(message.find("model 'llama'"), std::string::npos) << message;
  EXPECT_NE(message.find("predicted 0.0%"), std::string::npos) << message;
  EXPECT_NE(message.find("report 50.0%"), std::string::npos) << message;
  for (const std::string_view cause : {"tokenizer mismatch", "chat template not applied",
                                       "block size or hash seed", "LoRA namespace"}) {
    EXPECT_NE(message.find(cause), std::string::npos) << cause << " not in: " << message;
  }
}

TEST_F(CacheMismatchDetectorTest, WarnsTheOtherWayWhenEnginesReportNothingCached) {
  const auto warning = observe("qwen", 20, 600, 0);
  ASSERT_TRUE(warning);
  EXPECT_EQ(warning->kind, CacheMismatch::engines_report_no_cache);
  EXPECT_NE(warning->message().find("prefix caching disabled"), std::string::npos)
      << warning->message();
}

TEST_F(CacheMismatchDetectorTest, StaysSilentWhileBothSidesAgree) {
  EXPECT_FALSE(observe("agree", 50, 500, 450));
  EXPECT_FALSE(observe("cold", 50, 0, 0));
  // Both small but not near zero on one side only: no disagreement that matters.
  EXPECT_FALSE(observe("small", 50, 0, 50));
}

TEST_F(CacheMismatchDetectorTest, WarnsAtMostOnceAMinutePerModel) {
  ASSERT_TRUE(observe("llama", 20, 0, 500));
  clock_->advance(59s);
  EXPECT_FALSE(observe("llama", 1, 0, 500));
  // Another model is judged on its own.
  EXPECT_TRUE(observe("qwen", 20, 0, 500));
  clock_->advance(1s);
  EXPECT_TRUE(observe("llama", 1, 0, 500));
  EXPECT_FALSE(observe("llama", 1, 0, 500));
}

TEST_F(CacheMismatchDetectorTest, ForgetsRequestsOlderThanTheWindow) {
  EXPECT_FALSE(observe("llama", 19, 0, 500));
  EXPECT_EQ(detector_.window("llama").requests, 19U);
  // Past the window and the slot the requests were counted in.
  clock_->advance(detector_.options().window + detector_.options().window / 10);
  EXPECT_EQ(detector_.window("llama").requests, 0U);
  // Counted with the 19 forgotten ones it would reach the minimum; alone it does not.
  EXPECT_FALSE(observe("llama", 1, 0, 500));
  EXPECT_EQ(detector_.window("llama").requests, 1U);
}

TEST(RecordCacheOutcomeTest, CountsInTheNodesMetricsAndFeedsTheDetector) {
  MetricsRegistry registry;
  NodeMetrics::describe(registry);
  auto clock = std::make_shared<ManualClock>();
  CacheMismatchDetector detector{clock};
  RateLimitedLog log;
  record_cache_outcome(NodeMetrics{registry}, detector, log, "m", 100, 64, 32);
  EXPECT_EQ(registry.value(NodeMetrics::kPromptTokens, {{"model", "m"}}), 100);
  EXPECT_EQ(registry.value(NodeMetrics::kPredictedCachedTokens, {{"model", "m"}}), 64);
  EXPECT_EQ(registry.value(NodeMetrics::kEngineCachedTokens, {{"model", "m"}}), 32);
  EXPECT_EQ(detector.window("m").requests, 1U);
  EXPECT_EQ(detector.window("m").engine_cached_tokens, 32U);
}

}  // namespace
}  // namespace kvr::metrics
