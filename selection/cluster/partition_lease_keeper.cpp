#include "selection/cluster/partition_lease_keeper.hpp"

#include <algorithm>
#include <cmath>

#include "messages/check.hpp"

namespace kvr::cluster {
namespace {

bool has_member(std::span<const MemberRecord> members, const std::string& node_id,
                std::uint64_t incarnation) {
  return std::ranges::any_of(members, [&](const MemberRecord& member) {
    return member.node_id == node_id && member.incarnation == incarnation;
  });
}

}  // namespace

std::optional<std::string> validate(const PartitionLeaseOptions& options) {
  if (options.renew_interval.count() <= 0) return "the renew interval must be positive";
  if (options.renew_deadline <= options.renew_interval) {
    return "the renew deadline must be longer than the renew interval";
  }
  if (options.ttl <= options.renew_deadline) {
    return "the lease TTL must be longer than the renew deadline";
  }
  if (!(options.load_slack >= 0) || !std::isfinite(options.load_slack)) {
    return "the placement load slack must be a finite number >= 0";
  }
  return std::nullopt;
}

PartitionLeaseKeeper::PartitionLeaseKeeper(std::string node_id, std::uint64_t incarnation,
                                           PartitionLeaseOptions options)
    : node_id_(std::move(node_id)), incarnation_(incarnation), options_(options) {
  KVR_CHECK(!node_id_.empty());
  KVR_CHECK(!validate(options_).has_value());
}

bool PartitionLeaseKeeper::is_self(const std::string& node_id, std::uint64_t incarnation) const {
  return node_id == node_id_ && incarnation == incarnation_;
}

bool PartitionLeaseKeeper::holds(const std::string& partition, Clock::time_point now) const {
  const auto it = held_.find(partition);
  return it != held_.end() && now - it->second.written_at < options_.renew_deadline;
}

LeaseValue PartitionLeaseKeeper::own_value() const {
  return LeaseValue{node_id_, incarnation_, false};
}

std::vector<LeaseAction> PartitionLeaseKeeper::step(Clock::time_point now,
                                                    std::span<const MemberRecord> members,
                                                    std::span<const std::string> partitions,
                                                    const LeaseTable& table) {
  std::vector<LeaseAction> actions;
  // The fence comes first: a keeper that was paused past its deadline drops its claims before
  // it acts on anything, whatever its (possibly stale) table says.
  std::erase_if(held_, [&](const auto& entry) {
    return now - entry.second.written_at >= options_.renew_deadline;
  });

  std::set<std::string> universe(partitions.begin(), partitions.end());
  for (const auto& [partition, lease] : table.leases) universe.insert(partition);
  for (const auto& [partition, held] : held_) universe.insert(partition);
  for (const auto& [partition, incoming] : incoming_) universe.insert(partition);

  std::vector<PlacementMember> placement_members;
  placement_members.reserve(members.size());
  for (const auto& member : members) placement_members.push_back({member.node_id, member.capacity});
  const std::vector<std::string> all_partitions(universe.begin(), universe.end());
  const auto desired = assign(all_partitions, placement_members, options_.load_slack);
  // Until this process's own record is visible (a previous incarnation's may linger) it takes
  // nothing new: others cannot yet see it as a member either.
  const bool listed = has_member(members, node_id_, incarnation_);

  for (const auto& partition : all_partitions) {
    if (pending_.contains(partition)) continue;
    const auto lease_it = table.leases.find(partition);
    const LeaseRecord* lease = lease_it != table.leases.end() ? &lease_it->second : nullptr;
    const auto desired_it = desired.find(partition);
    std::optional<std::string> desired_owner;
    if (desired_it != desired.end()) desired_owner = desired_it->second;
    const bool desired_here = listed && desired_owner == node_id_;

    if (held_.contains(partition)) {
      decide_held(partition, lease, desired_owner, now, members, table, actions);
    } else {
      decide_free(partition, lease, desired_here, now, actions);
    }

    // A handover in: the lease is another node's (live, or ageing out) and this node is where
    // it should go.
    const bool foreign_lease = lease != nullptr && !lease->value.owner_node_id.empty() &&
                               !is_self(lease->value.owner_node_id, lease->value.owner_incarnation);
    const bool taking = held_.contains(partition) || pending_.contains(partition);
    const auto incoming_it = incoming_.find(partition);
    if (desired_here && foreign_lease && !taking) {
      Incoming& incoming = incoming_[partition];
      if (!incoming.prepare_asked) {
        incoming.prepare_asked = true;
        actions.emplace_back(PreparePartition{partition});
      } else if (incoming.prepared && (!incoming.announced_at ||
                                       now - *incoming.announced_at >= options_.renew_interval)) {
        // Refreshed so that it outlives neither this node nor the handover: it ages out with the
        // bucket's TTL once this node stops announcing.
        incoming.announced_at = now;
        actions.emplace_back(AnnounceReady{partition, ReadyValue{node_id_, incarnation_}});
      }
    } else if (incoming_it != incoming_.end()) {
      if (incoming_it->second.announced_at) actions.emplace_back(WithdrawReady{partition});
      if (!taking) actions.emplace_back(AbandonPartition{partition});
      incoming_.erase(incoming_it);
    }
  }
  return actions;
}

void PartitionLeaseKeeper::decide_held(const std::string& partition, const LeaseRecord* lease,
                                       const std::optional<std::string>& desired,
                                       Clock::time_point now, std::span<const MemberRecord> members,
                                       const LeaseTable& table, std::vector<LeaseAction>& actions) {
  const Held held = held_.at(partition);
  // A later revision than this node's last write is another node's write: superseded. (Its own
  // writes are reported before it steps again; an older revision is a table read before them.)
  if (lease != nullptr && lease->revision > held.revision) {
    held_.erase(partition);
    return;
  }
  if (desired && *desired != node_id_) {
    const auto ready = table.ready.find(partition);
    if (ready != table.ready.end() && ready->second.node_id == *desired &&
        has_member(members, ready->second.node_id, ready->second.incarnation)) {
      // Serving stops before the write goes out, so the successor never overlaps this node.
      held_.erase(partition);
      pending_[partition] = Pending{CallKind::release, now};
      actions.emplace_back(ReleaseLease{
          partition, held.revision,
          LeaseValue{ready->second.node_id, ready->second.incarnation, /*handed_over=*/true}});
      return;
    }
  }
  if (now - held.written_at >= options_.renew_interval) {
    pending_[partition] = Pending{CallKind::renew, now};
    actions.emplace_back(RenewLease{partition, held.revision, own_value()});
  }
}

void PartitionLeaseKeeper::decide_free(const std::string& partition, const LeaseRecord* lease,
                                       bool desired_here, Clock::time_point now,
                                       std::vector<LeaseAction>& actions) {
  auto acquire = [&](std::optional<std::uint64_t> over_revision) {
    pending_[partition] = Pending{CallKind::acquire, now};
    actions.emplace_back(AcquireLease{partition, over_revision, own_value()});
  };
  if (lease == nullptr) {
    // No key: it aged out (its owner's belief ended first), was never taken, or was erased.
    if (desired_here) acquire(std::nullopt);
    return;
  }
  const LeaseValue& value = lease->value;
  if (is_self(value.owner_node_id, value.owner_incarnation)) {
    // Handed to this node; or its own lease it stopped counting on (a failed or late renewal),
    // on which no other node can believe anything: either way only this node may write it.
    if (value.handed_over || desired_here) {
      acquire(lease->revision);
    } else {
      // Belongs elsewhere now: free it rather than make the desired owner wait for the TTL.
      pending_[partition] = Pending{CallKind::release, now};
      actions.emplace_back(ReleaseLease{partition, lease->revision, LeaseValue{}});
    }
    return;
  }
  if (value.owner_node_id.empty() && desired_here) acquire(lease->revision);
}

void PartitionLeaseKeeper::on_acquired(const std::string& partition,
                                       std::optional<std::uint64_t> revision) {
  const auto it = pending_.find(partition);
  if (it == pending_.end() || it->second.kind != CallKind::acquire) return;
  const Clock::time_point sent_at = it->second.sent_at;
  pending_.erase(it);
  if (revision) held_[partition] = Held{*revision, sent_at};
}

void PartitionLeaseKeeper::on_renewed(const std::string& partition,
                                      std::optional<std::uint64_t> revision) {
  const auto it = pending_.find(partition);
  if (it == pending_.end() || it->second.kind != CallKind::renew) return;
  const Clock::time_point sent_at = it->second.sent_at;
  pending_.erase(it);
  if (revision) {
    // Owned from when the write was sent, not when its answer came: a late answer (the node
    // was paused meanwhile) may already be past the deadline.
    held_[partition] = Held{*revision, sent_at};
  } else {
    held_.erase(partition);
  }
}

void PartitionLeaseKeeper::on_released(const std::string& partition) {
  const auto it = pending_.find(partition);
  if (it != pending_.end() && it->second.kind == CallKind::release) pending_.erase(it);
}

void PartitionLeaseKeeper::mark_prepared(const std::string& partition) {
  const auto it = incoming_.find(partition);
  if (it != incoming_.end() && it->second.prepare_asked) it->second.prepared = true;
}

std::vector<LeaseAction> PartitionLeaseKeeper::release_all() {
  std::vector<LeaseAction> actions;
  for (const auto& [partition, held] : held_) {
    // Replaces a renewal in flight: its answer is ignored, and if it lands first the release
    // fails and the lease simply ages out.
    pending_[partition] = Pending{CallKind::release, Clock::time_point{}};
    actions.emplace_back(ReleaseLease{partition, held.revision, LeaseValue{}});
  }
  held_.clear();
  for (const auto& [partition, incoming] : incoming_) {
    if (incoming.announced_at) actions.emplace_back(WithdrawReady{partition});
    actions.emplace_back(AbandonPartition{partition});
  }
  incoming_.clear();
  return actions;
}

std::vector<OwnedPartition> PartitionLeaseKeeper::owned(Clock::time_point now) const {
  std::vector<OwnedPartition> result;
  for (const auto& [partition, held] : held_) {
    if (now - held.written_at < options_.renew_deadline) {
      result.push_back({partition, held.revision, held.written_at + options_.renew_deadline});
    }
  }
  return result;
}

std::optional<std::uint64_t> PartitionLeaseKeeper::epoch_of(const std::string& partition,
                                                            Clock::time_point now) const {
  if (!holds(partition, now)) return std::nullopt;
  return held_.at(partition).revision;
}

std::optional<PartitionLeaseKeeper::Clock::time_point> PartitionLeaseKeeper::next_fence() const {
  std::optional<Clock::time_point> earliest;
  for (const auto& [partition, held] : held_) {
    const auto fence = held.written_at + options_.renew_deadline;
    if (!earliest || fence < *earliest) earliest = fence;
  }
  return earliest;
}

}  // namespace kvr::cluster
