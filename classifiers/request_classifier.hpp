// The public request-classifier plugin API: admission before worker selection. A classifier looks
// at each request and answers with a pollable AdmissionFuture (admit now, reject, or decide later);
// the classifier actor polls it without ever blocking a thread. A plugin includes
// <kvr/plugin.hpp>, which includes this header. The contract: docs/plugin-api.md.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <expected>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "classifiers/plugin_parameters.hpp"
#include "messages/ids.hpp"
#include "messages/session_context.hpp"

namespace kvr::plugins::request_classifier {

using kvr::DpRank;
using kvr::InputTrigger;
using kvr::SessionContext;
using kvr::WorkerId;
using kvr::WorkerWithDpRank;

/// The classifier actor's clock: the steady clock in a node, logical time in replay and tests.
using TimePoint = std::chrono::steady_clock::time_point;

/// How far a request has got: the most context tokens it has held so far. The host raises it as
/// the request proceeds; a classifier that keeps the request (or a copy) sees the latest value.
class RequestProgress {
 public:
  explicit RequestProgress(std::uint64_t context_tokens = 0) : context_tokens_(context_tokens) {}

  /// Monotonic high-water mark of the request's context tokens (prompt plus generated).
  std::uint64_t context_tokens() const { return context_tokens_; }
  /// Host side: raises the high-water mark; a lower value is ignored.
  void observe_context_tokens(std::uint64_t context_tokens) {
    if (context_tokens > context_tokens_) context_tokens_ = context_tokens;
  }

 private:
  std::uint64_t context_tokens_;
};

/// One request as a classifier sees it, with the decisions the classifier may attach to it (policy
/// class, due time, scheduling cost, worker-selection target). Copyable; copies share progress().
class ClassifyRequest {
 public:
  /// Host side: what the router knows about a request when it arrives.
  struct Arrival {
    std::optional<std::string> request_id;
    std::size_t input_tokens = 0;
    std::optional<SessionContext> session;
    std::optional<WorkerWithDpRank> pinned_worker;
    /// The tenant the client named in its RouteRequest; empty when it named none.
    std::optional<std::string> tenant;
    /// The host's clock when the request reached the classifier, i.e. the time of the classify()
    /// call (logical time in replay): classify() has no PollContext to ask.
    TimePoint arrived_at{};
  };

  /// Host side: policy class "default", no due time, a scheduling cost of input_tokens, no
  /// worker-selection target, and progress starting at input_tokens.
  explicit ClassifyRequest(Arrival arrival);

  std::optional<std::string_view> request_id() const;
  std::size_t input_tokens() const { return arrival_.input_tokens; }
  /// The tenant a client names in its RouteRequest (e.g. for per-tenant limits); empty when none.
  std::optional<std::string_view> tenant() const;
  /// When the request reached the classifier, on the host's clock (see Arrival::arrived_at): the
  /// time of the decision in classify(); a deferred poll reads PollContext::now() instead.
  TimePoint arrived_at() const { return arrival_.arrived_at; }
  /// Shared with the host, which raises it as the request proceeds.
  const RequestProgress& progress() const { return *progress_; }

  /// The policy class the request is queued and accounted under ("default" unless set).
  std::string_view policy_class() const { return policy_class_; }
  void set_policy_class(std::string policy_class) { policy_class_ = std::move(policy_class); }

  /// When the request should be served by; empty: no deadline.
  std::optional<TimePoint> due_at() const { return due_at_; }
  void set_due_at(TimePoint due_at) { due_at_ = due_at; }

  /// What the request costs the policy queue, in tokens (input_tokens unless set).
  std::uint64_t scheduling_cost_tokens() const { return scheduling_cost_tokens_; }
  void set_scheduling_cost_tokens(std::uint64_t tokens) { scheduling_cost_tokens_ = tokens; }

  /// nullptr without session metadata.
  const SessionContext* session_context() const;
  /// The worker the caller pinned the request to, if any.
  std::optional<WorkerWithDpRank> pinned_worker() const { return arrival_.pinned_worker; }

  /// A soft target for worker selection: one rank of a worker, or every rank (no dp_rank).
  struct WorkerSelectionTarget {
    WorkerId worker_id = 0;
    std::optional<DpRank> dp_rank;

    friend bool operator==(const WorkerSelectionTarget&, const WorkerSelectionTarget&) = default;
  };

