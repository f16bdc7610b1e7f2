// The policy-class queue of one partition: admitted requests that must wait because every
// eligible worker is busy for their class. Owned by the partition's selector (one owner, never
// shared between threads); plain C++, no clock reads: time is passed in.
//
// Dispatch order, applied each time the owner asks for the next request (next_dispatchable):
//   1. Only lane heads that the owner's check accepts are candidates. Each class keeps one lane
//      for unpinned requests and one lane per pinned worker; a lane is served in its own order
//      (below), so a lane whose head is refused waits as a whole while every other lane, of this
//      class and of the others, goes on. One busy pinned worker thus blocks no one else.
//   2. Strict priority: only candidates of the highest priority among all candidates compete.
//   3. Deficit round robin picks the class among those: the classes take turns in configuration
//      order; a class starting its turn adds its quantum to its deficit and is served while its
//      deficit covers its candidate's cost (max(1, scheduling_cost_tokens)), paying that cost
//      each time. A class that empties loses its deficit and its turn; a class without a
//      candidate of that priority is passed over, keeping its deficit but gaining none. With
//      every class backlogged, each class's share of the served tokens is its quantum's share of
//      the quanta (quanta 512:128 and equal costs: 4 requests to 1).
//   4. Within a class (and lane) the order is: priority (higher first), due time (earliest first;
//      requests with a due time before those without), then the class order: fcfs by arrival, or
//      wspt by scheduling_cost_tokens ascending with ties by arrival. Due times and the class
//      order rank requests within their class only; across classes, steps 2 and 3 decide (a
//      classifier that needs to overtake other classes raises the priority). Under sustained load
//      wspt can keep an expensive request waiting indefinitely; a due time bounds its wait.
// Cost: enqueue and removal are O(log n) in the requests of their lane; next_dispatchable checks
// the head of every non-empty lane, so it is linear in the classes and in the pinned workers that
// have requests waiting.
// Due times order dispatch but never dispatch by themselves: the owner calls expire(now) before it
// drains, and schedules a wake-up at earliest_due() to reject the requests that could not be served
// in time (`due_time_expired`).
//
// The selector's use: a request goes to selection at once unless its class must queue
// (should_queue over its eligible workers) or the queue is not empty; then it is enqueued
// (queue_full and unknown classes answer the request) and the queue drained. Whenever capacity
// frees (first token, completion, a new worker) and at earliest_due(), the selector calls
// expire(now), rejects what it returns, and drains in the same turn. A cancel calls remove().
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <expected>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "classifiers/queue/policy_class_config.hpp"
#include "messages/ids.hpp"

namespace kvr::classifiers {

/// The selector's clock: the steady clock in a node, logical time in replay and tests.
using QueueTimePoint = std::chrono::steady_clock::time_point;

/// One queued request, as the queue orders it. The owner keeps the request itself, keyed by id.
struct QueuedRequest {
  /// Unique among the queued requests.
  std::string request_id;
  /// A class of the queue (ClassifyRequest::policy_class).
  std::string policy_class = std::string{kDefaultPolicyClass};
  /// Strict priority (RouteRequest.priority): higher first, across all classes.
  std::uint32_t priority = 0;
  /// When the request should be served by; empty: no deadline.
  std::optional<QueueTimePoint> due_at;
  /// The request's cost to its class's deficit and its wspt rank (0 counts as 1 for the deficit).
  std::uint64_t scheduling_cost_tokens = 1;
  /// Uncached prompt tokens on the best eligible worker at enqueue, for the token queue limit.
  std::uint64_t uncached_tokens = 0;
  /// Set when the request may only go to this worker: it waits in that worker's lane.
  std::optional<WorkerWithDpRank> pinned_worker;
  /// Set by enqueue: increases with each accepted request (arrival order).
  std::uint64_t arrival_sequence = 0;
};

/// Why enqueue refused a request.
class QueueError {
 public:
  enum class Kind {
    QueueFull,         ///< over the class's limits: reject the newcomer (`queue_full`, 529)
    UnknownClass,      ///< no class of that name (a classifier named a class not configured)
    DuplicateRequest,  ///< a request with the same id is already queued
  };

  QueueError(Kind kind, std::string message) : kind_(kind), message_(std::move(message)) {}
  Kind kind() const { return kind_; }
  std::string_view message() const { return message_; }

 private:
  Kind kind_;
  std::string message_;
};

/// How much one class holds, for metrics.
struct PolicyClassDepth {
  std::string_view name;
  std::size_t requests = 0;
  std::uint64_t uncached_tokens = 0;
};

/// A non-owning reference to a callable, valid for the call it is passed to.
template <class Signature>
class FunctionRef;

template <class Result, class... Args>
class FunctionRef<Result(Args...)> {
 public:
  template <class Callable>
  requires(!std::is_same_v<std::remove_cvref_t<Callable>, FunctionRef> &&
           std::is_invocable_r_v<Result, Callable&, Args...>) FunctionRef(Callable&& callable)
  noexcept  // NOLINT(google-explicit-constructor)
      : object_(const_cast<void*>(static_cast<const void*>(std::addressof(callable)))),
        call_([](void* object, Args... args) -> Result {
          return std::invoke(*static_cast<std::remove_reference_t<Callable>*>(object),
                             std::forward<Args>(args)...);
        }) {}

  Result operator()(Args... args) const { return call_(object_, std::forward<Args>(args)...); }

