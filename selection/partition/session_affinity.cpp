#include "selection/partition/session_affinity.hpp"

#include <algorithm>
#include <iterator>
#include <utility>

#include <fmt/format.h>

#include "messages/check.hpp"

namespace kvr {
namespace {

// Debian's abseil has its own string_view type for heterogeneous lookup.
absl::string_view as_key(std::string_view text) { return {text.data(), text.size()}; }

}  // namespace

std::string_view as_str(SessionAffinityMode mode) {
  switch (mode) {
    case SessionAffinityMode::hard:
      return "hard";
    case SessionAffinityMode::soft:
      return "soft";
  }
  return "hard";
}

std::optional<SessionAffinityMode> parse_session_affinity_mode(std::string_view text) {
  if (text == "hard") return SessionAffinityMode::hard;
  if (text == "soft") return SessionAffinityMode::soft;
  return std::nullopt;
}

std::expected<void, std::string> SessionAffinityOptions::validate() const {
  if (ttl && (*ttl < std::chrono::seconds{1} || *ttl > kMaxSessionAffinityTtl)) {
    return std::unexpected(
        fmt::format("--router-session-affinity-ttl-secs: {} is outside the allowed 1 .. {} seconds",
                    ttl->count(), kMaxSessionAffinityTtl.count()));
  }
  if (max_sessions == 0) {
    return std::unexpected(std::string{"session affinity max_sessions: must be at least 1"});
  }
  if (max_request_age < std::chrono::seconds{1}) {
    return std::unexpected(std::string{"session affinity max_request_age: must be at least 1 s"});
  }
  return {};
}

SessionAffinity::SessionAffinity(SessionAffinityOptions options) : options_(std::move(options)) {
  KVR_CHECK(options_.validate().has_value());
  if (options_.ttl) ttl_ = *options_.ttl;
}

bool SessionAffinity::expired(const Binding& binding, TimePoint now) const {
  return binding.in_flight == 0 && now >= binding.last_used + ttl_;
}

const SessionAffinity::Binding* SessionAffinity::find_live(std::string_view session_id,
                                                           TimePoint now) const {
  const auto found = bindings_.find(as_key(session_id));
  if (found == bindings_.end() || expired(*found->second, now)) return nullptr;
  return &*found->second;
}

SessionAffinity::BindingList::iterator SessionAffinity::live(std::string_view session_id,
                                                             TimePoint now) {
  const auto found = bindings_.find(as_key(session_id));
  if (found == bindings_.end()) return lru_.end();
  const BindingList::iterator binding = found->second;
  if (expired(*binding, now)) {
    erase(binding);
    ++stats_.expired;
    return lru_.end();
  }
  return binding;
}

std::optional<WorkerWithDpRank> SessionAffinity::target_for(const SessionContext& session,
                                                            TimePoint now) const {
  if (!enabled() || session.session_id().empty()) return std::nullopt;
  if (const Binding* own = find_live(session.session_id(), now)) return own->worker;
  const auto parent = session.parent_session_id();
  if (options_.inherit_parent_binding && parent && !parent->empty() &&
      *parent != session.session_id()) {
    if (const Binding* inherited = find_live(*parent, now)) return inherited->worker;
  }
  return std::nullopt;
}

std::optional<WorkerWithDpRank> SessionAffinity::hard_target(const SessionContext& session,
                                                             TimePoint now) const {
  if (options_.mode != SessionAffinityMode::hard) return std::nullopt;
  return target_for(session, now);
}

std::optional<plugins::worker_selection::WorkerAffinityTarget> SessionAffinity::affinity_target(
    const SessionContext& session, TimePoint now) const {
  if (options_.mode != SessionAffinityMode::soft) return std::nullopt;
  const auto worker = target_for(session, now);
  if (!worker) return std::nullopt;
  // The KV cache lives on one rank, so the target names the rank.
  return plugins::worker_selection::WorkerAffinityTarget{.worker_id = worker->worker_id,
                                                         .dp_rank = worker->dp_rank};
}

bool SessionAffinity::invalidate(std::string_view session_id, WorkerWithDpRank worker) {
  const auto found = bindings_.find(as_key(session_id));
  if (found == bindings_.end() || found->second->worker != worker) return false;
  erase(found->second);
  ++stats_.invalidated;
  return true;
}

SessionAffinity::BindingList::iterator SessionAffinity::insert(std::string_view session_id,
                                                               WorkerWithDpRank worker,
                                                               TimePoint now) {
  if (bindings_.size() >= options_.max_sessions) {
    erase(std::prev(lru_.end()));
    ++stats_.evicted;
  }
  const std::uint64_t version = next_version_++;
  lru_.push_front(Binding{.session_id = std::string{session_id},
                          .worker = worker,
                          .generation = version,
                          .version = version,
                          .last_used = now});
  bindings_.emplace(as_key(lru_.front().session_id), lru_.begin());
  ++stats_.bindings_created;
  return lru_.begin();
}

void SessionAffinity::erase(BindingList::iterator binding) {
  // The map's key points into the list node: erase it first.
  bindings_.erase(as_key(binding->session_id));
  lru_.erase(binding);
}

void SessionAffinity::touch(BindingList::iterator binding, TimePoint now) {
  binding->last_used = std::max(binding->last_used, now);
  lru_.splice(lru_.begin(), lru_, binding);
}

void SessionAffinity::attach(OpenRequest& request, Binding& binding) {
  if (request.generation == binding.generation) return;
  detach(request);
  request.generation = binding.generation;
  ++binding.in_flight;
}

void SessionAffinity::detach(OpenRequest& request) {
  if (request.generation == 0) return;
  // A binding dropped, evicted or replaced since holds no count for this request.
  const auto found = bindings_.find(as_key(request.session_id));
  if (found != bindings_.end() && found->second->generation == request.generation &&
      found->second->in_flight > 0) {
    --found->second->in_flight;
  }
  request.generation = 0;
}

AffinityProposal SessionAffinity::propose(std::string_view request_id,
                                          const SessionContext& session, WorkerWithDpRank worker,
                                          TimePoint now) {
  if (!enabled() || session.session_id().empty()) return AffinityProposal::untracked;
  // A proposal of an id still open (a retry nobody abandoned) withdraws the earlier one first.
  if (requests_.contains(as_key(request_id))) (void)abandon(request_id, now);

  OpenRequest request{.session_id = std::string{session.session_id()},
                      .worker = worker,
                      .session_final = session.session_final().value_or(false)};
  BindingList::iterator binding = live(request.session_id, now);
  AffinityProposal result = AffinityProposal::kept;
  if (options_.mode == SessionAffinityMode::hard) {
    if (binding == lru_.end()) {
      binding = insert(request.session_id, worker, now);
      request.created_binding = true;
      result = AffinityProposal::bound;
    } else if (binding->worker != worker) {
      result = AffinityProposal::conflict;
    }
  } else if (binding == lru_.end()) {
    result = AffinityProposal::pending_bind;
  } else if (binding->worker != worker) {
    result = AffinityProposal::pending_rebind;
  }
  if (binding != lru_.end()) {
    request.observed_version = binding->version;
    attach(request, *binding);
    touch(binding, now);
  }
  request.proposed = proposal_times_.emplace(now, std::string{request_id});
  requests_.emplace(std::string{request_id}, std::move(request));
  return result;
}

AffinityCommit SessionAffinity::commit(std::string_view request_id, TimePoint now) {
  const auto found = requests_.find(as_key(request_id));
  if (found == requests_.end() || found->second.committed) return AffinityCommit::untracked;
  OpenRequest& request = found->second;
  request.committed = true;
  BindingList::iterator binding = live(request.session_id, now);

  if (options_.mode == SessionAffinityMode::hard) {
    if (binding == lru_.end()) return AffinityCommit::superseded;
    touch(binding, now);
    if (binding->version != request.observed_version || binding->worker != request.worker) {
      return AffinityCommit::superseded;
    }
    binding->confirmed = true;
    return AffinityCommit::confirmed;
  }

  if (binding == lru_.end()) {
    // The first binding of the session (or a binding dropped since the proposal): the session
    // follows the worker that is now serving it.
    binding = insert(request.session_id, request.worker, now);
    binding->confirmed = true;
    request.observed_version = binding->version;
    attach(request, *binding);
    return AffinityCommit::bound;
  }
  attach(request, *binding);
  touch(binding, now);
  // Another request moved the binding since this one was proposed: the newer decision stays.
  if (binding->version != request.observed_version) return AffinityCommit::superseded;
  binding->confirmed = true;
  if (binding->worker == request.worker) return AffinityCommit::confirmed;
  binding->worker = request.worker;
  binding->version = next_version_++;
  request.observed_version = binding->version;
  ++stats_.rebinds;
  return AffinityCommit::rebound;
}

AffinityRelease SessionAffinity::end_request(std::string_view request_id, TimePoint now) {
  const auto found = requests_.find(as_key(request_id));
  if (found == requests_.end()) return AffinityRelease::untracked;
  OpenRequest request = std::move(found->second);
  requests_.erase(found);
  proposal_times_.erase(request.proposed);

  const auto bound = bindings_.find(as_key(request.session_id));
  // A binding this request kept alive is live up to this moment, however old its last use.
  const bool attached = bound != bindings_.end() && bound->second->generation == request.generation;
  detach(request);
  if (bound == bindings_.end()) return AffinityRelease::kept;
  const BindingList::iterator binding = bound->second;
  if (!attached && expired(*binding, now)) {
    erase(binding);
    ++stats_.expired;
    return AffinityRelease::kept;
  }
  if (request.session_final) {
    erase(binding);
    ++stats_.dropped_final;
    return AffinityRelease::dropped;
  }
  // Hard mode binds at selection; a binding whose only evidence was this request, which never
  // responded, must not keep the session on a worker that may be broken.
  if (options_.mode == SessionAffinityMode::hard && !request.committed && request.created_binding &&
      binding->version == request.observed_version && !binding->confirmed) {
    erase(binding);
    ++stats_.dropped_failed;
    return AffinityRelease::dropped;
  }
  touch(binding, now);
  return AffinityRelease::kept;
}

AffinityRelease SessionAffinity::abandon(std::string_view request_id, TimePoint now) {
  return end_request(request_id, now);
}

AffinityRelease SessionAffinity::finish(std::string_view request_id, TimePoint now) {
  return end_request(request_id, now);
}

AffinityCommit SessionAffinity::complete(std::string_view request_id, TimePoint now) {
  const AffinityCommit committed = commit(request_id, now);
  (void)end_request(request_id, now);
  return committed;
}

std::size_t SessionAffinity::expire(TimePoint now) {
  if (!enabled()) return 0;
  while (!proposal_times_.empty() &&
         now >= proposal_times_.begin()->first + options_.max_request_age) {
    // Copied: ending the request erases the entry that holds the id.
    const std::string request_id = proposal_times_.begin()->second;
    (void)end_request(request_id, now);
  }
  std::size_t removed = 0;
  // The list is in order of last use, so the scan stops at the first binding still within its
  // TTL; bindings with requests in flight are skipped, not removed.
  auto next = lru_.end();
  while (next != lru_.begin()) {
    const auto current = std::prev(next);
    if (now < current->last_used + ttl_) break;
    if (current->in_flight > 0) {
      next = current;
      continue;
    }
    erase(current);
    ++removed;
  }
  stats_.expired += removed;
  return removed;
}

std::optional<WorkerWithDpRank> SessionAffinity::binding(std::string_view session_id,
                                                         TimePoint now) const {
  const Binding* found = find_live(session_id, now);
  if (found == nullptr) return std::nullopt;
  return found->worker;
}

std::expected<AffinityRouteOutcome, RouteFailure> route_with_session_affinity(
    SelectorState& selector, SessionAffinity& affinity, RouteRequest& request, TimePoint now) {
  const std::optional<SessionContext>& session = request.selection.session;
  if (!affinity.enabled() || !session || session->session_id().empty()) {
    auto routed = selector.route(request, now);
    if (!routed) return std::unexpected(std::move(routed.error()));
    return AffinityRouteOutcome{std::move(*routed), AffinityRouting::none};
  }

  AffinityRouting routing = AffinityRouting::none;
  std::optional<std::expected<RouteOutcome, RouteFailure>> routed;
  if (request.selection.pinned_worker) {
    // An explicit pin is the caller's decision for this request: its exact-target path.
    routed = selector.route(request, now);
  } else if (affinity.mode() == SessionAffinityMode::hard) {
    if (const auto target = affinity.hard_target(*session, now)) {
      auto direct = selector.route_to(request, *target, now);
      if (direct) {
        routed = std::move(direct);
        routing = AffinityRouting::bound_dispatch;
      } else if (direct.error().code != Error::no_workers) {
        return std::unexpected(std::move(direct.error()));  // the request itself is at fault
      } else if (!request.query_only && affinity.invalidate(session->session_id(), *target)) {
        routing = AffinityRouting::rebound_after_drop;
      }
    }
    if (!routed) routed = selector.route(request, now);
  } else {
    if (!request.selection.affinity_target && !request.without_soft_target) {
      request.selection.affinity_target = affinity.affinity_target(*session, now);
      if (request.selection.affinity_target) routing = AffinityRouting::target_offered;
    }
    routed = selector.route(request, now);
  }
  if (!*routed) return std::unexpected(std::move(routed->error()));
  if (!request.query_only) (void)affinity.propose(request.id(), *session, (*routed)->worker, now);
  return AffinityRouteOutcome{std::move(**routed), routing};
}

}  // namespace kvr
