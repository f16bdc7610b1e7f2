// Deterministic discrete-event replay of a Mooncake trace through the real selection pipeline
// and discovery core (the selector's state), with one simulated engine per worker, on a logical
// clock. Used by `kvr replay` and the quickstart; equal inputs and seed give equal reports.
// Admission runs as in a router node when the plugins configure it: the request classifier
// (selection/admission/admission_state.hpp) and the partition core (selection/partition/
// partition_router.hpp: the policy-class queue, selection, booking, session affinity), their
// timers on the same logical clock: a node's selector actor drives the same core. Each request's
// flight (selection/lifecycle/request_flight.hpp: its hops, its bookings' first token and release,
// the classifier's events) is decided by the core a node's lifecycle actor keeps per request.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "deploy/replay/tenant_assignment.hpp"
#include "deploy/simulation/engine_config.hpp"
#include "deploy/simulation/mooncake_trace.hpp"
#include "deploy/simulation/replay_report.hpp"
#include "messages/error.hpp"
#include "selection/cluster/sharding.hpp"
#include "selection/partition/session_affinity.hpp"
#include "selection/plugin_registry.hpp"

namespace kvr::replay {

/// How to replay.
struct ReplayOptions {
  /// Simulated workers (one data-parallel rank each).
  std::size_t workers = 16;
  /// Disaggregated serving: the first this many workers are prefill workers and the rest decode
  /// workers, and each request's route is planned (the prefill hop, then decode, or decode alone:
  /// the plugins' models.replay.disaggregation). 0: every worker is aggregated.
  std::size_t prefill_workers = 0;
  /// Sharded partitions: the model's workers split over this many shards, each routed by its own
  /// partition core, and each request sent to its prompt prefix's shard with bounded load
  /// (selection/cluster/sharding.hpp), as a cluster of nodes routes a sharded model.
  cluster::ShardingConfig sharding;
  /// Divides the trace's inter-arrival times (2: twice the request rate).
  double speedup = 1.0;
  /// Seeds every random choice of the policies.
  std::uint64_t seed = 0;
  /// Engine parameters of every worker; its block size is the router's too.
  simulation::EngineConfig engine;
  /// Time from a worker publishing KV events or a load report to the router applying it.
  double kv_event_delay_ms = 5.0;
  /// A busy worker reports its load at the end of a step at most this often (and always when it
  /// falls idle), as a live worker reports on a timer.
  double load_report_interval_ms = 50.0;
  /// Router settings other than the block size (kv-cost defaults, temperature, thresholds).
  plugins::worker_selection::RouterConfig router;
  /// The busy threshold of the policy class `default` when the plugins configure no class of
  /// that name (`--router-queue-threshold`): a fraction in (0, 1] of a worker's max batched
  /// tokens. Empty: `default` never queues.
  std::optional<double> queue_threshold;
  /// A request waits at most this long for admission, and as long again in the policy-class
  /// queue, then it is refused with `timeout` (a router node's first-token timeout).
  std::chrono::milliseconds admission_max_wait{30'000};
  /// Session affinity as a node's `--router-session-affinity-*` configure it (off unless a TTL is
  /// set).
  SessionAffinityOptions session_affinity;
  /// With session affinity on, a request's session is its first this many hash ids (the turns of
  /// a conversation share their opening); a shorter request has none.
  std::size_t session_key_blocks = 2;
  /// Called after each request is routed: (policy index, requests routed so far).
  std::function<void(std::size_t, std::size_t)> on_progress;
};

/// A trace prepared once and replayed under several policies.
class TraceReplay {
 public:
  /// Expands every request's hash ids into engine blocks (done once for all policies).
  /// `tenants` names each request's tenant (empty: none), which classifiers see and the report
  /// breaks the results down by.
  TraceReplay(std::string trace_name, std::vector<simulation::TraceRequest> requests,
              ReplayOptions options, TenantAssignment tenants = {});

  /// The hit rate of one shared infinite cache over the trace: an upper bound for any router.
  double infinite_cache_hit_rate() const;
  /// The simulated fleet's KV blocks together (workers × the engine's blocks).
  std::uint64_t fleet_kv_blocks() const;
  /// The hit rate of one LRU cache of fleet_kv_blocks() over the trace: the upper bound for any
  /// router of a fleet with this much KV memory.
  double capacity_bound_hit_rate() const;
  /// The model every replayed request names.
  static std::string_view model();

  /// Replays the trace with the policy `plugins` selects for aggregated workers, and their request
  /// classifier and policy classes; `label` names it in the report. `policy_index` is passed to
  /// the progress callback. Latencies count from a request's arrival in the trace.
  /// `outcomes`, when given, receives each completed request's outcome, by trace index; each
  /// carries the cached tokens the router predicted for it.
  simulation::PolicyReport run(
      const std::string& label, const plugins::RouterPlugins& plugins, std::size_t policy_index = 0,
      std::vector<simulation::ReplayRequestOutcome>* outcomes = nullptr) const;

  const std::string& trace_name() const { return trace_name_; }
  std::size_t size() const { return requests_.size(); }
  const ReplayOptions& options() const { return options_; }
  const TenantAssignment& tenants() const { return tenants_; }

 private:
  std::string trace_name_;
  std::vector<simulation::TraceRequest> requests_;
  std::vector<std::vector<BlockHash>> block_hashes_;
  /// Per tenant: requests, completions, TTFT and rejections.
  std::vector<simulation::TenantReport> tenant_reports(
      const std::vector<simulation::ReplayRequestOutcome>& outcomes,
      const std::vector<std::pair<std::uint32_t, Error>>& rejections) const;

  ReplayOptions options_;
  TenantAssignment tenants_;
};

}  // namespace kvr::replay
