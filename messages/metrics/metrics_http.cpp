#include "messages/metrics/metrics_http.hpp"

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <ctime>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <httplib.h>
#include <sys/socket.h>

#include "messages/metrics/rate_limited_log.hpp"

namespace kvr::metrics {
namespace {

// cpp-httplib's task queue for the accepted connections, bounded. httplib's own pool queues every
// accepted connection, each holding a descriptor, without bound: a flood of connections could take
// the process's last descriptors. Here enqueue() (the accept loop) waits while `max_waiting` wait
// for a worker.
class BoundedTaskQueue final : public httplib::TaskQueue {
 public:
  BoundedTaskQueue(std::size_t workers, std::size_t max_waiting) : max_waiting_(max_waiting) {
    for (std::size_t i = 0; i < workers; ++i) workers_.emplace_back([this] { work(); });
  }

  ~BoundedTaskQueue() override {
    if (!workers_.empty() && workers_.front().joinable()) shutdown();
  }

  BoundedTaskQueue(const BoundedTaskQueue&) = delete;
  BoundedTaskQueue& operator=(const BoundedTaskQueue&) = delete;

  void enqueue(std::function<void()> connection) override {
    std::unique_lock lock{mutex_};
    if (waiting_.size() >= max_waiting_) {
      log_.warn("metrics_port_busy",
                fmt::format("metrics port: {} connections wait for its {} workers; new "
                            "connections wait in the kernel's backlog",
                            waiting_.size(), workers_.size()));
      room_.wait(lock, [&] { return waiting_.size() < max_waiting_ || stopping_; });
    }
    waiting_.push_back(std::move(connection));
    work_.notify_one();
  }

  // Serves the connections already accepted, then joins the workers.
  void shutdown() override {
    {
      std::lock_guard lock{mutex_};
      stopping_ = true;
    }
    work_.notify_all();
    room_.notify_all();
    for (auto& worker : workers_) worker.join();
  }

 private:
  void work() {
    for (;;) {
      std::function<void()> connection;
      {
        std::unique_lock lock{mutex_};
        work_.wait(lock, [&] { return !waiting_.empty() || stopping_; });
        if (waiting_.empty()) return;
        connection = std::move(waiting_.front());
        waiting_.pop_front();
      }
      room_.notify_one();
      // Serves the connection and closes its socket.
      connection();
    }
  }

  const std::size_t max_waiting_;
  std::mutex mutex_;
  std::condition_variable work_;
  std::condition_variable room_;
  std::deque<std::function<void()>> waiting_;
  bool stopping_ = false;
  RateLimitedLog log_{std::chrono::seconds(30)};
  std::vector<std::thread> workers_;
};

}  // namespace

struct MetricsHttpServer::State {
  httplib::Server server;
  std::thread thread;
};

MetricsHttpServer::MetricsHttpServer(std::unique_ptr<State> state, std::uint16_t port)
    : state_(std::move(state)), port_(port) {}

std::expected<std::unique_ptr<MetricsHttpServer>, std::string> MetricsHttpServer::start(
    const std::string& host, std::uint16_t port, std::shared_ptr<const MetricsRegistry> registry,
    std::function<std::string()> healthy, std::function<void()> before_scrape,
    MetricsHttpLimits limits) {
  auto state = std::make_unique<State>();
  // cpp-httplib sets SO_REUSEPORT by default, which lets a second process bind the same port and
  // share its scrapes. SO_REUSEADDR alone still refuses a port another socket listens on (it only
  // allows rebinding past TIME_WAIT after a restart), so a port in use fails here.
  state->server.set_socket_options([](socket_t descriptor) {
    const int yes = 1;
    setsockopt(descriptor, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  // httplib's accept loop itself lies beyond its API: when accept() fails with EMFILE (the process
  // is out of descriptors) it sleeps 1 ms and tries again, about a thousand failing calls a second,
  // until a descriptor frees, then serves again. The bounded queue keeps this port from being what
  // takes the last ones.
  state->server.new_task_queue = [limits] {
    return new BoundedTaskQueue(std::max<std::size_t>(limits.workers, 1),
                                std::max<std::size_t>(limits.max_waiting_connections, 1));
  };
  state->server.set_read_timeout(limits.read_timeout);
  state->server.set_write_timeout(limits.write_timeout);
  state->server.set_keep_alive_timeout(std::max<std::time_t>(limits.keep_alive_timeout.count(), 1));
  state->server.set_keep_alive_max_count(std::max<std::size_t>(limits.keep_alive_max_requests, 1));
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
