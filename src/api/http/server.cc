// The HTTP/1.1 + WebSocket server of http_server.h on Boost.Beast/Asio. I/O threads (one
// io_context each) accept and own connections while they are idle, sending a header, lingering
// after an answer, or carrying a WebSocket; a bounded worker pool (worker_pool.cc) runs each
// admitted request: before_body, body, handler, answer. See http_server.h for the model and
// docs/design.md ("HTTP server") for why the answer is written by the worker.
#include <arpa/inet.h>
#include <fcntl.h>
#include <linux/sockios.h>
#include <malloc.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <exception>
#include <future>
#include <limits>
#include <list>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "api/http/internal.h"
#include "api/http_server.h"
#include "api/json_util.h"
#include "boost/asio/basic_socket_acceptor.hpp"
#include "boost/asio/buffer.hpp"
#include "boost/asio/error.hpp"
#include "boost/asio/executor_work_guard.hpp"
#include "boost/asio/generic/stream_protocol.hpp"
#include "boost/asio/io_context.hpp"
#include "boost/asio/post.hpp"
#include "boost/asio/steady_timer.hpp"
#include "boost/asio/write.hpp"
#include "boost/beast/core/buffers_to_string.hpp"
#include "boost/beast/core/error.hpp"
#include "boost/beast/core/flat_buffer.hpp"
#include "boost/beast/http.hpp"
#include "boost/beast/websocket.hpp"
#include "common/util.h"

namespace esb::api {
namespace {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = boost::beast::http;
namespace websocket = boost::beast::websocket;
using boost::system::error_code;
using Socket = net::generic::stream_protocol::socket;
using Acceptor = net::basic_socket_acceptor<net::generic::stream_protocol>;

// ---------------------------------------------------------------------------------------------
// Small text helpers

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// Percent-decodes `in`. Returns false on a malformed escape or a decoded NUL byte.
bool PercentDecode(std::string_view in, bool plus_is_space, std::string* out) {
  out->clear();
  out->reserve(in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    char c = in[i];
    if (c == '%') {
      if (i + 2 >= in.size()) return false;
      int hi = HexValue(in[i + 1]);
      int lo = HexValue(in[i + 2]);
      if (hi < 0 || lo < 0) return false;
      char d = static_cast<char>(hi * 16 + lo);
      if (d == '\0') return false;
      out->push_back(d);
      i += 2;
    } else if (c == '+' && plus_is_space) {
      out->push_back(' ');
    } else if (c == '\0') {
      return false;
    } else {
      out->push_back(c);
    }
  }
  return true;
}

// Splits "/a/b/" into decoded segments {"a", "b"}; "/" gives {}. False on bad escapes.
bool SplitPath(std::string_view path, std::vector<std::string>* segments) {
  segments->clear();
  if (path.empty() || path[0] != '/') return false;
  path.remove_prefix(1);
  if (!path.empty() && path.back() == '/') path.remove_suffix(1);
  if (path.empty()) return true;
  for (std::string_view raw : SplitString(path, '/')) {
    std::string seg;
    if (!PercentDecode(raw, false, &seg)) return false;
    segments->push_back(std::move(seg));
  }
  return true;
}

bool ParseQuery(std::string_view q, std::vector<std::pair<std::string, std::string>>* out) {
  for (std::string_view part : SplitString(q, '&', true)) {
    size_t eq = part.find('=');
    std::string key, value;
    if (!PercentDecode(part.substr(0, eq), true, &key)) return false;
    if (eq != std::string_view::npos && !PercentDecode(part.substr(eq + 1), true, &value)) {
      return false;
    }
    out->emplace_back(std::move(key), std::move(value));
  }
  return true;
}

bool HasCrLf(std::string_view s) { return s.find_first_of("\r\n") != std::string_view::npos; }

// ---------------------------------------------------------------------------------------------
// RateWindow: a minimum transfer rate, enforced over consecutive windows of `len_ms` each
// (the first one is the grace period): by the end of each window at least `rate` bytes/s of
// it must have gone through. Consecutive windows rather than one average since the start, so
// that a burst (or a client's large receive buffer absorbing the first megabytes) does not buy
// minutes of trickling afterwards.
class RateWindow {
 public:
  RateWindow(uint64_t rate, int64_t len_ms, int64_t now, uint64_t total)
      : rate_(rate), len_ms_(std::max<int64_t>(len_ms, 1)), start_(now), base_(total) {}
  // False if the window that just ended (now ≥ NextCheck()) fell short; otherwise a new window
  // starts when the old one has ended.
  bool Check(int64_t now, uint64_t total) {
    if (rate_ == 0 || now < start_ + len_ms_) return true;
    uint64_t need = rate_ * static_cast<uint64_t>(now - start_) / 1000;
    if (total - std::min(total, base_) < need) return false;
    start_ = now;
    base_ = total;
    return true;
  }
  // When the current window ends (far in the future without a minimum).
  int64_t NextCheck() const {
    return rate_ == 0 ? std::numeric_limits<int64_t>::max() : start_ + len_ms_;
  }

 private:
  uint64_t rate_;
  int64_t len_ms_;
  int64_t start_;
  uint64_t base_;
};

// ---------------------------------------------------------------------------------------------
// FdStream: a Beast/Asio SyncReadStream + SyncWriteStream over a connected socket fd, where
// every operation waits with poll() against a deadline. A worker uses it on the socket of the
// connection it owns (the connection's I/O thread does not touch the socket meanwhile).

class FdStream {
 public:
  FdStream(int fd, int64_t write_timeout_ms, uint64_t min_write_rate, int64_t rate_grace_ms)
      : fd_(fd),
        write_timeout_ms_(write_timeout_ms),
        min_write_rate_(min_write_rate),
        rate_grace_ms_(rate_grace_ms) {
    int domain = 0;
    socklen_t len = sizeof(domain);
    is_tcp_ = getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &domain, &len) == 0 && domain != AF_UNIX;
  }

  int fd() const { return fd_; }
  // Absolute MonotonicMs() deadline for reads; 0 = none.
  void set_read_deadline(int64_t deadline_ms) { read_deadline_ms_ = deadline_ms; }

  // Bytes the peer has taken off the connection so far: bytes written minus those still queued
  // in the kernel (unsent or unacknowledged), so that a large send buffer absorbing a response
  // does not count as the client having read it.
  uint64_t Delivered() const {
    int queued = 0;
    if (is_tcp_ && ioctl(fd_, SIOCOUTQ, &queued) != 0) queued = 0;
    uint64_t q = static_cast<uint64_t>(std::max(queued, 0));
    return written_ > q ? written_ - q : 0;
  }
  // Starts (on) or ends a minimum-rate check: from now on the peer must take at least
  // min_write_rate bytes/s over every rate_grace_ms window, or writes fail (and the connection
  // is reset). See WriteBudget.
  void StartRateWindow(bool on) {
    rate_on_ = on && min_write_rate_ > 0;
    if (rate_on_) rate_.emplace(min_write_rate_, rate_grace_ms_, MonotonicMs(), Delivered());
  }
  // True if the client took less than the minimum rate over a whole window (RateWindow).
  bool TooSlow(int64_t now) {
    return rate_on_ && now >= rate_->NextCheck() && !rate_->Check(now, Delivered());
  }

  template <class MutableBufferSequence>
  size_t read_some(const MutableBufferSequence& buffers, error_code& ec) {
    for (auto it = net::buffer_sequence_begin(buffers); it != net::buffer_sequence_end(buffers);
         ++it) {
      net::mutable_buffer b(*it);
      if (b.size() > 0) return ReadSome(b.data(), b.size(), ec);
    }
    ec = {};
    return 0;
  }
  template <class MutableBufferSequence>
  size_t read_some(const MutableBufferSequence& buffers) {
    error_code ec;
    size_t n = read_some(buffers, ec);
    if (ec) throw boost::system::system_error(ec);
    return n;
  }

  template <class ConstBufferSequence>
  size_t write_some(const ConstBufferSequence& buffers, error_code& ec) {
    std::array<iovec, 16> iov;
    size_t n = 0;
    for (auto it = net::buffer_sequence_begin(buffers);
         it != net::buffer_sequence_end(buffers) && n < iov.size(); ++it) {
      net::const_buffer b(*it);
      if (b.size() == 0) continue;
      iov[n].iov_base = const_cast<void*>(b.data());
      iov[n].iov_len = b.size();
      ++n;
    }
    if (n == 0) {
      ec = {};
      return 0;
    }
    return WriteSome(iov.data(), n, ec);
  }
  template <class ConstBufferSequence>
  size_t write_some(const ConstBufferSequence& buffers) {
    error_code ec;
    size_t n = write_some(buffers, ec);
    if (ec) throw boost::system::system_error(ec);
    return n;
  }

 private:
  size_t ReadSome(void* data, size_t size, error_code& ec) {
    for (;;) {
      int timeout = -1;
      if (read_deadline_ms_ > 0) {
        int64_t left = read_deadline_ms_ - MonotonicMs();
        if (left <= 0) {
          ec = beast::error::timeout;
          return 0;
        }
        timeout = static_cast<int>(std::min<int64_t>(left, 1 << 30));
      }
      pollfd pfd{fd_, POLLIN, 0};
      int r = poll(&pfd, 1, timeout);
      if (r < 0) {
        if (errno == EINTR) continue;
        ec = error_code(errno, boost::system::system_category());
        return 0;
      }
      if (r == 0) continue;  // re-check the deadline
      ssize_t n = recv(fd_, data, size, MSG_DONTWAIT);
      if (n > 0) {
        ec = {};
        return static_cast<size_t>(n);
      }
      if (n == 0) {
        ec = net::error::eof;
        return 0;
      }
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) continue;
      ec = error_code(errno, boost::system::system_category());
      return 0;
    }
  }

  size_t WriteSome(iovec* iov, size_t n, error_code& ec) {
    const int64_t deadline = MonotonicMs() + write_timeout_ms_;
    for (;;) {
      const int64_t now = MonotonicMs();
      int64_t left = deadline - now;
      if (left <= 0 || TooSlow(now)) {
        // A reader too slow to be served: the close that follows resets the connection, so
        // the kernel drops the unsent bytes at once instead of trickling them out for minutes.
        linger abort{1, 0};
        setsockopt(fd_, SOL_SOCKET, SO_LINGER, &abort, sizeof(abort));
        ec = beast::error::timeout;
        return 0;
      }
      msghdr msg{};
      msg.msg_iov = iov;
      msg.msg_iovlen = n;
      // MSG_NOSIGNAL: a vanished client must give EPIPE, not kill the daemon with SIGPIPE.
      ssize_t w = sendmsg(fd_, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (w >= 0) {
        written_ += static_cast<uint64_t>(w);
        ec = {};
        return static_cast<size_t>(w);
      }
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        ec = error_code(errno, boost::system::system_category());
        return 0;
      }
      // The rate is re-checked at least every 500 ms while the client does not read.
      if (rate_on_) left = std::min<int64_t>(left, 500);
      pollfd pfd{fd_, POLLOUT, 0};
      int r = poll(&pfd, 1, static_cast<int>(std::min<int64_t>(left, 1 << 30)));
      if (r < 0 && errno != EINTR) {
        ec = error_code(errno, boost::system::system_category());
        return 0;
      }
    }
  }

  int fd_;
  int64_t write_timeout_ms_;
  uint64_t min_write_rate_;
  int64_t rate_grace_ms_;
  bool is_tcp_ = false;
  int64_t read_deadline_ms_ = 0;
  uint64_t written_ = 0;  // bytes handed to the kernel
  bool rate_on_ = false;
  std::optional<RateWindow> rate_;
};

