#include "selection/partition/partition_router.hpp"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

namespace kvr {
namespace {

// Unreported bookings released with each route request, before the tick releases the rest: when
// clients do not report, bookings end as fast as requests arrive instead of piling up into one
// burst per tick that every queued request waits behind.
constexpr std::size_t kBookingExpiriesPerRoute = 4;

// Requests that may wait for the partition's lease at once; beyond it they are refused.
constexpr std::size_t kMaxAwaitingOwnership = 10'000;

// Routed prompts that may wait for the hit-rate ceilings; the next one records them all at once.
constexpr std::size_t kMaxDueCeilings = 1'024;

}  // namespace

PartitionRouter::PartitionRouter(PartitionRouterOptions options,
                                 const plugins::RouterPlugins& plugins)
    : options_(std::move(options)),
      selector_(options_.options, plugins),
      disaggregation_(
          selection::disaggregation_of(plugins.models, options_.options.partition.model)),
      affinity_(options_.affinity),
      label_(fmt::format("{}/{}", options_.options.partition.model,
                         options_.options.partition.routing_group)),
      resync_budget_(options_.resync_dumps_per_tick) {
  if (queues_requests(options_.policy_classes)) {
    queue_.emplace(PartitionQueueOptions{options_.policy_classes, options_.queue_max_wait});
  }
  if (options_.hit_rate_ceilings) ceilings_.emplace(*options_.hit_rate_ceilings);
}

PartitionRouter::~PartitionRouter() {
  if (options_.rank_budget) options_.rank_budget->give_back(ranks_held_);
}

std::optional<std::string> PartitionRouter::take_ranks(
    const discovery::WorkerRegistration& registration) {
  const auto& catalog = selector_.partition_workers().catalog();
  const discovery::CatalogEntry* known = catalog.find(registration.worker_id);
  if (known == nullptr && options_.max_workers != 0 && catalog.size() >= options_.max_workers) {
    return fmt::format(
        "the partition holds {} workers, its cap (--router-max-workers-per-partition)",
        catalog.size());
  }
  const std::uint64_t before = known != nullptr ? known->registration.data_parallel_size : 0;
  const std::uint64_t after = registration.data_parallel_size;
  if (after <= before || !options_.rank_budget) return std::nullopt;
  if (!options_.rank_budget->try_take(after - before)) {
    return fmt::format(
        "data_parallel_size: {} more ranks would exceed the node's {} rank entries "
        "(--router-max-rank-entries)",
        after - before, options_.rank_budget->limit());
  }
  ranks_held_ += after - before;
  return std::nullopt;
}

void PartitionRouter::settle_ranks() {
  if (!options_.rank_budget) return;
  std::uint64_t held = 0;
  for (const auto& [id, entry] : selector_.partition_workers().catalog().entries()) {
    held += entry.registration.data_parallel_size;
  }
  if (held < ranks_held_) {
    options_.rank_budget->give_back(ranks_held_ - held);
    ranks_held_ = held;
  }
}

// ---- requests -------------------------------------------------------------------------------

std::optional<RouteReply> PartitionRouter::route(RouteRequest& request, RouteTicket ticket,
                                                 TimePoint now, PartitionEffects& out) {
  if (options_.fenced && now >= owned_until_) {
    // A handover or takeover in progress: the lease is about to be this node's.
    if (awaiting_ownership_.size() >= kMaxAwaitingOwnership) {
      return failure(request, not_owned());
    }
    awaiting_ownership_.push_back({std::move(request), ticket, now + options_.ownership_wait});
    return std::nullopt;
  }
  if (selector_.expire_bookings(now, kBookingExpiriesPerRoute) > 0) drain_queue(now, out);
  if (request.hop == RouteHop::plan) resolve_hop(request);
  std::optional<RouteReply> reply = queue_ && !request.query_only
                                        ? offer_to_queue(request, ticket, now, out)
                                        : select(request, now, out);
  finish(out);
  return reply;
}

std::expected<void, std::string> PartitionRouter::change_booking(const BookingChange& change,
                                                                 TimePoint now,
                                                                 PartitionEffects& out) {
  std::optional<plugins::worker_selection::TtftCalibration> calibration;
  auto changed = change.release ? selector_.release(change.request_id, change.end, now)
                                : selector_.first_token(change.request_id, now, &calibration);
  if (calibration) {
    out.events.emplace_back(partition_event::TtftPredicted{
        calibration->worker, calibration->predicted_seconds, calibration->observed_seconds});
  }
  // Even when the booking is gone (its worker left), the proposal must end.
  apply_affinity(change, now, out);
  if (change.health) apply_health(*change.health, now, out);
  if (changed) drain_queue(now, out);
  finish(out);
  if (!changed) return std::unexpected(std::string{discovery::as_str(changed.error())});
  return {};
}

void PartitionRouter::cancel(std::string_view request_id, TimePoint now, PartitionEffects& out) {
  (void)now;
  if (!queue_) return;
  auto waiting = queue_->cancel(request_id);
  if (!waiting) return;
  out.events.emplace_back(
      partition_event::QueueOutcome{waiting->request.policy_class, "cancelled"});
  out.answers.emplace_back(
      waiting->ticket,
      failure(waiting->request,
              RouteFailure{Error::unavailable,
                           fmt::format("request '{}' was cancelled by its caller while queued",
                                       request_id)}));
}

void PartitionRouter::resolve_hop(RouteRequest& request) const {
  if (request.worker_type == WorkerType::Aggregated &&
      selector_.workers(WorkerType::Aggregated).empty() &&
      !selector_.workers(WorkerType::Decode).empty()) {
    // A client that names no role reaches a model served only by prefill and decode workers.
    request.worker_type = WorkerType::Decode;
  }
  // A pin names the worker that serves the request: it runs there alone.
  if (request.worker_type != WorkerType::Decode || request.selection.pinned_worker) {
    request.hop = RouteHop::single;
  }
}

std::expected<DisaggregationDecision, RouteFailure> PartitionRouter::plan_disaggregation(
    RouteRequest& request, TimePoint now) {
  // The decode worker the policy would choose, and what it would compute there: a probe books
  // nothing.
  request.query_only = true;
  auto best_decode = selector_.route(request, now);
  request.query_only = false;
  if (!best_decode) return std::unexpected(std::move(best_decode.error()));
  DisaggregationDecision decision{.decode_uncached_tokens = best_decode->uncached_prefill_tokens,
                                  .transfer_valid = disaggregation_.transfer_valid};
  request.worker_type = WorkerType::Prefill;
  const std::optional<std::uint64_t> prefill_work = selector_.least_prefill_work(request);
  request.worker_type = WorkerType::Decode;
  if (!prefill_work) {
    decision.reason = DisaggregationReason::no_prefill_worker;
  } else if (decision.decode_uncached_tokens < disaggregation_.min_uncached_tokens) {
    decision.reason = DisaggregationReason::short_prompt;
  } else if (disaggregation_.prefill_queue_check &&
             *prefill_work > selector_.queued_prefill_tokens(best_decode->worker) +
                                 decision.decode_uncached_tokens) {
    decision.reason = DisaggregationReason::prefill_queue;
  } else {
    decision.reason = DisaggregationReason::disaggregated;
  }
  return decision;
}

RouteReply PartitionRouter::select(RouteRequest& request, TimePoint now, PartitionEffects& out) {
  const auto started = options_.stopwatch ? options_.stopwatch->now() : TimePoint{};
  std::optional<DisaggregationDecision> decision;
  if (request.hop == RouteHop::plan && !request.query_only) {
    auto planned = plan_disaggregation(request, now);
    if (!planned) return failure(request, std::move(planned.error()));
    decision = *planned;
    out.events.emplace_back(partition_event::DisaggregationDecided{decision->reason});
    // The prefill hop is no part of the session: affinity follows the decode worker.
    if (decision->prefill_hop()) request.worker_type = WorkerType::Prefill;
  }
  std::expected<RouteOutcome, RouteFailure> routed = std::unexpected(RouteFailure{});
  if (decision && decision->prefill_hop()) {
    routed = selector_.route(request, now);
  } else if (auto with_affinity = route_with_session_affinity(selector_, affinity_, request, now)) {
    routed = std::move(with_affinity->outcome);
  } else {
    routed = std::unexpected(std::move(with_affinity.error()));
  }
  RouteReply reply{std::move(routed), selector_.policy_name(request.worker_type), {}, {}, decision};
  if (options_.stopwatch) {
    const std::chrono::duration<double> elapsed = options_.stopwatch->now() - started;
    out.events.emplace_back(partition_event::SelectionTimed{elapsed.count()});
  }
  if (reply.result) {
    const auto* entry =
        selector_.partition_workers().catalog().find(reply.result->worker.worker_id);
    if (entry != nullptr) {
      reply.generate_subject = entry->registration.generate_subject;
      reply.http_url = entry->registration.http_url;
    }
    if (!request.query_only) record_ceilings(request, out);
  }
  return reply;
}

// Only token blocks: the `estimate` mode's text blocks are bytes, not tokens, and never meet the
// engines' caches.
void PartitionRouter::record_ceilings(const RouteRequest& request, PartitionEffects& out) {
  const selection::SelectionRequest& selection = request.selection;
  if (!ceilings_ || selection.prompt_keys != selection::PromptKeys::kv_blocks) return;
  due_ceilings_.push_back({selection.block_hashes, selection.prompt_tokens});
  out.ceilings_due = true;
  // An owner that never records them does not grow this without bound.
  if (due_ceilings_.size() >= kMaxDueCeilings) record_due_ceilings(out);
}

void PartitionRouter::record_due_ceilings(PartitionEffects& out) {
  if (due_ceilings_.empty()) return;
  if (!fleet_kv_blocks_) {
    // A worker that registered no capacity adds none: the capacity ceiling is that of the KV
    // memory the fleet announced (0 when no worker did).
    std::uint64_t total = 0;
    for (const auto& [id, entry] : selector_.partition_workers().catalog().entries()) {
      total +=
          entry.registration.total_kv_blocks.value_or(0) * entry.registration.data_parallel_size;
    }
    fleet_kv_blocks_ = total;
  }
  for (const DueCeilings& due : due_ceilings_) {
    const auto cached = ceilings_->record(due.block_hashes, due.prompt_tokens,
                                          selector_.block_size(), *fleet_kv_blocks_);
    out.events.emplace_back(partition_event::CeilingsRecorded{
        due.prompt_tokens, cached.workload_tokens, cached.capacity_tokens});
  }
  due_ceilings_.clear();
}

void PartitionRouter::note_fleet_changed(PartitionEffects& out) {
  out.fleet_changed = true;
  fleet_kv_blocks_.reset();
}

RouteReply PartitionRouter::failure(const RouteRequest& request, RouteFailure failure) const {
  return RouteReply{
      std::unexpected(std::move(failure)), selector_.policy_name(request.worker_type), {}};
}

RouteFailure PartitionRouter::not_owned() const {
  return RouteFailure{Error::unavailable,
                      fmt::format("partition {} is not owned by this node (its lease is not held "
                                  "or not renewed in time); retry",
                                  label_)};
}

std::optional<RouteReply> PartitionRouter::offer_to_queue(RouteRequest& request, RouteTicket ticket,
                                                          TimePoint now, PartitionEffects& out) {
  if (auto prepared = selector_.prepare(request, now); !prepared) {
    return failure(request, std::move(prepared.error()));
  }
  auto admission = queue_->offer(selector_, request, ticket, now);
  if (!admission) {
    out.events.emplace_back(partition_event::QueueOutcome{
        request.policy_class,
        admission.error().code == Error::overloaded ? "queue_full" : "refused"});
    return failure(request, std::move(admission.error()));
  }
  if (*admission == PartitionQueue::Admission::route_now) return select(request, now, out);
  // Queued; freed capacity may take it in this same turn (its answer is then in `out`).
  drain_queue(now, out);
  const auto own =
      std::ranges::find(out.answers, ticket, &std::pair<RouteTicket, RouteReply>::first);
  if (own == out.answers.end()) return std::nullopt;
  RouteReply reply = std::move(own->second);
  out.answers.erase(own);
  return reply;
}

// Dispatches what freed capacity allows, in the queue's order, each booked before the next is
// checked; then asks to be woken for what still waits.
void PartitionRouter::drain_queue(TimePoint now, PartitionEffects& out) {
  if (!queue_ || queue_->empty()) return;
  expire_queue(now, out);
  queue_->drain(selector_, [this, now, &out](WaitingRoute&& waiting) {
    const std::chrono::duration<double> waited = now - waiting.enqueued_at;
    out.events.emplace_back(
        partition_event::QueueWaited{waiting.request.policy_class, waited.count()});
    out.events.emplace_back(
        partition_event::QueueOutcome{waiting.request.policy_class, "dispatched"});
    RouteReply reply = select(waiting.request, now, out);
    out.answers.emplace_back(waiting.ticket, std::move(reply));
  });
  arm_wake(out);
}

// Answers the waiting requests whose due time or wait limit passed.
void PartitionRouter::expire_queue(TimePoint now, PartitionEffects& out) {
  for (RefusedRoute& refused : queue_->expire(now)) {
    out.events.emplace_back(partition_event::QueueOutcome{refused.waiting.request.policy_class,
                                                          as_str(refused.failure.code)});
    out.answers.emplace_back(refused.waiting.ticket,
                             failure(refused.waiting.request, std::move(refused.failure)));
  }
}

// Asks for one wake-up at the queue's next due time or wait limit, unless one is armed for that
// time or earlier.
void PartitionRouter::arm_wake(PartitionEffects& out) {
  const auto next = queue_->next_expiry();
  if (!next || (wake_armed_for_ && *wake_armed_for_ <= *next)) return;
  wake_armed_for_ = next;
  out.wake_at = next;
}

void PartitionRouter::apply_affinity(const BookingChange& change, TimePoint now,
                                     PartitionEffects& out) {
  const std::string& request_id = change.request_id;
  AffinityCommit committed = AffinityCommit::untracked;
  switch (change.affinity) {
    case AffinityAction::none:
      return;
    case AffinityAction::commit:
      committed = affinity_.commit(request_id, now);
      break;
    case AffinityAction::abandon:
      (void)affinity_.abandon(request_id, now);
      return;
    case AffinityAction::finish:
      // A route-mode client may report only its completion: that commits as a first token would.
      if (change.release && change.end == discovery::BookingEnd::completed) {
        committed = affinity_.complete(request_id, now);
      } else {
        (void)affinity_.finish(request_id, now);
      }
      break;
  }
  if (committed == AffinityCommit::rebound) {
    out.events.emplace_back(partition_event::SessionRebound{});
  }
}

void PartitionRouter::apply_health(const WorkerHealthReport& report, TimePoint now,
                                   PartitionEffects& out) {
  const auto verdict = selector_.report_health(report, now);
  if (!verdict || !report.failure) return;
  out.events.emplace_back(partition_event::WorkerFailed{report.worker, *report.failure});
  if (verdict->ejected) {
    out.events.emplace_back(
        partition_event::WorkerEjected{report.worker, verdict->backoff, *report.failure,
                                       selector_.health().config().consecutive_failures});
  } else if (verdict->capped) {
    out.events.emplace_back(
        partition_event::EjectionCapped{report.worker, selector_.health().ejected(),
                                        selector_.partition_workers().catalog().size()});
  }
}

// ---- worker messages --------------------------------------------------------------------------

void PartitionRouter::register_worker(discovery::WorkerRegistration registration, TimePoint now,
                                      PartitionEffects& out) {
  const WorkerId id = registration.worker_id;
  if (auto over = take_ranks(registration)) return refuse("registration", std::move(*over), out);
  auto change = selector_.register_worker(std::move(registration), now);
  // A refused registration, or one with fewer ranks than before, gives ranks back.
  settle_ranks();
  if (!change) return refuse("registration", change.error().message(), out);
  if (*change == discovery::RegistrationChange::refreshed) {
    heard_from(id, now, out);
    return finish(out);
  }
  forget_dumps(id);
  out.events.emplace_back(
      partition_event::WorkerJoined{id, *change != discovery::RegistrationChange::added});
  note_fleet_changed(out);
  // What the worker cached before this node knew of it (the node started, or took the partition
  // over, while the worker sat idle) reaches the index only through a dump, since no event gap
  // would ever show it: each rank's is asked for once, paced like a reconnect's resync.
  const auto* entry = selector_.partition_workers().catalog().find(id);
  if (entry != nullptr && entry->registration.publishes_kv_events) {
    for (DpRank rank = 0; rank < entry->registration.data_parallel_size; ++rank) {
      resync_dumps_.push_back({id, rank});
    }
    send_resync_dumps(now, out);
  }
  drain_queue(now, out);
  finish(out);
}

void PartitionRouter::heartbeat(const discovery::WorkerLiveness& heartbeat, TimePoint now,
                                PartitionEffects& out) {
  auto renewed = selector_.heartbeat(heartbeat.worker_id, heartbeat.incarnation, now);
  if (!renewed) return refuse("heartbeat", std::string{discovery::as_str(renewed.error())}, out);
  heard_from(heartbeat.worker_id, now, out);
}

void PartitionRouter::deregister(const discovery::WorkerLiveness& deregistration, TimePoint now,
                                 PartitionEffects& out) {
  (void)now;
  auto removed = selector_.deregister(deregistration.worker_id, deregistration.incarnation);
  if (!removed) {
    return refuse("deregistration", std::string{discovery::as_str(removed.error())}, out);
  }
  out.events.emplace_back(partition_event::WorkerLeft{deregistration.worker_id, false});
  settle_ranks();
  forget_dumps(deregistration.worker_id);
  note_fleet_changed(out);
  out.removed.push_back(deregistration.worker_id);
  finish(out);
}

void PartitionRouter::update_load(const discovery::WorkerLoadReport& report, TimePoint now,
                                  PartitionEffects& out) {
  const auto* entry = selector_.partition_workers().catalog().find(report.worker_id);
  if (entry == nullptr || entry->registration.incarnation != report.incarnation) {
    return refuse("load", "unknown worker or stale incarnation", out);
  }
  for (const auto& [rank, load] : report.ranks) {
    auto updated = selector_.update_load({report.worker_id, rank}, load);
    if (!updated) return refuse("load", std::string{discovery::as_str(updated.error())}, out);
  }
  report_kv_usage(out);
  drain_queue(now, out);
  finish(out);
}

void PartitionRouter::apply_kv_events(const KvEventBatch& batch, TimePoint now,
                                      PartitionEffects& out) {
  auto outcome = selector_.apply_kv_events(batch);
  if (!outcome) return refuse("kv_events", std::string{discovery::as_str(outcome.error())}, out);
  if (outcome->rejected_events > 0 && outcome->first_error) {
    refuse("kv_event", std::string{discovery::as_str(*outcome->first_error)}, out);
  }
  if (outcome->gap) {
    out.events.emplace_back(partition_event::KvEventGap{});
    request_dump(batch.worker, now, out);
  }
  heard_from(batch.worker.worker_id, now, out);
}

void PartitionRouter::load_kv_dump(const KvDump& dump, TimePoint now, PartitionEffects& out) {
  (void)now;
  auto loaded = selector_.load_kv_dump(dump);
  if (!loaded) return refuse("kv_dump", std::string{discovery::as_str(loaded.error())}, out);
  dump_requested_.erase(dump.worker);
}

void PartitionRouter::refuse(std::string_view kind, std::string reason, PartitionEffects& out) {
  out.events.emplace_back(partition_event::MessageRefused{kind, std::move(reason)});
}

// Asks the worker for a dump of one rank, at most once per retry period.
void PartitionRouter::request_dump(WorkerWithDpRank worker, TimePoint now, PartitionEffects& out) {
  auto [it, inserted] = dump_requested_.try_emplace(worker, now);
  if (!inserted) {
    if (now - it->second < options_.dump_retry) return;
    it->second = now;
  }
  const auto* entry = selector_.partition_workers().catalog().find(worker.worker_id);
  if (entry == nullptr || entry->registration.dump_subject.empty()) return;
  out.dumps.push_back({entry->registration.dump_subject, worker});
}

// Forgets the dump requests of every rank of a worker, and the resync dumps it still owed.
void PartitionRouter::forget_dumps(WorkerId id) {
  absl::erase_if(dump_requested_, [id](const auto& entry) { return entry.first.worker_id == id; });
  resync_wanted_.erase(id);
  std::erase_if(resync_dumps_, [id](const WorkerWithDpRank& rank) { return rank.worker_id == id; });
}

// After a NATS reconnect: asks for the queued resync dumps that this tick's budget allows.
void PartitionRouter::send_resync_dumps(TimePoint now, PartitionEffects& out) {
  while (resync_budget_ > 0 && !resync_dumps_.empty()) {
    const WorkerWithDpRank rank = resync_dumps_.front();
    resync_dumps_.pop_front();
    --resync_budget_;
    request_dump(rank, now, out);
  }
}

// A message from worker `id` arrived. The first one after a NATS reconnect shows that the worker
// is reachable again: its ranks' dumps are queued (a dump asked for before that might be lost,
// while the worker itself was still reconnecting).
void PartitionRouter::heard_from(WorkerId id, TimePoint now, PartitionEffects& out) {
  if (resync_wanted_.empty()) return;
  const auto wanted = resync_wanted_.find(id);
  if (wanted == resync_wanted_.end()) return;
  resync_wanted_.erase(wanted);
  const auto* entry = selector_.partition_workers().catalog().find(id);
  if (entry == nullptr) return;
  for (DpRank rank = 0; rank < entry->registration.data_parallel_size; ++rank) {
    resync_dumps_.push_back({id, rank});
  }
  send_resync_dumps(now, out);
}

// The partition's KV blocks, used over total across its ranks, when the usage moved by at least
// 0.01 since it was last reported. Used blocks are the confirmed ones of the last report plus the
// bookings' change since, as the busy signals count them (a rank without a report or booking
// counts its total only). A rank without a capacity is left out of both: its usage is unknown.
// Nothing is reported while no rank has one. The classifier weighs partitions by their totals.
void PartitionRouter::report_kv_usage(PartitionEffects& out) {
  if (!options_.report_kv_usage) return;
  const discovery::PartitionWorkers& workers = selector_.partition_workers();
  std::uint64_t used = 0;
  std::uint64_t total = 0;
  for (const auto& [id, entry] : workers.catalog().entries()) {
    for (DpRank rank = 0; rank < entry.registration.data_parallel_size; ++rank) {
      const auto view = workers.load().rank_load({id, rank});
      if (!view || !view->total_kv_blocks) continue;
      const std::uint64_t capacity = *view->total_kv_blocks;
      total += capacity;
      const std::int64_t rank_used =
          static_cast<std::int64_t>(view->confirmed ? view->confirmed->kv_blocks_used : 0) +
          view->blocks_since_report;
      used += std::min<std::uint64_t>(rank_used < 0 ? 0 : static_cast<std::uint64_t>(rank_used),
                                      capacity);
    }
  }
  if (total == 0) return;
  const double usage = static_cast<double>(used) / static_cast<double>(total);
  if (reported_kv_usage_ && std::abs(usage - *reported_kv_usage_) < 0.01) return;
  reported_kv_usage_ = usage;
  out.kv_usage = PartitionKvUsage{used, total};
}

// ---- time and links ---------------------------------------------------------------------------

void PartitionRouter::tick(TimePoint now, PartitionEffects& out) {
  const std::size_t first_removed = out.removed.size();
  selector_.expire(now, out.removed);
  affinity_.expire(now);
  if (out.removed.size() > first_removed) {
    settle_ranks();
    for (std::size_t i = first_removed; i < out.removed.size(); ++i) {
      out.events.emplace_back(partition_event::WorkerLeft{out.removed[i], true});
      forget_dumps(out.removed[i]);
    }
    note_fleet_changed(out);
  }
  // Expired bookings free capacity; a removed worker's waiting requests get their answer.
  drain_queue(now, out);
  answer_overdue_awaiting(now, out);
  // A worker not heard from within its grace period after a reconnect owes no dump (it expires,
  // or a later event gap asks for one).
  absl::erase_if(resync_wanted_, [now](const auto& wanted) { return wanted.second <= now; });
  resync_budget_ = options_.resync_dumps_per_tick;
  send_resync_dumps(now, out);
  finish(out);
}

void PartitionRouter::wake(TimePoint now, PartitionEffects& out) {
  wake_armed_for_.reset();
  if (!queue_) return;
  expire_queue(now, out);
  drain_queue(now, out);
  arm_wake(out);
  finish(out);
}

void PartitionRouter::set_link(bool connected, TimePoint now, PartitionEffects& out) {
  if (!connected) {
    selector_.hold_liveness();
    return;
  }
  const discovery::LivenessGrace grace = selector_.resume_liveness(now);
  const discovery::WorkerCatalog& catalog = selector_.partition_workers().catalog();
  for (const auto& [id, entry] : catalog.entries()) {
    if (entry.registration.publishes_kv_events) {
      resync_wanted_.insert_or_assign(id, now + entry.registration.liveness_ttl);
    }
  }
  out.events.emplace_back(
      partition_event::LinkRestored{catalog.size(), grace.held_over, grace.renewed});
}

void PartitionRouter::set_owned_until(TimePoint owned_until, TimePoint now, PartitionEffects& out) {
  owned_until_ = owned_until;
  if (now >= owned_until || awaiting_ownership_.empty()) return;
  auto awaiting = std::exchange(awaiting_ownership_, {});
  for (auto& waiting : awaiting) {
    // Each is decided as a newcomer would be now (the queue, when it runs, included).
    if (auto reply = route(waiting.request, waiting.ticket, now, out)) {
      out.answers.emplace_back(waiting.ticket, std::move(*reply));
    }
  }
}

// Cluster mode: refuses the requests that waited for the lease longer than ownership_wait.
void PartitionRouter::answer_overdue_awaiting(TimePoint now, PartitionEffects& out) {
  auto overdue = std::ranges::partition(awaiting_ownership_,
                                        [now](const auto& waiting) { return waiting.until > now; });
  for (auto it = overdue.begin(); it != overdue.end(); ++it) {
    out.answers.emplace_back(it->ticket, failure(it->request, not_owned()));
  }
  awaiting_ownership_.erase(overdue.begin(), overdue.end());
}

void PartitionRouter::shut_down(PartitionEffects& out) {
  for (auto& waiting : awaiting_ownership_) {
    out.answers.emplace_back(
        waiting.ticket, failure(waiting.request, RouteFailure{Error::unavailable,
                                                              "the partition's selector stopped"}));
  }
  awaiting_ownership_.clear();
  if (!queue_) return;
  // Every waiting request is past a deadline of TimePoint::max(): the queue hands each one back.
  for (RefusedRoute& refused : queue_->expire(TimePoint::max())) {
    out.answers.emplace_back(
        refused.waiting.ticket,
        failure(refused.waiting.request,
                RouteFailure{Error::unavailable, "the router node is shutting down"}));
  }
}

void PartitionRouter::finish(PartitionEffects& out) {
  for (WorkerId id : selector_.take_returned()) {
    out.events.emplace_back(partition_event::WorkerReturned{id});
  }
}

// ---- reading ----------------------------------------------------------------------------------

PartitionGauges PartitionRouter::gauges() const {
  const discovery::PartitionWorkers& workers = selector_.partition_workers();
  return PartitionGauges{.bookings_open = workers.load().open_bookings(),
                         .booked_blocks = workers.load().booked_prompt_blocks(),
                         .workers = workers.catalog().size(),
                         .index_blocks = workers.index().node_count(),
                         .session_bindings = affinity_.size(),
                         .workers_ejected = selector_.health().ejected(),
                         .queued = queue_ ? queue_->size() : 0};
}

std::vector<classifiers::PolicyClassDepth> PartitionRouter::queue_depths() const {
  if (!queue_) return {};
  return queue_->depths();
}

PartitionFleet PartitionRouter::fleet() const {
  PartitionFleet fleet{options_.options.partition.model,
                       options_.options.partition.routing_group,
                       selector_.block_size(),
                       {}};
  for (const auto& [id, entry] : selector_.partition_workers().catalog().entries()) {
    for (DpRank rank = 0; rank < entry.registration.data_parallel_size; ++rank) {
      fleet.workers.emplace_back(WorkerWithDpRank{id, rank}, entry.registration.total_kv_blocks);
    }
  }
  return fleet;
}

}  // namespace kvr
