// The node's HTTP front door under hostile use, all real processes (nats-server, `kvr node
// --http-port`, `kvr mocker` workers served through the generate API with the bundled Qwen3
// tokenizer): a node under `ulimit -n 1024` flooded with 1,100 idle connections stays idle and
// answers /health; idle, silent and slowloris connections are closed at their timeouts and a new
// client is served; clients that never read their streams do not grow the node's memory; three
// pipelined POSTs get three answers.
#include <chrono>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "messages/descriptor_limit.hpp"
#include "tests/testing/kvr_binary.hpp"
#include "tests/testing/kvr_cluster_test.hpp"
#include "tests/testing/loopback_http.hpp"
#include "tests/testing/tokenizer_data.hpp"

namespace kvr {
namespace {

using namespace std::chrono_literals;
using Json = nlohmann::json;
using testing::free_port;
using testing::wait_until;
namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;

constexpr std::uint32_t kBlockSize = 16;

// CPU seconds (user and system) a process has used so far.
double cpu_seconds(pid_t pid) {
  std::ifstream stat{"/proc/" + std::to_string(pid) + "/stat"};
  std::string text{std::istreambuf_iterator<char>{stat}, std::istreambuf_iterator<char>{}};
  // Fields after the command's closing parenthesis: state is field 3, utime 14, stime 15.
  std::istringstream fields{text.substr(text.rfind(')') + 2)};
  std::string field;
  double ticks = 0;
  for (int index = 3; index <= 15 && fields >> field; ++index) {
    if (index == 14 || index == 15) ticks += std::stod(field);
  }
  return ticks / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

// Whether the server closed `socket` within `bound` (its end, or a reset).
bool closed_by_server(tcp::socket& socket, std::chrono::milliseconds bound = 20s) {
  const auto deadline = std::chrono::steady_clock::now() + bound;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left <= 0ms) return false;
    pollfd ready{.fd = socket.native_handle(), .events = POLLIN, .revents = 0};
    if (::poll(&ready, 1, static_cast<int>(left.count())) <= 0) return false;
    char bytes[4096];
    if (::recv(socket.native_handle(), bytes, sizeof bytes, 0) <= 0) return true;
  }
}

class FrontDoorLimitsTest : public testing::KvrClusterTest {
 protected:
  FrontDoorLimitsTest() : KvrClusterTest(kvr::testing::kvr_binary(), "front-door-limits") {}

  void TearDown() override {
    if (HasFailure()) {
      if (node_) std::cerr << "---- node log\n" << node_->log();
      if (mocker_) std::cerr << "---- mocker log\n" << mocker_->log();
    }
  }

  // A node with the bundled Qwen3 tokenizer for mock-model and one `kvr mocker` worker.
  void start(std::vector<std::string> extra = {},
             std::optional<std::uint64_t> descriptor_limit = std::nullopt,
             std::optional<std::uint64_t> kv_blocks = std::nullopt) {
    tokenizer_ = std::string{testing::bundled_tokenizers_dir()} + "/qwen3";
    metrics_port_ = free_port();
    http_port_ = free_port();
    extra.insert(extra.end(), {"--http-port", std::to_string(http_port_), "--tokenizer",
                               "mock-model=" + tokenizer_});
    node_ = kvr_->start_node({.block_size = kBlockSize,
                              .metrics_port = metrics_port_,
                              .descriptor_limit = descriptor_limit,
                              .extra = std::move(extra)});
    ASSERT_TRUE(node_);
    ASSERT_TRUE(testing::wait_until_healthy(metrics_port_, 20s)) << node_->log();
    mocker_ = kvr_->start_mocker(
        {.workers = 1, .block_size = kBlockSize, .num_gpu_blocks = kv_blocks, .time_scale = "20"});
    ASSERT_TRUE(mocker_);
    ASSERT_TRUE(wait_until([&] { return health() == 200; }, 20s));
  }

  int health() const {
    httplib::Client client{"127.0.0.1", http_port_};
    client.set_connection_timeout(5s);
    client.set_read_timeout(5s);
    const auto answer = client.Get("/health");
    return answer ? answer->status : 0;
  }

  tcp::socket connect() {
    tcp::socket socket{io_};
    socket.connect({net::ip::make_address("127.0.0.1"), http_port_});
    return socket;
  }

