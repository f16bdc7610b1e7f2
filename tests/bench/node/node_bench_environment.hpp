// The cluster the router-node benchmarks drive: a nats-server on loopback, one RouterNode in this
// process (kv-cost, block size 16, leases of one second so bookings of unreported decisions
// expire), and 64 simulated workers that registered, reported idle load and published their KV
// caches over NATS. Started on first use, stopped by shutdown(). Plain C++ (no CAF).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "actors/nats/nats_client.hpp"
#include "actors/node/router_node.hpp"
#include "tests/bench/node/node_bench_workload.hpp"
#include "tests/testing/nats_server.hpp"

namespace kvr::bench {

/// One running node and its fleet.
class NodeEnvironment {
 public:
  /// The environment, started on first call (aborts with a message when it cannot start).
  static NodeEnvironment& get();
  /// Stops the node and the server; call before the process exits.
  static void shutdown();

  const Workload& workload() const { return workload_; }
  const RequestTemplates& templates() const { return templates_; }
  std::string url() const { return server_->url(); }
  int server_pid() const { return server_->process().pid(); }
  actors::RouterNode& node() { return *node_; }
  /// The port the node's ingress actor is published on.
  std::uint16_t actor_port() const { return node_->actor_port(); }
  /// Renews every worker's lease (a heartbeat each); call before a measured run.
  void heartbeat();
  /// The node's metrics as Prometheus text (what /metrics serves).
  std::string metrics_text() const { return node_->metrics().render(); }

  ~NodeEnvironment();

 private:
  NodeEnvironment();
  Workload workload_;
  RequestTemplates templates_{workload_};
  std::unique_ptr<testing::NatsServer> server_;
  std::unique_ptr<actors::RouterNode> node_;
  std::unique_ptr<actors::nats::NatsClient> fleet_;
};

}  // namespace kvr::bench
