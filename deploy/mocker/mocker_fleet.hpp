// `kvr mocker`: a fleet of simulated inference workers in one process, speaking kvr's NATS
// protocol for real: registration, heartbeats, load metrics, KV event batches, `generate` with
// streamed chunks and cancellation, KV dumps, and deregistration on clean shutdown.
//
// Disaggregated serving follows vLLM's NixlConnector exchange, in GenerateRequest and
// GenerateChunk's kv_transfer_params (JSON text, read by read_kv_transfer_params in
// deploy/mocker/kv_transfer_params.hpp). A request with {"do_remote_decode": true} is a prefill
// hop: one token (whatever max_output_tokens says), the prompt's blocks then held, and its last
// chunk (finish_reason "length") carries {"do_remote_prefill": true, "do_remote_decode": false,
// "remote_block_ids": [one engine block index per held block], "remote_engine_id":
// "kvr-mocker-<worker id>-<rank>", "remote_request_id", "remote_host": "127.0.0.1",
// "remote_port": 5600 + rank, "tp_size": 1}. A request with {"do_remote_prefill": true, ...} is a
// decode hop: it pulls the prompt blocks its engine does not hold, at most len(remote_block_ids),
// waits for the modelled transfer (EngineConfig::transfer), counts them as cached prompt tokens
// and publishes them as stored. Mockers are separate processes with no side channel, so a prefill
// worker frees its held blocks when the modelled transfer of that many blocks would be over
// (its own TransferConfig: latency + per-block time from the hop's end), the very model the decode
// side waits on; that bound always comes, so no other timeout is needed. A decode hop queued
// before its transfer starts still waits the full transfer: the prefill side's hold is then
// shorter than a real one. Bad kv_transfer_params are refused with an INVALID_REQUEST error chunk
// naming the field. The worker's --role is not checked against the hop (vLLM does not either).
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
