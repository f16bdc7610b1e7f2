// LifecycleReport as the node's report subscription reads it: parse, decode_lifecycle_report and
// the refusal ack.
#include "selection/wire/route_messages.hpp"
#include "tests/fuzz/harness.hpp"

namespace kvr::fuzz {

void lifecycle_report(Input input) {
  const RouteDecodeLimits limits;
  v1::LifecycleReport wire;
  if (!wire.ParseFromArray(input.data(), static_cast<int>(input.size()))) return;
  auto report = decode_lifecycle_report(wire, limits);
  if (!report) {
    KVR_FUZZ_CHECK(!report.error().empty());
    (void)encode_lifecycle_ack(false, report.error()).SerializeAsString();
    return;
  }
  KVR_FUZZ_CHECK(!report->booking_id.empty() && report->booking_id.size() <= limits.max_id_length);
  KVR_FUZZ_CHECK(report->booking_id == wire.booking_id());
  KVR_FUZZ_CHECK(report->error.size() <= 4 * limits.max_id_length);
  KVR_FUZZ_CHECK(as_str(report->event) != "unknown");
}

}  // namespace kvr::fuzz
