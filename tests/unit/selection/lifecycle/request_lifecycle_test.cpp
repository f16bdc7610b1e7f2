// The generate-mode request lifecycle: Sent → Responding → Completed | Aborted, one retry on
// another worker for a failure before the first token, an explicit error after that, cancel and
// abort at every state, invalid events refused without effect, and every booking released exactly
// once. A small node stand-in carries out each step against a real SelectorState and
// SessionAffinity, as the lifecycle actor will.
#include "selection/lifecycle/request_lifecycle.hpp"

#include <type_traits>
#include <variant>

#include <gtest/gtest.h>

#include "discovery/block_hash.hpp"
#include "selection/config/router_policy_config.hpp"
#include "selection/partition/session_affinity.hpp"
#include "selection/policies/builtin_policies.hpp"
#include "tests/testing/worker_registration.hpp"

namespace kvr {
namespace {

using namespace std::chrono_literals;
namespace rc = plugins::request_classifier;

constexpr std::uint32_t kBlockSize = 16;
constexpr std::string_view kModel = "llama";
constexpr std::size_t kPromptTokens = 4 * kBlockSize;
const TimePoint kStart{std::chrono::seconds(1000)};
constexpr WorkerWithDpRank kA{1, 0};
constexpr WorkerWithDpRank kB{2, 0};

discovery::WorkerRegistration registration(WorkerId id) {
  return testing::worker_registration(id, std::string{kModel}, kBlockSize, 600s);
}

StreamChunk chunk(WorkerWithDpRank worker, std::uint32_t index, std::size_t tokens = 1,
                  bool finished = false) {
  return StreamChunk{.worker = worker, .index = index, .tokens = tokens, .finished = finished};
}

StreamChunk error_chunk(WorkerWithDpRank worker, std::uint32_t index, std::string error) {
  return StreamChunk{.worker = worker, .index = index, .error = std::move(error)};
}

// The names of classifier events, in order: "sent:1", "responding:1", "completed:1", "aborted:1".
std::vector<std::string> event_names(const std::vector<rc::ClassifyEvent>& events) {
  std::vector<std::string> names;
  for (const rc::ClassifyEvent& event : events) {
    names.push_back(std::visit(
        [](const auto& e) -> std::string {
          using E = std::decay_t<decltype(e)>;
          if constexpr (std::is_same_v<E, rc::Sent>) {
            return "sent:" + std::to_string(e.worker.worker_id);
          } else if constexpr (std::is_same_v<E, rc::Responding>) {
            return "responding:" + std::to_string(e.worker.worker_id);
          } else if constexpr (std::is_same_v<E, rc::Completed>) {
            return "completed:" + std::to_string(e.worker.worker_id);
          } else {
            return "aborted:" + (e.worker ? std::to_string(e.worker->worker_id) : std::string{"-"});
          }
        },
        event));
  }
  return names;
}

// One request as the node tracks it, and what the node did for it.
struct TrackedRequest {
  explicit TrackedRequest(std::string id, std::optional<SessionContext> context = std::nullopt)
      : lifecycle(std::move(id), kPromptTokens), session(std::move(context)) {}

  RequestLifecycle lifecycle;
  std::optional<SessionContext> session;
  /// Per booking (each successful route): how often the node released it.
  std::vector<int> releases_per_booking;
  int first_tokens = 0;
  int releases_of_removed_workers = 0;  // the selector had released them with the worker
  int dispatches = 0;
  int forwarded = 0;
  int cancels_at_worker = 0;
  int commits = 0;
  int abandons = 0;
  int finishes = 0;
  std::vector<rc::ClassifyEvent> events;
  std::vector<StreamEnd> stream_ends;
  std::vector<std::vector<WorkerId>> reroutes;
};

class RequestLifecycleTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto registered = selection::register_builtin_policies(registry_);
    ASSERT_TRUE(registered) << registered.error().message();
    make_state(SessionAffinityOptions{});
  }

  // Round-robin routing: first worker 1, then the next worker id after the last served.
  void make_state(SessionAffinityOptions affinity) {
    auto config = selection::parse_router_policy_config(
        "worker_selection: {aggregated: round-robin}", "test.yaml");
    ASSERT_TRUE(config) << config.error();
    auto plugins = registry_.resolve_plugins(*config);
    ASSERT_TRUE(plugins) << plugins.error().message();
    plugins_ = std::make_unique<plugins::RouterPlugins>(std::move(*plugins));
    SelectorOptions options;
    options.partition.model = std::string{kModel};
    options.router.block_size = kBlockSize;
    state_ = std::make_unique<SelectorState>(std::move(options), *plugins_);
    affinity_ = std::make_unique<SessionAffinity>(affinity);
  }

