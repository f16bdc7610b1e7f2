// The endpoint picker's bounds in one process: a fake router behind the RoutingGateway, a fleet
// directory with one engine, and Envoy's side played over gRPC (and, where a client must break
// HTTP/2's rules, over raw HTTP/2 frames on a socket). Shown: a stream whose request never arrives
// whole is answered 408 after --epp-request-timeout-ms; a routed stream whose answer never ends is
// ended after --epp-response-timeout-ms, its booking released once; streams beyond
// --epp-max-open-streams are answered 503 at once while the others are served; a connection is
// told its stream limit (and closed when it breaks it), and one that never acknowledges the limit
// meets the open-stream limit; a connection gRPC cannot accept for want of descriptors is counted;
// cancelled streams, silent or routed, leave no stream state and no booking. Deadlines are short
// settings and each test awaits the answer they cause; nothing sleeps.
#include "selection/front_door/endpoint_picker.hpp"

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "envoy/ext_proc.grpc.pb.h"
#include "messages/clock.hpp"
#include "tests/testing/child_process.hpp"

namespace kvr::front_door {
namespace {

using namespace std::chrono_literals;
using Json = nlohmann::json;
using kvr::testing::wait_until;
namespace ext = envoy::service::ext_proc::v3;

constexpr WorkerId kWorker = 7;
constexpr std::string_view kModel = "m";
constexpr std::string_view kEngineUrl = "http://127.0.0.1:8000";
const std::string kBody = R"({"model":"m","prompt":[1,2,3,4,5,6,7,8],"max_tokens":1})";

// ---- the router -------------------------------------------------------------------------------

// Books every request on the one engine and records the reports.
class FakeRouter final : public RoutingGateway {
 public:
  void route(v1::RouteRequest request, std::function<void(v1::RouteDecision)> done) override {
    v1::RouteDecision decision;
    decision.set_request_id(request.request_id());
    auto& success = *decision.mutable_success();
    success.set_worker_id(kWorker);
    success.set_worker_http_url(std::string{kEngineUrl});
    {
      std::lock_guard lock{mutex_};
      success.set_booking_id(fmt::format("booking-{}", bookings_++));
    }
    done(std::move(decision));
  }

  void report(v1::LifecycleReport report) override {
    std::lock_guard lock{mutex_};
    reports_.push_back(std::move(report));
  }

  std::shared_ptr<GenerateStream> generate(v1::GenerateRequest, GenerateCallbacks) override {
    ADD_FAILURE() << "the endpoint picker never generates";
    return nullptr;
  }

  std::size_t bookings() const {
    std::lock_guard lock{mutex_};
    return bookings_;
  }

  // The reports that ended each booking (completed or aborted), by booking id.
  std::map<std::string, std::vector<v1::LifecycleEvent>> ends() const {
    std::lock_guard lock{mutex_};
    std::map<std::string, std::vector<v1::LifecycleEvent>> ends;
    for (const auto& report : reports_) {
      if (report.event() != v1::LIFECYCLE_EVENT_FIRST_TOKEN) {
        ends[report.booking_id()].push_back(report.event());
      }
    }
    return ends;
  }

 private:
  mutable std::mutex mutex_;
  std::size_t bookings_ = 0;
  std::vector<v1::LifecycleReport> reports_;
};

// ---- Envoy's messages ---------------------------------------------------------------------------

void add_header(ext::HeaderMap& map, const std::string& key, const std::string& value) {
  auto* header = map.add_headers();
  header->set_key(key);
  header->set_raw_value(value);
}

// A stream's first message: the protocol configuration and a completion request's headers.
ext::ProcessingRequest request_headers(ext::ProcessingMode::BodySendMode mode) {
  ext::ProcessingRequest message;
  message.mutable_protocol_config()->set_request_body_mode(mode);
  message.mutable_protocol_config()->set_response_body_mode(mode);
  auto& map = *message.mutable_request_headers()->mutable_headers();
  add_header(map, ":method", "POST");
  add_header(map, ":path", "/v1/completions");
  add_header(map, ":authority", "gateway.example");
  add_header(map, "content-type", "application/json");
  return message;
}

ext::ProcessingRequest body_chunk(std::string bytes, bool end_of_stream) {
  ext::ProcessingRequest message;
  message.mutable_request_body()->set_body(std::move(bytes));
  message.mutable_request_body()->set_end_of_stream(end_of_stream);
  return message;
}

// One ext_proc stream, Envoy's side: blocking calls, each bounded by the stream's deadline.
class EnvoyStream {
 public:
  explicit EnvoyStream(ext::ExternalProcessor::Stub& stub) {
    context_.set_deadline(std::chrono::system_clock::now() + 20s);
    stream_ = stub.Process(&context_);
  }

