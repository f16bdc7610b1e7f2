#include "deploy/simulation/replay_report.hpp"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace kvr::simulation {
namespace {

double percentile(const std::vector<double>& sorted, double fraction) {
  if (sorted.empty()) return 0;
  // Nearest rank: the smallest value with at least `fraction` of the values at or below it.
  const auto rank =
      static_cast<std::size_t>(std::ceil(fraction * static_cast<double>(sorted.size())));
  return sorted[std::clamp<std::size_t>(rank, 1, sorted.size()) - 1];
}

// Rounds to a fixed number of decimals so that JSON output is byte-stable across platforms.
double rounded(double value, int decimals = 6) {
  const double scale = std::pow(10.0, decimals);
  return std::round(value * scale) / scale;
}

nlohmann::ordered_json latency_json(const LatencySummary& summary) {
  nlohmann::ordered_json json;
  json["max"] = rounded(summary.max);
  json["mean"] = rounded(summary.mean);
  json["p50"] = rounded(summary.p50);
  json["p90"] = rounded(summary.p90);
  json["p99"] = rounded(summary.p99);
  return json;
}

nlohmann::ordered_json counts_json(const NamedCounts& counts) {
  // Sorted by name whatever the order the report holds them in; a name given twice adds up.
  std::map<std::string, std::size_t> sorted;
  for (const auto& [name, count] : counts) sorted[name] += count;
  nlohmann::ordered_json json = nlohmann::ordered_json::object();
  for (const auto& [name, count] : sorted) json[name] = count;
  return json;
}

std::string counts_text(const NamedCounts& counts) {
  std::string text;
  for (const auto& [name, count] : counts) {
    text += fmt::format("{}{} {}", text.empty() ? "" : ", ", name, count);
  }
  return text.empty() ? "none" : text;
}

// A rung's value, or "-" when it is unknown.
std::string rung(bool known, double rate) { return known ? fmt::format("{:.3f}", rate) : "-"; }

// The ladder's rows, one per policy, from the highest rung down (docs/hit-rate.md).
std::string format_hit_rate_ladder(const ReplayReport& report) {
  const bool workload_known = report.block_size != 0;
  const bool capacity_known = workload_known && report.fleet_kv_blocks != 0;
  std::string text = fmt::format(
      "hit-rate ladder, model {} (docs/hit-rate.md): workload = one infinite cache; capacity = "
      "one LRU cache of the fleet's {} KV blocks; predicted = the router's overlap when it "
      "routed; delivered = the engines' cached tokens\n",
      report.model.empty() ? std::string{"?"} : report.model,
      capacity_known ? fmt::format("{}", report.fleet_kv_blocks) : std::string{"(unknown)"});
  text += fmt::format("{:<26} {:>9} {:>9} {:>9} {:>9} {:>14} {:>14} {:>14} {:>11} {:>7} {:>7}\n",
                      "policy", "workload", "capacity", "predicted", "delivered", "prompt tok",
                      "predicted tok", "engine tok", "engine<pred", "=pred", ">pred");
  for (const PolicyReport& policy : report.policies) {
    const metrics::ModelCacheOutcomes& cache = policy.cache_outcomes;
    text += fmt::format(
        "{:<26} {:>9} {:>9} {:>9} {:>9} {:>14} {:>14} {:>14} {:>11} {:>7} {:>7}\n", policy.policy,
        rung(workload_known, report.infinite_cache_hit_rate),
        rung(capacity_known, report.capacity_bound_hit_rate),
        rung(policy.predicted_known, cache.totals.predicted_hit_rate()),
        rung(true, cache.totals.delivered_hit_rate()), cache.totals.prompt_tokens,
        policy.predicted_known ? fmt::format("{}", cache.totals.predicted_cached_tokens) : "-",
        cache.totals.engine_cached_tokens,
        policy.predicted_known ? fmt::format("{}", cache.engine_below_predicted) : "-",
        policy.predicted_known ? fmt::format("{}", cache.engine_as_predicted) : "-",
        policy.predicted_known ? fmt::format("{}", cache.engine_above_predicted) : "-");
  }
  return text;
}

// A rate for the JSON report, or null when it is unknown.
nlohmann::ordered_json rate_json(bool known, double rate) {
  return known ? nlohmann::ordered_json(rounded(rate)) : nlohmann::ordered_json(nullptr);
}

nlohmann::ordered_json ladder_json(const PolicyReport& policy) {
  const metrics::ModelCacheOutcomes& cache = policy.cache_outcomes;
  nlohmann::ordered_json json;
  json["delivered"] = rounded(cache.totals.delivered_hit_rate());
  json["engine_above_predicted"] = cache.engine_above_predicted;
  json["engine_as_predicted"] = cache.engine_as_predicted;
  json["engine_below_predicted"] = cache.engine_below_predicted;
  json["engine_cached_tokens"] = cache.totals.engine_cached_tokens;
  json["predicted"] = rate_json(policy.predicted_known, cache.totals.predicted_hit_rate());
  json["predicted_cached_tokens"] = cache.totals.predicted_cached_tokens;
  json["prompt_tokens"] = cache.totals.prompt_tokens;
  return json;
}

}  // namespace

