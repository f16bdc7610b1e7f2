// One attempt's forwarding of a client's request to an engine over HTTP/1.1: connect (or take a
// kept-alive connection), send, read the answer, park the connection for the next request. Used
// by the front door's FlightDriver, which it reports to through an EngineSink.
#pragma once

#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/core/tcp_stream.hpp>
#include <boost/beast/http/buffer_body.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/string_body.hpp>

#include "messages/metrics/metrics_registry.hpp"
#include "selection/front_door/engine_connections.hpp"
#include "selection/partition/partition_messages.hpp"

namespace kvr::front_door {

/// What an engine relay reports, on the strand of the connection it works for.
class EngineSink {
 public:
  virtual ~EngineSink() = default;
  /// The answer's head arrived; EngineRelay::read_body() goes on to its body.
  virtual void engine_header(unsigned status, std::string content_type) = 0;
  /// Body bytes were decoded (valid until the next read_body()); `done`: the answer ended.
  virtual void engine_bytes(std::string_view bytes, bool done) = 0;
  /// The attempt failed; `cause`: the worker's fault (none: nobody's).
  virtual void engine_failed(std::string why, std::optional<FailureCause> cause) = 0;
};

/// The kept-alive engine connections every relay shares, and their counters by outcome.
struct EngineRelayPool {
  EngineConnections* connections = nullptr;
  metrics::ValueHandle opened;
  metrics::ValueHandle reused;
  metrics::ValueHandle resent;
};

/// The request an attempt sends.
struct EngineRequest {
  std::string host;
  std::string port;
  /// The engine's path and the endpoint's ("/v1/chat/completions").
  std::string target;
  std::string request_id;
  std::string accept;
  std::string authorization;
  std::string body;
};

/// One attempt's engine connection. Each attempt has its own, held by the handlers of its
/// operations as well: a retry never reuses a stream whose aborted operations have not yet
/// completed (Beast asserts one pending read or write per stream), and a late completion never
/// touches a buffer or parser that is gone. Its handlers hold the sink (weakly held otherwise)
/// while they are pending, and report nothing once the relay is closed.
class EngineRelay : public std::enable_shared_from_this<EngineRelay> {
 public:
  /// `executor`: the connection's strand.
  EngineRelay(const boost::asio::any_io_executor& executor, EngineRelayPool pool,
              std::weak_ptr<EngineSink> sink, EngineRequest request);

  /// Sends the request, on a kept-alive connection to the engine when one is parked.
  void send();
  /// Decodes what is already read, and reads from the engine only when nothing is left to
  /// decode, so that one client write carries every event one read brought.
  void read_body();
  /// No retry after the first byte: a long stream keeps neither its prompt nor its body.
  void drop_request() { request_.reset(); }
  /// The request's body, taken back for a retry; none once dropped.
  std::optional<std::string> take_body();
  /// Keeps the engine connection for the next request when its answer ended cleanly and the
  /// engine keeps it alive; false: it is closed with the attempt.
  bool park();
  /// Ends the attempt: its connection closes and its late completions do nothing.
  void close();

 private:
  void connect(const metrics::ValueHandle& outcome);
  bool resend_on_new_connection();
  void write_request();
  void read_header();
  std::optional<std::size_t> decode();
  void read_more();
  std::string address() const { return host_ + ":" + port_; }

  EngineRelayPool pool_;
  std::weak_ptr<EngineSink> sink_;
  boost::beast::tcp_stream stream_;
  boost::asio::ip::tcp::resolver resolver_;
  // Bounded: the answer's bytes pass through it into `chunk_`.
  boost::beast::flat_buffer buffer_;
  std::optional<boost::beast::http::request<boost::beast::http::string_body>> request_;
  std::optional<boost::beast::http::response_parser<boost::beast::http::buffer_body>> parser_;
  std::string host_;
  std::string port_;
  /// The connection served an earlier request (taken from the kept-alive ones).
  bool reused_ = false;
  /// Body bytes of the answer were decoded.
  bool answered_ = false;
  bool closed_ = false;
  /// The engine's answer is read through it; made at the first body read, so that an idle
  /// keep-alive connection costs a few hundred bytes.
  std::unique_ptr<char[]> chunk_;
};

}  // namespace kvr::front_door
