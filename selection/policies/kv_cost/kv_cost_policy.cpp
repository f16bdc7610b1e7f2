#include "selection/policies/kv_cost/kv_cost_policy.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <utility>

#include "selection/policies/common/best_row.hpp"

namespace kvr::selection::policies {
namespace {

struct RealParameter {
  std::string_view key;
  std::optional<double> KvCostParameters::*member;
  double min;
  double max;  // infinity: no upper bound
};

constexpr double kUnbounded = std::numeric_limits<double>::infinity();

constexpr std::array<RealParameter, 6> kRealParameters{{
    {"device_overlap_credit", &KvCostParameters::device_overlap_credit, 0.0, 1.0},
    {"host_overlap_credit", &KvCostParameters::host_overlap_credit, 0.0, 1.0},
    {"disk_overlap_credit", &KvCostParameters::disk_overlap_credit, 0.0, 1.0},
    {"prefill_load_scale", &KvCostParameters::prefill_load_scale, 0.0, kUnbounded},
    {"active_request_weight", &KvCostParameters::active_request_weight, 0.0, kUnbounded},
    {"temperature", &KvCostParameters::temperature, 0.0, kUnbounded},
}};

// A count of tokens or requests as a double. Such counts stay far below 2^63, where a signed
// conversion gives the same value without the branch x86-64 needs to convert an unsigned 64-bit
// integer (one per count per row in score_all()).
inline double count_as_double(std::size_t count) {
  return static_cast<double>(static_cast<std::int64_t>(count));
}

// One row of the formula in the header comment, with `to_blocks` turning tokens into blocks.
// Inlined into both score() and score_all().
template <class ToBlocks>
inline double kv_cost(const KvCostWeights& weights, double request_blocks, ToBlocks to_blocks,
                      const WorkerCandidate& candidate) {
  const WorkerCacheInput& cache = *candidate.cache();
  const double credit = weights.device_overlap_credit * cache.device_overlap_blocks() +
                        weights.host_overlap_credit * cache.host_overlap_blocks() +
                        weights.disk_overlap_credit * cache.disk_overlap_blocks();
  double prefill_blocks = std::max(0.0, request_blocks - credit);
  double other_load = 0.0;
  const WorkerLoadInput& load = *candidate.load();
  if (load.is_available()) {
    prefill_blocks += to_blocks(count_as_double(load.active_prefill_tokens()));
    other_load = load.decode_cost_blocks() +
                 weights.active_request_weight * count_as_double(load.active_requests());
  }
  return (weights.prefill_load_scale * prefill_blocks + other_load) *
         candidate.preferred_taint_multiplier().value_or(1.0);
}

}  // namespace

ProviderResult<KvCostParameters> KvCostParameters::read(ParameterReader& reader) {
  KvCostParameters parameters;
  for (const RealParameter& parameter : kRealParameters) {
    auto value = reader.optional<double>(parameter.key);
    if (!value) return std::unexpected(value.error());
    parameters.*parameter.member = *value;
  }
  auto seed = read_seed(reader);
  if (!seed) return std::unexpected(seed.error());
  parameters.seed = *seed;
  return parameters;
}

ProviderResult<void> KvCostParameters::validate() const {
  for (const RealParameter& parameter : kRealParameters) {
    const std::optional<double>& value = this->*parameter.member;
    if (!value) continue;
    auto valid =
        parameter.max == kUnbounded
            ? check_at_least(kKvCostPolicyType, parameter.key, *value, parameter.min)
            : check_range(kKvCostPolicyType, parameter.key, *value, parameter.min, parameter.max);
    if (!valid) return valid;
  }
  return {};
}

KvCostSettings KvCostSettings::resolve(const KvCostParameters& parameters,
                                       const RouterConfig& config, WorkerType worker_type,
                                       const RoutingPartition& partition) {
  return KvCostSettings{
      .weights =
          KvCostWeights{
              .device_overlap_credit =
                  parameters.device_overlap_credit.value_or(config.device_overlap_credit),
              .host_overlap_credit =
                  parameters.host_overlap_credit.value_or(config.host_overlap_credit),
              .disk_overlap_credit =
                  parameters.disk_overlap_credit.value_or(config.disk_overlap_credit),
              .prefill_load_scale =
                  parameters.prefill_load_scale.value_or(config.prefill_load_scale),
              .active_request_weight =
                  parameters.active_request_weight.value_or(config.active_request_weight),
          },
      .temperature = parameters.temperature.value_or(config.temperature),
      .seed = resolve_seed(parameters.seed, config, worker_type, partition),
  };
}

PolicyResult<double> KvCostScorer::score(const WorkerSelectionContext& context,
                                         const WorkerCandidate& candidate) {
  const double block_size = static_cast<double>(context.block_size());
  return kv_cost(
      weights_, static_cast<double>(context.request_blocks()),
      [block_size](double tokens) { return tokens / block_size; }, candidate);
}

PolicyResult<void> KvCostScorer::score_all(const WorkerSelectionContext& context,
                                           std::span<const WorkerCandidate> candidates,
                                           std::span<double> costs) {
  // Hoisted out of the loop: one virtual call and a few loads per selection, not per row.
  const KvCostWeights weights = weights_;
  const double request_blocks = static_cast<double>(context.request_blocks());
  const std::size_t block_size = context.block_size();
  const auto score_rows = [&](auto to_blocks) {
    for (std::size_t row = 0; row < candidates.size(); ++row) {
      costs[row] = kv_cost(weights, request_blocks, to_blocks, candidates[row]);
    }
  };
  if (std::has_single_bit(block_size)) {
    // Multiplying by the reciprocal of a power of two gives exactly the quotient (it only changes
    // the exponent), and a multiply costs a fraction of a divide in the per-row loop.
    const double reciprocal = 1.0 / static_cast<double>(block_size);
    score_rows([reciprocal](double tokens) { return tokens * reciprocal; });
  } else {
    const double divisor = static_cast<double>(block_size);
    score_rows([divisor](double tokens) { return tokens / divisor; });
  }
  return {};
}

PolicyResult<std::size_t> KvCostPicker::pick(const WorkerSelectionContext& /*context*/,
                                             const WorkerInputView& view) {
  const std::span<const ScoredWorkerCandidate> candidates = view.candidates();
  if (candidates.empty()) {
    return std::unexpected(WorkerSelectionPolicyError::failed("no candidates to pick from"));
  }
  if (temperature_ == 0.0 || candidates.size() == 1) return lowest_cost_row(candidates, rng_);
  return sample_softmax(candidates);
}

std::size_t KvCostPicker::sample_softmax(std::span<const ScoredWorkerCandidate> candidates) {
  double min_cost = candidates[0].cost();
  double max_cost = min_cost;
  std::size_t min_row = 0;
  for (std::size_t row = 1; row < candidates.size(); ++row) {
    const double cost = candidates[row].cost();
    if (cost < min_cost) {
      min_cost = cost;
      min_row = row;
    }
    max_cost = std::max(max_cost, cost);
  }
  if (!(max_cost > min_cost)) return rng_.uniform_index(candidates.size());

  // Normalise before dividing by the temperature: a tiny range times a tiny temperature would
  // underflow to 0 and turn the lowest row's exponent into 0/0.
  const double range = max_cost - min_cost;
  weights_.resize(candidates.size());
  double total = 0.0;
  for (std::size_t row = 0; row < candidates.size(); ++row) {
    const double normalised = (candidates[row].cost() - min_cost) / range;
    weights_[row] = std::exp(-normalised / temperature_);
    total += weights_[row];
  }
  double remaining = rng_.uniform_unit() * total;
  for (std::size_t row = 0; row < candidates.size(); ++row) {
    remaining -= weights_[row];
    if (remaining < 0.0) return row;
  }
  // Rounding can leave a sliver after the last row; the lowest cost (weight 1) absorbs it.
  return min_row;
}

WorkerSelectionPolicy make_kv_cost_policy(const KvCostParameters& parameters,
                                          const RouterConfig& config, WorkerType worker_type,
                                          const RoutingPartition& partition) {
  const KvCostSettings settings =
      KvCostSettings::resolve(parameters, config, worker_type, partition);
  std::vector<std::unique_ptr<WorkerScorer>> scorers;
  scorers.push_back(std::make_unique<KvCostScorer>(settings.weights));
  return WorkerSelectionPolicy{config, worker_type, std::move(scorers),
                               std::make_unique<KvCostPicker>(settings.temperature, settings.seed)};
}

ProviderResult<WorkerSelectionPolicyFactory> kv_cost_policy_provider(
    const WorkerSelectionPolicyParameters& parameters) {
  return provide<KvCostParameters>(parameters, &make_kv_cost_policy);
}

}  // namespace kvr::selection::policies
