// The front door's gateway actor on CAF's deterministic test coordinator, in front of a stand-in
// ingress that answers when the test says so: a decision reaches its callback once; a route the
// entry never answers ends with a timeout error from the gateway's one sweep timer (no CAF
// timeout per request), and a booking its late answer carries is aborted; a report is passed on;
// a stopping gateway answers every route still waiting.
#include "actors/front_door/gateway_actor.hpp"

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include <caf/send.hpp>
#include <caf/typed_event_based_actor.hpp>
#include <caf/typed_response_promise.hpp>
#include <gtest/gtest.h>

#include "actors/actor_types.hpp"
#include "tests/unit/actors/coordinated_actors.hpp"

namespace kvr::actors {
namespace {

using namespace std::chrono_literals;

// What the stand-in ingress holds: the route requests it has not answered, and every report.
struct IngressLog {
  std::vector<std::pair<std::string, caf::typed_response_promise<RouteDecisionMessage>>> routes;
  std::vector<v1::LifecycleReport> reports;
  /// The answer `answer(request id)` gives.
  std::map<std::string, v1::RouteDecision> decisions;
};

// Holds every route request until the test asks it to answer one (a promise is delivered from
// inside its actor, as CAF requires): a generate cancel naming the request id stands for that.
ingress_actor::behavior_type silent_ingress(ingress_actor::pointer self, IngressLog* log) {
  return {
      [self, log](route_atom, RouteRequestMessage& message) -> caf::result<RouteDecisionMessage> {
        auto promise = self->make_response_promise<RouteDecisionMessage>();
        log->routes.emplace_back(message.value.request_id(), promise);
        return promise;
      },
      [](route_atom, RouteRequestMessage&, std::string&) -> caf::result<RouteDecisionMessage> {
        return RouteDecisionMessage{};
      },
      [log](report_atom, LifecycleReportMessage& message) -> caf::result<LifecycleAckMessage> {
        log->reports.push_back(message.value);
        v1::LifecycleAck ack;
        ack.set_accepted(true);
        return LifecycleAckMessage{std::move(ack)};
      },
      [](generate_atom, GenerateRequestMessage&) -> caf::result<RouteDecisionMessage> {
        return RouteDecisionMessage{};
      },
      [log](cancel_atom, GenerateCancelMessage& message) {
        for (auto& [request_id, promise] : log->routes) {
          if (request_id == message.value.request_id()) {
            promise.deliver(RouteDecisionMessage{log->decisions[request_id]});
          }
        }
      },
  };
}

v1::RouteDecision booked(const std::string& request_id, const std::string& booking_id) {
  v1::RouteDecision decision;
  decision.set_request_id(request_id);
  decision.mutable_success()->set_worker_id(7);
  decision.mutable_success()->set_booking_id(booking_id);
  return decision;
}

class GatewayActorTest : public testing::CoordinatedActorsTest {
 protected:
  GatewayActorTest() {
    ingress_ = system_.spawn(silent_ingress, &ingress_log_);
    GatewayActorConfig config{services()};
    config.ingress = ingress_;
    config.route_timeout = 10s;
    config.sweep_interval = 1s;
    gateway_ = system_.spawn(gateway_behavior, std::move(config));
    scheduler_.run();
  }

  ~GatewayActorTest() override {
    if (gateway_) caf::anon_send_exit(gateway_, caf::exit_reason::user_shutdown);
    caf::anon_send_exit(ingress_, caf::exit_reason::user_shutdown);
    scheduler_.run();
  }

  // Routes `request_id` through the gateway; its decisions land in decisions_.
  void route(const std::string& request_id) {
    v1::RouteRequest request;
    request.set_request_id(request_id);
    caf::anon_send(gateway_, route_atom::value, RouteRequestMessage{std::move(request)},
                   DecisionCallback{[this](v1::RouteDecision decision) {
                     decisions_.push_back(std::move(decision));
                   }});
    scheduler_.run();
  }

  // The gateway's state, read between the scheduler's runs (nothing runs it meanwhile).
  const GatewayState& gateway_state() {
    auto* actor = caf::actor_cast<caf::abstract_actor*>(gateway_);
    return dynamic_cast<std::remove_pointer_t<gateway_actor::stateful_pointer<GatewayState>>&>(
               *actor)
        .state;
  }

  // The stand-in ingress answers `request_id` with `decision` now.
  void answer(const std::string& request_id, v1::RouteDecision decision) {
    ingress_log_.decisions[request_id] = std::move(decision);
    v1::GenerateCancel cancel;
    cancel.set_request_id(request_id);
    caf::anon_send(ingress_, cancel_atom::value, GenerateCancelMessage{std::move(cancel)});
    scheduler_.run();
  }

