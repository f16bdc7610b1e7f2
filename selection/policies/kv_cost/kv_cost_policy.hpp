// The built-in default worker-selection policy `kv-cost`: a KV-cache-aware cost per worker
// (prefill left after cache overlap, queued prefill, projected decode, active requests, preferred
// taints) and a picker taking the lowest cost or sampling a softmax over costs.
//
// Cost of a worker for a request of R = request_blocks() blocks, block size B:
//   credit  = device_overlap_credit·device + host_overlap_credit·host + disk_overlap_credit·disk
//             (overlap blocks per tier)
//   prefill = active_prefill_tokens / B + max(0, R − credit)        (real division, in blocks)
//   cost    = (prefill_load_scale·prefill + decode_cost_blocks
//              + active_request_weight·active_requests) · preferred_taint_multiplier
// where preferred_taint_multiplier = exp(−tanh(Σ weights of the request's preferred taints the
// worker carries)). A worker without a load observation (WorkerLoadInput::is_available() false)
// has every load term 0: its cost is the request's own prefill after credit, times the taint
// multiplier.
//
// Picker: temperature 0 takes the lowest cost, ties broken uniformly at random. Temperature T > 0
// normalises the costs to [0, 1] by (c − min) / (max − min) and samples a row with probability
// ∝ exp(−normalised / T); when every cost is equal it samples uniformly.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "selection/policies/common/parameters.hpp"
#include "selection/policies/common/plugin_api.hpp"
#include "selection/policies/common/policy_rng.hpp"

namespace kvr::selection::policies {

/// The registered type name of the built-in default policy.
inline constexpr std::string_view kKvCostPolicyType = "kv-cost";

/// `kv-cost` YAML parameters. Every field is optional; an absent one takes RouterConfig's value
/// when the factory runs (its defaults are shown).
struct KvCostParameters {
  /// Share of each device-tier overlap block credited against prefill, in [0, 1]; default 1.0.
  std::optional<double> device_overlap_credit;
  /// Share of each host-tier overlap block credited, in [0, 1]; default 0.75.
  std::optional<double> host_overlap_credit;
  /// Share of each disk-tier overlap block credited, in [0, 1]; default 0.25.
  std::optional<double> disk_overlap_credit;
  /// Weight of prefill blocks against decode blocks, >= 0; default 1.0.
  std::optional<double> prefill_load_scale;
  /// Cost in blocks added per active request, >= 0; default 0.0.
  std::optional<double> active_request_weight;
  /// Softmax temperature over range-normalised costs, >= 0; 0 takes the lowest; default 0.0.
  std::optional<double> temperature;
  /// Seed of the tie-break and sampling draws; default RouterConfig::seed, else derived from the
  /// partition's model, routing group and worker type (deterministic per partition).
  std::optional<std::uint64_t> seed;

  /// Reads the keys above; the caller rejects any other key.
  static ProviderResult<KvCostParameters> read(ParameterReader& reader);
  /// Fails naming the first parameter outside its range.
  ProviderResult<void> validate() const;
};

/// The weights of the kv-cost formula (see the file comment).
struct KvCostWeights {
  double device_overlap_credit = 1.0;
  double host_overlap_credit = 0.75;
  double disk_overlap_credit = 0.25;
  double prefill_load_scale = 1.0;
  double active_request_weight = 0.0;
};

/// The effective settings of one policy instance: its parameters over RouterConfig's values.
struct KvCostSettings {
  KvCostWeights weights;
  double temperature = 0.0;
  std::uint64_t seed = 0;

  static KvCostSettings resolve(const KvCostParameters& parameters, const RouterConfig& config,
                                WorkerType worker_type, const RoutingPartition& partition);
};

/// Scores each candidate with the kv-cost formula. Needs CACHE, LOAD and PREFERRED_TAINT.
class KvCostScorer final : public WorkerScorer {
 public:
  explicit KvCostScorer(const KvCostWeights& weights) : weights_(weights) {}

  WorkerInputs required_worker_inputs() const override {
    return WorkerInputs::CACHE | WorkerInputs::LOAD | WorkerInputs::PREFERRED_TAINT;
  }
  PolicyResult<double> score(const WorkerSelectionContext& context,
                             const WorkerCandidate& candidate) override;
  /// The same formula in one tight loop over all rows; never allocates.
  PolicyResult<void> score_all(const WorkerSelectionContext& context,
                               std::span<const WorkerCandidate> candidates,
                               std::span<double> costs) override;

 private:
  KvCostWeights weights_;
};

/// Lowest cost with a uniformly random tie-break at temperature 0, else a softmax sample over
/// range-normalised costs. Reuses one buffer, so a warm pick does not allocate.
class KvCostPicker final : public WorkerPicker {
 public:
  KvCostPicker(double temperature, std::uint64_t seed) : temperature_(temperature), rng_(seed) {}

  PolicyResult<std::size_t> pick(const WorkerSelectionContext& context,
                                 const WorkerInputView& view) override;

 private:
  std::size_t sample_softmax(std::span<const ScoredWorkerCandidate> candidates);

  double temperature_;
  PolicyRng rng_;
  std::vector<double> weights_;  // per-row softmax weights, reused across picks
};

/// A `kv-cost` policy: one KvCostScorer and a KvCostPicker, settings resolved against `config`.
WorkerSelectionPolicy make_kv_cost_policy(const KvCostParameters& parameters,
                                          const RouterConfig& config, WorkerType worker_type,
                                          const RoutingPartition& partition);

/// The registered provider of `kv-cost`.
ProviderResult<WorkerSelectionPolicyFactory> kv_cost_policy_provider(
    const WorkerSelectionPolicyParameters& parameters);

}  // namespace kvr::selection::policies
