// The router node's metrics in one place: every family's name, type and help text, and the series
// the node's parts (its actors, the NATS bridge) write, resolved from a MetricsRegistry. Plain
// C++, no CAF. Tests, the docs and dashboards read these names: they never change.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "messages/error.hpp"
#include "messages/ids.hpp"
#include "messages/metrics/metrics_registry.hpp"

namespace kvr::metrics {

/// One metric family of a node, as /metrics declares it.
struct NodeMetricFamily {
  std::string_view name;
  MetricType type = MetricType::Counter;
  std::string_view help;
  /// Ascending upper bounds; histograms only.
  std::span<const double> buckets;
};

/// A node's metric families and its series, resolved from a registry. A view: cheap to copy,
/// valid while the registry lives. Each accessor finds (or creates) its series under the
/// registry's lock: a hot path resolves its series once and keeps the handle; a rare event
/// resolves it when it happens, so that a series shows once it has happened at least once.
class NodeMetrics {
 public:
  // ---- family names ----------------------------------------------------------------------------
  // Route mode.
  static constexpr std::string_view kRouteRequests = "kvr_route_requests_total";
  static constexpr std::string_view kRouteDecisions = "kvr_route_decisions_total";
  static constexpr std::string_view kRouteQueries = "kvr_route_queries_total";
  static constexpr std::string_view kRouteErrors = "kvr_route_errors_total";
  static constexpr std::string_view kRouteLatency = "kvr_route_latency_seconds";
  static constexpr std::string_view kRouteBookingsOpen = "kvr_route_bookings_open";
  static constexpr std::string_view kRouteBookingsExpired = "kvr_route_bookings_expired_total";
  static constexpr std::string_view kBookingsRolledBack = "kvr_bookings_rolled_back_total";
  static constexpr std::string_view kLifecycleReports = "kvr_lifecycle_reports_total";
  static constexpr std::string_view kLifecycleReportsAfterEnd =
      "kvr_lifecycle_reports_after_end_total";
  // Partitions (the selectors).
  static constexpr std::string_view kSelectionLatency = "kvr_selection_latency_seconds";
  static constexpr std::string_view kBookingsOpen = "kvr_bookings_open";
  static constexpr std::string_view kBookedBlocks = "kvr_booked_blocks";
  static constexpr std::string_view kBookingCapRefusals = "kvr_booking_cap_refusals_total";
  static constexpr std::string_view kPolicyBuildFailures = "kvr_policy_build_failures_total";
  static constexpr std::string_view kClassifierFaults = "kvr_classifier_faults_total";
  static constexpr std::string_view kWorkers = "kvr_workers";
  static constexpr std::string_view kWorkersExpired = "kvr_workers_expired_total";
  static constexpr std::string_view kWorkerExpiriesSuppressed =
      "kvr_worker_expiries_suppressed_total";
  static constexpr std::string_view kWorkerLivenessGrants = "kvr_worker_liveness_grants_total";
  static constexpr std::string_view kWorkerMessagesRefused = "kvr_worker_messages_refused_total";
  static constexpr std::string_view kIndexBlocks = "kvr_index_blocks";
  static constexpr std::string_view kKvEventGaps = "kvr_kv_event_gaps_total";
  static constexpr std::string_view kKvDumpRequests = "kvr_kv_dump_requests_total";
  static constexpr std::string_view kSessionBindings = "kvr_session_bindings";
  static constexpr std::string_view kSessionRebinds = "kvr_session_rebinds_total";
  static constexpr std::string_view kWorkerFailures = "kvr_worker_failures_total";
  static constexpr std::string_view kWorkerEjections = "kvr_worker_ejections_total";
  static constexpr std::string_view kWorkersEjected = "kvr_workers_ejected";
  // Admission: the classifier and the policy-class queues.
  static constexpr std::string_view kAdmissionDecisions = "kvr_admission_decisions_total";
  static constexpr std::string_view kQueueDepth = "kvr_queue_depth";
  static constexpr std::string_view kQueueOutcomes = "kvr_queue_outcomes_total";
  static constexpr std::string_view kQueueWait = "kvr_queue_wait_seconds";
  // A learning policy's calibration (its observers).
  static constexpr std::string_view kPolicyPredictedTtft = "kvr_policy_predicted_ttft_seconds";
  static constexpr std::string_view kPolicyObservedTtft = "kvr_policy_observed_ttft_seconds";
  static constexpr std::string_view kPolicyLearntValue = "kvr_policy_learnt_value";
  // Cluster mode.
  static constexpr std::string_view kClusterOwnedPartitions = "kvr_cluster_owned_partitions";
  static constexpr std::string_view kClusterMembers = "kvr_cluster_members";
  static constexpr std::string_view kClusterPartitionOwned = "kvr_cluster_partition_owned";
  static constexpr std::string_view kClusterRenewFailures =
      "kvr_cluster_lease_renew_failures_total";
  static constexpr std::string_view kClusterHandovers = "kvr_cluster_handovers_total";
  static constexpr std::string_view kClusterForwards = "kvr_cluster_forwards_total";
  static constexpr std::string_view kClusterForwardLatency = "kvr_cluster_forward_latency_seconds";
  // Discovery and NATS.
  static constexpr std::string_view kDiscoveryRequests = "kvr_discovery_requests_total";
  static constexpr std::string_view kBadMessages = "kvr_bad_messages_total";
  static constexpr std::string_view kNatsReconnects = "kvr_nats_reconnects_total";
  static constexpr std::string_view kPeerHandshakesRefused = "kvr_peer_handshakes_refused_total";
  static constexpr std::string_view kPeerFramesRefused = "kvr_peer_frames_refused_total";
  static constexpr std::string_view kNatsConnected = "kvr_nats_connected";
  static constexpr std::string_view kNatsDropped = "kvr_nats_dropped_messages_total";
  // Generate mode.
  static constexpr std::string_view kGenerateRequests = "kvr_generate_requests_total";
  static constexpr std::string_view kGenerateOutcomes = "kvr_generate_outcomes_total";
  static constexpr std::string_view kGenerateRetries = "kvr_generate_retries_total";
  static constexpr std::string_view kGenerateFirstTokenTimeouts =
      "kvr_generate_first_token_timeouts_total";
  static constexpr std::string_view kGenerateStreamStalls = "kvr_generate_stream_stalls_total";
  static constexpr std::string_view kGenerateNatsLosses = "kvr_generate_nats_losses_total";
  static constexpr std::string_view kGenerateStaleChunks = "kvr_generate_stale_chunks_total";
  static constexpr std::string_view kGenerateInFlight = "kvr_generate_in_flight";
  // Disaggregated serving.
  static constexpr std::string_view kDisaggregationDecisions = "kvr_disaggregation_decisions_total";
  static constexpr std::string_view kPrefillHop = "kvr_prefill_hop_seconds";
  // Sharded partitions.
  static constexpr std::string_view kShardRoutes = "kvr_shard_routes_total";
  static constexpr std::string_view kShardLoadShare = "kvr_shard_load_share";
  static constexpr std::string_view kWorkerMessagesDecoded = "kvr_worker_messages_decoded_total";
  static constexpr std::string_view kKvBlocksDecoded = "kvr_kv_blocks_decoded_total";
  static constexpr std::string_view kDecodeHandoff = "kvr_decode_handoff_seconds";
  // The hit-rate ladder (docs/hit-rate.md), per model, from both doors.
  static constexpr std::string_view kPromptTokens = "kvr_prompt_tokens_total";
  static constexpr std::string_view kPredictedCachedTokens = "kvr_predicted_cached_tokens_total";
  static constexpr std::string_view kEngineCachedTokens = "kvr_engine_cached_tokens_total";
  static constexpr std::string_view kCachedTokensDifference = "kvr_cached_tokens_difference";
  static constexpr std::string_view kRoutedPromptTokens = "kvr_routed_prompt_tokens_total";
  static constexpr std::string_view kCeilingCachedTokens = "kvr_ceiling_cached_tokens_total";

