#include "deploy/mocker/vllm_info_routes.hpp"

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include <fmt/format.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include "deploy/mocker/vllm_engine_server.hpp"

namespace kvr::mocker {
namespace {

// The engine's load and counters, and the render calls, in Prometheus text with vLLM's names.
std::string metrics_text(VllmRouteContext& context) {
  const VllmEngineOptions& options = context.options();
  const EngineLoadSnapshot snapshot = context.engine().load();
  const std::string labels = fmt::format(R"(engine="0",model_name="{}")", options.model);
  std::string out;
  auto gauge = [&](std::string_view name, std::string_view help, double value) {
    out += fmt::format("# HELP {0} {1}\n# TYPE {0} gauge\n{0}{{{2}}} {3}\n", name, help, labels,
                       value);
  };
  auto counter = [&](std::string_view name, std::string_view help, std::uint64_t value) {
    out += fmt::format("# HELP {0} {1}\n# TYPE {0} counter\n{0}_total{{{2}}} {3}.0\n", name, help,
                       labels, value);
  };
  gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
        static_cast<double>(snapshot.running));
  gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
        static_cast<double>(snapshot.waiting));
  gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
        snapshot.kv_usage);
  counter("vllm:prefix_cache_queries",
          "Prefix cache queries, in terms of number of queried tokens.", snapshot.prefix_queries);
  counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
          snapshot.prefix_hits);
  counter("vllm:prompt_tokens", "Number of prefill tokens processed.", snapshot.prompt_tokens);
  counter("vllm:generation_tokens", "Number of generation tokens processed.",
          snapshot.generation_tokens);
  out += fmt::format(
      "# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.\n"
      "# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds {:.3f}\n",
      context.start_unix_seconds());
  out += "# HELP kvr_mock_render_requests Calls of the endpoints that give a prompt's token ids.\n";
  out += "# TYPE kvr_mock_render_requests counter\n";
  for (const auto& [endpoint, calls] :
       {std::pair{"/v1/chat/completions/render", &context.render_calls().chat_render},
        std::pair{"/v1/completions/render", &context.render_calls().completions_render},
        std::pair{"/tokenize", &context.render_calls().tokenize}}) {
    out += fmt::format("kvr_mock_render_requests_total{{endpoint=\"{}\",model_name=\"{}\"}} {}.0\n",
                       endpoint, options.model, calls->load());
  }
  out += "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n";
  out += "# TYPE vllm:cache_config_info gauge\n";
  out += fmt::format(
      "vllm:cache_config_info{{block_size=\"{}\",cache_dtype=\"auto\",enable_prefix_caching=\"{}"
      "\","
      "engine=\"0\",gpu_memory_utilization=\"0.9\",num_cpu_blocks=\"None\",num_gpu_blocks=\"{}\","
      "prefix_caching_hash_algo=\"builtin\"}} 1.0\n",
      options.engine.block_size, options.engine.enable_prefix_caching ? "True" : "False",
      options.engine.num_gpu_blocks);
  return out;
}

// vLLM lists the base model, then each adapter with the base as its parent and the adapter's
// path as its root.
std::string model_list(const VllmRouteContext& context) {
  const VllmEngineOptions& options = context.options();
  const auto created = static_cast<std::int64_t>(unix_seconds());
  auto card = [&](const std::string& id, std::string root, nlohmann::json parent) {
    return nlohmann::json{{"id", id},
                          {"object", "model"},
                          {"created", created},
                          {"owned_by", "vllm"},
                          {"root", std::move(root)},
                          {"parent", std::move(parent)},
                          {"max_model_len", context.max_model_len()}};
  };
  nlohmann::json data = nlohmann::json::array({card(options.model, options.model, nullptr)});
  for (const std::string& adapter : options.lora_adapters) {
    data.push_back(card(adapter, "/adapters/" + adapter, options.model));
  }
  return nlohmann::json{{"object", "list"}, {"data", std::move(data)}}.dump();
}

}  // namespace

void add_vllm_info_routes(httplib::Server& http, VllmRouteContext& context) {
  http.Get("/health",
           [](const httplib::Request&, httplib::Response& response) { response.status = 200; });
  http.Get("/v1/models", [&context](const httplib::Request&, httplib::Response& response) {
    response.set_content(model_list(context), "application/json");
  });
  http.Get("/metrics", [&context](const httplib::Request&, httplib::Response& response) {
    response.set_content(metrics_text(context), "text/plain; version=0.0.4; charset=utf-8");
  });
}

}  // namespace kvr::mocker