  void add_workers(std::initializer_list<WorkerId> ids) {
    for (const WorkerId id : ids) {
      auto added = state_->register_worker(registration(id), kStart);
      ASSERT_TRUE(added) << added.error().message();
      ASSERT_TRUE(state_->update_load({id, 0}, discovery::ConfirmedLoad{}));
    }
  }

  // Routes (or re-routes) the request, excluding the workers that failed it, and feeds the result
  // to its lifecycle.
  void route(TrackedRequest& request) {
    RouteRequest input;
    input.selection.request_id = request.lifecycle.request_id();
    input.selection.prompt_tokens = kPromptTokens;
    input.selection.block_hashes = blocks_;
    input.selection.session = request.session;
    const auto excluded = request.lifecycle.excluded_workers();
    input.selection.excluded_workers.assign(excluded.begin(), excluded.end());
    const auto routed = route_with_session_affinity(*state_, *affinity_, input, now_);
    if (routed) {
      request.releases_per_booking.push_back(0);
      apply(request, request.lifecycle.routed(routed->outcome.worker));
    } else {
      apply(request, request.lifecycle.route_failed(routed.error().code, routed.error().message));
    }
  }

  // Carries out a step in the documented order, as the node does.
  void apply(TrackedRequest& request, const LifecycleResult& result) {
    ASSERT_TRUE(result) << result.error().message;
    const LifecycleStep& step = *result;
    const std::string& id = request.lifecycle.request_id();
    if (step.cancel_at_worker) ++request.cancels_at_worker;
    if (step.first_token) {
      ++request.first_tokens;
      EXPECT_TRUE(state_->first_token(id)) << "prefill released twice or never booked";
    }
    if (step.commit_affinity) {
      ++request.commits;
      (void)affinity_->commit(id, now_);
    }
    if (step.release) {
      ASSERT_FALSE(request.releases_per_booking.empty()) << "release without a booking";
      ++request.releases_per_booking.back();
      const auto released = state_->release(id, *step.release);
      if (!released) {
        EXPECT_EQ(released.error(), discovery::LoadError::unknown_booking);
        ++request.releases_of_removed_workers;
      }
    }
    if (step.abandon_affinity) {
      ++request.abandons;
      (void)affinity_->abandon(id, now_);
    }
    if (step.finish_affinity) {
      ++request.finishes;
      (void)affinity_->finish(id, now_);
    }
    request.events.insert(request.events.end(), step.classifier_events.begin(),
                          step.classifier_events.end());
    if (step.forward_chunk) ++request.forwarded;
    if (step.end_stream) request.stream_ends.push_back(*step.end_stream);
    if (step.dispatch) ++request.dispatches;
    if (step.reroute) {
      request.reroutes.push_back(*step.reroute);
      route(request);
    }
  }

  // Every booking was released exactly once and the selector holds none.
  void expect_all_released_once(const TrackedRequest& request) {
    for (std::size_t i = 0; i < request.releases_per_booking.size(); ++i) {
      EXPECT_EQ(request.releases_per_booking[i], 1) << "booking " << i;
    }
    EXPECT_EQ(state_->partition_workers().load().open_bookings(), 0U);
    EXPECT_LE(request.first_tokens, static_cast<int>(request.releases_per_booking.size()));
  }

  std::vector<BlockHash> blocks_ = [] {
    std::vector<BlockHash> hashes;
    std::optional<BlockHash> parent;
    for (std::uint64_t i = 0; i < 4; ++i) {
      parent = discovery::BlockHasher::chain(parent, 7000 + i);
      hashes.push_back(*parent);
    }
    return hashes;
  }();
  TimePoint now_ = kStart;
  plugins::RouterPluginRegistry registry_;
  std::unique_ptr<plugins::RouterPlugins> plugins_;
  std::unique_ptr<SelectorState> state_;
  std::unique_ptr<SessionAffinity> affinity_;
};

// ---- happy path ---------------------------------------------------------------------------

