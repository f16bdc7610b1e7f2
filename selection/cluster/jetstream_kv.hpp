// One NATS JetStream key-value bucket over a connection the caller owns: open or create it with
// a TTL, read, create, compare-and-set, put, erase and list keys. The router cluster keeps its
// members and partition leases in two such buckets. Every call is a blocking request to the
// server bounded by the bucket's timeout: call it from a thread that may block (never from an
// actor's or a NATS delivery thread). Plain C++ over nats.c's KV API.
#pragma once

#include <chrono>
#include <cstdint>
#include <expected>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

struct __natsConnection;

namespace kvr::cluster {

/// Why a key-value call failed.
enum class KvErrorCode : std::uint8_t {
  not_found,              ///< get: no such key (never written, erased or aged out)
  already_exists,         ///< create: the key holds a value
  wrong_revision,         ///< update: the key's revision is not the expected one (or it vanished)
  jetstream_not_enabled,  ///< the server runs without JetStream
  invalid_argument,       ///< a bucket name, key or TTL the server refuses
  timeout,                ///< no answer within the bucket's timeout
  connection,             ///< the connection is closed or reconnecting
  server,                 ///< any other error the server or client reported
};

/// "not_found", "already_exists", ...
std::string_view as_str(KvErrorCode code);

/// An error code and a description for logs.
struct KvError {
  KvErrorCode code = KvErrorCode::server;
  std::string message;
};

/// A key's current value and its revision (the stream sequence of the write; grows bucket-wide).
struct KvEntry {
  std::string value;
  std::uint64_t revision = 0;
};

/// How to open (and, when missing, create) a bucket.
struct KvBucketOptions {
  /// [A-Za-z0-9_-]+
  std::string bucket;
  /// A value ages out this long after it was last written (the stream's MaxAge). At least 100 ms;
  /// zero keeps values forever.
  std::chrono::milliseconds ttl{0};
  /// Bound on every call's wait for the server.
  std::chrono::milliseconds timeout{2000};
  /// In the server's memory instead of its store directory. Off by default: a file bucket
  /// survives a nats-server restart, so nodes carry on with their leases instead of having to
  /// recreate the bucket.
  bool memory_storage = false;
};

/// One bucket. Thread-safe: nats.c's KV calls may be made from several threads. Destroy it
/// before the connection.
class JetStreamKv {
 public:
  /// Opens the bucket, creating it when missing. An existing bucket keeps its own settings
  /// (ttl() reports them). Fails with jetstream_not_enabled when the server has no JetStream.
  static std::expected<std::unique_ptr<JetStreamKv>, KvError> open_or_create(
      __natsConnection* connection, const KvBucketOptions& options);

  ~JetStreamKv();
  JetStreamKv(const JetStreamKv&) = delete;
  JetStreamKv& operator=(const JetStreamKv&) = delete;

  /// The key's value and revision; not_found when it has none.
  std::expected<KvEntry, KvError> get(std::string_view key);
  /// Writes the key only when it holds no value; its new revision, or already_exists.
  std::expected<std::uint64_t, KvError> create(std::string_view key, std::string_view value);
  /// Writes the key only when its revision is `expected_revision` (compare-and-set); the new
  /// revision, or wrong_revision.
  std::expected<std::uint64_t, KvError> update(std::string_view key, std::string_view value,
                                               std::uint64_t expected_revision);
  /// Writes the key whatever it holds; its new revision.
  std::expected<std::uint64_t, KvError> put(std::string_view key, std::string_view value);
  /// Deletes the key (a later create succeeds). Not conditional: never use it on a lease.
  std::expected<void, KvError> erase(std::string_view key);
  /// Every key that holds a value.
  std::expected<std::vector<std::string>, KvError> keys();

  const std::string& bucket() const { return bucket_; }
  /// The bucket's TTL as the server has it (zero: none).
  std::chrono::milliseconds ttl() const { return ttl_; }

 private:
  struct Handles;
  JetStreamKv(std::unique_ptr<Handles> handles, std::string bucket, std::chrono::milliseconds ttl);
  std::unique_ptr<Handles> handles_;
  std::string bucket_;
  std::chrono::milliseconds ttl_;
};

}  // namespace kvr::cluster
