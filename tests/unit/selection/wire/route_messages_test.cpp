#include "selection/wire/route_messages.hpp"

#include <cmath>
#include <limits>
#include <numeric>

#include <google/protobuf/util/message_differencer.h>
#include <gtest/gtest.h>

namespace kvr {
namespace {

v1::RouteRequest token_request(std::size_t tokens) {
  v1::RouteRequest wire;
  wire.set_request_id("r1");
  wire.set_model("m");
  for (std::uint32_t i = 0; i < tokens; ++i) wire.mutable_tokens()->add_ids(i + 1);
  return wire;
}

TEST(RouteRequestTest, KeepsTokenIdsAndCacheNamespaceForThePartitionsSelectorToHash) {
  auto wire = token_request(40);
  wire.set_cache_namespace("lora-a");
  auto decoded = decode_route_request(wire);
  ASSERT_TRUE(decoded) << decoded.error().message;
  std::vector<std::uint32_t> tokens(40);
  std::iota(tokens.begin(), tokens.end(), 1U);
  EXPECT_EQ(decoded->prompt_token_ids, tokens);
  EXPECT_EQ(decoded->cache_namespace, "lora-a");
  EXPECT_TRUE(decoded->selection.block_hashes.empty()) << "the block size is the partition's";
  EXPECT_EQ(decoded->selection.prompt_tokens, 40U);
  EXPECT_EQ(decoded->partition.routing_group, "default");
  EXPECT_EQ(decoded->worker_type, WorkerType::Aggregated);
  EXPECT_TRUE(decoded->tenant.empty());
}

TEST(RouteRequestTest, KeepsTheTenantTheClientNamed) {
  auto wire = token_request(8);
  wire.set_tenant("team-a");
  auto decoded = decode_route_request(wire);
  ASSERT_TRUE(decoded) << decoded.error().message;
  EXPECT_EQ(decoded->tenant, "team-a");
}

TEST(RouteRequestTest, UsesBlockHashesAsGiven) {
  v1::RouteRequest wire;
  wire.set_request_id("r2");
  wire.set_model("m");
  wire.set_routing_group("g");
  wire.set_worker_role(v1::WORKER_ROLE_PREFILL);
  wire.mutable_block_hashes()->add_hashes(11);
  wire.mutable_block_hashes()->add_hashes(22);
  wire.mutable_block_hashes()->set_prompt_tokens(33);
  auto decoded = decode_route_request(wire);
  ASSERT_TRUE(decoded) << decoded.error().message;
  EXPECT_EQ(decoded->selection.block_hashes, (std::vector<BlockHash>{11, 22}));
  EXPECT_EQ(decoded->partition.routing_group, "g");
  EXPECT_EQ(decoded->worker_type, WorkerType::Prefill);
  EXPECT_TRUE(decoded->prompt_token_ids.empty());
  EXPECT_EQ(decoded->id(), "r2");
}

// Each case breaks one field; the failure names it.
struct InvalidCase {
  std::string name;
  std::function<void(v1::RouteRequest&)> mutate;
  std::string field;
};

class RouteRequestInvalidTest : public ::testing::TestWithParam<InvalidCase> {};

TEST_P(RouteRequestInvalidTest, RefusesWithInvalidRequestNamingTheField) {
  auto wire = token_request(20);
  GetParam().mutate(wire);
  auto decoded = decode_route_request(wire);
  ASSERT_FALSE(decoded);
  EXPECT_EQ(decoded.error().code, Error::invalid_request);
  EXPECT_NE(decoded.error().message.find(GetParam().field), std::string::npos)
      << decoded.error().message;
}

INSTANTIATE_TEST_SUITE_P(
    Fields, RouteRequestInvalidTest,
    ::testing::Values(
        InvalidCase{"EmptyRequestId", [](auto& w) { w.set_request_id(""); }, "request_id"},
        InvalidCase{"EmptyModel", [](auto& w) { w.set_model(""); }, "model"},
        InvalidCase{"NoPrompt", [](auto& w) { w.clear_prompt(); }, "prompt"},
        InvalidCase{"EmptyTokens", [](auto& w) { w.mutable_tokens()->clear_ids(); }, "tokens"},
        InvalidCase{"UnknownRole",
                    [](auto& w) { w.set_worker_role(static_cast<v1::WorkerRole>(99)); },
                    "worker_role"},
        // More hashes than full blocks at the partition's block size: the selector refuses them
        // (SelectorStateTest.MoreHashesThanFullBlocksIsAnInvalidRequest); more than tokens, any
        // block size would.
        InvalidCase{"MoreHashesThanTokens",
                    [](auto& w) {
                      w.mutable_block_hashes()->add_hashes(1);
                      w.mutable_block_hashes()->add_hashes(2);
                      w.mutable_block_hashes()->add_hashes(3);
                      w.mutable_block_hashes()->set_prompt_tokens(2);
                    },
                    "block_hashes"},
        InvalidCase{"ZeroPromptTokens",
                    [](auto& w) { w.mutable_block_hashes()->set_prompt_tokens(0); },
                    "prompt_tokens"},
        InvalidCase{"HugePrompt",
                    [](auto& w) { w.mutable_block_hashes()->set_prompt_tokens(4'000'000'000U); },
                    "prompt_tokens"},
        InvalidCase{"PinnedWorkerZero",
                    [](auto& w) { w.mutable_pinned_worker()->set_worker_id(0); }, "pinned_worker"},
        InvalidCase{"NonFiniteTaintWeight",
                    [](auto& w) {
                      (*w.mutable_preferred_taints())["gpu"] =
                          std::numeric_limits<double>::infinity();
                    },
                    "preferred_taints"},
        InvalidCase{"SessionWithoutId",
                    [](auto& w) { w.mutable_session()->set_session_final(true); }, "session_id"},
        InvalidCase{"LongTenant", [](auto& w) { w.set_tenant(std::string(300, 't')); }, "tenant"},
        InvalidCase{"LongRequestId", [](auto& w) { w.set_request_id(std::string(300, 'x')); },
                    "request_id"}),
    [](const auto& test_case) { return test_case.param.name; });

// A node in a cluster forwards the request it decoded: encoding and decoding again loses nothing.
TEST(RouteRequestTest, EncodingADecodedRequestGivesItBackWhole) {
  v1::RouteRequest wire;
  wire.set_request_id("r1");
  wire.set_model("llama");
  wire.set_routing_group("batch");
  wire.set_worker_role(v1::WORKER_ROLE_PREFILL);
  wire.set_tenant("acme");
  for (std::uint32_t token : {5U, 6U, 7U}) wire.mutable_tokens()->add_ids(token);
  wire.set_cache_namespace("lora-a");
  wire.set_expected_output_tokens(64);
  wire.mutable_session()->set_session_id("s1");
  wire.mutable_session()->set_parent_session_id("s0");
  wire.mutable_session()->set_session_final(true);
  wire.mutable_session()->set_input_trigger(v1::INPUT_TRIGGER_TOOL_RESULT);
  wire.set_priority(3);
  wire.mutable_pinned_worker()->set_worker_id(9);
  wire.mutable_pinned_worker()->set_dp_rank(1);
  wire.add_allowed_workers(9);
  wire.add_allowed_workers(10);
  wire.add_required_taints("gpu");
  (*wire.mutable_preferred_taints())["fast"] = 0.5;
  (*wire.mutable_preferred_taints())["cheap"] = 0.25;
  wire.set_query_only(true);
  const auto decoded = decode_route_request(wire);
  ASSERT_TRUE(decoded) << decoded.error().message;
  const v1::RouteRequest encoded = encode_route_request(*decoded);
  const auto again = decode_route_request(encoded);
  ASSERT_TRUE(again) << again.error().message;
  // Compared as messages: a map field's serialized order is unspecified.
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(encoded, wire))
      << encoded.DebugString() << "\nvs\n"
      << wire.DebugString();
  EXPECT_TRUE(
      google::protobuf::util::MessageDifferencer::Equals(encoded, encode_route_request(*again)));
  EXPECT_EQ(again->selection.request_id, "r1");
  EXPECT_EQ(again->partition.routing_group, "batch");
  EXPECT_EQ(again->worker_type, WorkerType::Prefill);
  EXPECT_EQ(again->tenant, "acme");
  EXPECT_EQ(again->prompt_token_ids, (std::vector<std::uint32_t>{5, 6, 7}));
  EXPECT_EQ(again->cache_namespace, "lora-a");
  EXPECT_EQ(again->selection.expected_output_tokens, 64U);
  ASSERT_TRUE(again->selection.session);
  EXPECT_EQ(again->selection.session->parent_session_id(), "s0");
  EXPECT_EQ(again->selection.session->session_final(), true);
  EXPECT_EQ(again->selection.session->input_trigger(), InputTrigger::ToolResult);
  EXPECT_EQ(again->selection.strict_priority, 3U);
  ASSERT_TRUE(again->selection.pinned_worker);
  EXPECT_EQ(again->selection.pinned_worker->dp_rank, 1U);
  EXPECT_EQ(again->selection.allowed_workers, (std::vector<WorkerId>{9, 10}));
  EXPECT_EQ(again->selection.required_taints, std::vector<std::string>{"gpu"});
  ASSERT_EQ(again->selection.preferred_taints.size(), 2U);
  EXPECT_EQ(again->selection.preferred_taints[0].taint, "cheap");
  EXPECT_TRUE(again->query_only);

  // A block-hash prompt keeps its hashes and prompt length.
  v1::RouteRequest hashed;
  hashed.set_request_id("r2");
  hashed.set_model("llama");
  hashed.mutable_block_hashes()->set_prompt_tokens(40);
  hashed.mutable_block_hashes()->add_hashes(11);
  hashed.mutable_block_hashes()->add_hashes(12);
  const auto from_hashes =
      decode_route_request(encode_route_request(*decode_route_request(hashed)));
  ASSERT_TRUE(from_hashes);
  EXPECT_EQ(from_hashes->selection.prompt_tokens, 40U);
  EXPECT_EQ(from_hashes->selection.block_hashes, (std::vector<BlockHash>{11, 12}));
}

TEST(RouteRequestTest, ErrorDecisionCarriesTheWireCode) {
  const auto decision = encode_route_error("r", Error::no_workers, "none");
  EXPECT_EQ(decision.request_id(), "r");
  ASSERT_TRUE(decision.has_error());
  EXPECT_EQ(decision.error().code(), v1::ROUTE_ERROR_NO_WORKERS);
  EXPECT_EQ(decision.error().message(), "none");
}

TEST(RouteRequestTest, SuccessDecisionCarriesBookingAndOverlap) {
  RouteOutcome outcome;
  outcome.worker = {42, 1};
  outcome.device_overlap_blocks = 3;
  outcome.total_cost = 1.5;
  outcome.scorer_costs = {1.5};
  outcome.scorer_names = std::make_shared<const std::vector<std::string>>(
      std::vector<std::string>{"kvr::selection::policies::KvCostScorer"});
  const auto decision = encode_route_success("r", outcome,
                                             {.booking_id = "L-1",
                                              .booking_ttl = std::chrono::seconds(2),
                                              .policy = "p",
                                              .generate_subject = "kvr.ns.worker.42.generate",
                                              .http_url = "http://10.0.0.7:8000"});
  ASSERT_TRUE(decision.has_success());
  EXPECT_EQ(decision.success().worker_id(), 42U);
  EXPECT_EQ(decision.success().dp_rank(), 1U);
  EXPECT_EQ(decision.success().device_overlap_blocks(), 3U);
  EXPECT_EQ(decision.success().booking_id(), "L-1");
  EXPECT_EQ(decision.success().booking_ttl_ms(), 2000U);
  ASSERT_EQ(decision.success().costs_size(), 1);
  EXPECT_EQ(decision.success().costs(0).scorer(), "kvr::selection::policies::KvCostScorer");
  EXPECT_DOUBLE_EQ(decision.success().costs(0).cost(), 1.5);
  EXPECT_EQ(decision.success().generate_subject(), "kvr.ns.worker.42.generate");
  EXPECT_EQ(decision.success().worker_http_url(), "http://10.0.0.7:8000");
}

TEST(RouteRequestTest, LifecycleReportNeedsBookingAndKnownEvent) {
  v1::LifecycleReport wire;
  EXPECT_FALSE(decode_lifecycle_report(wire));
  wire.set_booking_id("L-1");
  EXPECT_FALSE(decode_lifecycle_report(wire));  // unspecified event
  wire.set_event(static_cast<v1::LifecycleEvent>(42));
  EXPECT_FALSE(decode_lifecycle_report(wire));
  wire.set_event(v1::LIFECYCLE_EVENT_ABORTED);
  wire.set_error("client went away");
  auto report = decode_lifecycle_report(wire);
  ASSERT_TRUE(report) << report.error();
  EXPECT_EQ(report->event, LifecycleEventKind::Aborted);
  EXPECT_EQ(report->error, "client went away");
}

// A request's key is its id scoped to its client; decisions and forwarding carry the client's id.
TEST(RequestScopeTest, ScopesIdsPerClientWithoutAmbiguity) {
  EXPECT_EQ(nats_client_of("_INBOX.conn123.42"), "_INBOX.conn123.");
  EXPECT_EQ(nats_client_of("_INBOX.conn123.*.7"), "_INBOX.conn123.*.");
  EXPECT_EQ(nats_client_of("_INBOX.single"), "_INBOX.single");
  EXPECT_EQ(nats_client_of("reply"), "reply");
  EXPECT_EQ(nats_client_of(""), "");

  RouteRequest request;
  request.selection.request_id = "r-1";
  scope_request_id(request, "_INBOX.a@b%.");
  EXPECT_EQ(request.id(), "r-1@_INBOX.a%40b%25.");
  EXPECT_EQ(request.client_id(), "r-1");
  EXPECT_EQ(request_scope(request), "_INBOX.a%40b%25.");
  // Scoped once: a second scope (a forwarding hop) changes nothing.
  scope_request_id(request, "actor:9");
  EXPECT_EQ(request.id(), "r-1@_INBOX.a%40b%25.");
  // Passed on escaped, the scope gives the same key on the owner.
  RouteRequest forwarded;
  forwarded.selection.request_id = std::string{request.client_id()};
  apply_request_scope(forwarded, request_scope(request));
  EXPECT_EQ(forwarded.id(), request.id());
  // An id with an '@' of its own cannot pose as another client's scope.
  RouteRequest tricky;
  tricky.selection.request_id = "r-1@_INBOX.a";
  scope_request_id(tricky, "b%.");
  RouteRequest plain;
  plain.selection.request_id = "r-1";
  scope_request_id(plain, "_INBOX.a@b%.");
  EXPECT_NE(tricky.id(), plain.id());
  // No client (no reply subject): the id stays as sent.
  RouteRequest unscoped;
  unscoped.selection.request_id = "r-2";
  scope_request_id(unscoped, "");
  EXPECT_EQ(unscoped.id(), "r-2");
  EXPECT_EQ(unscoped.client_id(), "r-2");
  // The wire form a node forwards carries the client's id.
  request.partition.model = "m";
  request.selection.prompt_tokens = 4;
  request.prompt_token_ids = {1, 2, 3, 4};
  EXPECT_EQ(encode_route_request(request).request_id(), "r-1");
}

}  // namespace
}  // namespace kvr
