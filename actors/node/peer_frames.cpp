#include "actors/node/peer_frames.hpp"

#include <atomic>
#include <cstdint>
#include <memory>
#include <stdexcept>

#include <caf/io/basp/header.hpp>
#include <caf/io/basp/message_type.hpp>
#include <caf/io/middleman.hpp>
#include <caf/io/network/default_multiplexer.hpp>
#include <caf/io/network/operation.hpp>
#include <caf/io/network/scribe_impl.hpp>
#include <caf/io/receive_policy.hpp>

namespace kvr::actors {
namespace {

namespace basp = caf::io::basp;
namespace network = caf::io::network;

// The limits and counts of one backend, shared with its connections: a connection may be
// destroyed after the backend when the actor system stops.
struct FrameGuard {
  std::atomic<std::size_t> message_bytes{PeerFrameLimits{}.message_bytes};
  std::atomic<std::uint64_t> frames_refused{0};
  std::atomic<std::uint64_t> handshakes_refused{0};
};

// A plaintext connection that refuses a frame over its limit. CAF's BASP broker reads a frame as
// a header (basp::header_size bytes) and then, when the header announces one, its payload: it asks
// for each through configure_read while it handles the bytes before, and the stream sizes its
// buffer to that length right after the broker's handler returns. A length over the limit is
// refused there, and the connection closed once the handler is done. The scribe follows the
// headers it passes on to know when the peer's handshake has been read.
class BoundedScribe final : public network::scribe_impl {
 public:
  BoundedScribe(network::default_multiplexer& backend, network::native_socket fd,
                std::shared_ptr<FrameGuard> guard)
      : scribe_impl(backend, fd), guard_(std::move(guard)) {}

  ~BoundedScribe() override {
    if (!handshake_read_) guard_->handshakes_refused.fetch_add(1, std::memory_order_relaxed);
  }

  void configure_read(caf::io::receive_policy::config policy) override {
    const std::size_t limit = handshake_read_
                                  ? guard_->message_bytes.load(std::memory_order_relaxed)
                                  : PeerFrameLimits::kHandshakeBytes;
    if (policy.second > limit) {
      // The read stays as it was (a header's length) until consume closes the connection.
      refused_ = true;
      return;
    }
    scribe_impl::configure_read(policy);
  }

  bool consume(caf::execution_unit* context, const void* bytes, std::size_t count) override {
    follow_frame(static_cast<const std::uint8_t*>(bytes), count);
    const bool keep_reading = scribe_impl::consume(context, bytes, count);
    if (!refused_) return keep_reading;
    guard_->frames_refused.fetch_add(1, std::memory_order_relaxed);
    // What CAF does when a read fails: the broker hears the connection closed and forgets it.
    io_failure(context, network::operation::read);
    return false;
  }

 private:
  // Reads the header fields this scribe needs (network byte order, basp/header.hpp): the
  // operation in byte 0, the payload length in bytes 4 to 7.
  void follow_frame(const std::uint8_t* bytes, std::size_t count) {
    if (awaiting_payload_) {
      awaiting_payload_ = false;
      if (handshake_frame_) handshake_read_ = true;
      return;
    }
    if (count != basp::header_size) return;
    const auto operation = static_cast<basp::message_type>(bytes[0]);
    handshake_frame_ = operation == basp::message_type::server_handshake ||
                       operation == basp::message_type::client_handshake;
    const std::uint32_t payload_length = (std::uint32_t{bytes[4]} << 24) |
                                         (std::uint32_t{bytes[5]} << 16) |
                                         (std::uint32_t{bytes[6]} << 8) | std::uint32_t{bytes[7]};
    awaiting_payload_ = payload_length > 0;
    if (!awaiting_payload_ && handshake_frame_) handshake_read_ = true;
  }

  std::shared_ptr<FrameGuard> guard_;
  bool awaiting_payload_ = false;
  bool handshake_frame_ = false;
  bool handshake_read_ = false;
  bool refused_ = false;
};

class BoundedMultiplexer final : public network::default_multiplexer {
 public:
  explicit BoundedMultiplexer(caf::actor_system* system) : default_multiplexer(system) {}

  caf::io::scribe_ptr new_scribe(network::native_socket fd) override {
    return caf::make_counted<BoundedScribe>(*this, fd, guard_);
  }

  void set_limits(PeerFrameLimits limits) {
    guard_->message_bytes.store(limits.message_bytes, std::memory_order_relaxed);
  }
  std::shared_ptr<const FrameGuard> guard() const { return guard_; }

 private:
  std::shared_ptr<FrameGuard> guard_ = std::make_shared<FrameGuard>();
};

BoundedMultiplexer& bounded_backend(caf::actor_system& system) {
  auto* backend = dynamic_cast<BoundedMultiplexer*>(&system.middleman().backend());
  if (backend == nullptr) {
    throw std::logic_error("the actor system's middleman was not loaded by load_bounded_middleman");
  }
  return *backend;
}

}  // namespace

void load_bounded_middleman(caf::actor_system_config& config) {
  config.load<caf::io::middleman, BoundedMultiplexer>();
}

void set_peer_frame_limits(caf::actor_system& system, PeerFrameLimits limits) {
  bounded_backend(system).set_limits(limits);
}

std::function<PeerFrameCounts()> peer_frame_counter(caf::actor_system& system) {
  return [guard = bounded_backend(system).guard()] {
    return PeerFrameCounts{
        .frames_refused = guard->frames_refused.load(std::memory_order_relaxed),
        .handshakes_refused = guard->handshakes_refused.load(std::memory_order_relaxed)};
  };
}

}  // namespace kvr::actors