TEST_F(RequestLifecycleTest, HappyPathSentRespondingCompleted) {
  add_workers({1, 2});
  TrackedRequest request{"r1"};
  EXPECT_EQ(request.lifecycle.state(), RequestState::Routing);
  route(request);
  EXPECT_EQ(request.lifecycle.state(), RequestState::Sent);
  EXPECT_EQ(request.lifecycle.worker(), kA);
  EXPECT_EQ(request.dispatches, 1);
  EXPECT_EQ(state_->partition_workers().load().rank_load(kA)->booked_prefill_tokens, kPromptTokens);

  apply(request, request.lifecycle.on_chunk(chunk(kA, 0, 1)));
  EXPECT_EQ(request.lifecycle.state(), RequestState::Responding);
  EXPECT_EQ(request.first_tokens, 1);
  EXPECT_EQ(state_->partition_workers().load().rank_load(kA)->booked_prefill_tokens, 0U);
  apply(request, request.lifecycle.on_chunk(chunk(kA, 1, 3)));
  EXPECT_EQ(request.first_tokens, 1) << "prefill is released once";
  apply(request, request.lifecycle.on_chunk(chunk(kA, 2, 2, /*finished=*/true)));

  EXPECT_EQ(request.lifecycle.state(), RequestState::Completed);
  EXPECT_TRUE(request.lifecycle.ended());
  EXPECT_EQ(request.forwarded, 3);
  EXPECT_EQ(request.lifecycle.output_tokens(), 6U);
  EXPECT_EQ(event_names(request.events),
            (std::vector<std::string>{"sent:1", "responding:1", "completed:1"}));
  EXPECT_EQ(std::get<rc::Completed>(request.events.back()).context_tokens, kPromptTokens + 6);
  EXPECT_TRUE(request.stream_ends.empty()) << "the worker's last chunk ends the stream";
  EXPECT_EQ(request.cancels_at_worker, 0);
  expect_all_released_once(request);
  EXPECT_EQ(request.releases_of_removed_workers, 0);
}

TEST_F(RequestLifecycleTest, FinishedFirstChunkIsRespondingAndCompletedInOneStep) {
  add_workers({1});
  TrackedRequest request{"r1"};
  route(request);
  const auto step = request.lifecycle.on_chunk(chunk(kA, 0, 1, /*finished=*/true));
  ASSERT_TRUE(step) << step.error().message;
  EXPECT_TRUE(step->first_token);
  EXPECT_TRUE(step->commit_affinity);
  EXPECT_TRUE(step->finish_affinity);
  EXPECT_EQ(step->release, discovery::BookingEnd::completed);
  EXPECT_EQ(event_names(step->classifier_events),
            (std::vector<std::string>{"responding:1", "completed:1"}));
  apply(request, step);
  expect_all_released_once(request);
}

// ---- retry before the first token ---------------------------------------------------------

TEST_F(RequestLifecycleTest, WorkerLostBeforeTheFirstTokenIsRetriedOnceElsewhere) {
  add_workers({1, 2});
  TrackedRequest request{"r1"};
  route(request);
  ASSERT_EQ(request.lifecycle.worker(), kA);

  const auto failed = request.lifecycle.worker_failed(kA.worker_id, "connection lost");
  ASSERT_TRUE(failed) << failed.error().message;
  EXPECT_EQ(failed->release, discovery::BookingEnd::failed);
  EXPECT_TRUE(failed->abandon_affinity);
  EXPECT_TRUE(failed->cancel_at_worker) << "the worker may still be running it";
  ASSERT_TRUE(failed->reroute);
  EXPECT_EQ(*failed->reroute, (std::vector<WorkerId>{kA.worker_id}));
  EXPECT_TRUE(failed->classifier_events.empty());
  EXPECT_FALSE(failed->end_stream);
  apply(request, failed);  // re-routes, excluding worker 1

  EXPECT_EQ(request.lifecycle.state(), RequestState::Sent);
  EXPECT_EQ(request.lifecycle.worker(), kB);
  EXPECT_EQ(request.lifecycle.retries(), 1U);
  apply(request, request.lifecycle.on_chunk(chunk(kB, 0)));
  apply(request, request.lifecycle.on_chunk(chunk(kB, 1, 1, /*finished=*/true)));
  EXPECT_EQ(request.lifecycle.state(), RequestState::Completed);
  EXPECT_EQ(event_names(request.events),
            (std::vector<std::string>{"sent:1", "sent:2", "responding:2", "completed:2"}));
  EXPECT_EQ(request.dispatches, 2);
  EXPECT_EQ(request.releases_per_booking.size(), 2U);
  expect_all_released_once(request);
}

TEST_F(RequestLifecycleTest, ErrorChunkBeforeAnyTokenIsRetriedWithoutCancellingTheWorker) {
  add_workers({1, 2});
  TrackedRequest request{"r1"};
  route(request);
  const auto failed = request.lifecycle.on_chunk(error_chunk(kA, 0, "CUDA out of memory"));
  ASSERT_TRUE(failed) << failed.error().message;
  EXPECT_FALSE(failed->cancel_at_worker) << "the worker ended the request itself";
  EXPECT_FALSE(failed->forward_chunk) << "nothing of the failed attempt reaches the client";
  ASSERT_TRUE(failed->reroute);
  apply(request, failed);
  EXPECT_EQ(request.lifecycle.worker(), kB);
  // The new worker's stream starts again at index 0.
  apply(request, request.lifecycle.on_chunk(chunk(kB, 0, 1, /*finished=*/true)));
  EXPECT_EQ(request.lifecycle.state(), RequestState::Completed);
  EXPECT_EQ(request.forwarded, 1);
  expect_all_released_once(request);
}

