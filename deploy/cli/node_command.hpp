// `kvr node`: runs a router node in route mode (the decision service) until SIGINT/SIGTERM.
#pragma once

#include <CLI/CLI.hpp>

namespace kvr::cli {

/// Adds the node subcommand to `app`; it runs when the subcommand is given.
void add_node_command(CLI::App& app, int& exit_code);

}  // namespace kvr::cli
