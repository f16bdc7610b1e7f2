// Generate (proxy) mode as the node's subscriptions read it: the same bytes as a GenerateRequest
// (decoded for a NATS client and for an actor client, with the bridge's refusal replies), as a
// GenerateCancel and as a worker's GenerateChunk. The request the node dispatches to a worker
// must decode again to the same route.
#include <google/protobuf/util/message_differencer.h>

#include "selection/wire/generate_messages.hpp"
#include "tests/fuzz/harness.hpp"

namespace kvr::fuzz {
namespace {

void refuse(const v1::GenerateRequest& wire, const RouteFailure& failure) {
  KVR_FUZZ_CHECK(failure.code == Error::invalid_request);
  const std::string& request_id = wire.route().request_id();
  (void)encode_route_error(request_id, failure.code, failure.message).SerializeAsString();
  (void)encode_end_chunk(request_id, 0, StreamEnd{"error", failure.code, failure.message},
                         std::nullopt)
      .SerializeAsString();
}

void generate(Input input) {
  const RouteDecodeLimits limits;
  v1::GenerateRequest wire;
  if (!wire.ParseFromArray(input.data(), static_cast<int>(input.size()))) return;
  auto to_actor = decode_generate_request(wire, limits, StreamTo::actor);
  auto to_subject = decode_generate_request(wire, limits, StreamTo::subject);
  if (!to_subject) refuse(wire, to_subject.error());
  if (!to_actor) {
    refuse(wire, to_actor.error());
    // Streaming to a subject only adds checks.
    KVR_FUZZ_CHECK(!to_subject.has_value());
    return;
  }
  KVR_FUZZ_CHECK(to_actor->stream_subject.empty());
  if (!to_subject) return;
  const std::string& subject = to_subject->stream_subject;
  KVR_FUZZ_CHECK(!subject.empty() && subject.size() <= 2 * limits.max_id_length);
  KVR_FUZZ_CHECK(subject.find_first_of(" \t\r\n*>") == std::string::npos);

  const v1::GenerateRequest dispatched =
      encode_worker_generate_request(*to_subject, 3, "_INBOX.fuzz.7");
  v1::GenerateRequest reparsed;
  KVR_FUZZ_CHECK(reparsed.ParseFromString(dispatched.SerializeAsString()));
  KVR_FUZZ_CHECK(reparsed.dp_rank() == 3 && reparsed.stream_subject() == "_INBOX.fuzz.7");
  auto again = decode_generate_request(reparsed, limits, StreamTo::subject);
  KVR_FUZZ_CHECK(again.has_value());
  KVR_FUZZ_CHECK(google::protobuf::util::MessageDifferencer::Equals(
      encode_route_request(to_subject->route), encode_route_request(again->route)));
}

void cancel_and_chunk(Input input) {
  v1::GenerateCancel cancel;
  if (cancel.ParseFromArray(input.data(), static_cast<int>(input.size()))) {
    (void)cancel.request_id().size();
  }
  v1::GenerateChunk chunk;
  if (!chunk.ParseFromArray(input.data(), static_cast<int>(input.size()))) return;
  const StreamChunk plain = decode_stream_chunk(chunk);
  KVR_FUZZ_CHECK(plain.tokens == static_cast<std::size_t>(chunk.token_ids_size()));
  KVR_FUZZ_CHECK(plain.error.has_value() ==
                 (chunk.has_error() || chunk.finish_reason() == "error"));
  KVR_FUZZ_CHECK(!plain.error || !plain.error->empty());
}

}  // namespace

void generate_request(Input input) {
  generate(input);
  cancel_and_chunk(input);
}

}  // namespace kvr::fuzz
