#include "classifiers/request_classifier.hpp"

#include <algorithm>
#include <exception>
#include <mutex>

#include <fmt/format.h>

namespace kvr::plugins::request_classifier {

namespace detail {

// The callback of the future's latest poll. Wakers may fire from any thread, so the callback is
// copied out under the lock and run outside it: a callback that fires or polls again cannot
// deadlock, at the price of a possible spurious wake-up racing with silence(), which the polling
// side tolerates anyway.
struct WakeSlot {
  void arm(std::function<void()> callback) {
    const std::lock_guard lock{mutex};
    on_wake = std::move(callback);
  }
  void silence() {
    const std::lock_guard lock{mutex};
    on_wake = nullptr;
  }
  void fire() {
    std::function<void()> callback;
    {
      const std::lock_guard lock{mutex};
      callback = on_wake;
    }
    if (callback) callback();
  }

  std::mutex mutex;
  std::function<void()> on_wake;
};

}  // namespace detail

ClassifyRequest::ClassifyRequest(Arrival arrival)
    : arrival_(std::move(arrival)),
      progress_(std::make_shared<RequestProgress>(arrival_.input_tokens)),
      scheduling_cost_tokens_(arrival_.input_tokens) {}

std::optional<std::string_view> ClassifyRequest::request_id() const {
  if (!arrival_.request_id) return std::nullopt;
  return std::string_view{*arrival_.request_id};
}

std::optional<std::string_view> ClassifyRequest::tenant() const {
  if (!arrival_.tenant) return std::nullopt;
  return std::string_view{*arrival_.tenant};
}

const SessionContext* ClassifyRequest::session_context() const {
  return arrival_.session ? &*arrival_.session : nullptr;
}

void Waker::wake() const {
  if (slot_) slot_->fire();
}

PollContext::PollContext(TimePoint now, std::function<void()> on_wake)
    : now_(now), on_wake_(std::move(on_wake)) {}

void PollContext::wake_at(TimePoint when) {
  if (!wake_time_ || when < *wake_time_) wake_time_ = when;
}

Waker PollContext::waker() {
  // Outside AdmissionFuture::poll (a host test driving a poll function directly) the context
  // gets a slot of its own.
  if (!slot_) {
    slot_ = std::make_shared<detail::WakeSlot>();
    slot_->arm(on_wake_);
  }
  gave_waker_ = true;
  return Waker{slot_};
}

AdmissionFuture AdmissionFuture::ready(ClassifyRequest request) {
  return AdmissionFuture{State{std::move(request)}};
}

AdmissionFuture AdmissionFuture::rejected(ClassifierError error) {
  return AdmissionFuture{State{std::move(error)}};
}

AdmissionFuture AdmissionFuture::deferred(std::function<Poll(PollContext&)> poll) {
  return AdmissionFuture{State{std::move(poll)}};
}

AdmissionFuture::AdmissionFuture(AdmissionFuture&&) noexcept = default;

AdmissionFuture& AdmissionFuture::operator=(AdmissionFuture&& other) noexcept {
  if (this != &other) {
    silence_wakers();
    state_ = std::move(other.state_);
    slot_ = std::move(other.slot_);
    resolved_ = other.resolved_;
  }
  return *this;
}

AdmissionFuture::~AdmissionFuture() { silence_wakers(); }

void AdmissionFuture::silence_wakers() {
  if (slot_) slot_->silence();
}

Poll AdmissionFuture::poll(PollContext& context) {
  if (resolved_) {
    return Poll::rejected(ClassifierError::failed("admission future polled after it resolved"));
  }
  if (auto* request = std::get_if<ClassifyRequest>(&state_)) {
    Poll answer = Poll::ready(std::move(*request));
    resolved_ = true;
    state_ = std::monostate{};
    return answer;
  }
  if (auto* error = std::get_if<ClassifierError>(&state_)) {
    Poll answer = Poll::rejected(std::move(*error));
    resolved_ = true;
    state_ = std::monostate{};
    return answer;
  }
  auto* poll_function = std::get_if<std::function<Poll(PollContext&)>>(&state_);
  if (poll_function == nullptr || !*poll_function) {
    resolved_ = true;
    return Poll::rejected(
        ClassifierError::failed("deferred admission future has no poll function"));
  }

  if (!slot_) slot_ = std::make_shared<detail::WakeSlot>();
  // Wakers from earlier polls share the slot, so they now reach this poll's callback.
  slot_->arm(context.on_wake_);
  context.slot_ = slot_;
  std::optional<Poll> answer;
  // The host's rule: an exception from plugin code fails this request only.
  try {
    answer = (*poll_function)(context);
  } catch (const std::exception& error) {
    answer = Poll::rejected(
        ClassifierError::failed(fmt::format("request classifier threw: {}", error.what())));
  } catch (...) {
    answer = Poll::rejected(
        ClassifierError::failed("request classifier threw a non-standard exception"));
  }
  context.slot_.reset();

  if (answer->is_pending()) {
    if (context.registered_wakeup()) return std::move(*answer);
    // Nothing would ever poll it again: fail loudly instead of leaking the request.
    answer = Poll::rejected(
        ClassifierError::failed("request classifier answered pending without registering a wake-up "
                                "(PollContext::wake_at or PollContext::waker)"));
  }
  resolved_ = true;
  silence_wakers();
  state_ = std::monostate{};
  return std::move(*answer);
}

std::expected<void, RequestClassifierProviderError> RequestClassifierParameters::check_policy_class(
    std::string_view name, std::string_view key) const {
  if (!policy_classes_ || name == "default" ||
      std::ranges::find(*policy_classes_, name) != policy_classes_->end()) {
    return {};
  }
  std::string known;
  for (const std::string& configured : *policy_classes_) {
    if (configured != "default") known += fmt::format("{}, ", configured);
  }
  known += "default";
  return std::unexpected(RequestClassifierProviderError{fmt::format(
      "{}: unknown policy class '{}'; policy_classes configures: {}", key, name, known)});
}

}  // namespace kvr::plugins::request_classifier
