#include "tests/testing/child_process.hpp"

#include <cstdlib>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>
#include <utility>

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;

namespace kvr::testing {

std::optional<ChildProcess> ChildProcess::start(const std::vector<std::string>& argv,
                                                const std::filesystem::path& log_file) {
  if (argv.empty()) return std::nullopt;
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log_file.c_str(),
                                   O_WRONLY | O_CREAT | O_APPEND, 0644);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  // Own process group: a test's cleanup can never signal the test runner itself.
  posix_spawnattr_t attributes;
  posix_spawnattr_init(&attributes);
  posix_spawnattr_setflags(&attributes, POSIX_SPAWN_SETPGROUP);
  posix_spawnattr_setpgroup(&attributes, 0);

  std::vector<char*> args;
  args.reserve(argv.size() + 1);
  for (const std::string& arg : argv) args.push_back(const_cast<char*>(arg.c_str()));
  args.push_back(nullptr);
  pid_t pid = -1;
  const int failed = posix_spawnp(&pid, args[0], &actions, &attributes, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attributes);
  if (failed != 0) return std::nullopt;
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

}  // namespace kvr::testing
