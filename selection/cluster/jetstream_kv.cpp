#include "selection/cluster/jetstream_kv.hpp"

#include <nats/nats.h>

namespace kvr::cluster {
namespace {

constexpr std::string_view kJetStreamNotEnabled =
    "JetStream is not enabled on the NATS server (start it with -js)";

// The client's description of the failed call: its thread-local last error names the server's
// reason ("wrong last sequence: 7", "max age needs to be >= 100ms").
std::string last_error_text(natsStatus status) {
  const char* text = nats_GetLastError(nullptr);
  std::string message = natsStatus_GetText(status);
  if (text != nullptr && text[0] != '\0') {
    message += ": ";
    message += text;
  }
  return message;
}

bool contains(std::string_view text, std::string_view part) {
  return text.find(part) != std::string_view::npos;
}

// Maps a failed nats.c call to an error. `conflict` is the code a failed compare-and-set means
// for this call (already_exists for create, wrong_revision for update): nats.c reports the
// server's JetStream error 10071 only as NATS_ERR with the text "wrong last sequence".
KvError error_of(natsStatus status, std::string_view what,
                 KvErrorCode conflict = KvErrorCode::server) {
  std::string text = last_error_text(status);
  auto make = [&](KvErrorCode code) { return KvError{code, std::string{what} + ": " + text}; };
  switch (status) {
    case NATS_NOT_FOUND:
      return make(KvErrorCode::not_found);
    case NATS_TIMEOUT:
      return make(KvErrorCode::timeout);
    case NATS_NO_RESPONDERS:
      // Nothing answers the JetStream API subjects: the server runs without -js.
      return KvError{KvErrorCode::jetstream_not_enabled,
                     std::string{kJetStreamNotEnabled} + " (" + std::string{what} + ")"};
    case NATS_CONNECTION_CLOSED:
    case NATS_CONNECTION_DISCONNECTED:
    case NATS_STALE_CONNECTION:
    case NATS_NOT_YET_CONNECTED:
      return make(KvErrorCode::connection);
    case NATS_INVALID_ARG:
    case NATS_INVALID_SUBJECT:
      return make(KvErrorCode::invalid_argument);
    default:
      break;
  }
  if (contains(text, "wrong last sequence")) return make(conflict);
  if (contains(text, "not enabled")) {
    return KvError{KvErrorCode::jetstream_not_enabled,
                   std::string{kJetStreamNotEnabled} + " (" + text + ")"};
  }
  if (contains(text, "max age") || contains(text, "invalid")) {
    return make(KvErrorCode::invalid_argument);
  }
  return make(KvErrorCode::server);
}

int length_of(std::string_view value) { return static_cast<int>(value.size()); }

}  // namespace

std::string_view as_str(KvErrorCode code) {
  switch (code) {
    case KvErrorCode::not_found:
      return "not_found";
    case KvErrorCode::already_exists:
      return "already_exists";
    case KvErrorCode::wrong_revision:
      return "wrong_revision";
    case KvErrorCode::jetstream_not_enabled:
      return "jetstream_not_enabled";
    case KvErrorCode::invalid_argument:
      return "invalid_argument";
    case KvErrorCode::timeout:
      return "timeout";
    case KvErrorCode::connection:
      return "connection";
    case KvErrorCode::server:
      return "server";
  }
  return "server";
}

struct JetStreamKv::Handles {
  jsCtx* js = nullptr;
  kvStore* kv = nullptr;
  std::chrono::milliseconds timeout{0};

