// `kvr replay-live`: replays a Mooncake trace against a running cluster (router nodes and workers
// on NATS) in real time and reports what a client measured, in the report format of `kvr replay`.
#pragma once

#include <CLI/CLI.hpp>

namespace kvr::cli {

/// Adds the replay-live subcommand to `app`; it runs when the subcommand is given.
void add_replay_live_command(CLI::App& app, int& exit_code);

}  // namespace kvr::cli
