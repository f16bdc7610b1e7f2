#include "actors/selector/selector_actor.hpp"

#include <algorithm>
#include <cmath>

#include <caf/typed_event_based_actor.hpp>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "actors/actor_types.hpp"
#include "messages/subjects.hpp"

namespace kvr::actors {
namespace {

using Self = selector_actor::stateful_pointer<SelectorActorState>;

std::string partition_label(const plugins::worker_selection::RoutingPartition& partition) {
  return fmt::format("{}/{}", partition.model, partition.routing_group);
}

metrics::NodeMetrics node_metrics(Self self) {
  return metrics::NodeMetrics{*self->state.config.metrics};
}

// Publishes the partition's gauges after a change.
void update_gauges(Self self) {
  auto& state = self->state;
  const discovery::PartitionWorkers& workers = state.selector->partition_workers();
  state.series.bookings_open.set(static_cast<double>(workers.load().open_bookings()));
  state.series.booked_blocks.set(static_cast<double>(workers.load().booked_prompt_blocks()));
  state.series.workers.set(static_cast<double>(workers.catalog().size()));
  state.series.index_blocks.set(static_cast<double>(workers.index().node_count()));
  if (state.affinity.enabled()) {
    state.series.session_bindings.set(static_cast<double>(state.affinity.size()));
  }
  state.series.workers_ejected.set(static_cast<double>(state.selector->health().ejected()));
  for (WorkerId id : state.selector->take_returned()) {
    spdlog::info("kvr node: worker {} returned to routing in partition {} after its ejection", id,
                 state.partition);
  }
}

// Applies a booking update's health report: counts a failure by its cause, and logs and counts an
// ejection (or a worker the ejection cap kept in routing).
void apply_health(Self self, const WorkerHealthReport& report) {
  auto& state = self->state;
  const auto verdict = state.selector->report_health(report, state.config.clock->now());
  if (!verdict || !report.failure) return;
  state.series.worker_failures[static_cast<std::size_t>(*report.failure)].add();
  if (verdict->ejected) {
    state.series.worker_ejections.add();
    spdlog::warn(
        "kvr node: worker {} ejected from routing in partition {} for {} ms after {} consecutive "
        "failures (last: {})",
        report.worker, state.partition, verdict->backoff.count(),
        state.selector->health().config().consecutive_failures, as_str(*report.failure));
  } else if (verdict->capped) {
    state.config.log->warn(
        fmt::format("{}:ejection-cap", state.partition),
        fmt::format("kvr node: worker {} keeps failing in partition {} but stays in routing: {} of "
                    "{} workers are ejected already (max_ejection_percent)",
                    report.worker, state.partition, state.selector->health().ejected(),
                    state.selector->partition_workers().catalog().size()));
  }
}

// Applies a lifecycle's affinity action to the request's proposal.
void apply_affinity(Self self, const std::string& request_id, AffinityAction action) {
  auto& affinity = self->state.affinity;
  const auto now = self->state.config.clock->now();
  switch (action) {
    case AffinityAction::none:
      return;
    case AffinityAction::commit:
      if (affinity.commit(request_id, now) == AffinityCommit::rebound) {
        node_metrics(self).session_rebinds(self->state.partition).add();
      }
      return;
    case AffinityAction::abandon:
      (void)affinity.abandon(request_id, now);
      return;
    case AffinityAction::finish:
      (void)affinity.finish(request_id, now);
      return;
  }
}

// Counts and logs (rate-limited) a worker message the partition's state refused.
void refuse(Self self, std::string_view kind, std::string_view reason) {
  auto& state = self->state;
  node_metrics(self).worker_messages_refused(state.partition, kind).add();
  state.config.log->warn(
      fmt::format("{}:{}", state.partition, kind),
      fmt::format("kvr node: partition {} refused a {}: {}", state.partition, kind, reason));
}

// Asks the worker for a dump of one rank, at most once per retry period.
void request_dump(Self self, WorkerWithDpRank worker) {
  auto& state = self->state;
  const auto now = state.config.clock->now();
  auto [it, inserted] = state.dump_requested.try_emplace(worker, now);
  if (!inserted) {
    if (now - it->second < state.config.dump_retry) return;
    it->second = now;
  }
  const auto* entry = state.selector->partition_workers().catalog().find(worker.worker_id);
  if (entry == nullptr || entry->registration.dump_subject.empty()) return;
  node_metrics(self).kv_dump_requests(state.partition).add();
  state.config.publisher->request_dump(entry->registration.dump_subject, worker);
}

// Forgets the dump requests of every rank of a worker, and the resync dumps it still owed.
void forget_dumps(Self self, WorkerId id) {
  auto& requested = self->state.dump_requested;
  for (auto it = requested.begin(); it != requested.end();) {
    if (it->first.worker_id == id) {
      requested.erase(it++);
    } else {
      ++it;
    }
  }
  self->state.resync_wanted.erase(id);
  std::erase_if(self->state.resync_dumps,
                [id](const WorkerWithDpRank& rank) { return rank.worker_id == id; });
}

// After a NATS reconnect: asks for the queued resync dumps that this tick's budget allows.
void send_resync_dumps(Self self) {
  auto& state = self->state;
  while (state.resync_budget > 0 && !state.resync_dumps.empty()) {
    const WorkerWithDpRank rank = state.resync_dumps.front();
    state.resync_dumps.pop_front();
    --state.resync_budget;
    request_dump(self, rank);
  }
}

// A message from worker `id` arrived. The first one after a NATS reconnect shows that the worker
// is reachable again: its ranks' dumps are queued (a dump asked for before that might be lost,
// while the worker itself was still reconnecting).
void heard_from(Self self, WorkerId id) {
  auto& state = self->state;
  if (state.resync_wanted.empty()) return;
  const auto wanted = state.resync_wanted.find(id);
  if (wanted == state.resync_wanted.end()) return;
  state.resync_wanted.erase(wanted);
  const auto* entry = state.selector->partition_workers().catalog().find(id);
  if (entry == nullptr) return;
  for (DpRank rank = 0; rank < entry->registration.data_parallel_size; ++rank) {
    state.resync_dumps.push_back({id, rank});
  }
  send_resync_dumps(self);
}

// The node's NATS connection went down (hold every worker lease: the missing heartbeats are the
// node's own outage) or came back (each lease runs one TTL from now; the KV state of every worker
// that publishes it is asked for again once the worker is heard from).
void on_nats_link(Self self, bool connected) {
  auto& state = self->state;
  if (!connected) {
    state.selector->hold_leases();
    return;
  }
  const auto now = state.config.clock->now();
  const discovery::LeaseGrace grace = state.selector->release_leases(now);
  const metrics::NodeMetrics metrics = node_metrics(self);
  metrics.worker_expiries_suppressed(state.partition).add(static_cast<double>(grace.held_over));
  metrics.worker_lease_grants(state.partition).add(static_cast<double>(grace.renewed));
  const discovery::WorkerCatalog& catalog = state.selector->partition_workers().catalog();
  for (const auto& [id, entry] : catalog.entries()) {
    if (entry.registration.publishes_kv_events) {
      state.resync_wanted.insert_or_assign(id, now + entry.registration.lease_ttl);
    }
  }
  if (catalog.size() > 0) {
    spdlog::info(
        "kvr node: partition {}: NATS is back; its {} workers were kept through the outage ({} "
        "leases had run out), every lease now runs one TTL from the reconnect, and their KV "
        "state is asked for again",
        state.partition, catalog.size(), grace.held_over);
  }
}

// Tells the classifier actor the partition's KV blocks, used over total across its ranks, when
// the usage moved by at least 0.01 since the last time. Used blocks are the confirmed ones of the
// last report plus the bookings' change since, as the busy signals count them (a rank without a
// report or booking counts its total only). The classifier weighs partitions by their totals.
void send_fleet_load(Self self) {
  auto& state = self->state;
  if (!state.config.classifier) return;
  const discovery::PartitionWorkers& workers = state.selector->partition_workers();
  std::uint64_t used = 0;
  std::uint64_t total = 0;
  for (const auto& [id, entry] : workers.catalog().entries()) {
    for (DpRank rank = 0; rank < entry.registration.data_parallel_size; ++rank) {
      const auto view = workers.load().rank_load({id, rank});
      if (!view) continue;
      total += view->total_kv_blocks;
      const std::int64_t rank_used =
          static_cast<std::int64_t>(view->confirmed ? view->confirmed->kv_blocks_used : 0) +
          view->blocks_since_report;
      used += std::min<std::uint64_t>(rank_used < 0 ? 0 : static_cast<std::uint64_t>(rank_used),
                                      view->total_kv_blocks);
    }
  }
  if (total == 0) return;
  const double usage = static_cast<double>(used) / static_cast<double>(total);
  if (state.sent_kv_usage && std::abs(usage - *state.sent_kv_usage) < 0.01) return;
  state.sent_kv_usage = usage;
  self->send(state.config.classifier, kv_usage_atom::value, state.config.options.partition.model,
             state.config.options.partition.routing_group, used, total);
}

// Selects and books one request (through session affinity): the reply to its caller.
SelectorReply route_request(Self self, RouteRequest& request) {
  auto& state = self->state;
  const auto started = state.config.clock->now();
  auto routed = route_with_session_affinity(*state.selector, state.affinity, request, started);
  SelectorReply reply{routed ? std::expected<RouteOutcome, RouteFailure>{std::move(routed->outcome)}
                             : std::unexpected(std::move(routed.error())),
                      state.selector->policy_name(request.worker_type),
                      {}};
  const std::chrono::duration<double> elapsed = state.config.clock->now() - started;
  state.series.selection_latency.observe(elapsed.count());
  if (reply.result) {
    const auto* entry =
        state.selector->partition_workers().catalog().find(reply.result->worker.worker_id);
    if (entry != nullptr) reply.generate_subject = entry->registration.generate_subject;
    const discovery::PredictedLoad& load = state.selector->partition_workers().load();
    state.series.bookings_open.set(static_cast<double>(load.open_bookings()));
    state.series.booked_blocks.set(static_cast<double>(load.booked_prompt_blocks()));
    if (state.affinity.enabled()) {
      state.series.session_bindings.set(static_cast<double>(state.affinity.size()));
    }
  }
  return reply;
}

SelectorReply failure_reply(Self self, const RouteRequest& request, RouteFailure failure) {
  return SelectorReply{std::unexpected(std::move(failure)),
                       self->state.selector->policy_name(request.worker_type),
                       {}};
}

void count_queue_outcome(Self self, std::string_view policy_class, std::string_view outcome) {
  node_metrics(self).queue_outcomes(self->state.partition, policy_class, outcome).add();
}

void update_queue_gauges(Self self) {
  auto& state = self->state;
  const auto depths = state.queue->depths();
  for (std::size_t i = 0; i < depths.size() && i < state.series.queue_depth.size(); ++i) {
    state.series.queue_depth[i].set(static_cast<double>(depths[i].requests));
  }
}

// Arms one wake message for the queue's next due time or wait limit, unless one is on its way
// for that time or earlier.
void arm_queue_timer(Self self) {
  auto& state = self->state;
  const auto next = state.queue->next_expiry();
  if (!next || (state.wake_armed_for && *state.wake_armed_for <= *next)) return;
  state.wake_armed_for = next;
  const auto now = state.config.clock->now();
  const auto delay = *next > now
                         ? std::chrono::duration_cast<std::chrono::microseconds>(*next - now)
                         : std::chrono::microseconds{0};
  self->delayed_send(self, delay, wake_atom::value);
}

// Answers the waiting requests whose due time or wait limit passed.
void expire_queue(Self self) {
  auto& state = self->state;
  for (RefusedRoute& refused : state.queue->expire(state.config.clock->now())) {
    count_queue_outcome(self, refused.waiting.request.policy_class, as_str(refused.failure.code));
    auto promise = state.queued_replies.extract(refused.waiting.ticket);
    if (!promise.empty()) {
      promise.mapped().deliver(
          failure_reply(self, refused.waiting.request, std::move(refused.failure)));
    }
  }
}

// Dispatches what freed capacity allows, in the queue's order, each booked before the next is
// checked; then re-arms the timer for what still waits.
void drain_queue(Self self) {
  auto& state = self->state;
  if (!state.queue || state.queue->empty()) return;
  expire_queue(self);
  state.queue->drain(*state.selector, [self, &state](WaitingRoute&& waiting) {
    const std::chrono::duration<double> waited = state.config.clock->now() - waiting.enqueued_at;
    node_metrics(self).queue_wait(waiting.request.policy_class).observe(waited.count());
    count_queue_outcome(self, waiting.request.policy_class, "dispatched");
    SelectorReply reply = route_request(self, waiting.request);
    auto promise = state.queued_replies.extract(waiting.ticket);
    if (!promise.empty()) promise.mapped().deliver(std::move(reply));
  });
  update_queue_gauges(self);
  arm_queue_timer(self);
}

// A route request when the queue runs: selected now, refused, or queued behind a promise.
caf::result<SelectorReply> offer_to_queue(Self self, RouteRequest& request) {
  auto& state = self->state;
  const auto now = state.config.clock->now();
  if (auto prepared = state.selector->prepare(request, now); !prepared) {
    return failure_reply(self, request, std::move(prepared.error()));
  }
  const QueueTicket ticket = state.next_ticket++;
  auto admission = state.queue->offer(*state.selector, request, ticket, now);
  if (!admission) {
    count_queue_outcome(self, request.policy_class,
                        admission.error().code == Error::overloaded ? "queue_full" : "refused");
    return failure_reply(self, request, std::move(admission.error()));
  }
  if (*admission == PartitionQueue::Admission::route_now) return route_request(self, request);
  auto promise = self->make_response_promise<SelectorReply>();
  state.queued_replies.emplace(ticket, promise);
  drain_queue(self);
  update_queue_gauges(self);
  return promise;
}
RouteFailure not_owned(Self self) {
  return RouteFailure{Error::unavailable,
                      fmt::format("partition {} is not owned by this node (its lease is not held "
                                  "or not renewed in time); retry",
                                  self->state.partition)};
}

// Cluster mode: refuses the requests that waited for the lease longer than ownership_wait.
void answer_overdue_awaiting(Self self, TimePoint now) {
  auto& awaiting = self->state.awaiting_ownership;
  auto overdue =
      std::ranges::partition(awaiting, [now](const auto& waiting) { return waiting.until > now; });
  for (auto it = overdue.begin(); it != overdue.end(); ++it) {
    it->promise.deliver(failure_reply(self, it->request, not_owned(self)));
  }
  awaiting.erase(overdue.begin(), overdue.end());
}

// Tells the classifier actor the partition's fleet after it changed (its block size and worker
// ranks), for the context a model's classifier is created with.
void send_fleet(Self self) {
  auto& state = self->state;
  if (!state.config.classifier) return;
  PartitionFleet fleet{state.config.options.partition.model,
                       state.config.options.partition.routing_group,
                       state.selector->block_size(),
                       {}};
  for (const auto& [id, entry] : state.selector->partition_workers().catalog().entries()) {
    for (DpRank rank = 0; rank < entry.registration.data_parallel_size; ++rank) {
      fleet.workers.emplace_back(WorkerWithDpRank{id, rank}, entry.registration.total_kv_blocks);
    }
  }
  self->send(state.config.classifier, fleet_atom::value, std::move(fleet));
}

}  // namespace

selector_actor::behavior_type selector_behavior(Self self, SelectorActorConfig config) {
  {
    auto& state = self->state;
    state.config = std::move(config);
    state.selector.emplace(state.config.options, *state.config.plugins);
    state.affinity = SessionAffinity{state.config.affinity};
    state.partition = partition_label(state.config.options.partition);
    const metrics::NodeMetrics metrics = node_metrics(self);
    state.series = {.bookings_open = metrics.bookings_open(state.partition),
                    .booked_blocks = metrics.booked_blocks(state.partition),
                    .workers = metrics.workers(state.partition),
                    .index_blocks = metrics.index_blocks(state.partition),
                    .session_bindings = state.affinity.enabled()
                                            ? metrics.session_bindings(state.partition)
                                            : metrics::ValueHandle{},
                    .selection_latency = metrics.selection_latency(),
                    .worker_ejections = metrics.worker_ejections(state.partition),
                    .workers_ejected = metrics.workers_ejected(state.partition)};
    for (std::size_t cause = 0; cause < kFailureCauses; ++cause) {
      state.series.worker_failures[cause] =
          metrics.worker_failures(state.partition, as_str(static_cast<FailureCause>(cause)));
    }
    if (queues_requests(state.config.policy_classes)) {
      state.queue.emplace(
          PartitionQueueOptions{state.config.policy_classes, state.config.queue_max_wait});
      for (const auto& policy_class : state.config.policy_classes) {
        state.series.queue_depth.push_back(metrics.queue_depth(state.partition, policy_class.name));
      }
      update_queue_gauges(self);
    }
    update_gauges(self);
    state.resync_budget = state.config.resync_dumps_per_tick;
    self->delayed_send(self, state.config.tick_interval, tick_atom::value);
    // Shutdown: every waiting request gets an explicit answer.
    self->set_exit_handler([self](caf::exit_msg& message) {
      for (auto& waiting : self->state.awaiting_ownership) {
        waiting.promise.deliver(SelectorReply{
            std::unexpected(RouteFailure{Error::unavailable, "the partition's selector stopped"}),
            {},
            {}});
      }
      self->state.awaiting_ownership.clear();
      for (auto& [ticket, promise] : self->state.queued_replies) {
        promise.deliver(SelectorReply{
            std::unexpected(RouteFailure{Error::unavailable, "the router node is shutting down"}),
            {},
            {}});
      }
      self->state.queued_replies.clear();
      // Cluster mode: a retired selector's partition holds nothing here any more. Reset last,
      // after anything this actor handled before its exit.
      if (self->state.config.fenced) {
        self->state.series.bookings_open.set(0);
        self->state.series.booked_blocks.set(0);
        self->state.series.workers.set(0);
        self->state.series.index_blocks.set(0);
        self->state.series.workers_ejected.set(0);
      }
      self->quit(message.reason);
    });
  }

  return {
      [self](worker_up_atom, discovery::WorkerRegistration& registration) {
        auto& state = self->state;
        const WorkerId id = registration.worker_id;
        auto change =
            state.selector->register_worker(std::move(registration), state.config.clock->now());
        if (!change) return refuse(self, "registration", change.error().message());
        if (*change != discovery::RegistrationChange::refreshed) {
          forget_dumps(self, id);
          spdlog::info("kvr node: worker {} {} in partition {}", id,
                       *change == discovery::RegistrationChange::added ? "joined" : "restarted",
                       state.partition);
          send_fleet(self);
          // A partition that changed hands: the new owner rebuilds the index from dumps.
          if (state.config.fenced) {
            const auto* entry = state.selector->partition_workers().catalog().find(id);
            if (entry != nullptr && entry->registration.publishes_kv_events) {
              for (DpRank rank = 0; rank < entry->registration.data_parallel_size; ++rank) {
                request_dump(self, {id, rank});
              }
            }
          }
          drain_queue(self);
        } else {
          heard_from(self, id);
        }
        update_gauges(self);
      },
      [self](heartbeat_atom, const WorkerLiveness& heartbeat) {
        auto renewed = self->state.selector->heartbeat(heartbeat.worker_id, heartbeat.incarnation,
                                                       self->state.config.clock->now());
        if (!renewed) return refuse(self, "heartbeat", discovery::as_str(renewed.error()));
        heard_from(self, heartbeat.worker_id);
      },
      [self](worker_down_atom, const WorkerLiveness& deregistration) {
        auto removed =
            self->state.selector->deregister(deregistration.worker_id, deregistration.incarnation);
        if (!removed) return refuse(self, "deregistration", discovery::as_str(removed.error()));
        spdlog::info("kvr node: worker {} left partition {}", deregistration.worker_id,
                     self->state.partition);
        forget_dumps(self, deregistration.worker_id);
        send_fleet(self);
        if (self->state.config.discovery) {
          self->send(self->state.config.discovery, removed_atom::value,
                     std::vector<WorkerId>{deregistration.worker_id});
        }
        update_gauges(self);
      },
      [self](load_atom, const WorkerLoadReport& report) {
        auto& state = self->state;
        const auto* entry = state.selector->partition_workers().catalog().find(report.worker_id);
        if (entry == nullptr || entry->registration.incarnation != report.incarnation) {
          return refuse(self, "load", "unknown worker or stale incarnation");
        }
        for (const auto& [rank, load] : report.ranks) {
          auto updated = state.selector->update_load({report.worker_id, rank}, load);
          if (!updated) return refuse(self, "load", discovery::as_str(updated.error()));
        }
        send_fleet_load(self);
        drain_queue(self);
      },
      [self](kv_events_atom, const KvEventBatch& batch) {
        auto& state = self->state;
        auto outcome = state.selector->apply_kv_events(batch);
        if (!outcome) return refuse(self, "kv_events", discovery::as_str(outcome.error()));
        if (outcome->rejected_events > 0 && outcome->first_error) {
          refuse(self, "kv_event", discovery::as_str(*outcome->first_error));
        }
        if (outcome->gap) {
          node_metrics(self).kv_event_gaps(state.partition).add();
          request_dump(self, batch.worker);
        }
        heard_from(self, batch.worker.worker_id);
      },
      [self](kv_dump_atom, const KvDump& dump) {
        auto& state = self->state;
        auto loaded = state.selector->load_kv_dump(dump);
        if (!loaded) return refuse(self, "kv_dump", discovery::as_str(loaded.error()));
        state.dump_requested.erase(dump.worker);
        update_gauges(self);
      },
      [self](route_atom, RouteRequest& request) -> caf::result<SelectorReply> {
        auto& state = self->state;
        if (state.config.fenced && state.config.clock->now() >= state.owned_until) {
          // A handover or takeover in progress: the lease is about to be this node's.
          constexpr std::size_t kMaxAwaiting = 10'000;
          if (state.awaiting_ownership.size() >= kMaxAwaiting) {
            return failure_reply(self, request, not_owned(self));
          }
          auto promise = self->make_response_promise<SelectorReply>();
          state.awaiting_ownership.push_back(
              {std::move(request), promise,
               state.config.clock->now() + state.config.ownership_wait});
          return promise;
        }
        if (state.selector->expire_bookings(state.config.clock->now(), kExpiriesPerRequest) > 0) {
          drain_queue(self);
        }
        if (state.queue) return offer_to_queue(self, request);
        return route_request(self, request);
      },
      [self](booking_atom, const BookingUpdate& update) -> BookingUpdateReply {
        auto& state = self->state;
        auto changed = update.release ? state.selector->release(update.request_id, update.end)
                                      : state.selector->first_token(update.request_id);
        // Even when the booking is gone (its worker left), the proposal must end.
        apply_affinity(self, update.request_id, update.affinity);
        if (update.health) apply_health(self, *update.health);
        if (changed) drain_queue(self);
        update_gauges(self);
        if (!changed) return {false, std::string{discovery::as_str(changed.error())}};
        return {true, {}};
      },
      [self](tick_atom) {
        auto& state = self->state;
        std::vector<WorkerId> removed;
        const auto now = state.config.clock->now();
        state.selector->expire(now, removed);
        state.affinity.expire(now);
        if (!removed.empty()) {
          for (WorkerId id : removed) {
            spdlog::info("kvr node: worker {} expired (no heartbeat) in partition {}", id,
                         state.partition);
            node_metrics(self).workers_expired(state.partition).add();
            forget_dumps(self, id);
          }
          send_fleet(self);
          if (state.config.discovery)
            self->send(state.config.discovery, removed_atom::value, removed);
        }
        // Expired bookings free capacity; a removed worker's waiting requests get their answer.
        drain_queue(self);
        answer_overdue_awaiting(self, now);
        // A worker not heard from within its grace period after a reconnect owes no dump (it
        // expires, or a later event gap asks for one).
        absl::erase_if(state.resync_wanted,
                       [now](const auto& wanted) { return wanted.second <= now; });
        state.resync_budget = state.config.resync_dumps_per_tick;
        send_resync_dumps(self);
        update_gauges(self);
        self->delayed_send(self, state.config.tick_interval, tick_atom::value);
      },
      [self](nats_link_atom, bool connected) { on_nats_link(self, connected); },
      [self](fence_atom, TimePoint owned_until) {
        auto& state = self->state;
        state.owned_until = owned_until;
        if (state.config.clock->now() >= owned_until || state.awaiting_ownership.empty()) return;
        auto awaiting = std::move(state.awaiting_ownership);
        state.awaiting_ownership.clear();
        for (auto& waiting : awaiting) {
          if (state.queue) {
            // Through the mailbox: the queue decides as for any newcomer.
            waiting.promise.delegate(caf::actor_cast<selector_actor>(self), route_atom::value,
                                     std::move(waiting.request));
          } else {
            waiting.promise.deliver(route_request(self, waiting.request));
          }
        }
      },
      [self](wake_atom) {
        auto& state = self->state;
        state.wake_armed_for.reset();
        if (!state.queue) return;
        expire_queue(self);
        drain_queue(self);
        update_queue_gauges(self);
        arm_queue_timer(self);
      },
      [self](cancel_atom, const std::string&, const std::string&, const std::string& request_id) {
        auto& state = self->state;
        if (!state.queue) return;
        auto waiting = state.queue->cancel(request_id);
        if (!waiting) return;
        count_queue_outcome(self, waiting->request.policy_class, "cancelled");
        auto promise = state.queued_replies.extract(waiting->ticket);
        if (!promise.empty()) {
          promise.mapped().deliver(failure_reply(
              self, waiting->request,
              RouteFailure{Error::unavailable,
                           fmt::format("request '{}' was cancelled by its caller while queued",
                                       request_id)}));
        }
        update_queue_gauges(self);
      },
  };
}

}  // namespace kvr::actors
