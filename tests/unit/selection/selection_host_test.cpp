// The host rules of docs/policies.md: eligibility, filter order, scorer sums and checks, picker
// bounds, lazy and restricted signal groups, and exception containment.
#include "selection/selection_host.hpp"

#include <chrono>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/testing/fake_worker_signals.hpp"

namespace kvr::selection {
namespace {

using plugins::worker_selection::ScoredWorkerCandidate;
using plugins::worker_selection::UndeclaredSignalGroup;
using plugins::worker_selection::WorkerInputView;
using plugins::worker_selection::WorkerSelectionContext;
using testing::FakeWorker;
using testing::FakeWorkerSignals;
using Kind = WorkerSelectionPolicyError::Kind;

// A scorer whose cost is a function of the candidate.
class FunctionScorer final : public WorkerScorer {
 public:
  FunctionScorer(WorkerInputs inputs,
                 std::function<PolicyResult<double>(const WorkerCandidate&)> fn)
      : inputs_(inputs), fn_(std::move(fn)) {}
  WorkerInputs required_worker_inputs() const override { return inputs_; }
  PolicyResult<double> score(const WorkerSelectionContext&, const WorkerCandidate& c) override {
    return fn_(c);
  }

 private:
  WorkerInputs inputs_;
  std::function<PolicyResult<double>(const WorkerCandidate&)> fn_;
};

class FunctionFilter final : public WorkerFilter {
 public:
  FunctionFilter(WorkerInputs inputs, std::function<PolicyResult<bool>(const WorkerCandidate&)> fn)
      : inputs_(inputs), fn_(std::move(fn)) {}
  WorkerInputs required_worker_inputs() const override { return inputs_; }
  PolicyResult<bool> keep(const WorkerSelectionContext&, const WorkerCandidate& c) override {
    return fn_(c);
  }

 private:
  WorkerInputs inputs_;
  std::function<PolicyResult<bool>(const WorkerCandidate&)> fn_;
};

// True when `read` returns a signal group; false when the group was not declared.
template <class Read>
bool readable(Read read) {
  try {
    (void)read();
    return true;
  } catch (const UndeclaredSignalGroup&) {
    return false;
  }
}

// Picks the lowest cost (first on ties), or a fixed row when one is set.
class LowestCostPicker final : public WorkerPicker {
 public:
  explicit LowestCostPicker(WorkerInputs inputs = WorkerInputs::NONE,
                            std::optional<std::size_t> fixed_row = std::nullopt)
      : inputs_(inputs), fixed_row_(fixed_row) {}
  WorkerInputs required_worker_inputs() const override { return inputs_; }
  PolicyResult<std::size_t> pick(const WorkerSelectionContext&,
                                 const WorkerInputView& view) override {
    last_view_had_cache = readable([&] { return view.cache(); });
    last_view_had_load = readable([&] { return view.load(); });
    last_candidate_count = view.candidates().size();
    if (fixed_row_) return *fixed_row_;
    std::size_t best = 0;
    for (std::size_t i = 1; i < view.candidates().size(); ++i) {
      if (view.candidates()[i].cost() < view.candidates()[best].cost()) best = i;
    }
    return best;
  }
  bool last_view_had_cache = false;
  bool last_view_had_load = false;
  std::size_t last_candidate_count = 0;

 private:
  WorkerInputs inputs_;
  std::optional<std::size_t> fixed_row_;
};

FakeWorker worker(WorkerId id, DpRank rank = 0) {
  FakeWorker fake;
  fake.worker = {id, rank};
  fake.load = WorkerLoadInput::Values{.active_requests = static_cast<std::size_t>(id)};
  return fake;
}

std::vector<std::unique_ptr<WorkerScorer>> scorers_of(std::unique_ptr<WorkerScorer> scorer) {
  std::vector<std::unique_ptr<WorkerScorer>> scorers;
  scorers.push_back(std::move(scorer));
  return scorers;
}

// Cost = worker id, so the lowest id wins unless eligibility or filters remove it.
std::unique_ptr<WorkerScorer> id_scorer() {
  return std::make_unique<FunctionScorer>(WorkerInputs::NONE, [](const WorkerCandidate& c) {
    return PolicyResult<double>{static_cast<double>(c.worker().worker_id)};
  });
}

class SelectionHostTest : public ::testing::Test {
 protected:
  WorkerSelectionPolicy id_policy() {
    return WorkerSelectionPolicy{config_, WorkerType::Aggregated, scorers_of(id_scorer()),
                                 std::make_unique<LowestCostPicker>()};
  }
  std::expected<SelectionResult, WorkerSelectionPolicyError> select(WorkerSelectionPolicy& policy) {
    return select_worker(policy, request_, partition_, signals_);
  }

