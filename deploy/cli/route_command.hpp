// `kvr route`: sends one RouteRequest to the router nodes over NATS and prints the decision.
#pragma once

#include <CLI/CLI.hpp>

namespace kvr::cli {

/// Adds the route subcommand to `app`; it runs when the subcommand is given.
void add_route_command(CLI::App& app, int& exit_code);

}  // namespace kvr::cli
