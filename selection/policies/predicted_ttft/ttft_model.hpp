// The online model behind the built-in policy `predicted-ttft`: predicts a request's time to first
// token on a worker from what a router sees (the prefill queued there, the request's own uncached
// tokens, the worker's KV usage) and learns its rates from the first tokens of the requests it
// routed. It is the policy's WorkerSelectionObserver; its scorer reads it. Plain C++, one owner.
//
// Prediction, in milliseconds, for S thousand prompt tokens to prefill before the first token (the
// worker's queued prefill plus the request's uncached tokens) at KV usage u in [0, 1]:
//   ttft = f_w · (step + prefill·S + interference·u + interference_per_1k·S·u)
// An engine prefills in chunks, one chunk per step, and every step also runs the worker's decodes,
// which cost more the fuller its KV: `step` is the wait for the step that produces the token,
// `prefill` the rate per thousand tokens, and the two interference terms the decodes' share of
// those steps. f_w is the worker's own factor (a slower or faster engine than the fleet's).
//
// Learning: least squares with exponential forgetting over (1, S, u, S·u) against each observed
// time to first token divided by f_w, regularised towards the prior; an observation far outside the
// recent residuals is clipped first, so one outlier (a preemption, a stalled engine) moves it
// little; coefficients stay non-negative. f_w is a slow exponential average of the worker's clipped
// log-ratio of observed to predicted, less the fleet's mean (factors are relative), applied only
// outside a dead zone around 1 (measured on the bundled trace: in a fleet of equal engines,
// factors that follow the noise cost 5% of mean TTFT).
// Observations come only from requests the policy itself selected (their signals are known); pins
// and hard session bindings are not learnt from.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <absl/container/flat_hash_map.h>

#include "selection/policies/common/plugin_api.hpp"

namespace kvr::selection::policies {

using plugins::worker_selection::LearntValue;
using plugins::worker_selection::RoutedRequest;
using plugins::worker_selection::RoutedRequestEnd;
using plugins::worker_selection::TtftCalibration;
using plugins::worker_selection::WorkerSelectionObserver;

/// The model's coefficients, in milliseconds (see the file comment).
struct TtftRates {
  double step_ms = 25.0;
  double prefill_ms_per_1k_tokens = 21.0;
  double interference_ms = 40.0;
  double interference_ms_per_1k_tokens = 4.0;
};

/// What a prediction reads of one candidate.
struct TtftFeatures {
  /// Prompt tokens to prefill before the request's first token, in thousands: the worker's queued
  /// prefill and the request's own uncached tokens.
  double work_k_tokens = 0;
  /// The worker's KV usage with the request, in [0, 1]; 0 when it registered no capacity.
  double kv_usage = 0;
};

/// Settings of the learning.
struct TtftLearning {
  /// False: the prior is used as it is.
  bool enabled = true;
  /// Observations the least-squares fit remembers (forgetting factor 1 − 1/memory).
  double memory = 2000;
  /// The exponential average weight of one observation in a worker's factor.
  double worker_factor_weight = 0.01;
};

/// The online model (file comment); a policy instance's observer.
class TtftModel final : public WorkerSelectionObserver {
 public:
  TtftModel(const TtftRates& prior, const TtftLearning& learning);

  /// The features of a candidate holding `cache` of the prompt (any tier counts as cached);
  /// `load` is null or unavailable when the worker has reported nothing yet.
  static TtftFeatures features(std::size_t prompt_tokens, std::size_t block_size,
                               const WorkerCacheInput& cache, const WorkerLoadInput* load);

  /// The predicted time to first token on `worker`, in milliseconds.
  double predict_ms(WorkerWithDpRank worker, const TtftFeatures& features) const {
    return worker_factor(worker) * shared_ms(features);
  }
  /// The prediction before the worker's factor.
  double shared_ms(const TtftFeatures& features) const {
    const double s = features.work_k_tokens;
    const double u = features.kv_usage;
    return coefficients_[0] + coefficients_[1] * s + coefficients_[2] * u +
           coefficients_[3] * s * u;
  }
  /// The factor the worker's predictions are multiplied by: 1 until its learnt factor leaves the
  /// dead zone around 1, so that a fleet of equal engines is not told apart by noise.
  double worker_factor(WorkerWithDpRank worker) const {
    if (worker_factors_.empty()) return 1.0;
    const auto found = worker_factors_.find(worker);
    return found == worker_factors_.end() ? 1.0 : found->second.applied;
  }
  /// A learnt factor is applied once it is this far from 1 (relative), and until it comes back
  /// within kFactorReturn; learnt factors of equal engines stay inside, so they tie.
  static constexpr double kFactorDeadZone = 0.1;
  static constexpr double kFactorReturn = 0.05;
  /// The current coefficients.
  TtftRates rates() const;
  /// The current prefill rate per thousand tokens.
  double prefill_ms_per_1k_tokens() const { return coefficients_[1]; }
  /// First tokens learnt from so far.
  std::uint64_t observations() const { return observations_; }

  // ---- WorkerSelectionObserver --------------------------------------------------------------
  void on_routed(const RoutedRequest& request) override;
  std::optional<TtftCalibration> on_first_token(std::string_view request_id,
                                                std::chrono::steady_clock::time_point at) override;
  void on_ended(std::string_view request_id, RoutedRequestEnd end,
                std::chrono::steady_clock::time_point at) override;
  std::vector<LearntValue> learnt_values() const override;

  /// Learns from one time to first token observed on `worker` for `features`.
  void learn(WorkerWithDpRank worker, const TtftFeatures& features, double observed_ms);

  /// Requests followed at most at once; older ones are forgotten first.
  static constexpr std::size_t kMaxFollowed = 1 << 16;

 private:
  struct Followed {
    WorkerWithDpRank worker;
    TtftFeatures features;
    double predicted_ms = 0;
    std::chrono::steady_clock::time_point routed_at;
  };
  using Vector = std::array<double, 4>;

  void forget_older_than(std::chrono::steady_clock::time_point cutoff);
  /// Refits the coefficients from the weighted normal equations and the prior.
  void solve();

  TtftLearning learning_;
  Vector coefficients_;
  Vector prior_;
  Vector ridge_{};
  // Σ λ^age · x xᵀ and Σ λ^age · x · observed, over the observations learnt from.
  std::array<Vector, 4> gram_{};
  Vector moments_{};
  double forgetting_;
  // A robust scale of recent residuals (ms): observations beyond a few of them are clipped.
  double residual_scale_ms_;
  std::uint64_t observations_ = 0;
  struct WorkerFactor {
    double learnt_log = 0;  // the exponential average of log(observed / predicted)
    // exp(learnt_log less the fleet's mean) once outside the dead zone, else 1
    double applied = 1;
  };
  absl::flat_hash_map<WorkerWithDpRank, WorkerFactor> worker_factors_;
  // Σ learnt_log over worker_factors_.
  double sum_learnt_log_ = 0;
  absl::flat_hash_map<std::string, Followed> followed_;
};

}  // namespace kvr::selection::policies
