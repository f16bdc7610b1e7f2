// An owning C++ handle over one NATS C client connection: connect with credentials, TLS and
// reconnect settings, publish, request/reply and callback subscriptions. Used by the router
// node's NATS bridge and by `kvr mocker`. Callbacks run on the client's delivery threads: they
// must only decode and hand the data on (to an actor or a queue), never block.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <expected>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

struct __natsConnection;
struct __natsSubscription;

namespace kvr::nats {

class SocketLoop;

/// Connection settings; every field has a safe default for a local nats-server.
struct NatsOptions {
  /// One or more server URLs, comma separated ("nats://127.0.0.1:4222").
  std::string url = "nats://127.0.0.1:4222";
  /// Connection name shown by the server's monitoring.
  std::string name = "kvr";
  std::string user;  ///< user/password credentials (both or neither)
  std::string password;
  std::string token;  ///< token credentials
  /// TLS: any of these turns TLS on; the CA file verifies the server.
  std::string tls_ca_file;
  std::string tls_cert_file;  ///< client certificate (with tls_key_file) for mutual TLS
  std::string tls_key_file;
  bool tls_skip_verify = false;  ///< for tests against self-signed servers only
  /// Wait between reconnect attempts; the client adds jitter.
  std::chrono::milliseconds reconnect_wait{250};
  /// Reconnect attempts before giving up; negative: forever.
  int max_reconnects = -1;
  /// How long the first connect may take.
  std::chrono::milliseconds connect_timeout{2000};
  /// Retry the first connect in the background instead of failing when no server is up yet.
  bool retry_on_failed_connect = false;
  /// Flush every publish at once: lowers request/reply latency from about 1 ms to about 0.2 ms
  /// at some cost in bulk throughput.
  bool send_asap = true;
  /// Pending-message limits per subscription before messages are dropped as a slow consumer.
  int max_pending_messages = 65536;
  /// Deliver every subscription's messages on a shared thread pool instead of one thread per
  /// subscription; for processes with many subscriptions.
  bool use_global_message_delivery = false;
  /// Run the socket on kvr's own loop (socket_loop.hpp) so that publish_deferred() can batch
  /// messages into one write: for a publisher answering bursts of requests. Plain TCP only; a
  /// TLS connection keeps nats.c's own reading thread and treats deferred publishes as publishes.
  bool deferred_publish = false;
};

/// A received message. Owns copies of its subject, reply and payload.
struct NatsMessage {
  std::string subject;
  std::string reply;  ///< empty when the sender expects no reply
  std::string data;
};

/// A subscription; unsubscribes when destroyed. Destroy it before its client.
class NatsSubscription {
 public:
  NatsSubscription(NatsSubscription&&) noexcept;
  NatsSubscription& operator=(NatsSubscription&&) noexcept;
  ~NatsSubscription();

  /// Messages dropped because the handler fell behind (slow consumer).
  std::int64_t dropped() const;

 private:
  friend class NatsClient;
  struct State;
  explicit NatsSubscription(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

/// Connection-level events, delivered on a client thread.
struct NatsEventHandlers {
  std::function<void()> on_disconnected;
  std::function<void()> on_reconnected;
  std::function<void()> on_closed;
  /// Asynchronous errors such as slow consumers: a description of the error.
  std::function<void(std::string_view)> on_error;
};

/// One connection. Thread-safe: any thread may publish.
class NatsClient {
 public:
  /// Connects; the error describes why (unreachable server, bad credentials, TLS files ...), with
  /// any password or token masked.
  static std::expected<std::unique_ptr<NatsClient>, std::string> connect(
      const NatsOptions& options, NatsEventHandlers handlers = {});

  ~NatsClient();
  NatsClient(const NatsClient&) = delete;
  NatsClient& operator=(const NatsClient&) = delete;

  /// Publishes `data` on `subject`; an error when the connection is closed or the subject bad.
  std::expected<void, std::string> publish(std::string_view subject, std::string_view data);
  /// Publishes `data` on `subject` but leaves it in the connection's buffer until
  /// flush_deferred() (or a later publish) writes it, so a burst goes out in one write; the
  /// publisher must call flush_deferred() when the burst ends. Without
  /// NatsOptions::deferred_publish, the same as publish().
  std::expected<void, std::string> publish_deferred(std::string_view subject,
                                                    std::string_view data);
  /// Writes every deferred publish now.
  void flush_deferred();
  /// Publishes with a reply subject.
  std::expected<void, std::string> publish_request(std::string_view subject, std::string_view reply,
                                                   std::string_view data);
  /// Sends a request and waits for one reply (blocking: not for actor threads).
  std::expected<NatsMessage, std::string> request(std::string_view subject, std::string_view data,
                                                  std::chrono::milliseconds timeout);
  /// Subscribes `handler` to `subject`; with a queue group, each message reaches one member.
  std::expected<NatsSubscription, std::string> subscribe(std::string_view subject,
                                                         std::function<void(NatsMessage)> handler,
                                                         std::string_view queue_group = {});
  /// Waits until the server has processed everything published so far.
  std::expected<void, std::string> flush(std::chrono::milliseconds timeout);
  /// A unique subject for replies.
  std::string new_inbox() const;
  /// True while connected (not while reconnecting or closed).
  bool connected() const;
  /// The largest message the server accepts (its max_payload), as its last INFO said.
  std::size_t max_payload() const;
  /// Successful reconnects since connect.
  std::uint64_t reconnects() const;
  /// The nats.c connection, for APIs this class does not wrap (JetStream key-value,
  /// selection/cluster/jetstream_kv.hpp). It stays owned by this client.
  __natsConnection* native_handle() const { return connection_; }

 private:
  /// connect() before its error is redacted of the credentials.
  static std::expected<std::unique_ptr<NatsClient>, std::string> connect_as_given(
      const NatsOptions& options, NatsEventHandlers handlers);
  struct Callbacks;
  NatsClient(__natsConnection* connection, std::unique_ptr<Callbacks> callbacks,
             std::unique_ptr<SocketLoop> loop);
  std::expected<void, std::string> publish_on(std::string_view subject, std::string_view data,
                                              bool deferred);
  __natsConnection* connection_;
  std::unique_ptr<Callbacks> callbacks_;
  std::unique_ptr<SocketLoop> loop_;  ///< with deferred_publish (plain TCP) only
};

}  // namespace kvr::nats
