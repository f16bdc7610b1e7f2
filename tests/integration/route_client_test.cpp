// The route client that asks again (messages/nats/route_client.hpp) against a real nats-server on
// loopback, with stand-in router nodes in one queue group that speak the route protocol: one that
// never answers (a hung node), ones that answer, or ask the client to go elsewhere.
#include "messages/nats/route_client.hpp"

#include <atomic>
#include <map>
#include <mutex>
#include <set>

#include <gtest/gtest.h>

#include "tests/testing/nats_recorder.hpp"
#include "tests/testing/nats_server.hpp"

namespace kvr::nats {
namespace {

using namespace std::chrono_literals;
using testing::NatsRecorder;
using testing::NatsServer;
using testing::wait_until;

constexpr std::string_view kRouteSubject = "kvr.test.router.route";
constexpr std::string_view kReportSubject = "kvr.test.router.report";
constexpr std::string_view kQueueGroup = "routers";

v1::RouteRequest request_named(std::string id) {
  v1::RouteRequest request;
  request.set_request_id(std::move(id));
  request.set_model("m");
  request.mutable_tokens()->add_ids(1);
  return request;
}

v1::RouteDecision success_for(const v1::RouteRequest& request) {
  v1::RouteDecision decision;
  decision.set_request_id(request.request_id());
  decision.mutable_success()->set_worker_id(7);
  decision.mutable_success()->set_booking_id("booking-" + request.request_id());
  return decision;
}

v1::RouteDecision error_for(const v1::RouteRequest& request, v1::RouteErrorCode code) {
  v1::RouteDecision decision;
  decision.set_request_id(request.request_id());
  decision.mutable_error()->set_code(code);
  decision.mutable_error()->set_message("stand-in");
  return decision;
}

// A stand-in router node: a member of the queue group that answers each request it takes with
// `answer` (nullopt: it keeps the request, as a hung node does) and remembers every id it saw.
class StandInNode {
 public:
  using Answer = std::function<std::optional<v1::RouteDecision>(const v1::RouteRequest&)>;

  ::testing::AssertionResult start(NatsClient& client, Answer answer) {
    answer_ = std::move(answer);
    auto subscribed = client.subscribe(
        kRouteSubject,
        [this, &client](NatsMessage message) {
          v1::RouteRequest request;
          if (!request.ParseFromString(message.data)) return;
          {
            std::lock_guard lock{mutex_};
            ids_.push_back(request.request_id());
            if (answer_ == nullptr) {
              kept_.emplace_back(std::move(message.reply), request);
              return;
            }
          }
          if (auto decision = answer_(request)) {
            (void)client.publish(message.reply, decision->SerializeAsString());
          } else {
            std::lock_guard lock{mutex_};
            kept_.emplace_back(std::move(message.reply), request);
          }
        },
        kQueueGroup);
    if (!subscribed) return ::testing::AssertionFailure() << subscribed.error();
    subscription_.emplace(std::move(*subscribed));
    if (auto flushed = client.flush(2s); !flushed) {
      return ::testing::AssertionFailure() << flushed.error();
    }
    return ::testing::AssertionSuccess();
  }

  // Leaves the queue group (what it kept stays kept).
  void stop() { subscription_.reset(); }

  std::vector<std::string> ids() const {
    std::lock_guard lock{mutex_};
    return ids_;
  }
  // The requests it kept unanswered: (reply subject, request).
  std::vector<std::pair<std::string, v1::RouteRequest>> kept() const {
    std::lock_guard lock{mutex_};
    return kept_;
  }

 private:
  Answer answer_;
  mutable std::mutex mutex_;
  std::vector<std::string> ids_;
  std::vector<std::pair<std::string, v1::RouteRequest>> kept_;
  std::optional<NatsSubscription> subscription_;
};

class RouteClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string error;
    server_ = NatsServer::start(&error);
    ASSERT_TRUE(server_) << error;
    for (auto* client : {&client_, &nodes_connection_}) {
      auto connected = NatsClient::connect({.url = server_->url()});
      ASSERT_TRUE(connected) << connected.error();
      *client = std::move(*connected);
    }
    auto router =
        RouteClient::open(*client_, std::string{kRouteSubject}, std::string{kReportSubject});
    ASSERT_TRUE(router) << router.error();
    router_.emplace(std::move(*router));
    ASSERT_TRUE(reports_.listen(*nodes_connection_, kReportSubject));
  }

