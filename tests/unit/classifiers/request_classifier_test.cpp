#include "classifiers/request_classifier.hpp"

#include <chrono>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace kvr::plugins::request_classifier {
namespace {

using namespace std::chrono_literals;

ClassifyRequest request(std::string id, std::size_t input_tokens = 100) {
  return ClassifyRequest{
      ClassifyRequest::Arrival{.request_id = std::move(id), .input_tokens = input_tokens}};
}

TEST(ClassifyRequestTest, StartsWithTheDefaultDecisions) {
  const ClassifyRequest req = request("r1", 300);
  EXPECT_EQ(req.request_id(), "r1");
  EXPECT_EQ(req.input_tokens(), 300U);
  EXPECT_EQ(req.progress().context_tokens(), 300U);
  EXPECT_EQ(req.policy_class(), "default");
  EXPECT_EQ(req.due_at(), std::nullopt);
  EXPECT_EQ(req.scheduling_cost_tokens(), 300U);
  EXPECT_EQ(req.session_context(), nullptr);
  EXPECT_EQ(req.pinned_worker(), std::nullopt);
  EXPECT_EQ(req.worker_selection_target(), std::nullopt);
}

TEST(ClassifyRequestTest, KeepsWhatTheClassifierSets) {
  ClassifyRequest req = request("r1");
  req.set_policy_class("interactive");
  req.set_due_at(TimePoint{} + 2s);
  req.set_scheduling_cost_tokens(40);
  req.set_worker_selection_target(WorkerWithDpRank{7, 1});
  EXPECT_EQ(req.policy_class(), "interactive");
  EXPECT_EQ(req.due_at(), TimePoint{} + 2s);
  EXPECT_EQ(req.scheduling_cost_tokens(), 40U);
  using Target = ClassifyRequest::WorkerSelectionTarget;
  EXPECT_EQ(req.worker_selection_target(), (Target{7, 1}));
  EXPECT_FALSE(req.worker_selection_target_cleared());
  req.set_worker_selection_target(WorkerId{9});
  EXPECT_EQ(req.worker_selection_target(), (Target{9, std::nullopt})) << "every rank of worker 9";
  req.clear_worker_selection_target();
  EXPECT_EQ(req.worker_selection_target(), std::nullopt);
  EXPECT_TRUE(req.worker_selection_target_cleared()) << "the session's soft binding goes too";
}

TEST(ClassifyRequestTest, ExposesSessionAndPin) {
  const ClassifyRequest req{ClassifyRequest::Arrival{
      .request_id = std::nullopt,
      .input_tokens = 10,
      .session = SessionContext{"s1", "parent", true, InputTrigger::ToolResult},
      .pinned_worker = WorkerWithDpRank{3, 0}}};
  EXPECT_EQ(req.request_id(), std::nullopt);
  ASSERT_NE(req.session_context(), nullptr);
  EXPECT_EQ(req.session_context()->session_id(), "s1");
  EXPECT_EQ(req.session_context()->input_trigger(), InputTrigger::ToolResult);
  EXPECT_EQ(req.pinned_worker(), (WorkerWithDpRank{3, 0}));
}

TEST(ClassifyRequestTest, ExposesTenantAndArrivalTime) {
  EXPECT_EQ(request("r1").tenant(), std::nullopt);
  const ClassifyRequest req{ClassifyRequest::Arrival{.request_id = "r1",
                                                     .input_tokens = 10,
                                                     .session = std::nullopt,
                                                     .pinned_worker = std::nullopt,
                                                     .tenant = "alice",
                                                     .arrived_at = TimePoint{} + 3s}};
  EXPECT_EQ(req.tenant(), "alice");
  EXPECT_EQ(req.arrived_at(), TimePoint{} + 3s);
}

TEST(ClassifyRequestTest, CopiesShareAMonotonicProgress) {
  const ClassifyRequest req = request("r1", 100);
  const ClassifyRequest kept = req;
  req.shared_progress()->observe_context_tokens(250);
  req.shared_progress()->observe_context_tokens(200);
  EXPECT_EQ(kept.progress().context_tokens(), 250U);
}

TEST(RequestClassifierTest, TheDefaultClassifierAdmitsUnchanged) {
  RequestClassifier classifier;
  AdmissionFuture future = classifier.classify(request("r1", 64));
  PollContext context{TimePoint{}, [] {}};
  Poll answer = future.poll(context);
  ASSERT_TRUE(answer.is_ready());
  EXPECT_EQ(answer.request().request_id(), "r1");
  EXPECT_EQ(answer.request().input_tokens(), 64U);
}

// An in-flight limit written against the API: requests beyond the limit wait, parked with a
// Waker, until a Completed or Aborted event frees a slot.
class InFlightLimit final : public RequestClassifier {
 public:
  explicit InFlightLimit(std::size_t limit) : state_(std::make_shared<State>(limit)) {}

