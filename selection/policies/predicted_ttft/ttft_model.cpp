#include "selection/policies/predicted_ttft/ttft_model.hpp"

#include <algorithm>
#include <cmath>
#include <utility>

#include <absl/strings/string_view.h>

#include "selection/policies/common/worker_signals.hpp"

namespace kvr::selection::policies {
namespace {

// The noise the prior's confidence is measured against: a prior coefficient is trusted about as
// much as a few observations this far off.
constexpr double kNoiseMs = 50.0;
// A residual beyond this many recent residual scales is clipped to it.
constexpr double kClipScales = 3.0;
// Each observation's weight in the residual scale.
constexpr double kScaleWeight = 0.05;
// A worker's factor stays within [1/kMaxFactor, kMaxFactor] of the fleet's.
const double kLogMaxFactor = std::log(2.0);
const double kLogDeadZone = std::log1p(TtftModel::kFactorDeadZone);
const double kLogReturn = std::log1p(TtftModel::kFactorReturn);
// Below this, a coefficient the fit drove down is held: every term is a real cost.
constexpr std::array<double, 4> kFloors{0.0, 0.5, 0.0, 0.0};

// This abseil's heterogeneous lookup takes its own string_view, not std::string_view.
absl::string_view key_of(std::string_view id) { return {id.data(), id.size()}; }

}  // namespace

TtftModel::TtftModel(const TtftRates& prior, const TtftLearning& learning)
    : learning_(learning),
      coefficients_{prior.step_ms, prior.prefill_ms_per_1k_tokens, prior.interference_ms,
                    prior.interference_ms_per_1k_tokens},
      prior_(coefficients_),
      forgetting_(1.0 - 1.0 / std::max(1.0, learning.memory)),
      residual_scale_ms_(kNoiseMs) {
  // Each prior coefficient is trusted as much as observations this noisy would pin it down to
  // about its own size (at least a millisecond): a few observations outweigh it.
  for (std::size_t i = 0; i < prior_.size(); ++i) {
    const double spread = std::max(1.0, prior_[i]);
    ridge_[i] = (kNoiseMs / spread) * (kNoiseMs / spread);
  }
}

TtftFeatures TtftModel::features(std::size_t prompt_tokens, std::size_t block_size,
                                 const WorkerCacheInput& cache, const WorkerLoadInput* load) {
  const double cached_tokens = total_overlap_blocks(cache) * static_cast<double>(block_size);
  double tokens = std::max(0.0, static_cast<double>(prompt_tokens) - cached_tokens);
  double kv_usage = 0;
  if (load != nullptr && load->is_available()) {
    tokens += static_cast<double>(load->active_prefill_tokens());
    if (const auto total = load->total_kv_blocks(); total && *total > 0) {
      kv_usage = std::min(1.0, load->decode_cost_blocks() / static_cast<double>(*total));
    }
  }
  return TtftFeatures{.work_k_tokens = tokens / 1000.0, .kv_usage = kv_usage};
}

TtftRates TtftModel::rates() const {
  return TtftRates{.step_ms = coefficients_[0],
                   .prefill_ms_per_1k_tokens = coefficients_[1],
                   .interference_ms = coefficients_[2],
                   .interference_ms_per_1k_tokens = coefficients_[3]};
}

void TtftModel::on_routed(const RoutedRequest& request) {
  // Without the selection's signals (a pinned or session-bound request) there is nothing to
  // learn from its first token.
  if (!learning_.enabled || !request.cache || !request.load) return;
  if (followed_.size() >= kMaxFollowed) {
    forget_older_than(request.routed_at - std::chrono::minutes{10});
    if (followed_.size() >= kMaxFollowed) return;
  }
  const TtftFeatures features = TtftModel::features(request.prompt_tokens, request.block_size,
                                                    *request.cache, &*request.load);
  followed_.insert_or_assign(std::string{request.request_id},
                             Followed{.worker = request.worker,
                                      .features = features,
                                      .predicted_ms = predict_ms(request.worker, features),
                                      .routed_at = request.routed_at});
}

std::optional<TtftCalibration> TtftModel::on_first_token(std::string_view request_id,
                                                         std::chrono::steady_clock::time_point at) {
  const auto found = followed_.find(key_of(request_id));
  if (found == followed_.end()) return std::nullopt;
  const Followed followed = found->second;
  followed_.erase(found);
  const double observed_ms =
      std::chrono::duration<double, std::milli>(at - followed.routed_at).count();
  if (!(observed_ms >= 0)) return std::nullopt;  // a clock that went back: nothing to learn
  learn(followed.worker, followed.features, observed_ms);
  return TtftCalibration{.worker = followed.worker,
                         .predicted_seconds = followed.predicted_ms / 1000.0,
                         .observed_seconds = observed_ms / 1000.0};
}

void TtftModel::on_ended(std::string_view request_id, RoutedRequestEnd /*end*/,
                         std::chrono::steady_clock::time_point /*at*/) {
  // Ended before its first token (cancelled, failed): its time says nothing about the worker.
  if (const auto found = followed_.find(key_of(request_id)); found != followed_.end()) {
    followed_.erase(found);
  }
}

void TtftModel::learn(WorkerWithDpRank worker, const TtftFeatures& features, double observed_ms) {
  if (!learning_.enabled || !std::isfinite(observed_ms)) return;
  ++observations_;
  const double s = features.work_k_tokens;
  const double u = features.kv_usage;
  const Vector x{1.0, s, u, s * u};

  // The worker's factor first, against the fleet's prediction.
  const double shared = std::max(1e-3, shared_ms(features));
  WorkerFactor& factor = worker_factors_.try_emplace(worker).first->second;
  const double log_ratio =
      std::clamp(std::log(std::max(observed_ms, 1e-3) / shared), -kLogMaxFactor, kLogMaxFactor);
  const double weight = learning_.worker_factor_weight;
  const double learnt_before = factor.learnt_log;
  factor.learnt_log = (1 - weight) * factor.learnt_log + weight * log_ratio;
  // Factors are relative to the fleet: their mean is taken out, or a common error (a prior far
  // off) could settle in every factor instead of in the shared rates, which fit it better.
  sum_learnt_log_ += factor.learnt_log - learnt_before;
  const double relative_log =
      factor.learnt_log - sum_learnt_log_ / static_cast<double>(worker_factors_.size());
  // Hysteresis: a factor near the edge of the dead zone does not flip in and out of use.
  const bool applied_before = factor.applied != 1.0;
  const bool apply = std::abs(relative_log) > (applied_before ? kLogReturn : kLogDeadZone);
  factor.applied = apply ? std::exp(relative_log) : 1.0;

  // Then the shared coefficients, against the observation with the worker's factor taken out.
  const double target = observed_ms / factor.applied;
  const double residual = target - shared_ms(features);
  const double limit = kClipScales * residual_scale_ms_;
  const double clipped = std::clamp(residual, -limit, limit);
  residual_scale_ms_ =
      std::max(1.0, (1 - kScaleWeight) * residual_scale_ms_ + kScaleWeight * std::abs(clipped));

  // Exponentially weighted normal equations: stable under any forgetting, unlike the recursive
  // update of an inverse, which winds up and diverges when observations stop exciting a feature.
  const double target_clipped = shared_ms(features) + clipped;
  for (std::size_t i = 0; i < 4; ++i) {
    for (std::size_t j = 0; j < 4; ++j) gram_[i][j] = forgetting_ * gram_[i][j] + x[i] * x[j];
    moments_[i] = forgetting_ * moments_[i] + x[i] * target_clipped;
  }
  solve();
}

void TtftModel::solve() {
  // (gram + ridge) θ = moments + ridge · prior, by Cholesky: the ridge keeps the system positive
  // definite, and pulls a coefficient the observations say nothing about back to its prior.
  std::array<Vector, 4> system = gram_;
  Vector right = moments_;
  for (std::size_t i = 0; i < 4; ++i) {
    system[i][i] += ridge_[i];
    right[i] += ridge_[i] * prior_[i];
  }
  std::array<Vector, 4> lower{};
  for (std::size_t i = 0; i < 4; ++i) {
    for (std::size_t j = 0; j <= i; ++j) {
      double sum = system[i][j];
      for (std::size_t k = 0; k < j; ++k) sum -= lower[i][k] * lower[j][k];
      if (i == j) {
        if (!(sum > 0)) return;  // lost to rounding: keep the last coefficients
        lower[i][i] = std::sqrt(sum);
      } else {
        lower[i][j] = sum / lower[j][j];
      }
    }
  }
  Vector y{};
  for (std::size_t i = 0; i < 4; ++i) {
    double sum = right[i];
    for (std::size_t k = 0; k < i; ++k) sum -= lower[i][k] * y[k];
    y[i] = sum / lower[i][i];
  }
  Vector solution{};
  for (std::size_t i = 4; i-- > 0;) {
    double sum = y[i];
    for (std::size_t k = i + 1; k < 4; ++k) sum -= lower[k][i] * solution[k];
    solution[i] = sum / lower[i][i];
  }
  for (std::size_t i = 0; i < 4; ++i) {
    // Every term is a real cost: a fit that drives one below its floor holds it there.
    coefficients_[i] = std::isfinite(solution[i]) ? std::max(solution[i], kFloors[i]) : prior_[i];
  }
}

void TtftModel::forget_older_than(std::chrono::steady_clock::time_point cutoff) {
  absl::erase_if(followed_,
                 [cutoff](const auto& entry) { return entry.second.routed_at < cutoff; });
}

std::vector<LearntValue> TtftModel::learnt_values() const {
  std::vector<LearntValue> values{
      {.name = "step_ms", .value = coefficients_[0]},
      {.name = "prefill_ms_per_1k_tokens", .value = coefficients_[1]},
      {.name = "decode_interference_ms", .value = coefficients_[2]},
      {.name = "decode_interference_ms_per_1k_tokens", .value = coefficients_[3]},
      {.name = "residual_scale_ms", .value = residual_scale_ms_},
      {.name = "observations", .value = static_cast<double>(observations_)},
  };
  std::vector<std::pair<WorkerWithDpRank, double>> factors;
  factors.reserve(worker_factors_.size());
  const double mean_learnt_log =
      worker_factors_.empty() ? 0.0 : sum_learnt_log_ / static_cast<double>(worker_factors_.size());
  for (const auto& [worker, factor] : worker_factors_) {
    factors.emplace_back(worker, std::exp(factor.learnt_log - mean_learnt_log));
  }
  std::ranges::sort(factors, {}, [](const auto& entry) {
    return std::pair{entry.first.worker_id, entry.first.dp_rank};
  });
  for (const auto& [worker, factor] : factors) {
    // Ranks of one worker are separate engines, but the series is per worker: rank 0 speaks for
    // a worker unless it has none.
    if (worker.dp_rank != 0 && !values.empty() && values.back().worker == worker.worker_id) {
      continue;
    }
    values.push_back({.name = "worker_factor", .worker = worker.worker_id, .value = factor});
  }
  return values;
}

}  // namespace kvr::selection::policies
