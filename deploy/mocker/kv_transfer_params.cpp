#include "deploy/mocker/kv_transfer_params.hpp"

#include <algorithm>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace kvr::mocker {

std::expected<KvTransferRequest, std::string> read_kv_transfer_params(
    const nlohmann::json& params) {
  if (params.is_null()) return KvTransferRequest{};
  if (!params.is_object()) return std::unexpected("kv_transfer_params must be a JSON object");
  // A field that is absent or null is unset, as vLLM's router sends them on a prefill hop.
  const auto given = [&](const char* field) -> const nlohmann::json* {
    const auto found = params.find(field);
    return found == params.end() || found->is_null() ? nullptr : &*found;
  };
  const auto flag = [&](const char* field) -> std::expected<bool, std::string> {
    const nlohmann::json* value = given(field);
    if (value == nullptr) return false;
    if (!value->is_boolean()) {
      return std::unexpected(fmt::format("kv_transfer_params.{} must be a boolean", field));
    }
    return value->get<bool>();
  };
  for (const char* field : {"remote_engine_id", "remote_request_id", "remote_host"}) {
    if (const nlohmann::json* value = given(field); value != nullptr && !value->is_string()) {
      return std::unexpected(fmt::format("kv_transfer_params.{} must be a string", field));
    }
  }
  for (const char* field : {"remote_port", "tp_size"}) {
    if (const nlohmann::json* value = given(field);
        value != nullptr && !value->is_number_integer()) {
      return std::unexpected(fmt::format("kv_transfer_params.{} must be an integer", field));
    }
  }
  std::uint64_t remote_blocks = 0;
  if (const nlohmann::json* ids = given("remote_block_ids")) {
    // A flat list of block ids, or one list per KV-cache group (vLLM's current form): a group's
    // list covers the prompt's blocks, so the longest bounds the pull.
    const auto block_ids = [](const nlohmann::json& list) {
      return list.is_array() && std::ranges::all_of(list, [](const nlohmann::json& id) {
               return id.is_number_unsigned();
             });
    };
    const bool grouped = ids->is_array() && !ids->empty() && ids->front().is_array();
    const bool valid = grouped ? std::ranges::all_of(*ids, block_ids) : block_ids(*ids);
    if (!valid) {
      return std::unexpected(
          "kv_transfer_params.remote_block_ids must be a list of block ids (or one per KV-cache "
          "group)");
    }
    remote_blocks = ids->size();
    if (grouped) {
      remote_blocks = 0;
      for (const nlohmann::json& group : *ids)
        remote_blocks = std::max(remote_blocks, group.size());
    }
  }
  const auto remote_decode = flag("do_remote_decode");
  if (!remote_decode) return std::unexpected(remote_decode.error());
  const auto remote_prefill = flag("do_remote_prefill");
  if (!remote_prefill) return std::unexpected(remote_prefill.error());
  if (*remote_decode && *remote_prefill) {
    return std::unexpected(
        "kv_transfer_params: do_remote_decode and do_remote_prefill are both true; the simulated "
        "engine serves one hop of a request");
  }
  if (*remote_decode)
    return KvTransferRequest{.kv_transfer = simulation::KvTransfer::remote_decode};
  if (*remote_prefill) {
    return KvTransferRequest{.kv_transfer = simulation::KvTransfer::remote_prefill,
                             .remote_blocks = remote_blocks};
  }
  return KvTransferRequest{};
}

nlohmann::json kv_transfer_answer(const KvTransferSource& source, std::string_view request_id,
                                  std::span<const simulation::BlockIndex> blocks) {
  return {{"do_remote_prefill", true},
          {"do_remote_decode", false},
          {"remote_block_ids", std::vector<simulation::BlockIndex>(blocks.begin(), blocks.end())},
          {"remote_engine_id", source.engine_id},
          {"remote_request_id", request_id},
          {"remote_host", source.host},
          {"remote_port", source.port},
          {"tp_size", 1}};
}

}  // namespace kvr::mocker