  // Fires the sweep timer once the clock reads `elapsed` more.
  void sweep_after(std::chrono::milliseconds elapsed) {
    clock_->advance(elapsed);
    ASSERT_TRUE(scheduler_.trigger_timeout()) << "the sweep is armed while routes wait";
    scheduler_.run();
  }

  IngressLog ingress_log_;
  ingress_actor ingress_;
  gateway_actor gateway_;
  std::vector<v1::RouteDecision> decisions_;
};

TEST_F(GatewayActorTest, TheEntrysDecisionReachesTheCallbackOnce) {
  route("r1");
  ASSERT_EQ(ingress_log_.routes.size(), 1U);
  EXPECT_TRUE(decisions_.empty());
  answer("r1", booked("r1", "b1"));
  ASSERT_EQ(decisions_.size(), 1U);
  EXPECT_EQ(decisions_[0].success().booking_id(), "b1");
  // Its deadline passes: nothing more is said about it.
  sweep_after(11s);
  EXPECT_EQ(decisions_.size(), 1U);
  EXPECT_TRUE(ingress_log_.reports.empty());
  EXPECT_FALSE(scheduler_.has_pending_timeout()) << "no sweep while nothing waits";
}

TEST_F(GatewayActorTest, ARouteTheEntryNeverAnswersEndsWithATimeoutAndItsLateBookingIsAborted) {
  route("r1");
  sweep_after(5s);
  EXPECT_TRUE(decisions_.empty()) << "not yet due";
  route("r2");  // due 5 s after r1
  for (int second = 0; second < 5; ++second) sweep_after(1s);
  ASSERT_EQ(decisions_.size(), 1U);
  EXPECT_EQ(decisions_[0].request_id(), "r1");
  ASSERT_TRUE(decisions_[0].has_error());
  EXPECT_EQ(decisions_[0].error().code(), v1::ROUTE_ERROR_TIMEOUT);
  EXPECT_NE(decisions_[0].error().message().find("10000 ms"), std::string::npos)
      << decisions_[0].error().message();

  // The entry answers r1 after all, with a booking nobody will report on: it is aborted.
  answer("r1", booked("r1", "late"));
  EXPECT_EQ(decisions_.size(), 1U) << "the callback ran once, with the timeout";
  ASSERT_EQ(ingress_log_.reports.size(), 1U);
  EXPECT_EQ(ingress_log_.reports[0].booking_id(), "late");
  EXPECT_EQ(ingress_log_.reports[0].event(), v1::LIFECYCLE_EVENT_ABORTED);

  for (int second = 0; second < 5; ++second) sweep_after(1s);
  ASSERT_EQ(decisions_.size(), 2U);
  EXPECT_EQ(decisions_[1].request_id(), "r2");
  EXPECT_EQ(decisions_[1].error().code(), v1::ROUTE_ERROR_TIMEOUT);
}

TEST_F(GatewayActorTest, AnsweredRequestsLeaveNoDeadlineBehind) {
  for (int i = 0; i < 100; ++i) {
    const std::string id = "r" + std::to_string(i);
    route(id);
    answer(id, booked(id, "b" + std::to_string(i)));
  }
  ASSERT_EQ(decisions_.size(), 100U);
  route("last");
  // Only the request still waiting keeps a deadline: the state does not grow with the traffic.
  EXPECT_EQ(ingress_log_.routes.size(), 101U);
  EXPECT_EQ(gateway_state().deadlines.size(), 1U);
}

TEST_F(GatewayActorTest, AReportGoesToTheEntry) {
  v1::LifecycleReport report;
  report.set_booking_id("b1");
  report.set_event(v1::LIFECYCLE_EVENT_FIRST_TOKEN);
  caf::anon_send(gateway_, report_atom::value, LifecycleReportMessage{report});
  scheduler_.run();
  ASSERT_EQ(ingress_log_.reports.size(), 1U);
  EXPECT_EQ(ingress_log_.reports[0].event(), v1::LIFECYCLE_EVENT_FIRST_TOKEN);
}

TEST_F(GatewayActorTest, AStoppingGatewayAnswersEveryRouteStillWaiting) {
  route("r1");
  route("r2");
  caf::anon_send_exit(gateway_, caf::exit_reason::user_shutdown);
  gateway_ = nullptr;
  scheduler_.run();
  ASSERT_EQ(decisions_.size(), 2U);
  for (const auto& decision : decisions_) {
    ASSERT_TRUE(decision.has_error());
    EXPECT_EQ(decision.error().code(), v1::ROUTE_ERROR_UNAVAILABLE);
  }
}

}  // namespace
}  // namespace kvr::actors
