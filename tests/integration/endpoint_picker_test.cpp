// The endpoint picker for Envoy (`kvr node --epp-port`) end to end, all real processes:
// nats-server, `kvr node`, and `kvr bridge`s in front of `kvr mocker --speak vllm` engines. The
// test plays Envoy's part of ext_proc message by message, as Envoy's filter sends them (header
// values in raw_value, the protocol configuration in the first message). Shown: in
// FULL_DUPLEX_STREAMED the headers' answer names an engine (header and envoy.lb metadata) and the
// body comes back whole; in BUFFERED the headers go on at once and the body's answer names the
// engine; the response phase ends the booking; the subset hint restricts the choice; refusals are
// local replies with OpenAI error objects; a cancelled stream releases its booking; a stream
// whose body never comes is answered 408 after --epp-request-timeout-ms; the gRPC health service
// follows the workers.
#include <csignal>
#include <fstream>
#include <optional>

#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include "envoy/ext_proc.grpc.pb.h"
#include "health/grpc_health.grpc.pb.h"
#include "tests/testing/kvr_binary.hpp"
#include "tests/testing/kvr_cluster_test.hpp"
#include "tests/testing/loopback_http.hpp"
#include "tests/testing/vllm_engines.hpp"

namespace kvr {
namespace {

using namespace std::chrono_literals;
using Json = nlohmann::json;
using testing::EnginePair;
using testing::free_port;
using testing::wait_until;
namespace ext = envoy::service::ext_proc::v3;
using BodyMode = ext::ProcessingMode::BodySendMode;
using Health = grpc::health::v1::HealthCheckResponse;

constexpr std::string_view kNamespace = "endpoint-picker";
constexpr WorkerId kFirstWorker = 800;
constexpr std::uint32_t kBlockSize = 16;
constexpr std::string_view kDestination = "x-gateway-destination-endpoint";

// ---- Envoy's messages ---------------------------------------------------------------------------

void add_header(ext::HeaderMap& map, const std::string& key, const std::string& value) {
  auto* header = map.add_headers();
  header->set_key(key);
  header->set_raw_value(value);
}

// The first message of a stream: the protocol configuration and the request's headers.
ext::ProcessingRequest request_headers(
    BodyMode mode, const std::string& path = "/v1/completions",
    const std::vector<std::pair<std::string, std::string>>& extra = {},
    bool end_of_stream = false) {
  ext::ProcessingRequest message;
  message.mutable_protocol_config()->set_request_body_mode(mode);
  message.mutable_protocol_config()->set_response_body_mode(mode);
  auto& headers = *message.mutable_request_headers();
  auto& map = *headers.mutable_headers();
  add_header(map, ":method", "POST");
  add_header(map, ":path", path);
  add_header(map, ":authority", "gateway.example");
  add_header(map, ":scheme", "http");
  add_header(map, "content-type", "application/json");
  for (const auto& [key, value] : extra) add_header(map, key, value);
  headers.set_end_of_stream(end_of_stream);
  return message;
}

// The subset hint as Envoy forwards it: filter metadata envoy.lb.subset_hint.
void hint_subset(ext::ProcessingRequest& message, const google::protobuf::Value& subset) {
  auto& space =
      (*message.mutable_metadata_context()->mutable_filter_metadata())["envoy.lb.subset_hint"];
  (*space.mutable_fields())["x-gateway-destination-endpoint-subset"] = subset;
}

google::protobuf::Value list_of(const std::vector<std::string>& endpoints) {
  google::protobuf::Value value;
  for (const auto& endpoint : endpoints) {
    value.mutable_list_value()->add_values()->set_string_value(endpoint);
  }
  return value;
}

ext::ProcessingRequest body_chunk(std::string bytes, bool end_of_stream, bool response = false) {
  ext::ProcessingRequest message;
  auto* body = response ? message.mutable_response_body() : message.mutable_request_body();
  body->set_body(std::move(bytes));
  body->set_end_of_stream(end_of_stream);
  return message;
}

ext::ProcessingRequest response_headers(int status, const std::string& content_type) {
  ext::ProcessingRequest message;
  auto& map = *message.mutable_response_headers()->mutable_headers();
  add_header(map, ":status", std::to_string(status));
  add_header(map, "content-type", content_type);
  return message;
}

// ---- reading the picker's answers ---------------------------------------------------------------

// The value a mutation sets for `key` (raw_value, as Envoy reads it); empty when unset. Fails the
// test when the key is set twice or set to append.
std::string set_value(const ext::HeaderMutation& mutation, std::string_view key) {
  std::string found;
  int times = 0;
  for (const auto& option : mutation.set_headers()) {
    if (option.header().key() != key) continue;
    ++times;
    found = option.header().raw_value();
    EXPECT_TRUE(option.header().value().empty()) << key;
    EXPECT_FALSE(option.has_append() && option.append().value()) << key;
  }
  EXPECT_LE(times, 1) << key;
  return found;
}

// envoy.lb's x-gateway-destination-endpoint in the dynamic metadata; empty when absent.
std::string lb_destination(const ext::ProcessingResponse& reply) {
  const auto& fields = reply.dynamic_metadata().fields();
  const auto lb = fields.find("envoy.lb");
  if (lb == fields.end()) return {};
  const auto& inner = lb->second.struct_value().fields();
  const auto destination = inner.find(std::string{kDestination});
  return destination == inner.end() ? std::string{} : destination->second.string_value();
}

// One ext_proc stream, Envoy's side (blocking calls, each bounded by the stream's deadline).
class EnvoyStream {
 public:
  explicit EnvoyStream(ext::ExternalProcessor::Stub& stub) {
    context_.set_deadline(std::chrono::system_clock::now() + 30s);
    stream_ = stub.Process(&context_);
  }

