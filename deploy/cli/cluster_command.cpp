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
#include <nlohmann/json.hpp>

#include "deploy/cli/cli_options.hpp"
#include "messages/nats/nats_client.hpp"
#include "selection/cluster/cluster_status.hpp"

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

std::string as_text(const std::string& ns, const cluster::ClusterStatus& status) {
  const cluster::StatusSummary summary = cluster::summarise(status);
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
    const cluster::LeaseState state = cluster::state_of(status, partition);
    const bool leased = partition.lease && !partition.lease->owner_node_id.empty();
    std::string desired = partition.desired_owner.value_or("-");
    if (cluster::handover_pending(partition, state)) desired += " (handover pending)";
    partitions.push_back({partition.partition, std::string{cluster::as_str(state)},
                          leased ? partition.lease->owner_node_id : "-",
                          partition.lease ? fmt::format("{}", partition.epoch) : "-",
                          partition.lease && partition.lease->handed_over ? "yes" : "no",
                          partition.ready ? partition.ready->node_id : "-", desired});
  }
  out += table(partitions);
  return out;
}

nlohmann::json as_json(const std::string& ns, const cluster::ClusterStatus& status) {
  const cluster::StatusSummary summary = cluster::summarise(status);
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
    const cluster::LeaseState state = cluster::state_of(status, partition);
    nlohmann::json entry{{"partition", partition.partition},
                         {"state", cluster::as_str(state)},
                         {"owner", nullptr},
                         {"owner_incarnation", nullptr},
                         {"epoch", nullptr},
                         {"handed_over", partition.lease && partition.lease->handed_over},
                         {"ready", nullptr},
                         {"desired_owner", nullptr},
                         {"handover_pending", cluster::handover_pending(partition, state)}};
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
  auto client = nats::NatsClient::connect(options.nats);
  if (!client) {
    std::cerr << "kvr cluster status: " << client.error() << '\n';
    return kNoCluster;
  }
  std::vector<std::string> skipped;
  auto status =
      cluster::read_cluster_status((*client)->native_handle(), options.ns,
                                   std::chrono::milliseconds(options.timeout_ms), &skipped);
  for (const std::string& record : skipped) {
    std::cerr << "kvr cluster status: ignored " << record << '\n';
  }
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
