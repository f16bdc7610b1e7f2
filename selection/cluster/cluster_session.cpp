#include "selection/cluster/cluster_session.hpp"

#include <type_traits>
#include <utility>

#include <fmt/format.h>

namespace kvr::cluster {

ClusterSession::ClusterSession(MemberRecord self, JetStreamKv& members, JetStreamKv& partitions,
                               PartitionLeaseOptions options)
    : self_(std::move(self)),
      members_(&members),
      partitions_(&partitions),
      keeper_(self_.node_id, self_.incarnation, options) {}

std::expected<std::vector<MemberRecord>, KvError> ClusterSession::read_members() {
  auto keys = members_->keys();
  if (!keys) return std::unexpected(std::move(keys.error()));
  std::vector<MemberRecord> members;
  for (const std::string& key : *keys) {
    if (!parse_member_key(key)) continue;
    auto entry = members_->get(key);
    if (!entry) {
      if (entry.error().code == KvErrorCode::not_found) continue;  // aged out since keys()
      return std::unexpected(std::move(entry.error()));
    }
    // A record another version or a stranger wrote badly is ignored, not fatal.
    if (auto member = decode_member(entry->value)) members.push_back(std::move(*member));
  }
  return members;
}

std::expected<LeaseTable, KvError> ClusterSession::read_table() {
  auto keys = partitions_->keys();
  if (!keys) return std::unexpected(std::move(keys.error()));
  LeaseTable table;
  for (const std::string& key : *keys) {
    const auto kind = parse_partitions_key(key);
    if (!kind) continue;
    auto entry = partitions_->get(key);
    if (!entry) {
      if (entry.error().code == KvErrorCode::not_found) continue;
      return std::unexpected(std::move(entry.error()));
    }
    if (kind->is_ready) {
      if (auto ready = decode_ready(entry->value)) table.ready.emplace(kind->partition, *ready);
    } else if (auto lease = decode_lease(entry->value)) {
      table.leases.emplace(kind->partition, LeaseRecord{*lease, entry->revision});
    }
  }
  return table;
}

void ClusterSession::run(const LeaseAction& action, ClusterStep& result) {
  const auto failed = [&](std::string_view what, const std::string& partition,
                          const KvError& error) {
    result.failures.push_back(
        fmt::format("{} {}: {} ({})", what, partition, error.message, as_str(error.code)));
  };
  std::visit(
      [&](const auto& call) {
        using Call = std::decay_t<decltype(call)>;
        if constexpr (std::is_same_v<Call, AcquireLease>) {
          const std::string key = lease_key(call.partition);
          const std::string value = encode(call.value);
          auto written = call.over_revision ? partitions_->update(key, value, *call.over_revision)
                                            : partitions_->create(key, value);
          if (!written) failed("acquire", call.partition, written.error());
          if (written) {
            preparing_.erase(call.partition);
            prepared_.erase(call.partition);
          }
          keeper_.on_acquired(call.partition,
                              written ? std::optional{*written} : std::optional<std::uint64_t>{});
        } else if constexpr (std::is_same_v<Call, RenewLease>) {
          auto written =
              partitions_->update(lease_key(call.partition), encode(call.value), call.revision);
          if (!written) {
            failed("renew", call.partition, written.error());
            ++result.renew_failures;
          }
          keeper_.on_renewed(call.partition,
                             written ? std::optional{*written} : std::optional<std::uint64_t>{});
        } else if constexpr (std::is_same_v<Call, ReleaseLease>) {
          auto written =
              partitions_->update(lease_key(call.partition), encode(call.value), call.revision);
          if (!written) failed("release", call.partition, written.error());
          if (written) ++result.released;
          keeper_.on_released(call.partition);
          preparing_.erase(call.partition);
          prepared_.erase(call.partition);
          result.drop.push_back(call.partition);
        } else if constexpr (std::is_same_v<Call, PreparePartition>) {
          preparing_.insert(call.partition);
        } else if constexpr (std::is_same_v<Call, AnnounceReady>) {
          auto written = partitions_->put(ready_key(call.partition), encode(call.value));
          if (!written) failed("announce", call.partition, written.error());
        } else if constexpr (std::is_same_v<Call, WithdrawReady>) {
          auto erased = partitions_->erase(ready_key(call.partition));
          if (!erased && erased.error().code != KvErrorCode::not_found) {
            failed("withdraw", call.partition, erased.error());
          }
        } else if constexpr (std::is_same_v<Call, AbandonPartition>) {
          preparing_.erase(call.partition);
          prepared_.erase(call.partition);
          result.drop.push_back(call.partition);
        }
      },
      action);
}

ClusterStep ClusterSession::step(PartitionLeaseKeeper::Clock::time_point now,
                                 const std::vector<std::string>& partitions,
                                 const StopServing& stop_serving) {
  ClusterStep result;
  // The announcement first: a node that cannot announce itself should not take leases either,
  // and the fence ends what it holds.
  if (auto announced = members_->put(member_key(self_.node_id), encode(self_)); !announced) {
    result.failures.push_back(fmt::format("announce member: {}", announced.error().message));
    result.owned = keeper_.owned(now);
    return result;
  }
  auto members = read_members();
  auto table = members ? read_table() : std::unexpected(members.error());
  if (!members || !table) {
    result.failures.push_back(
        fmt::format("read buckets: {}", members ? table.error().message : members.error().message));
    result.owned = keeper_.owned(now);
    return result;
  }
  const std::vector<LeaseAction> actions = keeper_.step(now, *members, partitions, *table);
  if (stop_serving) {
    std::vector<std::string> releasing;
    for (const LeaseAction& action : actions) {
      if (const auto* release = std::get_if<ReleaseLease>(&action)) {
        releasing.push_back(release->partition);
      }
    }
    if (!releasing.empty()) stop_serving(releasing);
  }
  for (const LeaseAction& action : actions) run(action, result);
  result.prepare.assign(preparing_.begin(), preparing_.end());
  result.owned = keeper_.owned(now);
  std::map<std::string, std::string> addresses;
  for (const MemberRecord& member : *members) addresses[member.node_id] = member.address;
  for (const auto& [partition, lease] : table->leases) {
    if (keeper_.epoch_of(partition, now)) continue;
    if (lease.value.owner_node_id.empty()) continue;
    const auto address = addresses.find(lease.value.owner_node_id);
    result.elsewhere.emplace(
        partition, PartitionOwner{lease.value.owner_node_id,
                                  address == addresses.end() ? std::string{} : address->second,
                                  lease.revision});
  }
  result.members = std::move(*members);
  return result;
}

void ClusterSession::leave() {
  (void)members_->erase(member_key(self_.node_id));
  ClusterStep ignored;
  for (const LeaseAction& action : keeper_.release_all()) run(action, ignored);
}

}  // namespace kvr::cluster
