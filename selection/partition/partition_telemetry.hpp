// A partition's metrics and log lines: what the partition core's events and gauges become in a
// router node (kvr_* series labelled with the partition, rate-limited warnings). Plain C++; the
// selector actor owns one next to its PartitionRouter. Single-threaded.
#pragma once

#include <array>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "messages/metrics/metrics_registry.hpp"
#include "messages/metrics/node_metrics.hpp"
#include "messages/metrics/rate_limited_log.hpp"
#include "selection/partition/partition_router.hpp"

namespace kvr {

/// Writes one partition's events and gauges.
class PartitionTelemetry {
 public:
  /// Resolves the partition's series once; `router` gives the label, affinity and queue classes.
  PartitionTelemetry(const PartitionRouter& router,
                     std::shared_ptr<metrics::MetricsRegistry> metrics,
                     std::shared_ptr<metrics::RateLimitedLog> log);

  /// Counts and logs what an input's effects report (events, dump requests).
  void record(const PartitionEffects& effects) const;
  /// Sets the partition's gauges from the core's current state.
  void write_gauges(const PartitionRouter& router) const;
  /// The policies' learnt values as gauges (only policies with observers have any), at most once
  /// a second: it resolves a series per value (one per worker), so the owner calls it on its tick,
  /// never per request.
  void write_learnt_values(const PartitionRouter& router, TimePoint now) const;
  /// Cluster mode: a retired partition holds nothing here any more.
  void zero_gauges() const;

 private:
  struct Writer;

  std::string partition_;
  std::shared_ptr<metrics::MetricsRegistry> registry_;
  std::shared_ptr<metrics::RateLimitedLog> log_;
  metrics::ValueHandle bookings_open_;
  metrics::ValueHandle booked_blocks_;
  metrics::ValueHandle workers_;
  metrics::ValueHandle index_blocks_;
  metrics::ValueHandle session_bindings_;
  metrics::HistogramHandle selection_latency_;
  metrics::HistogramHandle predicted_ttft_;
  metrics::HistogramHandle observed_ttft_;
  metrics::ValueHandle worker_ejections_;
  metrics::ValueHandle workers_ejected_;
  metrics::ValueHandle kv_dump_requests_;
  /// By FailureCause.
  std::array<metrics::ValueHandle, kFailureCauses> worker_failures_;
  /// Resolved at a partition's first decision of each reason: aggregated partitions have none.
  mutable std::array<std::optional<metrics::ValueHandle>, kDisaggregationReasons>
      disaggregation_decisions_;
  /// The hit-rate ceilings, when the partition measures them.
  metrics::ValueHandle routed_prompt_tokens_;
  metrics::ValueHandle workload_cached_tokens_;
  metrics::ValueHandle capacity_cached_tokens_;
  /// When the learnt values were last written; empty: never.
  mutable std::optional<TimePoint> learnt_written_at_;
  /// Per policy class (in queue order), when the queue runs.
  std::vector<metrics::ValueHandle> queue_depth_;
};

}  // namespace kvr
