// `kvr cluster status`: reads a namespace's router cluster from its two NATS JetStream key-value
// buckets and prints its members, each partition's lease (owner, epoch, handover, readiness) and
// the owner placement wants for it, as a table or JSON.
#pragma once

#include <CLI/CLI.hpp>

namespace kvr::cli {

/// Adds the cluster subcommand (with its status subcommand) to `app`; it runs when given.
void add_cluster_command(CLI::App& app, int& exit_code);

}  // namespace kvr::cli