// One write of a response (a whole buffered answer, or one chunk of a streamed one) must be
// taken by the client at Options::min_write_bytes_per_second over every min_rate_grace window
// (RateWindow), measured on bytes that actually left the socket (not those a large kernel send
// buffer absorbed). Without it a client that reads a trickle, just enough to make
// progress, would hold the thread and the response's memory for as long as it likes.
class WriteBudget {
 public:
  explicit WriteBudget(FdStream& stream) : stream_(stream) { stream_.StartRateWindow(true); }
  ~WriteBudget() { stream_.StartRateWindow(false); }
  WriteBudget(const WriteBudget&) = delete;
  WriteBudget& operator=(const WriteBudget&) = delete;

 private:
  FdStream& stream_;
};
// How long a connection that was answered and is being closed may keep sending (its bytes are
// read and dropped by its I/O thread), so that the answer is not destroyed by a TCP RST, which the
// kernel sends when a socket is closed with unread data.
constexpr int64_t kLingerMs = 2000;

// Buffered responses up to this size are not counted in the response budget.
constexpr uint64_t kUncountedResponseBytes = 64 << 10;
// Freeing a body or response this large asks for memory to be returned to the system.
constexpr uint64_t kTrimWorthyBytes = 1 << 20;
// The server calls malloc_trim at most this often, and only after such a free.
constexpr int64_t kTrimIntervalMs = 2000;

// How long the server stops accepting after an accept error it cannot resolve at once (out of
// file descriptors with nothing to close, out of kernel memory).
constexpr int64_t kAcceptBackoffMs = 100;

// ---------------------------------------------------------------------------------------------
// Streaming request body

std::string SlowBodyMessage(uint64_t min_rate, int64_t grace_ms) {
  return Cat("request body arrives too slowly (it must arrive at least ", min_rate,
             " bytes/s over every ", grace_ms / 1000.0, " s)");
}

class StreamBodyReader : public BodyReader {
 public:
  StreamBodyReader(FdStream& stream, beast::flat_buffer& buffer,
                   http::request_parser<http::empty_body>&& header_parser, uint64_t cap,
                   int64_t timeout_ms, bool send_continue, uint64_t min_rate, int64_t grace_ms)
      : stream_(stream),
        buffer_(buffer),
        parser_(std::move(header_parser)),
        cap_(cap),
        timeout_ms_(timeout_ms),
        send_continue_(send_continue),
        min_rate_(min_rate),
        grace_ms_(grace_ms),
        rate_(min_rate, grace_ms, MonotonicMs(), 0) {
    parser_.body_limit(cap);
    content_length_ = parser_.content_length() ? std::optional<uint64_t>(*parser_.content_length())
                                               : std::nullopt;
  }

  absl::StatusOr<size_t> Read(char* buf, size_t max) override {
    if (!status_.ok()) return status_;
    if (done_) return 0;
    if (max == 0) return absl::InvalidArgumentError("BodyReader::Read with an empty buffer");
    if (send_continue_) {
      send_continue_ = false;
      static constexpr std::string_view kContinue = "HTTP/1.1 100 Continue\r\n\r\n";
      error_code ec;
      net::write(stream_, net::buffer(kContinue.data(), kContinue.size()), ec);
      if (ec) return Fail(absl::UnavailableError("client disconnected"));
    }
    for (;;) {
      if (parser_.is_done()) {
        done_ = true;
        return 0;
      }
      parser_.get().body().data = buf;
      parser_.get().body().size = max;
      parser_.get().body().more = true;
      if (!rate_.Check(MonotonicMs(), bytes_read_)) {
        return Fail(absl::DeadlineExceededError(SlowBodyMessage(min_rate_, grace_ms_)));
      }
      int64_t deadline = MonotonicMs() + timeout_ms_;
      const int64_t due = rate_.NextCheck();
      const bool rate_bound = due < deadline;
      stream_.set_read_deadline(std::min(deadline, due));
      error_code ec;
      http::read_some(stream_, buffer_, parser_, ec);
      if (ec == beast::error::timeout && rate_bound) continue;  // the window ended: check it
      if (ec == http::error::need_buffer) ec = {};
      size_t n = max - parser_.get().body().size;
      if (ec) {
        if (ec == http::error::body_limit) {
          return Fail(absl::ResourceExhaustedError(
              Cat("request body exceeds the limit of ", cap_, " bytes")));
        }
        if (ec == beast::error::timeout) {
          return Fail(absl::DeadlineExceededError("timed out reading the request body"));
        }
        if (ec == http::error::end_of_stream || ec == http::error::partial_message ||
            ec == net::error::eof) {
          return Fail(absl::UnavailableError("client disconnected during the request body"));
        }
        return Fail(absl::InvalidArgumentError(Cat("malformed request body: ", ec.message())));
      }
      if (n > 0) {
        bytes_read_ += n;
        return n;
      }
    }
  }
  std::optional<uint64_t> content_length() const override { return content_length_; }
  uint64_t bytes_read() const override { return bytes_read_; }
  bool done() const override { return done_; }
  bool failed() const { return !status_.ok(); }

 private:
  absl::Status Fail(absl::Status s) {
    status_ = s;
    return s;
  }

  FdStream& stream_;
  beast::flat_buffer& buffer_;
  http::request_parser<http::buffer_body> parser_;
  uint64_t cap_;
  int64_t timeout_ms_;
  bool send_continue_;
  uint64_t min_rate_;
  int64_t grace_ms_;
  RateWindow rate_;
  std::optional<uint64_t> content_length_;
  uint64_t bytes_read_ = 0;
  bool done_ = false;
  absl::Status status_;
};

// ---------------------------------------------------------------------------------------------
// Streaming response body

class ChunkedWriter : public ResponseWriter {
 public:
  ChunkedWriter(FdStream& stream, bool chunked) : stream_(stream), chunked_(chunked) {}

  bool Write(std::string_view data) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!ok_ || finished_) return false;
    if (data.empty()) return true;
    if (http_internal::PeerHasClosed(stream_.fd())) return Broken();
    WriteBudget budget(stream_);
    error_code ec;
    if (chunked_) {
      char head[24];
      int len = snprintf(head, sizeof(head), "%zx\r\n", data.size());
      std::array<net::const_buffer, 3> bufs = {
          net::buffer(head, len), net::buffer(data.data(), data.size()), net::buffer("\r\n", 2)};
      net::write(stream_, bufs, ec);
    } else {
      net::write(stream_, net::buffer(data.data(), data.size()), ec);
    }
    if (ec) return Broken();
    bytes_ += data.size();
    return true;
  }
  bool ok() const override { return ok_.load(); }
  bool ClientGone() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (ok_ && http_internal::PeerHasClosed(stream_.fd())) ok_ = false;
    return !ok_;
  }
  uint64_t bytes_written() const override { return bytes_.load(); }

  // Writes the terminating zero-length chunk. Later writes (from stray threads) are refused.
  bool Finish() {
    std::lock_guard<std::mutex> lock(mu_);
    if (!ok_) return false;
    finished_ = true;
    if (!chunked_) return true;
    error_code ec;
    net::write(stream_, net::buffer("0\r\n\r\n", 5), ec);
    if (ec) return Broken();
    return true;
  }

 private:
  bool Broken() {
    ok_ = false;
    return false;
  }

  FdStream& stream_;
  bool chunked_;
  std::mutex mu_;  // serialises writes from several threads
  std::atomic<bool> ok_{true};
  std::atomic<uint64_t> bytes_{0};
  bool finished_ = false;
};

// ---------------------------------------------------------------------------------------------
// Connection-level helpers

// Client-controlled text for a log line: control bytes escaped (no forged lines), length capped.
std::string LogSafe(std::string_view s) {
  std::string out;
  for (unsigned char c : s.substr(0, 300)) {
    if (c < 0x20 || c == 0x7f || c == '\\') {
      char esc[8];
      snprintf(esc, sizeof(esc), "\\x%02x", c);
      out += esc;
    } else {
      out.push_back(static_cast<char>(c));
    }
  }
  if (s.size() > 300) out += "...";
  return out;
}

PeerInfo PeerOf(int fd, const sockaddr_storage& ss, bool is_unix) {
  PeerInfo peer;
  if (is_unix) {
    peer.is_unix = true;
    peer.address = "unix";
    ucred cred{};
    socklen_t cl = sizeof(cred);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cl) == 0) {
      peer.uid = cred.uid;
      peer.gid = cred.gid;
      peer.pid = cred.pid;
    }
    return peer;
  }
  char host[INET6_ADDRSTRLEN] = "?";
  if (ss.ss_family == AF_INET) {
    auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
    inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
    peer.is_loopback = (ntohl(a->sin_addr.s_addr) >> 24) == 127;
    peer.address = Cat(host, ":", ntohs(a->sin_port));
  } else if (ss.ss_family == AF_INET6) {
    auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
    inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
    peer.is_loopback = IN6_IS_ADDR_LOOPBACK(&a->sin6_addr) ||
                       (IN6_IS_ADDR_V4MAPPED(&a->sin6_addr) && a->sin6_addr.s6_addr[12] == 127);
    peer.address = Cat("[", host, "]:", ntohs(a->sin6_port));
  }
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return peer;
}

// What the per-peer connection cap counts: the IP address (without the port) over TCP, the uid
// over the unix socket.
std::string PeerKey(const PeerInfo& peer) {
  if (peer.is_unix) return Cat("uid:", peer.uid);
  std::string_view a = peer.address;
  size_t colon = a.rfind(':');
  return std::string(colon == std::string_view::npos ? a : a.substr(0, colon));
}

std::string_view ReasonOf(int status) {
  return http::obsolete_reason(static_cast<http::status>(status));
}

// A complete error answer as one string (for answers sent without waiting: refusals at accept,
// header timeouts).
std::string ErrorMessageBytes(const HttpServer::Options& opts, int status, std::string_view code,
                              std::string_view message) {
  std::string body = boost::json::serialize(ErrorBody(code, message));
  return Cat("HTTP/1.1 ", status, " ", ReasonOf(status), "\r\nServer: ", opts.server_name,
             "\r\nContent-Type: application/json\r\nContent-Length: ", body.size(),
             status == 503 ? "\r\nRetry-After: 1" : "", "\r\nConnection: close\r\n\r\n", body);
}

