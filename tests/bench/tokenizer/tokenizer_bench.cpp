// The native tokenizer's speed with the Qwen3 tokenizer: MB/s and tokens/s of one thread on
// English prose, source code and CJK text (tests/data/tokenizers/bench), with the segment cache
// off (every byte encoded), and a long conversation's next turn with the cache on and off.
#include <fstream>
#include <sstream>
#include <string>

#include <benchmark/benchmark.h>

#include "selection/tokenizer/prompt_tokenizer.hpp"
#include "selection/tokenizer/tokenizer.hpp"

namespace kvr::tokenizer {
namespace {

std::string read_file(const std::string& path) {
  std::ifstream in{path, std::ios::binary};
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

const Tokenizer& qwen3(bool cache) {
  const auto load = [](bool with_cache) {
    TokenizerOptions options;
    if (!with_cache) options.segment_cache_bytes = 0;
    auto loaded = Tokenizer::load(std::string{KVR_TOKENIZERS_DIR} + "/qwen3", options);
    if (!loaded) {
      std::fprintf(stderr, "%s\n", loaded.error().message.c_str());
      std::abort();
    }
    return std::move(*loaded);
  };
  static const Tokenizer cached = load(true);
  static const Tokenizer uncached = load(false);
  return cache ? cached : uncached;
}

void encode_text(benchmark::State& state, const char* file) {
  const std::string text =
      read_file(std::string{KVR_SOURCE_DIR} + "/tests/data/tokenizers/bench/" + file);
  const Tokenizer& tokenizer = qwen3(false);
  std::size_t tokens = 0;
  for (auto _ : state) {
    auto ids = tokenizer.encode(text, false);
    tokens += ids->size();
    benchmark::DoNotOptimize(ids);
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * text.size()));
  state.counters["tokens_per_second"] =
      benchmark::Counter(static_cast<double>(tokens), benchmark::Counter::kIsRate);
}

void BM_EncodeProse(benchmark::State& state) { encode_text(state, "prose_en.txt"); }
void BM_EncodeCode(benchmark::State& state) { encode_text(state, "code.txt"); }
void BM_EncodeCjk(benchmark::State& state) { encode_text(state, "cjk.txt"); }
BENCHMARK(BM_EncodeProse)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_EncodeCode)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_EncodeCjk)->Unit(benchmark::kMillisecond);

// A conversation rendered in Qwen3's chat format: `turns` user/assistant messages of prose.
std::string conversation(int turns) {
  const std::string prose =
      read_file(std::string{KVR_SOURCE_DIR} + "/tests/data/tokenizers/bench/prose_en.txt");
  std::string text = "<|im_start|>system\nYou are a careful assistant.<|im_end|>\n";
  for (int turn = 0; turn < turns; ++turn) {
    text += turn % 2 == 0 ? "<|im_start|>user\n" : "<|im_start|>assistant\n";
    text += prose.substr(static_cast<std::size_t>(turn) * 700, 700);
    text += "<|im_end|>\n";
  }
  return text;
}

// The 21st turn of a conversation whose first 20 turns were encoded before (cache on), against
// the same 21 turns encoded cold (cache off).
void BM_EncodeTwentyFirstTurn(benchmark::State& state) {
  const bool cache = state.range(0) == 1;
  const Tokenizer& tokenizer = qwen3(cache);
  const std::string earlier = conversation(20);
  const std::string next = conversation(21);
  (void)tokenizer.encode(earlier, false);
  for (auto _ : state) benchmark::DoNotOptimize(tokenizer.encode(next, false));
  state.SetLabel(cache ? "segment cache on" : "cold");
}
BENCHMARK(BM_EncodeTwentyFirstTurn)->Arg(0)->Arg(1)->Unit(benchmark::kMicrosecond);

// Qwen3's chat template rendering a 20-turn conversation (a system prompt, then user and
// assistant turns of about 700 bytes of prose each), parsed once.
void BM_RenderChatTwentyTurns(benchmark::State& state) {
  auto loaded = PromptTokenizer::load(std::string{KVR_TOKENIZERS_DIR} + "/qwen3");
  if (!loaded) {
    state.SkipWithError(loaded.error().message.c_str());
    return;
  }
  const std::string prose =
      read_file(std::string{KVR_SOURCE_DIR} + "/tests/data/tokenizers/bench/prose_en.txt");
  nlohmann::ordered_json body{{"messages", nlohmann::ordered_json::array()}};
  body["messages"].push_back({{"role", "system"}, {"content", "You are a careful assistant."}});
  for (int turn = 0; turn < 20; ++turn) {
    body["messages"].push_back(
        {{"role", turn % 2 == 0 ? "user" : "assistant"},
         {"content", prose.substr(static_cast<std::size_t>(turn) * 700, 700)}});
  }
  const auto chat = PromptTokenizer::chat_from_openai(body);
  std::size_t bytes = 0;
  for (auto _ : state) {
    auto rendered = (*loaded)->encode_chat(*chat);
    bytes = rendered->text.size();
    benchmark::DoNotOptimize(rendered);
  }
  state.SetLabel("render + encode");
  state.counters["rendered_bytes"] = static_cast<double>(bytes);
}
BENCHMARK(BM_RenderChatTwentyTurns)->Unit(benchmark::kMicrosecond);

// The template alone, without encoding the text it renders.
void BM_RenderChatTemplateOnly(benchmark::State& state) {
  const std::string dir = std::string{KVR_TOKENIZERS_DIR} + "/qwen3/tokenizer_config.json";
  std::ifstream in{dir};
  const auto config = nlohmann::ordered_json::parse(in);
  const auto templates = chat_template::ChatTemplateConfig::from_tokenizer_config(config);
  const std::string prose =
      read_file(std::string{KVR_SOURCE_DIR} + "/tests/data/tokenizers/bench/prose_en.txt");
  chat_template::ChatRequest chat;
  chat.messages.push_back({{"role", "system"}, {"content", "You are a careful assistant."}});
  for (int turn = 0; turn < 20; ++turn) {
    chat.messages.push_back({{"role", turn % 2 == 0 ? "user" : "assistant"},
                             {"content", prose.substr(static_cast<std::size_t>(turn) * 700, 700)}});
  }
  chat.add_generation_prompt = true;
  for (auto _ : state) benchmark::DoNotOptimize(templates->render_chat(chat));
}
BENCHMARK(BM_RenderChatTemplateOnly)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace kvr::tokenizer

BENCHMARK_MAIN();
