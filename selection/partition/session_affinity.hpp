// Session affinity (the reference's `--router-session-affinity-*`): the table binding a session id
// to the (worker, rank) that serves it, with the rules that bind, rebind, expire and drop those
// bindings. Owned by a selector next to its SelectorState (one table per partition); the selector
// actor calls route_with_session_affinity() for each request and the lifecycle path reports
// commit / abandon / finish / complete. Plain C++, single-threaded, on an injected clock.
//
// Semantics (off by default; on when a TTL is configured):
//   - hard mode: a request of a bound session is booked on exactly the bound worker, without
//     running the policy (SelectorState::route_to). When that worker cannot take it (gone,
//     unavailable, excluded, outside the request's allow-list or taints) the binding is dropped
//     and the policy selects once, normally; the session then binds to that pick. The first
//     request of a session selects normally and binds at selection time (propose): a second
//     request of the same session that arrives before the first one's first token already goes
//     to the same worker, which is what hard mode promises. (The reference makes that second
//     request wait for the first one's commit; an actor cannot wait, and binding early is the
//     same outcome.) Such a provisional binding is dropped again when its request fails before
//     the first token (abandon) unless a request already started responding on it; the first
//     token confirms it (commit).
//   - soft mode: the binding is offered to the policy as the request's affinity target
//     (WorkerSelectionContext::affinity_target()); the policy may choose another worker. Any
//     change of the binding, including the first binding of a new session, is committed only when
//     the response stream starts (commit, at the first token) or, for a client that reports no
//     first token, when the request completes (complete), so a binding always names a worker that
//     has really served the session (and so holds its prefix); a request that fails before its
//     first token (abandon) leaves the binding as it was. Concurrent requests commit
//     optimistically: a commit moves the binding only if nobody moved it since the request was
//     proposed (otherwise the newer binding stays).
//   - TTL, sliding: a binding expires TTL after its last use (proposal, first token, end of a
//     request). A binding with requests in flight never expires; the TTL counts from when the
//     last of them ended, as in the reference. Expiry is driven by expire(now) from the
//     selector's timer, and an expired binding is never used even before expire() removes it.
//   - session_final = true: the binding is dropped when that request ends (finish or abandon).
//   - bounded memory: at most max_sessions bindings; inserting beyond that evicts the least
//     recently used binding.
//   - parent sessions: a request whose own session has no binding inherits its parent session's
//     binding (hard: dispatched there; soft: offered as the target), since a sub-agent's prompt
//     usually starts with its parent's context, which the parent's worker holds. The request then
//     binds its own session as usual; the parent's binding is only read (neither refreshed nor
//     dropped because of a child). The reference instead binds all children of one parent to a
//     shared group key; inheriting keeps one key per session and needs no second table.
#pragma once

#include <chrono>
#include <cstdint>
#include <expected>
#include <list>
#include <map>
#include <optional>
#include <string>
#include <string_view>

#include <absl/container/flat_hash_map.h>
#include <absl/strings/string_view.h>

#include "messages/ids.hpp"
#include "messages/session_context.hpp"
#include "selection/partition/selector_state.hpp"

namespace kvr {

/// How a bound session treats selection.
enum class SessionAffinityMode : std::uint8_t {
  hard,  ///< dispatch exactly to the bound worker, bypassing the policy
  soft,  ///< offer the bound worker to the policy as its affinity target
};

/// "hard" or "soft".
std::string_view as_str(SessionAffinityMode mode);

/// Parses "hard" or "soft" (`--router-session-affinity-mode`); nullopt for anything else.
std::optional<SessionAffinityMode> parse_session_affinity_mode(std::string_view text);

/// The largest TTL accepted, one year (as the reference).
inline constexpr std::chrono::seconds kMaxSessionAffinityTtl{31'536'000};

/// Settings of session affinity.
struct SessionAffinityOptions {
  /// Idle time after which a binding expires (`--router-session-affinity-ttl-secs`); empty: session
  /// affinity is off (the default). Between 1 s and kMaxSessionAffinityTtl.
  std::optional<std::chrono::seconds> ttl;
  /// `--router-session-affinity-mode`; hard as in the reference.
  SessionAffinityMode mode = SessionAffinityMode::hard;
  /// Bindings kept at most; beyond it the least recently used is evicted. At least 1.
  std::size_t max_sessions = 1'000'000;
  /// A session without a binding of its own uses its parent session's binding.
  bool inherit_parent_binding = true;
  /// A request proposed this long ago and never ended is taken as ended by expire(), so that a
  /// lost end report (a route-mode booking that expired unreported) cannot keep its session's
  /// binding alive forever. At least 1 s; longer than any generation.
  std::chrono::seconds max_request_age{3600};

