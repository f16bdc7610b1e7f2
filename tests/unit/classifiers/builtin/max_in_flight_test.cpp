// max-in-flight: admission up to the limit, deferral with a Waker beyond it, wake-ups from
// Completed/Aborted only (oldest first), per-tenant budgets, retries, dropped futures and the
// parameter checks.
#include "classifiers/builtin/max_in_flight.hpp"

#include <chrono>
#include <memory>
#include <vector>

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

const TimePoint kStart{};
const WorkerWithDpRank kWorker{1, 0};
const WorkerWithDpRank kOtherWorker{2, 0};

class MaxInFlightTest : public ::testing::Test {
 protected:
  void limit(std::uint32_t max_in_flight, bool per_tenant = false) {
    classifier_ = std::make_unique<MaxInFlightClassifier>(
        MaxInFlightParameters{.max_in_flight = max_in_flight, .per_tenant = per_tenant});
  }

  std::unique_ptr<Admission> arrive(std::string id, std::optional<std::string> tenant = {}) {
    return Admission::start(*classifier_,
                            make_request({.id = std::move(id), .tenant = std::move(tenant)}), now_);
  }

  void completed(std::string id) { classifier_->on_event(Completed{std::move(id), kWorker, 200}); }

  std::unique_ptr<MaxInFlightClassifier> classifier_;
  TimePoint now_ = kStart;
};

TEST_F(MaxInFlightTest, AdmitsUpToTheLimitAtTheFirstPoll) {
  limit(2);
  auto first = arrive("r1");
  auto second = arrive("r2");
  EXPECT_TRUE(first->is_ready());
  EXPECT_TRUE(second->is_ready());
  EXPECT_EQ(first->request().request_id(), "r1");
  EXPECT_EQ(classifier_->in_flight(), 2U);
}

TEST_F(MaxInFlightTest, DefersOverTheLimitWithAWakerAndNoTime) {
  limit(1);
  auto first = arrive("r1");
  auto second = arrive("r2");
  ASSERT_TRUE(first->is_ready());
  EXPECT_TRUE(second->is_pending());
  EXPECT_EQ(second->wake_time(), std::nullopt);  // no polling on a timer
  EXPECT_EQ(classifier_->waiting(), 1U);
  EXPECT_EQ(classifier_->in_flight(), 1U);
}

TEST_F(MaxInFlightTest, ADeferredRequestIsPolledAgainOnlyWhenARequestCompletes) {
  limit(1);
  auto first = arrive("r1");
  auto second = arrive("r2");
  ASSERT_TRUE(second->is_pending());

  classifier_->on_event(Sent{"r1", kWorker});
  classifier_->on_event(Responding{"r1", kWorker});
  EXPECT_EQ(second->wakes(), 0);
  EXPECT_FALSE(second->step(kStart + 1h));  // however late, nothing woke it
  EXPECT_EQ(second->polls(), 1);

  completed("r1");
  EXPECT_EQ(second->wakes(), 1);
  ASSERT_TRUE(second->step(kStart + 1h));
  EXPECT_TRUE(second->is_ready());
  EXPECT_EQ(second->polls(), 2);
  EXPECT_EQ(classifier_->in_flight(), 1U);
}

TEST_F(MaxInFlightTest, AnAbortedRequestFreesItsSlotToo) {
  limit(1);
  auto first = arrive("r1");
  auto second = arrive("r2");
  classifier_->on_event(Aborted{"r1", kWorker, "worker lost"});
  ASSERT_TRUE(second->step(kStart));
  EXPECT_TRUE(second->is_ready());
}

