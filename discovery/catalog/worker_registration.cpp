#include "discovery/catalog/worker_registration.hpp"

#include <string_view>

#include "messages/http_url.hpp"
#include "messages/subjects.hpp"
#include "messages/worker_role.hpp"

namespace kvr::discovery {
namespace {

std::unexpected<RegistrationError> bad(std::string field, std::string reason) {
  return std::unexpected(RegistrationError{std::move(field), std::move(reason)});
}

// `text` in quotes for a log line: bytes outside printable ASCII as \xNN.
std::string quoted(std::string_view text) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out = "'";
  for (const char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte < 0x20 || byte >= 0x7F || c == '\\') {
      out += "\\x";
      out += kHex[byte >> 4];
      out += kHex[byte & 0xF];
    } else {
      out += c;
    }
  }
  return out + "'";
}

}  // namespace

std::expected<WorkerRegistration, RegistrationError> validate_registration(
    WorkerRegistration registration, const RegistrationLimits& limits) {
  if (registration.worker_id == 0) return bad("worker_id", "must be non-zero");
  if (registration.model.empty()) return bad("model", "must not be empty");
  const std::pair<std::string_view, const std::string*> strings[] = {
      {"model", &registration.model},
      {"routing_group", &registration.routing_group},
      {"generate_subject", &registration.generate_subject},
      {"dump_subject", &registration.dump_subject},
      {"http_url", &registration.http_url}};
  for (const auto& [field, value] : strings) {
    if (value->size() > limits.max_string_length) {
      return bad(std::string(field), "longer than " + std::to_string(limits.max_string_length));
    }
  }
  // Generate requests and dump requests go there: a subject nobody can serve (whitespace, a
  // wildcard) or one the routers serve themselves would leave requests waiting for nothing.
  for (const auto& [field, value] : {std::pair<std::string_view, const std::string*>{
                                         "generate_subject", &registration.generate_subject},
                                     {"dump_subject", &registration.dump_subject}}) {
    if (value->empty()) continue;  // not served: route mode only, or no dumps
    if (const std::string why = subjects::invalid_worker_subject(*value); !why.empty()) {
      return bad(std::string(field), quoted(*value) + " " + why);
    }
  }
  // HTTP requests routed to the worker go there: one that is no base URL would fail each of them.
  if (!registration.http_url.empty()) {
    if (const std::string why = invalid_http_url(registration.http_url); !why.empty()) {
      return bad("http_url", quoted(registration.http_url) + " " + why);
    }
    registration.http_url = std::string{trim_trailing_slash(registration.http_url)};
  }
  if (registration.routing_group.empty()) registration.routing_group = "default";
  // '#' names a shard of a routing group inside a node (selection/cluster/sharding.hpp).
  if (registration.routing_group.find('#') != std::string::npos) {
    return bad("routing_group", quoted(registration.routing_group) + " contains '#'");
  }
  if (registration.block_size == 0) return bad("block_size", "must be positive");
  if (registration.block_size > limits.max_block_size) {
    return bad("block_size", std::to_string(registration.block_size) + " is more than " +
                                 std::to_string(limits.max_block_size) + " tokens");
  }
  if (limits.required_block_size != 0 && registration.block_size != limits.required_block_size) {
    return bad("block_size", std::to_string(registration.block_size) +
                                 " differs from the router's " +
                                 std::to_string(limits.required_block_size));
  }
  // No capacity is allowed (engines that do not publish theirs); one that is given is checked.
  if (const auto& blocks = registration.total_kv_blocks) {
    if (*blocks == 0) {
      return bad("total_kv_blocks", "0 is no capacity; leave it unset when unknown");
    }
    if (*blocks > limits.max_kv_blocks_per_rank) {
      return bad("total_kv_blocks",
                 "more than " + std::to_string(limits.max_kv_blocks_per_rank) + " per rank");
    }
  }
  if (registration.data_parallel_size == 0) return bad("data_parallel_size", "must be positive");
  if (registration.data_parallel_size > limits.max_data_parallel_size) {
    return bad("data_parallel_size", "more than " + std::to_string(limits.max_data_parallel_size));
  }
  if (registration.taints.size() > limits.max_taints) {
    return bad("taints", "more than " + std::to_string(limits.max_taints));
  }
  for (const std::string& taint : registration.taints) {
    if (taint.empty() || taint.size() > limits.max_string_length) {
      return bad("taints", "empty or overlong taint");
    }
  }
  if (registration.lora_adapters.size() > limits.max_lora_adapters) {
    return bad("lora_adapters", "more than " + std::to_string(limits.max_lora_adapters));
  }
  for (const std::string& adapter : registration.lora_adapters) {
    if (adapter.empty() || adapter.size() > limits.max_string_length) {
      return bad("lora_adapters", "empty or overlong adapter name");
    }
    if (adapter == registration.model) {
      return bad("lora_adapters", "'" + adapter + "' is the model itself");
    }
  }
  if (registration.liveness_ttl.count() == 0)
    registration.liveness_ttl = limits.default_liveness_ttl;
  if (registration.liveness_ttl < limits.min_liveness_ttl ||
      registration.liveness_ttl > limits.max_liveness_ttl) {
    return bad("liveness_ttl_ms", "outside [" + std::to_string(limits.min_liveness_ttl.count()) +
                                      ", " + std::to_string(limits.max_liveness_ttl.count()) +
                                      "] ms");
  }
  return registration;
}

std::expected<WorkerRegistration, RegistrationError> registration_from_proto(
    const v1::WorkerRegistration& wire, const RegistrationLimits& limits) {
  const auto role = worker_type_from_wire(wire.role());
  if (!role) return bad("role", "unspecified or unknown role " + std::to_string(wire.role()));
  WorkerRegistration registration;
  registration.worker_id = wire.worker_id();
  registration.incarnation = wire.incarnation();
  registration.model = wire.model();
  registration.role = *role;
  registration.routing_group = wire.routing_group();
  registration.block_size = wire.block_size();
  // 0 (or absent) on the wire: the engine did not say.
  if (wire.total_kv_blocks() != 0) registration.total_kv_blocks = wire.total_kv_blocks();
  registration.data_parallel_size = wire.data_parallel_size() == 0 ? 1 : wire.data_parallel_size();
  registration.taints.assign(wire.taints().begin(), wire.taints().end());
  registration.max_num_batched_tokens = wire.max_num_batched_tokens();
  registration.max_num_seqs = wire.max_num_seqs();
  registration.publishes_kv_events = wire.publishes_kv_events();
  // Absent: the router's default. An explicit 0 is no liveness at all (a worker that would expire
  // at once), so it is refused rather than read as the default.
  if (wire.has_liveness_ttl_ms() && wire.liveness_ttl_ms() == 0) {
    return bad("liveness_ttl_ms",
               "0 is not a liveness TTL; leave the field out for the default of " +
                   std::to_string(limits.default_liveness_ttl.count()) + " ms");
  }
  registration.liveness_ttl = std::chrono::milliseconds(wire.liveness_ttl_ms());
  registration.generate_subject = wire.generate_subject();
  registration.dump_subject = wire.dump_subject();
  registration.http_url = wire.http_url();
  registration.lora_adapters.assign(wire.lora_adapters().begin(), wire.lora_adapters().end());
  return validate_registration(std::move(registration), limits);
}

}  // namespace kvr::discovery
