#include "messages/metrics/metrics_http.hpp"

#include <cerrno>
#include <cstring>
#include <thread>

#include <fmt/format.h>
#include <httplib.h>
#include <sys/socket.h>

namespace kvr::metrics {

struct MetricsHttpServer::State {
  httplib::Server server;
  std::thread thread;
};

MetricsHttpServer::MetricsHttpServer(std::unique_ptr<State> state, std::uint16_t port)
    : state_(std::move(state)), port_(port) {}

std::expected<std::unique_ptr<MetricsHttpServer>, std::string> MetricsHttpServer::start(
    const std::string& host, std::uint16_t port, std::shared_ptr<const MetricsRegistry> registry,
    std::function<std::string()> healthy, std::function<void()> before_scrape) {
  auto state = std::make_unique<State>();
  // cpp-httplib sets SO_REUSEPORT by default, which lets a second process bind the same port and
  // share its scrapes. SO_REUSEADDR alone still refuses a port another socket listens on (it only
  // allows rebinding past TIME_WAIT after a restart), so a port in use fails here.
  state->server.set_socket_options([](socket_t descriptor) {
    const int yes = 1;
    setsockopt(descriptor, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  // Two threads: a scrape and a health probe never wait for each other.
  state->server.new_task_queue = [] { return new httplib::ThreadPool(2); };
  state->server.Get("/metrics", [registry, before_scrape = std::move(before_scrape)](
                                    const httplib::Request&, httplib::Response& response) {
    if (before_scrape) before_scrape();
    response.set_content(registry->render(), "text/plain; version=0.0.4; charset=utf-8");
  });
  state->server.Get("/healthz", [healthy](const httplib::Request&, httplib::Response& response) {
    const std::string problem = healthy ? healthy() : std::string{};
    if (problem.empty()) {
      response.set_content("ok\n", "text/plain");
    } else {
      response.status = 503;
      response.set_content(problem + "\n", "text/plain");
    }
  });
  int bound = port;
  errno = 0;
  if (port == 0) {
    bound = state->server.bind_to_any_port(host);
  } else if (!state->server.bind_to_port(host, port)) {
    bound = -1;
  }
  if (bound < 0) {
    const int error = errno;
    return std::unexpected(fmt::format("--metrics-port {}: cannot listen on {}:{}: {}", port, host,
                                       port, error != 0 ? std::strerror(error) : "bind failed"));
  }
  State* raw = state.get();
  state->thread = std::thread{[raw] { raw->server.listen_after_bind(); }};
  // httplib's stop() does nothing until the listen loop runs: wait for it, so that a server
  // stopped at once (a node that fails its next startup step) is not left listening forever.
  // (bounded: a loop that ends at once never shows as running)
  for (const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
       !state->server.is_running() && std::chrono::steady_clock::now() < until;) {
    std::this_thread::yield();
  }
  return std::unique_ptr<MetricsHttpServer>(
      new MetricsHttpServer(std::move(state), static_cast<std::uint16_t>(bound)));
}

MetricsHttpServer::~MetricsHttpServer() {
  state_->server.stop();
  if (state_->thread.joinable()) state_->thread.join();
}

}  // namespace kvr::metrics
