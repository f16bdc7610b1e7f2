// Summaries of a trace replay: per-policy KV hit rate, latency percentiles, throughput and load
// balance, and the hit-rate ladder (docs/hit-rate.md), rendered as a text table and as JSON. Used
// by `kvr replay` (offline and live).
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "deploy/simulation/engine.hpp"
#include "messages/metrics/hit_rate_ladder.hpp"

namespace kvr::simulation {

/// Milliseconds from one steady-clock instant to another: the unit of every time in a report.
inline double ms_between(std::chrono::steady_clock::time_point from,
                         std::chrono::steady_clock::time_point to) {
  return std::chrono::duration<double, std::milli>(to - from).count();
}

/// Mean and percentiles of one latency, in milliseconds.
struct LatencySummary {
  double mean = 0;
  double p50 = 0;
  double p90 = 0;
  double p99 = 0;
  double max = 0;
};

/// Summarises `values` (empty: all zero). Percentiles use the nearest-rank method.
LatencySummary summarize(std::vector<double> values);

/// One request's outcome in a replay, whichever way it was served.
struct ReplayRequestOutcome {
  std::size_t trace_index = 0;
  WorkerWithDpRank worker;
  /// stats.arrival_ms is the request's arrival at the router, so its latencies include any wait
  /// for admission or in the queue.
  RequestStats stats;
  /// When the router sent it to its worker (stats.arrival_ms when it did not wait); 0 if unknown.
  double dispatched_ms = 0;
  /// The prompt tokens the router predicted cached when it routed the request (its overlap in
  /// tokens); unknown when the engines were reached without the router.
  std::optional<std::uint64_t> predicted_cached_tokens;
  /// A request that took the prefill hop: its prefill worker (`worker` decoded it).
  std::optional<WorkerWithDpRank> prefill_worker;
  /// Retries its flight made before it completed (a worker that failed it before its first
  /// token, a failed prefill hop).
  std::uint32_t retries = 0;
};

/// Counts by name (an error code, a failure message), sorted by name.
using NamedCounts = std::vector<std::pair<std::string, std::size_t>>;

/// One tenant's share of a policy's run.
struct TenantReport {
  std::string tenant;
  /// The tenant's requests in the trace replayed.
  std::size_t requests = 0;
  std::size_t completed = 0;
  /// From the request's arrival, admission and queue waits included.
  LatencySummary ttft_ms;
  /// The tenant's requests refused by admission or the queue, by error code.
  NamedCounts rejected;
};

/// A learning policy's predictions of time to first token beside the times observed, and what it
/// learnt by the end of the run.
struct TtftCalibrationReport {
  std::size_t predictions = 0;
  double mean_predicted_ms = 0;
  double mean_observed_ms = 0;
  /// Median of |predicted − observed| / observed over the predictions.
  double median_relative_error = 0;
  /// Median of |predicted − observed|.
  double median_absolute_error_ms = 0;
  /// The policy's partition-wide learnt values by name, and its per-worker factors' range.
  std::vector<std::pair<std::string, double>> learnt;
};

/// Summarises (predicted, observed) pairs in milliseconds; `learnt` is copied as given.
TtftCalibrationReport make_calibration_report(
    const std::vector<std::pair<double, double>>& predicted_observed_ms,
    std::vector<std::pair<std::string, double>> learnt);

/// The result of one policy over one trace.
struct PolicyReport {
  std::string policy;
  std::size_t requests = 0;
  std::size_t completed = 0;
  /// Requests the router could not place (explicit selection errors); rejections are not failures.
  std::size_t failed = 0;
  /// Requests admission (the request classifier) or the policy-class queue refused, by error code
  /// (e.g. rate_limited, overloaded, timeout): answered outcomes, counted apart from failures.
  NamedCounts rejected;
  /// What a front door added to each request's time to first token: the client's TTFT less the
  /// engine's own (the node's Server-Timing); only from a replay through `kvr node --http-port`.
  std::optional<LatencySummary> front_door_added_ms;
  /// Prompt tokens served from cache / prompt tokens.
  double hit_rate = 0;
  /// The ladder's measured rungs over the completed requests: prompt tokens, the router's
  /// predicted cached tokens and the engines' (hit_rate is their delivered rate), and how the two
  /// differed per request.
  metrics::ModelCacheOutcomes cache_outcomes;
  /// Whether any completed request carried the router's prediction (not so for engines reached
  /// directly): without it the predicted rung is unknown.
  bool predicted_known = false;
  LatencySummary ttft_ms;
  /// Mean inter-token latency per request, summarised over requests.
  LatencySummary itl_ms;
  LatencySummary e2e_ms;
  /// Simulated span from the first arrival to the last completion.
  double makespan_s = 0;
  double output_tokens_per_s = 0;
  double requests_per_s = 0;
  /// max / mean of prompt+output tokens served per worker (1.0 is perfectly even).
  double load_imbalance = 0;
  /// Mean share of the makespan the workers spent running engine steps (0..1).
  double utilization = 0;
  /// Disaggregated serving: the router's decisions by reason (disaggregated, short_prompt, ...);
  /// empty for an aggregated fleet.
  NamedCounts disaggregation;
  /// Sharded partitions: requests routed by each shard, and how many of them spilled from their
  /// prompt prefix's shard to another; empty for an unsharded model.
  std::vector<std::size_t> shard_requests;
  std::size_t shard_spills = 0;
  /// Selection failures by message, for diagnosis.
  std::vector<std::pair<std::string, std::size_t>> failures;
  /// Only for a policy that predicts time to first token (predicted-ttft).
  std::optional<TtftCalibrationReport> ttft_calibration;
  /// Per tenant, in the order the tenants were named; empty when the replay names none.
  std::vector<TenantReport> tenants;
  /// Wall-clock seconds the replay of this policy took (not part of the JSON: it varies).
  double wall_seconds = 0;
};

/// The total of `counts`.
std::size_t total(const NamedCounts& counts);

/// Builds a report from outcomes; `workers` is the fleet size, for the imbalance figure. Every
/// request without an outcome counts as failed (subtract the rejections once they are known).
PolicyReport make_policy_report(std::string policy, std::size_t requests,
                                const std::vector<ReplayRequestOutcome>& outcomes,
                                std::size_t workers);

/// Everything one replay run produced.
struct ReplayReport {
  std::string trace;
  std::size_t requests = 0;
  std::size_t workers = 0;
  double speedup = 1;
  std::uint64_t seed = 0;
  std::uint32_t block_size = 0;
  /// The hit rate of one infinite shared cache: an upper bound for any router (the ladder's
  /// workload ceiling; unknown while block_size is 0).
  double infinite_cache_hit_rate = 0;
  /// The fleet's KV blocks together (0: unknown), and the hit rate of one LRU cache of that many
  /// blocks over the trace: the ladder's capacity-bound ceiling.
  std::uint64_t fleet_kv_blocks = 0;
  double capacity_bound_hit_rate = 0;
  /// The model the requests named: the ladder's label.
  std::string model;
  std::vector<PolicyReport> policies;
};

/// A fixed-width table with one row per policy; below it the hit-rate ladder, one row per policy
/// (workload ceiling, capacity-bound ceiling, predicted, delivered, the token counters; "-" for a
/// rung that is unknown), then, when any policy has them, each policy's rejections by code and a
/// table of its tenants.
std::string format_table(const ReplayReport& report);

/// Deterministic JSON (keys sorted, fixed float formatting): equal inputs give equal bytes.
std::string to_json(const ReplayReport& report);

}  // namespace kvr::simulation
