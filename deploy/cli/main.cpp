// The kvr command: one executable, one subcommand per job (bridge, cluster, mocker, node, replay,
// replay-live, route, tokenize).
#include <iostream>
#include <string>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <google/protobuf/stubs/logging.h>
#include <spdlog/spdlog.h>

#include "deploy/cli/bridge_command.hpp"
#include "deploy/cli/cli_options.hpp"
#include "deploy/cli/cluster_command.hpp"
#include "deploy/cli/mocker_command.hpp"
#include "deploy/cli/node_command.hpp"
#include "deploy/cli/replay_command.hpp"
#include "deploy/cli/replay_live_command.hpp"
#include "deploy/cli/route_command.hpp"
#include "deploy/cli/tokenize_command.hpp"
#include "kvr/version.hpp"
#include "messages/metrics/rate_limited_log.hpp"

namespace {

// libprotobuf writes an ERROR line to stderr for each string field with invalid UTF-8 that it
// parses, outside the node's rate-limited logging: a flood of such messages from the network
// would become a flood of log lines. Its lines go through the same rate limit instead.
void log_protobuf(google::protobuf::LogLevel level, const char* /*file*/, int /*line*/,
                  const std::string& message) {
  static kvr::metrics::RateLimitedLog limiter;
  if (level >= google::protobuf::LOGLEVEL_FATAL) {
    spdlog::critical("protobuf: {}", message);
    return;
  }
  limiter.warn("protobuf", "protobuf: " + message);
}

}  // namespace

int main(int argc, char** argv) {
  google::protobuf::SetLogHandler(&log_protobuf);
  CLI::App app{"kvr: a KV-cache-aware request router for LLM inference fleets"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "kvr " KVR_VERSION_STRING);
  int exit_code = 0;
  kvr::cli::add_bridge_command(app, exit_code);
  kvr::cli::add_cluster_command(app, exit_code);
  kvr::cli::add_mocker_command(app, exit_code);
  kvr::cli::add_node_command(app, exit_code);
  kvr::cli::add_replay_command(app, exit_code);
  kvr::cli::add_replay_live_command(app, exit_code);
  kvr::cli::add_route_command(app, exit_code);
  kvr::cli::add_tokenize_command(app, exit_code);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    // --help and --version are "errors" with exit code 0: CLI11 prints them.
    if (error.get_exit_code() == 0) return app.exit(error);
    // Every other parse or validation error is a usage error: one line that names the option
    // (CLI11's message does), and exit code 2 rather than CLI11's own codes.
    std::string command = "kvr";
    // The whole chain of subcommands given ("kvr cluster status").
    for (const CLI::App* level = &app; !level->get_subcommands().empty();) {
      level = level->get_subcommands().front();
      command += " " + level->get_name();
    }
    std::string message = error.what();
    // CLI11 says only that a subcommand is required when the first word is none of them.
    if (app.get_subcommands().empty() && argc > 1 && argv[1][0] != '-') {
      message = fmt::format("'{}' is not a subcommand", argv[1]);
    }
    std::cerr << command << ": " << message << " (see " << command << " --help)\n";
    return kvr::cli::kUsageError;
  }
  return exit_code;
}
