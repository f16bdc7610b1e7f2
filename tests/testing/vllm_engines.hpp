// A vLLM-speaking engine (`kvr mocker --speak vllm`, one engine) and the `kvr bridge` in front of
// it, as child processes of an integration test: what the bridge and front-door tests start once
// per worker.
#pragma once

#include <chrono>
#include <cstdint>
#include <expected>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "messages/ids.hpp"
#include "tests/testing/child_process.hpp"
#include "tests/testing/kvr_processes.hpp"

namespace kvr::testing {

struct EnginePairOptions {
  WorkerId worker = 0;
  std::string model = "mock-model";
  std::uint32_t block_size = 16;
  std::uint64_t num_gpu_blocks = 2048;
  /// The engine's clock, in multiples of the modelled GPU's.
  std::string time_scale = "20";
  /// Whether the bridge has the engine's replay endpoint.
  bool replay = true;
  std::string health_interval_ms = "50";
  /// How often the bridge scrapes the engine's /metrics into load reports.
  std::string load_interval_ms = "50";
  int liveness_ttl_ms = 1500;
  /// Appended to the engine's arguments.
  std::vector<std::string> engine_args;
  /// Appended to the bridge's arguments (e.g. --role prefill).
  std::vector<std::string> bridge_args;
};

/// One engine and its bridge; the processes end with it.
struct EnginePair {
  WorkerId worker = 0;
  std::uint16_t http_port = 0;
  std::uint16_t kv_port = 0;
  std::uint16_t replay_port = 0;
  std::uint16_t bridge_metrics_port = 0;
  std::vector<std::string> engine_args;  // to start it again on the same ports
  std::optional<ChildProcess> engine;
  std::optional<ChildProcess> bridge;

  std::string url() const { return "http://127.0.0.1:" + std::to_string(http_port); }
};

/// Starts the engine, waits until it answers /health, then starts its bridge (which registers the
/// worker). The error says which step failed, with the process's log.
std::expected<std::unique_ptr<EnginePair>, std::string> start_engine_pair(
    const KvrProcesses& kvr, const EnginePairOptions& options,
    std::chrono::milliseconds timeout = std::chrono::seconds(20));

/// Every pair's engine and bridge log, headed by their worker, for a failed test's output.
std::string engine_pair_logs(const std::vector<std::unique_ptr<EnginePair>>& pairs);

}  // namespace kvr::testing
