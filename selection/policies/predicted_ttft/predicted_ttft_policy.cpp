#include "selection/policies/predicted_ttft/predicted_ttft_policy.hpp"

#include <algorithm>
#include <array>
#include <utility>
#include <vector>

#include "selection/policies/common/best_row.hpp"
#include "selection/policies/common/worker_signals.hpp"

namespace kvr::selection::policies {
namespace {

// The prediction of one row; inlined into score() and score_all().
inline double predicted_ms(const TtftModel& model, const WorkerSelectionContext& context,
                           const WorkerCandidate& candidate) {
  const TtftFeatures features = TtftModel::features(context.prompt_tokens(), context.block_size(),
                                                    *candidate.cache(), candidate.load());
  return model.predict_ms(candidate.worker(), features);
}

}  // namespace

ProviderResult<PredictedTtftParameters> PredictedTtftParameters::read(ParameterReader& reader) {
  PredictedTtftParameters parameters;
  const std::array<std::pair<std::string_view, double*>, 9> reals{{
      {"prior_step_ms", &parameters.prior.step_ms},
      {"prior_prefill_ms_per_1k_tokens", &parameters.prior.prefill_ms_per_1k_tokens},
      {"prior_decode_interference_ms", &parameters.prior.interference_ms},
      {"prior_decode_interference_ms_per_1k_tokens",
       &parameters.prior.interference_ms_per_1k_tokens},
      {"memory", &parameters.memory},
      {"worker_factor_weight", &parameters.worker_factor_weight},
      {"sticky_fraction", &parameters.sticky_fraction},
      {"sticky_margin", &parameters.sticky_margin},
      {"sticky_margin_ms", &parameters.sticky_margin_ms},
  }};
  for (const auto& [key, member] : reals) {
    auto value = reader.optional<double>(key, *member);
    if (!value) return std::unexpected(value.error());
    *member = *value;
  }
  auto learn = reader.optional<bool>("learn", parameters.learn);
  if (!learn) return std::unexpected(learn.error());
  parameters.learn = *learn;
  auto seed = read_seed(reader);
  if (!seed) return std::unexpected(seed.error());
  parameters.seed = *seed;
  return parameters;
}

ProviderResult<void> PredictedTtftParameters::validate() const {
  constexpr std::string_view type = kPredictedTtftPolicyType;
  return first_failure({
      check_at_least(type, "prior_step_ms", prior.step_ms, 0.0),
      check_at_least(type, "prior_prefill_ms_per_1k_tokens", prior.prefill_ms_per_1k_tokens, 0.0),
      check_at_least(type, "prior_decode_interference_ms", prior.interference_ms, 0.0),
      check_at_least(type, "prior_decode_interference_ms_per_1k_tokens",
                     prior.interference_ms_per_1k_tokens, 0.0),
      check_at_least(type, "memory", memory, 10.0),
      check_range(type, "worker_factor_weight", worker_factor_weight, 0.0, 1.0),
      check_range(type, "sticky_fraction", sticky_fraction, 0.0, 1.0),
      check_at_least(type, "sticky_margin", sticky_margin, 0.0),
      check_at_least(type, "sticky_margin_ms", sticky_margin_ms, 0.0),
  });
}

PolicyResult<double> PredictedTtftScorer::score(const WorkerSelectionContext& context,
                                                const WorkerCandidate& candidate) {
  return predicted_ms(*model_, context, candidate);
}

PolicyResult<void> PredictedTtftScorer::score_all(const WorkerSelectionContext& context,
                                                  std::span<const WorkerCandidate> candidates,
                                                  std::span<double> costs) {
  const TtftModel& model = *model_;
  for (std::size_t row = 0; row < candidates.size(); ++row) {
    costs[row] = predicted_ms(model, context, candidates[row]);
  }
  return {};
}

PolicyResult<std::size_t> CacheStickyPicker::pick(const WorkerSelectionContext& context,
                                                  const WorkerInputView& view) {
  const std::span<const ScoredWorkerCandidate> candidates = view.candidates();
  if (candidates.empty()) {
    return std::unexpected(WorkerSelectionPolicyError::failed("no candidates to pick from"));
  }
  const std::size_t best = lowest_cost_row(candidates, rng_);
  const std::span<const WorkerCacheInput> cache = *view.cache();
  std::size_t holder = 0;
  double most_held = -1;
  for (std::size_t row = 0; row < candidates.size(); ++row) {
    const double held = total_overlap_blocks(cache[row]);
    if (held > most_held ||
        (held == most_held && candidates[row].cost() < candidates[holder].cost())) {
      holder = row;
      most_held = held;
    }
  }
  const double wanted = sticky_fraction_ * static_cast<double>(context.request_blocks());
  const bool holds_enough = most_held > 0 && most_held >= wanted;
  const double best_cost = candidates[best].cost();
  if (holds_enough &&
      candidates[holder].cost() <= best_cost * (1 + sticky_margin_) + sticky_margin_ms_) {
    return holder;
  }
  return best;
}

WorkerSelectionPolicy make_predicted_ttft_policy(const PredictedTtftParameters& parameters,
                                                 const RouterConfig& config, WorkerType worker_type,
                                                 const RoutingPartition& partition) {
  auto model = std::make_shared<TtftModel>(
      parameters.prior, TtftLearning{.enabled = parameters.learn,
                                     .memory = parameters.memory,
                                     .worker_factor_weight = parameters.worker_factor_weight});
  std::vector<std::unique_ptr<WorkerScorer>> scorers;
  scorers.push_back(std::make_unique<PredictedTtftScorer>(model));
  std::vector<std::shared_ptr<plugins::worker_selection::WorkerSelectionObserver>> observers{
      std::move(model)};
  return WorkerSelectionPolicy{
      config,
      worker_type,
      {},
      std::move(scorers),
      std::make_unique<CacheStickyPicker>(
          parameters.sticky_fraction, parameters.sticky_margin, parameters.sticky_margin_ms,
          resolve_seed(parameters.seed, config, worker_type, partition)),
      std::move(observers)};
}

ProviderResult<WorkerSelectionPolicyFactory> predicted_ttft_policy_provider(
    const WorkerSelectionPolicyParameters& parameters) {
  return provide<PredictedTtftParameters>(parameters, &make_predicted_ttft_policy);
}

}  // namespace kvr::selection::policies
