// Passive worker health on a manual clock: ejection after consecutive failures, a success that
// resets the count, a back-off that grows with repeat ejections and is capped, the ejection cap
// (a fleet-wide failure never ejects every worker), return after the back-off, history dropped on
// leave, and slow start (a joining worker's share ramps up, then stops mattering). The first
// tests drive WorkerHealth alone; the later ones drive it through SelectorState's routing.
#include "selection/partition/worker_health.hpp"

#include <map>

#include <gtest/gtest.h>

#include "messages/clock.hpp"
#include "selection/config/router_policy_config.hpp"
#include "selection/partition/selector_state.hpp"
#include "selection/policies/builtin_policies.hpp"
#include "tests/testing/worker_registration.hpp"

namespace kvr {
namespace {

using namespace std::chrono_literals;

selection::WorkerHealthConfig config(std::uint32_t failures = 3) {
  selection::WorkerHealthConfig health;
  health.consecutive_failures = failures;
  health.base_ejection_time = 1s;
  health.max_ejection_time = 3s;
  health.max_ejection_percent = 50;
  return health;
}

// Reports `count` failures against `worker`; returns the last verdict.
FailureVerdict fail(WorkerHealth& health, WorkerId worker, const ManualClock& clock,
                    std::size_t workers, int count = 1) {
  FailureVerdict verdict;
  for (int i = 0; i < count; ++i) verdict = health.failure(worker, clock.now(), workers);
  return verdict;
}

// Advances the clock and returns the workers whose back-off ended.
std::vector<WorkerId> advance(WorkerHealth& health, ManualClock& clock,
                              std::chrono::milliseconds by) {
  clock.advance(by);
  std::vector<WorkerId> returned;
  health.return_due(clock.now(), returned);
  return returned;
}

TEST(WorkerHealthTest, ConsecutiveFailuresEjectTheWorker) {
  ManualClock clock;
  WorkerHealth health{config(3)};
  EXPECT_FALSE(fail(health, 1, clock, 4, 2).ejected);
  EXPECT_FALSE(health.is_ejected(1));
  const FailureVerdict third = fail(health, 1, clock, 4);
  EXPECT_TRUE(third.ejected);
  EXPECT_EQ(third.backoff, 1s);
  EXPECT_TRUE(health.is_ejected(1));
  EXPECT_EQ(health.ejected(), 1);
  // Reports racing the ejection (requests sent before it) change nothing.
  EXPECT_FALSE(fail(health, 1, clock, 4, 5).ejected);
  EXPECT_EQ(health.ejected(), 1);
}

TEST(WorkerHealthTest, ASuccessResetsTheConsecutiveCount) {
  ManualClock clock;
  WorkerHealth health{config(3)};
  fail(health, 1, clock, 4, 2);
  EXPECT_EQ(health.consecutive_failures(1), 2);
  health.success(1);
  EXPECT_EQ(health.consecutive_failures(1), 0);
  EXPECT_FALSE(fail(health, 1, clock, 4, 2).ejected);
  EXPECT_FALSE(health.is_ejected(1));
  EXPECT_TRUE(fail(health, 1, clock, 4).ejected);
}

TEST(WorkerHealthTest, TheWorkerReturnsWhenItsBackOffEnds) {
  ManualClock clock;
  WorkerHealth health{config(2)};
  ASSERT_TRUE(fail(health, 7, clock, 4, 2).ejected);
  EXPECT_TRUE(advance(health, clock, 999ms).empty());
  EXPECT_TRUE(health.is_ejected(7));
  EXPECT_EQ(advance(health, clock, 1ms), std::vector<WorkerId>{7});
  EXPECT_FALSE(health.is_ejected(7));
  EXPECT_EQ(health.ejected(), 0);
  // It needs a full run of failures again.
  EXPECT_FALSE(fail(health, 7, clock, 4).ejected);
  EXPECT_TRUE(fail(health, 7, clock, 4).ejected);
}

TEST(WorkerHealthTest, TheBackOffGrowsWithRepeatEjectionsAndIsCapped) {
  ManualClock clock;
  WorkerHealth health{config(1)};
  std::vector<std::chrono::milliseconds> backoffs;
  for (int ejection = 0; ejection < 5; ++ejection) {
    const FailureVerdict verdict = fail(health, 3, clock, 4);
    ASSERT_TRUE(verdict.ejected) << "ejection " << ejection;
    backoffs.push_back(verdict.backoff);
    // Fails again right after its return: no healthy stretch forgives anything.
    ASSERT_EQ(advance(health, clock, verdict.backoff), std::vector<WorkerId>{3});
  }
  EXPECT_EQ(backoffs, (std::vector<std::chrono::milliseconds>{1s, 2s, 3s, 3s, 3s}));
}

TEST(WorkerHealthTest, AHealthyStretchForgivesPastEjections) {
  ManualClock clock;
  WorkerHealth health{config(1)};
  ASSERT_EQ(fail(health, 3, clock, 4).backoff, 1s);
  advance(health, clock, 1s);
  ASSERT_EQ(fail(health, 3, clock, 4).backoff, 2s);
  advance(health, clock, 2s);
  // Two base periods in routing without an ejection forget both.
  advance(health, clock, 2s);
  EXPECT_EQ(fail(health, 3, clock, 4).backoff, 1s);
}

TEST(WorkerHealthTest, TheEjectionCapKeepsTheRestInRouting) {
  ManualClock clock;
  WorkerHealth health{config(2)};  // 50 %
  // Four workers: two may be ejected; all four fail (a fleet-wide failure).
  EXPECT_TRUE(fail(health, 1, clock, 4, 2).ejected);
  EXPECT_TRUE(fail(health, 2, clock, 4, 2).ejected);
  const FailureVerdict third = fail(health, 3, clock, 4, 2);
  EXPECT_FALSE(third.ejected);
  EXPECT_TRUE(third.capped);
  EXPECT_FALSE(fail(health, 4, clock, 4, 5).ejected);
  EXPECT_EQ(health.ejected(), 2);
  EXPECT_FALSE(health.is_ejected(3));
  EXPECT_FALSE(health.is_ejected(4));
  // When one returns, the next failure of a worker past its threshold ejects it.
  advance(health, clock, 1s);
  EXPECT_EQ(health.ejected(), 0);
  EXPECT_TRUE(fail(health, 3, clock, 4).ejected);
}

TEST(WorkerHealthTest, TheCapRoundsDownButAllowsOneAndNeverAll) {
  selection::WorkerHealthConfig ten_percent = config();
  ten_percent.max_ejection_percent = 10;
  const WorkerHealth small{ten_percent};
  EXPECT_EQ(small.max_ejected(1), 0);  // a lone worker is never ejected
  EXPECT_EQ(small.max_ejected(2), 1);
  EXPECT_EQ(small.max_ejected(9), 1);
  EXPECT_EQ(small.max_ejected(20), 2);
  selection::WorkerHealthConfig all = config();
  all.max_ejection_percent = 100;
  EXPECT_EQ(WorkerHealth{all}.max_ejected(3), 2);
  selection::WorkerHealthConfig none = config();
  none.max_ejection_percent = 0;
  EXPECT_EQ(WorkerHealth{none}.max_ejected(10), 0);
}

TEST(WorkerHealthTest, ALeavingWorkerDropsItsHistory) {
  ManualClock clock;
  WorkerHealth health{config(2)};
  ASSERT_TRUE(fail(health, 5, clock, 4, 2).ejected);
  health.left(5);
  EXPECT_FALSE(health.is_ejected(5));
  EXPECT_EQ(health.ejected(), 0);
  // Back (a new process): its first failure neither ejects it nor finds an old back-off.
  EXPECT_FALSE(health.joined(5, clock.now()));
  EXPECT_FALSE(fail(health, 5, clock, 4).ejected);
  EXPECT_EQ(fail(health, 5, clock, 4).backoff, 1s);
}

TEST(WorkerHealthTest, ZeroConsecutiveFailuresNeverEjects) {
  ManualClock clock;
  WorkerHealth health{config(0)};
  EXPECT_FALSE(fail(health, 1, clock, 4, 100).ejected);
  EXPECT_EQ(health.ejected(), 0);
}

TEST(WorkerHealthTest, SlowStartOffersAGrowingShareOfTheSelections) {
  ManualClock clock;
  selection::WorkerHealthConfig ramp = config();
  ramp.slow_start_window = 10s;
  ramp.slow_start_min_weight = 0.1;
  WorkerHealth health{ramp};
  EXPECT_FALSE(health.joined(1, clock.now()));
  clock.advance(9s);
  // Within one window of the first worker: as cold as it, no ramp.
  EXPECT_FALSE(health.joined(2, clock.now()));
  clock.advance(1s);
  ASSERT_TRUE(health.joined(9, clock.now()));
  ASSERT_TRUE(health.ramping(clock.now()));
  EXPECT_DOUBLE_EQ(health.weight(9, clock.now()), 0.1);
  const auto offers = [&](int selections) {
    int offered = 0;
    for (int i = 0; i < selections; ++i) offered += health.offer(9, clock.now()) ? 1 : 0;
    return offered;
  };
  EXPECT_EQ(offers(100), 10);
  clock.advance(5s);
  EXPECT_DOUBLE_EQ(health.weight(9, clock.now()), 0.55);
  EXPECT_NEAR(offers(100), 55, 1);
  clock.advance(5s);
  EXPECT_FALSE(health.ramping(clock.now()));
  EXPECT_DOUBLE_EQ(health.weight(9, clock.now()), 1);
  EXPECT_EQ(offers(100), 100);
  EXPECT_TRUE(health.offer(2, clock.now()));
}

TEST(WorkerHealthConfigTest, ValidationNamesTheKey) {
  selection::WorkerHealthConfig bad = config();
  bad.max_ejection_percent = 101;
  ASSERT_FALSE(bad.validate());
  EXPECT_EQ(bad.validate().error().key, "max_ejection_percent");
  bad = config();
  bad.max_ejection_time = 500ms;
  EXPECT_EQ(bad.validate().error().key, "max_ejection_time_ms");
  bad = config();
  bad.base_ejection_time = 0ms;
  EXPECT_EQ(bad.validate().error().key, "base_ejection_time_ms");
  bad = config();
  bad.slow_start_min_weight = 0;
  EXPECT_EQ(bad.validate().error().key, "slow_start_min_weight");
  EXPECT_TRUE(config().validate());
  EXPECT_TRUE(selection::WorkerHealthConfig{}.validate());
}

TEST(WorkerHealthConfigTest, TheRouterPolicyYamlReadsAndChecksTheSection) {
  auto parsed = selection::parse_router_policy_config(
      "worker_health:\n  consecutive_failures: 2\n  base_ejection_time_ms: 250\n"
      "  max_ejection_time_ms: 1000\n  max_ejection_percent: 34\n"
      "  slow_start_window_ms: 3000\n  slow_start_min_weight: 0.2\n",
      "policy.yaml");
  ASSERT_TRUE(parsed) << parsed.error();
  EXPECT_EQ(parsed->worker_health.consecutive_failures, 2);
  EXPECT_EQ(parsed->worker_health.base_ejection_time, 250ms);
  EXPECT_EQ(parsed->worker_health.max_ejection_time, 1000ms);
  EXPECT_DOUBLE_EQ(parsed->worker_health.max_ejection_percent, 34);
  EXPECT_EQ(parsed->worker_health.slow_start_window, 3000ms);
  EXPECT_DOUBLE_EQ(parsed->worker_health.slow_start_min_weight, 0.2);

  const auto defaults = selection::parse_router_policy_config("", "empty.yaml");
  ASSERT_TRUE(defaults);
  EXPECT_EQ(defaults->worker_health.consecutive_failures, 3);
  EXPECT_EQ(defaults->worker_health.slow_start_window, 0ms);

  const auto out_of_range = selection::parse_router_policy_config(
      "worker_health:\n  max_ejection_percent: 150\n", "policy.yaml");
  ASSERT_FALSE(out_of_range);
  EXPECT_NE(out_of_range.error().find("policy.yaml:2: worker_health.max_ejection_percent"),
            std::string::npos)
      << out_of_range.error();
  const auto unknown = selection::parse_router_policy_config(
      "worker_health:\n  consecutive_failure: 3\n", "policy.yaml");
  ASSERT_FALSE(unknown);
  EXPECT_NE(unknown.error().find("worker_health.consecutive_failure: unknown key"),
            std::string::npos)
      << unknown.error();
  const auto wrong_kind = selection::parse_router_policy_config(
      "worker_health:\n  base_ejection_time_ms: soon\n", "policy.yaml");
  ASSERT_FALSE(wrong_kind);
  EXPECT_NE(wrong_kind.error().find("base_ejection_time_ms"), std::string::npos)
      << wrong_kind.error();
}

// ---- through the selector's routing --------------------------------------------------------

constexpr std::uint32_t kBlockSize = 16;

class SelectorHealthTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto registered = selection::register_builtin_policies(registry_);
    ASSERT_TRUE(registered) << registered.error().message();
  }

