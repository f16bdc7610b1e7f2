// The cluster the router-node benchmarks drive: a nats-server on loopback, one RouterNode in this
// process (kv-cost, block size 16, a booking TTL of one second so the bookings of unreported
// decisions expire), and 64 simulated workers that registered, reported idle load and published
// their KV caches over NATS. Started on first use, stopped by shutdown(). Plain C++ (no CAF).
//
// With KVR_BENCH_CLUSTER_NODES=N (N ≥ 1), N nodes run in cluster mode instead (a nats-server
// with JetStream): one owns the fleet's partition and the others forward to it, so the NATS
// benchmarks measure what forwarding costs; node() is the first, metrics_text() joins all.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "actors/node/router_node.hpp"
#include "messages/nats/nats_client.hpp"
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
  actors::RouterNode& node() { return *nodes_.front(); }
  /// The port the node's ingress actor is published on.
  std::uint16_t actor_port() const { return nodes_.front()->actor_port(); }
  /// Renews every worker's liveness (a heartbeat each); call before a measured run.
  void heartbeat();
  /// The node's metrics as Prometheus text (what /metrics serves).
  std::string metrics_text() const {
    std::string text;
    for (const auto& node : nodes_) text += node->metrics().render();
    return text;
  }

  ~NodeEnvironment();

 private:
  NodeEnvironment();
  Workload workload_;
  RequestTemplates templates_{workload_};
  std::unique_ptr<testing::NatsServer> server_;
  std::vector<std::unique_ptr<actors::RouterNode>> nodes_;
  /// The sum of a series over the nodes.
  double total(std::string_view name, const metrics::Labels& labels) const;
  std::unique_ptr<nats::NatsClient> fleet_;
};

}  // namespace kvr::bench
