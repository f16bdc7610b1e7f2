// The router node's HTTP endpoint on loopback: GET /metrics (Prometheus text from the
// MetricsRegistry) and GET /healthz (200 "ok" while the health check passes, else 503). Runs
// cpp-httplib on its own threads; reads only thread-safe state. Plain C++, no CAF.
#pragma once

#include <cstdint>
#include <expected>
#include <functional>
#include <memory>
#include <string>

#include "messages/metrics/metrics_registry.hpp"

namespace kvr::metrics {

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
      std::function<std::string()> healthy, std::function<void()> before_scrape = {});

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
