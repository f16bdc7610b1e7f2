#include "selection/cluster/placement.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>

#include <xxhash.h>

namespace kvr::cluster {
namespace {

bool usable(double weight) { return std::isfinite(weight) && weight > 0; }

std::uint64_t hash_of(std::string_view text, std::uint64_t seed = 0) {
  return XXH3_64bits_withSeed(text.data(), text.size(), seed);
}

// The member's hash of the partition, as a number strictly inside (0, 1): the top 53 bits,
// centred in their interval, so ln() is always finite and negative.
double unit_interval(std::uint64_t hash) {
  return (static_cast<double>(hash >> 11) + 0.5) * 0x1p-53;
}

double score_with_seed(std::string_view partition, std::uint64_t member_seed, double weight) {
  if (!usable(weight)) return 0;
  return -weight / std::log(unit_interval(hash_of(partition, member_seed)));
}

// A member prepared for scoring: its hash seed computed once.
struct ScoredMember {
  std::string_view node_id;
  double weight;
  std::uint64_t seed;
};

// The usable members sorted by node id, one entry per id (the largest weight), so that the
// input order and duplicates cannot change an answer.
std::vector<ScoredMember> normalise(std::span<const PlacementMember> members) {
  std::vector<ScoredMember> result;
  result.reserve(members.size());
  for (const auto& member : members) {
    if (usable(member.weight)) {
      result.push_back({member.node_id, member.weight, hash_of(member.node_id)});
    }
  }
  std::ranges::sort(result, [](const ScoredMember& a, const ScoredMember& b) {
    return a.node_id != b.node_id ? a.node_id < b.node_id : a.weight > b.weight;
  });
  const auto duplicates = std::ranges::unique(
      result, [](const ScoredMember& a, const ScoredMember& b) { return a.node_id == b.node_id; });
  result.erase(duplicates.begin(), duplicates.end());
  return result;
}

// True when (score_a, id_a) ranks above (score_b, id_b): higher score, then smaller id.
bool ranks_above(double score_a, std::string_view id_a, double score_b, std::string_view id_b) {
  return score_a != score_b ? score_a > score_b : id_a < id_b;
}

}  // namespace

std::string partition_key(std::string_view model, std::string_view routing_group) {
  std::string key;
  key.reserve(model.size() + 1 + routing_group.size());
  key.append(model).append("/").append(routing_group);
  return key;
}

double rendezvous_score(std::string_view partition, std::string_view node_id, double weight) {
  return score_with_seed(partition, hash_of(node_id), weight);
}

std::optional<std::string> desired_owner(std::string_view partition,
                                         std::span<const PlacementMember> members) {
  const auto normalised = normalise(members);
  std::optional<std::string> owner;
  double best_score = 0;
  for (const auto& member : normalised) {
    const double score = score_with_seed(partition, member.seed, member.weight);
    if (!owner || ranks_above(score, member.node_id, best_score, *owner)) {
      best_score = score;
      owner = std::string{member.node_id};
    }
  }
  return owner;
}

std::map<std::string, std::string> assign(std::span<const std::string> partitions,
                                          std::span<const PlacementMember> members,
                                          double epsilon) {
  std::map<std::string, std::string> assignment;
  const auto normalised = normalise(members);
  if (normalised.empty()) return assignment;
  if (!(epsilon >= 0)) epsilon = 0;  // also catches NaN

  // One pass order fixed by the partitions' own hashes: unlike the key order, it does not make
  // the partitions late in the alphabet the ones displaced when members fill up.
  std::vector<std::pair<std::uint64_t, std::string_view>> order;
  {
    std::set<std::string_view> distinct(partitions.begin(), partitions.end());
    order.reserve(distinct.size());
    for (std::string_view partition : distinct) order.emplace_back(hash_of(partition), partition);
  }
  std::ranges::sort(order);

  double total_weight = 0;
  for (const auto& member : normalised) total_weight += member.weight;
  std::vector<std::size_t> room(normalised.size());
  const auto count = static_cast<double>(order.size());
  for (std::size_t i = 0; i < normalised.size(); ++i) {
    const double fair = count * normalised[i].weight / total_weight;
    const double slack = (1 + epsilon) * fair;
    // A share that is an integer up to rounding error (110.00000000000001) must not round up.
    const double tolerance = 1e-9 * std::max(1.0, slack);
    // The slack is whole partitions only: a few partitions (a model's shards) spread evenly.
    room[i] = std::max(static_cast<std::size_t>(std::ceil(fair - tolerance)),
                       static_cast<std::size_t>(std::floor(slack + tolerance)));
  }

  std::vector<double> scores(normalised.size());
  for (const auto& [hash, partition] : order) {
    for (std::size_t i = 0; i < normalised.size(); ++i) {
      scores[i] = score_with_seed(partition, normalised[i].seed, normalised[i].weight);
    }
    // The best member with room; the rooms add up to at least the partition count, so one has.
    std::optional<std::size_t> best;
    for (std::size_t i = 0; i < normalised.size(); ++i) {
      if (room[i] == 0) continue;
      if (!best ||
          ranks_above(scores[i], normalised[i].node_id, scores[*best], normalised[*best].node_id)) {
        best = i;
      }
    }
    if (!best) break;
    --room[*best];
    assignment.emplace(std::string{partition}, std::string{normalised[*best].node_id});
  }
  return assignment;
}

PlacementSpread spread_of(const std::map<std::string, std::string>& assignment,
                          std::span<const PlacementMember> members) {
  std::map<std::string_view, std::size_t> owned;
  for (const auto& member : members) owned.emplace(member.node_id, 0);
  for (const auto& [partition, owner] : assignment) ++owned[owner];
  PlacementSpread spread;
  if (owned.empty()) return spread;
  spread.min_owned = std::numeric_limits<std::size_t>::max();
  std::size_t total = 0;
  for (const auto& [node, count] : owned) {
    spread.min_owned = std::min(spread.min_owned, count);
    spread.max_owned = std::max(spread.max_owned, count);
    total += count;
  }
  spread.mean_owned = static_cast<double>(total) / static_cast<double>(owned.size());
  return spread;
}

std::size_t moved_partitions(const std::map<std::string, std::string>& before,
                             const std::map<std::string, std::string>& after) {
  std::size_t moved = 0;
  for (const auto& [partition, owner] : before) {
    const auto it = after.find(partition);
    if (it == after.end() || it->second != owner) ++moved;
  }
  for (const auto& [partition, owner] : after) {
    if (!before.contains(partition)) ++moved;
  }
  return moved;
}

}  // namespace kvr::cluster
