#include "messages/nats/nats_client.hpp"

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <vector>

#include <nats/nats.h>

#include "messages/nats/redact.hpp"
#include "messages/nats/socket_loop.hpp"

namespace kvr::nats {
namespace {

std::string describe(natsStatus status, std::string_view what) {
  std::string message{what};
  message += ": ";
  message += natsStatus_GetText(status);
  // The thread-local error stack often names the underlying cause (file, TLS, auth).
  char stack[512] = {};
  if (nats_GetLastErrorStack(stack, sizeof(stack)) == NATS_OK && stack[0] != '\0') {
    message += " (";
    message += stack;
    message += ")";
  }
  return message;
}

// Owns a natsOptions while a connection is being set up.
struct OptionsDeleter {
  void operator()(natsOptions* options) const { natsOptions_Destroy(options); }
};
using OptionsPtr = std::unique_ptr<natsOptions, OptionsDeleter>;

NatsMessage copy_message(natsMsg* message) {
  NatsMessage copy;
  copy.subject = natsMsg_GetSubject(message);
  if (const char* reply = natsMsg_GetReply(message); reply != nullptr) copy.reply = reply;
  copy.data.assign(natsMsg_GetData(message),
                   static_cast<std::size_t>(natsMsg_GetDataLength(message)));
  return copy;
}

NatsMessage take_message(natsMsg* message) {
  NatsMessage copy = copy_message(message);
  natsMsg_Destroy(message);
  return copy;
}

int to_int(std::size_t size) { return static_cast<int>(size); }

// Runs a nats.c publish call through the socket loop when the client has one (it writes now, or
// defers), else as it is.
template <typename Send>
natsStatus send_through(SocketLoop* loop, natsConnection* connection, bool deferred, Send&& send) {
  return loop != nullptr ? loop->publish(connection, deferred, std::forward<Send>(send)) : send();
}

std::string terminated(std::string_view text) { return std::string{text}; }

}  // namespace

struct NatsClient::Callbacks {
  NatsEventHandlers handlers;
  std::atomic<std::uint64_t> reconnects{0};
  // The client calls the closed handler on its own thread after natsConnection_Close returns;
  // until then this object must stay alive.
  std::mutex mutex;
  std::condition_variable closed_signal;
  bool closed = false;
};

struct NatsSubscription::State {
  natsSubscription* subscription = nullptr;
  std::function<void(NatsMessage)> handler;
  // Delivered messages, already copied, freed in batches: nats.c frees a message on its
  // collector thread and wakes that thread whenever it is idle, which at thousands of messages
  // per second is a cross-core wakeup per message. At most 32 messages or 256 KiB stay
  // allocated between deliveries. Only the subscription's delivery thread touches these (a
  // subscription's callbacks never overlap), and the destructor once the handler completed.
  static constexpr std::size_t kRetiredMessages = 32;
  static constexpr std::size_t kRetiredBytes = 256 * 1024;
  std::vector<natsMsg*> retired;
  std::size_t retired_bytes = 0;

