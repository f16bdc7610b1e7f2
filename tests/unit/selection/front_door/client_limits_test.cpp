// The front door against clients that send too slowly, too much at once, or never: pipelined
// requests, the header, body, idle and send timeouts, the connection cap (an idle connection's
// slot reclaimed, else a 503), and an accept loop out of file descriptors. Raw sockets on
// loopback against a front door that forwards to an engine stand-in; timeouts are set short and
// each test awaits the event (a close, an answer) within a bound.
#include <chrono>
#include <csignal>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "messages/metrics/metrics_registry.hpp"
#include "selection/front_door/http_front_door.hpp"
#include "tests/testing/child_process.hpp"
#include "tests/unit/selection/front_door/front_door_stand_ins.hpp"

namespace kvr::front_door {
namespace {

using namespace std::chrono_literals;
using stand_ins::EngineStandIn;
using stand_ins::OneEngineGateway;
namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;

const std::string kBody = R"({"model":"m","prompt":[1,2,3,4],"max_tokens":1})";

std::string completion_request(bool close = false) {
  return "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" +
         std::string{close ? "Connection: close\r\n" : ""} +
         "Content-Length: " + std::to_string(kBody.size()) + "\r\n\r\n" + kBody;
}

// Waits for `done` (checked every millisecond) for `bound` at most.
bool wait_until(const std::function<bool()>& done, std::chrono::milliseconds bound = 10s) {
  const auto deadline = std::chrono::steady_clock::now() + bound;
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

// Whether the server closed `socket` within `bound` (its end read; what came before is kept).
bool closed_by_server(tcp::socket& socket, std::string* received = nullptr,
                      std::chrono::milliseconds bound = 10s) {
  const auto deadline = std::chrono::steady_clock::now() + bound;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left <= 0ms) return false;
    pollfd ready{.fd = socket.native_handle(), .events = POLLIN, .revents = 0};
    if (::poll(&ready, 1, static_cast<int>(left.count())) <= 0) return false;
    char bytes[4096];
    const ssize_t got = ::recv(socket.native_handle(), bytes, sizeof bytes, 0);
    if (got <= 0) return true;  // the end, or a reset
    if (received != nullptr) received->append(bytes, static_cast<std::size_t>(got));
  }
}

class ClientLimitsTest : public ::testing::Test {
 protected:
  void start(FrontDoorOptions options = {}) {
    engine_ = std::make_unique<EngineStandIn>(EngineStandIn::Behaviour{});
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
    options.threads = 2;
    auto started = HttpFrontDoor::start(std::move(options), gateway_, directory, metrics_);
    ASSERT_TRUE(started) << started.error();
    front_door_ = std::move(*started);
  }

  tcp::socket connect() {
    tcp::socket socket{io_};
    socket.connect({net::ip::make_address("127.0.0.1"), front_door_->port()});
    return socket;
  }

  // One answer read from `socket` (10 s at most).
  std::optional<http::response<http::string_body>> read_answer(tcp::socket& socket,
                                                               beast::flat_buffer& buffer) {
    const timeval bound{.tv_sec = 10, .tv_usec = 0};
    ::setsockopt(socket.native_handle(), SOL_SOCKET, SO_RCVTIMEO, &bound, sizeof bound);
    http::response<http::string_body> answer;
    beast::error_code error;
    http::read(socket, buffer, answer, error);
    if (error) return std::nullopt;
    return answer;
  }

  double timeouts(const std::string& phase) const {
    return metrics_->value("kvr_http_client_timeouts_total", {{"phase", phase}});
  }

