// Session affinity: the binding table on its own (hard and soft binding, commit / abandon /
// finish, sliding TTL, session_final, LRU bound, parent sessions) and routed through a real
// SelectorState (hard dispatch without the policy, dropping an unusable binding, the reference's
// soft-pinning walkthrough with the soft-affinity-load-guard policy).
#include "selection/partition/session_affinity.hpp"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "discovery/block_hash.hpp"
#include "selection/config/router_policy_config.hpp"
#include "selection/policies/builtin_policies.hpp"
#include "tests/testing/worker_registration.hpp"

namespace kvr {
namespace {

using namespace std::chrono_literals;
using plugins::worker_selection::WorkerAffinityTarget;

constexpr std::uint32_t kBlockSize = 16;
constexpr std::string_view kModel = "llama";
const TimePoint kStart{std::chrono::seconds(1000)};
constexpr WorkerWithDpRank kA{1, 0};
constexpr WorkerWithDpRank kB{2, 0};
constexpr WorkerWithDpRank kC{3, 0};

SessionContext session(std::string id, std::optional<bool> final = std::nullopt,
                       std::optional<std::string> parent = std::nullopt) {
  return SessionContext{std::move(id), std::move(parent), final, std::nullopt};
}

SessionAffinityOptions options(SessionAffinityMode mode, std::chrono::seconds ttl = 60s,
                               std::size_t max_sessions = 1000) {
  return SessionAffinityOptions{.ttl = ttl, .mode = mode, .max_sessions = max_sessions};
}

// ---- configuration ------------------------------------------------------------------------

TEST(SessionAffinityOptionsTest, OffByDefaultAndThenTracksNothing) {
  SessionAffinity affinity;
  EXPECT_FALSE(affinity.enabled());
  const auto s = session("s");
  EXPECT_EQ(affinity.propose("r1", s, kA, kStart), AffinityProposal::untracked);
  EXPECT_FALSE(affinity.hard_target(s, kStart));
  EXPECT_FALSE(affinity.affinity_target(s, kStart));
  EXPECT_EQ(affinity.commit("r1", kStart), AffinityCommit::untracked);
  EXPECT_EQ(affinity.finish("r1", kStart), AffinityRelease::untracked);
  EXPECT_EQ(affinity.size(), 0U);
  EXPECT_EQ(affinity.open_requests(), 0U);
}

TEST(SessionAffinityOptionsTest, ValidationNamesTheFlagAndTheRange) {
  EXPECT_TRUE(SessionAffinityOptions{}.validate());
  EXPECT_TRUE(options(SessionAffinityMode::soft, 1s).validate());
  EXPECT_TRUE(options(SessionAffinityMode::soft, kMaxSessionAffinityTtl).validate());
  for (const auto ttl : {0s, kMaxSessionAffinityTtl + 1s}) {
    const auto refused = options(SessionAffinityMode::hard, ttl).validate();
    ASSERT_FALSE(refused);
    EXPECT_NE(refused.error().find("--router-session-affinity-ttl-secs"), std::string::npos)
        << refused.error();
    EXPECT_NE(refused.error().find("31536000"), std::string::npos) << refused.error();
  }
  const auto no_room = options(SessionAffinityMode::hard, 10s, 0).validate();
  ASSERT_FALSE(no_room);
  EXPECT_NE(no_room.error().find("max_sessions"), std::string::npos) << no_room.error();
  auto ageless = options(SessionAffinityMode::hard);
  ageless.max_request_age = 0s;
  const auto refused_age = ageless.validate();
  ASSERT_FALSE(refused_age);
  EXPECT_NE(refused_age.error().find("max_request_age"), std::string::npos) << refused_age.error();
}

TEST(SessionAffinityOptionsTest, ModeNamesRoundTrip) {
  EXPECT_EQ(parse_session_affinity_mode("hard"), SessionAffinityMode::hard);
  EXPECT_EQ(parse_session_affinity_mode("soft"), SessionAffinityMode::soft);
  EXPECT_FALSE(parse_session_affinity_mode("Hard"));
  EXPECT_FALSE(parse_session_affinity_mode(""));
  EXPECT_EQ(as_str(SessionAffinityMode::soft), "soft");
  EXPECT_EQ(as_str(SessionAffinityMode::hard), "hard");
}

// ---- hard mode ----------------------------------------------------------------------------

TEST(SessionAffinityHardTest, FirstRequestBindsAtSelectionAndTheFirstTokenConfirms) {
  SessionAffinity affinity{options(SessionAffinityMode::hard)};
  const auto s = session("s");
  EXPECT_FALSE(affinity.hard_target(s, kStart));
  EXPECT_EQ(affinity.propose("r1", s, kA, kStart), AffinityProposal::bound);
  // A second request arriving before r1's first token already goes to A.
  EXPECT_EQ(affinity.hard_target(s, kStart + 1s), kA);
  EXPECT_FALSE(affinity.affinity_target(s, kStart + 1s)) << "soft targets only in soft mode";
  EXPECT_EQ(affinity.commit("r1", kStart + 2s), AffinityCommit::confirmed);
  EXPECT_EQ(affinity.commit("r1", kStart + 2s), AffinityCommit::untracked);
  EXPECT_EQ(affinity.finish("r1", kStart + 3s), AffinityRelease::kept);
  EXPECT_EQ(affinity.binding("s", kStart + 3s), kA);
  EXPECT_EQ(affinity.open_requests(), 0U);
  EXPECT_EQ(affinity.stats().bindings_created, 1U);
}

TEST(SessionAffinityHardTest, ProvisionalBindingOfAFailedFirstRequestIsDropped) {
  SessionAffinity affinity{options(SessionAffinityMode::hard)};
  const auto s = session("s");
  ASSERT_EQ(affinity.propose("r1", s, kA, kStart), AffinityProposal::bound);
  EXPECT_EQ(affinity.abandon("r1", kStart + 1s), AffinityRelease::dropped);
  EXPECT_FALSE(affinity.hard_target(s, kStart + 1s));
  EXPECT_EQ(affinity.stats().dropped_failed, 1U);
}

// A completion is evidence the worker served the session: a provisional binding whose request
// completes without a reported first token is confirmed, not dropped as a failed one.
TEST(SessionAffinityHardTest, CompletionWithoutAFirstTokenConfirmsTheProvisionalBinding) {
  SessionAffinity affinity{options(SessionAffinityMode::hard)};
  const auto s = session("s");
  ASSERT_EQ(affinity.propose("r1", s, kA, kStart), AffinityProposal::bound);
  EXPECT_EQ(affinity.complete("r1", kStart + 1s), AffinityCommit::confirmed);
  EXPECT_EQ(affinity.hard_target(s, kStart + 1s), kA);
  EXPECT_EQ(affinity.open_requests(), 0U);
  EXPECT_EQ(affinity.stats().dropped_failed, 0U);
}

TEST(SessionAffinityHardTest, BindingConfirmedByAnotherRequestSurvivesTheCreatorsFailure) {
  SessionAffinity affinity{options(SessionAffinityMode::hard)};
  const auto s = session("s");
  ASSERT_EQ(affinity.propose("r1", s, kA, kStart), AffinityProposal::bound);
  ASSERT_EQ(affinity.propose("r2", s, kA, kStart), AffinityProposal::kept);
  ASSERT_EQ(affinity.commit("r2", kStart + 1s), AffinityCommit::confirmed);
  EXPECT_EQ(affinity.abandon("r1", kStart + 2s), AffinityRelease::kept);
  EXPECT_EQ(affinity.hard_target(s, kStart + 2s), kA);
}

TEST(SessionAffinityHardTest, PinnedDispatchElsewhereLeavesTheBindingAlone) {
  SessionAffinity affinity{options(SessionAffinityMode::hard)};
  const auto s = session("s");
  ASSERT_EQ(affinity.propose("r1", s, kA, kStart), AffinityProposal::bound);
  ASSERT_EQ(affinity.commit("r1", kStart), AffinityCommit::confirmed);
  EXPECT_EQ(affinity.propose("r2", s, kB, kStart), AffinityProposal::conflict);
  EXPECT_EQ(affinity.commit("r2", kStart), AffinityCommit::superseded);
  EXPECT_EQ(affinity.finish("r2", kStart), AffinityRelease::kept);
  EXPECT_EQ(affinity.hard_target(s, kStart), kA);
}

TEST(SessionAffinityHardTest, InvalidateDropsOnlyTheSessionsOwnBindingToThatWorker) {
  SessionAffinity affinity{options(SessionAffinityMode::hard)};
  ASSERT_EQ(affinity.propose("r1", session("s"), kA, kStart), AffinityProposal::bound);
  EXPECT_FALSE(affinity.invalidate("s", kB)) << "the binding names A";
  EXPECT_FALSE(affinity.invalidate("other", kA));
  EXPECT_TRUE(affinity.invalidate("s", kA));
  EXPECT_FALSE(affinity.binding("s", kStart));
  EXPECT_EQ(affinity.stats().invalidated, 1U);
  // The request that was proposed on it ends without trouble.
  EXPECT_EQ(affinity.finish("r1", kStart), AffinityRelease::kept);
  EXPECT_EQ(affinity.open_requests(), 0U);
}

TEST(SessionAffinityHardTest, ProposingARequestAgainReplacesItsEarlierProposal) {
  SessionAffinity affinity{options(SessionAffinityMode::hard)};
  const auto s = session("s");
  ASSERT_EQ(affinity.propose("r1", s, kA, kStart), AffinityProposal::bound);
  // A retry that nobody abandoned: the provisional binding to A goes, B is bound.
  EXPECT_EQ(affinity.propose("r1", s, kB, kStart + 1s), AffinityProposal::bound);
  EXPECT_EQ(affinity.hard_target(s, kStart + 1s), kB);
  EXPECT_EQ(affinity.open_requests(), 1U);
}

// ---- soft mode ----------------------------------------------------------------------------

TEST(SessionAffinitySoftTest, FirstBindingIsCommittedOnlyAtTheFirstToken) {
  SessionAffinity affinity{options(SessionAffinityMode::soft)};
  const auto s = session("s");
  EXPECT_EQ(affinity.propose("r1", s, kA, kStart), AffinityProposal::pending_bind);
  EXPECT_FALSE(affinity.affinity_target(s, kStart + 1s));
  EXPECT_FALSE(affinity.hard_target(s, kStart + 1s)) << "hard targets only in hard mode";
  EXPECT_EQ(affinity.commit("r1", kStart + 2s), AffinityCommit::bound);
  const auto target = affinity.affinity_target(s, kStart + 2s);
  ASSERT_TRUE(target);
  EXPECT_EQ(*target, (WorkerAffinityTarget{.worker_id = kA.worker_id, .dp_rank = kA.dp_rank}));
}

TEST(SessionAffinitySoftTest, RebindingWaitsForTheFirstToken) {
  SessionAffinity affinity{options(SessionAffinityMode::soft)};
  const auto s = session("s");
  ASSERT_EQ(affinity.propose("r1", s, kA, kStart), AffinityProposal::pending_bind);
  ASSERT_EQ(affinity.commit("r1", kStart), AffinityCommit::bound);
  ASSERT_EQ(affinity.finish("r1", kStart), AffinityRelease::kept);

  // The policy sent r2 to B: the binding still names A until r2 responds.
  EXPECT_EQ(affinity.propose("r2", s, kB, kStart + 1s), AffinityProposal::pending_rebind);
  EXPECT_EQ(affinity.binding("s", kStart + 1s), kA);
  EXPECT_EQ(affinity.affinity_target(s, kStart + 1s)->worker_id, kA.worker_id);
  EXPECT_EQ(affinity.commit("r2", kStart + 2s), AffinityCommit::rebound);
  EXPECT_EQ(affinity.binding("s", kStart + 2s), kB);
  EXPECT_EQ(affinity.stats().rebinds, 1U);
}

TEST(SessionAffinitySoftTest, AbandonBeforeTheFirstTokenKeepsTheOldBinding) {
  SessionAffinity affinity{options(SessionAffinityMode::soft)};
  const auto s = session("s");
  ASSERT_EQ(affinity.propose("r1", s, kA, kStart), AffinityProposal::pending_bind);
  ASSERT_EQ(affinity.commit("r1", kStart), AffinityCommit::bound);
  ASSERT_EQ(affinity.finish("r1", kStart), AffinityRelease::kept);
  ASSERT_EQ(affinity.propose("r2", s, kB, kStart), AffinityProposal::pending_rebind);
  EXPECT_EQ(affinity.abandon("r2", kStart + 1s), AffinityRelease::kept);
  EXPECT_EQ(affinity.binding("s", kStart + 1s), kA);
  EXPECT_EQ(affinity.commit("r2", kStart + 1s), AffinityCommit::untracked);

  // A new session whose only request fails never gets a binding.
  ASSERT_EQ(affinity.propose("n1", session("new"), kB, kStart), AffinityProposal::pending_bind);
  EXPECT_EQ(affinity.abandon("n1", kStart), AffinityRelease::kept);
  EXPECT_FALSE(affinity.binding("new", kStart));
}

TEST(SessionAffinitySoftTest, ConcurrentRebindsKeepTheFirstCommittedMove) {
  SessionAffinity affinity{options(SessionAffinityMode::soft)};
  const auto s = session("s");
  ASSERT_EQ(affinity.propose("r1", s, kA, kStart), AffinityProposal::pending_bind);
  ASSERT_EQ(affinity.commit("r1", kStart), AffinityCommit::bound);
  // r2 and r3 both left A (for B and C) while the binding named A.
  ASSERT_EQ(affinity.propose("r2", s, kB, kStart), AffinityProposal::pending_rebind);
  ASSERT_EQ(affinity.propose("r3", s, kC, kStart), AffinityProposal::pending_rebind);
  EXPECT_EQ(affinity.commit("r3", kStart + 1s), AffinityCommit::rebound);
  // r2 responds later, but the binding moved since r2 was proposed: C stays.
  EXPECT_EQ(affinity.commit("r2", kStart + 2s), AffinityCommit::superseded);
  EXPECT_EQ(affinity.binding("s", kStart + 2s), kC);
}

TEST(SessionAffinitySoftTest, CommitOfTheBoundWorkerConfirms) {
  SessionAffinity affinity{options(SessionAffinityMode::soft)};
  const auto s = session("s");
  ASSERT_EQ(affinity.propose("r1", s, kA, kStart), AffinityProposal::pending_bind);
  ASSERT_EQ(affinity.commit("r1", kStart), AffinityCommit::bound);
  EXPECT_EQ(affinity.propose("r2", s, kA, kStart), AffinityProposal::kept);
  EXPECT_EQ(affinity.commit("r2", kStart), AffinityCommit::confirmed);
  EXPECT_EQ(affinity.stats().rebinds, 0U);
}

// A route-mode client may report only its completion: that binds and moves the soft binding as a
// first token does, and a completion after the first token commits nothing twice.
TEST(SessionAffinitySoftTest, CompletionWithoutAFirstTokenBindsAndRebinds) {
  SessionAffinity affinity{options(SessionAffinityMode::soft)};
  const auto s = session("s");
  ASSERT_EQ(affinity.propose("r1", s, kA, kStart), AffinityProposal::pending_bind);
  EXPECT_EQ(affinity.complete("r1", kStart + 1s), AffinityCommit::bound);
  EXPECT_EQ(affinity.binding("s", kStart + 1s), kA);

  ASSERT_EQ(affinity.propose("r2", s, kB, kStart + 2s), AffinityProposal::pending_rebind);
  EXPECT_EQ(affinity.complete("r2", kStart + 3s), AffinityCommit::rebound);
  EXPECT_EQ(affinity.binding("s", kStart + 3s), kB);
  EXPECT_EQ(affinity.stats().rebinds, 1U);

  ASSERT_EQ(affinity.propose("r3", s, kC, kStart + 4s), AffinityProposal::pending_rebind);
  ASSERT_EQ(affinity.commit("r3", kStart + 5s), AffinityCommit::rebound);
  EXPECT_EQ(affinity.complete("r3", kStart + 6s), AffinityCommit::untracked);
  EXPECT_EQ(affinity.binding("s", kStart + 6s), kC);
  EXPECT_EQ(affinity.stats().rebinds, 2U);
  EXPECT_EQ(affinity.open_requests(), 0U);
}

// ---- TTL, session_final, LRU --------------------------------------------------------------

TEST(SessionAffinityExpiryTest, TtlSlidesWithEachUse) {
  SessionAffinity affinity{options(SessionAffinityMode::hard, 10s)};
  const auto s = session("s");
  ASSERT_EQ(affinity.propose("r1", s, kA, kStart), AffinityProposal::bound);
  ASSERT_EQ(affinity.commit("r1", kStart + 1s), AffinityCommit::confirmed);
  ASSERT_EQ(affinity.finish("r1", kStart + 2s), AffinityRelease::kept);  // last use: +2 s
  EXPECT_EQ(affinity.expire(kStart + 11s), 0U);
  EXPECT_EQ(affinity.hard_target(s, kStart + 11s), kA);

  // r2 uses the binding at +11 s: it now lives until +21 s after r2's end.
  ASSERT_EQ(affinity.propose("r2", s, kA, kStart + 11s), AffinityProposal::kept);
  ASSERT_EQ(affinity.finish("r2", kStart + 11s), AffinityRelease::kept);
  EXPECT_EQ(affinity.expire(kStart + 20s), 0U);
  EXPECT_EQ(affinity.binding("s", kStart + 20s), kA);
  // Expired at +21 s, even before expire() removes it.
  EXPECT_FALSE(affinity.binding("s", kStart + 21s));
  EXPECT_FALSE(affinity.hard_target(s, kStart + 21s));
  EXPECT_EQ(affinity.size(), 1U);
  EXPECT_EQ(affinity.expire(kStart + 21s), 1U);
  EXPECT_EQ(affinity.size(), 0U);
  EXPECT_EQ(affinity.stats().expired, 1U);
  // The session's next request selects anew.
  EXPECT_EQ(affinity.propose("r3", s, kB, kStart + 22s), AffinityProposal::bound);
}

TEST(SessionAffinityExpiryTest, BindingWithARequestInFlightDoesNotExpire) {
  SessionAffinity affinity{options(SessionAffinityMode::soft, 10s)};
  const auto s = session("s");
  ASSERT_EQ(affinity.propose("long", s, kA, kStart), AffinityProposal::pending_bind);
  ASSERT_EQ(affinity.commit("long", kStart + 1s), AffinityCommit::bound);
  // A generation longer than the TTL keeps its session bound.
  EXPECT_EQ(affinity.expire(kStart + 60s), 0U);
  EXPECT_EQ(affinity.binding("s", kStart + 60s), kA);
  ASSERT_EQ(affinity.finish("long", kStart + 60s), AffinityRelease::kept);
  // The TTL counts from the end of the request.
  EXPECT_EQ(affinity.expire(kStart + 69s), 0U);
  EXPECT_EQ(affinity.expire(kStart + 70s), 1U);
}

TEST(SessionAffinityExpiryTest, RequestWhoseEndIsNeverReportedStopsHoldingItsBinding) {
  auto settings = options(SessionAffinityMode::soft, 10s);
  settings.max_request_age = 100s;
  SessionAffinity affinity{settings};
  ASSERT_EQ(affinity.propose("lost", session("s"), kA, kStart), AffinityProposal::pending_bind);
  ASSERT_EQ(affinity.commit("lost", kStart), AffinityCommit::bound);
  ASSERT_EQ(affinity.propose("other", session("t"), kB, kStart + 50s),
            AffinityProposal::pending_bind);
  EXPECT_EQ(affinity.expire(kStart + 99s), 0U);
  EXPECT_EQ(affinity.open_requests(), 2U);
  // At +100 s "lost" is taken as ended (a use: the binding lives 10 s more); "other" stays open.
  EXPECT_EQ(affinity.expire(kStart + 100s), 0U);
  EXPECT_EQ(affinity.open_requests(), 1U);
  EXPECT_EQ(affinity.binding("s", kStart + 100s), kA);
  EXPECT_EQ(affinity.finish("lost", kStart + 100s), AffinityRelease::untracked);
  EXPECT_EQ(affinity.expire(kStart + 110s), 1U);
  EXPECT_FALSE(affinity.binding("s", kStart + 110s));
}

TEST(SessionAffinityExpiryTest, ExpireSkipsBusyBindingsAndRemovesOlderIdleOnes) {
  SessionAffinity affinity{options(SessionAffinityMode::hard, 10s)};
  ASSERT_EQ(affinity.propose("idle", session("idle"), kA, kStart), AffinityProposal::bound);
  ASSERT_EQ(affinity.commit("idle", kStart), AffinityCommit::confirmed);
  ASSERT_EQ(affinity.finish("idle", kStart), AffinityRelease::kept);
  ASSERT_EQ(affinity.propose("busy", session("busy"), kB, kStart + 1s), AffinityProposal::bound);
  ASSERT_EQ(affinity.propose("idle2", session("idle2"), kC, kStart + 2s), AffinityProposal::bound);
  ASSERT_EQ(affinity.finish("idle2", kStart + 2s), AffinityRelease::dropped)
      << "a provisional binding whose request never responded goes";
  ASSERT_EQ(affinity.propose("idle3", session("idle3"), kC, kStart + 3s), AffinityProposal::bound);
  ASSERT_EQ(affinity.commit("idle3", kStart + 3s), AffinityCommit::confirmed);
  ASSERT_EQ(affinity.finish("idle3", kStart + 3s), AffinityRelease::kept);
  // At +13 s: "idle" (+0) and "idle3" (+3) are past their TTL, "busy" has a request in flight.
  EXPECT_EQ(affinity.expire(kStart + 13s), 2U);
  EXPECT_EQ(affinity.binding("busy", kStart + 13s), kB);
  EXPECT_EQ(affinity.size(), 1U);
}

TEST(SessionAffinityExpiryTest, SessionFinalDropsTheBindingAfterThatRequest) {
  SessionAffinity affinity{options(SessionAffinityMode::soft)};
  ASSERT_EQ(affinity.propose("r1", session("s"), kA, kStart), AffinityProposal::pending_bind);
  ASSERT_EQ(affinity.commit("r1", kStart), AffinityCommit::bound);
  ASSERT_EQ(affinity.finish("r1", kStart), AffinityRelease::kept);

  const auto last = session("s", /*final=*/true);
  ASSERT_EQ(affinity.propose("r2", last, kA, kStart + 1s), AffinityProposal::kept);
  ASSERT_EQ(affinity.commit("r2", kStart + 2s), AffinityCommit::confirmed);
  // Still bound while the final request runs ...
  EXPECT_EQ(affinity.binding("s", kStart + 2s), kA);
  // ... and gone once it ends.
  EXPECT_EQ(affinity.finish("r2", kStart + 3s), AffinityRelease::dropped);
  EXPECT_FALSE(affinity.binding("s", kStart + 3s));
  EXPECT_FALSE(affinity.affinity_target(session("s"), kStart + 3s));
  EXPECT_EQ(affinity.stats().dropped_final, 1U);
}

TEST(SessionAffinityExpiryTest, SessionFinalAlsoDropsWhenTheRequestFails) {
  SessionAffinity affinity{options(SessionAffinityMode::hard)};
  ASSERT_EQ(affinity.propose("r1", session("s"), kA, kStart), AffinityProposal::bound);
  ASSERT_EQ(affinity.commit("r1", kStart), AffinityCommit::confirmed);
  ASSERT_EQ(affinity.finish("r1", kStart), AffinityRelease::kept);
  ASSERT_EQ(affinity.propose("r2", session("s", true), kA, kStart), AffinityProposal::kept);
  EXPECT_EQ(affinity.abandon("r2", kStart), AffinityRelease::dropped);
  EXPECT_FALSE(affinity.binding("s", kStart));
}

TEST(SessionAffinityExpiryTest, AtMostMaxSessionsLeastRecentlyUsedEvicted) {
  SessionAffinity affinity{options(SessionAffinityMode::hard, 600s, /*max_sessions=*/3)};
  const auto bind = [&](const std::string& id, WorkerWithDpRank worker, TimePoint at) {
    ASSERT_EQ(affinity.propose(id, session(id), worker, at), AffinityProposal::bound);
    ASSERT_EQ(affinity.commit(id, at), AffinityCommit::confirmed);
    ASSERT_EQ(affinity.finish(id, at), AffinityRelease::kept);
  };
  bind("s1", kA, kStart);
  bind("s2", kB, kStart + 1s);
  bind("s3", kC, kStart + 2s);
  // s1 is used again: s2 becomes the least recently used.
  ASSERT_EQ(affinity.propose("again", session("s1"), kA, kStart + 3s), AffinityProposal::kept);
  ASSERT_EQ(affinity.finish("again", kStart + 3s), AffinityRelease::kept);
  bind("s4", kA, kStart + 4s);
  EXPECT_EQ(affinity.size(), 3U);
  EXPECT_EQ(affinity.stats().evicted, 1U);
  EXPECT_FALSE(affinity.binding("s2", kStart + 4s));
  EXPECT_EQ(affinity.binding("s1", kStart + 4s), kA);
  EXPECT_EQ(affinity.binding("s3", kStart + 4s), kC);
  EXPECT_EQ(affinity.binding("s4", kStart + 4s), kA);
  for (int i = 0; i < 100; ++i) bind(fmt::format("many{}", i), kB, kStart + 5s);
  EXPECT_EQ(affinity.size(), 3U);
}

TEST(SessionAffinityExpiryTest, RequestOfAnEvictedBindingEndsCleanly) {
  SessionAffinity affinity{options(SessionAffinityMode::soft, 600s, /*max_sessions=*/1)};
  ASSERT_EQ(affinity.propose("r1", session("s1"), kA, kStart), AffinityProposal::pending_bind);
  ASSERT_EQ(affinity.commit("r1", kStart), AffinityCommit::bound);
  ASSERT_EQ(affinity.propose("r2", session("s2"), kB, kStart), AffinityProposal::pending_bind);
  ASSERT_EQ(affinity.commit("r2", kStart), AffinityCommit::bound);  // evicts s1, r1 in flight
  EXPECT_EQ(affinity.finish("r1", kStart), AffinityRelease::kept);
  EXPECT_FALSE(affinity.binding("s1", kStart));
  EXPECT_EQ(affinity.binding("s2", kStart), kB);
  EXPECT_EQ(affinity.open_requests(), 1U);
}

// ---- parent sessions ----------------------------------------------------------------------

TEST(SessionAffinityParentTest, ChildWithoutABindingInheritsItsParentsWorker) {
  SessionAffinity affinity{options(SessionAffinityMode::hard)};
  ASSERT_EQ(affinity.propose("p1", session("parent"), kA, kStart), AffinityProposal::bound);
  const auto child = session("child", std::nullopt, "parent");
  EXPECT_EQ(affinity.hard_target(child, kStart), kA);
  // The child binds its own session; the parent's binding is only read.
  EXPECT_EQ(affinity.propose("c1", child, kA, kStart), AffinityProposal::bound);
  EXPECT_EQ(affinity.binding("child", kStart), kA);
  EXPECT_EQ(affinity.size(), 2U);
}

TEST(SessionAffinityParentTest, ChildsOwnBindingWinsOverItsParents) {
  SessionAffinity affinity{options(SessionAffinityMode::soft)};
  ASSERT_EQ(affinity.propose("p1", session("parent"), kA, kStart), AffinityProposal::pending_bind);
  ASSERT_EQ(affinity.commit("p1", kStart), AffinityCommit::bound);
  const auto child = session("child", std::nullopt, "parent");
  EXPECT_EQ(affinity.affinity_target(child, kStart)->worker_id, kA.worker_id);
  ASSERT_EQ(affinity.propose("c1", child, kB, kStart), AffinityProposal::pending_bind);
  ASSERT_EQ(affinity.commit("c1", kStart), AffinityCommit::bound);
  EXPECT_EQ(affinity.affinity_target(child, kStart)->worker_id, kB.worker_id);
  EXPECT_EQ(affinity.binding("parent", kStart), kA) << "a child never moves its parent";
}

TEST(SessionAffinityParentTest, InheritanceCanBeTurnedOff) {
  auto settings = options(SessionAffinityMode::hard);
  settings.inherit_parent_binding = false;
  SessionAffinity affinity{settings};
  ASSERT_EQ(affinity.propose("p1", session("parent"), kA, kStart), AffinityProposal::bound);
  EXPECT_FALSE(affinity.hard_target(session("child", std::nullopt, "parent"), kStart));
}

TEST(SessionAffinityParentTest, InvalidatingAnInheritedTargetLeavesTheParentBound) {
  SessionAffinity affinity{options(SessionAffinityMode::hard)};
  ASSERT_EQ(affinity.propose("p1", session("parent"), kA, kStart), AffinityProposal::bound);
  EXPECT_FALSE(affinity.invalidate("child", kA));
  EXPECT_EQ(affinity.binding("parent", kStart), kA);
}

// ---- routing through the selector ---------------------------------------------------------

std::vector<BlockHash> prompt_blocks(std::size_t length, std::uint64_t branch) {
  std::vector<BlockHash> hashes;
  std::optional<BlockHash> parent;
  for (std::size_t i = 0; i < length; ++i) {
    parent = discovery::BlockHasher::chain(parent, branch * 1000 + i);
    hashes.push_back(*parent);
  }
  return hashes;
}

discovery::WorkerRegistration registration(WorkerId id) {
  return testing::worker_registration(id, std::string{kModel}, kBlockSize, 600s);
}

class SessionAffinityRoutingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto registered = selection::register_builtin_policies(registry_);
    ASSERT_TRUE(registered) << registered.error().message();
  }

