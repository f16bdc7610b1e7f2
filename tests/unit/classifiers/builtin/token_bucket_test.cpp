// token-bucket: admission while a tenant's bucket holds the cost, rate_limited rejections, refill
// over time, per-tenant buckets, requests larger than the bucket, and in defer mode a wake-up at
// the refill time with the tenant's deferred requests served oldest first.
#include "classifiers/builtin/token_bucket.hpp"

#include <chrono>
#include <memory>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/unit/classifiers/builtin/classifier_host.hpp"

namespace kvr::classifiers::builtin {
namespace {

using namespace plugins::request_classifier;
using namespace std::chrono_literals;
using testing::Admission;
using ::testing::HasSubstr;
using testing::make_request;
using testing::parameter_error;

const TimePoint kStart = TimePoint{} + 1h;

// 100 tokens/s into a bucket of 1000.
class TokenBucketTest : public ::testing::Test {
 protected:
  void mode(TokenBucketMode mode) {
    classifier_ = std::make_unique<TokenBucketClassifier>(
        TokenBucketParameters{.rate_tokens_per_s = 100, .burst_tokens = 1000, .mode = mode});
  }

  std::unique_ptr<Admission> arrive(std::size_t tokens, TimePoint at,
                                    std::optional<std::string> tenant = {}) {
    return Admission::start(*classifier_,
                            make_request({.id = "r" + std::to_string(++requests_),
                                          .input_tokens = tokens,
                                          .tenant = std::move(tenant),
                                          .arrived_at = at}),
                            at);
  }

