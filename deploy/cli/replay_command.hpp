// `kvr replay`: replays a Mooncake trace through the real selection pipeline and simulated
// workers, comparing policies side by side (table on stdout, optional JSON and PNG plot).
#pragma once

#include <CLI/CLI.hpp>

namespace kvr::cli {

/// Adds the replay subcommand to `app`; it runs when the subcommand is given.
void add_replay_command(CLI::App& app, int& exit_code);

}  // namespace kvr::cli
