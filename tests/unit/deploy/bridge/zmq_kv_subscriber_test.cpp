// The subscriber against a stand-in engine: a real ZMQ PUB socket on 127.0.0.1 sending the
// engines' three-frame messages, and a ROUTER replay socket answering as vLLM's does.
#include "deploy/bridge/zmq_kv_subscriber.hpp"

#include <bit>
#include <cerrno>
#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>

#include <gtest/gtest.h>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "deploy/worker/vllm_kv_frames.hpp"

namespace kvr::bridge {
namespace {

using namespace std::chrono_literals;

constexpr std::chrono::milliseconds kDeadline = 10s;

using worker::encode_sequence;

// A batch [ts, [["AllBlocksCleared"]], 0] whose ts carries `tag`, so the test can tell batches
// apart: fixarray 3, float64 (big-endian), fixarray 1, fixarray 1, fixstr 16, 0.
std::string payload(double tag) {
  static_assert(std::endian::native == std::endian::little);
  std::string out = "\x93\xcb";
  const auto bits = std::byteswap(std::bit_cast<std::uint64_t>(tag));
  out.append(reinterpret_cast<const char*>(&bits), sizeof bits);
  out += "\x91\x91\xb0";
  out += "AllBlocksCleared";
  out.push_back('\0');
  return out;
}

std::string bound_endpoint(zmq::socket_t& socket) {
  socket.bind("tcp://127.0.0.1:*");
  return socket.get(zmq::sockopt::last_endpoint);
}

// What the subscriber handed on, waited for with deadlines.
struct Received {
  std::mutex mutex;
  std::condition_variable changed;
  std::vector<double> tags;  // ts of each batch, in delivery order
  int lost = 0;
  int malformed = 0;
  std::vector<std::size_t> restarts;  // batches delivered before each on_restart

  ZmqSubscriberCallbacks callbacks() {
    return ZmqSubscriberCallbacks{.on_batch =
                                      [this](DpRank, EngineKvEventBatch batch) {
                                        std::lock_guard lock{mutex};
                                        tags.push_back(batch.ts);
                                        changed.notify_all();
                                      },
                                  .on_lost =
                                      [this](DpRank) {
                                        std::lock_guard lock{mutex};
                                        ++lost;
                                        changed.notify_all();
                                      },
                                  .on_restart =
                                      [this](DpRank) {
                                        std::lock_guard lock{mutex};
                                        restarts.push_back(tags.size());
                                        changed.notify_all();
                                      },
                                  .on_malformed =
                                      [this](DpRank, const DecodeError&) {
                                        std::lock_guard lock{mutex};
                                        ++malformed;
                                        changed.notify_all();
                                      }};
  }

  template <typename Predicate>
  bool wait(Predicate predicate, std::chrono::milliseconds timeout = kDeadline) {
    std::unique_lock lock{mutex};
    return changed.wait_for(lock, timeout, [&] { return predicate(*this); });
  }
  std::vector<double> tags_now() {
    std::lock_guard lock{mutex};
    return tags;
  }
};

// The stand-in engine's publisher, with the last batches kept for replay.
class StandInPublisher {
 public:
  explicit StandInPublisher(zmq::context_t& context) : pub_(context, zmq::socket_type::pub) {
    pub_.set(zmq::sockopt::linger, 0);
    endpoint_ = bound_endpoint(pub_);
  }
  // Bound to `endpoint`, once the previous publisher there has let go of it: an engine restarted
  // on the same port.
  StandInPublisher(zmq::context_t& context, const std::string& endpoint)
      : pub_(context, zmq::socket_type::pub), endpoint_(endpoint) {
    pub_.set(zmq::sockopt::linger, 0);
    const auto deadline = std::chrono::steady_clock::now() + kDeadline;
    while (true) {
      try {
        pub_.bind(endpoint);
        return;
      } catch (const zmq::error_t& error) {
        if (error.num() != EADDRINUSE || std::chrono::steady_clock::now() > deadline) throw;
        std::this_thread::yield();
      }
    }
  }
  const std::string& endpoint() const { return endpoint_; }

  void send(std::uint64_t sequence, const std::string& body, bool keep = true) {
    ASSERT_TRUE(worker::send_kv_event(pub_, "kv", sequence, body));
    if (keep) buffer_[sequence] = body;
  }
  void send_raw(std::vector<std::string> parts) {
    std::vector<zmq::const_buffer> frames;
    for (const auto& part : parts) frames.push_back(zmq::buffer(part));
    ASSERT_TRUE(zmq::send_multipart(pub_, frames));
  }
  // Keeps `body` for replay as `sequence` without publishing it (a message the SUB missed).
  void keep_only(std::uint64_t sequence, const std::string& body) { buffer_[sequence] = body; }
  void forget_before(std::uint64_t sequence) {
    buffer_.erase(buffer_.begin(), buffer_.find(sequence));
  }
  std::map<std::uint64_t, std::string> buffer() const { return buffer_; }

