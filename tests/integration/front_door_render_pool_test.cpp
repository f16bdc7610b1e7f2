// The front door keeps answering while kvr's native tokenizer renders huge prompts: the renders
// run on their own threads, not the HTTP threads. Real processes: nats-server, `kvr node
// --http-port --http-threads 1 --tokenizer mock-model=<bundled qwen3>`, and `kvr mocker` workers
// (no HTTP URL: the node tokenizes every prompt itself and serves it through its generate API).
#include <array>
#include <atomic>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <nlohmann/json.hpp>
#include <sys/socket.h>
#include <unistd.h>

#include "tests/testing/kvr_binary.hpp"
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

// POSTs `body` to /v1/completions on 127.0.0.1:`port` from the loopback address `source` (the
// front door tells clients apart by address) and returns the answer's status; 0: no answer.
int post_from(const std::string& source, std::uint16_t port, const std::string& body) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return 0;
  sockaddr_in local{};
  local.sin_family = AF_INET;
  ::inet_pton(AF_INET, source.c_str(), &local.sin_addr);
  sockaddr_in remote{};
  remote.sin_family = AF_INET;
  remote.sin_port = htons(port);
  ::inet_pton(AF_INET, "127.0.0.1", &remote.sin_addr);
  const timeval bound{.tv_sec = 300, .tv_usec = 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &bound, sizeof bound);
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &bound, sizeof bound);
  std::string request =
      "POST /v1/completions HTTP/1.1\r\nHost: kvr\r\nContent-Type: application/json\r\n"
      "Connection: close\r\nContent-Length: " +
      std::to_string(body.size()) + "\r\n\r\n" + body;
  std::string answer;
  if (::bind(fd, reinterpret_cast<const sockaddr*>(&local), sizeof local) == 0 &&
      ::connect(fd, reinterpret_cast<const sockaddr*>(&remote), sizeof remote) == 0) {
    std::size_t sent = 0;
    while (sent < request.size()) {
      const ssize_t wrote = ::send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
      if (wrote <= 0) break;
      sent += static_cast<std::size_t>(wrote);
    }
    char bytes[4096];
    for (ssize_t got; answer.size() < 12 && (got = ::recv(fd, bytes, sizeof bytes, 0)) > 0;) {
      answer.append(bytes, static_cast<std::size_t>(got));
    }
  }
  ::close(fd);
  return answer.starts_with("HTTP/1.1 ") && answer.size() >= 12 ? std::stoi(answer.substr(9, 3))
                                                                : 0;
}

std::string huge_completion(std::size_t bytes, std::uint32_t seed) {
  return Json{{"model", "mock-model"}, {"prompt", random_words(bytes, seed)}, {"max_tokens", 1}}
      .dump();
}

class FrontDoorRenderPoolTest : public testing::KvrClusterTest {
 protected:
  FrontDoorRenderPoolTest() : KvrClusterTest(kvr::testing::kvr_binary(), std::string{kNamespace}) {}

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

TEST_F(FrontDoorRenderPoolTest, AClientPastItsRenderQueueIsRefusedWhileAnotherClientIsServed) {
  const char* tokenizers = testing::bundled_tokenizers_dir();
  if (tokenizers == nullptr) GTEST_SKIP() << "KVR_TOKENIZERS_DIR is not set";
  metrics_port_ = free_port();
  http_port_ = free_port();
  // One render thread, and one render of each client waiting for it.
  node_ = kvr_->start_node({.block_size = kBlockSize,
                            .metrics_port = metrics_port_,
                            .extra = {"--http-port", std::to_string(http_port_), "--render-threads",
                                      "1", "--render-queue-per-client", "1", "--tokenizer",
                                      "mock-model=" + std::string{tokenizers} + "/qwen3"}});
  ASSERT_TRUE(node_);
  ASSERT_TRUE(testing::wait_until_healthy(metrics_port_, 20s)) << node_->log();
  mocker_ = kvr_->start_mocker(
      {.workers = 2, .worker_id_base = kFirstWorker, .block_size = kBlockSize, .time_scale = "20"});
  ASSERT_TRUE(mocker_);
  ASSERT_TRUE(wait_until([&] { return health_status() == 200; }, 20s));

  // Client A (127.0.0.1) sends four huge prompts at once: one renders, one waits its turn, and
  // those past its queue are refused at once.
  constexpr int kFirstClientPrompts = 4;
  std::array<std::atomic<int>, kFirstClientPrompts> statuses{};
  std::vector<std::thread> first_client;
  for (int i = 0; i < kFirstClientPrompts; ++i) {
    first_client.emplace_back([this, i, &statuses] {
      statuses[i] = post_from("127.0.0.1", http_port_,
                              huge_completion(std::size_t{1} << 20, static_cast<std::uint32_t>(i)));
    });
  }
  const auto refused = [&] {
    return node_metric("kvr_native_renders_refused_total{reason=\"client_queue_full\"}");
  };
  ASSERT_TRUE(wait_until([&] { return refused() >= 1; }, 120s))
      << "waiting renders: " << node_metric("kvr_native_render_queue");
  // Client B (127.0.0.2) still gets its turn.
  EXPECT_EQ(post_from("127.0.0.2", http_port_, huge_completion(64 << 10, 8)), 200);
  // Each refusal counted reached its client as a 503.
  const auto answered_503 = [&] {
    int count = 0;
    for (const auto& status : statuses) count += status.load() == 503 ? 1 : 0;
    return count;
  };
  EXPECT_TRUE(wait_until([&] { return answered_503() == refused(); }, 10s))
      << answered_503() << " answered 503, " << refused() << " refused";
  EXPECT_EQ(node_metric("kvr_native_renders_refused_total{reason=\"queue_full\"}"), 0);

  if (HasFailure()) std::cerr << "---- node log\n" << node_->log();
  node_.reset();
  for (std::thread& client : first_client) client.join();
}

}  // namespace
}  // namespace kvr