 private:
  void* object_;
  Result (*call_)(void*, Args...);
};

/// Whether a lane's head may be dispatched now: for an unpinned request, whether some eligible
/// worker is not busy for its class; for a pinned one, whether its worker is not busy for it.
using DispatchCheck = FunctionRef<bool(const PolicyClassConfig&, const QueuedRequest&)>;
/// Receives each request that drain() dispatches; it may enqueue into or remove from the queue.
using DispatchSink = FunctionRef<void(QueuedRequest&&)>;

/// The queue; see the file comment for the dispatch order. Not thread-safe; movable, not copyable.
class PolicyClassQueue {
 public:
  /// `classes` must be valid (validate_policy_class) with unique names, and not empty; typically
  /// resolve_policy_classes() of the router-policy config. Aborts otherwise.
  explicit PolicyClassQueue(std::vector<PolicyClassConfig> classes);

  PolicyClassQueue(PolicyClassQueue&&) noexcept;
  PolicyClassQueue& operator=(PolicyClassQueue&&) noexcept;
  PolicyClassQueue(const PolicyClassQueue&) = delete;
  PolicyClassQueue& operator=(const PolicyClassQueue&) = delete;
  ~PolicyClassQueue();

  /// Queues `request` (its arrival_sequence is assigned here). Refuses, keeping every request
  /// already queued, when its class is unknown, its id is already queued, or the class would hold
  /// more than request_queue_limit_per_worker × `eligible_workers` requests or more than
  /// uncached_token_queue_limit_per_worker × `eligible_workers` uncached tokens with it (so a
  /// class with a limit refuses everything while no worker is eligible).
  std::expected<void, QueueError> enqueue(QueuedRequest request, std::size_t eligible_workers);

  /// Removes and returns the next request in dispatch order among the lane heads `can_dispatch`
  /// accepts; nullopt (and no change) when it accepts none. `can_dispatch` is called at most
  /// once per non-empty lane, and must not change the queue.
  std::optional<QueuedRequest> next_dispatchable(DispatchCheck can_dispatch);

  /// Hands `dispatch` each next_dispatchable(can_dispatch) in turn until there is none, so that
  /// freed capacity is used in the same actor turn; `dispatch` books the request, so that the next
  /// check sees the worker's new load. Returns how many were dispatched.
  std::size_t drain(DispatchCheck can_dispatch, DispatchSink dispatch);

  /// Removes and returns, earliest due first (then by arrival), every request whose due time is
  /// at or before `now`.
  std::vector<QueuedRequest> expire(QueueTimePoint now);
  /// The earliest due time of a queued request: when expire() next has something to do.
  std::optional<QueueTimePoint> earliest_due() const;

  /// Removes a queued request (cancelled, client gone); nullopt when it is not queued.
  std::optional<QueuedRequest> remove(std::string_view request_id);
  bool contains(std::string_view request_id) const;

  /// Queued requests over all classes.
  std::size_t size() const { return entries_.size(); }
  bool empty() const { return entries_.empty(); }
  /// Each class's queued requests and uncached tokens, in configuration order.
  std::vector<PolicyClassDepth> depths() const;
  /// One class's depth; nullopt for an unknown class.
  std::optional<PolicyClassDepth> depth(std::string_view policy_class) const;

  /// The class named `policy_class`, or nullptr.
  const PolicyClassConfig* find_class(std::string_view policy_class) const;

 private:
  struct Stored;
  struct LaneKey {
    std::uint32_t priority;
    std::int64_t due_rank;     // due time's ticks; max when none
    std::uint64_t order_rank;  // scheduling cost for wspt, 0 for fcfs
    std::uint64_t sequence;
    Stored* stored;
  };
  struct LaneOrder {
    bool operator()(const LaneKey& left, const LaneKey& right) const;
  };
  using Lane = std::set<LaneKey, LaneOrder>;
  struct ClassState {
    PolicyClassConfig config;
    Lane unpinned;
    std::map<WorkerWithDpRank, Lane> pinned;  // non-empty lanes only
    std::size_t requests = 0;
    std::uint64_t uncached_tokens = 0;
    std::uint64_t deficit = 0;
  };
  struct StringHash {
    using is_transparent = void;
    std::size_t operator()(std::string_view text) const noexcept {
      return std::hash<std::string_view>{}(text);
    }
  };
  struct Stored {
    QueuedRequest request;
    std::uint32_t class_index = 0;
    Lane* lane = nullptr;
    Lane::iterator lane_position;
    std::optional<std::multimap<QueueTimePoint, Stored*>::iterator> due_position;
  };
  using Entries = std::unordered_map<std::string, Stored, StringHash, std::equal_to<>>;

  // Takes the entry out of every index and returns its request.
  QueuedRequest take(Entries::iterator entry);
  // Picks among the classes whose candidate has `priority` by deficit round robin.
  std::uint32_t pick_class(std::uint32_t priority);
  void end_turn();

  std::vector<ClassState> classes_;
  std::unordered_map<std::string, std::uint32_t, StringHash, std::equal_to<>> class_index_;
  Entries entries_;
  std::multimap<QueueTimePoint, Stored*> due_index_;
  std::uint64_t next_sequence_ = 0;
  // Deficit round robin: whose turn it is, and whether that turn has been granted its quantum.
  std::uint32_t current_class_ = 0;
  bool turn_started_ = false;
  // Scratch for next_dispatchable: each class's candidate (nullptr: none).
  std::vector<const LaneKey*> candidates_;
};

}  // namespace kvr::classifiers
