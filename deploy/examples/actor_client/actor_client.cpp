// An out-of-process actor client of a kvr node: connects to the ingress actor the node publishes on
// its --actor-port (plaintext, so the node runs with --plaintext-peers on loopback; see
// docs/security.md for TLS), then
//   1. routes a prompt and prints the decision,
//   2. reports the request completed, releasing its booking,
//   3. generates through the node and prints the streamed tokens.
// Usage: kvr_actor_client HOST PORT MODEL
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <string>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/io/middleman.hpp>
#include <caf/scoped_actor.hpp>
#include <kvr/actors/client/ingress_protocol.hpp>

namespace {

using namespace std::chrono_literals;
namespace ka = kvr::actors;

// The same 64-token prompt for both requests: the second finds it cached where the first went.
void add_prompt(kvr::v1::RouteRequest& route, const std::string& id, const std::string& model) {
  route.set_request_id(id);
  route.set_model(model);
  for (std::uint32_t token = 1; token <= 64; ++token) route.mutable_tokens()->add_ids(token);
}

// Asks until a decision comes that is not "no workers yet" (a node that just started may not have
// heard its workers), for at most 20 s.
kvr::v1::RouteDecision route(caf::scoped_actor& self, const ka::ingress_actor& ingress,
                             const std::string& model) {
  kvr::v1::RouteDecision decision;
  for (int attempt = 1; attempt <= 40; ++attempt) {
    ka::RouteRequestMessage request;
    add_prompt(request.value, "actor-client-route-" + std::to_string(attempt), model);
    self->request(ingress, 5s, ka::route_atom::value, request)
        .receive([&](ka::RouteDecisionMessage& reply) { decision = reply.value; },
                 [&](caf::error& failure) {
                   decision.mutable_error()->set_message(to_string(failure));
                 });
    if (decision.has_success() || decision.error().code() != kvr::v1::ROUTE_ERROR_NO_WORKERS) {
      return decision;
    }
    self->receive(caf::after(500ms) >> [] {});
  }
  return decision;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::cerr << "usage: kvr_actor_client HOST PORT MODEL\n";
    return 2;
  }
  const std::string host = argv[1];
  const auto port = static_cast<std::uint16_t>(std::stoul(argv[2]));
  const std::string model = argv[3];

  caf::actor_system_config config;
  config.load<caf::io::middleman>();
  // A cluster node closes a peer connection silent for a second: keep it alive while idle.
  config.set("middleman.heartbeat-interval", caf::timespan{200ms});
  config.add_message_types<caf::id_block::kvr_actors>();
  caf::actor_system system{config};
  auto ingress = system.middleman().remote_actor<ka::ingress_actor>(host, port);
  if (!ingress) {
    std::cerr << "cannot connect to " << host << ":" << port << ": "
              << system.render(ingress.error()) << "\n";
    return 1;
  }
  caf::scoped_actor self{system};

  // 1. Route.
  const kvr::v1::RouteDecision decision = route(self, *ingress, model);
  if (!decision.has_success()) {
    std::cerr << "route failed: " << decision.error().message() << "\n";
    return 1;
  }
  const kvr::v1::RouteSuccess& routed = decision.success();
  std::cout << "routed " << decision.request_id() << " to worker " << routed.worker_id() << " rank "
            << routed.dp_rank() << " (policy " << routed.policy() << ", "
            << routed.device_overlap_blocks() << " blocks cached), booking " << routed.booking_id()
            << "\n";

  // 2. Report: the request completed, so the node releases its booking.
  ka::LifecycleReportMessage report;
  report.value.set_booking_id(routed.booking_id());
  report.value.set_event(kvr::v1::LIFECYCLE_EVENT_COMPLETED);
  report.value.set_context_tokens(64);
  bool accepted = false;
  self->request(*ingress, 5s, ka::report_atom::value, report)
      .receive([&](ka::LifecycleAckMessage& ack) { accepted = ack.value.accepted(); },
               [&](caf::error& failure) { std::cerr << to_string(failure) << "\n"; });
  if (!accepted) {
    std::cerr << "the report was not accepted\n";
    return 1;
  }
  std::cout << "reported completed: accepted\n";

  // 3. Generate: the first decision answers the request, then the chunks arrive as messages.
  ka::GenerateRequestMessage generate;
  add_prompt(*generate.value.mutable_route(), "actor-client-generate", model);
  generate.value.set_max_output_tokens(8);
  kvr::v1::RouteDecision first;
  self->request(*ingress, 5s, ka::generate_atom::value, generate)
      .receive(
          [&](ka::RouteDecisionMessage& reply) { first = reply.value; },
          [&](caf::error& failure) { first.mutable_error()->set_message(to_string(failure)); });
  if (!first.has_success()) {
    std::cerr << "generate failed: " << first.error().message() << "\n";
    return 1;
  }
  std::size_t tokens = 0;
  std::string finish_reason;
  for (bool finished = false; !finished;) {
    bool received = false;
    self->receive(
        [&](ka::chunk_atom, ka::GenerateChunkMessage& chunk) {
          received = true;
          tokens += static_cast<std::size_t>(chunk.value.token_ids_size());
          finished = chunk.value.finished();
          finish_reason = chunk.value.finish_reason();
          if (chunk.value.has_error()) finish_reason += ": " + chunk.value.error().message();
        },
        caf::after(30s) >> [] {});
    if (!received) {
      std::cerr << "no chunk within 30 s\n";
      return 1;
    }
  }
  std::cout << "generated on worker " << first.success().worker_id() << ": " << tokens
            << " tokens, finished (" << finish_reason << ")\n";
  return finish_reason == "length" ? 0 : 1;
}