  SelectorState& make_state(selection::WorkerHealthConfig health, std::string policy = {}) {
    selection::RouterPolicyConfig config;
    if (!policy.empty()) {
      config.worker_selection[static_cast<std::size_t>(WorkerType::Aggregated)] = policy;
    }
    auto plugins = registry_.resolve_plugins(config);
    EXPECT_TRUE(plugins) << plugins.error().message();
    plugins_ = std::make_unique<plugins::RouterPlugins>(std::move(*plugins));
    SelectorOptions options;
    options.partition.model = "llama";
    options.router.block_size = kBlockSize;
    options.router.seed = 42;
    options.booking_ttl = 30s;
    options.health = health;
    state_ = std::make_unique<SelectorState>(std::move(options), *plugins_);
    return *state_;
  }

  void add_worker(WorkerId id) {
    auto added = state_->register_worker(testing::worker_registration(id, "llama", kBlockSize, 60s),
                                         clock_.now());
    ASSERT_TRUE(added) << added.error().message();
    ASSERT_TRUE(state_->update_load({id, 0}, discovery::ConfirmedLoad{}));
  }

  // Routes a one-block request and releases it at once; returns the chosen worker (0: none).
  WorkerId route_and_release() {
    RouteRequest input;
    input.selection.request_id = "r" + std::to_string(next_id_++);
    input.selection.prompt_tokens = kBlockSize;
    input.selection.block_hashes = {next_id_};
    auto routed = state_->route(input, clock_.now());
    if (!routed) return 0;
    EXPECT_TRUE(state_->release(input.id(), discovery::BookingEnd::completed));
    return routed->worker.worker_id;
  }

