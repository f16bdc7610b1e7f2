#include "deploy/mocker/vllm_engine_server.hpp"

#include <chrono>
#include <limits>
#include <optional>
#include <thread>

#include <fmt/format.h>
#include <httplib.h>

#include "absl/container/flat_hash_set.h"
#include "deploy/mocker/kv_transfer_params.hpp"
#include "deploy/mocker/vllm_completion_routes.hpp"
#include "deploy/mocker/vllm_engine_loop.hpp"
#include "deploy/mocker/vllm_info_routes.hpp"
#include "deploy/mocker/vllm_kv_event_sockets.hpp"
#include "deploy/mocker/vllm_render_routes.hpp"
#include "deploy/mocker/vllm_route_context.hpp"

namespace kvr::mocker {
namespace {

// Every group of HTTP routes the engine serves, registered in this order; a new API adds its
// group here.
constexpr VllmRouteGroup kVllmRouteGroups[] = {
    add_vllm_info_routes,
    add_vllm_completion_routes,
    add_vllm_render_routes,
};

void configure_http_server(httplib::Server& http, std::uint32_t threads) {
  http.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  // As vLLM's server (uvicorn on asyncio) does: streamed tokens are small writes, which Nagle's
  // algorithm would hold back.
  http.set_tcp_nodelay(true);
  // uvicorn serves any number of requests on a kept-alive connection (cpp-httplib's default
  // closes it after 5) and closes one idle for 5 s.
  http.set_keep_alive_max_count(std::numeric_limits<std::size_t>::max());
  http.set_keep_alive_timeout(5);
}

}  // namespace

// Declared in the order they must be built; destroyed in reverse, each after what uses it.
struct VllmEngineServer::State {
  State(VllmEngineOptions engine_options, simulation::Engine simulated_engine)
      : options(std::move(engine_options)),
        engine(std::move(simulated_engine), options, kv_sockets),
        routes(options, engine) {}

  VllmEngineOptions options;
  VllmKvEventSockets kv_sockets;
  VllmEngineLoop engine;
  VllmRouteContext routes;
  httplib::Server http;
  std::thread http_thread;
  std::uint16_t http_port = 0;
};

std::expected<void, std::string> check_lora_adapters(std::string_view model,
                                                     const std::vector<std::string>& adapters) {
  absl::flat_hash_set<std::string_view> seen;
  for (const std::string& name : adapters) {
    if (name.empty()) return std::unexpected("an adapter's name must not be empty");
    // A request naming it could not tell the base model from the adapter.
    if (name == model) {
      return std::unexpected(fmt::format("adapter `{}` has the served model's name", name));
    }
    if (!seen.insert(name).second) {
      return std::unexpected(fmt::format("adapter `{}` is given twice", name));
    }
  }
  return {};
}

VllmEngineServer::VllmEngineServer(std::unique_ptr<State> state) : state_(std::move(state)) {}

std::expected<std::unique_ptr<VllmEngineServer>, std::string> VllmEngineServer::start(
    VllmEngineOptions options) {
  auto engine = simulation::Engine::create(options.engine);
  if (!engine) return std::unexpected(engine.error().message());
  if (options.replay_buffer == 0) return std::unexpected("the replay buffer must hold a batch");
  if (options.http_threads == 0) return std::unexpected("the HTTP server needs a thread");
  if (auto valid = check_lora_adapters(options.model, options.lora_adapters); !valid) {
    return std::unexpected(fmt::format("LoRA adapters: {}", valid.error()));
  }
  auto state = std::make_unique<State>(std::move(options), std::move(*engine));
  const VllmEngineOptions& opts = state->options;
  if (auto bound = state->kv_sockets.bind(opts); !bound) return std::unexpected(bound.error());
  configure_http_server(state->http, opts.http_threads);
  for (VllmRouteGroup add_routes : kVllmRouteGroups) add_routes(state->http, state->routes);
  const int port =
      opts.http_port == 0
          ? state->http.bind_to_any_port(opts.host)
          : (state->http.bind_to_port(opts.host, opts.http_port) ? opts.http_port : -1);
  if (port <= 0) {
    return std::unexpected(
        fmt::format("cannot bind the HTTP server on {}:{}", opts.host, opts.http_port));
  }
  state->http_port = static_cast<std::uint16_t>(port);
  // What this engine's prefill hops name as the source of their KV.
  state->engine.start(KvTransferSource{.engine_id = fmt::format("kvr-mocker-{}-0", port),
                                       .host = opts.host,
                                       .port = kNixlSideChannelPort});
  state->kv_sockets.start_replay();
  State* raw = state.get();
  state->http_thread = std::thread{[raw] { raw->http.listen_after_bind(); }};
  // httplib's stop() does nothing until the listen loop runs: wait for it.
  // (bounded: a loop that ends at once never shows as running)
  for (const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
       !state->http.is_running() && std::chrono::steady_clock::now() < until;) {
    std::this_thread::yield();
  }
  return std::unique_ptr<VllmEngineServer>(new VllmEngineServer(std::move(state)));
}

VllmEngineServer::~VllmEngineServer() {
  State& state = *state_;
  state.kv_sockets.request_stop();
  // The engine thread closes every channel as it ends, which frees the HTTP threads.
  state.engine.stop();
  state.http.stop();
  if (state.http_thread.joinable()) state.http_thread.join();
  // The replay thread is joined as kv_sockets is destroyed.
}

std::string VllmEngineServer::url() const {
  return fmt::format("http://{}:{}", state_->options.host, state_->http_port);
}

}  // namespace kvr::mocker
