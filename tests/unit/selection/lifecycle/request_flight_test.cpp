// A request's flight driven by hand, time included: first token and completion, the first-token
// and stall deadlines, retries as a setting, both hops of a disaggregated request with their
// failure rules (docs/disaggregation.md), cancel at every stage, and every booking released
// exactly once under every interleaving of the inputs (explored exhaustively to a depth).
#include "selection/lifecycle/request_flight.hpp"

#include <algorithm>
#include <type_traits>
#include <variant>

#include <gtest/gtest.h>

namespace kvr {
namespace {

using namespace std::chrono_literals;
namespace rc = plugins::request_classifier;

constexpr std::size_t kPromptTokens = 64;
const FlightTime kStart{std::chrono::seconds(1000)};
constexpr WorkerWithDpRank kA{1, 0};
constexpr WorkerWithDpRank kB{2, 0};
constexpr WorkerWithDpRank kC{3, 0};
constexpr WorkerWithDpRank kP{10, 0};
constexpr WorkerWithDpRank kQ{11, 0};
constexpr std::string_view kAnswer = R"({"do_remote_prefill":true,"remote_block_ids":[1,2]})";

StreamChunk chunk(WorkerWithDpRank worker, std::uint32_t index, bool finished = false) {
  return StreamChunk{.worker = worker,
                     .index = index,
                     .tokens = 1,
                     .finished = finished,
                     .finish_reason = finished ? "length" : ""};
}

StreamChunk error_chunk(WorkerWithDpRank worker, std::uint32_t index) {
  return StreamChunk{.worker = worker, .index = index, .error = "out of blocks"};
}

// A prefill worker's answer: its one token and where the KV is.
StreamChunk prefill_answer(WorkerWithDpRank worker, std::string params = std::string{kAnswer}) {
  StreamChunk answer = chunk(worker, 0, true);
  answer.kv_transfer_params = std::move(params);
  return answer;
}

std::string terminal_event(const std::vector<rc::ClassifyEvent>& events) {
  std::string names;
  for (const auto& event : events) {
    names += std::visit(
        [](const auto& e) -> std::string {
          using E = std::decay_t<decltype(e)>;
          if constexpr (std::is_same_v<E, rc::Sent>) return "S";
          if constexpr (std::is_same_v<E, rc::Responding>) return "R";
          if constexpr (std::is_same_v<E, rc::Completed>) return "C";
          return "A";
        },
        event);
  }
  return names;
}

FlightStep ok(const FlightResult& result) {
  EXPECT_TRUE(result) << result.error().message;
  return result ? *result : FlightStep{};
}

// ---- single hop -------------------------------------------------------------------------------

TEST(RequestFlightTest, StartsWithAPlanAndDispatchesWhereRouted) {
  RequestFlight flight("r1", kPromptTokens);
  const FlightStep start = flight.start(kStart);
  ASSERT_TRUE(start.route);
  EXPECT_FALSE(start.route->decode_after_transfer);
  EXPECT_FALSE(start.route->retry);
  EXPECT_TRUE(start.route->excluded.empty());
  EXPECT_FALSE(flight.deadline());

  const FlightStep routed =
      ok(flight.routed({.worker = kA, .predicted_cached_tokens = 32}, kStart));
  ASSERT_TRUE(routed.dispatch);
  EXPECT_EQ(routed.dispatch->worker, kA);
  EXPECT_EQ(routed.dispatch->hop, FlightHop::single);
  EXPECT_FALSE(routed.dispatch->max_output_tokens);
  EXPECT_TRUE(routed.dispatch->kv_transfer_params.empty());
  EXPECT_EQ(terminal_event(routed.classifier_events), "S");
  EXPECT_EQ(flight.deadline(), kStart + 30s);
}

TEST(RequestFlightTest, FirstTokenBooksPrefillDoneAndRecordsTheCacheOutcomeOnce) {
  RequestFlight flight("r1", kPromptTokens);
  (void)flight.start(kStart);
  (void)ok(flight.routed({.worker = kA, .predicted_cached_tokens = 32}, kStart));
  StreamChunk first = chunk(kA, 0);
  first.cached_prompt_tokens = 16;
  const FlightStep step = ok(flight.on_chunk(first, kStart + 5ms));
  ASSERT_TRUE(step.first_token);
  EXPECT_FALSE(step.first_token->release);
  EXPECT_EQ(step.first_token->affinity, AffinityAction::commit);
  ASSERT_TRUE(step.first_token->health);
  EXPECT_FALSE(step.first_token->health->failure);
  ASSERT_TRUE(step.cache_outcome);
  EXPECT_EQ(step.cache_outcome->predicted_cached_tokens, 32U);
  EXPECT_EQ(step.cache_outcome->delivered_cached_tokens, 16U);
  EXPECT_TRUE(step.forward_chunk);
  EXPECT_FALSE(step.release);
  EXPECT_EQ(step.context_tokens, kPromptTokens + 1);

  const FlightStep second = ok(flight.on_chunk(chunk(kA, 1), kStart + 6ms));
  EXPECT_FALSE(second.first_token);
  EXPECT_FALSE(second.cache_outcome);
  const FlightStep last = ok(flight.on_chunk(chunk(kA, 2, true), kStart + 7ms));
  ASSERT_TRUE(last.release);
  EXPECT_EQ(last.release->end, discovery::BookingEnd::completed);
  EXPECT_EQ(last.release->affinity, AffinityAction::finish);
  EXPECT_TRUE(last.completed);
  EXPECT_EQ(flight.forwarded(), 3U);
  EXPECT_TRUE(flight.ended());
  EXPECT_FALSE(flight.deadline());
  EXPECT_FALSE(flight.on_chunk(chunk(kA, 3), kStart + 8ms));
}

TEST(RequestFlightTest, NoFirstChunkInTimeRetriesElsewhereThenEndsTheStream) {
  RequestFlight flight("r1", kPromptTokens, FlightOptions{.first_token_timeout = 100ms});
  (void)flight.start(kStart);
  (void)ok(flight.routed({.worker = kA}, kStart));
  EXPECT_TRUE(flight.tick(kStart + 99ms).release == std::nullopt);

  const FlightStep timeout = flight.tick(kStart + 100ms);
  EXPECT_EQ(timeout.timed_out, FlightTimeout::first_token);
  EXPECT_EQ(timeout.cancel_at_worker, kA);
  ASSERT_TRUE(timeout.release);
  EXPECT_EQ(timeout.release->end, discovery::BookingEnd::failed);
  EXPECT_EQ(timeout.release->affinity, AffinityAction::abandon);
  ASSERT_TRUE(timeout.release->health);
  EXPECT_EQ(timeout.release->health->failure, FailureCause::first_token_timeout);
  ASSERT_TRUE(timeout.route);
  EXPECT_TRUE(timeout.route->retry);
  EXPECT_EQ(timeout.route->excluded, std::vector<WorkerId>{kA.worker_id});
  EXPECT_FALSE(flight.deadline());

  (void)ok(flight.routed({.worker = kB}, kStart + 110ms));
  EXPECT_EQ(flight.deadline(), kStart + 210ms);
  const FlightStep again = flight.tick(kStart + 210ms);
  ASSERT_TRUE(again.end_stream);
  EXPECT_EQ(again.end_stream->error, Error::worker_failed);
  EXPECT_NE(again.end_stream->message.find("no retry is left"), std::string::npos);
  EXPECT_FALSE(again.route);
  EXPECT_EQ(terminal_event(again.classifier_events), "A");
  EXPECT_TRUE(flight.ended());
}

TEST(RequestFlightTest, TheRetryCountIsASetting) {
  for (const std::uint32_t retries : {0U, 1U, 3U}) {
    RequestFlight flight("r1", kPromptTokens, FlightOptions{.max_retries = retries});
    (void)flight.start(kStart);
    std::uint32_t routes = 0;
    WorkerId next = 1;
    FlightStep step = ok(flight.routed({.worker = {next, 0}}, kStart));
    while (!flight.ended()) {
      step = ok(flight.on_chunk(error_chunk({next, 0}, 0), kStart));
      if (!step.route) break;
      ++routes;
      EXPECT_EQ(step.route->excluded.size(), routes);
      (void)ok(flight.routed({.worker = {++next, 0}}, kStart));
    }
    EXPECT_EQ(routes, retries);
    EXPECT_EQ(flight.retries(), retries);
    ASSERT_TRUE(step.end_stream);
    EXPECT_EQ(step.end_stream->error, Error::worker_failed);
  }
}

TEST(RequestFlightTest, AStalledStreamEndsWithATimeoutAgainstItsWorker) {
  RequestFlight flight("r1", kPromptTokens, FlightOptions{.stall_timeout = 50ms});
  (void)flight.start(kStart);
  (void)ok(flight.routed({.worker = kA}, kStart));
  (void)ok(flight.on_chunk(chunk(kA, 0), kStart + 10ms));
  EXPECT_EQ(flight.deadline(), kStart + 60ms);
  (void)ok(flight.on_chunk(chunk(kA, 1), kStart + 40ms));
  // The deadline moves with each chunk: a tick at the old one does nothing.
  EXPECT_FALSE(flight.tick(kStart + 60ms).end_stream);
  EXPECT_EQ(flight.deadline(), kStart + 90ms);

  const FlightStep stalled = flight.tick(kStart + 90ms);
  EXPECT_EQ(stalled.timed_out, FlightTimeout::stall);
  ASSERT_TRUE(stalled.end_stream);
  EXPECT_EQ(stalled.end_stream->error, Error::timeout);
  EXPECT_NE(stalled.end_stream->message.find("after chunk 1"), std::string::npos);
  EXPECT_EQ(stalled.cancel_at_worker, kA);
  ASSERT_TRUE(stalled.release);
  EXPECT_EQ(stalled.release->affinity, AffinityAction::finish);
  ASSERT_TRUE(stalled.release->health);
  EXPECT_EQ(stalled.release->health->failure, FailureCause::stream_timeout);
  EXPECT_FALSE(stalled.route);  // tokens reached the client: never retried
}

TEST(RequestFlightTest, AFailedDispatchCountsAgainstTheWorkerAndRetries) {
  RequestFlight flight("r1", kPromptTokens);
  (void)flight.start(kStart);
  (void)ok(flight.routed({.worker = kA}, kStart));
  const FlightStep failed = ok(flight.dispatch_failed("no generate subject", kStart));
  ASSERT_TRUE(failed.release);
  ASSERT_TRUE(failed.release->health);
  EXPECT_EQ(failed.release->health->failure, FailureCause::dispatch_failed);
  EXPECT_FALSE(failed.cancel_at_worker);  // it never got the request
  ASSERT_TRUE(failed.route);
  EXPECT_FALSE(flight.dispatch_failed("again", kStart));  // nothing is dispatched now
}

TEST(RequestFlightTest, AnAttemptFailedAfterTheFirstTokenEndsTheStreamWithItsCause) {
  RequestFlight flight("r1", kPromptTokens);
  (void)flight.start(kStart);
  (void)ok(flight.routed({.worker = kA}, kStart));
  (void)ok(flight.on_chunk(chunk(kA, 0), kStart));
  const FlightStep failed =
      ok(flight.attempt_failed(FailureCause::worker_failed, "the answer broke off", kStart));
  ASSERT_TRUE(failed.end_stream);
  EXPECT_NE(failed.end_stream->message.find("the answer broke off"), std::string::npos);
  ASSERT_TRUE(failed.release);
  ASSERT_TRUE(failed.release->health);
  EXPECT_EQ(failed.release->health->failure, FailureCause::worker_failed);
  EXPECT_FALSE(failed.route);
  EXPECT_FALSE(flight.attempt_failed(FailureCause::worker_failed, "again", kStart));
}

TEST(RequestFlightTest, AWorkerLeavingAfterTheFirstTokenEndsTheStream) {
  RequestFlight flight("r1", kPromptTokens);
  (void)flight.start(kStart);
  (void)ok(flight.routed({.worker = kA}, kStart));
  (void)ok(flight.on_chunk(chunk(kA, 0), kStart));
  EXPECT_FALSE(ok(flight.worker_left(kB.worker_id, "left", kStart)).end_stream);
  const FlightStep left = ok(flight.worker_left(kA.worker_id, "left", kStart));
  ASSERT_TRUE(left.end_stream);
  EXPECT_EQ(left.end_stream->error, Error::worker_failed);
  EXPECT_FALSE(left.route);
}

TEST(RequestFlightTest, ARouteToAWorkerThatFailedTheRequestIsUndone) {
  RequestFlight flight("r1", kPromptTokens);
  (void)flight.start(kStart);
  (void)ok(flight.routed({.worker = kA}, kStart));
  (void)ok(flight.on_chunk(error_chunk(kA, 0), kStart));
  const FlightStep step = ok(flight.routed({.worker = kA}, kStart));
  ASSERT_TRUE(step.release);
  EXPECT_EQ(step.release->end, discovery::BookingEnd::cancelled);
  EXPECT_TRUE(step.warning);
  ASSERT_TRUE(step.end_stream);
  EXPECT_EQ(step.end_stream->error, Error::policy_failed);
  EXPECT_FALSE(step.dispatch);
}

// ---- cancel at every stage --------------------------------------------------------------------

TEST(RequestFlightTest, CancelWhileRoutingUndoesTheLateBooking) {
  RequestFlight flight("r1", kPromptTokens);
  (void)flight.start(kStart);
  const FlightStep cancelled = ok(flight.cancel("client left"));
  ASSERT_TRUE(cancelled.end_stream);
  EXPECT_EQ(cancelled.end_stream->finish_reason, "cancelled");
  EXPECT_FALSE(cancelled.release);  // nothing is booked yet
  EXPECT_FALSE(cancelled.cancel_at_worker);
  const FlightStep late = ok(flight.routed({.worker = kA}, kStart));
  ASSERT_TRUE(late.release);
  EXPECT_EQ(late.release->end, discovery::BookingEnd::cancelled);
  EXPECT_FALSE(late.dispatch);
  EXPECT_FALSE(flight.cancel("twice"));
}

TEST(RequestFlightTest, CancelWhileSentOrRespondingStopsTheWorkerAndReleases) {
  for (const bool responding : {false, true}) {
    RequestFlight flight("r1", kPromptTokens);
    (void)flight.start(kStart);
    (void)ok(flight.routed({.worker = kA}, kStart));
    if (responding) (void)ok(flight.on_chunk(chunk(kA, 0), kStart));
    const FlightStep cancelled = ok(flight.cancel("client left"));
    EXPECT_EQ(cancelled.cancel_at_worker, kA);
    ASSERT_TRUE(cancelled.release);
    EXPECT_EQ(cancelled.release->end, discovery::BookingEnd::cancelled);
    EXPECT_EQ(cancelled.release->affinity,
              responding ? AffinityAction::finish : AffinityAction::abandon);
    EXPECT_FALSE(cancelled.release->health);  // the client's cancel says nothing of the worker
    EXPECT_FALSE(flight.deadline());
  }
}

// ---- both hops --------------------------------------------------------------------------------

// A request planned onto prefill worker P, answered with its transfer parameters.
struct TwoHops {
  RequestFlight flight{"r1", kPromptTokens,
                       FlightOptions{.first_token_timeout = 100ms, .stall_timeout = 100ms}};
  FlightStep answer;

