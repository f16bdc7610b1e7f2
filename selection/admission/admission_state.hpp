// The admission state of one routed model, as a plain object: it owns the model's
// RequestClassifier and the AdmissionFutures of its undecided requests. The classifier actor keeps
// one per model and drives it; `kvr replay` and the tests can drive it on a logical clock. No CAF.
//
// Rules:
//   - admit() calls classify() (an exception fails that request only, with an explicit error) and
//     polls the future once. A future still pending is kept with the wake-ups its poll registered:
//     the earliest wake_at() time, and Wakers, which only record the request as woken (they may
//     fire inside the classifier's own code, e.g. on_event, or on another thread) and then call
//     the owner's wake signal once per batch of wake-ups.
//   - poll_due() re-polls only the requests that were woken or whose wake time passed; the others
//     are not touched, so any number of deferred futures cost nothing while nothing wakes them.
//     Each request is polled at most once per call.
//   - A deferred request whose due time (ClassifyRequest::due_at at arrival) passes is rejected
//     with due_time_expired, whatever its future would answer.
//   - With a wait limit, a request still deferred that long after admit() is refused with timeout
//     (its client has most likely given up; admitting it later would book a worker for nobody).
//     Its future is dropped and the classifier is told nothing, as for cancel(): it was never
//     admitted. A due time that passes first wins (due_time_expired).
//   - Lifecycle events of admitted requests go to on_event in the order given, each terminal one
//     (Completed, Aborted) at most once: a request is forgotten at its end, and events for a
//     request that is not admitted here (never, or no longer) are dropped.
//   - cancel() drops a pending future (which silences its Wakers) or, for an admitted request,
//     tells the classifier Aborted.
//   - An admitted request's progress (ClassifyRequest::progress(), shared by every copy of it and
//     by its retries) is raised by observe_progress() as its context grows, and by a Completed
//     event's context_tokens before the classifier sees the event.
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <expected>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include "classifiers/request_classifier.hpp"
#include "messages/error.hpp"
#include "selection/partition/route_request.hpp"

namespace kvr {

/// Why admission refused a request: the error code the client receives, and the reason.
struct AdmissionRejected {
  Error code = Error::rejected;
  std::string message;
  /// When a retry would be admitted, if the classifier said.
  std::optional<std::chrono::milliseconds> retry_after;
};

/// The decision for one request.
struct AdmissionOutcome {
  std::string request_id;
  /// Admitted (the request with the classifier's overrides), or rejected.
  std::variant<plugins::request_classifier::ClassifyRequest, AdmissionRejected> result;

  bool admitted() const {
    return std::holds_alternative<plugins::request_classifier::ClassifyRequest>(result);
  }
  const plugins::request_classifier::ClassifyRequest& request() const {
    return std::get<plugins::request_classifier::ClassifyRequest>(result);
  }
  const AdmissionRejected& rejection() const { return std::get<AdmissionRejected>(result); }
};

/// The error code a classifier's rejection maps to: Overloaded → overloaded, RateLimited →
/// rate_limited, Failed → rejected.
Error admission_error(plugins::request_classifier::ClassifierError::Kind kind);

/// What the classifier sees of a route request arriving at `now` (a pin without a rank is shown
/// as rank 0; an empty tenant as none).
plugins::request_classifier::ClassifyRequest classify_request(
    const RouteRequest& request, plugins::request_classifier::TimePoint now);

/// Carries an admitted request's decisions on the route request: the worker-selection target as
/// selection.affinity_target (a soft target, which session affinity then does not replace), the
/// policy class, due time and scheduling cost for the policy-class queue. A generate request
/// keeps them for its retry, which routes the same RouteRequest again.
void apply_admission(RouteRequest& request,
                     const plugins::request_classifier::ClassifyRequest& admitted);

/// Runs a classifier factory, as the node and replay do once per model: the classifier, or why
/// it cannot be built ("its factory threw: ...", "its factory returned no classifier"). A plugin's
/// fault fails its model's requests, never its caller.
std::expected<std::unique_ptr<plugins::request_classifier::RequestClassifier>, std::string>
build_classifier(const plugins::request_classifier::RequestClassifierFactory& factory,
                 const plugins::request_classifier::RequestClassifierContext& context);

/// What cancel() found.
enum class AdmissionCancel : std::uint8_t {
  unknown,   ///< not pending, not admitted: nothing changed
  pending,   ///< its future was dropped (no event: it was never admitted)
  admitted,  ///< the classifier was told Aborted
};

/// The admission state of one model (file comment).
class AdmissionState {
 public:
  using TimePoint = plugins::request_classifier::TimePoint;
  /// Called after a Waker recorded a wake-up into an empty batch; it should only schedule a
  /// poll_due() (it may run on any thread, inside the classifier's code).
  using WakeSignal = std::function<void()>;

