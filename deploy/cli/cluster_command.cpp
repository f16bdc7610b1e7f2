#include "deploy/cli/cluster_command.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <ctime>
#include <expected>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nats/nats.h>
#include <nlohmann/json.hpp>

#include "deploy/cli/cli_options.hpp"
#include "messages/nats/nats_client.hpp"
#include "selection/cluster/cluster_values.hpp"
#include "selection/cluster/jetstream_kv.hpp"
#include "selection/cluster/placement.hpp"

namespace kvr::cli {
namespace {

// The exit codes of `kvr cluster status` (also in its --help).
constexpr int kStatusShown = 0;
constexpr int kNoCluster = 1;

struct ClusterStatusOptions {
  nats::NatsOptions nats;
  std::string ns = "default";
  bool json = false;
  int timeout_ms = 2000;
};

/// What the partitions bucket holds for one partition, and where placement wants it.
struct PartitionStatus {
  std::string partition;
  std::optional<cluster::LeaseValue> lease;
  std::uint64_t epoch = 0;  ///< the lease key's revision; 0 without a lease key
  std::optional<cluster::ReadyValue> ready;
  std::optional<std::string> desired_owner;
};

struct ClusterStatus {
  std::vector<cluster::MemberRecord> members;  ///< by node id
  std::vector<PartitionStatus> partitions;     ///< by partition key
};

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

std::expected<std::unique_ptr<cluster::JetStreamKv>, std::string> open_existing(
    natsConnection* connection, const std::string& bucket, const ClusterStatusOptions& options) {
  const auto timeout = std::chrono::milliseconds(options.timeout_ms);
  auto exists = bucket_exists(connection, bucket, timeout);
  if (!exists) return std::unexpected(exists.error());
  if (!*exists) {
    return std::unexpected(fmt::format(
        "no router cluster in namespace '{}': the bucket '{}' does not exist (a node started "
        "with `kvr node --cluster --namespace {}` creates it)",
        options.ns, bucket, options.ns));
  }
  auto opened = cluster::JetStreamKv::open_or_create(
      connection, cluster::KvBucketOptions{.bucket = bucket, .timeout = timeout});
  if (!opened) return std::unexpected(opened.error().message);
  return std::move(*opened);
}

std::expected<std::vector<cluster::MemberRecord>, std::string> read_members(
    cluster::JetStreamKv& bucket) {
  auto keys = bucket.keys();
  if (!keys) return std::unexpected(keys.error().message);
  std::vector<cluster::MemberRecord> members;
  for (const std::string& key : *keys) {
    if (!cluster::parse_member_key(key)) continue;
    auto entry = bucket.get(key);
    if (!entry) {
      if (entry.error().code == cluster::KvErrorCode::not_found) continue;  // aged out since
      return std::unexpected(entry.error().message);
    }
    auto member = cluster::decode_member(entry->value);
    if (!member) {
      std::cerr << fmt::format("kvr cluster status: member key '{}' ignored: {}\n", key,
                               member.error());
      continue;
    }
    members.push_back(std::move(*member));
  }
  std::ranges::sort(members, {}, &cluster::MemberRecord::node_id);
  return members;
}

std::expected<std::map<std::string, PartitionStatus>, std::string> read_partitions(
    cluster::JetStreamKv& bucket) {
  auto keys = bucket.keys();
  if (!keys) return std::unexpected(keys.error().message);
  std::map<std::string, PartitionStatus> partitions;
  for (const std::string& key : *keys) {
    const auto kind = cluster::parse_partitions_key(key);
    if (!kind) continue;
    auto entry = bucket.get(key);
    if (!entry) {
      if (entry.error().code == cluster::KvErrorCode::not_found) continue;
      return std::unexpected(entry.error().message);
    }
    PartitionStatus& status = partitions[kind->partition];
    status.partition = kind->partition;
    if (kind->is_ready) {
      auto ready = cluster::decode_ready(entry->value);
      if (ready) status.ready = std::move(*ready);
      continue;
    }
    auto lease = cluster::decode_lease(entry->value);
    if (!lease) {
      std::cerr << fmt::format("kvr cluster status: lease key '{}' ignored: {}\n", key,
                               lease.error());
      continue;
    }
    status.lease = std::move(*lease);
    status.epoch = entry->revision;
  }
  return partitions;
}

std::expected<ClusterStatus, std::string> read_status(const ClusterStatusOptions& options) {
  auto client = nats::NatsClient::connect(options.nats);
  if (!client) return std::unexpected(client.error());
  natsConnection* connection = (*client)->native_handle();
  auto members_bucket = open_existing(connection, cluster::members_bucket(options.ns), options);
  if (!members_bucket) return std::unexpected(members_bucket.error());
  auto partitions_bucket =
      open_existing(connection, cluster::partitions_bucket(options.ns), options);
  if (!partitions_bucket) return std::unexpected(partitions_bucket.error());

  ClusterStatus status;
  auto members = read_members(**members_bucket);
  if (!members) return std::unexpected(members.error());
  status.members = std::move(*members);
  auto partitions = read_partitions(**partitions_bucket);
  if (!partitions) return std::unexpected(partitions.error());

  // The placement every node computes, over the partitions the bucket names: a partition whose
  // desired owner is not its owner is waiting for a handover.
  std::vector<cluster::PlacementMember> placement_members;
  for (const auto& member : status.members) {
    placement_members.push_back({member.node_id, member.capacity});
  }
  std::vector<std::string> names;
  for (const auto& [name, partition] : *partitions) names.push_back(name);
  const auto desired = cluster::assign(names, placement_members);
  for (auto& [name, partition] : *partitions) {
    if (const auto it = desired.find(name); it != desired.end()) {
      partition.desired_owner = it->second;
    }
    status.partitions.push_back(std::move(partition));
  }
  return status;
}

// How a partition's lease stands, as one word for the table and the JSON.
enum class LeaseState : std::uint8_t {
  owned,         ///< a live member holds it
  handing_over,  ///< its last owner stopped serving and named a successor (the lease's owner)
  expiring,      ///< its owner (or that incarnation) is no longer a member: it is ageing out
  released,      ///< released with no successor: anyone may take it
  unleased,      ///< no lease key (only a readiness key)
};

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

bool is_member(const ClusterStatus& status, const std::string& node_id, std::uint64_t incarnation) {
  return std::ranges::any_of(status.members, [&](const cluster::MemberRecord& member) {
    return member.node_id == node_id && member.incarnation == incarnation;
  });
}

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

struct Summary {
  std::size_t owned = 0;
  std::size_t handovers_pending = 0;
};

Summary summarise(const ClusterStatus& status) {
  Summary summary;
  for (const auto& partition : status.partitions) {
    const LeaseState state = state_of(status, partition);
    if (state == LeaseState::owned) ++summary.owned;
    if (handover_pending(partition, state)) ++summary.handovers_pending;
  }
  return summary;
}

std::string utc_time(std::int64_t unix_ms) {
  const std::time_t seconds = static_cast<std::time_t>(unix_ms / 1000);
  std::tm parts{};
  if (gmtime_r(&seconds, &parts) == nullptr) return "-";
  char text[32] = {};
  if (std::strftime(text, sizeof(text), "%Y-%m-%dT%H:%M:%SZ", &parts) == 0) return "-";
  return text;
}

// Left-aligned columns, two spaces apart, each as wide as its widest cell.
std::string table(const std::vector<std::vector<std::string>>& rows) {
  std::vector<std::size_t> widths;
  for (const auto& row : rows) {
    widths.resize(std::max(widths.size(), row.size()));
    for (std::size_t c = 0; c < row.size(); ++c) widths[c] = std::max(widths[c], row[c].size());
  }
  std::string out;
  for (const auto& row : rows) {
    std::string line = " ";
    for (std::size_t c = 0; c < row.size(); ++c) {
      line += " ";
      line += c + 1 == row.size() ? row[c] : fmt::format("{:<{}}", row[c], widths[c] + 1);
    }
    out += line + "\n";
  }
  return out;
}

std::string as_text(const std::string& ns, const ClusterStatus& status) {
  const Summary summary = summarise(status);
  std::string out = fmt::format(
      "cluster '{}': {} members; {} partitions: {} owned, {} handovers pending\n", ns,
      status.members.size(), status.partitions.size(), summary.owned, summary.handovers_pending);
  out += "members:\n";
  std::vector<std::vector<std::string>> members{
      {"NODE ID", "ADDRESS", "CAPACITY", "STARTED AT", "INCARNATION"}};
  for (const auto& member : status.members) {
    members.push_back({member.node_id, member.address.empty() ? "-" : member.address,
                       fmt::format("{:g}", member.capacity), utc_time(member.started_at_unix_ms),
                       fmt::format("{}", member.incarnation)});
  }
  out += table(members);
  out += "partitions:\n";
  std::vector<std::vector<std::string>> partitions{
      {"PARTITION", "STATE", "OWNER", "EPOCH", "HANDED OVER", "READY", "DESIRED OWNER"}};
  for (const auto& partition : status.partitions) {
    const LeaseState state = state_of(status, partition);
    const bool leased = partition.lease && !partition.lease->owner_node_id.empty();
    std::string desired = partition.desired_owner.value_or("-");
    if (handover_pending(partition, state)) desired += " (handover pending)";
    partitions.push_back({partition.partition, std::string{as_str(state)},
                          leased ? partition.lease->owner_node_id : "-",
                          partition.lease ? fmt::format("{}", partition.epoch) : "-",
                          partition.lease && partition.lease->handed_over ? "yes" : "no",
                          partition.ready ? partition.ready->node_id : "-", desired});
  }
  out += table(partitions);
  return out;
}

nlohmann::json as_json(const std::string& ns, const ClusterStatus& status) {
  const Summary summary = summarise(status);
  nlohmann::json members = nlohmann::json::array();
  for (const auto& member : status.members) {
    members.push_back({{"node_id", member.node_id},
                       {"address", member.address},
                       {"capacity", member.capacity},
                       {"started_at_unix_ms", member.started_at_unix_ms},
                       {"incarnation", member.incarnation}});
  }
  nlohmann::json partitions = nlohmann::json::array();
  for (const auto& partition : status.partitions) {
    const LeaseState state = state_of(status, partition);
    nlohmann::json entry{{"partition", partition.partition},
                         {"state", as_str(state)},
                         {"owner", nullptr},
                         {"owner_incarnation", nullptr},
                         {"epoch", nullptr},
                         {"handed_over", partition.lease && partition.lease->handed_over},
                         {"ready", nullptr},
                         {"desired_owner", nullptr},
                         {"handover_pending", handover_pending(partition, state)}};
    if (partition.lease) {
      entry["epoch"] = partition.epoch;
      if (!partition.lease->owner_node_id.empty()) {
        entry["owner"] = partition.lease->owner_node_id;
        entry["owner_incarnation"] = partition.lease->owner_incarnation;
      }
    }
    if (partition.ready) {
      entry["ready"] = {{"node_id", partition.ready->node_id},
                        {"incarnation", partition.ready->incarnation}};
    }
    if (partition.desired_owner) entry["desired_owner"] = *partition.desired_owner;
    partitions.push_back(std::move(entry));
  }
  return {{"namespace", ns},
          {"members", std::move(members)},
          {"partitions", std::move(partitions)},
          {"summary",
           {{"members", status.members.size()},
            {"partitions", status.partitions.size()},
            {"owned", summary.owned},
            {"handovers_pending", summary.handovers_pending}}}};
}

int run_status(const ClusterStatusOptions& options) {
  auto status = read_status(options);
  if (!status) {
    std::cerr << "kvr cluster status: " << status.error() << '\n';
    return kNoCluster;
  }
  if (options.json) {
    std::cout << as_json(options.ns, *status).dump(2) << '\n';
  } else {
    std::cout << as_text(options.ns, *status);
  }
  return kStatusShown;
}

}  // namespace

void add_cluster_command(CLI::App& app, int& exit_code) {
  auto* command = app.add_subcommand(
      "cluster", "inspect the router cluster of a namespace (nodes started with --cluster)");
  command->require_subcommand(1);
  auto* status = command->add_subcommand(
      "status",
      "print the cluster's members, each partition's lease (owner, epoch, handover, readiness) "
      "and its desired owner");
  status->footer(
      "Reads the JetStream key-value buckets kvr_<namespace>_members and "
      "kvr_<namespace>_partitions (never writes them). A partition's epoch is its lease key's "
      "revision; its state is owned (a live member holds it), handing-over (its last owner "
      "stopped serving and named a successor, shown as the owner, that has yet to take it), "
      "expiring (its owner is no longer a member; the "
      "lease ages out within the lease TTL), released or unleased. The desired owner is the "
      "placement every node computes (bounded-load rendezvous hashing over the live members, "
      "weighted by capacity) over the partitions the bucket names; one other than the owner is "
      "a handover that is pending.\n"
      "Exit codes: 0 printed; 1 no connection, no JetStream on the server, or no cluster in the "
      "namespace (the buckets do not exist); 2 usage error.");
  auto options = std::make_shared<ClusterStatusOptions>();
  add_nats_options(*status, options->nats);
  options->nats.name = "kvr-cluster-status";
  // A one-shot reader: fail rather than wait for a server that is down.
  options->nats.max_reconnects = 0;
  add_namespace_option(*status, options->ns);
  status->add_flag("--json", options->json, "print JSON instead of tables");
  status
      ->add_option("--timeout-ms", options->timeout_ms,
                   "how long each read of the buckets may wait for the server")
      ->capture_default_str()
      ->check(CLI::Range(1, 600'000));
  status->callback([options, &exit_code] { exit_code = run_status(*options); });
}

}  // namespace kvr::cli
