// The queue between a worker process's other threads (NATS callbacks, a ZMQ subscriber, an HTTP
// prober) and the one loop that owns the worker's state, as `kvr mocker` and `kvr bridge` run
// it: other threads only push; the loop takes everything queued at once and sleeps until the
// next item, its next deadline or a stop request.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <stop_token>

namespace kvr::worker {

/// A thread-safe FIFO of `Item` with one consuming loop.
template <class Item>
class WorkerInbox {
 public:
  /// Queues `item` and wakes the loop. Any thread.
  void push(Item item) {
    {
      std::lock_guard lock{mutex_};
      items_.push_back(std::move(item));
    }
    signal_.notify_one();
  }

  /// Moves everything queued into `out` (which the caller has emptied), in arrival order.
  void take_all(std::deque<Item>& out) {
    std::lock_guard lock{mutex_};
    out.swap(items_);
  }

  /// Drops the queued items for which `drop` is true.
  template <class Predicate>
  void erase_if(Predicate drop) {
    std::lock_guard lock{mutex_};
    std::erase_if(items_, drop);
  }

  /// Sleeps until an item is queued, `stop` is requested or `deadline` passes.
  template <class Clock, class Duration>
  void wait_until(const std::stop_token& stop,
                  const std::chrono::time_point<Clock, Duration>& deadline) {
    std::unique_lock lock{mutex_};
    signal_.wait_until(lock, stop, deadline, [this] { return !items_.empty(); });
  }

  /// Sleeps until an item is queued or `stop` is requested.
  void wait(const std::stop_token& stop) {
    std::unique_lock lock{mutex_};
    signal_.wait(lock, stop, [this] { return !items_.empty(); });
  }

 private:
  std::mutex mutex_;
  std::condition_variable_any signal_;
  std::deque<Item> items_;
};

}  // namespace kvr::worker