  RouterConfig config_;
  RoutingPartition partition_{.model = "m"};
  SelectionRequest request_{.request_id = "r", .prompt_tokens = 64};
  FakeWorkerSignals signals_;
};

TEST_F(SelectionHostTest, PicksLowestCostAndReportsPerScorerCosts) {
  signals_.set_workers({worker(3), worker(1), worker(2)});
  std::vector<std::unique_ptr<WorkerScorer>> scorers;
  scorers.push_back(id_scorer());
  scorers.push_back(std::make_unique<FunctionScorer>(
      WorkerInputs::NONE, [](const WorkerCandidate&) { return PolicyResult<double>{0.5}; }));
  WorkerSelectionPolicy policy{config_, WorkerType::Aggregated, std::move(scorers),
                               std::make_unique<LowestCostPicker>()};
  auto result = select(policy);
  ASSERT_TRUE(result) << result.error().message();
  EXPECT_EQ(result->worker, (WorkerWithDpRank{1, 0}));
  EXPECT_DOUBLE_EQ(result->total_cost, 1.5);
  ASSERT_EQ(result->scorer_costs.size(), 2U);
  EXPECT_DOUBLE_EQ(result->scorer_costs[0], 1.0);
  EXPECT_DOUBLE_EQ(result->scorer_costs[1], 0.5);
  EXPECT_EQ(result->eligible_workers, 3U);
  ASSERT_EQ(scorer_names(policy).size(), 2U);
  EXPECT_NE(scorer_names(policy)[0].find("FunctionScorer"), std::string::npos);
}

TEST_F(SelectionHostTest, NoWorkersOfTheTypeIsNoEndpoints) {
  FakeWorker prefill = worker(1);
  prefill.type = WorkerType::Prefill;
  signals_.set_workers({prefill});
  auto policy = id_policy();
  auto result = select(policy);
  ASSERT_FALSE(result);
  EXPECT_EQ(result.error().kind(), Kind::NoEndpoints);
}

TEST_F(SelectionHostTest, AllowListRestrictsEligibility) {
  signals_.set_workers({worker(1), worker(2), worker(3)});
  const std::vector<WorkerId> allowed{3, 2};
  request_.allowed_workers = allowed;
  auto policy = id_policy();
  auto result = select(policy);
  ASSERT_TRUE(result);
  EXPECT_EQ(result->worker.worker_id, 2U);
  EXPECT_EQ(result->eligible_workers, 2U);
}

TEST_F(SelectionHostTest, ExcludedWorkersAreNeverEligible) {
  // Worker 1 would win on cost; excluding it (every rank) leaves worker 2.
  signals_.set_workers({worker(1, 0), worker(1, 1), worker(2), worker(3)});
  const std::vector<WorkerId> excluded{1};
  request_.excluded_workers = excluded;
  auto policy = id_policy();
  auto result = select(policy);
  ASSERT_TRUE(result);
  EXPECT_EQ(result->worker.worker_id, 2U);
  EXPECT_EQ(result->eligible_workers, 2U);
}

TEST_F(SelectionHostTest, ExclusionWinsOverTheAllowListAndThePin) {
  signals_.set_workers({worker(1), worker(2), worker(3)});
  const std::vector<WorkerId> allowed{1, 3};
  const std::vector<WorkerId> excluded{1};
  request_.allowed_workers = allowed;
  request_.excluded_workers = excluded;
  auto policy = id_policy();
  auto result = select(policy);
  ASSERT_TRUE(result);
  EXPECT_EQ(result->worker.worker_id, 3U);

  request_.pinned_worker = WorkerAffinityTarget{.worker_id = 1};
  auto pinned = select(policy);
  ASSERT_FALSE(pinned);
  EXPECT_EQ(pinned.error().kind(), Kind::NoEligibleWorkers);
}

TEST_F(SelectionHostTest, ExcludingEveryWorkerIsNoEligibleWorkers) {
  signals_.set_workers({worker(1), worker(2)});
  const std::vector<WorkerId> excluded{2, 1};
  request_.excluded_workers = excluded;
  auto policy = id_policy();
  auto result = select(policy);
  ASSERT_FALSE(result);
  EXPECT_EQ(result.error().kind(), Kind::NoEligibleWorkers);
  EXPECT_NE(std::string{result.error().message()}.find("exclusions"), std::string::npos)
      << result.error().message();
}

TEST_F(SelectionHostTest, PinnedWorkerWithoutRankAdmitsEveryRank) {
  signals_.set_workers({worker(1), worker(5, 0), worker(5, 1)});
  request_.pinned_worker = WorkerAffinityTarget{.worker_id = 5};
  auto policy = id_policy();
  auto result = select(policy);
  ASSERT_TRUE(result);
  EXPECT_EQ(result->worker.worker_id, 5U);
  EXPECT_EQ(result->eligible_workers, 2U);
}

TEST_F(SelectionHostTest, PinnedRankSelectsExactlyThatRank) {
  signals_.set_workers({worker(1), worker(5, 0), worker(5, 1)});
  request_.pinned_worker = WorkerAffinityTarget{.worker_id = 5, .dp_rank = 1};
  auto policy = id_policy();
  auto result = select(policy);
  ASSERT_TRUE(result);
  EXPECT_EQ(result->worker, (WorkerWithDpRank{5, 1}));
}

TEST_F(SelectionHostTest, PinToAbsentWorkerIsNoEligibleWorkers) {
  signals_.set_workers({worker(1)});
  request_.pinned_worker = WorkerAffinityTarget{.worker_id = 9};
  auto policy = id_policy();
  auto result = select(policy);
  ASSERT_FALSE(result);
  EXPECT_EQ(result.error().kind(), Kind::NoEligibleWorkers);
}

TEST_F(SelectionHostTest, RequiredTaintsMustAllBeCarried) {
  FakeWorker a = worker(1);
  a.taints = {"gpu=h100"};
  FakeWorker b = worker(2);
  b.taints = {"gpu=h100", "region=eu"};
  signals_.set_workers({a, b});
  const std::vector<std::string> required{"region=eu", "gpu=h100"};
  request_.required_taints = required;
  auto policy = id_policy();
  auto result = select(policy);
  ASSERT_TRUE(result);
  EXPECT_EQ(result->worker.worker_id, 2U);
}

TEST_F(SelectionHostTest, BusyWorkersAreNotEligible) {
  FakeWorker full = worker(1);
  full.kv_usage = 0.97;
  FakeWorker prefilling = worker(2);
  prefilling.active_prefill_tokens = 50'000;
  FakeWorker unobserved = worker(4);  // no kv usage known: not judged busy
  signals_.set_workers({full, prefilling, worker(3), unobserved});
  config_.busy_kv_usage_threshold = 0.95;
  config_.busy_prefill_tokens_threshold = 10'000;
  auto policy = id_policy();
  auto result = select(policy);
  ASSERT_TRUE(result);
  EXPECT_EQ(result->worker.worker_id, 3U);
  EXPECT_EQ(result->eligible_workers, 2U);
}

TEST_F(SelectionHostTest, UnavailableWorkersAreNotEligible) {
  FakeWorker down = worker(1);
  down.available = false;
  signals_.set_workers({down, worker(2)});
  auto policy = id_policy();
  auto result = select(policy);
  ASSERT_TRUE(result);
  EXPECT_EQ(result->worker.worker_id, 2U);
}

TEST_F(SelectionHostTest, FiltersRunInDeclarationOrderAndAllMustPass) {
  signals_.set_workers({worker(1), worker(2), worker(3), worker(4)});
  std::vector<std::string> calls;
  std::vector<std::unique_ptr<WorkerFilter>> filters;
  filters.push_back(
      std::make_unique<FunctionFilter>(WorkerInputs::NONE, [&](const WorkerCandidate& c) {
        calls.push_back("first:" + std::to_string(c.worker().worker_id));
        return PolicyResult<bool>{c.worker().worker_id != 1};
      }));
  filters.push_back(
      std::make_unique<FunctionFilter>(WorkerInputs::NONE, [&](const WorkerCandidate& c) {
        calls.push_back("second:" + std::to_string(c.worker().worker_id));
        return PolicyResult<bool>{c.worker().worker_id != 2};
      }));
  WorkerSelectionPolicy policy{config_, WorkerType::Aggregated, std::move(filters),
                               scorers_of(id_scorer()), std::make_unique<LowestCostPicker>()};
  auto result = select(policy);
  ASSERT_TRUE(result);
  EXPECT_EQ(result->worker.worker_id, 3U);
  EXPECT_EQ(result->kept_workers, 2U);
  // The second filter sees only what the first kept.
  EXPECT_EQ(calls, (std::vector<std::string>{"first:1", "first:2", "first:3", "first:4", "second:2",
                                             "second:3", "second:4"}));
}

TEST_F(SelectionHostTest, AllFilteredFailsTheSelection) {
  signals_.set_workers({worker(1), worker(2)});
  std::vector<std::unique_ptr<WorkerFilter>> filters;
  filters.push_back(std::make_unique<FunctionFilter>(
      WorkerInputs::NONE, [](const WorkerCandidate&) { return PolicyResult<bool>{false}; }));
  WorkerSelectionPolicy policy{config_, WorkerType::Aggregated, std::move(filters),
                               scorers_of(id_scorer()), std::make_unique<LowestCostPicker>()};
  auto result = select(policy);
  ASSERT_FALSE(result);
  EXPECT_EQ(result.error().kind(), Kind::AllFiltered);
  EXPECT_NE(result.error().message().find("all eligible workers filtered"), std::string::npos);
}

TEST_F(SelectionHostTest, FilterFailurePropagatesItsMessage) {
  signals_.set_workers({worker(1)});
  std::vector<std::unique_ptr<WorkerFilter>> filters;
  filters.push_back(
      std::make_unique<FunctionFilter>(WorkerInputs::NONE, [](const WorkerCandidate&) {
        return PolicyResult<bool>{
            std::unexpected(WorkerSelectionPolicyError::failed("quota store unavailable"))};
      }));
  WorkerSelectionPolicy policy{config_, WorkerType::Aggregated, std::move(filters),
                               scorers_of(id_scorer()), std::make_unique<LowestCostPicker>()};
  auto result = select(policy);
  ASSERT_FALSE(result);
  EXPECT_EQ(result.error().kind(), Kind::Failed);
  EXPECT_NE(result.error().message().find("quota store unavailable"), std::string::npos);
  EXPECT_NE(result.error().message().find("filter 0"), std::string::npos);
}

TEST_F(SelectionHostTest, NonFiniteContributionNamesScorerAndRow) {
  signals_.set_workers({worker(1), worker(2)});
  std::vector<std::unique_ptr<WorkerScorer>> scorers;
  scorers.push_back(id_scorer());
  scorers.push_back(
      std::make_unique<FunctionScorer>(WorkerInputs::NONE, [](const WorkerCandidate& c) {
        return PolicyResult<double>{c.worker().worker_id == 2 ? std::nan("") : 0.0};
      }));
  WorkerSelectionPolicy policy{config_, WorkerType::Aggregated, std::move(scorers),
                               std::make_unique<LowestCostPicker>()};
  auto result = select(policy);
  ASSERT_FALSE(result);
  EXPECT_EQ(result.error().kind(), Kind::NonFiniteCost);
  EXPECT_NE(result.error().message().find("scorer 1"), std::string::npos);
  EXPECT_NE(result.error().message().find("row 1 (worker 2"), std::string::npos);
}

TEST_F(SelectionHostTest, InfiniteTotalFailsEvenWhenEachContributionIsFinite) {
  signals_.set_workers({worker(1)});
  std::vector<std::unique_ptr<WorkerScorer>> scorers;
  for (int i = 0; i < 2; ++i) {
    scorers.push_back(
        std::make_unique<FunctionScorer>(WorkerInputs::NONE, [](const WorkerCandidate&) {
          return PolicyResult<double>{std::numeric_limits<double>::max()};
        }));
  }
  WorkerSelectionPolicy policy{config_, WorkerType::Aggregated, std::move(scorers),
                               std::make_unique<LowestCostPicker>()};
  auto result = select(policy);
  ASSERT_FALSE(result);
  EXPECT_EQ(result.error().kind(), Kind::NonFiniteCost);
  EXPECT_NE(result.error().message().find("total cost"), std::string::npos);
}

// A batch scorer that forgets the last row (from its `forget_from`-th call on).
class ForgetfulBatchScorer final : public WorkerScorer {
 public:
  explicit ForgetfulBatchScorer(int forget_from = 0) : forget_from_(forget_from) {}
  PolicyResult<double> score(const WorkerSelectionContext&, const WorkerCandidate&) override {
    return 0.0;
  }
  PolicyResult<void> score_all(const WorkerSelectionContext&, std::span<const WorkerCandidate> rows,
                               std::span<double> costs) override {
    const std::size_t written = calls_++ >= forget_from_ ? rows.size() - 1 : rows.size();
    for (std::size_t i = 0; i < written; ++i) costs[i] = 1.0;
    return {};
  }