  // A selector whose aggregated workers use the policy in `yaml` (router-policy YAML).
  void make_state(std::string_view yaml, SessionAffinityOptions affinity) {
    auto config = selection::parse_router_policy_config(yaml, "test.yaml");
    ASSERT_TRUE(config) << config.error();
    auto plugins = registry_.resolve_plugins(*config);
    ASSERT_TRUE(plugins) << plugins.error().message();
    plugins_ = std::make_unique<plugins::RouterPlugins>(std::move(*plugins));
    SelectorOptions options;
    options.partition.model = std::string{kModel};
    options.router.block_size = kBlockSize;
    options.router.seed = 42;
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

  RouteRequest input(const std::string& request_id, const SessionContext* context) {
    RouteRequest routed;
    routed.selection.request_id = request_id;
    routed.selection.prompt_tokens = blocks_.size() * kBlockSize;
    routed.selection.block_hashes = blocks_;
    if (context != nullptr) routed.selection.session = *context;
    return routed;
  }

  std::expected<AffinityRouteOutcome, RouteFailure> route(const std::string& request_id,
                                                          const SessionContext* context,
                                                          TimePoint now = kStart) {
    RouteRequest request = input(request_id, context);
    return route_with_session_affinity(*state_, *affinity_, request, now);
  }

  // The request responds and completes, as the lifecycle reports it.
  void complete(const std::string& request_id, TimePoint now = kStart) {
    ASSERT_TRUE(state_->first_token(request_id));
    (void)affinity_->commit(request_id, now);
    ASSERT_TRUE(state_->release(request_id, discovery::BookingEnd::completed));
    (void)affinity_->finish(request_id, now);
  }

  std::uint32_t open_bookings(WorkerWithDpRank worker) const {
    return state_->partition_workers().load().rank_load(worker)->open_bookings;
  }

  std::vector<BlockHash> blocks_ = prompt_blocks(4, 1);
  plugins::RouterPluginRegistry registry_;
  std::unique_ptr<plugins::RouterPlugins> plugins_;
  std::unique_ptr<SelectorState> state_;
  std::unique_ptr<SessionAffinity> affinity_;
};

constexpr std::string_view kRoundRobin = "worker_selection: {aggregated: round-robin}";

TEST_F(SessionAffinityRoutingTest, HardModeBindsTheFirstRequestAndDispatchesExactlyAfterwards) {
  make_state(kRoundRobin, options(SessionAffinityMode::hard));
  add_workers({1, 2, 3});
  const auto s = session("s");
  const auto first = route("r1", &s);
  ASSERT_TRUE(first) << first.error().message;
  EXPECT_EQ(first->routing, AffinityRouting::none);
  EXPECT_EQ(first->outcome.worker, kA);  // round-robin starts at worker 1
  EXPECT_EQ(affinity_->binding("s", kStart), kA);

  for (int i = 2; i <= 5; ++i) {
    const auto next = route(fmt::format("r{}", i), &s);
    ASSERT_TRUE(next) << next.error().message;
    EXPECT_EQ(next->routing, AffinityRouting::bound_dispatch);
    EXPECT_EQ(next->outcome.worker, kA);
    EXPECT_EQ(next->outcome.eligible_workers, 1U);
  }
  EXPECT_EQ(open_bookings(kA), 5U);
  // The policy never ran for the bound requests: round-robin continues with worker 2.
  RouteRequest sessionless_request = input("x", nullptr);
  const auto sessionless = state_->route(sessionless_request, kStart);
  ASSERT_TRUE(sessionless) << sessionless.error().message;
  EXPECT_EQ(sessionless->worker, kB);
  EXPECT_EQ(affinity_->open_requests(), 5U);
}

TEST_F(SessionAffinityRoutingTest, HardModeDropsABindingToAGoneWorkerAndReselectsOnce) {
  make_state(kRoundRobin, options(SessionAffinityMode::hard));
  add_workers({1, 2});
  const auto s = session("s");
  ASSERT_TRUE(route("r1", &s));
  complete("r1");
  ASSERT_EQ(affinity_->binding("s", kStart), kA);

  ASSERT_TRUE(state_->deregister(1, 1));
  const auto moved = route("r2", &s, kStart + 1s);
  ASSERT_TRUE(moved) << moved.error().message;
  EXPECT_EQ(moved->routing, AffinityRouting::rebound_after_drop);
  EXPECT_EQ(moved->outcome.worker, kB);
  EXPECT_EQ(affinity_->binding("s", kStart + 1s), kB) << "binds to the new pick";
  EXPECT_EQ(affinity_->stats().invalidated, 1U);

  const auto next = route("r3", &s, kStart + 2s);
  ASSERT_TRUE(next) << next.error().message;
  EXPECT_EQ(next->routing, AffinityRouting::bound_dispatch);
  EXPECT_EQ(next->outcome.worker, kB);
}

TEST_F(SessionAffinityRoutingTest, HardModeRetryExcludingTheBoundWorkerReselects) {
  make_state(kRoundRobin, options(SessionAffinityMode::hard));
  add_workers({1, 2, 3});
  const auto s = session("s");
  ASSERT_TRUE(route("r1", &s));
  complete("r1");
  ASSERT_TRUE(route("r2", &s));
  // r2's worker failed before the first token: the lifecycle abandons and retries excluding it.
  ASSERT_TRUE(state_->release("r2", discovery::BookingEnd::failed));
  EXPECT_EQ(affinity_->abandon("r2", kStart), AffinityRelease::kept);
  const std::vector<WorkerId> excluded{kA.worker_id};
  auto retry = input("r2", &s);
  retry.selection.excluded_workers = excluded;
  const auto rerouted = route_with_session_affinity(*state_, *affinity_, retry, kStart);
  ASSERT_TRUE(rerouted) << rerouted.error().message;
  EXPECT_EQ(rerouted->routing, AffinityRouting::rebound_after_drop);
  EXPECT_NE(rerouted->outcome.worker, kA);
  EXPECT_EQ(affinity_->binding("s", kStart), rerouted->outcome.worker);
}

TEST_F(SessionAffinityRoutingTest, HardModeInvalidRequestKeepsTheBinding) {
  make_state(kRoundRobin, options(SessionAffinityMode::hard));
  add_workers({1, 2});
  const auto s = session("s");
  ASSERT_TRUE(route("r1", &s));
  // The same request id again while its booking is open: the request is at fault, not the worker.
  const auto duplicate = route("r1", &s);
  ASSERT_FALSE(duplicate);
  EXPECT_EQ(duplicate.error().code, Error::invalid_request);
  EXPECT_EQ(affinity_->binding("s", kStart), kA);
  EXPECT_EQ(state_->partition_workers().load().open_bookings(), 1U);
}

TEST_F(SessionAffinityRoutingTest, PinnedRequestFollowsItsPinAndLeavesTheHardBinding) {
  make_state(kRoundRobin, options(SessionAffinityMode::hard));
  add_workers({1, 2});
  const auto s = session("s");
  ASSERT_TRUE(route("r1", &s));
  complete("r1");
  auto pinned = input("r2", &s);
  pinned.selection.pinned_worker = WorkerAffinityTarget{.worker_id = kB.worker_id};
  const auto routed = route_with_session_affinity(*state_, *affinity_, pinned, kStart);
  ASSERT_TRUE(routed) << routed.error().message;
  EXPECT_EQ(routed->outcome.worker, kB);
  EXPECT_EQ(routed->routing, AffinityRouting::none);
  EXPECT_EQ(affinity_->binding("s", kStart), kA);
}

TEST_F(SessionAffinityRoutingTest, WithoutASessionAffinityStaysOutOfTheWay) {
  make_state(kRoundRobin, options(SessionAffinityMode::hard));
  add_workers({1, 2});
  for (int i = 0; i < 4; ++i) {
    const auto routed = route(fmt::format("r{}", i), nullptr);
    ASSERT_TRUE(routed) << routed.error().message;
    EXPECT_EQ(routed->routing, AffinityRouting::none);
    EXPECT_EQ(routed->outcome.worker.worker_id, static_cast<WorkerId>(i % 2 + 1));
  }
  EXPECT_EQ(affinity_->open_requests(), 0U);
}

TEST_F(SessionAffinityRoutingTest, RouteToRefusesAWorkerThatCannotTakeTheRequest) {
  make_state(kRoundRobin, options(SessionAffinityMode::hard));
  add_workers({1, 2});
  auto plain = input("r1", nullptr);
  const auto unknown = state_->route_to(plain, {9, 0}, kStart);
  ASSERT_FALSE(unknown);
  EXPECT_EQ(unknown.error().code, Error::no_workers);
  EXPECT_NE(unknown.error().message.find("not registered"), std::string::npos)
      << unknown.error().message;
  const auto rank = state_->route_to(plain, {1, 3}, kStart);
  ASSERT_FALSE(rank);
  EXPECT_NE(rank.error().message.find("data-parallel ranks"), std::string::npos)
      << rank.error().message;
  const std::vector<WorkerId> allowed{2};
  plain.selection.allowed_workers = allowed;
  const auto outside = state_->route_to(plain, kA, kStart);
  ASSERT_FALSE(outside);
  EXPECT_NE(outside.error().message.find("allow-list"), std::string::npos)
      << outside.error().message;
  const std::vector<std::string> taints{"gpu=h100"};
  plain.selection.allowed_workers = {};
  plain.selection.required_taints = taints;
  const auto untainted = state_->route_to(plain, kA, kStart);
  ASSERT_FALSE(untainted);
  EXPECT_NE(untainted.error().message.find("gpu=h100"), std::string::npos)
      << untainted.error().message;
  plain.selection.required_taints = {};
  plain.worker_type = WorkerType::Decode;
  const auto role = state_->route_to(plain, kA, kStart);
  ASSERT_FALSE(role);
  EXPECT_NE(role.error().message.find("aggregated"), std::string::npos) << role.error().message;
  EXPECT_EQ(state_->partition_workers().load().open_bookings(), 0U);

  plain.worker_type = WorkerType::Aggregated;
  const auto booked = state_->route_to(plain, kB, kStart);
  ASSERT_TRUE(booked) << booked.error().message;
  EXPECT_EQ(booked->worker, kB);
  EXPECT_EQ(open_bookings(kB), 1U);
}

TEST_F(SessionAffinityRoutingTest, RouteToReportsTheChosenWorkersOverlap) {
  make_state(kRoundRobin, options(SessionAffinityMode::hard));
  add_workers({1, 2});
  ASSERT_TRUE(state_->apply_kv_events(
      KvEventBatch{.worker = kB,
                   .incarnation = 1,
                   .event_id = 1,
                   .events = {KvStoredEvent{
                       std::nullopt, {blocks_[0], blocks_[1], blocks_[2]}, StorageTier::Device}}}));
  auto plain = input("r1", nullptr);
  plain.selection.prompt_tokens += 5;
  const auto booked = state_->route_to(plain, kB, kStart);
  ASSERT_TRUE(booked) << booked.error().message;
  EXPECT_EQ(booked->device_overlap_blocks, 3U);
  EXPECT_EQ(booked->uncached_prefill_tokens, kBlockSize + 5);
  EXPECT_EQ(state_->partition_workers().load().rank_load(kB)->booked_prefill_tokens,
            kBlockSize + 5);
}

TEST_F(SessionAffinityRoutingTest, SoftModeOffersTheBindingButAClassifierTargetWins) {
  make_state(kRoundRobin, options(SessionAffinityMode::soft));
  add_workers({1, 2});
  const auto s = session("s");
  const auto first = route("r1", &s);
  ASSERT_TRUE(first) << first.error().message;
  EXPECT_EQ(first->routing, AffinityRouting::none);
  complete("r1");
  // round-robin ignores the target, so the next request goes to B: soft is only a preference.
  const auto second = route("r2", &s);
  ASSERT_TRUE(second) << second.error().message;
  EXPECT_EQ(second->routing, AffinityRouting::target_offered);
  EXPECT_EQ(second->outcome.worker, kB);
  EXPECT_EQ(affinity_->binding("s", kStart), kA) << "rebinding waits for the first token";
  complete("r2");
  EXPECT_EQ(affinity_->binding("s", kStart), kB);

  auto classified = input("r3", &s);
  classified.selection.affinity_target = WorkerAffinityTarget{.worker_id = kA.worker_id};
  const auto third = route_with_session_affinity(*state_, *affinity_, classified, kStart);
  ASSERT_TRUE(third) << third.error().message;
  EXPECT_EQ(third->routing, AffinityRouting::none) << "the classifier's target is kept";
  complete("r3");

  // A classifier that cleared the target: the session's binding is not offered either.
  auto cleared = input("r4", &s);
  cleared.without_soft_target = true;
  const auto fourth = route_with_session_affinity(*state_, *affinity_, cleared, kStart);
  ASSERT_TRUE(fourth) << fourth.error().message;
  EXPECT_EQ(fourth->routing, AffinityRouting::none);
  EXPECT_EQ(cleared.selection.affinity_target, std::nullopt) << "no soft target reached selection";
}

// The reference's soft-pinning walkthrough, end to end through the selector: request 1 of a
// session lands on A and binds there; with request 1 still open, A is loaded above the guard's
// limit, so request 2 (target A) goes to B and the session rebinds to B at its first token; once
// everything completed, request 3 (target B) stays on B although A is now lighter: A → B → B.
TEST_F(SessionAffinityRoutingTest, SoftPinningWalkthroughWithTheLoadGuard) {
  make_state(R"(
worker_selection:
  aggregated: guard
  instances:
    - name: guard
      type: soft-affinity-load-guard
      parameters: {max_active_requests: 2, margin: 1}
)",
             options(SessionAffinityMode::soft));
  add_workers({1, 2});
  // Another session's long request keeps B busy throughout.
  {
    RouteRequest background = input("b-background", nullptr);
    ASSERT_TRUE(state_->route_to(background, kB, kStart));
  }