  net::io_context io_;
  std::shared_ptr<metrics::MetricsRegistry> metrics_ = std::make_shared<metrics::MetricsRegistry>();
  std::unique_ptr<EngineStandIn> engine_;
  std::shared_ptr<OneEngineGateway> gateway_;
  std::unique_ptr<HttpFrontDoor> front_door_;
};

TEST_F(ClientLimitsTest, APathThatIsNotUtf8IsAnswered404CountedAsOtherAndTheNextRequestServed) {
  start();
  auto client = connect();
  net::write(client, net::buffer(std::string{"GET /\x97\xff HTTP/1.1\r\nHost: kvr\r\n\r\n"} +
                                 completion_request(/*close=*/true)));
  beast::flat_buffer buffer;
  const auto refused = read_answer(client, buffer);
  ASSERT_TRUE(refused);
  EXPECT_EQ(refused->result_int(), 404u);
  const auto error = nlohmann::json::parse(refused->body(), nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(error.is_discarded()) << refused->body();
  EXPECT_EQ(error["error"]["code"], "unknown_url");
  const auto served = read_answer(client, buffer);
  ASSERT_TRUE(served);
  EXPECT_EQ(served->result_int(), 200u);
  EXPECT_EQ(metrics_->value("kvr_http_requests_total", {{"endpoint", "other"}, {"code", "404"}}),
            1);
}

TEST_F(ClientLimitsTest, ThreePipelinedPostsGetThreeAnswersInOrder) {
  start();
  auto client = connect();
  net::write(client, net::buffer(completion_request() + completion_request() +
                                 completion_request(/*close=*/true)));
  beast::flat_buffer buffer;
  for (int i = 0; i < 3; ++i) {
    const auto answer = read_answer(client, buffer);
    ASSERT_TRUE(answer) << "answer " << i;
    EXPECT_EQ(answer->result_int(), 200u) << "answer " << i;
  }
  EXPECT_EQ(engine_->answered(), 3);
  EXPECT_TRUE(closed_by_server(client)) << "the third asked for the connection's close";
}

TEST_F(ClientLimitsTest, AHeadSentAByteAtATimeIsCutOffAtTheHeaderTimeout) {
  start({.header_timeout = 300ms});
  auto client = connect();
  const std::string head =
      "POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Padding: " + std::string(4000, 'a') +
      "\r\n\r\n";
  // A byte each 20 ms: every read makes progress, the head never completes in time.
  std::size_t sent = 0;
  bool closed = false;
  for (; sent < head.size() && !closed; ++sent) {
    beast::error_code error;
    net::write(client, net::buffer(head.data() + sent, 1), error);
    if (error) break;
    pollfd ready{.fd = client.native_handle(), .events = POLLIN, .revents = 0};
    closed = ::poll(&ready, 1, 20) > 0;
  }
  EXPECT_TRUE(closed || closed_by_server(client));
  EXPECT_LT(sent, head.size()) << "the head was cut off before it was whole";
  EXPECT_TRUE(wait_until([&] { return timeouts("header") == 1; }))
      << "the timeout is counted as its read ends, after the socket closed";
}

TEST_F(ClientLimitsTest, ANewConnectionThatSendsNothingIsClosedAtTheHeaderTimeout) {
  start({.header_timeout = 200ms});
  auto client = connect();
  EXPECT_TRUE(closed_by_server(client));
  EXPECT_TRUE(wait_until([&] { return timeouts("header") == 1; }))
      << "the timeout is counted as its read ends, after the socket closed";
  EXPECT_TRUE(wait_until([&] { return front_door_->connections() == 0; }));
}

TEST_F(ClientLimitsTest, AKeptAliveConnectionIdlePastItsTimeoutIsClosed) {
  start({.idle_timeout = 200ms});
  auto client = connect();
  net::write(client, net::buffer(completion_request()));
  beast::flat_buffer buffer;
  const auto answer = read_answer(client, buffer);
  ASSERT_TRUE(answer);
  EXPECT_EQ(answer->result_int(), 200u);
  EXPECT_TRUE(closed_by_server(client));
  EXPECT_TRUE(wait_until([&] { return timeouts("idle") == 1; }));
  EXPECT_EQ(timeouts("header"), 0);
}

TEST_F(ClientLimitsTest, ABodyBelowTheMinimumRateIsClosed) {
  start({.body_timeout = 200ms, .min_body_bytes_per_second = 1024});
  auto client = connect();
  net::write(client, net::buffer(std::string{"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                             "Content-Length: 100000\r\n\r\n{\"model\":"}));
  EXPECT_TRUE(closed_by_server(client));
  EXPECT_TRUE(wait_until([&] { return timeouts("body") == 1; }));
  EXPECT_EQ(engine_->answered(), 0);
}

TEST_F(ClientLimitsTest, AtTheCapANewClientTakesTheSlotOfTheConnectionIdleLongest) {
  start({.max_connections = 2});
  auto oldest = connect();
  ASSERT_TRUE(wait_until([&] { return front_door_->connections() == 1; }));
  auto newer = connect();
  ASSERT_TRUE(wait_until([&] { return front_door_->connections() == 2; }));
  auto client = connect();
  net::write(client, net::buffer(completion_request()));
  beast::flat_buffer buffer;
  const auto answer = read_answer(client, buffer);
  ASSERT_TRUE(answer);
  EXPECT_EQ(answer->result_int(), 200u);
  EXPECT_TRUE(closed_by_server(oldest));
  EXPECT_EQ(metrics_->value("kvr_http_idle_connections_reclaimed_total"), 1);
  // The newer idle connection kept its slot and is served.
  net::write(newer, net::buffer(completion_request()));
  beast::flat_buffer newer_buffer;
  const auto newer_answer = read_answer(newer, newer_buffer);
  ASSERT_TRUE(newer_answer);
  EXPECT_EQ(newer_answer->result_int(), 200u);
}

TEST_F(ClientLimitsTest, AtTheCapWithNoIdleConnectionANewClientIsAnswered503) {
  start({.max_connections = 1});
  auto busy = connect();
  ASSERT_TRUE(wait_until([&] { return front_door_->idle_connections() == 1; }));
  // Half a head: the connection is reading a request, not idle.
  net::write(busy, net::buffer(std::string{"POST /v1/completions HTTP/1.1\r\nHo"}));
  ASSERT_TRUE(wait_until([&] { return front_door_->idle_connections() == 0; }));
  auto refused = connect();
  std::string received;
  EXPECT_TRUE(closed_by_server(refused, &received));
  EXPECT_TRUE(received.starts_with("HTTP/1.1 503 ")) << received;
  EXPECT_NE(received.find("Connection: close"), std::string::npos) << received;
  EXPECT_NE(received.find(R"("code":"service_unavailable")"), std::string::npos) << received;
  EXPECT_EQ(metrics_->value("kvr_http_connections_refused_total", {{"reason", "limit"}}), 1);
  // The busy connection was left alone.
  net::write(busy, net::buffer("st: x\r\nContent-Type: application/json\r\nContent-Length: " +
                               std::to_string(kBody.size()) + "\r\n\r\n" + kBody));
  beast::flat_buffer buffer;
  const auto answer = read_answer(busy, buffer);
  ASSERT_TRUE(answer);
  EXPECT_EQ(answer->result_int(), 200u);
}

TEST_F(ClientLimitsTest, TheCapIsClampedUnderTheDescriptorLimit) {
  rlimit saved{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &saved), 0);
  rlimit lowered = saved;
  lowered.rlim_cur = std::min<rlim_t>(saved.rlim_max, 1024);
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &lowered), 0);
  start({.max_connections = 20'000});
  ::setrlimit(RLIMIT_NOFILE, &saved);
  // 1024 less a reserve of 128, two descriptors a connection.
  EXPECT_EQ(front_door_->max_connections(), (lowered.rlim_cur - 128) / 2);
}

// The process runs out of descriptors while clients wait in the listen queue: each accept
// answers one of them 503 through the spare descriptor and the loop pauses, longer each time,
// instead of spinning; accepting resumes once descriptors are free. The clients are another
// process's (a Python child), so that this one's table can be filled.
TEST_F(ClientLimitsTest, OutOfDescriptorsTheAcceptLoopBacksOffAndClientsAreToldWhy) {
  start();
  kvr::testing::TemporaryDirectory folder;
  const auto log = folder.path() / "clients.log";
  const std::string script = fmt::format(
      "import signal, socket, time\n"
      "signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGUSR1}})\n"
      "print('waiting', flush=True)\n"
      "signal.sigwait({{signal.SIGUSR1}})\n"
      "clients = [socket.create_connection(('127.0.0.1', {}), timeout=10) for _ in range(200)]\n"
      "print('connected', flush=True)\n"
      "time.sleep(60)\n",
      front_door_->port());
  auto clients = kvr::testing::ChildProcess::start({"python3", "-c", script}, log);
  ASSERT_TRUE(clients);
  ASSERT_TRUE(kvr::testing::wait_until(
      [&] { return clients->log().find("waiting") != std::string::npos; }, 10s));
  {
    // A request served, and its connection closed, first; then nothing runs but the accept loop.
    // UBSan's vptr check reads a type it meets for the first time through a pipe, which cannot
    // be opened once the descriptors are gone (a false report).
    auto client = connect();
    net::write(client, net::buffer(completion_request(/*close=*/true)));
    beast::flat_buffer buffer;
    ASSERT_TRUE(read_answer(client, buffer));
    ASSERT_TRUE(closed_by_server(client));
  }
  ASSERT_TRUE(wait_until([&] { return metrics_->value("kvr_http_connections_open") == 0; }));
  // No descriptor left below a lowered limit.
  rlimit saved{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &saved), 0);
  std::vector<int> fillers;
  int highest = 0;
  for (const auto& entry : std::filesystem::directory_iterator{"/proc/self/fd"}) {
    highest = std::max(highest, std::stoi(entry.path().filename().string()));
  }
  rlimit lowered = saved;
  lowered.rlim_cur = static_cast<rlim_t>(highest) + 1;
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &lowered), 0);
  for (int fd; (fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC)) >= 0;) fillers.push_back(fd);
  clients->signal(SIGUSR1);
  const auto errors = [&] {
    return metrics_->value("kvr_http_accept_errors_total", {{"error", "descriptors"}});
  };
  const auto refused = [&] {
    return metrics_->value("kvr_http_connections_refused_total", {{"reason", "descriptors"}});
  };
  // (A failure is counted before its client's refusal.)
  const bool failed = wait_until([&] { return errors() >= 3 && refused() >= 3; });
  const double seen = errors();
  const double told = refused();
  for (const int fd : fillers) ::close(fd);
  ::setrlimit(RLIMIT_NOFILE, &saved);
  ASSERT_TRUE(failed) << "the accept loop met no shortage of descriptors";
  // Spinning, the count would be in the hundreds by the time it is seen at 3.
  EXPECT_LE(seen, 5);
  EXPECT_GE(told, 3) << "each failed accept answers one waiting client";
  // Descriptors are back: accepting resumes (after a pause of a second at most).
  auto client = connect();
  net::write(client, net::buffer(completion_request()));
  beast::flat_buffer buffer;
  const auto answer = read_answer(client, buffer);
  ASSERT_TRUE(answer);
  EXPECT_EQ(answer->result_int(), 200u);
}

}  // namespace
}  // namespace kvr::front_door
