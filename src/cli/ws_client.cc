#include "cli/ws_client.h"

#include <signal.h>
#include <unistd.h>

#include <array>
#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/beast/core/buffers_to_string.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/websocket.hpp>
#include <boost/json.hpp>
#include <cerrno>

#include "absl/strings/str_cat.h"

namespace esb::cli {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace websocket = boost::beast::websocket;
using tcp = asio::ip::tcp;
using Clock = std::chrono::steady_clock;

namespace {
// The largest message accepted from the daemon.
constexpr size_t kMaxMessageBytes = 16u << 20;
}  // namespace

struct WebSocketClient::Impl {
  asio::io_context ioc;
  websocket::stream<tcp::socket> ws{ioc};
  beast::flat_buffer rbuf;
  bool reading = false;
  bool closed = false;
  beast::error_code read_ec;
  std::deque<Message> inbox;
  // Interactive mode: messages go here instead of the inbox.
  std::function<void(Message)> on_message;
  std::deque<std::pair<std::string, bool>> outbox;
  bool writing = false;
  bool write_failed = false;
  uint64_t writes_done = 0, writes_queued = 0;

  void StartRead() {
    if (reading || closed) return;
    reading = true;
    ws.async_read(rbuf, [this](beast::error_code ec, size_t) {
      reading = false;
      if (ec) {
        closed = true;
        read_ec = ec;
        return;
      }
      Message m{beast::buffers_to_string(rbuf.data()), ws.got_binary()};
      rbuf.consume(rbuf.size());
      if (on_message) {
        on_message(std::move(m));
        StartRead();
      } else {
        inbox.push_back(std::move(m));
      }
    });
  }

  void Queue(std::string data, bool binary) {
    outbox.emplace_back(std::move(data), binary);
    ++writes_queued;
    PumpWrite();
  }
  void PumpWrite() {
    if (writing || outbox.empty() || write_failed || closed) return;
    writing = true;
    ws.binary(outbox.front().second);
    ws.async_write(asio::buffer(outbox.front().first), [this](beast::error_code ec, size_t) {
      writing = false;
      outbox.pop_front();
      ++writes_done;
      if (ec) {
        write_failed = true;
        return;
      }
      PumpWrite();
    });
  }

