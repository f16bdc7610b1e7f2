// AdmissionState without CAF, on explicit time points: ready, rejected, a throwing classifier,
// deferred futures woken by time and by on_event (the built-in max-in-flight), no re-poll
// without a wake-up, due-time expiry, the wait limit, cancel, and the lifecycle events' order and
// uniqueness.
#include "selection/admission/admission_state.hpp"

#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "classifiers/builtin/kv_capacity_pause.hpp"
#include "classifiers/builtin/max_in_flight.hpp"
#include "messages/clock.hpp"

namespace kvr {
namespace {

using namespace plugins::request_classifier;
using namespace std::chrono_literals;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

const TimePoint kStart{std::chrono::hours(1)};
const WorkerWithDpRank kWorker{1, 0};
const WorkerWithDpRank kOtherWorker{2, 0};

ClassifyRequest make_request(std::string id, std::size_t tokens = 100) {
  return ClassifyRequest{ClassifyRequest::Arrival{
      .request_id = std::move(id), .input_tokens = tokens, .arrived_at = kStart}};
}

// A classifier whose answer each test chooses; it counts polls and records events.
class ScriptedClassifier final : public RequestClassifier {
 public:
  std::function<AdmissionFuture(ClassifyRequest)> answer = [](ClassifyRequest request) {
    return AdmissionFuture::ready(std::move(request));
  };
  std::vector<std::string> events;
  std::vector<Waker> wakers;

  AdmissionFuture classify(ClassifyRequest request) override { return answer(std::move(request)); }
  void on_event(const ClassifyEvent& event) override {
    std::visit(
        [this](const auto& e) {
          using E = std::decay_t<decltype(e)>;
          std::string kind = std::is_same_v<E, Sent>         ? "sent"
                             : std::is_same_v<E, Responding> ? "responding"
                             : std::is_same_v<E, Completed>  ? "completed"
                                                             : "aborted";
          std::string worker;
          if constexpr (std::is_same_v<E, Aborted>) {
            worker = e.worker ? std::to_string(e.worker->worker_id) : "-";
          } else {
            worker = std::to_string(e.worker.worker_id);
          }
          events.push_back(fmt::format("{} {} {}", kind, e.request_id, worker));
        },
        event);
  }
};

class AdmissionStateTest : public ::testing::Test {
 protected:
  AdmissionStateTest() {
    auto classifier = std::make_unique<ScriptedClassifier>();
    scripted_ = classifier.get();
    state_ = std::make_unique<AdmissionState>(std::move(classifier), [this] { ++signals_; });
  }