std::size_t total(const NamedCounts& counts) {
  std::size_t sum = 0;
  for (const auto& [name, count] : counts) sum += count;
  return sum;
}

LatencySummary summarize(std::vector<double> values) {
  LatencySummary summary;
  if (values.empty()) return summary;
  std::ranges::sort(values);
  summary.mean =
      std::accumulate(values.begin(), values.end(), 0.0) / static_cast<double>(values.size());
  summary.p50 = percentile(values, 0.50);
  summary.p90 = percentile(values, 0.90);
  summary.p99 = percentile(values, 0.99);
  summary.max = values.back();
  return summary;
}

PolicyReport make_policy_report(std::string policy, std::size_t requests,
                                const std::vector<ReplayRequestOutcome>& outcomes,
                                std::size_t workers) {
  PolicyReport report;
  report.policy = std::move(policy);
  report.requests = requests;
  report.completed = outcomes.size();
  report.failed = requests - std::min(requests, outcomes.size());
  std::vector<double> ttft;
  std::vector<double> itl;
  std::vector<double> e2e;
  ttft.reserve(outcomes.size());
  e2e.reserve(outcomes.size());
  std::uint64_t prompt_tokens = 0;
  std::uint64_t cached_tokens = 0;
  std::uint64_t output_tokens = 0;
  double first_arrival = outcomes.empty() ? 0 : outcomes.front().stats.arrival_ms;
  double last_completion = 0;
  std::map<WorkerWithDpRank, double> served;
  metrics::HitRateLadder ladder;
  for (const auto& outcome : outcomes) {
    const RequestStats& stats = outcome.stats;
    ladder.record({}, metrics::CacheOutcome::of(stats.prompt_tokens,
                                                outcome.predicted_cached_tokens.value_or(0),
                                                stats.cached_prompt_tokens));
    report.predicted_known = report.predicted_known || outcome.predicted_cached_tokens.has_value();
    ttft.push_back(stats.ttft_ms());
    if (stats.output_tokens > 1) itl.push_back(stats.mean_inter_token_ms());
    e2e.push_back(stats.completion_ms - stats.arrival_ms);
    prompt_tokens += stats.prompt_tokens;
    cached_tokens += stats.cached_prompt_tokens;
    output_tokens += stats.output_tokens;
    first_arrival = std::min(first_arrival, stats.arrival_ms);
    last_completion = std::max(last_completion, stats.completion_ms);
    served[outcome.worker] += static_cast<double>(stats.prompt_tokens + stats.output_tokens);
  }
  report.hit_rate = prompt_tokens == 0
                        ? 0
                        : static_cast<double>(cached_tokens) / static_cast<double>(prompt_tokens);
  report.cache_outcomes = ladder.model({});
  report.ttft_ms = summarize(std::move(ttft));
  report.itl_ms = summarize(std::move(itl));
  report.e2e_ms = summarize(std::move(e2e));
  report.makespan_s = std::max(0.0, last_completion - first_arrival) / 1000.0;
  if (report.makespan_s > 0) {
    report.output_tokens_per_s = static_cast<double>(output_tokens) / report.makespan_s;
    report.requests_per_s = static_cast<double>(outcomes.size()) / report.makespan_s;
  }
  if (workers > 0 && !served.empty()) {
    double total = 0;
    double largest = 0;
    for (const auto& [worker, tokens] : served) {
      total += tokens;
      largest = std::max(largest, tokens);
    }
    const double mean = total / static_cast<double>(workers);
    report.load_imbalance = mean > 0 ? largest / mean : 0;
  }
  return report;
}

TtftCalibrationReport make_calibration_report(
    const std::vector<std::pair<double, double>>& predicted_observed_ms,
    std::vector<std::pair<std::string, double>> learnt) {
  TtftCalibrationReport report;
  report.predictions = predicted_observed_ms.size();
  report.learnt = std::move(learnt);
  if (predicted_observed_ms.empty()) return report;
  std::vector<double> relative;
  std::vector<double> absolute;
  relative.reserve(predicted_observed_ms.size());
  absolute.reserve(predicted_observed_ms.size());
  for (const auto& [predicted, observed] : predicted_observed_ms) {
    report.mean_predicted_ms += predicted;
    report.mean_observed_ms += observed;
    absolute.push_back(std::abs(predicted - observed));
    relative.push_back(absolute.back() / std::max(observed, 1e-3));
  }
  const auto count = static_cast<double>(predicted_observed_ms.size());
  report.mean_predicted_ms /= count;
  report.mean_observed_ms /= count;
  report.median_relative_error = summarize(std::move(relative)).p50;
  report.median_absolute_error_ms = summarize(std::move(absolute)).p50;
  return report;
}

