// Deeply nested request bodies against real processes (nats-server, `kvr node`, `kvr bridge`s in
// front of `kvr mocker --speak vllm` engines, `kvr mocker` workers, `kvr tokenize`): a chat whose
// tool parameters, tool-call arguments (an object or a JSON string) or content nest 40,000 levels
// (1.5 MB, well under the body cap) once ran a thread's stack out in the chat-template renderer.
// Shown: the HTTP front door and the endpoint picker in the `native` tokenizer mode, the generate
// path (workers without an HTTP URL, tokenized natively), the engine's render and tokenize
// endpoints and `kvr tokenize` each refuse them with a 400 naming the field, and go on serving.
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include "envoy/ext_proc.grpc.pb.h"
#include "tests/testing/kvr_binary.hpp"
#include "tests/testing/kvr_cluster_test.hpp"
#include "tests/testing/loopback_http.hpp"
#include "tests/testing/process_run.hpp"
#include "tests/testing/tokenizer_data.hpp"
#include "tests/testing/vllm_engines.hpp"

namespace kvr {
namespace {

using namespace std::chrono_literals;
using Json = nlohmann::json;
using testing::EnginePair;
using testing::free_port;
using testing::wait_until;
namespace ext = envoy::service::ext_proc::v3;

constexpr std::string_view kNamespace = "front-door-hostile";
constexpr WorkerId kFirstWorker = 900;
constexpr std::uint32_t kBlockSize = 16;
constexpr int kHostileDepth = 40'000;
// The message of a refused body names its field and the default limit.
constexpr std::string_view kTooDeep = ": nested deeper than 128 levels";

std::string repeated(std::string_view text, int times) {
  std::string out;
  out.reserve(text.size() * static_cast<std::size_t>(times));
  for (int i = 0; i < times; ++i) out += text;
  return out;
}

// {"a": {"a": ... {}}}, `levels` objects deep.
std::string nested_object(int levels) {
  return repeated(R"({"a":)", levels - 1) + "{}" + repeated("}", levels - 1);
}

std::string chat_start() {
  return R"({"model":"mock-model","max_tokens":2,"messages":[{"role":"user","content":"Weather?"})";
}

// One hostile chat: its body, and the field its refusal names.
struct HostileChat {
  std::string field;
  std::string body;
};

std::vector<HostileChat> hostile_chats() {
  const std::string deep = nested_object(kHostileDepth);
  const std::string call_start =
      R"(,{"role":"assistant","content":"","tool_calls":[{"id":"call1","type":"function",)"
      R"("function":{"name":"get_weather","arguments":)";
  const std::string arguments_field = "messages[1].tool_calls[0].function.arguments";
  return {
      {"tools[0].function.parameters",
       chat_start() +
           R"(],"tools":[{"type":"function","function":{"name":"get_weather",)"
           R"("parameters":)" +
           deep + "}}]}"},
      {arguments_field, chat_start() + call_start + deep + "}}]}]}"},
      {arguments_field, chat_start() + call_start + Json(deep).dump() + "}}]}]}"},
      // A member after the deep one: nlohmann's ordered objects copy the deep one as they grow.
      {"tools[0].function.parameters",
       chat_start() +
           R"(],"tools":[{"type":"function","function":{"name":"get_weather",)"
           R"("parameters":)" +
           deep + R"(,"strict":true}}],"temperature":0})"},
      {"messages[0].content", R"({"model":"mock-model","messages":[{"role":"user","content":)" +
                                  repeated("[", kHostileDepth) + repeated("]", kHostileDepth) +
                                  "}]}"},
  };
}

// A chat the same processes serve.
std::string normal_chat() {
  return chat_start() +
         R"(],"tools":[{"type":"function","function":{"name":"get_weather","parameters":)"
         R"({"type":"object","properties":{"city":{"type":"string"}}}}}]})";
}

// Expects an OpenAI error object of status 400 that names `field` as its param.
void expect_refused(int status, const std::string& body, const std::string& field) {
  EXPECT_EQ(status, 400) << field << ": " << body.substr(0, 500);
  const Json error = Json::parse(body, nullptr, false).value("error", Json());
  EXPECT_EQ(error.value("param", Json()), field) << body.substr(0, 500);
  EXPECT_NE(error.value("message", std::string{}).find(field + std::string{kTooDeep}),
            std::string::npos)
      << body.substr(0, 500);
}

// The bundled Qwen3 tokenizer: the node's and the engines' in these tests.
std::string qwen3_tokenizer() { return std::string{testing::bundled_tokenizers_dir()} + "/qwen3"; }

// ---- Envoy's side of ext_proc
// ----------------------------------------------------------------------

void add_header(ext::HeaderMap& map, const std::string& key, const std::string& value) {
  auto* header = map.add_headers();
  header->set_key(key);
  header->set_raw_value(value);
}

ext::ProcessingRequest chat_headers() {
  ext::ProcessingRequest message;
  message.mutable_protocol_config()->set_request_body_mode(
      ext::ProcessingMode::FULL_DUPLEX_STREAMED);
  message.mutable_protocol_config()->set_response_body_mode(
      ext::ProcessingMode::FULL_DUPLEX_STREAMED);
  auto& map = *message.mutable_request_headers()->mutable_headers();
  add_header(map, ":method", "POST");
  add_header(map, ":path", "/v1/chat/completions");
  add_header(map, ":authority", "gateway.example");
  add_header(map, ":scheme", "http");
  add_header(map, "content-type", "application/json");
  return message;
}

// Sends `body` on a new stream as Envoy streams it (chunks below 64 KiB) and closes the stream
// once the picker answered: its first answer.
ext::ProcessingResponse send_to_picker(ext::ExternalProcessor::Stub& stub,
                                       const std::string& body) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + 60s);
  auto stream = stub.Process(&context);
  EXPECT_TRUE(stream->Write(chat_headers()));
  constexpr std::size_t kChunk = 60'000;
  for (std::size_t at = 0; at < body.size(); at += kChunk) {
    ext::ProcessingRequest chunk;
    chunk.mutable_request_body()->set_body(body.substr(at, kChunk));
    chunk.mutable_request_body()->set_end_of_stream(at + kChunk >= body.size());
    if (!stream->Write(chunk)) break;  // the picker answered early
  }
  ext::ProcessingResponse reply;
  EXPECT_TRUE(stream->Read(&reply)) << "the endpoint picker ended the stream";
  stream->WritesDone();
  ext::ProcessingResponse rest;
  while (stream->Read(&rest)) {
  }
  (void)stream->Finish();
  return reply;
}

