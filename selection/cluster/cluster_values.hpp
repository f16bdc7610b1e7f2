// The router cluster's records in NATS JetStream key-value buckets: bucket names, the keys of a
// partition's lease and readiness records, and the values (protobuf, messages/kvr/v1/
// cluster.proto) of members, leases and readiness; and a partition's ownership as the node's
// actors pass it on (OwnedPartition, PartitionOwner). Plain C++.
#pragma once

#include <chrono>
#include <cstdint>
#include <expected>
#include <optional>
#include <string>
#include <string_view>

namespace kvr::cluster {

/// "kvr_<ns>_members": one key per node, its value a MemberRecord.
std::string members_bucket(std::string_view ns);
/// "kvr_<ns>_partitions": a lease key and, during a handover, a readiness key per partition.
std::string partitions_bucket(std::string_view ns);

/// A node's record in the members bucket, keyed by member_key(node_id).
struct MemberRecord {
  std::string node_id;
  std::uint64_t incarnation = 0;
  std::string address;  ///< "host:port" of the node's CAF middleman
  double capacity = 1.0;
  std::int64_t started_at_unix_ms = 0;

  friend bool operator==(const MemberRecord&, const MemberRecord&) = default;
};

/// The value of a partition's lease key. Its revision is the lease's epoch.
struct LeaseValue {
  /// Empty: released by its last owner with no successor; anyone may take it over.
  std::string owner_node_id;
  std::uint64_t owner_incarnation = 0;
  /// Written by the previous owner: it stopped serving and hands the lease to this owner, who
  /// takes it by a compare-and-set over this revision.
  bool handed_over = false;

  friend bool operator==(const LeaseValue&, const LeaseValue&) = default;
};

/// The value of a partition's readiness key: this node is ready to take the partition over.
struct ReadyValue {
  std::string node_id;
  std::uint64_t incarnation = 0;

  friend bool operator==(const ReadyValue&, const ReadyValue&) = default;
};

std::string encode(const MemberRecord& member);
std::string encode(const LeaseValue& lease);
std::string encode(const ReadyValue& ready);

/// The decoders fail, with a description, on bytes that are not the message or miss its
/// required fields (a node id; a member's incarnation and positive capacity).
std::expected<MemberRecord, std::string> decode_member(std::string_view bytes);
std::expected<LeaseValue, std::string> decode_lease(std::string_view bytes);
std::expected<ReadyValue, std::string> decode_ready(std::string_view bytes);

/// A JetStream key allows only [-/_=.A-Za-z0-9] and '.' separates tokens, so a partition key
/// ("<model>/<routing group>") or node id is escaped: bytes outside [-/_A-Za-z0-9] become
/// "=XX" (upper-case hex). Reversible and injective.
std::string escape_key_token(std::string_view text);
/// The inverse of escape_key_token(); nullopt for text it cannot have produced.
std::optional<std::string> unescape_key_token(std::string_view token);

/// "<escaped node id>" in the members bucket.
std::string member_key(std::string_view node_id);
/// "lease.<escaped partition>" in the partitions bucket.
std::string lease_key(std::string_view partition);
/// "ready.<escaped partition>" in the partitions bucket.
std::string ready_key(std::string_view partition);

/// What a key of the partitions bucket is: which partition, and whether lease or readiness.
struct PartitionKeyKind {
  std::string partition;
  bool is_ready = false;  ///< false: the lease key
};
/// Parses a partitions-bucket key; nullopt for a key kvr does not write.
std::optional<PartitionKeyKind> parse_partitions_key(std::string_view key);
/// The node id of a members-bucket key; nullopt when it is not one kvr writes.
std::optional<std::string> parse_member_key(std::string_view key);

/// A partition this node may serve now, with the epoch its selector stamps on what it books.
struct OwnedPartition {
  std::string partition;
  std::uint64_t epoch = 0;  ///< the lease revision
  /// The fence: the partition stops being owned at this instant unless a renewal succeeds
  /// first. Hand it to the serving selector so that it stops on its own clock even when the
  /// node's cluster code is stuck in a KV call.
  std::chrono::steady_clock::time_point owned_until;

  friend bool operator==(const OwnedPartition&, const OwnedPartition&) = default;
};

/// Who serves a partition, as the last step read it.
struct PartitionOwner {
  std::string node_id;
  /// The owner's CAF middleman "host:port" (from its member record); empty when unknown.
  std::string address;
  std::uint64_t epoch = 0;
};

}  // namespace kvr::cluster