  /// Offers worker selection one rank of a worker as a soft target
  /// (WorkerSelectionContext::affinity_target()), in place of the session's soft binding.
  void set_worker_selection_target(WorkerWithDpRank worker) {
    worker_selection_target_ = WorkerSelectionTarget{worker.worker_id, worker.dp_rank};
    target_cleared_ = false;
  }
  /// Offers worker selection every rank of `worker_id` as a soft target.
  void set_worker_selection_target(WorkerId worker_id) {
    worker_selection_target_ = WorkerSelectionTarget{worker_id, std::nullopt};
    target_cleared_ = false;
  }
  /// Routes the request without a soft target: neither one set here nor the session's soft
  /// binding (a hard binding and a pin still apply).
  void clear_worker_selection_target() {
    worker_selection_target_.reset();
    target_cleared_ = true;
  }
  /// Host side: the target set by the classifier, if any.
  std::optional<WorkerSelectionTarget> worker_selection_target() const {
    return worker_selection_target_;
  }
  /// Host side: true when the classifier cleared the target last (no soft target at all).
  bool worker_selection_target_cleared() const { return target_cleared_; }

  /// Host side: the progress object the host raises as the request proceeds.
  const std::shared_ptr<RequestProgress>& shared_progress() const { return progress_; }

 private:
  Arrival arrival_;
  std::shared_ptr<RequestProgress> progress_;
  std::string policy_class_ = "default";
  std::optional<TimePoint> due_at_;
  std::uint64_t scheduling_cost_tokens_;
  std::optional<WorkerSelectionTarget> worker_selection_target_;
  bool target_cleared_ = false;
};

/// Why a classifier refused a request; the caller receives the message.
class ClassifierError {
 public:
  enum class Kind {
    Overloaded,   ///< too much work in flight or queued
    RateLimited,  ///< too many requests in a time window
    Failed,       ///< the classifier itself failed (threw, broke the poll contract ...)
  };

  static ClassifierError overloaded(std::string message) {
    return {Kind::Overloaded, std::move(message)};
  }
  /// `retry_after`: when the request would be admitted if sent again (clients get it as an HTTP
  /// Retry-After); empty when the classifier cannot say.
  static ClassifierError rate_limited(
      std::string message, std::optional<std::chrono::milliseconds> retry_after = std::nullopt) {
    ClassifierError error{Kind::RateLimited, std::move(message)};
    error.retry_after_ = retry_after;
    return error;
  }
  static ClassifierError failed(std::string message) { return {Kind::Failed, std::move(message)}; }

  Kind kind() const { return kind_; }
  std::string_view message() const { return message_; }
  std::optional<std::chrono::milliseconds> retry_after() const { return retry_after_; }

 private:
  ClassifierError(Kind kind, std::string message) : kind_(kind), message_(std::move(message)) {}
  Kind kind_;
  std::string message_;
  std::optional<std::chrono::milliseconds> retry_after_;
};

namespace detail {
/// Where the Wakers of one pending future deliver; defined in request_classifier.cpp.
struct WakeSlot;
}  // namespace detail

/// A handle that asks the host to poll a pending AdmissionFuture again, e.g. from on_event when
/// capacity frees up. Cheap to copy; may be fired any number of times, from any thread. Firing a
/// Waker whose future has resolved, or a default-constructed one, does nothing.
class Waker {
 public:
  Waker() = default;
  /// Requests a poll of the future this Waker was obtained for.
  void wake() const;

 private:
  friend class PollContext;
  explicit Waker(std::shared_ptr<detail::WakeSlot> slot) : slot_(std::move(slot)) {}
  std::shared_ptr<detail::WakeSlot> slot_;
};

/// What a deferred future's poll function receives: the time, and the two ways to register the
/// wake-up that a pending answer needs (a time, or a Waker the classifier fires later).
class PollContext {
 public:
  /// Host side: one poll at `now`; Wakers handed out by this poll call `on_wake`, which should
  /// only schedule a later poll (it may run inside the classifier's own code, e.g. on_event).
  PollContext(TimePoint now, std::function<void()> on_wake);

  TimePoint now() const { return now_; }
  /// Asks to be polled again at `when` (or soon after); the earliest of several calls counts.
  void wake_at(TimePoint when);
  /// A Waker for this future; the host polls again once it is fired.
  Waker waker();

  /// Host side: the earliest time passed to wake_at(), if any.
  std::optional<TimePoint> wake_time() const { return wake_time_; }
  /// Host side: true when this poll registered a wake-up of either kind.
  bool registered_wakeup() const { return wake_time_.has_value() || gave_waker_; }