  bool send(const ext::ProcessingRequest& message) { return stream_->Write(message); }

  // The next answer; an empty message (and a failure) when the stream ended.
  ext::ProcessingResponse next() {
    ext::ProcessingResponse reply;
    if (!stream_->Read(&reply)) ADD_FAILURE() << "the endpoint picker ended the stream";
    return reply;
  }

  // The rest of a FULL_DUPLEX_STREAMED request body's echo.
  void skip_echoed_body() {
    for (;;) {
      const ext::ProcessingResponse reply = next();
      const auto& streamed = reply.request_body().response().body_mutation().streamed_response();
      if (!reply.has_request_body() || streamed.end_of_stream()) return;
    }
  }

  // The stream's status once the picker ended it; `left` counts answers still unread.
  grpc::Status ended(int* left = nullptr) {
    ext::ProcessingResponse reply;
    while (stream_->Read(&reply)) {
      if (left != nullptr) ++*left;
    }
    return stream_->Finish();
  }

  void cancel() { context_.TryCancel(); }

 private:
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<ext::ProcessingRequest, ext::ProcessingResponse>>
      stream_;
};

// What a local reply says.
struct LocalReply {
  int status = 0;
  Json error;
  std::string retry_after;
};

LocalReply local_reply_of(const ext::ProcessingResponse& reply) {
  EXPECT_TRUE(reply.has_immediate_response()) << reply.DebugString();
  const auto& immediate = reply.immediate_response();
  LocalReply local{.status = static_cast<int>(immediate.status().code())};
  const Json body = Json::parse(immediate.body(), nullptr, false);
  if (body.is_object()) local.error = body.value("error", Json());
  for (const auto& option : immediate.headers().set_headers()) {
    if (option.header().key() == "retry-after") local.retry_after = option.header().raw_value();
  }
  return local;
}

// ---- raw HTTP/2, for a client that ignores what the server tells it
// ------------------------------

struct Frame {
  std::uint8_t type = 0;
  std::uint8_t flags = 0;
  std::uint32_t stream = 0;
  std::string payload;
};

constexpr std::uint8_t kData = 0x0;
constexpr std::uint8_t kHeaders = 0x1;
constexpr std::uint8_t kSettings = 0x4;
constexpr std::uint8_t kEndHeaders = 0x4;
constexpr std::uint8_t kAck = 0x1;
constexpr std::uint16_t kMaxConcurrentStreams = 0x3;

std::uint32_t big_endian(std::string_view bytes) {
  std::uint32_t value = 0;
  for (const char byte : bytes) value = (value << 8) | static_cast<unsigned char>(byte);
  return value;
}

// A client connection speaking HTTP/2 frame by frame (each read bounded by 10 s).
class RawHttp2 {
 public:
  explicit RawHttp2(std::uint16_t port) : socket_(::socket(AF_INET, SOCK_STREAM, 0)) {
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(port);
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    timeval timeout{.tv_sec = 10, .tv_usec = 0};
    ::setsockopt(socket_, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
    connected_ =
        ::connect(socket_, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) == 0;
    write("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n");
    send(kSettings, 0, 0, {});
  }
  ~RawHttp2() { ::close(socket_); }
  RawHttp2(const RawHttp2&) = delete;
  RawHttp2& operator=(const RawHttp2&) = delete;

  bool connected() const { return connected_; }

  void send(std::uint8_t type, std::uint8_t flags, std::uint32_t stream,
            const std::string& payload) {
    std::string frame;
    const auto length = static_cast<std::uint32_t>(payload.size());
    for (const int shift : {16, 8, 0}) frame.push_back(static_cast<char>((length >> shift) & 0xff));
    frame.push_back(static_cast<char>(type));
    frame.push_back(static_cast<char>(flags));
    for (const int shift : {24, 16, 8, 0})
      frame.push_back(static_cast<char>((stream >> shift) & 0xff));
    write(frame + payload);
  }

  // Whether the server closed the connection (not merely sent nothing for 10 s).
  bool closed() const { return closed_; }

  // Reads until the connection closes or nothing comes for 10 s: whether it closed.
  bool read_until_closed() {
    while (read()) {
    }
    return closed_;
  }

  // The next frame; nullopt when the connection closed (or nothing came for 10 s).
  std::optional<Frame> read() {
    std::string header;
    if (!read_exactly(9, header)) return std::nullopt;
    Frame frame{.type = static_cast<std::uint8_t>(header[3]),
                .flags = static_cast<std::uint8_t>(header[4]),
                .stream = big_endian(header.substr(5, 4)) & 0x7fff'ffff};
    if (!read_exactly(big_endian(header.substr(0, 3)), frame.payload)) return std::nullopt;
    return frame;
  }

  // The next frame of `type` (on `stream`, when given), skipping the others.
  std::optional<Frame> read_until(std::uint8_t type, std::optional<std::uint32_t> stream = {}) {
    for (auto frame = read(); frame; frame = read()) {
      if (frame->type == type && (!stream || frame->stream == *stream)) return frame;
    }
    return std::nullopt;
  }

 private:
  void write(const std::string& bytes) {
    ASSERT_EQ(::send(socket_, bytes.data(), bytes.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(bytes.size()));
  }

  bool read_exactly(std::size_t size, std::string& into) {
    into.resize(size);
    std::size_t at = 0;
    while (at < size) {
      const ssize_t got = ::recv(socket_, into.data() + at, size - at, 0);
      if (got == 0 || (got < 0 && errno == ECONNRESET)) closed_ = true;
      if (got <= 0) return false;
      at += static_cast<std::size_t>(got);
    }
    return true;
  }

  int socket_;
  bool connected_ = false;
  bool closed_ = false;
};

// An HPACK literal header field without indexing, its name and value as they are.
std::string hpack_literal(std::string_view name, std::string_view value) {
  std::string field(1, '\0');
  field.push_back(static_cast<char>(name.size()));
  field += name;
  field.push_back(static_cast<char>(value.size()));
  field += value;
  return field;
}

// The head of an ext_proc call, as a gRPC client sends it.
std::string process_call_head() {
  return hpack_literal(":method", "POST") + hpack_literal(":scheme", "http") +
         hpack_literal(":path", "/envoy.service.ext_proc.v3.ExternalProcessor/Process") +
         hpack_literal(":authority", "localhost") +
         hpack_literal("content-type", "application/grpc") + hpack_literal("te", "trailers");
}

// SETTINGS_MAX_CONCURRENT_STREAMS in a SETTINGS frame; nullopt when it is not set.
std::optional<std::uint32_t> max_concurrent_streams(const Frame& settings) {
  std::optional<std::uint32_t> value;
  for (std::size_t at = 0; at + 6 <= settings.payload.size(); at += 6) {
    if (big_endian(settings.payload.substr(at, 2)) == kMaxConcurrentStreams) {
      value = big_endian(settings.payload.substr(at + 2, 4));
    }
  }
  return value;
}

// The ext_proc answer in a DATA frame's payload (one whole gRPC message).
std::optional<ext::ProcessingResponse> processing_response(const std::string& payload) {
  ext::ProcessingResponse reply;
  if (payload.size() < 5 || big_endian(payload.substr(1, 4)) != payload.size() - 5 ||
      !reply.ParseFromString(payload.substr(5))) {
    return std::nullopt;
  }
  return reply;
}

// A gRPC message in a DATA frame's payload: uncompressed, its length, its bytes.
std::string grpc_message(const google::protobuf::Message& message) {
  const std::string bytes = message.SerializeAsString();
  std::string framed(1, '\0');
  const auto length = static_cast<std::uint32_t>(bytes.size());
  for (const int shift : {24, 16, 8, 0})
    framed.push_back(static_cast<char>((length >> shift) & 0xff));
  return framed + bytes;
}

// ---- the fixture --------------------------------------------------------------------------------

discovery::WorkerRegistration engine_registration() {
  discovery::WorkerRegistration worker;
  worker.worker_id = kWorker;
  worker.incarnation = 1;
  worker.model = std::string{kModel};
  worker.block_size = 16;
  worker.total_kv_blocks = 1000;
  worker.liveness_ttl = 1000ms;
  worker.http_url = std::string{kEngineUrl};
  return worker;
}

class EndpointPickerLimitsTest : public ::testing::Test {
 protected:
  // Starts the picker with `options` (its port any free one) and a client channel to it.
  void start(EndpointPickerOptions options) {
    // A manual clock: the engine stays live however long the test runs.
    directory_ = std::make_shared<FleetDirectory>(std::make_shared<ManualClock>());
    directory_->registered(engine_registration());
    options.port = 0;
    auto started = EndpointPicker::start(std::move(options), router_, directory_, metrics_);
    ASSERT_TRUE(started) << started.error();
    picker_ = std::move(*started);
    channel_ = grpc::CreateChannel(fmt::format("127.0.0.1:{}", picker_->port()),
                                   grpc::InsecureChannelCredentials());
    stub_ = ext::ExternalProcessor::NewStub(channel_);
  }

  double metric(std::string_view name, const metrics::Labels& labels = {}) const {
    return metrics_->value(name, labels);
  }

  // Routes a FULL_DUPLEX_STREAMED request on `envoy`: its destination's reply (the echoed body
  // read too).
  void route(EnvoyStream& envoy) {
    ASSERT_TRUE(envoy.send(request_headers(ext::ProcessingMode::FULL_DUPLEX_STREAMED)));
    ASSERT_TRUE(envoy.send(body_chunk(kBody, true)));
    const ext::ProcessingResponse routed = envoy.next();
    ASSERT_TRUE(routed.has_request_headers()) << routed.DebugString();
    envoy.skip_echoed_body();
  }

  std::shared_ptr<FakeRouter> router_ = std::make_shared<FakeRouter>();
  std::shared_ptr<FleetDirectory> directory_;
  std::shared_ptr<metrics::MetricsRegistry> metrics_ = std::make_shared<metrics::MetricsRegistry>();
  std::unique_ptr<EndpointPicker> picker_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<ext::ExternalProcessor::Stub> stub_;
};

TEST_F(EndpointPickerLimitsTest, AStreamWhoseBodyNeverComesIsAnswered408AfterTheRequestTimeout) {
  start({.request_timeout = 200ms});
  EnvoyStream envoy{*stub_};
  ASSERT_TRUE(envoy.send(request_headers(ext::ProcessingMode::FULL_DUPLEX_STREAMED)));
  ASSERT_TRUE(envoy.send(body_chunk(R"({"model":)", false)));

  // Awaited: the deadline's answer is the stream's first.
  const LocalReply reply = local_reply_of(envoy.next());
  EXPECT_EQ(reply.status, 408);
  EXPECT_EQ(reply.error["code"], "request_timeout");
  EXPECT_EQ(reply.error["type"], "invalid_request_error");
  EXPECT_TRUE(envoy.ended().ok());
  EXPECT_TRUE(wait_until([&] { return picker_->open_streams() == 0; }, 5s));
  EXPECT_EQ(metric("kvr_epp_stream_timeouts_total", {{"phase", "request"}}), 1);
  EXPECT_EQ(metric("kvr_epp_requests_total", {{"outcome", "refused"}, {"code", "408"}}), 1);
  EXPECT_EQ(router_->bookings(), 0u);
}

TEST_F(EndpointPickerLimitsTest, AStreamThatSendsNothingIsAnswered408AfterTheRequestTimeout) {
  start({.request_timeout = 200ms});
  EnvoyStream envoy{*stub_};
  EXPECT_EQ(local_reply_of(envoy.next()).status, 408);
  EXPECT_TRUE(envoy.ended().ok());
  EXPECT_TRUE(wait_until([&] { return picker_->open_streams() == 0; }, 5s));
}

TEST_F(EndpointPickerLimitsTest,
       ARoutedStreamWhoseAnswerNeverEndsIsEndedAndItsBookingReleasedOnce) {
  start({.request_timeout = 200ms, .response_timeout = 300ms});
  EnvoyStream envoy{*stub_};
  route(envoy);
  EXPECT_EQ(picker_->in_flight(), 1u);

  // No response phase follows: the response deadline ends the stream.
  const LocalReply reply = local_reply_of(envoy.next());
  EXPECT_EQ(reply.status, 504);
  EXPECT_EQ(reply.error["code"], "timeout");
  EXPECT_TRUE(envoy.ended().ok());
  EXPECT_TRUE(wait_until([&] { return picker_->open_streams() == 0; }, 5s));
  EXPECT_EQ(picker_->in_flight(), 0u);
  const auto ends = router_->ends();
  ASSERT_EQ(ends.size(), 1u);
  EXPECT_EQ(ends.begin()->second, std::vector{v1::LIFECYCLE_EVENT_ABORTED});
  EXPECT_EQ(metric("kvr_epp_stream_timeouts_total", {{"phase", "response"}}), 1);
  EXPECT_EQ(metric("kvr_epp_requests_total", {{"outcome", "routed"}, {"code", "200"}}), 1);
}

TEST_F(EndpointPickerLimitsTest, StreamsBeyondTheOpenStreamLimitAreAnswered503AndTheOthersServed) {
  start({.max_open_streams = 2});
  // BUFFERED: the headers are answered at once, so each answer shows its stream is served.
  EnvoyStream first{*stub_};
  EnvoyStream second{*stub_};
  for (EnvoyStream* envoy : {&first, &second}) {
    ASSERT_TRUE(envoy->send(request_headers(ext::ProcessingMode::BUFFERED)));
    ASSERT_TRUE(envoy->next().has_request_headers());
  }

  EnvoyStream third{*stub_};
  const LocalReply refused = local_reply_of(third.next());
  EXPECT_EQ(refused.status, 503);
  EXPECT_EQ(refused.error["code"], "service_unavailable");
  EXPECT_EQ(refused.retry_after, "1");
  EXPECT_TRUE(third.ended().ok());
  EXPECT_EQ(metric("kvr_epp_streams_refused_total"), 1);

  // The two open streams are served to their end.
  for (EnvoyStream* envoy : {&first, &second}) {
    ASSERT_TRUE(envoy->send(body_chunk(kBody, true)));
    const ext::ProcessingResponse routed = envoy->next();
    EXPECT_TRUE(routed.has_request_body()) << routed.DebugString();
  }
  EXPECT_EQ(router_->bookings(), 2u);
  // Their slots come back: a new stream is served again.
  first.cancel();
  second.cancel();
  ASSERT_TRUE(wait_until([&] { return picker_->open_streams() == 0; }, 5s));
  EnvoyStream later{*stub_};
  ASSERT_TRUE(later.send(request_headers(ext::ProcessingMode::BUFFERED)));
  EXPECT_TRUE(later.next().has_request_headers());
}

TEST_F(EndpointPickerLimitsTest, BodyBytesBeyondTheBufferedBodyLimitAreAnswered503) {
  start({.max_body_bytes = 4096, .max_buffered_body_bytes = 4096});
  EnvoyStream holding{*stub_};
  ASSERT_TRUE(holding.send(request_headers(ext::ProcessingMode::FULL_DUPLEX_STREAMED)));
  // JSON whitespace after the object: a valid body of 3,000 bytes, its end not sent yet.
  ASSERT_TRUE(holding.send(body_chunk(kBody + std::string(3000 - kBody.size(), ' '), false)));
  ASSERT_TRUE(wait_until([&] { return metric("kvr_epp_buffered_body_bytes") == 3000; }, 5s));

  EnvoyStream late{*stub_};
  ASSERT_TRUE(late.send(request_headers(ext::ProcessingMode::FULL_DUPLEX_STREAMED)));
  ASSERT_TRUE(late.send(body_chunk(std::string(2000, ' '), false)));
  const LocalReply refused = local_reply_of(late.next());
  EXPECT_EQ(refused.status, 503);
  EXPECT_EQ(refused.retry_after, "1");
  EXPECT_TRUE(late.ended().ok());

  // The first body is whole and routed; once echoed its bytes are given back.
  ASSERT_TRUE(holding.send(body_chunk({}, true)));
  const ext::ProcessingResponse routed = holding.next();
  EXPECT_TRUE(routed.has_request_headers()) << routed.DebugString();
  holding.skip_echoed_body();
  EXPECT_TRUE(wait_until([&] { return metric("kvr_epp_buffered_body_bytes") == 0; }, 5s));
}

TEST_F(EndpointPickerLimitsTest, AConnectionIsToldItsStreamLimitAndOneThatExceedsItIsClosed) {
  start({.max_streams_per_connection = 2});
  RawHttp2 client{picker_->port()};
  ASSERT_TRUE(client.connected());
  const auto settings = client.read_until(kSettings);
  ASSERT_TRUE(settings);
  EXPECT_EQ(max_concurrent_streams(*settings), 2u);
  client.send(kSettings, kAck, 0, {});
  for (const std::uint32_t stream : {1u, 3u}) {
    client.send(kHeaders, kEndHeaders, stream, process_call_head());
  }
  ASSERT_TRUE(wait_until([&] { return picker_->open_streams() == 2; }, 5s));

  // A third stream breaks the limit the client acknowledged: gRPC (1.51) closes the connection,
  // and its streams end with it.
  client.send(kHeaders, kEndHeaders, 5, process_call_head());
  EXPECT_TRUE(client.read_until_closed());
  EXPECT_TRUE(wait_until([&] { return picker_->open_streams() == 0; }, 5s));
  // Other connections are served.
  EnvoyStream envoy{*stub_};
  ASSERT_TRUE(envoy.send(request_headers(ext::ProcessingMode::BUFFERED)));
  EXPECT_TRUE(envoy.next().has_request_headers());
}

TEST_F(EndpointPickerLimitsTest, AClientThatNeverAcknowledgesTheLimitMeetsTheOpenStreamLimit) {
  start({.max_streams_per_connection = 1, .max_open_streams = 2});
  RawHttp2 client{picker_->port()};
  ASSERT_TRUE(client.connected());
  // The server's SETTINGS are never acknowledged, so gRPC holds this connection to none of them.
  for (const std::uint32_t stream : {1u, 3u, 5u}) {
    client.send(kHeaders, kEndHeaders, stream, process_call_head());
  }
  // One of them (gRPC starts them in no set order) is answered 503 at once, before any message:
  // the first answer on the connection. The other two stay open, and are served.
  const auto refused = client.read_until(kData);
  ASSERT_TRUE(refused);
  const auto refusal = processing_response(refused->payload);
  ASSERT_TRUE(refusal);
  EXPECT_EQ(local_reply_of(*refusal).status, 503);
  EXPECT_EQ(picker_->open_streams(), 2u);
  EXPECT_EQ(metric("kvr_epp_streams_refused_total"), 1);
  const std::uint32_t served_stream = refused->stream == 1 ? 3 : 1;
  client.send(kData, 0, served_stream,
              grpc_message(request_headers(ext::ProcessingMode::BUFFERED)));
  const auto answer = client.read_until(kData, served_stream);
  ASSERT_TRUE(answer);
  const auto served = processing_response(answer->payload);
  ASSERT_TRUE(served);
  EXPECT_TRUE(served->has_request_headers()) << served->DebugString();
}

TEST_F(EndpointPickerLimitsTest, AConnectionGrpcCannotAcceptForWantOfDescriptorsIsCounted) {
  start({});
  // The picker logs the failure while no descriptor is free. UBSan checks the types of a log
  // call's objects the first time it meets them, with a pipe it could not open then: a line
  // logged now has it meet them.
  spdlog::info("endpoint picker test: taking the process's descriptors (port {})", picker_->port());
  // The process's descriptors, all but one, taken: the client's socket takes the last, so the
  // picker's accept4() fails with EMFILE.
  rlimit limit{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &limit), 0);
  const rlimit restore = limit;
  limit.rlim_cur = std::min<rlim_t>(limit.rlim_cur, 4096);
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &limit), 0);
  std::vector<int> taken;
  for (int descriptor = ::open("/dev/null", O_RDONLY); descriptor >= 0;
       descriptor = ::open("/dev/null", O_RDONLY)) {
    taken.push_back(descriptor);
  }
  ASSERT_FALSE(taken.empty());
  ::close(taken.back());
  taken.pop_back();
  {
    RawHttp2 client{picker_->port()};
    EXPECT_TRUE(client.connected());
    EXPECT_TRUE(wait_until([&] { return metric("kvr_epp_accept_failures_total") == 1; }, 5s));
  }
  for (const int descriptor : taken) ::close(descriptor);
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &restore), 0);
}

