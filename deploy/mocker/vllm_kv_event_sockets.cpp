#include "deploy/mocker/vllm_kv_event_sockets.hpp"

#include <array>
#include <chrono>
#include <iterator>
#include <vector>

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <zmq_addon.hpp>

#include "deploy/mocker/vllm_engine_server.hpp"
#include "deploy/worker/vllm_kv_frames.hpp"

namespace kvr::mocker {

VllmKvEventSockets::~VllmKvEventSockets() {
  replay_thread_.request_stop();
  if (replay_thread_.joinable()) replay_thread_.join();
}

std::expected<void, std::string> VllmKvEventSockets::bind(const VllmEngineOptions& options) {
  topic_ = options.topic;
  replay_capacity_ = options.replay_buffer;
  skip_every_ = options.skip_every;
  try {
    publisher_.set(zmq::sockopt::linger, 0);
    publisher_.set(zmq::sockopt::sndhwm, 100'000);  // vLLM's
    publisher_.bind(fmt::format("tcp://{}:{}", options.host, options.kv_events_port));
    if (options.replay_port != 0) {
      replay_socket_.emplace(context_, zmq::socket_type::router);
      replay_socket_->set(zmq::sockopt::linger, 0);
      replay_socket_->bind(fmt::format("tcp://{}:{}", options.host, options.replay_port));
    }
  } catch (const zmq::error_t& error) {
    return std::unexpected(fmt::format("cannot bind the KV event sockets on {} (ports {}, {}): {}",
                                       options.host, options.kv_events_port, options.replay_port,
                                       error.what()));
  }
  return {};
}

void VllmKvEventSockets::start_replay() {
  if (!replay_socket_) return;
  replay_thread_ = std::jthread{[this](std::stop_token stop) { serve_replay(stop); }};
}

void VllmKvEventSockets::publish(std::string payload) {
  const std::uint64_t sequence = next_sequence_++;
  {
    std::lock_guard lock{replay_mutex_};
    replay_buffer_.emplace_back(sequence, payload);
    while (replay_buffer_.size() > replay_capacity_) replay_buffer_.pop_front();
  }
  if (skip_every_ != 0 && (sequence + 1) % skip_every_ == 0) return;
  try {
    worker::send_kv_event(publisher_, topic_, sequence, payload, zmq::send_flags::dontwait);
  } catch (const zmq::error_t& error) {
    spdlog::warn("kvr mocker: KV event publish failed: {}", error.what());
  }
}

void VllmKvEventSockets::serve_replay(const std::stop_token& stop) {
  zmq::socket_t& router = *replay_socket_;
  while (!stop.stop_requested()) {
    try {
      std::array<zmq::pollitem_t, 1> items = {{{router.handle(), 0, ZMQ_POLLIN, 0}}};
      if (zmq::poll(items.data(), items.size(), std::chrono::milliseconds(100)) == 0) continue;
      std::vector<zmq::message_t> frames;
      if (!zmq::recv_multipart(router, std::back_inserter(frames), zmq::recv_flags::dontwait)) {
        continue;
      }
      const auto request = worker::read_replay_request(frames);
      if (!request) continue;
      std::vector<std::pair<std::uint64_t, std::string>> answer;
      {
        std::lock_guard lock{replay_mutex_};
        for (const auto& entry : replay_buffer_) {
          if (entry.first >= request->first_sequence) answer.push_back(entry);
        }
      }
      for (const auto& [sequence, payload] : answer) {
        worker::send_replay_message(router, request->identity, sequence, payload);
      }
      worker::send_replay_end(router, request->identity);
    } catch (const zmq::error_t& error) {
      if (error.num() == ETERM) return;
      spdlog::warn("kvr mocker: replay socket: {}", error.what());
    }
  }
}

}  // namespace kvr::mocker
