// The forwarder's routing table (cluster mode): from the last cluster view, where a route request,
// generate request or lifecycle report goes — served by this node, forwarded to the node that owns
// it (with that node's middleman address), or held for the next view. Plain C++; the forwarder
// actor (forwarder_actor.hpp) asks it and keeps only mailboxes, promises, connections and streams.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>

#include "selection/cluster/cluster_session.hpp"
#include "selection/cluster/cluster_values.hpp"
#include "selection/cluster/partition_lease_keeper.hpp"

namespace kvr::cluster {

/// How many views a route request or report may wait for while its partition (or its lease's
/// node) is unknown or changing hands; after that its routing is final.
inline constexpr int kMaxViewWaits = 3;

/// The lease-id prefix of a node's leases in cluster mode: its incarnation, 16 lower-case hex
/// digits. A cluster lease id is "<prefix>-<rest>".
std::string booking_id_prefix(std::uint64_t incarnation);

/// Where one request goes.
struct ForwardDecision {
  enum class Action {
    serve_here,  ///< this node's actors serve it
    forward,     ///< send it to `node_id`'s ingress
    await_view,  ///< hold it until the next view, then ask again
  };
  Action action = Action::serve_here;
  /// forward: the owner's node id.
  std::string node_id;
  /// forward: the owner's middleman "host:port" from its member record in the last view;
  /// nullopt when the view has no member record of that node (its last known address stands).
  std::optional<std::string> address;

  static ForwardDecision serve_here() { return {}; }
  static ForwardDecision await_view() { return {Action::await_view, {}, std::nullopt}; }
  static ForwardDecision forward(std::string node_id, std::optional<std::string> address) {
    return {Action::forward, std::move(node_id), std::move(address)};
  }

  friend bool operator==(const ForwardDecision&, const ForwardDecision&) = default;
};

/// The routing table of one node's forwarder, rebuilt from each cluster view. Not thread-safe: one
/// owner (the forwarder actor).
class ForwardTable {
 public:
  /// An empty table: it owns nothing and knows no member, so every route request waits.
  ForwardTable() = default;
  /// `node_id` is this node's member id; `booking_id_prefix` the prefix of its own booking ids
  /// (booking_id_prefix of its incarnation): both are served here whatever a view says.
  ForwardTable(std::string node_id, std::string booking_id_prefix);

  /// Replaces the table's picture with one view: the partitions this node owns, the owner of each
  /// partition leased elsewhere, and the live members (their lease prefixes and addresses).
  void apply(std::span<const OwnedPartition> owned,
             const std::map<std::string, PartitionOwner>& elsewhere,
             std::span<const MemberRecord> members);

  /// A route request's destination by its partition key (placement.hpp partition_key()), after
  /// waiting for `views_waited` views: here when this node owns the partition, forwarded when
  /// another node does, otherwise held for the next view until kMaxViewWaits views went by, then
  /// served here (final).
  ForwardDecision route(const std::string& partition, int views_waited) const;

  /// A generate request's destination by its partition key: forwarded when another node owns
  /// the partition, otherwise served here. Never held: a generate request does not wait.
  ForwardDecision generate(const std::string& partition) const;

  /// A lifecycle report's destination by its lease id's prefix: here for this node's leases,
  /// forwarded to the member whose incarnation the prefix names, otherwise (a node not in the
  /// last view, or not a cluster lease id) held for the next view until kMaxViewWaits views went
  /// by, then served here (final; this node's reservation actor answers it).
  ForwardDecision report(std::string_view booking_id, int views_waited) const;

  /// Whether a request already routed (and refused as not the owner's, or never sent because its
  /// owner could not be reached) may wait for another view after `views_waited`.
  static bool may_await_view(int views_waited) { return views_waited < kMaxViewWaits; }

  /// Whether this node owns `partition` in the last view.
  bool owns(const std::string& partition) const { return owned_.contains(partition); }
  /// The partitions this node owns in the last view.
  const std::set<std::string>& owned() const { return owned_; }
  /// A member's middleman address in the last view; nullopt when it has no member record.
  std::optional<std::string> address_of(const std::string& node_id) const;

 private:
  // The node that owns `partition` when it is not this one.
  std::optional<std::string> remote_owner(const std::string& partition) const;

  std::string node_id_;
  std::string booking_id_prefix_;
  std::set<std::string> owned_;
  // Owner node ids of the partitions leased elsewhere (possibly this node, by a stale record).
  std::map<std::string, std::string> owner_by_partition_;
  std::map<std::string, std::string> node_by_booking_id_prefix_;
  std::map<std::string, std::string> address_by_node_;
};

}  // namespace kvr::cluster
