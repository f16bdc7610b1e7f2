#include "selection/front_door/engine_relay.hpp"

#include <limits>

#include <boost/beast/core/read_size.hpp>
#include <boost/beast/http/read.hpp>
#include <boost/beast/http/write.hpp>
#include <fmt/format.h>
#include <unistd.h>

#include "selection/front_door/tcp_options.hpp"

namespace kvr::front_door {
namespace {

namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;

// The most of an engine's answer one read takes and one client write carries.
constexpr std::size_t kRelayChunkBytes = 16 * 1024;

}  // namespace

EngineRelay::EngineRelay(const net::any_io_executor& executor, EngineRelayPool pool,
                         std::weak_ptr<EngineSink> sink, EngineRequest request)
    : pool_(pool),
      sink_(std::move(sink)),
      stream_(executor),
      resolver_(executor),
      buffer_(kRelayChunkBytes),
      host_(std::move(request.host)),
      port_(std::move(request.port)) {
  request_.emplace(http::verb::post, request.target, 11);
  request_->set(http::field::host, host_ + ":" + port_);
  request_->set(http::field::content_type, "application/json");
  request_->set(http::field::user_agent, "kvr");
  request_->set("x-request-id", request.request_id);
  if (!request.accept.empty()) request_->set(http::field::accept, request.accept);
  if (!request.authorization.empty()) {
    request_->set(http::field::authorization, request.authorization);
  }
  // Moved, not copied (prompts run to megabytes); a retry takes it back.
  request_->body() = std::move(request.body);
  request_->prepare_payload();
}

void EngineRelay::send() {
  if (auto parked = pool_.connections->take(address())) {
    beast::error_code error;
    stream_.socket().assign(parked->protocol, parked->handle, error);
    if (!error) {
      reused_ = true;
      pool_.reused.add();
      return write_request();
    }
    ::close(parked->handle);
  }
  connect(pool_.opened);
}

void EngineRelay::connect(const metrics::ValueHandle& outcome) {
  outcome.add();
  connect_engine(stream_, resolver_, host_, port_,
                 [self = shared_from_this(), sink = sink_.lock()](beast::error_code error,
                                                                  std::string_view what) {
                   if (self->closed_ || !sink) return;
                   if (error) {
                     return sink->engine_failed(fmt::format("cannot {}: {}", what, error.message()),
                                                FailureCause::worker_failed);
                   }
                   self->write_request();
                 });
}

// A kept-alive connection the engine closed as the request went out fails before any answer
// byte: the request is sent again on a new connection, and the engine is not to blame.
bool EngineRelay::resend_on_new_connection() {
  if (!reused_) return false;
  reused_ = false;
  beast::error_code ignored;
  stream_.socket().close(ignored);
  buffer_.clear();
  parser_.reset();
  connect(pool_.resent);
  return true;
}

void EngineRelay::write_request() {
  http::async_write(
      stream_, *request_,
      [self = shared_from_this(), sink = sink_.lock()](beast::error_code error, std::size_t) {
        if (self->closed_ || !sink) return;
        if (error) {
          if (self->resend_on_new_connection()) return;
          return sink->engine_failed("cannot send: " + error.message(),
                                     FailureCause::worker_failed);
        }
        self->read_header();
      });
}

void EngineRelay::read_header() {
  parser_.emplace();
  // No limit here (a stream may run long; a gathered answer has its own). Not boost::none:
  // Beast 1.74 compares a Content-Length with an empty limit as exceeding it.
  parser_->body_limit(std::numeric_limits<std::uint64_t>::max());
  http::async_read_header(
      stream_, buffer_, *parser_,
      [self = shared_from_this(), sink = sink_.lock()](beast::error_code error, std::size_t) {
        if (self->closed_ || !sink) return;
        if (error) {
          if (!self->parser_->got_some() && self->resend_on_new_connection()) return;
          return sink->engine_failed("no answer: " + error.message(), FailureCause::worker_failed);
        }
        const auto& header = self->parser_->get();
        const auto type = header[http::field::content_type];
        sink->engine_header(header.result_int(), std::string{type.data(), type.size()});
      });
}

void EngineRelay::read_body() {
  if (!chunk_) {
    chunk_ = std::make_unique<char[]>(kRelayChunkBytes);
    buffer_.reserve(kRelayChunkBytes);  // one read takes every event waiting in the socket
  }
  const auto decoded = decode();
  if (!decoded) return;
  if (*decoded > 0 || parser_->is_done()) {
    if (*decoded > 0) answered_ = true;
    if (auto sink = sink_.lock()) {
      sink->engine_bytes(std::string_view{chunk_.get(), *decoded}, parser_->is_done());
    }
    return;
  }
  read_more();
}

// The answer's body bytes decoded from what is buffered into `chunk_`; none when the answer is
// not valid HTTP (the attempt has failed then).
std::optional<std::size_t> EngineRelay::decode() {
  auto& parser = *parser_;
  std::size_t decoded = 0;
  while (!parser.is_done() && buffer_.size() > 0 && decoded < kRelayChunkBytes) {
    auto& body = parser.get().body();
    body.data = chunk_.get() + decoded;
    body.size = kRelayChunkBytes - decoded;
    beast::error_code error;
    const std::size_t used = parser.put(buffer_.data(), error);
    buffer_.consume(used);
    decoded = kRelayChunkBytes - body.size;
    if (error == http::error::need_more || error == http::error::need_buffer) break;
    if (error) {
      if (auto sink = sink_.lock()) {
        sink->engine_failed("the answer is not valid HTTP: " + error.message(),
                            FailureCause::worker_failed);
      }
      return std::nullopt;
    }
    if (used == 0) break;
  }
  return decoded;
}

void EngineRelay::read_more() {
  const std::size_t room = beast::read_size(buffer_, kRelayChunkBytes);
  if (room == 0) {
    if (auto sink = sink_.lock()) {
      sink->engine_failed(
          fmt::format("the answer's framing needs more than {} bytes", kRelayChunkBytes),
          FailureCause::worker_failed);
    }
    return;
  }
  stream_.async_read_some(buffer_.prepare(room), [self = shared_from_this(), sink = sink_.lock()](
                                                     beast::error_code error, std::size_t n) {
    if (self->closed_ || !sink) return;
    self->buffer_.commit(n);
    if (error == net::error::eof && self->parser_->need_eof()) {
      self->parser_->put_eof(error);  // an answer delimited by the connection's end
    }
    if (error) {
      return sink->engine_failed(self->answered_ ? "the answer broke off: " + error.message()
                                                 : "no answer: " + error.message(),
                                 FailureCause::worker_failed);
    }
    self->read_body();
  });
}

std::optional<std::string> EngineRelay::take_body() {
  if (!request_) return std::nullopt;
  return std::move(request_->body());
}

bool EngineRelay::park() {
  if (!parser_ || !parser_->is_done() || !parser_->keep_alive() || buffer_.size() != 0) {
    return false;
  }
  beast::error_code error;
  const auto protocol = stream_.socket().local_endpoint(error).protocol();
  if (error) return false;
  const auto handle = stream_.socket().release(error);
  if (error) return false;
  pool_.connections->park(address(), {protocol, handle});
  return true;
}

void EngineRelay::close() {
  closed_ = true;
  resolver_.cancel();
  if (stream_.socket().is_open()) {
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream_.close();
  }
}

}  // namespace kvr::front_door