  AdmissionFuture classify(ClassifyRequest request) override {
    return AdmissionFuture::deferred(
        [state = state_, request = std::move(request)](PollContext& context) -> Poll {
          if (state->in_flight < state->limit) {
            ++state->in_flight;
            return Poll::ready(request);
          }
          state->waiting.push_back(context.waker());
          return Poll::pending();
        });
  }

  void on_event(const ClassifyEvent& event) override {
    if (!std::holds_alternative<Completed>(event) && !std::holds_alternative<Aborted>(event)) {
      return;
    }
    --state_->in_flight;
    if (!state_->waiting.empty()) {
      state_->waiting.front().wake();
      state_->waiting.pop_front();
    }
  }

 private:
  struct State {
    explicit State(std::size_t max) : limit(max) {}
    std::size_t limit;
    std::size_t in_flight = 0;
    std::deque<Waker> waiting;
  };
  std::shared_ptr<State> state_;
};

TEST(RequestClassifierTest, AParkedRequestIsAdmittedAfterAnEventWakesIt) {
  InFlightLimit classifier{1};
  std::vector<int> repoll;  // the ids the polling side was asked to poll again
  auto first = classifier.classify(request("r1"));
  auto second = classifier.classify(request("r2"));

  PollContext poll_first{TimePoint{}, [&] { repoll.push_back(1); }};
  ASSERT_TRUE(first.poll(poll_first).is_ready());
  PollContext poll_second{TimePoint{}, [&] { repoll.push_back(2); }};
  ASSERT_TRUE(second.poll(poll_second).is_pending());
  EXPECT_TRUE(repoll.empty());

  classifier.on_event(Sent{"r1", WorkerWithDpRank{1, 0}});
  EXPECT_TRUE(repoll.empty());
  classifier.on_event(Completed{"r1", WorkerWithDpRank{1, 0}, 180});
  EXPECT_EQ(repoll, std::vector<int>{2});

  PollContext again{TimePoint{} + 1ms, [&] { repoll.push_back(2); }};
  Poll answer = second.poll(again);
  ASSERT_TRUE(answer.is_ready());
  EXPECT_EQ(answer.request().request_id(), "r2");
}

TEST(RequestClassifierContextTest, ExposesBlockSizeAndWorkers) {
  const std::vector<ClassifierWorker> workers{{WorkerWithDpRank{1, 0}, 1000},
                                              {WorkerWithDpRank{1, 1}, 1200}};
  const RequestClassifierContext context{16, workers};
  EXPECT_EQ(context.block_size(), 16U);
  ASSERT_EQ(context.workers().size(), 2U);
  EXPECT_EQ(context.workers()[1].worker(), (WorkerWithDpRank{1, 1}));
  EXPECT_EQ(context.workers()[1].total_kv_blocks(), 1200U);
}

TEST(RequestClassifierContextTest, AWorkerWithoutCapacityHasNoTotalKvBlocks) {
  const std::vector<ClassifierWorker> workers{{WorkerWithDpRank{1, 0}, 1000},
                                              {WorkerWithDpRank{2, 0}, std::nullopt}};
  const RequestClassifierContext context{16, workers};
  ASSERT_EQ(context.workers().size(), 2U);
  EXPECT_EQ(context.workers()[0].total_kv_blocks(), 1000U);
  EXPECT_EQ(context.workers()[1].worker(), (WorkerWithDpRank{2, 0}));
  EXPECT_EQ(context.workers()[1].total_kv_blocks(), std::nullopt);
}

TEST(RequestClassifierParametersTest, ReadsStrictlyWithTheClassifierErrorType) {
  auto source =
      classifiers::ParameterSource::from_text("{max_in_flight: 32, burst: 4}", "parameters");
  ASSERT_TRUE(source.has_value()) << source.error();
  ParameterReader reader = RequestClassifierParameters{*source}.reader();
  std::expected<std::uint32_t, RequestClassifierProviderError> limit =
      reader.required<std::uint32_t>("max_in_flight");
  ASSERT_TRUE(limit.has_value());
  EXPECT_EQ(*limit, 32U);
  auto finished = reader.finish();
  ASSERT_FALSE(finished.has_value());
  EXPECT_EQ(finished.error().message(),
            "parameters: unknown parameter 'burst'; accepted: 'max_in_flight'");
}

TEST(RequestClassifierParametersTest, AbsentParametersAreEmpty) {
  ParameterReader reader = RequestClassifierParameters{nullptr}.reader();
  EXPECT_EQ(reader.optional<std::uint32_t>("max_in_flight", 8).value(), 8U);
  EXPECT_FALSE(reader.required<std::string>("mode").has_value());
}

}  // namespace
}  // namespace kvr::plugins::request_classifier