  /// Every family of a node, in the order /metrics help was written.
  static std::span<const NodeMetricFamily> families();

  /// Declares every family in `registry` (help text, type, histogram buckets) and the series that
  /// show from the start (kvr_route_bookings_open, kvr_nats_reconnects_total and
  /// kvr_booking_cap_refusals_total at 0).
  static void describe(MetricsRegistry& registry);

  explicit NodeMetrics(MetricsRegistry& registry) : registry_(&registry) {}

  // ---- route mode ------------------------------------------------------------------------------
  /// Route requests received, by ingress ("nats", "actor").
  ValueHandle route_requests(std::string_view ingress) const;
  /// Successful decisions delivered, by chosen worker.
  ValueHandle route_decisions(WorkerId worker) const;
  /// Query-only route requests answered with a decision (nothing booked).
  ValueHandle route_queries() const;
  /// Requests answered with an error, labelled with the error's as_str() ("no_workers").
  ValueHandle route_errors(Error code) const;
  HistogramHandle route_latency() const;
  ValueHandle route_bookings_open() const;
  ValueHandle route_bookings_expired() const;
  ValueHandle bookings_rolled_back() const;
  /// Lifecycle reports by event ("first_token", ...) and whether a booking accepted them.
  ValueHandle lifecycle_reports(std::string_view event, bool accepted) const;
  /// Reports acknowledged without effect: their booking had taken them already, by event.
  ValueHandle lifecycle_reports_after_end(std::string_view event) const;

