// Subscribes to an engine's ZMQ KV event publisher (vLLM, SGLang): one SUB socket per
// data-parallel rank (the engine offsets the port by the rank), sequence gaps filled from the
// engine's replay socket, decoded batches handed to a callback on the subscriber's own thread.
// Used by `kvr bridge`.
//
// Wire format (deploy/worker/vllm_kv_frames.hpp): each message is three frames: topic, an 8-byte
// big-endian sequence number (per publisher, from 0) and the msgpack payload
// (kv_event_decoder.hpp). Replay: a DEALER connects to the engine's ROUTER and sends an empty
// delimiter and the first wanted sequence number; the engine answers with (delimiter, sequence,
// payload) for each batch it still buffers from there on, then a sequence of -1 with an empty
// payload.
//
// High-water mark: ZMQ drops messages for a SUB socket whose queue holds receive_high_water_mark
// messages (and the engine's PUB drops at its own mark, 100,000 in vLLM). A dropped message shows
// up as a sequence gap, which the replay fills while the engine still buffers it (vLLM keeps the
// last 10,000 batches); beyond that the rank is cleared (on_lost), never left wrong.
//
// Engine restarts: PUB/SUB delivers one publisher's messages in order, so a live (not replayed)
// message whose sequence number is below the last live one of its rank comes from a new
// publisher, numbering from 0 again: the engine restarted, possibly faster than a health probe
// could notice. The subscriber then forgets the rank's sequence, calls on_restart before it hands
// on that message, and carries on (a gap in the new numbering is replayed as usual). A repeat of
// the last number counts as a duplicate, so a new engine whose first message seen carries the old
// one's last number is missed here; the bridge also watches process_start_time_seconds.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <expected>
#include <functional>
#include <memory>
#include <string>

#include "deploy/bridge/kv_event_decoder.hpp"
#include "messages/ids.hpp"

namespace kvr::bridge {

/// The endpoint of data-parallel rank `rank`: a tcp endpoint's port plus the rank, an ipc or
/// inproc endpoint with "_dp<rank>" appended (as the engines bind them); rank 0 unchanged.
std::expected<std::string, std::string> endpoint_for_rank(const std::string& endpoint, DpRank rank);

/// Where and how to subscribe.
struct ZmqSubscriberOptions {
  std::string endpoint = "tcp://127.0.0.1:5557";  ///< the engine's PUB socket (rank 0)
  std::string replay_endpoint;  ///< the engine's ROUTER socket (rank 0); empty: no replay
  std::string topic;            ///< only messages whose topic starts with this; empty: all
  std::uint32_t data_parallel_size = 1;
  int receive_high_water_mark = 100'000;  ///< messages queued per SUB socket before ZMQ drops
  std::chrono::milliseconds replay_timeout{2000};  ///< longest wait for a replay's end marker
  DecoderLimits limits;
};

/// Counters of the subscriber, readable from any thread.
struct ZmqSubscriberStats {
  std::uint64_t messages = 0;            ///< messages received (live and replayed)
  std::uint64_t batches = 0;             ///< decoded batches handed to on_batch
  std::uint64_t malformed_frames = 0;    ///< messages without three frames or an 8-byte sequence
  std::uint64_t malformed_payloads = 0;  ///< payloads the decoder rejected
  std::uint64_t stale_messages = 0;      ///< sequence numbers already seen (dropped)
  std::uint64_t gaps = 0;                ///< sequence gaps detected
  std::uint64_t replays_filled = 0;      ///< gaps the replay socket filled
  std::uint64_t replays_failed = 0;      ///< gaps it could not fill (the rank was lost)
  std::uint64_t restarts = 0;            ///< publisher restarts seen (sequence numbers went back)
};

/// What the subscriber hands on, always from its own thread.
struct ZmqSubscriberCallbacks {
  /// A decoded batch of `rank`, in sequence order.
  std::function<void(DpRank rank, EngineKvEventBatch batch)> on_batch;
  /// `rank` missed messages that could not be replayed: what it holds is no longer known.
  std::function<void(DpRank rank)> on_lost;
  /// The publisher of `rank` restarted: every batch of `rank` handed on after this call comes
  /// from the new one. Called before the first of them.
  std::function<void(DpRank rank)> on_restart;
  /// A payload of `rank` was rejected (already counted); for logging.
  std::function<void(DpRank rank, const DecodeError& error)> on_malformed;
};

/// The subscriber thread and its sockets; stops and joins when destroyed.
class ZmqKvSubscriber {
 public:
  /// Connects the sockets (errors name the endpoint) and starts the thread.
  static std::expected<std::unique_ptr<ZmqKvSubscriber>, std::string> start(
      ZmqSubscriberOptions options, ZmqSubscriberCallbacks callbacks);
  ~ZmqKvSubscriber();
  ZmqKvSubscriber(const ZmqKvSubscriber&) = delete;
  ZmqKvSubscriber& operator=(const ZmqKvSubscriber&) = delete;

  /// Stops the thread; no callback runs after it returns.
  void stop();

  /// A snapshot of the counters.
  ZmqSubscriberStats stats() const;

 private:
  struct State;
  explicit ZmqKvSubscriber(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace kvr::bridge
