// A bounded pool of threads for the front doors' CPU-heavy work, the native tokenizer's renders,
// so that it runs off their I/O threads and fairly between clients. Used by PromptRenderer.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <expected>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace kvr::front_door {

/// The most threads a pool takes by default (one per hardware thread up to this): renders share
/// the machine with the I/O threads and the router's actors.
inline constexpr std::size_t kMaxDefaultRenderThreads = 8;

/// A pool's size and limits.
struct RenderPoolOptions {
  /// Worker threads; 0: one per hardware thread, at least 1 and at most kMaxDefaultRenderThreads.
  std::size_t threads = 0;
  /// Tasks waiting for a thread, all clients together; more are refused.
  std::size_t max_queued = 256;
  /// Tasks of one client waiting for a thread; more of that client's are refused.
  std::size_t max_queued_per_client = 32;

  /// Checks ranges; the error names the `kvr node` flag.
  std::expected<void, std::string> validate() const;
};

/// Why submit refused a task.
enum class RenderPoolRefusal : std::uint8_t {
  queue_full,         ///< max_queued tasks wait already
  client_queue_full,  ///< max_queued_per_client tasks of the same client wait already
};

/// How a task is called: by a worker, or by the pool's destructor for a task that never started.
enum class TaskStart : std::uint8_t { run, cancelled };

/// Runs tasks on its own threads. Waiting tasks are queued per client and served round-robin
/// across clients (one task of each client with tasks waiting, in the order the clients became
/// waiting), so one client's many tasks delay another client's by at most one of theirs per
/// thread. Every accepted task is called exactly once: with TaskStart::run on a worker, or, when
/// the pool is destroyed before it started, with TaskStart::cancelled on the destroying thread
/// (before the running tasks finish, which it then waits for). Tasks must not throw and must not
/// call into the pool.
class RenderPool {
 public:
  using Task = std::function<void(TaskStart)>;

  /// Starts the threads. `queue_changed`, when given, is called with the change of the number of
  /// waiting tasks (+1 as one is queued, -1 as one is taken, minus those cancelled at the end),
  /// under the pool's lock (it must be quick and not call the pool): a gauge's add, which
  /// several pools can share.
  explicit RenderPool(RenderPoolOptions options = {}, std::function<void(int)> queue_changed = {});
  ~RenderPool();
  RenderPool(const RenderPool&) = delete;
  RenderPool& operator=(const RenderPool&) = delete;

  /// Queues `task` under `client` (a client's address; empty: no client in particular, whose
  /// tasks share one turn and only the pool's limit applies to them), or refuses it (the task is
  /// then dropped uncalled).
  std::expected<void, RenderPoolRefusal> submit(std::string_view client, Task task);

  /// Tasks waiting for a thread.
  std::size_t queued() const;

  /// The number of worker threads.
  std::size_t threads() const { return workers_.size(); }

  /// The pool's options, `threads` resolved.
  const RenderPoolOptions& options() const { return options_; }

 private:
  using Lanes = std::map<std::string, std::deque<Task>, std::less<>>;

  void work();

  RenderPoolOptions options_;
  std::function<void(int)> queue_changed_;
  mutable std::mutex mutex_;
  std::condition_variable task_waiting_;
  bool stopping_ = false;
  /// Each client's waiting tasks, oldest first; a client without waiting tasks has no lane.
  Lanes lanes_;
  /// The clients with waiting tasks, the next to be served first (each lane once).
  std::deque<Lanes::iterator> turns_;
  std::size_t queued_ = 0;
  std::vector<std::thread> workers_;
};

}  // namespace kvr::front_door