  // ---- partitions (label `partition`: "model/routing group") ------------------------------------
  HistogramHandle selection_latency() const;
  /// A learning policy's predicted time to first token of each request it predicted, and the
  /// time observed for the same requests, side by side.
  HistogramHandle policy_predicted_ttft(std::string_view partition) const;
  HistogramHandle policy_observed_ttft(std::string_view partition) const;
  /// One value a policy's observer learnt, by role, name and worker ("" for the partition).
  ValueHandle policy_learnt_value(std::string_view partition, std::string_view role,
                                  std::string_view name, std::string_view worker) const;
  ValueHandle bookings_open(std::string_view partition) const;
  /// Prompt blocks over a partition's open bookings (what the booked-blocks caps count).
  ValueHandle booked_blocks(std::string_view partition) const;
  /// Routes refused by a cap on open bookings, by `scope` (node, partition, client) and `cap`
  /// (bookings, blocks).
  ValueHandle booking_cap_refusals(std::string_view scope, std::string_view cap) const;
  /// Worker-selection policies whose factory failed, by partition and role (aggregated, ...).
  ValueHandle policy_build_failures(std::string_view partition, std::string_view role) const;
  /// Faults of a model's request classifier, by `stage`: build (its factory threw or returned
  /// nothing), event (on_event threw), fleet_load (on_fleet_load threw).
  ValueHandle classifier_faults(std::string_view model, std::string_view stage) const;
  ValueHandle workers(std::string_view partition) const;
  ValueHandle workers_expired(std::string_view partition) const;
  /// Workers' liveness that ran out while the node's own NATS connection was down and were held
  /// instead of expired (counted at the reconnect).
  ValueHandle worker_expiries_suppressed(std::string_view partition) const;
  /// Workers' liveness renewed to one TTL from a NATS reconnect: the grace periods granted.
  ValueHandle worker_liveness_grants(std::string_view partition) const;
  /// Worker messages a partition refused, by kind ("registration", "heartbeat", ...).
  ValueHandle worker_messages_refused(std::string_view partition, std::string_view kind) const;
  ValueHandle index_blocks(std::string_view partition) const;
  ValueHandle kv_event_gaps(std::string_view partition) const;
  ValueHandle kv_dump_requests(std::string_view partition) const;
  ValueHandle session_bindings(std::string_view partition) const;
  ValueHandle session_rebinds(std::string_view partition) const;
  /// Failures reported against the partition's workers, by cause (FailureCause).
  ValueHandle worker_failures(std::string_view partition, std::string_view cause) const;
  /// Workers ejected from routing by outlier detection, and those ejected now.
  ValueHandle worker_ejections(std::string_view partition) const;
  ValueHandle workers_ejected(std::string_view partition) const;

  // Admission.
  /// A classifier's decision: `decision` admitted, deferred (pending at its first poll) or
  /// rejected, with the error code of a rejection as `reason` (empty otherwise).
  ValueHandle admission_decisions(std::string_view decision, std::string_view reason = {}) const;
  /// Requests waiting in a partition's queue, by policy class.
  ValueHandle queue_depth(std::string_view partition, std::string_view policy_class) const;
  /// Requests that left a partition's queue (or were refused by it), by class and outcome:
  /// dispatched, queue_full, due_time_expired, timeout, cancelled.
  ValueHandle queue_outcomes(std::string_view partition, std::string_view policy_class,
                             std::string_view outcome) const;
  /// Time a dispatched request waited in its queue, by policy class.
  HistogramHandle queue_wait(std::string_view policy_class) const;