  explicit TwoHops(std::chrono::milliseconds transfer_valid = 1000ms) {
    (void)flight.start(kStart);
    const FlightStep prefill = ok(flight.routed({.worker = kP,
                                                 .prefill_hop = true,
                                                 .predicted_cached_tokens = 48,
                                                 .transfer_valid = transfer_valid},
                                                kStart));
    EXPECT_TRUE(prefill.dispatch);
    StreamChunk one = prefill_answer(kP);
    one.cached_prompt_tokens = 48;
    answer = ok(flight.on_chunk(one, kStart + 20ms));
  }
};

TEST(RequestFlightTest, ThePrefillHopSendsOneTokenAndTheTransferRequest) {
  RequestFlight flight("r1", kPromptTokens);
  (void)flight.start(kStart);
  const FlightStep prefill =
      ok(flight.routed({.worker = kP, .prefill_hop = true, .predicted_cached_tokens = 48}, kStart));
  ASSERT_TRUE(prefill.dispatch);
  EXPECT_EQ(prefill.dispatch->hop, FlightHop::prefill);
  EXPECT_EQ(prefill.dispatch->max_output_tokens, 1U);
  EXPECT_EQ(prefill.dispatch->kv_transfer_params, kRemoteDecodeTransferParams);
  EXPECT_TRUE(prefill.classifier_events.empty());  // classifiers never see the prefill hop
  EXPECT_EQ(flight.prefill_worker(), kP);
  EXPECT_EQ(flight.state(), RequestState::Routing);
}

TEST(RequestFlightTest, ThePrefillAnswerReleasesItsBookingAndRoutesTheDecodeHop) {
  TwoHops hops;
  const FlightStep& answer = hops.answer;
  ASSERT_TRUE(answer.first_token);
  EXPECT_EQ(answer.first_token->affinity, AffinityAction::none);
  ASSERT_TRUE(answer.release);
  EXPECT_EQ(answer.release->end, discovery::BookingEnd::completed);
  ASSERT_TRUE(answer.cache_outcome);
  EXPECT_EQ(answer.cache_outcome->delivered_cached_tokens, 48U);
  EXPECT_EQ(answer.prefill_hop_took, 20ms);
  EXPECT_TRUE(answer.hold_chunk);
  EXPECT_TRUE(answer.discard_held);
  EXPECT_FALSE(answer.forward_chunk);  // its token never reaches the client
  ASSERT_TRUE(answer.route);
  EXPECT_TRUE(answer.route->decode_after_transfer);
  EXPECT_FALSE(answer.route->retry);

  const FlightStep decode = ok(hops.flight.routed({.worker = kA}, kStart + 25ms));
  ASSERT_TRUE(decode.dispatch);
  EXPECT_EQ(decode.dispatch->hop, FlightHop::decode);
  EXPECT_EQ(decode.dispatch->kv_transfer_params, kAnswer);
  EXPECT_EQ(decode.handoff_took, 5ms);
  EXPECT_EQ(terminal_event(decode.classifier_events), "S");

  const FlightStep first = ok(hops.flight.on_chunk(chunk(kA, 0), kStart + 30ms));
  EXPECT_TRUE(first.forward_chunk);
  EXPECT_FALSE(first.cache_outcome);  // counted at the prefill: the decode hop's is transferred KV
  EXPECT_EQ(first.first_token->affinity, AffinityAction::commit);
  const FlightStep last = ok(hops.flight.on_chunk(chunk(kA, 1, true), kStart + 31ms));
  EXPECT_TRUE(last.completed);
  EXPECT_EQ(terminal_event(last.classifier_events), "C");
}

TEST(RequestFlightTest, AOneTokenPrefillThatEndedTheGenerationServesTheRequest) {
  RequestFlight flight("r1", kPromptTokens);
  (void)flight.start(kStart);
  (void)ok(flight.routed({.worker = kP, .prefill_hop = true}, kStart));
  StreamChunk stop = chunk(kP, 0, true);
  stop.finish_reason = "stop";
  const FlightStep served = ok(flight.on_chunk(stop, kStart + 5ms));
  EXPECT_TRUE(served.hold_chunk);
  EXPECT_TRUE(served.relay_held);
  EXPECT_FALSE(served.route);
  ASSERT_TRUE(served.first_token);
  EXPECT_EQ(served.first_token->affinity, AffinityAction::commit);
  ASSERT_TRUE(served.release);
  EXPECT_EQ(served.release->end, discovery::BookingEnd::completed);
  EXPECT_TRUE(served.completed);
  EXPECT_EQ(terminal_event(served.classifier_events), "SRC");
  EXPECT_EQ(flight.forwarded(), 1U);
  EXPECT_EQ(flight.worker(), kP);
}

TEST(RequestFlightTest, APrefillFailureIsPlannedAgainWithoutThatWorkerThenEndsTheStream) {
  RequestFlight flight("r1", kPromptTokens);
  (void)flight.start(kStart);
  (void)ok(flight.routed({.worker = kP, .prefill_hop = true}, kStart));
  const FlightStep failed = ok(flight.on_chunk(error_chunk(kP, 0), kStart));
  ASSERT_TRUE(failed.release);
  EXPECT_EQ(failed.release->end, discovery::BookingEnd::failed);
  ASSERT_TRUE(failed.release->health);
  EXPECT_EQ(failed.release->health->failure, FailureCause::worker_failed);
  ASSERT_TRUE(failed.route);
  EXPECT_TRUE(failed.route->retry);
  EXPECT_FALSE(failed.route->decode_after_transfer);
  EXPECT_EQ(failed.route->excluded, std::vector<WorkerId>{kP.worker_id});
  EXPECT_FALSE(failed.end_stream);

  (void)ok(flight.routed({.worker = kQ, .prefill_hop = true}, kStart));
  StreamChunk answer = prefill_answer(kQ, "[1]");
  answer.kv_transfer_params_error = "not a JSON object";  // as decode_stream_chunk finds
  const FlightStep unusable = ok(flight.on_chunk(answer, kStart));
  ASSERT_TRUE(unusable.end_stream);
  EXPECT_EQ(unusable.end_stream->error, Error::worker_failed);
  EXPECT_NE(unusable.end_stream->message.find("prefill hop failed on worker 11"),
            std::string::npos);
  EXPECT_NE(unusable.end_stream->message.find("kv_transfer_params"), std::string::npos);
  EXPECT_EQ(terminal_event(unusable.classifier_events), "A");
  EXPECT_TRUE(flight.ended());
}

TEST(RequestFlightTest, APrefillWithoutAnAnswerInTimeIsCancelledAtItsWorker) {
  RequestFlight flight("r1", kPromptTokens, FlightOptions{.first_token_timeout = 100ms});
  (void)flight.start(kStart);
  (void)ok(flight.routed({.worker = kP, .prefill_hop = true}, kStart));
  (void)ok(flight.on_chunk(chunk(kP, 0), kStart + 10ms));  // its token, but no answer
  EXPECT_EQ(flight.deadline(), kStart + 100ms);
  const FlightStep timeout = flight.tick(kStart + 100ms);
  EXPECT_EQ(timeout.timed_out, FlightTimeout::first_token);
  EXPECT_EQ(timeout.cancel_at_worker, kP);
  EXPECT_TRUE(timeout.discard_held);
  ASSERT_TRUE(timeout.release);
  EXPECT_EQ(timeout.release->health->failure, FailureCause::first_token_timeout);
  ASSERT_TRUE(timeout.route);
}

TEST(RequestFlightTest, APrefillStreamingMoreThanOneTokenFails) {
  RequestFlight flight("r1", kPromptTokens);
  (void)flight.start(kStart);
  (void)ok(flight.routed({.worker = kP, .prefill_hop = true}, kStart));
  FlightStep step;
  for (std::uint32_t i = 0; !step.route && i < 10; ++i)
    step = ok(flight.on_chunk(chunk(kP, i), kStart));
  ASSERT_TRUE(step.route);
  EXPECT_EQ(step.cancel_at_worker, kP);
  EXPECT_EQ(step.route->excluded, std::vector<WorkerId>{kP.worker_id});
}

TEST(RequestFlightTest, ADecodeFailureReusesTheTransferWhileItIsValid) {
  TwoHops hops(1000ms);
  (void)ok(hops.flight.routed({.worker = kA}, kStart + 25ms));
  const FlightStep failed = ok(hops.flight.on_chunk(error_chunk(kA, 0), kStart + 30ms));
  ASSERT_TRUE(failed.route);
  EXPECT_TRUE(failed.route->decode_after_transfer);
  EXPECT_EQ(failed.route->excluded, std::vector<WorkerId>{kA.worker_id});
  const FlightStep retry = ok(hops.flight.routed({.worker = kB}, kStart + 35ms));
  ASSERT_TRUE(retry.dispatch);
  EXPECT_EQ(retry.dispatch->hop, FlightHop::decode);
  EXPECT_EQ(retry.dispatch->kv_transfer_params, kAnswer);
}

TEST(RequestFlightTest, ADecodeFailureAfterTheTransferExpiredPlansFromThePrefillHop) {
  TwoHops hops(100ms);
  (void)ok(hops.flight.routed({.worker = kA}, kStart + 25ms));
  // The transfer is valid until 120 ms; the decode worker times out at 125 ms.
  const FlightStep failed = hops.flight.tick(kStart + 125ms);
  ASSERT_TRUE(failed.route);
  EXPECT_FALSE(failed.route->decode_after_transfer);
  const FlightStep again =
      ok(hops.flight.routed({.worker = kQ, .prefill_hop = true}, kStart + 130ms));
  ASSERT_TRUE(again.dispatch);
  EXPECT_EQ(again.dispatch->hop, FlightHop::prefill);
}

TEST(RequestFlightTest, ATransferWhosePrefillWorkerLeftIsNotReused) {
  TwoHops hops(1000ms);
  (void)ok(hops.flight.routed({.worker = kA}, kStart + 25ms));
  (void)ok(hops.flight.worker_left(kP.worker_id, "left", kStart + 26ms));
  const FlightStep failed = ok(hops.flight.on_chunk(error_chunk(kA, 0), kStart + 30ms));
  ASSERT_TRUE(failed.route);
  EXPECT_FALSE(failed.route->decode_after_transfer);
}

TEST(RequestFlightTest, CancelDuringThePrefillHopStopsThePrefillWorker) {
  RequestFlight flight("r1", kPromptTokens);
  (void)flight.start(kStart);
  (void)ok(flight.routed({.worker = kP, .prefill_hop = true}, kStart));
  const FlightStep cancelled = ok(flight.cancel("client left"));
  EXPECT_EQ(cancelled.cancel_at_worker, kP);
  ASSERT_TRUE(cancelled.release);
  EXPECT_EQ(cancelled.release->end, discovery::BookingEnd::cancelled);
  ASSERT_TRUE(cancelled.end_stream);
  EXPECT_EQ(cancelled.end_stream->finish_reason, "cancelled");
  EXPECT_FALSE(flight.prefill_worker());
  EXPECT_FALSE(flight.on_chunk(prefill_answer(kP), kStart));  // its late answer is refused
}

TEST(RequestFlightTest, CancelBetweenTheHopsEndsWithoutABookingToRelease) {
  TwoHops hops;
  const FlightStep cancelled = ok(hops.flight.cancel("client left"));
  EXPECT_FALSE(cancelled.release);  // the prefill's booking ended with its answer
  ASSERT_TRUE(cancelled.end_stream);
  const FlightStep late = ok(hops.flight.routed({.worker = kA}, kStart + 30ms));
  ASSERT_TRUE(late.release);
  EXPECT_EQ(late.release->end, discovery::BookingEnd::cancelled);
  EXPECT_FALSE(late.dispatch);
}

TEST(RequestFlightTest, ChunksFromAnotherWorkerAreRefusedWithoutEffect) {
  RequestFlight flight("r1", kPromptTokens);
  (void)flight.start(kStart);
  (void)ok(flight.routed({.worker = kP, .prefill_hop = true}, kStart));
  const FlightResult stale = flight.on_chunk(chunk(kA, 0), kStart);
  ASSERT_FALSE(stale);
  EXPECT_EQ(stale.error().kind, LifecycleError::Kind::stale_worker);
  EXPECT_EQ(flight.prefill_worker(), kP);
}

// ---- release exactly once, whatever the order ------------------------------------------------

// The node's side of a flight: a fleet that books one worker per route and checks every booking
// change against what is open.
struct Stand {
  explicit Stand(bool two_hops)
      : disaggregated(two_hops),
        flight(
            "r1", kPromptTokens,
            FlightOptions{.max_retries = 1, .first_token_timeout = 10ms, .stall_timeout = 10ms}) {
    apply(flight.start(now));
  }