TEST_F(RequestLifecycleTest, RemovedWorkerBeforeTheFirstTokenIsRetriedAndItsBookingIsGone) {
  add_workers({1, 2});
  TrackedRequest request{"r1"};
  route(request);
  // The selector drops the worker with its bookings; the lifecycle is told afterwards.
  ASSERT_TRUE(state_->deregister(kA.worker_id, 1));
  apply(request, request.lifecycle.worker_failed(kA.worker_id, "worker removed"));
  EXPECT_EQ(request.releases_of_removed_workers, 1);
  EXPECT_EQ(request.lifecycle.worker(), kB);
  apply(request, request.lifecycle.on_chunk(chunk(kB, 0, 1, /*finished=*/true)));
  expect_all_released_once(request);
}

TEST_F(RequestLifecycleTest, SecondFailureBeforeTheFirstTokenIsAnExplicitError) {
  add_workers({1, 2, 3});
  TrackedRequest request{"r1"};
  route(request);
  apply(request, request.lifecycle.worker_failed(kA.worker_id, "connection lost"));
  ASSERT_EQ(request.lifecycle.worker(), kB);

  const auto failed = request.lifecycle.on_chunk(error_chunk(kB, 0, "engine crashed"));
  ASSERT_TRUE(failed) << failed.error().message;
  EXPECT_FALSE(failed->reroute) << "one retry only, although worker 3 is there";
  EXPECT_EQ(failed->release, discovery::BookingEnd::failed);
  EXPECT_TRUE(failed->abandon_affinity);
  ASSERT_TRUE(failed->end_stream);
  EXPECT_EQ(failed->end_stream->finish_reason, "error");
  EXPECT_EQ(failed->end_stream->error, Error::worker_failed);
  EXPECT_NE(failed->end_stream->message.find("engine crashed"), std::string::npos)
      << failed->end_stream->message;
  apply(request, failed);

  EXPECT_EQ(request.lifecycle.state(), RequestState::Aborted);
  EXPECT_EQ(event_names(request.events),
            (std::vector<std::string>{"sent:1", "sent:2", "aborted:2"}));
  EXPECT_EQ(request.lifecycle.excluded_workers().size(), 2U);
  EXPECT_EQ(request.stream_ends.size(), 1U);
  expect_all_released_once(request);
}

TEST_F(RequestLifecycleTest, RetryThatFindsNoOtherWorkerIsAnExplicitError) {
  add_workers({1});
  TrackedRequest request{"r1"};
  route(request);
  apply(request, request.lifecycle.worker_failed(kA.worker_id, "connection lost"));
  EXPECT_EQ(request.lifecycle.state(), RequestState::Aborted);
  ASSERT_EQ(request.stream_ends.size(), 1U);
  EXPECT_EQ(request.stream_ends[0].error, Error::worker_failed);
  EXPECT_NE(request.stream_ends[0].message.find("connection lost"), std::string::npos)
      << request.stream_ends[0].message;
  EXPECT_EQ(event_names(request.events), (std::vector<std::string>{"sent:1", "aborted:1"}));
  EXPECT_EQ(request.releases_per_booking.size(), 1U);
  expect_all_released_once(request);
}

TEST_F(RequestLifecycleTest, RoutingFailureBeforeAnyWorkerAbortsWithoutAWorker) {
  TrackedRequest request{"r1"};  // no workers at all
  route(request);
  EXPECT_EQ(request.lifecycle.state(), RequestState::Aborted);
  EXPECT_EQ(event_names(request.events), (std::vector<std::string>{"aborted:-"}));
  ASSERT_EQ(request.stream_ends.size(), 1U);
  EXPECT_EQ(request.stream_ends[0].error, Error::no_workers);
  EXPECT_TRUE(request.releases_per_booking.empty());
  EXPECT_EQ(request.dispatches, 0);
}

// ---- failure after the first token --------------------------------------------------------

