#include "selection/admission/admission_state.hpp"

#include <algorithm>
#include <exception>
#include <unordered_set>

#include <fmt/format.h>

namespace kvr {

namespace rc = plugins::request_classifier;

Error admission_error(rc::ClassifierError::Kind kind) {
  switch (kind) {
    case rc::ClassifierError::Kind::Overloaded:
      return Error::overloaded;
    case rc::ClassifierError::Kind::RateLimited:
      return Error::rate_limited;
    case rc::ClassifierError::Kind::Failed:
      return Error::rejected;
  }
  return Error::rejected;
}

rc::ClassifyRequest classify_request(const RouteRequest& request, rc::TimePoint now) {
  rc::ClassifyRequest::Arrival arrival;
  arrival.request_id = request.id();
  arrival.input_tokens = request.selection.prompt_tokens;
  arrival.session = request.selection.session;
  if (const auto& pin = request.selection.pinned_worker) {
    // A pin without a rank names every rank of the worker; the classifier sees rank 0.
    arrival.pinned_worker = WorkerWithDpRank{pin->worker_id, pin->dp_rank.value_or(0)};
  }
  if (!request.tenant.empty()) arrival.tenant = request.tenant;
  arrival.arrived_at = now;
  return rc::ClassifyRequest{std::move(arrival)};
}

std::expected<std::unique_ptr<rc::RequestClassifier>, std::string> build_classifier(
    const rc::RequestClassifierFactory& factory, const rc::RequestClassifierContext& context) {
  try {
    auto classifier = factory(context);
    if (!classifier) return std::unexpected(std::string{"its factory returned no classifier"});
    return classifier;
  } catch (const std::exception& error) {
    return std::unexpected(fmt::format("its factory threw: {}", error.what()));
  } catch (...) {
    return std::unexpected(std::string{"its factory threw a non-standard exception"});
  }
}

void apply_admission(RouteRequest& request, const rc::ClassifyRequest& admitted) {
  if (const auto target = admitted.worker_selection_target()) {
    request.selection.affinity_target =
        plugins::worker_selection::WorkerAffinityTarget{target->worker_id, target->dp_rank};
  } else if (admitted.worker_selection_target_cleared()) {
    request.selection.affinity_target.reset();
    request.without_soft_target = true;
  }
  request.policy_class = std::string{admitted.policy_class()};
  request.due_at = admitted.due_at();
  request.scheduling_cost_tokens = admitted.scheduling_cost_tokens();
}

void AdmissionState::WokenQueue::push(std::uint64_t sequence) {
  bool first = false;
  {
    const std::lock_guard lock{mutex};
    first = woken.empty();
    woken.push_back(sequence);
  }
  // Outside the lock: the signal may enqueue a message, or (in a test) look at the queue.
  if (first && signal) signal();
}

std::vector<std::uint64_t> AdmissionState::WokenQueue::drain() {
  const std::lock_guard lock{mutex};
  return std::exchange(woken, {});
}

bool AdmissionState::WokenQueue::empty() {
  const std::lock_guard lock{mutex};
  return woken.empty();
}

std::optional<AdmissionState::TimePoint> AdmissionState::Pending::expires_at() const {
  if (due_at && wait_until) return std::min(*due_at, *wait_until);
  return due_at ? due_at : wait_until;
}

AdmissionState::AdmissionState(std::unique_ptr<rc::RequestClassifier> classifier,
                               WakeSignal on_wake, std::optional<Duration> max_wait)
    : classifier_(std::move(classifier)),
      woken_(std::make_shared<WokenQueue>()),
      max_wait_(max_wait) {
  woken_->signal = std::move(on_wake);
}

AdmissionState::~AdmissionState() {
  // The futures go first: a deferred one may hand its state back to the classifier.
  pending_.clear();
}

std::optional<AdmissionOutcome> AdmissionState::admit(std::string request_id,
                                                      rc::ClassifyRequest request, TimePoint now) {
  if (pending_ids_.contains(request_id) || admitted_.contains(request_id)) {
    return AdmissionOutcome{
        request_id, AdmissionRejected{Error::invalid_request,
                                      fmt::format("request '{}' is already being admitted or "
                                                  "served",
                                                  request_id)}};
  }
  const std::optional<TimePoint> due_at = request.due_at();
  std::optional<rc::AdmissionFuture> future;
  // The host's rule: an exception from plugin code fails this request only.
  try {
    future.emplace(classifier_->classify(std::move(request)));
  } catch (const std::exception& error) {
    return AdmissionOutcome{
        request_id, AdmissionRejected{Error::rejected,
                                      fmt::format("request classifier threw: {}", error.what())}};
  } catch (...) {
    return AdmissionOutcome{
        request_id,
        AdmissionRejected{Error::rejected, "request classifier threw a non-standard exception"}};
  }
  const std::uint64_t sequence = next_sequence_++;
  pending_ids_.emplace(request_id, sequence);
  std::optional<TimePoint> wait_until;
  if (max_wait_) wait_until = now + *max_wait_;
  pending_.emplace(sequence, Pending{std::move(request_id), std::move(*future), std::nullopt,
                                     due_at, wait_until});
  return poll(sequence, now);
}

std::optional<AdmissionOutcome> AdmissionState::poll(std::uint64_t sequence, TimePoint now) {
  auto it = pending_.find(sequence);
  if (it == pending_.end()) return std::nullopt;  // decided or cancelled since it was woken
  Pending& entry = it->second;
  forget_timers(sequence, entry);
  entry.wake_at.reset();
  if (entry.due_at && *entry.due_at <= now) {
    return finish(sequence,
                  AdmissionRejected{Error::due_time_expired,
                                    "the request's due time passed while admission deferred it"});
  }
  if (entry.wait_until && *entry.wait_until <= now) {
    const auto limit = std::chrono::duration_cast<std::chrono::milliseconds>(*max_wait_);
    return finish(sequence,
                  AdmissionRejected{Error::timeout,
                                    fmt::format("the request waited for admission longer than "
                                                "the limit of {} ms",
                                                limit.count())});
  }
  const std::weak_ptr<WokenQueue> queue = woken_;
  rc::PollContext context{now, [queue, sequence] {
                            if (auto woken = queue.lock()) woken->push(sequence);
                          }};
  ++polls_;
  rc::Poll answer = entry.future.poll(context);  // catches the poll function's exceptions
  if (!answer.is_pending()) return decide(sequence, std::move(answer));
  if (context.wake_time()) {
    entry.wake_at = *context.wake_time();
    wake_times_.emplace(*entry.wake_at, sequence);
  }
  if (const auto expires_at = entry.expires_at()) expiry_times_.emplace(*expires_at, sequence);
  return std::nullopt;
}

AdmissionOutcome AdmissionState::decide(std::uint64_t sequence, rc::Poll answer) {
  if (answer.is_ready()) return finish(sequence, std::move(answer.request()));
  const rc::ClassifierError& error = answer.error();
  return finish(sequence, AdmissionRejected{admission_error(error.kind()),
                                            std::string{error.message()}, error.retry_after()});
}

AdmissionOutcome AdmissionState::finish(
    std::uint64_t sequence, std::variant<rc::ClassifyRequest, AdmissionRejected> result) {
  auto node = pending_.extract(sequence);
  Pending& entry = node.mapped();
  forget_timers(sequence, entry);
  pending_ids_.erase(entry.request_id);
  if (const auto* admitted = std::get_if<rc::ClassifyRequest>(&result)) {
    admitted_.emplace(entry.request_id, Admitted{std::nullopt, admitted->shared_progress()});
  }
  return AdmissionOutcome{std::move(entry.request_id), std::move(result)};
}

void AdmissionState::forget_timers(std::uint64_t sequence, const Pending& pending) {
  if (pending.wake_at) wake_times_.erase({*pending.wake_at, sequence});
  if (const auto expires_at = pending.expires_at()) expiry_times_.erase({*expires_at, sequence});
}

std::vector<AdmissionOutcome> AdmissionState::poll_due(TimePoint now) {
  // Each request once: a poll that wakes its own future again waits for the next call (the wake
  // signal asks for it), so a misbehaving classifier cannot spin this loop.
  std::vector<std::uint64_t> due;
  for (auto it = expiry_times_.begin(); it != expiry_times_.end() && it->first <= now; ++it) {
    due.push_back(it->second);
  }
  for (auto it = wake_times_.begin(); it != wake_times_.end() && it->first <= now; ++it) {
    due.push_back(it->second);
  }
  std::unordered_set<std::uint64_t> polled;
  std::vector<AdmissionOutcome> outcomes;
  const auto run = [&](std::uint64_t sequence) {
    if (!polled.insert(sequence).second) return;
    if (auto outcome = poll(sequence, now)) outcomes.push_back(std::move(*outcome));
  };
  for (const std::uint64_t sequence : due) run(sequence);
  // A poll may fire other requests' Wakers; those are polled in the same call.
  for (auto woken = woken_->drain(); !woken.empty(); woken = woken_->drain()) {
    bool progressed = false;
    for (const std::uint64_t sequence : woken) {
      if (polled.contains(sequence)) {
        woken_->push(sequence);  // the next call polls it
        continue;
      }
      progressed = true;
      run(sequence);
    }
    if (!progressed) break;
  }
  return outcomes;
}

AdmissionCancel AdmissionState::cancel(const std::string& request_id, std::string_view reason) {
  if (auto it = pending_ids_.find(request_id); it != pending_ids_.end()) {
    auto node = pending_.extract(it->second);
    forget_timers(it->second, node.mapped());
    pending_ids_.erase(it);
    return AdmissionCancel::pending;  // the future's destructor silences its Wakers
  }
  auto admitted = admitted_.find(request_id);
  if (admitted == admitted_.end()) return AdmissionCancel::unknown;
  const std::optional<WorkerWithDpRank> worker = admitted->second.worker;
  admitted_.erase(admitted);
  forward(rc::Aborted{request_id, worker, std::string{reason}});
  return AdmissionCancel::admitted;
}

void AdmissionState::on_event(const rc::ClassifyEvent& event) {
  const std::string& request_id =
      std::visit([](const auto& e) -> const std::string& { return e.request_id; }, event);
  auto it = admitted_.find(request_id);
  if (it == admitted_.end()) return;
  if (const auto* sent = std::get_if<rc::Sent>(&event)) it->second.worker = sent->worker;
  if (const auto* responding = std::get_if<rc::Responding>(&event)) {
    it->second.worker = responding->worker;
  }
  if (const auto* completed = std::get_if<rc::Completed>(&event)) {
    if (completed->context_tokens && it->second.progress) {
      it->second.progress->observe_context_tokens(*completed->context_tokens);
    }
  }
  if (std::holds_alternative<rc::Completed>(event) || std::holds_alternative<rc::Aborted>(event)) {
    admitted_.erase(it);
  }
  forward(event);
}

void AdmissionState::observe_progress(const std::string& request_id, std::uint64_t context_tokens) {
  const auto it = admitted_.find(request_id);
  if (it == admitted_.end() || !it->second.progress) return;
  it->second.progress->observe_context_tokens(context_tokens);
}

void AdmissionState::forward(const rc::ClassifyEvent& event) {
  // The plugin must not throw; if it does, the event is lost (and counted), not the node.
  try {
    classifier_->on_event(event);
  } catch (...) {
    fault("event", std::current_exception());
  }
}

void AdmissionState::on_fleet_load(const rc::FleetLoad& load) {
  try {
    classifier_->on_fleet_load(load);
  } catch (...) {
    fault("fleet_load", std::current_exception());
  }
}

void AdmissionState::fault(std::string_view stage, std::exception_ptr error) const {
  if (!on_fault_) return;
  try {
    std::rethrow_exception(std::move(error));
  } catch (const std::exception& thrown) {
    on_fault_(stage, thrown.what());
  } catch (...) {
    on_fault_(stage, "a non-standard exception");
  }
}

std::optional<AdmissionState::TimePoint> AdmissionState::next_deadline() const {
  std::optional<TimePoint> next;
  if (!wake_times_.empty()) next = wake_times_.begin()->first;
  if (!expiry_times_.empty() && (!next || expiry_times_.begin()->first < *next)) {
    next = expiry_times_.begin()->first;
  }
  return next;
}

bool AdmissionState::has_woken() const { return !woken_->empty(); }

}  // namespace kvr