  void apply(const FlightStep& step) {
    if (step.first_token) {
      EXPECT_TRUE(booked) << "a first token without a booking";
    }
    if (step.release) {
      EXPECT_TRUE(booked) << "a release without an open booking";
      booked = false;
      ++releases;
    }
    if (step.hold_chunk) ++held;
    if (step.relay_held) forwarded += std::exchange(held, 0);
    if (step.discard_held) held = 0;
    if (step.forward_chunk) ++forwarded;
    if (step.completed) ++ends;
    if (step.end_stream) ++ends;
    if (step.dispatch) {
      dispatched = step.dispatch->worker;
      next_index = 0;
    }
    if (step.route) {
      EXPECT_FALSE(route) << "a second route while one is pending";
      EXPECT_FALSE(booked) << "routed while a booking is open";
      route = step.route;
    }
  }
  void apply(const FlightResult& result) {
    if (result) apply(*result);
  }

  // Books the first worker the route may take: a prefill worker for a plan when the model has
  // them, a decode worker otherwise.
  void answer_route() {
    const FlightRouteRequest request = *std::exchange(route, std::nullopt);
    const auto allowed = [&](WorkerWithDpRank worker) {
      return std::ranges::find(request.excluded, worker.worker_id) == request.excluded.end();
    };
    if (disaggregated && !request.decode_after_transfer) {
      for (WorkerWithDpRank worker : {kP, kQ}) {
        if (allowed(worker)) {
          booked = true;
          ++bookings;
          return apply(flight.routed({.worker = worker, .prefill_hop = true}, now));
        }
      }
    }
    for (WorkerWithDpRank worker : {kA, kB, kC}) {
      if (allowed(worker)) {
        booked = true;
        ++bookings;
        return apply(flight.routed({.worker = worker}, now));
      }
    }
    apply(flight.route_failed(Error::no_workers, "none left", now));
  }

