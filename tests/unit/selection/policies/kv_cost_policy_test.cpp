// kv-cost: the cost formula row by row, its tier credits and taint multiplier, the batch scorer,
// the lowest-cost and softmax picks, and how parameters fall back to RouterConfig.
#include "selection/policies/kv_cost/kv_cost_policy.hpp"

#include <cmath>
#include <vector>

#include <gtest/gtest.h>

#include "tests/unit/selection/policies/policy_test_support.hpp"

namespace kvr::selection::policies {
namespace {

class KvCostPolicyTest : public PolicyTest {
 protected:
  KvCostPolicyTest() {
    config_.block_size = 16;
    request_.prompt_tokens = 160;  // 10 blocks
  }

  WorkerSelectionPolicy policy(const KvCostParameters& parameters = {}) {
    return make_kv_cost_policy(parameters, config_, WorkerType::Aggregated, partition_);
  }

  // The cost kv-cost gives `worker` when it is the only candidate.
  double cost_of(const testing::FakeWorker& worker, const KvCostParameters& parameters = {}) {
    signals_.set_workers({worker});
    auto kv_cost = policy(parameters);
    auto result = select(kv_cost);
    EXPECT_TRUE(result) << result.error().message();
    return result ? result->total_cost : std::nan("");
  }
};

TEST_F(KvCostPolicyTest, CostOfOneRowMatchesTheFormulaByHand) {
  testing::FakeWorker worker =
      loaded_worker(1, /*active_requests=*/4, /*active_prefill_tokens=*/40, /*decode=*/7);
  worker.cache = WorkerCacheInput{4, 2, 4};
  worker.taints = {"gpu=h100"};
  const std::vector<PreferredTaint> preferred{{"gpu=h100", 0.5}};
  request_.preferred_taints = preferred;

  // credit 4·1 + 2·0.75 + 4·0.25 = 6.5, so 3.5 of the 10 request blocks need prefill; queued
  // prefill 40/16 = 2.5 blocks; (2·(2.5 + 3.5) + 7 + 0.5·4) · exp(−tanh(0.5)).
  const double expected = 21.0 * std::exp(-std::tanh(0.5));
  EXPECT_DOUBLE_EQ(cost_of(worker, {.prefill_load_scale = 2.0, .active_request_weight = 0.5}),
                   expected);
}

TEST_F(KvCostPolicyTest, OverlapIsCreditedByTier) {
  // 8 overlap blocks of a 10-block prompt on one tier each: 10 − 8·credit blocks remain.
  EXPECT_DOUBLE_EQ(cost_of(cached_worker(1, {8, 0, 0})), 2.0);
  EXPECT_DOUBLE_EQ(cost_of(cached_worker(1, {0, 8, 0})), 4.0);
  EXPECT_DOUBLE_EQ(cost_of(cached_worker(1, {0, 0, 8})), 8.0);
  EXPECT_DOUBLE_EQ(cost_of(cached_worker(1, {0, 8, 0}), {.host_overlap_credit = 0.5}), 6.0);
}

TEST_F(KvCostPolicyTest, DeviceOverlapWinsOverTheSameOverlapOnSlowerTiers) {
  signals_.set_workers(
      {cached_worker(1, {0, 0, 8}), cached_worker(2, {8, 0, 0}), cached_worker(3, {0, 8, 0})});
  auto kv_cost = policy();
  EXPECT_EQ(pick(kv_cost), 2U);
}

TEST_F(KvCostPolicyTest, CreditNeverMakesPrefillNegative) {
  testing::FakeWorker worker = loaded_worker(1, 0, 0, /*decode=*/3);
  worker.cache = WorkerCacheInput{12, 0, 0};  // more overlap than the prompt has blocks
  EXPECT_DOUBLE_EQ(cost_of(worker), 3.0);
}

TEST_F(KvCostPolicyTest, PreferredTaintMultiplierLowersTheCost) {
  testing::FakeWorker plain = loaded_worker(1, 2, 0, 6);
  testing::FakeWorker preferred = loaded_worker(2, 2, 0, 6);
  preferred.taints = {"zone=a"};
  const std::vector<PreferredTaint> taints{{"zone=a", 1.0}};
  request_.preferred_taints = taints;
  signals_.set_workers({plain, preferred});
  auto kv_cost = policy();
  auto result = select(kv_cost);
  ASSERT_TRUE(result) << result.error().message();
  EXPECT_EQ(result->worker.worker_id, 2U);
  EXPECT_DOUBLE_EQ(result->total_cost, cost_of(plain) * std::exp(-std::tanh(1.0)));
}

TEST_F(KvCostPolicyTest, WorkerWithoutLoadObservationHasNoLoadTerms) {
  testing::FakeWorker fresh = cached_worker(1, {6, 0, 0});
  fresh.load.reset();
  EXPECT_DOUBLE_EQ(cost_of(fresh, {.active_request_weight = 5.0}), 4.0);
}

TEST_F(KvCostPolicyTest, BatchScoringEqualsScoringEachRow) {
  const std::vector<WorkerCacheInput> cache{{1, 2, 3}, {0, 0, 0}, {9, 1, 0}, {0.5, 0, 0}};
  const std::vector<WorkerLoadInput> load{
      WorkerLoadInput{{.active_requests = 3, .active_prefill_tokens = 17, .decode_cost_blocks = 2}},
      WorkerLoadInput{}, WorkerLoadInput{{.active_requests = 1, .decode_cost_blocks = 0.5}},
      WorkerLoadInput{{.active_prefill_tokens = 1'000'003, .decode_cost_blocks = 1}}};
  const std::vector<WorkerCandidate> candidates{
      WorkerCandidate{{1, 0}, &cache[0], &load[0], 0.8},
      WorkerCandidate{{2, 0}, &cache[1], &load[1], 1.0},
      WorkerCandidate{{3, 1}, &cache[2], &load[2], std::nullopt},
      WorkerCandidate{{4, 0}, &cache[3], &load[3], std::nullopt}};
  KvCostScorer scorer{{.prefill_load_scale = 1.5, .active_request_weight = 0.25}};
  // The batch form multiplies by the reciprocal of a power-of-two block size and divides by any
  // other; both must give exactly what score() gives.
  for (const std::uint32_t block_size : {16U, 12U, 1U}) {
    const WorkerSelectionContext context{request_, block_size, WorkerType::Aggregated, partition_};
    std::vector<double> costs(candidates.size(), std::nan(""));
    ASSERT_TRUE(scorer.score_all(context, candidates, costs));
    for (std::size_t row = 0; row < candidates.size(); ++row) {
      auto single = scorer.score(context, candidates[row]);
      ASSERT_TRUE(single);
      EXPECT_EQ(costs[row], *single) << "block size " << block_size << ", row " << row;
    }
  }
}

TEST_F(KvCostPolicyTest, ZeroTemperatureSpreadsTiesUniformlyAndNeverPicksAHigherCost) {
  signals_.set_workers({cached_worker(1, {5, 0, 0}), cached_worker(2, {2, 0, 0}),
                        cached_worker(3, {5, 0, 0}), cached_worker(4, {5, 0, 0}),
                        cached_worker(5, {1, 0, 0})});
  auto kv_cost = policy({.seed = 7});
  const auto counts = pick_counts(kv_cost, 600);
  EXPECT_FALSE(counts.contains(2));
  EXPECT_FALSE(counts.contains(5));
  for (const WorkerId tied : {1U, 3U, 4U}) {
    ASSERT_TRUE(counts.contains(tied)) << "worker " << tied;
    EXPECT_GT(counts.at(tied), 150) << "worker " << tied;  // 200 expected of each
  }
}

TEST_F(KvCostPolicyTest, PositiveTemperaturePrefersLowerCosts) {
  // Costs 0, 5 and 10 blocks normalise to 0, 0.5 and 1; at temperature 0.25 the weights are
  // 1, e^-2 and e^-4, about 86%, 12% and 2% of the picks.
  request_.prompt_tokens = 160;
  signals_.set_workers(
      {cached_worker(1, {10, 0, 0}), cached_worker(2, {5, 0, 0}), cached_worker(3, {0, 0, 0})});
  auto kv_cost = policy({.temperature = 0.25, .seed = 11});
  const auto counts = pick_counts(kv_cost, 2000);
  EXPECT_GT(counts.at(1), counts.at(2));
  EXPECT_GT(counts.at(2), counts.at(3));
  EXPECT_GT(counts.at(3), 0);
  EXPECT_NEAR(counts.at(1) / 2000.0, 0.86, 0.04);
}

TEST_F(KvCostPolicyTest, PositiveTemperatureWithEqualCostsIsUniform) {
  signals_.set_workers({cached_worker(1, {3, 0, 0}), cached_worker(2, {3, 0, 0})});
  auto kv_cost = policy({.temperature = 1.0, .seed = 5});
  const auto counts = pick_counts(kv_cost, 1000);
  EXPECT_NEAR(counts.at(1), 500, 60);
}

TEST_F(KvCostPolicyTest, SameSeedGivesTheSameSequence) {
  signals_.set_workers({cached_worker(1, {4, 0, 0}), cached_worker(2, {3, 0, 0}),
                        cached_worker(3, {4, 0, 0}), cached_worker(4, {1, 0, 0})});
  auto first = policy({.temperature = 0.5, .seed = 42});
  auto second = policy({.temperature = 0.5, .seed = 42});
  auto other = policy({.temperature = 0.5, .seed = 43});
  const auto sequence = picks(first, 200);
  EXPECT_EQ(picks(second, 200), sequence);
  EXPECT_NE(picks(other, 200), sequence);
}

TEST_F(KvCostPolicyTest, AbsentParametersTakeRouterConfigValuesAtFactoryTime) {
  config_.device_overlap_credit = 0.9;
  config_.host_overlap_credit = 0.6;
  config_.disk_overlap_credit = 0.1;
  config_.prefill_load_scale = 2.0;
  config_.active_request_weight = 3.0;
  config_.temperature = 0.7;
  const KvCostSettings inherited =
      KvCostSettings::resolve({}, config_, WorkerType::Aggregated, partition_);
  EXPECT_EQ(inherited.weights.device_overlap_credit, 0.9);
  EXPECT_EQ(inherited.weights.host_overlap_credit, 0.6);
  EXPECT_EQ(inherited.weights.disk_overlap_credit, 0.1);
  EXPECT_EQ(inherited.weights.prefill_load_scale, 2.0);
  EXPECT_EQ(inherited.weights.active_request_weight, 3.0);
  EXPECT_EQ(inherited.temperature, 0.7);

  const KvCostSettings overridden =
      KvCostSettings::resolve({.host_overlap_credit = 0.0, .temperature = 0.0}, config_,
                              WorkerType::Aggregated, partition_);
  EXPECT_EQ(overridden.weights.host_overlap_credit, 0.0);
  EXPECT_EQ(overridden.temperature, 0.0);
  EXPECT_EQ(overridden.weights.device_overlap_credit, 0.9);
}

TEST_F(KvCostPolicyTest, SeedComesFromParameterThenRouterConfigThenPartition) {
  const auto seed_of = [&](const KvCostParameters& parameters, WorkerType type,
                           const RoutingPartition& partition) {
    return KvCostSettings::resolve(parameters, config_, type, partition).seed;
  };
  const RoutingPartition other_model{.model = "other"};
  const std::uint64_t derived = seed_of({}, WorkerType::Aggregated, partition_);
  EXPECT_EQ(seed_of({}, WorkerType::Aggregated, partition_), derived);
  EXPECT_NE(seed_of({}, WorkerType::Prefill, partition_), derived);
  EXPECT_NE(seed_of({}, WorkerType::Aggregated, other_model), derived);

  config_.seed = 99;
  EXPECT_EQ(seed_of({}, WorkerType::Aggregated, partition_), 99U);
  EXPECT_EQ(seed_of({.seed = 5}, WorkerType::Aggregated, partition_), 5U);
}

TEST_F(KvCostPolicyTest, ValidationNamesTheParameterAndItsRange) {
  const auto error_of = [](const KvCostParameters& parameters) {
    auto valid = parameters.validate();
    return valid ? std::string{} : std::string{valid.error().message()};
  };
  EXPECT_EQ(error_of({}), "");
  EXPECT_EQ(error_of({.device_overlap_credit = 1.0, .temperature = 0.0}), "");
  const std::string credit = error_of({.host_overlap_credit = 1.5});
  EXPECT_NE(credit.find("'host_overlap_credit'"), std::string::npos) << credit;
  EXPECT_NE(credit.find("[0, 1]"), std::string::npos) << credit;
  const std::string temperature = error_of({.temperature = -0.1});
  EXPECT_NE(temperature.find("'temperature'"), std::string::npos) << temperature;
  EXPECT_NE(temperature.find(">= 0"), std::string::npos) << temperature;
  EXPECT_NE(error_of({.prefill_load_scale = std::nan("")}).find("'prefill_load_scale'"),
            std::string::npos);
  EXPECT_NE(error_of({.active_request_weight = -1}).find("'active_request_weight'"),
            std::string::npos);
  EXPECT_NE(error_of({.disk_overlap_credit = -0.5}).find("'disk_overlap_credit'"),
            std::string::npos);
}

}  // namespace
}  // namespace kvr::selection::policies
