// Credentials never reach a log line: a NATS URL may carry a password or a token
// ("nats://user:secret@host:4222", "nats://token@host:4222"), and both the URL and the NATS
// library's error text may be printed.
#pragma once

#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kvr::nats {

/// `urls` (one or more, comma separated) with each URL's credentials masked:
/// "nats://user:secret@h:4222" → "nats://user:***@h:4222", "nats://token@h" → "nats://***@h".
std::string redact_urls(std::string_view urls);

/// The passwords and tokens that `urls` carry, in the order they appear.
std::vector<std::string> url_secrets(std::string_view urls);

/// `text` with every occurrence of each non-empty secret replaced by "***".
std::string redact(std::string text, std::span<const std::string> secrets);

}  // namespace kvr::nats
