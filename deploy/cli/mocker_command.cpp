#include "deploy/cli/mocker_command.hpp"

#include <condition_variable>
#include <mutex>
#include <thread>

#include <spdlog/spdlog.h>

#include "deploy/cli/cli_options.hpp"
#include "deploy/mocker/mocker_fleet.hpp"

namespace kvr::cli {
namespace {

int run_mocker(mocker::MockerOptions options, double duration_s) {
  auto wait_for_signal = block_termination_signals();
  auto fleet = mocker::MockerFleet::create(std::move(options));
  if (!fleet) {
    spdlog::error("kvr mocker: {}", fleet.error());
    return 2;
  }
  std::stop_source stop;
  // The signal waiter ends the run; with --duration a timer does too. Both hold their own copy
  // of the stop source (shared state), so a late signal never touches a finished frame.
  std::jthread signal_thread{[stop, wait_for_signal]() mutable {
    const int signal = wait_for_signal();
    if (signal != 0) stop.request_stop();
  }};
  signal_thread.detach();
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
  command->add_option("--namespace", options->ns, "subject namespace (kvr.<namespace>.…)")
      ->envname("KVR_NAMESPACE")
      ->capture_default_str();
  command->add_option("--workers", options->workers, "simulated workers in this process")
      ->capture_default_str();
  command
      ->add_option("--worker-id-base", options->worker_id_base,
                   "first worker id (then +1 per worker); 0 picks a random base")
      ->capture_default_str();
  command->add_option("--model", options->model, "served model name")->capture_default_str();
  command->add_option("--role", *role, "aggregated, prefill, decode or encode")
      ->capture_default_str()
      ->check(CLI::IsMember({"aggregated", "prefill", "decode", "encode"}));
  command->add_option("--routing-group", options->routing_group, "routing group")
      ->capture_default_str();
  command
      ->add_option("--data-parallel-size", options->data_parallel_size,
                   "data-parallel ranks per worker")
      ->capture_default_str();
  command->add_option("--taint", options->taints, "a worker taint (repeatable), e.g. gpu=h100");
  command->add_flag("!--no-kv-events", options->publish_kv_events,
                    "publish no KV events (routers predict the cache)");
  command
      ->add_option_function<int>(
          "--lease-ttl-ms",
          [options](int ms) { options->lease_ttl = std::chrono::milliseconds(ms); },
          "routers drop a worker whose heartbeats stop for this long")
      ->default_str("3000");
  command
      ->add_option_function<int>(
          "--load-interval-ms",
          [options](int ms) { options->load_interval = std::chrono::milliseconds(ms); },
          "load metrics period")
      ->default_str("100");
  command
      ->add_option("--duration", *duration_s,
                   "stop after this many seconds (0: run until signalled)")
      ->capture_default_str();
  add_engine_options(*command, options->engine);
  command->callback([options, duration_s, role, &exit_code] {
    options->role = *parse_worker_type(*role);
    exit_code = run_mocker(*options, *duration_s);
  });
}

}  // namespace kvr::cli