  using Duration = TimePoint::duration;

  /// `max_wait`: the wait limit of deferred requests (file comment); empty: none. It must be
  /// positive.
  explicit AdmissionState(
      std::unique_ptr<plugins::request_classifier::RequestClassifier> classifier,
      WakeSignal on_wake = {}, std::optional<Duration> max_wait = std::nullopt);
  ~AdmissionState();
  AdmissionState(const AdmissionState&) = delete;
  AdmissionState& operator=(const AdmissionState&) = delete;

  /// Classifies a request and polls its future once: the outcome, or empty while it is pending.
  /// A request id already pending or admitted here is rejected (invalid_request).
  std::optional<AdmissionOutcome> admit(std::string request_id,
                                        plugins::request_classifier::ClassifyRequest request,
                                        TimePoint now);
  /// Re-polls the woken requests and those whose wake time passed; rejects those whose due time
  /// or wait limit passed. Returns the decisions made, in the order made.
  std::vector<AdmissionOutcome> poll_due(TimePoint now);
  /// Drops a pending request, or tells the classifier that an admitted one was aborted.
  AdmissionCancel cancel(const std::string& request_id, std::string_view reason);
  /// A lifecycle event of an admitted request (file comment).
  void on_event(const plugins::request_classifier::ClassifyEvent& event);
  /// An admitted request now holds `context_tokens` tokens of context (prompt plus generated):
  /// raises its progress; a request not admitted here is ignored.
  void observe_progress(const std::string& request_id, std::uint64_t context_tokens);
  void on_fleet_load(const plugins::request_classifier::FleetLoad& load);
  /// Told each exception on_event ("event") or on_fleet_load ("fleet_load") of the classifier
  /// let escape, with its message: the event is lost, and the owner counts and logs it.
  using FaultSink = std::function<void(std::string_view stage, std::string_view what)>;
  void on_fault(FaultSink sink) { on_fault_ = std::move(sink); }

  /// When poll_due() must run next for time reasons: the earliest wake time, due time or wait
  /// limit; empty: none.
  std::optional<TimePoint> next_deadline() const;
  /// True when a Waker fired since the last poll_due().
  bool has_woken() const;
  std::size_t pending() const { return pending_.size(); }
  std::size_t admitted() const { return admitted_.size(); }
  /// Polls made so far (admit's first poll included).
  std::uint64_t polls() const { return polls_; }

 private:
  struct Pending {
    std::string request_id;
    plugins::request_classifier::AdmissionFuture future;
    std::optional<TimePoint> wake_at;
    std::optional<TimePoint> due_at;
    /// When the wait limit refuses it; empty: no limit.
    std::optional<TimePoint> wait_until;
    /// The earliest of due_at and wait_until: its key in expiry_times_.
    std::optional<TimePoint> expires_at() const;
  };
  struct Admitted {
    std::optional<WorkerWithDpRank> worker;
    std::shared_ptr<plugins::request_classifier::RequestProgress> progress;
  };
  /// Wake-ups recorded by Wakers (any thread), drained by poll_due().
  struct WokenQueue {
    std::mutex mutex;
    std::vector<std::uint64_t> woken;
    WakeSignal signal;
    void push(std::uint64_t sequence);
    std::vector<std::uint64_t> drain();
    bool empty();
  };

  /// Polls one pending future; erases it and returns its outcome once decided.
  std::optional<AdmissionOutcome> poll(std::uint64_t sequence, TimePoint now);
  AdmissionOutcome decide(std::uint64_t sequence, plugins::request_classifier::Poll answer);
  /// Erases a pending request with its decision.
  AdmissionOutcome finish(
      std::uint64_t sequence,
      std::variant<plugins::request_classifier::ClassifyRequest, AdmissionRejected> result);
  void forget_timers(std::uint64_t sequence, const Pending& pending);
  void forward(const plugins::request_classifier::ClassifyEvent& event);
  void fault(std::string_view stage, std::exception_ptr error) const;
  FaultSink on_fault_;

  std::unique_ptr<plugins::request_classifier::RequestClassifier> classifier_;
  std::shared_ptr<WokenQueue> woken_;
  std::optional<Duration> max_wait_;
  std::uint64_t next_sequence_ = 1;
  std::unordered_map<std::uint64_t, Pending> pending_;
  std::unordered_map<std::string, std::uint64_t> pending_ids_;
  std::unordered_map<std::string, Admitted> admitted_;
  std::set<std::pair<TimePoint, std::uint64_t>> wake_times_;
  /// Pending requests by Pending::expires_at().
  std::set<std::pair<TimePoint, std::uint64_t>> expiry_times_;
  std::uint64_t polls_ = 0;
};

}  // namespace kvr
