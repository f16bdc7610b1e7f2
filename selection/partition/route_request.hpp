// A route request as the router's actors carry it, from the decoder to the partition's selector:
// the partition and worker role it is for, and the selection request itself. Plain C++; the
// decoders (selection/wire) produce it, the selector's state consumes it.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "messages/ids.hpp"
#include "selection/partition/disaggregation.hpp"
#include "selection/selection_request.hpp"
#include "selection/worker_selection.hpp"

namespace kvr {

/// One request to route.
struct RouteRequest {
  plugins::worker_selection::RoutingPartition partition;
  WorkerType worker_type = WorkerType::Aggregated;
  selection::SelectionRequest selection;
  /// The prompt's token ids when the client sent tokens instead of block hashes. A block size is
  /// a property of a partition's workers, so the partition's selector hashes them into
  /// selection.block_hashes at its block size, and then clears them.
  std::vector<std::uint32_t> prompt_token_ids;
  /// The prompt's UTF-8 text, when the client has no token ids (the `estimate` tokenizer mode):
  /// the selector hashes it into text blocks (PromptKeys::text_blocks), then clears it.
  std::string prompt_text;
  /// The cache namespace the token ids or the text are hashed in.
  std::string cache_namespace;
  /// Who the request is for, as the client named it (per-tenant admission); empty: none.
  std::string tenant;
  /// What admission decided (the request classifier, when the node runs one), carried for the
  /// policy-class queue: the class it is queued and accounted under, when it should be served by,
  /// and what it costs the queue in tokens (empty: its uncached tokens).
  std::string policy_class = "default";
  std::optional<std::chrono::steady_clock::time_point> due_at;
  std::optional<std::uint64_t> scheduling_cost_tokens;
  /// The classifier cleared the request's soft target: the session's soft binding is not offered
  /// to worker selection either.
  bool without_soft_target = false;
  /// Request ids are unique per client, not across clients: the node keys a request by its id
  /// scoped to its client, "<client's id>@<client>" (scope_request_id), and answers with the
  /// client's id, the first client_id_size bytes. 0: the id is not scoped (the client's own).
  std::uint32_t client_id_size = 0;
  /// A probe: the decision the request would get, with its overlap and costs, and nothing held
  /// (no booking, no session binding, no admission, no queue, no hit-rate ceiling).
  bool query_only = false;
  /// Which hop of a generate request this is (disaggregated serving).
  RouteHop hop = RouteHop::single;

  /// The id the node keys the request by (bookings, queue, classifier).
  const std::string& id() const { return selection.request_id; }
  /// The id the client chose, as decisions carry it back.
  std::string_view client_id() const {
    const std::string_view id = selection.request_id;
    return client_id_size == 0 ? id : id.substr(0, client_id_size);
  }
};

/// Appends an already escaped client scope (request_scope() of a scoped request, as a forwarding
/// node passes it on) to an unscoped request's id; an empty scope leaves the id unscoped.
inline void apply_request_scope(RouteRequest& request, std::string_view scope) {
  if (scope.empty() || request.client_id_size != 0) return;
  std::string& id = request.selection.request_id;
  request.client_id_size = static_cast<std::uint32_t>(id.size());
  id.reserve(id.size() + 1 + scope.size());
  id += '@';
  id += scope;
}

/// Scopes the request's id to `client` (a NATS client's reply prefix, an actor client's address;
/// empty: left unscoped): two clients may use the same id, one client's open id stays unique.
/// '@' and '%' in `client` are written %40 and %25, so the client follows the id's last '@' and
/// no two (id, client) pairs give the same key. A request scoped already stays as it is.
inline void scope_request_id(RouteRequest& request, std::string_view client) {
  std::string escaped;
  escaped.reserve(client.size());
  for (const char c : client) {
    if (c == '@') {
      escaped += "%40";
    } else if (c == '%') {
      escaped += "%25";
    } else {
      escaped += c;
    }
  }
  apply_request_scope(request, escaped);
}

/// The (escaped) client scope of a scoped request; empty when unscoped.
inline std::string_view request_scope(const RouteRequest& request) {
  if (request.client_id_size == 0) return {};
  return std::string_view{request.selection.request_id}.substr(request.client_id_size + 1);
}

/// How a client's scope starts, by the way it reached the node: over NATS (followed by its reply
/// prefix), as a remote actor, or as an actor of the node's own process (the front door, the
/// endpoint picker, a program that embeds the node). The prefixes keep one kind from posing as
/// another (a NATS reply subject may start with anything).
inline constexpr std::string_view kNatsScope = "nats:";
inline constexpr std::string_view kRemoteActorScope = "actor:";
inline constexpr std::string_view kLocalActorScope = "local:";

/// The client whose per-client booking caps the request counts against: its scope, or empty for
/// an unscoped request and for the node's own actors, whose bookings the node itself ends.
inline std::string_view capped_client(const RouteRequest& request) {
  const std::string_view scope = request_scope(request);
  return scope.starts_with(kLocalActorScope) ? std::string_view{} : scope;
}

/// A NATS client's identity, from the reply subject of its request: the subject up to its last
/// token ("_INBOX.<connection>." for a client's request(), which adds one token per request), or
/// the whole subject when it has fewer than three tokens; empty without a reply subject.
inline std::string_view nats_client_of(std::string_view reply_subject) {
  const std::size_t last = reply_subject.rfind('.');
  if (last == std::string_view::npos || reply_subject.find('.') == last) return reply_subject;
  return reply_subject.substr(0, last + 1);
}

}  // namespace kvr