  // Request 1: no binding yet, A is the least loaded.
  const auto s = session("S");
  const auto first = route("req1", &s);
  ASSERT_TRUE(first) << first.error().message;
  EXPECT_EQ(first->routing, AffinityRouting::none);
  EXPECT_EQ(first->outcome.worker, kA);
  EXPECT_FALSE(affinity_->binding("S", kStart)) << "bound only once the response starts";
  ASSERT_TRUE(state_->first_token("req1"));
  ASSERT_EQ(affinity_->commit("req1", kStart + 1s), AffinityCommit::bound);
  EXPECT_EQ(affinity_->binding("S", kStart + 1s), kA);

  // Request 1 stays open; two more requests booked on A put it at 3 active, above the limit of
  // 2, while B (1 active) is lighter by at least the margin.
  {
    RouteRequest background = input("a-load-1", nullptr);
    ASSERT_TRUE(state_->route_to(background, kA, kStart + 2s));
  }
  {
    RouteRequest background = input("a-load-2", nullptr);
    ASSERT_TRUE(state_->route_to(background, kA, kStart + 2s));
  }
  EXPECT_EQ(open_bookings(kA), 3U);

  const auto second = route("req2", &s, kStart + 3s);
  ASSERT_TRUE(second) << second.error().message;
  EXPECT_EQ(second->routing, AffinityRouting::target_offered);
  EXPECT_EQ(second->outcome.worker, kB);
  EXPECT_EQ(affinity_->binding("S", kStart + 3s), kA) << "no rebinding before the first token";
  ASSERT_TRUE(state_->first_token("req2"));
  EXPECT_EQ(affinity_->commit("req2", kStart + 4s), AffinityCommit::rebound);
  EXPECT_EQ(affinity_->binding("S", kStart + 4s), kB);

