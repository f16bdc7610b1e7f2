// The selector actor: one per routing partition (model x routing group), the mailbox and timers of
// that partition's core (PartitionRouter, selection/partition/partition_router.hpp), which decides
// everything: routing, booking, session affinity, the policy-class queue, passive health, KV dumps
// and the ownership fence. Spawned on demand (linked) by the discovery actor.
//
// State it owns: the partition's PartitionRouter, the response promises of requests that wait (in
// the queue or for the partition's lease) by ticket, and the partition's metric series.
// Messages it handles (its typed interface, `selector_actor`, in actors/actor_types.hpp), each
// passed to the core with the clock's time, then the core's effects carried out:
//   worker_up, heartbeat, worker_dn, load, kv_events, kv_dump: worker state;
//   route(RouteRequest) -> SelectorReply: answered now, or later through a promise;
//   booking(BookingUpdate) -> BookingUpdateReply: first token or release of a booking;
//   cancel(model, group, request id): the caller gave up on a queued request;
//   fence(owned until): cluster mode, the partition's lease fence;
//   nats_link(bool connected): the node's NATS connection went down or came back;
//   tick: internal, its own timer (a shard publishes its load then); wake: internal, the queue's
//   next deadline; flush: internal, the hit-rate ceilings of the prompts routed since the last
//   one (sent to itself, so that they run after the answers have left).
// Effects: answers go to their promises, dump requests to the RouterPublisher (never waiting),
// workers that left to the discovery actor (which tells the lifecycle actor), the fleet and its KV
// usage to the classifier actor, events to metrics and the log. At spawn (the partition's
// creation) the policy factories run, a role whose policy cannot be built is counted in
// kvr_policy_build_failures_total and logged once, and the classifier actor is told the fleet.
// It must never block, throw, share its state, or call NATS request().
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <unordered_map>
#include <vector>

#include <caf/stateful_actor.hpp>
#include <caf/typed_response_promise.hpp>

#include "actors/actor_types.hpp"
#include "messages/clock.hpp"
#include "messages/metrics/metrics_registry.hpp"
#include "messages/metrics/rate_limited_log.hpp"
#include "selection/partition/partition_router.hpp"
#include "selection/partition/partition_telemetry.hpp"
#include "selection/wire/nats_bridge.hpp"

namespace kvr::actors {

/// What a selector actor is spawned with: the partition core's settings and the shell's wiring.
struct SelectorActorConfig : PartitionRouterOptions, NodeServices {
  /// Resolved policies; must outlive the actor system.
  const plugins::RouterPlugins* plugins = nullptr;
  /// Told about workers that left (expired); may be empty.
  removal_watcher_actor discovery;
  /// Period of the expiry tick.
  std::chrono::milliseconds tick_interval{100};
  /// The node's classifier actor, told the partition's fleet and KV usage; null (no classifier
  /// configured): nothing is sent.
  classifier_actor classifier;
  /// A shard of a sharded partition (its routing group names the shard) publishes its load
  /// (SelectorState::work_ahead_tokens) on this subject every shard_load_interval, so that every
  /// node can choose shards; empty: not a shard.
  std::string shard_load_subject;
  std::uint32_t shards = 1;
  std::chrono::milliseconds shard_load_interval{100};
};

/// The selector actor's state.
struct SelectorActorState {
  static inline const char* name = "kvr.selector";
  std::optional<PartitionRouter> router;
  SelectorActorConfig config;
  /// Reused for every input.
  PartitionEffects effects;
  /// The reply promise of each waiting request, by its ticket.
  std::unordered_map<RouteTicket, caf::typed_response_promise<SelectorReply>> waiting;
  RouteTicket next_ticket = 1;
  /// The partition's metrics and log lines.
  std::optional<PartitionTelemetry> telemetry;
  /// When the shard last published its load.
  TimePoint load_published{};
  /// A flush message is on its way to record the routed prompts' hit-rate ceilings.
  bool ceilings_flush_sent = false;
};

/// The selector actor's behaviour.
selector_actor::behavior_type selector_behavior(
    selector_actor::stateful_pointer<SelectorActorState> self, SelectorActorConfig config);

}  // namespace kvr::actors
