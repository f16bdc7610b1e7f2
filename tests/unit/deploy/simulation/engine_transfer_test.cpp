// The simulated engine's disaggregated serving: a prefill worker's remote_decode requests hold
// their blocks until released; a decode worker's remote_prefill requests wait for their KV
// transfer, count it as cached and announce it as stored.
#include <optional>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "deploy/simulation/engine.hpp"
#include "deploy/simulation/timing_model.hpp"

namespace kvr::simulation {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

constexpr std::uint32_t kBlockSize = 16;
// 40 tokens: two full blocks (hashes 21, 22) and a partial third.
constexpr std::uint64_t kPrompt = 40;
constexpr std::uint64_t kPromptBlocks = 3;

// Times that are exact in binary, so that sums can be compared exactly.
EngineConfig transfer_config(std::uint32_t num_gpu_blocks = 64) {
  EngineConfig config;
  config.block_size = kBlockSize;
  config.num_gpu_blocks = num_gpu_blocks;
  config.transfer.latency_ms = 3.0;
  config.transfer.ms_per_block = 0.5;
  return config;
}

Engine make_engine(const EngineConfig& config) {
  auto engine = Engine::create(config);
  EXPECT_TRUE(engine.has_value());
  return std::move(*engine);
}

EngineRequest request(EngineRequestId id, std::vector<BlockHash> hashes, std::uint64_t prompt,
                      std::uint64_t output, KvTransfer kv_transfer = KvTransfer::none,
                      std::optional<std::uint64_t> remote_blocks = std::nullopt) {
  return EngineRequest{.id = id,
                       .block_hashes = std::move(hashes),
                       .prompt_tokens = prompt,
                       .output_tokens = output,
                       .kv_transfer = kv_transfer,
                       .remote_blocks = remote_blocks};
}

EngineRequest pulled(EngineRequestId id, std::uint64_t output,
                     std::optional<std::uint64_t> remote_blocks = std::nullopt) {
  return request(id, {21, 22}, kPrompt, output, KvTransfer::remote_prefill, remote_blocks);
}

void add(Engine& engine, EngineRequest request, double now_ms = 0.0) {
  const auto added = engine.add_request(std::move(request), now_ms);
  ASSERT_TRUE(added.has_value()) << as_str(added.error());
}

KvEvent stored(std::optional<BlockHash> parent, std::vector<BlockHash> hashes) {
  return KvStoredEvent{parent, std::move(hashes), StorageTier::Device};
}

// Steps until the engine is idle (at most `limit` steps), each from the previous one's end.
std::vector<StepResult> run_to_idle(Engine& engine, double now_ms, std::size_t limit = 1000) {
  std::vector<StepResult> steps;
  while (engine.has_work() && steps.size() < limit) {
    steps.push_back(engine.step(now_ms));
    EXPECT_GT(steps.back().duration_ms, 0.0) << "step " << steps.size();
    now_ms = steps.back().end_ms();
  }
  EXPECT_FALSE(engine.has_work()) << "still busy after " << limit << " steps";
  return steps;
}

double transfer_ms(const EngineConfig& config, std::uint64_t blocks) {
  return (config.transfer.latency_ms + config.transfer.ms_per_block * static_cast<double>(blocks)) /
         config.timing.time_scale;
}

TEST(EngineTransferTest, PrefillOnlyRequestMakesOneTokenAndHoldsItsBlocksUntilReleased) {
  Engine engine = make_engine(transfer_config());
  add(engine, request(1, {21, 22}, kPrompt, 50, KvTransfer::remote_decode));

  const std::vector<StepResult> steps = run_to_idle(engine, 0.0);
  ASSERT_EQ(steps.size(), 1U);
  const StepResult& step = steps[0];
  EXPECT_EQ(step.prefill_tokens, kPrompt);
  ASSERT_EQ(step.first_tokens.size(), 1U);
  ASSERT_EQ(step.completions.size(), 1U);
  EXPECT_EQ(step.completions[0].output_tokens, 1U);
  EXPECT_EQ(step.completions[0].held_blocks, kPromptBlocks);
  EXPECT_THAT(step.kv_events, ElementsAre(stored(std::nullopt, {21, 22})));

  // Held: referenced, but no longer a request.
  EXPECT_EQ(engine.held_blocks(1).size(), kPromptBlocks);
  EngineLoad load = engine.load();
  EXPECT_EQ(load.active_requests, 0U);
  EXPECT_EQ(load.waiting_requests, 0U);
  EXPECT_EQ(load.kv_blocks_used, kPromptBlocks);
  EXPECT_EQ(engine.pool().cached_blocks(), 0U);

  EXPECT_TRUE(engine.release_transfer(1));
  EXPECT_FALSE(engine.release_transfer(1));
  EXPECT_THAT(engine.held_blocks(1), IsEmpty());
  load = engine.load();
  EXPECT_EQ(load.kv_blocks_used, 0U);
  // Released like any finished request's: the hashed blocks stay cached and are reused.
  EXPECT_EQ(engine.pool().cached_blocks(), 2U);
  add(engine, request(2, {21, 22}, kPrompt, 1), steps.back().end_ms());
  const std::vector<StepResult> again = run_to_idle(engine, steps.back().end_ms());
  ASSERT_FALSE(again.empty());
  ASSERT_EQ(again[0].first_tokens.size(), 1U);
  EXPECT_EQ(again[0].first_tokens[0].cached_prompt_tokens, 2 * kBlockSize);
}

TEST(EngineTransferTest, HeldBlocksAreNeverEvictedAndAFullPoolStallsUntilRelease) {
  // 16 blocks, 3 held: a request needing 15 cannot run until the hold ends.
  Engine engine = make_engine(transfer_config(16));
  add(engine, request(1, {21, 22}, kPrompt, 1, KvTransfer::remote_decode));
  const std::vector<StepResult> prefill = run_to_idle(engine, 0.0);
  ASSERT_EQ(prefill.size(), 1U);
  const double now = prefill.back().end_ms();

  add(engine, request(2, {}, 15 * kBlockSize, 1), now);
  ASSERT_TRUE(engine.has_work());
  const StepResult stalled = engine.step(now);
  EXPECT_EQ(stalled.duration_ms, 0.0);
  EXPECT_THAT(stalled.first_tokens, IsEmpty());
  EXPECT_THAT(stalled.kv_events, IsEmpty());
  EXPECT_FALSE(engine.has_work());
  EXPECT_TRUE(engine.pool().contains(21));
  EXPECT_TRUE(engine.pool().contains(22));
  EXPECT_EQ(engine.load().waiting_requests, 1U);

  ASSERT_TRUE(engine.release_transfer(1));
  const std::vector<StepResult> after = run_to_idle(engine, now);
  ASSERT_FALSE(after.empty());
  ASSERT_EQ(after.back().completions.size(), 1U);
  EXPECT_EQ(after.back().completions[0].id, 2U);
}

TEST(EngineTransferTest, HeldIdStaysTakenAndResetDropsTheHold) {
  Engine engine = make_engine(transfer_config());
  add(engine, request(1, {21, 22}, kPrompt, 1, KvTransfer::remote_decode));
  run_to_idle(engine, 0.0);
  const auto duplicate = engine.add_request(request(1, {}, 8, 1), 100.0);
  ASSERT_FALSE(duplicate.has_value());
  EXPECT_EQ(duplicate.error(), RequestError::duplicate_id);

  engine.reset();
  EXPECT_THAT(engine.held_blocks(1), IsEmpty());
  EXPECT_EQ(engine.load().kv_blocks_used, 0U);
  EXPECT_FALSE(engine.release_transfer(1));
}

TEST(EngineTransferTest, DecodeRequestWaitsForItsTransferThenComputesOnlyTheLastPromptToken) {
  const EngineConfig config = transfer_config();
  Engine engine = make_engine(config);
  add(engine, pulled(1, 3));

  // Nothing to compute: the step lasts exactly the transfer of every prompt block.
  const StepResult wait = engine.step(0.0);
  EXPECT_EQ(wait.duration_ms, transfer_ms(config, kPromptBlocks));
  EXPECT_EQ(wait.duration_ms, 3.0 + 0.5 * 3);
  EXPECT_EQ(wait.prefill_tokens, 0U);
  EXPECT_EQ(wait.decode_requests, 0U);
  EXPECT_THAT(wait.first_tokens, IsEmpty());
  ASSERT_EQ(wait.transfers_done.size(), 1U);
  EXPECT_EQ(wait.transfers_done[0].id, 1U);
  EXPECT_EQ(wait.transfers_done[0].blocks, kPromptBlocks);
  // The router learns that this worker now holds the transferred blocks.
  EXPECT_THAT(wait.kv_events, ElementsAre(stored(std::nullopt, {21, 22})));

  const StepResult first = engine.step(wait.end_ms());
  EXPECT_EQ(first.prefill_tokens, 1U);
  EXPECT_EQ(first.duration_ms, TimingModel(config.timing).step_ms(1, 0, first.kv_utilisation));
  ASSERT_EQ(first.first_tokens.size(), 1U);
  EXPECT_EQ(first.first_tokens[0].cached_prompt_tokens, kPrompt - 1);
  EXPECT_EQ(first.first_tokens[0].time_ms, wait.end_ms() + first.duration_ms);
  // The blocks were announced when they arrived, not again.
  EXPECT_THAT(first.kv_events, IsEmpty());

  const std::vector<StepResult> rest = run_to_idle(engine, first.end_ms());
  ASSERT_FALSE(rest.empty());
  ASSERT_EQ(rest.back().completions.size(), 1U);
  const RequestStats& stats = rest.back().completions[0];
  EXPECT_EQ(stats.output_tokens, 3U);
  EXPECT_EQ(stats.cached_prompt_tokens, kPrompt - 1);
  EXPECT_EQ(stats.held_blocks, 0U);
  EXPECT_EQ(engine.load().kv_blocks_used, 0U);
}

TEST(EngineTransferTest, DecodeWorkerHoldingPartOfThePrefixPullsOnlyTheRest) {
  const EngineConfig config = transfer_config();
  Engine engine = make_engine(config);
  // An earlier request left block 21 cached here.
  add(engine, request(1, {21}, kBlockSize + 4, 1));
  const std::vector<StepResult> earlier = run_to_idle(engine, 0.0);
  const double now = earlier.back().end_ms();
  ASSERT_TRUE(engine.pool().contains(21));

  add(engine, pulled(2, 2), now);
  const StepResult wait = engine.step(now);
  EXPECT_DOUBLE_EQ(wait.duration_ms, transfer_ms(config, kPromptBlocks - 1));
  EXPECT_LT(wait.duration_ms, transfer_ms(config, kPromptBlocks));
  ASSERT_EQ(wait.transfers_done.size(), 1U);
  EXPECT_EQ(wait.transfers_done[0].blocks, kPromptBlocks - 1);
  EXPECT_THAT(wait.kv_events, ElementsAre(stored(21, {22})));

  const StepResult first = engine.step(wait.end_ms());
  EXPECT_EQ(first.prefill_tokens, 1U);
  ASSERT_EQ(first.first_tokens.size(), 1U);
  // Reused here and transferred alike: only the last token was computed.
  EXPECT_EQ(first.first_tokens[0].cached_prompt_tokens, kPrompt - 1);
}

TEST(EngineTransferTest, TransferIsBoundedByTheBlocksThePrefillWorkerHolds) {
  const EngineConfig config = transfer_config();
  Engine engine = make_engine(config);
  add(engine, pulled(1, 1, 1));

  const StepResult wait = engine.step(0.0);
  EXPECT_EQ(wait.duration_ms, transfer_ms(config, 1));
  ASSERT_EQ(wait.transfers_done.size(), 1U);
  EXPECT_EQ(wait.transfers_done[0].blocks, 1U);
  EXPECT_THAT(wait.kv_events, ElementsAre(stored(std::nullopt, {21})));

  // The tokens after the transferred block are prefilled here.
  const StepResult first = engine.step(wait.end_ms());
  EXPECT_EQ(first.prefill_tokens, kPrompt - kBlockSize);
  ASSERT_EQ(first.first_tokens.size(), 1U);
  EXPECT_EQ(first.first_tokens[0].cached_prompt_tokens, kBlockSize);
  EXPECT_THAT(first.kv_events, ElementsAre(stored(21, {22})));
}

TEST(EngineTransferTest, NothingToPullMeansNoWait) {
  Engine engine = make_engine(transfer_config());
  add(engine, pulled(1, 1, 0));
  const StepResult step = engine.step(0.0);
  EXPECT_EQ(step.prefill_tokens, kPrompt);
  EXPECT_THAT(step.transfers_done, IsEmpty());
  ASSERT_EQ(step.first_tokens.size(), 1U);
  EXPECT_EQ(step.first_tokens[0].cached_prompt_tokens, 0U);
}

TEST(EngineTransferTest, TransferOfNoTimeEndsAtOnceAndTheRequestRunsInTheSameStep) {
  EngineConfig config = transfer_config();
  config.transfer.latency_ms = 0.0;
  config.transfer.ms_per_block = 0.0;
  Engine engine = make_engine(config);
  add(engine, pulled(1, 1));
  const StepResult step = engine.step(0.0);
  EXPECT_GT(step.duration_ms, 0.0);
  EXPECT_EQ(step.prefill_tokens, 1U);
  ASSERT_EQ(step.transfers_done.size(), 1U);
  ASSERT_EQ(step.first_tokens.size(), 1U);
  EXPECT_EQ(step.first_tokens[0].cached_prompt_tokens, kPrompt - 1);
  EXPECT_THAT(step.kv_events, ElementsAre(stored(std::nullopt, {21, 22})));
}

TEST(EngineTransferTest, TimeScaleDividesTheTransferTime) {
  EngineConfig config = transfer_config();
  config.timing.time_scale = 4.0;
  Engine engine = make_engine(config);
  add(engine, pulled(1, 1));
  const StepResult wait = engine.step(0.0);
  EXPECT_EQ(wait.duration_ms, (3.0 + 0.5 * 3) / 4.0);
}

TEST(EngineTransferTest, TransferringRequestIsWaitingWithItsBlocksWhileOthersRun) {
  EngineConfig config = transfer_config();
  config.transfer.latency_ms = 10'000.0;  // outlasts the other request's whole life
  Engine engine = make_engine(config);
  add(engine, request(1, {}, 20, 4));
  add(engine, pulled(2, 2));

  const StepResult first = engine.step(0.0);
  EXPECT_EQ(first.prefill_tokens, 20U);
  EXPECT_THAT(first.transfers_done, IsEmpty());
  const EngineLoad load = engine.load();
  EXPECT_EQ(load.active_requests, 1U);
  EXPECT_EQ(load.waiting_requests, 1U);
  EXPECT_EQ(load.transferring_requests, 1U);
  // Request 1's two blocks and the three being filled.
  EXPECT_EQ(load.kv_blocks_used, 2U + kPromptBlocks);
  const discovery::ConfirmedLoad report = load_report(load);
  EXPECT_EQ(report.active_requests, 2U);
  EXPECT_EQ(report.waiting_requests, 1U);
  ASSERT_TRUE(engine.next_transfer_end_ms().has_value());
  EXPECT_EQ(*engine.next_transfer_end_ms(), transfer_ms(config, kPromptBlocks));

  const std::vector<StepResult> rest = run_to_idle(engine, first.end_ms());
  std::optional<double> transfer_end;
  std::optional<double> first_token;
  for (const StepResult& step : rest) {
    if (!step.transfers_done.empty()) transfer_end = step.end_ms();
    for (const FirstToken& token : step.first_tokens) {
      if (token.id == 2) first_token = token.time_ms;
    }
  }
  ASSERT_TRUE(transfer_end.has_value());
  ASSERT_TRUE(first_token.has_value());
  EXPECT_DOUBLE_EQ(*transfer_end, transfer_ms(config, kPromptBlocks));
  EXPECT_GT(*first_token, *transfer_end);
}

TEST(EngineTransferTest, AbortingATransferringRequestFreesItsBlocks) {
  EngineConfig config = transfer_config();
  config.transfer.latency_ms = 10'000.0;
  Engine engine = make_engine(config);
  add(engine, request(1, {}, 20, 4));
  add(engine, pulled(2, 2));
  engine.step(0.0);
  ASSERT_EQ(engine.load().transferring_requests, 1U);

  EXPECT_TRUE(engine.abort_request(2));
  const EngineLoad load = engine.load();
  EXPECT_EQ(load.transferring_requests, 0U);
  EXPECT_EQ(load.waiting_requests, 0U);
  EXPECT_EQ(load.kv_blocks_used, 2U);
  EXPECT_FALSE(engine.next_transfer_end_ms().has_value());
}

TEST(EngineTransferTest, TransfersTakeSeatsAndResetAbortsThemAfterTheRunningOnes) {
  EngineConfig config = transfer_config();
  config.transfer.latency_ms = 10'000.0;
  config.max_num_seqs = 3;
  Engine engine = make_engine(config);
  add(engine, request(1, {}, 20, 4));
  add(engine, pulled(2, 2));
  add(engine, request(3, {}, 20, 4, KvTransfer::remote_prefill));
  add(engine, request(4, {}, 20, 4));
  engine.step(0.0);
  const EngineLoad load = engine.load();
  EXPECT_EQ(load.active_requests, 1U);
  EXPECT_EQ(load.transferring_requests, 2U);
  // Request 4 found no seat: two are taken by the transfers.
  EXPECT_EQ(load.waiting_requests, 3U);

  const ResetResult reset = engine.reset();
  EXPECT_THAT(reset.aborted, ElementsAre(1U, 2U, 3U, 4U));
  EXPECT_FALSE(engine.has_work());
  EXPECT_EQ(engine.load().kv_blocks_used, 0U);
}

}  // namespace
}  // namespace kvr::simulation
