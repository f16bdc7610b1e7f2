#include "deploy/bridge/zmq_kv_subscriber.hpp"

#include <array>
#include <cerrno>
#include <charconv>
#include <iterator>
#include <optional>
#include <thread>
#include <vector>

#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "deploy/bridge/kv_translator.hpp"
#include "deploy/worker/vllm_kv_frames.hpp"

namespace kvr::bridge {
namespace {

// How often the thread looks at its stop flag while the engine is quiet.
constexpr std::chrono::milliseconds kPollInterval{50};
// Messages taken from one socket before the others get a turn.
constexpr int kMaxBurst = 256;

}  // namespace

std::expected<std::string, std::string> endpoint_for_rank(const std::string& endpoint,
                                                          DpRank rank) {
  if (rank == 0) return endpoint;
  if (endpoint.starts_with("tcp://")) {
    const auto colon = endpoint.rfind(':');
    int port = 0;
    const char* begin = endpoint.data() + colon + 1;
    const char* end = endpoint.data() + endpoint.size();
    auto [last, error] = std::from_chars(begin, end, port);
    if (colon < 6 || error != std::errc{} || last != end || port <= 0 ||
        port + static_cast<long>(rank) > 65535) {
      return std::unexpected("endpoint '" + endpoint + "' has no port to offset by the rank");
    }
    return endpoint.substr(0, colon + 1) + std::to_string(port + static_cast<int>(rank));
  }
  if (endpoint.starts_with("ipc://") || endpoint.starts_with("inproc://")) {
    return endpoint + "_dp" + std::to_string(rank);
  }
  return std::unexpected("endpoint '" + endpoint + "' is not tcp://, ipc:// or inproc://");
}

struct ZmqKvSubscriber::State {
  ZmqSubscriberOptions options;
  ZmqSubscriberCallbacks callbacks;
  zmq::context_t context{1};
  std::vector<zmq::socket_t> subscribers;  // one per rank
  std::vector<std::string> replay_endpoints;
  SequenceTracker sequences;
  // The last live (not replayed) sequence number of each rank.
  std::vector<std::optional<std::uint64_t>> last_live;
  std::jthread thread;

  std::atomic<std::uint64_t> messages{0};
  std::atomic<std::uint64_t> batches{0};
  std::atomic<std::uint64_t> malformed_frames{0};
  std::atomic<std::uint64_t> malformed_payloads{0};
  std::atomic<std::uint64_t> stale_messages{0};
  std::atomic<std::uint64_t> gaps{0};
  std::atomic<std::uint64_t> replays_filled{0};
  std::atomic<std::uint64_t> replays_failed{0};
  std::atomic<std::uint64_t> restarts{0};

  explicit State(ZmqSubscriberOptions opts, ZmqSubscriberCallbacks cbs)
      : options(std::move(opts)),
        callbacks(std::move(cbs)),
        sequences(options.data_parallel_size),
        last_live(options.data_parallel_size) {}

  void deliver(DpRank rank, const zmq::message_t& payload) {
    auto batch = decode_kv_event_batch(
        std::string_view{static_cast<const char*>(payload.data()), payload.size()}, options.limits);
    if (!batch) {
      ++malformed_payloads;
      if (callbacks.on_malformed) callbacks.on_malformed(rank, batch.error());
      return;
    }
    ++batches;
    if (callbacks.on_batch) callbacks.on_batch(rank, std::move(*batch));
  }

  // Applies one (sequence, payload) of `rank` if it is the next; false for a hole.
  bool apply_in_order(DpRank rank, std::uint64_t sequence, const zmq::message_t& payload) {
    const auto check = sequences.check(rank, sequence);
    if (check.verdict == SequenceTracker::Verdict::stale) {
      ++stale_messages;
      return true;
    }
    if (check.verdict == SequenceTracker::Verdict::gap) return false;
    sequences.accept(rank, sequence);
    deliver(rank, payload);
    return true;
  }

