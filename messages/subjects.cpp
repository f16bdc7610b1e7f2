#include "messages/subjects.hpp"

#include <algorithm>
#include <cctype>

namespace kvr::subjects {
namespace {

std::string under(std::string_view ns, std::string_view suffix) {
  std::string subject;
  subject.reserve(4 + ns.size() + 1 + suffix.size());
  subject.append("kvr.").append(ns).append(".").append(suffix);
  return subject;
}

}  // namespace

std::string partition_token(std::string_view partition) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  std::string token;
  token.reserve(partition.size());
  for (const unsigned char c : partition) {
    if (std::isalnum(c) != 0 || c == '-' || c == '/' || c == '_') {
      token += static_cast<char>(c);
    } else {
      token += '=';
      token += kHex[c >> 4];
      token += kHex[c & 0xF];
    }
  }
  return token;
}

std::string worker_register(std::string_view ns) { return under(ns, "workers.register"); }
std::string worker_heartbeat(std::string_view ns) { return under(ns, "workers.heartbeat"); }
std::string worker_deregister(std::string_view ns) { return under(ns, "workers.deregister"); }
std::string worker_load(std::string_view ns) { return under(ns, "workers.load"); }
std::string worker_discover(std::string_view ns) { return under(ns, "workers.discover"); }
std::string kv_events(std::string_view ns, WorkerId worker) {
  return under(ns, "kv." + std::to_string(worker));
}
std::string kv_events_all(std::string_view ns) { return under(ns, "kv.*"); }
std::string router_route(std::string_view ns) { return under(ns, "router.route"); }
std::string router_shard_load(std::string_view ns) { return under(ns, "router.shard_load"); }
std::string router_partition_route(std::string_view ns, std::string_view partition) {
  return under(ns, "router." + partition_token(partition) + ".route");
}
std::string partition_kv_events(std::string_view ns, std::string_view partition, WorkerId worker) {
  return under(ns, "kv." + partition_token(partition) + "." + std::to_string(worker));
}
std::string partition_kv_events_all(std::string_view ns, std::string_view partition) {
  return under(ns, "kv." + partition_token(partition) + ".*");
}
std::string partition_load(std::string_view ns, std::string_view partition, WorkerId worker) {
  return under(ns, "load." + partition_token(partition) + "." + std::to_string(worker));
}
std::string every_load(std::string_view ns) { return under(ns, "load.>"); }
std::string every_kv_events(std::string_view ns) { return under(ns, "kv.>"); }
std::string partition_load_all(std::string_view ns, std::string_view partition) {
  return under(ns, "load." + partition_token(partition) + ".*");
}
std::string router_generate(std::string_view ns) { return under(ns, "router.generate"); }
std::string router_generate_cancel(std::string_view ns) {
  return under(ns, "router.generate.cancel");
}
std::string router_report(std::string_view ns) { return under(ns, "router.report"); }
std::string worker_generate(std::string_view ns, WorkerId worker) {
  return under(ns, "worker." + std::to_string(worker) + ".generate");
}
std::string worker_dump(std::string_view ns, WorkerId worker) {
  return under(ns, "worker." + std::to_string(worker) + ".dump");
}

bool is_valid_namespace(std::string_view ns) {
  return !ns.empty() && std::ranges::all_of(ns, [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '_' || c == '-';
  });
}

std::string invalid_worker_subject(std::string_view subject) {
  if (subject.empty()) return "empty";
  for (const char c : subject) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte <= 0x20 || byte == 0x7F) return "contains whitespace or a control character";
    if (c == '*' || c == '>') return "contains a wildcard";
  }
  if (subject.front() == '.' || subject.back() == '.' ||
      subject.find("..") != std::string_view::npos) {
    return "has an empty token";
  }
  if (subject.starts_with("_INBOX.")) return "is a reply inbox (_INBOX.)";
  if (subject.front() == '$') return "is a system subject ($)";
  // kvr.<namespace>.<kind>...: the kinds a router subscribes to.
  if (subject.starts_with("kvr.")) {
    const std::string_view rest = subject.substr(4);
    const std::size_t dot = rest.find('.');
    if (dot != std::string_view::npos) {
      const std::string_view after_ns = rest.substr(dot + 1);
      const std::string_view kind = after_ns.substr(0, after_ns.find('.'));
      if (kind == "router" || kind == "workers" || kind == "kv" || kind == "load") {
        return "is in the routers' own subject space (kvr.<namespace>." + std::string{kind} + ".)";
      }
    }
  }
  return {};
}

}  // namespace kvr::subjects
