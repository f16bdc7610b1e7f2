#include "tests/testing/kvr_processes.hpp"

#include <algorithm>
#include <fstream>
#include <iterator>
#include <numeric>
#include <type_traits>
#include <utility>

#include "tests/testing/loopback_http.hpp"

namespace kvr::testing {

namespace {

// Appends `--flag value` when the option is set.
template <class T>
void add(std::vector<std::string>& arguments, const char* flag, const std::optional<T>& value) {
  if (!value) return;
  arguments.emplace_back(flag);
  if constexpr (std::is_same_v<T, std::string>) {
    arguments.push_back(*value);
  } else {
    arguments.push_back(std::to_string(*value));
  }
}

}  // namespace

KvrProcesses::KvrProcesses(std::string binary, std::string nats_url, std::string ns,
                           std::filesystem::path log_dir, std::vector<std::string> nats_flags)
    : binary_(std::move(binary)),
      nats_url_(std::move(nats_url)),
      namespace_(std::move(ns)),
      log_dir_(std::move(log_dir)),
      nats_flags_(std::move(nats_flags)) {}

std::optional<ChildProcess> KvrProcesses::start(const std::vector<std::string>& command,
                                                const std::vector<std::string>& arguments,
                                                const std::string& log_name) const {
  std::vector<std::string> argv{binary_};
  argv.insert(argv.end(), command.begin(), command.end());
  argv.insert(argv.end(), {"--nats", nats_url_, "--namespace", namespace_});
  argv.insert(argv.end(), nats_flags_.begin(), nats_flags_.end());
  argv.insert(argv.end(), arguments.begin(), arguments.end());
  return ChildProcess::start(argv, log_path(log_name));
}

std::optional<ChildProcess> KvrProcesses::start_mocker(const MockerOptions& options,
                                                       const std::string& log_name) const {
  std::vector<std::string> arguments{"--workers", std::to_string(options.workers)};
  add(arguments, "--worker-id-base", options.worker_id_base);
  add(arguments, "--block-size", options.block_size);
  add(arguments, "--num-gpu-blocks", options.num_gpu_blocks);
  add(arguments, "--time-scale", options.time_scale);
  add(arguments, "--liveness-ttl-ms", options.liveness_ttl_ms);
  add(arguments, "--load-interval-ms", options.load_interval_ms);
  add(arguments, "--nats-reconnect-wait-ms", options.nats_reconnect_wait_ms);
  arguments.insert(arguments.end(), options.extra.begin(), options.extra.end());
  return start({"mocker"}, arguments, log_name);
}

std::optional<ChildProcess> KvrProcesses::start_node(const NodeOptions& options,
                                                     const std::string& log_name) const {
  std::vector<std::string> arguments;
  add(arguments, "--block-size", options.block_size);
  add(arguments, "--router-booking-ttl-secs", options.booking_ttl_secs);
  add(arguments, "--metrics-port", options.metrics_port);
  add(arguments, "--actor-port", options.actor_port);
  add(arguments, "--nats-reconnect-wait-ms", options.nats_reconnect_wait_ms);
  const auto given = [&](std::string_view flag) {
    return std::ranges::find(options.extra, flag) != options.extra.end();
  };
  if ((options.actor_port || given("--cluster")) && !given("--peer-tls-cert")) {
    arguments.emplace_back("--plaintext-peers");
  }
  arguments.insert(arguments.end(), options.extra.begin(), options.extra.end());
  if (!options.descriptor_limit) return start({"node"}, arguments, log_name);
  std::vector<std::string> argv{
      "bash", "-c", "ulimit -n " + std::to_string(*options.descriptor_limit) + " && exec \"$@\"",
      "kvr", binary_, "node", "--nats", nats_url_, "--namespace", namespace_};
  argv.insert(argv.end(), nats_flags_.begin(), nats_flags_.end());
  argv.insert(argv.end(), arguments.begin(), arguments.end());
  return ChildProcess::start(argv, log_path(log_name));
}

bool wait_until_healthy(std::uint16_t metrics_port, std::chrono::milliseconds timeout) {
  return wait_until(
      [&] { return http_get(metrics_port, "/healthz").find("200") != std::string::npos; }, timeout);
}

std::vector<std::uint32_t> prompt(std::size_t tokens, std::uint32_t first) {
  std::vector<std::uint32_t> ids(tokens);
  std::iota(ids.begin(), ids.end(), first);
  return ids;
}

std::string read_file(const std::filesystem::path& path) {
  std::ifstream input{path, std::ios::binary};
  return {std::istreambuf_iterator<char>{input}, std::istreambuf_iterator<char>{}};
}

}  // namespace kvr::testing
