// The two ZMQ sockets of `kvr mocker --speak vllm`'s KV events: the PUB socket that sends each
// batch live in vLLM's three-frame messages (topic, 8-byte big-endian sequence from 0, payload),
// and vLLM's replay service on a ROUTER socket: (identity, "", start sequence) is answered with
// every buffered batch from there, then sequence -1 with an empty payload. The engine loop
// (vllm_engine_loop.hpp) publishes; VllmEngineServer binds them and starts the replay thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <expected>
#include <mutex>
#include <optional>
#include <stop_token>
#include <string>
#include <thread>
#include <utility>

#include <zmq.hpp>

namespace kvr::mocker {

struct VllmEngineOptions;

/// The KV event sockets and the batches kept for replay. publish() is for one thread (the
/// engine's); the replay thread only reads the buffer, under its lock.
class VllmKvEventSockets {
 public:
  VllmKvEventSockets() = default;
  ~VllmKvEventSockets();
  VllmKvEventSockets(const VllmKvEventSockets&) = delete;
  VllmKvEventSockets& operator=(const VllmKvEventSockets&) = delete;

  /// Binds the PUB socket and, unless options.replay_port is 0, the replay socket; the error
  /// names the host and ports.
  std::expected<void, std::string> bind(const VllmEngineOptions& options);

  /// Starts answering replay requests on its own thread (nothing without a replay socket).
  void start_replay();

  /// Asks the replay thread to end (within its poll interval); the destructor joins it.
  void request_stop() { replay_thread_.request_stop(); }

  /// Gives `payload` the next sequence number, keeps it for replay and sends it live (unless the
  /// fault injection skips it); a failed send is logged.
  void publish(std::string payload);

 private:
  void serve_replay(const std::stop_token& stop);

  std::string topic_;
  std::size_t replay_capacity_ = 0;
  std::uint32_t skip_every_ = 0;

  zmq::context_t context_{1};
  zmq::socket_t publisher_{context_, zmq::socket_type::pub};
  std::optional<zmq::socket_t> replay_socket_;
  std::uint64_t next_sequence_ = 0;  // the publishing thread's
  std::mutex replay_mutex_;
  std::deque<std::pair<std::uint64_t, std::string>> replay_buffer_;  // guarded by replay_mutex_
  // Last: it ends (and is joined) before the sockets it uses close.
  std::jthread replay_thread_;
};

}  // namespace kvr::mocker
