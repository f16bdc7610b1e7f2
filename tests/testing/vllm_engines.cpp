#include "tests/testing/vllm_engines.hpp"

#include "tests/testing/loopback_http.hpp"

namespace kvr::testing {

std::expected<std::unique_ptr<EnginePair>, std::string> start_engine_pair(
    const KvrProcesses& kvr, const EnginePairOptions& options, std::chrono::milliseconds timeout) {
  auto pair = std::make_unique<EnginePair>();
  pair->worker = options.worker;
  const std::string name = std::to_string(options.worker);
  // A port free a moment ago may be taken by another test before the engine binds it: an engine
  // that exits before it answers /health is started again on fresh ports.
  constexpr int kAttempts = 3;
  for (int attempt = 1;; ++attempt) {
    pair->http_port = free_port();
    pair->kv_port = free_port();
    pair->replay_port = options.replay ? free_port() : 0;
    std::vector<std::string> args = {"--speak",
                                     "vllm",
                                     "--workers",
                                     "1",
                                     "--model",
                                     options.model,
                                     "--http-port",
                                     std::to_string(pair->http_port),
                                     "--kv-events-port",
                                     std::to_string(pair->kv_port),
                                     "--kv-events-replay-port",
                                     std::to_string(pair->replay_port),
                                     "--block-size",
                                     std::to_string(options.block_size),
                                     "--num-gpu-blocks",
                                     std::to_string(options.num_gpu_blocks),
                                     "--time-scale",
                                     options.time_scale};
    args.insert(args.end(), options.engine_args.begin(), options.engine_args.end());
    pair->engine_args = args;
    pair->engine = kvr.start({"mocker"}, args, "engine-" + name + ".log");
    if (!pair->engine) return std::unexpected("cannot start engine " + name);
    bool healthy = false;
    (void)wait_until(
        [&] {
          healthy = http_get(pair->http_port, "/health").starts_with("HTTP/1.1 200");
          return healthy || !pair->engine->running();
        },
        timeout);
    if (healthy) break;
    if (pair->engine->running() || attempt == kAttempts) {
      return std::unexpected("engine " + name + " never answered /health:\n" + pair->engine->log());
    }
  }
  pair->bridge_metrics_port = free_port();
  std::vector<std::string> bridge_args = {"--engine",
                                          "vllm",
                                          "--engine-url",
                                          pair->url(),
                                          "--kv-events",
                                          "tcp://127.0.0.1:" + std::to_string(pair->kv_port),
                                          "--worker-id",
                                          name,
                                          "--liveness-ttl-ms",
                                          std::to_string(options.liveness_ttl_ms),
                                          "--load-interval-ms",
                                          options.load_interval_ms,
                                          "--health-interval-ms",
                                          options.health_interval_ms,
                                          "--metrics-port",
                                          std::to_string(pair->bridge_metrics_port)};
  if (options.replay) {
    bridge_args.push_back("--kv-events-replay");
    bridge_args.push_back("tcp://127.0.0.1:" + std::to_string(pair->replay_port));
  }
  bridge_args.insert(bridge_args.end(), options.bridge_args.begin(), options.bridge_args.end());
  pair->bridge = kvr.start({"bridge"}, bridge_args, "bridge-" + name + ".log");
  if (!pair->bridge) return std::unexpected("cannot start the bridge of engine " + name);
  return pair;
}

std::string engine_pair_logs(const std::vector<std::unique_ptr<EnginePair>>& pairs) {
  std::string logs;
  for (const auto& pair : pairs) {
    const std::string worker = std::to_string(pair->worker);
    if (pair->engine) logs += "---- engine " + worker + "\n" + pair->engine->log();
    if (pair->bridge) logs += "---- bridge " + worker + "\n" + pair->bridge->log();
  }
  return logs;
}

}  // namespace kvr::testing