std::string format_table(const ReplayReport& report) {
  std::string table = fmt::format(
      "trace {}: {} requests, {} workers, speedup {}, block size {}; infinite-cache hit rate "
      "{:.3f}\n",
      report.trace, report.requests, report.workers, report.speedup, report.block_size,
      report.infinite_cache_hit_rate);
  // The same widths as the rows below, so that every value sits under its header.
  table += fmt::format(
      "{:<26} {:>11} {:>6} {:>10} {:>9} {:>9} {:>9} {:>7} {:>9} {:>9} {:>9} {:>6} {:>5}\n",
      "policy", "completed", "hit", "ttft mean", "ttft p50", "ttft p90", "ttft p99", "itl",
      "e2e p50", "e2e p99", "out tok/s", "imbal", "busy");
  for (const PolicyReport& policy : report.policies) {
    table += fmt::format(
        "{:<26} {:>11} {:>6.3f} {:>10.1f} {:>9.1f} {:>9.1f} {:>9.1f} {:>7.2f} {:>9.1f} {:>9.1f} "
        "{:>9.0f} {:>6.2f} {:>5.2f}\n",
        policy.policy, fmt::format("{}/{}", policy.completed, policy.requests), policy.hit_rate,
        policy.ttft_ms.mean, policy.ttft_ms.p50, policy.ttft_ms.p90, policy.ttft_ms.p99,
        policy.itl_ms.mean, policy.e2e_ms.p50, policy.e2e_ms.p99, policy.output_tokens_per_s,
        policy.load_imbalance, policy.utilization);
  }
  table +=
      "(latencies in ms of simulated time; hit = prompt tokens served from cache / prompt "
      "tokens; imbal = max/mean tokens served per worker; busy = share of time workers ran "
      "steps)\n";
  table += format_hit_rate_ladder(report);
  for (const PolicyReport& policy : report.policies) {
    if (!policy.ttft_calibration) continue;
    const TtftCalibrationReport& calibration = *policy.ttft_calibration;
    std::string learnt;
    for (const auto& [name, value] : calibration.learnt) {
      learnt += fmt::format("{}{} {:.3g}", learnt.empty() ? "" : ", ", name, value);
    }
    table += fmt::format(
        "{} calibration: {} predictions, mean predicted {:.1f} ms vs observed {:.1f} ms, median "
        "error {:.1f} ms ({:.0f}%); learnt: {}\n",
        policy.policy, calibration.predictions, calibration.mean_predicted_ms,
        calibration.mean_observed_ms, calibration.median_absolute_error_ms,
        100 * calibration.median_relative_error, learnt);
  }
  for (const PolicyReport& policy : report.policies) {
    if (policy.disaggregation.empty()) continue;
    table +=
        fmt::format("{} disaggregation: {}\n", policy.policy, counts_text(policy.disaggregation));
  }
  for (const PolicyReport& policy : report.policies) {
    if (policy.shard_requests.empty()) continue;
    std::string shards;
    for (std::size_t shard = 0; shard < policy.shard_requests.size(); ++shard) {
      shards += fmt::format("{}{} {}", shard == 0 ? "" : ", ", shard, policy.shard_requests[shard]);
    }
    table += fmt::format("{} shards: {}; spilled {} ({:.1f}%)\n", policy.policy, shards,
                         policy.shard_spills,
                         100.0 * static_cast<double>(policy.shard_spills) /
                             static_cast<double>(std::max<std::size_t>(1, policy.requests)));
  }
  // Only runs with admission or tenants have these, so other tables stay as they were.
  const bool any_rejected = std::ranges::any_of(
      report.policies, [](const PolicyReport& policy) { return !policy.rejected.empty(); });
  if (any_rejected) {
    table += "rejected by admission or the queue (answered, not failed):\n";
    for (const PolicyReport& policy : report.policies) {
      table += fmt::format("  {:<26} {} ({})\n", policy.policy, total(policy.rejected),
                           counts_text(policy.rejected));
    }
  }
  const bool any_tenants = std::ranges::any_of(
      report.policies, [](const PolicyReport& policy) { return !policy.tenants.empty(); });
  if (any_tenants) {
    table += fmt::format("{:<26} {:<12} {:>9} {:>9} {:>9} {:>9} {:>9}  {}\n", "policy", "tenant",
                         "requests", "completed", "rejected", "ttft p50", "ttft p99",
                         "rejected by code");
    for (const PolicyReport& policy : report.policies) {
      for (const TenantReport& tenant : policy.tenants) {
        std::string row =
            fmt::format("{:<26} {:<12} {:>9} {:>9} {:>9} {:>9.1f} {:>9.1f}", policy.policy,
                        tenant.tenant, tenant.requests, tenant.completed, total(tenant.rejected),
                        tenant.ttft_ms.p50, tenant.ttft_ms.p99);
        if (!tenant.rejected.empty()) row += "  " + counts_text(tenant.rejected);
        table += row + "\n";
      }
    }
  }
  return table;
}

