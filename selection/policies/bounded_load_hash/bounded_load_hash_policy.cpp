#include "selection/policies/bounded_load_hash/bounded_load_hash_policy.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>

#include "selection/policies/common/hashing.hpp"
#include "selection/policies/common/worker_signals.hpp"

namespace kvr::selection::policies {
namespace {

constexpr std::uint32_t kUnmapped = std::numeric_limits<std::uint32_t>::max();
// Distinct starting states keep a prefix key from colliding with a prompt-length key.
constexpr std::uint64_t kPrefixKeySeed = 0x6B76722D70726566ULL;
constexpr std::uint64_t kPromptLengthKeySeed = 0x6B76722D6C656E67ULL;

std::uint64_t ring_point(WorkerWithDpRank worker, std::size_t virtual_node) {
  return hash_combine(hash_combine(mix64(worker.worker_id), worker.dp_rank), virtual_node);
}

}  // namespace

ProviderResult<BoundedLoadHashParameters> BoundedLoadHashParameters::read(ParameterReader& reader) {
  const BoundedLoadHashParameters defaults;
  auto prefix = reader.optional<std::int64_t>("prefix_blocks", defaults.prefix_blocks);
  if (!prefix) return std::unexpected(prefix.error());
  auto factor = reader.optional<double>("load_factor", defaults.load_factor);
  if (!factor) return std::unexpected(factor.error());
  auto nodes = reader.optional<std::int64_t>("virtual_nodes", defaults.virtual_nodes);
  if (!nodes) return std::unexpected(nodes.error());
  return BoundedLoadHashParameters{
      .prefix_blocks = *prefix, .load_factor = *factor, .virtual_nodes = *nodes};
}

ProviderResult<void> BoundedLoadHashParameters::validate() const {
  return first_failure({
      check_integer_range(kBoundedLoadHashPolicyType, "prefix_blocks", prefix_blocks, 1, 65536),
      check_at_least(kBoundedLoadHashPolicyType, "load_factor", load_factor, 1.0),
      check_integer_range(kBoundedLoadHashPolicyType, "virtual_nodes", virtual_nodes, 1, 1000),
  });
}

BoundedLoadHashPicker::BoundedLoadHashPicker(const BoundedLoadHashParameters& parameters)
    : prefix_blocks_(static_cast<std::size_t>(parameters.prefix_blocks)),
      load_factor_(parameters.load_factor),
      virtual_nodes_(static_cast<std::size_t>(parameters.virtual_nodes)) {}

std::uint64_t BoundedLoadHashPicker::request_key(const WorkerSelectionContext& context,
                                                 std::size_t prefix_blocks) {
  const std::span<const std::uint64_t> hashes = context.block_hashes();
  if (hashes.empty()) return hash_combine(kPromptLengthKeySeed, context.prompt_tokens());
  std::uint64_t key = kPrefixKeySeed;
  for (const std::uint64_t hash : hashes.first(std::min(prefix_blocks, hashes.size()))) {
    key = hash_combine(key, hash);
  }
  return key;
}

bool BoundedLoadHashPicker::map_rows(std::span<const ScoredWorkerCandidate> candidates) {
  if (candidates.size() != members_.size()) return false;
  // The host usually lists the same workers in the same order: then the mapping still holds.
  if (std::ranges::equal(candidates, last_row_order_, {}, &ScoredWorkerCandidate::worker)) {
    return true;
  }
  std::ranges::fill(row_of_member_, kUnmapped);
  for (std::size_t row = 0; row < candidates.size(); ++row) {
    const auto member = std::ranges::lower_bound(members_, candidates[row].worker());
    if (member == members_.end() || *member != candidates[row].worker()) return false;
    std::uint32_t& mapped = row_of_member_[static_cast<std::size_t>(member - members_.begin())];
    if (mapped != kUnmapped) return false;  // a repeated candidate: not the same set
    mapped = static_cast<std::uint32_t>(row);
  }
  last_row_order_.resize(candidates.size());
  std::ranges::transform(candidates, last_row_order_.begin(), &ScoredWorkerCandidate::worker);
  return true;
}

void BoundedLoadHashPicker::rebuild(std::span<const ScoredWorkerCandidate> candidates) {
  members_.resize(candidates.size());
  std::ranges::transform(candidates, members_.begin(), &ScoredWorkerCandidate::worker);
  std::ranges::sort(members_);
  members_.erase(std::ranges::unique(members_).begin(), members_.end());
  row_of_member_.assign(members_.size(), kUnmapped);
  last_row_order_.clear();
  ring_.clear();
  ring_.reserve(members_.size() * virtual_nodes_);
  for (std::size_t member = 0; member < members_.size(); ++member) {
    for (std::size_t node = 0; node < virtual_nodes_; ++node) {
      ring_.push_back({ring_point(members_[member], node), static_cast<std::uint32_t>(member)});
    }
  }
  std::ranges::sort(ring_, [](const RingPoint& a, const RingPoint& b) {
    return a.point != b.point ? a.point < b.point : a.member < b.member;
  });
}

PolicyResult<std::size_t> BoundedLoadHashPicker::pick(const WorkerSelectionContext& context,
                                                      const WorkerInputView& view) {
  const auto load = view.load();  // throws unless the picker declared LOAD
  const auto candidates = view.candidates();
  if (candidates.empty()) {
    return std::unexpected(WorkerSelectionPolicyError::failed("no candidates to pick from"));
  }
  if (!map_rows(candidates)) {
    rebuild(candidates);
    if (!map_rows(candidates)) {
      return std::unexpected(WorkerSelectionPolicyError::failed(
          "the candidates list a (worker, rank) more than once"));
    }
  }

  std::size_t total_active = 0;
  for (const WorkerLoadInput& worker : *load) total_active += active_requests_of(worker);
  const double capacity = std::ceil(load_factor_ * static_cast<double>(total_active + 1) /
                                    static_cast<double>(candidates.size()));

  const std::uint64_t key = request_key(context, prefix_blocks_);
  const auto start_point = std::ranges::lower_bound(ring_, key, {}, &RingPoint::point);
  const std::size_t start =
      start_point == ring_.end() ? 0 : static_cast<std::size_t>(start_point - ring_.begin());
  for (std::size_t step = 0; step < ring_.size(); ++step) {
    const std::size_t row = row_of_member_[ring_[(start + step) % ring_.size()].member];
    if (static_cast<double>(active_requests_of((*load)[row]) + 1) <= capacity) return row;
  }
  // Unreachable (the lightest worker always has room); the key's own worker is the fallback.
  return std::size_t{row_of_member_[ring_[start].member]};
}

WorkerSelectionPolicy make_bounded_load_hash_policy(const BoundedLoadHashParameters& parameters,
                                                    const RouterConfig& config,
                                                    WorkerType worker_type,
                                                    const RoutingPartition& /*partition*/) {
  return picker_only_policy(config, worker_type,
                            std::make_unique<BoundedLoadHashPicker>(parameters));
}

ProviderResult<WorkerSelectionPolicyFactory> bounded_load_hash_policy_provider(
    const WorkerSelectionPolicyParameters& parameters) {
  return provide<BoundedLoadHashParameters>(parameters, &make_bounded_load_hash_policy);
}

}  // namespace kvr::selection::policies