// Sends a complete error answer without blocking (best effort: a client that does not read
// simply does not get it) and closes `fd`.
void SendAndClose(int fd, const HttpServer::Options& opts, int status, std::string_view code,
                  std::string_view message) {
  std::string msg = ErrorMessageBytes(opts, status, code, message);
  (void)send(fd, msg.data(), msg.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
  shutdown(fd, SHUT_WR);
  close(fd);
}

// Extra response headers, minus those the server manages (or that would inject headers).
template <class Message>
void AddHeaders(Message& res, const HttpServer::Options& opts, const Response& resp) {
  res.set(http::field::server, opts.server_name);
  if (!resp.content_type.empty()) res.set(http::field::content_type, resp.content_type);
  for (const auto& [k, v] : resp.headers) {
    if (k.empty() || HasCrLf(k) || HasCrLf(v) || EqualsIgnoreCase(k, "content-length") ||
        EqualsIgnoreCase(k, "transfer-encoding") || EqualsIgnoreCase(k, "connection")) {
      continue;  // managed here, or would allow header injection
    }
    res.set(k, v);
  }
}

Response OverShare(std::string message) {
  Response r = ErrorResponse(429, "too_many_requests", message);
  r.SetHeader("Retry-After", "1");
  return r;
}

Response Unavailable(std::string message) {
  Response r = ErrorResponse(503, "unavailable", message);
  r.SetHeader("Retry-After", "1");
  return r;
}

Response TooLarge(uint64_t limit) {
  return ErrorResponse(413, "payload_too_large",
                       Cat("request body exceeds the limit of ", limit, " bytes"));
}

// Headers the server refuses to guess about (RFC 9110/9112): ambiguity here is how requests get
// smuggled past a proxy or authenticated as someone else. A second Host, Authorization,
// Content-Type or Content-Length (which one would count?), Content-Length together with
// Transfer-Encoding, an HTTP/1.1 request without Host, and any transfer coding other than plain
// "chunked" (a "gzip, chunked" body decoded as plain chunked would be wrong: 501).
std::optional<Response> CheckHeaders(const Request& req, unsigned version) {
  int host = 0, auth = 0, ctype = 0, clen = 0, te = 0;
  std::vector<std::string> codings;
  for (const auto& [k, v] : req.headers_) {
    if (EqualsIgnoreCase(k, "host")) ++host;
    if (EqualsIgnoreCase(k, "authorization")) ++auth;
    if (EqualsIgnoreCase(k, "content-type")) ++ctype;
    if (EqualsIgnoreCase(k, "content-length")) ++clen;
    if (EqualsIgnoreCase(k, "transfer-encoding")) {
      ++te;
      for (std::string_view c : SplitString(v, ',')) {
        codings.push_back(ToLowerAscii(TrimAscii(c)));
      }
    }
  }
  for (auto [count, name] : {std::pair{host, "Host"}, std::pair{auth, "Authorization"},
                             std::pair{ctype, "Content-Type"}, std::pair{clen, "Content-Length"}}) {
    if (count > 1) {
      return ErrorResponse(400, "bad_request", Cat("more than one ", name, " header"));
    }
  }
  if (clen > 0 && te > 0) {
    return ErrorResponse(400, "bad_request",
                         "both Content-Length and Transfer-Encoding: the body length is ambiguous");
  }
  if (version >= 11 && host == 0) {
    return ErrorResponse(400, "bad_request", "HTTP/1.1 request without a Host header");
  }
  if (!codings.empty() && !(codings.size() == 1 && codings[0] == "chunked")) {
    std::string what = LogSafe(JoinStrings(codings, ", "));
    return ErrorResponse(
        501, "bad_request",
        Cat("unsupported Transfer-Encoding '", what, "': only 'chunked' is supported"));
  }
  return std::nullopt;
}

}  // namespace

namespace http_internal {
class Conn;
class WsSession;
}  // namespace http_internal

// ---------------------------------------------------------------------------------------------
// Server state

struct HttpServer::Impl : std::enable_shared_from_this<HttpServer::Impl> {
  explicit Impl(Options o) : opts(std::move(o)) {}
  ~Impl() {
    // Connections still held by the I/O contexts' pending handlers are destroyed with them and
    // touch the members below on the way: the contexts go first.
    tick.reset();
    listeners.clear();
    io.clear();
    if (reserve_fd >= 0) close(reserve_fd);
  }

  struct IoThread {
    net::io_context ioc{1};
    std::optional<net::executor_work_guard<net::io_context::executor_type>> guard;
    std::thread thread;
  };
  struct Listener {
    int fd = -1;
    int family = AF_UNSPEC;
    bool is_unix = false;
    std::unique_ptr<Acceptor> acceptor;  // on io[0]
    std::unique_ptr<net::steady_timer> pause;
  };

  absl::Status ListenTcp();
  absl::Status ListenUnix();
  void WaitAccept(Listener& l);
  void AcceptAll(Listener& l);
  void PauseAccepting(Listener& l, int err);
  void Admit(int fd, const sockaddr_storage& ss, const Listener& l);
  // Closes the connection that has waited longest (idle or sending a header), of the peer
  // `peer_key` if given. False: none.
  bool EvictOldest(std::string_view why, const std::string* peer_key = nullptr);
  void Tick();
  void Observe(const Request& req, int status, int64_t start_ms, std::string_view extra);
  // The access log's token bucket (Options::access_log_lines_per_second): true if a line for
  // a response with `status` may be written now; counts and, once a second, summarises the
  // lines it refuses. status < 0: only emit a due summary (the tick).
  bool AccessLogAdmit(int status, int64_t now);

  // A request in progress (max_connections): its id, or 0 if over the cap or stopping. `fd` is
  // shut down if the request is still busy when Stop()'s drain time is over.
  uint64_t BeginRequest(int fd) {
    std::lock_guard<std::mutex> lock(mu);
    if (stopping.load() || static_cast<int>(busy.size()) >= opts.max_connections) return 0;
    uint64_t id = next_id++;
    busy[id] = fd;
    return id;
  }
  void EndRequest(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu);
    busy.erase(id);
    cv.notify_all();
  }
  // A stream (SSE, download, WebSocket) within max_streams.
  bool BeginStream() {
    std::lock_guard<std::mutex> lock(mu);
    if (streams >= max_streams) return false;
    ++streams;
    return true;
  }
  void EndStream() {
    std::lock_guard<std::mutex> lock(mu);
    --streams;
  }

  // What one principal (RouteOptions::before_body) holds right now.
  struct Share {
    int requests = 0;
    uint64_t body_bytes = 0;
    uint64_t response_bytes = 0;
    bool empty() const { return requests <= 0 && body_bytes == 0 && response_bytes == 0; }
  };
  enum class Reserved { kOk, kOverShare, kOverBudget };

  // A request for `principal`, within its share of max_connections. False: over it.
  bool AcquireRequest(const std::string& principal) {
    std::lock_guard<std::mutex> lock(share_mu);
    Share& s = shares[principal];
    if (s.requests >= max_requests_per_principal) {
      if (s.empty()) shares.erase(principal);
      return false;
    }
    ++s.requests;
    return true;
  }
  void ReleaseRequest(const std::string& principal) {
    std::lock_guard<std::mutex> lock(share_mu);
    auto it = shares.find(principal);
    if (it == shares.end()) return;
    --it->second.requests;
    if (it->second.empty()) shares.erase(it);
  }
  // Buffered memory of one kind (request bodies, responses) for `principal`: within the
  // server-wide `limit` (running total `*total`) and within its share of it (`Share::*part`).
  Reserved Reserve(const std::string& principal, uint64_t bytes, uint64_t* total, uint64_t limit,
                   uint64_t per_principal, uint64_t Share::*part) {
    std::lock_guard<std::mutex> lock(share_mu);
    if (bytes > limit || *total > limit - bytes) return Reserved::kOverBudget;
    Share& s = shares[principal];
    if (bytes > per_principal || s.*part > per_principal - bytes) {
      if (s.empty()) shares.erase(principal);
      return Reserved::kOverShare;
    }
    s.*part += bytes;
    *total += bytes;
    return Reserved::kOk;
  }
  void Release(const std::string& principal, uint64_t bytes, uint64_t* total,
               uint64_t Share::*part) {
    if (bytes == 0) return;
    std::lock_guard<std::mutex> lock(share_mu);
    *total -= bytes;
    auto it = shares.find(principal);
    if (it == shares.end()) return;
    it->second.*part -= bytes;
    if (it->second.empty()) shares.erase(it);
  }
  // Body memory (Options::max_buffered_body_bytes).
  Reserved ReserveBody(const std::string& principal, uint64_t bytes) {
    return Reserve(principal, bytes, &body_bytes, opts.max_buffered_body_bytes,
                   max_body_per_principal, &Share::body_bytes);
  }
  void ReleaseBody(const std::string& principal, uint64_t bytes) {
    Release(principal, bytes, &body_bytes, &Share::body_bytes);
  }
  // A buffered response waiting for its client (Options::max_buffered_response_bytes).
  Reserved ReserveResponse(const std::string& principal, uint64_t bytes) {
    return Reserve(principal, bytes, &response_bytes, opts.max_buffered_response_bytes,
                   max_response_per_principal, &Share::response_bytes);
  }
  void ReleaseResponse(const std::string& principal, uint64_t bytes) {
    Release(principal, bytes, &response_bytes, &Share::response_bytes);
  }
  // Asks the tick for a malloc_trim (large bodies and answers come and go in bursts; glibc keeps
  // what they freed unless asked, so the daemon's RSS would stay at its peak for good).
  void WantTrim() { trim_wanted.store(true); }

  Options opts;
  Router router;
  // Resolved limits (Options with 0 = derived).
  int max_open = 0;
  int max_per_peer = 0;
  int max_streams = 0;
  int max_requests_per_principal = 0;
  uint64_t max_body_per_principal = 0;
  uint64_t max_response_per_principal = 0;
  // Kept open so that, out of fds, the server can still accept (and refuse) a connection.
  int reserve_fd = -1;
  int tcp_port = -1;
  LogThrottle busy_log, thread_log, evict_log, accept_log, failed_log, peer_log, stream_log;
  std::unique_ptr<http_internal::WorkerPool> pool;
  std::atomic<bool> stopping{false};

  // Open connections, per peer (PeerKey), and header-phase buffer memory.
  std::atomic<int> open_conns{0};
  std::atomic<uint64_t> header_bytes{0};
  std::mutex peer_mu;
  std::unordered_map<std::string, int> peers;
  // Connections that are idle or sending a header, oldest first (the eviction order). A
  // connection's own fields `listed` and `pos` are guarded by wait_mu too.
  std::mutex wait_mu;
  std::list<http_internal::Conn*> waiting;

  std::mutex mu;  // requests in progress
  std::condition_variable cv;
  std::map<uint64_t, int> busy;  // id → fd
  uint64_t next_id = 1;
  int streams = 0;

  std::mutex share_mu;
  std::map<std::string, Share> shares;  // principals with a request in progress
  uint64_t body_bytes = 0;              // buffered request bodies, all connections
  uint64_t response_bytes = 0;          // buffered responses being written, all connections
  std::atomic<bool> trim_wanted{false};
  int64_t last_trim = 0;  // io[0] only

  std::mutex log_mu;  // the access log's token bucket
  double log_tokens = 0;
  int64_t log_refill_ms = 0;
  int64_t log_summary_ms = 0;
  uint64_t log_dropped = 0;
  uint64_t log_dropped_4xx = 0;

  std::mutex lifecycle_mu;
  bool started = false;
  bool stopped = false;

  // Last, so that they are destroyed first (see ~Impl; explicit there anyway).
  std::vector<std::unique_ptr<IoThread>> io;
  std::atomic<size_t> next_io{0};
  std::vector<Listener> listeners;
  std::unique_ptr<net::steady_timer> tick;
};

// ---------------------------------------------------------------------------------------------
// Connections

namespace http_internal {

using Impl = HttpServer::Impl;

// One client connection. Its I/O thread owns it while it waits for (and reads) a request
// header, writes an answer the server produced itself, or lingers before closing; a worker owns
// it from admission to the end of the answer (Work). Ownership changes hands only through
// net::post and the worker pool's queue, so the two never touch the socket at once.
class Conn : public std::enable_shared_from_this<Conn> {
 public:
  Conn(Impl& srv, net::io_context& ioc, Socket sock, PeerInfo peer, std::string peer_key)
      : srv_(srv),
        opts_(srv.opts),
        ioc_(ioc),
        sock_(std::move(sock)),
        fd_(sock_.native_handle()),
        peer_(std::move(peer)),
        peer_key_(std::move(peer_key)),
        timer_(ioc),
        buf_(std::max<size_t>(opts_.max_header_bytes + (128 << 10), 1 << 20)),
        stream_(fd_, opts_.write_timeout.count(), opts_.min_write_bytes_per_second,
                opts_.min_rate_grace.count()) {}

  ~Conn() {
    Unlist();
    AccountHeader(0);
    srv_.open_conns.fetch_sub(1);
    std::lock_guard<std::mutex> lock(srv_.peer_mu);
    auto it = srv_.peers.find(peer_key_);
    if (it != srv_.peers.end() && --it->second <= 0) srv_.peers.erase(it);
  }

