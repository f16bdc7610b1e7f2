// One HTTP/1.1 request to an engine, its whole answer read into memory: the front door's render
// and tokenize calls. Asynchronous on the caller's executor (a connection's strand), with one
// deadline over resolve, connect, write and read. Only included by the front door's .cpp files.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include <boost/asio/any_io_executor.hpp>

namespace kvr::front_door {

/// What an engine answered, or why it did not.
struct EngineAnswer {
  /// Empty when the engine answered (any status).
  std::string failure;
  unsigned status = 0;
  std::string body;
};

struct EngineCallRequest {
  /// The engine's base URL (http:// only).
  std::string base_url;
  /// Appended to the base URL's path ("/tokenize").
  std::string path;
  std::string body;
  std::chrono::milliseconds timeout{10'000};
  std::size_t max_answer_bytes = std::size_t{16} << 20;
};

/// Posts `request.body` as JSON; `done` runs once on `executor`.
void call_engine(boost::asio::any_io_executor executor, EngineCallRequest request,
                 std::function<void(EngineAnswer)> done);

}  // namespace kvr::front_door
