// The native renders' thread pool: clients served in turn, its queue limits, the queue length it
// reports, and what its destruction does with tasks still waiting. Tasks block on promises the
// test fulfils, so every order asserted here is forced, never timed.
#include "selection/front_door/render_pool.hpp"

#include <algorithm>
#include <future>
#include <latch>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/unit/selection/front_door/render_pool_blocker.hpp"

namespace kvr::front_door {
namespace {

using ::testing::ElementsAre;

using render_tests::Blocker;

// Records the names of the tasks in the order workers ran them.
class RunOrder {
 public:
  explicit RunOrder(std::ptrdiff_t expected) : all_done_(expected) {}
  RenderPool::Task task(std::string name) {
    return [this, name = std::move(name)](TaskStart start) {
      {
        const std::lock_guard lock{mutex_};
        names_.push_back(start == TaskStart::run ? name : name + " cancelled");
      }
      all_done_.count_down();
    };
  }
  std::vector<std::string> wait() {
    all_done_.wait();
    const std::lock_guard lock{mutex_};
    return names_;
  }

 private:
  std::mutex mutex_;
  std::vector<std::string> names_;
  std::latch all_done_;
};

TEST(RenderPoolTest, ServesEachWaitingClientInTurn) {
  RenderPool pool{RenderPoolOptions{.threads = 1}};
  Blocker blocker;
  ASSERT_TRUE(pool.submit("blocker", blocker.task()));
  blocker.wait_started();
  RunOrder order{11};
  for (int i = 0; i < 10; ++i) ASSERT_TRUE(pool.submit("a", order.task("a" + std::to_string(i))));
  ASSERT_TRUE(pool.submit("b", order.task("b0")));
  blocker.release();
  EXPECT_THAT(order.wait(),
              ElementsAre("a0", "b0", "a1", "a2", "a3", "a4", "a5", "a6", "a7", "a8", "a9"));
}

TEST(RenderPoolTest, RefusesATaskPastTheClientsQueueLimit) {
  RenderPool pool{RenderPoolOptions{.threads = 1, .max_queued = 10, .max_queued_per_client = 2}};
  Blocker blocker;
  ASSERT_TRUE(pool.submit("blocker", blocker.task()));
  blocker.wait_started();
  RunOrder order{3};
  ASSERT_TRUE(pool.submit("a", order.task("a0")));
  ASSERT_TRUE(pool.submit("a", order.task("a1")));
  const auto refused = pool.submit("a", order.task("a2"));
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error(), RenderPoolRefusal::client_queue_full);
  // Another client still has room.
  EXPECT_TRUE(pool.submit("b", order.task("b0")));
  blocker.release();
  EXPECT_THAT(order.wait(), ElementsAre("a0", "b0", "a1"));
}

TEST(RenderPoolTest, RefusesATaskPastThePoolsQueueLimit) {
  RenderPool pool{RenderPoolOptions{.threads = 1, .max_queued = 2, .max_queued_per_client = 10}};
  Blocker blocker;
  ASSERT_TRUE(pool.submit("blocker", blocker.task()));
  blocker.wait_started();
  RunOrder order{2};
  ASSERT_TRUE(pool.submit("a", order.task("a0")));
  ASSERT_TRUE(pool.submit("b", order.task("b0")));
  const auto refused = pool.submit("c", order.task("c0"));
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error(), RenderPoolRefusal::queue_full);
  EXPECT_EQ(pool.queued(), 2u);
  blocker.release();
  EXPECT_THAT(order.wait(), ElementsAre("a0", "b0"));
}

TEST(RenderPoolTest, TasksWithoutAClientHaveOnlyThePoolsLimit) {
  RenderPool pool{RenderPoolOptions{.threads = 1, .max_queued = 10, .max_queued_per_client = 1}};
  Blocker blocker;
  ASSERT_TRUE(pool.submit("blocker", blocker.task()));
  blocker.wait_started();
  RunOrder order{3};
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(pool.submit("", order.task(std::to_string(i))));
  blocker.release();
  EXPECT_THAT(order.wait(), ElementsAre("0", "1", "2"));
}

TEST(RenderPoolTest, ReportsEachChangeOfTheQueue) {
  std::mutex mutex;
  std::vector<int> changes;
  const auto recorded = [&] {
    const std::lock_guard lock{mutex};
    return changes;
  };
  std::optional<RenderPool> pool;
  pool.emplace(RenderPoolOptions{.threads = 1}, [&](int change) {
    const std::lock_guard lock{mutex};
    changes.push_back(change);
  });
  Blocker blocker;
  ASSERT_TRUE(pool->submit("blocker", blocker.task()));
  blocker.wait_started();
  RunOrder order{2};
  ASSERT_TRUE(pool->submit("a", order.task("a0")));
  ASSERT_TRUE(pool->submit("b", order.task("b0")));
  EXPECT_THAT(recorded(), ElementsAre(+1, -1, +1, +1));
  std::thread destroyer{[&] { pool.reset(); }};
  order.wait();  // both cancelled
  EXPECT_THAT(recorded(), ElementsAre(+1, -1, +1, +1, -2));
  blocker.release();
  destroyer.join();
}

TEST(RenderPoolTest, DestructionCancelsEachWaitingTaskOnceAndWaitsForTheRunningOne) {
  std::optional<RenderPool> pool;
  pool.emplace(RenderPoolOptions{.threads = 1});
  Blocker blocker;
  ASSERT_TRUE(pool->submit("blocker", blocker.task()));
  blocker.wait_started();
  RunOrder order{3};
  ASSERT_TRUE(pool->submit("a", order.task("a0")));
  ASSERT_TRUE(pool->submit("a", order.task("a1")));
  ASSERT_TRUE(pool->submit("b", order.task("b0")));
  std::promise<void> destroyed;
  std::thread destroyer{[&] {
    pool.reset();
    destroyed.set_value();
  }};
  // The waiting tasks are cancelled while the blocker still runs, in turn order.
  EXPECT_THAT(order.wait(), ElementsAre("a0 cancelled", "b0 cancelled", "a1 cancelled"));
  auto destroyed_future = destroyed.get_future();
  EXPECT_EQ(destroyed_future.wait_for(std::chrono::seconds{0}), std::future_status::timeout);
  blocker.release();
  destroyed_future.wait();
  destroyer.join();
}

TEST(RenderPoolTest, RunsTasksOffTheSubmittingThread) {
  RenderPool pool{RenderPoolOptions{.threads = 2}};
  EXPECT_EQ(pool.threads(), 2u);
  std::promise<std::thread::id> ran_on;
  ASSERT_TRUE(pool.submit("a", [&](TaskStart) { ran_on.set_value(std::this_thread::get_id()); }));
  EXPECT_NE(ran_on.get_future().get(), std::this_thread::get_id());
}

TEST(RenderPoolTest, DefaultsToTheHardwareThreadsUpToEight) {
  const RenderPool pool;
  const std::size_t hardware = std::max(1u, std::thread::hardware_concurrency());
  EXPECT_EQ(pool.threads(), std::min<std::size_t>(hardware, kMaxDefaultRenderThreads));
}

}  // namespace
}  // namespace kvr::front_door
