// vLLM's ZMQ KV event framing: the sequence frame against bytes written out by hand from the
// published format (so the library is checked against the format, not against itself), and each
// message kind sent and read back over real inproc ZMQ sockets.
#include "deploy/worker/vllm_kv_frames.hpp"

#include <iterator>

#include <gtest/gtest.h>
#include <zmq_addon.hpp>

namespace kvr::worker {
namespace {

using namespace std::string_literals;

std::vector<zmq::message_t> receive(zmq::socket_t& socket) {
  std::vector<zmq::message_t> frames;
  EXPECT_TRUE(zmq::recv_multipart(socket, std::back_inserter(frames)));
  return frames;
}

std::vector<zmq::message_t> frames_of(const std::vector<std::string>& parts) {
  std::vector<zmq::message_t> frames;
  for (const auto& part : parts) frames.emplace_back(part.data(), part.size());
  return frames;
}

TEST(VllmKvFramesTest, EncodesSequenceNumbersAsEightBigEndianBytes) {
  EXPECT_EQ(encode_sequence(0), "\0\0\0\0\0\0\0\0"s);
  EXPECT_EQ(encode_sequence(0x0102030405060708ULL), "\x01\x02\x03\x04\x05\x06\x07\x08"s);
  EXPECT_EQ(encode_sequence(kEndOfReplay), "\xff\xff\xff\xff\xff\xff\xff\xff"s);
}

TEST(VllmKvFramesTest, DecodesOnlyEightByteSequenceFrames) {
  EXPECT_EQ(decode_sequence("\0\0\0\0\0\0\x01\x00"s), 256U);
  EXPECT_EQ(decode_sequence(encode_sequence(0xfedcba9876543210ULL)), 0xfedcba9876543210ULL);
  EXPECT_FALSE(decode_sequence("\0\0\0\0\0\0\x01"s));
  EXPECT_FALSE(decode_sequence("\0\0\0\0\0\0\0\x01\x00"s));
  EXPECT_FALSE(decode_sequence(std::string_view{}));
}

TEST(VllmKvFramesTest, ReadsLiveMessagesOfThreeFramesWithAnEightByteSequence) {
  const auto frames = frames_of({"kv", encode_sequence(41), "payload"});
  const auto message = read_kv_event(frames);
  ASSERT_TRUE(message);
  EXPECT_EQ(message->sequence, 41U);
  EXPECT_EQ(message->payload->to_string(), "payload");
  EXPECT_FALSE(read_kv_event(frames_of({"kv", encode_sequence(41)})));
  EXPECT_FALSE(read_kv_event(frames_of({"kv", "1234567", "payload"})));
  EXPECT_FALSE(read_kv_event(frames_of({"kv", encode_sequence(1), "a", "b"})));
}

TEST(VllmKvFramesTest, SendsLiveMessagesAsTopicSequenceAndPayload) {
  zmq::context_t context;
  zmq::socket_t pull{context, zmq::socket_type::pull};
  pull.bind("inproc://live");
  zmq::socket_t push{context, zmq::socket_type::push};
  push.connect("inproc://live");
  ASSERT_TRUE(send_kv_event(push, "topic", 7, "batch"));
  const auto frames = receive(pull);
  ASSERT_EQ(frames.size(), 3U);
  EXPECT_EQ(frames[0].to_string(), "topic");
  EXPECT_EQ(frames[1].to_string(), "\0\0\0\0\0\0\0\x07"s);
  EXPECT_EQ(frames[2].to_string(), "batch");
}

TEST(VllmKvFramesTest, ReplaysBetweenDealerAndRouterAsTheEngineDoes) {
  zmq::context_t context;
  zmq::socket_t router{context, zmq::socket_type::router};
  router.bind("inproc://replay");
  zmq::socket_t dealer{context, zmq::socket_type::dealer};
  dealer.connect("inproc://replay");

  ASSERT_TRUE(send_replay_request(dealer, 5));
  const auto request_frames = receive(router);
  ASSERT_EQ(request_frames.size(), 3U);
  EXPECT_EQ(request_frames[1].size(), 0U);  // the delimiter
  EXPECT_EQ(request_frames[2].to_string(), "\0\0\0\0\0\0\0\x05"s);
  const auto request = read_replay_request(request_frames);
  ASSERT_TRUE(request);
  EXPECT_EQ(request->first_sequence, 5U);

  send_replay_message(router, request->identity, 5, "five");
  send_replay_end(router, request->identity);
  const auto first_frames = receive(dealer);
  const auto first = read_replay_answer(first_frames);
  ASSERT_TRUE(first);
  EXPECT_FALSE(first->end());
  EXPECT_EQ(first->sequence, 5U);
  EXPECT_EQ(first->payload->to_string(), "five");
  const auto end_frames = receive(dealer);
  ASSERT_EQ(end_frames.size(), 3U);
  EXPECT_EQ(end_frames[1].to_string(), "\xff\xff\xff\xff\xff\xff\xff\xff"s);
  EXPECT_EQ(end_frames[2].size(), 0U);
  const auto end = read_replay_answer(end_frames);
  ASSERT_TRUE(end);
  EXPECT_TRUE(end->end());
}

TEST(VllmKvFramesTest, ReadsReplayAnswersWithoutTheDelimiterAndRejectsOtherShapes) {
  const auto frames = frames_of({encode_sequence(3), "three"});  // the answer points into them
  const auto bare = read_replay_answer(frames);
  ASSERT_TRUE(bare);
  EXPECT_EQ(bare->sequence, 3U);
  EXPECT_EQ(bare->payload->to_string(), "three");
  EXPECT_FALSE(read_replay_answer(frames_of({})));
  EXPECT_FALSE(read_replay_answer(frames_of({encode_sequence(3)})));
  EXPECT_FALSE(read_replay_answer(frames_of({"", "short", "three"})));
  EXPECT_FALSE(read_replay_answer(frames_of({"x", encode_sequence(3), "three"})));
}

TEST(VllmKvFramesTest, RejectsReplayRequestsWithoutAnEightByteSequence) {
  EXPECT_FALSE(read_replay_request(frames_of({"id", "", "1234"})));
  EXPECT_FALSE(read_replay_request(frames_of({"id", encode_sequence(1)})));
  const auto request = read_replay_request(frames_of({"id", "", encode_sequence(9)}));
  ASSERT_TRUE(request);
  EXPECT_EQ(request->identity, "id");
  EXPECT_EQ(request->first_sequence, 9U);
}

}  // namespace
}  // namespace kvr::worker