 private:
  int forget_from_;
  int calls_ = 0;
};

TEST_F(SelectionHostTest, UnwrittenScoreSlotFailsTheSelection) {
  signals_.set_workers({worker(1), worker(2), worker(3)});
  WorkerSelectionPolicy policy{config_, WorkerType::Aggregated,
                               scorers_of(std::make_unique<ForgetfulBatchScorer>()),
                               std::make_unique<LowestCostPicker>()};
  auto result = select(policy);
  ASSERT_FALSE(result);
  EXPECT_EQ(result.error().kind(), Kind::NonFiniteCost);
  EXPECT_NE(result.error().message().find("row 2"), std::string::npos);
}

TEST_F(SelectionHostTest, UnwrittenSlotFailsEvenWhereAnEarlierSelectionWroteIt) {
  signals_.set_workers({worker(1), worker(2), worker(3)});
  WorkerSelectionPolicy policy{config_, WorkerType::Aggregated,
                               scorers_of(std::make_unique<ForgetfulBatchScorer>(1)),
                               std::make_unique<LowestCostPicker>()};
  ASSERT_TRUE(select(policy));
  auto result = select(policy);
  ASSERT_FALSE(result);
  EXPECT_EQ(result.error().kind(), Kind::NonFiniteCost);
  EXPECT_NE(result.error().message().find("row 2"), std::string::npos);
}

TEST_F(SelectionHostTest, UnwrittenSlotOfALaterScorerAfterFilteringFailsTheSelection) {
  signals_.set_workers({worker(1), worker(2), worker(3), worker(4)});
  std::vector<std::unique_ptr<WorkerFilter>> filters;
  filters.push_back(std::make_unique<FunctionFilter>(
      WorkerInputs::NONE,
      [](const WorkerCandidate& c) { return PolicyResult<bool>{c.worker().worker_id != 2}; }));
  std::vector<std::unique_ptr<WorkerScorer>> scorers;
  scorers.push_back(id_scorer());
  scorers.push_back(std::make_unique<ForgetfulBatchScorer>());
  WorkerSelectionPolicy policy{config_, WorkerType::Aggregated, std::move(filters),
                               std::move(scorers), std::make_unique<LowestCostPicker>()};
  auto result = select(policy);
  ASSERT_FALSE(result);
  EXPECT_EQ(result.error().kind(), Kind::NonFiniteCost);
  EXPECT_NE(result.error().message().find("scorer 1"), std::string::npos);
  EXPECT_NE(result.error().message().find("row 2 (worker 4"), std::string::npos)
      << result.error().message();
}

TEST_F(SelectionHostTest, PickerRowIsBoundsChecked) {
  signals_.set_workers({worker(1), worker(2)});
  WorkerSelectionPolicy policy{config_, WorkerType::Aggregated, scorers_of(id_scorer()),
                               std::make_unique<LowestCostPicker>(WorkerInputs::NONE, 2)};
  auto result = select(policy);
  ASSERT_FALSE(result);
  EXPECT_EQ(result.error().kind(), Kind::InvalidPickerRow);
  EXPECT_NE(result.error().message().find("row 2 of 2"), std::string::npos);
}

TEST_F(SelectionHostTest, SignalGroupsAreComputedOnlyWhenDeclared) {
  signals_.set_workers({worker(1), worker(2)});
  auto plain = id_policy();
  ASSERT_TRUE(select(plain));
  EXPECT_EQ(signals_.cache_requests(), 0);
  EXPECT_EQ(signals_.load_requests(), 0);

  WorkerSelectionPolicy with_load{
      config_, WorkerType::Aggregated,
      scorers_of(std::make_unique<FunctionScorer>(WorkerInputs::LOAD,
                                                  [](const WorkerCandidate& c) {
                                                    return PolicyResult<double>{static_cast<double>(
                                                        c.load()->active_requests())};
                                                  })),
      std::make_unique<LowestCostPicker>()};
  ASSERT_TRUE(select(with_load));
  EXPECT_EQ(signals_.cache_requests(), 0);
  EXPECT_EQ(signals_.load_requests(), 1);
}

TEST_F(SelectionHostTest, EachComponentSeesOnlyItsOwnGroups) {
  signals_.set_workers({worker(1), worker(2)});
  bool scorer_saw_cache = true;
  bool scorer_saw_load = false;
  bool filter_saw_load = true;
  bool filter_saw_taint = false;
  std::vector<std::unique_ptr<WorkerFilter>> filters;
  filters.push_back(std::make_unique<FunctionFilter>(
      WorkerInputs::PREFERRED_TAINT, [&](const WorkerCandidate& c) {
        filter_saw_load = readable([&] { return c.load(); });
        filter_saw_taint = c.preferred_taint_multiplier().has_value();
        return PolicyResult<bool>{true};
      }));
  auto picker = std::make_unique<LowestCostPicker>(WorkerInputs::CACHE);
  auto* picker_view = picker.get();
  WorkerSelectionPolicy policy{config_, WorkerType::Aggregated, std::move(filters),
                               scorers_of(std::make_unique<FunctionScorer>(
                                   WorkerInputs::LOAD,
                                   [&](const WorkerCandidate& c) {
                                     scorer_saw_cache = readable([&] { return c.cache(); });
                                     scorer_saw_load = readable([&] { return c.load(); });
                                     return PolicyResult<double>{0.0};
                                   })),
                               std::move(picker)};
  ASSERT_TRUE(select(policy));
  EXPECT_FALSE(filter_saw_load);
  EXPECT_TRUE(filter_saw_taint);
  EXPECT_FALSE(scorer_saw_cache);
  EXPECT_TRUE(scorer_saw_load);
  EXPECT_TRUE(picker_view->last_view_had_cache);
  EXPECT_FALSE(picker_view->last_view_had_load);
}

// A picker that reads the load group whether or not it declared it.
class LoadReadingPicker final : public WorkerPicker {
 public:
  WorkerInputs required_worker_inputs() const override { return WorkerInputs::CACHE; }
  PolicyResult<std::size_t> pick(const WorkerSelectionContext&,
                                 const WorkerInputView& view) override {
    return (*view.load())[0].active_requests() > 0 ? 0 : 1;
  }
};

TEST_F(SelectionHostTest, ReadingAnUndeclaredGroupFailsTheSelectionNamingComponentAndGroup) {
  signals_.set_workers({worker(1), worker(2)});
  WorkerSelectionPolicy scorer_reads_cache{
      config_,
      WorkerType::Aggregated,
      {},
      scorers_of(std::make_unique<FunctionScorer>(WorkerInputs::LOAD,
                                                  [](const WorkerCandidate& c) {
                                                    return PolicyResult<double>{
                                                        c.cache()->device_overlap_blocks()};
                                                  })),
      std::make_unique<LowestCostPicker>()};
  auto failed = select(scorer_reads_cache);
  ASSERT_FALSE(failed);
  EXPECT_THAT(
      std::string{failed.error().message()},
      ::testing::AllOf(::testing::HasSubstr("scorer 0"), ::testing::HasSubstr("FunctionScorer"),
                       ::testing::HasSubstr("CACHE signal group")));

  WorkerSelectionPolicy picker_reads_load{
      config_, WorkerType::Aggregated, {}, {}, std::make_unique<LoadReadingPicker>()};
  failed = select(picker_reads_load);
  ASSERT_FALSE(failed);
  EXPECT_THAT(std::string{failed.error().message()},
              ::testing::AllOf(::testing::HasSubstr("LoadReadingPicker"),
                               ::testing::HasSubstr("LOAD signal group")));
  // The host is unharmed: a policy that declares what it reads is served on the same signals.
  WorkerSelectionPolicy declared{config_,
                                 WorkerType::Aggregated,
                                 {},
                                 {},
                                 std::make_unique<LowestCostPicker>(WorkerInputs::LOAD)};
  EXPECT_TRUE(select(declared));
}

TEST_F(SelectionHostTest, LoadWithoutObservationIsUnavailableNotIdle) {
  FakeWorker fresh = worker(1);
  fresh.load.reset();
  signals_.set_workers({fresh});
  std::optional<bool> available;
  WorkerSelectionPolicy policy{
      config_, WorkerType::Aggregated,
      scorers_of(std::make_unique<FunctionScorer>(WorkerInputs::LOAD,
                                                  [&](const WorkerCandidate& c) {
                                                    available = c.load()->is_available();
                                                    return PolicyResult<double>{0.0};
                                                  })),
      std::make_unique<LowestCostPicker>()};
  ASSERT_TRUE(select(policy));
  EXPECT_EQ(available, false);
}

TEST_F(SelectionHostTest, ExceptionFailsOnlyThatSelection) {
  signals_.set_workers({worker(1), worker(2)});
  bool throw_next = true;
  WorkerSelectionPolicy policy{config_, WorkerType::Aggregated,
                               scorers_of(std::make_unique<FunctionScorer>(
                                   WorkerInputs::NONE,
                                   [&](const WorkerCandidate& c) -> PolicyResult<double> {
                                     if (throw_next) throw std::runtime_error("boom");
                                     return static_cast<double>(c.worker().worker_id);
                                   })),
                               std::make_unique<LowestCostPicker>()};
  auto failed = select(policy);
  ASSERT_FALSE(failed);
  EXPECT_EQ(failed.error().kind(), Kind::Failed);
  EXPECT_NE(failed.error().message().find("boom"), std::string::npos);
  throw_next = false;
  auto next = select(policy);
  ASSERT_TRUE(next);
  EXPECT_EQ(next->worker.worker_id, 1U);
}

// Records, per worker, the multiplier and cost the picker saw.
class RecordingPicker final : public WorkerPicker {
 public:
  WorkerInputs required_worker_inputs() const override { return WorkerInputs::PREFERRED_TAINT; }
  PolicyResult<std::size_t> pick(const WorkerSelectionContext&,
                                 const WorkerInputView& view) override {
    seen.clear();
    for (const ScoredWorkerCandidate& row : view.candidates()) {
      seen[row.worker().worker_id] = {row.preferred_taint_multiplier(), row.cost()};
    }
    return 0;
  }
  std::map<WorkerId, std::pair<std::optional<double>, double>> seen;
};

TEST_F(SelectionHostTest, RowsStayAlignedThroughFiltersScorersAndThePicker) {
  // Per-worker taints, a filter that drops a row in the middle, and scorers with different
  // groups: every component must see each worker's own multiplier, load and cost.
  std::vector<FakeWorker> fleet;
  for (WorkerId id = 1; id <= 5; ++id) {
    FakeWorker fake = worker(id);
    if (id % 2 == 1) fake.taints = {"zone=a"};
    fleet.push_back(fake);
  }
  signals_.set_workers(fleet);
  const std::vector<PreferredTaint> preferred{{"zone=a", 1.0}};
  request_.preferred_taints = preferred;
  const double tainted = std::exp(-std::tanh(1.0));
  const auto multiplier_of = [&](WorkerId id) { return id % 2 == 1 ? tainted : 1.0; };

  std::vector<std::unique_ptr<WorkerFilter>> filters;
  // The filter and the first scorer declare the same groups, so the scorer sees candidates the
  // host rebuilt after the filter removed a row.
  const WorkerInputs load_and_taint = WorkerInputs::LOAD | WorkerInputs::PREFERRED_TAINT;
  filters.push_back(std::make_unique<FunctionFilter>(load_and_taint, [&](const WorkerCandidate& c) {
    EXPECT_EQ(c.load()->active_requests(), c.worker().worker_id);
    EXPECT_EQ(c.preferred_taint_multiplier(), multiplier_of(c.worker().worker_id));
    return PolicyResult<bool>{c.worker().worker_id != 2};
  }));
  std::vector<std::unique_ptr<WorkerScorer>> scorers;
  scorers.push_back(std::make_unique<FunctionScorer>(load_and_taint, [&](const WorkerCandidate& c) {
    EXPECT_EQ(c.preferred_taint_multiplier(), multiplier_of(c.worker().worker_id));
    return PolicyResult<double>{static_cast<double>(c.load()->active_requests())};
  }));
  scorers.push_back(std::make_unique<FunctionScorer>(
      WorkerInputs::PREFERRED_TAINT, [&](const WorkerCandidate& c) {
        EXPECT_THROW((void)c.load(), UndeclaredSignalGroup);
        EXPECT_EQ(c.preferred_taint_multiplier(), multiplier_of(c.worker().worker_id));
        return PolicyResult<double>{*c.preferred_taint_multiplier()};
      }));
  auto picker = std::make_unique<RecordingPicker>();
  auto* recorded = picker.get();
  WorkerSelectionPolicy policy{config_, WorkerType::Aggregated, std::move(filters),
                               std::move(scorers), std::move(picker)};
  // Twice: the second selection reuses the first one's scratch.
  for (int round = 0; round < 2; ++round) {
    auto result = select(policy);
    ASSERT_TRUE(result) << result.error().message();
    EXPECT_EQ(result->kept_workers, 4U);
    ASSERT_EQ(recorded->seen.size(), 4U);
    EXPECT_FALSE(recorded->seen.contains(2));
    for (const auto& [id, row] : recorded->seen) {
      EXPECT_EQ(row.first, multiplier_of(id)) << "worker " << id;
      // The load scorer's active requests equal the worker id (see worker()).
      EXPECT_DOUBLE_EQ(row.second, static_cast<double>(id) + multiplier_of(id)) << "worker " << id;
    }
    EXPECT_EQ(result->worker.worker_id, 1U);
    ASSERT_TRUE(result->load);
    EXPECT_EQ(result->load->active_requests(), 1U);
  }
}

TEST_F(SelectionHostTest, PreferredTaintMultiplierFollowsTheFormula) {
  const std::vector<PreferredTaint> preferred{{"gpu=h100", 0.5}, {"region=eu", 0.25}};
  const std::vector<std::string> both{"gpu=h100", "region=eu"};
  const std::vector<std::string> one{"gpu=h100"};
  const std::vector<std::string> none;
  EXPECT_DOUBLE_EQ(preferred_taint_multiplier(preferred, both), std::exp(-std::tanh(0.75)));
  EXPECT_DOUBLE_EQ(preferred_taint_multiplier(preferred, one), std::exp(-std::tanh(0.5)));
  EXPECT_DOUBLE_EQ(preferred_taint_multiplier(preferred, none), 1.0);
}

TEST_F(SelectionHostTest, ContextCarriesTheRequest) {
  signals_.set_workers({worker(1)});
  const std::vector<BlockHash> hashes{11, 22, 33, 44};
  request_.block_hashes = hashes;
  request_.prompt_tokens = 70;
  config_.block_size = 16;
  request_.affinity_target = WorkerAffinityTarget{.worker_id = 1};
  std::size_t seen_blocks = 0;
  std::size_t seen_hashes = 0;
  std::optional<WorkerAffinityTarget> seen_target;

  class ContextScorer final : public WorkerScorer {
   public:
    explicit ContextScorer(std::function<void(const WorkerSelectionContext&)> fn)
        : fn_(std::move(fn)) {}
    PolicyResult<double> score(const WorkerSelectionContext& context,
                               const WorkerCandidate&) override {
      fn_(context);
      return 0.0;
    }

   private:
    std::function<void(const WorkerSelectionContext&)> fn_;
  };
  WorkerSelectionPolicy policy{
      config_, WorkerType::Aggregated,
      scorers_of(std::make_unique<ContextScorer>([&](const WorkerSelectionContext& context) {
        seen_blocks = context.request_blocks();
        seen_hashes = context.block_hashes().size();
        seen_target = context.affinity_target();
      })),
      std::make_unique<LowestCostPicker>()};
  ASSERT_TRUE(select(policy));
  EXPECT_EQ(seen_blocks, 5U);  // 70 tokens at 16 per block, rounded up
  EXPECT_EQ(seen_hashes, 4U);
  ASSERT_TRUE(seen_target);
  EXPECT_EQ(seen_target->worker_id, 1U);
}

// Counts what it is told; throws from every call when `fail` is set.
class CountingObserver final : public plugins::worker_selection::WorkerSelectionObserver {
 public:
  void on_routed(const plugins::worker_selection::RoutedRequest& request) override {
    if (fail) throw std::runtime_error("observer broke");
    routed.emplace_back(request.request_id);
  }
  std::optional<plugins::worker_selection::TtftCalibration> on_first_token(
      std::string_view request_id, std::chrono::steady_clock::time_point) override {
    if (fail) throw std::runtime_error("observer broke");
    first_tokens.emplace_back(request_id);
    return plugins::worker_selection::TtftCalibration{
        .worker = {1, 0}, .predicted_seconds = 0.5, .observed_seconds = 0.25};
  }
  std::vector<plugins::worker_selection::LearntValue> learnt_values() const override {
    if (fail) throw std::runtime_error("observer broke");
    return {{.name = "rate", .value = 2}};
  }
  bool fail = false;
  std::vector<std::string> routed;
  std::vector<std::string> first_tokens;
};

TEST_F(SelectionHostTest, ObserversAreToldInOrderAndTheirExceptionsAreCaughtAndCounted) {
  auto counting = std::make_shared<CountingObserver>();
  auto broken = std::make_shared<CountingObserver>();
  broken->fail = true;
  WorkerSelectionPolicy policy{config_,
                               WorkerType::Aggregated,
                               {},
                               scorers_of(id_scorer()),
                               std::make_unique<LowestCostPicker>(),
                               {broken, counting}};
  SelectionHost& host = SelectionHost::of(policy);
  ASSERT_TRUE(host.has_observers());
  host.notify_routed({.request_id = "a", .worker = {1, 0}});
  const auto calibration = host.notify_first_token("a", {});
  host.notify_ended("a", plugins::worker_selection::RoutedRequestEnd::Completed, {});
  const auto values = host.learnt_values();

  EXPECT_EQ(counting->routed, std::vector<std::string>{"a"});
  EXPECT_EQ(counting->first_tokens, std::vector<std::string>{"a"});
  ASSERT_TRUE(calibration) << "the working observer's prediction, though the first one threw";
  EXPECT_DOUBLE_EQ(calibration->predicted_seconds, 0.5);
  ASSERT_EQ(values.size(), 1U);
  EXPECT_EQ(values[0].name, "rate");
  // on_routed, on_first_token and learnt_values threw; on_ended is the base's no-op.
  EXPECT_EQ(host.observer_failures(), 3U);
}

TEST_F(SelectionHostTest, ANullObserverIsRefusedAtConstruction) {
  EXPECT_THROW((WorkerSelectionPolicy{config_,
                                      WorkerType::Aggregated,
                                      {},
                                      scorers_of(id_scorer()),
                                      std::make_unique<LowestCostPicker>(),
                                      {nullptr}}),
               std::invalid_argument);
}

}  // namespace
}  // namespace kvr::selection
