// The kvr command: one executable, one subcommand per job (mocker, node, replay, route, ...).
#include <CLI/CLI.hpp>

#include "deploy/cli/mocker_command.hpp"
#include "deploy/cli/node_command.hpp"
#include "deploy/cli/replay_command.hpp"
#include "deploy/cli/route_command.hpp"

int main(int argc, char** argv) {
  CLI::App app{"kvr: a KV-cache-aware request router for LLM inference fleets"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "kvr 0.1.0");
  int exit_code = 0;
  kvr::cli::add_mocker_command(app, exit_code);
  kvr::cli::add_node_command(app, exit_code);
  kvr::cli::add_replay_command(app, exit_code);
  kvr::cli::add_route_command(app, exit_code);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    return app.exit(error);
  }
  return exit_code;
}
