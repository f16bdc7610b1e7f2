#include "deploy/cli/replay_live_command.hpp"

#include <chrono>
#include <cmath>
#include <iostream>
#include <optional>

#include <fmt/format.h>

#include "deploy/cli/cli_options.hpp"
#include "deploy/cli/replay_output.hpp"
#include "deploy/replay/live_replay.hpp"
#include "deploy/replay/openai_replay.hpp"
#include "messages/http_url.hpp"

namespace kvr::cli {
namespace {

constexpr std::string_view kReplayLiveCommand = "kvr replay-live";

struct ReplayLiveCommandOptions {
  ReplayOutputOptions output;
  replay::LiveReplayOptions live;
  // Unset: the workers' registrations say.
  std::optional<std::uint32_t> block_size;
  double timeout_s = 60;
  double ready_timeout_s = 15;
  int route_retry_after_ms = 150;
  // Non-empty: through an OpenAI-compatible HTTP API instead of NATS.
  std::vector<std::string> openai_urls;
  replay::OpenAiApi openai_api = replay::OpenAiApi::chat;
  bool measure_from_send = false;
  std::size_t warmup = 0;
};

std::chrono::milliseconds seconds_to_ms(double seconds) {
  return std::chrono::milliseconds(static_cast<std::int64_t>(std::llround(seconds * 1000)));
}

// The common table with live wording: latencies are wall-clock, as the client measured them.
std::string live_table(const simulation::ReplayReport& report) {
  std::string table = simulation::format_table(report);
  for (const auto& [simulated, live_text] :
       {std::pair<std::string_view, std::string_view>{"ms of simulated time",
                                                      "ms of wall-clock time, measured by this "
                                                      "client"},
        {"busy = share of time workers ran steps", "busy: not measured live"}}) {
    if (const auto at = table.find(simulated); at != std::string::npos) {
      table.replace(at, simulated.size(), live_text);
    }
  }
  return table;
}

int run_openai_replay(const ReplayLiveCommandOptions& options,
                      const std::vector<simulation::TraceRequest>& trace) {
  replay::OpenAiReplayOptions openai;
  openai.base_urls = options.openai_urls;
  openai.model = options.live.model;
  openai.api = options.openai_api;
  openai.speedup = options.output.speedup;
  openai.concurrency = options.live.concurrency;
  openai.measure_from_send = options.measure_from_send;
  openai.warmup = options.warmup;
  openai.request_timeout = seconds_to_ms(options.timeout_s);
  openai.tenant = options.live.tenant;
  openai.tenants = options.live.tenants;
  ProgressBar progress{{"openai"}, trace.size(), !options.output.quiet};
  openai.on_progress = [&progress](std::size_t done) { progress.update(0, done); };
  const auto started = std::chrono::steady_clock::now();
  replay::OpenAiReplayResult result = replay::run_openai_replay(openai, trace);
  result.report.wall_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  simulation::ReplayReport report;
  report.trace = trace_name(options.output);
  report.requests = trace.size();
  report.workers = result.requests_per_worker.size();
  report.speedup = options.output.speedup;
  report.block_size = options.block_size.value_or(0);
  report.model = options.live.model;
  if (options.block_size) {
    std::vector<std::vector<BlockHash>> hashes;
    hashes.reserve(trace.size());
    for (const auto& request : trace) {
      hashes.push_back(simulation::expand_to_block_hashes(request, *options.block_size));
    }
    report.infinite_cache_hit_rate =
        simulation::infinite_cache_hit_rate(trace, hashes, *options.block_size);
  }
  report.policies.push_back(result.report);
  std::cout << live_table(report) << replay::format_openai_summary(result);
  if (!write_decisions(kReplayLiveCommand, options.output,
                       {PolicyDecisions{result.report.policy, std::move(result.outcomes)}})) {
    return 1;
  }
  const int written = write_report(kReplayLiveCommand, options.output, report,
                                   simulation::to_json(report), "failed");
  if (written != 0) return written;
  return result.report.failed == 0 ? 0 : 1;
}

int run_live_replay(const ReplayLiveCommandOptions& options) {
  auto trace = load_trace(kReplayLiveCommand, options.output);
  if (!trace) return kUsageError;
  if (!options.openai_urls.empty()) return run_openai_replay(options, *trace);
  replay::LiveReplayOptions live_options = options.live;
  live_options.speedup = options.output.speedup;
  live_options.block_size = options.block_size.value_or(0);
  live_options.request_timeout = seconds_to_ms(options.timeout_s);
  live_options.ready_timeout = seconds_to_ms(options.ready_timeout_s);
  live_options.route_retry.retry_after = std::chrono::milliseconds(options.route_retry_after_ms);
  ProgressBar progress{{"live"}, trace->size(), !options.output.quiet};
  live_options.on_progress = [&progress](std::size_t done) { progress.update(0, done); };
  auto live = replay::LiveReplay::connect(live_options);
  if (!live) {
    std::cerr << kReplayLiveCommand << ": " << live.error() << '\n';
    return kUsageError;
  }
  if (!options.output.quiet) {
    std::cerr << fmt::format(
        "  live cluster: namespace '{}', model '{}', {} workers announced, block size {}\n",
        live_options.ns, live_options.model, (*live)->workers(), (*live)->block_size());
  }
  const auto started = std::chrono::steady_clock::now();
  replay::LiveReplayResult result = (*live)->run(*trace);
  result.report.wall_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  if (!options.output.quiet) {
    std::cerr << fmt::format("  {:<26} replayed in {:.2f} s\n", result.report.policy,
                             result.report.wall_seconds);
  }

  simulation::ReplayReport report;
  report.trace = trace_name(options.output);
  report.requests = trace->size();
  report.workers = result.workers;
  report.speedup = options.output.speedup;
  report.seed = 0;
  report.block_size = result.block_size;
  report.infinite_cache_hit_rate = result.infinite_cache_hit_rate;
  report.fleet_kv_blocks = result.fleet_kv_blocks;
  report.capacity_bound_hit_rate = result.capacity_bound_hit_rate;
  report.model = live_options.model;
  report.policies.push_back(result.report);

  std::cout << live_table(report) << replay::format_live_summary(result);
  if (!write_decisions(kReplayLiveCommand, options.output,
                       {PolicyDecisions{result.report.policy, std::move(result.outcomes)}})) {
    return 1;
  }
  const int written = write_report(kReplayLiveCommand, options.output, report,
                                   replay::live_report_json(report, result), "failed");
  if (written != 0) return written;
  // The report is out either way; a failed request makes the run fail.
  return result.report.failed == 0 ? 0 : 1;
}

}  // namespace

void add_replay_live_command(CLI::App& app, int& exit_code) {
  auto* command = app.add_subcommand(
      "replay-live",
      "replay a Mooncake trace against a running cluster (kvr node + workers on NATS) in real "
      "time; latencies are wall-clock, as this client measures them");
  auto options = std::make_shared<ReplayLiveCommandOptions>();
  add_replay_output_options(*command, options->output);
  auto& live = options->live;
  live.nats.name = "kvr-replay";
  live.nats.max_reconnects = 10;
  add_nats_options(*command, live.nats);
  add_namespace_option(*command, live.ns);
  command->add_option("--model", live.model, "model every request asks for")
      ->capture_default_str()
      ->check(non_empty());
  command
      ->add_option("--block-size", options->block_size,
                   "tokens per KV block of the requests' hashes; unset: the workers' "
                   "registrations say")
      ->check(CLI::Range(1U, 4096U));
  command
      ->add_option("--concurrency", live.concurrency,
                   "most requests in flight; later arrivals wait (the wait counts in TTFT)")
      ->capture_default_str()
      ->check(CLI::Range(std::size_t{1}, std::size_t{1'000'000}));
  command
      ->add_option("--timeout", options->timeout_s,
                   "seconds a request may take from its route request to its last token; then it "
                   "is cancelled, reported aborted and counted as failed")
      ->capture_default_str()
      ->check(finite_range(0.001, 86'400.0));
  command
      ->add_option("--ready-timeout", options->ready_timeout_s,
                   "seconds to wait for the workers to announce themselves and a router to "
                   "route a probe request")
      ->capture_default_str()
      ->check(finite_range(0.1, 3'600.0));
  command
      ->add_option("--route-retry-after-ms", options->route_retry_after_ms,
                   "ask for a route again, with a fresh id, when no decision came this long "
                   "after the last ask (a hung node keeps its share of the queue group)")
      ->capture_default_str()
      ->check(CLI::Range(1, 600'000));
  command
      ->add_option("--route-attempts", live.route_retry.max_attempts,
                   "most route asks per request (1: never ask again)")
      ->capture_default_str()
      ->check(CLI::Range(1, 100));
  command->add_flag("--send-tokens", live.send_tokens,
                    "send the synthesized prompt tokens (the router hashes them) instead of block "
                    "hashes");
  auto* tenant = command->add_option(
      "--tenant", live.tenant,
      "tenant every request names (per-tenant admission in the node; default: none)");
  auto* tenants =
      command
          ->add_option("--tenants", live.tenants,
                       "spread the requests over N tenants: request i names tenant t<i mod N>")
          ->check(CLI::Range(std::size_t{1}, std::size_t{1'000'000}));
  tenant->excludes(tenants);
  tenants->excludes(tenant);
  command
      ->add_option("--openai-url", options->openai_urls,
                   "send the requests through an OpenAI-compatible API instead of NATS: a base "
                   "URL ending in /v1 (a kvr node's --http-port, or engines reached directly, "
                   "in turn when repeated); TTFT is the first streamed token, the hit rate the "
                   "engines' reported cached tokens")
      ->check([](const std::string& url) {
        const std::string fault = invalid_http_url(url);
        if (!fault.empty()) return "'" + url + "' " + fault;
        return url.starts_with("http://") ? std::string{}
                                          : std::string{"only http:// URLs are supported"};
      });
  command->add_flag("--measure-from-send", options->measure_from_send,
                    "with --openai-url: latencies from each request's sending, not its arrival "
                    "(with a high --speedup: closed-loop load at --concurrency streams)");
  command->add_option("--warmup", options->warmup,
                      "with --openai-url: leave the first N requests out of the front door's "
                      "added latency (a closed loop sends its first --concurrency at once)");
  command
      ->add_option("--openai-api", options->openai_api,
                   "with --openai-url: chat (the prompt as text in a user message) or "
                   "completions (the prompt as token ids)")
      ->transform(CLI::CheckedTransformer(
          std::map<std::string, replay::OpenAiApi>{{"chat", replay::OpenAiApi::chat},
                                                   {"completions", replay::OpenAiApi::completions}},
          CLI::ignore_case));
  command->footer(
      "A request the node's admission control refuses (ROUTE_ERROR_OVERLOADED, _RATE_LIMITED, "
      "_DUE_TIME_EXPIRED, _REJECTED) is counted as \"rejected by admission\", not as failed. "
      "Exit codes: 0 every request completed or was rejected by admission; 1 a request failed; "
      "2 bad options or no cluster to replay against.");
  command->callback([options, &exit_code] { exit_code = run_live_replay(*options); });
}

}  // namespace kvr::cli
