// A stand-in for the classifier actor's polling side, for the built-in classifiers' tests: it
// polls a future once when it is created and again only on a wake-up (a fired Waker, or the time
// the last poll asked for), counting both, so a test sees every poll a classifier caused.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include <gtest/gtest.h>

#include "classifiers/plugin_parameters.hpp"
#include "classifiers/request_classifier.hpp"

namespace kvr::classifiers::builtin::testing {

using namespace plugins::request_classifier;

/// One request's admission as the host drives it.
class Admission {
 public:
  /// Classifies `request` and polls the future once at `now`, as the host does on arrival.
  static std::unique_ptr<Admission> start(RequestClassifier& classifier, ClassifyRequest request,
                                          TimePoint now) {
    auto admission =
        std::unique_ptr<Admission>(new Admission(classifier.classify(std::move(request))));
    admission->poll(now);
    return admission;
  }

  /// Polls at `now` when a wake-up is due (a Waker fired, or the requested time has come);
  /// returns whether it polled.
  bool step(TimePoint now) {
    if (answer_ && !answer_->is_pending()) return false;
    const bool time_due = wake_time_ && *wake_time_ <= now;
    if (wakes_ == 0 && !time_due) return false;
    poll(now);
    return true;
  }

  bool is_ready() const { return answer_ && answer_->is_ready(); }
  bool is_pending() const { return answer_ && answer_->is_pending(); }
  bool is_rejected() const { return answer_ && answer_->is_rejected(); }
  const ClassifyRequest& request() const { return answer_->request(); }
  const ClassifierError& error() const { return answer_->error(); }

  /// Polls so far, including the first.
  int polls() const { return polls_; }
  /// Waker firings since the last poll.
  int wakes() const { return wakes_; }
  /// The time the last poll asked to be polled again at, if any.
  std::optional<TimePoint> wake_time() const { return wake_time_; }

 private:
  explicit Admission(AdmissionFuture future) : future_(std::move(future)) {}

  void poll(TimePoint now) {
    wakes_ = 0;
    PollContext context{now, [this] { ++wakes_; }};
    answer_.emplace(future_.poll(context));
    ++polls_;
    wake_time_ = context.wake_time();
  }

  AdmissionFuture future_;
  std::optional<Poll> answer_;
  int polls_ = 0;
  int wakes_ = 0;
  std::optional<TimePoint> wake_time_;
};

/// A request as the host builds it.
struct RequestSpec {
  std::string id;
  std::size_t input_tokens = 100;
  std::optional<std::string> tenant;
  std::optional<SessionContext> session;
  TimePoint arrived_at{};
};

inline ClassifyRequest make_request(RequestSpec spec) {
  return ClassifyRequest{ClassifyRequest::Arrival{.request_id = std::move(spec.id),
                                                  .input_tokens = spec.input_tokens,
                                                  .session = std::move(spec.session),
                                                  .pinned_worker = std::nullopt,
                                                  .tenant = std::move(spec.tenant),
                                                  .arrived_at = spec.arrived_at}};
}

/// A turn of session `id`; `final_turn` ends it.
inline SessionContext session(std::string id, bool final_turn = false) {
  return SessionContext{std::move(id), std::nullopt, final_turn, std::nullopt};
}

/// The classifier's `parameters` from a YAML flow mapping.
inline RequestClassifierParameters parameters(std::string_view yaml) {
  auto source = ParameterSource::from_text(yaml, "parameters");
  EXPECT_TRUE(source.has_value()) << source.error();
  return RequestClassifierParameters{source.value_or(ParameterSource::empty("parameters"))};
}

/// The provider's error message for `yaml` (empty, with a failure, when it succeeded).
template <class Parameters>
std::string parameter_error(std::string_view yaml) {
  auto parsed = Parameters::read(parameters(yaml));
  EXPECT_FALSE(parsed.has_value()) << "accepted: " << yaml;
  return parsed.has_value() ? std::string{} : std::string{parsed.error().message()};
}

}  // namespace kvr::classifiers::builtin::testing