  // Asks the replay socket of `rank` for everything from `first_missing`; true when every message
  // before `until` has been applied afterwards.
  bool replay(DpRank rank, std::uint64_t first_missing, std::uint64_t until,
              const std::stop_token& stop) {
    if (replay_endpoints.empty()) return false;
    try {
      zmq::socket_t dealer{context, zmq::socket_type::dealer};
      dealer.set(zmq::sockopt::linger, 0);
      dealer.connect(replay_endpoints[rank]);
      if (!worker::send_replay_request(dealer, first_missing)) return false;
      const auto deadline = std::chrono::steady_clock::now() + options.replay_timeout;
      bool in_order = true;
      while (!stop.stop_requested()) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            deadline - std::chrono::steady_clock::now());
        if (left <= std::chrono::milliseconds::zero()) return false;
        std::array<zmq::pollitem_t, 1> items = {{{dealer.handle(), 0, ZMQ_POLLIN, 0}}};
        if (zmq::poll(items.data(), items.size(), std::min(left, kPollInterval)) == 0) continue;
        std::vector<zmq::message_t> frames;
        if (!zmq::recv_multipart(dealer, std::back_inserter(frames), zmq::recv_flags::dontwait)) {
          continue;
        }
        const auto answer = worker::read_replay_answer(frames);
        if (!answer) {
          ++malformed_frames;
          continue;
        }
        if (answer->end()) break;
        ++messages;
        // A hole inside the replay: keep reading to the end marker, but the gap stays open.
        if (in_order) in_order = apply_in_order(rank, answer->sequence, *answer->payload);
      }
      return in_order && sequences.expected(rank).value_or(0) >= until;
    } catch (const zmq::error_t&) {
      return false;
    }
  }

  void handle(DpRank rank, std::vector<zmq::message_t>& frames, const std::stop_token& stop) {
    const auto message = worker::read_kv_event(frames);
    if (!message) {
      ++malformed_frames;
      return;
    }
    ++messages;
    const std::uint64_t sequence = message->sequence;
    if (last_live[rank] && sequence < *last_live[rank]) {
      // One publisher's messages arrive in order: this one numbers from 0 again. (A repeat of
      // the last number is taken as a duplicate, stale, as before.)
      ++restarts;
      sequences.reset(rank);
      if (callbacks.on_restart) callbacks.on_restart(rank);
    }
    last_live[rank] = sequence;
    const auto check = sequences.check(rank, sequence);
    if (check.verdict == SequenceTracker::Verdict::gap) {
      ++gaps;
      if (replay(rank, check.first_missing, sequence, stop)) {
        ++replays_filled;
      } else {
        ++replays_failed;
        if (callbacks.on_lost) callbacks.on_lost(rank);
        // Start over from this message: what came before it is gone for good.
        sequences.accept(rank, sequence - 1);
      }
    }
    // After a replay this message is stale (the replay delivered it) or next.
    (void)apply_in_order(rank, sequence, *message->payload);
  }

  void run(const std::stop_token& stop) {
    std::vector<zmq::pollitem_t> items;
    for (auto& socket : subscribers) items.push_back({socket.handle(), 0, ZMQ_POLLIN, 0});
    while (!stop.stop_requested()) {
      try {
        if (zmq::poll(items, kPollInterval) == 0) continue;
        for (std::size_t rank = 0; rank < subscribers.size(); ++rank) {
          if ((items[rank].revents & ZMQ_POLLIN) == 0) continue;
          for (int burst = 0; burst < kMaxBurst && !stop.stop_requested(); ++burst) {
            std::vector<zmq::message_t> frames;
            if (!zmq::recv_multipart(subscribers[rank], std::back_inserter(frames),
                                     zmq::recv_flags::dontwait)) {
              break;
            }
            handle(static_cast<DpRank>(rank), frames, stop);
          }
        }
      } catch (const zmq::error_t& error) {
        if (error.num() == ETERM) return;
        // A transient socket error: count it and keep listening.
        ++malformed_frames;
      }
    }
  }
};

std::expected<std::unique_ptr<ZmqKvSubscriber>, std::string> ZmqKvSubscriber::start(
    ZmqSubscriberOptions options, ZmqSubscriberCallbacks callbacks) {
  if (options.data_parallel_size == 0 || options.data_parallel_size > 64) {
    return std::unexpected("data-parallel size must be in [1, 64]");
  }
  if (options.receive_high_water_mark < 0) {
    return std::unexpected("the receive high-water mark must not be negative");
  }
  auto state = std::make_unique<State>(std::move(options), std::move(callbacks));
  const ZmqSubscriberOptions& opts = state->options;
  for (DpRank rank = 0; rank < opts.data_parallel_size; ++rank) {
    auto endpoint = endpoint_for_rank(opts.endpoint, rank);
    if (!endpoint) return std::unexpected(endpoint.error());
    try {
      zmq::socket_t socket{state->context, zmq::socket_type::sub};
      socket.set(zmq::sockopt::linger, 0);
      socket.set(zmq::sockopt::rcvhwm, opts.receive_high_water_mark);
      socket.set(zmq::sockopt::subscribe, opts.topic);
      socket.connect(*endpoint);
      state->subscribers.push_back(std::move(socket));
    } catch (const zmq::error_t& error) {
      return std::unexpected("cannot subscribe to '" + *endpoint + "': " + error.what());
    }
    if (!opts.replay_endpoint.empty()) {
      auto replay = endpoint_for_rank(opts.replay_endpoint, rank);
      if (!replay) return std::unexpected(replay.error());
      state->replay_endpoints.push_back(*replay);
    }
  }
  State* raw = state.get();
  state->thread = std::jthread{[raw](std::stop_token stop) { raw->run(stop); }};
  return std::unique_ptr<ZmqKvSubscriber>(new ZmqKvSubscriber(std::move(state)));
}

ZmqKvSubscriber::ZmqKvSubscriber(std::unique_ptr<State> state) : state_(std::move(state)) {}

ZmqKvSubscriber::~ZmqKvSubscriber() { stop(); }

void ZmqKvSubscriber::stop() {
  if (!state_ || !state_->thread.joinable()) return;
  state_->thread.request_stop();
  state_->thread.join();
}

ZmqSubscriberStats ZmqKvSubscriber::stats() const {
  const State& s = *state_;
  return ZmqSubscriberStats{.messages = s.messages.load(),
                            .batches = s.batches.load(),
                            .malformed_frames = s.malformed_frames.load(),
                            .malformed_payloads = s.malformed_payloads.load(),
                            .stale_messages = s.stale_messages.load(),
                            .gaps = s.gaps.load(),
                            .replays_filled = s.replays_filled.load(),
                            .replays_failed = s.replays_failed.load(),
                            .restarts = s.restarts.load()};
}

}  // namespace kvr::bridge