  enum Input { kRoute, kChunk, kLast, kError, kLeave, kTick, kCancel, kAbort, kInputs };

  void feed(int input) {
    now += 4ms;
    switch (input) {
      case kRoute:
        if (route) answer_route();
        break;
      case kChunk:
      case kLast:
        if (dispatched) {
          StreamChunk next = chunk(*dispatched, next_index++, input == kLast);
          if (input == kLast && flight.prefill_worker()) next.kv_transfer_params = kAnswer;
          apply(flight.on_chunk(next, now));
        }
        break;
      case kError:
        if (dispatched) apply(flight.on_chunk(error_chunk(*dispatched, next_index++), now));
        break;
      case kLeave:
        if (dispatched) apply(flight.worker_left(dispatched->worker_id, "left", now));
        break;
      case kTick:
        now += 10ms;
        apply(flight.tick(now));
        break;
      case kCancel:
        apply(flight.cancel("client"));
        break;
      case kAbort:
        apply(flight.abort(Error::unavailable, "shutdown"));
        break;
    }
  }

  // Ends the flight however it stands (a late route answered, then cancelled).
  void finish() {
    if (!flight.ended()) apply(flight.cancel("end of the sequence"));
    if (route) answer_route();
  }

  bool disaggregated;
  FlightTime now = kStart;
  RequestFlight flight;
  std::optional<FlightRouteRequest> route;
  std::optional<WorkerWithDpRank> dispatched;
  std::uint32_t next_index = 0;
  bool booked = false;
  int bookings = 0;
  int releases = 0;
  int held = 0;
  int forwarded = 0;
  int ends = 0;
};

void explore(const Stand& stand, int depth, std::size_t& sequences) {
  if (depth == 0 || stand.flight.ended()) {
    Stand ended = stand;
    ended.finish();
    ++sequences;
    EXPECT_TRUE(ended.flight.ended());
    EXPECT_FALSE(ended.booked) << "a booking left open";
    EXPECT_EQ(ended.releases, ended.bookings);
    EXPECT_EQ(ended.ends, 1) << "the stream must end exactly once";
    EXPECT_EQ(static_cast<std::uint32_t>(ended.forwarded), ended.flight.forwarded());
    EXPECT_FALSE(ended.flight.deadline());
    return;
  }
  for (int input = 0; input < Stand::kInputs; ++input) {
    Stand next = stand;
    next.feed(input);
    explore(next, depth - 1, sequences);
    if (::testing::Test::HasFailure()) return;
  }
}

TEST(RequestFlightTest, EveryBookingIsReleasedOnceAndEveryStreamEndsOnceInAnyOrder) {
  for (const bool disaggregated : {false, true}) {
    std::size_t sequences = 0;
    explore(Stand(disaggregated), 6, sequences);
    EXPECT_GT(sequences, 1000U);
  }
}

}  // namespace
}  // namespace kvr
