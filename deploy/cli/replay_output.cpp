#include "deploy/cli/replay_output.hpp"

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>

#include <fcntl.h>
#include <fmt/format.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include "deploy/cli/cli_options.hpp"

extern char** environ;

namespace kvr::cli {
extern const char kPlotReplayScript[];

namespace {

bool write_file(const std::string& path, const std::string& contents) {
  std::ofstream output{path, std::ios::binary};
  output << contents;
  return static_cast<bool>(output);
}

// Runs the embedded plot script with Debian's python3-matplotlib.
bool draw_plot(const std::string& json_path, const std::string& plot_path) {
  char script_path[] = "/tmp/kvr-plot-XXXXXX.py";
  const int fd = mkstemps(script_path, 3);
  if (fd < 0) return false;
  const std::string_view script{kPlotReplayScript};
  const bool written =
      write(fd, script.data(), script.size()) == static_cast<ssize_t>(script.size());
  close(fd);
  // Debian's interpreter is the one python3-matplotlib installs into; a python3 earlier on PATH
  // (a virtualenv, pyenv) may lack it. KVR_PYTHON overrides both.
  std::string python = "python3";
  if (const char* chosen = std::getenv("KVR_PYTHON"); chosen != nullptr && *chosen != '\0') {
    python = chosen;
  } else if (access("/usr/bin/python3", X_OK) == 0) {
    python = "/usr/bin/python3";
  }
  bool drawn = false;
  if (written) {
    std::vector<std::string> argv{python, script_path, json_path, plot_path};
    std::vector<char*> args;
    for (auto& arg : argv) args.push_back(arg.data());
    args.push_back(nullptr);
    pid_t pid = -1;
    if (posix_spawnp(&pid, python.c_str(), nullptr, nullptr, args.data(), environ) == 0) {
      int status = 0;
      waitpid(pid, &status, 0);
      drawn = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    }
  }
  unlink(script_path);
  return drawn;
}

}  // namespace

void add_replay_output_options(CLI::App& app, ReplayOutputOptions& options) {
  app.add_option("--trace", options.trace, "Mooncake JSONL trace")
      ->capture_default_str()
      ->check(CLI::ExistingFile);
  app.add_option("--limit", options.limit, "replay only the first N requests (0: all)")
      ->capture_default_str();
  app.add_option("--speedup", options.speedup, "divides inter-arrival times")
      ->capture_default_str()
      ->check(finite_range(1e-6, 1e6));
  app.add_option("--json", options.json_path, "write the report as JSON")->check(non_empty());
  app.add_option("--plot", options.plot_path, "write a PNG plot (python3-matplotlib)")
      ->check(non_empty());
  app.add_option("--decisions", options.decisions_path,
                 "write each completed request's worker: policy, trace index, worker, rank "
                 "(tab-separated, one request a line)")
      ->check(non_empty());
  app.add_flag("--quiet", options.quiet, "no progress bar");
}

std::optional<std::vector<simulation::TraceRequest>> load_trace(
    std::string_view command, const ReplayOutputOptions& options) {
  auto trace = simulation::load_mooncake_trace(options.trace, options.limit);
  if (!trace) {
    std::cerr << command << ": " << trace.error() << '\n';
    return std::nullopt;
  }
  return std::move(*trace);
}

std::string trace_name(const ReplayOutputOptions& options) {
  return std::filesystem::path{options.trace}.filename().string();
}

ProgressBar::ProgressBar(std::vector<std::string> labels, std::size_t total, bool enabled)
    : labels_(std::move(labels)), total_(total), enabled_(enabled), terminal_(isatty(2) == 1) {}

void ProgressBar::update(std::size_t policy, std::size_t done) {
  if (!enabled_ || total_ == 0) return;
  const std::size_t step = terminal_ ? 1 : 25;
  const std::size_t percent = done * 100 / total_ / step * step;
  if (policy == last_policy_ && percent == last_percent_ && done != total_) return;
  last_policy_ = policy;
  last_percent_ = percent;
  constexpr std::size_t kWidth = 30;
  const std::size_t filled = percent * kWidth / 100;
  std::cerr << fmt::format("{}  {:<26} [{}{}] {:>3}% {}/{}", terminal_ ? "\r" : "", labels_[policy],
                           std::string(filled, '#'), std::string(kWidth - filled, '.'), percent,
                           done, total_);
  if (done == total_ || !terminal_) std::cerr << '\n';
  std::cerr.flush();
}

int write_report(std::string_view command, const ReplayOutputOptions& options,
                 const simulation::ReplayReport& report, const std::string& json,
                 std::string_view failure_verb) {
  for (const auto& policy : report.policies) {
    for (const auto& [message, count] : policy.failures) {
      std::cout << fmt::format("  {}: {} requests {}: {}\n", policy.policy, count, failure_verb,
                               message);
    }
  }
  std::string json_path = options.json_path;
  if (!json_path.empty() && !write_file(json_path, json)) {
    std::cerr << command << ": cannot write " << json_path << '\n';
    return 1;
  }
  if (!options.plot_path.empty()) {
    std::string temporary_json;
    if (json_path.empty()) {
      temporary_json = options.plot_path + ".json.tmp";
      if (!write_file(temporary_json, json)) return 1;
      json_path = temporary_json;
    }
    const bool drawn = draw_plot(json_path, options.plot_path);
    if (!temporary_json.empty()) std::filesystem::remove(temporary_json);
    if (!drawn) {
      std::cerr << command << ": plotting failed (is python3-matplotlib installed?)\n";
      return 1;
    }
    std::cout << "plot written to " << options.plot_path << '\n';
  }
  return 0;
}

bool write_decisions(std::string_view command, const ReplayOutputOptions& options,
                     const std::vector<PolicyDecisions>& decisions) {
  if (options.decisions_path.empty()) return true;
  std::ofstream out{options.decisions_path};
  for (const PolicyDecisions& policy : decisions) {
    for (const simulation::ReplayRequestOutcome& outcome : policy.outcomes) {
      out << policy.label << '\t' << outcome.trace_index << '\t' << outcome.worker.worker_id << '\t'
          << outcome.worker.dp_rank << '\n';
    }
  }
  out.flush();
  if (!out) {
    std::cerr << command << ": cannot write --decisions " << options.decisions_path << '\n';
    return false;
  }
  return true;
}

}  // namespace kvr::cli
