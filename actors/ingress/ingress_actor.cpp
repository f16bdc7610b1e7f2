#include "actors/ingress/ingress_actor.hpp"

#include <caf/actor_cast.hpp>
#include <caf/typed_event_based_actor.hpp>
#include <caf/typed_response_promise.hpp>

#include "messages/metrics/node_metrics.hpp"

namespace kvr::actors {

ingress_actor::behavior_type ingress_behavior(ingress_actor::pointer self,
                                              IngressActorConfig config) {
  const metrics::NodeMetrics metrics{*config.metrics};
  const metrics::ValueHandle route_requests = metrics.route_requests("actor");
  // `client`: the client's scope, to escape (an actor client's address) or escaped already (a
  // forwarding node's).
  const auto serve_route = [self, config, metrics, route_requests](
                               const v1::RouteRequest& wire, const std::string& client,
                               bool escaped) -> caf::result<RouteDecisionMessage> {
    route_requests.add();
    auto request = decode_route_request(wire, config.limits);
    if (!request) {
      metrics.route_errors(request.error().code).add();
      return RouteDecisionMessage{
          encode_route_error(wire.request_id(), request.error().code, request.error().message)};
    }
    if (escaped) {
      apply_request_scope(*request, client);
    } else {
      scope_request_id(*request, client);
    }
    // Delegated: the entry answers the client itself and always answers (the reservation actor's
    // request to the selector carries the timeout). A request/then here would add a response hop
    // and a timer on CAF's clock thread per decision, measured at several microseconds of CPU
    // each (tests/bench/node).
    return self->make_response_promise<RouteDecisionMessage>().delegate(
        config.entry.route, route_atom::value,
        RouteEnvelope{std::move(*request), {}, config.clock->now()});
  };
  return {
      [self, serve_route](route_atom,
                          RouteRequestMessage& message) -> caf::result<RouteDecisionMessage> {
        // An actor client's request ids are its own: scoped to the sending actor, marked local
        // when it runs in this process (its bookings are the node's own to end).
        const auto& sender = self->current_sender();
        if (!sender) return serve_route(message.value, std::string{}, false);
        std::string client{sender->node() == self->node() ? kLocalActorScope : kRemoteActorScope};
        client += caf::to_string(sender);
        return serve_route(message.value, client, false);
      },
      [serve_route](route_atom, RouteRequestMessage& message,
                    std::string& client) -> caf::result<RouteDecisionMessage> {
        // Forwarded by the node the client reached: its scope is the client's, not the sender's.
        return serve_route(message.value, client, true);
      },
      [self, config](report_atom,
                     LifecycleReportMessage& message) -> caf::result<LifecycleAckMessage> {
        auto report = decode_lifecycle_report(message.value, config.limits);
        if (!report) return LifecycleAckMessage{encode_lifecycle_ack(false, report.error())};
        // Delegated as route requests are: the reservation actor always acknowledges.
        return self->make_response_promise<LifecycleAckMessage>().delegate(
            config.entry.report, report_atom::value, ReportEnvelope{std::move(*report), {}});
      },
      [self, config, metrics](
          generate_atom, GenerateRequestMessage& message) -> caf::result<RouteDecisionMessage> {
        metrics.generate_requests("actor").add();
        const std::string& request_id = message.value.route().request_id();
        const auto refuse = [&](Error code, std::string text) {
          metrics.route_errors(code).add();
          return RouteDecisionMessage{encode_route_error(request_id, code, text)};
        };
        auto client = caf::actor_cast<caf::actor>(self->current_sender());
        if (!client) {
          return refuse(Error::invalid_request,
                        "generate needs a sender actor to stream the response to");
        }
        if (!config.entry.generate) {
          return refuse(Error::unavailable, "generate is not served here");
        }
        auto request = decode_generate_request(message.value, config.limits, StreamTo::actor);
        if (!request) return refuse(request.error().code, request.error().message);
        // Delegated: answered with the first decision (always: the lifecycle ends a route failure,
        // a retry's end and shutdown each with an explicit error).
        return self->make_response_promise<RouteDecisionMessage>().delegate(
            config.entry.generate, generate_atom::value,
            GenerateEnvelope{std::move(*request), {}, config.clock->now(), std::move(client)});
      },
      [self, config](cancel_atom, GenerateCancelMessage& message) {
        if (!config.entry.generate || message.value.request_id().empty()) return;
        self->send(config.entry.generate, cancel_atom::value,
                   std::move(*message.value.mutable_request_id()));
      },
  };
}

}  // namespace kvr::actors
