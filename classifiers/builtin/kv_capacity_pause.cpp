#include "classifiers/builtin/kv_capacity_pause.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "classifiers/builtin/provider.hpp"

namespace kvr::classifiers::builtin {

using plugins::request_classifier::AdmissionFuture;
using plugins::request_classifier::ClassifyRequest;
using plugins::request_classifier::FleetLoad;
using plugins::request_classifier::ParameterReader;
using plugins::request_classifier::Poll;
using plugins::request_classifier::PollContext;
using plugins::request_classifier::RequestClassifierFactory;
using plugins::request_classifier::RequestClassifierParameters;
using plugins::request_classifier::RequestClassifierProviderError;
using plugins::request_classifier::TimePoint;
using plugins::request_classifier::Waker;

struct KvCapacityPauseClassifier::Ticket {
  Waker waker;            // from the latest pending poll
  bool released = false;  // a resume let it through
};

struct KvCapacityPauseClassifier::State {
  explicit State(const KvCapacityPauseParameters& parameters)
      : pause_above(parameters.pause_above),
        resume_below(parameters.resume_below),
        max_pause(std::chrono::milliseconds{parameters.max_pause_ms}),
        session_ttl(std::chrono::milliseconds{parameters.session_ttl_ms}) {}

  TimePoint forced_resume_at() const { return paused_since + max_pause; }

  // Ends the pause: everything deferred is let through.
  void resume(TimePoint now) {
    paused = false;
    resumed_at = now;
    std::vector<std::weak_ptr<Ticket>> released;
    released.swap(waiting);
    for (const auto& weak : released) {
      if (auto ticket = weak.lock()) {
        ticket->released = true;
        ticket->waker.wake();
      }
    }
  }

  void force_resume_if_due(TimePoint now) {
    if (paused && now >= forced_resume_at()) resume(now);
  }

  bool is_running(const ClassifyRequest& request, TimePoint now) const {
    const auto* session = request.session_context();
    if (session == nullptr) return false;
    const auto found = sessions.find(std::string{session->session_id()});
    return found != sessions.end() && now - found->second <= session_ttl;
  }

  // An admitted turn makes its session running, or ends it when it is the final one.
  void admitted(const ClassifyRequest& request, TimePoint now) {
    const auto* session = request.session_context();
    if (session == nullptr) return;
    std::string id{session->session_id()};
    if (session->session_final().value_or(false)) {
      sessions.erase(id);
    } else {
      sessions.insert_or_assign(std::move(id), now);
    }
  }

  void forget_idle_sessions(TimePoint now) {
    if (now - swept_at < session_ttl) return;
    swept_at = now;
    std::erase_if(sessions, [&](const auto& entry) { return now - entry.second > session_ttl; });
  }