  void TearDown() override { router_.reset(); }

  std::unique_ptr<NatsServer> server_;
  std::unique_ptr<NatsClient> client_;
  std::unique_ptr<NatsClient> nodes_connection_;
  std::optional<RouteClient> router_;
  NatsRecorder reports_;
};

TEST(RouteAttemptIdTest, TheFirstAskKeepsTheIdAndEveryLaterAskHasAFreshOne) {
  EXPECT_EQ(attempt_request_id("req", 0), "req");
  EXPECT_EQ(attempt_request_id("req", 1), "req~1");
  EXPECT_EQ(attempt_request_id("req", 4), "req~4");
}

// One of three nodes is hung: every request is still answered, those that reached it by a later
// ask with a fresh id, and no id is asked twice.
TEST_F(RouteClientTest, AHungMemberOfTheQueueGroupCostsOnlyARetry) {
  StandInNode hung;
  StandInNode healthy_a;
  StandInNode healthy_b;
  ASSERT_TRUE(hung.start(*nodes_connection_, nullptr));
  const auto answer = [](const v1::RouteRequest& request) { return success_for(request); };
  ASSERT_TRUE(healthy_a.start(*nodes_connection_, answer));
  ASSERT_TRUE(healthy_b.start(*nodes_connection_, answer));

  constexpr int kRequests = 60;
  int asked_again = 0;
  for (int i = 0; i < kRequests; ++i) {
    const std::string id = "r-" + std::to_string(i);
    auto routed =
        router_->route(request_named(id), {.retry_after = 100ms, .max_attempts = 8, .timeout = 5s});
    ASSERT_TRUE(routed) << id << ": " << routed.error();
    EXPECT_TRUE(routed->decision.has_success());
    EXPECT_EQ(routed->decision.request_id(), id) << "the answer carries the request's own id";
    if (routed->attempts > 1) ++asked_again;
  }
  // About a third of the first asks reached the hung node; each was asked again.
  EXPECT_GT(hung.ids().size(), 0U);
  EXPECT_GE(asked_again, 1);
  std::set<std::string> seen;
  for (const StandInNode* node : {&hung, &healthy_a, &healthy_b}) {
    for (const std::string& id : node->ids()) {
      EXPECT_TRUE(seen.insert(id).second) << id << " was asked twice";
    }
  }
}

// The hung node wakes up and answers an ask whose request another ask already settled: the
// client releases that booking at once (ABORTED, CLIENT_CANCELLED) instead of leaving it open
// until its lease ends.
TEST_F(RouteClientTest, ALateSuccessIsReleased) {
  StandInNode hung;
  ASSERT_TRUE(hung.start(*nodes_connection_, nullptr));
  std::atomic<bool> healthy_started = false;
  StandInNode healthy;
  // The hung node alone takes the first ask, then leaves the group to the healthy one.
  std::thread join([&] {
    wait_until([&] { return !hung.ids().empty(); }, 5s);
    hung.stop();
    healthy_started = static_cast<bool>(healthy.start(
        *nodes_connection_, [](const v1::RouteRequest& request) { return success_for(request); }));
  });
  auto routed =
      router_->route(request_named("late"), {.retry_after = 1s, .max_attempts = 4, .timeout = 10s});
  join.join();
  ASSERT_TRUE(healthy_started);
  ASSERT_TRUE(routed) << routed.error();
  EXPECT_EQ(routed->attempts, 2);
  EXPECT_EQ(routed->decision.success().booking_id(), "booking-late~1");

  // Now the hung node answers its ask.
  const auto kept = hung.kept();
  ASSERT_EQ(kept.size(), 1U);
  EXPECT_EQ(kept.front().second.request_id(), "late");
  ASSERT_TRUE(nodes_connection_->publish(kept.front().first,
                                         success_for(kept.front().second).SerializeAsString()));
  ASSERT_TRUE(reports_.wait_for(1, 5s));
  v1::LifecycleReport release;
  ASSERT_TRUE(release.ParseFromString(reports_.payloads().front()));
  EXPECT_EQ(release.booking_id(), "booking-late");
  EXPECT_EQ(release.event(), v1::LIFECYCLE_EVENT_ABORTED);
  EXPECT_EQ(release.abort_cause(), v1::ABORT_CAUSE_CLIENT_CANCELLED);
}