  std::map<WorkerId, int> route_many(int count) {
    std::map<WorkerId, int> chosen;
    for (int i = 0; i < count; ++i) ++chosen[route_and_release()];
    return chosen;
  }

  ManualClock clock_;
  plugins::RouterPluginRegistry registry_;
  std::unique_ptr<plugins::RouterPlugins> plugins_;
  std::unique_ptr<SelectorState> state_;
  std::uint64_t next_id_ = 1;
};

TEST_F(SelectorHealthTest, AnEjectedWorkerGetsNoRoutesUntilItsBackOffEnds) {
  auto& state = make_state(config(3), "round-robin");
  add_worker(1);
  add_worker(2);
  add_worker(3);
  EXPECT_EQ(route_many(30).size(), 3);
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(state.report_health({2, FailureCause::first_token_timeout}, clock_.now()));
  }
  EXPECT_FALSE(state.health().is_ejected(2));
  const auto verdict = state.report_health({2, FailureCause::first_token_timeout}, clock_.now());
  ASSERT_TRUE(verdict && verdict->ejected);
  const auto while_ejected = route_many(30);
  EXPECT_FALSE(while_ejected.contains(2));
  EXPECT_EQ(while_ejected.at(1) + while_ejected.at(3), 30);
  // A pinned route to it is refused too: the worker is not available.
  RouteRequest pinned;
  pinned.selection.request_id = "pinned";
  pinned.selection.prompt_tokens = kBlockSize;
  EXPECT_FALSE(state.route_to(pinned, {2, 0}, clock_.now()));

  clock_.advance(1s);
  EXPECT_TRUE(route_many(30).contains(2));
  EXPECT_EQ(state.take_returned(), std::vector<WorkerId>{2});
}