TEST_F(RequestLifecycleTest, WorkerDeathAfterTheFirstTokenAbortsWithoutRetry) {
  add_workers({1, 2});
  TrackedRequest request{"r1"};
  route(request);
  apply(request, request.lifecycle.on_chunk(chunk(kA, 0, 4)));
  const auto failed = request.lifecycle.worker_failed(kA.worker_id, "connection lost");
  ASSERT_TRUE(failed) << failed.error().message;
  EXPECT_FALSE(failed->reroute);
  EXPECT_EQ(failed->release, discovery::BookingEnd::failed);
  EXPECT_TRUE(failed->finish_affinity);
  EXPECT_FALSE(failed->abandon_affinity);
  ASSERT_TRUE(failed->end_stream);
  EXPECT_EQ(failed->end_stream->error, Error::worker_failed);
  apply(request, failed);
  EXPECT_EQ(request.lifecycle.state(), RequestState::Aborted);
  EXPECT_EQ(request.lifecycle.retries(), 0U);
  EXPECT_EQ(event_names(request.events),
            (std::vector<std::string>{"sent:1", "responding:1", "aborted:1"}));
  expect_all_released_once(request);
}

TEST_F(RequestLifecycleTest, ErrorChunkAfterTheFirstTokenAbortsWithoutRetry) {
  add_workers({1, 2});
  TrackedRequest request{"r1"};
  route(request);
  apply(request, request.lifecycle.on_chunk(chunk(kA, 0)));
  apply(request, request.lifecycle.on_chunk(error_chunk(kA, 1, "decode failed")));
  EXPECT_EQ(request.lifecycle.state(), RequestState::Aborted);
  EXPECT_EQ(request.dispatches, 1);
  EXPECT_EQ(request.cancels_at_worker, 0);
  ASSERT_EQ(request.stream_ends.size(), 1U);
  EXPECT_NE(request.stream_ends[0].message.find("decode failed"), std::string::npos);
  expect_all_released_once(request);
}

// ---- cancel and abort ---------------------------------------------------------------------

TEST_F(RequestLifecycleTest, CancelWhileRoutingReleasesTheLateBookingWithoutDispatch) {
  add_workers({1});
  TrackedRequest request{"r1"};
  const auto cancelled = request.lifecycle.cancel("client went away");
  ASSERT_TRUE(cancelled) << cancelled.error().message;
  EXPECT_FALSE(cancelled->release) << "nothing is booked yet";
  EXPECT_FALSE(cancelled->cancel_at_worker);
  ASSERT_TRUE(cancelled->end_stream);
  EXPECT_EQ(cancelled->end_stream->finish_reason, "cancelled");
  apply(request, cancelled);
  EXPECT_EQ(event_names(request.events), (std::vector<std::string>{"aborted:-"}));
  // The route that was in flight completes afterwards: its booking is undone, not dispatched.
  route(request);
  EXPECT_EQ(request.dispatches, 0);
  EXPECT_EQ(request.lifecycle.state(), RequestState::Aborted);
  EXPECT_EQ(event_names(request.events), (std::vector<std::string>{"aborted:-"}));
  expect_all_released_once(request);
  // A route failure arriving after the cancel changes nothing either.
  const auto late_failure = request.lifecycle.route_failed(Error::no_workers, "none");
  ASSERT_TRUE(late_failure);
  EXPECT_TRUE(late_failure->empty());
}

TEST_F(RequestLifecycleTest, CancelWhileSentReleasesAndTellsTheWorker) {
  add_workers({1});
  TrackedRequest request{"r1"};
  route(request);
  const auto cancelled = request.lifecycle.cancel("client went away");
  ASSERT_TRUE(cancelled) << cancelled.error().message;
  EXPECT_TRUE(cancelled->cancel_at_worker);
  EXPECT_EQ(cancelled->release, discovery::BookingEnd::cancelled);
  EXPECT_TRUE(cancelled->abandon_affinity);
  EXPECT_FALSE(cancelled->first_token);
  apply(request, cancelled);
  EXPECT_EQ(event_names(request.events), (std::vector<std::string>{"sent:1", "aborted:1"}));
  expect_all_released_once(request);
}

TEST_F(RequestLifecycleTest, CancelWhileRespondingReleasesAndFinishesAffinity) {
  add_workers({1});
  TrackedRequest request{"r1"};
  route(request);
  apply(request, request.lifecycle.on_chunk(chunk(kA, 0)));
  const auto cancelled = request.lifecycle.cancel("client went away");
  ASSERT_TRUE(cancelled) << cancelled.error().message;
  EXPECT_TRUE(cancelled->cancel_at_worker);
  EXPECT_EQ(cancelled->release, discovery::BookingEnd::cancelled);
  EXPECT_TRUE(cancelled->finish_affinity);
  apply(request, cancelled);
  EXPECT_EQ(event_names(request.events),
            (std::vector<std::string>{"sent:1", "responding:1", "aborted:1"}));
  expect_all_released_once(request);
}

