#include "messages/metrics/node_metrics.hpp"

#include <array>
#include <string>
#include <vector>

#include "messages/metrics/hit_rate_ladder.hpp"

namespace kvr::metrics {
namespace {

using N = NodeMetrics;

// Selection takes microseconds, a route through the node tens of them.
constexpr auto kLatencyBuckets = std::to_array<double>(
    {0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1});

// A queued request waits from a few milliseconds (a burst) to its wait limit (seconds).
constexpr auto kQueueWaitBuckets =
    std::to_array<double>({0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30});

// Times to first token, from a cached short prompt (milliseconds) to a long queue (seconds).
constexpr auto kTtftBuckets =
    std::to_array<double>({0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30});

constexpr auto kFamilies = std::to_array<NodeMetricFamily>({
    {N::kRouteRequests,
     MetricType::Counter,
     "Route requests received, by ingress (nats, actor).",
     {}},
    {N::kRouteDecisions,
     MetricType::Counter,
     "Successful route decisions delivered, by chosen worker.",
     {}},
    {N::kRouteQueries,
     MetricType::Counter,
     "Query-only route requests answered with a decision; nothing was booked.",
     {}},
    {N::kRouteErrors,
     MetricType::Counter,
     "Route requests answered with an error, by error code.",
     {}},
    {N::kSelectionLatency, MetricType::Histogram,
     "Time a selector spends selecting and booking one request.", kLatencyBuckets},
    {N::kRouteLatency, MetricType::Histogram,
     "Time from receiving a route request to answering it.", kLatencyBuckets},
    {N::kBookingsOpen, MetricType::Gauge, "Bookings held in predicted load, by partition.", {}},
    {N::kBookedBlocks,
     MetricType::Gauge,
     "Prompt blocks over the open bookings, by partition (the booked-blocks caps count them).",
     {}},
    {N::kPolicyBuildFailures,
     MetricType::Counter,
     "Worker-selection policies whose factory threw or returned an unusable policy, by partition "
     "and role; the role's requests fail with ROUTE_ERROR_POLICY_FAILED.",
     {}},
    {N::kClassifierFaults,
     MetricType::Counter,
     "Faults of a model's request classifier, by model and stage: build (the factory threw or "
     "returned none; the model's requests fail with ROUTE_ERROR_POLICY_FAILED), event or "
     "fleet_load (the hook threw; the event is lost).",
     {}},
    {N::kBookingCapRefusals,
     MetricType::Counter,
     "Routes refused (overloaded) by a cap on open bookings or booked blocks, by scope (node, "
     "partition) and cap (bookings, blocks).",
     {}},
    {N::kRouteBookingsOpen,
     MetricType::Gauge,
     "Route-mode bookings in the reservation ledger.",
     {}},
    {N::kRouteBookingsExpired,
     MetricType::Counter,
     "Route-mode bookings ended by expiry (never reported).",
     {}},
    {N::kBookingsRolledBack,
     MetricType::Counter,
     "Bookings released because their decision could not be delivered.",
     {}},
    {N::kLifecycleReports,
     MetricType::Counter,
     "Lifecycle reports, by event and whether a booking accepted them.",
     {}},
    {N::kLifecycleReportsAfterEnd,
     MetricType::Counter,
     "Lifecycle reports acknowledged without effect, by event: a report sent again, or a first "
     "token its booking's completion overtook.",
     {}},
    {N::kBadMessages,
     MetricType::Counter,
     "Network messages dropped as malformed or absurd, by subscribed subject.",
     {}},
    {N::kWorkerMessagesRefused,
     MetricType::Counter,
     "Decoded worker messages a partition refused, by partition and kind.",
     {}},
    {N::kIndexBlocks, MetricType::Gauge, "Distinct blocks in the partition's KV index.", {}},
    {N::kWorkers, MetricType::Gauge, "Registered workers, by partition.", {}},
    {N::kWorkerFailures,
     MetricType::Counter,
     "Request failures reported against a partition's workers, by cause.",
     {}},
    {N::kWorkerEjections,
     MetricType::Counter,
     "Workers ejected from routing after consecutive failures.",
     {}},
    {N::kWorkersEjected, MetricType::Gauge, "Workers ejected from routing now.", {}},
    {N::kWorkersExpired,
     MetricType::Counter,
     "Workers removed because their heartbeats stopped.",
     {}},
    {N::kWorkerExpiriesSuppressed,
     MetricType::Counter,
     "Workers' liveness that ran out while the node's own NATS connection was down, held instead "
     "of "
     "expired (counted at the reconnect), by partition.",
     {}},
    {N::kWorkerLivenessGrants,
     MetricType::Counter,
     "Workers' liveness renewed to one TTL from a NATS reconnect (grace periods), by partition.",
     {}},
    {N::kKvEventGaps, MetricType::Counter, "KV event batches that skipped event ids.", {}},
    {N::kKvDumpRequests,
     MetricType::Counter,
     "KV dumps asked of workers after event-id gaps or a NATS reconnect.",
     {}},
    {N::kDiscoveryRequests, MetricType::Counter, "Requests to every worker to register again.", {}},
    {N::kNatsReconnects, MetricType::Counter, "Successful NATS reconnects.", {}},
    {N::kPeerHandshakesRefused,
     MetricType::Counter,
     "Handshakes the actor and cluster ports refused: garbage, a plaintext peer on a TLS port, "
     "a certificate of another CA, a frame over the limit, a connection closed mid-handshake.",
     {}},
    {N::kPeerFramesRefused,
     MetricType::Counter,
     "Frames over their limit on a plaintext peer port (64 KiB until the handshake, then "
     "--peer-max-message-bytes); each closed its connection before it was allocated.",
     {}},
    {N::kNatsConnected, MetricType::Gauge, "1 while connected to NATS.", {}},
    {N::kNatsDropped,
     MetricType::Counter,
     "Messages dropped by the NATS client for a subscription that fell behind, by subject.",
     {}},
    {N::kGenerateRequests, MetricType::Counter, "Generate requests received, by ingress.", {}},
    {N::kGenerateOutcomes,
     MetricType::Counter,
     "Generate requests ended, by outcome (completed, error, cancelled).",
     {}},
    {N::kGenerateRetries,
     MetricType::Counter,
     "Generate requests retried on another worker after a failure before the first token.",
     {}},
    {N::kGenerateFirstTokenTimeouts,
     MetricType::Counter,
     "Generate attempts that produced no first chunk in time.",
     {}},
    {N::kGenerateStreamStalls,
     MetricType::Counter,
     "Generate streams ended because their worker sent no chunk for the stall timeout.",
     {}},
    {N::kGenerateNatsLosses,
     MetricType::Counter,
     "Generate requests ended because the node lost its NATS connection mid-request.",
     {}},
    {N::kGenerateStaleChunks,
     MetricType::Counter,
     "Worker chunks for requests that ended or moved to another worker.",
     {}},
    {N::kGenerateInFlight, MetricType::Gauge, "Generate requests being served by this node.", {}},
    {N::kPromptTokens,
     MetricType::Counter,
     "Prompt tokens of the requests whose engine reported its cached tokens, by model.",
     {}},
    {N::kPredictedCachedTokens,
     MetricType::Counter,
     "Prompt tokens the router predicted cached (its overlap at routing time), of the same "
     "requests, by model.",
     {}},
    {N::kEngineCachedTokens,
     MetricType::Counter,
     "Prompt tokens the engines reported served from their cache, of the same requests, by model.",
     {}},
    {N::kCachedTokensDifference, MetricType::Histogram,
     "Per request, engine-reported minus router-predicted cached prompt tokens, by model.",
     kCachedTokensDifferenceBuckets},
    {N::kRoutedPromptTokens,
     MetricType::Counter,
     "Prompt tokens of every request routed with token ids, by model: the hit-rate ceilings' "
     "denominator.",
     {}},
    {N::kCeilingCachedTokens,
     MetricType::Counter,
     "Prompt tokens of the same requests that one cache would have held, by model and ceiling: "
     "workload (one cache of --hit-rate-workload-tokens or the fleet's KV, if larger) or "
     "capacity (one LRU cache of the fleet's KV blocks).",
     {}},
    {N::kSessionBindings, MetricType::Gauge, "Session-affinity bindings, by partition.", {}},
    {N::kSessionRebinds,
     MetricType::Counter,
     "Soft session bindings moved to another worker, by partition.",
     {}},
    {N::kAdmissionDecisions,
     MetricType::Counter,
     "Request-classifier decisions, by decision (admitted, deferred, rejected) and reason.",
     {}},
    {N::kQueueDepth,
     MetricType::Gauge,
     "Requests waiting in the queue, by partition and class.",
     {}},
    {N::kQueueOutcomes,
     MetricType::Counter,
     "Requests that left or were refused by the queue, by partition, class and outcome.",
     {}},
    {N::kDisaggregationDecisions,
     MetricType::Counter,
     "Generate requests of models served by prefill and decode workers, by partition and what "
     "the router decided: disaggregated (the prefill hop, then decode), short_prompt, "
     "prefill_queue or no_prefill_worker (decode alone).",
     {}},
    {N::kShardRoutes,
     MetricType::Counter,
     "Requests of sharded partitions this node sent to a shard, by partition, shard and outcome: "
     "home (the shard of the prompt's prefix) or spilled (another shard, the faster way).",
     {}},
    {N::kWorkerMessagesDecoded,
     MetricType::Counter,
     "Worker load reports and KV event batches this node decoded, by the partition or shard it "
     "follows them for (previous_subjects: the previous release's shared subjects) and kind.",
     {}},
    {N::kKvBlocksDecoded,
     MetricType::Counter,
     "KV blocks stored or removed in the event batches this node decoded, by partition or shard.",
     {}},
    {N::kShardLoadShare,
     MetricType::Gauge,
     "A shard's part of its partition's load (queued prefill and held KV tokens), as its owner "
     "last published it, by partition and shard.",
     {}},
    {N::kPrefillHop, MetricType::Histogram,
     "Time from routing a prefill hop to its worker's answer carrying the KV transfer "
     "parameters, by model.",
     kTtftBuckets},
    {N::kDecodeHandoff, MetricType::Histogram,
     "Time the node takes from a prefill hop's answer to dispatching the decode hop (routing "
     "the decode worker included).",
     kLatencyBuckets},
    {N::kPolicyPredictedTtft, MetricType::Histogram,
     "Time to first token a learning policy predicted for the requests it routed, by partition.",
     kTtftBuckets},
    {N::kPolicyObservedTtft, MetricType::Histogram,
     "Time to first token observed for the same requests, by partition.", kTtftBuckets},
    {N::kPolicyLearntValue,
     MetricType::Gauge,
     "A value a learning policy has learnt online (a rate, a per-worker factor), by partition, "
     "role, name and worker (empty: the whole partition).",
     {}},
    {N::kQueueWait, MetricType::Histogram,
     "Time a dispatched request waited in its queue, by policy class.", kQueueWaitBuckets},
    {N::kClusterOwnedPartitions,
     MetricType::Gauge,
     "Partitions this node owns (cluster mode).",
     {}},
    {N::kClusterMembers, MetricType::Gauge, "Live cluster members, this node included.", {}},
    {N::kClusterPartitionOwned,
     MetricType::Gauge,
     "1 while this node owns the partition (its lease held and renewed in time), else 0.",
     {}},
    {N::kClusterRenewFailures,
     MetricType::Counter,
     "Partition lease renewals that failed (the partition is lost at once).",
     {}},
    {N::kClusterHandovers,
     MetricType::Counter,
     "Partition leases this node handed to their desired owner or gave back.",
     {}},
    {N::kClusterForwards,
     MetricType::Counter,
     "Requests forwarded to the node that owns their partition or lease, by kind and outcome.",
     {}},
    {N::kClusterForwardLatency, MetricType::Histogram,
     "Time from forwarding a request to its owner's answer.", kLatencyBuckets},
});

Labels one_label(std::string_view label, std::string_view value) {
  if (label.empty()) return {};
  return {{std::string{label}, std::string{value}}};
}

}  // namespace

std::span<const NodeMetricFamily> NodeMetrics::families() { return kFamilies; }

void NodeMetrics::describe(MetricsRegistry& registry) {
  for (const NodeMetricFamily& family : kFamilies) {
    registry.describe(std::string{family.name}, family.type, std::string{family.help},
                      std::vector<double>(family.buckets.begin(), family.buckets.end()));
  }
  NodeMetrics metrics{registry};
  metrics.route_bookings_open().set(0);
  metrics.nats_reconnects().add(0);
  for (const std::string_view scope : {"node", "partition", "client"}) {
    for (const std::string_view cap : {"bookings", "blocks"}) {
      metrics.booking_cap_refusals(scope, cap).add(0);
    }
  }
}

ValueHandle NodeMetrics::counter(std::string_view name, std::string_view label,
                                 std::string_view value) const {
  return registry_->counter(name, one_label(label, value));
}

ValueHandle NodeMetrics::gauge(std::string_view name, std::string_view label,
                               std::string_view value) const {
  return registry_->gauge(name, one_label(label, value));
}

ValueHandle NodeMetrics::route_requests(std::string_view ingress) const {
  return counter(kRouteRequests, "ingress", ingress);
}
ValueHandle NodeMetrics::route_decisions(WorkerId worker) const {
  return counter(kRouteDecisions, "worker", std::to_string(worker));
}
ValueHandle NodeMetrics::route_errors(Error code) const {
  return counter(kRouteErrors, "code", as_str(code));
}
HistogramHandle NodeMetrics::route_latency() const { return registry_->histogram(kRouteLatency); }
ValueHandle NodeMetrics::route_queries() const { return counter(kRouteQueries); }
ValueHandle NodeMetrics::route_bookings_open() const { return gauge(kRouteBookingsOpen); }
ValueHandle NodeMetrics::route_bookings_expired() const { return counter(kRouteBookingsExpired); }
ValueHandle NodeMetrics::bookings_rolled_back() const { return counter(kBookingsRolledBack); }
ValueHandle NodeMetrics::lifecycle_reports(std::string_view event, bool accepted) const {
  return registry_->counter(kLifecycleReports, {{"event", std::string{event}},
                                                {"accepted", accepted ? "true" : "false"}});
}

ValueHandle NodeMetrics::lifecycle_reports_after_end(std::string_view event) const {
  return counter(kLifecycleReportsAfterEnd, "event", event);
}

HistogramHandle NodeMetrics::selection_latency() const {
  return registry_->histogram(kSelectionLatency);
}
HistogramHandle NodeMetrics::policy_predicted_ttft(std::string_view partition) const {
  return registry_->histogram(kPolicyPredictedTtft, {{"partition", std::string{partition}}});
}
HistogramHandle NodeMetrics::policy_observed_ttft(std::string_view partition) const {
  return registry_->histogram(kPolicyObservedTtft, {{"partition", std::string{partition}}});
}
ValueHandle NodeMetrics::policy_learnt_value(std::string_view partition, std::string_view role,
                                             std::string_view name, std::string_view worker) const {
  return registry_->gauge(kPolicyLearntValue, {{"partition", std::string{partition}},
                                               {"role", std::string{role}},
                                               {"name", std::string{name}},
                                               {"worker", std::string{worker}}});
}
ValueHandle NodeMetrics::bookings_open(std::string_view partition) const {
  return gauge(kBookingsOpen, "partition", partition);
}
ValueHandle NodeMetrics::booked_blocks(std::string_view partition) const {
  return gauge(kBookedBlocks, "partition", partition);
}
ValueHandle NodeMetrics::booking_cap_refusals(std::string_view scope, std::string_view cap) const {
  return registry_->counter(kBookingCapRefusals,
                            {{"scope", std::string{scope}}, {"cap", std::string{cap}}});
}
ValueHandle NodeMetrics::policy_build_failures(std::string_view partition,
                                               std::string_view role) const {
  return registry_->counter(kPolicyBuildFailures,
                            {{"partition", std::string{partition}}, {"role", std::string{role}}});
}
ValueHandle NodeMetrics::classifier_faults(std::string_view model, std::string_view stage) const {
  return registry_->counter(kClassifierFaults,
                            {{"model", std::string{model}}, {"stage", std::string{stage}}});
}
ValueHandle NodeMetrics::workers(std::string_view partition) const {
  return gauge(kWorkers, "partition", partition);
}
ValueHandle NodeMetrics::worker_failures(std::string_view partition, std::string_view cause) const {
  return registry_->counter(kWorkerFailures,
                            {{"partition", std::string{partition}}, {"cause", std::string{cause}}});
}
ValueHandle NodeMetrics::worker_ejections(std::string_view partition) const {
  return counter(kWorkerEjections, "partition", partition);
}
ValueHandle NodeMetrics::workers_ejected(std::string_view partition) const {
  return gauge(kWorkersEjected, "partition", partition);
}
ValueHandle NodeMetrics::workers_expired(std::string_view partition) const {
  return counter(kWorkersExpired, "partition", partition);
}
ValueHandle NodeMetrics::worker_expiries_suppressed(std::string_view partition) const {
  return counter(kWorkerExpiriesSuppressed, "partition", partition);
}
ValueHandle NodeMetrics::worker_liveness_grants(std::string_view partition) const {
  return counter(kWorkerLivenessGrants, "partition", partition);
}
ValueHandle NodeMetrics::worker_messages_refused(std::string_view partition,
                                                 std::string_view kind) const {
  return registry_->counter(kWorkerMessagesRefused,
                            {{"partition", std::string{partition}}, {"kind", std::string{kind}}});
}
ValueHandle NodeMetrics::routed_prompt_tokens(std::string_view model) const {
  return counter(kRoutedPromptTokens, "model", model);
}
ValueHandle NodeMetrics::ceiling_cached_tokens(std::string_view model,
                                               std::string_view ceiling) const {
  return registry_->counter(kCeilingCachedTokens,
                            {{"model", std::string{model}}, {"ceiling", std::string{ceiling}}});
}
ValueHandle NodeMetrics::index_blocks(std::string_view partition) const {
  return gauge(kIndexBlocks, "partition", partition);
}
ValueHandle NodeMetrics::kv_event_gaps(std::string_view partition) const {
  return counter(kKvEventGaps, "partition", partition);
}
ValueHandle NodeMetrics::kv_dump_requests(std::string_view partition) const {
  return counter(kKvDumpRequests, "partition", partition);
}
ValueHandle NodeMetrics::session_bindings(std::string_view partition) const {
  return gauge(kSessionBindings, "partition", partition);
}
ValueHandle NodeMetrics::session_rebinds(std::string_view partition) const {
  return counter(kSessionRebinds, "partition", partition);
}

ValueHandle NodeMetrics::admission_decisions(std::string_view decision,
                                             std::string_view reason) const {
  return registry_->counter(kAdmissionDecisions,
                            {{"decision", std::string{decision}}, {"reason", std::string{reason}}});
}
ValueHandle NodeMetrics::queue_depth(std::string_view partition,
                                     std::string_view policy_class) const {
  return registry_->gauge(
      kQueueDepth, {{"partition", std::string{partition}}, {"class", std::string{policy_class}}});
}
ValueHandle NodeMetrics::queue_outcomes(std::string_view partition, std::string_view policy_class,
                                        std::string_view outcome) const {
  return registry_->counter(kQueueOutcomes, {{"partition", std::string{partition}},
                                             {"class", std::string{policy_class}},
                                             {"outcome", std::string{outcome}}});
}
HistogramHandle NodeMetrics::queue_wait(std::string_view policy_class) const {
  return registry_->histogram(kQueueWait, {{"class", std::string{policy_class}}});
}

ValueHandle NodeMetrics::cluster_owned_partitions() const { return gauge(kClusterOwnedPartitions); }
ValueHandle NodeMetrics::cluster_members() const { return gauge(kClusterMembers); }
ValueHandle NodeMetrics::cluster_partition_owned(std::string_view partition) const {
  return gauge(kClusterPartitionOwned, "partition", partition);
}
ValueHandle NodeMetrics::cluster_renew_failures() const { return counter(kClusterRenewFailures); }
ValueHandle NodeMetrics::cluster_handovers() const { return counter(kClusterHandovers); }
ValueHandle NodeMetrics::cluster_forwards(std::string_view kind, std::string_view outcome) const {
  return registry_->counter(kClusterForwards,
                            {{"kind", std::string{kind}}, {"outcome", std::string{outcome}}});
}
HistogramHandle NodeMetrics::cluster_forward_latency() const {
  return registry_->histogram(kClusterForwardLatency);
}

ValueHandle NodeMetrics::discovery_requests() const { return counter(kDiscoveryRequests); }
ValueHandle NodeMetrics::bad_messages(std::string_view subject) const {
  return counter(kBadMessages, "subject", subject);
}
ValueHandle NodeMetrics::nats_reconnects() const { return counter(kNatsReconnects); }
ValueHandle NodeMetrics::peer_handshakes_refused() const { return counter(kPeerHandshakesRefused); }
ValueHandle NodeMetrics::peer_frames_refused() const { return counter(kPeerFramesRefused); }
ValueHandle NodeMetrics::nats_connected() const { return gauge(kNatsConnected); }
ValueHandle NodeMetrics::nats_dropped(std::string_view subject) const {
  return counter(kNatsDropped, "subject", subject);
}

ValueHandle NodeMetrics::generate_requests(std::string_view ingress) const {
  return counter(kGenerateRequests, "ingress", ingress);
}
ValueHandle NodeMetrics::generate_outcomes(std::string_view outcome) const {
  return counter(kGenerateOutcomes, "outcome", outcome);
}
ValueHandle NodeMetrics::generate_retries() const { return counter(kGenerateRetries); }
ValueHandle NodeMetrics::disaggregation_decisions(std::string_view partition,
                                                  std::string_view reason) const {
  return registry_->counter(kDisaggregationDecisions, {{"partition", std::string{partition}},
                                                       {"reason", std::string{reason}}});
}
ValueHandle NodeMetrics::shard_routes(std::string_view partition, std::uint32_t shard,
                                      std::string_view outcome) const {
  return registry_->counter(kShardRoutes, {{"partition", std::string{partition}},
                                           {"shard", std::to_string(shard)},
                                           {"outcome", std::string{outcome}}});
}
ValueHandle NodeMetrics::worker_messages_decoded(std::string_view partition,
                                                 std::string_view kind) const {
  return registry_->counter(kWorkerMessagesDecoded,
                            {{"partition", std::string{partition}}, {"kind", std::string{kind}}});
}
ValueHandle NodeMetrics::kv_blocks_decoded(std::string_view partition) const {
  return registry_->counter(kKvBlocksDecoded, {{"partition", std::string{partition}}});
}
ValueHandle NodeMetrics::shard_load_share(std::string_view partition, std::uint32_t shard) const {
  return registry_->gauge(
      kShardLoadShare, {{"partition", std::string{partition}}, {"shard", std::to_string(shard)}});
}
HistogramHandle NodeMetrics::prefill_hop(std::string_view model) const {
  return registry_->histogram(kPrefillHop, {{"model", std::string{model}}});
}
HistogramHandle NodeMetrics::decode_handoff() const { return registry_->histogram(kDecodeHandoff); }
ValueHandle NodeMetrics::generate_first_token_timeouts() const {
  return counter(kGenerateFirstTokenTimeouts);
}
ValueHandle NodeMetrics::generate_stream_stalls() const { return counter(kGenerateStreamStalls); }
ValueHandle NodeMetrics::generate_nats_losses() const { return counter(kGenerateNatsLosses); }
ValueHandle NodeMetrics::generate_stale_chunks() const { return counter(kGenerateStaleChunks); }
ValueHandle NodeMetrics::generate_in_flight() const { return gauge(kGenerateInFlight); }

void NodeMetrics::record_cache_outcome(std::string_view model, std::uint64_t prompt_tokens,
                                       std::uint64_t predicted_cached_tokens,
                                       std::uint64_t engine_cached_tokens) const {
  const CacheOutcome outcome =
      CacheOutcome::of(prompt_tokens, predicted_cached_tokens, engine_cached_tokens);
  const Labels labels = one_label("model", model);
  registry_->counter(kPromptTokens, labels).add(static_cast<double>(outcome.prompt_tokens));
  registry_->counter(kPredictedCachedTokens, labels)
      .add(static_cast<double>(outcome.predicted_cached_tokens));
  registry_->counter(kEngineCachedTokens, labels)
      .add(static_cast<double>(outcome.engine_cached_tokens));
  registry_->histogram(kCachedTokensDifference, labels)
      .observe(static_cast<double>(outcome.difference()));
}

}  // namespace kvr::metrics
