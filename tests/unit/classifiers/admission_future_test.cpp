// The polling mechanics of AdmissionFuture, driven the way the classifier actor will drive them:
// poll, read the registered wake-up, poll again at that time or when a Waker fires.
#include <chrono>
#include <optional>
#include <stdexcept>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "classifiers/request_classifier.hpp"

namespace kvr::plugins::request_classifier {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;

const TimePoint kStart{};

ClassifyRequest request(std::string id) {
  return ClassifyRequest{
      ClassifyRequest::Arrival{.request_id = std::move(id), .input_tokens = 100}};
}

// The polling side: counts wake-ups, as the actor would queue re-polls.
struct Poller {
  int wake_ups = 0;
  PollContext context(TimePoint now) {
    return PollContext{now, [this] { ++wake_ups; }};
  }
};

TEST(AdmissionFutureTest, AReadyFutureAdmitsAtTheFirstPoll) {
  Poller poller;
  auto future = AdmissionFuture::ready(request("r1"));
  auto context = poller.context(kStart);
  Poll answer = future.poll(context);
  ASSERT_TRUE(answer.is_ready());
  EXPECT_EQ(answer.request().request_id(), "r1");
  EXPECT_TRUE(future.is_resolved());
}

TEST(AdmissionFutureTest, ARejectedFutureRejectsWithItsReason) {
  Poller poller;
  auto future = AdmissionFuture::rejected(ClassifierError::overloaded("32 requests in flight"));
  auto context = poller.context(kStart);
  Poll answer = future.poll(context);
  ASSERT_TRUE(answer.is_rejected());
  EXPECT_EQ(answer.error().kind(), ClassifierError::Kind::Overloaded);
  EXPECT_EQ(answer.error().message(), "32 requests in flight");
}

TEST(AdmissionFutureTest, ADeferredFutureAdmitsWhenPolledAtItsWakeTime) {
  const TimePoint release = kStart + 5ms;
  auto future = AdmissionFuture::deferred([req = request("r1"), release](PollContext& context) {
    if (context.now() < release) {
      context.wake_at(release);
      return Poll::pending();
    }
    return Poll::ready(req);
  });
  Poller poller;
  auto first = poller.context(kStart);
  EXPECT_TRUE(future.poll(first).is_pending());
  EXPECT_EQ(first.wake_time(), release);
  EXPECT_FALSE(future.is_resolved());

  auto second = poller.context(*first.wake_time());
  Poll answer = future.poll(second);
  ASSERT_TRUE(answer.is_ready());
  EXPECT_EQ(answer.request().request_id(), "r1");
  EXPECT_TRUE(future.is_resolved());
}

TEST(AdmissionFutureTest, ADeferredFutureRejectsAfterItsDeadline) {
  const TimePoint deadline = kStart + 10ms;
  auto future = AdmissionFuture::deferred([deadline](PollContext& context) {
    if (context.now() >= deadline) return Poll::rejected(ClassifierError::rate_limited("late"));
    context.wake_at(deadline);
    return Poll::pending();
  });
  Poller poller;
  auto first = poller.context(kStart);
  ASSERT_TRUE(future.poll(first).is_pending());
  auto second = poller.context(deadline);
  Poll answer = future.poll(second);
  ASSERT_TRUE(answer.is_rejected());
  EXPECT_EQ(answer.error().kind(), ClassifierError::Kind::RateLimited);
}

TEST(AdmissionFutureTest, TheEarliestWakeTimeCounts) {
  PollContext context{kStart, [] {}};
  context.wake_at(kStart + 9ms);
  context.wake_at(kStart + 3ms);
  context.wake_at(kStart + 7ms);
  EXPECT_EQ(context.wake_time(), kStart + 3ms);
}

TEST(AdmissionFutureTest, AFiredWakerCallsThePollingSideAndTheNextPollAdmits) {
  bool capacity_free = false;
  std::optional<Waker> parked;
  auto future = AdmissionFuture::deferred([&, req = request("r1")](PollContext& context) {
    if (capacity_free) return Poll::ready(req);
    parked = context.waker();
    return Poll::pending();
  });
  Poller poller;
  auto first = poller.context(kStart);
  ASSERT_TRUE(future.poll(first).is_pending());
  EXPECT_TRUE(first.registered_wakeup());
  EXPECT_EQ(first.wake_time(), std::nullopt);
  ASSERT_TRUE(parked.has_value());
  EXPECT_EQ(poller.wake_ups, 0);

  capacity_free = true;
  parked->wake();
  EXPECT_EQ(poller.wake_ups, 1);
  auto second = poller.context(kStart + 1ms);
  EXPECT_TRUE(future.poll(second).is_ready());
}

TEST(AdmissionFutureTest, AnEarlierWakerReachesTheLatestPollsCallback) {
  std::optional<Waker> first_waker;
  auto future = AdmissionFuture::deferred([&](PollContext& context) {
    Waker waker = context.waker();
    if (!first_waker) first_waker = waker;
    return Poll::pending();
  });
  int first_calls = 0;
  int second_calls = 0;
  PollContext first{kStart, [&] { ++first_calls; }};
  ASSERT_TRUE(future.poll(first).is_pending());
  PollContext second{kStart + 1ms, [&] { ++second_calls; }};
  ASSERT_TRUE(future.poll(second).is_pending());

  first_waker->wake();
  EXPECT_EQ(first_calls, 0);
  EXPECT_EQ(second_calls, 1);
}

TEST(AdmissionFutureTest, AWakerOfAResolvedFutureDoesNothing) {
  bool admit = false;
  std::optional<Waker> parked;
  auto future = AdmissionFuture::deferred([&, req = request("r1")](PollContext& context) {
    if (admit) return Poll::ready(req);
    parked = context.waker();
    return Poll::pending();
  });
  Poller poller;
  auto first = poller.context(kStart);
  ASSERT_TRUE(future.poll(first).is_pending());
  admit = true;
  auto second = poller.context(kStart);
  ASSERT_TRUE(future.poll(second).is_ready());

  parked->wake();
  EXPECT_EQ(poller.wake_ups, 0);
}

TEST(AdmissionFutureTest, AWakerOfADestroyedFutureDoesNothing) {
  std::optional<Waker> parked;
  Poller poller;
  {
    auto future = AdmissionFuture::deferred([&](PollContext& context) {
      parked = context.waker();
      return Poll::pending();
    });
    auto context = poller.context(kStart);
    ASSERT_TRUE(future.poll(context).is_pending());
  }
  parked->wake();
  EXPECT_EQ(poller.wake_ups, 0);
}

TEST(AdmissionFutureTest, AssigningOverAPendingFutureSilencesItsWakers) {
  std::optional<Waker> parked;
  Poller poller;
  auto future = AdmissionFuture::deferred([&](PollContext& context) {
    parked = context.waker();
    return Poll::pending();
  });
  auto context = poller.context(kStart);
  ASSERT_TRUE(future.poll(context).is_pending());
  future = AdmissionFuture::ready(request("r2"));
  parked->wake();
  EXPECT_EQ(poller.wake_ups, 0);
}

TEST(AdmissionFutureTest, ADefaultWakerDoesNothing) {
  const Waker waker;
  waker.wake();
  SUCCEED() << "waking an unbound Waker is harmless";
}

TEST(AdmissionFutureTest, PendingWithoutAWakeUpIsRejected) {
  auto future = AdmissionFuture::deferred([](PollContext&) { return Poll::pending(); });
  Poller poller;
  auto context = poller.context(kStart);
  Poll answer = future.poll(context);
  ASSERT_TRUE(answer.is_rejected());
  EXPECT_EQ(answer.error().kind(), ClassifierError::Kind::Failed);
  EXPECT_THAT(answer.error().message(), HasSubstr("without registering a wake-up"));
  EXPECT_TRUE(future.is_resolved());
}

TEST(AdmissionFutureTest, AThrowingPollFunctionRejectsThatRequestOnly) {
  auto future = AdmissionFuture::deferred(
      [](PollContext&) -> Poll { throw std::runtime_error("classifier bug"); });
  Poller poller;
  auto context = poller.context(kStart);
  Poll answer = future.poll(context);
  ASSERT_TRUE(answer.is_rejected());
  EXPECT_EQ(answer.error().message(), "request classifier threw: classifier bug");
}

TEST(AdmissionFutureTest, PollingAResolvedFutureAgainIsRejected) {
  auto future = AdmissionFuture::ready(request("r1"));
  Poller poller;
  auto first = poller.context(kStart);
  ASSERT_TRUE(future.poll(first).is_ready());
  auto second = poller.context(kStart);
  Poll again = future.poll(second);
  ASSERT_TRUE(again.is_rejected());
  EXPECT_THAT(again.error().message(), HasSubstr("polled after it resolved"));
}

}  // namespace
}  // namespace kvr::plugins::request_classifier