  bool send(const ext::ProcessingRequest& message) { return stream_->Write(message); }

  // The next answer; an empty message (and a failure) when the stream ended.
  ext::ProcessingResponse next() {
    ext::ProcessingResponse reply;
    if (!stream_->Read(&reply)) {
      ADD_FAILURE() << "the endpoint picker ended the stream";
      return {};
    }
    return reply;
  }

  // The rest of a FULL_DUPLEX_STREAMED body's echo, up to its end_of_stream.
  std::string echoed_body(bool request, std::size_t* chunks = nullptr) {
    std::string echoed;
    for (;;) {
      const ext::ProcessingResponse reply = next();
      EXPECT_TRUE(request ? reply.has_request_body() : reply.has_response_body())
          << reply.DebugString();
      const auto& streamed =
          (request ? reply.request_body() : reply.response_body()).response().body_mutation();
      if (!streamed.has_streamed_response()) return echoed;
      EXPECT_LE(streamed.streamed_response().body().size(), 62'000u);
      echoed += streamed.streamed_response().body();
      if (chunks != nullptr) ++*chunks;
      if (streamed.streamed_response().end_of_stream()) return echoed;
    }
  }

  // Ends Envoy's side; the answers still coming are counted into `left`.
  grpc::Status close(int* left = nullptr) {
    stream_->WritesDone();
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
struct Refusal {
  int status = 0;
  Json error;
  std::string content_type;
  std::string retry_after;
};

Refusal refusal_of(const ext::ProcessingResponse& reply) {
  EXPECT_TRUE(reply.has_immediate_response()) << reply.DebugString();
  const auto& immediate = reply.immediate_response();
  const Json body = Json::parse(immediate.body(), nullptr, false);
  return Refusal{static_cast<int>(immediate.status().code()),
                 body.is_object() ? body.value("error", Json()) : Json(),
                 set_value(immediate.headers(), "content-type"),
                 set_value(immediate.headers(), "retry-after")};
}

// A completions request with a prompt of token ids (nothing to render).
std::string completion(std::uint32_t first_token) {
  return Json{
      {"model", "mock-model"}, {"prompt", testing::prompt(48, first_token)}, {"max_tokens", 2}}
      .dump();
}

class EndpointPickerTest : public testing::KvrClusterTest {
 protected:
  EndpointPickerTest() : KvrClusterTest(kvr::testing::kvr_binary(), std::string{kNamespace}) {}

  void TearDown() override {
    if (HasFailure()) {
      if (node_) std::cerr << "---- node log\n" << node_->log();
      std::cerr << testing::engine_pair_logs(pairs_);
    }
  }

  EnginePair& start_pair(WorkerId worker) {
    auto pair = testing::start_engine_pair(*kvr_, {.worker = worker, .block_size = kBlockSize});
    EXPECT_TRUE(pair) << pair.error();
    if (!pair) pair = std::make_unique<EnginePair>();
    pairs_.push_back(std::move(*pair));
    return *pairs_.back();
  }

  void start_node(std::vector<std::string> extra = {}) {
    metrics_port_ = free_port();
    epp_port_ = free_port();
    extra.insert(extra.end(), {"--epp-port", std::to_string(epp_port_), "--http-port",
                               std::to_string(free_port())});
    node_ = kvr_->start_node(
        {.block_size = kBlockSize, .metrics_port = metrics_port_, .extra = std::move(extra)});
    ASSERT_TRUE(node_);
    ASSERT_TRUE(testing::wait_until_healthy(metrics_port_, 20s)) << node_->log();
    channel_ = grpc::CreateChannel("127.0.0.1:" + std::to_string(epp_port_),
                                   grpc::InsecureChannelCredentials());
    stub_ = ext::ExternalProcessor::NewStub(channel_);
    health_ = grpc::health::v1::Health::NewStub(channel_);
  }

  // The serving status of `service`; -1 when the check failed.
  int health(const std::string& service) const {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + 2s);
    grpc::health::v1::HealthCheckRequest request;
    request.set_service(service);
    grpc::health::v1::HealthCheckResponse response;
    if (!health_->Check(&context, request, &response).ok()) return -1;
    return response.status();
  }

  // Readiness: the picker sees `workers` live workers and the node knows them.
  void wait_until_ready(int workers = 1) {
    ASSERT_TRUE(wait_until([&] { return health("readiness") == Health::SERVING; }, 20s));
    ASSERT_TRUE(wait_until([&] { return node_metric("kvr_workers") == workers; }, 10s));
  }

  double node_metric(const std::string& name) const {
    return testing::metric(testing::http_get(metrics_port_, "/metrics"), name);
  }

  std::string endpoint_of(const EnginePair& pair) const {
    return "127.0.0.1:" + std::to_string(pair.http_port);
  }

  // Routes `body` in FULL_DUPLEX_STREAMED (with `subset` as the hint when given) and closes the
  // stream once the body is back: the destination, or the refusal's reply.
  ext::ProcessingResponse route_once(
      const std::string& body, const std::optional<google::protobuf::Value>& subset = {},
      const std::vector<std::pair<std::string, std::string>>& headers = {}) {
    EnvoyStream envoy{*stub_};
    auto first =
        request_headers(ext::ProcessingMode::FULL_DUPLEX_STREAMED, "/v1/completions", headers);
    if (subset) hint_subset(first, *subset);
    EXPECT_TRUE(envoy.send(first));
    EXPECT_TRUE(envoy.send(body_chunk(body, true)));
    ext::ProcessingResponse reply = envoy.next();
    if (reply.has_request_headers()) {
      EXPECT_EQ(envoy.echoed_body(true), body);
    }
    EXPECT_TRUE(envoy.close().ok());
    return reply;
  }

  std::string destination_of(const ext::ProcessingResponse& reply) {
    EXPECT_TRUE(reply.has_request_headers()) << reply.DebugString();
    return set_value(reply.request_headers().response().header_mutation(), kDestination);
  }

  std::vector<std::unique_ptr<EnginePair>> pairs_;
  std::optional<testing::ChildProcess> node_;
  std::uint16_t metrics_port_ = 0;
  std::uint16_t epp_port_ = 0;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<ext::ExternalProcessor::Stub> stub_;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_;
};

TEST_F(EndpointPickerTest, FullDuplexNamesAnEngineEchoesTheBodyAndEndsTheBookingWithTheAnswer) {
  start_node();
  const EnginePair& first = start_pair(kFirstWorker);
  const EnginePair& second = start_pair(kFirstWorker + 1);
  wait_until_ready(2);
  // Larger than one echoed chunk: JSON whitespace after the object.
  const std::string body = completion(1) + std::string(100'000, ' ');
  EnvoyStream envoy{*stub_};
  ASSERT_TRUE(envoy.send(request_headers(ext::ProcessingMode::FULL_DUPLEX_STREAMED)));
  ASSERT_TRUE(envoy.send(body_chunk(body.substr(0, 70'000), false)));
  ASSERT_TRUE(envoy.send(body_chunk(body.substr(70'000), true)));

  // The headers' answer waited for the body: it names the engine, twice alike.
  const ext::ProcessingResponse routed = envoy.next();
  ASSERT_TRUE(routed.has_request_headers()) << routed.DebugString();
  const auto& common = routed.request_headers().response();
  EXPECT_TRUE(common.clear_route_cache());
  const std::string destination = set_value(common.header_mutation(), kDestination);
  const EnginePair& chosen = destination == endpoint_of(first) ? first : second;
  EXPECT_EQ(destination, endpoint_of(chosen));
  EXPECT_EQ(lb_destination(routed), destination);
  EXPECT_EQ(set_value(common.header_mutation(), "x-kvr-worker-id"), std::to_string(chosen.worker));
  EXPECT_FALSE(set_value(common.header_mutation(), "x-kvr-request-id").empty());
  EXPECT_EQ(set_value(common.header_mutation(), "content-length"), std::to_string(body.size()));
  // Then the body, whole, in chunks below Envoy's 64 KiB message limit.
  std::size_t chunks = 0;
  EXPECT_EQ(envoy.echoed_body(true, &chunks), body);
  EXPECT_GE(chunks, 2u);
  EXPECT_TRUE(wait_until([&] { return node_metric("kvr_route_bookings_open") == 1; }, 5s));

  // Envoy sends the request to the engine (the test does, the engine is real) and streams the
  // engine's answer through the picker, which echoes it.
  httplib::Client engine{"127.0.0.1", chosen.http_port};
  const auto answer = engine.Post("/v1/completions", body, "application/json");
  ASSERT_TRUE(answer);
  ASSERT_EQ(answer->status, 200) << answer->body;
  ASSERT_TRUE(envoy.send(response_headers(200, "application/json")));
  const ext::ProcessingResponse headers_answer = envoy.next();
  ASSERT_TRUE(headers_answer.has_response_headers()) << headers_answer.DebugString();
  EXPECT_EQ(headers_answer.response_headers().response().status(), ext::CommonResponse::CONTINUE);
  const std::size_t half = answer->body.size() / 2;
  ASSERT_TRUE(envoy.send(body_chunk(answer->body.substr(0, half), false, true)));
  const ext::ProcessingResponse first_half = envoy.next();
  ASSERT_TRUE(first_half.has_response_body()) << first_half.DebugString();
  const auto& echoed = first_half.response_body().response().body_mutation().streamed_response();
  EXPECT_EQ(echoed.body(), answer->body.substr(0, half));
  EXPECT_FALSE(echoed.end_of_stream());
  EXPECT_TRUE(wait_until(
      [&] {
        return node_metric("kvr_lifecycle_reports_total{event=\"first_token\",accepted=\"true\"") ==
               1;
      },
      5s));
  ASSERT_TRUE(envoy.send(body_chunk(answer->body.substr(half), true, true)));
  EXPECT_EQ(envoy.echoed_body(false), answer->body.substr(half));
  EXPECT_TRUE(envoy.close().ok());

  EXPECT_TRUE(wait_until([&] { return node_metric("kvr_route_bookings_open") == 0; }, 5s));
  EXPECT_EQ(node_metric("kvr_lifecycle_reports_total{event=\"completed\",accepted=\"true\""), 1);
  EXPECT_EQ(node_metric("kvr_epp_requests_total{outcome=\"routed\""), 1);
  EXPECT_TRUE(wait_until([&] { return node_metric("kvr_epp_streams_open") == 0; }, 5s));
}

TEST_F(EndpointPickerTest, BufferedModeContinuesTheHeadersAndNamesTheEngineWithTheBody) {
  start_node();
  const EnginePair& pair = start_pair(kFirstWorker);
  wait_until_ready();
  const std::string body =
      Json{{"model", "mock-model"},
           {"max_tokens", 2},
           {"messages", {{{"role", "user"}, {"content", "Route me through Envoy, please."}}}}}
          .dump();
  EnvoyStream envoy{*stub_};
  ASSERT_TRUE(envoy.send(request_headers(ext::ProcessingMode::BUFFERED, "/v1/chat/completions")));
  // At once, before any body: Envoy sends the buffered body only after this answer.
  const ext::ProcessingResponse go_on = envoy.next();
  ASSERT_TRUE(go_on.has_request_headers()) << go_on.DebugString();
  EXPECT_EQ(go_on.request_headers().response().header_mutation().set_headers_size(), 0);

  ASSERT_TRUE(envoy.send(body_chunk(body, true)));
  const ext::ProcessingResponse routed = envoy.next();
  ASSERT_TRUE(routed.has_request_body()) << routed.DebugString();
  const auto& common = routed.request_body().response();
  EXPECT_EQ(set_value(common.header_mutation(), kDestination), endpoint_of(pair));
  EXPECT_EQ(lb_destination(routed), endpoint_of(pair));
  // Envoy forwards its own buffered body.
  EXPECT_FALSE(common.has_body_mutation());
  // Rendered by the engine (a chat's token ids are the engine's own).
  EXPECT_GE(node_metric("kvr_http_render_calls_total{endpoint=\"/v1/chat/completions/render\","
                        "outcome=\"ok\""),
            1);

  ASSERT_TRUE(envoy.send(response_headers(200, "application/json")));
  EXPECT_TRUE(envoy.next().has_response_headers());
  ASSERT_TRUE(envoy.send(body_chunk(R"({"object":"chat.completion"})", true, true)));
  const ext::ProcessingResponse passed = envoy.next();
  ASSERT_TRUE(passed.has_response_body()) << passed.DebugString();
  EXPECT_FALSE(passed.response_body().response().has_body_mutation());
  EXPECT_TRUE(envoy.close().ok());
  EXPECT_TRUE(wait_until([&] { return node_metric("kvr_route_bookings_open") == 0; }, 5s));
  EXPECT_EQ(node_metric("kvr_lifecycle_reports_total{event=\"completed\",accepted=\"true\""), 1);
}

TEST_F(EndpointPickerTest, TheSubsetHintRestrictsTheChoice) {
  start_node();
  const EnginePair& first = start_pair(kFirstWorker);
  const EnginePair& second = start_pair(kFirstWorker + 1);
  wait_until_ready(2);
  // The same prompt each time: unhinted, its cached blocks would keep it on one engine.
  const std::string body = completion(5000);
  for (int i = 0; i < 3; ++i) {
    for (const EnginePair* pair : {&first, &second}) {
      EXPECT_EQ(destination_of(route_once(body, list_of({endpoint_of(*pair)}))),
                endpoint_of(*pair));
    }
  }
  // One comma-joined string; an unknown endpoint among the listed ones is skipped.
  google::protobuf::Value joined;
  joined.set_string_value("10.1.2.3:8000, " + endpoint_of(second));
  EXPECT_EQ(destination_of(route_once(body, joined)), endpoint_of(second));
  // An address without a port: any engine on it.
  const std::string any_port = destination_of(route_once(body, list_of({"127.0.0.1"})));
  EXPECT_TRUE(any_port == endpoint_of(first) || any_port == endpoint_of(second)) << any_port;
  // A hint naming no live engine (or nothing): 503.
  for (const auto& hint : {list_of({"127.0.0.1:1"}), list_of({})}) {
    const Refusal refused = refusal_of(route_once(body, hint));
    EXPECT_EQ(refused.status, 503);
    EXPECT_EQ(refused.error["code"], "service_unavailable");
  }
  EXPECT_TRUE(wait_until([&] { return node_metric("kvr_route_bookings_open") == 0; }, 5s));
}

TEST_F(EndpointPickerTest, RefusalsAreLocalRepliesWithOpenAiErrorObjects) {
  start_node({"--http-max-body-bytes", "4096"});
  start_pair(kFirstWorker);
  wait_until_ready();
  const auto expect = [](const Refusal& refused, int status, const std::string& code,
                         const std::string& param = {}) {
    EXPECT_EQ(refused.status, status);
    EXPECT_EQ(refused.content_type, "application/json");
    ASSERT_TRUE(refused.error.is_object());
    EXPECT_TRUE(refused.error["message"].is_string());
    if (code.empty()) {
      EXPECT_TRUE(refused.error["code"].is_null()) << refused.error;
    } else {
      EXPECT_EQ(refused.error["code"], code) << refused.error;
    }
    if (!param.empty()) {
      EXPECT_EQ(refused.error["param"], param) << refused.error;
    }
  };
  expect(refusal_of(route_once(R"({"model":"no-such-model","prompt":"x"})")), 404,
         "model_not_found", "model");
  expect(refusal_of(route_once("{not json")), 400, "");
  expect(refusal_of(route_once(completion(1), {}, {{"x-kvr-priority", "high"}})), 400, "",
         "x-kvr-priority");
  {
    // Another path: refused from its headers, nothing else read.
    EnvoyStream envoy{*stub_};
    ASSERT_TRUE(
        envoy.send(request_headers(ext::ProcessingMode::FULL_DUPLEX_STREAMED, "/v1/embeddings")));
    expect(refusal_of(envoy.next()), 404, "unknown_url");
    EXPECT_TRUE(envoy.close().ok());
  }
  {
    // No body at all.
    EnvoyStream envoy{*stub_};
    ASSERT_TRUE(envoy.send(
        request_headers(ext::ProcessingMode::FULL_DUPLEX_STREAMED, "/v1/completions", {}, true)));
    const Refusal refused = refusal_of(envoy.next());
    expect(refused, 400, "");
    EXPECT_NE(refused.error["message"].get<std::string>().find("JSON body"), std::string::npos);
    EXPECT_TRUE(envoy.close().ok());
  }
  {
    // Over the body limit, across chunks.
    EnvoyStream envoy{*stub_};
    ASSERT_TRUE(envoy.send(request_headers(ext::ProcessingMode::FULL_DUPLEX_STREAMED)));
    ASSERT_TRUE(envoy.send(body_chunk(std::string(3000, ' '), false)));
    ASSERT_TRUE(envoy.send(body_chunk(std::string(3000, ' '), false)));
    expect(refusal_of(envoy.next()), 413, "request_too_large");
    EXPECT_TRUE(envoy.close().ok());
  }
  {
    // Observability mode: the picker never answers.
    EnvoyStream envoy{*stub_};
    auto first = request_headers(ext::ProcessingMode::FULL_DUPLEX_STREAMED);
    first.set_observability_mode(true);
    ASSERT_TRUE(envoy.send(first));
    auto body = body_chunk(completion(1), true);
    body.set_observability_mode(true);
    ASSERT_TRUE(envoy.send(body));
    int answers = 0;
    EXPECT_TRUE(envoy.close(&answers).ok());
    EXPECT_EQ(answers, 0);
  }
  EXPECT_EQ(node_metric("kvr_epp_requests_total{outcome=\"refused\",code=\"404\""), 2);
  EXPECT_EQ(node_metric("kvr_epp_requests_total{outcome=\"routed\""), 0);
  EXPECT_EQ(node_metric("kvr_route_bookings_open"), 0);
}

TEST_F(EndpointPickerTest, ARateLimitedTenantIs429) {
  const auto config = directory_.path() / "policy.yaml";
  {
    std::ofstream yaml{config};
    yaml << "request_classifier:\n  type: token-bucket\n  parameters:\n"
            "    rate_tokens_per_s: 1\n    burst_tokens: 10\n    mode: reject\n";
  }
  start_node({"--router-policy-config", config.string()});
  start_pair(kFirstWorker);
  wait_until_ready();
  const std::string body = R"({"model":"mock-model","prompt":[1,2,3,4,5,6,7,8],"max_tokens":1})";
  EXPECT_TRUE(route_once(body, {}, {{"x-kvr-tenant", "a"}}).has_request_headers());
  const Refusal limited = refusal_of(route_once(body, {}, {{"x-kvr-tenant", "a"}}));
  EXPECT_EQ(limited.status, 429);
  EXPECT_EQ(limited.error["code"], "rate_limit_exceeded");
  // 8 of the 10 tokens were taken; the 6 missing for another 8 refill in 6 s.
  EXPECT_EQ(limited.retry_after, "6");
  // OpenAI's `user` names another tenant, with a bucket of its own.
  EXPECT_TRUE(
      route_once(R"({"model":"mock-model","prompt":[1,2,3,4,5,6,7,8],"max_tokens":1,"user":"b"})")
          .has_request_headers());
}

TEST_F(EndpointPickerTest, AStreamEnvoyCancelsReleasesItsBooking) {
  start_node();
  start_pair(kFirstWorker);
  wait_until_ready();
  {
    EnvoyStream envoy{*stub_};
    ASSERT_TRUE(envoy.send(request_headers(ext::ProcessingMode::FULL_DUPLEX_STREAMED)));
    ASSERT_TRUE(envoy.send(body_chunk(completion(1), true)));
    ASSERT_TRUE(envoy.next().has_request_headers());
    ASSERT_TRUE(wait_until([&] { return node_metric("kvr_route_bookings_open") == 1; }, 5s));
    ASSERT_TRUE(wait_until([&] { return node_metric("kvr_epp_requests_in_flight") == 1; }, 5s));
    envoy.cancel();
  }
  EXPECT_TRUE(wait_until([&] { return node_metric("kvr_route_bookings_open") == 0; }, 5s));
  EXPECT_EQ(node_metric("kvr_lifecycle_reports_total{event=\"aborted\",accepted=\"true\""), 1);
  EXPECT_EQ(node_metric("kvr_lifecycle_reports_total{event=\"completed\""), 0);
  EXPECT_TRUE(wait_until([&] { return node_metric("kvr_epp_streams_open") == 0; }, 5s));
  EXPECT_EQ(node_metric("kvr_epp_requests_in_flight"), 0);
}

TEST_F(EndpointPickerTest, AStreamWhoseBodyNeverComesIsAnswered408AfterTheRequestTimeoutFlag) {
  start_node({"--epp-request-timeout-ms", "300"});
  start_pair(kFirstWorker);
  wait_until_ready();
  EnvoyStream envoy{*stub_};
  ASSERT_TRUE(envoy.send(request_headers(ext::ProcessingMode::FULL_DUPLEX_STREAMED)));
  // Awaited: the node's deadline answers it.
  const Refusal refused = refusal_of(envoy.next());
  EXPECT_EQ(refused.status, 408);
  EXPECT_EQ(refused.error["code"], "request_timeout");
  EXPECT_EQ(refused.content_type, "application/json");
  EXPECT_TRUE(envoy.close().ok());
  EXPECT_TRUE(wait_until([&] { return node_metric("kvr_epp_streams_open") == 0; }, 5s));
  EXPECT_EQ(node_metric("kvr_epp_stream_timeouts_total{phase=\"request\""), 1);
  EXPECT_EQ(node_metric("kvr_route_bookings_open"), 0);
}

TEST_F(EndpointPickerTest, ADrainRefusesNewRequestsWhileRoutedAnswersEnd) {
  start_node();
  start_pair(kFirstWorker);
  wait_until_ready();
  // Routed before the drain: its answer is still to come.
  EnvoyStream routed{*stub_};
  ASSERT_TRUE(routed.send(request_headers(ext::ProcessingMode::FULL_DUPLEX_STREAMED)));
  ASSERT_TRUE(routed.send(body_chunk(completion(1), true)));
  ASSERT_TRUE(routed.next().has_request_headers());
  EXPECT_EQ(routed.echoed_body(true), completion(1));
  // Open, its body never sent: the node's stop ends it. Buffered, so that the node's answer to
  // its headers shows they came before the drain (after it, they would be refused).
  EnvoyStream waiting{*stub_};
  ASSERT_TRUE(waiting.send(request_headers(ext::ProcessingMode::BUFFERED)));
  ASSERT_TRUE(waiting.next().has_request_headers());

  node_->signal(SIGTERM);
  ASSERT_TRUE(wait_until([&] { return health("readiness") == Health::NOT_SERVING; }, 10s));
  EXPECT_EQ(health("liveness"), Health::SERVING);
  {
    EnvoyStream late{*stub_};
    ASSERT_TRUE(late.send(request_headers(ext::ProcessingMode::FULL_DUPLEX_STREAMED)));
    const Refusal refused = refusal_of(late.next());
    EXPECT_EQ(refused.status, 503);
    EXPECT_EQ(refused.error["code"], "service_unavailable");
    EXPECT_TRUE(late.close().ok());
  }
  // The routed request's answer ends its booking, and with it the drain: the node exits at once.
  ASSERT_TRUE(routed.send(response_headers(200, "application/json")));
  EXPECT_TRUE(routed.next().has_response_headers());
  ASSERT_TRUE(routed.send(body_chunk(R"({"object":"text_completion"})", true, true)));
  EXPECT_EQ(routed.echoed_body(false), R"({"object":"text_completion"})");
  EXPECT_TRUE(routed.close().ok());
  EXPECT_EQ(node_->wait(10s), 0) << node_->log();
  EXPECT_EQ(node_->log().find("still in flight"), std::string::npos) << node_->log();
  int answers = 0;
  EXPECT_FALSE(waiting.close(&answers).ok());
  EXPECT_EQ(answers, 0);
}

TEST_F(EndpointPickerTest, APortInUseStopsASecondNodeNamingIt) {
  start_node();
  ASSERT_TRUE(wait_until([&] { return health("liveness") == Health::SERVING; }, 10s));
  auto second = kvr_->start_node(
      {.block_size = kBlockSize, .extra = {"--epp-port", std::to_string(epp_port_)}},
      "second-node.log");
  ASSERT_TRUE(second);
  const auto status = second->wait(30s);
  ASSERT_TRUE(status.has_value()) << "the second node kept running:\n" << second->log();
  EXPECT_EQ(*status, 2) << second->log();
  EXPECT_NE(second->log().find("--epp-port " + std::to_string(epp_port_)), std::string::npos)
      << second->log();
  // The first node still serves it.
  EXPECT_EQ(health("liveness"), Health::SERVING);
}

TEST_F(EndpointPickerTest, HealthFollowsTheWorkers) {
  start_node();
  ASSERT_TRUE(wait_until([&] { return health("liveness") == Health::SERVING; }, 10s));
  const std::vector<std::string> ready_services = {
      "readiness", "envoy.service.ext_proc.v3.ExternalProcessor", ""};
  for (const auto& service : ready_services) {
    EXPECT_EQ(health(service), Health::NOT_SERVING) << service;
  }
  EnginePair& pair = start_pair(kFirstWorker);
  for (const auto& service : ready_services) {
    EXPECT_TRUE(wait_until([&] { return health(service) == Health::SERVING; }, 20s)) << service;
  }
  // A deregistered worker leaves: its bridge stops cleanly.
  pair.bridge->stop();
  EXPECT_TRUE(wait_until([&] { return health("readiness") == Health::NOT_SERVING; }, 10s));
  EXPECT_EQ(health("liveness"), Health::SERVING);
}

}  // namespace
}  // namespace kvr
