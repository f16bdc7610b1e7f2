// vLLM's ZMQ KV event framing, both sides: the engine's publisher and replay service (written by
// `kvr mocker --speak vllm`) and their reader (`kvr bridge`'s subscriber). The msgpack payload
// inside the frames is not this file's business (deploy/bridge/kv_event_decoder.hpp reads it).
//
// Live messages (PUB → SUB): three frames: topic, the publisher's sequence number (8 bytes,
// big-endian, from 0), payload. Replay (DEALER → ROUTER): the DEALER sends an empty delimiter and
// the first wanted sequence number; the ROUTER answers, to the asker's identity, (delimiter,
// sequence, payload) for each message it still buffers from there on, then sequence -1 with an
// empty payload.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <zmq.hpp>

namespace kvr::worker {

/// The size of a sequence-number frame.
inline constexpr std::size_t kSequenceFrameBytes = 8;

/// The sequence number that ends a replay's answer (-1 as the engine writes it).
inline constexpr std::uint64_t kEndOfReplay = ~std::uint64_t{0};

/// `sequence` as its frame: 8 bytes, big-endian.
std::string encode_sequence(std::uint64_t sequence);

/// The sequence number a frame holds; nullopt unless the frame has exactly 8 bytes.
std::optional<std::uint64_t> decode_sequence(std::string_view frame);
/// The same for a received frame.
std::optional<std::uint64_t> decode_sequence(const zmq::message_t& frame);

/// Sends one live KV event message (topic, sequence, payload) on `publisher`; false when ZMQ did
/// not take it (with send_flags::dontwait: the queue was full). ZMQ errors are thrown as
/// zmq::error_t, as by every cppzmq call.
bool send_kv_event(zmq::socket_t& publisher, std::string_view topic, std::uint64_t sequence,
                   std::string_view payload, zmq::send_flags flags = zmq::send_flags::none);

/// A live KV event message as received; `payload` points into the frames it was read from.
struct KvEventFrames {
  std::uint64_t sequence = 0;
  const zmq::message_t* payload = nullptr;
};

/// Reads a live message; nullopt unless it has three frames and an 8-byte sequence number.
std::optional<KvEventFrames> read_kv_event(const std::vector<zmq::message_t>& frames);

/// Asks a replay service, from a DEALER socket, for every message from `first_sequence` on;
/// false when ZMQ did not take the request.
bool send_replay_request(zmq::socket_t& dealer, std::uint64_t first_sequence);

/// A replay request as the ROUTER receives it.
struct ReplayRequest {
  std::string identity;  ///< the asker's routing identity, to address the answer to
  std::uint64_t first_sequence = 0;
};

/// Reads a request on the ROUTER side; nullopt unless (identity, delimiter, 8-byte sequence).
std::optional<ReplayRequest> read_replay_request(const std::vector<zmq::message_t>& frames);

/// Answers one buffered message of a replay to `identity`.
void send_replay_message(zmq::socket_t& router, std::string_view identity, std::uint64_t sequence,
                         std::string_view payload);

/// Ends the replay answer to `identity` (sequence -1, empty payload).
void send_replay_end(zmq::socket_t& router, std::string_view identity);

/// One message of a replay's answer as the DEALER receives it; `payload` points into the frames.
struct ReplayAnswer {
  std::uint64_t sequence = 0;
  const zmq::message_t* payload = nullptr;

  /// Whether this is the end marker, after which nothing more comes.
  bool end() const { return sequence == kEndOfReplay; }
};

/// Reads one answer on the DEALER side: (delimiter, sequence, payload), or (sequence, payload)
/// from an engine that leaves the delimiter out; nullopt for anything else.
std::optional<ReplayAnswer> read_replay_answer(const std::vector<zmq::message_t>& frames);

}  // namespace kvr::worker
