#include "deploy/cli/route_command.hpp"

#include <chrono>
#include <iostream>
#include <random>

#include <fmt/format.h>

#include "deploy/cli/cli_options.hpp"
#include "kvr/v1/routing.pb.h"
#include "messages/error.hpp"
#include "messages/nats/nats_client.hpp"
#include "messages/nats/route_client.hpp"
#include "messages/subjects.hpp"

namespace kvr::cli {
namespace {

struct RouteCommandOptions {
  nats::NatsOptions nats;
  std::string ns = "default";
  std::vector<std::uint32_t> tokens;
  std::string text;
  std::string model = "mock-model";
  std::string routing_group;
  std::string role = "aggregated";
  std::string request_id;
  std::string cache_namespace;
  std::string tenant;
  int timeout_ms = 5000;
  int retry_after_ms = 150;
  int attempts = 7;
  bool query_only = false;
};

v1::WorkerRole wire_role(std::string_view role) {
  if (role == "prefill") return v1::WORKER_ROLE_PREFILL;
  if (role == "decode") return v1::WORKER_ROLE_DECODE;
  if (role == "encode") return v1::WORKER_ROLE_ENCODE;
  return v1::WORKER_ROLE_AGGREGATED;
}

// The exit codes of `kvr route` (also in its --help and the README): an answered decision that
// refuses the request is not a failure of the tool, and a script must tell a usage error (fix the
// command), an admission refusal (retry later, or lower the rate), a request that cannot be routed
// at all and a node that did not answer (none runs, or none in time) apart.
constexpr int kRouted = 0;
constexpr int kRouteError = 1;
static_assert(kUsageError == 2, "kvr route documents usage errors as exit code 2");
constexpr int kRejectedByAdmission = 3;
constexpr int kNoDecision = 4;

std::string print_decision(const v1::RouteDecision& decision) {
  if (decision.has_error() && is_admission_rejection(decision.error().code())) {
    return fmt::format("request {}: rejected by admission: {}: {}", decision.request_id(),
                       v1::RouteErrorCode_Name(decision.error().code()),
                       decision.error().message());
  }
  if (decision.has_error()) {
    return fmt::format("request {}: error {}: {}", decision.request_id(),
                       v1::RouteErrorCode_Name(decision.error().code()),
                       decision.error().message());
  }
  const auto& success = decision.success();
  std::string costs;
  for (const v1::ScorerCost& cost : success.costs()) {
    costs +=
        fmt::format("{}{} {}", costs.empty() ? "\n  costs: " : ", ", cost.scorer(), cost.cost());
  }
  const std::string booking =
      success.booking_id().empty()
          ? std::string{"no booking (query only)"}
          : fmt::format("booking {} (ttl {} ms)", success.booking_id(), success.booking_ttl_ms());
  return fmt::format(
      "request {}: worker {} rank {}\n  overlap blocks: device {} host {} disk {}\n"
      "  {}\n  policy {} total cost {}{}\n  generate subject {}{}",
      decision.request_id(), success.worker_id(), success.dp_rank(),
      success.device_overlap_blocks(), success.host_overlap_blocks(), success.disk_overlap_blocks(),
      booking, success.policy(), success.total_cost(), costs, success.generate_subject(),
      success.worker_http_url().empty() ? "" : "\n  http url " + success.worker_http_url());
}

int run_route(const RouteCommandOptions& options) {
  v1::RouteRequest request;
  std::string request_id = options.request_id;
  if (request_id.empty()) request_id = fmt::format("kvr-route-{:08x}", std::random_device{}());
  request.set_request_id(request_id);
  request.set_model(options.model);
  request.set_routing_group(options.routing_group);
  request.set_worker_role(wire_role(options.role));
  request.set_cache_namespace(options.cache_namespace);
  request.set_tenant(options.tenant);
  request.set_query_only(options.query_only);
  auto* tokens = request.mutable_tokens();
  if (!options.text.empty()) {
    // The stated rule for --text: each UTF-8 byte of the text is one token id (0..255).
    for (unsigned char byte : options.text) tokens->add_ids(byte);
  } else {
    for (std::uint32_t token : options.tokens) tokens->add_ids(token);
  }
  auto client = nats::NatsClient::connect(options.nats);
  if (!client) {
    std::cerr << "kvr route: " << client.error() << '\n';
    return kNoDecision;
  }
  auto router = nats::RouteClient::open(**client, subjects::router_route(options.ns),
                                        subjects::router_report(options.ns));
  if (!router) {
    std::cerr << "kvr route: " << router.error() << '\n';
    return kNoDecision;
  }
  auto routed =
      router->route(request, {.retry_after = std::chrono::milliseconds(options.retry_after_ms),
                              .max_attempts = options.attempts,
                              .timeout = std::chrono::milliseconds(options.timeout_ms)});
  if (!routed) {
    std::cerr << "kvr route: no decision: " << routed.error() << '\n';
    return kNoDecision;
  }
  const v1::RouteDecision& decision = routed->decision;
  if (routed->attempts > 1) {
    std::cerr << fmt::format("kvr route: answered after {} asks\n", routed->attempts);
  }
  std::cout << print_decision(decision) << '\n';
  if (decision.has_success()) return kRouted;
  if (decision.has_error() && is_admission_rejection(decision.error().code())) {
    return kRejectedByAdmission;
  }
  return kRouteError;
}

}  // namespace

void add_route_command(CLI::App& app, int& exit_code) {
  auto* command = app.add_subcommand(
      "route", "ask the router nodes for one routing decision (RouteRequest over NATS)");
  command->footer(
      "Exit codes:\n"
      "  0 routed (a worker was chosen)\n"
      "  1 route error: the node answered with an error (e.g. ROUTE_ERROR_NO_WORKERS)\n"
      "  2 usage or configuration error (a bad option)\n"
      "  3 rejected by admission: ROUTE_ERROR_OVERLOADED (a full queue or a booking cap),\n"
      "    _RATE_LIMITED, _DUE_TIME_EXPIRED or _REJECTED (the request classifier)\n"
      "  4 no decision: no connection to NATS, or no node answered (no responders, or none\n"
      "    within --timeout-ms)\n"
      "A request with no decision after --retry-after-ms is asked again with a fresh id (a hung\n"
      "node keeps its share of the queue group), up to --attempts asks; the first decision wins\n"
      "and a later one is released.\n"
      "A decision, error or not, is printed on stdout.");
  auto options = std::make_shared<RouteCommandOptions>();
  add_nats_options(*command, options->nats);
  options->nats.name = "kvr-route";
  add_namespace_option(*command, options->ns);
  auto* tokens =
      command->add_option("--tokens", options->tokens, "prompt token ids, comma separated (1,2,3)")
          ->delimiter(',');
  auto* text = command->add_option(
      "--text", options->text,
      "prompt text; each UTF-8 byte becomes one token id (0..255), hashed like --tokens");
  tokens->excludes(text);
  text->excludes(tokens);
  command->add_option("--model", options->model, "model to route for")
      ->capture_default_str()
      ->check(non_empty());
  command->add_option("--routing-group", options->routing_group, "routing group (default)");
  command->add_option("--role", options->role, "worker role")
      ->capture_default_str()
      ->check(CLI::IsMember({"aggregated", "prefill", "decode", "encode"}));
  command->add_option("--request-id", options->request_id, "request id (default: random)");
  command->add_option("--cache-namespace", options->cache_namespace,
                      "cache namespace mixed into the block hashes (e.g. a LoRA name)");
  command->add_option("--tenant", options->tenant,
                      "who the request is for (per-tenant admission; default: none)");
  command->add_option("--timeout-ms", options->timeout_ms, "how long to wait for the decision")
      ->capture_default_str()
      ->check(CLI::Range(1, 600'000));
  command
      ->add_option("--retry-after-ms", options->retry_after_ms,
                   "ask again (fresh id) when no decision came this long after the last ask")
      ->capture_default_str()
      ->check(CLI::Range(1, 600'000));
  command->add_option("--attempts", options->attempts, "most asks in all (1: never ask again)")
      ->capture_default_str()
      ->check(CLI::Range(1, 100));
  command->add_flag("--query-only", options->query_only,
                    "only ask which worker the request would get, with its overlap and costs: "
                    "nothing is booked and admission does not run");
  command->callback([options, &exit_code] {
    if (options->tokens.empty() && options->text.empty()) {
      std::cerr << "kvr route: give the prompt with --tokens or --text\n";
      exit_code = kUsageError;
      return;
    }
    exit_code = run_route(*options);
  });
}

}  // namespace kvr::cli