class FrontDoorHostileTest : public testing::KvrClusterTest {
 protected:
  FrontDoorHostileTest() : KvrClusterTest(kvr::testing::kvr_binary(), std::string{kNamespace}) {}

  void TearDown() override {
    if (HasFailure()) {
      if (node_) std::cerr << "---- node log\n" << node_->log();
      if (mocker_) std::cerr << "---- mocker log\n" << mocker_->log();
      std::cerr << testing::engine_pair_logs(pairs_);
    }
  }

  void start_node(std::vector<std::string> extra) {
    metrics_port_ = free_port();
    http_port_ = free_port();
    extra.insert(extra.end(), {"--http-port", std::to_string(http_port_)});
    node_ = kvr_->start_node(
        {.block_size = kBlockSize, .metrics_port = metrics_port_, .extra = std::move(extra)});
    ASSERT_TRUE(node_);
    ASSERT_TRUE(testing::wait_until_healthy(metrics_port_, 20s)) << node_->log();
  }

  // An engine speaking vLLM's API with the Qwen3 tokenizer, and its bridge.
  void start_native_engine(WorkerId worker) {
    auto pair =
        testing::start_engine_pair(*kvr_, {.worker = worker,
                                           .block_size = kBlockSize,
                                           .engine_args = {"--tokenizer", qwen3_tokenizer()}});
    ASSERT_TRUE(pair) << pair.error();
    pairs_.push_back(std::move(*pair));
  }

  // The front door serves the model and kvr's tokenizer agrees with its engine (native mode).
  void wait_until_native() {
    ASSERT_TRUE(wait_until([&] { return post_status("/health") == 200; }, 20s));
    ASSERT_TRUE(wait_until(
        [&] { return node_metric("kvr_tokenizer_parity{model=\"mock-model\"}") == 1; }, 20s))
        << node_->log();
  }

  int post_status(const std::string& path) const {
    httplib::Client http{"127.0.0.1", http_port_};
    const auto result = http.Get(path);
    return result ? result->status : 0;
  }

  std::pair<int, std::string> post(std::uint16_t port, const std::string& path,
                                   const std::string& body) const {
    httplib::Client http{"127.0.0.1", port};
    http.set_read_timeout(60s);
    http.set_write_timeout(60s);
    const auto result = http.Post(path, body, "application/json");
    if (!result) return {0, {}};
    return {result->status, result->body};
  }

  double node_metric(const std::string& name) const {
    return testing::metric(testing::http_get(metrics_port_, "/metrics"), name);
  }

  std::vector<std::unique_ptr<EnginePair>> pairs_;
  std::optional<testing::ChildProcess> node_;
  std::optional<testing::ChildProcess> mocker_;
  std::uint16_t metrics_port_ = 0;
  std::uint16_t http_port_ = 0;
};

TEST_F(FrontDoorHostileTest, TheHttpFrontDoorInNativeModeRefusesDeepBodiesAndServesOn) {
  start_node({"--tokenizer-mode", "native", "--tokenizer", "mock-model=" + qwen3_tokenizer()});
  start_native_engine(kFirstWorker);
  wait_until_native();
  if (HasFatalFailure()) return;
  for (const HostileChat& chat : hostile_chats()) {
    const auto [status, body] = post(http_port_, "/v1/chat/completions", chat.body);
    expect_refused(status, body, chat.field);
  }
  ASSERT_TRUE(node_->running());
  const auto [status, body] = post(http_port_, "/v1/chat/completions", normal_chat());
  EXPECT_EQ(status, 200) << body;
  EXPECT_GE(node_metric("kvr_native_renders_total{model=\"mock-model\",outcome=\"ok\"}"), 1);
}

