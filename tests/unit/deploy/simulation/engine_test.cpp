#include "deploy/simulation/engine.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace kvr::simulation {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

constexpr double kTolerance = 1e-9;

// Hand-computed with the default coefficients:
// prefill_ms(T) = 4.209989e-7 T^2 + 0.01518344 T + 16.50142.
constexpr double kPrefill5Ms = 16.5773477249725;
constexpr double kPrefill72Ms = 17.5968101382976;  // 0.0021824 + 1.09320768 + 16.50142
constexpr double kPrefill100Ms = 18.023973989;     // 0.004209989 + 1.518344 + 16.50142
constexpr double kPrefill200Ms = 19.554947956;     // 0.016839956 + 3.036688 + 16.50142
constexpr double kPrefill3616Ms = 76.9094916329984;
constexpr double kPrefill8192Ms = 169.1369184042496;
// decode_ms(u) = max(1, -25.74 u^2 + 54.01 u + 5.74).
constexpr double kDecode2of16Ms = 12.0890625;         // u = 0.125: -0.4021875 + 6.75125 + 5.74
constexpr double kDecode6of16Ms = 22.3740625;         // u = 0.375: -3.6196875 + 20.25375 + 5.74
constexpr double kDecode6of6Ms = 34.01;               // u = 1
constexpr double kDecode4of6Ms = 30.306666666666665;  // u = 2/3

EngineConfig small_config(std::uint32_t block_size, std::uint32_t num_gpu_blocks) {
  EngineConfig config;
  config.block_size = block_size;
  config.num_gpu_blocks = num_gpu_blocks;
  return config;
}

Engine make_engine(const EngineConfig& config) {
  auto engine = Engine::create(config);
  EXPECT_TRUE(engine.has_value());
  return std::move(*engine);
}

EngineRequest request(EngineRequestId id, std::vector<BlockHash> hashes, std::uint64_t prompt,
                      std::uint64_t output) {
  return EngineRequest{id, std::move(hashes), prompt, output};
}

void add(Engine& engine, EngineRequest request, double now_ms = 0.0) {
  const auto added = engine.add_request(std::move(request), now_ms);
  ASSERT_TRUE(added.has_value()) << as_str(added.error());
}

KvEvent stored(std::optional<BlockHash> parent, std::vector<BlockHash> hashes) {
  return KvStoredEvent{parent, std::move(hashes), StorageTier::Device};
}

KvEvent removed(std::vector<BlockHash> hashes) {
  return KvRemovedEvent{std::move(hashes), StorageTier::Device};
}

// Steps until the engine is idle, each step starting when the previous one ended.
std::vector<StepResult> run_to_idle(Engine& engine, double now_ms) {
  std::vector<StepResult> steps;
  while (engine.has_work()) {
    steps.push_back(engine.step(now_ms));
    now_ms = steps.back().end_ms();
  }
  return steps;
}

TEST(EngineTest, PrefillThenDecodeStepsFollowTimingModel) {
  Engine engine = make_engine(small_config(64, 16));
  add(engine, request(1, {}, 100, 3));

  const StepResult prefill = engine.step(0.0);
  EXPECT_EQ(prefill.prefill_tokens, 100U);
  EXPECT_EQ(prefill.decode_requests, 0U);
  EXPECT_NEAR(prefill.duration_ms, kPrefill100Ms, kTolerance);
  ASSERT_EQ(prefill.first_tokens.size(), 1U);
  EXPECT_EQ(prefill.first_tokens[0].id, 1U);
  EXPECT_NEAR(prefill.first_tokens[0].time_ms, kPrefill100Ms, kTolerance);

  // 101 tokens of KV need 2 of 16 blocks.
  const StepResult decode = engine.step(prefill.end_ms());
  EXPECT_EQ(decode.prefill_tokens, 0U);
  EXPECT_EQ(decode.decode_requests, 1U);
  EXPECT_NEAR(decode.kv_utilisation, 0.125, kTolerance);
  EXPECT_NEAR(decode.duration_ms, kDecode2of16Ms, kTolerance);
  EXPECT_THAT(decode.next_tokens, ElementsAre(1U));

  const StepResult last = engine.step(decode.end_ms());
  ASSERT_EQ(last.completions.size(), 1U);
  const RequestStats& stats = last.completions[0];
  EXPECT_NEAR(stats.first_token_ms, kPrefill100Ms, kTolerance);
  EXPECT_NEAR(stats.completion_ms, kPrefill100Ms + 2 * kDecode2of16Ms, kTolerance);
  EXPECT_NEAR(stats.ttft_ms(), kPrefill100Ms, kTolerance);
  EXPECT_NEAR(stats.mean_inter_token_ms(), kDecode2of16Ms, kTolerance);
  EXPECT_NEAR(stats.max_inter_token_ms, kDecode2of16Ms, kTolerance);
  EXPECT_EQ(stats.output_tokens, 3U);
  EXPECT_FALSE(engine.has_work());
  EXPECT_EQ(engine.load().active_decode_blocks, 0U);
}

