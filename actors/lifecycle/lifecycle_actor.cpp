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
#include "actors/lifecycle/flight_effects.hpp"
#include "actors/support/request_error.hpp"
#include "messages/metrics/node_metrics.hpp"

namespace kvr::actors {
namespace {

using Self = LifecycleSelf;

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

// Forgets a flight that ended and has no route request in flight.
void maybe_forget(Self self, std::uint64_t stream_id) {
  auto& state = self->state;
  auto it = state.flights.find(stream_id);
  if (it == state.flights.end()) return;
  if (!it->second.flight.ended() || it->second.route_pending) return;
  auto index = state.by_request_id.find(it->second.request.route.id());
  if (index != state.by_request_id.end() && index->second == stream_id) {
    state.by_request_id.erase(index);
  }
  if (it->second.stream_actor) untrack_client(self, it->second.stream_actor);
  state.flights.erase(it);
  update_in_flight(self);
}

// One timer per request for its flight's deadline: a new one only when the deadline comes before
// the pending timer (a deadline that moved later is found when the pending one fires).
void arm_timer(Self self, std::uint64_t stream_id, GenerateFlight& flight) {
  const auto deadline = flight.flight.deadline();
  if (!deadline || (flight.timer_at && *flight.timer_at <= *deadline)) return;
  flight.timer_at = *deadline;
  self->delayed_send(self, std::max(*deadline - self->clock().now(), caf::timespan{0}),
                     deadline_atom::value, stream_id, ++flight.timer);
}

void route_flight(Self self, std::uint64_t stream_id, const FlightRouteRequest& route);
void dispatch(Self self, std::uint64_t stream_id, const FlightDispatch& dispatch);
void carry_out(Self self, std::uint64_t stream_id, FlightStep step, const v1::GenerateChunk* chunk);

// Feeds the outcome of one input to the flight; a refused input changes nothing.
void apply(Self self, std::uint64_t stream_id, FlightResult result,
           const v1::GenerateChunk* chunk = nullptr) {
  if (!result) {
    if (result.error().kind == LifecycleError::Kind::after_end ||
        result.error().kind == LifecycleError::Kind::stale_worker) {
      // Chunks racing a cancel or a retry: expected, only counted.
      node_metrics(self).generate_stale_chunks().add();
    } else {
      self->state.config.log->warn(
          "generate-lifecycle",
          fmt::format("kvr node: the flight refused an input: {}", result.error().message));
    }
    maybe_forget(self, stream_id);
    return;
  }
  carry_out(self, stream_id, std::move(*result), chunk);
}

void carry_out(Self self, std::uint64_t stream_id, FlightStep step,
               const v1::GenerateChunk* chunk) {
  GenerateFlight* flight = find_flight(self, stream_id);
  if (flight == nullptr) return;
  auto& config = self->state.config;
  const std::string& model = flight->request.route.partition.model;
  if (step.warning) config.log->warn("generate-routed", fmt::format("kvr node: {}", *step.warning));
  if (step.cancel_at_worker) cancel_at_worker(self, *flight, *step.cancel_at_worker);
  if (step.first_token) send_booking(self, *flight, std::move(*step.first_token));
  if (step.release) send_booking(self, *flight, std::move(*step.release));
  if (config.classifier) {
    if (step.context_tokens) {
      self->send(config.classifier, classify_atom::value, model, flight->request.route.id(),
                 *step.context_tokens);
    }
    for (auto& event : step.classifier_events) {
      self->send(config.classifier, classify_atom::value, ClassifierEvent{model, std::move(event)});
    }
  }
  record_step(self, *flight, step);
  if (step.hold_chunk && chunk != nullptr) flight->held.push_back(*chunk);
  if (step.relay_held) {
    // The prefill worker served the whole request: its chunks are the client's stream.
    flight->generate_subject = flight->prefill_subject;
    for (const v1::GenerateChunk& held : flight->held) send_chunk(self, *flight, held);
  }
  if (step.relay_held || step.discard_held) flight->held.clear();
  if (step.forward_chunk && chunk != nullptr) send_chunk(self, *flight, *chunk);
  if (step.end_stream) end_client_stream(self, *flight, *step.end_stream);
  if (step.dispatch) dispatch(self, stream_id, *step.dispatch);
  if (step.route) {
    route_flight(self, stream_id, *step.route);
  }
  // A dispatch that failed at once (a request above NATS's payload limit, say) may have ended
  // the flight through a nested carry_out, which may have forgotten it.
  flight = find_flight(self, stream_id);
  if (flight == nullptr) return;
  arm_timer(self, stream_id, *flight);
  maybe_forget(self, stream_id);
}

// Sends the request to the worker the flight chose, for the hop it names.
void dispatch(Self self, std::uint64_t stream_id, const FlightDispatch& hop) {
  GenerateFlight* flight = find_flight(self, stream_id);
  if (flight == nullptr) return;
  const std::string& subject =
      hop.hop == FlightHop::prefill ? flight->prefill_subject : flight->generate_subject;
  const bool sent =
      !subject.empty() &&
      self->state.config.publisher->publish(
          subject, encode_worker_generate_request(
                       flight->request, hop.worker.dp_rank, stream_subject(self, stream_id),
                       WorkerHop{.max_output_tokens = hop.max_output_tokens,
                                 .kv_transfer_params = hop.kv_transfer_params})
                       .SerializeAsString());
  if (!sent) {
    apply(self, stream_id,
          flight->flight.dispatch_failed(subject.empty()
                                             ? "the worker registered no generate subject"
                                             : "the request could not be published to the worker",
                                         self->clock().now()));
  }
}

void on_routed(Self self, std::uint64_t stream_id, SelectorReply& reply) {
  GenerateFlight* flight = find_flight(self, stream_id);
  if (flight == nullptr) return;
  flight->route_pending = false;
  const std::string& request_id = flight->request.route.id();
  const auto now = self->clock().now();
  if (!reply.result) {
    const RouteFailure& failure = reply.result.error();
    node_metrics(self).route_errors(failure.code).add();
    publish_decision(self, *flight, encode_route_error(request_id, failure.code, failure.message));
    apply(self, stream_id, flight->flight.route_failed(failure.code, failure.message, now));
    return;
  }
  const RouteOutcome& outcome = *reply.result;
  const std::uint64_t prompt_tokens = flight->request.route.selection.prompt_tokens;
  FlightRoute route{.worker = outcome.worker,
                    .prefill_hop = reply.disaggregation && reply.disaggregation->prefill_hop(),
                    .predicted_cached_tokens =
                        prompt_tokens - std::min(prompt_tokens, outcome.uncached_prefill_tokens),
                    .transfer_valid = reply.disaggregation
                                          ? std::optional{reply.disaggregation->transfer_valid}
                                          : std::nullopt};
  FlightResult step = flight->flight.routed(route, now);
  if (step && step->dispatch) {
    (route.prefill_hop ? flight->prefill_subject : flight->generate_subject) =
        reply.generate_subject;
    node_metrics(self).route_decisions(outcome.worker.worker_id).add();
    // The client's decision names the worker that starts its request (a prefill worker, for two
    // hops); its chunks name the worker that generates them.
    publish_decision(
        self, *flight,
        encode_route_success(request_id, outcome,
                             RouteSuccessInfo{.booking_id = {},
                                              .booking_ttl = {},
                                              .policy = reply.policy,
                                              .generate_subject = reply.generate_subject,
                                              .http_url = reply.http_url}));
  }
  apply(self, stream_id, std::move(step));
}

// Asks the partition's selector for a worker as the flight says.
void route_flight(Self self, std::uint64_t stream_id, const FlightRouteRequest& route) {
  GenerateFlight* flight = find_flight(self, stream_id);
  if (flight == nullptr) return;
  flight->route_pending = true;
  RouteRequest request = routed_as(flight->request.route, route);
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

// Feeds `input` to every flight in flight (not ended), by stream id (a flight may end and be
// forgotten on the way).
template <typename Input>
void for_each_flight(Self self, Input input) {
  std::vector<std::uint64_t> ids;
  for (const auto& [id, flight] : self->state.flights) {
    if (!flight.flight.ended()) ids.push_back(id);
  }
  for (std::uint64_t id : ids) {
    if (GenerateFlight* flight = find_flight(self, id)) input(id, *flight);
  }
}

// Ends every request in flight with an explicit `unavailable` error (a route still with its
// selector is cancelled there); returns how many ended.
std::size_t abort_every_flight(Self self, std::string_view reason) {
  std::size_t ended = 0;
  for_each_flight(self, [&](std::uint64_t id, GenerateFlight& flight) {
    if (flight.route_pending) {
      self->state.routes.cancel_route(self, flight.request.route.partition,
                                      flight.request.route.id());
    }
    ++ended;
    apply(self, id, flight.flight.abort(Error::unavailable, reason));
  });
  return ended;
}

FlightOptions flight_options(const LifecycleActorConfig& config) {
  return FlightOptions{.max_retries = config.max_retries,
                       .first_token_timeout = config.first_token_timeout,
                       .stall_timeout = config.stream_stall_timeout};
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
    self->state.monitored_clients.erase(message.source);
    for_each_flight(self, [&](std::uint64_t id, GenerateFlight& flight) {
      if (flight.stream_actor && flight.stream_actor.address() == message.source) {
        apply(self, id, flight.flight.cancel("the client actor terminated"));
      }
    });
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
                                                        flight_options(state.config));
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
        carry_out(self, stream_id, it->second.flight.start(self->clock().now()), nullptr);
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
          apply(self, stream_id, flight->flight.cancel("cancelled by the client"));
        }
      },
      [self](flush_atom) { self->state.relays.write(*self->state.config.publisher); },
      [self](chunk_atom, ChunkEnvelope& envelope) {
        GenerateFlight* flight = find_flight(self, envelope.stream_id);
        if (flight == nullptr) {
          node_metrics(self).generate_stale_chunks().add();
          return;
        }
        apply(self, envelope.stream_id,
              flight->flight.on_chunk(decode_stream_chunk(envelope.chunk), self->clock().now()),
              &envelope.chunk);
      },
      [self](selector_atom, std::string& model, std::string& group, selector_actor& selector) {
        self->state.routes.learn(std::move(model), std::move(group), selector);
      },
      [self](removed_atom, const std::vector<WorkerId>& removed) {
        for (WorkerId worker : removed) {
          const std::string reason =
              fmt::format("worker {} left the fleet (booking expired or deregistered)", worker);
          for_each_flight(self, [&](std::uint64_t id, GenerateFlight& flight) {
            apply(self, id, flight.flight.worker_left(worker, reason, self->clock().now()));
          });
        }
      },
      [self](deadline_atom, std::uint64_t stream_id, std::uint32_t timer) {
        GenerateFlight* flight = find_flight(self, stream_id);
        if (flight == nullptr || flight->timer != timer) return;  // ended, or superseded
        flight->timer_at.reset();
        carry_out(self, stream_id, flight->flight.tick(self->clock().now()), nullptr);
      },
      [self](nats_link_atom, bool connected) {
        if (connected) return;
        // Chunks published while the node is cut off never reach it: no stream in flight can
        // continue whole, so each ends now with an explicit error (its client may retry).
        const std::size_t ended =
            abort_every_flight(self, "the node lost its NATS connection mid-request");
        node_metrics(self).generate_nats_losses().add(static_cast<double>(ended));
      },
  };
}

}  // namespace kvr::actors
