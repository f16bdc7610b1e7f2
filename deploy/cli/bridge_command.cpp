#include "deploy/cli/bridge_command.hpp"

#include <spdlog/spdlog.h>

#include "deploy/bridge/engine_bridge.hpp"
#include "deploy/cli/cli_options.hpp"
#include "deploy/cli/stop_signals.hpp"
#include "discovery/catalog/worker_registration.hpp"
#include "messages/worker_role.hpp"

namespace kvr::cli {
namespace {

int run_bridge(bridge::BridgeOptions options) {
  // Before any thread starts, so that every thread inherits the blocked signals.
  auto signals = StopSignals::install("kvr bridge");
  auto engine_bridge = bridge::EngineBridge::create(std::move(options));
  if (!engine_bridge) {
    spdlog::error("kvr bridge: {}", engine_bridge.error());
    return kUsageError;
  }
  signals->ready();
  const bridge::BridgeStats stats = (*engine_bridge)->run(signals->stop_source().get_token());
  spdlog::info(
      "kvr bridge: stopped; registrations {} deregistrations {} engine restarts {} kv batches {} "
      "load reports {} dumps {} ranks lost {} malformed payloads {} bad messages {}; generate {} "
      "completed {} cancelled {} failed {} refused {}",
      stats.registrations, stats.deregistrations, stats.engine_restarts, stats.kv_batches_published,
      stats.load_reports, stats.dumps_served, stats.ranks_lost, stats.malformed_payloads,
      stats.bad_messages, stats.generate_requests, stats.generate_completed,
      stats.generate_cancelled, stats.generate_failed, stats.generate_refused);
  return 0;
}

}  // namespace

void add_bridge_command(CLI::App& app, int& exit_code) {
  auto* command = app.add_subcommand(
      "bridge",
      "make a vLLM or SGLang engine a kvr worker (KV events, load, registration, generate)");
  auto options = std::make_shared<bridge::BridgeOptions>();
  auto engine = std::make_shared<std::string>("vllm");
  auto role = std::make_shared<std::string>("aggregated");
  add_nats_options(*command, options->nats);
  add_namespace_option(*command, options->ns);
  command->add_option("--engine", *engine, "the engine: vllm or sglang")
      ->capture_default_str()
      ->envname("KVR_BRIDGE_ENGINE")
      ->check(CLI::IsMember({"vllm", "sglang"}));
  command->add_option("--engine-url", options->engine_url, "the engine's HTTP server")
      ->capture_default_str()
      ->envname("KVR_BRIDGE_ENGINE_URL")
      ->check(non_empty());
  command
      ->add_option("--advertise-url", options->advertise_url,
                   "the engine's HTTP base URL as routers reach it, registered with the worker "
                   "(default: --engine-url)")
      ->envname("KVR_BRIDGE_ADVERTISE_URL");
  command
      ->add_option("--kv-events", options->kv_events,
                   "the engine's ZMQ KV event publisher (rank r at port + r)")
      ->capture_default_str()
      ->envname("KVR_BRIDGE_KV_EVENTS")
      ->check(non_empty());
  command
      ->add_option("--kv-events-replay", options->kv_events_replay,
                   "the engine's ZMQ replay socket (empty: none; a gap then clears the rank)")
      ->envname("KVR_BRIDGE_KV_EVENTS_REPLAY");
  command->add_option("--topic", options->topic, "ZMQ topic of the engine's KV events")
      ->envname("KVR_BRIDGE_TOPIC");
  command->add_option("--model", options->model, "served model name (default: the engine's)")
      ->envname("KVR_BRIDGE_MODEL");
  command
      ->add_option("--block-size", options->block_size,
                   "tokens per KV block (0: from the engine's metrics; required from one)")
      ->capture_default_str()
      ->envname("KVR_BRIDGE_BLOCK_SIZE")
      ->check(CLI::Range(std::uint32_t{0}, discovery::kMaxBlockSize));
  command
      ->add_option("--num-gpu-blocks", options->num_gpu_blocks,
                   "KV capacity per rank in blocks (0: from the engine's metrics, else none)")
      ->capture_default_str()
      ->envname("KVR_BRIDGE_NUM_GPU_BLOCKS")
      ->check(CLI::Range(std::uint64_t{0}, std::uint64_t{1} << 32));
  command
      ->add_option("--data-parallel-size", options->data_parallel_size,
                   "data-parallel ranks of the engine")
      ->capture_default_str()
      ->envname("KVR_BRIDGE_DATA_PARALLEL_SIZE")
      ->check(CLI::Range(std::uint32_t{1}, std::uint32_t{64}));
  command->add_option("--worker-id", options->worker_id, "worker id (0: random)")
      ->capture_default_str()
      ->envname("KVR_BRIDGE_WORKER_ID");
  command
      ->add_option("--role", *role,
                   "aggregated, prefill, decode or encode (prefill and decode: --engine vllm with "
                   "a KV connector; the bridge passes its kv_transfer_params between the hops)")
      ->capture_default_str()
      ->envname("KVR_BRIDGE_ROLE")
      ->check(CLI::IsMember({"aggregated", "prefill", "decode", "encode"}));
  command->add_option("--routing-group", options->routing_group, "routing group")
      ->capture_default_str()
      ->envname("KVR_BRIDGE_ROUTING_GROUP")
      ->check(non_empty());
  command->add_option("--taint", options->taints, "a worker taint (repeatable), e.g. gpu=h100")
      ->envname("KVR_BRIDGE_TAINTS")
      ->delimiter(',')
      ->check(non_empty());
  command
      ->add_option_function<int>(
          "--liveness-ttl-ms",
          [options](int ms) { options->liveness_ttl = std::chrono::milliseconds(ms); },
          "routers drop the worker when heartbeats stop for this long")
      ->default_str("3000")
      ->envname("KVR_BRIDGE_LIVENESS_TTL_MS")
      ->check(CLI::Range(100, 3'600'000));
  command
      ->add_option_function<int>(
          "--load-interval-ms",
          [options](int ms) { options->load_interval = std::chrono::milliseconds(ms); },
          "how often the engine's /metrics is scraped into LoadMetrics")
      ->default_str("200")
      ->envname("KVR_BRIDGE_LOAD_INTERVAL_MS")
      ->check(CLI::Range(10, 60'000));
  command
      ->add_option_function<int>(
          "--health-interval-ms",
          [options](int ms) { options->health_interval = std::chrono::milliseconds(ms); },
          "how often the engine's /health is asked")
      ->default_str("500")
      ->envname("KVR_BRIDGE_HEALTH_INTERVAL_MS")
      ->check(CLI::Range(10, 60'000));
  command
      ->add_option("--zmq-high-water-mark", options->zmq_high_water_mark,
                   "KV event messages queued per rank before ZMQ drops (then replayed)")
      ->capture_default_str()
      ->envname("KVR_BRIDGE_ZMQ_HWM")
      ->check(CLI::Range(1, 10'000'000));
  command
      ->add_option("--max-concurrent-generates", options->max_concurrent_generates,
                   "generate requests streamed from the engine at once (HTTP threads)")
      ->capture_default_str()
      ->envname("KVR_BRIDGE_MAX_CONCURRENT_GENERATES")
      ->check(CLI::Range(std::uint32_t{1}, std::uint32_t{4096}));
  command
      ->add_option_function<int>(
          "--generate-read-timeout-ms",
          [options](int ms) { options->generate_read_timeout = std::chrono::milliseconds(ms); },
          "longest silence of the engine within one generate stream")
      ->default_str("120000")
      ->envname("KVR_BRIDGE_GENERATE_READ_TIMEOUT_MS")
      ->check(CLI::Range(100, 3'600'000));
  command
      ->add_option("--metrics-port", options->metrics_port,
                   "serve the bridge's /metrics and /healthz on 127.0.0.1:P, bound exclusively; "
                   "unset: no HTTP endpoint")
      ->envname("KVR_BRIDGE_METRICS_PORT")
      ->check(CLI::Range(1, 65'535));
  command->callback([options, engine, role, &exit_code] {
    options->engine = *bridge::parse_engine_kind(*engine);
    options->role = *parse_worker_type(*role);
    exit_code = run_bridge(*options);
  });
}

}  // namespace kvr::cli
