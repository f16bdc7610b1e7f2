#include "tests/testing/child_process.hpp"

#include <cstdlib>
#include <fstream>
#include <random>
#include <sstream>
#include <string_view>
#include <thread>
#include <utility>

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;

namespace kvr::testing {

namespace {

// The executable `name` names: itself when it contains a slash, else the first match on PATH.
std::optional<std::string> resolve_executable(const std::string& name) {
  if (name.find('/') != std::string::npos) return name;
  const char* path = std::getenv("PATH");
  std::string_view directories = path != nullptr ? path : "/usr/bin:/bin";
  while (!directories.empty()) {
    const std::size_t colon = directories.find(':');
    const std::string directory{directories.substr(0, colon)};
    const std::string candidate = (directory.empty() ? "." : directory) + "/" + name;
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
    if (colon == std::string_view::npos) break;
    directories.remove_prefix(colon + 1);
  }
  return std::nullopt;
}

}  // namespace

std::optional<ChildProcess> ChildProcess::start(const std::vector<std::string>& argv,
                                                const std::filesystem::path& log_file) {
  if (argv.empty()) return std::nullopt;
  const auto executable = resolve_executable(argv[0]);
  if (!executable) return std::nullopt;
  std::vector<char*> args;
  args.reserve(argv.size() + 1);
  for (const std::string& arg : argv) args.push_back(const_cast<char*>(arg.c_str()));
  args.push_back(nullptr);
  const std::string log_path = log_file.string();
  const pid_t parent = getpid();

  // fork + execve rather than posix_spawn, to set a parent-death signal: a test process that
  // crashes (an assertion, a sanitizer abort) must not leave servers running behind it. Between
  // fork and exec the child only makes async-signal-safe calls.
  const pid_t pid = fork();
  if (pid < 0) return std::nullopt;
  if (pid == 0) {
    setpgid(0, 0);  // own group: a test's cleanup can never signal the test runner itself
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);  // the parent died before the signal was armed
    const int input = open("/dev/null", O_RDONLY);
    const int output = open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (input < 0 || output < 0) _exit(127);
    dup2(input, STDIN_FILENO);
    dup2(output, STDOUT_FILENO);
    dup2(output, STDERR_FILENO);
    execve(executable->c_str(), args.data(), environ);
    _exit(127);
  }
  setpgid(pid, pid);  // also from the parent, so the group exists before start() returns
  return ChildProcess{pid, log_file};
}

ChildProcess::ChildProcess(ChildProcess&& other) noexcept
    : pid_(std::exchange(other.pid_, -1)),
      log_file_(std::move(other.log_file_)),
      exit_status_(other.exit_status_) {}

ChildProcess& ChildProcess::operator=(ChildProcess&& other) noexcept {
  if (this != &other) {
    if (pid_ > 0) stop();
    pid_ = std::exchange(other.pid_, -1);
    log_file_ = std::move(other.log_file_);
    exit_status_ = other.exit_status_;
  }
  return *this;
}

ChildProcess::~ChildProcess() {
  if (pid_ > 0) stop();
}

bool ChildProcess::running() {
  if (pid_ <= 0 || exit_status_) return false;
  int status = 0;
  const pid_t reaped = waitpid(pid_, &status, WNOHANG);
  if (reaped == pid_) {
    exit_status_ = WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
    return false;
  }
  return reaped == 0;
}

void ChildProcess::signal(int signal_number) const {
  if (pid_ > 0 && !exit_status_) kill(pid_, signal_number);
}

std::optional<int> ChildProcess::wait(std::chrono::milliseconds timeout) {
  wait_until([this] { return !running(); }, timeout);
  return exit_status_;
}

std::optional<int> ChildProcess::stop(std::chrono::milliseconds grace) {
  if (!running()) return exit_status_;
  kill(pid_, SIGCONT);  // a stopped child cannot handle SIGTERM
  kill(pid_, SIGTERM);
  if (wait(grace)) return exit_status_;
  kill(pid_, SIGKILL);
  return wait(std::chrono::milliseconds(5000));
}

std::string ChildProcess::log() const {
  std::ifstream input{log_file_};
  std::stringstream text;
  text << input.rdbuf();
  return text.str();
}

TemporaryDirectory::TemporaryDirectory() {
  std::string pattern = (std::filesystem::temp_directory_path() / "kvr-test-XXXXXX").string();
  if (mkdtemp(pattern.data()) == nullptr) std::abort();
  path_ = pattern;
}

TemporaryDirectory::~TemporaryDirectory() {
  std::error_code ignored;
  std::filesystem::remove_all(path_, ignored);
}

void use_small_asan_quarantine_in_children() {
  const char* asan = std::getenv("ASAN_OPTIONS");
  const std::string options = asan != nullptr && *asan != '\0' ? std::string{asan} + ":" : "";
  setenv("ASAN_OPTIONS", (options + "quarantine_size_mb=1").c_str(), 1);
}

std::uint64_t resident_kib(pid_t pid) {
  std::ifstream status{"/proc/" + std::to_string(pid) + "/status"};
  std::string line;
  while (std::getline(status, line)) {
    if (line.starts_with("VmRSS:")) return std::stoull(line.substr(6));
  }
  return 0;
}

}  // namespace kvr::testing
