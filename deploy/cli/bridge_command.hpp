// `kvr bridge`: runs a sidecar that makes one vLLM or SGLang engine a kvr worker, until
// SIGINT/SIGTERM.
#pragma once

#include <CLI/CLI.hpp>

namespace kvr::cli {

/// Adds the bridge subcommand to `app`; it runs when the subcommand is given.
void add_bridge_command(CLI::App& app, int& exit_code);

}  // namespace kvr::cli