  std::unique_ptr<TokenBucketClassifier> classifier_;
  int requests_ = 0;
};

TEST_F(TokenBucketTest, AdmitsWhileTheBucketHoldsTheCost) {
  mode(TokenBucketMode::Reject);
  EXPECT_TRUE(arrive(400, kStart)->is_ready());
  EXPECT_TRUE(arrive(400, kStart)->is_ready());
  EXPECT_DOUBLE_EQ(classifier_->tokens_at(std::nullopt, kStart), 200.0);
}

TEST_F(TokenBucketTest, OverTheRateRejectsAsRateLimited) {
  mode(TokenBucketMode::Reject);
  ASSERT_TRUE(arrive(900, kStart, "alice")->is_ready());
  auto over = arrive(200, kStart, "alice");
  ASSERT_TRUE(over->is_rejected());
  EXPECT_EQ(over->error().kind(), ClassifierError::Kind::RateLimited);
  EXPECT_THAT(std::string{over->error().message()}, HasSubstr("tenant 'alice'"));
  EXPECT_DOUBLE_EQ(classifier_->tokens_at("alice", kStart), 100.0);  // a rejection costs nothing
  // The missing 100 tokens refill in one second at 100 tokens/s: the client may retry then.
  EXPECT_EQ(over->error().retry_after(), std::chrono::milliseconds{1000});
  EXPECT_TRUE(arrive(200, kStart + 1s, "alice")->is_ready());
}

TEST_F(TokenBucketTest, TheBucketRefillsAtTheRateUpToTheBurst) {
  mode(TokenBucketMode::Reject);
  ASSERT_TRUE(arrive(1000, kStart)->is_ready());
  EXPECT_TRUE(arrive(150, kStart + 1s)->is_rejected());   // 100 tokens back
  EXPECT_TRUE(arrive(150, kStart + 1500ms)->is_ready());  // 150
  EXPECT_DOUBLE_EQ(classifier_->tokens_at(std::nullopt, kStart + 1500ms), 0.0);
  EXPECT_DOUBLE_EQ(classifier_->tokens_at(std::nullopt, kStart + 1h), 1000.0);  // capped
}

TEST_F(TokenBucketTest, EachTenantHasItsOwnBucket) {
  mode(TokenBucketMode::Reject);
  ASSERT_TRUE(arrive(1000, kStart, "alice")->is_ready());
  EXPECT_TRUE(arrive(100, kStart, "alice")->is_rejected());
  EXPECT_TRUE(arrive(1000, kStart, "bob")->is_ready());
  EXPECT_TRUE(arrive(1000, kStart)->is_ready());  // no tenant: one shared bucket of its own
  EXPECT_TRUE(arrive(100, kStart)->is_rejected());
}

TEST_F(TokenBucketTest, ARequestLargerThanTheBucketWaitsForAFullBucketAndLeavesDebt) {
  mode(TokenBucketMode::Reject);
  ASSERT_TRUE(arrive(100, kStart)->is_ready());
  EXPECT_TRUE(arrive(1500, kStart)->is_rejected());  // 900 < the full 1000
  ASSERT_TRUE(arrive(1500, kStart + 1s)->is_ready());
  EXPECT_DOUBLE_EQ(classifier_->tokens_at(std::nullopt, kStart + 1s), -500.0);
  EXPECT_TRUE(arrive(100, kStart + 5s)->is_rejected());  // -100
  EXPECT_TRUE(arrive(100, kStart + 7s)->is_ready());     // 100
}

TEST_F(TokenBucketTest, DeferModeWakesAtTheRefillTimeAndNotBefore) {
  mode(TokenBucketMode::Defer);
  ASSERT_TRUE(arrive(800, kStart)->is_ready());
  auto deferred = arrive(400, kStart);  // 200 in the bucket: 2 s to go
  ASSERT_TRUE(deferred->is_pending());
  EXPECT_EQ(deferred->wake_time(), kStart + 2s);
  EXPECT_FALSE(deferred->step(kStart + 1999ms));
  EXPECT_EQ(deferred->polls(), 1);

  ASSERT_TRUE(deferred->step(kStart + 2s));
  EXPECT_TRUE(deferred->is_ready());
  EXPECT_EQ(deferred->polls(), 2);
  EXPECT_NEAR(classifier_->tokens_at(std::nullopt, kStart + 2s), 0.0, 1e-6);
}

TEST_F(TokenBucketTest, DeferModeServesATenantsDeferredRequestsOldestFirst) {
  mode(TokenBucketMode::Defer);
  ASSERT_TRUE(arrive(700, kStart, "alice")->is_ready());
  auto first = arrive(800, kStart, "alice");   // 300 in the bucket: 5 s to go
  auto second = arrive(100, kStart, "alice");  // affordable, but behind the first
  ASSERT_TRUE(first->is_pending());
  ASSERT_TRUE(second->is_pending());
  EXPECT_EQ(first->wake_time(), kStart + 5s);
  EXPECT_EQ(second->wake_time(), std::nullopt);  // waits for the first, with a Waker

  EXPECT_FALSE(second->step(kStart + 4s));
  ASSERT_TRUE(first->step(kStart + 5s));
  ASSERT_TRUE(first->is_ready());
  EXPECT_EQ(second->wakes(), 1);
  ASSERT_TRUE(second->step(kStart + 5s));
  ASSERT_TRUE(second->is_pending());  // now first in line: 0 tokens, 1 s to go
  EXPECT_EQ(second->wake_time(), kStart + 6s);
  ASSERT_TRUE(second->step(kStart + 6s));
  EXPECT_TRUE(second->is_ready());
  EXPECT_EQ(second->polls(), 3);

  EXPECT_TRUE(arrive(1000, kStart, "bob")->is_ready());  // bob never waited behind alice
}

TEST_F(TokenBucketTest, ADroppedFirstInLineHandsTheTurnToTheNext) {
  mode(TokenBucketMode::Defer);
  ASSERT_TRUE(arrive(1000, kStart)->is_ready());
  auto first = arrive(500, kStart);
  auto second = arrive(100, kStart);
  auto third = arrive(100, kStart);
  ASSERT_TRUE(second->is_pending());
  third.reset();  // dropping one that is not first wakes no one
  EXPECT_EQ(second->wakes(), 0);
  first.reset();
  EXPECT_EQ(second->wakes(), 1);
  ASSERT_TRUE(second->step(kStart + 1s));
  EXPECT_TRUE(second->is_ready());
}

TEST(TokenBucketLongWaitTest, ATinyRateAsksForAWakeUpAtMostADayAhead) {
  TokenBucketClassifier classifier{TokenBucketParameters{
      .rate_tokens_per_s = 1e-9, .burst_tokens = 10, .mode = TokenBucketMode::Defer}};
  auto spend = Admission::start(
      classifier, make_request({.id = "r1", .input_tokens = 10, .arrived_at = kStart}), kStart);
  ASSERT_TRUE(spend->is_ready());
  auto deferred = Admission::start(
      classifier, make_request({.id = "r2", .input_tokens = 10, .arrived_at = kStart}), kStart);
  ASSERT_TRUE(deferred->is_pending());
  EXPECT_EQ(deferred->wake_time(), kStart + 24h);
  ASSERT_TRUE(deferred->step(kStart + 24h));
  EXPECT_TRUE(deferred->is_pending());  // asks again, a day later
  EXPECT_EQ(deferred->wake_time(), kStart + 48h);
}

TEST(TokenBucketParametersTest, ReadsRateBurstAndMode) {
  auto parsed = TokenBucketParameters::read(
      testing::parameters("{rate_tokens_per_s: 2.5, burst_tokens: 4000, mode: defer}"));
  ASSERT_TRUE(parsed.has_value()) << parsed.error().message();
  EXPECT_DOUBLE_EQ(parsed->rate_tokens_per_s, 2.5);
  EXPECT_EQ(parsed->burst_tokens, 4000U);
  EXPECT_EQ(parsed->mode, TokenBucketMode::Defer);
  parsed =
      TokenBucketParameters::read(testing::parameters("{rate_tokens_per_s: 10, burst_tokens: 10}"));
  ASSERT_TRUE(parsed.has_value()) << parsed.error().message();
  EXPECT_EQ(parsed->mode, TokenBucketMode::Reject);
}

TEST(TokenBucketParametersTest, BadParametersFailNamingTheKey) {
  EXPECT_THAT(parameter_error<TokenBucketParameters>("{burst_tokens: 10}"),
              HasSubstr("parameters.rate_tokens_per_s: required parameter is missing"));
  EXPECT_EQ(parameter_error<TokenBucketParameters>("{rate_tokens_per_s: 0, burst_tokens: 10}"),
            "parameters.rate_tokens_per_s: must be greater than 0, got 0");
  EXPECT_EQ(parameter_error<TokenBucketParameters>("{rate_tokens_per_s: -1, burst_tokens: 10}"),
            "parameters.rate_tokens_per_s: must be greater than 0, got -1");
  EXPECT_EQ(parameter_error<TokenBucketParameters>("{rate_tokens_per_s: 1, burst_tokens: 0}"),
            "parameters.burst_tokens: must be at least 1, got 0");
  EXPECT_THAT(parameter_error<TokenBucketParameters>("{rate_tokens_per_s: 1, burst_tokens: 1.5}"),
              HasSubstr("parameters.burst_tokens: expected a non-negative 64-bit integer"));
  EXPECT_EQ(parameter_error<TokenBucketParameters>(
                "{rate_tokens_per_s: 1, burst_tokens: 1, mode: queue}"),
            "parameters.mode: expected 'reject' or 'defer', got 'queue'");
  EXPECT_THAT(
      parameter_error<TokenBucketParameters>("{rate_tokens_per_s: 1, burst_tokens: 1, tenant: a}"),
      HasSubstr("unknown parameter 'tenant'"));
}

}  // namespace
}  // namespace kvr::classifiers::builtin
