// The node's endpoint picker for Envoy (`kvr node --epp-port`): a gRPC server of Envoy's external
// processing API (ext_proc v3) speaking the Gateway API Inference Extension's endpoint-picker
// protocol. Envoy streams each HTTP request's headers and body to it; it renders the prompt into
// token ids with an engine of the model, routes them through the RoutingGateway as the HTTP front
// door does, and answers with the chosen engine's "ip:port" in the x-gateway-destination-endpoint
// header and the envoy.lb dynamic metadata (an ORIGINAL_DST cluster sends the request there), or
// with a local reply carrying an OpenAI error object. The response phase of the same stream
// reports the first byte as the first token and the end as the completion, so the booking is
// released exactly once (docs/gateway.md).
//
// gRPC's callback API: a stream is a reactor, not a thread; its events run on an Asio strand of
// their own (one thread serves every stream's logic, which only parses and routes). Plain C++ (no
// CAF); gRPC and Asio stay inside the .cpp.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <expected>
#include <memory>
#include <string>

#include "messages/metrics/metrics_registry.hpp"
#include "selection/config/model_config.hpp"
#include "selection/front_door/fleet_directory.hpp"
#include "selection/front_door/native_tokenizers.hpp"
#include "selection/front_door/render_pool.hpp"
#include "selection/front_door/routing_gateway.hpp"
#include "selection/tokenizer/request_json.hpp"

namespace kvr::front_door {

struct EndpointPickerOptions {
  /// An IP address.
  std::string address = "127.0.0.1";
  /// 0: any free port (see EndpointPicker::port()).
  std::uint16_t port = 0;
  /// A request body above this is refused with 413 (the node passes the HTTP API's limit).
  std::size_t max_body_bytes = std::size_t{8} << 20;
  /// Header naming the session (session affinity).
  std::string session_header = "x-session-id";
  /// How each model's prompts become routing keys (engine rendering, or text estimates).
  selection::TokenizerModes tokenizer_modes;
  /// The `native` mode's tokenizers by model (null or missing: the model is served as `engine`).
  std::shared_ptr<const NativeTokenizers> native_tokenizers;
  /// Render and tokenize calls in flight at once; beyond it a request is refused with 503.
  std::size_t max_renders_in_flight = 1024;
  /// A render or tokenize call without an answer after this long fails.
  std::chrono::milliseconds render_timeout{10'000};
  /// How often the health service follows the directory (readiness: a worker is live).
  std::chrono::milliseconds health_interval{250};
  /// A stream whose request (headers and body) has not arrived whole this long after the stream
  /// opened is answered 408 and ended, its body and state released. 30 s,
  /// as nginx's 60 s client_header_timeout plus client_body_timeout allow a slow client but not a
  /// silent one: Envoy streams the body as its client sends it, and the 8 MiB body limit arrives
  /// within it at 2.3 Mbit/s, while a stream that sends nothing costs its slot for seconds, not
  /// for good. (Envoy's ext_proc message_timeout, 200 ms by default, does not apply to
  /// FULL_DUPLEX_STREAMED bodies, so Envoy bounds nothing here itself.)
  std::chrono::milliseconds request_timeout{30'000};
  /// A stream whose request arrived whole but whose answer has not ended this long after is
  /// ended: answered 504 while it is still being routed, else its booking released (aborted).
  /// An hour: far beyond any answer an engine streams (the OpenAI clients give up after 10
  /// minutes by default), so only a stream Envoy forgot meets it; such streams are small, so the
  /// bound is about "eventually", not memory. (Routing has tighter bounds of its own: the render
  /// timeout and the router's.)
  std::chrono::milliseconds response_timeout{3'600'000};
  /// Streams one HTTP/2 connection may have open at once (SETTINGS_MAX_CONCURRENT_STREAMS; a
  /// client waits, Envoy opens another connection). Envoy multiplexes a worker thread's requests
  /// on one connection: generous, but bounded.
  std::size_t max_streams_per_connection = 1024;
  /// Streams open over every connection; a new stream beyond it is answered 503 at once (a few
  /// KB each while the request is read, plus its body: bounded by request_timeout).
  std::size_t max_open_streams = 10'000;
  /// Request body bytes held over every stream while their requests arrive; a chunk beyond it
  /// is answered 503, so that many streams each sending up to max_body_bytes cannot take the
  /// node's memory. A gigabyte: 128 bodies of the 8 MiB limit at once, and thousands of ordinary
  /// prompts.
  std::size_t max_buffered_body_bytes = std::size_t{1} << 30;
  /// The memory gRPC itself may use for its connections and calls (its ResourceQuota); under
  /// pressure gRPC shrinks its buffers and cancels streams rather than grow.
  std::size_t grpc_memory_bytes = std::size_t{1} << 30;
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

class EndpointPicker {
 public:
  /// Binds and starts serving; the error names the address.
  static std::expected<std::unique_ptr<EndpointPicker>, std::string> start(
      EndpointPickerOptions options, std::shared_ptr<RoutingGateway> gateway,
      std::shared_ptr<const FleetDirectory> directory,
      std::shared_ptr<metrics::MetricsRegistry> metrics);
  /// Shuts the server down (streams still open get a short grace), releasing every open booking.
  ~EndpointPicker();
  EndpointPicker(const EndpointPicker&) = delete;
  EndpointPicker& operator=(const EndpointPicker&) = delete;

  std::uint16_t port() const;
  /// A drain: readiness turns NOT_SERVING and new requests are refused with 503; the streams of
  /// requests already routed go on.
  void stop_intake();
  /// Streams holding a booking (routed, their response not yet over).
  std::size_t in_flight() const;
  /// Streams open (their state held, from their first byte to their end).
  std::size_t open_streams() const;

  struct State;

 private:
  explicit EndpointPicker(std::shared_ptr<State> state);
  std::shared_ptr<State> state_;
};

}  // namespace kvr::front_door
