// The built-in policy `bounded-load-hash`: consistent hashing with bounded loads on the prompt's
// leading blocks, so that requests sharing a prefix land on the same worker until it is full.
// No scorers (reported cost 0).
//   - key: the first min(prefix_blocks, n) of the request's n block hashes, combined in order; a
//     request without block hashes (a prompt shorter than one block) uses its prompt token count;
//   - ring: virtual_nodes points per candidate (worker, rank), at hashes of the worker id, rank
//     and point index; rebuilt only when the candidate set changes;
//   - capacity: with n candidates and A their total active requests (0 without a load
//     observation), a worker is full when active_requests + 1 > ceil(load_factor · (A + 1) / n);
//   - pick: walk clockwise from the key's point to the first worker that is not full. Some
//     worker is never full (the lightest has at most A / n active requests), so the walk ends.
// Removing a worker moves only the keys it held (and those pushed on by capacity).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "selection/policies/common/parameters.hpp"
#include "selection/policies/common/plugin_api.hpp"

namespace kvr::selection::policies {

/// The registered type name.
inline constexpr std::string_view kBoundedLoadHashPolicyType = "bounded-load-hash";

/// `bounded-load-hash` YAML parameters.
struct BoundedLoadHashParameters {
  /// How many leading block hashes form the key; an integer in [1, 65536]; default 4.
  std::int64_t prefix_blocks = 4;
  /// The bound c on a worker's load relative to the mean; >= 1; default 1.25.
  double load_factor = 1.25;
  /// Ring points per (worker, rank); an integer in [1, 1000]; default 100.
  std::int64_t virtual_nodes = 100;

  /// Reads the keys above; the caller rejects any other key.
  static ProviderResult<BoundedLoadHashParameters> read(ParameterReader& reader);
  /// Fails naming the first parameter outside its range.
  ProviderResult<void> validate() const;
};

/// Consistent hashing with bounded loads (file comment). Keeps its ring between picks; a warm
/// pick over an unchanged candidate set does not allocate. Needs LOAD.
class BoundedLoadHashPicker final : public WorkerPicker {
 public:
  explicit BoundedLoadHashPicker(const BoundedLoadHashParameters& parameters);

  WorkerInputs required_worker_inputs() const override { return WorkerInputs::LOAD; }
  PolicyResult<std::size_t> pick(const WorkerSelectionContext& context,
                                 const WorkerInputView& view) override;

  /// The ring key of a request (file comment).
  static std::uint64_t request_key(const WorkerSelectionContext& context,
                                   std::size_t prefix_blocks);

 private:
  struct RingPoint {
    std::uint64_t point;
    std::uint32_t member;  // index into members_
  };

  /// Points row_of_member_ at the candidates' rows; false when their set is not members_.
  bool map_rows(std::span<const ScoredWorkerCandidate> candidates);
  /// Makes the candidates the ring's members.
  void rebuild(std::span<const ScoredWorkerCandidate> candidates);

  std::size_t prefix_blocks_;
  double load_factor_;
  std::size_t virtual_nodes_;
  std::vector<WorkerWithDpRank> members_;         // sorted, distinct
  std::vector<RingPoint> ring_;                   // sorted by point
  std::vector<std::uint32_t> row_of_member_;      // for the current pick
  std::vector<WorkerWithDpRank> last_row_order_;  // candidates of the last mapping, by row
};

/// A `bounded-load-hash` policy: one BoundedLoadHashPicker.
WorkerSelectionPolicy make_bounded_load_hash_policy(const BoundedLoadHashParameters& parameters,
                                                    const RouterConfig& config,
                                                    WorkerType worker_type,
                                                    const RoutingPartition& partition);

/// The registered provider of `bounded-load-hash`.
ProviderResult<WorkerSelectionPolicyFactory> bounded_load_hash_policy_provider(
    const WorkerSelectionPolicyParameters& parameters);

}  // namespace kvr::selection::policies
