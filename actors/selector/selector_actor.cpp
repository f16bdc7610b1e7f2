#include "actors/selector/selector_actor.hpp"

#include <algorithm>

#include <caf/typed_event_based_actor.hpp>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "messages/metrics/node_metrics.hpp"
#include "selection/cluster/sharding.hpp"
#include "selection/wire/shard_messages.hpp"

namespace kvr::actors {
namespace {

using Self = selector_actor::stateful_pointer<SelectorActorState>;

TimePoint now(Self self) { return self->state.config.clock->now(); }

// Carries out the effects of the input just handled (answers, dumps, removals, the classifier's
// fleet and KV usage, the queue's wake-up, metrics and logs), then clears them.
void carry_out(Self self, bool gauges) {
  auto& state = self->state;
  PartitionEffects& effects = state.effects;
  if (effects.ceilings_due && !state.ceilings_flush_sent) {
    // Recorded in a message of their own, after this one's answers have left: the node yields
    // an actor's thread after each message (scheduler.max-throughput), so the answer's way back
    // does not wait for them.
    state.ceilings_flush_sent = true;
    self->send(self, flush_atom::value);
  }
  for (auto& [ticket, reply] : effects.answers) {
    auto promise = state.waiting.extract(ticket);
    if (!promise.empty()) promise.mapped().deliver(std::move(reply));
  }
  for (const DumpRequest& dump : effects.dumps) {
    state.config.publisher->request_dump(dump.dump_subject, dump.worker);
  }
  if (!effects.removed.empty() && state.config.discovery) {
    self->send(state.config.discovery, removed_atom::value, effects.removed);
  }
  if (state.config.classifier && effects.fleet_changed) {
    self->send(state.config.classifier, fleet_atom::value, state.router->fleet());
  }
  if (state.config.classifier && effects.kv_usage) {
    const auto& partition = state.config.options.partition;
    self->send(state.config.classifier, kv_usage_atom::value, partition.model,
               partition.routing_group, effects.kv_usage->used, effects.kv_usage->total);
  }
  if (effects.wake_at) {
    const auto delay =
        std::chrono::duration_cast<std::chrono::microseconds>(*effects.wake_at - now(self));
    self->delayed_send(self, std::max(delay, std::chrono::microseconds{0}), wake_atom::value);
  }
  state.telemetry->record(effects);
  if (gauges) state.telemetry->write_gauges(*state.router);
  effects.clear();
}

// A shard publishes its load for the nodes that choose shards, at most once per interval.
void publish_shard_load(Self self) {
  auto& state = self->state;
  if (state.config.shard_load_subject.empty()) return;
  const TimePoint at = now(self);
  if (at - state.load_published < state.config.shard_load_interval) return;
  state.load_published = at;
  const auto& partition = state.config.options.partition;
  const cluster::ShardedGroup group = cluster::split_shard_group(partition.routing_group);
  if (!group.shard) return;
  state.config.publisher->publish(
      state.config.shard_load_subject,
      encode_shard_load({.model = partition.model,
                         .routing_group = std::string{group.routing_group},
                         .shard = *group.shard,
                         .shards = state.config.shards,
                         .worker_tokens = state.router->state().work_ahead_tokens()}));
}

}  // namespace

selector_actor::behavior_type selector_behavior(Self self, SelectorActorConfig config) {
  {
    auto& state = self->state;
    state.config = std::move(config);
    state.config.report_kv_usage = static_cast<bool>(state.config.classifier);
    state.config.stopwatch = state.config.clock;
    // The factories run here, when the partition is created: a role whose policy cannot be built
    // is counted and logged once now, not at each of its requests.
    if (!state.config.options.on_policy_build_failure) {
      state.config.options.on_policy_build_failure =
          [registry = state.config.metrics](
              const plugins::worker_selection::RoutingPartition& partition, WorkerType role,
              const std::string& reason) {
            metrics::NodeMetrics{*registry}
                .policy_build_failures(
                    fmt::format("{}/{}", partition.model, partition.routing_group), as_str(role))
                .add();
            spdlog::error("kvr node: {}", reason);
          };
    }
    state.router.emplace(state.config, *state.config.plugins);
    state.telemetry.emplace(*state.router, state.config.metrics, state.config.log);
    state.telemetry->write_gauges(*state.router);
    // The classifier actor builds the model's classifier at its partition's first description.
    if (state.config.classifier) {
      self->send(state.config.classifier, fleet_atom::value, state.router->fleet());
    }
    self->delayed_send(self, state.config.tick_interval, tick_atom::value);
  }
  // Shutdown: every waiting request gets an explicit answer.
  self->set_exit_handler([self](caf::exit_msg& message) {
    self->state.router->shut_down(self->state.effects);
    carry_out(self, false);
    // Cluster mode: a retired selector's partition holds nothing here any more. Reset last,
    // after anything this actor handled before its exit.
    if (self->state.config.fenced) self->state.telemetry->zero_gauges();
    self->quit(message.reason);
  });

  return {
      [self](worker_up_atom, discovery::WorkerRegistration& registration) {
        self->state.router->register_worker(std::move(registration), now(self),
                                            self->state.effects);
        carry_out(self, true);
      },
      [self](heartbeat_atom, const WorkerLiveness& heartbeat) {
        self->state.router->heartbeat(heartbeat, now(self), self->state.effects);
        carry_out(self, false);
      },
      [self](worker_down_atom, const WorkerLiveness& deregistration) {
        self->state.router->deregister(deregistration, now(self), self->state.effects);
        carry_out(self, true);
      },
      [self](load_atom, const WorkerLoadReport& report) {
        self->state.router->update_load(report, now(self), self->state.effects);
        carry_out(self, false);
      },
      [self](kv_events_atom, const KvEventBatch& batch) {
        self->state.router->apply_kv_events(batch, now(self), self->state.effects);
        carry_out(self, false);
      },
      [self](kv_dump_atom, const KvDump& dump) {
        self->state.router->load_kv_dump(dump, now(self), self->state.effects);
        carry_out(self, true);
      },
      [self](route_atom, RouteRequest& request) -> caf::result<SelectorReply> {
        auto& state = self->state;
        const RouteTicket ticket = state.next_ticket++;
        auto reply = state.router->route(request, ticket, now(self), state.effects);
        carry_out(self, true);
        if (reply) return std::move(*reply);
        auto promise = self->make_response_promise<SelectorReply>();
        state.waiting.emplace(ticket, promise);
        return promise;
      },
      [self](booking_atom, const BookingUpdate& update) -> BookingUpdateReply {
        auto changed =
            self->state.router->change_booking(update.change, now(self), self->state.effects);
        carry_out(self, true);
        if (!changed) return {false, std::move(changed.error())};
        return {true, {}};
      },
      [self](tick_atom) {
        self->state.router->tick(now(self), self->state.effects);
        self->state.telemetry->write_learnt_values(*self->state.router, now(self));
        carry_out(self, true);
        publish_shard_load(self);
        self->delayed_send(self, self->state.config.tick_interval, tick_atom::value);
      },
      [self](nats_link_atom, bool connected) {
        self->state.router->set_link(connected, now(self), self->state.effects);
        carry_out(self, false);
      },
      [self](fence_atom, TimePoint owned_until) {
        self->state.router->set_owned_until(owned_until, now(self), self->state.effects);
        carry_out(self, true);
      },
      [self](wake_atom) {
        self->state.router->wake(now(self), self->state.effects);
        carry_out(self, true);
      },
      [self](flush_atom) {
        self->state.ceilings_flush_sent = false;
        self->state.router->record_due_ceilings(self->state.effects);
        carry_out(self, false);
      },
      [self](cancel_atom, const std::string&, const std::string&, const std::string& request_id) {
        self->state.router->cancel(request_id, now(self), self->state.effects);
        carry_out(self, true);
      },
  };
}

}  // namespace kvr::actors
