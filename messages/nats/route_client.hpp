// A route-mode client that survives a hung router node (docs/protocol.md, "Asking again"). Nodes
// share one NATS queue group, and NATS keeps handing a stopped (SIGSTOP, a frozen VM) member its
// share of the requests until the server drops its connection, seconds later. So a client that
// gets no decision within a short time asks again with a fresh request id, which the queue group
// most likely hands to another member, and keeps listening for the earlier asks: whichever
// decision comes first is the answer, and a later success is released at once (ABORTED,
// CLIENT_CANCELLED) so that its booking holds nothing. A decision that says the partition moved
// (OWNER_LOST, UNAVAILABLE) or "no responders" also asks again; any other decision is final.
#pragma once

#include <chrono>
#include <cstdint>
#include <expected>
#include <memory>
#include <string>
#include <string_view>

#include "kvr/v1/routing.pb.h"
#include "messages/nats/nats_client.hpp"

namespace kvr::nats {

/// When to ask again. Ask k (from 0) goes out `retry_after` × k after the first unless a final
/// decision came first, at most `max_attempts` asks in all; the whole call waits at most `timeout`.
/// The default asks up to seven times within 900 ms: with one of three nodes hung, the chance that
/// every ask of the first second reaches it is 3^-7 (0.05%).
struct RouteRetryPolicy {
  std::chrono::milliseconds retry_after{150};
  int max_attempts = 7;
  std::chrono::milliseconds timeout{5000};
};

/// The id ask `attempt` (from 0) carries: the request's own id, then "<id>~<attempt>". A fresh id,
/// since the first ask may still hold its id open at a hung node that wakes up.
std::string attempt_request_id(std::string_view request_id, int attempt);

/// True when the decision asks the client to try again at once (the partition moved, or the node
/// is stopping): another node, or the partition's new owner, answers.
bool asks_for_retry(const v1::RouteDecision& decision);

/// A decision and how many asks it took.
struct RoutedDecision {
  /// The decision, with the request's own id (not the ask's).
  v1::RouteDecision decision;
  /// Asks sent (1: answered the first time).
  int attempts = 0;
};

/// Sends route requests on one subject with RouteRetryPolicy; thread-safe, one inbox
/// subscription for every call. Destroy it before its client.
class RouteClient {
 public:
  /// Subscribes to a fresh inbox of `client`; `route_subject` is kvr.<ns>.router.route (or a
  /// partition's), `report_subject` where the releases of extra decisions go.
  static std::expected<RouteClient, std::string> open(NatsClient& client, std::string route_subject,
                                                      std::string report_subject);
  RouteClient(RouteClient&&) noexcept;
  RouteClient& operator=(RouteClient&&) noexcept;
  ~RouteClient();

  /// Routes `request`: the first final decision (after retries), or an error when none came
  /// within the policy's timeout (the error says whether no node answered at all).
  std::expected<RoutedDecision, std::string> route(const v1::RouteRequest& request,
                                                   const RouteRetryPolicy& policy = {});

 private:
  struct State;
  explicit RouteClient(std::shared_ptr<State> state);
  std::shared_ptr<State> state_;
};

}  // namespace kvr::nats
