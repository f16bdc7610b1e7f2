#include "selection/front_door/engine_call.hpp"

#include <optional>

#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <fmt/format.h>

#include "messages/http_url.hpp"
#include "selection/front_door/tcp_options.hpp"

namespace kvr::front_door {
namespace {

namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;

class EngineCall : public std::enable_shared_from_this<EngineCall> {
 public:
  EngineCall(net::any_io_executor executor, EngineCallRequest request,
             std::function<void(EngineAnswer)> done)
      : request_(std::move(request)),
        done_(std::move(done)),
        resolver_(executor),
        stream_(executor) {}

  void start() {
    const auto url = split_http_url(request_.base_url);
    if (!url) return finish(fmt::format("'{}' is not an HTTP URL", request_.base_url));
    if (url->https) {
      return finish(
          fmt::format("'{}': the front door reaches engines over http:// only", request_.base_url));
    }
    message_.method(http::verb::post);
    message_.target(url->path + request_.path);
    message_.set(http::field::host, url->host + ":" + url->port);
    message_.set(http::field::content_type, "application/json");
    message_.set(http::field::user_agent, "kvr");
    message_.body() = std::move(request_.body);
    message_.prepare_payload();
    stream_.expires_after(request_.timeout);
    connect_engine(stream_, resolver_, url->host, url->port,
                   [self = shared_from_this()](beast::error_code error, std::string_view what) {
                     if (error)
                       return self->finish(fmt::format("cannot {}: {}", what, error.message()));
                     self->write();
                   });
  }

 private:
  void write() {
    http::async_write(stream_, message_,
                      [self = shared_from_this()](beast::error_code error, std::size_t) {
                        if (error) return self->finish("cannot send: " + error.message());
                        self->read();
                      });
  }

  void read() {
    buffer_.reserve(16 * 1024);  // a fresh buffer reads 512 bytes at a time; answers run to 100 KB
    parser_.emplace();
    parser_->body_limit(request_.max_answer_bytes);
    http::async_read(stream_, buffer_, *parser_,
                     [self = shared_from_this()](beast::error_code error, std::size_t) {
                       if (error) return self->finish("no answer: " + error.message());
                       EngineAnswer answer;
                       answer.status = self->parser_->get().result_int();
                       answer.body = std::move(self->parser_->get().body());
                       self->finish(std::move(answer));
                     });
  }

  void finish(std::string failure) { finish(EngineAnswer{.failure = std::move(failure)}); }

  void finish(EngineAnswer answer) {
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream_.close();
    if (auto done = std::exchange(done_, nullptr)) done(std::move(answer));
  }

  EngineCallRequest request_;
  std::function<void(EngineAnswer)> done_;
  tcp::resolver resolver_;
  beast::tcp_stream stream_;
  beast::flat_buffer buffer_;
  http::request<http::string_body> message_;
  std::optional<http::response_parser<http::string_body>> parser_;
};

}  // namespace

void call_engine(net::any_io_executor executor, EngineCallRequest request,
                 std::function<void(EngineAnswer)> done) {
  std::make_shared<EngineCall>(std::move(executor), std::move(request), std::move(done))->start();
}

}  // namespace kvr::front_door
