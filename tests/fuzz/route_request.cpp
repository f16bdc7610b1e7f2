// RouteRequest as the node's route subscription reads it: parse, decode_route_request, the error
// reply for a refusal; for an accepted request, the cluster forwarding round trip
// (encode_route_request) must decode again to the same wire form.
#include <google/protobuf/util/message_differencer.h>

#include "selection/wire/route_messages.hpp"
#include "tests/fuzz/harness.hpp"

namespace kvr::fuzz {

void route_request(Input input) {
  const RouteDecodeLimits limits;
  v1::RouteRequest wire;
  if (!wire.ParseFromArray(input.data(), static_cast<int>(input.size()))) {
    // The bridge still answers, quoting whatever request id was read before the failure.
    (void)encode_route_error(wire.request_id(), Error::invalid_request, "not protobuf")
        .SerializeAsString();
    return;
  }
  auto request = decode_route_request(wire, limits);
  if (!request) {
    KVR_FUZZ_CHECK(request.error().code == Error::invalid_request);
    KVR_FUZZ_CHECK(!request.error().message.empty());
    (void)encode_route_error(wire.request_id(), request.error().code, request.error().message)
        .SerializeAsString();
    return;
  }
  const selection::SelectionRequest& selection = request->selection;
  KVR_FUZZ_CHECK(!selection.request_id.empty());
  KVR_FUZZ_CHECK(selection.request_id.size() <= limits.max_id_length);
  KVR_FUZZ_CHECK(!request->partition.model.empty());
  KVR_FUZZ_CHECK(!request->partition.routing_group.empty());
  KVR_FUZZ_CHECK(selection.prompt_tokens > 0);
  KVR_FUZZ_CHECK(selection.prompt_tokens <= limits.max_prompt_tokens);
  KVR_FUZZ_CHECK(selection.block_hashes.size() <= selection.prompt_tokens);
  KVR_FUZZ_CHECK(request->prompt_token_ids.empty() || selection.block_hashes.empty());
  KVR_FUZZ_CHECK(selection.allowed_workers.size() <= limits.max_allowed_workers);
  KVR_FUZZ_CHECK(selection.required_taints.size() <= limits.max_taints);
  KVR_FUZZ_CHECK(selection.preferred_taints.size() <= limits.max_taints);

  // decode(encode(r)) gives r back: the forwarded wire form is a fixed point.
  const v1::RouteRequest encoded = encode_route_request(*request);
  v1::RouteRequest reparsed;
  KVR_FUZZ_CHECK(reparsed.ParseFromString(encoded.SerializeAsString()));
  auto again = decode_route_request(reparsed, limits);
  KVR_FUZZ_CHECK(again.has_value());
  KVR_FUZZ_CHECK(
      google::protobuf::util::MessageDifferencer::Equals(encoded, encode_route_request(*again)));
}

}  // namespace kvr::fuzz
