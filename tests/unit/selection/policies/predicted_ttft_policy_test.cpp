// predicted-ttft: the lowest predicted time to first token wins, a worker holding most of the
// prompt keeps it within the sticky margin, and the model learns its rates and each worker's
// factor from observed first tokens, robust to outliers.
#include "selection/policies/predicted_ttft/predicted_ttft_policy.hpp"

#include <chrono>
#include <cmath>
#include <string>

#include <gtest/gtest.h>

#include "tests/unit/selection/policies/policy_test_support.hpp"

namespace kvr::selection::policies {
namespace {

using std::chrono::milliseconds;
using TimePoint = std::chrono::steady_clock::time_point;

// A worker with `queued` prefill tokens waiting and `cached_blocks` of the prompt.
testing::FakeWorker worker(WorkerId id, std::size_t queued, double cached_blocks = 0) {
  testing::FakeWorker fake = loaded_worker(id, 1, queued);
  fake.cache = WorkerCacheInput{cached_blocks, 0, 0};
  return fake;
}

class PredictedTtftPolicyTest : public PolicyTest {
 protected:
  PredictedTtftPolicyTest() {
    config_.block_size = 16;
    request_.prompt_tokens = 1600;  // 100 blocks
  }

  WorkerSelectionPolicy policy(PredictedTtftParameters parameters = {}) {
    parameters.seed = 1;
    return make_predicted_ttft_policy(parameters, config_, WorkerType::Aggregated, partition_);
  }
};

TEST_F(PredictedTtftPolicyTest, TheWorkerHoldingThePromptWinsWhenQueuesAreEqual) {
  signals_.set_workers({worker(1, 2000, 0), worker(2, 2000, 90), worker(3, 2000, 10)});
  auto predicted = policy();
  EXPECT_EQ(pick(predicted), 2U);
}

TEST_F(PredictedTtftPolicyTest, ALongQueueOutweighsTheCacheBeyondTheMargin) {
  // Worker 2 holds the whole prompt but has 40k tokens queued: about 25 + 21 * 40 = 865 ms
  // against 25 + 21 * 1.6 = 59 ms on the idle worker 1.
  signals_.set_workers({worker(1, 0, 0), worker(2, 40'000, 100)});
  auto predicted = policy();
  EXPECT_EQ(pick(predicted), 1U);
}

TEST_F(PredictedTtftPolicyTest, TheHolderKeepsThePromptWithinTheStickyMargin) {
  // Without stickiness the idle uncached worker 1 is predicted faster (59 ms against 25 + 21 *
  // 2.0 = 67 ms); worker 2 holds all of the prompt and is within 20% of it.
  signals_.set_workers({worker(1, 0, 0), worker(2, 2000, 100)});
  auto sticky = policy();
  EXPECT_EQ(pick(sticky), 2U);
  auto greedy = policy({.sticky_margin = 0});
  EXPECT_EQ(pick(greedy), 1U);
  // Worker 2 now holds 40% of the prompt, predicted 25 + 21 * 1.66 = 59.9 ms against 58.6 ms:
  // kept only when sticky_fraction allows a holder of 40%.
  signals_.set_workers({worker(1, 0, 0), worker(2, 700, 40)});
  auto half = policy({.sticky_fraction = 0.5});
  EXPECT_EQ(pick(half), 1U);
  auto third = policy({.sticky_fraction = 0.3});
  EXPECT_EQ(pick(third), 2U);
}

TEST_F(PredictedTtftPolicyTest, TheCostIsThePredictionInMilliseconds) {
  signals_.set_workers({worker(1, 1000, 50)});
  auto predicted = policy();
  auto result = select(predicted);
  ASSERT_TRUE(result) << result.error().message();
  // 800 uncached + 1000 queued tokens, KV usage 0: 25 + 21 * 1.8.
  EXPECT_NEAR(result->total_cost, 25 + 21 * 1.8, 1e-9);
}

TEST(TtftModelTest, LearnsRatesTwiceThePriorsFromObservations) {
  TtftModel model{TtftRates{}, TtftLearning{.memory = 500, .worker_factor_weight = 0}};
  const WorkerWithDpRank worker{1, 0};
  // An engine twice as slow as the prior in every term.
  const auto truth = [](const TtftFeatures& f) {
    return 50 + 42 * f.work_k_tokens + 80 * f.kv_usage + 8 * f.work_k_tokens * f.kv_usage;
  };
  const TtftFeatures probe{.work_k_tokens = 10, .kv_usage = 0.5};
  const double error_before = std::abs(model.predict_ms(worker, probe) - truth(probe));
  for (int i = 0; i < 2000; ++i) {
    const TtftFeatures features{.work_k_tokens = (i * 7 % 40) / 2.0,
                                .kv_usage = (i * 13 % 10) / 10.0};
    model.learn(worker, features, truth(features));
  }
  const double error_after = std::abs(model.predict_ms(worker, probe) - truth(probe));
  EXPECT_LT(error_after, 0.05 * error_before);
  EXPECT_NEAR(model.rates().prefill_ms_per_1k_tokens, 42, 2);
  EXPECT_EQ(model.observations(), 2000U);
}

TEST(TtftModelTest, OneOutlierMovesTheModelLittle) {
  TtftModel model{TtftRates{}, TtftLearning{.worker_factor_weight = 0}};
  const WorkerWithDpRank worker{1, 0};
  for (int i = 0; i < 500; ++i) {
    const TtftFeatures features{.work_k_tokens = (i % 20) * 1.0, .kv_usage = 0.2};
    model.learn(worker, features, model.predict_ms(worker, features));
  }
  const TtftFeatures probe{.work_k_tokens = 5, .kv_usage = 0.2};
  const double before = model.predict_ms(worker, probe);
  model.learn(worker, probe, 100'000);  // a stalled engine: 100 s
  EXPECT_LT(std::abs(model.predict_ms(worker, probe) - before), 0.1 * before);
}

TEST(TtftModelTest, ASlowerWorkerLearnsAFactorAboveOne) {
  TtftModel model{TtftRates{}, TtftLearning{.enabled = true, .worker_factor_weight = 0.05}};
  const WorkerWithDpRank fast{1, 0};
  const WorkerWithDpRank slow{2, 0};
  const auto base = [](const TtftFeatures& f) { return 25 + 21 * f.work_k_tokens; };
  for (int i = 0; i < 1000; ++i) {
    const TtftFeatures features{.work_k_tokens = (i % 10) * 1.0};
    model.learn(fast, features, base(features));
    model.learn(slow, features, 1.5 * base(features));
  }
  // The fleet's rates sit between the two; each worker's factor takes it to its own speed.
  EXPECT_NEAR(model.worker_factor(slow) / model.worker_factor(fast), 1.5, 0.1);
  const TtftFeatures probe{.work_k_tokens = 4};
  EXPECT_NEAR(model.predict_ms(fast, probe), base(probe), 0.1 * base(probe));
  EXPECT_NEAR(model.predict_ms(slow, probe), 1.5 * base(probe), 0.1 * 1.5 * base(probe));
  // Never beyond twice the fleet's.
  for (int i = 0; i < 400; ++i) model.learn(slow, {.work_k_tokens = 1}, 1e6);
  EXPECT_LE(model.worker_factor(slow), 2.0 + 1e-9);
}

TEST(TtftModelTest, FollowsRoutedRequestsToTheirFirstTokenAndForgetsEndedOnes) {
  TtftModel model{TtftRates{}, TtftLearning{}};
  const TimePoint t0{milliseconds{1000}};
  const WorkerLoadInput load{WorkerLoadInput::Values{.active_prefill_tokens = 1000}};
  RoutedRequest routed{.request_id = "a",
                       .worker = {3, 0},
                       .prompt_tokens = 1000,
                       .block_size = 16,
                       .cache = WorkerCacheInput{},
                       .load = load,
                       .routed_at = t0};
  model.on_routed(routed);
  const auto calibration = model.on_first_token("a", t0 + milliseconds{120});
  ASSERT_TRUE(calibration);
  EXPECT_EQ(calibration->worker.worker_id, 3U);
  EXPECT_NEAR(calibration->predicted_seconds, (25 + 21 * 2.0) / 1000, 1e-9);
  EXPECT_NEAR(calibration->observed_seconds, 0.120, 1e-9);
  EXPECT_EQ(model.observations(), 1U);
  // A second first token of the same request, and an unknown one, are nothing to learn from.
  EXPECT_FALSE(model.on_first_token("a", t0 + milliseconds{130}));
  EXPECT_FALSE(model.on_first_token("never", t0));

  // A request that ended before its first token is forgotten, not learnt from.
  routed.request_id = "b";
  model.on_routed(routed);
  model.on_ended("b", RoutedRequestEnd::Cancelled, t0 + milliseconds{5});
  EXPECT_FALSE(model.on_first_token("b", t0 + milliseconds{500}));

  // A request booked without the policy's signals (a pin) is not followed.
  routed.request_id = "c";
  routed.load.reset();
  model.on_routed(routed);
  EXPECT_FALSE(model.on_first_token("c", t0 + milliseconds{50}));
  EXPECT_EQ(model.observations(), 1U);
}

TEST(TtftModelTest, LearntValuesNameTheRatesAndEachWorkersFactorRelativeToTheFleet) {
  TtftModel model{TtftRates{}, TtftLearning{}};
  model.learn({7, 0}, {.work_k_tokens = 1}, 80);  // slower than the 46 ms predicted
  model.learn({8, 0}, {.work_k_tokens = 1}, 40);  // faster
  const auto values = model.learnt_values();
  ASSERT_GE(values.size(), 2U);
  EXPECT_EQ(values.front().name, "step_ms");
  EXPECT_FALSE(values.front().worker);
  const LearntValue& slow = values[values.size() - 2];
  const LearntValue& fast = values.back();
  EXPECT_EQ(slow.name, "worker_factor");
  EXPECT_EQ(slow.worker, 7U);
  EXPECT_EQ(fast.worker, 8U);
  EXPECT_GT(slow.value, 1.0);
  EXPECT_LT(fast.value, 1.0);
}

TEST(TtftModelTest, WithoutLearningThePriorStays) {
  TtftModel model{TtftRates{}, TtftLearning{.enabled = false}};
  model.learn({1, 0}, {.work_k_tokens = 3}, 5000);
  EXPECT_EQ(model.observations(), 0U);
  EXPECT_DOUBLE_EQ(model.predict_ms({1, 0}, {.work_k_tokens = 1}), 46);
}

TEST(PredictedTtftParametersTest, ValidationNamesTheParameter) {
  PredictedTtftParameters parameters;
  parameters.memory = 5;
  auto valid = parameters.validate();
  ASSERT_FALSE(valid);
  EXPECT_NE(valid.error().message().find("memory"), std::string::npos);
  parameters = {};
  parameters.prior.prefill_ms_per_1k_tokens = -1;
  valid = parameters.validate();
  ASSERT_FALSE(valid);
  EXPECT_NE(valid.error().message().find("prior_prefill_ms_per_1k_tokens"), std::string::npos);
}

}  // namespace
}  // namespace kvr::selection::policies
