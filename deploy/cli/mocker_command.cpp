#include "deploy/cli/mocker_command.hpp"

#include <condition_variable>
#include <mutex>
#include <thread>

#include <spdlog/spdlog.h>

#include "deploy/cli/cli_options.hpp"
#include "deploy/cli/stop_signals.hpp"
#include "deploy/mocker/mocker_fleet.hpp"

namespace kvr::cli {
namespace {

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
  const auto ids = (*fleet)->worker_ids();
  spdlog::info("kvr mocker: {} workers (ids {}..{}) serving", ids.size(), ids.front(), ids.back());
  signals->ready();
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
          "--lease-ttl-ms",
          [options](int ms) { options->lease_ttl = std::chrono::milliseconds(ms); },
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
  command->callback([options, duration_s, role, &exit_code] {
    options->role = *parse_worker_type(*role);
    exit_code = run_mocker(*options, *duration_s);
  });
}

}  // namespace kvr::cli
