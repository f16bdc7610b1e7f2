// The built-in request classifier `kv-capacity-pause`: while the fleet's KV cache is nearly full,
// holds back new sessions so that the sessions already running can finish their turns.
//   - A pause begins when a fleet-load report (RequestClassifier::on_fleet_load) is above
//     `pause_above`, and ends when one is below `resume_below` (hysteresis), or by force
//     `max_pause_ms` after it began, whichever comes first. A forced resume admits everything
//     deferred; a later report still above `pause_above` begins the next pause.
//   - During a pause a new session is deferred; a turn of a running session is admitted. Running:
//     an earlier turn with the same session id was admitted within `session_ttl_ms` and was not
//     the session's final turn (SessionContext::session_final). A request without session
//     metadata counts as new.
//   - A deferred request registers both wake-ups: a Waker fired when a report ends the pause, and
//     wake_at at the forced-resume time.
// Without a fleet-load report nothing is paused. The host's fleet load counts only the workers
// that registered a KV capacity (a worker without one is never full by KV); a fleet in which none
// did sends no report, so this classifier never pauses it. classify() decides at
// ClassifyRequest::arrived_at(), a deferred poll at PollContext::now().
//
// Written against the public API (classifiers/request_classifier.hpp) only, as an example.
#pragma once

#include <cstdint>
#include <expected>
#include <memory>
#include <string_view>

#include "classifiers/request_classifier.hpp"

namespace kvr::classifiers::builtin {

/// The registered type name.
inline constexpr std::string_view kKvCapacityPauseType = "kv-capacity-pause";

/// `kv-capacity-pause` YAML parameters; 0 <= resume_below < pause_above <= 1.
struct KvCapacityPauseParameters {
  /// Fleet KV usage above which new sessions pause; required.
  double pause_above = 1.0;
  /// Fleet KV usage below which a pause ends; required.
  double resume_below = 0.0;
  /// How long a pause lasts at most before a forced resume; >= 1; default 30000.
  std::uint64_t max_pause_ms = 30'000;
  /// How long after its last admitted turn a session still counts as running; >= 1; default
  /// 600000 (10 minutes). Bounds the memory of sessions that never send a final turn.
  std::uint64_t session_ttl_ms = 600'000;

  /// Reads and checks the keys above; unknown keys, a missing or bad value fail naming the key.
  static std::expected<KvCapacityPauseParameters,
                       plugins::request_classifier::RequestClassifierProviderError>
  read(const plugins::request_classifier::RequestClassifierParameters& parameters);
};

/// The `kv-capacity-pause` classifier (file comment).
class KvCapacityPauseClassifier final : public plugins::request_classifier::RequestClassifier {
 public:
  explicit KvCapacityPauseClassifier(const KvCapacityPauseParameters& parameters);
  ~KvCapacityPauseClassifier() override;

  plugins::request_classifier::AdmissionFuture classify(
      plugins::request_classifier::ClassifyRequest request) override;
  void on_fleet_load(const plugins::request_classifier::FleetLoad& load) override;

  /// True while new sessions are held back (a forced resume shows once a poll or classify()
  /// reaches its time).
  bool paused() const;

 private:
  struct State;
  struct Ticket;
  std::shared_ptr<State> state_;  // shared with the deferred futures, which may outlive this
};

/// The registered provider of `kv-capacity-pause`.
std::expected<plugins::request_classifier::RequestClassifierFactory,
              plugins::request_classifier::RequestClassifierProviderError>
kv_capacity_pause_provider(
    const plugins::request_classifier::RequestClassifierParameters& parameters);

}  // namespace kvr::classifiers::builtin