TEST_F(RequestLifecycleTest, CancelWhileAwaitingTheRetryReleasesNothingMore) {
  add_workers({1, 2});
  TrackedRequest request{"r1"};
  route(request);
  // The failure is reported, but the node has not re-routed yet.
  const auto failed = request.lifecycle.worker_failed(kA.worker_id, "connection lost");
  ASSERT_TRUE(failed);
  ++request.releases_per_booking.back();
  ASSERT_TRUE(state_->release("r1", *failed->release));
  EXPECT_EQ(request.lifecycle.state(), RequestState::Routing);
  const auto cancelled = request.lifecycle.cancel("client went away");
  ASSERT_TRUE(cancelled) << cancelled.error().message;
  EXPECT_FALSE(cancelled->release) << "the failed attempt was already released";
  EXPECT_FALSE(cancelled->cancel_at_worker);
  EXPECT_EQ(event_names(cancelled->classifier_events), (std::vector<std::string>{"aborted:1"}));
  apply(request, cancelled);
  expect_all_released_once(request);
}

TEST_F(RequestLifecycleTest, CancelOrAbortAfterTheEndIsRefused) {
  add_workers({1});
  TrackedRequest request{"r1"};
  route(request);
  apply(request, request.lifecycle.on_chunk(chunk(kA, 0, 1, /*finished=*/true)));
  const auto cancelled = request.lifecycle.cancel("late");
  ASSERT_FALSE(cancelled);
  EXPECT_EQ(cancelled.error().kind, LifecycleError::Kind::after_end);
  const auto aborted = request.lifecycle.abort(Error::timeout, "late");
  ASSERT_FALSE(aborted);
  EXPECT_EQ(aborted.error().kind, LifecycleError::Kind::after_end);
  EXPECT_EQ(request.lifecycle.state(), RequestState::Completed);
  expect_all_released_once(request);
}

TEST_F(RequestLifecycleTest, AbortEndsTheRequestWithItsErrorCode) {
  add_workers({1});
  TrackedRequest request{"r1"};
  route(request);
  apply(request, request.lifecycle.on_chunk(chunk(kA, 0)));
  const auto aborted = request.lifecycle.abort(Error::unavailable, "partition moved");
  ASSERT_TRUE(aborted) << aborted.error().message;
  EXPECT_EQ(aborted->release, discovery::BookingEnd::failed);
  EXPECT_TRUE(aborted->cancel_at_worker);
  ASSERT_TRUE(aborted->end_stream);
  EXPECT_EQ(aborted->end_stream->error, Error::unavailable);
  EXPECT_FALSE(aborted->reroute) << "kvr gave up: no retry";
  apply(request, aborted);
  EXPECT_EQ(request.lifecycle.state(), RequestState::Aborted);
  expect_all_released_once(request);
}

// ---- invalid events -----------------------------------------------------------------------

TEST_F(RequestLifecycleTest, ChunkAfterCompletionAndDuplicateCompletionAreRefused) {
  add_workers({1});
  TrackedRequest request{"r1"};
  route(request);
  apply(request, request.lifecycle.on_chunk(chunk(kA, 0, 1, /*finished=*/true)));
  const auto extra = request.lifecycle.on_chunk(chunk(kA, 1));
  ASSERT_FALSE(extra);
  EXPECT_EQ(extra.error().kind, LifecycleError::Kind::after_end);
  EXPECT_NE(extra.error().message.find("r1"), std::string::npos) << extra.error().message;
  const auto again = request.lifecycle.on_chunk(chunk(kA, 1, 1, /*finished=*/true));
  ASSERT_FALSE(again);
  EXPECT_EQ(again.error().kind, LifecycleError::Kind::after_end);
  const auto error_after = request.lifecycle.on_chunk(error_chunk(kA, 1, "late"));
  ASSERT_FALSE(error_after);
  EXPECT_EQ(request.lifecycle.state(), RequestState::Completed);
  EXPECT_EQ(event_names(request.events),
            (std::vector<std::string>{"sent:1", "responding:1", "completed:1"}));
  expect_all_released_once(request);
}

TEST_F(RequestLifecycleTest, ChunksFromAnotherWorkerOrSeenBeforeAreRefused) {
  add_workers({1, 2});
  TrackedRequest request{"r1"};
  route(request);
  const auto stranger = request.lifecycle.on_chunk(chunk(kB, 0));
  ASSERT_FALSE(stranger);
  EXPECT_EQ(stranger.error().kind, LifecycleError::Kind::stale_worker);
  const auto other_rank = request.lifecycle.on_chunk(chunk({kA.worker_id, 1}, 0));
  ASSERT_FALSE(other_rank);
  EXPECT_EQ(other_rank.error().kind, LifecycleError::Kind::stale_worker);
  EXPECT_EQ(request.lifecycle.state(), RequestState::Sent) << "refused events change nothing";
  apply(request, request.lifecycle.on_chunk(chunk(kA, 0)));
  const auto repeated = request.lifecycle.on_chunk(chunk(kA, 0));
  ASSERT_FALSE(repeated);
  EXPECT_EQ(repeated.error().kind, LifecycleError::Kind::out_of_order);
  apply(request, request.lifecycle.on_chunk(chunk(kA, 1, 1, /*finished=*/true)));
  expect_all_released_once(request);
}

