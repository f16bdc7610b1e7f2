// `kvr bridge`: makes one vLLM or SGLang engine (or one data-parallel group of it) a kvr worker
// without changing the engine. It registers the worker with what the engine reports over HTTP,
// heartbeats while the engine answers /health (deregistering when it stops, registering a new
// incarnation when it returns, and likewise when the engine restarted between two probes: its
// ZMQ sequence numbers went back or its process_start_time_seconds changed), publishes LoadMetrics
// from the engine's /metrics, forwards the engine's ZMQ KV events as kvr KvEventBatches, serves KV
// dumps from its own picture, and serves the worker's generate subject through the engine's
// /v1/completions (generate_forwarder.hpp), passing vLLM's kv_transfer_params both ways for
// disaggregated prefill/decode (vLLM only: with SGLang the prefill and decode roles are refused).
// With --metrics-port it serves its own Prometheus /metrics (kvr_bridge_*: ZMQ messages,
// malformed frames and payloads, sequence gaps, replays, cleared ranks, engine restarts, unknown
// removals, published batches and blocks, generate outcomes) and /healthz (200 while registered
// with a live engine). Threads: the run loop owns all state; the ZMQ subscriber, the prober (which
// asks the engine's /health and /metrics, so the loop forwarding KV events never waits on HTTP)
// and NATS callbacks only queue, except generate requests and cancels, which go straight to the
// forwarder's own threads.
#pragma once

#include <chrono>
#include <cstdint>
#include <expected>
#include <memory>
#include <optional>
#include <stop_token>
#include <string>
#include <vector>

#include "deploy/bridge/engine_metrics.hpp"
#include "deploy/bridge/zmq_kv_subscriber.hpp"
#include "messages/ids.hpp"
#include "messages/nats/nats_client.hpp"

namespace kvr::bridge {

/// Everything a bridge is told on its command line.
struct BridgeOptions {
  nats::NatsOptions nats;
  std::string ns = "default";
  EngineKind engine = EngineKind::vllm;
  /// The engine's HTTP server: /health, /v1/models, /metrics.
  std::string engine_url = "http://127.0.0.1:8000";
  /// The engine's HTTP base URL as routers reach it (registered as the worker's http_url), when
  /// it differs from engine_url (a bridge beside its engine reaches it on loopback); empty:
  /// engine_url.
  std::string advertise_url;
  /// The engine's KV event sockets (rank 0; rank r at port + r) and topic.
  std::string kv_events = "tcp://127.0.0.1:5557";
  std::string kv_events_replay;
  std::string topic;
  /// Served model name; empty: the first model the engine lists on /v1/models.
  std::string model;
  /// Tokens per KV block; 0: from the engine's metrics (vllm:cache_config_info). Required: the
  /// bridge does not register while neither says.
  std::uint32_t block_size = 0;
  /// KV capacity per rank in blocks; 0: from the engine's metrics. When neither says, the worker
  /// registers without a capacity (docs/protocol.md).
  std::uint64_t num_gpu_blocks = 0;
  std::uint32_t data_parallel_size = 1;
  /// 0 picks a random id.
  WorkerId worker_id = 0;
  /// Prefill and decode need a vLLM engine with a KV connector (e.g. NixlConnector).
  WorkerType role = WorkerType::Aggregated;
  std::string routing_group = "default";
  std::vector<std::string> taints;
  std::chrono::milliseconds liveness_ttl{3000};
  /// How often /metrics is scraped and LoadMetrics published.
  std::chrono::milliseconds load_interval{200};
  /// How often /health is asked.
  std::chrono::milliseconds health_interval{500};
  /// Longest wait for one HTTP answer of the engine.
  std::chrono::milliseconds http_timeout{1000};
  int zmq_high_water_mark = 100'000;
  /// Generate requests streamed from the engine at once (HTTP threads).
  std::uint32_t max_concurrent_generates = 128;
  /// Longest silence of the engine within one generate stream.
  std::chrono::milliseconds generate_read_timeout{120'000};
  /// Serve the bridge's own /metrics and /healthz on 127.0.0.1 at this port (0: any free port);
  /// unset: none.
  std::optional<std::uint16_t> metrics_port;

  /// Checks ranges; the error names the option.
  std::expected<void, std::string> validate() const;
  /// The URL the worker registers: advertise_url, else engine_url.
  const std::string& advertised_url() const {
    return advertise_url.empty() ? engine_url : advertise_url;
  }
};

/// Counters of one bridge run, for logs and tests.
struct BridgeStats {
  std::uint64_t registrations = 0;
  std::uint64_t deregistrations = 0;
  /// Restarts seen between health probes (each a deregistration and a registration).
  std::uint64_t engine_restarts = 0;
  std::uint64_t kv_batches_published = 0;
  std::uint64_t load_reports = 0;
  std::uint64_t dumps_served = 0;
  std::uint64_t ranks_lost = 0;
  std::uint64_t malformed_payloads = 0;
  std::uint64_t bad_messages = 0;
  std::uint64_t generate_requests = 0;
  std::uint64_t generate_completed = 0;
  std::uint64_t generate_cancelled = 0;
  std::uint64_t generate_failed = 0;
  std::uint64_t generate_refused = 0;
};

/// One bridge; run() serves until stopped.
class EngineBridge {
 public:
  /// Validates the options and connects to NATS; an error names what failed.
  static std::expected<std::unique_ptr<EngineBridge>, std::string> create(BridgeOptions options);
  ~EngineBridge();
  EngineBridge(const EngineBridge&) = delete;
  EngineBridge& operator=(const EngineBridge&) = delete;

  /// Serves until `stop` is requested, then deregisters; returns the run's counters.
  BridgeStats run(std::stop_token stop);

  WorkerId worker_id() const;

  /// The port of the bridge's /metrics, when it serves one.
  std::optional<std::uint16_t> metrics_port() const;

 private:
  struct State;
  explicit EngineBridge(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace kvr::bridge
