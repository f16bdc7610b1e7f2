// vLLM's NixlConnector exchange (a request's kv_transfer_params): reading what a request asks of
// the engine and writing a prefill hop's answer. Used by both of `kvr mocker`'s speaks: the NATS
// fleet (mocker_fleet.cpp) and the vLLM-speaking engine (vllm_engine_server.hpp).
#pragma once

#include <cstdint>
#include <expected>
#include <span>
#include <string>
#include <string_view>

#include <nlohmann/json_fwd.hpp>

#include "deploy/simulation/engine.hpp"

namespace kvr::mocker {

/// What a request's kv_transfer_params (vLLM's NixlConnector exchange) asks of the engine; shared
/// by both of `kvr mocker`'s speaks (kvr's GenerateRequest carries the same JSON as a string).
struct KvTransferRequest {
  /// do_remote_decode: remote_decode; do_remote_prefill: remote_prefill; neither: none.
  simulation::KvTransfer kv_transfer = simulation::KvTransfer::none;
  /// remote_prefill: len(remote_block_ids), the blocks the prefill worker holds (0 when null).
  std::uint64_t remote_blocks = 0;
};

/// Reads kv_transfer_params: null for an ordinary request, else an object whose fields have
/// vLLM's types (do_remote_decode and do_remote_prefill booleans, not both true; remote_block_ids
/// a list of block ids; remote_engine_id, remote_request_id, remote_host strings; remote_port,
/// tp_size integers; each may be null). The error names the offending field.
std::expected<KvTransferRequest, std::string> read_kv_transfer_params(const nlohmann::json& params);

/// vLLM's default NIXL side-channel port (VLLM_NIXL_SIDE_CHANNEL_PORT); data-parallel rank r
/// listens on it + r.
inline constexpr std::uint16_t kNixlSideChannelPort = 5600;

/// Where a prefill worker's held KV can be pulled from, as its kv_transfer_params name it.
struct KvTransferSource {
  std::string engine_id;   ///< remote_engine_id
  std::string host;        ///< remote_host
  std::uint16_t port = 0;  ///< remote_port
};

/// The kv_transfer_params a finished do_remote_decode request answers with, as vLLM's
/// NixlConnector returns them: {"do_remote_prefill": true, "do_remote_decode": false,
/// "remote_block_ids": [one id per held block], "remote_engine_id", "remote_request_id",
/// "remote_host", "remote_port", "tp_size": 1}.
nlohmann::json kv_transfer_answer(const KvTransferSource& source, std::string_view request_id,
                                  std::span<const simulation::BlockIndex> blocks);

}  // namespace kvr::mocker