std::string to_json(const ReplayReport& report) {
  nlohmann::ordered_json policies = nlohmann::ordered_json::array();
  for (const PolicyReport& policy : report.policies) {
    nlohmann::ordered_json entry;
    entry["completed"] = policy.completed;
    if (!policy.disaggregation.empty()) {
      entry["disaggregation"] = counts_json(policy.disaggregation);
    }
    entry["e2e_ms"] = latency_json(policy.e2e_ms);
    entry["failed"] = policy.failed;
    entry["failures"] = counts_json(policy.failures);
    if (policy.front_door_added_ms) {
      entry["front_door_added_ms"] = latency_json(*policy.front_door_added_ms);
    }
    entry["hit_rate"] = rounded(policy.hit_rate);
    entry["hit_rate_ladder"] = ladder_json(policy);
    entry["itl_ms"] = latency_json(policy.itl_ms);
    entry["load_imbalance"] = rounded(policy.load_imbalance);
    entry["makespan_s"] = rounded(policy.makespan_s);
    entry["output_tokens_per_s"] = rounded(policy.output_tokens_per_s);
    entry["policy"] = policy.policy;
    entry["rejected"] = counts_json(policy.rejected);
    entry["requests"] = policy.requests;
    entry["requests_per_s"] = rounded(policy.requests_per_s);
    if (!policy.shard_requests.empty()) {
      entry["shards"] = {{"requests", policy.shard_requests}, {"spilled", policy.shard_spills}};
    }
    nlohmann::ordered_json tenants = nlohmann::ordered_json::array();
    for (const TenantReport& tenant : policy.tenants) {
      nlohmann::ordered_json tenant_entry;
      tenant_entry["completed"] = tenant.completed;
      tenant_entry["rejected"] = counts_json(tenant.rejected);
      tenant_entry["requests"] = tenant.requests;
      tenant_entry["tenant"] = tenant.tenant;
      tenant_entry["ttft_ms"] = latency_json(tenant.ttft_ms);
      tenants.push_back(std::move(tenant_entry));
    }
    entry["tenants"] = std::move(tenants);
    if (policy.ttft_calibration) {
      const TtftCalibrationReport& calibration = *policy.ttft_calibration;
      nlohmann::ordered_json learnt = nlohmann::ordered_json::object();
      for (const auto& [name, value] : calibration.learnt) learnt[name] = rounded(value);
      nlohmann::ordered_json calibration_json;
      calibration_json["learnt"] = std::move(learnt);
      calibration_json["mean_observed_ms"] = rounded(calibration.mean_observed_ms);
      calibration_json["mean_predicted_ms"] = rounded(calibration.mean_predicted_ms);
      calibration_json["median_absolute_error_ms"] = rounded(calibration.median_absolute_error_ms);
      calibration_json["median_relative_error"] = rounded(calibration.median_relative_error);
      calibration_json["predictions"] = calibration.predictions;
      entry["ttft_calibration"] = std::move(calibration_json);
    }
    entry["ttft_ms"] = latency_json(policy.ttft_ms);
    entry["utilization"] = rounded(policy.utilization);
    policies.push_back(std::move(entry));
  }
  // Keys in sorted order: "policies" comes between "model" and "requests".
  nlohmann::ordered_json json;
  json["block_size"] = report.block_size;
  json["capacity_bound_hit_rate"] = rate_json(report.block_size != 0 && report.fleet_kv_blocks != 0,
                                              report.capacity_bound_hit_rate);
  json["fleet_kv_blocks"] = report.fleet_kv_blocks;
  json["infinite_cache_hit_rate"] = rounded(report.infinite_cache_hit_rate);
  json["model"] = report.model;
  json["policies"] = std::move(policies);
  json["requests"] = report.requests;
  json["seed"] = report.seed;
  json["speedup"] = rounded(report.speedup);
  json["trace"] = report.trace;
  json["workers"] = report.workers;
  return json.dump(2) + "\n";
}

}  // namespace kvr::simulation