  double node_metric(const std::string& name) const {
    return testing::metric(testing::http_get(metrics_port_, "/metrics"), name);
  }

  static std::string post(const std::string& path, const std::string& body, bool close = false) {
    return "POST " + path + " HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" +
           (close ? "Connection: close\r\n" : "") +
           "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
  }

  net::io_context io_;
  std::string tokenizer_;
  std::optional<testing::ChildProcess> node_;
  std::optional<testing::ChildProcess> mocker_;
  std::uint16_t metrics_port_ = 0;
  std::uint16_t http_port_ = 0;
};

TEST_F(FrontDoorLimitsTest,
       UnderADescriptorLimitOf1024AFloodOfIdleConnectionsNeitherSpinsNorStalls) {
  // This process holds 1,100 client sockets.
  ASSERT_GE(raise_descriptor_limit().soft, 2048u);
  start({}, 1024);
  if (HasFatalFailure()) return;
  EXPECT_NE(node_->log().find("at most 448 client connections"), std::string::npos)
      << "the cap is clamped under the limit (1024 less 128, two descriptors a connection)";
  std::vector<tcp::socket> idle;
  for (int i = 0; i < 1100; ++i) {
    tcp::socket socket{io_};
    beast::error_code error;
    socket.connect({net::ip::make_address("127.0.0.1"), http_port_}, error);
    ASSERT_FALSE(error) << "connection " << i << ": " << error.message();
    idle.push_back(std::move(socket));
  }
  // Each accepted, or refused with a 503 while reclaimed connections closed.
  ASSERT_TRUE(wait_until(
      [&] {
        return node_metric("kvr_http_connections_accepted_total") +
                   node_metric("kvr_http_connections_refused_total") >=
               1100;
      },
      20s));
  EXPECT_LE(node_metric("kvr_http_connections_open"), 448 + 448 / 16);
  // While they sit idle the node does nothing (a spinning accept loop burns a whole core).
  const double before = cpu_seconds(node_->pid());
  const auto start_time = std::chrono::steady_clock::now();
  EXPECT_EQ(health(), 200) << "a new client takes an idle connection's slot";
  std::this_thread::sleep_for(1s);  // the measurement's window, not a wait for an event
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_time).count();
  const double share = (cpu_seconds(node_->pid()) - before) / elapsed;
  std::cout << "node CPU with 1,100 idle connections: " << share * 100 << "% of a core\n";
  EXPECT_LT(share, 0.5);
  EXPECT_EQ(health(), 200);
}

TEST_F(FrontDoorLimitsTest,
       SilentSlowAndIdleConnectionsAreClosedAtTheirTimeoutsAndANewClientIsServed) {
  start({"--http-header-timeout-ms", "1000", "--http-idle-timeout-ms", "1000"});
  if (HasFatalFailure()) return;
  std::vector<tcp::socket> silent;
  std::vector<tcp::socket> slow;
  for (int i = 0; i < 50; ++i) {
    silent.push_back(connect());
    slow.push_back(connect());
    // A head begun and never finished (slowloris).
    net::write(slow.back(), net::buffer(std::string{"GET /health HTTP/1.1\r\nHost: x\r\nX-a: "}));
  }
  auto kept_alive = connect();
  net::write(kept_alive, net::buffer(std::string{"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"}));
  beast::flat_buffer buffer;
  http::response<http::string_body> answer;
  http::read(kept_alive, buffer, answer);
  EXPECT_EQ(answer.result_int(), 200u);
  for (auto& socket : silent) EXPECT_TRUE(closed_by_server(socket));
  for (auto& socket : slow) EXPECT_TRUE(closed_by_server(socket));
  EXPECT_TRUE(closed_by_server(kept_alive));
  EXPECT_GE(node_metric("kvr_http_client_timeouts_total{phase=\"header\""), 100);
  EXPECT_GE(node_metric("kvr_http_client_timeouts_total{phase=\"idle\""), 1);
  EXPECT_EQ(health(), 200);
}