  /// Fails naming the flag and the allowed range of the first invalid setting.
  std::expected<void, std::string> validate() const;
};

/// What a proposal did to the session's binding.
enum class AffinityProposal : std::uint8_t {
  untracked,       ///< affinity off, or no session id: nothing recorded
  bound,           ///< hard: the session was unbound and is now bound to the worker (provisional)
  kept,            ///< the binding already names the worker
  pending_bind,    ///< soft: unbound session; binds to the worker at the first token
  pending_rebind,  ///< soft: bound elsewhere; moves to the worker at the first token
  conflict,        ///< hard: the request went elsewhere (an explicit pin); the binding stays
};

/// What a commit (first token) did.
enum class AffinityCommit : std::uint8_t {
  untracked,   ///< no proposal of this request is open
  bound,       ///< soft: the session was unbound and is now bound to the request's worker
  rebound,     ///< soft: the binding moved to the request's worker
  confirmed,   ///< the binding names the request's worker (hard: no longer provisional)
  superseded,  ///< the binding changed since the proposal (or is gone, in hard mode); left alone
};

/// What the end of a request (abandon or finish) did to the binding.
enum class AffinityRelease : std::uint8_t {
  untracked,  ///< no proposal of this request is open
  kept,       ///< the binding, if any, stays (refreshed: the end of a request is a use)
  dropped,    ///< the binding was removed (session_final, or a failed provisional hard binding)
};

/// Counters for metrics.
struct SessionAffinityStats {
  std::uint64_t bindings_created = 0;
  std::uint64_t rebinds = 0;
  std::uint64_t invalidated = 0;  ///< hard: the bound worker could not take a request
  std::uint64_t dropped_final = 0;
  std::uint64_t dropped_failed = 0;  ///< hard: provisional binding whose request failed
  std::uint64_t expired = 0;
  std::uint64_t evicted = 0;
};

/// The session → (worker, rank) table of one partition (file comment). Single-threaded.
class SessionAffinity {
 public:
  /// `options` must be valid (validate() at startup); off when options.ttl is empty.
  explicit SessionAffinity(SessionAffinityOptions options = {});
  // The index points into the list's nodes: moving keeps them, copying would not.
  SessionAffinity(const SessionAffinity&) = delete;
  SessionAffinity& operator=(const SessionAffinity&) = delete;
  SessionAffinity(SessionAffinity&&) = default;
  SessionAffinity& operator=(SessionAffinity&&) = default;

  bool enabled() const { return options_.ttl.has_value(); }
  SessionAffinityMode mode() const { return options_.mode; }
  const SessionAffinityOptions& options() const { return options_; }

  // ---- before selection ---------------------------------------------------------------------
  /// Hard mode: the worker a request of `session` must be booked on (its own binding, or its
  /// parent's); nullopt in soft mode, when off, or without a live binding.
  std::optional<WorkerWithDpRank> hard_target(const SessionContext& session, TimePoint now) const;
  /// Soft mode: the target to offer the policy (SelectionRequest::affinity_target); nullopt in hard
  /// mode, when off, or without a live binding.
  std::optional<plugins::worker_selection::WorkerAffinityTarget> affinity_target(
      const SessionContext& session, TimePoint now) const;
  /// Hard mode: `worker`, bound to `session_id`, could not take a request; drops that binding
  /// (only the session's own, never a parent's). False when the binding names another worker.
  bool invalidate(std::string_view session_id, WorkerWithDpRank worker);

  // ---- the request's lifecycle --------------------------------------------------------------
  /// After booking: `request_id` of `session` goes to `worker`. Proposing an id again (a retry)
  /// replaces the earlier proposal.
  AffinityProposal propose(std::string_view request_id, const SessionContext& session,
                           WorkerWithDpRank worker, TimePoint now);
  /// The request's response stream started (first token): commits its proposal. A second commit
  /// of the same request does nothing (untracked).
  AffinityCommit commit(std::string_view request_id, TimePoint now);
  /// The request failed (or was cancelled) before its first token: its proposal is withdrawn and
  /// the binding stays as it was (a provisional hard binding of its own is dropped). A retry
  /// proposes again.
  AffinityRelease abandon(std::string_view request_id, TimePoint now);
  /// The request ended after its first token (completed, cancelled or failed). Before a commit
  /// this is abandon().
  AffinityRelease finish(std::string_view request_id, TimePoint now);
  /// The request completed. A completion shows that its worker served the session as surely as a
  /// first token does, and a route-mode client may report only its completion: a proposal no
  /// first token committed is committed now, then the request ends as finish() ends it. Returns
  /// what the commit did (untracked when the first token had committed it, or for an unknown id).
  AffinityCommit complete(std::string_view request_id, TimePoint now);

