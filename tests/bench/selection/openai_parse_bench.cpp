// What reading an OpenAI request costs the front door before it can route (docs/performance.md,
// "The front door"): a completion whose prompt is a typical request of the bundled trace as token
// ids (the first as long as the trace's mean, about 12,000 ids, an 80 KB body), written as
// `kvr replay-live` and the OpenAI SDKs write it. "plain" is that body (its ids read eight digits
// at a time); "nested" is the same ids as a list of lists, which the front door reads element by
// element through simdjson: the way every prompt was read before.
#include <cstdint>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>
#include <nlohmann/json.hpp>

#include "deploy/simulation/mooncake_trace.hpp"
#include "selection/front_door/openai_api.hpp"

namespace kvr::front_door {
namespace {

// The ids of the first trace request whose prompt is at least the trace's mean length.
std::vector<std::uint32_t> typical_prompt() {
  auto trace = simulation::load_mooncake_trace(KVR_MOONCAKE_TRACE_PATH);
  if (!trace || trace->empty()) return {};
  std::uint64_t total = 0;
  for (const auto& request : *trace) total += request.input_length;
  const std::uint64_t mean = total / trace->size();
  for (const auto& request : *trace) {
    if (request.input_length >= mean) return simulation::synthesize_prompt_tokens(request);
  }
  return {};
}

void BM_ParseTokenIdPrompt(benchmark::State& state) {
  const bool nested = state.range(0) != 0;
  const std::vector<std::uint32_t> ids = typical_prompt();
  if (ids.empty()) {
    state.SkipWithError("the bundled trace did not load");
    return;
  }
  nlohmann::json body{{"model", "mock-model"}, {"max_tokens", 352}, {"stream", true}};
  body["prompt"] = nested ? nlohmann::json::array({ids}) : nlohmann::json(ids);
  const std::string text = body.dump();
  for (auto _ : state) {
    auto request = parse_generation_request(Endpoint::completions, text);
    if (!request || request->prompt_token_ids.size() != ids.size()) {
      state.SkipWithError("the body was not read");
      return;
    }
    benchmark::DoNotOptimize(request->prompt_token_ids.data());
  }
  state.counters["ids"] = static_cast<double>(ids.size());
  state.counters["body_bytes"] = static_cast<double>(text.size());
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * text.size()));
}

BENCHMARK(BM_ParseTokenIdPrompt)->ArgName("nested")->Arg(0)->Arg(1)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace kvr::front_door

BENCHMARK_MAIN();