// OWNER_LOST and UNAVAILABLE ask again at once, not after retry_after; other errors are final.
TEST_F(RouteClientTest, APartitionThatMovedIsAskedAgainAtOnceAndOtherErrorsAreFinal) {
  std::atomic<int> asks = 0;
  StandInNode node;
  ASSERT_TRUE(node.start(*nodes_connection_, [&](const v1::RouteRequest& request) {
    const int ask = asks++;
    if (request.request_id().starts_with("moved")) {
      if (ask == 0) return error_for(request, v1::ROUTE_ERROR_OWNER_LOST);
      if (ask == 1) return error_for(request, v1::ROUTE_ERROR_UNAVAILABLE);
      return success_for(request);
    }
    return error_for(request, v1::ROUTE_ERROR_NO_WORKERS);
  }));
  // retry_after is far beyond the test's bounds: only an immediate ask finishes in time.
  const RouteRetryPolicy slow_retries{.retry_after = 60s, .max_attempts = 5, .timeout = 120s};
  const auto started = std::chrono::steady_clock::now();
  auto moved = router_->route(request_named("moved"), slow_retries);
  ASSERT_TRUE(moved) << moved.error();
  EXPECT_TRUE(moved->decision.has_success());
  EXPECT_EQ(moved->attempts, 3);
  EXPECT_LT(std::chrono::steady_clock::now() - started, 30s);

  asks = 0;
  auto refused = router_->route(request_named("none"), slow_retries);
  ASSERT_TRUE(refused) << refused.error();
  EXPECT_EQ(refused->attempts, 1);
  EXPECT_EQ(refused->decision.error().code(), v1::ROUTE_ERROR_NO_WORKERS);
  EXPECT_EQ(node.ids(), (std::vector<std::string>{"moved", "moved~1", "moved~2", "none"}));
}

// No node at all: NATS's "no responders" ends the call with an error that says so, after the
// policy's asks (never a hang until the timeout's end).
TEST_F(RouteClientTest, WithoutANodeTheErrorSaysNoNodeSubscribes) {
  const auto started = std::chrono::steady_clock::now();
  auto routed = router_->route(request_named("alone"),
                               {.retry_after = 20ms, .max_attempts = 3, .timeout = 60s});
  ASSERT_FALSE(routed);
  EXPECT_NE(routed.error().find("no router node subscribes"), std::string::npos) << routed.error();
  EXPECT_LT(std::chrono::steady_clock::now() - started, 30s);
}

// With every ask kept by hung nodes, the call ends at its timeout with an error, having asked
// exactly max_attempts times.
TEST_F(RouteClientTest, AskingStopsAtTheAttemptBound) {
  StandInNode hung;
  ASSERT_TRUE(hung.start(*nodes_connection_, nullptr));
  auto routed = router_->route(request_named("stuck"),
                               {.retry_after = 10ms, .max_attempts = 3, .timeout = 300ms});
  ASSERT_FALSE(routed);
  EXPECT_NE(routed.error().find("no decision within 300 ms (3 asks"), std::string::npos)
      << routed.error();
  EXPECT_EQ(hung.ids(), (std::vector<std::string>{"stuck", "stuck~1", "stuck~2"}));
}

}  // namespace
}  // namespace kvr::nats