// Chunks lost on the way (here the first one): the stream cannot be whole, so the attempt fails,
// the worker is told to stop, and the request is retried on another worker.
TEST_F(RequestLifecycleTest, AGapBeforeTheFirstTokenRetriesOnAnotherWorker) {
  add_workers({1, 2});
  TrackedRequest request{"r1"};
  route(request);
  apply(request, request.lifecycle.on_chunk(chunk(kA, 1)));
  EXPECT_EQ(request.cancels_at_worker, 1);
  ASSERT_EQ(request.lifecycle.worker(), kB);
  EXPECT_EQ(request.lifecycle.state(), RequestState::Sent);
  EXPECT_EQ(request.forwarded, 0) << "nothing of the broken attempt reached the client";
  apply(request, request.lifecycle.on_chunk(chunk(kB, 0, 1, /*finished=*/true)));
  EXPECT_EQ(request.lifecycle.state(), RequestState::Completed);
  EXPECT_EQ(event_names(request.events),
            (std::vector<std::string>{"sent:1", "sent:2", "responding:2", "completed:2"}));
  expect_all_released_once(request);
}

// After the first token a gap ends the stream with an explicit error naming the lost chunks.
TEST_F(RequestLifecycleTest, AGapAfterTheFirstTokenEndsTheStreamWithAnError) {
  add_workers({1, 2});
  TrackedRequest request{"r1"};
  route(request);
  apply(request, request.lifecycle.on_chunk(chunk(kA, 0)));
  apply(request, request.lifecycle.on_chunk(chunk(kA, 3)));
  EXPECT_EQ(request.lifecycle.state(), RequestState::Aborted);
  EXPECT_EQ(request.cancels_at_worker, 1);
  EXPECT_EQ(request.forwarded, 1) << "only the first chunk";
  ASSERT_EQ(request.stream_ends.size(), 1U);
  EXPECT_EQ(request.stream_ends[0].finish_reason, "error");
  EXPECT_EQ(request.stream_ends[0].error, Error::worker_failed);
  EXPECT_NE(request.stream_ends[0].message.find("chunks 1 to 2 of worker 1 were lost"),
            std::string::npos)
      << request.stream_ends[0].message;
  EXPECT_EQ(event_names(request.events),
            (std::vector<std::string>{"sent:1", "responding:1", "aborted:1"}));
  expect_all_released_once(request);
}

TEST_F(RequestLifecycleTest, LateChunkOfTheFailedWorkerIsRefusedAfterTheRetry) {
  add_workers({1, 2});
  TrackedRequest request{"r1"};
  route(request);
  apply(request, request.lifecycle.worker_failed(kA.worker_id, "connection lost"));
  ASSERT_EQ(request.lifecycle.worker(), kB);
  const auto late = request.lifecycle.on_chunk(chunk(kA, 0));
  ASSERT_FALSE(late);
  EXPECT_EQ(late.error().kind, LifecycleError::Kind::stale_worker);
  EXPECT_EQ(request.lifecycle.state(), RequestState::Sent);
  apply(request, request.lifecycle.on_chunk(chunk(kB, 0, 1, /*finished=*/true)));
  expect_all_released_once(request);
}

TEST_F(RequestLifecycleTest, UnrelatedWorkerFailureChangesNothing) {
  add_workers({1, 2});
  TrackedRequest request{"r1"};
  route(request);
  const auto other = request.lifecycle.worker_failed(kB.worker_id, "worker removed");
  ASSERT_TRUE(other);
  EXPECT_TRUE(other->empty());
  EXPECT_EQ(request.lifecycle.state(), RequestState::Sent);
  apply(request, request.lifecycle.on_chunk(chunk(kA, 0, 1, /*finished=*/true)));
  const auto after_end = request.lifecycle.worker_failed(kA.worker_id, "worker removed");
  ASSERT_TRUE(after_end);
  EXPECT_TRUE(after_end->empty());
  expect_all_released_once(request);
}