TEST(EngineTest, TimeScaleDividesEveryEngineTime) {
  EngineConfig config = small_config(64, 16);
  config.timing.time_scale = 10.0;
  Engine engine = make_engine(config);
  add(engine, request(1, {}, 100, 3), 5.0);

  const std::vector<StepResult> steps = run_to_idle(engine, 5.0);
  ASSERT_EQ(steps.size(), 3U);
  EXPECT_NEAR(steps[0].duration_ms, kPrefill100Ms / 10.0, kTolerance);
  EXPECT_NEAR(steps[1].duration_ms, kDecode2of16Ms / 10.0, kTolerance);
  ASSERT_EQ(steps[2].completions.size(), 1U);
  EXPECT_NEAR(steps[2].completions[0].ttft_ms(), kPrefill100Ms / 10.0, kTolerance);
  EXPECT_NEAR(steps[2].completions[0].completion_ms,
              5.0 + (kPrefill100Ms + 2 * kDecode2of16Ms) / 10.0, kTolerance);
}

TEST(EngineTest, MixedStepCostsPrefillPlusDecode) {
  Engine engine = make_engine(small_config(64, 16));
  add(engine, request(1, {}, 100, 5));
  const StepResult first = engine.step(0.0);
  add(engine, request(2, {}, 200, 5), first.end_ms());

  // Request 1 decodes (101 tokens, 2 blocks) while request 2 prefills (200 tokens, 4 blocks).
  const StepResult mixed = engine.step(first.end_ms());
  EXPECT_EQ(mixed.prefill_tokens, 200U);
  EXPECT_EQ(mixed.decode_requests, 1U);
  EXPECT_NEAR(mixed.kv_utilisation, 6.0 / 16.0, kTolerance);
  EXPECT_NEAR(mixed.duration_ms, kPrefill200Ms + kDecode6of16Ms, kTolerance);
  EXPECT_THAT(mixed.next_tokens, ElementsAre(1U));
  ASSERT_EQ(mixed.first_tokens.size(), 1U);
  EXPECT_EQ(mixed.first_tokens[0].id, 2U);
}

TEST(EngineTest, SecondRequestReusesSharedPrefix) {
  Engine engine = make_engine(small_config(64, 16));
  // 200 tokens: three full blocks and 8 tokens in a partial one.
  add(engine, request(1, {1, 2, 3}, 200, 1));
  const StepResult first = engine.step(0.0);
  EXPECT_THAT(first.kv_events, ElementsAre(stored(std::nullopt, {1, 2, 3})));
  EXPECT_EQ(engine.cached_prefix_tokens(std::vector<BlockHash>{1, 2, 7}), 128U);

  add(engine, request(2, {1, 2, 7}, 200, 1), first.end_ms());
  const StepResult second = engine.step(first.end_ms());
  // Blocks 1 and 2 are reused: 200 - 128 = 72 tokens are prefilled.
  EXPECT_EQ(second.prefill_tokens, 72U);
  EXPECT_NEAR(second.duration_ms, kPrefill72Ms, kTolerance);
  ASSERT_EQ(second.first_tokens.size(), 1U);
  EXPECT_EQ(second.first_tokens[0].cached_prompt_tokens, 128U);
  ASSERT_EQ(second.completions.size(), 1U);
  EXPECT_EQ(second.completions[0].cached_prompt_tokens, 128U);
  EXPECT_THAT(second.kv_events, ElementsAre(stored(2, {7})));
}

