#include "deploy/cli/mocker_command.hpp"

#include <condition_variable>
#include <mutex>
#include <thread>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "deploy/cli/cli_options.hpp"
#include "deploy/cli/stop_signals.hpp"
#include "deploy/mocker/mocker_fleet.hpp"
#include "deploy/mocker/vllm_engine_server.hpp"
#include "selection/tokenizer/prompt_tokenizer.hpp"

namespace kvr::cli {
namespace {

// Waits for a signal, or for `duration_s` seconds when positive.
void wait_for_stop(std::stop_source stop, double duration_s) {
  std::mutex mutex;
  std::condition_variable_any wake;
  std::unique_lock lock{mutex};
  std::stop_token token = stop.get_token();
  if (duration_s > 0) {
    wake.wait_for(lock, token, std::chrono::duration<double>(duration_s), [] { return false; });
  } else {
    wake.wait(lock, token, [] { return false; });
  }
}

// `--speak vllm`: one vLLM-speaking engine per --workers, engine i on every port + stride * i.
int run_vllm_engines(const mocker::MockerOptions& options, mocker::VllmEngineOptions vllm,
                     std::uint32_t stride, double duration_s, const std::string& tokenizer_path) {
  auto signals = StopSignals::install("kvr mocker");
  if (options.data_parallel_size != 1) {
    spdlog::error("kvr mocker: --speak vllm runs one rank per engine (--data-parallel-size 1)");
    return kUsageError;
  }
  if (auto valid = check_simulated_blocks(options.workers, options.engine, "--workers"); !valid) {
    spdlog::error("kvr mocker: {}", valid.error());
    return kUsageError;
  }
  if (auto valid = mocker::check_lora_adapters(options.model, vllm.lora_adapters); !valid) {
    spdlog::error("kvr mocker: --lora-adapter: {}", valid.error());
    return kUsageError;
  }
  if (!tokenizer_path.empty()) {
    auto loaded = tokenizer::PromptTokenizer::load(tokenizer_path);
    if (!loaded) {
      spdlog::error("kvr mocker: --tokenizer: {}", loaded.error().message);
      return kUsageError;
    }
    vllm.tokenizer = std::move(*loaded);
  }
  for (std::uint16_t port : {vllm.http_port, vllm.kv_events_port, vllm.replay_port}) {
    if (port != 0 && std::uint32_t{port} + stride * (options.workers - 1) > 65535) {
      spdlog::error("kvr mocker: port {} + --port-stride x (--workers - 1) exceeds 65535", port);
      return kUsageError;
    }
  }
  // Each engine answers as soon as it starts, and starting one only binds its ports: from here
  // on a signal stops the engines gracefully.
  signals->ready();
  std::vector<std::unique_ptr<mocker::VllmEngineServer>> engines;
  for (std::uint32_t i = 0; i < options.workers; ++i) {
    mocker::VllmEngineOptions engine = vllm;
    engine.model = options.model;
    engine.engine = options.engine;
    const auto offset = [i, stride](std::uint16_t port) {
      return port == 0 ? port : static_cast<std::uint16_t>(port + stride * i);
    };
    engine.http_port = offset(vllm.http_port);
    engine.kv_events_port = offset(vllm.kv_events_port);
    engine.replay_port = offset(vllm.replay_port);
    auto started = mocker::VllmEngineServer::start(std::move(engine));
    if (!started) {
      spdlog::error("kvr mocker: {}", started.error());
      return kUsageError;
    }
    spdlog::info("kvr mocker: vLLM-speaking engine {} at {} (KV events tcp://{}:{}, replay {})", i,
                 (*started)->url(), vllm.host, offset(vllm.kv_events_port),
                 vllm.replay_port == 0
                     ? std::string{"none"}
                     : fmt::format("tcp://{}:{}", vllm.host, offset(vllm.replay_port)));
    engines.push_back(std::move(*started));
  }
  wait_for_stop(signals->stop_source(), duration_s);
  engines.clear();
  spdlog::info("kvr mocker: stopped");
  return 0;
}

int run_mocker(mocker::MockerOptions options, double duration_s) {
  // Before any thread starts, so that every thread inherits the blocked signals.
  auto signals = StopSignals::install("kvr mocker");
  if (auto valid =
          check_simulated_blocks(std::uint64_t{options.workers} * options.data_parallel_size,
                                 options.engine, "--workers x --data-parallel-size");
      !valid) {
    spdlog::error("kvr mocker: {}", valid.error());
    return kUsageError;
  }
  auto fleet = mocker::MockerFleet::create(std::move(options));
  if (!fleet) {
    spdlog::error("kvr mocker: {}", fleet.error());
    return kUsageError;
  }
  // A signal ends the run; with --duration a timer does too. The timer holds its own copy of
  // the stop source (shared state), so that it never touches a finished frame.
  std::stop_source stop = signals->stop_source();
  std::jthread timer;
  if (duration_s > 0) {
    timer = std::jthread{[stop, duration_s](std::stop_token cancelled) mutable {
      std::mutex mutex;
      std::condition_variable_any wake;
      std::unique_lock lock{mutex};
      wake.wait_for(lock, cancelled, std::chrono::duration<double>(duration_s),
                    [] { return false; });
      stop.request_stop();
    }};
  }
  // Before "serving": whoever saw that line may stop the mocker and expect a clean exit.
  signals->ready();
  const auto ids = (*fleet)->worker_ids();
  spdlog::info("kvr mocker: {} workers (ids {}..{}) serving", ids.size(), ids.front(), ids.back());
  const mocker::MockerStats stats = (*fleet)->run(stop.get_token());
  spdlog::info(
      "kvr mocker: stopped; generate {} completed {} cancelled {} rejected {} bad messages {} "
      "kv batches {} dumps {}",
      stats.generate_requests, stats.completed_requests, stats.cancelled_requests,
      stats.rejected_requests, stats.bad_messages, stats.kv_event_batches, stats.dumps_served);
  if (timer.joinable()) timer.request_stop();
  return 0;
}

}  // namespace

void add_mocker_command(CLI::App& app, int& exit_code) {
  auto* command = app.add_subcommand(
      "mocker", "run simulated inference workers that speak kvr's NATS protocol");
  auto options = std::make_shared<mocker::MockerOptions>();
  auto duration_s = std::make_shared<double>(0.0);
  auto role = std::make_shared<std::string>("aggregated");
  auto speak = std::make_shared<std::string>("kvr");
  auto vllm = std::make_shared<mocker::VllmEngineOptions>();
  auto stride = std::make_shared<std::uint32_t>(10);
  add_nats_options(*command, options->nats);
  add_namespace_option(*command, options->ns);
  command->add_option("--workers", options->workers, "simulated workers in this process")
      ->capture_default_str()
      ->check(CLI::Range(std::uint32_t{1}, std::uint32_t{4096}));
  command
      ->add_option("--worker-id-base", options->worker_id_base,
                   "first worker id (then +1 per worker); 0 picks a random base")
      ->capture_default_str();
  command->add_option("--model", options->model, "served model name")
      ->capture_default_str()
      ->check(non_empty());
  command->add_option("--role", *role, "aggregated, prefill, decode or encode")
      ->capture_default_str()
      ->check(CLI::IsMember({"aggregated", "prefill", "decode", "encode"}));
  command->add_option("--routing-group", options->routing_group, "routing group")
      ->capture_default_str()
      ->check(non_empty());
  command
      ->add_option("--data-parallel-size", options->data_parallel_size,
                   "data-parallel ranks per worker")
      ->capture_default_str()
      ->check(CLI::Range(std::uint32_t{1}, std::uint32_t{64}));
  command->add_option("--taint", options->taints, "a worker taint (repeatable), e.g. gpu=h100")
      ->check(non_empty());
  command->add_flag("!--no-kv-events", options->publish_kv_events,
                    "publish no KV events (routers predict the cache)");
  command
      ->add_option_function<int>(
          "--liveness-ttl-ms",
          [options](int ms) { options->liveness_ttl = std::chrono::milliseconds(ms); },
          "routers drop a worker whose heartbeats stop for this long")
      ->default_str("3000")
      ->check(CLI::Range(100, 3'600'000));
  command
      ->add_option_function<int>(
          "--load-interval-ms",
          [options](int ms) { options->load_interval = std::chrono::milliseconds(ms); },
          "load metrics period")
      ->default_str("100")
      ->check(CLI::Range(1, 60'000));
  command
      ->add_option("--duration", *duration_s,
                   "stop after this many seconds (0: run until signalled)")
      ->capture_default_str()
      ->check(finite_range(0, 31'536'000));
  add_engine_options(*command, options->engine);
  // Disaggregated serving: how long a decode worker waits for a prompt's KV, and how long a
  // prefill worker holds it (both speaks).
  command
      ->add_option("--transfer-latency-ms", options->engine.transfer.latency_ms,
                   "fixed cost of one KV transfer between a prefill and a decode worker (real ms, "
                   "divided by --time-scale)")
      ->group("Simulated engine")
      ->capture_default_str()
      ->check(finite_range(0, 1e6));
  command
      ->add_option("--transfer-ms-per-block", options->engine.transfer.ms_per_block,
                   "KV transfer cost per block (real ms, divided by --time-scale; the default is "
                   "an 8B model's 64-token block over a ~25 GB/s RDMA link)")
      ->group("Simulated engine")
      ->capture_default_str()
      ->check(finite_range(0, 1e6));
  const std::string group = "Speaking vLLM (--speak vllm)";
  command
      ->add_option("--speak", *speak,
                   "kvr: workers over NATS; vllm: engines speaking vLLM's HTTP API, Prometheus "
                   "metrics and ZMQ KV events (no NATS), for `kvr bridge`")
      ->capture_default_str()
      ->check(CLI::IsMember({"kvr", "vllm"}));
  command->add_option("--listen-host", vllm->host, "interface the engines' sockets bind to")
      ->group(group)
      ->capture_default_str()
      ->check(non_empty());
  command
      ->add_option("--http-port", vllm->http_port,
                   "HTTP port of the first engine (0: any free port)")
      ->group(group)
      ->capture_default_str();
  command
      ->add_option("--kv-events-port", vllm->kv_events_port,
                   "ZMQ PUB port of the first engine's KV events")
      ->group(group)
      ->capture_default_str()
      ->check(CLI::Range(1, 65535));
  command
      ->add_option("--kv-events-replay-port", vllm->replay_port,
                   "ZMQ ROUTER replay port of the first engine (0: none)")
      ->group(group)
      ->capture_default_str();
  command
      ->add_option("--port-stride", *stride,
                   "engine i listens on each port + stride x i (HTTP, KV events, replay)")
      ->group(group)
      ->capture_default_str()
      ->check(CLI::Range(1, 10'000));
  command->add_option("--kv-events-topic", vllm->topic, "ZMQ topic of the KV event messages")
      ->group(group);
  command
      ->add_option("--kv-events-replay-buffer", vllm->replay_buffer,
                   "KV event batches the replay socket keeps")
      ->group(group)
      ->capture_default_str()
      ->check(CLI::Range(std::size_t{1}, std::size_t{10'000'000}));
  command
      ->add_option("--kv-events-skip-every", vllm->skip_every,
                   "fault injection: every nth KV event batch is not sent live (only replayed)")
      ->group(group)
      ->capture_default_str();
  command
      ->add_option("--http-threads", vllm->http_threads,
                   "HTTP server threads per engine (a streamed answer holds one while it runs)")
      ->group(group)
      ->capture_default_str()
      ->check(CLI::Range(1U, 10'000U));
  command
      ->add_flag("!--no-render-endpoints", vllm->render_endpoints,
                 "answer 404 on /v1/completions/render and /v1/chat/completions/render, as a vLLM "
                 "without them does (/tokenize stays)")
      ->group(group);
  command
      ->add_option("--lora-adapter", vllm->lora_adapters,
                   "a LoRA adapter served besides --model (repeatable): listed by /v1/models, "
                   "accepted as a request's model, cached apart and named in KV events (lora_id: "
                   "its 1-based position here)")
      ->group(group)
      ->check(non_empty());
  auto tokenizer_path = std::make_shared<std::string>();
  command
      ->add_option("--tokenizer", *tokenizer_path,
                   "a model's tokenizer (a folder with tokenizer.json and tokenizer_config.json): "
                   "prompts, chats, render and tokenize use it and its chat template instead of "
                   "the mock tokenizer")
      ->group(group)
      ->check(CLI::ExistingPath);
  command->callback([options, duration_s, role, speak, vllm, stride, tokenizer_path, &exit_code] {
    options->role = *parse_worker_type(*role);
    exit_code = *speak == "vllm"
                    ? run_vllm_engines(*options, *vllm, *stride, *duration_s, *tokenizer_path)
                    : run_mocker(*options, *duration_s);
  });
}

}  // namespace kvr::cli
