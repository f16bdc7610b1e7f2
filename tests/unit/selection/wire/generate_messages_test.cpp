#include "selection/wire/generate_messages.hpp"

#include <fmt/format.h>
#include <gtest/gtest.h>

namespace kvr {
namespace {

v1::GenerateRequest generate_request(std::size_t tokens, std::uint32_t max_output_tokens) {
  v1::GenerateRequest wire;
  wire.mutable_route()->set_request_id("g1");
  wire.mutable_route()->set_model("m");
  for (std::uint32_t i = 0; i < tokens; ++i) wire.mutable_route()->mutable_tokens()->add_ids(i);
  wire.set_max_output_tokens(max_output_tokens);
  wire.set_stream_subject("_INBOX.client.1");
  return wire;
}

TEST(GenerateMessagesTest, DecodesTheRouteAndKeepsTheClientStreamSubject) {
  auto decoded = decode_generate_request(generate_request(40, 8));
  ASSERT_TRUE(decoded) << decoded.error().message;
  EXPECT_EQ(decoded->route.id(), "g1");
  EXPECT_EQ(decoded->route.prompt_token_ids.size(), 40U);
  EXPECT_EQ(decoded->stream_subject, "_INBOX.client.1");
  EXPECT_TRUE(decoded->route.selection.excluded_workers.empty());
}

TEST(GenerateMessagesTest, RefusesMissingStreamSubjectOutputTokensAndBadRoutes) {
  auto wire = generate_request(40, 8);
  wire.clear_stream_subject();
  EXPECT_EQ(decode_generate_request(wire).error().code, Error::invalid_request);
  wire = generate_request(40, 8);
  wire.set_stream_subject("a.*");
  EXPECT_FALSE(decode_generate_request(wire));
  wire = generate_request(40, 0);
  EXPECT_FALSE(decode_generate_request(wire));
  wire.mutable_route()->set_expected_output_tokens(4);  // the fallback for max_output_tokens
  EXPECT_TRUE(decode_generate_request(wire));
  wire = generate_request(40, kMaxGenerateOutputTokens + 1);
  EXPECT_FALSE(decode_generate_request(wire));
  wire = generate_request(0, 8);
  auto empty_prompt = decode_generate_request(wire);
  ASSERT_FALSE(empty_prompt);
  EXPECT_NE(empty_prompt.error().message.find("tokens"), std::string::npos);
  wire.clear_route();
  EXPECT_FALSE(decode_generate_request(wire));
  // A query-only probe books nothing, so there is nothing to generate on.
  wire = generate_request(40, 8);
  wire.mutable_route()->set_query_only(true);
  auto query = decode_generate_request(wire);
  ASSERT_FALSE(query);
  EXPECT_NE(query.error().message.find("query_only"), std::string::npos);
}

TEST(GenerateMessagesTest, ARequestAWorkerCannotBeSentIsNamedWithTheLimitAndWhatFits) {
  auto decoded = decode_generate_request(generate_request(400'000, 8));
  ASSERT_TRUE(decoded) << decoded.error().message;
  const std::size_t size = decoded->wire.ByteSizeLong();
  EXPECT_FALSE(too_large_for_workers(*decoded, 0));  // no limit known
  EXPECT_FALSE(too_large_for_workers(*decoded, size + kWorkerRequestHeadroom));
  // NATS's default max_payload: 1 MiB.
  const auto refused = too_large_for_workers(*decoded, 1 << 20);
  ASSERT_TRUE(refused);
  EXPECT_NE(refused->find(std::to_string(size) + " bytes"), std::string::npos) << *refused;
  EXPECT_NE(refused->find("max_payload 1048576"), std::string::npos) << *refused;
  // Ids 0..399,999 take 1-3 bytes each (about 1.1 MiB): about 340,000 of them fit.
  const std::size_t fit = 400'000 * ((1 << 20) - kWorkerRequestHeadroom) / size;
  EXPECT_NE(refused->find(fmt::format("about {} prompt tokens", fit)), std::string::npos)
      << *refused;
  EXPECT_TRUE(too_large_for_workers(*decoded, size + kWorkerRequestHeadroom - 1));
}

TEST(GenerateMessagesTest, AnActorStreamNeedsNoStreamSubject) {
  auto wire = generate_request(40, 8);
  wire.clear_stream_subject();
  auto decoded = decode_generate_request(wire, {}, StreamTo::actor);
  ASSERT_TRUE(decoded) << decoded.error().message;
  EXPECT_TRUE(decoded->stream_subject.empty());
  // A subject an actor client sets anyway is not used (and not validated).
  wire.set_stream_subject("a.*");
  decoded = decode_generate_request(wire, {}, StreamTo::actor);
  ASSERT_TRUE(decoded) << decoded.error().message;
  EXPECT_TRUE(decoded->stream_subject.empty());
  // Everything else is validated as for NATS clients.
  wire.set_max_output_tokens(0);
  EXPECT_FALSE(decode_generate_request(wire, {}, StreamTo::actor));
}

TEST(GenerateMessagesTest, WorkerRequestCarriesTheNodeStreamSubjectAndRank) {
  auto decoded = decode_generate_request(generate_request(40, 8));
  ASSERT_TRUE(decoded);
  const auto dispatched = encode_worker_generate_request(*decoded, 3, "_INBOX.node.7");
  EXPECT_EQ(dispatched.stream_subject(), "_INBOX.node.7");
  EXPECT_EQ(dispatched.dp_rank(), 3U);
  EXPECT_EQ(dispatched.max_output_tokens(), 8U);
  EXPECT_EQ(dispatched.route().request_id(), "g1");
  EXPECT_EQ(dispatched.route().tokens().ids_size(), 40);
}

TEST(GenerateMessagesTest, WorkerRequestKeepsTheSamplingParametersUnchanged) {
  v1::GenerateRequest wire = generate_request(40, 8);
  wire.mutable_sampling()->set_temperature(0.0F);
  wire.mutable_sampling()->set_seed(11);
  wire.mutable_sampling()->add_stop_token_ids(5);
  auto decoded = decode_generate_request(wire);
  ASSERT_TRUE(decoded);
  const auto dispatched = encode_worker_generate_request(*decoded, 0, "_INBOX.node.8");
  ASSERT_TRUE(dispatched.has_sampling());
  EXPECT_EQ(dispatched.sampling().SerializeAsString(), wire.sampling().SerializeAsString());
  EXPECT_TRUE(dispatched.sampling().has_temperature());
  EXPECT_FALSE(dispatched.sampling().has_top_p());
}

TEST(GenerateMessagesTest, TheHopsOfADisaggregatedRequestCarryTheirTransferParameters) {
  auto decoded = decode_generate_request(generate_request(40, 8));
  ASSERT_TRUE(decoded);
  const auto prefill = encode_worker_generate_request(
      *decoded, 0, "_INBOX.node.9",
      WorkerHop{.max_output_tokens = 1, .kv_transfer_params = kRemoteDecodeTransferParams});
  EXPECT_EQ(prefill.max_output_tokens(), 1U);
  EXPECT_EQ(prefill.kv_transfer_params(), kRemoteDecodeTransferParams);
  EXPECT_FALSE(kv_transfer_params_error(prefill.kv_transfer_params()));

  const std::string answer = R"({"do_remote_prefill":true,"remote_block_ids":[4,5]})";
  const auto decode = encode_worker_generate_request(*decoded, 1, "_INBOX.node.9",
                                                     WorkerHop{.kv_transfer_params = answer});
  EXPECT_EQ(decode.max_output_tokens(), 8U) << "the client's";
  EXPECT_EQ(decode.kv_transfer_params(), answer);

  EXPECT_TRUE(kv_transfer_params_error("[1,2]"));
  EXPECT_TRUE(kv_transfer_params_error("{\"a\":"));
  EXPECT_TRUE(
      kv_transfer_params_error("{\"x\":\"" + std::string(kMaxKvTransferParamsBytes, 'a') + "\"}"));
}

TEST(GenerateMessagesTest, AClientMayNotSendTransferParameters) {
  auto wire = generate_request(40, 8);
  wire.set_kv_transfer_params(R"({"do_remote_prefill":true,"remote_host":"10.0.0.1"})");
  auto refused = decode_generate_request(wire);
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().code, Error::invalid_request);
  EXPECT_NE(refused.error().message.find("kv_transfer_params"), std::string::npos);
}

TEST(GenerateMessagesTest, ChunksMapOntoStreamChunksWithErrors) {
  v1::GenerateChunk chunk;
  chunk.set_worker_id(5);
  chunk.set_dp_rank(1);
  chunk.set_index(2);
  chunk.add_token_ids(9);
  chunk.add_token_ids(10);
  auto plain = decode_stream_chunk(chunk);
  EXPECT_EQ(plain.worker, (WorkerWithDpRank{5, 1}));
  EXPECT_EQ(plain.index, 2U);
  EXPECT_EQ(plain.tokens, 2U);
  EXPECT_FALSE(plain.finished);
  EXPECT_FALSE(plain.error);

  chunk.set_finished(true);
  chunk.set_finish_reason("error");
  plain = decode_stream_chunk(chunk);
  ASSERT_TRUE(plain.error);
  chunk.mutable_error()->set_message("out of blocks");
  EXPECT_EQ(*decode_stream_chunk(chunk).error, "out of blocks");
  chunk.set_finish_reason("cancelled");
  chunk.clear_error();
  EXPECT_FALSE(decode_stream_chunk(chunk).error);
}

TEST(GenerateMessagesTest, EndChunkIsFinalAndCarriesTheErrorCode) {
  const auto chunk = encode_end_chunk(
      "g1", 4, StreamEnd{"error", Error::worker_failed, "worker 7 failed"}, WorkerWithDpRank{7, 0});
  EXPECT_EQ(chunk.request_id(), "g1");
  EXPECT_EQ(chunk.index(), 4U);
  EXPECT_TRUE(chunk.finished());
  EXPECT_EQ(chunk.finish_reason(), "error");
  EXPECT_EQ(chunk.worker_id(), 7U);
  EXPECT_EQ(chunk.error().code(), v1::ROUTE_ERROR_WORKER_FAILED);
  EXPECT_EQ(chunk.error().message(), "worker 7 failed");
  const auto cancelled = encode_end_chunk("g1", 0, StreamEnd{"cancelled", std::nullopt, "bye"}, {});
  EXPECT_FALSE(cancelled.has_error());
  EXPECT_EQ(cancelled.finish_reason(), "cancelled");
  EXPECT_EQ(worker_cancel_subject("kvr.ns.worker.7.generate"), "kvr.ns.worker.7.generate.cancel");
}

}  // namespace
}  // namespace kvr
