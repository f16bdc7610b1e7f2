// A partition's admission queue as its selector runs it: whether a request goes to selection now
// or waits until a worker is no longer busy for its policy class, the waiting requests themselves,
// and which of them freed capacity takes (the order is classifiers/queue/policy_class_queue.hpp's).
// Plain C++ over the partition's SelectorState; the selector actor and `kvr replay` drive it, each
// on its own clock. Single-threaded: the selector's owner calls it.
//
// The owner's loop: offer() every newcomer (route it at once on route_now); drain() after an
// offer that queued and whenever capacity frees (first token, completion, a new worker, a load
// report), routing each request drain() hands back; at next_expiry() call expire() and answer
// what it returns; cancel() a request whose client gave up.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <expected>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "classifiers/queue/policy_class_queue.hpp"
#include "selection/partition/route_request.hpp"
#include "selection/partition/route_result.hpp"
#include "selection/partition/selector_state.hpp"

namespace kvr {

/// How a partition queues.
struct PartitionQueueOptions {
  /// The classes, resolved (classifiers::resolve_policy_classes): valid, unique, not empty.
  std::vector<classifiers::PolicyClassConfig> classes;
  /// A request waits at most this long; then it is refused with `timeout`.
  std::chrono::milliseconds max_wait{30'000};
};

/// The owner's handle on a waiting request (a response promise's key, a trace index).
using QueueTicket = std::uint64_t;

/// What waits: the request, its owner's ticket and when it arrived.
struct WaitingRoute {
  QueueTicket ticket = 0;
  RouteRequest request;
  TimePoint enqueued_at;
};

/// A waiting request the queue gave up on, and the answer it gets.
struct RefusedRoute {
  WaitingRoute waiting;
  RouteFailure failure;
};

/// True when a node configuration queues at all: some class has a busy threshold (otherwise no
/// request would ever wait, and the selector skips the queue entirely).
bool queues_requests(const std::vector<classifiers::PolicyClassConfig>& classes);

/// One partition's queue.
class PartitionQueue {
 public:
  enum class Admission : std::uint8_t {
    route_now,  ///< route the request now: its class need not wait and nothing waits
    queued,     ///< the queue holds it now (moved out of the caller's request): drain()
  };

  explicit PartitionQueue(PartitionQueueOptions options);

  /// Decides for a newcomer. `request` must be prepared (SelectorState::prepare). Fails, keeping
  /// every waiting request, with `overloaded` when its class is over its queue limits
  /// (queue_full), `invalid_request` for an unknown class or an id that already waits.
  std::expected<Admission, RouteFailure> offer(SelectorState& selector, RouteRequest& request,
                                               QueueTicket ticket, TimePoint now);

  /// Hands `dispatch` each waiting request that may go now, in dispatch order; `dispatch` routes
  /// (and so books) it before the next is checked. Returns how many it handed over.
  std::size_t drain(SelectorState& selector,
                    classifiers::FunctionRef<void(WaitingRoute&&)> dispatch);

  /// Removes the requests whose due time has passed (`due_time_expired`) or that have waited
  /// max_wait (`timeout`), earliest first.
  std::vector<RefusedRoute> expire(TimePoint now);
  /// When expire() next has something to do; empty while nothing waits.
  std::optional<TimePoint> next_expiry();

  /// Removes a waiting request (its client gave up); empty when it does not wait.
  std::optional<WaitingRoute> cancel(std::string_view request_id);

  std::size_t size() const { return waiting_.size(); }
  bool empty() const { return waiting_.empty(); }
  /// Each class's waiting requests and uncached tokens, in configuration order.
  std::vector<classifiers::PolicyClassDepth> depths() const { return queue_.depths(); }
  std::chrono::milliseconds max_wait() const { return max_wait_; }

 private:
  struct Waiting {
    WaitingRoute route;
    std::uint64_t sequence = 0;  // tells a re-used request id from the one a deadline is for
  };
  struct WaitDeadline {
    TimePoint at;
    std::string request_id;
    std::uint64_t sequence = 0;
  };

  // Takes a request the class queue has released out of waiting_.
  WaitingRoute take(std::string_view request_id);
  // Drops wait deadlines whose request no longer waits from the front.
  void prune_deadlines();

  classifiers::PolicyClassQueue queue_;
  std::chrono::milliseconds max_wait_;
  std::unordered_map<std::string, Waiting> waiting_;
  std::uint64_t next_sequence_ = 0;
  // In arrival order, which is deadline order since every request waits max_wait; entries of
  // requests that left are skipped lazily.
  std::deque<WaitDeadline> wait_deadlines_;
  std::vector<classifiers::WorkerPrefillLoad> loads_;  // scratch
};

}  // namespace kvr