  /// Ends requests older than max_request_age, then removes bindings idle for the TTL with no
  /// request in flight; returns how many bindings were removed.
  std::size_t expire(TimePoint now);

  // ---- inspection ---------------------------------------------------------------------------
  /// The session's own live binding (no parent), without touching it.
  std::optional<WorkerWithDpRank> binding(std::string_view session_id, TimePoint now) const;
  /// Bindings held, expired ones not yet removed included.
  std::size_t size() const { return bindings_.size(); }
  /// Requests proposed and not yet ended.
  std::size_t open_requests() const { return requests_.size(); }
  const SessionAffinityStats& stats() const { return stats_; }

 private:
  struct Binding {
    std::string session_id;
    WorkerWithDpRank worker;
    std::uint64_t generation = 0;  // unique per created binding
    std::uint64_t version = 0;     // changes when created or moved
    bool confirmed = false;        // hard: some request reached its first token on it
    std::uint32_t in_flight = 0;   // open requests attached to this generation
    TimePoint last_used;
  };
  using BindingList = std::list<Binding>;
  using ProposalTimes = std::multimap<TimePoint, std::string>;

  struct OpenRequest {
    std::string session_id;
    WorkerWithDpRank worker;
    std::uint64_t observed_version = 0;  // the binding's version at proposal (0: none)
    std::uint64_t generation = 0;        // binding generation counting this request in flight
    bool created_binding = false;        // hard: this proposal created the binding
    bool committed = false;
    bool session_final = false;
    ProposalTimes::iterator proposed;  // in proposal_times_
  };

  bool expired(const Binding& binding, TimePoint now) const;
  /// The live binding of `session_id`, or nullptr.
  const Binding* find_live(std::string_view session_id, TimePoint now) const;
  /// The live binding, removing an expired one first.
  BindingList::iterator live(std::string_view session_id, TimePoint now);
  std::optional<WorkerWithDpRank> target_for(const SessionContext& session, TimePoint now) const;
  BindingList::iterator insert(std::string_view session_id, WorkerWithDpRank worker, TimePoint now);
  void erase(BindingList::iterator binding);
  void touch(BindingList::iterator binding, TimePoint now);
  void attach(OpenRequest& request, Binding& binding);
  void detach(OpenRequest& request);
  /// Ends an open request: withdraws it, drops what it must drop, refreshes the rest.
  AffinityRelease end_request(std::string_view request_id, TimePoint now);

  SessionAffinityOptions options_;
  std::chrono::steady_clock::duration ttl_{};
  BindingList lru_;  // front: most recently used
  // Keys point into the lru_ nodes. Debian's abseil has its own string_view type for lookups.
  absl::flat_hash_map<absl::string_view, BindingList::iterator> bindings_;
  absl::flat_hash_map<std::string, OpenRequest> requests_;
  ProposalTimes proposal_times_;  // open requests by proposal time
  std::uint64_t next_version_ = 1;
  SessionAffinityStats stats_;
};

/// How session affinity shaped one routing decision.
enum class AffinityRouting : std::uint8_t {
  none,            ///< no session, affinity off, unbound (first request) or pinned: policy chose
  bound_dispatch,  ///< hard: booked on the bound worker without running the policy
  rebound_after_drop,  ///< hard: the bound worker could not take it; binding dropped, policy chose
  target_offered,      ///< soft: the binding was offered to the policy as its target
};

/// A booked decision and how affinity shaped it.
struct AffinityRouteOutcome {
  RouteOutcome outcome;
  AffinityRouting routing = AffinityRouting::none;
};

/// Routes one request with session affinity, for the selector actor: hard mode books a bound
/// session on its worker (SelectorState::route_to) and falls back once to the policy after
/// dropping an unusable binding; soft mode offers the binding as the affinity target unless the
/// request already carries one (a classifier's target wins). A pinned request is routed by its
/// pin (the binding is left alone in hard mode). Every success is proposed to `affinity`; the
/// lifecycle then commits, abandons or finishes it. Failures are route()'s.
std::expected<AffinityRouteOutcome, RouteFailure> route_with_session_affinity(
    SelectorState& selector, SessionAffinity& affinity, RouteRequest& request, TimePoint now);

}  // namespace kvr