 private:
  friend class AdmissionFuture;
  TimePoint now_;
  std::function<void()> on_wake_;
  std::optional<TimePoint> wake_time_;
  bool gave_waker_ = false;
  // The polled future's wake slot, set by AdmissionFuture::poll for the duration of the poll.
  std::shared_ptr<detail::WakeSlot> slot_;
};

/// The answer of one poll: admitted (with the request, possibly changed), rejected, or pending.
class Poll {
 public:
  static Poll ready(ClassifyRequest request) { return Poll{std::move(request)}; }
  static Poll rejected(ClassifierError error) { return Poll{std::move(error)}; }
  /// Not decided yet; the poll must have registered a wake-up through its PollContext.
  static Poll pending() { return Poll{Pending{}}; }

  bool is_pending() const { return std::holds_alternative<Pending>(state_); }
  bool is_ready() const { return std::holds_alternative<ClassifyRequest>(state_); }
  bool is_rejected() const { return std::holds_alternative<ClassifierError>(state_); }
  /// The admitted request; only when is_ready().
  ClassifyRequest& request() { return std::get<ClassifyRequest>(state_); }
  const ClassifyRequest& request() const { return std::get<ClassifyRequest>(state_); }
  /// The reason for rejecting; only when is_rejected().
  const ClassifierError& error() const { return std::get<ClassifierError>(state_); }

 private:
  struct Pending {};
  template <class State>
  explicit Poll(State state) : state_(std::move(state)) {}
  std::variant<Pending, ClassifyRequest, ClassifierError> state_;
};

/// A pollable admission decision. The classifier actor polls it until it is ready or rejected;
/// a pending poll registers a wake-up (PollContext::wake_at or waker()), so nothing ever blocks.
/// Move-only; destroying or resolving it silences its Wakers.
class AdmissionFuture {
 public:
  /// Admit now.
  static AdmissionFuture ready(ClassifyRequest request);
  /// Reject with a reason (overload, rate ...).
  static AdmissionFuture rejected(ClassifierError error);
  /// Decide later: `poll` runs at each host poll until it answers ready or rejected.
  static AdmissionFuture deferred(std::function<Poll(PollContext&)> poll);

  AdmissionFuture(AdmissionFuture&&) noexcept;
  AdmissionFuture& operator=(AdmissionFuture&&) noexcept;
  AdmissionFuture(const AdmissionFuture&) = delete;
  AdmissionFuture& operator=(const AdmissionFuture&) = delete;
  ~AdmissionFuture();

  /// Host side: polls once. An exception from the poll function, a pending answer without a
  /// registered wake-up, or a poll after the future resolved gives a rejection (Kind::Failed).
  Poll poll(PollContext& context);
  /// Host side: true once a poll answered ready or rejected.
  bool is_resolved() const { return resolved_; }

 private:
  // Empty (monostate) once resolved, so that a deferred poll function's captures are released.
  using State = std::variant<std::monostate, ClassifyRequest, ClassifierError,
                             std::function<Poll(PollContext&)>>;
  explicit AdmissionFuture(State state) : state_(std::move(state)) {}
  void silence_wakers();

  State state_;
  std::shared_ptr<detail::WakeSlot> slot_;  // deferred futures only, from their first poll
  bool resolved_ = false;
};

/// The request was handed to a worker.
struct Sent {
  std::string request_id;
  WorkerWithDpRank worker;
};
/// The worker produced its first token.
struct Responding {
  std::string request_id;
  WorkerWithDpRank worker;
};
/// The request finished; context_tokens is its final context size when known.
struct Completed {
  std::string request_id;
  WorkerWithDpRank worker;
  std::optional<std::size_t> context_tokens;
};
/// The request ended without completing (cancelled, failed, worker lost); worker is empty when it
/// never reached one.
struct Aborted {
  std::string request_id;
  std::optional<WorkerWithDpRank> worker;
  std::string error;
};
/// A lifecycle event of an admitted request.
using ClassifyEvent = std::variant<Sent, Responding, Completed, Aborted>;

/// How full the model's fleet is, as the host last observed it.
struct FleetLoad {
  /// Used over total KV cache blocks across the model's workers that registered a capacity, in
  /// [0, 1]. Workers without one are left out; while none has one, the host reports no load.
  double kv_usage = 0.0;
  /// When the host observed it, on the classifier actor's clock.
  TimePoint at{};
};

/// Decides admission for each request of one routed model. Owned by one classifier actor, so it is
/// never called from two threads at once; it must not block or throw.
class RequestClassifier {
 public:
  virtual ~RequestClassifier() = default;
  /// The admission decision for `request`; the default admits at once, unchanged.
  virtual AdmissionFuture classify(ClassifyRequest request) {
    return AdmissionFuture::ready(std::move(request));
  }
  /// Lifecycle events of admitted requests, in lifecycle order per request.
  virtual void on_event(const ClassifyEvent& /*event*/) {}
  /// The fleet's load, called by the host whenever it changes (in time order). A classifier that
  /// defers on load keeps the latest value and fires its parked Wakers when it allows more.
  virtual void on_fleet_load(const FleetLoad& /*load*/) {}
};

/// One (worker, rank) of the model's fleet, as a classifier's factory sees it.
class ClassifierWorker {
 public:
  ClassifierWorker(WorkerWithDpRank worker, std::optional<std::uint64_t> total_kv_blocks)
      : worker_(worker), total_kv_blocks_(total_kv_blocks) {}

