#include "deploy/cli/replay_command.hpp"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>

#include <fcntl.h>
#include <fmt/format.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include "deploy/cli/cli_options.hpp"
#include "deploy/replay/live_replay.hpp"
#include "deploy/replay/trace_replay.hpp"
#include "selection/config/router_policy_config.hpp"
#include "selection/policies/builtin_policies.hpp"

extern char** environ;

namespace kvr::cli {
extern const char kPlotReplayScript[];

namespace {

struct ReplayCommandOptions {
  std::string trace = KVR_DEFAULT_TRACE;
  std::size_t limit = 0;
  std::string policies = "kv-cost,round-robin,random,least-loaded";
  std::string router_policy_config;
  std::string json_path;
  std::string plot_path;
  bool quiet = false;
  replay::ReplayOptions replay;
  // Live mode: drive a running cluster instead of simulating one.
  bool live = false;
  replay::LiveReplayOptions live_options;
  double timeout_s = 60;
  double ready_timeout_s = 15;
};

std::vector<std::string> split_names(const std::string& text) {
  std::vector<std::string> names;
  std::size_t start = 0;
  while (start <= text.size()) {
    const std::size_t comma = text.find(',', start);
    std::string name =
        text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    if (!name.empty()) names.push_back(std::move(name));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return names;
}

// Redraws one progress line on stderr at most every percent.
class ProgressBar {
 public:
  ProgressBar(std::vector<std::string> labels, std::size_t total, bool enabled)
      : labels_(std::move(labels)), total_(total), enabled_(enabled), terminal_(isatty(2) == 1) {}

  void update(std::size_t policy, std::size_t done) {
    if (!enabled_ || total_ == 0) return;
    // A terminal gets a bar redrawn every percent; a log file a line every quarter.
    const std::size_t step = terminal_ ? 1 : 25;
    const std::size_t percent = done * 100 / total_ / step * step;
    if (policy == last_policy_ && percent == last_percent_ && done != total_) return;
    last_policy_ = policy;
    last_percent_ = percent;
    constexpr std::size_t kWidth = 30;
    const std::size_t filled = percent * kWidth / 100;
    std::cerr << fmt::format("{}  {:<26} [{}{}] {:>3}% {}/{}", terminal_ ? "\r" : "",
                             labels_[policy], std::string(filled, '#'),
                             std::string(kWidth - filled, '.'), percent, done, total_);
    if (done == total_ || !terminal_) std::cerr << '\n';
    std::cerr.flush();
  }

 private:
  std::vector<std::string> labels_;
  std::size_t total_;
  bool enabled_;
  bool terminal_;
  std::size_t last_policy_ = SIZE_MAX;
  std::size_t last_percent_ = SIZE_MAX;
};

bool write_file(const std::string& path, const std::string& contents) {
  std::ofstream output{path, std::ios::binary};
  output << contents;
  return static_cast<bool>(output);
}

// Runs the embedded plot script with Debian's python3-matplotlib.
bool draw_plot(const std::string& json_path, const std::string& plot_path) {
  char script_path[] = "/tmp/kvr-plot-XXXXXX.py";
  const int fd = mkstemps(script_path, 3);
  if (fd < 0) return false;
  const std::string_view script{kPlotReplayScript};
  const bool written =
      write(fd, script.data(), script.size()) == static_cast<ssize_t>(script.size());
  close(fd);
  // Debian's interpreter is the one python3-matplotlib installs into; a python3 earlier on PATH
  // (a virtualenv, pyenv) may lack it. KVR_PYTHON overrides both.
  std::string python = "python3";
  if (const char* chosen = std::getenv("KVR_PYTHON"); chosen != nullptr && *chosen != '\0') {
    python = chosen;
  } else if (access("/usr/bin/python3", X_OK) == 0) {
    python = "/usr/bin/python3";
  }
  bool drawn = false;
  if (written) {
    std::vector<std::string> argv{python, script_path, json_path, plot_path};
    std::vector<char*> args;
    for (auto& arg : argv) args.push_back(arg.data());
    args.push_back(nullptr);
    pid_t pid = -1;
    if (posix_spawnp(&pid, python.c_str(), nullptr, nullptr, args.data(), environ) == 0) {
      int status = 0;
      waitpid(pid, &status, 0);
      drawn = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    }
  }
  unlink(script_path);
  return drawn;
}

// Prints the failures, writes the JSON and the plot; the command's exit code.
int write_report(const ReplayCommandOptions& options, const simulation::ReplayReport& report,
                 const std::string& json) {
  for (const auto& policy : report.policies) {
    for (const auto& [message, count] : policy.failures) {
      std::cout << fmt::format("  {}: {} requests {}: {}\n", policy.policy, count,
                               options.live ? "failed" : "not routed", message);
    }
  }
  std::string json_path = options.json_path;
  if (!json_path.empty() && !write_file(json_path, json)) {
    std::cerr << "kvr replay: cannot write " << json_path << '\n';
    return 1;
  }
  if (!options.plot_path.empty()) {
    std::string temporary_json;
    if (json_path.empty()) {
      temporary_json = options.plot_path + ".json.tmp";
      if (!write_file(temporary_json, json)) return 1;
      json_path = temporary_json;
    }
    const bool drawn = draw_plot(json_path, options.plot_path);
    if (!temporary_json.empty()) std::filesystem::remove(temporary_json);
    if (!drawn) {
      std::cerr << "kvr replay: plotting failed (is python3-matplotlib installed?)\n";
      return 1;
    }
    std::cout << "plot written to " << options.plot_path << '\n';
  }
  return 0;
}

int run_replay(const ReplayCommandOptions& options) {
  auto trace = simulation::load_mooncake_trace(options.trace, options.limit);
  if (!trace) {
    std::cerr << "kvr replay: " << trace.error() << '\n';
    return 2;
  }
  plugins::RouterPluginRegistry registry;
  if (auto registered = selection::register_builtin_policies(registry); !registered) {
    std::cerr << "kvr replay: " << registered.error().message() << '\n';
    return 2;
  }
  selection::RouterPolicyConfig base_config;
  if (!options.router_policy_config.empty()) {
    auto loaded = selection::load_router_policy_config(options.router_policy_config);
    if (!loaded) {
      std::cerr << "kvr replay: " << loaded.error() << '\n';
      return 2;
    }
    base_config = std::move(*loaded);
  }
  const std::vector<std::string> names = split_names(options.policies);
  if (names.empty()) {
    std::cerr << "kvr replay: --policies names no policy\n";
    return 2;
  }
  // Every name is resolved before anything runs, so a typo stops the run at once.
  std::vector<plugins::RouterPlugins> resolved;
  for (const std::string& name : names) {
    selection::RouterPolicyConfig config = base_config;
    config.worker_selection[static_cast<std::size_t>(WorkerType::Aggregated)] = name;
    auto plugins = registry.resolve_plugins(config);
    if (!plugins) {
      std::cerr << "kvr replay: --policies " << name << ": " << plugins.error().message() << '\n';
      return 2;
    }
    resolved.push_back(std::move(*plugins));
  }

  ProgressBar progress{names, trace->size(), !options.quiet};
  replay::ReplayOptions replay_options = options.replay;
  replay_options.on_progress = [&progress](std::size_t policy, std::size_t done) {
    progress.update(policy, done);
  };
  const std::string trace_name = std::filesystem::path{options.trace}.filename().string();
  replay::TraceReplay replay{trace_name, std::move(*trace), replay_options};

  simulation::ReplayReport report;
  report.trace = trace_name;
  report.requests = replay.size();
  report.workers = replay_options.workers;
  report.speedup = replay_options.speedup;
  report.seed = replay_options.seed;
  report.block_size = replay_options.engine.block_size;
  report.infinite_cache_hit_rate = replay.infinite_cache_hit_rate();
  for (std::size_t i = 0; i < names.size(); ++i) {
    const auto started = std::chrono::steady_clock::now();
    simulation::PolicyReport policy = replay.run(names[i], resolved[i], i);
    policy.wall_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    if (!options.quiet) {
      std::cerr << fmt::format("  {:<26} replayed in {:.2f} s\n", names[i], policy.wall_seconds);
    }
    report.policies.push_back(std::move(policy));
  }

  std::cout << simulation::format_table(report);
  return write_report(options, report, simulation::to_json(report));
}

int run_live_replay(const ReplayCommandOptions& options) {
  auto trace = simulation::load_mooncake_trace(options.trace, options.limit);
  if (!trace) {
    std::cerr << "kvr replay --live: " << trace.error() << '\n';
    return 2;
  }
  replay::LiveReplayOptions live_options = options.live_options;
  live_options.speedup = options.replay.speedup;
  live_options.request_timeout =
      std::chrono::milliseconds(static_cast<std::int64_t>(std::llround(options.timeout_s * 1000)));
  live_options.ready_timeout = std::chrono::milliseconds(
      static_cast<std::int64_t>(std::llround(options.ready_timeout_s * 1000)));
  ProgressBar progress{{"live"}, trace->size(), !options.quiet};
  live_options.on_progress = [&progress](std::size_t done) { progress.update(0, done); };
  auto live = replay::LiveReplay::connect(live_options);
  if (!live) {
    std::cerr << "kvr replay --live: " << live.error() << '\n';
    return 2;
  }
  const std::string trace_name = std::filesystem::path{options.trace}.filename().string();
  if (!options.quiet) {
    std::cerr << fmt::format(
        "  live cluster: namespace '{}', model '{}', {} workers announced, block size {}\n",
        live_options.ns, live_options.model, (*live)->workers(), (*live)->block_size());
  }
  const auto started = std::chrono::steady_clock::now();
  replay::LiveReplayResult result = (*live)->run(*trace);
  result.report.wall_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  if (!options.quiet) {
    std::cerr << fmt::format("  {:<26} replayed in {:.2f} s\n", result.report.policy,
                             result.report.wall_seconds);
  }

  simulation::ReplayReport report;
  report.trace = trace_name;
  report.requests = trace->size();
  report.workers = result.workers;
  report.speedup = options.replay.speedup;
  report.seed = 0;
  report.block_size = result.block_size;
  report.infinite_cache_hit_rate = result.infinite_cache_hit_rate;
  report.policies.push_back(result.report);

  // The common table; live latencies are wall-clock, as the client measured them.
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
  std::cout << table << replay::format_live_summary(result);
  const int written = write_report(options, report, replay::live_report_json(report, result));
  if (written != 0) return written;
  // The report is out either way; a failed request makes the run fail.
  return result.report.failed == 0 ? 0 : 1;
}
}  // namespace

void add_replay_command(CLI::App& app, int& exit_code) {
  auto* command = app.add_subcommand(
      "replay",
      "replay a Mooncake trace through kvr's selection pipeline and simulated workers, or "
      "(--live) against a running cluster");
  auto options = std::make_shared<ReplayCommandOptions>();
  command->add_option("--trace", options->trace, "Mooncake JSONL trace")
      ->capture_default_str()
      ->check(CLI::ExistingFile);
  command->add_option("--workers", options->replay.workers, "simulated workers")
      ->capture_default_str()
      ->check(CLI::Range(std::size_t{1}, std::size_t{100'000}));
  command->add_option("--speedup", options->replay.speedup, "divides inter-arrival times")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  command->add_option("--limit", options->limit, "replay only the first N requests (0: all)")
      ->capture_default_str();
  command->add_option("--seed", options->replay.seed, "seed of every random choice")
      ->capture_default_str();
  command
      ->add_option("--policies", options->policies,
                   "comma-separated policy types or router-policy instances, run side by side")
      ->capture_default_str();
  command
      ->add_option("--router-policy-config", options->router_policy_config,
                   "router-policy YAML whose instances --policies may name")
      ->check(CLI::ExistingFile);
  command->add_option("--json", options->json_path, "write the report as JSON");
  command->add_option("--plot", options->plot_path, "write a PNG plot (python3-matplotlib)");
  command
      ->add_option("--kv-event-delay-ms", options->replay.kv_event_delay_ms,
                   "delay from a worker's KV event or load report to the router")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  command
      ->add_option("--temperature", options->replay.router.temperature,
                   "kv-cost softmax temperature (0: lowest cost)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  command->add_flag("--quiet", options->quiet, "no progress bar");
  add_engine_options(*command, options->replay.engine);

  // Live mode: the same trace and report against a running cluster.
  const std::string live_group = "Live replay (--live)";
  auto* live = command
                   ->add_flag("--live", options->live,
                              "drive a running cluster (kvr node + workers on NATS) instead of "
                              "simulating one; latencies are wall-clock")
                   ->group(live_group);
  auto& live_options = options->live_options;
  live_options.nats.name = "kvr-replay";
  live_options.nats.max_reconnects = 10;
  add_nats_options(*command, live_options.nats);
  for (const char* name :
       {"--nats", "--nats-user", "--nats-password", "--nats-token", "--nats-tls-ca",
        "--nats-tls-cert", "--nats-tls-key", "--nats-reconnect-wait-ms"}) {
    command->get_option(name)->group(live_group);
  }
  command->add_option("--namespace", live_options.ns, "subject namespace (kvr.<namespace>.…)")
      ->envname("KVR_NAMESPACE")
      ->capture_default_str()
      ->group(live_group);
  command->add_option("--model", live_options.model, "model every request asks for")
      ->capture_default_str()
      ->group(live_group)
      ->needs(live);
  command
      ->add_option("--concurrency", live_options.concurrency,
                   "most requests in flight; later arrivals wait (the wait counts in TTFT)")
      ->capture_default_str()
      ->check(CLI::Range(std::size_t{1}, std::size_t{1'000'000}))
      ->group(live_group)
      ->needs(live);
  command
      ->add_option("--timeout", options->timeout_s,
                   "seconds a request may take from its route request to its last token; then it "
                   "is cancelled, reported aborted and counted as failed")
      ->capture_default_str()
      ->check(CLI::Range(0.001, 86'400.0))
      ->group(live_group)
      ->needs(live);
  command
      ->add_option("--ready-timeout", options->ready_timeout_s,
                   "seconds to wait for the workers to announce themselves and a router to "
                   "route a probe request")
      ->capture_default_str()
      ->check(CLI::Range(0.1, 3'600.0))
      ->group(live_group)
      ->needs(live);
  command
      ->add_flag("--send-tokens", live_options.send_tokens,
                 "send the synthesized prompt tokens (the router hashes them) instead of block "
                 "hashes")
      ->group(live_group)
      ->needs(live);
  // In live mode the cluster decides these: naming one is a mistake worth stopping for.
  for (const char* name :
       {"--workers", "--policies", "--router-policy-config", "--seed", "--kv-event-delay-ms",
        "--temperature", "--num-gpu-blocks", "--max-num-batched-tokens", "--max-num-seqs",
        "--time-scale", "--no-prefix-caching", "--prefill-quadratic-ms", "--prefill-linear-ms",
        "--prefill-constant-ms", "--decode-quadratic-ms", "--decode-linear-ms",
        "--decode-constant-ms", "--decode-floor-ms"}) {
    live->excludes(command->get_option(name));
  }
  command->callback([options, command, &exit_code] {
    if (auto valid = options->replay.engine.validate(); !valid) {
      std::cerr << "kvr replay: " << valid.error().message() << '\n';
      exit_code = 2;
      return;
    }
    if (options->live) {
      // The block size is the cluster's unless given: the workers announce theirs.
      options->live_options.block_size =
          command->count("--block-size") > 0 ? options->replay.engine.block_size : 0;
      exit_code = run_live_replay(*options);
      return;
    }
    exit_code = run_replay(*options);
  });
}

}  // namespace kvr::cli