TEST_F(RequestLifecycleTest, RoutingTwiceOrToAnExcludedWorkerIsRefused) {
  add_workers({1, 2});
  TrackedRequest request{"r1"};
  route(request);
  const auto twice = request.lifecycle.routed(kB);
  ASSERT_FALSE(twice);
  EXPECT_EQ(twice.error().kind, LifecycleError::Kind::invalid_state);
  EXPECT_EQ(request.lifecycle.worker(), kA);

  RequestLifecycle retrying{"r2", kPromptTokens};
  ASSERT_TRUE(retrying.routed(kA));
  const auto failed = retrying.worker_failed(kA.worker_id, "connection lost");
  ASSERT_TRUE(failed && failed->reroute);
  const auto excluded = retrying.routed(kA);
  ASSERT_FALSE(excluded);
  EXPECT_EQ(excluded.error().kind, LifecycleError::Kind::invalid_state);
  EXPECT_EQ(retrying.state(), RequestState::Routing);
  const auto route_failure_while_sent = request.lifecycle.route_failed(Error::no_workers, "x");
  ASSERT_FALSE(route_failure_while_sent);
  EXPECT_EQ(route_failure_while_sent.error().kind, LifecycleError::Kind::invalid_state);
}

TEST_F(RequestLifecycleTest, ZeroRetriesMeansTheFirstFailureIsFinal) {
  RequestLifecycle lifecycle{"r1", kPromptTokens, LifecycleOptions{.max_retries = 0}};
  ASSERT_TRUE(lifecycle.routed(kA));
  const auto failed = lifecycle.worker_failed(kA.worker_id, "connection lost");
  ASSERT_TRUE(failed);
  EXPECT_FALSE(failed->reroute);
  EXPECT_EQ(lifecycle.state(), RequestState::Aborted);
}

TEST_F(RequestLifecycleTest, StateNames) {
  EXPECT_EQ(as_str(RequestState::Routing), "routing");
  EXPECT_EQ(as_str(RequestState::Sent), "sent");
  EXPECT_EQ(as_str(RequestState::Responding), "responding");
  EXPECT_EQ(as_str(RequestState::Completed), "completed");
  EXPECT_EQ(as_str(RequestState::Aborted), "aborted");
}

// ---- with session affinity ----------------------------------------------------------------

TEST_F(RequestLifecycleTest, SoftSessionBindsToTheRetriedWorkerAtItsFirstToken) {
  make_state(SessionAffinityOptions{.ttl = 60s, .mode = SessionAffinityMode::soft});
  add_workers({1, 2});
  TrackedRequest request{"r1", SessionContext{"s", std::nullopt, std::nullopt, std::nullopt}};
  route(request);
  apply(request, request.lifecycle.worker_failed(kA.worker_id, "connection lost"));
  EXPECT_EQ(request.abandons, 1);
  EXPECT_FALSE(affinity_->binding("s", now_)) << "the failed attempt bound nothing";
  ASSERT_EQ(request.lifecycle.worker(), kB);
  apply(request, request.lifecycle.on_chunk(chunk(kB, 0)));
  EXPECT_EQ(affinity_->binding("s", now_), kB);
  apply(request, request.lifecycle.on_chunk(chunk(kB, 1, 1, /*finished=*/true)));
  EXPECT_EQ(request.commits, 1);
  EXPECT_EQ(request.finishes, 1);
  EXPECT_EQ(affinity_->open_requests(), 0U);
  expect_all_released_once(request);
}

TEST_F(RequestLifecycleTest, HardSessionRetryDropsTheBindingToTheFailedWorker) {
  make_state(SessionAffinityOptions{.ttl = 60s, .mode = SessionAffinityMode::hard});
  add_workers({1, 2});
  const SessionContext s{"s", std::nullopt, std::nullopt, std::nullopt};
  TrackedRequest first{"r1", s};
  route(first);
  apply(first, first.lifecycle.on_chunk(chunk(kA, 0, 1, /*finished=*/true)));
  ASSERT_EQ(affinity_->binding("s", now_), kA);

  // Request 2 is dispatched to the bound worker, which dies before the first token: the retry
  // cannot use the binding (its worker is excluded), drops it and binds the new pick.
  TrackedRequest second{"r2", s};
  route(second);
  ASSERT_EQ(second.lifecycle.worker(), kA);
  apply(second, second.lifecycle.worker_failed(kA.worker_id, "connection lost"));
  EXPECT_EQ(second.lifecycle.worker(), kB);
  EXPECT_EQ(affinity_->binding("s", now_), kB);
  apply(second, second.lifecycle.on_chunk(chunk(kB, 0, 1, /*finished=*/true)));
  EXPECT_EQ(affinity_->binding("s", now_), kB);
  expect_all_released_once(first);
  expect_all_released_once(second);
}

}  // namespace
}  // namespace kvr