TEST_F(SelectorHealthTest, AClientCancelDoesNotCountAndReportsForUnknownWorkersAreIgnored) {
  auto& state = make_state(config(2), "round-robin");
  add_worker(1);
  add_worker(2);
  // A cancellation arrives as no health report at all (the reservation actor drops it), and a
  // success in between resets the count.
  ASSERT_TRUE(state.report_health({1, FailureCause::worker_failed}, clock_.now()));
  ASSERT_TRUE(state.report_health({1, std::nullopt}, clock_.now()));
  ASSERT_TRUE(state.report_health({1, FailureCause::worker_failed}, clock_.now()));
  EXPECT_FALSE(state.health().is_ejected(1));
  EXPECT_FALSE(state.report_health({99, FailureCause::worker_failed}, clock_.now()));
}

TEST_F(SelectorHealthTest, ADeregisteredOrExpiredWorkerDropsItsEjection) {
  auto& state = make_state(config(1), "round-robin");
  add_worker(1);
  add_worker(2);
  ASSERT_TRUE(state.report_health({1, FailureCause::worker_failed}, clock_.now())->ejected);
  ASSERT_TRUE(state.deregister(1, 1));
  EXPECT_EQ(state.health().ejected(), 0);
  add_worker(1);
  EXPECT_FALSE(state.health().is_ejected(1));
  EXPECT_TRUE(route_many(10).contains(1));
}