  // Accepting thread: the new connection is idle (evictable) from now on.
  void ListNew() { List(); }
  void Start() { WaitRequest(); }
  // I/O thread: closes the connection if it is still idle or sending a header.
  void Evict() {
    if (state_ == State::kWaiting) Close();
  }
  net::io_context& ioc() { return ioc_; }
  const PeerInfo& peer() const { return peer_; }
  const std::string& peer_key() const { return peer_key_; }

  // Guarded by Impl::wait_mu.
  bool listed = false;
  std::list<Conn*>::iterator pos;

 private:
  friend class WsSession;
  enum class State { kWaiting, kWorker, kWriting, kLinger, kWebSocket, kClosed };
  enum class Next { kClose, kLinger, kKeep, kWebSocket };

  // ---- I/O thread ----

  void List() {
    std::lock_guard<std::mutex> lock(srv_.wait_mu);
    if (listed) return;
    srv_.waiting.push_back(this);
    pos = std::prev(srv_.waiting.end());
    listed = true;
  }
  void Unlist() {
    std::lock_guard<std::mutex> lock(srv_.wait_mu);
    if (!listed) return;
    srv_.waiting.erase(pos);
    listed = false;
  }
  // Keeps Impl::header_bytes up to date with this connection's header buffer.
  void AccountHeader(size_t bytes) {
    srv_.header_bytes.fetch_add(static_cast<uint64_t>(bytes) - counted_);
    counted_ = bytes;
  }
  void AccountHeader() {
    AccountHeader(state_ == State::kWaiting && header_started_ ? buf_.capacity() : 0);
  }

  void Arm(int64_t ms) {
    const uint64_t gen = ++timer_gen_;
    timer_.expires_after(std::chrono::milliseconds(std::max<int64_t>(ms, 0)));
    timer_.async_wait([self = shared_from_this(), gen](error_code ec) {
      if (!ec) self->OnTimer(gen);
    });
  }
  void Disarm() {
    ++timer_gen_;
    timer_.cancel();
  }

  void WaitRequest() {
    if (state_ == State::kClosed) return;  // evicted before it started
    if (srv_.stopping.load()) return Close();
    state_ = State::kWaiting;
    hp_.emplace();
    hp_->header_limit(static_cast<std::uint32_t>(opts_.max_header_bytes));
    hp_->body_limit(boost::none);  // checked per route
    header_started_ = buf_.size() > 0;
    // An idle connection holds no buffer (10,000 idle keep-alive clients cost sockets only).
    if (!header_started_ && buf_.capacity() > 0) buf_.shrink_to_fit();
    List();
    AccountHeader();
    Arm(header_started_ || fresh_ ? opts_.header_timeout.count() : opts_.idle_timeout.count());
    if (header_started_) return Parse();
    sock_.async_wait(Socket::wait_read, [self = shared_from_this()](error_code ec) {
      if (self->state_ != State::kWaiting) return;
      if (ec) return self->Close();
      self->ReadSome();
    });
  }

  void ReadSome() {
    const size_t room = opts_.max_header_bytes + 1 - std::min(buf_.size(), opts_.max_header_bytes);
    net::mutable_buffer b = buf_.prepare(std::min<size_t>(room, 16 << 10));
    sock_.async_read_some(
        b, [self = shared_from_this()](error_code ec, size_t n) { self->OnRead(ec, n); });
  }

  void OnRead(error_code ec, size_t n) {
    if (state_ != State::kWaiting) return;
    if (ec) return Close();  // closed (or reset) while idle or mid-header: nothing to answer
    buf_.commit(n);
    if (!header_started_) {
      header_started_ = true;
      Arm(opts_.header_timeout.count());
    }
    AccountHeader();
    Parse();
  }

  void Parse() {
    for (;;) {
      std::string_view data(static_cast<const char*>(buf_.data().data()), buf_.size());
      const size_t eoh = data.find("\r\n\r\n");
      std::string_view head = data.substr(0, eoh == std::string_view::npos ? data.size() : eoh);
      // Obsolete line folding (a header line starting with a space or tab) is rejected rather
      // than unfolded (RFC 9112 §5.2): two parsers that disagree about it can be smuggled past.
      if (head.find("\r\n ") != std::string_view::npos ||
          head.find("\r\n\t") != std::string_view::npos) {
        return RefuseHeader(400, "obsolete line folding in the request header is not accepted",
                            " (obs-fold)");
      }
      // SECURITY: the header budgets count raw bytes, but each parsed field costs Beast an
      // allocation of ~100 bytes however short it is: a flood of tiny fields is refused on its
      // raw lines (one per field, folding is refused above), before the parser sees them.
      if (static_cast<size_t>(std::count(head.begin(), head.end(), '\n')) >
          opts_.max_header_fields + 1) {
        return RefuseHeader(
            400, Cat("too many request header fields (limit ", opts_.max_header_fields, ")"),
            " (too many header fields)");
      }
      error_code pec;
      const size_t used = hp_->put(buf_.data(), pec);
      buf_.consume(used);
      if (pec == http::error::need_more) {
        if (used > 0 && buf_.size() > 0) continue;
        if (buf_.size() > opts_.max_header_bytes) return HeaderTooLarge();
        AccountHeader();
        if (srv_.header_bytes.load() > opts_.max_buffered_header_bytes) {
          srv_.EvictOldest("header memory budget");
        }
        return ReadSome();
      }
      if (pec == http::error::header_limit || pec == http::error::buffer_overflow) {
        return HeaderTooLarge();
      }
      if (pec) {
        return RefuseHeader(400, Cat("malformed HTTP request: ", pec.message()), " (malformed)");
      }
      if (hp_->is_header_done()) return OnHeader();
      if (used == 0) return ReadSome();
    }
  }

  void HeaderTooLarge() {
    RefuseHeader(400, Cat("request header too large (limit ", opts_.max_header_bytes, " bytes)"),
                 " (header too large)");
  }

  // An answer to a request whose header could not be parsed; the connection is closed after it.
  void RefuseHeader(int status, std::string message, std::string_view log_extra) {
    Unlist();
    Request req;
    req.peer_ = peer_;
    req.start_ms_ = MonotonicMs();
    Answer(req, ErrorResponse(status, ErrorCodeForStatus(status), message), 11, false, log_extra);
  }

  // A complete header: parse the target, check the headers, route, and admit (or answer).
  void OnHeader() {
    Unlist();
    Disarm();
    state_ = State::kWorker;  // not yet, but no longer waiting
    AccountHeader();
    fresh_ = false;
    auto req = std::make_unique<Request>();
    req->fd_ = fd_;
    req->peer_ = peer_;
    req->start_ms_ = MonotonicMs();
    const auto& h = hp_->get();
    version_ = h.version();
    req->method_ = std::string(h.method_string());
    req->target_ = std::string(h.target());
    for (const auto& f : h) {
      req->headers_.emplace_back(std::string(f.name_string()), std::string(f.value()));
    }
    keep_alive_ = hp_->keep_alive();
    const bool chunked = hp_->chunked();
    // Content-Length, or 0 if absent (chunked bodies are limited while they are read).
    clen_ = hp_->content_length().value_or(0);
    has_body_ = chunked || clen_ > 0;
    req->has_body_ = has_body_;

    // Target: origin-form only.
    std::string_view target = req->target_;
    size_t q = target.find('?');
    std::string_view raw_path = target.substr(0, q);
    std::vector<std::string> segments;
    if (!SplitPath(raw_path, &segments) || !PercentDecode(raw_path, false, &req->path_) ||
        (q != std::string_view::npos && !ParseQuery(target.substr(q + 1), &req->query_))) {
      req->path_.clear();
      return Answer(*req, ErrorResponse(400, "bad_request", "malformed request target"), version_,
                    false, "");
    }
    if (std::optional<Response> bad = CheckHeaders(*req, version_)) {
      return Answer(*req, std::move(*bad), version_, false, "");
    }
    Router::Match match = srv_.router.Find(req->method_, segments);
    if (match.handler == nullptr) {
      if (match.path_known) {
        Response r = ErrorResponse(405, "method_not_allowed",
                                   Cat("method ", req->method_, " not allowed for ", req->path_,
                                       " (allowed: ", match.allow, ")"));
        r.SetHeader("Allow", match.allow);
        return Answer(*req, std::move(r), version_, keep_alive_ && !has_body_, "");
      }
      return Answer(
          *req,
          ErrorResponse(404, "not_found", Cat("no such endpoint: ", req->method_, " ", req->path_)),
          version_, keep_alive_ && !has_body_, "");
    }
    req->params_ = std::move(match.params);
    // A route that takes no body never reads one: the request is answered on its header, so an
    // announced body that never comes holds no worker and no budget.
    if (has_body_ && !match.options->accepts_body && !match.options->stream_body) {
      return Answer(*req,
                    ErrorResponse(413, "payload_too_large",
                                  Cat(req->method_, " ", req->path_, " takes no request body")),
                    version_, false, "");
    }
    handler_ = match.handler;
    route_ = match.options;
    id_ = srv_.BeginRequest(fd_);
    if (id_ == 0) {
      if (uint64_t times = srv_.busy_log.Hit()) {
        LogWarn(Cat("http: ", opts_.max_connections, " requests in progress; answering 503 to ",
                    peer_.address, " (", times, " times so far)"));
      }
      return Answer(
          *req,
          Unavailable(srv_.stopping.load() ? "server is shutting down"
                                           : "too many requests in progress; retry shortly"),
          version_, false, "");
    }
    req_ = std::move(req);
    bool queued =
        srv_.pool->Submit([self = shared_from_this(), keep = srv_.shared_from_this()]() mutable {
          self->Work();
          self.reset();  // before the server's last reference, if this is it
        });
    if (!queued) {
      srv_.EndRequest(id_);
      if (uint64_t times = srv_.thread_log.Hit()) {
        LogError(Cat("http: cannot start a worker thread (", times, " times so far)"));
      }
      std::unique_ptr<Request> r = std::move(req_);
      Answer(*r, Unavailable("the server cannot start a worker; retry shortly"), version_, false,
             "");
    }
  }

  // Writes an answer the I/O thread produced itself (errors before admission), then waits for
  // the next request or lingers.
  void Answer(const Request& req, Response resp, unsigned version, bool keep_alive,
              std::string_view log_extra) {
    if (srv_.stopping.load()) keep_alive = false;
    state_ = State::kWriting;
    auto res = std::make_shared<http::response<http::string_body>>(
        static_cast<http::status>(resp.status), version >= 11 ? 11 : 10);
    AddHeaders(*res, opts_, resp);
    res->body() = std::move(resp.body);
    res->keep_alive(keep_alive);
    res->prepare_payload();
    srv_.Observe(req, resp.status, req.start_ms_ ? req.start_ms_ : MonotonicMs(), log_extra);
    Arm(opts_.write_timeout.count());
    http::async_write(sock_, *res,
                      [self = shared_from_this(), res, keep_alive](error_code ec, size_t) {
                        if (self->state_ != State::kWriting) return;
                        self->Disarm();
                        if (ec) return self->Close();
                        if (keep_alive) return self->WaitRequest();
                        self->Linger();
                      });
  }

  // Closes politely: stop sending now, read and drop what the client still sends for a while
  // (kLingerMs), then close, so that the answer is not destroyed by a TCP reset.
  void Linger() {
    if (srv_.stopping.load()) return Close();
    state_ = State::kLinger;
    error_code ec;
    sock_.shutdown(Socket::shutdown_send, ec);
    Arm(kLingerMs);
    Drain();
  }
  void Drain() {
    buf_.consume(buf_.size());
    sock_.async_read_some(buf_.prepare(4096), [self = shared_from_this()](error_code ec, size_t) {
      if (self->state_ != State::kLinger) return;
      if (ec) return self->Close();
      self->Drain();
    });
  }