TEST_F(EndpointPickerLimitsTest, CancelledStreamsLeaveNoStreamStateAndNoBooking) {
  start({});
  constexpr std::size_t kSilent = 100;
  constexpr std::size_t kHeadersOnly = 100;
  constexpr std::size_t kRouted = 3;
  std::vector<std::unique_ptr<EnvoyStream>> streams;
  for (std::size_t i = 0; i < kSilent + kHeadersOnly + kRouted; ++i) {
    streams.push_back(std::make_unique<EnvoyStream>(*stub_));
  }
  for (std::size_t i = kSilent; i < kSilent + kHeadersOnly; ++i) {
    ASSERT_TRUE(streams[i]->send(request_headers(ext::ProcessingMode::FULL_DUPLEX_STREAMED)));
  }
  for (std::size_t i = kSilent + kHeadersOnly; i < streams.size(); ++i) route(*streams[i]);
  ASSERT_TRUE(wait_until([&] { return picker_->open_streams() == streams.size(); }, 10s));
  EXPECT_EQ(picker_->in_flight(), kRouted);

  for (auto& stream : streams) stream->cancel();
  EXPECT_TRUE(wait_until([&] { return picker_->open_streams() == 0; }, 10s));
  EXPECT_EQ(picker_->in_flight(), 0u);
  EXPECT_EQ(metric("kvr_epp_streams_open"), 0);
  EXPECT_EQ(metric("kvr_epp_requests_in_flight"), 0);
  // Each booking ended once, aborted.
  const auto ends = router_->ends();
  EXPECT_EQ(ends.size(), kRouted);
  for (const auto& [booking, events] : ends) {
    EXPECT_EQ(events, std::vector{v1::LIFECYCLE_EVENT_ABORTED}) << booking;
  }
}

TEST(EndpointPickerOptionsTest, RefusesStreamBoundsOutOfRangeNamingTheFlag) {
  const auto error_of = [](EndpointPickerOptions options) {
    const auto valid = options.validate();
    return valid ? std::string{} : valid.error();
  };
  EXPECT_TRUE(error_of({}).empty()) << error_of({});
  EXPECT_NE(error_of({.request_timeout = 0ms}).find("--epp-request-timeout-ms"), std::string::npos);
  EXPECT_NE(
      error_of({.request_timeout = 2s, .response_timeout = 1s}).find("--epp-response-timeout-ms"),
      std::string::npos);
  EXPECT_NE(error_of({.max_streams_per_connection = 0}).find("--epp-max-streams-per-connection"),
            std::string::npos);
  EXPECT_NE(error_of({.max_open_streams = 0}).find("--epp-max-open-streams"), std::string::npos);
  EXPECT_NE(error_of({.max_buffered_body_bytes = 4096}).find("--epp-max-buffered-body-bytes"),
            std::string::npos);
  EXPECT_NE(error_of({.grpc_memory_bytes = std::size_t{1} << 20}).find("--epp-grpc-memory-bytes"),
            std::string::npos);
}

}  // namespace
}  // namespace kvr::front_door