TEST_F(FrontDoorLimitsTest, StreamsTheirClientsNeverReadDoNotGrowTheNodesMemory) {
  testing::use_small_asan_quarantine_in_children();
  // Room in the worker's KV cache for a million output tokens each.
  start({"--http-max-pending-stream-bytes", "262144"}, std::nullopt, 10 * 1'000'000 / kBlockSize);
  if (HasFatalFailure()) return;
  const std::uint64_t before_kib = testing::resident_kib(node_->pid());
  const std::string body =
      Json{{"model", "mock-model"},
           {"stream", true},
           {"max_tokens", 1'000'000},
           {"messages", {{{"role", "user"}, {"content", "Count to a million."}}}}}
          .dump();
  std::vector<tcp::socket> readers;
  for (int i = 0; i < 10; ++i) {
    tcp::socket socket{io_};
    // A small window: the node's writes stall at once.
    socket.open(tcp::v4());
    socket.set_option(net::socket_base::receive_buffer_size(4096));
    socket.connect({net::ip::make_address("127.0.0.1"), http_port_});
    net::write(socket, net::buffer(post("/v1/chat/completions", body)));
    readers.push_back(std::move(socket));
  }
  ASSERT_TRUE(wait_until(
      [&] {
        return node_metric("kvr_http_streams_overflowed_total") +
                   node_metric("kvr_http_client_timeouts_total{phase=\"send\"") >=
               10;
      },
      90s))
      << "every unread stream is ended";
  const std::uint64_t after_kib = testing::resident_kib(node_->pid());
  std::cout << "node resident memory: " << before_kib / 1024 << " MiB before the streams, "
            << after_kib / 1024 << " MiB after\n";
  EXPECT_LT(after_kib, before_kib + 100 * 1024) << before_kib << " KiB, then " << after_kib;
  // Each connection is closed by the node. (Reading each to its end is no test of that: the
  // node's kernel still sends what it had buffered, through the readers' tiny windows, at the
  // pace of zero-window probes whose backoff can exceed any bound here.)
  EXPECT_TRUE(wait_until([&] { return node_metric("kvr_http_connections_open") == 0; }, 10s));
  EXPECT_TRUE(wait_until([&] { return node_metric("kvr_http_requests_in_flight") == 0; }, 10s));
  EXPECT_EQ(health(), 200);
}

TEST_F(FrontDoorLimitsTest, ThreePipelinedPostsGetThreeAnswers) {
  start();
  if (HasFatalFailure()) return;
  const std::string body =
      Json{{"model", "mock-model"}, {"prompt", {1, 2, 3, 4, 5}}, {"max_tokens", 2}}.dump();
  auto client = connect();
  net::write(client, net::buffer(post("/v1/completions", body) + post("/v1/completions", body) +
                                 post("/v1/completions", body, /*close=*/true)));
  const timeval bound{.tv_sec = 20, .tv_usec = 0};
  ::setsockopt(client.native_handle(), SOL_SOCKET, SO_RCVTIMEO, &bound, sizeof bound);
  beast::flat_buffer buffer;
  for (int i = 0; i < 3; ++i) {
    http::response<http::string_body> answer;
    beast::error_code error;
    http::read(client, buffer, answer, error);
    ASSERT_FALSE(error) << "answer " << i << ": " << error.message();
    EXPECT_EQ(answer.result_int(), 200u) << answer.body();
  }
}

TEST_F(FrontDoorLimitsTest, MoreThanOneChoiceThroughTheGenerateApiIsRefusedNotIgnored) {
  start();
  if (HasFatalFailure()) return;
  httplib::Client client{"127.0.0.1", http_port_};
  client.set_read_timeout(20s);
  const auto chat = [&](int choices) {
    return client.Post("/v1/chat/completions",
                       Json{{"model", "mock-model"},
                            {"max_tokens", 2},
                            {"n", choices},
                            {"messages", {{{"role", "user"}, {"content", "Hello"}}}}}
                           .dump(),
                       "application/json");
  };
  const auto two = chat(2);
  ASSERT_TRUE(two);
  EXPECT_EQ(two->status, 400) << two->body;
  const Json error = Json::parse(two->body, nullptr, false);
  EXPECT_EQ(error["error"]["param"], "n") << two->body;
  const auto one = chat(1);
  ASSERT_TRUE(one);
  EXPECT_EQ(one->status, 200) << one->body;
  EXPECT_EQ(Json::parse(one->body, nullptr, false)["choices"].size(), 1u);
}

}  // namespace
}  // namespace kvr
