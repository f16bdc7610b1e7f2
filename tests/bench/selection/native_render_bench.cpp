// kvr's native renders of OpenAI bodies with the Qwen3 tokenizer (segment cache off: every body
// new), by body size: on the caller's thread, and through the render pool with the answer run on
// an io_context, as the front doors get it. Their difference is what the hand-over to a render
// thread costs, which PromptRenderer's inline_below_bytes weighs against holding an I/O thread.
// Then a huge prompt of random words (7 MiB, about 3 M tokens) encoded whole and stopped at the
// route's limit of 2,097,152 tokens, and one long run of letters (one pre-tokenized piece).
#include <fstream>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>

#include <benchmark/benchmark.h>
#include <boost/asio/io_context.hpp>
#include <nlohmann/json.hpp>

#include "messages/metrics/metrics_registry.hpp"
#include "selection/front_door/prompt_renderer.hpp"

namespace kvr::front_door {
namespace {

std::string read_file(const std::string& path) {
  std::ifstream in{path, std::ios::binary};
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::shared_ptr<const NativeTokenizers> qwen3() {
  static const auto tokenizers = [] {
    auto loaded = tokenizer::PromptTokenizer::load(std::string{KVR_TOKENIZERS_DIR} + "/qwen3",
                                                   {.segment_cache_bytes = 0});
    if (!loaded) {
      std::fprintf(stderr, "%s\n", loaded.error().message.c_str());
      std::abort();
    }
    auto map = std::make_shared<NativeTokenizers>();
    map->emplace("qwen3", std::move(*loaded));
    return map;
  }();
  return tokenizers;
}

// A chat of one user message of English prose, its body about `bytes` long.
std::string chat_body(std::size_t bytes) {
  static const std::string prose =
      read_file(std::string{KVR_SOURCE_DIR} + "/tests/data/tokenizers/bench/prose_en.txt");
  std::string content;
  while (content.size() < bytes) content += prose;
  content.resize(bytes > 80 ? bytes - 80 : 1);
  return nlohmann::json{
      {"model", "qwen3"},
      {"messages", nlohmann::json::array({{{"role", "user"}, {"content", content}}})}}
      .dump();
}

std::string random_words(std::size_t bytes) {
  std::mt19937 random{7};
  std::uniform_int_distribution<int> letter{'a', 'z'};
  std::uniform_int_distribution<int> length{2, 9};
  std::string text;
  while (text.size() < bytes) {
    for (int i = length(random); i > 0; --i) text.push_back(static_cast<char>(letter(random)));
    text.push_back(' ');
  }
  return text;
}

void render_bodies(benchmark::State& state, std::size_t inline_below_bytes) {
  const std::string body = chat_body(static_cast<std::size_t>(state.range(0)));
  PromptRenderer renderer{selection::TokenizerModes{},
                          8,
                          std::chrono::seconds{5},
                          std::make_shared<metrics::MetricsRegistry>(),
                          qwen3(),
                          {.pool = {.threads = 1}, .inline_below_bytes = inline_below_bytes}};
  boost::asio::io_context io;
  auto request = parse_generation_request(Endpoint::chat_completions, body);
  std::size_t tokens = 0;
  for (auto _ : state) {
    GenerationRequest copy = *request;
    renderer.render(io.get_executor(), copy, body, {},
                    [&](RenderResult key) { tokens = key ? key->tokens.size() : 0; });
    io.restart();
    io.run();
  }
  if (tokens == 0) state.SkipWithError("no tokens");
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * body.size()));
  state.counters["tokens"] = static_cast<double>(tokens);
}

void BM_RenderOnTheCallersThread(benchmark::State& state) {
  render_bodies(state, std::numeric_limits<std::size_t>::max());
}
void BM_RenderOnThePool(benchmark::State& state) { render_bodies(state, 0); }
BENCHMARK(BM_RenderOnTheCallersThread)
    ->Arg(256)
    ->Arg(1024)
    ->Arg(4096)
    ->Arg(16384)
    ->Arg(65536)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_RenderOnThePool)
    ->Arg(256)
    ->Arg(1024)
    ->Arg(4096)
    ->Arg(16384)
    ->Arg(65536)
    ->Unit(benchmark::kMicrosecond);

// 7 MiB of random words: with no limit (every id), and stopped at the route's limit.
void BM_EncodeHugePrompt(benchmark::State& state) {
  static const std::string text = random_words(std::size_t{7} << 20);
  const std::size_t limit =
      state.range(0) == 0 ? tokenizer::kNoIdLimit : NativeRenderOptions{}.max_prompt_tokens;
  const auto& prompt_tokenizer = *qwen3()->at("qwen3");
  std::size_t ids = 0;
  for (auto _ : state) {
    auto encoded = prompt_tokenizer.encode_prompt(text, limit);
    ids = encoded ? encoded->size() : 0;
    benchmark::DoNotOptimize(encoded);
  }
  state.SetLabel(state.range(0) == 0 ? "no limit" : "stopped at 2097152 tokens");
  state.counters["ids"] = static_cast<double>(ids);
}
BENCHMARK(BM_EncodeHugePrompt)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->Iterations(1);

// One run of letters without a space: a single pre-tokenized piece, encoded whole whatever the
// limit (BPE knows its ids only at the end); by its length in KiB.
void BM_EncodeOneLongWord(benchmark::State& state) {
  std::mt19937 random{11};
  std::uniform_int_distribution<int> letter{'a', 'z'};
  std::string text;
  for (std::int64_t i = 0; i < state.range(0) * 1024; ++i) {
    text.push_back(static_cast<char>(letter(random)));
  }
  const auto& prompt_tokenizer = *qwen3()->at("qwen3");
  std::size_t ids = 0;
  for (auto _ : state) {
    auto encoded = prompt_tokenizer.encode_prompt(text, NativeRenderOptions{}.max_prompt_tokens);
    ids = encoded ? encoded->size() : 0;
    benchmark::DoNotOptimize(encoded);
  }
  state.counters["ids"] = static_cast<double>(ids);
}
BENCHMARK(BM_EncodeOneLongWord)->Arg(64)->Arg(1024)->Arg(7168)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace kvr::front_door

BENCHMARK_MAIN();