TEST_F(SelectorHealthTest, AFleetWideFailureLeavesWorkersInRouting) {
  auto& state = make_state(config(1), "round-robin");  // 50 %
  for (WorkerId id = 1; id <= 4; ++id) add_worker(id);
  for (WorkerId id = 1; id <= 4; ++id) {
    (void)state.report_health({id, FailureCause::first_token_timeout}, clock_.now());
  }
  EXPECT_EQ(state.health().ejected(), 2);
  const auto chosen = route_many(20);
  EXPECT_EQ(chosen.size(), 2);
  EXPECT_FALSE(chosen.contains(0)) << "every request is routed";
}

TEST_F(SelectorHealthTest, SlowStartLimitsACacheBlindPolicyThenStopsMattering) {
  selection::WorkerHealthConfig health = config();
  health.slow_start_window = 10s;
  health.slow_start_min_weight = 0.1;
  auto& state = make_state(health, "least-loaded");
  add_worker(1);
  add_worker(2);
  clock_.advance(10s);  // the fleet is warm
  // Both carry a long-running request: an idle newcomer is what a cache-blind policy prefers.
  for (const char* id : {"busy-1", "busy-2"}) {
    RouteRequest busy;
    busy.selection.request_id = id;
    busy.selection.prompt_tokens = kBlockSize;
    ASSERT_TRUE(state.route(busy, clock_.now()));
  }
  add_worker(3);
  EXPECT_LT(state.health().weight(3, clock_.now()), 1);
  const auto ramping = route_many(100);
  EXPECT_EQ(ramping.at(3), 10) << "offered one selection in ten at the start of its window";
  EXPECT_EQ(ramping.at(1) + ramping.at(2), 90);

  clock_.advance(10s);
  EXPECT_EQ(route_many(100).at(3), 100) << "after the window it takes everything it would";
}

TEST_F(SelectorHealthTest, SlowStartNeverTurnsAwayARequestOnlyTheNewcomerCanTake) {
  selection::WorkerHealthConfig health = config();
  health.slow_start_window = 10s;
  auto& state = make_state(health, "least-loaded");
  add_worker(1);
  clock_.advance(10s);
  add_worker(2);
  ASSERT_LT(state.health().weight(2, clock_.now()), 1);
  for (int i = 0; i < 5; ++i) {
    RouteRequest input;
    input.selection.request_id = "only-2-" + std::to_string(i);
    input.selection.prompt_tokens = kBlockSize;
    input.selection.allowed_workers = {2};
    auto routed = state.route(input, clock_.now());
    ASSERT_TRUE(routed) << routed.error().message;
    EXPECT_EQ(routed->worker.worker_id, 2);
  }
}

TEST_F(SelectorHealthTest, AFleetThatRegistersTogetherIsNotRamped) {
  selection::WorkerHealthConfig health = config();
  health.slow_start_window = 10s;
  auto& state = make_state(health, "round-robin");
  add_worker(1);
  clock_.advance(2s);
  add_worker(2);
  add_worker(3);
  for (WorkerId id = 1; id <= 3; ++id) EXPECT_EQ(state.health().weight(id, clock_.now()), 1);
  const auto chosen = route_many(30);
  EXPECT_EQ(chosen.at(1), 10);
  EXPECT_EQ(chosen.at(2), 10);
  EXPECT_EQ(chosen.at(3), 10);
}

}  // namespace
}  // namespace kvr