TEST(EngineTest, FullyCachedPromptRecomputesItsLastBlock) {
  Engine engine = make_engine(small_config(64, 16));
  add(engine, request(1, {1, 2}, 128, 1));
  const StepResult first = engine.step(0.0);

  add(engine, request(2, {1, 2}, 128, 1), first.end_ms());
  const StepResult second = engine.step(first.end_ms());
  EXPECT_EQ(second.prefill_tokens, 64U);
  ASSERT_EQ(second.first_tokens.size(), 1U);
  EXPECT_EQ(second.first_tokens[0].cached_prompt_tokens, 64U);
  // The recomputed copy of block 2 is not announced again.
  EXPECT_THAT(second.kv_events, IsEmpty());
}

TEST(EngineTest, PrefixesComputedInTheSameStepAreNotSharedOrAnnouncedTwice) {
  Engine engine = make_engine(small_config(64, 16));
  add(engine, request(1, {1, 2, 3}, 200, 1));
  add(engine, request(2, {1, 2, 3}, 200, 1));

  const StepResult step = engine.step(0.0);
  EXPECT_EQ(step.prefill_tokens, 400U);
  ASSERT_EQ(step.first_tokens.size(), 2U);
  EXPECT_EQ(step.first_tokens[1].cached_prompt_tokens, 0U);
  EXPECT_THAT(step.kv_events, ElementsAre(stored(std::nullopt, {1, 2, 3})));
}

TEST(EngineTest, EvictsLeastRecentlyUsedBlocksTailFirst) {
  // Four blocks of four tokens; a nine-token prompt needs two full blocks and a partial one.
  Engine engine = make_engine(small_config(4, 4));
  add(engine, request(1, {11, 12}, 9, 1));
  const StepResult first = engine.step(0.0);
  EXPECT_THAT(first.kv_events, ElementsAre(stored(std::nullopt, {11, 12})));
  // Released tail first, so the prompt's last block is evicted before its first.
  EXPECT_THAT(engine.pool().eviction_order(), ElementsAre(12, 11));

  // Two free blocks, then one eviction.
  add(engine, request(2, {21, 22}, 9, 1));
  const StepResult second = engine.step(first.end_ms());
  EXPECT_THAT(second.kv_events, ElementsAre(removed({12}), stored(std::nullopt, {21, 22})));
  EXPECT_THAT(engine.pool().eviction_order(), ElementsAre(11, 22, 21));

  // Reuses 11, takes the one free block and evicts 22, the least recently used left.
  add(engine, request(3, {11, 31}, 9, 1));
  const StepResult third = engine.step(second.end_ms());
  EXPECT_EQ(third.prefill_tokens, 5U);
  EXPECT_NEAR(third.duration_ms, kPrefill5Ms, kTolerance);
  EXPECT_THAT(third.kv_events, ElementsAre(removed({22}), stored(11, {31})));
  EXPECT_THAT(engine.pool().eviction_order(), ElementsAre(21, 31, 11));
}

