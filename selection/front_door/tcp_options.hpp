// Socket set-up the front door's connections share. Only included by the front door's .cpp files.
#pragma once

#include <charconv>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include <boost/asio/ip/address.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core/tcp_stream.hpp>

namespace kvr::front_door {

/// Streamed answers are many small writes: without TCP_NODELAY, Nagle's algorithm holds each one
/// until the peer acknowledges the last, and a delayed acknowledgement stalls a stream for tens of
/// milliseconds.
inline void set_no_delay(boost::beast::tcp_stream& stream) {
  boost::system::error_code ignored;
  stream.socket().set_option(boost::asio::ip::tcp::no_delay(true), ignored);
}

/// The endpoint of an IP-literal host (an IPv6 one without brackets, as split_http_url gives it)
/// and a port; empty for a host name (resolved instead).
inline std::optional<boost::asio::ip::tcp::endpoint> literal_endpoint(const std::string& host,
                                                                      const std::string& port) {
  boost::system::error_code error;
  const auto ip = boost::asio::ip::make_address(host, error);
  std::uint16_t number = 0;
  const auto [end, parse_error] = std::from_chars(port.data(), port.data() + port.size(), number);
  if (error || parse_error != std::errc{} || end != port.data() + port.size()) return std::nullopt;
  return boost::asio::ip::tcp::endpoint{ip, number};
}

/// Connects `stream` to an engine's host and port with TCP_NODELAY, then calls `done(error,
/// what)` once (`what`: "resolve" or "connect", for the message). Engines register IP addresses
/// as a rule, so a literal skips the resolver (whose thread hop costs tens of microseconds).
/// `done` must keep `stream` and `resolver` alive.
template <typename Done>
void connect_engine(boost::beast::tcp_stream& stream, boost::asio::ip::tcp::resolver& resolver,
                    const std::string& host, const std::string& port, Done done) {
  auto connected = [&stream, done](boost::system::error_code error) {
    if (!error) set_no_delay(stream);
    done(error, "connect");
  };
  if (const auto endpoint = literal_endpoint(host, port)) {
    return stream.async_connect(*endpoint, std::move(connected));
  }
  resolver.async_resolve(
      host, port,
      [&stream, done, connected](boost::system::error_code error,
                                 boost::asio::ip::tcp::resolver::results_type found) {
        if (error) return done(error, "resolve");
        stream.async_connect(found, [connected](boost::system::error_code connect_error,
                                                const auto&) { connected(connect_error); });
      });
}

}  // namespace kvr::front_door