  // Publishes sequence 0 until the subscriber has it: ZMQ drops what a PUB sends before the SUB's
  // subscription arrives; the repeats are stale to the subscriber.
  void send_first(Received& received) { send_until_delivered(received, 0, payload(0)); }

  // Publishes `sequence` until the subscriber has handed on one more batch than before.
  void send_until_delivered(Received& received, std::uint64_t sequence, const std::string& body) {
    const std::size_t before = received.tags_now().size();
    for (int attempt = 0; attempt < 1000; ++attempt) {
      send(sequence, body);
      if (received.wait([&](const Received& r) { return r.tags.size() > before; }, 20ms)) return;
    }
    FAIL() << "the subscriber never received sequence " << sequence;
  }

 private:
  zmq::socket_t pub_;
  std::string endpoint_;
  std::map<std::uint64_t, std::string> buffer_;
};

// A ROUTER replay socket on its own thread, answering requests from a buffer snapshot.
class StandInReplay {
 public:
  StandInReplay(zmq::context_t& context, std::map<std::uint64_t, std::string> buffer)
      : router_(context, zmq::socket_type::router), buffer_(std::move(buffer)) {
    router_.set(zmq::sockopt::linger, 0);
    endpoint_ = bound_endpoint(router_);
    thread_ = std::jthread{[this](std::stop_token stop) { serve(stop); }};
  }
  const std::string& endpoint() const { return endpoint_; }
  void set_buffer(std::map<std::uint64_t, std::string> buffer) {
    std::lock_guard lock{mutex_};
    buffer_ = std::move(buffer);
  }
  int requests() const { return requests_.load(); }

 private:
  void serve(const std::stop_token& stop) {
    while (!stop.stop_requested()) {
      std::array<zmq::pollitem_t, 1> items = {{{router_.handle(), 0, ZMQ_POLLIN, 0}}};
      if (zmq::poll(items.data(), 1, 20ms) == 0) continue;
      std::vector<zmq::message_t> request;
      if (!zmq::recv_multipart(router_, std::back_inserter(request))) continue;
      const auto asked = worker::read_replay_request(request);
      if (!asked) continue;
      ++requests_;
      std::lock_guard lock{mutex_};
      for (const auto& [sequence, body] : buffer_) {
        if (sequence < asked->first_sequence) continue;
        worker::send_replay_message(router_, asked->identity, sequence, body);
      }
      worker::send_replay_end(router_, asked->identity);
    }
  }

