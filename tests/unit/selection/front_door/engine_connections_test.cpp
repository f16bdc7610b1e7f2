// The front door's kept-alive engine connections: the pool on its own (socket pairs, a manual
// clock), then HttpFrontDoor forwarding to a hand-written engine over loopback, which shows each
// request's connection (new, reused, or resent when the engine dropped a reused one).
#include "selection/front_door/engine_connections.hpp"

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <gtest/gtest.h>
#include <httplib.h>
#include <sys/socket.h>
#include <unistd.h>

#include "messages/metrics/metrics_registry.hpp"
#include "selection/front_door/http_front_door.hpp"
#include "tests/unit/selection/front_door/front_door_stand_ins.hpp"

namespace kvr::front_door {
namespace {
using stand_ins::EngineStandIn;
using stand_ins::OneEngineGateway;

using namespace std::chrono_literals;
namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;

// ---- the pool ---------------------------------------------------------------------------------

// One end of a connected socket pair is parked; the test holds the other (the "engine").
struct SocketPair {
  SocketPair() { EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, ends), 0); }
  ~SocketPair() {
    if (ends[1] >= 0) ::close(ends[1]);
  }
  EngineConnections::Parked parked() const { return {tcp::v4(), ends[0]}; }
  void close_engine_side() {
    ::close(ends[1]);
    ends[1] = -1;
  }
  // Whether the parked end was closed by the pool: the engine's side reads its end (or, when
  // the closed end had unread bytes, a reset).
  bool closed_by_pool() const {
    char byte = 0;
    const ssize_t got = ::recv(ends[1], &byte, 1, MSG_DONTWAIT);
    return got == 0 || (got < 0 && errno == ECONNRESET);
  }
  int ends[2]{-1, -1};
};

TEST(EngineConnectionsTest, GivesBackTheNewestIdleConnectionOfTheSameEngine) {
  EngineConnections pool{{.per_engine = 4, .idle_limit = 4s}};
  SocketPair older;
  SocketPair newer;
  pool.park("10.0.0.1:8000", older.parked());
  pool.park("10.0.0.1:8000", newer.parked());
  EXPECT_FALSE(pool.take("10.0.0.2:8000"));
  const auto taken = pool.take("10.0.0.1:8000");
  ASSERT_TRUE(taken);
  EXPECT_EQ(taken->handle, newer.ends[0]);
  const auto next = pool.take("10.0.0.1:8000");
  ASSERT_TRUE(next);
  EXPECT_EQ(next->handle, older.ends[0]);
  EXPECT_FALSE(pool.take("10.0.0.1:8000"));
  ::close(older.ends[0]);
  ::close(newer.ends[0]);
}

TEST(EngineConnectionsTest, AConnectionTheEngineClosedOrWroteOnIsClosedNotGiven) {
  EngineConnections pool{{.per_engine = 4, .idle_limit = 4s}};
  SocketPair closed;
  SocketPair chatty;
  SocketPair good;
  pool.park("e:1", good.parked());
  pool.park("e:1", closed.parked());
  pool.park("e:1", chatty.parked());
  closed.close_engine_side();
  ASSERT_EQ(::send(chatty.ends[1], "x", 1, 0), 1);
  const auto taken = pool.take("e:1");
  ASSERT_TRUE(taken);
  EXPECT_EQ(taken->handle, good.ends[0]);
  EXPECT_TRUE(chatty.closed_by_pool());
  EXPECT_EQ(pool.idle(), 0u);
  ::close(good.ends[0]);
}

TEST(EngineConnectionsTest, AConnectionIdlePastTheLimitIsClosed) {
  auto clock = std::make_shared<ManualClock>();
  EngineConnections pool{{.per_engine = 4, .idle_limit = 4s}, clock};
  SocketPair old_one;
  pool.park("e:1", old_one.parked());
  clock->advance(3s);
  SocketPair recent;
  pool.park("e:1", recent.parked());
  clock->advance(1500ms);  // old_one idle 4.5 s, recent 1.5 s
  const auto taken = pool.take("e:1");
  ASSERT_TRUE(taken);
  EXPECT_EQ(taken->handle, recent.ends[0]);
  EXPECT_TRUE(old_one.closed_by_pool());
  EXPECT_EQ(pool.idle(), 0u);
  ::close(recent.ends[0]);
}

TEST(EngineConnectionsTest, KeepsAtMostItsShareOfAnEngineAndClosesTheRest) {
  EngineConnections pool{{.per_engine = 1, .idle_limit = 4s}};
  SocketPair first;
  SocketPair second;
  pool.park("e:1", first.parked());
  pool.park("e:1", second.parked());
  EXPECT_EQ(pool.idle(), 1u);
  EXPECT_TRUE(second.closed_by_pool());
  EXPECT_FALSE(first.closed_by_pool());
}

