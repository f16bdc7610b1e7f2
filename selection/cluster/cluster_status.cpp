#include "selection/cluster/cluster_status.hpp"

#include <algorithm>
#include <map>
#include <memory>

#include <fmt/format.h>
#include <nats/nats.h>

#include "selection/cluster/jetstream_kv.hpp"
#include "selection/cluster/placement.hpp"

namespace kvr::cluster {
namespace {

// Whether the bucket exists. The status command only reads a cluster: JetStreamKv's
// open_or_create() would create a missing bucket, so this asks first (and tells a server without
// JetStream from a namespace where no node ever joined).
std::expected<bool, std::string> bucket_exists(natsConnection* connection,
                                               const std::string& bucket,
                                               std::chrono::milliseconds timeout) {
  jsOptions options;
  jsOptions_Init(&options);
  options.Wait = timeout.count();
  jsCtx* js = nullptr;
  if (natsStatus status = natsConnection_JetStream(&js, connection, &options); status != NATS_OK) {
    return std::unexpected(
        fmt::format("cannot start a JetStream context: {}", natsStatus_GetText(status)));
  }
  kvStore* kv = nullptr;
  const natsStatus status = js_KeyValue(&kv, js, bucket.c_str());
  const char* detail = nats_GetLastError(nullptr);
  const std::string text = detail != nullptr ? detail : "";
  if (kv != nullptr) kvStore_Destroy(kv);
  jsCtx_Destroy(js);
  if (status == NATS_OK) return true;
  if (status == NATS_NOT_FOUND) return false;
  // Nothing answers the JetStream API subjects (or the account has JetStream off).
  if (status == NATS_NO_RESPONDERS || text.find("not enabled") != std::string::npos) {
    return std::unexpected(
        std::string{"JetStream is not enabled on the NATS server (start it with -js); a router "
                    "cluster keeps its members and leases there"});
  }
  return std::unexpected(fmt::format("bucket '{}': {}{}{}", bucket, natsStatus_GetText(status),
                                     text.empty() ? "" : ": ", text));
}

std::expected<std::unique_ptr<JetStreamKv>, std::string> open_existing(
    natsConnection* connection, const std::string& bucket, const std::string& ns,
    std::chrono::milliseconds timeout) {
  auto exists = bucket_exists(connection, bucket, timeout);
  if (!exists) return std::unexpected(exists.error());
  if (!*exists) {
    return std::unexpected(fmt::format(
        "no router cluster in namespace '{}': the bucket '{}' does not exist (a node started "
        "with `kvr node --cluster --namespace {}` creates it)",
        ns, bucket, ns));
  }
  auto opened = JetStreamKv::open_or_create(connection,
                                            KvBucketOptions{.bucket = bucket, .timeout = timeout});
  if (!opened) return std::unexpected(opened.error().message);
  return std::move(*opened);
}

std::expected<std::vector<MemberRecord>, std::string> read_members(
    JetStreamKv& bucket, std::vector<std::string>* skipped) {
  auto keys = bucket.keys();
  if (!keys) return std::unexpected(keys.error().message);
  std::vector<MemberRecord> members;
  for (const std::string& key : *keys) {
    if (!parse_member_key(key)) continue;
    auto entry = bucket.get(key);
    if (!entry) {
      if (entry.error().code == KvErrorCode::not_found) continue;  // aged out since
      return std::unexpected(entry.error().message);
    }
    auto member = decode_member(entry->value);
    if (!member) {
      if (skipped) skipped->push_back(fmt::format("member key '{}': {}", key, member.error()));
      continue;
    }
    members.push_back(std::move(*member));
  }
  std::ranges::sort(members, {}, &MemberRecord::node_id);
  return members;
}

std::expected<std::map<std::string, PartitionStatus>, std::string> read_partitions(
    JetStreamKv& bucket, std::vector<std::string>* skipped) {
  auto keys = bucket.keys();
  if (!keys) return std::unexpected(keys.error().message);
  std::map<std::string, PartitionStatus> partitions;
  for (const std::string& key : *keys) {
    const auto kind = parse_partitions_key(key);
    if (!kind) continue;
    auto entry = bucket.get(key);
    if (!entry) {
      if (entry.error().code == KvErrorCode::not_found) continue;
      return std::unexpected(entry.error().message);
    }
    PartitionStatus& status = partitions[kind->partition];
    status.partition = kind->partition;
    if (kind->is_ready) {
      auto ready = decode_ready(entry->value);
      if (ready) status.ready = std::move(*ready);
      continue;
    }
    auto lease = decode_lease(entry->value);
    if (!lease) {
      if (skipped) skipped->push_back(fmt::format("lease key '{}': {}", key, lease.error()));
      continue;
    }
    status.lease = std::move(*lease);
    status.epoch = entry->revision;
  }
  return partitions;
}

}  // namespace

std::expected<ClusterStatus, std::string> read_cluster_status(natsConnection* connection,
                                                              const std::string& ns,
                                                              std::chrono::milliseconds timeout,
                                                              std::vector<std::string>* skipped) {
  auto members = open_existing(connection, members_bucket(ns), ns, timeout);
  if (!members) return std::unexpected(members.error());
  auto partitions = open_existing(connection, partitions_bucket(ns), ns, timeout);
  if (!partitions) return std::unexpected(partitions.error());

  ClusterStatus status;
  auto member_records = read_members(**members, skipped);
  if (!member_records) return std::unexpected(member_records.error());
  status.members = std::move(*member_records);
  auto partition_records = read_partitions(**partitions, skipped);
  if (!partition_records) return std::unexpected(partition_records.error());

  // The placement every node computes, over the partitions the bucket names: a partition whose
  // desired owner is not its owner is waiting for a handover.
  std::vector<PlacementMember> placement_members;
  for (const auto& member : status.members) {
    placement_members.push_back({member.node_id, member.capacity});
  }
  std::vector<std::string> names;
  for (const auto& [name, partition] : *partition_records) names.push_back(name);
  const auto desired = assign(names, placement_members);
  for (auto& [name, partition] : *partition_records) {
    if (const auto it = desired.find(name); it != desired.end()) {
      partition.desired_owner = it->second;
    }
    status.partitions.push_back(std::move(partition));
  }
  return status;
}

std::string_view as_str(LeaseState state) {
  switch (state) {
    case LeaseState::owned:
      return "owned";
    case LeaseState::handing_over:
      return "handing-over";
    case LeaseState::expiring:
      return "expiring";
    case LeaseState::released:
      return "released";
    case LeaseState::unleased:
      return "unleased";
  }
  return "unleased";
}

namespace {

bool is_member(const ClusterStatus& status, const std::string& node_id, std::uint64_t incarnation) {
  return std::ranges::any_of(status.members, [&](const MemberRecord& member) {
    return member.node_id == node_id && member.incarnation == incarnation;
  });
}

}  // namespace

LeaseState state_of(const ClusterStatus& status, const PartitionStatus& partition) {
  if (!partition.lease) return LeaseState::unleased;
  if (partition.lease->owner_node_id.empty()) return LeaseState::released;
  if (partition.lease->handed_over) return LeaseState::handing_over;
  if (!is_member(status, partition.lease->owner_node_id, partition.lease->owner_incarnation)) {
    return LeaseState::expiring;
  }
  return LeaseState::owned;
}

bool handover_pending(const PartitionStatus& partition, LeaseState state) {
  return state == LeaseState::owned && partition.desired_owner &&
         *partition.desired_owner != partition.lease->owner_node_id;
}

StatusSummary summarise(const ClusterStatus& status) {
  StatusSummary summary;
  for (const auto& partition : status.partitions) {
    const LeaseState state = state_of(status, partition);
    if (state == LeaseState::owned) ++summary.owned;
    if (handover_pending(partition, state)) ++summary.handovers_pending;
  }
  return summary;
}

}  // namespace kvr::cluster