  void Close() {
    if (state_ == State::kClosed) return;
    state_ = State::kClosed;
    Unlist();
    AccountHeader();
    Disarm();
    error_code ec;
    sock_.close(ec);
  }

  void OnTimer(uint64_t gen) {
    if (gen != timer_gen_) return;
    switch (state_) {
      case State::kWaiting:
        if (header_started_) {
          Request req;
          req.peer_ = peer_;
          srv_.Observe(req, 408, MonotonicMs(), " (header read timeout)");
          std::string msg =
              ErrorMessageBytes(opts_, 408, "bad_request", "timed out reading the request header");
          (void)send(fd_, msg.data(), msg.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
          shutdown(fd_, SHUT_WR);
        }
        return Close();  // idle: close quietly
      case State::kWriting: {
        // A reader too slow to be served: reset, so the kernel drops the unsent bytes at once.
        linger abort{1, 0};
        setsockopt(fd_, SOL_SOCKET, SO_LINGER, &abort, sizeof(abort));
        return Close();
      }
      case State::kLinger:
        return Close();
      default:
        return;
    }
  }

  // ---- Worker thread ----

  void Work() {
    Next next = Next::kClose;
    try {
      next = Handle();
    } catch (const std::exception& e) {
      if (uint64_t times = srv_.failed_log.Hit()) {
        LogError(Cat("http: connection failed: ", e.what(), " (", times, " times so far)"));
      }
    } catch (...) {
      if (uint64_t times = srv_.failed_log.Hit()) {
        LogError(
            Cat("http: connection failed with a non-std exception (", times, " times so far)"));
      }
    }
    req_.reset();  // frees the body before the connection waits for its next request
    handler_ = nullptr;
    route_ = nullptr;
    srv_.EndRequest(id_);
    if (next == Next::kWebSocket) return;  // the WebSocket session owns the socket now
    net::post(ioc_, [self = shared_from_this(), next] {
      if (next == Next::kKeep) return self->WaitRequest();
      if (next == Next::kLinger) return self->Linger();
      self->Close();
    });
  }

  // A buffered body's part of its principal's share and of the server-wide budget; released
  // on destruction.
  struct BodyBudget {
    Impl& srv;
    const std::string& principal;
    uint64_t bytes = 0;
    Impl::Reserved Grow(uint64_t more) {
      Impl::Reserved r = srv.ReserveBody(principal, more);
      if (r == Impl::Reserved::kOk) bytes += more;
      return r;
    }
    void Release() {
      srv.ReleaseBody(principal, bytes);
      if (bytes >= kTrimWorthyBytes) srv.WantTrim();
      bytes = 0;
    }
    ~BodyBudget() { Release(); }
  };

  // A buffered response's part of the response budget; released on destruction.
  struct ResponseBudget {
    Impl& srv;
    const std::string& principal;
    uint64_t bytes = 0;
    ~ResponseBudget() {
      srv.ReleaseResponse(principal, bytes);
      if (bytes >= kTrimWorthyBytes) srv.WantTrim();
    }
  };

  // One of the principal's requests in progress (Options::max_requests_per_principal).
  struct RequestSlot {
    Impl& srv;
    std::string principal;
    bool held = false;
    ~RequestSlot() {
      if (held) srv.ReleaseRequest(principal);
    }
  };

  // before_body → principal's share → body → handler → answer.
  Next Handle() {
    Request& req = *req_;
    bool keep_alive = keep_alive_;
    const unsigned version = version_;
    const bool expect_continue =
        EqualsIgnoreCase(TrimAscii(req.HeaderOr("expect", "")), "100-continue");
    // Admission (authentication) on the header alone: a client that is turned away never gets
    // a body byte read or buffered, nor a "100 Continue", nor a WebSocket.
    if (route_->before_body) {
      std::optional<Response> refused;
      try {
        refused = route_->before_body(req);
      } catch (const std::exception& e) {
        LogError(Cat("http: before_body for ", req.method_, " ", req.path_, " threw: ", e.what()));
        refused = ErrorResponse(500, "internal", "internal server error");
      }
      if (refused) return Finish(req, std::move(*refused), version, keep_alive && !has_body_);
    }
    RequestSlot slot{srv_, req.principal_};
    if (!srv_.AcquireRequest(slot.principal)) {
      static LogThrottle throttle;
      if (uint64_t n = throttle.Hit()) {
        LogWarn(Cat("http: a principal is over its share of ", srv_.max_requests_per_principal,
                    " requests in progress; answering 429 (", n, " times so far)"));
      }
      return Finish(req,
                    OverShare(Cat("too many requests in progress for this client (limit ",
                                  srv_.max_requests_per_principal, "); retry shortly")),
                    version, keep_alive && !has_body_);
    }
    slot.held = true;

    std::unique_ptr<StreamBodyReader> reader;
    BodyBudget budget{srv_, slot.principal};  // held until the handler is done with req.body_
    if (route_->stream_body) {
      uint64_t cap = route_->max_stream_body_bytes;
      if (clen_ > cap) return Finish(req, TooLarge(cap), version, false);
      reader = std::make_unique<StreamBodyReader>(
          stream_, buf_, std::move(*hp_), cap, opts_.body_timeout.count(),
          expect_continue && has_body_, opts_.min_read_bytes_per_second,
          opts_.min_rate_grace.count());
      header_moved_ = true;
      req.body_reader_ = reader.get();
    } else if (has_body_) {
      if (clen_ > opts_.max_body_bytes)
        return Finish(req, TooLarge(opts_.max_body_bytes), version, false);
      if (expect_continue) {
        static constexpr std::string_view kContinue = "HTTP/1.1 100 Continue\r\n\r\n";
        error_code ec;
        net::write(stream_, net::buffer(kContinue.data(), kContinue.size()), ec);
        if (ec) return Next::kClose;
      }
      bool gone = false;
      std::optional<Response> failed = ReadBufferedBody(req, budget, &gone);
      if (failed || gone) {
        budget.Release();  // the partial body is freed already; the linger must not hold it
        if (gone) {
          srv_.Observe(req, 499, req.start_ms_, " (client went away during the body)");
          return Next::kClose;
        }
        return Finish(req, std::move(*failed), version, false);
      }
    }

    Response resp;
    try {
      resp = (*handler_)(req);
    } catch (const std::exception& e) {
      LogError(Cat("http: handler for ", req.method_, " ", req.path_, " threw: ", e.what()));
      resp = ErrorResponse(500, "internal", "internal server error");
    } catch (...) {
      LogError(
          Cat("http: handler for ", req.method_, " ", req.path_, " threw a non-std exception"));
      resp = ErrorResponse(500, "internal", "internal server error");
    }
    if (reader && !reader->done()) {
      // The handler did not consume the whole body: the rest cannot be skipped safely.
      keep_alive = false;
    }
    if (resp.websocket) {
      if (!reader && !has_body_) return Upgrade(req, std::move(resp.websocket));
      return Finish(req, ErrorResponse(400, "bad_request", "a WebSocket upgrade takes no body"),
                    version, false);
    }
    if (!resp.stream) {
      // The body is not needed any more: free it (and its budget) before a possibly slow write.
      // (A stream function may still read the request, body included.)
      req.body_ = std::string();
      budget.Release();
    }
    return Finish(req, std::move(resp), version, keep_alive);
  }

  // Reads a buffered body into req.body_, its memory counted in the server-wide budget: all of
  // a Content-Length up front (the parser reserves that much), a chunked body as it grows.
  // Returns the answer for a body that cannot be had (too large, over budget, too slow,
  // malformed), or sets *gone when the client went away; the partial body is freed by then.
  std::optional<Response> ReadBufferedBody(Request& req, BodyBudget& budget, bool* gone) {
    if (std::optional<Response> refused = Refusal(budget.Grow(clen_))) return refused;
    http::request_parser<http::string_body> bp(std::move(*hp_));
    header_moved_ = true;
    bp.body_limit(opts_.max_body_bytes);
    const int64_t start = MonotonicMs();
    const int64_t deadline = start + opts_.body_timeout.count();
    RateWindow rate(opts_.min_read_bytes_per_second, opts_.min_rate_grace.count(), start, 0);
    error_code ec;
    bool too_slow = false;
    while (!bp.is_done()) {
      // The reservation is held only while the body keeps coming: a stall or a trickle (below
      // min_read_bytes_per_second over a window) loses it.
      if (!rate.Check(MonotonicMs(), bp.get().body().size())) {
        too_slow = true;
        ec = beast::error::timeout;
        break;
      }
      const int64_t stall = std::min(deadline, MonotonicMs() + opts_.body_stall_timeout.count());
      const int64_t due = rate.NextCheck();
      stream_.set_read_deadline(std::min(stall, due));
      http::read_some(stream_, buf_, bp, ec);
      if (ec == beast::error::timeout && due < stall && MonotonicMs() < stall) {
        ec = {};
        continue;  // the rate window ended: check it
      }
      if (ec) break;
      uint64_t held = bp.get().body().capacity();
      if (held > budget.bytes) {
        if (std::optional<Response> refused = Refusal(budget.Grow(held - budget.bytes))) {
          return refused;
        }
      }
    }
    if (!ec) {
      req.body_ = std::move(bp.get().body());
      return std::nullopt;
    }
    if (ec == http::error::body_limit) return TooLarge(opts_.max_body_bytes);
    if (ec == beast::error::timeout) {
      return ErrorResponse(
          408, "bad_request",
          too_slow ? SlowBodyMessage(opts_.min_read_bytes_per_second, opts_.min_rate_grace.count())
                   : std::string("timed out reading the request body"));
    }
    if (ec == http::error::partial_message || ec == net::error::eof ||
        ec == http::error::end_of_stream || ec.category() == boost::system::system_category()) {
      *gone = true;
      return std::nullopt;
    }
    return ErrorResponse(400, "bad_request", Cat("malformed request body: ", ec.message()));
  }

  // The answer for a body reservation that failed, if it did.
  std::optional<Response> Refusal(Impl::Reserved r) {
    if (r == Impl::Reserved::kOk) return std::nullopt;
    if (r == Impl::Reserved::kOverShare) {
      static LogThrottle throttle;
      if (uint64_t n = throttle.Hit()) {
        LogWarn(Cat("http: a principal is over its share of ", srv_.max_body_per_principal,
                    " bytes of buffered request bodies; answering 429 (", n, " times so far)"));
      }
      return OverShare(Cat("this client is sending too many request bodies at once (limit ",
                           srv_.max_body_per_principal, " bytes); retry shortly"));
    }
    static LogThrottle throttle;
    if (uint64_t n = throttle.Hit()) {
      LogWarn(Cat("http: buffered request bodies at the budget of ", opts_.max_buffered_body_bytes,
                  " bytes; answering 503 (", n, " times so far)"));
    }
    return Unavailable("the server is receiving too many request bodies at once; retry shortly");
  }

  // Sends `resp` (plain or streamed) from the worker and logs it.
  Next Finish(Request& req, Response resp, unsigned version, bool keep_alive) {
    if (srv_.stopping.load()) keep_alive = false;
    if (resp.status < 200 || resp.status > 999) {
      LogError(Cat("http: handler returned invalid status ", resp.status));
      resp = ErrorResponse(500, "internal", "internal server error");
    }
    if (resp.status == 204 || resp.status == 304) {
      resp.body.clear();  // these answers cannot carry a body
      resp.stream = nullptr;
      resp.content_type.clear();
    }
    version = version >= 11 ? 11 : 10;
    error_code ec;
    if (!resp.stream) {
      // A large answer is held until the client has taken it: it must fit the response budget.
      ResponseBudget held{srv_, req.principal_};
      if (resp.body.size() > kUncountedResponseBytes) {
        Impl::Reserved r = srv_.ReserveResponse(req.principal_, resp.body.size());
        if (r == Impl::Reserved::kOk) {
          held.bytes = resp.body.size();
        } else {
          static LogThrottle throttle;
          if (uint64_t n = throttle.Hit()) {
            LogWarn(Cat("http: buffered responses at their budget (",
                        r == Impl::Reserved::kOverShare ? "a principal's share" : "server-wide",
                        "); answering ", resp.body.size(), " bytes with an error (", n,
                        " times so far)"));
          }
          srv_.WantTrim();
          resp = r == Impl::Reserved::kOverShare
                     ? OverShare(
                           "this client is being sent too many large answers at once; "
                           "retry shortly")
                     : Unavailable(
                           "the server is sending too many large answers at once; "
                           "retry shortly");
        }
      }
      http::response<http::string_body> res{static_cast<http::status>(resp.status), version};
      AddHeaders(res, opts_, resp);
      res.body() = std::move(resp.body);
      res.keep_alive(keep_alive);
      res.prepare_payload();
      // Observed before writing, so that metrics are updated by the time the client sees the
      // answer (handy for tests; the write time of a small answer is negligible).
      srv_.Observe(req, resp.status, req.start_ms_, "");
      {
        WriteBudget wb(stream_);
        http::write(stream_, res, ec);
      }
      if (ec) return Next::kClose;
      if (!keep_alive) return StopSending(), Next::kLinger;
      return Next::kKeep;
    }

    // Streamed: chunked on HTTP/1.1; on HTTP/1.0 the body ends when the connection closes.
    if (!srv_.BeginStream()) {
      if (uint64_t n = srv_.stream_log.Hit()) {
        LogWarn(
            Cat("http: ", srv_.max_streams, " streams open; answering 503 (", n, " times so far)"));
      }
      resp =
          Unavailable(Cat("too many streams open (limit ", srv_.max_streams, "); retry shortly"));
      return Finish(req, std::move(resp), version, false);
    }
    struct StreamSlot {
      Impl& srv;
      ~StreamSlot() { srv.EndStream(); }
    } stream_slot{srv_};
    const bool chunked = version >= 11;
    if (!chunked) keep_alive = false;
    http::response<http::empty_body> res{static_cast<http::status>(resp.status), version};
    AddHeaders(res, opts_, resp);
    res.keep_alive(keep_alive);
    if (chunked) res.chunked(true);
    http::response_serializer<http::empty_body> sr(res);
    {
      WriteBudget wb(stream_);
      http::write_header(stream_, sr, ec);
    }
    if (ec) {
      srv_.Observe(req, resp.status, req.start_ms_, " (client gone before the stream)");
      return Next::kClose;
    }
    ChunkedWriter writer(stream_, chunked);
    bool threw = false;
    try {
      resp.stream(writer);
    } catch (const std::exception& e) {
      threw = true;
      LogError(Cat("http: stream for ", req.method_, " ", req.path_, " threw: ", e.what()));
    } catch (...) {
      threw = true;
      LogError(Cat("http: stream for ", req.method_, " ", req.path_, " threw"));
    }
    const bool sse = StartsWithIgnoreCase(resp.content_type, "text/event-stream");
    if (threw) {
      keep_alive = false;
      // SSE: tell the client in-band. Downloads: no terminating chunk, so the client sees a
      // truncated (failed) transfer rather than a short file.
      if (sse) writer.WriteEvent("error", ErrorBody("internal", "internal server error"));
      if (sse) writer.Finish();
    } else {
      writer.Finish();
    }
    srv_.Observe(req, resp.status, req.start_ms_,
                 Cat(" stream ", writer.bytes_written(), "B", writer.ok() ? "" : " (client gone)",
                     threw ? " (handler threw)" : ""));
    if (!writer.ok()) return Next::kClose;
    if (!keep_alive) return StopSending(), Next::kLinger;
    return Next::kKeep;
  }

  // Stop sending now (the I/O thread then drains and closes the connection).
  void StopSending() { shutdown(fd_, SHUT_WR); }

  Next Upgrade(Request& req, Response::WebSocketFn fn);

  Impl& srv_;
  const HttpServer::Options& opts_;
  net::io_context& ioc_;
  Socket sock_;
  const int fd_;
  const PeerInfo peer_;
  const std::string peer_key_;
  net::steady_timer timer_;
  uint64_t timer_gen_ = 0;
  beast::flat_buffer buf_;
  size_t counted_ = 0;  // this connection's part of Impl::header_bytes
  State state_ = State::kWaiting;
  bool fresh_ = true;            // never served a request (its idle wait is header_timeout)
  bool header_started_ = false;  // a byte of the next request has arrived
  std::optional<http::request_parser<http::empty_body>> hp_;
  bool header_moved_ = false;  // hp_ was moved into a body parser
  // The request in progress (worker).
  FdStream stream_;
  std::unique_ptr<Request> req_;
  const Handler* handler_ = nullptr;
  const RouteOptions* route_ = nullptr;
  uint64_t id_ = 0;
  unsigned version_ = 11;
  bool keep_alive_ = false;
  bool has_body_ = false;
  uint64_t clen_ = 0;
};

// ---------------------------------------------------------------------------------------------
// WebSocket sessions

// An upgraded connection: the I/O thread runs the WebSocket (handshake, reads into an inbox,
// queued writes, pings, the closing handshake); the handler on its worker calls the synchronous
// WebSocket interface, which posts to the I/O thread and waits.
class WsSession : public WebSocket, public std::enable_shared_from_this<WsSession> {
 public:
  WsSession(std::shared_ptr<Conn> conn)
      : conn_(std::move(conn)), opts_(conn_->opts_), ioc_(conn_->ioc_), fd_(conn_->fd_) {}