  ScriptedClassifier* scripted_;
  std::unique_ptr<AdmissionState> state_;
  int signals_ = 0;
};

TEST_F(AdmissionStateTest, ReadyAdmitsAtOnceWithTheClassifiersOverrides) {
  scripted_->answer = [](ClassifyRequest request) {
    request.set_policy_class("short");
    request.set_scheduling_cost_tokens(7);
    request.set_worker_selection_target(kOtherWorker);
    return AdmissionFuture::ready(std::move(request));
  };
  auto outcome = state_->admit("r1", make_request("r1"), kStart);
  ASSERT_TRUE(outcome);
  ASSERT_TRUE(outcome->admitted());
  EXPECT_EQ(outcome->request_id, "r1");
  EXPECT_EQ(outcome->request().policy_class(), "short");
  EXPECT_EQ(outcome->request().scheduling_cost_tokens(), 7U);
  EXPECT_EQ(outcome->request().worker_selection_target(),
            (ClassifyRequest::WorkerSelectionTarget{kOtherWorker.worker_id, kOtherWorker.dp_rank}));
  EXPECT_EQ(state_->pending(), 0U);
  EXPECT_EQ(state_->admitted(), 1U);
}

TEST_F(AdmissionStateTest, RejectedMapsTheKindToAnErrorCodeAndKeepsTheReason) {
  scripted_->answer = [](ClassifyRequest request) {
    return request.request_id() == "r1"
               ? AdmissionFuture::rejected(ClassifierError::overloaded("too busy"))
               : AdmissionFuture::rejected(ClassifierError::rate_limited("slow down"));
  };
  auto overloaded = state_->admit("r1", make_request("r1"), kStart);
  ASSERT_TRUE(overloaded);
  ASSERT_FALSE(overloaded->admitted());
  EXPECT_EQ(overloaded->rejection().code, Error::overloaded);
  EXPECT_EQ(overloaded->rejection().message, "too busy");
  auto limited = state_->admit("r2", make_request("r2"), kStart);
  ASSERT_TRUE(limited);
  EXPECT_EQ(limited->rejection().code, Error::rate_limited);
  EXPECT_EQ(state_->admitted(), 0U);
  EXPECT_EQ(admission_error(ClassifierError::Kind::Failed), Error::rejected);
}

TEST_F(AdmissionStateTest, AThrowingClassifierFailsOnlyThatRequest) {
  scripted_->answer = [](ClassifyRequest request) -> AdmissionFuture {
    if (request.request_id() == "bad") throw std::runtime_error("boom");
    return AdmissionFuture::ready(std::move(request));
  };
  auto bad = state_->admit("bad", make_request("bad"), kStart);
  ASSERT_TRUE(bad);
  ASSERT_FALSE(bad->admitted());
  EXPECT_EQ(bad->rejection().code, Error::rejected);
  EXPECT_THAT(bad->rejection().message, HasSubstr("boom"));
  auto good = state_->admit("good", make_request("good"), kStart);
  ASSERT_TRUE(good);
  EXPECT_TRUE(good->admitted());
}

TEST_F(AdmissionStateTest, AThrowingPollFunctionFailsOnlyThatRequest) {
  scripted_->answer = [](ClassifyRequest) {
    return AdmissionFuture::deferred([](PollContext&) -> Poll { throw std::runtime_error("bad"); });
  };
  auto outcome = state_->admit("r1", make_request("r1"), kStart);
  ASSERT_TRUE(outcome);
  EXPECT_EQ(outcome->rejection().code, Error::rejected);
  EXPECT_THAT(outcome->rejection().message, HasSubstr("bad"));
  EXPECT_EQ(state_->pending(), 0U);
}

TEST_F(AdmissionStateTest, DeferredIsWokenByItsTimeAndNotBefore) {
  scripted_->answer = [](ClassifyRequest request) {
    return AdmissionFuture::deferred([request](PollContext& context) {
      if (context.now() >= kStart + 50ms) return Poll::ready(request);
      context.wake_at(kStart + 50ms);
      return Poll::pending();
    });
  };
  EXPECT_FALSE(state_->admit("r1", make_request("r1"), kStart));
  EXPECT_EQ(state_->next_deadline(), kStart + 50ms);
  EXPECT_TRUE(state_->poll_due(kStart + 49ms).empty());
  EXPECT_EQ(state_->polls(), 1U);  // not due: not polled
  auto outcomes = state_->poll_due(kStart + 50ms);
  ASSERT_EQ(outcomes.size(), 1U);
  EXPECT_TRUE(outcomes[0].admitted());
  EXPECT_EQ(outcomes[0].request_id, "r1");
  EXPECT_FALSE(state_->next_deadline());
}

TEST(AdmissionStateMaxInFlightTest, DeferredIsWokenByOnEventOfAnotherRequest) {
  AdmissionState state{std::make_unique<classifiers::builtin::MaxInFlightClassifier>(
                           classifiers::builtin::MaxInFlightParameters{.max_in_flight = 2}),
                       {}};
  ASSERT_TRUE(state.admit("r1", make_request("r1"), kStart)->admitted());
  ASSERT_TRUE(state.admit("r2", make_request("r2"), kStart)->admitted());
  EXPECT_FALSE(state.admit("r3", make_request("r3"), kStart));
  EXPECT_EQ(state.pending(), 1U);
  EXPECT_FALSE(state.next_deadline());  // a Waker, no time
  EXPECT_TRUE(state.poll_due(kStart + 1h).empty());
  state.on_event(Sent{"r1", kWorker});
  EXPECT_FALSE(state.has_woken());
  state.on_event(Completed{"r1", kWorker, 120});
  EXPECT_TRUE(state.has_woken());  // recorded inside on_event, polled only by poll_due
  EXPECT_EQ(state.pending(), 1U);
  auto outcomes = state.poll_due(kStart + 1ms);
  ASSERT_EQ(outcomes.size(), 1U);
  EXPECT_EQ(outcomes[0].request_id, "r3");
  EXPECT_TRUE(outcomes[0].admitted());
  EXPECT_EQ(state.pending(), 0U);
}

TEST_F(AdmissionStateTest, NeverRepollsWithoutAWakeUp) {
  int polls = 0;
  scripted_->answer = [this, &polls](ClassifyRequest) {
    return AdmissionFuture::deferred([this, &polls](PollContext& context) {
      ++polls;
      scripted_->wakers.push_back(context.waker());
      return Poll::pending();
    });
  };
  for (int i = 0; i < 10'000; ++i) {
    const std::string id = "r" + std::to_string(i);
    ASSERT_FALSE(state_->admit(id, make_request(id), kStart));
  }
  EXPECT_EQ(polls, 10'000);
  for (int round = 1; round <= 5; ++round) {
    EXPECT_TRUE(state_->poll_due(kStart + round * 1h).empty());
  }
  EXPECT_EQ(polls, 10'000);
  EXPECT_EQ(signals_, 0);
  // One Waker fired: exactly that future is polled again.
  scripted_->wakers[42].wake();
  EXPECT_EQ(signals_, 1);
  EXPECT_TRUE(state_->poll_due(kStart + 6h).empty());
  EXPECT_EQ(polls, 10'001);
  EXPECT_EQ(state_->pending(), 10'000U);
}

TEST_F(AdmissionStateTest, DueTimePassingWhileDeferredRejects) {
  scripted_->answer = [this](ClassifyRequest) {
    return AdmissionFuture::deferred([this](PollContext& context) {
      scripted_->wakers.push_back(context.waker());
      return Poll::pending();
    });
  };
  ClassifyRequest request = make_request("r1");
  request.set_due_at(kStart + 20ms);
  EXPECT_FALSE(state_->admit("r1", request, kStart));
  EXPECT_EQ(state_->next_deadline(), kStart + 20ms);
  EXPECT_TRUE(state_->poll_due(kStart + 19ms).empty());
  auto outcomes = state_->poll_due(kStart + 20ms);
  ASSERT_EQ(outcomes.size(), 1U);
  ASSERT_FALSE(outcomes[0].admitted());
  EXPECT_EQ(outcomes[0].rejection().code, Error::due_time_expired);
  EXPECT_EQ(state_->pending(), 0U);
  // Its Waker is silenced: firing it later polls nothing.
  scripted_->wakers[0].wake();
  EXPECT_TRUE(state_->poll_due(kStart + 1s).empty());
}

TEST(AdmissionStateWaitLimitTest, ARequestDeferredPastTheWaitLimitTimesOutAndIsDropped) {
  ManualClock clock{kStart};
  auto classifier = std::make_unique<ScriptedClassifier>();
  ScriptedClassifier* scripted = classifier.get();
  scripted->answer = [scripted](ClassifyRequest) {
    return AdmissionFuture::deferred([scripted](PollContext& context) {
      scripted->wakers.push_back(context.waker());
      return Poll::pending();  // never admits
    });
  };
  int signals = 0;
  AdmissionState state{std::move(classifier), [&signals] { ++signals; }, 100ms};
  EXPECT_FALSE(state.admit("r1", make_request("r1"), clock.now()));
  clock.advance(30ms);
  EXPECT_FALSE(state.admit("r2", make_request("r2"), clock.now()));
  // The wait limit is a time poll_due() must run at, as a due time is.
  EXPECT_EQ(state.next_deadline(), kStart + 100ms);
  clock.advance(69ms);
  EXPECT_TRUE(state.poll_due(clock.now()).empty());
  EXPECT_EQ(state.polls(), 2U);
  clock.advance(1ms);
  auto outcomes = state.poll_due(clock.now());
  ASSERT_EQ(outcomes.size(), 1U);
  EXPECT_EQ(outcomes[0].request_id, "r1");
  ASSERT_FALSE(outcomes[0].admitted());
  EXPECT_EQ(outcomes[0].rejection().code, Error::timeout);
  EXPECT_THAT(outcomes[0].rejection().message, HasSubstr("waited for admission"));
  EXPECT_THAT(outcomes[0].rejection().message, HasSubstr("100 ms"));
  // Its future is dropped (its Waker is silenced); r2 keeps waiting until its own limit.
  EXPECT_EQ(state.pending(), 1U);
  EXPECT_EQ(state.admitted(), 0U);
  EXPECT_EQ(state.next_deadline(), kStart + 130ms);
  scripted->wakers[0].wake();
  EXPECT_EQ(signals, 0);
  // Never admitted: the classifier is told nothing, and a cancel finds nothing.
  EXPECT_TRUE(scripted->events.empty());
  EXPECT_EQ(state.cancel("r1", "late"), AdmissionCancel::unknown);
  clock.advance(30ms);
  outcomes = state.poll_due(clock.now());
  ASSERT_EQ(outcomes.size(), 1U);
  EXPECT_EQ(outcomes[0].request_id, "r2");
  EXPECT_EQ(outcomes[0].rejection().code, Error::timeout);
  EXPECT_FALSE(state.next_deadline());
  EXPECT_TRUE(scripted->events.empty());
}

TEST(AdmissionStateWaitLimitTest, AnEarlierDueTimeWinsAndARequestAdmittedInTimeIsNotTimedOut) {
  ManualClock clock{kStart};
  auto classifier = std::make_unique<ScriptedClassifier>();
  ScriptedClassifier* scripted = classifier.get();
  // "late" is admitted once woken at 50 ms; the others never.
  scripted->answer = [](ClassifyRequest request) {
    return AdmissionFuture::deferred([request](PollContext& context) {
      if (request.request_id() == "late" && context.now() >= kStart + 50ms) {
        return Poll::ready(request);
      }
      context.wake_at(kStart + 50ms);
      return Poll::pending();
    });
  };
  AdmissionState state{std::move(classifier), {}, 100ms};
  ClassifyRequest due = make_request("due");
  due.set_due_at(kStart + 20ms);
  EXPECT_FALSE(state.admit("due", due, clock.now()));
  EXPECT_FALSE(state.admit("late", make_request("late"), clock.now()));
  EXPECT_EQ(state.next_deadline(), kStart + 20ms);
  clock.advance(20ms);
  auto outcomes = state.poll_due(clock.now());
  ASSERT_EQ(outcomes.size(), 1U);
  EXPECT_EQ(outcomes[0].rejection().code, Error::due_time_expired);
  clock.advance(30ms);
  outcomes = state.poll_due(clock.now());
  ASSERT_EQ(outcomes.size(), 1U);
  EXPECT_EQ(outcomes[0].request_id, "late");
  EXPECT_TRUE(outcomes[0].admitted());
  // Admitted before its limit: nothing is due any more, and its end is told as usual.
  EXPECT_FALSE(state.next_deadline());
  clock.advance(1h);
  EXPECT_TRUE(state.poll_due(clock.now()).empty());
  state.on_event(Completed{"late", kWorker, 10});
  EXPECT_THAT(scripted->events, ElementsAre("completed late 1"));
}

TEST(AdmissionStateFleetLoadTest, FleetLoadReachesTheClassifierAndItsWakersResumeAPause) {
  AdmissionState state{std::make_unique<classifiers::builtin::KvCapacityPauseClassifier>(
                           classifiers::builtin::KvCapacityPauseParameters{
                               .pause_above = 0.5, .resume_below = 0.3, .max_pause_ms = 60'000}),
                       {}};
  ASSERT_TRUE(state.admit("before", make_request("before"), kStart)->admitted());
  state.on_fleet_load(FleetLoad{.kv_usage = 0.9, .at = kStart + 1ms});
  // Paused: a new session (no session metadata) is deferred.
  EXPECT_FALSE(state.admit("paused", make_request("paused"), kStart + 2ms));
  EXPECT_EQ(state.pending(), 1U);
  state.on_fleet_load(FleetLoad{.kv_usage = 0.4, .at = kStart + 3ms});  // hysteresis: still paused
  EXPECT_FALSE(state.has_woken());
  state.on_fleet_load(FleetLoad{.kv_usage = 0.2, .at = kStart + 4ms});
  EXPECT_TRUE(state.has_woken());
  auto outcomes = state.poll_due(kStart + 4ms);
  ASSERT_EQ(outcomes.size(), 1U);
  EXPECT_EQ(outcomes[0].request_id, "paused");
  EXPECT_TRUE(outcomes[0].admitted());
}

TEST_F(AdmissionStateTest, CancelDropsAPendingFutureWithoutAnEvent) {
  scripted_->answer = [this](ClassifyRequest) {
    return AdmissionFuture::deferred([this](PollContext& context) {
      scripted_->wakers.push_back(context.waker());
      return Poll::pending();
    });
  };
  EXPECT_FALSE(state_->admit("r1", make_request("r1"), kStart));
  EXPECT_EQ(state_->cancel("r1", "cancelled by the client"), AdmissionCancel::pending);
  EXPECT_EQ(state_->pending(), 0U);
  scripted_->wakers[0].wake();  // silenced with its future
  EXPECT_EQ(signals_, 0);
  EXPECT_TRUE(scripted_->events.empty());
  EXPECT_EQ(state_->cancel("r1", "again"), AdmissionCancel::unknown);
}

TEST_F(AdmissionStateTest, CancelOfAnAdmittedRequestTellsAbortedOnce) {
  ASSERT_TRUE(state_->admit("r1", make_request("r1"), kStart)->admitted());
  state_->on_event(Sent{"r1", kWorker});
  EXPECT_EQ(state_->cancel("r1", "cancelled by the client"), AdmissionCancel::admitted);
  // The lifecycle's own Aborted for the same request arrives later: dropped.
  state_->on_event(Aborted{"r1", kWorker, "cancelled"});
  EXPECT_THAT(scripted_->events, ElementsAre("sent r1 1", "aborted r1 1"));
}

TEST_F(AdmissionStateTest, EventsInLifecycleOrderIncludingASecondSentAfterARetry) {
  ASSERT_TRUE(state_->admit("r1", make_request("r1"), kStart)->admitted());
  state_->on_event(Sent{"r1", kWorker});
  state_->on_event(Sent{"r1", kOtherWorker});
  state_->on_event(Responding{"r1", kOtherWorker});
  state_->on_event(Completed{"r1", kOtherWorker, 140});
  state_->on_event(Completed{"r1", kOtherWorker, 140});  // a duplicate end: dropped
  state_->on_event(Sent{"never-admitted", kWorker});     // not ours: dropped
  EXPECT_THAT(scripted_->events,
              ElementsAre("sent r1 1", "sent r1 2", "responding r1 2", "completed r1 2"));
  EXPECT_EQ(state_->admitted(), 0U);
}

TEST_F(AdmissionStateTest, ADuplicateRequestIdIsRejected) {
  ASSERT_TRUE(state_->admit("r1", make_request("r1"), kStart)->admitted());
  auto again = state_->admit("r1", make_request("r1"), kStart);
  ASSERT_TRUE(again);
  EXPECT_EQ(again->rejection().code, Error::invalid_request);
}

TEST(AdmissionRouteRequestTest, TheClassifierSeesTheRequestAndItsDecisionsAreCarriedOn) {
  RouteRequest route;
  route.selection.request_id = "r1";
  route.selection.prompt_tokens = 300;
  route.selection.pinned_worker = plugins::worker_selection::WorkerAffinityTarget{7, std::nullopt};
  route.tenant = "acme";
  ClassifyRequest seen = classify_request(route, kStart + 5ms);
  EXPECT_EQ(seen.request_id(), "r1");
  EXPECT_EQ(seen.input_tokens(), 300U);
  EXPECT_EQ(seen.tenant(), "acme");
  EXPECT_EQ(seen.arrived_at(), kStart + 5ms);
  EXPECT_EQ(seen.pinned_worker(), (WorkerWithDpRank{7, 0}));
  route.tenant.clear();
  EXPECT_FALSE(classify_request(route, kStart).tenant());

  EXPECT_EQ(route.policy_class, "default");
  seen.set_policy_class("short");
  seen.set_due_at(kStart + 1s);
  seen.set_scheduling_cost_tokens(42);
  seen.set_worker_selection_target(kOtherWorker);
  apply_admission(route, seen);
  EXPECT_EQ(route.policy_class, "short");
  EXPECT_EQ(route.due_at, kStart + 1s);
  EXPECT_EQ(route.scheduling_cost_tokens, 42U);
  EXPECT_EQ(route.selection.affinity_target, (plugins::worker_selection::WorkerAffinityTarget{
                                                 kOtherWorker.worker_id, kOtherWorker.dp_rank}));
  EXPECT_FALSE(route.without_soft_target);

  // Every rank of a worker.
  seen.set_worker_selection_target(WorkerId{9});
  apply_admission(route, seen);
  EXPECT_EQ(route.selection.affinity_target,
            (plugins::worker_selection::WorkerAffinityTarget{9, std::nullopt}));
  // Cleared: no target, and the session's soft binding is not offered either.
  seen.clear_worker_selection_target();
  apply_admission(route, seen);
  EXPECT_EQ(route.selection.affinity_target, std::nullopt);
  EXPECT_TRUE(route.without_soft_target);
}

}  // namespace
}  // namespace kvr
