// kv-capacity-pause: new sessions pause above pause_above and resume below resume_below
// (hysteresis), turns of running sessions pass, a forced resume after max_pause_ms, and the
// parameter checks.
#include "classifiers/builtin/kv_capacity_pause.hpp"

#include <chrono>
#include <memory>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/unit/classifiers/builtin/classifier_host.hpp"

namespace kvr::classifiers::builtin {
namespace {

using namespace plugins::request_classifier;
using namespace std::chrono_literals;
using testing::Admission;
using ::testing::HasSubstr;
using testing::make_request;
using testing::parameter_error;
using testing::session;

const TimePoint kStart = TimePoint{} + 1h;

// Pauses above 0.9, resumes below 0.7, at most 1 s; sessions are remembered for 60 s.
class KvCapacityPauseTest : public ::testing::Test {
 protected:
  KvCapacityPauseTest()
      : classifier_(KvCapacityPauseParameters{.pause_above = 0.9,
                                              .resume_below = 0.7,
                                              .max_pause_ms = 1000,
                                              .session_ttl_ms = 60'000}) {}

  std::unique_ptr<Admission> arrive(std::optional<SessionContext> turn, TimePoint at) {
    return Admission::start(classifier_,
                            make_request({.id = "r" + std::to_string(++requests_),
                                          .session = std::move(turn),
                                          .arrived_at = at}),
                            at);
  }
  void load(double kv_usage, TimePoint at) {
    classifier_.on_fleet_load(FleetLoad{.kv_usage = kv_usage, .at = at});
  }

  KvCapacityPauseClassifier classifier_;
  int requests_ = 0;
};

TEST_F(KvCapacityPauseTest, AdmitsEverythingUntilTheFleetIsFull) {
  EXPECT_TRUE(arrive(session("s1"), kStart)->is_ready());  // no report yet
  load(0.85, kStart);
  EXPECT_FALSE(classifier_.paused());
  EXPECT_TRUE(arrive(session("s2"), kStart)->is_ready());
  EXPECT_TRUE(arrive(std::nullopt, kStart)->is_ready());
}

TEST_F(KvCapacityPauseTest, AboveTheThresholdANewSessionIsDeferredWithBothWakeUps) {
  load(0.95, kStart);
  EXPECT_TRUE(classifier_.paused());
  auto deferred = arrive(session("s1"), kStart + 100ms);
  ASSERT_TRUE(deferred->is_pending());
  EXPECT_EQ(deferred->wake_time(), kStart + 1s);  // the forced resume
  EXPECT_EQ(deferred->wakes(), 0);
  auto sessionless = arrive(std::nullopt, kStart + 100ms);
  EXPECT_TRUE(sessionless->is_pending());  // counts as new
}

TEST_F(KvCapacityPauseTest, ResumesOnlyBelowResumeBelow) {
  load(0.95, kStart);
  auto deferred = arrive(session("s1"), kStart);
  ASSERT_TRUE(deferred->is_pending());

  load(0.8, kStart + 100ms);  // between the thresholds: still paused
  EXPECT_TRUE(classifier_.paused());
  EXPECT_EQ(deferred->wakes(), 0);
  EXPECT_FALSE(deferred->step(kStart + 100ms));
  EXPECT_EQ(deferred->polls(), 1);

  load(0.65, kStart + 200ms);
  EXPECT_FALSE(classifier_.paused());
  EXPECT_EQ(deferred->wakes(), 1);
  ASSERT_TRUE(deferred->step(kStart + 200ms));
  EXPECT_TRUE(deferred->is_ready());
  EXPECT_EQ(deferred->polls(), 2);

  load(0.85, kStart + 300ms);  // between again: stays resumed
  EXPECT_FALSE(classifier_.paused());
  EXPECT_TRUE(arrive(session("s2"), kStart + 300ms)->is_ready());
  load(0.91, kStart + 400ms);
  EXPECT_TRUE(classifier_.paused());
}

TEST_F(KvCapacityPauseTest, TurnsOfRunningSessionsPassDuringAPause) {
  ASSERT_TRUE(arrive(session("running"), kStart)->is_ready());
  load(0.95, kStart + 1ms);
  EXPECT_TRUE(arrive(session("running"), kStart + 2ms)->is_ready());
  EXPECT_TRUE(arrive(session("new"), kStart + 2ms)->is_pending());
}

TEST_F(KvCapacityPauseTest, AfterItsFinalTurnASessionCountsAsNew) {
  ASSERT_TRUE(arrive(session("s1"), kStart)->is_ready());
  load(0.95, kStart + 1ms);
  EXPECT_TRUE(arrive(session("s1", /*final_turn=*/true), kStart + 2ms)->is_ready());
  EXPECT_TRUE(arrive(session("s1"), kStart + 3ms)->is_pending());
}

TEST_F(KvCapacityPauseTest, ASessionIdleLongerThanItsTtlCountsAsNew) {
  ASSERT_TRUE(arrive(session("s1"), kStart)->is_ready());
  load(0.95, kStart + 60s);
  EXPECT_TRUE(arrive(session("s1"), kStart + 60s)->is_ready());  // seen 60 s ago: running
  load(0.95, kStart + 120s + 1ms);
  EXPECT_TRUE(arrive(session("s1"), kStart + 120s + 1ms)->is_pending());
}

TEST_F(KvCapacityPauseTest, APauseEndsByForceAfterMaxPause) {
  load(0.95, kStart);
  auto deferred = arrive(session("s1"), kStart + 200ms);
  ASSERT_TRUE(deferred->is_pending());
  EXPECT_FALSE(deferred->step(kStart + 999ms));
  EXPECT_EQ(deferred->polls(), 1);

  ASSERT_TRUE(deferred->step(kStart + 1s));  // woken by time, the fleet still full
  EXPECT_TRUE(deferred->is_ready());
  EXPECT_EQ(deferred->polls(), 2);
  EXPECT_FALSE(classifier_.paused());

  load(0.95, kStart + 1100ms);  // still full: the next pause begins
  EXPECT_TRUE(classifier_.paused());
  auto next = arrive(session("s2"), kStart + 1100ms);
  ASSERT_TRUE(next->is_pending());
  EXPECT_EQ(next->wake_time(), kStart + 2100ms);
}

TEST_F(KvCapacityPauseTest, AForcedResumeLetsThroughEveryoneDeferredEvenIfThePauseReturns) {
  load(0.95, kStart);
  auto first = arrive(session("s1"), kStart);
  auto second = arrive(session("s2"), kStart);
  ASSERT_TRUE(first->step(kStart + 1s));
  ASSERT_TRUE(first->is_ready());
  EXPECT_EQ(second->wakes(), 1);
  load(0.95, kStart + 1s);  // paused again before the host polled the second one
  ASSERT_TRUE(second->step(kStart + 1s));
  EXPECT_TRUE(second->is_ready());
}

TEST_F(KvCapacityPauseTest, ARequestArrivingAfterTheForcedResumeTimeIsAdmitted) {
  load(0.95, kStart);
  EXPECT_TRUE(arrive(session("s1"), kStart + 1s)->is_ready());
  EXPECT_FALSE(classifier_.paused());
}

TEST(KvCapacityPauseParametersTest, ReadsTheThresholdsAndDefaults) {
  auto parsed =
      KvCapacityPauseParameters::read(testing::parameters("{pause_above: 0.95, resume_below: 0}"));
  ASSERT_TRUE(parsed.has_value()) << parsed.error().message();
  EXPECT_DOUBLE_EQ(parsed->pause_above, 0.95);
  EXPECT_DOUBLE_EQ(parsed->resume_below, 0.0);
  EXPECT_EQ(parsed->max_pause_ms, 30'000U);
  EXPECT_EQ(parsed->session_ttl_ms, 600'000U);
  parsed = KvCapacityPauseParameters::read(testing::parameters(
      "{pause_above: 1, resume_below: 0.5, max_pause_ms: 250, session_ttl_ms: 5000}"));
  ASSERT_TRUE(parsed.has_value()) << parsed.error().message();
  EXPECT_EQ(parsed->max_pause_ms, 250U);
  EXPECT_EQ(parsed->session_ttl_ms, 5000U);
}

TEST(KvCapacityPauseParametersTest, BadParametersFailNamingTheKey) {
  EXPECT_THAT(parameter_error<KvCapacityPauseParameters>("{resume_below: 0.5}"),
              HasSubstr("parameters.pause_above: required parameter is missing"));
  EXPECT_THAT(parameter_error<KvCapacityPauseParameters>("{pause_above: 0.9}"),
              HasSubstr("parameters.resume_below: required parameter is missing"));
  EXPECT_EQ(parameter_error<KvCapacityPauseParameters>("{pause_above: 1.5, resume_below: 0.5}"),
            "parameters.pause_above: must be in (0, 1], got 1.5");
  EXPECT_EQ(parameter_error<KvCapacityPauseParameters>("{pause_above: 0.9, resume_below: 0.9}"),
            "parameters.resume_below: must be in [0, pause_above) = [0, 0.9), got 0.9");
  EXPECT_THAT(parameter_error<KvCapacityPauseParameters>("{pause_above: 0.9, resume_below: -0.1}"),
              HasSubstr("parameters.resume_below: must be in [0, pause_above)"));
  EXPECT_THAT(parameter_error<KvCapacityPauseParameters>(
                  "{pause_above: 0.9, resume_below: 0.5, max_pause_ms: 0}"),
              HasSubstr("parameters.max_pause_ms: must be in [1, "));
  EXPECT_THAT(parameter_error<KvCapacityPauseParameters>(
                  "{pause_above: 0.9, resume_below: 0.5, session_ttl_ms: 0}"),
              HasSubstr("parameters.session_ttl_ms: must be in [1, "));
  EXPECT_THAT(parameter_error<KvCapacityPauseParameters>("{pause_above: high, resume_below: 0.5}"),
              HasSubstr("parameters.pause_above: expected a finite number"));
  EXPECT_THAT(parameter_error<KvCapacityPauseParameters>(
                  "{pause_above: 0.9, resume_below: 0.5, resume_above: 0.8}"),
              HasSubstr("unknown parameter 'resume_above'"));
}

}  // namespace
}  // namespace kvr::classifiers::builtin