  // I/O thread: takes the connection's socket and answers the upgrade.
  void Accept(const http::request<http::empty_body>& req, std::function<void(error_code)> done) {
    ws_.emplace(std::move(conn_->sock_));
    websocket::stream_base::timeout t{};
    t.handshake_timeout = opts_.header_timeout;
    t.idle_timeout = opts_.websocket_idle_timeout;
    t.keep_alive_pings = true;  // a ping at half the idle timeout; no answer at all → dropped
    ws_->set_option(t);
    ws_->set_option(
        websocket::stream_base::decorator([name = opts_.server_name](websocket::response_type& r) {
          r.set(http::field::server, name);
        }));
    ws_->read_message_max(opts_.websocket_max_message_bytes);
    ws_->async_accept(req, [self = shared_from_this(), done = std::move(done)](error_code ec) {
      done(ec);
      if (!ec) self->ReadNext();
    });
  }

  bool Send(std::string_view data, bool binary) override {
    auto out = std::make_shared<Out>();
    out->data.assign(data);
    out->binary = binary;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (closed_) return false;
    }
    net::post(ioc_, [self = shared_from_this(), out] {
      self->outq_.push_back(out);
      if (self->outq_.size() == 1) self->WriteNext();
    });
    std::unique_lock<std::mutex> lock(mu_);
    const auto deadline = std::chrono::steady_clock::now() + opts_.write_timeout;
    if (!cv_.wait_until(lock, deadline, [&] { return out->done || closed_; })) {
      lock.unlock();
      Abort("write timed out");
      return false;
    }
    if (out->ok) ++sent_;
    return out->ok;
  }

  absl::StatusOr<Message> Receive(std::chrono::milliseconds timeout) override {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, timeout, [&] { return !inbox_.empty() || closed_; });
    if (!inbox_.empty()) {
      Message m = std::move(inbox_.front());
      inbox_.pop_front();
      inbox_bytes_ -= m.data.size();
      if (paused_ && inbox_bytes_ < InboxLimit()) {
        paused_ = false;
        net::post(ioc_, [self = shared_from_this()] { self->ReadNext(); });
      }
      return m;
    }
    if (closed_) return absl::UnavailableError(why_);
    return absl::DeadlineExceededError("no WebSocket message within the timeout");
  }

  void Close(int code, std::string_view reason) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (close_sent_ || closed_) return;  // closing already, or closed by the client / lost
      close_sent_ = true;
    }
    websocket::close_reason cr;
    cr.code = static_cast<std::uint16_t>(code);
    reason = reason.substr(0, 123);
    cr.reason.assign(reason.data(), reason.size());
    net::post(ioc_, [self = shared_from_this(), cr] {
      auto done = [self](error_code ec) {
        {
          std::lock_guard<std::mutex> lock(self->mu_);
          self->close_done_ = true;
        }
        self->MarkClosed(ec ? Cat("closing failed: ", ec.message())
                            : std::string("closed by the server"));
      };
      if (self->ws_ && self->ws_->is_open()) {
        self->ws_->async_close(cr, done);
      } else {
        done(error_code());
      }
    });
    // The closing handshake ends when the client answered (Beast then tears the connection
    // down); the pending read sees the client's close frame first, so wait for the close itself.
    std::unique_lock<std::mutex> lock(mu_);
    const auto deadline = std::chrono::steady_clock::now() + opts_.write_timeout;
    if (!cv_.wait_until(lock, deadline, [&] { return close_done_; })) {
      lock.unlock();
      Abort("the client did not complete the closing handshake");
    }
  }

  bool ClientGone() override {
    std::lock_guard<std::mutex> lock(mu_);
    return closed_;
  }

  // The worker is done with the handler: close (1000, or 1011 if it threw), and drop the
  // connection if that does not complete.
  void Finish(bool threw) { Close(threw ? kError : kNormal, threw ? "internal error" : ""); }

  uint64_t received() {
    std::lock_guard<std::mutex> lock(mu_);
    return received_;
  }
  uint64_t sent() {
    std::lock_guard<std::mutex> lock(mu_);
    return sent_;
  }

 private:
  struct Out {
    std::string data;
    bool binary = false;
    bool done = false;  // guarded by mu_
    bool ok = false;
  };

  // Messages the handler has not taken yet, beyond which reading pauses (backpressure).
  size_t InboxLimit() const { return std::max<size_t>(opts_.websocket_max_message_bytes, 1); }

  // I/O thread.
  void ReadNext() {
    ws_->async_read(rbuf_,
                    [self = shared_from_this()](error_code ec, size_t) { self->OnMessage(ec); });
  }
  void OnMessage(error_code ec) {
    if (ec) {
      std::string why;
      if (ec == websocket::error::closed) {
        const auto& r = ws_->reason();
        why = Cat("closed by the client (code ", static_cast<int>(r.code),
                  r.reason.empty()
                      ? ""
                      : Cat(": ", LogSafe(std::string_view(r.reason.data(), r.reason.size()))),
                  ")");
      } else if (ec == websocket::error::message_too_big) {
        why = Cat("closed with 1009: a message exceeded ", opts_.websocket_max_message_bytes,
                  " bytes");
      } else {
        why = Cat("connection lost: ", ec.message());
      }
      return MarkClosed(why);
    }
    Message m;
    m.data = beast::buffers_to_string(rbuf_.data());
    m.binary = ws_->got_binary();
    rbuf_.consume(rbuf_.size());
    if (rbuf_.capacity() > (64 << 10)) rbuf_.shrink_to_fit();
    bool more = true;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++received_;
      inbox_bytes_ += m.data.size();
      inbox_.push_back(std::move(m));
      if (inbox_bytes_ >= InboxLimit() || inbox_.size() >= 64) {
        paused_ = true;
        more = false;
      }
    }
    cv_.notify_all();
    if (more) ReadNext();
  }
  void WriteNext() {
    const std::shared_ptr<Out>& out = outq_.front();
    ws_->binary(out->binary);
    ws_->async_write(net::buffer(out->data), [self = shared_from_this()](error_code ec, size_t) {
      std::shared_ptr<Out> done = self->outq_.front();
      self->outq_.pop_front();
      {
        std::lock_guard<std::mutex> lock(self->mu_);
        done->done = true;
        done->ok = !ec;
      }
      self->cv_.notify_all();
      if (ec) {
        // Fail the writes still queued too.
        std::lock_guard<std::mutex> lock(self->mu_);
        for (auto& o : self->outq_) o->done = true;
        self->outq_.clear();
        return;
      }
      if (!self->outq_.empty()) self->WriteNext();
    });
  }
  void MarkClosed(std::string why) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!closed_) why_ = "WebSocket " + why;
      closed_ = true;
    }
    cv_.notify_all();
  }
  // Any thread: drops the connection at once.
  void Abort(std::string why) {
    MarkClosed(why);
    net::post(ioc_, [self = shared_from_this()] {
      error_code ec;
      if (self->ws_) beast::get_lowest_layer(*self->ws_).close(ec);
    });
  }

  std::shared_ptr<Conn> conn_;  // keeps the connection counted while the WebSocket is open
  const HttpServer::Options& opts_;
  net::io_context& ioc_;
  const int fd_;
  std::optional<websocket::stream<Socket>> ws_;  // I/O thread
  beast::flat_buffer rbuf_;                      // I/O thread
  std::deque<std::shared_ptr<Out>> outq_;        // I/O thread
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Message> inbox_;
  size_t inbox_bytes_ = 0;
  bool paused_ = false;
  bool closed_ = false;
  bool close_sent_ = false;
  bool close_done_ = false;
  std::string why_;
  uint64_t received_ = 0;
  uint64_t sent_ = 0;
};

