// A client connection's generation requests (/v1/chat/completions, /v1/completions), from the
// parsed request to the answer's last byte: render, route, forward (an EngineRelay per attempt)
// or serve through the node's generate API, carrying out what RequestFlight decides (retries,
// deadlines, one release per booking). The front door's Connection owns one and writes for it.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/buffer.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/beast/core/error.hpp>
#include <boost/beast/http/message.hpp>
#include <boost/beast/http/string_body.hpp>

#include "selection/front_door/engine_relay.hpp"
#include "selection/front_door/generated_answer.hpp"
#include "selection/front_door/http_front_door.hpp"
#include "selection/front_door/openai_api.hpp"
#include "selection/front_door/prompt_renderer.hpp"
#include "selection/front_door/request_routing.hpp"
#include "selection/lifecycle/request_flight.hpp"

namespace kvr::front_door {

using AnswerHeaders = std::vector<std::pair<std::string, std::string>>;

/// The head of a streamed answer (200, chunked): its type and kvr's headers.
struct StreamHead {
  std::string content_type;
  AnswerHeaders headers;
};

/// What the client connection does for its flight, on its strand.
class FlightClient {
 public:
  virtual ~FlightClient() = default;
  /// The connection, kept alive by the flight's pending handlers.
  virtual std::shared_ptr<void> hold() = 0;
  virtual std::weak_ptr<void> weak_hold() = 0;
  /// Keeps one read pending on the client's socket: its end is FlightDriver::client_gone().
  virtual void watch_client() = 0;
  /// A write to the client is under way.
  virtual bool writing() const = 0;
  /// Writes a whole answer; the next request follows (or the connection closes).
  virtual void respond(std::string_view endpoint, unsigned status, std::string body,
                       std::string content_type, AnswerHeaders headers) = 0;
  /// Writes an error answer (with the request's id).
  virtual void respond_error(std::string_view endpoint, const HttpError& error) = 0;
  /// Writes one chunk of a streamed answer, after the answer's head when `head` is set; `done`
  /// runs when the write completed.
  virtual void write_chunk(boost::asio::const_buffer bytes, const StreamHead* head,
                           std::function<void(boost::beast::error_code)> done) = 0;
  /// Ends a streamed answer: `tail` (an error event, or empty), then the last chunk.
  virtual void end_chunks(std::string tail) = 0;
  virtual void close() = 0;
};

/// One generation request in flight on a client connection (FlightDriver's).
struct FrontDoorFlight {
  Endpoint endpoint = Endpoint::chat_completions;
  std::string endpoint_path;
  GenerationRequest request;
  std::string body;
  std::string authorization;
  std::string accept;
  RequestMetadata metadata;
  RoutingKey key;
  std::chrono::steady_clock::time_point received;
  // The attempt's forwarding began (its engine connection opened, the request sent from then).
  std::chrono::steady_clock::time_point forwarded;
  // Decides the forwarded request's flight (retries, deadlines, one release per booking); the
  // connection carries out its steps. Absent for a request served through the generate API,
  // whose flight the node's lifecycle actor runs.
  std::optional<RequestFlight> core;
  // When the deadline timer wakes for the core.
  std::optional<FlightTime> deadline_at;
  // The byte runs relayed from the attempt's engine: the core's chunk indexes.
  std::uint32_t runs = 0;
  // The attempt under way: its booking and worker.
  std::string booking_id;
  std::uint64_t worker_id = 0;
  std::string worker_url;
  std::uint64_t predicted_cached_tokens = 0;
  bool first_byte = false;
  std::chrono::steady_clock::time_point engine_first_byte;
  // What the client has been sent of the answer.
  bool header_sent = false;
  bool streaming = false;
  std::string answer;       // a non-streamed answer, gathered
  std::string stream_tail;  // a streamed answer's last bytes: its usage, when it has one
  unsigned answer_status = 200;
  std::string answer_type;
  // A model whose workers registered no HTTP URL is served through the node's generate API:
  // tokenized and answered with its tokenizer.
  std::shared_ptr<const tokenizer::PromptTokenizer> tokenizer;
  std::shared_ptr<GenerateStream> generation;
  std::optional<GeneratedAnswer> generated;
  // Server-Sent Events waiting for the client while a write is under way.
  std::string events;
  bool events_end = false;
};

/// Runs the generation requests of one client connection, one at a time; every call and handler
/// runs on the connection's strand.
class FlightDriver : private EngineSink {
 public:
  /// `deadline`: the connection's timer, the flight's while one is in flight.
  FlightDriver(HttpFrontDoor::State& server, FlightClient& client,
               boost::asio::any_io_executor executor, const std::string& client_address,
               boost::asio::steady_timer& deadline)
      : server_(server),
        client_(client),
        executor_(std::move(executor)),
        client_address_(client_address),
        deadline_(deadline) {}