  void retire(natsMsg* message) {
    retired.push_back(message);
    retired_bytes += static_cast<std::size_t>(natsMsg_GetDataLength(message));
    if (retired.size() >= kRetiredMessages || retired_bytes >= kRetiredBytes) free_retired();
  }
  void free_retired() {
    for (natsMsg* message : retired) natsMsg_Destroy(message);
    retired.clear();
    retired_bytes = 0;
  }
  // Set by the client once the subscription is closed and its handler has returned for the last
  // time; only then may the handler's state be freed.
  std::mutex mutex;
  std::condition_variable completed_signal;
  bool completed = false;
};

NatsSubscription::NatsSubscription(std::unique_ptr<State> state) : state_(std::move(state)) {}
NatsSubscription::NatsSubscription(NatsSubscription&&) noexcept = default;
NatsSubscription& NatsSubscription::operator=(NatsSubscription&& other) noexcept {
  if (this != &other) {
    NatsSubscription discarded{std::move(*this)};
    state_ = std::move(other.state_);
  }
  return *this;
}

NatsSubscription::~NatsSubscription() {
  if (state_ && state_->subscription != nullptr) {
    // A handler may be running on a delivery thread: wait for the client's completion callback
    // before freeing what the handler uses. Bounded, so a wedged client cannot hang shutdown.
    const bool unsubscribed = natsSubscription_Unsubscribe(state_->subscription) == NATS_OK;
    std::unique_lock lock{state_->mutex};
    if (unsubscribed) {
      state_->completed_signal.wait_for(lock, std::chrono::seconds(5),
                                        [this] { return state_->completed; });
    }
    // (A closed connection completes its subscriptions too.) A handler that never completed
    // may still retire messages: leak them rather than race.
    if (state_->completed) state_->free_retired();
    lock.unlock();
    natsSubscription_Destroy(state_->subscription);
  }
}

std::int64_t NatsSubscription::dropped() const {
  int64_t dropped = 0;
  if (state_ && state_->subscription != nullptr) {
    natsSubscription_GetDropped(state_->subscription, &dropped);
  }
  return dropped;
}

std::expected<std::unique_ptr<NatsClient>, std::string> NatsClient::connect(
    const NatsOptions& options, NatsEventHandlers handlers) {
  auto client = connect_as_given(options, std::move(handlers));
  if (client) return client;
  // The URL and the library's error text may both carry the credentials.
  std::vector<std::string> secrets = url_secrets(options.url);
  secrets.push_back(options.password);
  secrets.push_back(options.token);
  return std::unexpected(redact(std::move(client.error()), secrets));
}

std::expected<std::unique_ptr<NatsClient>, std::string> NatsClient::connect_as_given(
    const NatsOptions& options, NatsEventHandlers handlers) {
  natsOptions* raw_options = nullptr;
  if (natsStatus status = natsOptions_Create(&raw_options); status != NATS_OK) {
    return std::unexpected(describe(status, "cannot create NATS options"));
  }
  OptionsPtr opts{raw_options};
  auto callbacks = std::make_unique<Callbacks>();
  callbacks->handlers = std::move(handlers);
  Callbacks* closure = callbacks.get();

  auto check = [](natsStatus status, std::string_view what) -> std::expected<void, std::string> {
    if (status != NATS_OK) return std::unexpected(describe(status, what));
    return {};
  };
  const std::string url = options.url;
  std::expected<void, std::string> set =
      check(natsOptions_SetURL(opts.get(), url.c_str()), "invalid NATS url '" + url + "'");
  if (set && !options.name.empty()) {
    set = check(natsOptions_SetName(opts.get(), options.name.c_str()), "invalid connection name");
  }
  if (set && (!options.user.empty() || !options.password.empty())) {
    set = check(natsOptions_SetUserInfo(opts.get(), options.user.c_str(), options.password.c_str()),
                "invalid NATS user credentials");
  }
  if (set && !options.token.empty()) {
    set = check(natsOptions_SetToken(opts.get(), options.token.c_str()), "invalid NATS token");
  }
  const bool tls =
      !options.tls_ca_file.empty() || !options.tls_cert_file.empty() || options.tls_skip_verify;
  if (set && tls) set = check(natsOptions_SetSecure(opts.get(), true), "cannot enable TLS");
  if (set && !options.tls_ca_file.empty()) {
    set = check(natsOptions_LoadCATrustedCertificates(opts.get(), options.tls_ca_file.c_str()),
                "cannot load TLS CA file '" + options.tls_ca_file + "'");
  }
  if (set && !options.tls_cert_file.empty()) {
    set = check(natsOptions_LoadCertificatesChain(opts.get(), options.tls_cert_file.c_str(),
                                                  options.tls_key_file.c_str()),
                "cannot load TLS certificate '" + options.tls_cert_file + "'");
  }
  if (set && options.tls_skip_verify) {
    set = check(natsOptions_SkipServerVerification(opts.get(), true), "cannot skip TLS verify");
  }
  if (set) {
    set = check(natsOptions_SetReconnectWait(opts.get(), options.reconnect_wait.count()),
                "invalid reconnect wait");
  }
  if (set) {
    set = check(natsOptions_SetMaxReconnect(opts.get(), options.max_reconnects), "bad reconnects");
  }
  if (set) {
    set = check(natsOptions_SetTimeout(opts.get(), options.connect_timeout.count()),
                "invalid connect timeout");
  }
  // kvr's socket loop writes where the publisher says, so nats.c needs no flusher thread.
  std::unique_ptr<SocketLoop> loop;
  if (set && options.deferred_publish && !tls) {
    auto started = SocketLoop::start();
    if (!started) return std::unexpected("cannot start the NATS socket loop: " + started.error());
    loop = std::move(*started);
    set = check(loop->install(opts.get()), "cannot install the NATS socket loop");
  }
  if (set) {
    set = check(natsOptions_SetSendAsap(opts.get(), options.send_asap || loop != nullptr),
                "send asap");
  }
  if (set) {
    set = check(natsOptions_SetMaxPendingMsgs(opts.get(), options.max_pending_messages),
                "invalid max pending messages");
  }
  if (set && options.use_global_message_delivery) {
    set = check(natsOptions_UseGlobalMessageDelivery(opts.get(), true), "global delivery");
  }
  if (set && options.retry_on_failed_connect) {
    set = check(natsOptions_SetRetryOnFailedConnect(opts.get(), true, nullptr, nullptr),
                "cannot retry on failed connect");
  }
  if (set) {
    set = check(natsOptions_SetDisconnectedCB(
                    opts.get(),
                    [](natsConnection*, void* data) {
                      auto* cb = static_cast<Callbacks*>(data);
                      if (cb->handlers.on_disconnected) cb->handlers.on_disconnected();
                    },
                    closure),
                "disconnect callback");
  }
  if (set) {
    set = check(natsOptions_SetReconnectedCB(
                    opts.get(),
                    [](natsConnection*, void* data) {
                      auto* cb = static_cast<Callbacks*>(data);
                      cb->reconnects.fetch_add(1, std::memory_order_relaxed);
                      if (cb->handlers.on_reconnected) cb->handlers.on_reconnected();
                    },
                    closure),
                "reconnect callback");
  }
  if (set) {
    set = check(natsOptions_SetClosedCB(
                    opts.get(),
                    [](natsConnection*, void* data) {
                      auto* cb = static_cast<Callbacks*>(data);
                      if (cb->handlers.on_closed) cb->handlers.on_closed();
                      std::lock_guard lock{cb->mutex};
                      cb->closed = true;
                      cb->closed_signal.notify_all();
                    },
                    closure),
                "closed callback");
  }
  if (set) {
    set = check(natsOptions_SetErrorHandler(
                    opts.get(),
                    [](natsConnection*, natsSubscription*, natsStatus status, void* data) {
                      auto* cb = static_cast<Callbacks*>(data);
                      if (cb->handlers.on_error) cb->handlers.on_error(natsStatus_GetText(status));
                    },
                    closure),
                "error callback");
  }
  if (!set) return std::unexpected(set.error());

  natsConnection* connection = nullptr;
  if (natsStatus status = natsConnection_Connect(&connection, opts.get());
      status != NATS_OK && !(status == NATS_NOT_YET_CONNECTED && options.retry_on_failed_connect)) {
    return std::unexpected(describe(status, "cannot connect to NATS at " + url));
  }
  return std::unique_ptr<NatsClient>(
      new NatsClient(connection, std::move(callbacks), std::move(loop)));
}

NatsClient::NatsClient(natsConnection* connection, std::unique_ptr<Callbacks> callbacks,
                       std::unique_ptr<SocketLoop> loop)
    : connection_(connection), callbacks_(std::move(callbacks)), loop_(std::move(loop)) {}

NatsClient::~NatsClient() {
  // nats.c writes its buffer while closing only when it owns the socket: write what deferred
  // publishes left first.
  if (loop_) loop_->flush(connection_);
  natsConnection_Close(connection_);
  // Connection callbacks run on the client's own thread, the closed one last: wait for it
  // before freeing what they use. Should it never come, leak the callbacks rather than risk a
  // use after free.
  bool closed = false;
  {
    std::unique_lock lock{callbacks_->mutex};
    closed = callbacks_->closed_signal.wait_for(lock, std::chrono::seconds(5),
                                                [this] { return callbacks_->closed; });
  }
  // The loop reads and writes for the connection until here; it stops before the connection is
  // freed. Unclosed, nats.c may still call into it: leak it with the callbacks.
  if (loop_) loop_->stop();
  natsConnection_Destroy(connection_);
  if (!closed) {
    static_cast<void>(callbacks_.release());
    static_cast<void>(loop_.release());
  }
}

std::expected<void, std::string> NatsClient::publish_on(std::string_view subject,
                                                        std::string_view data, bool deferred) {
  const std::string subject_text = terminated(subject);
  auto send = [&] {
    return natsConnection_Publish(connection_, subject_text.c_str(), data.data(),
                                  to_int(data.size()));
  };
  if (natsStatus status = send_through(loop_.get(), connection_, deferred, send);
      status != NATS_OK) {
    return std::unexpected(describe(status, "publish on " + subject_text));
  }
  return {};
}

std::expected<void, std::string> NatsClient::publish(std::string_view subject,
                                                     std::string_view data) {
  return publish_on(subject, data, false);
}

std::expected<void, std::string> NatsClient::publish_deferred(std::string_view subject,
                                                              std::string_view data) {
  return publish_on(subject, data, true);
}

void NatsClient::flush_deferred() {
  if (loop_) loop_->flush(connection_);
}

std::expected<void, std::string> NatsClient::publish_request(std::string_view subject,
                                                             std::string_view reply,
                                                             std::string_view data) {
  const std::string subject_text = terminated(subject);
  const std::string reply_text = terminated(reply);
  auto send = [&] {
    return natsConnection_PublishRequest(connection_, subject_text.c_str(), reply_text.c_str(),
                                         data.data(), to_int(data.size()));
  };
  if (natsStatus status = send_through(loop_.get(), connection_, false, send); status != NATS_OK) {
    return std::unexpected(describe(status, "publish request on " + subject_text));
  }
  return {};
}

std::expected<NatsMessage, std::string> NatsClient::request(std::string_view subject,
                                                            std::string_view data,
                                                            std::chrono::milliseconds timeout) {
  const std::string subject_text = terminated(subject);
  natsMsg* reply = nullptr;
  if (natsStatus status = natsConnection_Request(&reply, connection_, subject_text.c_str(),
                                                 data.data(), to_int(data.size()), timeout.count());
      status != NATS_OK) {
    return std::unexpected(describe(status, "request on " + subject_text));
  }
  return take_message(reply);
}

std::expected<NatsSubscription, std::string> NatsClient::subscribe(
    std::string_view subject, std::function<void(NatsMessage)> handler,
    std::string_view queue_group) {
  auto state = std::make_unique<NatsSubscription::State>();
  state->handler = std::move(handler);
  const std::string subject_text = terminated(subject);
  const std::string group_text = terminated(queue_group);
  auto on_message = [](natsConnection*, natsSubscription*, natsMsg* message, void* data) {
    auto* subscription = static_cast<NatsSubscription::State*>(data);
    NatsMessage copy = copy_message(message);
    subscription->retire(message);
    subscription->handler(std::move(copy));
  };
  natsStatus status =
      queue_group.empty()
          ? natsConnection_Subscribe(&state->subscription, connection_, subject_text.c_str(),
                                     on_message, state.get())
          : natsConnection_QueueSubscribe(&state->subscription, connection_, subject_text.c_str(),
                                          group_text.c_str(), on_message, state.get());
  if (status != NATS_OK) return std::unexpected(describe(status, "subscribe to " + subject_text));
  status = natsSubscription_SetOnCompleteCB(
      state->subscription,
      [](void* data) {
        auto* done = static_cast<NatsSubscription::State*>(data);
        std::lock_guard lock{done->mutex};
        done->completed = true;
        done->completed_signal.notify_all();
      },
      state.get());
  if (status != NATS_OK) {
    natsSubscription_Destroy(state->subscription);
    return std::unexpected(describe(status, "subscribe to " + subject_text));
  }
  return NatsSubscription{std::move(state)};
}

std::expected<void, std::string> NatsClient::flush(std::chrono::milliseconds timeout) {
  if (natsStatus status = natsConnection_FlushTimeout(connection_, timeout.count());
      status != NATS_OK) {
    return std::unexpected(describe(status, "flush"));
  }
  return {};
}

std::string NatsClient::new_inbox() const {
  natsInbox* inbox = nullptr;
  if (natsInbox_Create(&inbox) != NATS_OK) return "_INBOX.kvr";
  std::string text = inbox;
  natsInbox_Destroy(inbox);
  return text;
}

bool NatsClient::connected() const {
  return natsConnection_Status(connection_) == NATS_CONN_STATUS_CONNECTED;
}

std::size_t NatsClient::max_payload() const {
  const std::int64_t limit = natsConnection_GetMaxPayload(connection_);
  return limit > 0 ? static_cast<std::size_t>(limit) : 0;
}

std::uint64_t NatsClient::reconnects() const {
  return callbacks_->reconnects.load(std::memory_order_relaxed);
}

}  // namespace kvr::nats
