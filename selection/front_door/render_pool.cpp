#include "selection/front_door/render_pool.hpp"

#include <algorithm>
#include <utility>

namespace kvr::front_door {

std::expected<void, std::string> RenderPoolOptions::validate() const {
  if (threads > 256) return std::unexpected("--render-threads: at most 256");
  if (max_queued == 0 || max_queued > 1'000'000) {
    return std::unexpected("--render-queue: between 1 and 1,000,000");
  }
  if (max_queued_per_client == 0 || max_queued_per_client > max_queued) {
    return std::unexpected("--render-queue-per-client: between 1 and --render-queue");
  }
  return {};
}
namespace {

std::size_t resolved_threads(std::size_t threads) {
  if (threads > 0) return threads;
  return std::clamp<std::size_t>(std::thread::hardware_concurrency(), 1, kMaxDefaultRenderThreads);
}

}  // namespace

RenderPool::RenderPool(RenderPoolOptions options, std::function<void(int)> queue_changed)
    : options_(options), queue_changed_(std::move(queue_changed)) {
  options_.threads = resolved_threads(options_.threads);
  workers_.reserve(options_.threads);
  for (std::size_t i = 0; i < options_.threads; ++i) workers_.emplace_back([this] { work(); });
}

RenderPool::~RenderPool() {
  Lanes waiting;
  std::deque<Lanes::iterator> turns;
  {
    const std::lock_guard lock{mutex_};
    stopping_ = true;
    // A moved map keeps its nodes: the turns still point into `waiting`.
    waiting = std::move(lanes_);
    turns = std::move(turns_);
    if (queue_changed_ && queued_ > 0) queue_changed_(-static_cast<int>(queued_));
    queued_ = 0;
  }
  task_waiting_.notify_all();
  // Told at once, not after the running tasks (those may take long), in the order they would
  // have run.
  while (!turns.empty()) {
    const auto lane = turns.front();
    turns.pop_front();
    lane->second.front()(TaskStart::cancelled);
    lane->second.pop_front();
    if (!lane->second.empty()) turns.push_back(lane);
  }
  for (std::thread& worker : workers_) worker.join();
}

std::expected<void, RenderPoolRefusal> RenderPool::submit(std::string_view client, Task task) {
  const std::lock_guard lock{mutex_};
  if (queued_ >= options_.max_queued) return std::unexpected(RenderPoolRefusal::queue_full);
  auto lane = lanes_.find(client);
  const std::size_t waiting = lane == lanes_.end() ? 0 : lane->second.size();
  if (!client.empty() && waiting >= options_.max_queued_per_client) {
    return std::unexpected(RenderPoolRefusal::client_queue_full);
  }
  if (lane == lanes_.end()) {
    lane = lanes_.emplace(std::string{client}, std::deque<Task>{}).first;
    turns_.push_back(lane);
  }
  lane->second.push_back(std::move(task));
  ++queued_;
  if (queue_changed_) queue_changed_(+1);
  task_waiting_.notify_one();
  return {};
}

std::size_t RenderPool::queued() const {
  const std::lock_guard lock{mutex_};
  return queued_;
}

void RenderPool::work() {
  std::unique_lock lock{mutex_};
  while (true) {
    task_waiting_.wait(lock, [&] { return stopping_ || !turns_.empty(); });
    if (stopping_) return;
    const auto lane = turns_.front();
    turns_.pop_front();
    Task task = std::move(lane->second.front());
    lane->second.pop_front();
    // The client's next task waits for every other waiting client's turn.
    if (lane->second.empty()) {
      lanes_.erase(lane);
    } else {
      turns_.push_back(lane);
    }
    --queued_;
    if (queue_changed_) queue_changed_(-1);
    lock.unlock();
    task(TaskStart::run);
    task = nullptr;  // what it holds is released outside the lock
    lock.lock();
  }
}

}  // namespace kvr::front_door
