// What Envoy streams to the endpoint picker (`kvr node --epp-port`) for one HTTP request: a
// sequence of envoy.service.ext_proc.v3.ProcessingRequest messages, each as protobuf's delimited
// form (a varint length, then the message). The picker's reading of them lives inside its gRPC
// reactor (PickerStream in selection/front_door/endpoint_picker.cpp), so this harness follows its
// steps itself: the protocol configuration, the request headers (keys lower-cased, raw_value
// before value), the path, the body's chunks up to the size limit, then the body parsed and the
// routing headers read as the HTTP front door does (openai_checks.hpp), and the response headers'
// status. The body may start with a "%nest ..." line (nesting.hpp). Properties: those of
// openai_checks.hpp, and every refusal's error object is JSON whatever bytes it names.
#include <charconv>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/util/delimited_message_util.h>

#include "envoy/ext_proc.pb.h"
#include "tests/fuzz/harness.hpp"
#include "tests/fuzz/nesting.hpp"
#include "tests/fuzz/openai_checks.hpp"

namespace kvr::fuzz {
namespace {

namespace ext = envoy::service::ext_proc::v3;
using front_door::Endpoint;

// The picker's default body limit (EndpointPickerOptions::max_body_bytes).
constexpr std::size_t kMaxBodyBytes = std::size_t{8} << 20;
// Messages read from one input; a stream is a handful.
constexpr int kMaxMessages = 64;

class PickerStream {
 public:
  // False once the picker is done with the stream: a refusal, or a message out of order.
  bool handle(const ext::ProcessingRequest& message) {
    if (message.observability_mode()) return false;
    if (message.has_protocol_config()) {
      request_mode_ = message.protocol_config().request_body_mode();
    }
    switch (message.request_case()) {
      case ext::ProcessingRequest::kRequestHeaders:
        return on_request_headers(message.request_headers());
      case ext::ProcessingRequest::kRequestBody:
        return on_request_body(message.request_body());
      case ext::ProcessingRequest::kRequestTrailers:
        if (phase_ == Phase::body) return decide();
        return true;
      case ext::ProcessingRequest::kResponseHeaders:
        on_response_headers(message.response_headers());
        return true;
      default:
        return true;
    }
  }

 private:
  enum class Phase : std::uint8_t { headers, body, routed };

  bool full_duplex() const { return request_mode_ == ext::ProcessingMode::FULL_DUPLEX_STREAMED; }

  std::string_view header(std::string_view name) const {
    for (const auto& [key, value] : headers_) {
      if (key == name) return value;
    }
    return {};
  }

  bool refuse(const front_door::HttpError& error) {
    check_error_body(error);
    return false;
  }

  bool on_request_headers(const ext::HttpHeaders& headers) {
    if (phase_ != Phase::headers) return false;
    for (const auto& header : headers.headers().headers()) {
      std::string key = header.key();
      for (char& c : key) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      headers_.emplace_back(std::move(key),
                            header.raw_value().empty() ? header.value() : header.raw_value());
    }
    if (request_mode_ && *request_mode_ != ext::ProcessingMode::BUFFERED && !full_duplex()) {
      return false;
    }
    const std::string path{header(":path").substr(0, header(":path").find('?'))};
    if (path == "/v1/chat/completions") {
      endpoint_ = Endpoint::chat_completions;
    } else if (path == "/v1/completions") {
      endpoint_ = Endpoint::completions;
    } else {
      return refuse(front_door::HttpError{.status = 404,
                                          .message = fmt::format("no endpoint {}", path),
                                          .type = "invalid_request_error",
                                          .code = "unknown_url"});
    }
    if (const auto method = header(":method"); !method.empty() && method != "POST") {
      return refuse(front_door::HttpError{.status = 405,
                                          .message = fmt::format("{} takes POST only", path),
                                          .type = "invalid_request_error"});
    }
    if (headers.end_of_stream()) return false;
    phase_ = Phase::body;
    return true;
  }

  bool on_request_body(const ext::HttpBody& chunk) {
    if (phase_ != Phase::body) return false;
    if (body_.size() + chunk.body().size() > kMaxBodyBytes) return false;
    body_ += chunk.body();
    if (chunk.end_of_stream() || !full_duplex()) return decide();
    return true;
  }

  bool decide() {
    const std::string body = expand_nesting(body_);
    const auto request = check_generation_request(endpoint_, body);
    const auto metadata =
        check_request_metadata([this](std::string_view name) { return header(name); });
    // Routed (as if a worker was picked): the response phase follows on the same stream.
    phase_ = Phase::routed;
    return request && metadata;
  }

  void on_response_headers(const ext::HttpHeaders& headers) {
    for (const auto& header : headers.headers().headers()) {
      if (header.key() != ":status") continue;
      const std::string text = header.raw_value().empty() ? header.value() : header.raw_value();
      unsigned status = 0;
      std::from_chars(text.data(), text.data() + text.size(), status);
    }
  }

  Phase phase_ = Phase::headers;
  std::optional<ext::ProcessingMode::BodySendMode> request_mode_;
  std::vector<std::pair<std::string, std::string>> headers_;
  Endpoint endpoint_ = Endpoint::chat_completions;
  std::string body_;
};

}  // namespace

void epp_request(Input input) {
  google::protobuf::io::CodedInputStream coded{input.data(), static_cast<int>(input.size())};
  PickerStream stream;
  for (int read = 0; read < kMaxMessages; ++read) {
    ext::ProcessingRequest message;
    bool clean_eof = false;
    if (!google::protobuf::util::ParseDelimitedFromCodedStream(&message, &coded, &clean_eof)) {
      return;
    }
    if (!stream.handle(message)) return;
  }
}

}  // namespace kvr::fuzz