  WorkerWithDpRank worker() const { return worker_; }
  /// The KV cache capacity the worker registered, in blocks; nullopt when it registered none
  /// (its engine did not say). The host's FleetLoad leaves such workers out.
  std::optional<std::uint64_t> total_kv_blocks() const { return total_kv_blocks_; }

 private:
  WorkerWithDpRank worker_;
  std::optional<std::uint64_t> total_kv_blocks_;
};

/// The model as discovery describes it: its block size and fleet. A classifier's factory receives
/// it; the host keeps it up to date (workers joining and leaving, the block size learnt from the
/// first registration) and alive as long as the classifier, which may keep a reference and read it
/// in any later call. The host changes it only between calls into the classifier.
class RequestClassifierContext {
 public:
  RequestClassifierContext(std::uint32_t block_size, std::span<const ClassifierWorker> workers)
      : block_size_(block_size), workers_(workers.begin(), workers.end()) {}

  /// Tokens per KV block; 0 until the model's first worker registered.
  std::size_t block_size() const { return block_size_; }
  /// Every (worker, rank) of the model, as discovery last described them.
  std::span<const ClassifierWorker> workers() const { return workers_; }

  /// Host side: the model's fleet changed.
  void update(std::uint32_t block_size, std::vector<ClassifierWorker> workers) {
    block_size_ = block_size;
    workers_ = std::move(workers);
  }

 private:
  std::uint32_t block_size_;
  std::vector<ClassifierWorker> workers_;
};

/// A startup diagnostic shown to the operator (bad parameters ...).
class RequestClassifierProviderError {
 public:
  explicit RequestClassifierProviderError(std::string message) : message_(std::move(message)) {}
  std::string_view message() const { return message_; }

 private:
  std::string message_;
};

/// Reads the classifier's `parameters` mapping strictly, like the worker-selection
/// ParameterReader: required<T>(key), optional<T>(key, fallback), finish().
using ParameterReader = plugins::BasicParameterReader<RequestClassifierProviderError>;

/// The classifier's YAML `parameters` mapping (may be absent: then every key is absent), and the
/// policy classes the router-policy YAML configures.
class RequestClassifierParameters {
 public:
  /// A null `source` means no parameters. `policy_classes`: the configured class names ("default"
  /// is always known); empty: the host does not say, and check_policy_class accepts any name.
  explicit RequestClassifierParameters(
      std::shared_ptr<const classifiers::ParameterSource> source,
      std::optional<std::vector<std::string>> policy_classes = std::nullopt)
      : source_(std::move(source)), policy_classes_(std::move(policy_classes)) {}
  /// A fresh strict reader over the mapping.
  ParameterReader reader() const { return ParameterReader{source_}; }
  /// For a provider, about a class its classifier will set: fails, naming `key` (its parameter
  /// path, e.g. "parameters.buckets[0].policy_class") and the known classes, when no class of
  /// that name is configured, so that a typo stops startup rather than refusing requests.
  std::expected<void, RequestClassifierProviderError> check_policy_class(
      std::string_view name, std::string_view key) const;

 private:
  std::shared_ptr<const classifiers::ParameterSource> source_;
  std::optional<std::vector<std::string>> policy_classes_;
};

using RequestClassifierFactory =
    std::function<std::unique_ptr<RequestClassifier>(const RequestClassifierContext&)>;
using RequestClassifierProvider =
    std::function<std::expected<RequestClassifierFactory, RequestClassifierProviderError>(
        const RequestClassifierParameters&)>;

}  // namespace kvr::plugins::request_classifier