  /// Starts a generation request whose body was read whole at `received`.
  void start(Endpoint endpoint,
             boost::beast::http::request<boost::beast::http::string_body> request,
             std::string request_id, std::chrono::steady_clock::time_point received);
  /// A request is in flight.
  bool active() const { return flight_.has_value(); }
  /// Ends the request in flight with `error`: an error answer, or an error event when the
  /// answer's header went out already. Releases its booking with `cause`.
  void fail_flight(const HttpError& error, v1::AbortCause cause);
  /// The client went away: the request is cancelled and the connection closed.
  void client_gone();
  /// The connection closes: the engine connection closes with it.
  void close_engine();

 private:
  using Flight = FrontDoorFlight;

  template <typename Value>
  std::function<void(Value)> on_strand(void (FlightDriver::*handle)(std::uint64_t, Value));
  void route();
  void request_route(const FlightRouteRequest& route);
  void on_decision(std::uint64_t epoch, v1::RouteDecision decision);
  void carry_out(FlightResult result, const HttpError* failure = nullptr,
                 std::string_view why = {});
  void arm_deadline();
  HttpError error_for(const StreamEnd& end, std::optional<FlightTimeout> timed_out,
                      std::string_view timeout) const;
  void report_release(const BookingChange& release, std::string_view why,
                      v1::AbortCause otherwise = v1::ABORT_CAUSE_UNSPECIFIED);
  void end_attempt();

  void generate();
  void on_generate_decision(std::uint64_t epoch, v1::RouteDecision decision);
  void on_generate_chunk(std::uint64_t epoch, v1::GenerateChunk chunk);
  void write_events();

  void forward();
  void engine_header(unsigned status, std::string content_type) override;
  void engine_bytes(std::string_view bytes, bool done) override;
  void engine_failed(std::string why, std::optional<FailureCause> cause) override;
  void read_engine_body();
  void park_engine();
  StreamChunk engine_run(bool last);
  AnswerHeaders kvr_headers() const;
  void record_cache_outcome(const Flight& flight, std::string_view answer);
  void finish_whole_answer();
  template <class Holder>
  void send_chunk(boost::asio::const_buffer bytes, Holder holder, bool last,
                  void (FlightDriver::*then)());
  void finish_stream();
  void end_stream(const HttpError* failure = nullptr);
  void end_flight();
  void report(const std::string& booking_id, v1::LifecycleEvent event,
              v1::AbortCause cause = v1::ABORT_CAUSE_UNSPECIFIED, std::string error = {});

  HttpFrontDoor::State& server_;
  FlightClient& client_;
  const boost::asio::any_io_executor executor_;
  // The client's IP address: its renders wait their turn behind those of other clients.
  const std::string& client_address_;
  boost::asio::steady_timer& deadline_;
  std::string request_id_;
  /// Advanced whenever an attempt or flight ends: a late handler of an older one does nothing.
  std::uint64_t epoch_ = 0;
  std::optional<Flight> flight_;
  /// The engine connection of the attempt under way; none between attempts.
  std::shared_ptr<EngineRelay> relay_;
  // The connection while its route request waits for the decision (see request_route()).
  std::shared_ptr<void> routing_;
};

}  // namespace kvr::front_door