TEST(EngineTest, ChunkedPrefillSplitsLongPromptByTokenBudget) {
  Engine engine = make_engine(EngineConfig{});
  add(engine, request(1, {}, 20'000, 2));

  const std::vector<StepResult> steps = run_to_idle(engine, 0.0);
  ASSERT_EQ(steps.size(), 4U);
  EXPECT_EQ(steps[0].prefill_tokens, 8'192U);
  EXPECT_EQ(steps[1].prefill_tokens, 8'192U);
  EXPECT_EQ(steps[2].prefill_tokens, 3'616U);
  EXPECT_NEAR(steps[0].duration_ms, kPrefill8192Ms, kTolerance);
  EXPECT_NEAR(steps[2].duration_ms, kPrefill3616Ms, kTolerance);
  EXPECT_THAT(steps[0].first_tokens, IsEmpty());
  EXPECT_THAT(steps[1].first_tokens, IsEmpty());
  ASSERT_EQ(steps[2].first_tokens.size(), 1U);
  EXPECT_NEAR(steps[2].first_tokens[0].time_ms, 2 * kPrefill8192Ms + kPrefill3616Ms, 1e-6);
  EXPECT_EQ(steps[3].decode_requests, 1U);
  EXPECT_EQ(steps[3].completions.size(), 1U);
}

TEST(EngineTest, DecodesTakeBudgetBeforePrefillChunks) {
  EngineConfig config = small_config(4, 64);
  config.max_num_batched_tokens = 10;
  Engine engine = make_engine(config);
  add(engine, request(1, {}, 5, 10));
  add(engine, request(2, {}, 5, 10));
  (void)engine.step(0.0);  // both prefills: 10 tokens

  add(engine, request(3, {}, 30, 1));
  const StepResult step = engine.step(100.0);
  EXPECT_EQ(step.decode_requests, 2U);
  EXPECT_EQ(step.prefill_tokens, 8U);
  EXPECT_EQ(engine.load().active_prefill_tokens, 22U);
}

TEST(EngineTest, StoredEventsChainParentsAcrossPrefillChunks) {
  EngineConfig config = small_config(4, 16);
  config.max_num_batched_tokens = 6;
  Engine engine = make_engine(config);
  add(engine, request(1, {101, 102, 103}, 14, 1));

  const std::vector<StepResult> steps = run_to_idle(engine, 0.0);
  ASSERT_EQ(steps.size(), 3U);
  // 6 tokens fill block 101; 12 fill 102 and 103; the last 2 fill no hashed block.
  EXPECT_THAT(steps[0].kv_events, ElementsAre(stored(std::nullopt, {101})));
  EXPECT_THAT(steps[1].kv_events, ElementsAre(stored(101, {102, 103})));
  EXPECT_THAT(steps[2].kv_events, IsEmpty());
  EXPECT_EQ(steps[2].completions.size(), 1U);
}

TEST(EngineTest, PreemptsNewestRequestWhenPoolFillsAndRecomputesIt) {
  // Six blocks of four tokens; each request peaks at 8 + 6 - 1 = 13 tokens, four blocks.
  Engine engine = make_engine(small_config(4, 6));
  add(engine, request(1, {11, 12}, 8, 6));
  add(engine, request(2, {21, 22}, 8, 6));

  const StepResult prefill = engine.step(0.0);
  EXPECT_EQ(prefill.first_tokens.size(), 2U);
  EXPECT_THAT(prefill.kv_events,
              ElementsAre(stored(std::nullopt, {11, 12}), stored(std::nullopt, {21, 22})));

  // Decodes 2..5: each request grows to a third block in the first of them, filling the pool.
  double now = prefill.end_ms();
  for (int decode = 0; decode < 4; ++decode) {
    const StepResult step = engine.step(now);
    EXPECT_EQ(step.decode_requests, 2U);
    EXPECT_NEAR(step.duration_ms, kDecode6of6Ms, kTolerance);
    EXPECT_THAT(step.preempted, IsEmpty());
    now = step.end_ms();
  }

  // Request 1 needs a fourth block: request 2, the newest, is preempted; 1 finishes.
  const StepResult preempting = engine.step(now);
  EXPECT_THAT(preempting.preempted, ElementsAre(2U));
  EXPECT_EQ(preempting.decode_requests, 1U);
  EXPECT_NEAR(preempting.duration_ms, kDecode4of6Ms, kTolerance);
  ASSERT_EQ(preempting.completions.size(), 1U);
  EXPECT_EQ(preempting.completions[0].id, 1U);
  EXPECT_THAT(preempting.kv_events, IsEmpty());
  EXPECT_EQ(engine.load().waiting_requests, 1U);
  // 8 prompt + 5 generated tokens, of which the 8 in blocks 21 and 22 are still cached.
  EXPECT_EQ(engine.load().active_prefill_tokens, 5U);

  // Readmitted: 21 and 22 are reused, the 5 remaining tokens are recomputed and the sixth token
  // appears.
  const StepResult recompute = engine.step(preempting.end_ms());
  EXPECT_EQ(recompute.prefill_tokens, 5U);
  EXPECT_NEAR(recompute.duration_ms, kPrefill5Ms, kTolerance);
  EXPECT_THAT(recompute.first_tokens, IsEmpty());
  EXPECT_THAT(recompute.next_tokens, ElementsAre(2U));
  ASSERT_EQ(recompute.completions.size(), 1U);
  const RequestStats& stats = recompute.completions[0];
  EXPECT_EQ(stats.preemptions, 1U);
  EXPECT_EQ(stats.output_tokens, 6U);
  EXPECT_EQ(stats.cached_prompt_tokens, 0U);
  EXPECT_NEAR(stats.max_inter_token_ms, kDecode4of6Ms + kPrefill5Ms, kTolerance);
  EXPECT_FALSE(engine.has_work());
}

TEST(EngineTest, MaxNumSeqsBoundsRunningRequests) {
  EngineConfig config = small_config(64, 16);
  config.max_num_seqs = 2;
  Engine engine = make_engine(config);
  for (EngineRequestId id : {1, 2, 3}) add(engine, request(id, {}, 10, 5));

  const StepResult step = engine.step(0.0);
  EXPECT_EQ(step.first_tokens.size(), 2U);
  const EngineLoad load = engine.load();
  EXPECT_EQ(load.active_requests, 2U);
  EXPECT_EQ(load.waiting_requests, 1U);
  EXPECT_EQ(load.active_prefill_tokens, 10U);
}

TEST(EngineTest, LoadReportsBlocksAndPendingPrefill) {
  Engine engine = make_engine(small_config(64, 16));
  add(engine, request(1, {1, 2, 3}, 200, 2));
  EXPECT_EQ(engine.load().active_prefill_tokens, 200U);

  (void)engine.step(0.0);
  const EngineLoad load = engine.load();
  EXPECT_EQ(load.active_requests, 1U);
  EXPECT_EQ(load.active_prefill_tokens, 0U);
  EXPECT_EQ(load.active_decode_blocks, 4U);
  EXPECT_EQ(load.kv_blocks_used, 4U);
  EXPECT_EQ(load.total_blocks, 16U);

  // Waiting requests count the prompt minus the prefix cached when they arrived.
  add(engine, request(2, {1, 2, 9}, 200, 2));
  EXPECT_EQ(engine.load().active_prefill_tokens, 72U);
}

TEST(EngineTest, ResetClearsPoolAndDropsRequests) {
  Engine engine = make_engine(small_config(64, 16));
  add(engine, request(1, {1}, 100, 5));
  (void)engine.step(0.0);
  add(engine, request(2, {2}, 100, 5));

  const ResetResult reset = engine.reset();
  EXPECT_THAT(reset.kv_events, ElementsAre(KvEvent{KvClearedEvent{}}));
  EXPECT_THAT(reset.aborted, ElementsAre(1U, 2U));
  EXPECT_FALSE(engine.has_work());
  EXPECT_THAT(engine.dump(), IsEmpty());
  EXPECT_EQ(engine.load().kv_blocks_used, 0U);
  EXPECT_EQ(engine.load().active_prefill_tokens, 0U);
  // Ids are free again.
  add(engine, request(1, {1}, 100, 5));
}

TEST(EngineTest, DumpReportsCachedChainsWithParents) {
  Engine engine = make_engine(small_config(64, 16));
  add(engine, request(1, {1, 2, 3}, 200, 1));
  const StepResult first = engine.step(0.0);
  add(engine, request(2, {1, 2, 4}, 200, 1));
  (void)engine.step(first.end_ms());

  EXPECT_THAT(engine.dump(),
              ElementsAre(KvStoredEvent{std::nullopt, {1, 2, 3}, StorageTier::Device},
                          KvStoredEvent{2, {4}, StorageTier::Device}));
}

TEST(EngineTest, AbortReleasesBlocksWithoutEvents) {
  Engine engine = make_engine(small_config(64, 16));
  add(engine, request(1, {1, 2}, 150, 10));
  (void)engine.step(0.0);
  EXPECT_TRUE(engine.abort_request(1));
  EXPECT_FALSE(engine.abort_request(1));
  EXPECT_FALSE(engine.has_work());
  EXPECT_EQ(engine.load().active_decode_blocks, 0U);
  EXPECT_EQ(engine.pool().cached_blocks(), 2U);
  EXPECT_EQ(engine.step(50.0).duration_ms, 0.0);
}

TEST(EngineTest, DisabledPrefixCachingNeitherReusesNorAnnounces) {
  EngineConfig config = small_config(64, 16);
  config.enable_prefix_caching = false;
  Engine engine = make_engine(config);
  add(engine, request(1, {1, 2}, 150, 1));
  const StepResult first = engine.step(0.0);
  add(engine, request(2, {1, 2}, 150, 1));
  const StepResult second = engine.step(first.end_ms());
  EXPECT_THAT(first.kv_events, IsEmpty());
  EXPECT_EQ(second.prefill_tokens, 150U);
  EXPECT_EQ(second.first_tokens.at(0).cached_prompt_tokens, 0U);
}

TEST(EngineTest, RejectsRequestsItCouldNeverServe) {
  Engine engine = make_engine(small_config(4, 4));
  EXPECT_EQ(engine.add_request(request(1, {}, 0, 1), 0.0).error(), RequestError::empty_prompt);
  EXPECT_EQ(engine.add_request(request(1, {}, 4, 0), 0.0).error(), RequestError::no_output_tokens);
  EXPECT_EQ(engine.add_request(request(1, {1, 2}, 7, 1), 0.0).error(),
            RequestError::too_many_block_hashes);
  // 16 + 2 - 1 = 17 tokens need five blocks.
  EXPECT_EQ(engine.add_request(request(1, {}, 16, 2), 0.0).error(),
            RequestError::exceeds_kv_capacity);
  EXPECT_TRUE(engine.add_request(request(1, {}, 16, 1), 0.0).has_value());
  EXPECT_EQ(engine.add_request(request(1, {}, 4, 1), 0.0).error(), RequestError::duplicate_id);
}

TEST(EngineTest, MovedEngineKeepsItsRequests) {
  std::vector<Engine> engines;
  engines.push_back(make_engine(small_config(64, 16)));
  add(engines[0], request(1, {}, 100, 2));
  engines.push_back(make_engine(small_config(64, 16)));
  engines.push_back(make_engine(small_config(64, 16)));  // reallocates, moving engines[0]

  const std::vector<StepResult> steps = run_to_idle(engines[0], 0.0);
  ASSERT_EQ(steps.size(), 2U);
  EXPECT_EQ(steps[1].completions.at(0).id, 1U);
}

TEST(EngineTest, SteppingIntoAReusedResultGivesTheSameSteps) {
  // Enough requests on a small pool to evict and preempt, so every kind of result is filled.
  EngineConfig config = small_config(16, 12);
  config.max_num_batched_tokens = 64;
  Engine fresh = make_engine(config);
  Engine reused = make_engine(config);
  for (Engine* engine : {&fresh, &reused}) {
    add(*engine, request(1, {1, 2, 3}, 60, 20));
    add(*engine, request(2, {1, 2, 5}, 50, 30));
    add(*engine, request(3, {7, 8}, 40, 10));
  }
  StepResult result;
  double now = 0.0;
  std::size_t steps = 0;
  bool preempted = false;
  bool evicted = false;
  for (int wave = 0; wave < 2; ++wave) {
    if (wave == 1) {
      // The first wave left its prompts cached; these need room, so they evict.
      for (Engine* engine : {&fresh, &reused}) {
        add(*engine, request(4, {20, 21, 22}, 60, 20), now);
        add(*engine, request(5, {30, 31, 32}, 60, 20), now);
      }
    }
    while (fresh.has_work()) {
      const StepResult expected = fresh.step(now);
      reused.step(now, result);
      ASSERT_EQ(result.start_ms, expected.start_ms);
      ASSERT_EQ(result.duration_ms, expected.duration_ms);
      ASSERT_EQ(result.prefill_tokens, expected.prefill_tokens);
      ASSERT_EQ(result.decode_requests, expected.decode_requests);
      ASSERT_EQ(result.kv_events, expected.kv_events) << "step " << steps;
      ASSERT_EQ(result.next_tokens, expected.next_tokens);
      ASSERT_EQ(result.preempted, expected.preempted);
      ASSERT_EQ(result.first_tokens.size(), expected.first_tokens.size());
      ASSERT_EQ(result.completions.size(), expected.completions.size());
      preempted = preempted || !expected.preempted.empty();
      for (const KvEvent& event : expected.kv_events) {
        evicted = evicted || std::holds_alternative<KvRemovedEvent>(event);
      }
      now = expected.end_ms();
      ++steps;
    }
  }
  EXPECT_FALSE(reused.has_work());
  EXPECT_TRUE(preempted);
  EXPECT_TRUE(evicted);
}

TEST(EngineTest, CreateRejectsInvalidConfig) {
  EngineConfig config;
  config.timing.time_scale = -1.0;
  const auto engine = Engine::create(config);
  ASSERT_FALSE(engine.has_value());
  EXPECT_EQ(engine.error().field, "timing.time_scale");
}

}  // namespace
}  // namespace kvr::simulation
