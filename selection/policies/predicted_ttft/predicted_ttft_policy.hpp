// The built-in policy `predicted-ttft`: routes each request to the worker where its time to first
// token is predicted lowest, by a model that learns its rates online from the first tokens of the
// requests it routed (ttft_model.hpp), and keeps a request on the worker holding most of its
// prompt until that worker's prediction exceeds the best one by a margin.
//
// Scorer: the predicted time to first token in milliseconds (its reported cost).
// Picker: let h be the candidate with the most overlap blocks (device + host + disk; ties: the
// lower prediction). When h holds at least sticky_fraction of the prompt's blocks and
//   prediction(h) <= lowest prediction · (1 + sticky_margin) + sticky_margin_ms
// h is taken (its cache stays where the next turns of its conversation will look); else the
// lowest prediction, ties broken uniformly at random.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string_view>

#include "selection/policies/common/parameters.hpp"
#include "selection/policies/common/plugin_api.hpp"
#include "selection/policies/common/policy_rng.hpp"
#include "selection/policies/predicted_ttft/ttft_model.hpp"

namespace kvr::selection::policies {

/// The registered type name.
inline constexpr std::string_view kPredictedTtftPolicyType = "predicted-ttft";

/// `predicted-ttft` YAML parameters; every one is optional (defaults shown).
struct PredictedTtftParameters {
  /// The prior rates (ttft_model.hpp), in milliseconds, each >= 0; the learning starts from them.
  /// The defaults fit vLLM's published step times for an 8B model on one H100-class GPU.
  TtftRates prior;
  /// Learn online; false uses the prior as it is.
  bool learn = true;
  /// Observations the fit remembers, >= 10; default 2000.
  double memory = 2000;
  /// Weight of one observation in a worker's own factor, in [0, 1]; 0 keeps every factor at 1;
  /// default 0.01.
  double worker_factor_weight = 0.01;
  /// A worker holding at least this share of the prompt's blocks keeps it, in [0, 1]; default 0.5.
  /// 1 keeps only a worker holding the whole prompt.
  double sticky_fraction = 0.5;
  /// ... while its prediction is within this relative margin of the best, >= 0; default 0.2.
  double sticky_margin = 0.2;
  /// ... plus this many milliseconds, >= 0; default 0.
  double sticky_margin_ms = 0;
  /// Seed of the tie-break draws; default as resolve_seed.
  std::optional<std::uint64_t> seed;

  /// Reads the keys above; the caller rejects any other key.
  static ProviderResult<PredictedTtftParameters> read(ParameterReader& reader);
  /// Fails naming the first parameter outside its range.
  ProviderResult<void> validate() const;
};

/// Predicted time to first token per candidate, in milliseconds. Needs CACHE and LOAD.
class PredictedTtftScorer final : public WorkerScorer {
 public:
  explicit PredictedTtftScorer(std::shared_ptr<const TtftModel> model) : model_(std::move(model)) {}

  WorkerInputs required_worker_inputs() const override {
    return WorkerInputs::CACHE | WorkerInputs::LOAD;
  }
  PolicyResult<double> score(const WorkerSelectionContext& context,
                             const WorkerCandidate& candidate) override;
  PolicyResult<void> score_all(const WorkerSelectionContext& context,
                               std::span<const WorkerCandidate> candidates,
                               std::span<double> costs) override;

 private:
  std::shared_ptr<const TtftModel> model_;
};

/// The sticky rule of the file comment over the scored rows. Needs CACHE.
class CacheStickyPicker final : public WorkerPicker {
 public:
  CacheStickyPicker(double sticky_fraction, double sticky_margin, double sticky_margin_ms,
                    std::uint64_t seed)
      : sticky_fraction_(sticky_fraction),
        sticky_margin_(sticky_margin),
        sticky_margin_ms_(sticky_margin_ms),
        rng_(seed) {}

  WorkerInputs required_worker_inputs() const override { return WorkerInputs::CACHE; }
  PolicyResult<std::size_t> pick(const WorkerSelectionContext& context,
                                 const WorkerInputView& view) override;

 private:
  double sticky_fraction_;
  double sticky_margin_;
  double sticky_margin_ms_;
  PolicyRng rng_;
};

/// A `predicted-ttft` policy: its model (the policy's observer), scorer and picker.
WorkerSelectionPolicy make_predicted_ttft_policy(const PredictedTtftParameters& parameters,
                                                 const RouterConfig& config, WorkerType worker_type,
                                                 const RoutingPartition& partition);

/// The registered provider of `predicted-ttft`.
ProviderResult<WorkerSelectionPolicyFactory> predicted_ttft_policy_provider(
    const WorkerSelectionPolicyParameters& parameters);

}  // namespace kvr::selection::policies
