// A client's request rendered by kvr's own tokenizer, as the front doors' `native` tokenizer mode
// renders it (PromptRenderer, for a model without engines to ask): the body parsed by
// parse_generation_request, then its messages, tools and chat_template_kwargs handed to the
// model's chat template (PromptTokenizer::chat_from_openai, encode_chat) and the text encoded; a
// completions prompt encoded as it is. The tokenizers are the bundled ones (KVR_TOKENIZERS_DIR)
// whose configs carry chat templates; the body's `model` picks one ("qwen3", "mistral-nemo",
// "deepseek-v3"; any other model is served by qwen3's). A first line "%nest ..." nests part of the
// body deeply (nesting.hpp). Properties: the renderer answers every request, with token ids of
// the model's vocabulary or a 400 naming the reason.
#include <array>
#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>

#include "messages/metrics/metrics_registry.hpp"
#include "selection/front_door/prompt_renderer.hpp"
#include "tests/fuzz/harness.hpp"
#include "tests/fuzz/nesting.hpp"

namespace kvr::fuzz {
namespace {

using front_door::Endpoint;

constexpr std::array<std::string_view, 3> kFamilies = {"qwen3", "mistral-nemo", "deepseek-v3"};

struct NativeRenderer {
  NativeRenderer() {
    auto tokenizers = std::make_shared<front_door::NativeTokenizers>();
    // A small segment cache: it is exercised, and the process stays small.
    const tokenizer::TokenizerOptions options{.segment_cache_bytes = std::size_t{1} << 20};
    for (const std::string_view family : kFamilies) {
      auto loaded = tokenizer::PromptTokenizer::load(
          std::string{KVR_FUZZ_TOKENIZERS_DIR} + "/" + std::string{family}, options);
      KVR_FUZZ_CHECK(loaded.has_value());
      KVR_FUZZ_CHECK((*loaded)->has_chat_template());
      tokenizers->emplace(std::string{family}, std::move(*loaded));
    }
    native = tokenizers;
    renderer.emplace(selection::TokenizerModes{}, 1, std::chrono::seconds{10},
                     std::make_shared<metrics::MetricsRegistry>(), tokenizers);
  }
  std::shared_ptr<const front_door::NativeTokenizers> native;
  std::optional<front_door::PromptRenderer> renderer;
  boost::asio::io_context io;
};

NativeRenderer& native_renderer() {
  // Never destroyed: the tokenizers are large, and exit need not free them.
  static NativeRenderer* const renderer = new NativeRenderer;
  return *renderer;
}

void render(Endpoint endpoint, const std::string& body) {
  auto request =
      front_door::parse_generation_request(endpoint, body, front_door::PromptTextUse::skip);
  if (!request) return;
  NativeRenderer& native = native_renderer();
  const auto found = native.native->find(request->model);
  if (found == native.native->end()) request->model = kFamilies[0];
  const tokenizer::Tokenizer& tokenizer = native.native->at(request->model)->tokenizer();
  const bool ids_given = !request->prompt_token_ids.empty();
  std::optional<front_door::RenderResult> result;
  {
    // No engine to ask: the model's native tokenizer renders, before render returns or on a
    // render thread that posts the answer to the executor.
    const auto work = boost::asio::make_work_guard(native.io);
    native.io.restart();
    native.renderer->render(native.io.get_executor(), *request, body, {},
                            [&](front_door::RenderResult key) { result = std::move(key); });
    while (!result && native.io.run_one() > 0) {
    }
  }
  KVR_FUZZ_CHECK(result.has_value());
  if (!*result) {
    KVR_FUZZ_CHECK(!ids_given);
    KVR_FUZZ_CHECK(result->error().status == 400);
    KVR_FUZZ_CHECK(!result->error().message.empty());
    return;
  }
  const front_door::RoutingKey& key = **result;
  KVR_FUZZ_CHECK(!key.tokens.empty());
  if (ids_given) return;  // the client's ids, routed as they came
  for (const tokenizer::TokenId id : key.tokens) KVR_FUZZ_CHECK(id < tokenizer.vocab_size());
}

}  // namespace

void chat_request(Input input) {
  const std::string body = expand_nesting(as_text(input));
  render(Endpoint::chat_completions, body);
  render(Endpoint::completions, body);
}

}  // namespace kvr::fuzz