Conn::Next Conn::Upgrade(Request& req, Response::WebSocketFn fn) {
  if (header_moved_ || !websocket::is_upgrade(hp_->get())) {
    Response r = ErrorResponse(426, "bad_request",
                               "this endpoint takes a WebSocket upgrade (Connection: Upgrade, "
                               "Upgrade: websocket, Sec-WebSocket-Key, Sec-WebSocket-Version: 13)");
    r.SetHeader("Upgrade", "websocket");
    return Finish(req, std::move(r), version_, false);
  }
  if (buf_.size() > 0) {
    return Finish(req,
                  ErrorResponse(400, "bad_request", "data sent before the WebSocket handshake"),
                  version_, false);
  }
  if (!srv_.BeginStream()) {
    if (uint64_t n = srv_.stream_log.Hit()) {
      LogWarn(Cat("http: ", srv_.max_streams, " streams open; refusing a WebSocket with 503 (", n,
                  " times so far)"));
    }
    return Finish(
        req,
        Unavailable(Cat("too many streams open (limit ", srv_.max_streams, "); retry shortly")),
        version_, false);
  }
  struct StreamSlot {
    Impl& srv;
    ~StreamSlot() { srv.EndStream(); }
  } stream_slot{srv_};
  state_ = State::kWebSocket;
  auto session = std::make_shared<WsSession>(shared_from_this());
  auto accepted = std::make_shared<std::promise<error_code>>();
  std::future<error_code> accepted_f = accepted->get_future();
  auto upgrade = std::make_shared<http::request<http::empty_body>>(hp_->get());
  net::post(ioc_, [session, upgrade, accepted] {
    session->Accept(*upgrade, [accepted](error_code ec) { accepted->set_value(ec); });
  });
  // The handshake is bounded by handshake_timeout (header_timeout); the margin covers a busy
  // I/O thread.
  if (accepted_f.wait_for(opts_.header_timeout + std::chrono::seconds(5)) !=
          std::future_status::ready ||
      accepted_f.get()) {
    srv_.Observe(req, 400, req.start_ms_, " (WebSocket handshake failed)");
    session->Finish(false);
    return Next::kWebSocket;
  }
  srv_.Observe(req, 101, req.start_ms_, " websocket");
  bool threw = false;
  try {
    fn(*session);
  } catch (const std::exception& e) {
    threw = true;
    LogError(
        Cat("http: WebSocket handler for ", req.method_, " ", req.path_, " threw: ", e.what()));
  } catch (...) {
    threw = true;
    LogError(Cat("http: WebSocket handler for ", req.method_, " ", req.path_, " threw"));
  }
  session->Finish(threw);
  if (opts_.access_log && srv_.AccessLogAdmit(101, MonotonicMs())) {
    LogInfo(Cat("http websocket ", LogSafe(req.path_), " ended after ", req.ElapsedMs(),
                "ms: ", session->received(), " messages in, ", session->sent(), " out ",
                peer_.address, threw ? " (handler threw)" : ""));
  }
  return Next::kWebSocket;
}

}  // namespace http_internal

// ---------------------------------------------------------------------------------------------
// Listening and accepting

absl::Status HttpServer::Impl::ListenTcp() {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  std::string port = std::to_string(opts.port);
  int rc = getaddrinfo(opts.host.empty() ? nullptr : opts.host.c_str(), port.c_str(), &hints, &res);
  if (rc != 0) {
    return absl::InvalidArgumentError(
        Cat("cannot resolve listen address '", opts.host, "': ", gai_strerror(rc)));
  }
  absl::Status last = absl::UnavailableError("no usable address");
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    UniqueFd fd(socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!fd) {
      last = ErrnoStatus("socket");
      continue;
    }
    int one = 1;
    setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0) {
      last = ErrnoStatus(Cat("bind ", opts.host, ":", opts.port));
      continue;
    }
    if (listen(fd.get(), 4096) != 0) {
      last = ErrnoStatus("listen");
      continue;
    }
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    getsockname(fd.get(), reinterpret_cast<sockaddr*>(&ss), &len);
    tcp_port = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                              : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
    Listener l;
    l.fd = fd.release();
    l.family = ai->ai_family;
    listeners.push_back(std::move(l));
    freeaddrinfo(res);
    return absl::OkStatus();
  }
  freeaddrinfo(res);
  return last;
}

absl::Status HttpServer::Impl::ListenUnix() {
  const std::string& path = opts.unix_socket_path;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(Cat("unix socket path too long: ", path));
  }
  memcpy(addr.sun_path, path.data(), path.size());
  struct stat st;
  if (lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      return absl::FailedPreconditionError(
          Cat(path, " exists and is not a socket; refusing to replace it"));
    }
    UniqueFd probe(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (probe && connect(probe.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
      return absl::AlreadyExistsError(Cat(path, " is in use by a running server"));
    }
    // SECURITY: only a socket (checked above with lstat, so not a symlink target) that nobody
    // listens on is removed: a stale file left by a dead daemon.
    if (unlink(path.c_str()) != 0 && errno != ENOENT) {
      return ErrnoStatus(Cat("unlink stale socket ", path));
    }
  }
  UniqueFd fd(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd) return ErrnoStatus("socket(AF_UNIX)");
  if (bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return ErrnoStatus(Cat("bind ", path));
  }
  // SECURITY: the socket's mode is its access control (0660: owner and group only). It is set
  // before listen(), so nobody can connect while the mode is still the umask default.
  if (chmod(path.c_str(), static_cast<mode_t>(opts.unix_socket_mode)) != 0) {
    absl::Status s = ErrnoStatus(Cat("chmod ", path));
    unlink(path.c_str());
    return s;
  }
  if (listen(fd.get(), 4096) != 0) {
    absl::Status s = ErrnoStatus("listen");
    unlink(path.c_str());
    return s;
  }
  Listener l;
  l.fd = fd.release();
  l.family = AF_UNIX;
  l.is_unix = true;
  listeners.push_back(std::move(l));
  return absl::OkStatus();
}

void HttpServer::Impl::WaitAccept(Listener& l) {
  l.acceptor->async_wait(Acceptor::wait_read, [this, &l](error_code ec) {
    if (ec || stopping.load()) return;
    AcceptAll(l);
  });
}

// Takes the listener out for a moment (kAcceptBackoffMs), for an accept error that retrying at
// once would only repeat (out of fds with nothing to close, out of kernel memory): the I/O
// thread never spins on a listener it cannot serve, and keeps serving everything else.
void HttpServer::Impl::PauseAccepting(Listener& l, int err) {
  if (uint64_t times = accept_log.Hit()) {
    LogWarn(Cat("http: accept: ", strerror(err), "; pausing accepts for ", kAcceptBackoffMs,
                " ms (", times, " times so far)"));
  }
  l.pause->expires_after(std::chrono::milliseconds(kAcceptBackoffMs));
  l.pause->async_wait([this, &l](error_code ec) {
    if (!ec && !stopping.load()) WaitAccept(l);
  });
}

