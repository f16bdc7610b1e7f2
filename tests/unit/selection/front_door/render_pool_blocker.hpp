// A RenderPool task that holds a pool's thread until released, for the native render tests.
#pragma once

#include <future>

#include "selection/front_door/render_pool.hpp"

namespace kvr::front_door::render_tests {

// started() resolves once the task runs; release() lets it end (a cancelled task does nothing).
class Blocker {
 public:
  RenderPool::Task task() {
    return [this](TaskStart start) {
      if (start == TaskStart::cancelled) return;
      started_.set_value();
      release_future_.wait();
    };
  }
  void wait_started() { started_.get_future().wait(); }
  void release() { release_.set_value(); }

 private:
  std::promise<void> started_;
  std::promise<void> release_;
  std::shared_future<void> release_future_ = release_.get_future().share();
};

}  // namespace kvr::front_door::render_tests
