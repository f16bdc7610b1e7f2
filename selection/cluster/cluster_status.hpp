// What a router cluster's JetStream buckets say, read without writing them: the members, each
// partition's lease, readiness and desired owner (the placement every node computes), and how
// each lease stands. `kvr cluster status` prints it; plain C++ over the NATS C client.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <expected>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "selection/cluster/cluster_values.hpp"

struct __natsConnection;  // natsConnection of the NATS C client

namespace kvr::cluster {

/// What the partitions bucket holds for one partition, and where placement wants it.
struct PartitionStatus {
  std::string partition;
  std::optional<LeaseValue> lease;
  std::uint64_t epoch = 0;  ///< the lease key's revision; 0 without a lease key
  std::optional<ReadyValue> ready;
  std::optional<std::string> desired_owner;
};

struct ClusterStatus {
  std::vector<MemberRecord> members;        ///< by node id
  std::vector<PartitionStatus> partitions;  ///< by partition key
};

/// Reads namespace `ns`'s members and partitions buckets over `connection`, each read waiting
/// at most `timeout`. The error says why there is nothing to read: no JetStream on the server,
/// no cluster in the namespace (its buckets do not exist; they are never created here), or the
/// server's error. Records that do not decode are skipped, each named on `skipped`.
std::expected<ClusterStatus, std::string> read_cluster_status(
    __natsConnection* connection, const std::string& ns, std::chrono::milliseconds timeout,
    std::vector<std::string>* skipped = nullptr);

/// How a partition's lease stands.
enum class LeaseState : std::uint8_t {
  owned,         ///< a live member holds it
  handing_over,  ///< its last owner stopped serving and named a successor (the lease's owner)
  expiring,      ///< its owner (or that incarnation) is no longer a member: it is ageing out
  released,      ///< released with no successor: anyone may take it
  unleased,      ///< no lease key (only a readiness key)
};

/// "owned", "handing-over", "expiring", "released" or "unleased".
std::string_view as_str(LeaseState state);

LeaseState state_of(const ClusterStatus& status, const PartitionStatus& partition);

/// A live owner that placement would move the partition away from.
bool handover_pending(const PartitionStatus& partition, LeaseState state);

struct StatusSummary {
  std::size_t owned = 0;
  std::size_t handovers_pending = 0;
};

StatusSummary summarise(const ClusterStatus& status);

}  // namespace kvr::cluster
