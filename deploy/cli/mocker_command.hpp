// `kvr mocker`: runs a fleet of simulated workers against a NATS server until SIGINT/SIGTERM.
#pragma once

#include <CLI/CLI.hpp>

namespace kvr::cli {

/// Adds the mocker subcommand to `app`; it runs when the subcommand is given.
void add_mocker_command(CLI::App& app, int& exit_code);

}  // namespace kvr::cli