  // Cluster mode.
  ValueHandle cluster_owned_partitions() const;
  ValueHandle cluster_members() const;
  /// 1 while this node owns `partition` ("<model>/<routing group>"), else 0.
  ValueHandle cluster_partition_owned(std::string_view partition) const;
  ValueHandle cluster_renew_failures() const;
  /// Partition leases this node handed to their desired owner (or gave back on shutdown).
  ValueHandle cluster_handovers() const;
  /// Requests forwarded to a partition's owner, by kind (route, report, generate) and outcome
  /// (answered, owner_lost).
  ValueHandle cluster_forwards(std::string_view kind, std::string_view outcome) const;
  /// From forwarding a request to its owner's answer.
  HistogramHandle cluster_forward_latency() const;

  // ---- discovery and NATS ----------------------------------------------------------------------
  ValueHandle discovery_requests() const;
  /// Network messages dropped, by subscribed subject.
  ValueHandle bad_messages(std::string_view subject) const;
  ValueHandle nats_reconnects() const;
  /// TLS handshakes the actor and cluster ports refused (garbage, plaintext, a foreign CA).
  ValueHandle peer_handshakes_refused() const;
  ValueHandle peer_frames_refused() const;
  ValueHandle nats_connected() const;
  /// Messages the NATS client dropped for a subscription that fell behind (slow consumer), by
  /// subscribed subject; refreshed on every scrape.
  ValueHandle nats_dropped(std::string_view subject) const;

  // ---- generate mode ---------------------------------------------------------------------------
  /// Generate requests received, by ingress ("nats", "actor").
  ValueHandle generate_requests(std::string_view ingress) const;
  /// Generate requests ended, by outcome ("completed", "error", "cancelled").
  ValueHandle generate_outcomes(std::string_view outcome) const;
  ValueHandle generate_retries() const;
  ValueHandle generate_first_token_timeouts() const;
  ValueHandle generate_stream_stalls() const;
  ValueHandle generate_nats_losses() const;
  ValueHandle generate_stale_chunks() const;
  ValueHandle generate_in_flight() const;
  /// Generate requests of disaggregated partitions planned, by partition and reason
  /// (DisaggregationReason: disaggregated, short_prompt, prefill_queue, no_prefill_worker).
  ValueHandle disaggregation_decisions(std::string_view partition, std::string_view reason) const;
  /// Requests this node sent to a shard of a sharded partition ("<model>/<routing group>"), by
  /// shard and outcome: home (its prefix's shard) or spilled (another, the faster way).
  ValueHandle shard_routes(std::string_view partition, std::uint32_t shard,
                           std::string_view outcome) const;
  /// Worker load reports and KV event batches this node decoded, by the partition (or shard) it
  /// follows them for ("previous_subjects": the previous release's shared subjects), and kind
  /// (load, kv_events).
  ValueHandle worker_messages_decoded(std::string_view partition, std::string_view kind) const;
  /// KV blocks stored or removed in the batches this node decoded, by partition (or shard).
  ValueHandle kv_blocks_decoded(std::string_view partition) const;
  /// A shard's part of its partition's published load (0..1), as this node last saw it.
  ValueHandle shard_load_share(std::string_view partition, std::uint32_t shard) const;
  /// The prefill hop, from its routing to the prefill worker's answer (one attempt), by model.
  HistogramHandle prefill_hop(std::string_view model) const;
  /// The node's own part of the second hop: the prefill's answer to the decode dispatch.
  HistogramHandle decode_handoff() const;

  // ---- the hit-rate ladder (label `model`) -----------------------------------------------------
  /// Counts one request whose engine reported its cached prompt tokens: its prompt tokens, the
  /// router's predicted cached tokens (its overlap at routing time in tokens) and the engine's,
  /// both capped at the prompt, and engine − predicted in kvr_cached_tokens_difference. Both doors
  /// call it (generate mode at the first chunk, the HTTP front door at the engine's usage);
  /// record_cache_outcome in cache_mismatch_detector.hpp adds the node's mismatch warning.
  void record_cache_outcome(std::string_view model, std::uint64_t prompt_tokens,
                            std::uint64_t predicted_cached_tokens,
                            std::uint64_t engine_cached_tokens) const;
  /// Prompt tokens of every routed request with token ids: the ceilings' denominator.
  ValueHandle routed_prompt_tokens(std::string_view model) const;
  /// Their cached tokens under one ceiling, `workload` or `capacity`.
  ValueHandle ceiling_cached_tokens(std::string_view model, std::string_view ceiling) const;

 private:
  ValueHandle counter(std::string_view name, std::string_view label = {},
                      std::string_view value = {}) const;
  ValueHandle gauge(std::string_view name, std::string_view label = {},
                    std::string_view value = {}) const;

  MetricsRegistry* registry_;
};

}  // namespace kvr::metrics
