// The metrics port's bounds on its clients, on loopback: a client that connects and sends nothing
// gives its worker back after the read timeout, and a kept-alive connection idle between requests
// is closed after the keep-alive timeout. Each test awaits the event (an answer, a close) within a
// bound shorter than cpp-httplib's own 5 s defaults, so each fails against the defaults.
#include "messages/metrics/metrics_http.hpp"

#include <chrono>
#include <memory>
#include <string>

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

namespace kvr::metrics {
namespace {

using namespace std::chrono_literals;

// A client socket connected to 127.0.0.1:`port`, each read bounded by `read_bound`.
class RawClient {
 public:
  RawClient(std::uint16_t port, std::chrono::seconds read_bound)
      : socket_(::socket(AF_INET, SOCK_STREAM, 0)) {
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(port);
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    timeval timeout{.tv_sec = static_cast<time_t>(read_bound.count()), .tv_usec = 0};
    ::setsockopt(socket_, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
    connected_ =
        ::connect(socket_, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) == 0;
  }
  ~RawClient() { ::close(socket_); }
  RawClient(const RawClient&) = delete;
  RawClient& operator=(const RawClient&) = delete;

  bool connected() const { return connected_; }

  bool send(const std::string& bytes) {
    return ::send(socket_, bytes.data(), bytes.size(), MSG_NOSIGNAL) ==
           static_cast<ssize_t>(bytes.size());
  }

  // What one read brings: bytes, empty once the server closed, nullopt when nothing came in time.
  std::optional<std::string> read() {
    char buffer[4096];
    const ssize_t got = ::recv(socket_, buffer, sizeof(buffer), 0);
    if (got < 0) return std::nullopt;
    return std::string(buffer, static_cast<std::size_t>(got));
  }

 private:
  int socket_;
  bool connected_ = false;
};

std::unique_ptr<MetricsHttpServer> start_server(MetricsHttpLimits limits) {
  auto started = MetricsHttpServer::start(
      "127.0.0.1", 0, std::make_shared<MetricsRegistry>(), [] { return std::string{}; }, {},
      limits);
  EXPECT_TRUE(started) << started.error();
  return started ? std::move(*started) : nullptr;
}

TEST(MetricsHttpServerTest, AClientThatSendsNothingGivesItsWorkerBackAfterTheReadTimeout) {
  const auto server = start_server({.read_timeout = 200ms, .workers = 1});
  ASSERT_TRUE(server);
  // Accepted first, it takes the only worker.
  RawClient silent{server->port(), 10s};
  ASSERT_TRUE(silent.connected());

  httplib::Client probe{"127.0.0.1", server->port()};
  probe.set_read_timeout(3s);
  const auto answer = probe.Get("/healthz");
  ASSERT_TRUE(answer) << httplib::to_string(answer.error());
  EXPECT_EQ(answer->status, 200);
  // The silent client's connection was closed when its read timed out.
  EXPECT_EQ(silent.read(), std::string{});
}

TEST(MetricsHttpServerTest, AKeptAliveConnectionIdleBetweenRequestsIsClosed) {
  const auto server = start_server({.keep_alive_timeout = 1s});
  ASSERT_TRUE(server);
  RawClient client{server->port(), 3s};
  ASSERT_TRUE(client.connected());
  ASSERT_TRUE(client.send("GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"));
  // The answer, whole (its head and body may come in separate reads).
  std::string answer;
  while (!answer.ends_with("ok\n")) {
    const auto more = client.read();
    ASSERT_TRUE(more && !more->empty()) << answer;
    answer += *more;
  }
  EXPECT_TRUE(answer.starts_with("HTTP/1.1 200")) << answer;
  // Idle from here: the server closes the connection (an empty read), within the read's bound.
  EXPECT_EQ(client.read(), std::string{});
}

}  // namespace
}  // namespace kvr::metrics
