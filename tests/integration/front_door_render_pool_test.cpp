// The front door keeps answering while kvr's native tokenizer renders huge prompts: the renders
// run on their own threads, not the HTTP threads. Real processes: nats-server, `kvr node
// --http-port --http-threads 1 --tokenizer mock-model=<bundled qwen3>`, and `kvr mocker` workers
// (no HTTP URL: the node tokenizes every prompt itself and serves it through its generate API).
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include "tests/testing/kvr_cluster_test.hpp"
#include "tests/testing/loopback_http.hpp"
#include "tests/testing/process_run.hpp"
#include "tests/testing/tokenizer_data.hpp"

namespace kvr {
namespace {

using namespace std::chrono_literals;
using Json = nlohmann::json;
using testing::free_port;
using testing::wait_until;

constexpr std::string_view kNamespace = "front-door-render-pool";
constexpr WorkerId kFirstWorker = 900;
constexpr std::uint32_t kBlockSize = 16;

// About `bytes` of lowercase words of 2 to 9 letters, the same every run.
std::string random_words(std::size_t bytes, std::uint32_t seed) {
  std::mt19937 random{seed};
  std::uniform_int_distribution<int> letter{'a', 'z'};
  std::uniform_int_distribution<int> length{2, 9};
  std::string text;
  text.reserve(bytes + 16);
  while (text.size() < bytes) {
    for (int i = length(random); i > 0; --i) text.push_back(static_cast<char>(letter(random)));
    text.push_back(' ');
  }
  return text;
}

class FrontDoorRenderPoolTest : public testing::KvrClusterTest {
 protected:
  FrontDoorRenderPoolTest() : KvrClusterTest(KVR_BINARY, std::string{kNamespace}) {}

  void TearDown() override {
    if (HasFailure()) {
      if (node_) std::cerr << "---- node log\n" << node_->log();
      if (mocker_) std::cerr << "---- mocker log\n" << mocker_->log();
    }
  }

  double node_metric(const std::string& name) const {
    return testing::metric(testing::http_get(metrics_port_, "/metrics"), name);
  }

  int health_status() const {
    httplib::Client http{"127.0.0.1", http_port_};
    http.set_read_timeout(30s);
    const auto result = http.Get("/health");
    return result ? result->status : 0;
  }

  std::optional<testing::ChildProcess> node_;
  std::optional<testing::ChildProcess> mocker_;
  std::uint16_t metrics_port_ = 0;
  std::uint16_t http_port_ = 0;
};

TEST_F(FrontDoorRenderPoolTest, HealthAnswersWhileHugePromptsRender) {
  const char* tokenizers = testing::bundled_tokenizers_dir();
  if (tokenizers == nullptr) GTEST_SKIP() << "KVR_TOKENIZERS_DIR is not set";
  metrics_port_ = free_port();
  http_port_ = free_port();
  // One HTTP thread: a render on it would hold every other request.
  node_ = kvr_->start_node(
      {.block_size = kBlockSize,
       .metrics_port = metrics_port_,
       .extra = {"--http-port", std::to_string(http_port_), "--http-threads", "1", "--tokenizer",
                 "mock-model=" + std::string{tokenizers} + "/qwen3"}});
  ASSERT_TRUE(node_);
  ASSERT_TRUE(testing::wait_until_healthy(metrics_port_, 20s)) << node_->log();
  mocker_ = kvr_->start_mocker(
      {.workers = 2, .worker_id_base = kFirstWorker, .block_size = kBlockSize, .time_scale = "20"});
  ASSERT_TRUE(mocker_);
  ASSERT_TRUE(wait_until([&] { return health_status() == 200; }, 20s));

  // More huge prompts than the render threads (at most 8): some run, the rest wait their turn.
  constexpr int kHugePrompts = 10;
  const double rendered_before = node_metric("kvr_native_render_seconds_count");
  std::vector<std::thread> clients;
  for (int i = 0; i < kHugePrompts; ++i) {
    clients.emplace_back([this, i] {
      httplib::Client http{"127.0.0.1", http_port_};
      http.set_read_timeout(300s);
      http.set_write_timeout(60s);
      const std::string body = Json{
          {"model", "mock-model"},
          {"prompt", random_words(std::size_t{2} << 20, static_cast<std::uint32_t>(i))},
          {"max_tokens", 1}}.dump();
      // The answer does not matter here (the node is stopped under it at the end).
      (void)http.Post("/v1/completions", body, "application/json");
    });
  }
  // Every body has arrived and is being rendered or waits for a render thread.
  ASSERT_TRUE(
      wait_until([&] { return node_metric("kvr_http_requests_in_flight") == kHugePrompts; }, 120s))
      << "in flight: " << node_metric("kvr_http_requests_in_flight");
  ASSERT_GT(node_metric("kvr_native_render_queue"), 0);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(health_status(), 200);
  // Answered while the huge prompts still rendered.
  EXPECT_LT(node_metric("kvr_native_render_seconds_count") - rendered_before, kHugePrompts);
  EXPECT_GT(node_metric("kvr_native_render_queue"), 0);

  node_.reset();  // ends the huge requests' connections
  for (std::thread& client : clients) client.join();
}

}  // namespace
}  // namespace kvr
