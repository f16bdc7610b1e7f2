#include "actors/lifecycle/lifecycle_actor.hpp"

#include <algorithm>
#include <vector>

#include <caf/actor_system.hpp>
#include <caf/delegated.hpp>
#include <caf/exit_reason.hpp>
#include <caf/sec.hpp>
#include <caf/typed_event_based_actor.hpp>
#include <fmt/format.h>

#include "actors/actor_types.hpp"
#include "actors/support/request_error.hpp"
#include "messages/metrics/node_metrics.hpp"

namespace kvr::actors {
namespace {

using Self = lifecycle_actor::stateful_pointer<LifecycleActorState>;

// A prefill hop answers with one token: a worker that streams more is misbehaving.
constexpr std::size_t kMaxPrefillChunks = 4;

std::string stream_subject(Self self, std::uint64_t stream_id) {
  return fmt::format("{}.{}", self->state.config.stream_inbox_prefix, stream_id);
}

metrics::NodeMetrics node_metrics(Self self) {
  return metrics::NodeMetrics{*self->state.config.metrics};
}

void update_in_flight(Self self) {
  node_metrics(self).generate_in_flight().set(static_cast<double>(self->state.flights.size()));
}

GenerateFlight* find_flight(Self self, std::uint64_t stream_id) {
  auto it = self->state.flights.find(stream_id);
  return it == self->state.flights.end() ? nullptr : &it->second;
}

// Sends the first RouteDecision (once): the response to an actor client, else on the request's
// reply subject.
void publish_decision(Self self, GenerateFlight& flight, const v1::RouteDecision& decision) {
  if (flight.stream_actor) {
    if (flight.decision_promise.pending()) {
      flight.decision_promise.deliver(RouteDecisionMessage{decision});
    }
    return;
  }
  if (flight.reply_subject.empty()) return;
  self->state.relays.publish(self, *self->state.config.publisher, flight.reply_subject,
                             decision.SerializeAsString());
  flight.reply_subject.clear();
}

// Sends one chunk of the client's stream: to its actor, else on its stream subject.
void send_chunk(Self self, const GenerateFlight& flight, const v1::GenerateChunk& chunk) {
  if (flight.stream_actor) {
    self->send(flight.stream_actor, chunk_atom::value, GenerateChunkMessage{chunk});
  } else {
    self->state.relays.publish(self, *self->state.config.publisher, flight.request.stream_subject,
                               chunk.SerializeAsString());
  }
}

// Counts an actor client's flights: the first is monitored, the last stops the monitoring.
void track_client(Self self, const stream_client_actor& client) {
  if (++self->state.monitored_clients[client.address()] == 1) self->monitor(client);
}
void untrack_client(Self self, const stream_client_actor& client) {
  auto& clients = self->state.monitored_clients;
  const auto it = clients.find(client.address());
  if (it == clients.end() || --it->second > 0) return;
  self->demonitor(client.address());
  clients.erase(it);
}

// Sends a booking change to the partition's selector; a failure is only logged (the selector's
// booking expiry releases a booking whose update was lost).
void send_booking(Self self, const GenerateFlight& flight, bool release, discovery::BookingEnd end,
                  AffinityAction affinity, std::optional<WorkerHealthReport> health = {}) {
  auto& config = self->state.config;
  self->request(
          self->state.routes.selector_for(flight.request.route.partition), config.selector_timeout,
          booking_atom::value,
          BookingUpdate{flight.request.route.partition,
                        {flight.request.route.id(), release, end, affinity, std::move(health)}})
      .then([](const BookingUpdateReply&) {},
            [self](const caf::error& error) {
              self->state.config.log->warn(
                  "generate-booking", fmt::format("kvr node: generate booking update failed: {}",
                                                  self->system().render(error)));
            });
}

// Forgets a flight that ended and has no route request in flight.
void maybe_forget(Self self, std::uint64_t stream_id) {
  auto& state = self->state;
  auto it = state.flights.find(stream_id);
  if (it == state.flights.end()) return;
  if (!it->second.lifecycle.ended() || it->second.route_pending) return;
  auto index = state.by_request_id.find(it->second.request.route.id());
  if (index != state.by_request_id.end() && index->second == stream_id) {
    state.by_request_id.erase(index);
  }
  if (it->second.stream_actor) untrack_client(self, it->second.stream_actor);
  state.flights.erase(it);
  update_in_flight(self);
}

// The response is flowing: remembers when its last chunk came and, unless a check is pending
// already, checks for a stall one stall timeout from now (one timer per quiet period, not one
// per chunk).
void watch_for_stall(Self self, std::uint64_t stream_id, GenerateFlight& flight) {
  flight.last_chunk_at = self->clock().now();
  if (flight.stall_check_pending) return;
  flight.stall_check_pending = true;
  self->delayed_send(self, self->state.config.stream_stall_timeout, stall_atom::value, stream_id,
                     flight.attempt);
}

void carry_out(Self self, std::uint64_t stream_id, LifecycleStep step,
               const v1::GenerateChunk* chunk);

// Feeds the outcome of one lifecycle event; a refused event changes nothing.
void apply(Self self, std::uint64_t stream_id, LifecycleResult result,
           const v1::GenerateChunk* chunk = nullptr) {
  if (!result) {
    if (result.error().kind == LifecycleError::Kind::after_end ||
        result.error().kind == LifecycleError::Kind::stale_worker) {
      // Chunks racing a cancel or a retry: expected, only counted.
      node_metrics(self).generate_stale_chunks().add();
    } else {
      self->state.config.log->warn(
          "generate-lifecycle",
          fmt::format("kvr node: lifecycle refused an event: {}", result.error().message));
    }
    maybe_forget(self, stream_id);
    return;
  }
  carry_out(self, stream_id, std::move(*result), chunk);
}

// Tells the worker serving `generate_subject` to stop request `request_id`.
void cancel_at_worker(Self self, const std::string& request_id,
                      const std::string& generate_subject) {
  v1::GenerateCancel cancel;
  cancel.set_request_id(request_id);
  self->state.config.publisher->publish(worker_cancel_subject(generate_subject),
                                        cancel.SerializeAsString());
}

void route_flight(Self self, std::uint64_t stream_id);
void cancel_prefill(Self self, GenerateFlight& flight);
void fail_prefill(Self self, std::uint64_t stream_id, FailureCause cause, std::string_view reason,
                  bool tell_worker);

// Sends the request to the worker it was just routed to and arms its first-token deadline.
void dispatch(Self self, std::uint64_t stream_id) {
  GenerateFlight* flight = find_flight(self, stream_id);
  if (flight == nullptr || !flight->lifecycle.worker()) return;
  auto& config = self->state.config;
  const WorkerWithDpRank worker = *flight->lifecycle.worker();
  ++flight->attempt;
  WorkerHop hop;
  if (flight->transfer) hop.kv_transfer_params = flight->transfer->params;
  bool sent = false;
  if (!flight->generate_subject.empty()) {
    sent = config.publisher->publish(
        flight->generate_subject,
        encode_worker_generate_request(flight->request, worker.dp_rank,
                                       stream_subject(self, stream_id), hop)
            .SerializeAsString());
  }
  if (flight->handoff_from) {
    const std::chrono::duration<double> handoff = self->clock().now() - *flight->handoff_from;
    node_metrics(self).decode_handoff().observe(handoff.count());
    flight->handoff_from.reset();
  }
  if (!sent) {
    flight->failure_cause = FailureCause::dispatch_failed;
    apply(self, stream_id,
          flight->lifecycle.worker_failed(
              worker.worker_id, flight->generate_subject.empty()
                                    ? "the worker registered no generate subject"
                                    : "the request could not be published to the worker"));
    return;
  }
  self->delayed_send(self, config.first_token_timeout, deadline_atom::value, stream_id,
                     flight->attempt);
}

void carry_out(Self self, std::uint64_t stream_id, LifecycleStep step,
               const v1::GenerateChunk* chunk) {
  GenerateFlight* flight = find_flight(self, stream_id);
  if (flight == nullptr) return;
  auto& config = self->state.config;
  const std::string& request_id = flight->request.route.id();
  const auto worker = flight->lifecycle.worker();
  if (step.cancel_at_worker && !flight->generate_subject.empty()) {
    cancel_at_worker(self, request_id, flight->generate_subject);
  }
  if (step.first_token) {
    send_booking(self, *flight, false, discovery::BookingEnd::completed,
                 step.commit_affinity ? AffinityAction::commit : AffinityAction::none,
                 worker ? std::optional{WorkerHealthReport{worker->worker_id, {}}} : std::nullopt);
  }
  if (step.release) {
    std::optional<WorkerHealthReport> health;
    if (flight->failure_cause && worker) {
      health = WorkerHealthReport{worker->worker_id, flight->failure_cause};
    }
    flight->failure_cause.reset();
    send_booking(self, *flight, true, *step.release,
                 step.abandon_affinity  ? AffinityAction::abandon
                 : step.finish_affinity ? AffinityAction::finish
                                        : AffinityAction::none,
                 std::move(health));
  }
  if (config.classifier) {
    if (step.context_tokens) {
      self->send(config.classifier, classify_atom::value, flight->request.route.partition.model,
                 flight->lifecycle.request_id(), *step.context_tokens);
    }
    for (auto& event : step.classifier_events) {
      self->send(config.classifier, classify_atom::value,
                 ClassifierEvent{flight->request.route.partition.model, std::move(event)});
    }
  }
  if (step.first_token && chunk != nullptr &&
      !std::exchange(flight->cache_outcome_recorded, true)) {
    // The worker's first chunk carries the prompt tokens its engine served from cache.
    metrics::record_cache_outcome(node_metrics(self), *config.cache_mismatch, *config.log,
                                  flight->request.route.partition.model,
                                  flight->request.route.selection.prompt_tokens,
                                  flight->predicted_cached_tokens, chunk->cached_prompt_tokens());
  }
  if (step.forward_chunk && chunk != nullptr) {
    send_chunk(self, *flight, *chunk);
    ++flight->relayed;
    if (flight->lifecycle.state() == RequestState::Completed) {
      node_metrics(self).generate_outcomes("completed").add();
    } else {
      watch_for_stall(self, stream_id, *flight);
    }
  }
  if (step.end_stream) {
    const StreamEnd& end = *step.end_stream;
    publish_decision(
        self, *flight,
        encode_route_error(request_id, end.error.value_or(Error::unavailable), end.message));
    send_chunk(self, *flight, encode_end_chunk(request_id, flight->relayed, end, worker));
    ++flight->relayed;
    node_metrics(self).generate_outcomes(end.finish_reason).add();
  }
  if (step.dispatch) dispatch(self, stream_id);
  if (step.reroute) {
    node_metrics(self).generate_retries().add();
    route_flight(self, stream_id);
  }
  // A dispatch that failed at once (a generate request above NATS's payload limit, say) ended
  // the flight through a nested carry_out, which may have forgotten it.
  flight = find_flight(self, stream_id);
  if (flight == nullptr) return;
  if (flight->lifecycle.ended() && flight->prefill) {
    // Cancelled or aborted while its prefill hop ran: that worker stops, its booking ends.
    cancel_prefill(self, *flight);
  }
  maybe_forget(self, stream_id);
}

// ---- the prefill hop of a disaggregated request (docs/disaggregation.md) ----------------------

// Ends the prefill hop's booking and forgets the hop; `health`: what it says of the worker.
void end_prefill(Self self, GenerateFlight& flight, discovery::BookingEnd end,
                 std::optional<WorkerHealthReport> health) {
  send_booking(self, flight, true, end, AffinityAction::none, std::move(health));
  flight.prefill.reset();
}

void cancel_prefill(Self self, GenerateFlight& flight) {
  cancel_at_worker(self, flight.request.route.id(), flight.prefill->generate_subject);
  end_prefill(self, flight, discovery::BookingEnd::cancelled, std::nullopt);
}

// The prefill hop failed: planned again without that worker (max_retries times), else the
// request ends with an explicit error.
void fail_prefill(Self self, std::uint64_t stream_id, FailureCause cause, std::string_view reason,
                  bool tell_worker) {
  GenerateFlight* flight = find_flight(self, stream_id);
  if (flight == nullptr || !flight->prefill) return;
  const WorkerId worker = flight->prefill->worker.worker_id;
  if (tell_worker) {
    cancel_at_worker(self, flight->request.route.id(), flight->prefill->generate_subject);
  }
  end_prefill(self, *flight, discovery::BookingEnd::failed, WorkerHealthReport{worker, cause});
  flight->failed_prefill_workers.push_back(worker);
  if (flight->prefill_retries < self->state.config.lifecycle.max_retries) {
    // Planned again without the failed worker: another prefill worker, or the decode worker alone
    // when none is left.
    ++flight->prefill_retries;
    node_metrics(self).generate_retries().add();
    route_flight(self, stream_id);
    return;
  }
  apply(self, stream_id,
        flight->lifecycle.route_failed(
            Error::worker_failed,
            fmt::format("the prefill hop failed on worker {}: {}", worker, reason)));
}

// Sends the prefill hop to its worker: one output token, the KV kept for the decode worker.
void dispatch_prefill(Self self, std::uint64_t stream_id) {
  GenerateFlight* flight = find_flight(self, stream_id);
  if (flight == nullptr || !flight->prefill) return;
  auto& config = self->state.config;
  ++flight->attempt;
  const PrefillHop& hop = *flight->prefill;
  const bool sent =
      !hop.generate_subject.empty() &&
      config.publisher->publish(
          hop.generate_subject,
          encode_worker_generate_request(
              flight->request, hop.worker.dp_rank, stream_subject(self, stream_id),
              WorkerHop{.max_output_tokens = 1, .kv_transfer_params = kRemoteDecodeTransferParams})
              .SerializeAsString());
  if (!sent) {
    fail_prefill(self, stream_id, FailureCause::dispatch_failed,
                 hop.generate_subject.empty() ? "the worker registered no generate subject"
                                              : "the request could not be published to the worker",
                 false);
    return;
  }
  self->delayed_send(self, config.first_token_timeout, deadline_atom::value, stream_id,
                     flight->attempt);
}

void start_prefill(Self self, std::uint64_t stream_id, const SelectorReply& reply) {
  GenerateFlight* flight = find_flight(self, stream_id);
  if (flight == nullptr) return;
  const RouteOutcome& outcome = *reply.result;
  if (flight->lifecycle.ended()) {
    // Cancelled while it was being routed: the late booking is undone.
    send_booking(self, *flight, true, discovery::BookingEnd::cancelled, AffinityAction::none);
    maybe_forget(self, stream_id);
    return;
  }
  const std::uint64_t prompt_tokens = flight->request.route.selection.prompt_tokens;
  flight->prefill = PrefillHop{
      .worker = outcome.worker,
      .generate_subject = reply.generate_subject,
      .routed_at = self->clock().now(),
      .predicted_cached_tokens =
          prompt_tokens - std::min(prompt_tokens, outcome.uncached_prefill_tokens),
  };
  node_metrics(self).route_decisions(outcome.worker.worker_id).add();
  // The client's decision names the worker that starts its request; its chunks name the decode
  // worker that generates them.
  publish_decision(self, *flight,
                   encode_route_success(flight->request.route.id(), outcome,
                                        RouteSuccessInfo{.booking_id = {},
                                                         .booking_ttl = {},
                                                         .policy = reply.policy,
                                                         .generate_subject = reply.generate_subject,
                                                         .http_url = reply.http_url}));
  dispatch_prefill(self, stream_id);
}

// The prefill hop's one token ended the generation: the prefill worker served the request, and
// its chunks are the client's stream (booking, classifier events and stream as for one hop).
void serve_from_prefill(Self self, std::uint64_t stream_id) {
  GenerateFlight* flight = find_flight(self, stream_id);
  const PrefillHop hop = std::move(*flight->prefill);
  flight->prefill.reset();
  flight->generate_subject = hop.generate_subject;
  ++flight->attempt;  // the prefill's deadline no longer applies
  auto step = flight->lifecycle.routed(hop.worker);
  if (!step) {
    apply(self, stream_id, std::move(step));
    return;
  }
  step->dispatch = false;  // it has answered already
  carry_out(self, stream_id, std::move(*step), nullptr);
  for (const v1::GenerateChunk& chunk : hop.chunks) {
    flight = find_flight(self, stream_id);
    if (flight == nullptr) return;
    apply(self, stream_id, flight->lifecycle.on_chunk(decode_stream_chunk(chunk)), &chunk);
  }
}

// A chunk of the prefill worker: its answer (the final chunk, with the transfer parameters)
// sends the request on to a decode worker; its token never reaches the client, whose stream
// starts with the decode worker's.
void on_prefill_chunk(Self self, std::uint64_t stream_id, const v1::GenerateChunk& chunk) {
  GenerateFlight* flight = find_flight(self, stream_id);
  PrefillHop& hop = *flight->prefill;
  if (chunk.worker_id() != hop.worker.worker_id || chunk.dp_rank() != hop.worker.dp_rank) {
    node_metrics(self).generate_stale_chunks().add();
    return;
  }
  if (chunk.has_error() || chunk.finish_reason() == "error") {
    fail_prefill(
        self, stream_id, FailureCause::worker_failed,
        chunk.error().message().empty() ? "the worker reported an error" : chunk.error().message(),
        false);
    return;
  }
  const std::string& model = flight->request.route.partition.model;
  if (!std::exchange(hop.responded, true)) {
    if (!std::exchange(flight->cache_outcome_recorded, true)) {
      auto& config = self->state.config;
      metrics::record_cache_outcome(node_metrics(self), *config.cache_mismatch, *config.log, model,
                                    flight->request.route.selection.prompt_tokens,
                                    hop.predicted_cached_tokens, chunk.cached_prompt_tokens());
    }
    send_booking(self, *flight, false, discovery::BookingEnd::completed, AffinityAction::none,
                 WorkerHealthReport{hop.worker.worker_id, {}});
  }
  hop.chunks.push_back(chunk);
  if (!chunk.finished()) {
    if (hop.chunks.size() > kMaxPrefillChunks) {
      fail_prefill(self, stream_id, FailureCause::worker_failed,
                   "it streamed more than the one token of a prefill", true);
    }
    return;
  }
  const std::string& params = chunk.kv_transfer_params();
  if (params.empty() && chunk.finish_reason() == "stop") {
    // Its one token ended the generation (an end-of-sequence or stop token): vLLM gives no
    // transfer parameters then, and nothing is left for a decode worker.
    serve_from_prefill(self, stream_id);
    return;
  }
  std::optional<std::string> unusable = params.empty()
                                            ? std::optional<std::string>{"it carries none"}
                                            : kv_transfer_params_error(params);
  if (unusable) {
    fail_prefill(self, stream_id, FailureCause::worker_failed,
                 fmt::format("its answer has no usable kv_transfer_params: {}", *unusable), false);
    return;
  }
  const auto now = self->clock().now();
  const std::chrono::duration<double> took = now - hop.routed_at;
  node_metrics(self).prefill_hop(model).observe(took.count());
  flight->transfer = KvTransfer{params, hop.worker.worker_id, now + flight->transfer_valid};
  end_prefill(self, *flight, discovery::BookingEnd::completed, std::nullopt);
  flight->handoff_from = now;
  route_flight(self, stream_id);
}

void on_routed(Self self, std::uint64_t stream_id, SelectorReply& reply) {
  GenerateFlight* flight = find_flight(self, stream_id);
  if (flight == nullptr) return;
  flight->route_pending = false;
  const std::string request_id = flight->request.route.id();
  if (!reply.result) {
    const RouteFailure& failure = reply.result.error();
    node_metrics(self).route_errors(failure.code).add();
    publish_decision(self, *flight, encode_route_error(request_id, failure.code, failure.message));
    apply(self, stream_id, flight->lifecycle.route_failed(failure.code, failure.message));
    return;
  }
  const RouteOutcome& outcome = *reply.result;
  if (reply.disaggregation) flight->transfer_valid = reply.disaggregation->transfer_valid;
  if (reply.disaggregation && reply.disaggregation->prefill_hop()) {
    start_prefill(self, stream_id, reply);
    return;
  }
  auto step = flight->lifecycle.routed(outcome.worker);
  if (!step) {
    // Booked where the lifecycle cannot go (an excluded worker): undo it and give up.
    send_booking(self, *flight, true, discovery::BookingEnd::cancelled, AffinityAction::abandon);
    self->state.config.log->warn("generate-routed",
                                 fmt::format("kvr node: {}", step.error().message));
    apply(self, stream_id, flight->lifecycle.abort(Error::policy_failed, step.error().message));
    return;
  }
  if (step->dispatch) {
    flight->generate_subject = reply.generate_subject;
    const std::uint64_t prompt_tokens = flight->request.route.selection.prompt_tokens;
    flight->predicted_cached_tokens =
        prompt_tokens - std::min(prompt_tokens, outcome.uncached_prefill_tokens);
    node_metrics(self).route_decisions(outcome.worker.worker_id).add();
    publish_decision(
        self, *flight,
        encode_route_success(request_id, outcome,
                             RouteSuccessInfo{.booking_id = {},
                                              .booking_ttl = {},
                                              .policy = reply.policy,
                                              .generate_subject = reply.generate_subject,
                                              .http_url = reply.http_url}));
  }
  carry_out(self, stream_id, std::move(*step), nullptr);
}

// Asks the partition's selector for a worker, excluding those that failed the request.
void route_flight(Self self, std::uint64_t stream_id) {
  GenerateFlight* flight = find_flight(self, stream_id);
  if (flight == nullptr) return;
  flight->route_pending = true;
  RouteRequest request = flight->request.route;
  const auto excluded = flight->lifecycle.excluded_workers();
  request.selection.excluded_workers.assign(excluded.begin(), excluded.end());
  request.selection.excluded_workers.insert(request.selection.excluded_workers.end(),
                                            flight->failed_prefill_workers.begin(),
                                            flight->failed_prefill_workers.end());
  if (flight->transfer && self->clock().now() >= flight->transfer->valid_until) {
    flight->transfer.reset();  // too old to pull: prefilled again
  }
  if (flight->transfer) {
    request.worker_type = WorkerType::Decode;
    request.hop = RouteHop::decode_after_transfer;
  } else {
    request.hop = RouteHop::plan;
  }
  auto& config = self->state.config;
  const route_target_actor& selector = self->state.routes.selector_for(request.partition);
  self->request(selector, config.selector_timeout, route_atom::value, std::move(request))
      .then([self, stream_id](SelectorReply& reply) { on_routed(self, stream_id, reply); },
            [self, stream_id](const caf::error& error) {
              SelectorReply reply{
                  std::unexpected(RouteFailure{request_error(error),
                                               fmt::format("the selector did not answer: {}",
                                                           self->system().render(error))}),
                  {},
                  {}};
              on_routed(self, stream_id, reply);
            });
}

// Refuses a request at once: its decision (the response to an actor client, else on its reply
// subject) and its stream.
caf::result<RouteDecisionMessage> refuse(Self self, const GenerateEnvelope& envelope, Error code,
                                         const std::string& message) {
  auto& config = self->state.config;
  const std::string& request_id = envelope.request.route.id();
  node_metrics(self).route_errors(code).add();
  if (envelope.stream_actor) {
    // The decision leaves before the stream's end, as for a request that was served.
    auto promise = self->make_response_promise<RouteDecisionMessage>();
    promise.deliver(RouteDecisionMessage{encode_route_error(request_id, code, message)});
    self->send(caf::actor_cast<stream_client_actor>(envelope.stream_actor), chunk_atom::value,
               GenerateChunkMessage{encode_end_chunk(
                   request_id, 0, StreamEnd{"error", code, message}, std::nullopt)});
    return promise;
  }
  if (!envelope.reply_subject.empty()) {
    config.publisher->publish(envelope.reply_subject,
                              encode_route_error(request_id, code, message).SerializeAsString());
  }
  config.publisher->publish(
      envelope.request.stream_subject,
      encode_end_chunk(request_id, 0, StreamEnd{"error", code, message}, std::nullopt)
          .SerializeAsString());
  return caf::delegated<RouteDecisionMessage>{};  // a NATS client: answered on its subjects
}

// Ends every request in flight with an explicit `unavailable` error (a route still with its
// selector is cancelled there); returns how many ended.
std::size_t abort_every_flight(Self self, std::string_view reason) {
  std::vector<std::uint64_t> ids;
  for (const auto& [id, flight] : self->state.flights) {
    if (!flight.lifecycle.ended()) ids.push_back(id);
  }
  for (std::uint64_t id : ids) {
    GenerateFlight* flight = find_flight(self, id);
    if (flight == nullptr) continue;
    if (flight->route_pending) {
      self->state.routes.cancel_route(self, flight->request.route.partition,
                                      flight->request.route.id());
    }
    apply(self, id, flight->lifecycle.abort(Error::unavailable, reason));
  }
  return ids.size();
}

}  // namespace

lifecycle_actor::behavior_type lifecycle_behavior(Self self, LifecycleActorConfig config) {
  self->state.config = std::move(config);
  if (!self->state.config.cache_mismatch) {
    self->state.config.cache_mismatch =
        std::make_shared<metrics::CacheMismatchDetector>(self->state.config.clock);
  }
  update_in_flight(self);
  self->state.routes = PartitionRoutes{self->state.config.discovery};
  if (self->state.config.discovery) {
    self->send(self->state.config.discovery, watch_atom::value, removal_watcher_actor{self});
    self->send(self->state.config.discovery, watch_atom::value, selector_subscriber_actor{self});
  }
  // Shutdown: no client is left without an end to its stream.
  self->set_exit_handler([self](caf::exit_msg& message) {
    abort_every_flight(self, "the router node is shutting down");
    self->quit(message.reason);
  });
  // An actor client that terminated reads no more: cancel its requests (at the worker too).
  self->set_down_handler([self](caf::down_msg& message) {
    std::vector<std::uint64_t> ids;
    for (const auto& [id, flight] : self->state.flights) {
      if (flight.stream_actor && flight.stream_actor.address() == message.source &&
          !flight.lifecycle.ended()) {
        ids.push_back(id);
      }
    }
    self->state.monitored_clients.erase(message.source);
    for (std::uint64_t id : ids) {
      if (GenerateFlight* flight = find_flight(self, id)) {
        apply(self, id, flight->lifecycle.cancel("the client actor terminated"));
      }
    }
  });
  return {
      [self](generate_atom, GenerateEnvelope& envelope) -> caf::result<RouteDecisionMessage> {
        auto& state = self->state;
        const std::string request_id = envelope.request.route.id();
        if (state.by_request_id.contains(request_id)) {
          return refuse(self, envelope, Error::invalid_request,
                        fmt::format("request '{}' is already being served", request_id));
        }
        if (auto too_large =
                too_large_for_workers(envelope.request, state.config.publisher->max_payload())) {
          return refuse(self, envelope, Error::invalid_request, *too_large);
        }
        const std::uint64_t stream_id = state.next_stream_id++;
        auto [it, inserted] = state.flights.try_emplace(stream_id, std::move(envelope.request),
                                                        state.config.lifecycle);
        it->second.reply_subject = std::move(envelope.reply_subject);
        // An actor client gets the first decision as the response; a NATS client on its subject.
        caf::result<RouteDecisionMessage> decision = caf::delegated<RouteDecisionMessage>{};
        if (envelope.stream_actor) {
          it->second.decision_promise = self->make_response_promise<RouteDecisionMessage>();
          decision = it->second.decision_promise;
          // The ingress's interface promises actor clients their stream as chunk messages.
          it->second.stream_actor =
              caf::actor_cast<stream_client_actor>(std::move(envelope.stream_actor));
          track_client(self, it->second.stream_actor);
        }
        state.by_request_id.emplace(request_id, stream_id);
        update_in_flight(self);
        route_flight(self, stream_id);
        return decision;
      },
      [self](cancel_atom, const std::string& request_id) {
        auto& state = self->state;
        const auto index = state.by_request_id.find(request_id);
        if (index == state.by_request_id.end()) return;  // served by another node, or ended
        const std::uint64_t stream_id = index->second;
        if (GenerateFlight* flight = find_flight(self, stream_id)) {
          if (flight->route_pending) {
            state.routes.cancel_route(self, flight->request.route.partition, request_id);
          }
          apply(self, stream_id, flight->lifecycle.cancel("cancelled by the client"));
        }
      },
      [self](flush_atom) { self->state.relays.write(*self->state.config.publisher); },
      [self](chunk_atom, ChunkEnvelope& envelope) {
        GenerateFlight* flight = find_flight(self, envelope.stream_id);
        if (flight == nullptr) {
          node_metrics(self).generate_stale_chunks().add();
          return;
        }
        if (flight->prefill) {
          on_prefill_chunk(self, envelope.stream_id, envelope.chunk);
          return;
        }
        apply(self, envelope.stream_id,
              flight->lifecycle.on_chunk(decode_stream_chunk(envelope.chunk)), &envelope.chunk);
      },
      [self](selector_atom, std::string& model, std::string& group, selector_actor& selector) {
        self->state.routes.learn(std::move(model), std::move(group), selector);
      },
      [self](removed_atom, const std::vector<WorkerId>& removed) {
        std::vector<std::uint64_t> ids;
        for (const auto& [id, flight] : self->state.flights) ids.push_back(id);
        for (std::uint64_t id : ids) {
          for (WorkerId worker : removed) {
            GenerateFlight* flight = find_flight(self, id);
            if (flight != nullptr && flight->transfer && flight->transfer->source == worker) {
              flight->transfer->valid_until = {};  // the KV left with its prefill worker
            }
            if (flight != nullptr && flight->prefill &&
                flight->prefill->worker.worker_id == worker) {
              fail_prefill(self, id, FailureCause::worker_failed,
                           fmt::format("worker {} left the fleet", worker), false);
              continue;
            }
            if (flight != nullptr) {
              apply(self, id,
                    flight->lifecycle.worker_failed(
                        worker, fmt::format("worker {} left the fleet (booking expired or "
                                            "deregistered)",
                                            worker)));
            }
          }
        }
      },
      [self](stall_atom, std::uint64_t stream_id, std::uint32_t attempt) {
        GenerateFlight* flight = find_flight(self, stream_id);
        if (flight == nullptr || flight->attempt != attempt) return;
        flight->stall_check_pending = false;
        if (flight->lifecycle.state() != RequestState::Responding) return;
        const auto timeout = self->state.config.stream_stall_timeout;
        const auto quiet = self->clock().now() - flight->last_chunk_at;
        if (quiet < timeout) {
          // A chunk came since the check was set: check again one timeout after it.
          flight->stall_check_pending = true;
          self->delayed_send(self, timeout - quiet, stall_atom::value, stream_id, attempt);
          return;
        }
        node_metrics(self).generate_stream_stalls().add();
        flight->failure_cause = FailureCause::stream_timeout;
        apply(self, stream_id,
              flight->lifecycle.abort(
                  Error::timeout, fmt::format("worker {} sent no chunk for {} ms after chunk {}",
                                              flight->lifecycle.worker()->worker_id,
                                              timeout.count(), flight->relayed - 1)));
      },
      [self](nats_link_atom, bool connected) {
        if (connected) return;
        // Chunks published while the node is cut off never reach it: no stream in flight can
        // continue whole, so each ends now with an explicit error (its client may retry).
        const std::size_t ended =
            abort_every_flight(self, "the node lost its NATS connection mid-request");
        node_metrics(self).generate_nats_losses().add(static_cast<double>(ended));
      },
      [self](deadline_atom, std::uint64_t stream_id, std::uint32_t attempt) {
        GenerateFlight* flight = find_flight(self, stream_id);
        if (flight != nullptr && flight->attempt == attempt && flight->prefill) {
          node_metrics(self).generate_first_token_timeouts().add();
          fail_prefill(
              self, stream_id, FailureCause::first_token_timeout,
              fmt::format("no answer within {} ms", self->state.config.first_token_timeout.count()),
              true);
          return;
        }
        if (flight == nullptr || flight->attempt != attempt ||
            flight->lifecycle.state() != RequestState::Sent || !flight->lifecycle.worker()) {
          return;
        }
        node_metrics(self).generate_first_token_timeouts().add();
        flight->failure_cause = FailureCause::first_token_timeout;
        apply(self, stream_id,
              flight->lifecycle.worker_failed(
                  flight->lifecycle.worker()->worker_id,
                  fmt::format("no first chunk within {} ms",
                              self->state.config.first_token_timeout.count())));
      },
  };
}

}  // namespace kvr::actors
