#include "deploy/worker/vllm_kv_frames.hpp"

#include <array>

#include <zmq_addon.hpp>

namespace kvr::worker {

std::string encode_sequence(std::uint64_t sequence) {
  std::string bytes(kSequenceFrameBytes, '\0');
  for (std::size_t i = kSequenceFrameBytes; i-- > 0;) {
    bytes[i] = static_cast<char>(sequence & 0xFF);
    sequence >>= 8;
  }
  return bytes;
}

std::optional<std::uint64_t> decode_sequence(std::string_view frame) {
  if (frame.size() != kSequenceFrameBytes) return std::nullopt;
  std::uint64_t sequence = 0;
  for (const char byte : frame) sequence = (sequence << 8) | static_cast<std::uint8_t>(byte);
  return sequence;
}

std::optional<std::uint64_t> decode_sequence(const zmq::message_t& frame) {
  return decode_sequence(std::string_view{static_cast<const char*>(frame.data()), frame.size()});
}

bool send_kv_event(zmq::socket_t& publisher, std::string_view topic, std::uint64_t sequence,
                   std::string_view payload, zmq::send_flags flags) {
  const std::string sequence_frame = encode_sequence(sequence);
  const std::array<zmq::const_buffer, 3> frames = {zmq::buffer(topic), zmq::buffer(sequence_frame),
                                                   zmq::buffer(payload)};
  return zmq::send_multipart(publisher, frames, flags).has_value();
}

std::optional<KvEventFrames> read_kv_event(const std::vector<zmq::message_t>& frames) {
  if (frames.size() != 3) return std::nullopt;
  const auto sequence = decode_sequence(frames[1]);
  if (!sequence) return std::nullopt;
  return KvEventFrames{.sequence = *sequence, .payload = &frames[2]};
}

bool send_replay_request(zmq::socket_t& dealer, std::uint64_t first_sequence) {
  const std::string sequence_frame = encode_sequence(first_sequence);
  const std::array<zmq::const_buffer, 2> request = {zmq::const_buffer{},
                                                    zmq::buffer(sequence_frame)};
  return zmq::send_multipart(dealer, request).has_value();
}

std::optional<ReplayRequest> read_replay_request(const std::vector<zmq::message_t>& frames) {
  if (frames.size() != 3) return std::nullopt;
  const auto first = decode_sequence(frames[2]);
  if (!first) return std::nullopt;
  return ReplayRequest{.identity = frames[0].to_string(), .first_sequence = *first};
}

void send_replay_message(zmq::socket_t& router, std::string_view identity, std::uint64_t sequence,
                         std::string_view payload) {
  const std::string sequence_frame = encode_sequence(sequence);
  const std::array<zmq::const_buffer, 4> reply = {zmq::buffer(identity), zmq::const_buffer{},
                                                  zmq::buffer(sequence_frame),
                                                  zmq::buffer(payload)};
  zmq::send_multipart(router, reply);
}

void send_replay_end(zmq::socket_t& router, std::string_view identity) {
  send_replay_message(router, identity, kEndOfReplay, {});
}

std::optional<ReplayAnswer> read_replay_answer(const std::vector<zmq::message_t>& frames) {
  // A DEALER sees the ROUTER's empty delimiter; tolerate an engine that leaves it out.
  const std::size_t first = (frames.size() == 3 && frames[0].size() == 0) ? 1 : 0;
  if (frames.size() - first != 2) return std::nullopt;
  const auto sequence = decode_sequence(frames[first]);
  if (!sequence) return std::nullopt;
  return ReplayAnswer{.sequence = *sequence, .payload = &frames[first + 1]};
}

}  // namespace kvr::worker
