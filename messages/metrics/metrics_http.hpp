// The router node's HTTP endpoint on loopback: GET /metrics (Prometheus text from the
// MetricsRegistry) and GET /healthz (200 "ok" while the health check passes, else 503). Runs
// cpp-httplib on its own threads, each client bounded in time and the connections it holds bounded
// in number; reads only thread-safe state. Plain C++, no CAF.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <expected>
#include <functional>
#include <memory>
#include <string>

#include "messages/metrics/metrics_registry.hpp"

namespace kvr::metrics {

/// What one client may take of the port. cpp-httplib (0.11.4) serves a connection on one worker
/// thread from its first byte to its close: these bound how long that is, and how many accepted
/// connections (each a descriptor) wait for a worker.
struct MetricsHttpLimits {
  /// Each read of a connection must bring bytes within this (a client that sends nothing gives its
  /// worker back then).
  std::chrono::milliseconds read_timeout{5'000};
  /// Each write of a connection must complete within this.
  std::chrono::milliseconds write_timeout{5'000};
  /// A kept-alive connection idle this long between requests is closed (whole seconds, >= 1):
  /// Prometheus scrapes every 15 s or more, so keep-alive saves it nothing, while an idle
  /// connection holds a worker.
  std::chrono::seconds keep_alive_timeout{1};
  /// Requests one connection may make before it is closed.
  std::size_t keep_alive_max_requests = 5;
  /// Threads serving connections: two, so that a scrape and a health probe never wait for each
  /// other.
  std::size_t workers = 2;
  /// Accepted connections waiting for a worker; beyond it the accept loop waits (new clients wait
  /// in the kernel's backlog) instead of taking more descriptors.
  std::size_t max_waiting_connections = 16;
};

/// A running HTTP server; stopped when destroyed.
class MetricsHttpServer {
 public:
  /// Binds `host:port` exclusively (port 0: any free port; a port another socket listens on is
  /// an error, not shared) and serves in the background. `healthy` returns an empty string when
  /// healthy, else the reason (sent with 503). `before_scrape`, when set, runs before each
  /// /metrics render (to copy values kept elsewhere into the registry). The error names the
  /// option and the address.
  static std::expected<std::unique_ptr<MetricsHttpServer>, std::string> start(
      const std::string& host, std::uint16_t port, std::shared_ptr<const MetricsRegistry> registry,
      std::function<std::string()> healthy, std::function<void()> before_scrape = {},
      MetricsHttpLimits limits = {});

  ~MetricsHttpServer();
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  /// The bound port.
  std::uint16_t port() const { return port_; }

 private:
  struct State;
  explicit MetricsHttpServer(std::unique_ptr<State> state, std::uint16_t port);
  std::unique_ptr<State> state_;
  std::uint16_t port_;
};

}  // namespace kvr::metrics