  Handles() = default;
  Handles(const Handles&) = delete;
  Handles& operator=(const Handles&) = delete;
  ~Handles() {
    if (kv != nullptr) kvStore_Destroy(kv);
    if (js != nullptr) jsCtx_Destroy(js);
  }
};

std::expected<std::unique_ptr<JetStreamKv>, KvError> JetStreamKv::open_or_create(
    natsConnection* connection, const KvBucketOptions& options) {
  if (connection == nullptr) {
    return std::unexpected(KvError{KvErrorCode::invalid_argument, "no NATS connection"});
  }
  if (options.ttl.count() != 0 && options.ttl < std::chrono::milliseconds(100)) {
    return std::unexpected(
        KvError{KvErrorCode::invalid_argument,
                "bucket '" + options.bucket + "': a TTL must be at least 100 ms"});
  }
  auto handles = std::make_unique<Handles>();
  handles->timeout = options.timeout;
  jsOptions js_options;
  jsOptions_Init(&js_options);
  js_options.Wait = options.timeout.count();
  if (natsStatus status = natsConnection_JetStream(&handles->js, connection, &js_options);
      status != NATS_OK) {
    return std::unexpected(error_of(status, "cannot start a JetStream context"));
  }
  const std::string what = "bucket '" + options.bucket + "'";
  natsStatus status = js_KeyValue(&handles->kv, handles->js, options.bucket.c_str());
  if (status == NATS_NOT_FOUND) {
    kvConfig config;
    kvConfig_Init(&config);
    config.Bucket = options.bucket.c_str();
    config.History = 1;
    // nats.c hands TTL to the server as the stream's MaxAge, which JetStream counts in
    // nanoseconds (jetstream_kv_test checks a key ages out after the TTL).
    config.TTL = std::chrono::nanoseconds(options.ttl).count();
    config.StorageType = options.memory_storage ? js_MemoryStorage : js_FileStorage;
    status = js_CreateKeyValue(&handles->kv, handles->js, &config);
    // Another node created it first, possibly with other settings: use theirs.
    if (status != NATS_OK && contains(last_error_text(status), "already in use")) {
      status = js_KeyValue(&handles->kv, handles->js, options.bucket.c_str());
    }
    if (status != NATS_OK) return std::unexpected(error_of(status, "cannot create " + what));
  } else if (status != NATS_OK) {
    return std::unexpected(error_of(status, "cannot open " + what));
  }

  jsStreamInfo* info = nullptr;
  jsErrCode js_error{};
  const std::string stream = "KV_" + options.bucket;
  if (status = js_GetStreamInfo(&info, handles->js, stream.c_str(), nullptr, &js_error);
      status != NATS_OK) {
    return std::unexpected(error_of(status, "cannot read the settings of " + what));
  }
  const auto ttl = std::chrono::duration_cast<std::chrono::milliseconds>(
      std::chrono::nanoseconds(info->Config->MaxAge));
  jsStreamInfo_Destroy(info);
  return std::unique_ptr<JetStreamKv>{new JetStreamKv(std::move(handles), options.bucket, ttl)};
}

JetStreamKv::JetStreamKv(std::unique_ptr<Handles> handles, std::string bucket,
                         std::chrono::milliseconds ttl)
    : handles_(std::move(handles)), bucket_(std::move(bucket)), ttl_(ttl) {}

JetStreamKv::~JetStreamKv() = default;

std::expected<KvEntry, KvError> JetStreamKv::get(std::string_view key) {
  const std::string name{key};
  kvEntry* entry = nullptr;
  if (natsStatus status = kvStore_Get(&entry, handles_->kv, name.c_str()); status != NATS_OK) {
    return std::unexpected(error_of(status, "get '" + name + "' in " + bucket_));
  }
  KvEntry result;
  const auto* data = static_cast<const char*>(kvEntry_Value(entry));
  result.value.assign(data != nullptr ? data : "",
                      static_cast<std::size_t>(kvEntry_ValueLen(entry)));
  result.revision = kvEntry_Revision(entry);
  kvEntry_Destroy(entry);
  return result;
}

std::expected<std::uint64_t, KvError> JetStreamKv::create(std::string_view key,
                                                          std::string_view value) {
  const std::string name{key};
  std::uint64_t revision = 0;
  if (natsStatus status =
          kvStore_Create(&revision, handles_->kv, name.c_str(), value.data(), length_of(value));
      status != NATS_OK) {
    return std::unexpected(
        error_of(status, "create '" + name + "' in " + bucket_, KvErrorCode::already_exists));
  }
  return revision;
}

std::expected<std::uint64_t, KvError> JetStreamKv::update(std::string_view key,
                                                          std::string_view value,
                                                          std::uint64_t expected_revision) {
  const std::string name{key};
  // nats.c reads revision 0 as "no expectation": an update over it would be a plain put.
  if (expected_revision == 0) {
    return std::unexpected(
        KvError{KvErrorCode::invalid_argument, "update '" + name + "': revision 0 is no revision"});
  }
  std::uint64_t revision = 0;
  if (natsStatus status = kvStore_Update(&revision, handles_->kv, name.c_str(), value.data(),
                                         length_of(value), expected_revision);
      status != NATS_OK) {
    return std::unexpected(
        error_of(status, "update '" + name + "' in " + bucket_, KvErrorCode::wrong_revision));
  }
  return revision;
}

std::expected<std::uint64_t, KvError> JetStreamKv::put(std::string_view key,
                                                       std::string_view value) {
  const std::string name{key};
  std::uint64_t revision = 0;
  if (natsStatus status =
          kvStore_Put(&revision, handles_->kv, name.c_str(), value.data(), length_of(value));
      status != NATS_OK) {
    return std::unexpected(error_of(status, "put '" + name + "' in " + bucket_));
  }
  return revision;
}

std::expected<void, KvError> JetStreamKv::erase(std::string_view key) {
  const std::string name{key};
  if (natsStatus status = kvStore_Delete(handles_->kv, name.c_str()); status != NATS_OK) {
    return std::unexpected(error_of(status, "delete '" + name + "' in " + bucket_));
  }
  return {};
}

std::expected<std::vector<std::string>, KvError> JetStreamKv::keys() {
  kvWatchOptions watch_options;
  kvWatchOptions_Init(&watch_options);
  watch_options.Timeout = handles_->timeout.count();
  kvKeysList list{};
  natsStatus status = kvStore_Keys(&list, handles_->kv, &watch_options);
  // Older clients report an empty bucket as "not found".
  if (status == NATS_NOT_FOUND) return std::vector<std::string>{};
  if (status != NATS_OK) return std::unexpected(error_of(status, "list the keys of " + bucket_));
  std::vector<std::string> keys;
  keys.reserve(static_cast<std::size_t>(list.Count));
  for (int i = 0; i < list.Count; ++i) keys.emplace_back(list.Keys[i]);
  kvKeysList_Destroy(&list);
  return keys;
}

}  // namespace kvr::cluster