  // Everything of the session and A's extra load completes; the load drains.
  for (const std::string id : {"a-load-1", "a-load-2"}) {
    ASSERT_TRUE(state_->release(id, discovery::BookingEnd::completed));
  }
  ASSERT_TRUE(state_->release("req1", discovery::BookingEnd::completed));
  EXPECT_EQ(affinity_->finish("req1", kStart + 5s), AffinityRelease::kept);
  ASSERT_TRUE(state_->release("req2", discovery::BookingEnd::completed));
  EXPECT_EQ(affinity_->finish("req2", kStart + 5s), AffinityRelease::kept);
  EXPECT_EQ(open_bookings(kA), 0U);
  EXPECT_EQ(open_bookings(kB), 1U);  // the background request

  // Without a target the guard would now pick A, the lighter worker ...
  RouteRequest control_request = input("control", nullptr);
  const auto control = state_->route(control_request, kStart + 6s);
  ASSERT_TRUE(control) << control.error().message;
  EXPECT_EQ(control->worker, kA);
  ASSERT_TRUE(state_->release("control", discovery::BookingEnd::completed));
  // ... but request 3 carries the binding, B, which is within the limit: it stays on B.
  const auto third = route("req3", &s, kStart + 7s);
  ASSERT_TRUE(third) << third.error().message;
  EXPECT_EQ(third->routing, AffinityRouting::target_offered);
  EXPECT_EQ(third->outcome.worker, kB);
  ASSERT_TRUE(state_->first_token("req3"));
  EXPECT_EQ(affinity_->commit("req3", kStart + 8s), AffinityCommit::confirmed);
  EXPECT_EQ(affinity_->binding("S", kStart + 8s), kB);
}

}  // namespace
}  // namespace kvr
