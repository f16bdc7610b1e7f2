// `kvr mocker`, `kvr node` and the other kvr commands as child processes of integration tests,
// all pointed at one nats-server and namespace, with their logs in one directory; and the small
// helpers the tests around them share (prompts, reading a report, waiting for /healthz).
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "messages/ids.hpp"
#include "tests/testing/child_process.hpp"

namespace kvr::testing {

/// The options of one `kvr mocker`; an unset one keeps the mocker's default.
struct MockerOptions {
  int workers = 1;
  std::optional<WorkerId> worker_id_base;
  std::optional<std::uint32_t> block_size;
  std::optional<std::uint64_t> num_gpu_blocks;
  /// Below 1 slows the simulated engine down, above 1 speeds it up.
  std::optional<std::string> time_scale;
  std::optional<int> liveness_ttl_ms;
  std::optional<int> load_interval_ms;
  std::optional<int> nats_reconnect_wait_ms;
  std::vector<std::string> extra;  ///< appended as given
};

/// The options of one `kvr node`; an unset one keeps the node's default. Its peer ports (the
/// actor port, --cluster) serve plaintext on loopback unless `extra` gives --peer-tls-cert.
struct NodeOptions {
  std::optional<std::uint32_t> block_size;
  std::optional<std::uint16_t> metrics_port;
  std::optional<std::uint16_t> actor_port;
  std::optional<std::string> booking_ttl_secs;
  std::optional<int> nats_reconnect_wait_ms;
  /// Runs the node under this RLIMIT_NOFILE, soft and hard (`ulimit -n`).
  std::optional<std::uint64_t> descriptor_limit;
  std::vector<std::string> extra;  ///< appended as given
};

/// Starts kvr commands against one NATS server and namespace; each logs to a file of its own in
/// `log_dir`. The processes end with their handles (ChildProcess).
class KvrProcesses {
 public:
  /// `binary` is the kvr executable; `nats_flags` go to every process after the URL and the
  /// namespace (e.g. --nats-tls-ca).
  KvrProcesses(std::string binary, std::string nats_url, std::string ns,
               std::filesystem::path log_dir, std::vector<std::string> nats_flags = {});

  /// `kvr <command...> --nats URL --namespace NS <nats flags> <arguments...>`; nullopt when it
  /// cannot be started.
  std::optional<ChildProcess> start(const std::vector<std::string>& command,
                                    const std::vector<std::string>& arguments,
                                    const std::string& log_name) const;
  std::optional<ChildProcess> start_mocker(const MockerOptions& options,
                                           const std::string& log_name = "mocker.log") const;
  std::optional<ChildProcess> start_node(const NodeOptions& options,
                                         const std::string& log_name = "node.log") const;

  /// Where the process started with `log_name` writes its output.
  std::filesystem::path log_path(const std::string& log_name) const { return log_dir_ / log_name; }

 private:
  std::string binary_;
  std::string nats_url_;
  std::string namespace_;
  std::filesystem::path log_dir_;
  std::vector<std::string> nats_flags_;
};

/// Polls a node's /healthz on `metrics_port` until it answers 200 or `timeout` passes.
bool wait_until_healthy(std::uint16_t metrics_port, std::chrono::milliseconds timeout);

/// `tokens` consecutive token ids from `first`: prompts over disjoint ranges share no block.
std::vector<std::uint32_t> prompt(std::size_t tokens, std::uint32_t first);

/// The bytes of the file at `path` (empty when it cannot be read).
std::string read_file(const std::filesystem::path& path);

}  // namespace kvr::testing
