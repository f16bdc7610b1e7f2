#include "selection/cluster/cluster_values.hpp"

#include <cmath>

#include "kvr/v1/cluster.pb.h"

namespace kvr::cluster {
namespace {

constexpr std::string_view kLeasePrefix = "lease.";
constexpr std::string_view kReadyPrefix = "ready.";
constexpr std::string_view kHexDigits = "0123456789ABCDEF";

bool kept_in_key(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
         c == '_' || c == '/';
}

std::optional<int> hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return std::nullopt;
}

template <typename Proto>
std::string serialise(const Proto& proto) {
  std::string bytes;
  proto.SerializeToString(&bytes);
  return bytes;
}

template <typename Proto>
bool parse(Proto& proto, std::string_view bytes) {
  return proto.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()));
}

}  // namespace

std::string members_bucket(std::string_view ns) { return "kvr_" + std::string{ns} + "_members"; }

std::string partitions_bucket(std::string_view ns) {
  return "kvr_" + std::string{ns} + "_partitions";
}

std::string encode(const MemberRecord& member) {
  kvr::v1::ClusterMember proto;
  proto.set_node_id(member.node_id);
  proto.set_incarnation(member.incarnation);
  proto.set_address(member.address);
  proto.set_capacity(member.capacity);
  proto.set_started_at_unix_ms(member.started_at_unix_ms);
  return serialise(proto);
}

std::string encode(const LeaseValue& lease) {
  kvr::v1::PartitionLease proto;
  proto.set_owner_node_id(lease.owner_node_id);
  proto.set_owner_incarnation(lease.owner_incarnation);
  proto.set_handed_over(lease.handed_over);
  return serialise(proto);
}

std::string encode(const ReadyValue& ready) {
  kvr::v1::PartitionReady proto;
  proto.set_node_id(ready.node_id);
  proto.set_incarnation(ready.incarnation);
  return serialise(proto);
}

std::expected<MemberRecord, std::string> decode_member(std::string_view bytes) {
  kvr::v1::ClusterMember proto;
  if (!parse(proto, bytes)) return std::unexpected("not a ClusterMember message");
  if (proto.node_id().empty()) return std::unexpected("member record without a node id");
  if (proto.incarnation() == 0) return std::unexpected("member record without an incarnation");
  if (!std::isfinite(proto.capacity()) || proto.capacity() <= 0) {
    return std::unexpected("member record with a capacity that is not positive");
  }
  return MemberRecord{proto.node_id(), proto.incarnation(), proto.address(), proto.capacity(),
                      proto.started_at_unix_ms()};
}

std::expected<LeaseValue, std::string> decode_lease(std::string_view bytes) {
  kvr::v1::PartitionLease proto;
  if (!parse(proto, bytes)) return std::unexpected("not a PartitionLease message");
  // An empty owner is valid (released); a successor mark without one is not.
  if (proto.owner_node_id().empty() && proto.handed_over()) {
    return std::unexpected("lease handed over to no node");
  }
  return LeaseValue{proto.owner_node_id(), proto.owner_incarnation(), proto.handed_over()};
}

std::expected<ReadyValue, std::string> decode_ready(std::string_view bytes) {
  kvr::v1::PartitionReady proto;
  if (!parse(proto, bytes)) return std::unexpected("not a PartitionReady message");
  if (proto.node_id().empty()) return std::unexpected("readiness record without a node id");
  return ReadyValue{proto.node_id(), proto.incarnation()};
}

std::string escape_key_token(std::string_view text) {
  std::string token;
  token.reserve(text.size());
  for (const char c : text) {
    if (kept_in_key(c)) {
      token.push_back(c);
    } else {
      const auto byte = static_cast<unsigned char>(c);
      token.push_back('=');
      token.push_back(kHexDigits[byte >> 4]);
      token.push_back(kHexDigits[byte & 0xF]);
    }
  }
  return token;
}

std::optional<std::string> unescape_key_token(std::string_view token) {
  std::string text;
  text.reserve(token.size());
  for (std::size_t i = 0; i < token.size(); ++i) {
    const char c = token[i];
    if (kept_in_key(c)) {
      text.push_back(c);
      continue;
    }
    if (c != '=' || i + 2 >= token.size()) return std::nullopt;
    const auto high = hex_value(token[i + 1]);
    const auto low = hex_value(token[i + 2]);
    if (!high || !low) return std::nullopt;
    const char decoded = static_cast<char>((*high << 4) | *low);
    // Only the escaped form of a byte is accepted, so every key has one reading.
    if (kept_in_key(decoded)) return std::nullopt;
    text.push_back(decoded);
    i += 2;
  }
  return text;
}

std::string member_key(std::string_view node_id) { return escape_key_token(node_id); }

std::string lease_key(std::string_view partition) {
  return std::string{kLeasePrefix} + escape_key_token(partition);
}

std::string ready_key(std::string_view partition) {
  return std::string{kReadyPrefix} + escape_key_token(partition);
}

std::optional<PartitionKeyKind> parse_partitions_key(std::string_view key) {
  for (const bool is_ready : {false, true}) {
    const std::string_view prefix = is_ready ? kReadyPrefix : kLeasePrefix;
    if (!key.starts_with(prefix)) continue;
    auto partition = unescape_key_token(key.substr(prefix.size()));
    if (!partition || partition->empty()) return std::nullopt;
    return PartitionKeyKind{std::move(*partition), is_ready};
  }
  return std::nullopt;
}

std::optional<std::string> parse_member_key(std::string_view key) {
  auto node_id = unescape_key_token(key);
  if (!node_id || node_id->empty()) return std::nullopt;
  return node_id;
}

}  // namespace kvr::cluster
