// Where each routing partition should live in a router cluster: weighted rendezvous hashing of
// the partition key over the live members, and a bounded-load assignment of a known partition
// set. Every node computes the same answer from the same inputs, so no node has to tell another
// where a partition belongs. Used by the partition lease keeper (partition_lease_keeper.hpp) and
// the placement benchmark; plain C++.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kvr::cluster {

/// One live cluster member as placement sees it.
struct PlacementMember {
  std::string node_id;
  /// Relative capacity: a member with twice the weight gets about twice the partitions. Members
  /// with a weight that is not a positive finite number get none.
  double weight = 1.0;
};

/// The default slack of assign(): a member owns at most ⌈(1 + ε) · its fair share⌉ partitions.
inline constexpr double kDefaultLoadSlack = 0.1;

/// The partition key placement hashes: "<model>/<routing group>".
std::string partition_key(std::string_view model, std::string_view routing_group);

/// The weighted rendezvous score of `node_id` for `partition`: -weight / ln(u), u the member's
/// hash of the partition mapped into (0, 1). The highest score wins; 0 for unusable weights.
double rendezvous_score(std::string_view partition, std::string_view node_id, double weight);

/// The member with the highest rendezvous score for `partition` (ties: the smaller node id);
/// nullopt when no member has a usable weight. Adding a member moves only the partitions it
/// wins; removing one moves only the partitions it held.
std::optional<std::string> desired_owner(std::string_view partition,
                                         std::span<const PlacementMember> members);

/// Every partition's owner under a load bound: partitions are taken in an order fixed by their
/// own hash, each goes to its highest-scoring member that still has room, a member's room being
/// its fair share (partitions · weight / total weight) rounded up, or (1 + epsilon) times it
/// rounded down when that is more: the slack is whole partitions, so that a few partitions (a
/// model's shards) spread evenly. The result depends only on the sets
/// given (not their order; duplicate partitions count once, a duplicated node id keeps its
/// largest weight). Empty when no member has a usable weight.
std::map<std::string, std::string> assign(std::span<const std::string> partitions,
                                          std::span<const PlacementMember> members,
                                          double epsilon = kDefaultLoadSlack);

/// How evenly an assignment spreads: partitions per member (members that got none included).
struct PlacementSpread {
  std::size_t min_owned = 0;
  std::size_t max_owned = 0;
  double mean_owned = 0;
};

/// The spread of `assignment` over `members`.
PlacementSpread spread_of(const std::map<std::string, std::string>& assignment,
                          std::span<const PlacementMember> members);

/// The number of partitions whose owner differs between two assignments (a partition missing
/// from one of them counts as moved).
std::size_t moved_partitions(const std::map<std::string, std::string>& before,
                             const std::map<std::string, std::string>& after);

}  // namespace kvr::cluster