  double pause_above;
  double resume_below;
  TimePoint::duration max_pause;
  TimePoint::duration session_ttl;
  bool paused = false;
  TimePoint paused_since{};
  TimePoint resumed_at{};
  TimePoint swept_at{};
  std::vector<std::weak_ptr<Ticket>> waiting;
  std::unordered_map<std::string, TimePoint> sessions;  // running, by id: last admitted turn
};

std::expected<KvCapacityPauseParameters, RequestClassifierProviderError>
KvCapacityPauseParameters::read(const RequestClassifierParameters& parameters) {
  const KvCapacityPauseParameters defaults;
  ParameterReader reader = parameters.reader();
  auto pause_above = reader.required<double>("pause_above");
  if (!pause_above) return std::unexpected(pause_above.error());
  auto resume_below = reader.required<double>("resume_below");
  if (!resume_below) return std::unexpected(resume_below.error());
  auto max_pause_ms = reader.optional<std::uint64_t>("max_pause_ms", defaults.max_pause_ms);
  if (!max_pause_ms) return std::unexpected(max_pause_ms.error());
  auto session_ttl_ms = reader.optional<std::uint64_t>("session_ttl_ms", defaults.session_ttl_ms);
  if (!session_ttl_ms) return std::unexpected(session_ttl_ms.error());
  if (auto finished = reader.finish(); !finished) return std::unexpected(finished.error());

  const auto fail = [](std::string message) {
    return std::unexpected(RequestClassifierProviderError{std::move(message)});
  };
  if (!(*pause_above > 0.0 && *pause_above <= 1.0)) {
    return fail(fmt::format("parameters.pause_above: must be in (0, 1], got {}", *pause_above));
  }
  if (!(*resume_below >= 0.0 && *resume_below < *pause_above)) {
    return fail(
        fmt::format("parameters.resume_below: must be in [0, pause_above) = [0, {}), got {}",
                    *pause_above, *resume_below));
  }
  // About 34 years: far below where the clock's nanosecond count would overflow.
  constexpr std::uint64_t kMaxMs = std::uint64_t{1} << 40;
  if (*max_pause_ms < 1 || *max_pause_ms > kMaxMs) {
    return fail(
        fmt::format("parameters.max_pause_ms: must be in [1, {}], got {}", kMaxMs, *max_pause_ms));
  }
  if (*session_ttl_ms < 1 || *session_ttl_ms > kMaxMs) {
    return fail(fmt::format("parameters.session_ttl_ms: must be in [1, {}], got {}", kMaxMs,
                            *session_ttl_ms));
  }
  return KvCapacityPauseParameters{.pause_above = *pause_above,
                                   .resume_below = *resume_below,
                                   .max_pause_ms = *max_pause_ms,
                                   .session_ttl_ms = *session_ttl_ms};
}

KvCapacityPauseClassifier::KvCapacityPauseClassifier(const KvCapacityPauseParameters& parameters)
    : state_(std::make_shared<State>(parameters)) {}

KvCapacityPauseClassifier::~KvCapacityPauseClassifier() = default;

AdmissionFuture KvCapacityPauseClassifier::classify(ClassifyRequest request) {
  const TimePoint now = request.arrived_at();
  State& state = *state_;
  state.forget_idle_sessions(now);
  state.force_resume_if_due(now);
  if (!state.paused || state.is_running(request, now)) {
    state.admitted(request, now);
    return AdmissionFuture::ready(std::move(request));
  }
  // Registered at arrival, so that a resume before the first poll lets it through too.
  auto ticket = std::make_shared<Ticket>();
  state.waiting.push_back(ticket);
  return AdmissionFuture::deferred([state = state_, ticket = std::move(ticket),
                                    request = std::move(request)](PollContext& context) -> Poll {
    const TimePoint polled_at = context.now();
    state->force_resume_if_due(polled_at);
    if (ticket->released || !state->paused || state->is_running(request, polled_at)) {
      state->admitted(request, polled_at);
      return Poll::ready(request);
    }
    ticket->waker = context.waker();             // a report below resume_below
    context.wake_at(state->forced_resume_at());  // or the forced resume
    return Poll::pending();
  });
}

void KvCapacityPauseClassifier::on_fleet_load(const FleetLoad& load) {
  if (!std::isfinite(load.kv_usage)) return;
  State& state = *state_;
  state.force_resume_if_due(load.at);
  if (!state.paused && load.kv_usage > state.pause_above) {
    state.paused = true;
    // A report older than the last resume cannot start the pause before it.
    state.paused_since = std::max(load.at, state.resumed_at);
  } else if (state.paused && load.kv_usage < state.resume_below) {
    state.resume(load.at);
  }
}

bool KvCapacityPauseClassifier::paused() const { return state_->paused; }

std::expected<RequestClassifierFactory, RequestClassifierProviderError> kv_capacity_pause_provider(
    const RequestClassifierParameters& parameters) {
  return read_then_make<KvCapacityPauseClassifier, KvCapacityPauseParameters>(parameters);
}

}  // namespace kvr::classifiers::builtin