// ---- forwarding over them ---------------------------------------------------------------------

class ForwardingTest : public testing::Test {
 protected:
  void start(EngineStandIn::Behaviour behaviour) {
    engine_ = std::make_unique<EngineStandIn>(behaviour);
    auto directory = std::make_shared<FleetDirectory>();
    discovery::WorkerRegistration worker;
    worker.worker_id = OneEngineGateway::kWorker;
    worker.incarnation = 1;
    worker.model = "m";
    worker.block_size = 16;
    worker.liveness_ttl = 600s;
    worker.http_url = engine_->url();
    directory->registered(worker);
    gateway_ = std::make_shared<OneEngineGateway>(engine_->url());
    auto started = HttpFrontDoor::start({}, gateway_, directory, metrics_);
    ASSERT_TRUE(started) << started.error();
    front_door_ = std::move(*started);
  }

  int post_completion() {
    httplib::Client client{"127.0.0.1", front_door_->port()};
    client.set_read_timeout(10s);
    const auto answer =
        client.Post("/v1/completions", R"({"model":"m","prompt":[1,2,3,4],"max_tokens":1})",
                    "application/json");
    return answer ? answer->status : 0;
  }

  double connections(const std::string& outcome) const {
    return metrics_->value("kvr_http_engine_connections_total", {{"outcome", outcome}});
  }

  std::shared_ptr<metrics::MetricsRegistry> metrics_ = std::make_shared<metrics::MetricsRegistry>();
  std::unique_ptr<EngineStandIn> engine_;
  std::shared_ptr<OneEngineGateway> gateway_;
  std::unique_ptr<HttpFrontDoor> front_door_;
};

// A client that leaves while its request is routed, and the front door stops before the decision
// comes (as the node stops it before its actors): the pending decision does not keep the
// connection alive past the front door, and the decision that comes later ends its booking.
TEST_F(ForwardingTest, ADecisionForAConnectionThatIsGoneEndsItsBooking) {
  start({});
  gateway_->hold_routes();
  {
    net::io_context io;
    tcp::socket client{io};
    client.connect({net::ip::make_address("127.0.0.1"), front_door_->port()});
    const std::string body = R"({"model":"m","prompt":[1,2,3,4],"max_tokens":1})";
    const std::string request =
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
        "Content-Type: application/json\r\nContent-Length: " +
        std::to_string(body.size()) + "\r\n\r\n" + body;
    net::write(client, net::buffer(request));
    ASSERT_TRUE(gateway_->wait_held(1));
  }  // the client goes away
  front_door_.reset();  // drains: every connection has ended when it returns
  EXPECT_EQ(metrics_->value("kvr_http_connections_open"), 0)
      << "no connection outlives its front door";
  EXPECT_EQ(gateway_->aborted(), 0);
  gateway_->release_held();
  EXPECT_EQ(gateway_->aborted(), 1) << "the late decision's booking is ended";
}

TEST_F(ForwardingTest, RequestsForwardedOneAfterAnotherShareOneEngineConnection) {
  start({});
  for (int i = 0; i < 3; ++i) ASSERT_EQ(post_completion(), 200);
  EXPECT_EQ(engine_->connections(), 1);
  EXPECT_EQ(engine_->answered(), 3);
  EXPECT_EQ(connections("new"), 1);
  EXPECT_EQ(connections("reused"), 2);
}

TEST_F(ForwardingTest, AReusedConnectionTheEngineDropsIsResentOnANewOneWithoutBlame) {
  start({.drop_second_request_of_first_connection = true});
  ASSERT_EQ(post_completion(), 200);
  ASSERT_EQ(post_completion(), 200);
  EXPECT_EQ(engine_->connections(), 2);
  EXPECT_EQ(engine_->answered(), 2);
  EXPECT_EQ(connections("reused"), 1);
  EXPECT_EQ(connections("resent"), 1);
  // Neither an engine failure nor a routing retry: the booking was never aborted.
  EXPECT_EQ(metrics_->value("kvr_http_engine_failures_total", {{"phase", "first_byte"}}), 0);
  EXPECT_EQ(metrics_->value("kvr_http_retries_total"), 0);
  EXPECT_EQ(gateway_->aborted(), 0);
}

TEST_F(ForwardingTest, AnEngineThatClosesAfterEachAnswerGetsANewConnectionEachTime) {
  start({.close_after_answer = true});
  for (int i = 0; i < 2; ++i) ASSERT_EQ(post_completion(), 200);
  EXPECT_EQ(engine_->connections(), 2);
  EXPECT_EQ(connections("new"), 2);
  EXPECT_EQ(connections("reused"), 0);
}

}  // namespace
}  // namespace kvr::front_door