void HttpServer::Impl::AcceptAll(Listener& l) {
  for (int i = 0; i < 256; ++i) {
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    int fd = accept4(l.fd, reinterpret_cast<sockaddr*>(&ss), &len, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd >= 0) {
      Admit(fd, ss, l);
      continue;
    }
    const int err = errno;
    if (err == EMFILE || err == ENFILE) {
      // Out of fds despite the cap (other parts of the daemon use fds too): make room by
      // closing the oldest idle connection; with none, use the reserve fd to take the waiting
      // connection off the queue and refuse it, so that it is not retried forever.
      if (EvictOldest("out of file descriptors")) return PauseAccepting(l, err);
      if (reserve_fd >= 0) {
        close(reserve_fd);
        reserve_fd = -1;
        int refused = accept4(l.fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (refused >= 0) {
          SendAndClose(refused, opts, 503, "unavailable",
                       "the server is out of file descriptors; retry shortly");
        }
        reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
        if (uint64_t times = accept_log.Hit()) {
          LogWarn(Cat("http: accept: ", strerror(err), "; refused a connection (", times,
                      " times so far)"));
        }
        if (refused >= 0 && reserve_fd >= 0) continue;
      }
      return PauseAccepting(l, err);
    }
    if (err == ENOBUFS || err == ENOMEM) return PauseAccepting(l, err);
    break;  // EAGAIN (drained), ECONNABORTED, EINTR, ...
  }
  WaitAccept(l);
}

void HttpServer::Impl::Admit(int fd, const sockaddr_storage& ss, const Listener& l) {
  PeerInfo peer = PeerOf(fd, ss, l.is_unix);
  std::string key = PeerKey(peer);
  if (open_conns.load() >= max_open && !EvictOldest("open-connection cap")) {
    SendAndClose(fd, opts, 503, "unavailable", "too many connections");
    return;
  }
  bool admitted = false;
  {
    std::lock_guard<std::mutex> lock(peer_mu);
    int& n = peers[key];
    if (n < max_per_peer) {
      ++n;
      admitted = true;
    }
  }
  if (!admitted) {
    // At its own cap a peer displaces its own oldest idle connection, never somebody else's;
    // with none idle (all busy), the new connection is refused.
    bool evicted = EvictOldest("the peer's connection cap", &key);
    if (uint64_t times = peer_log.Hit()) {
      LogWarn(Cat("http: ", max_per_peer, " connections open from ", LogSafe(key), "; ",
                  evicted ? "closed its oldest idle one" : "refusing another with 503", " (", times,
                  " times so far)"));
    }
    if (!evicted) {
      SendAndClose(fd, opts, 503, "unavailable",
                   Cat("too many connections from this client (limit ", max_per_peer, ")"));
      return;
    }
    std::lock_guard<std::mutex> lock(peer_mu);
    ++peers[key];  // the evicted one is un-counted when it is gone
  }
  IoThread& t = *io[next_io.fetch_add(1) % io.size()];
  Socket sock(t.ioc);
  error_code ec;
  sock.assign(net::generic::stream_protocol(l.family, l.is_unix ? 0 : IPPROTO_TCP), fd, ec);
  if (ec) {
    LogError(Cat("http: cannot adopt an accepted socket: ", ec.message()));
    close(fd);
    std::lock_guard<std::mutex> lock(peer_mu);
    if (--peers[key] <= 0) peers.erase(key);
    return;
  }
  // Counted from here on: the connection's destructor un-counts it.
  open_conns.fetch_add(1);
  auto conn = std::make_shared<http_internal::Conn>(*this, t.ioc, std::move(sock), std::move(peer),
                                                    std::move(key));
  conn->ListNew();
  net::post(t.ioc, [conn] { conn->Start(); });
}

bool HttpServer::Impl::EvictOldest(std::string_view why, const std::string* peer_key) {
  std::shared_ptr<http_internal::Conn> victim;
  {
    std::lock_guard<std::mutex> lock(wait_mu);
    for (auto it = waiting.begin(); it != waiting.end() && !victim;) {
      http_internal::Conn* c = *it;
      if (peer_key != nullptr && c->peer_key() != *peer_key) {
        ++it;
        continue;
      }
      it = waiting.erase(it);
      c->listed = false;
      victim = c->weak_from_this().lock();  // null if it is being destroyed
    }
  }
  if (!victim) return false;
  if (uint64_t times = evict_log.Hit()) {
    LogWarn(Cat("http: closing the oldest idle connection (", victim->peer().address, "): ", why,
                " (", times, " times so far)"));
  }
  net::post(victim->ioc(), [victim] { victim->Evict(); });
  return true;
}

// Once a second on io[0]: the access log's overflow summary, returning freed memory.
void HttpServer::Impl::Tick() {
  const int64_t now = MonotonicMs();
  if (opts.access_log) AccessLogAdmit(-1, now);
  if (trim_wanted.load() && now - last_trim >= kTrimIntervalMs) {
    trim_wanted = false;
    last_trim = now;
    malloc_trim(0);
  }
  tick->expires_after(std::chrono::seconds(1));
  tick->async_wait([this](error_code ec) {
    if (!ec && !stopping.load()) Tick();
  });
}

bool HttpServer::Impl::AccessLogAdmit(int status, int64_t now) {
  if (opts.access_log_lines_per_second <= 0) return true;
  std::string summary;
  bool admit = false;
  {
    std::lock_guard<std::mutex> lock(log_mu);
    const double rate = opts.access_log_lines_per_second;
    if (log_refill_ms == 0) {
      log_tokens = rate;
      log_refill_ms = now;
      log_summary_ms = now;
    }
    log_tokens = std::min(rate, log_tokens + (now - log_refill_ms) * rate / 1000.0);
    log_refill_ms = now;
    if (status >= 0 && log_tokens >= 1) {
      log_tokens -= 1;
      admit = true;
    } else if (status >= 0) {
      ++log_dropped;
      if (status >= 400 && status < 500) ++log_dropped_4xx;
    }
    if (log_dropped > 0 && now - log_summary_ms >= 1000) {
      summary = Cat("access log: ", log_dropped, " requests not logged (", log_dropped_4xx,
                    " 4xx) in the last ", now - log_summary_ms, " ms (limit ",
                    opts.access_log_lines_per_second, " lines/s)");
      log_dropped = 0;
      log_dropped_4xx = 0;
    }
    if (now - log_summary_ms >= 1000) log_summary_ms = now;
  }
  if (!summary.empty()) LogWarn(summary);
  return admit;
}

void HttpServer::Impl::Observe(const Request& req, int status, int64_t start_ms,
                               std::string_view extra) {
  const int64_t now = MonotonicMs();
  int64_t ms = now - start_ms;
  if (opts.access_log && AccessLogAdmit(status, now)) {
    LogInfo(Cat("http ", req.method_.empty() ? "-" : LogSafe(req.method_), " ",
                LogSafe(req.path_.empty() ? req.target_ : req.path_), " ", status, " ", ms, "ms ",
                req.peer_.address, extra));
  }
  if (opts.on_response) {
    try {
      opts.on_response(req, status, ms);
    } catch (...) {
    }
  }
}

// ---------------------------------------------------------------------------------------------
// HttpServer

HttpServer::HttpServer(Options options) : impl_(std::make_shared<Impl>(std::move(options))) {}

HttpServer::~HttpServer() { Stop(); }

Router& HttpServer::router() { return impl_->router; }

absl::Status HttpServer::Start() {
  std::lock_guard<std::mutex> lock(impl_->lifecycle_mu);
  Impl& s = *impl_;
  if (s.started) return absl::FailedPreconditionError("HttpServer already started");
  if (s.opts.port < 0 && s.opts.unix_socket_path.empty()) {
    return absl::InvalidArgumentError("HttpServer: no TCP port and no unix socket configured");
  }
  if (s.opts.max_connections < 1) {
    return absl::InvalidArgumentError("HttpServer: max_connections must be at least 1");
  }
  if (s.opts.io_threads < 1 || s.opts.io_threads > 64) {
    return absl::InvalidArgumentError("HttpServer: io_threads must be 1..64");
  }
  s.max_open = s.opts.max_open_connections;
  if (s.max_open <= 0) {
    rlimit rl{};
    getrlimit(RLIMIT_NOFILE, &rl);
    rlim_t soft = rl.rlim_cur == RLIM_INFINITY ? (1 << 20) : rl.rlim_cur;
    s.max_open = static_cast<int>(std::min<rlim_t>(soft / 4 * 3, 1 << 20));
  }
  s.max_open = std::max(s.max_open, s.opts.max_connections + 16);
  s.max_per_peer = s.opts.max_open_connections_per_peer > 0
                       ? s.opts.max_open_connections_per_peer
                       : std::max(1, s.max_open - s.max_open / 8);
  s.max_streams = s.opts.max_streams > 0 ? s.opts.max_streams : s.opts.max_connections;
  s.max_requests_per_principal = s.opts.max_requests_per_principal > 0
                                     ? s.opts.max_requests_per_principal
                                     : std::max(1, s.opts.max_connections / 4);
  s.max_response_per_principal = s.opts.max_buffered_response_bytes_per_principal > 0
                                     ? s.opts.max_buffered_response_bytes_per_principal
                                     : s.opts.max_buffered_response_bytes / 4;
  s.max_body_per_principal = s.opts.max_buffered_body_bytes_per_principal > 0
                                 ? s.opts.max_buffered_body_bytes_per_principal
                                 : s.opts.max_buffered_body_bytes / 4;
  if (s.reserve_fd < 0) s.reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (s.reserve_fd < 0) return ErrnoStatus("open /dev/null");
  absl::Status st;
  if (s.opts.port >= 0) st = s.ListenTcp();
  if (st.ok() && !s.opts.unix_socket_path.empty()) st = s.ListenUnix();
  if (!st.ok()) {
    for (const Impl::Listener& l : s.listeners) close(l.fd);
    s.listeners.clear();
    s.tcp_port = -1;
    return st;
  }
  s.pool = std::make_unique<http_internal::WorkerPool>(
      s.opts.max_connections, s.opts.worker_stack_bytes, s.opts.worker_idle_timeout);
  for (int i = 0; i < s.opts.io_threads; ++i) {
    auto t = std::make_unique<Impl::IoThread>();
    t->guard.emplace(t->ioc.get_executor());
    s.io.push_back(std::move(t));
  }
  net::io_context& main = s.io[0]->ioc;
  for (Impl::Listener& l : s.listeners) {
    l.acceptor = std::make_unique<Acceptor>(main);
    l.pause = std::make_unique<net::steady_timer>(main);
    error_code ec;
    l.acceptor->assign(net::generic::stream_protocol(l.family, l.is_unix ? 0 : IPPROTO_TCP), l.fd,
                       ec);
    if (ec) return absl::InternalError(Cat("http: cannot adopt a listener: ", ec.message()));
    l.acceptor->non_blocking(true, ec);
    net::post(main, [impl = impl_.get(), &l] { impl->WaitAccept(l); });
  }
  s.tick = std::make_unique<net::steady_timer>(main);
  net::post(main, [impl = impl_.get()] { impl->Tick(); });
  for (auto& t : s.io) {
    net::io_context* ioc = &t->ioc;
    t->thread = std::thread([ioc] {
      for (;;) {
        try {
          ioc->run();
          return;
        } catch (const std::exception& e) {
          LogError(Cat("http: I/O thread: ", e.what()));
        }
      }
    });
  }
  s.started = true;
  std::vector<std::string> where;
  if (s.tcp_port >= 0) where.push_back(Cat(s.opts.host, ":", s.tcp_port));
  if (!s.opts.unix_socket_path.empty()) where.push_back(s.opts.unix_socket_path);
  LogInfo(Cat("http: listening on ", JoinStrings(where, " and "), " (", s.opts.io_threads,
              " I/O threads, ", s.opts.max_connections, " requests and ", s.max_streams,
              " streams at once, ", s.max_open, " open connections, ", s.max_per_peer,
              " per peer)"));
  return absl::OkStatus();
}

bool HttpServer::Stop() {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lock(s.lifecycle_mu);
  if (!s.started || s.stopped) return true;
  s.stopped = true;
  s.stopping.store(true);
  // Stop accepting (on the listeners' thread) and wait for it, so that nothing listens once
  // Stop() returns.
  auto closed = std::make_shared<std::promise<void>>();
  std::future<void> closed_f = closed->get_future();
  net::post(s.io[0]->ioc, [impl = impl_.get(), closed] {
    for (Impl::Listener& l : impl->listeners) {
      error_code ec;
      l.pause->cancel();
      l.acceptor->close(ec);  // closes l.fd
      l.fd = -1;
    }
    impl->tick->cancel();
    closed->set_value();
  });
  if (closed_f.wait_for(std::chrono::seconds(5)) != std::future_status::ready) {
    LogWarn("http: the accepting thread did not stop listening in time");
  }
  if (!s.opts.unix_socket_path.empty()) unlink(s.opts.unix_socket_path.c_str());
  // Idle and header-phase connections are closed at once; busy ones when their answer is done.
  while (s.EvictOldest("shutting down")) {
  }

  {
    std::unique_lock<std::mutex> ul(s.mu);
    s.cv.wait_for(ul, s.opts.drain_timeout, [&] { return s.busy.empty(); });
    if (!s.busy.empty()) {
      LogWarn(Cat("http: ", s.busy.size(),
                  " connection(s) still busy after the drain timeout; shutting them down"));
      // SECURITY-neutral: shutdown() on fds that are still open (a busy connection's socket is
      // closed only after it has left `busy`, under mu).
      for (const auto& [id, fd] : s.busy) shutdown(fd, SHUT_RDWR);
      s.cv.wait_for(ul, std::chrono::seconds(2), [&] { return s.busy.empty(); });
    }
  }
  bool clean;
  {
    std::lock_guard<std::mutex> ul(s.mu);
    clean = s.busy.empty();
    if (!clean) {
      LogWarn(Cat("http: ", s.busy.size(), " handler(s) still running after Stop(); detached"));
    }
  }
  // Whatever the I/O threads still hold (lingering connections, WebSockets whose handlers are
  // gone) is closed when the server is destroyed.
  for (auto& t : s.io) {
    t->guard.reset();
    t->ioc.stop();
  }
  for (auto& t : s.io) {
    if (t->thread.joinable()) t->thread.join();
  }
  return clean;
}

int HttpServer::tcp_port() const { return impl_->tcp_port; }

int HttpServer::active_connections() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return static_cast<int>(impl_->busy.size());
}

int HttpServer::open_connections() const { return impl_->open_conns.load(); }

}  // namespace esb::api