TEST_F(FrontDoorHostileTest, TheEndpointPickerInNativeModeRefusesDeepBodiesAndRoutesOn) {
  const std::uint16_t epp_port = free_port();
  start_node({"--tokenizer-mode", "native", "--tokenizer", "mock-model=" + qwen3_tokenizer(),
              "--epp-port", std::to_string(epp_port)});
  start_native_engine(kFirstWorker);
  wait_until_native();
  if (HasFatalFailure()) return;
  const auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(epp_port),
                                           grpc::InsecureChannelCredentials());
  const auto stub = ext::ExternalProcessor::NewStub(channel);
  for (const HostileChat& chat : hostile_chats()) {
    const ext::ProcessingResponse reply = send_to_picker(*stub, chat.body);
    ASSERT_TRUE(reply.has_immediate_response()) << chat.field << ": " << reply.DebugString();
    expect_refused(static_cast<int>(reply.immediate_response().status().code()),
                   reply.immediate_response().body(), chat.field);
  }
  ASSERT_TRUE(node_->running());
  const ext::ProcessingResponse routed = send_to_picker(*stub, normal_chat());
  ASSERT_TRUE(routed.has_request_headers()) << routed.DebugString();
  bool named = false;
  for (const auto& option : routed.request_headers().response().header_mutation().set_headers()) {
    named = named || (option.header().key() == "x-gateway-destination-endpoint" &&
                      option.header().raw_value() ==
                          "127.0.0.1:" + std::to_string(pairs_.front()->http_port));
  }
  EXPECT_TRUE(named) << routed.DebugString();
}

TEST_F(FrontDoorHostileTest, TheGeneratePathRefusesDeepBodiesAndServesOn) {
  // `kvr mocker` workers register no HTTP URL: the node tokenizes natively in any mode.
  start_node({"--tokenizer", "mock-model=" + qwen3_tokenizer()});
  mocker_ = kvr_->start_mocker(
      {.workers = 1, .worker_id_base = kFirstWorker, .block_size = kBlockSize, .time_scale = "20"});
  ASSERT_TRUE(mocker_);
  ASSERT_TRUE(wait_until([&] { return post_status("/health") == 200; }, 20s));
  for (const HostileChat& chat : hostile_chats()) {
    const auto [status, body] = post(http_port_, "/v1/chat/completions", chat.body);
    expect_refused(status, body, chat.field);
  }
  ASSERT_TRUE(node_->running());
  const auto [status, body] = post(http_port_, "/v1/chat/completions", normal_chat());
  EXPECT_EQ(status, 200) << body;
  EXPECT_EQ(Json::parse(body, nullptr, false)["usage"]["completion_tokens"], 2) << body;
}

TEST_F(FrontDoorHostileTest, TheEnginesRenderAndTokenizeEndpointsRefuseDeepBodiesAndRenderOn) {
  start_native_engine(kFirstWorker);
  if (HasFatalFailure()) return;
  EnginePair& engine = *pairs_.front();
  for (const std::string path : {"/v1/chat/completions/render", "/tokenize"}) {
    for (const HostileChat& chat : hostile_chats()) {
      const auto [status, body] = post(engine.http_port, path, chat.body);
      EXPECT_EQ(status, 400) << path << " " << chat.field << ": " << body.substr(0, 500);
      EXPECT_NE(body.find(chat.field + std::string{kTooDeep}), std::string::npos)
          << path << ": " << body.substr(0, 500);
    }
  }
  ASSERT_TRUE(engine.engine->running());
  const auto [status, body] = post(engine.http_port, "/v1/chat/completions/render", normal_chat());
  ASSERT_EQ(status, 200) << body;
  EXPECT_FALSE(Json::parse(body, nullptr, false).value("token_ids", Json::array()).empty()) << body;
}

TEST_F(FrontDoorHostileTest, KvrTokenizeRefusesADeepLineAndEncodesTheNext) {
  const auto input = directory_.path() / "chats.jsonl";
  {
    std::ofstream lines{input};
    for (const HostileChat& chat : hostile_chats()) lines << chat.body << "\n";
    lines << normal_chat() << "\n";
  }
  const testing::ProcessRun run =
      testing::run_process({kvr::testing::kvr_binary(), "tokenize", "--tokenizer",
                            qwen3_tokenizer(), "--input", input.string()},
                           directory_.path() / "tokenize.log", 60s);
  // 1: an input failed (a crash would be a negated signal).
  ASSERT_EQ(run.exit_code, std::optional<int>{1}) << run.output.substr(0, 2000);
  const std::vector<HostileChat> chats = hostile_chats();
  for (std::size_t line = 0; line < chats.size(); ++line) {
    EXPECT_NE(run.output.find(
                  fmt::format(R"("error":"line {}: {}{})", line + 1, chats[line].field, kTooDeep)),
              std::string::npos)
        << line + 1 << ": " << run.output.substr(0, 2000);
  }
  EXPECT_NE(run.output.find(R"({"ids":[)"), std::string::npos) << run.output.substr(0, 2000);
}

}  // namespace
}  // namespace kvr
