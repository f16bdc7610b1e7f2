// Idle keep-alive connections to engines, shared by the front door's connections. Forwarding a
// request over one skips a TCP handshake and the engine's accept, as a proxy's upstream pool does.
// Sockets are parked as native handles, not as Asio objects, because an Asio socket belongs to
// the strand that made it and the next request for the engine may run on another.
#pragma once

#include <chrono>
#include <cstddef>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <boost/asio/ip/tcp.hpp>

#include "messages/clock.hpp"

namespace kvr::front_door {

struct EngineConnectionsOptions {
  /// Idle connections kept per engine address (host:port); 0: a new connection per request.
  std::size_t per_engine = 64;
  /// One idle longer is closed instead of used: vLLM's server (uvicorn) closes its side after
  /// 5 s, and a request sent as it does so would find the connection gone.
  std::chrono::milliseconds idle_limit{4'000};
};

class EngineConnections {
 public:
  using Handle = boost::asio::ip::tcp::socket::native_handle_type;

  /// A connection the engine can still take a request on.
  struct Parked {
    boost::asio::ip::tcp protocol;
    Handle handle;
  };

  explicit EngineConnections(EngineConnectionsOptions options,
                             std::shared_ptr<const Clock> clock = Clock::steady());
  ~EngineConnections();
  EngineConnections(const EngineConnections&) = delete;
  EngineConnections& operator=(const EngineConnections&) = delete;

  /// The most recently parked idle connection to `address` that is still open and quiet (the
  /// engine has neither closed it nor sent anything on it); the caller owns it. None: connect.
  std::optional<Parked> take(const std::string& address);
  /// Keeps a connection whose last answer ended cleanly; closes it when the engine's share is full.
  void park(const std::string& address, Parked connection);
  /// Idle connections kept now, over every engine.
  std::size_t idle() const;

 private:
  struct Idle {
    Parked connection;
    std::chrono::steady_clock::time_point since;
  };

  EngineConnectionsOptions options_;
  std::shared_ptr<const Clock> clock_;
  mutable std::mutex mutex_;
  std::unordered_map<std::string, std::vector<Idle>> idle_;
};

}  // namespace kvr::front_door
