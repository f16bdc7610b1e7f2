// `kvr tokenize`: prompts and chats to token ids with kvr's native tokenizer and chat templates,
// and, with --check-engine, the same inputs compared with an engine's own rendering.
#pragma once

#include <CLI/CLI.hpp>

namespace kvr::cli {

/// Adds the tokenize subcommand to `app`; it runs when the subcommand is given.
void add_tokenize_command(CLI::App& app, int& exit_code);

}  // namespace kvr::cli