  zmq::socket_t router_;
  std::string endpoint_;
  std::mutex mutex_;
  std::map<std::uint64_t, std::string> buffer_;
  std::atomic<int> requests_{0};
  std::jthread thread_;
};

ZmqSubscriberOptions options_for(const std::string& endpoint, const std::string& replay = {}) {
  return ZmqSubscriberOptions{.endpoint = endpoint, .replay_endpoint = replay, .topic = "kv"};
}

std::vector<double> sequence_tags(std::initializer_list<double> tags) { return tags; }

TEST(ZmqKvSubscriberTest, DeliversBatchesInSequenceOrderOnItsTopic) {
  zmq::context_t context;
  StandInPublisher engine{context};
  Received received;
  auto subscriber = ZmqKvSubscriber::start(options_for(engine.endpoint()), received.callbacks());
  ASSERT_TRUE(subscriber) << subscriber.error();
  engine.send_first(received);
  engine.send_raw({"other-topic", encode_sequence(1), payload(99)});
  engine.send(1, payload(1));
  engine.send(2, payload(2));
  ASSERT_TRUE(received.wait([](const Received& r) { return r.tags.size() == 3; }));
  EXPECT_EQ(received.tags_now(), sequence_tags({0, 1, 2}));
  const auto stats = (*subscriber)->stats();
  EXPECT_EQ(stats.gaps, 0U);
  EXPECT_EQ(stats.batches, 3U);
}

TEST(ZmqKvSubscriberTest, FillsASequenceGapFromTheReplaySocket) {
  zmq::context_t context;
  StandInPublisher engine{context};
  StandInReplay replay{context, {}};
  Received received;
  auto subscriber = ZmqKvSubscriber::start(options_for(engine.endpoint(), replay.endpoint()),
                                           received.callbacks());
  ASSERT_TRUE(subscriber) << subscriber.error();
  engine.send_first(received);
  // Sequences 1 and 2 never reach the subscriber; the replay socket still has them.
  engine.keep_only(1, payload(1));
  engine.keep_only(2, payload(2));
  engine.keep_only(3, payload(3));
  replay.set_buffer(engine.buffer());
  engine.send(3, payload(3));
  ASSERT_TRUE(received.wait([](const Received& r) { return r.tags.size() == 4; }));
  engine.send(4, payload(4));
  ASSERT_TRUE(received.wait([](const Received& r) { return r.tags.size() == 5; }));
  EXPECT_EQ(received.tags_now(), sequence_tags({0, 1, 2, 3, 4}));
  const auto stats = (*subscriber)->stats();
  EXPECT_EQ(stats.gaps, 1U);
  EXPECT_EQ(stats.replays_filled, 1U);
  EXPECT_EQ(stats.replays_failed, 0U);
  EXPECT_EQ(replay.requests(), 1);
  EXPECT_EQ(received.lost, 0);
}

TEST(ZmqKvSubscriberTest, LosesTheRankWhenTheReplayNoLongerHasTheGap) {
  zmq::context_t context;
  StandInPublisher engine{context};
  StandInReplay replay{context, {}};
  Received received;
  auto subscriber = ZmqKvSubscriber::start(options_for(engine.endpoint(), replay.endpoint()),
                                           received.callbacks());
  ASSERT_TRUE(subscriber) << subscriber.error();
  engine.send_first(received);
  // Missed 1 and 2, and the engine's replay buffer starts at 2 already.
  engine.keep_only(1, payload(1));
  engine.keep_only(2, payload(2));
  engine.keep_only(3, payload(3));
  engine.forget_before(2);
  replay.set_buffer(engine.buffer());
  engine.send(3, payload(3));
  ASSERT_TRUE(received.wait([](const Received& r) { return r.lost == 1 && r.tags.size() >= 2; }));
  // The stream restarts at the message that revealed the gap; nothing replayed is applied out
  // of order.
  EXPECT_EQ(received.tags_now(), sequence_tags({0, 3}));
  engine.send(4, payload(4));
  ASSERT_TRUE(received.wait([](const Received& r) { return r.tags.size() == 3; }));
  EXPECT_EQ(received.tags_now(), sequence_tags({0, 3, 4}));
  const auto stats = (*subscriber)->stats();
  EXPECT_EQ(stats.replays_failed, 1U);
  EXPECT_EQ(replay.requests(), 1);
}

TEST(ZmqKvSubscriberTest, LosesTheRankOnAGapWithoutAReplayEndpoint) {
  zmq::context_t context;
  StandInPublisher engine{context};
  Received received;
  auto subscriber = ZmqKvSubscriber::start(options_for(engine.endpoint()), received.callbacks());
  ASSERT_TRUE(subscriber) << subscriber.error();
  engine.send_first(received);
  engine.send(5, payload(5));
  ASSERT_TRUE(received.wait([](const Received& r) { return r.lost == 1 && r.tags.size() == 2; }));
  EXPECT_EQ(received.tags_now(), sequence_tags({0, 5}));
}

TEST(ZmqKvSubscriberTest, SeesAPublisherRestartBySequenceNumbersGoingBack) {
  zmq::context_t context;
  Received received;
  auto old_engine = std::make_unique<StandInPublisher>(context);
  const std::string endpoint = old_engine->endpoint();
  auto subscriber = ZmqKvSubscriber::start(options_for(endpoint), received.callbacks());
  ASSERT_TRUE(subscriber) << subscriber.error();
  old_engine->send_first(received);
  for (std::uint64_t sequence = 1; sequence <= 3; ++sequence) {
    old_engine->send(sequence, payload(static_cast<double>(sequence)));
  }
  ASSERT_TRUE(received.wait([](const Received& r) { return r.tags.size() == 4; }));
  EXPECT_TRUE(received.restarts.empty());

  // The engine restarts on the same port and numbers from 0 again; the subscriber reconnects.
  old_engine.reset();
  StandInPublisher new_engine{context, endpoint};
  new_engine.send_until_delivered(received, 0, payload(10));
  new_engine.send(1, payload(11));
  new_engine.send(2, payload(12));
  ASSERT_TRUE(received.wait([](const Received& r) { return r.tags.size() == 7; }));
  // Nothing of the new engine is dropped as stale, and the restart is signalled once, before
  // its first batch.
  EXPECT_EQ(received.tags_now(), sequence_tags({0, 1, 2, 3, 10, 11, 12}));
  EXPECT_EQ(received.restarts, std::vector<std::size_t>{4});
  const auto stats = (*subscriber)->stats();
  EXPECT_EQ(stats.restarts, 1U);
  EXPECT_EQ(stats.gaps, 0U);
  EXPECT_EQ(received.lost, 0);
}

TEST(ZmqKvSubscriberTest, ReplaysWhatARestartedPublisherSentBeforeTheSubscriberRejoined) {
  zmq::context_t context;
  StandInReplay replay{context, {}};
  Received received;
  auto old_engine = std::make_unique<StandInPublisher>(context);
  const std::string endpoint = old_engine->endpoint();
  auto subscriber =
      ZmqKvSubscriber::start(options_for(endpoint, replay.endpoint()), received.callbacks());
  ASSERT_TRUE(subscriber) << subscriber.error();
  old_engine->send_first(received);
  for (std::uint64_t sequence = 1; sequence <= 5; ++sequence) {
    old_engine->send(sequence, payload(static_cast<double>(sequence)));
  }
  ASSERT_TRUE(received.wait([](const Received& r) { return r.tags.size() == 6; }));

  // The new engine's sequences 0 and 1 went out before the subscriber reconnected; its replay
  // socket still has them.
  old_engine.reset();
  StandInPublisher new_engine{context, endpoint};
  new_engine.keep_only(0, payload(20));
  new_engine.keep_only(1, payload(21));
  new_engine.keep_only(2, payload(22));
  replay.set_buffer(new_engine.buffer());
  new_engine.send_until_delivered(received, 2, payload(22));
  ASSERT_TRUE(received.wait([](const Received& r) { return r.tags.size() == 9; }));
  // (The next batch comes after the replay's bookkeeping.)
  new_engine.send(3, payload(23));
  ASSERT_TRUE(received.wait([](const Received& r) { return r.tags.size() == 10; }));
  EXPECT_EQ(received.tags_now(), sequence_tags({0, 1, 2, 3, 4, 5, 20, 21, 22, 23}));
  EXPECT_EQ(received.restarts, std::vector<std::size_t>{6});
  const auto stats = (*subscriber)->stats();
  EXPECT_EQ(stats.restarts, 1U);
  EXPECT_EQ(stats.gaps, 1U);
  EXPECT_EQ(stats.replays_filled, 1U);
  EXPECT_EQ(received.lost, 0);
}

TEST(ZmqKvSubscriberTest, CountsAndDropsMalformedFramesAndPayloads) {
  zmq::context_t context;
  StandInPublisher engine{context};
  Received received;
  auto subscriber = ZmqKvSubscriber::start(options_for(engine.endpoint()), received.callbacks());
  ASSERT_TRUE(subscriber) << subscriber.error();
  engine.send_first(received);
  engine.send_raw({"kv", encode_sequence(1)});         // two frames
  engine.send_raw({"kv", "1234", payload(1)});         // a 4-byte sequence
  engine.send(1, std::string{"\x93\xc1\x90\x00", 4});  // not msgpack
  engine.send(2, payload(2));
  ASSERT_TRUE(received.wait([](const Received& r) { return r.tags.size() == 2; }));
  EXPECT_EQ(received.tags_now(), sequence_tags({0, 2}));
  EXPECT_EQ(received.malformed, 1);
  const auto stats = (*subscriber)->stats();
  EXPECT_EQ(stats.malformed_frames, 2U);
  EXPECT_EQ(stats.malformed_payloads, 1U);
  EXPECT_EQ(stats.gaps, 0U);
}

TEST(ZmqKvSubscriberTest, RejectsAnEndpointItCannotUse) {
  Received received;
  auto bad =
      ZmqKvSubscriber::start(ZmqSubscriberOptions{.endpoint = "nonsense"}, received.callbacks());
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.error().find("nonsense"), std::string::npos);
}

TEST(ZmqKvSubscriberTest, OffsetsEndpointsByTheRank) {
  EXPECT_EQ(endpoint_for_rank("tcp://127.0.0.1:5557", 0), "tcp://127.0.0.1:5557");
  EXPECT_EQ(endpoint_for_rank("tcp://127.0.0.1:5557", 3), "tcp://127.0.0.1:5560");
  EXPECT_EQ(endpoint_for_rank("tcp://*:5557", 1), "tcp://*:5558");
  EXPECT_EQ(endpoint_for_rank("ipc:///tmp/kv", 2), "ipc:///tmp/kv_dp2");
  EXPECT_FALSE(endpoint_for_rank("tcp://host", 1));
  EXPECT_FALSE(endpoint_for_rank("tcp://host:65535", 1));
  EXPECT_FALSE(endpoint_for_rank("udp://host:1", 1));
}

}  // namespace
}  // namespace kvr::bridge