  // Runs the io_context until `done()` or the deadline; false at the deadline.
  template <typename Pred>
  bool RunUntil(Pred done, Clock::time_point deadline) {
    while (!done()) {
      if (ioc.stopped()) ioc.restart();
      const Clock::time_point now = Clock::now();
      if (now >= deadline) return false;
      ioc.run_one_for(deadline - now);
    }
    return true;
  }
};

WebSocketClient::WebSocketClient(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

WebSocketClient::~WebSocketClient() {
  beast::error_code ec;
  impl_->ws.next_layer().close(ec);
}

absl::StatusOr<std::unique_ptr<WebSocketClient>> WebSocketClient::Connect(
    const Endpoint& endpoint, const std::string& target,
    const std::vector<std::pair<std::string, std::string>>& headers,
    std::chrono::milliseconds timeout, Refusal* refusal) {
  auto impl = std::make_unique<Impl>();
  const Clock::time_point deadline = Clock::now() + timeout;
  tcp::resolver resolver(impl->ioc);
  beast::error_code ec;
  auto results = resolver.resolve(endpoint.host, endpoint.port, ec);
  if (ec)
    return absl::UnavailableError(absl::StrCat("cannot connect to esbd at ", endpoint.url,
                                               ": cannot resolve host '", endpoint.host,
                                               "': ", ec.message()));
  bool connected = false;
  asio::async_connect(impl->ws.next_layer(), results,
                      [&](beast::error_code e, const tcp::endpoint&) {
                        ec = e;
                        connected = true;
                      });
  if (!impl->RunUntil([&] { return connected; }, deadline) || ec) {
    std::string why = !connected ? "timed out"
                      : ec == asio::error::connection_refused
                          ? "connection refused (is esbd running? start it with `make run`)"
                          : ec.message();
    return absl::UnavailableError(
        absl::StrCat("cannot connect to esbd at ", endpoint.url, ": ", why));
  }
  impl->ws.set_option(websocket::stream_base::decorator([headers](websocket::request_type& req) {
    req.set(beast::http::field::user_agent, "esb");
    for (const auto& [name, value] : headers) req.set(name, value);
  }));
  impl->ws.read_message_max(kMaxMessageBytes);
  websocket::response_type res;
  bool shaken = false;
  impl->ws.async_handshake(res, endpoint.host_header, endpoint.base_path + target,
                           [&](beast::error_code e) {
                             ec = e;
                             shaken = true;
                           });
  if (!impl->RunUntil([&] { return shaken; }, deadline))
    return absl::DeadlineExceededError(
        absl::StrCat("esbd at ", endpoint.url, " did not answer the WebSocket upgrade in time"));
  if (ec) {
    if (res.result_int() != 0 && res.result_int() != 101) {
      if (refusal != nullptr) {
        refusal->status = res.result_int();
        refusal->body = res.body();
      }
      return absl::FailedPreconditionError(
          absl::StrCat("esbd answered ", res.result_int(), " instead of a WebSocket"));
    }
    return absl::UnavailableError(
        absl::StrCat("WebSocket handshake with esbd at ", endpoint.url, " failed: ", ec.message()));
  }
  return std::unique_ptr<WebSocketClient>(new WebSocketClient(std::move(impl)));
}

absl::Status WebSocketClient::Send(std::string_view data, bool binary,
                                   std::chrono::milliseconds timeout) {
  Impl& s = *impl_;
  if (s.closed || s.write_failed) return absl::UnavailableError("the WebSocket is closed");
  s.Queue(std::string(data), binary);
  const uint64_t mine = s.writes_queued;
  if (!s.RunUntil([&] { return s.writes_done >= mine || s.write_failed || s.closed; },
                  Clock::now() + timeout))
    return absl::DeadlineExceededError("the WebSocket write timed out");
  if (s.write_failed || (s.writes_done < mine))
    return absl::UnavailableError("the WebSocket is closed");
  return absl::OkStatus();
}

absl::StatusOr<WebSocketClient::Message> WebSocketClient::Receive(
    std::chrono::milliseconds timeout) {
  Impl& s = *impl_;
  if (s.inbox.empty()) {
    s.StartRead();
    s.RunUntil([&] { return !s.inbox.empty() || s.closed; }, Clock::now() + timeout);
  }
  if (!s.inbox.empty()) {
    Message m = std::move(s.inbox.front());
    s.inbox.pop_front();
    return m;
  }
  if (s.closed)
    return absl::UnavailableError(absl::StrCat("the WebSocket was closed (code ", close_code(),
                                               close_reason().empty() ? "" : ": ", close_reason(),
                                               ")"));
  return absl::DeadlineExceededError("no message in time");
}

void WebSocketClient::Close(int code, std::chrono::milliseconds timeout) {
  Impl& s = *impl_;
  if (s.closed) return;
  bool done = false;
  s.ws.async_close(websocket::close_reason(static_cast<websocket::close_code>(code)),
                   [&](beast::error_code) { done = true; });
  s.RunUntil([&] { return done; }, Clock::now() + timeout);
  s.closed = true;
}

int WebSocketClient::close_code() const { return static_cast<int>(impl_->ws.reason().code); }

std::string WebSocketClient::close_reason() const {
  return std::string(impl_->ws.reason().reason.c_str());
}

absl::StatusOr<int> WebSocketClient::RunInteractive(const Interactive& io) {
  Impl& s = *impl_;
  auto write_all = [&](std::string_view data) {
    while (!data.empty()) {
      ssize_t n = ::write(io.out_fd, data.data(), data.size());
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return;
      data.remove_prefix(static_cast<size_t>(n));
    }
  };
  s.on_message = [&](Message m) {
    if (m.binary)
      write_all(m.data);
    else if (io.on_control)
      io.on_control(m.data);
  };
  // Keystrokes: a pipe or a terminal through the io_context; a regular file (which epoll
  // cannot watch) is read whole up front.
  asio::posix::stream_descriptor in(s.ioc);
  std::array<char, 4096> ibuf;
  std::function<void()> read_in = [&] {
    in.async_read_some(asio::buffer(ibuf), [&](beast::error_code ec, size_t n) {
      if (ec) {
        // End of the input (a pipe, not a terminal in raw mode): the terminal's EOF character,
        // so a shell reading it ends as it would at a keyboard's ^D.
        if (ec == asio::error::eof) s.Queue(std::string("\x04"), true);
        return;
      }
      s.Queue(std::string(ibuf.data(), n), true);
      read_in();
    });
  };
  if (io.in_fd >= 0) {
    beast::error_code ec;
    int fd = ::dup(io.in_fd);
    if (fd >= 0) in.assign(fd, ec);
    if (fd < 0 || ec) {
      if (fd >= 0 && !in.is_open()) ::close(fd);
      std::string all;
      for (;;) {
        ssize_t n = ::read(io.in_fd, ibuf.data(), ibuf.size());
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        all.append(ibuf.data(), static_cast<size_t>(n));
      }
      if (!all.empty()) s.Queue(std::move(all), true);
    } else {
      read_in();
    }
  }
  asio::signal_set winch(s.ioc);
  std::function<void()> wait_winch = [&] {
    winch.async_wait([&](beast::error_code ec, int) {
      if (ec) return;
      if (std::optional<std::pair<int, int>> size = io.window_size()) {
        s.Queue(boost::json::serialize(boost::json::object{
                    {"type", "resize"}, {"rows", size->first}, {"cols", size->second}}),
                false);
      }
      wait_winch();
    });
  };
  if (io.window_size) {
    winch.add(SIGWINCH);
    wait_winch();
  }
  // Whatever came in before (Receive calls) is delivered first.
  while (!s.inbox.empty()) {
    Message m = std::move(s.inbox.front());
    s.inbox.pop_front();
    s.on_message(std::move(m));
  }
  s.StartRead();
  while (!s.closed) {
    if (s.ioc.stopped()) s.ioc.restart();
    s.ioc.run_one();
  }
  beast::error_code ignored;
  winch.cancel(ignored);
  in.close(ignored);
  // Let the cancelled handlers run before the locals they use go away.
  s.ioc.restart();
  s.ioc.poll();
  s.on_message = nullptr;
  return close_code();
}

}  // namespace esb::cli
