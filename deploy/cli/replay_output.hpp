// The report side shared by `kvr replay` and `kvr replay-live`: the trace and output options, the
// progress bar, and writing a report's failures, its JSON form and its PNG plot.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <CLI/CLI.hpp>

#include "deploy/simulation/mooncake_trace.hpp"
#include "deploy/simulation/replay_report.hpp"

namespace kvr::cli {

/// What to replay and where the report goes.
struct ReplayOutputOptions {
  std::string trace = KVR_DEFAULT_TRACE;
  /// Replay only the first `limit` requests (0: all).
  std::size_t limit = 0;
  /// Divides the trace's inter-arrival times.
  double speedup = 1.0;
  std::string json_path;
  std::string plot_path;
  /// Where each routed request's worker is written (one line per completed request); empty: not.
  std::string decisions_path;
  /// No progress bar and no timing lines on stderr.
  bool quiet = false;
};

/// Adds --trace, --limit, --speedup, --json, --plot, --decisions and --quiet.
void add_replay_output_options(CLI::App& app, ReplayOutputOptions& options);

/// Loads the trace; on failure prints "<command>: <reason>" and returns nullopt.
std::optional<std::vector<simulation::TraceRequest>> load_trace(std::string_view command,
                                                                const ReplayOutputOptions& options);

/// The trace's file name, as reports name it.
std::string trace_name(const ReplayOutputOptions& options);

/// Redraws one progress line on stderr: every percent on a terminal, every quarter in a log.
class ProgressBar {
 public:
  ProgressBar(std::vector<std::string> labels, std::size_t total, bool enabled);

  /// `done` of the total requests of the `policy`-th label have ended.
  void update(std::size_t policy, std::size_t done);

 private:
  std::vector<std::string> labels_;
  std::size_t total_;
  bool enabled_;
  bool terminal_;
  std::size_t last_policy_ = SIZE_MAX;
  std::size_t last_percent_ = SIZE_MAX;
};

/// Prints each policy's failures ("<policy>: N requests <failure_verb>: <reason>"), writes `json`
/// to --json and draws --plot from it; the command's exit code (1 when a file cannot be written
/// or the plot fails, else 0). Error lines start with `command`.
int write_report(std::string_view command, const ReplayOutputOptions& options,
                 const simulation::ReplayReport& report, const std::string& json,
                 std::string_view failure_verb);

/// One policy's completed requests, for --decisions: "<label>\t<trace index>\t<worker>\t<rank>"
/// per line, in trace order. Comparing two runs' files shows where their routing differs.
struct PolicyDecisions {
  std::string label;
  std::vector<simulation::ReplayRequestOutcome> outcomes;
};

/// Writes --decisions (nothing when it is not given); false, after an error line starting with
/// `command`, when the file cannot be written.
bool write_decisions(std::string_view command, const ReplayOutputOptions& options,
                     const std::vector<PolicyDecisions>& decisions);

}  // namespace kvr::cli