TEST_F(MaxInFlightTest, AFreedSlotGoesToTheOldestDeferredRequestNotToANewcomer) {
  limit(1);
  auto first = arrive("r1");
  auto second = arrive("r2");
  auto third = arrive("r3");
  completed("r1");
  EXPECT_EQ(second->wakes(), 1);
  EXPECT_EQ(third->wakes(), 0);

  // A newcomer before r2's poll finds the slot already handed over.
  auto newcomer = arrive("r4");
  EXPECT_TRUE(newcomer->is_pending());
  ASSERT_TRUE(second->step(kStart));
  EXPECT_TRUE(second->is_ready());

  completed("r2");
  EXPECT_EQ(third->wakes(), 1);
  EXPECT_EQ(newcomer->wakes(), 0);
  ASSERT_TRUE(third->step(kStart));
  EXPECT_TRUE(third->is_ready());
  completed("r3");
  ASSERT_TRUE(newcomer->step(kStart));
  EXPECT_TRUE(newcomer->is_ready());
}

TEST_F(MaxInFlightTest, SeveralFreedSlotsWakeAsManyOfTheOldest) {
  limit(2);
  auto first = arrive("r1");
  auto second = arrive("r2");
  auto third = arrive("r3");
  auto fourth = arrive("r4");
  auto fifth = arrive("r5");
  completed("r1");
  completed("r2");
  EXPECT_EQ(third->wakes(), 1);
  EXPECT_EQ(fourth->wakes(), 1);
  EXPECT_EQ(fifth->wakes(), 0);
  ASSERT_TRUE(fourth->step(kStart));  // the host may poll them in any order
  ASSERT_TRUE(third->step(kStart));
  EXPECT_TRUE(third->is_ready());
  EXPECT_TRUE(fourth->is_ready());
  EXPECT_TRUE(fifth->is_pending());
}

TEST_F(MaxInFlightTest, ARetrysSecondSentIsNotCountedTwice) {
  limit(2);
  auto first = arrive("r1");
  classifier_->on_event(Sent{"r1", kWorker});
  classifier_->on_event(Sent{"r1", kOtherWorker});  // retried on another worker
  EXPECT_EQ(classifier_->in_flight(), 1U);
  auto second = arrive("r2");
  EXPECT_TRUE(second->is_ready());
  auto third = arrive("r3");
  EXPECT_TRUE(third->is_pending());

  classifier_->on_event(Completed{"r1", kOtherWorker, 300});
  ASSERT_TRUE(third->step(kStart));
  EXPECT_TRUE(third->is_ready());
  EXPECT_EQ(classifier_->in_flight(), 2U);
}

TEST_F(MaxInFlightTest, AnEndForARequestNotCountedChangesNothing) {
  limit(1);
  auto first = arrive("r1");
  auto second = arrive("r2");
  completed("r1");
  ASSERT_TRUE(second->step(kStart));
  auto third = arrive("r3");
  ASSERT_TRUE(third->is_pending());

  completed("r1");  // a second end of r1
  classifier_->on_event(Aborted{"unknown", std::nullopt, "cancelled"});
  EXPECT_EQ(third->wakes(), 0);
  EXPECT_EQ(classifier_->in_flight(), 1U);
}

TEST_F(MaxInFlightTest, PerTenantBudgetsAreIndependent) {
  limit(1, /*per_tenant=*/true);
  auto a1 = arrive("a1", "alice");
  auto a2 = arrive("a2", "alice");
  auto b1 = arrive("b1", "bob");
  auto n1 = arrive("n1");
  auto n2 = arrive("n2");
  EXPECT_TRUE(a1->is_ready());
  EXPECT_TRUE(a2->is_pending());
  EXPECT_TRUE(b1->is_ready());  // alice's full budget does not hold bob back
  EXPECT_TRUE(n1->is_ready());  // requests without a tenant share one budget of their own
  EXPECT_TRUE(n2->is_pending());
  EXPECT_EQ(classifier_->in_flight("alice"), 1U);
  EXPECT_EQ(classifier_->waiting("alice"), 1U);
  EXPECT_EQ(classifier_->in_flight("bob"), 1U);

  completed("b1");
  completed("n1");
  EXPECT_EQ(a2->wakes(), 0);  // bob's slot is not alice's
  EXPECT_EQ(n2->wakes(), 1);
  completed("a1");
  EXPECT_EQ(a2->wakes(), 1);
  ASSERT_TRUE(a2->step(kStart));
  EXPECT_TRUE(a2->is_ready());
}

