// Deterministic discrete-event replay of a Mooncake trace through the real selection pipeline
// and discovery core (the selector's state), with one simulated engine per worker, on a logical
// clock. Used by `kvr replay` and the quickstart; equal inputs and seed give equal reports.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "deploy/simulation/engine_config.hpp"
#include "deploy/simulation/mooncake_trace.hpp"
#include "deploy/simulation/replay_report.hpp"
#include "selection/plugin_registry.hpp"

namespace kvr::replay {

/// How to replay.
struct ReplayOptions {
  /// Simulated workers (one data-parallel rank each).
  std::size_t workers = 16;
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
  /// Called after each request is routed: (policy index, requests routed so far).
  std::function<void(std::size_t, std::size_t)> on_progress;
};

/// A trace prepared once and replayed under several policies.
class TraceReplay {
 public:
  /// Expands every request's hash ids into engine blocks (done once for all policies).
  TraceReplay(std::string trace_name, std::vector<simulation::TraceRequest> requests,
              ReplayOptions options);

  /// The hit rate of one shared infinite cache over the trace: an upper bound for any router.
  double infinite_cache_hit_rate() const;

  /// Replays the trace with the policy `plugins` selects for aggregated workers; `label` names
  /// it in the report. `policy_index` is passed to the progress callback.
  simulation::PolicyReport run(const std::string& label, const plugins::RouterPlugins& plugins,
                               std::size_t policy_index = 0) const;

  const std::string& trace_name() const { return trace_name_; }
  std::size_t size() const { return requests_.size(); }
  const ReplayOptions& options() const { return options_; }

 private:
  std::string trace_name_;
  std::vector<simulation::TraceRequest> requests_;
  std::vector<std::vector<BlockHash>> block_hashes_;
  ReplayOptions options_;
};

}  // namespace kvr::replay
