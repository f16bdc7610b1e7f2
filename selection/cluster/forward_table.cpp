#include "selection/cluster/forward_table.hpp"

#include <charconv>

namespace kvr::cluster {

std::string booking_id_prefix(std::uint64_t incarnation) {
  char digits[16];
  const auto end = std::to_chars(digits, digits + sizeof digits, incarnation, 16).ptr;
  const auto length = static_cast<std::size_t>(end - digits);
  std::string prefix(sizeof digits - length, '0');
  prefix.append(digits, length);
  return prefix;
}

ForwardTable::ForwardTable(std::string node_id, std::string booking_id_prefix)
    : node_id_(std::move(node_id)), booking_id_prefix_(std::move(booking_id_prefix)) {}

void ForwardTable::apply(std::span<const OwnedPartition> owned,
                         const std::map<std::string, PartitionOwner>& elsewhere,
                         std::span<const MemberRecord> members) {
  owned_.clear();
  for (const auto& partition : owned) owned_.insert(partition.partition);
  owner_by_partition_.clear();
  for (const auto& [partition, owner] : elsewhere) owner_by_partition_[partition] = owner.node_id;
  node_by_booking_id_prefix_.clear();
  address_by_node_.clear();
  for (const auto& member : members) {
    node_by_booking_id_prefix_[booking_id_prefix(member.incarnation)] = member.node_id;
    address_by_node_[member.node_id] = member.address;
  }
}

std::optional<std::string> ForwardTable::remote_owner(const std::string& partition) const {
  if (owned_.contains(partition)) return std::nullopt;
  const auto owner = owner_by_partition_.find(partition);
  // A record naming this node for a partition it does not own is stale: never forward to itself.
  if (owner == owner_by_partition_.end() || owner->second == node_id_) return std::nullopt;
  return owner->second;
}

ForwardDecision ForwardTable::route(const std::string& partition, int views_waited) const {
  if (auto owner = remote_owner(partition)) {
    auto address = address_of(*owner);
    return ForwardDecision::forward(std::move(*owner), std::move(address));
  }
  // Nobody (or only a stale record of this node) owns it: a handover or takeover is under way,
  // and a later view names the owner.
  if (may_await_view(views_waited) && !owns(partition)) return ForwardDecision::await_view();
  return ForwardDecision::serve_here();
}

ForwardDecision ForwardTable::generate(const std::string& partition) const {
  if (auto owner = remote_owner(partition)) {
    auto address = address_of(*owner);
    return ForwardDecision::forward(std::move(*owner), std::move(address));
  }
  return ForwardDecision::serve_here();
}

ForwardDecision ForwardTable::report(std::string_view booking_id, int views_waited) const {
  const auto dash = booking_id.find('-');
  if (dash != std::string_view::npos) {
    const std::string prefix{booking_id.substr(0, dash)};
    if (prefix == booking_id_prefix_) return ForwardDecision::serve_here();
    if (const auto node = node_by_booking_id_prefix_.find(prefix);
        node != node_by_booking_id_prefix_.end()) {
      if (node->second == node_id_) return ForwardDecision::serve_here();
      return ForwardDecision::forward(node->second, address_of(node->second));
    }
  }
  // A lease of a node that joined after this one's last view: the next view knows it.
  if (may_await_view(views_waited)) return ForwardDecision::await_view();
  return ForwardDecision::serve_here();
}

std::optional<std::string> ForwardTable::address_of(const std::string& node_id) const {
  const auto address = address_by_node_.find(node_id);
  if (address == address_by_node_.end()) return std::nullopt;
  return address->second;
}

}  // namespace kvr::cluster
