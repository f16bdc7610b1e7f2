#include "deploy/cli/replay_command.hpp"

#include <chrono>
#include <iostream>
#include <optional>

#include <fmt/format.h>

#include "classifiers/queue/policy_class_config.hpp"
#include "deploy/cli/cli_options.hpp"
#include "deploy/cli/replay_output.hpp"
#include "deploy/replay/tenant_assignment.hpp"
#include "deploy/replay/trace_replay.hpp"
#include "selection/config/router_policy_config.hpp"
#include "selection/policies/builtin_policies.hpp"
#include "selection/sdk/plugin_loader.hpp"

namespace kvr::cli {
namespace {

constexpr std::string_view kReplayCommand = "kvr replay";

struct ReplayCommandOptions {
  ReplayOutputOptions output;
  std::string policies = "kv-cost,round-robin,random,least-loaded";
  std::string router_policy_config;
  /// --plugin, loaded before the YAML's `plugins`.
  std::vector<std::string> plugin_paths;
  /// `name:weight,...`; empty: no tenants.
  std::string tenants;
  /// Replay only this tenant's requests; empty: all.
  std::string only_tenant;
  std::optional<double> queue_threshold;
  SessionAffinityFlags session_affinity;
  replay::ReplayOptions replay;
  /// With --prefill-workers: override models.replay.disaggregation of the YAML.
  std::optional<std::uint64_t> min_uncached_tokens;
  bool prefill_queue_check = false;
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

int run_replay(const ReplayCommandOptions& options) {
  auto trace = load_trace(kReplayCommand, options.output);
  if (!trace) return kUsageError;
  plugins::RouterPluginRegistry registry;
  if (auto registered = selection::register_builtin_policies(registry); !registered) {
    std::cerr << kReplayCommand << ": " << registered.error().message() << '\n';
    return kUsageError;
  }
  selection::RouterPolicyConfig base_config;
  if (!options.router_policy_config.empty()) {
    auto loaded = selection::load_router_policy_config(options.router_policy_config);
    if (!loaded) {
      std::cerr << kReplayCommand << ": " << loaded.error() << '\n';
      return kUsageError;
    }
    base_config = std::move(*loaded);
  }
  // Before --policies is resolved: it may name a plugin's types.
  if (auto loaded = plugins::load_plugins(options.plugin_paths, registry); !loaded) {
    std::cerr << kReplayCommand << ": --plugin: " << loaded.error() << '\n';
    return kUsageError;
  }
  if (auto loaded = plugins::load_plugins(base_config.plugins, registry); !loaded) {
    std::cerr << kReplayCommand << ": --router-policy-config: plugins: " << loaded.error() << '\n';
    return kUsageError;
  }
  // Replay runs the request classifier and the policy-class queue, so nothing is left unapplied.
  const std::vector<std::string> names = split_names(options.policies);
  if (names.empty()) {
    std::cerr << kReplayCommand << ": --policies names no policy\n";
    return kUsageError;
  }
  // Every name is resolved before anything runs, so a typo stops the run at once.
  std::vector<plugins::RouterPlugins> resolved;
  for (const std::string& name : names) {
    selection::RouterPolicyConfig config = base_config;
    config.worker_selection[static_cast<std::size_t>(WorkerType::Aggregated)] = name;
    if (options.replay.prefill_workers > 0) {
      // A disaggregated fleet: the policy serves the prefill and decode pools too, unless the
      // YAML names theirs.
      for (const WorkerType role : {WorkerType::Prefill, WorkerType::Decode}) {
        auto& chosen = config.worker_selection[static_cast<std::size_t>(role)];
        if (!chosen) chosen = name;
      }
      auto& disaggregation =
          config.models[std::string{replay::TraceReplay::model()}].disaggregation;
      if (!disaggregation) disaggregation.emplace();
      if (options.min_uncached_tokens) {
        disaggregation->min_uncached_tokens = *options.min_uncached_tokens;
      }
      if (options.prefill_queue_check) disaggregation->prefill_queue_check = true;
    }
    auto plugins = registry.resolve_plugins(config);
    if (!plugins) {
      std::cerr << kReplayCommand << ": --policies " << name << ": " << plugins.error().message()
                << '\n';
      return kUsageError;
    }
    resolved.push_back(std::move(*plugins));
  }

  replay::TenantAssignment tenants;
  if (!options.tenants.empty()) {
    auto weights = replay::parse_tenant_weights(options.tenants);
    if (!weights) {
      std::cerr << kReplayCommand << ": --tenants: " << weights.error() << '\n';
      return kUsageError;
    }
    tenants = replay::assign_tenants(*weights, trace->size(), options.replay.seed);
  }
  if (!options.only_tenant.empty()) {
    // The tenant's own requests at their own arrival times: the baseline of it running alone.
    const auto chosen = std::ranges::find(tenants.names, options.only_tenant);
    if (chosen == tenants.names.end()) {
      std::cerr << kReplayCommand << ": --only-tenant: '" << options.only_tenant
                << "' is not one of the --tenants\n";
      return kUsageError;
    }
    const auto tenant = static_cast<std::uint32_t>(chosen - tenants.names.begin());
    std::vector<simulation::TraceRequest> kept;
    for (std::size_t i = 0; i < trace->size(); ++i) {
      if (tenants.of_request[i] == tenant) kept.push_back(std::move((*trace)[i]));
    }
    *trace = std::move(kept);
    tenants = replay::TenantAssignment{{options.only_tenant},
                                       std::vector<std::uint32_t>(trace->size(), 0)};
  }

  ProgressBar progress{names, trace->size(), !options.output.quiet};
  replay::ReplayOptions replay_options = options.replay;
  replay_options.queue_threshold = options.queue_threshold;
  replay_options.session_affinity = session_affinity_options(options.session_affinity);
  replay_options.speedup = options.output.speedup;
  replay_options.on_progress = [&progress](std::size_t policy, std::size_t done) {
    progress.update(policy, done);
  };
  const std::string name = trace_name(options.output);
  replay::TraceReplay replay{name, std::move(*trace), replay_options, std::move(tenants)};

  simulation::ReplayReport report;
  report.trace = name;
  report.requests = replay.size();
  report.workers = replay_options.workers;
  report.speedup = replay_options.speedup;
  report.seed = replay_options.seed;
  report.block_size = replay_options.engine.block_size;
  report.infinite_cache_hit_rate = replay.infinite_cache_hit_rate();
  report.fleet_kv_blocks = replay.fleet_kv_blocks();
  report.capacity_bound_hit_rate = replay.capacity_bound_hit_rate();
  report.model = std::string{replay::TraceReplay::model()};
  std::vector<PolicyDecisions> decisions(options.output.decisions_path.empty() ? 0 : names.size());
  for (std::size_t i = 0; i < names.size(); ++i) {
    const auto started = std::chrono::steady_clock::now();
    std::vector<simulation::ReplayRequestOutcome>* outcomes = nullptr;
    if (!decisions.empty()) {
      decisions[i].label = names[i];
      outcomes = &decisions[i].outcomes;
    }
    simulation::PolicyReport policy = replay.run(names[i], resolved[i], i, outcomes);
    policy.wall_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    if (!options.output.quiet) {
      std::cerr << fmt::format("  {:<26} replayed in {:.2f} s\n", names[i], policy.wall_seconds);
    }
    report.policies.push_back(std::move(policy));
  }

  std::cout << simulation::format_table(report);
  if (!write_decisions(kReplayCommand, options.output, decisions)) return 1;
  return write_report(kReplayCommand, options.output, report, simulation::to_json(report),
                      "not routed");
}

}  // namespace

void add_replay_command(CLI::App& app, int& exit_code) {
  auto* command = app.add_subcommand(
      "replay",
      "replay a Mooncake trace through kvr's selection pipeline and simulated workers, policies "
      "side by side (replay-live drives a running cluster instead)");
  auto options = std::make_shared<ReplayCommandOptions>();
  add_replay_output_options(*command, options->output);
  command->add_option("--workers", options->replay.workers, "simulated workers")
      ->capture_default_str()
      ->check(CLI::Range(std::size_t{1}, std::size_t{100'000}));
  command->add_option("--seed", options->replay.seed, "seed of every random choice")
      ->capture_default_str();
  command
      ->add_option("--policies", options->policies,
                   "comma-separated policy types or router-policy instances, run side by side")
      ->capture_default_str()
      ->check(non_empty());
  command
      ->add_option("--plugin", options->plugin_paths,
                   "a plugin library (built against the kvr SDK with KVR_PLUGIN_CATALOG) whose "
                   "types --policies may name; repeatable")
      ->delimiter(',');
  command
      ->add_option("--router-policy-config", options->router_policy_config,
                   "router-policy YAML whose instances --policies may name")
      ->check(CLI::ExistingFile);
  command
      ->add_option("--router-queue-threshold", options->queue_threshold,
                   "queue requests of the policy class `default` while every worker's active "
                   "prefill tokens exceed this fraction in (0, 1] of its max batched tokens (when "
                   "policy_classes configure no `default`; default: off)")
      ->check(finite_range(0, 1));
  auto* tenants = command
                      ->add_option("--tenants", options->tenants,
                                   "assign the requests to tenants in proportion to weights, e.g. "
                                   "heavy:5,light:1 (seeded by --seed)")
                      ->check(non_empty());
  command
      ->add_option("--only-tenant", options->only_tenant,
                   "replay only this tenant's requests, at their own arrival times")
      ->check(non_empty())
      ->needs(tenants);
  command
      ->add_option("--kv-event-delay-ms", options->replay.kv_event_delay_ms,
                   "delay from a worker's KV event or load report to the router")
      ->capture_default_str()
      ->check(finite_range(0, 60'000));
  command
      ->add_option("--temperature", options->replay.router.temperature,
                   "kv-cost softmax temperature (0: lowest cost)")
      ->capture_default_str()
      ->check(finite_range(0, 1e6));
  add_session_affinity_options(*command, options->session_affinity);
  command
      ->add_option("--session-key-blocks", options->replay.session_key_blocks,
                   "with session affinity on, a request's session is its first N hash ids (a "
                   "conversation's turns share their opening; 0: no sessions)")
      ->capture_default_str()
      ->check(CLI::Range(std::size_t{0}, std::size_t{1'000'000}));
  command
      ->add_option("--prefill-workers", options->replay.prefill_workers,
                   "disaggregated serving: this many of the --workers are prefill workers and the "
                   "rest decode workers (0: all aggregated)")
      ->capture_default_str();
  command
      ->add_option("--disaggregation-min-uncached-tokens", options->min_uncached_tokens,
                   "with --prefill-workers: a request with fewer uncached prompt tokens on the "
                   "best decode worker skips the prefill hop (the YAML's "
                   "models.replay.disaggregation.min_uncached_tokens)")
      ->check(CLI::Range(std::uint64_t{0}, std::uint64_t{1} << 21));
  command->add_flag("--disaggregation-prefill-queue-check", options->prefill_queue_check,
                    "with --prefill-workers: skip the prefill hop when the prefill pool's queue "
                    "costs more than prefilling on the decode worker");
  command
      ->add_option("--partition-shards", options->replay.sharding.shards,
                   "split the model into this many shards, each routing its share of the workers; "
                   "a request goes to its prompt prefix's shard unless another is the faster way")
      ->check(CLI::Range(1U, 1024U))
      ->capture_default_str();
  command
      ->add_option("--shard-prefix-tokens", options->replay.sharding.prefix_tokens,
                   "with --partition-shards: the prompt prefix, in tokens, that picks a request's "
                   "shard")
      ->check(CLI::Range(1U, 1U << 20))
      ->capture_default_str();
  command
      ->add_option("--shard-miss-cost", options->replay.sharding.miss_cost,
                   "with --partition-shards: a request leaves its prefix's shard when another's "
                   "least loaded worker is ahead by more than this many times its prompt tokens")
      ->check(CLI::Range(0.0, 1000.0))
      ->capture_default_str();
  command
      ->add_option("--shard-load-interval-ms", options->replay.sharding.load_interval_ms,
                   "with --partition-shards: each shard publishes its load this often")
      ->check(CLI::Range(1U, 60'000U))
      ->capture_default_str();
  add_engine_options(*command, options->replay.engine);
  command->callback([options, &exit_code] {
    if (auto valid = options->replay.engine.validate(); !valid) {
      std::cerr << kReplayCommand << ": " << valid.error().message() << '\n';
      exit_code = kUsageError;
      return;
    }
    if (auto valid =
            check_simulated_blocks(options->replay.workers, options->replay.engine, "--workers");
        !valid) {
      std::cerr << kReplayCommand << ": " << valid.error() << '\n';
      exit_code = kUsageError;
      return;
    }
    if (options->replay.prefill_workers > 0 &&
        options->replay.prefill_workers >= options->replay.workers) {
      std::cerr << kReplayCommand << ": --prefill-workers: must leave at least one of the "
                << options->replay.workers << " --workers for decode\n";
      exit_code = kUsageError;
      return;
    }
    if (options->queue_threshold) {
      // The same rule as a configured class's prefill_busy_threshold_frac.
      if (auto valid = classifiers::validate_policy_class(
              classifiers::default_policy_class(*options->queue_threshold));
          !valid) {
        std::cerr << kReplayCommand << ": --router-queue-threshold: " << valid.error().message
                  << '\n';
        exit_code = kUsageError;
        return;
      }
    }
    exit_code = run_replay(*options);
  });
}

}  // namespace kvr::cli
