#include "selection/partition/partition_telemetry.hpp"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

namespace kvr {

// Counts and logs one event.
struct PartitionTelemetry::Writer {
  const PartitionTelemetry& telemetry;
  const std::string& partition = telemetry.partition_;
  metrics::NodeMetrics metrics{*telemetry.registry_};

  void operator()(const partition_event::WorkerJoined& e) const {
    spdlog::info("kvr node: worker {} {} in partition {}", e.worker,
                 e.restarted ? "restarted" : "joined", partition);
  }
  void operator()(const partition_event::WorkerLeft& e) const {
    if (!e.expired) {
      spdlog::info("kvr node: worker {} left partition {}", e.worker, partition);
      return;
    }
    spdlog::info("kvr node: worker {} expired (no heartbeat) in partition {}", e.worker, partition);
    metrics.workers_expired(partition).add();
  }
  void operator()(const partition_event::WorkerReturned& e) const {
    spdlog::info("kvr node: worker {} returned to routing in partition {} after its ejection",
                 e.worker, partition);
  }
  void operator()(const partition_event::MessageRefused& e) const {
    metrics.worker_messages_refused(partition, e.kind).add();
    telemetry.log_->warn(
        fmt::format("{}:{}", partition, e.kind),
        fmt::format("kvr node: partition {} refused a {}: {}", partition, e.kind, e.reason));
  }
  void operator()(const partition_event::KvEventGap&) const {
    metrics.kv_event_gaps(partition).add();
  }
  void operator()(const partition_event::WorkerFailed& e) const {
    telemetry.worker_failures_[static_cast<std::size_t>(e.cause)].add();
  }
  void operator()(const partition_event::WorkerEjected& e) const {
    telemetry.worker_ejections_.add();
    spdlog::warn(
        "kvr node: worker {} ejected from routing in partition {} for {} ms after {} consecutive "
        "failures (last: {})",
        e.worker, partition, e.backoff.count(), e.consecutive_failures, as_str(e.cause));
  }
  void operator()(const partition_event::EjectionCapped& e) const {
    telemetry.log_->warn(
        fmt::format("{}:ejection-cap", partition),
        fmt::format("kvr node: worker {} keeps failing in partition {} but stays in routing: {} of "
                    "{} workers are ejected already (max_ejection_percent)",
                    e.worker, partition, e.ejected, e.workers));
  }
  void operator()(const partition_event::SessionRebound&) const {
    metrics.session_rebinds(partition).add();
  }
  void operator()(const partition_event::QueueOutcome& e) const {
    metrics.queue_outcomes(partition, e.policy_class, e.outcome).add();
  }
  void operator()(const partition_event::QueueWaited& e) const {
    metrics.queue_wait(e.policy_class).observe(e.seconds);
  }
  void operator()(const partition_event::LinkRestored& e) const {
    metrics.worker_expiries_suppressed(partition).add(static_cast<double>(e.held_over));
    metrics.worker_liveness_grants(partition).add(static_cast<double>(e.renewed));
    if (e.workers == 0) return;
    spdlog::info(
        "kvr node: partition {}: NATS is back; its {} workers were kept through the outage ({} "
        "workers' liveness had run out), every worker's liveness now runs one TTL from the "
        "reconnect, and their KV "
        "state is asked for again",
        partition, e.workers, e.held_over);
  }
  void operator()(const partition_event::SelectionTimed& e) const {
    telemetry.selection_latency_.observe(e.seconds);
  }
  void operator()(const partition_event::TtftPredicted& e) const {
    telemetry.predicted_ttft_.observe(e.predicted_seconds);
    telemetry.observed_ttft_.observe(e.observed_seconds);
  }
  void operator()(const partition_event::DisaggregationDecided& e) const {
    auto& series = telemetry.disaggregation_decisions_[static_cast<std::size_t>(e.reason)];
    if (!series) series = metrics.disaggregation_decisions(partition, as_str(e.reason));
    series->add();
  }
  void operator()(const partition_event::CeilingsRecorded& e) const {
    telemetry.routed_prompt_tokens_.add(static_cast<double>(e.prompt_tokens));
    telemetry.workload_cached_tokens_.add(static_cast<double>(e.workload_cached_tokens));
    telemetry.capacity_cached_tokens_.add(static_cast<double>(e.capacity_cached_tokens));
  }
};

PartitionTelemetry::PartitionTelemetry(const PartitionRouter& router,
                                       std::shared_ptr<metrics::MetricsRegistry> metrics,
                                       std::shared_ptr<metrics::RateLimitedLog> log)
    : partition_(router.label()), registry_(std::move(metrics)), log_(std::move(log)) {
  const metrics::NodeMetrics node{*registry_};
  bookings_open_ = node.bookings_open(partition_);
  booked_blocks_ = node.booked_blocks(partition_);
  workers_ = node.workers(partition_);
  index_blocks_ = node.index_blocks(partition_);
  if (router.affinity().enabled()) session_bindings_ = node.session_bindings(partition_);
  selection_latency_ = node.selection_latency();
  predicted_ttft_ = node.policy_predicted_ttft(partition_);
  observed_ttft_ = node.policy_observed_ttft(partition_);
  worker_ejections_ = node.worker_ejections(partition_);
  workers_ejected_ = node.workers_ejected(partition_);
  kv_dump_requests_ = node.kv_dump_requests(partition_);
  for (std::size_t cause = 0; cause < kFailureCauses; ++cause) {
    worker_failures_[cause] =
        node.worker_failures(partition_, as_str(static_cast<FailureCause>(cause)));
  }
  if (router.ceilings() != nullptr) {
    const std::string& model = router.options().options.partition.model;
    routed_prompt_tokens_ = node.routed_prompt_tokens(model);
    workload_cached_tokens_ = node.ceiling_cached_tokens(model, "workload");
    capacity_cached_tokens_ = node.ceiling_cached_tokens(model, "capacity");
  }
  if (router.queues()) {
    for (const auto& policy_class : router.options().policy_classes) {
      queue_depth_.push_back(node.queue_depth(partition_, policy_class.name));
    }
  }
}

void PartitionTelemetry::record(const PartitionEffects& effects) const {
  for (std::size_t i = 0; i < effects.dumps.size(); ++i) kv_dump_requests_.add();
  if (effects.events.empty()) return;
  const Writer writer{*this};
  for (const PartitionEvent& event : effects.events) std::visit(writer, event);
}

void PartitionTelemetry::write_gauges(const PartitionRouter& router) const {
  const PartitionGauges gauges = router.gauges();
  bookings_open_.set(static_cast<double>(gauges.bookings_open));
  booked_blocks_.set(static_cast<double>(gauges.booked_blocks));
  workers_.set(static_cast<double>(gauges.workers));
  index_blocks_.set(static_cast<double>(gauges.index_blocks));
  if (router.affinity().enabled()) {
    session_bindings_.set(static_cast<double>(gauges.session_bindings));
  }
  workers_ejected_.set(static_cast<double>(gauges.workers_ejected));
  if (queue_depth_.empty()) return;
  const auto depths = router.queue_depths();
  for (std::size_t i = 0; i < depths.size() && i < queue_depth_.size(); ++i) {
    queue_depth_[i].set(static_cast<double>(depths[i].requests));
  }
}

void PartitionTelemetry::write_learnt_values(const PartitionRouter& router, TimePoint now) const {
  if (learnt_written_at_ && now - *learnt_written_at_ < std::chrono::seconds{1}) return;
  learnt_written_at_ = now;
  const auto values = router.state().learnt_values();
  if (values.empty()) return;
  const metrics::NodeMetrics node{*registry_};
  for (const auto& [role, value] : values) {
    const std::string worker = value.worker ? std::to_string(*value.worker) : std::string{};
    node.policy_learnt_value(partition_, as_str(role), value.name, worker).set(value.value);
  }
}

void PartitionTelemetry::zero_gauges() const {
  for (const auto* gauge :
       {&bookings_open_, &booked_blocks_, &workers_, &index_blocks_, &workers_ejected_}) {
    gauge->set(0);
  }
}

}  // namespace kvr
