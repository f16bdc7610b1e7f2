// The node's OpenAI-compatible HTTP API (`kvr node --http-port`): POST /v1/chat/completions and
// /v1/completions, GET /v1/models and /health. For each generation request it asks an engine of
// the model to render the prompt into token ids (the engine's own chat template and tokenizer,
// so the ids match its KV cache; or, in the `estimate` mode, takes the prompt's text), routes them
// through the RoutingGateway, forwards the client's body unchanged to the chosen engine's HTTP URL
// and streams the engine's answer back, reporting the first streamed byte as the first token and
// the end as the completion. An engine that fails before its first byte is left out and the request
// routed once more; a client that goes away closes the engine's connection at once and releases the
// booking.
//
// Built on Boost.Beast and Asio: every connection is a few kilobytes of state on a strand, not a
// thread, and a slow client only slows its own engine connection (one chunk in flight each way).
// Plain C++ (no CAF); Beast stays inside the .cpp.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <expected>
#include <memory>
#include <string>
#include <thread>

#include "messages/metrics/metrics_registry.hpp"
#include "selection/config/model_config.hpp"
#include "selection/front_door/engine_connections.hpp"
#include "selection/front_door/fleet_directory.hpp"
#include "selection/front_door/native_tokenizers.hpp"
#include "selection/front_door/render_pool.hpp"
#include "selection/front_door/routing_gateway.hpp"
#include "selection/tokenizer/request_json.hpp"

namespace kvr::front_door {

struct FrontDoorOptions {
  std::string address = "127.0.0.1";
  /// 0: any free port (see HttpFrontDoor::port()).
  std::uint16_t port = 0;
  /// Threads running the connections (each connection stays on one strand): one per core, so
  /// that new requests are not queued behind the relays of the streams in flight.
  std::size_t threads = std::clamp<std::size_t>(std::thread::hardware_concurrency(), 1, 64);
  /// A request body above this is refused with 413.
  std::size_t max_body_bytes = std::size_t{8} << 20;
  /// A non-streamed engine answer above this ends the request with 502.
  std::size_t max_response_bytes = std::size_t{64} << 20;
  /// Open client connections at most; clamped at start so that each may hold an engine
  /// connection too within the descriptor limit (less a reserve). At the cap a new client takes
  /// the slot of the connection idle the longest, or is answered 503 and closed.
  std::size_t max_connections = 20'000;
  /// Header naming the session (session affinity).
  std::string session_header = "x-session-id";
  /// How each model's prompts become routing keys (engine rendering, or text estimates).
  selection::TokenizerModes tokenizer_modes;
  /// The `native` mode's tokenizers by model (null or missing: the model is served as `engine`).
  std::shared_ptr<const NativeTokenizers> native_tokenizers;
  /// Render and tokenize calls in flight at once over all engines; beyond it a request is
  /// refused with 503.
  std::size_t max_renders_in_flight = 1024;
  /// A render or tokenize call without an answer after this long fails.
  std::chrono::milliseconds render_timeout{10'000};
  /// An engine that sends no first byte this long after the request was forwarded has failed.
  std::chrono::milliseconds first_byte_timeout{30'000};
  /// A streamed answer with no byte for this long ends with an error event.
  std::chrono::milliseconds stall_timeout{30'000};
  /// Retries of a request whose engine failed before its first byte, each on another worker.
  std::uint32_t max_retries = 1;
  /// A kept-alive client connection idle this long between requests is closed (nginx's
  /// keepalive_timeout is 75 s, Envoy's connection idle timeout an hour).
  std::chrono::milliseconds idle_timeout{60'000};
  /// A request's head (a new connection's first one from the accept, a kept-alive connection's
  /// from its first byte) must arrive whole within this (nginx's client_header_timeout is 60 s).
  std::chrono::milliseconds header_timeout{30'000};
  /// A request body must make progress: it may take this long plus its bytes at
  /// `min_body_bytes_per_second` (nginx's client_body_timeout is 60 s between two reads).
  std::chrono::milliseconds body_timeout{30'000};
  std::size_t min_body_bytes_per_second = 8 * 1024;
  /// A write to a client that does not complete within this closes the connection: a client that
  /// stops reading holds neither its engine nor its booking (nginx's send_timeout is 60 s).
  std::chrono::milliseconds send_timeout{60'000};
  /// A stream through kvr's generate API (no engine to back-pressure) whose client lags this many
  /// bytes of events behind is ended: its generation cancelled, its booking released.
  std::size_t max_pending_stream_bytes = std::size_t{1} << 20;
  /// Idle keep-alive connections to each engine, reused by the next requests forwarded to it.
  EngineConnectionsOptions engine_connections;
  /// The deepest a request body may nest (objects and arrays, the body itself the first level);
  /// a deeper one is refused with a 400 naming the field, before anything walks it. At most
  /// tokenizer::kMaxJsonDepthCeiling, what the chat template's own walks allow.
  int max_json_depth = tokenizer::kDefaultMaxJsonDepth;
  /// The threads the `native` tokenizer mode renders prompts on, and how many renders may wait
  /// for them (in all, and of one client: its address).
  RenderPoolOptions render_pool;

  /// Checks ranges; the error names the option.
  std::expected<void, std::string> validate() const;
};

class HttpFrontDoor {
 public:
  /// Binds and starts serving; the error names the address.
  static std::expected<std::unique_ptr<HttpFrontDoor>, std::string> start(
      FrontDoorOptions options, std::shared_ptr<RoutingGateway> gateway,
      std::shared_ptr<const FleetDirectory> directory,
      std::shared_ptr<metrics::MetricsRegistry> metrics);
  /// Ends every request in flight with an explicit error, then stops.
  ~HttpFrontDoor();
  HttpFrontDoor(const HttpFrontDoor&) = delete;
  HttpFrontDoor& operator=(const HttpFrontDoor&) = delete;

  std::uint16_t port() const;
  /// Stops accepting connections and requests (a drain); those in flight go on.
  void stop_intake();
  /// Generation requests between their body and their last byte.
  std::size_t in_flight() const;
  /// Open client connections.
  std::size_t connections() const;
  /// The connection cap in force (max_connections, clamped under the descriptor limit).
  std::size_t max_connections() const;
  /// Open client connections waiting for a request's first byte (those a new client may take the
  /// slot of at the cap).
  std::size_t idle_connections() const;

  struct State;

 private:
  explicit HttpFrontDoor(std::shared_ptr<State> state);
  std::shared_ptr<State> state_;
};

}  // namespace kvr::front_door
