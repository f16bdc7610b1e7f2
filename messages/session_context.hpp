// Session metadata a routed request may carry (plugin API SessionContext and InputTrigger). Shared
// by the worker-selection and request-classifier plugin APIs, which re-export it.
// The contract: docs/plugin-api.md.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <utility>

namespace kvr {

/// What started a session turn.
enum class InputTrigger { UserMessage, ToolResult, Other };

/// Session metadata a request carried.
class SessionContext {
 public:
  SessionContext(std::string session_id, std::optional<std::string> parent_session_id,
                 std::optional<bool> session_final, std::optional<InputTrigger> input_trigger)
      : session_id_(std::move(session_id)),
        parent_session_id_(std::move(parent_session_id)),
        session_final_(session_final),
        input_trigger_(input_trigger) {}

  std::string_view session_id() const { return session_id_; }
  std::optional<std::string_view> parent_session_id() const {
    if (!parent_session_id_) return std::nullopt;
    return std::string_view{*parent_session_id_};
  }
  /// True: the session ends with this request.
  std::optional<bool> session_final() const { return session_final_; }
  std::optional<InputTrigger> input_trigger() const { return input_trigger_; }

 private:
  std::string session_id_;
  std::optional<std::string> parent_session_id_;
  std::optional<bool> session_final_;
  std::optional<InputTrigger> input_trigger_;
};

}  // namespace kvr
