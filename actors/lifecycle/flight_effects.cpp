#include "actors/lifecycle/flight_effects.hpp"

#include <caf/actor_system.hpp>
#include <caf/delegated.hpp>
#include <caf/typed_event_based_actor.hpp>
#include <fmt/format.h>

#include "messages/metrics/node_metrics.hpp"

namespace kvr::actors {

void publish_decision(LifecycleSelf self, GenerateFlight& flight,
                      const v1::RouteDecision& decision) {
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

void send_chunk(LifecycleSelf self, const GenerateFlight& flight, const v1::GenerateChunk& chunk) {
  if (flight.stream_actor) {
    self->send(flight.stream_actor, chunk_atom::value, GenerateChunkMessage{chunk});
  } else {
    self->state.relays.publish(self, *self->state.config.publisher, flight.request.stream_subject,
                               chunk.SerializeAsString());
  }
}

void end_client_stream(LifecycleSelf self, GenerateFlight& flight, const StreamEnd& end) {
  const std::string& request_id = flight.request.route.id();
  publish_decision(
      self, flight,
      encode_route_error(request_id, end.error.value_or(Error::unavailable), end.message));
  send_chunk(self, flight,
             encode_end_chunk(request_id, flight.flight.forwarded(), end, flight.flight.worker()));
}

void send_booking(LifecycleSelf self, const GenerateFlight& flight, BookingChange change) {
  auto& config = self->state.config;
  self->request(self->state.routes.selector_for(flight.request.route.partition),
                config.selector_timeout, booking_atom::value,
                BookingUpdate{flight.request.route.partition, std::move(change)})
      .then([](const BookingUpdateReply&) {},
            [self](const caf::error& error) {
              self->state.config.log->warn(
                  "generate-booking", fmt::format("kvr node: generate booking update failed: {}",
                                                  self->system().render(error)));
            });
}

void cancel_at_worker(LifecycleSelf self, const GenerateFlight& flight, WorkerWithDpRank worker) {
  const bool prefill = flight.flight.worker() != worker;
  const std::string& subject = prefill ? flight.prefill_subject : flight.generate_subject;
  if (subject.empty()) return;
  v1::GenerateCancel cancel;
  cancel.set_request_id(flight.request.route.id());
  self->state.config.publisher->publish(worker_cancel_subject(subject), cancel.SerializeAsString());
}

void record_step(LifecycleSelf self, const GenerateFlight& flight, const FlightStep& step) {
  auto& config = self->state.config;
  const metrics::NodeMetrics metrics{*config.metrics};
  const std::string& model = flight.request.route.partition.model;
  if (step.cache_outcome) {
    metrics::record_cache_outcome(metrics, *config.cache_mismatch, *config.log, model,
                                  flight.request.route.selection.prompt_tokens,
                                  step.cache_outcome->predicted_cached_tokens,
                                  step.cache_outcome->delivered_cached_tokens);
  }
  if (step.timed_out == FlightTimeout::first_token) metrics.generate_first_token_timeouts().add();
  if (step.timed_out == FlightTimeout::stall) metrics.generate_stream_stalls().add();
  const auto seconds = [](std::chrono::nanoseconds took) {
    return std::chrono::duration<double>(took).count();
  };
  if (step.prefill_hop_took) metrics.prefill_hop(model).observe(seconds(*step.prefill_hop_took));
  if (step.handoff_took) metrics.decode_handoff().observe(seconds(*step.handoff_took));
  if (step.route && step.route->retry) metrics.generate_retries().add();
  if (step.completed) metrics.generate_outcomes("completed").add();
  if (step.end_stream) metrics.generate_outcomes(step.end_stream->finish_reason).add();
}

void track_client(LifecycleSelf self, const stream_client_actor& client) {
  if (++self->state.monitored_clients[client.address()] == 1) self->monitor(client);
}
void untrack_client(LifecycleSelf self, const stream_client_actor& client) {
  auto& clients = self->state.monitored_clients;
  const auto it = clients.find(client.address());
  if (it == clients.end() || --it->second > 0) return;
  self->demonitor(client.address());
  clients.erase(it);
}

caf::result<RouteDecisionMessage> refuse(LifecycleSelf self, const GenerateEnvelope& envelope,
                                         Error code, const std::string& message) {
  auto& config = self->state.config;
  const std::string& request_id = envelope.request.route.id();
  metrics::NodeMetrics{*config.metrics}.route_errors(code).add();
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

}  // namespace kvr::actors