TEST_F(MaxInFlightTest, WithoutPerTenantEveryTenantSharesOneBudget) {
  limit(1);
  auto a1 = arrive("a1", "alice");
  auto b1 = arrive("b1", "bob");
  EXPECT_TRUE(a1->is_ready());
  EXPECT_TRUE(b1->is_pending());
  completed("a1");
  EXPECT_EQ(b1->wakes(), 1);
}

TEST_F(MaxInFlightTest, ADroppedDeferredRequestLeavesTheQueue) {
  limit(1);
  auto first = arrive("r1");
  auto second = arrive("r2");
  auto third = arrive("r3");
  second.reset();  // cancelled: the host drops its future
  EXPECT_EQ(classifier_->waiting(), 1U);
  completed("r1");
  EXPECT_EQ(third->wakes(), 1);
  ASSERT_TRUE(third->step(kStart));
  EXPECT_TRUE(third->is_ready());
}

TEST_F(MaxInFlightTest, ADroppedRequestHandedASlotPassesItOn) {
  limit(1);
  auto first = arrive("r1");
  auto second = arrive("r2");
  auto third = arrive("r3");
  completed("r1");
  ASSERT_EQ(second->wakes(), 1);
  second.reset();  // cancelled before the host polled it again
  EXPECT_EQ(third->wakes(), 1);
  ASSERT_TRUE(third->step(kStart));
  EXPECT_TRUE(third->is_ready());
  EXPECT_EQ(classifier_->in_flight(), 1U);
}

TEST_F(MaxInFlightTest, ARequestWithoutAnIdIsRejected) {
  limit(1);
  auto admission =
      Admission::start(*classifier_, ClassifyRequest{ClassifyRequest::Arrival{}}, kStart);
  ASSERT_TRUE(admission->is_rejected());
  EXPECT_EQ(admission->error().kind(), ClassifierError::Kind::Failed);
  EXPECT_EQ(classifier_->in_flight(), 0U);
}

TEST(MaxInFlightParametersTest, ReadsTheLimitAndPerTenant) {
  auto parsed = MaxInFlightParameters::read(testing::parameters("{max_in_flight: 32}"));
  ASSERT_TRUE(parsed.has_value()) << parsed.error().message();
  EXPECT_EQ(parsed->max_in_flight, 32U);
  EXPECT_FALSE(parsed->per_tenant);
  parsed = MaxInFlightParameters::read(testing::parameters("{max_in_flight: 4, per_tenant: true}"));
  ASSERT_TRUE(parsed.has_value()) << parsed.error().message();
  EXPECT_TRUE(parsed->per_tenant);
}

TEST(MaxInFlightParametersTest, BadParametersFailNamingTheKey) {
  EXPECT_THAT(parameter_error<MaxInFlightParameters>("{}"),
              HasSubstr("parameters.max_in_flight: required parameter is missing"));
  EXPECT_EQ(parameter_error<MaxInFlightParameters>("{max_in_flight: 0}"),
            "parameters.max_in_flight: must be at least 1, got 0");
  EXPECT_THAT(parameter_error<MaxInFlightParameters>("{max_in_flight: -2}"),
              HasSubstr("parameters.max_in_flight: expected a non-negative 32-bit integer"));
  EXPECT_THAT(parameter_error<MaxInFlightParameters>("{max_in_flight: 2, per_tenant: maybe}"),
              HasSubstr("parameters.per_tenant: expected a boolean"));
  EXPECT_THAT(parameter_error<MaxInFlightParameters>("{max_in_flight: 2, tenant: true}"),
              HasSubstr("unknown parameter 'tenant'"));
}

}  // namespace
}  // namespace kvr::classifiers::builtin
