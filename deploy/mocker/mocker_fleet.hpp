// `kvr mocker`: a fleet of simulated inference workers in one process, speaking kvr's NATS
// protocol for real: registration, heartbeats, load metrics, KV event batches, `generate` with
// streamed chunks and cancellation, KV dumps, and deregistration on clean shutdown.
#pragma once

#include <chrono>
#include <cstdint>
#include <expected>
#include <memory>
#include <stop_token>
#include <string>
#include <vector>

#include "deploy/simulation/engine_config.hpp"
#include "messages/ids.hpp"
#include "messages/nats/nats_client.hpp"

namespace kvr::mocker {

/// Everything a mocker process is told on its command line.
struct MockerOptions {
  nats::NatsOptions nats;
  /// Subject namespace: kvr.<namespace>.…
  std::string ns = "default";
  /// Simulated workers in this process.
  std::uint32_t workers = 4;
  /// Worker ids are worker_id_base, worker_id_base + 1, ...; 0 picks a random base.
  WorkerId worker_id_base = 0;
  std::string model = "mock-model";
  WorkerType role = WorkerType::Aggregated;
  std::string routing_group = "default";
  /// Data-parallel ranks per worker, each with its own engine.
  std::uint32_t data_parallel_size = 1;
  std::vector<std::string> taints;
  /// false: publish no KV events (the router then predicts the cache: approximate mode).
  bool publish_kv_events = true;
  /// A worker missing heartbeats for this long is removed by routers.
  std::chrono::milliseconds liveness_ttl{3000};
  /// How often each worker publishes LoadMetrics.
  std::chrono::milliseconds load_interval{100};
  /// Per-rank engine parameters.
  simulation::EngineConfig engine;

  /// Checks ranges and the engine config; the error names the option.
  std::expected<void, std::string> validate() const;
};

/// Counters of one fleet run, for logs and tests.
struct MockerStats {
  std::uint64_t generate_requests = 0;
  std::uint64_t completed_requests = 0;
  std::uint64_t cancelled_requests = 0;
  std::uint64_t rejected_requests = 0;
  std::uint64_t bad_messages = 0;
  std::uint64_t kv_event_batches = 0;
  std::uint64_t dumps_served = 0;
};

/// Runs the fleet until `stop` is requested, then deregisters every worker. The fleet owns its
/// engines on one thread; NATS callbacks only queue messages for it.
class MockerFleet {
 public:
  /// Connects to NATS and subscribes; an error names what failed.
  static std::expected<std::unique_ptr<MockerFleet>, std::string> create(MockerOptions options);
  ~MockerFleet();
  MockerFleet(const MockerFleet&) = delete;
  MockerFleet& operator=(const MockerFleet&) = delete;

  /// Registers the workers and serves until stop is requested; returns the run's counters.
  MockerStats run(std::stop_token stop);

  /// The ids of the simulated workers.
  std::vector<WorkerId> worker_ids() const;

 private:
  struct State;
  explicit MockerFleet(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace kvr::mocker
