// HTTP/1.1 server: Beast for parsing and serialising, our own poll()-based socket stream for
// deadlines, an epoll poller for idle and header-phase connections, one thread per request. See
// http_server.h for the model.
#include "api/http_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <malloc.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <linux/sockios.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <exception>
#include <limits>
#include <list>
#include <mutex>
#include <set>
#include <thread>
#include <unordered_map>

#include "api/json_util.h"
#include "boost/asio/buffer.hpp"
#include "boost/asio/error.hpp"
#include "boost/asio/write.hpp"
#include "boost/beast/core/error.hpp"
#include "boost/beast/core/flat_buffer.hpp"
#include "boost/beast/http.hpp"
#include "common/util.h"

namespace esb::api {
namespace {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = boost::beast::http;
using boost::system::error_code;

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
// every operation waits with poll() against a deadline. Reads can also be made interruptible by
// the server's stop eventfd (for idle keep-alive waits).

class FdStream {
 public:
  FdStream(int fd, int stop_fd, int64_t write_timeout_ms, uint64_t min_write_rate,
           int64_t rate_grace_ms)
      : fd_(fd),
        stop_fd_(stop_fd),
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

  // Waits until the socket is readable (data or EOF). False on timeout, stop or error.
  bool WaitReadable(int64_t deadline_ms, bool interruptible) {
    for (;;) {
      int64_t left = deadline_ms - MonotonicMs();
      if (left <= 0) return false;
      pollfd fds[2] = {{fd_, POLLIN, 0}, {stop_fd_, POLLIN, 0}};
      int r = poll(fds, interruptible ? 2 : 1, static_cast<int>(std::min<int64_t>(left, 1 << 30)));
      if (r < 0) {
        if (errno == EINTR) continue;
        return false;
      }
      if (r == 0) continue;
      if (interruptible && fds[1].revents != 0) return false;
      return true;
    }
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
  int stop_fd_;
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

bool PeerHasClosed(int fd) {
  if (fd < 0) return false;
  pollfd pfd{fd, POLLRDHUP, 0};
  if (poll(&pfd, 1, 0) <= 0) return false;
  return (pfd.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

// How long a connection that was answered and is being closed may keep sending (its bytes are
// read and dropped by the poller), so that the answer is not destroyed by a TCP RST, which the
// kernel sends when a socket is closed with unread data.
constexpr int64_t kLingerMs = 2000;

// Buffered responses up to this size are not counted in the response budget.
constexpr uint64_t kUncountedResponseBytes = 64 << 10;
// Freeing a body or response this large asks the poller to return memory to the system.
constexpr uint64_t kTrimWorthyBytes = 1 << 20;
// The poller calls malloc_trim at most this often, and only after such a free.
constexpr int64_t kTrimIntervalMs = 2000;

// How long the poller stops accepting after an accept error it cannot resolve at once (out of
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
    if (PeerHasClosed(stream_.fd())) return Broken();
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
    if (ok_ && PeerHasClosed(stream_.fd())) ok_ = false;
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

}  // namespace

// ---------------------------------------------------------------------------------------------
// Request

std::string Request::Param(std::string_view name) const {
  auto it = params_.find(name);
  return it == params_.end() ? std::string() : it->second;
}

std::optional<std::string> Request::Query(std::string_view key) const {
  for (const auto& [k, v] : query_) {
    if (k == key) return v;
  }
  return std::nullopt;
}

std::vector<std::string> Request::QueryAll(std::string_view key) const {
  std::vector<std::string> out;
  for (const auto& [k, v] : query_) {
    if (k == key) out.push_back(v);
  }
  return out;
}

std::optional<std::string> Request::Header(std::string_view name) const {
  for (const auto& [k, v] : headers_) {
    if (EqualsIgnoreCase(k, name)) return v;
  }
  return std::nullopt;
}

std::string Request::HeaderOr(std::string_view name, std::string_view fallback) const {
  std::optional<std::string> v = Header(name);
  return v ? *v : std::string(fallback);
}

bool Request::Accepts(std::string_view mime_type) const {
  for (const auto& [k, v] : headers_) {
    if (!EqualsIgnoreCase(k, "accept")) continue;
    for (std::string_view item : SplitString(v, ',')) {
      std::string_view type = TrimAscii(item.substr(0, item.find(';')));
      if (EqualsIgnoreCase(type, mime_type)) return true;
    }
  }
  return false;
}

std::string Request::ContentType() const {
  std::optional<std::string> v = Header("content-type");
  if (!v) return "";
  std::string_view type = TrimAscii(std::string_view(*v).substr(0, v->find(';')));
  return ToLowerAscii(type);
}

bool Request::ClientGone() const { return PeerHasClosed(fd_); }

int64_t Request::ElapsedMs() const { return MonotonicMs() - start_ms_; }

// ---------------------------------------------------------------------------------------------
// Response

bool ResponseWriter::WriteEvent(std::string_view event, const boost::json::value& data) {
  return WriteEventText(event, boost::json::serialize(data));
}

bool ResponseWriter::WriteEventText(std::string_view event, std::string_view data) {
  std::string out;
  out.reserve(event.size() + data.size() + 24);
  if (!event.empty()) {
    out.append("event: ");
    for (char c : event) {
      if (c != '\r' && c != '\n') out.push_back(c);
    }
    out.push_back('\n');
  }
  // Every line of data becomes its own "data:" field; the client joins them with '\n'.
  size_t start = 0;
  for (;;) {
    size_t end = data.find_first_of("\r\n", start);
    std::string_view line = data.substr(start, end == std::string_view::npos ? end : end - start);
    out.append("data: ").append(line).push_back('\n');
    if (end == std::string_view::npos) break;
    start = end + 1;
    if (data[end] == '\r' && start < data.size() && data[start] == '\n') ++start;
  }
  out.push_back('\n');
  return Write(out);
}

bool ResponseWriter::WriteComment(std::string_view text) {
  std::string out = ": ";
  for (char c : text) {
    if (c != '\r' && c != '\n') out.push_back(c);
  }
  out.append("\n\n");
  return Write(out);
}

void Response::SetHeader(std::string_view name, std::string_view value) {
  for (auto& [k, v] : headers) {
    if (EqualsIgnoreCase(k, name)) {
      v = std::string(value);
      return;
    }
  }
  headers.emplace_back(std::string(name), std::string(value));
}

Response Response::Stream(int status, std::string content_type, StreamFn fn) {
  Response r;
  r.status = status;
  r.content_type = std::move(content_type);
  r.stream = std::move(fn);
  return r;
}

Response Response::Sse(StreamFn fn) {
  Response r = Stream(200, "text/event-stream", std::move(fn));
  r.SetHeader("Cache-Control", "no-cache");
  r.SetHeader("X-Accel-Buffering", "no");
  return r;
}

Response Response::Text(int status, std::string body, std::string content_type) {
  Response r;
  r.status = status;
  r.content_type = std::move(content_type);
  r.body = std::move(body);
  return r;
}

Response JsonResponse(int status, const boost::json::value& value) {
  Response r;
  r.status = status;
  r.body = boost::json::serialize(value);
  return r;
}

boost::json::object ErrorBody(std::string_view code, std::string_view message) {
  boost::json::object o;
  o["error"] = true;
  o["code"] = code;
  o["message"] = message;
  return o;
}

Response ErrorResponse(int status, std::string_view code, std::string_view message) {
  return JsonResponse(status, ErrorBody(code, message));
}

Response ErrorResponse(int status, std::string_view message) {
  return ErrorResponse(status, ErrorCodeForStatus(status), message);
}

std::string_view ErrorCodeForStatus(int status) {
  switch (status) {
    case 400:
      return "bad_request";
    case 401:
      return "unauthorized";
    case 403:
      return "forbidden";
    case 404:
      return "not_found";
    case 405:
      return "method_not_allowed";
    case 409:
      return "conflict";
    case 413:
      return "payload_too_large";
    case 415:
      return "unsupported_media_type";
    case 422:
      return "unprocessable";
    case 429:
      return "too_many_requests";
    case 503:
      return "unavailable";
    default:
      return status >= 500 ? "internal" : "bad_request";
  }
}

Response StatusResponse(const absl::Status& status) {
  int code = 500;
  switch (status.code()) {
    case absl::StatusCode::kOk:
      code = 200;
      break;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kPermissionDenied:
    case absl::StatusCode::kUnimplemented:
      code = 400;
      break;
    case absl::StatusCode::kUnauthenticated:
      code = 401;
      break;
    case absl::StatusCode::kNotFound:
      code = 404;
      break;
    case absl::StatusCode::kAlreadyExists:
    case absl::StatusCode::kAborted:
      code = 409;
      break;
    case absl::StatusCode::kResourceExhausted:
      code = 429;
      break;
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDeadlineExceeded:
      code = 503;
      break;
    default:
      code = 500;
  }
  if (code == 200) return JsonResponse(200, boost::json::object{{"error", false}});
  return ErrorResponse(code, StdView(status.message()));
}

std::optional<std::string> BearerToken(const Request& req) {
  std::optional<std::string> h = req.Header("authorization");
  if (!h) return std::nullopt;
  std::string_view v = TrimAscii(*h);
  if (v.size() < 7 || !EqualsIgnoreCase(v.substr(0, 7), "bearer ")) return std::nullopt;
  std::string_view token = TrimAscii(v.substr(7));
  if (token.empty()) return std::nullopt;
  return std::string(token);
}

// ---------------------------------------------------------------------------------------------
// Router

void Router::Add(std::string method, std::string_view pattern, Handler handler,
                 RouteOptions options) {
  Route r;
  r.method = std::move(method);
  std::string_view p = pattern;
  if (!p.empty() && p.front() == '/') p.remove_prefix(1);
  if (!p.empty() && p.back() == '/') p.remove_suffix(1);
  if (!p.empty()) {
    for (std::string_view seg : SplitString(p, '/')) r.segments.emplace_back(seg);
  }
  r.handler = std::move(handler);
  r.options = options;
  routes_.push_back(std::move(r));
}

Router::Match Router::Find(std::string_view method,
                           const std::vector<std::string>& segments) const {
  Match best;
  int best_score = -1;
  std::vector<std::string> allowed;
  for (const Route& r : routes_) {
    if (r.segments.size() != segments.size()) continue;
    int score = 0;
    bool match = true;
    for (size_t i = 0; i < segments.size(); ++i) {
      const std::string& s = r.segments[i];
      bool is_param = s.size() >= 2 && s.front() == '{' && s.back() == '}';
      if (is_param) continue;
      if (s != segments[i]) {
        match = false;
        break;
      }
      // Earlier literal segments weigh more, so "/a/x/{p}" beats "/a/{q}/y".
      score += 1 << std::min<size_t>(20, segments.size() - i);
    }
    if (!match) continue;
    best.path_known = true;
    if (std::find(allowed.begin(), allowed.end(), r.method) == allowed.end()) {
      allowed.push_back(r.method);
    }
    if (r.method != method || score <= best_score) continue;
    best_score = score;
    best.handler = &r.handler;
    best.options = &r.options;
    best.params.clear();
    for (size_t i = 0; i < segments.size(); ++i) {
      const std::string& s = r.segments[i];
      if (s.size() >= 2 && s.front() == '{' && s.back() == '}') {
        best.params[s.substr(1, s.size() - 2)] = segments[i];
      }
    }
  }
  best.allow = JoinStrings(allowed, ", ");
  return best;
}

// ---------------------------------------------------------------------------------------------
// Server internals

struct HttpServer::Impl : std::enable_shared_from_this<HttpServer::Impl> {
  explicit Impl(Options o) : opts(std::move(o)) {}
  ~Impl() {
    for (Listener& l : listeners) {
      if (l.fd >= 0) close(l.fd);
    }
    if (stop_fd >= 0) close(stop_fd);
    if (wake_fd >= 0) close(wake_fd);
    if (epoll_fd >= 0) close(epoll_fd);
    if (reserve_fd >= 0) close(reserve_fd);
  }

  struct Listener {
    int fd = -1;
    bool is_unix = false;
  };

  // A connection handed back by a request thread (keep-alive), with the bytes it had read past
  // the end of its last request (pipelining).
  struct Parked {
    int fd = -1;
    PeerInfo peer;
    std::string pending;
    bool draining = false;
  };

  absl::Status ListenTcp();
  absl::Status ListenUnix();
  void PollLoop();
  void Serve(uint64_t id, int fd, PeerInfo peer, std::string prefill, int64_t header_deadline);
  // A request thread is done with a connection: hand it back to the poller, for the next
  // request (keep-alive) or to be drained and closed (`draining`, see kLingerMs).
  void Park(uint64_t id, int fd, PeerInfo peer, std::string pending, bool draining);
  void Finished(uint64_t id, int fd);
  void Observe(const Request& req, int status, int64_t start_ms, std::string_view extra);
  // The access log's token bucket (Options::access_log_lines_per_second): true if a line for
  // a response with `status` may be written now; counts and, once a second, summarises the
  // lines it refuses. status < 0: only emit a due summary (the poller's timer).
  bool AccessLogAdmit(int status, int64_t now);

  // What one principal (RouteOptions::before_body) holds right now.
  struct Share {
    int requests = 0;
    uint64_t body_bytes = 0;
    uint64_t response_bytes = 0;
    bool empty() const { return requests <= 0 && body_bytes == 0 && response_bytes == 0; }
  };
  enum class Reserved { kOk, kOverShare, kOverBudget };

  // A request thread for `principal`, within its share of max_connections. False: over it.
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

  Options opts;
  Router router;
  int stop_fd = -1;
  int wake_fd = -1;  // eventfd: a request thread parked a connection
  int epoll_fd = -1;
  int max_open = 0;  // open-connection cap (Options::max_open_connections, resolved)
  // Kept open so that, out of fds, the poller can still accept (and refuse) a connection.
  int reserve_fd = -1;
  LogThrottle busy_log, thread_log, evict_log, accept_log, failed_log;  // per-connection logs
  std::vector<Listener> listeners;
  std::thread poller;
  int tcp_port = -1;

  std::mutex mu;
  std::condition_variable cv;
  std::map<uint64_t, int> conns;  // request threads: id → fd; an fd is closed only under `mu`
  std::vector<Parked> parked;     // handed back, not yet taken by the poller
  uint64_t next_id = 1;
  std::atomic<bool> stopping{false};
  std::atomic<int> poller_conns{0};     // connections the poller owns (idle / header phase)

  std::mutex share_mu;
  std::map<std::string, Share> shares;  // principals with a request in progress
  uint64_t body_bytes = 0;              // buffered request bodies, all connections
  int max_requests_per_principal = 0;   // resolved Options (0 → a quarter)
  uint64_t max_body_per_principal = 0;
  uint64_t response_bytes = 0;  // buffered responses being written, all connections
  uint64_t max_response_per_principal = 0;
  // Set when a large body or response was freed; the poller then returns freed memory to the
  // system (malloc_trim) once things are quiet, at most every kTrimIntervalMs.
  std::atomic<bool> trim_wanted{false};
  // Asks the poller for a malloc_trim, waking it (it may be asleep with no deadline to keep).
  void WantTrim() {
    if (trim_wanted.exchange(true)) return;
    Wake();
  }
  void Wake() {
    uint64_t one = 1;
    if (wake_fd >= 0) (void)!write(wake_fd, &one, sizeof(one));
  }

  std::mutex log_mu;  // the access log's token bucket
  double log_tokens = 0;
  int64_t log_refill_ms = 0;
  int64_t log_summary_ms = 0;
  uint64_t log_dropped = 0;
  uint64_t log_dropped_4xx = 0;
  bool LogSummaryPending() {
    std::lock_guard<std::mutex> lock(log_mu);
    return log_dropped > 0;
  }

  std::mutex lifecycle_mu;
  bool started = false;
  bool stopped = false;
};

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
    if (listen(fd.get(), 1024) != 0) {
      last = ErrnoStatus("listen");
      continue;
    }
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    getsockname(fd.get(), reinterpret_cast<sockaddr*>(&ss), &len);
    tcp_port = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                              : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
    listeners.push_back({fd.release(), false});
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
  if (listen(fd.get(), 1024) != 0) {
    absl::Status s = ErrnoStatus("listen");
    unlink(path.c_str());
    return s;
  }
  listeners.push_back({fd.release(), true});
  return absl::OkStatus();
}

namespace {

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

// A complete error answer for a connection the poller closes, sent without blocking (best
// effort: a client that does not read simply does not get it).
void SendAndClose(int fd, const HttpServer::Options& opts, int status, std::string_view reason,
                  std::string_view code, std::string_view message) {
  std::string body = boost::json::serialize(ErrorBody(code, message));
  std::string msg =
      Cat("HTTP/1.1 ", status, " ", reason, "\r\nServer: ", opts.server_name,
          "\r\nContent-Type: application/json\r\nContent-Length: ", body.size(),
          status == 503 ? "\r\nRetry-After: 1" : "", "\r\nConnection: close\r\n\r\n", body);
  (void)send(fd, msg.data(), msg.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
  shutdown(fd, SHUT_WR);
  close(fd);
}

// The poller's view of a connection that is idle or still sending its request header.
struct PollConn {
  int fd = -1;
  PeerInfo peer;
  std::string buf;               // header bytes so far (≤ max_header_bytes + one read)
  int64_t deadline = 0;          // MonotonicMs(): idle or header deadline
  bool header_started = false;   // a byte of the next request has arrived
  bool fresh = true;             // never served a request (idle wait = header_timeout)
  bool draining = false;         // answered and half-closed: read and drop until EOF or deadline
  std::list<int>::iterator age;  // position in the eviction order (oldest first)
};

}  // namespace

// The poller: accepts, reads headers without blocking, enforces the header / idle deadlines and
// the open-connection and header-memory caps, and starts a request thread once a header block
// is complete. Runs until the server stops; then closes every connection it owns.
void HttpServer::Impl::PollLoop() {
  int64_t accept_paused_until = 0;              // listeners out of epoll until then (0: not)
  std::unordered_map<int, PollConn> pc;         // fd → state
  std::list<int> age;                           // fds, in the order they entered the poller
  std::set<std::pair<int64_t, int>> deadlines;  // (deadline, fd)
  uint64_t header_bytes = 0;                    // sum of pc[*].buf.capacity()

  auto set_deadline = [&](PollConn& c, int64_t d) {
    deadlines.erase({c.deadline, c.fd});
    c.deadline = d;
    deadlines.insert({d, c.fd});
  };
  // Forgets a connection (the fd stays open: the caller closes it or hands it on).
  auto forget = [&](int fd) -> PollConn {
    auto it = pc.find(fd);
    PollConn c = std::move(it->second);
    pc.erase(it);
    deadlines.erase({c.deadline, fd});
    age.erase(c.age);
    header_bytes -= c.buf.capacity();
    epoll_ctl(epoll_fd, EPOLL_CTL_DEL, fd, nullptr);
    poller_conns.fetch_sub(1);
    return c;
  };
  auto drop = [&](int fd) {
    forget(fd);
    close(fd);
  };
  auto open_total = [&] {
    std::lock_guard<std::mutex> lock(mu);
    return pc.size() + conns.size();
  };
  // Hands a connection with a complete header to a request thread (or answers 503).
  auto dispatch = [&](int fd) {
    PollConn c = forget(fd);
    uint64_t id = 0;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (!stopping.load() && static_cast<int>(conns.size()) < opts.max_connections) {
        id = next_id++;
        conns[id] = fd;
      }
    }
    if (id == 0) {
      if (uint64_t times = busy_log.Hit()) {
        LogWarn(Cat("http: ", opts.max_connections, " requests in progress; answering 503 to ",
                    c.peer.address, " (", times, " times so far)"));
      }
      SendAndClose(fd, opts, 503, "Service Unavailable", "unavailable",
                   stopping.load() ? "server is shutting down"
                                   : "too many requests in progress; retry shortly");
      return;
    }
    try {
      std::thread([self = shared_from_this(), id, fd, peer = std::move(c.peer),
                   buf = std::move(c.buf), deadline = c.deadline]() mutable {
        self->Serve(id, fd, std::move(peer), std::move(buf), deadline);
      }).detach();
    } catch (const std::exception& e) {
      if (uint64_t times = thread_log.Hit()) {
        LogError(Cat("http: cannot start a request thread: ", e.what(), " (", times,
                     " times so far)"));
      }
      Finished(id, fd);
    }
  };
  // Looks for the end of the header block; handles a complete or an oversized header.
  // Returns false if the connection is gone (dispatched or closed).
  auto check_header = [&](PollConn& c, size_t scan_from) -> bool {
    size_t from = scan_from >= 3 ? scan_from - 3 : 0;
    size_t end = c.buf.find("\r\n\r\n", from);
    if (end != std::string::npos && end + 4 <= opts.max_header_bytes + 4) {
      dispatch(c.fd);
      return false;
    }
    if (c.buf.size() > opts.max_header_bytes) {
      int fd = c.fd;
      forget(fd);
      SendAndClose(fd, opts, 400, "Bad Request", "bad_request",
                   Cat("request header too large (limit ", opts.max_header_bytes, " bytes)"));
      return false;
    }
    return true;
  };
  auto add = [&](int fd, PeerInfo peer, std::string pending, bool fresh, bool draining) {
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLRDHUP;
    ev.data.fd = fd;
    if (epoll_ctl(epoll_fd, EPOLL_CTL_ADD, fd, &ev) != 0) {
      LogError(Cat("http: epoll_ctl add: ", strerror(errno)));
      close(fd);
      return;
    }
    PollConn& c = pc[fd];
    c.fd = fd;
    c.peer = std::move(peer);
    c.buf = std::move(pending);
    c.fresh = fresh;
    c.draining = draining;
    c.header_started = !c.buf.empty();
    header_bytes += c.buf.capacity();
    age.push_back(fd);
    c.age = std::prev(age.end());
    poller_conns.fetch_add(1);
    int64_t wait = draining                    ? kLingerMs
                   : c.header_started || fresh ? opts.header_timeout.count()
                                               : opts.idle_timeout.count();
    c.deadline = MonotonicMs() + wait;
    deadlines.insert({c.deadline, fd});
    if (c.header_started) check_header(c, 0);
  };
  // Closes the connection that has been in the poller longest (idle or trickling a header).
  auto evict_oldest = [&](std::string_view why) -> bool {
    if (age.empty()) return false;
    int fd = age.front();
    if (uint64_t times = evict_log.Hit()) {
      LogWarn(Cat("http: closing the oldest idle connection (", pc[fd].peer.address, "): ", why,
                  " (", times, " times so far)"));
    }
    drop(fd);
    return true;
  };
  // Takes the listeners out of epoll for a moment (the poller's timer puts them back), for an
  // accept error that retrying at once would only repeat. The poller never sleeps: deadlines
  // and parked connections keep being served meanwhile.
  auto pause_accepting = [&](int err) {
    if (uint64_t times = accept_log.Hit()) {
      LogWarn(Cat("http: accept: ", strerror(err), "; pausing accepts for ", kAcceptBackoffMs,
                  " ms (", times, " times so far)"));
    }
    if (accept_paused_until != 0) return;
    for (const Listener& l : listeners) epoll_ctl(epoll_fd, EPOLL_CTL_DEL, l.fd, nullptr);
    accept_paused_until = MonotonicMs() + kAcceptBackoffMs;
  };
  auto accept_all = [&](const Listener& l) {
    for (int i = 0; i < 256; ++i) {
      sockaddr_storage ss{};
      socklen_t len = sizeof(ss);
      int fd = accept4(l.fd, reinterpret_cast<sockaddr*>(&ss), &len, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) {
        const int err = errno;
        if (err == EMFILE || err == ENFILE) {
          // Out of fds despite the cap (other parts of the daemon use fds too): make room by
          // closing the oldest idle connection; with none, use the reserve fd to take the
          // waiting connection off the queue and refuse it, so that it is not retried forever.
          if (evict_oldest("out of file descriptors")) continue;
          if (reserve_fd >= 0) {
            close(reserve_fd);
            reserve_fd = -1;
            int refused = accept4(l.fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
            if (refused >= 0) {
              SendAndClose(refused, opts, 503, "Service Unavailable", "unavailable",
                           "the server is out of file descriptors; retry shortly");
            }
            reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
            if (uint64_t times = accept_log.Hit()) {
              LogWarn(Cat("http: accept: ", strerror(err), "; refused a connection (", times,
                          " times so far)"));
            }
            if (refused >= 0 && reserve_fd >= 0) continue;
          }
          pause_accepting(err);
          return;
        }
        if (err == ENOBUFS || err == ENOMEM) pause_accepting(err);
        return;  // EAGAIN (drained), ECONNABORTED, EINTR, ...
      }
      if (static_cast<int>(open_total()) >= max_open && !evict_oldest("open-connection cap")) {
        SendAndClose(fd, opts, 503, "Service Unavailable", "unavailable", "too many connections");
        continue;
      }
      add(fd, PeerOf(fd, ss, l.is_unix), std::string(), /*fresh=*/true, /*draining=*/false);
    }
  };
  auto on_readable = [&](int fd) {
    auto it = pc.find(fd);
    if (it == pc.end()) return;
    PollConn& c = it->second;
    char tmp[16384];
    if (c.draining) {
      ssize_t n = recv(fd, tmp, sizeof(tmp), MSG_DONTWAIT);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        drop(fd);
      }
      return;
    }
    size_t room = opts.max_header_bytes + 1 - std::min(c.buf.size(), opts.max_header_bytes);
    ssize_t n = recv(fd, tmp, std::min(sizeof(tmp), room), MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
      drop(fd);  // closed (or reset) while idle or mid-header: nothing to answer
      return;
    }
    if (n < 0) return;
    if (!c.header_started) {
      c.header_started = true;
      set_deadline(c, MonotonicMs() + opts.header_timeout.count());
    }
    size_t old = c.buf.size();
    header_bytes -= c.buf.capacity();
    c.buf.append(tmp, static_cast<size_t>(n));
    header_bytes += c.buf.capacity();
    if (!check_header(c, old)) return;
    while (header_bytes > opts.max_buffered_header_bytes && evict_oldest("header memory budget")) {
    }
  };
  auto expire = [&](int64_t now) {
    while (!deadlines.empty() && deadlines.begin()->first <= now) {
      int fd = deadlines.begin()->second;
      PollConn c = forget(fd);
      if (c.header_started && !c.draining) {
        Request req;
        req.peer_ = c.peer;
        Observe(req, 408, now, " (header read timeout)");
        SendAndClose(fd, opts, 408, "Request Timeout", "bad_request",
                     "timed out reading the request header");
      } else {
        close(fd);  // idle: close quietly
      }
    }
  };
  auto take_parked = [&] {
    uint64_t v;
    (void)!read(wake_fd, &v, sizeof(v));
    std::vector<Parked> got;
    {
      std::lock_guard<std::mutex> lock(mu);
      got.swap(parked);
    }
    for (Parked& p : got) {
      add(p.fd, std::move(p.peer), std::move(p.pending), /*fresh=*/false, p.draining);
    }
  };

  auto resume_accepting = [&](int64_t now) {
    if (accept_paused_until == 0 || now < accept_paused_until) return;
    accept_paused_until = 0;
    for (const Listener& l : listeners) {
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.fd = l.fd;
      if (epoll_ctl(epoll_fd, EPOLL_CTL_ADD, l.fd, &ev) != 0) {
        LogError(Cat("http: epoll_ctl re-add listener: ", strerror(errno)));
      }
    }
  };

  int64_t last_trim = 0;
  std::vector<epoll_event> events(256);
  while (!stopping.load()) {
    int timeout = -1;
    int64_t next = deadlines.empty() ? 0 : deadlines.begin()->first;
    // Timers of their own: the access log's overflow summary, returning freed memory.
    const bool timers = trim_wanted.load() || (opts.access_log && LogSummaryPending());
    if (timers && (next == 0 || next > MonotonicMs() + 1000)) next = MonotonicMs() + 1000;
    if (accept_paused_until != 0 && (next == 0 || accept_paused_until < next)) {
      next = accept_paused_until;
    }
    if (next != 0) {
      int64_t left = next - MonotonicMs();
      timeout = static_cast<int>(std::clamp<int64_t>(left, 0, 1 << 30));
    }
    int n = epoll_wait(epoll_fd, events.data(), static_cast<int>(events.size()), timeout);
    if (n < 0) {
      if (errno == EINTR) continue;
      LogError(Cat("http: epoll_wait failed: ", strerror(errno)));
      break;
    }
    for (int i = 0; i < n; ++i) {
      int fd = events[i].data.fd;
      if (fd == stop_fd) break;
      if (fd == wake_fd) {
        take_parked();
        continue;
      }
      bool is_listener = false;
      for (const Listener& l : listeners) {
        if (l.fd == fd) {
          accept_all(l);
          is_listener = true;
        }
      }
      if (!is_listener) on_readable(fd);
    }
    int64_t now = MonotonicMs();
    expire(now);
    resume_accepting(now);
    if (timers && opts.access_log) AccessLogAdmit(-1, now);
    if (trim_wanted.load() && now - last_trim >= kTrimIntervalMs) {
      // Large bodies and answers come and go in bursts; glibc keeps what they freed unless
      // asked, so after a burst the daemon's RSS would stay at its peak for good.
      trim_wanted = false;
      last_trim = now;
      malloc_trim(0);
    }
  }
  // Stopping: idle and header-phase connections are dropped at once.
  for (auto& [fd, c] : pc) close(fd);
  poller_conns.store(0);
  std::lock_guard<std::mutex> lock(mu);
  for (Parked& p : parked) close(p.fd);
  parked.clear();
}

void HttpServer::Impl::Park(uint64_t id, int fd, PeerInfo peer, std::string pending,
                            bool draining) {
  std::lock_guard<std::mutex> lock(mu);
  conns.erase(id);
  if (stopping.load()) {
    close(fd);
  } else {
    parked.push_back({fd, std::move(peer), std::move(pending), draining});
    uint64_t one = 1;
    (void)!write(wake_fd, &one, sizeof(one));
  }
  cv.notify_all();
}

void HttpServer::Impl::Finished(uint64_t id, int fd) {
  std::lock_guard<std::mutex> lock(mu);
  conns.erase(id);
  close(fd);
  cv.notify_all();
}

namespace {
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
}  // namespace

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
      if (log_dropped == 0) Wake();  // the poller's timer writes the summary
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

namespace {

// One request on a connection whose header block the poller has read: parse → route → admit →
// read the body → handle → write the response. A keep-alive connection then goes back to the
// poller with whatever the client sent beyond this request (pipelining).
class Connection {
 public:
  Connection(HttpServer::Impl& srv, int fd, PeerInfo peer, std::string_view prefill,
             int64_t header_deadline)
      : srv_(srv),
        opts_(srv.opts),
        stream_(fd, srv.stop_fd, opts_.write_timeout.count(), opts_.min_write_bytes_per_second,
                opts_.min_rate_grace.count()),
        buffer_(std::max<size_t>(opts_.max_header_bytes + (128 << 10), 1 << 20)),
        peer_(std::move(peer)),
        header_deadline_(header_deadline) {
    net::mutable_buffer b = buffer_.prepare(prefill.size());
    memcpy(b.data(), prefill.data(), prefill.size());
    buffer_.commit(prefill.size());
  }

  // Returns true if the connection may be reused; `Pending()` then has the bytes read beyond
  // this request.
  bool Run() { return HandleOne(); }

  // True if the connection should be closed politely (see kLingerMs): the poller drains it.
  bool lingering() const { return lingering_; }

  std::string Pending() const {
    return std::string(static_cast<const char*>(buffer_.data().data()), buffer_.size());
  }

 private:
  // A buffered body's part of its principal's share and of the server-wide budget; released
  // on destruction.
  struct BodyBudget {
    HttpServer::Impl& srv;
    const std::string& principal;
    uint64_t bytes = 0;
    HttpServer::Impl::Reserved Grow(uint64_t more) {
      HttpServer::Impl::Reserved r = srv.ReserveBody(principal, more);
      if (r == HttpServer::Impl::Reserved::kOk) bytes += more;
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
    HttpServer::Impl& srv;
    const std::string& principal;
    uint64_t bytes = 0;
    ~ResponseBudget() {
      srv.ReleaseResponse(principal, bytes);
      if (bytes >= kTrimWorthyBytes) srv.WantTrim();
    }
  };

  // One of the principal's request threads (Options::max_requests_per_principal).
  struct RequestSlot {
    HttpServer::Impl& srv;
    std::string principal;
    bool held = false;
    ~RequestSlot() {
      if (held) srv.ReleaseRequest(principal);
    }
  };

  // Returns true if the connection may be reused.
  bool HandleOne() {
    Request req;
    req.fd_ = stream_.fd();
    req.peer_ = peer_;
    req.start_ms_ = MonotonicMs();

    http::request_parser<http::empty_body> hp;
    hp.header_limit(static_cast<std::uint32_t>(opts_.max_header_bytes));
    hp.body_limit(boost::none);  // checked per route below
    // The poller's deadline: the header does not get more time for having changed threads.
    stream_.set_read_deadline(header_deadline_);
    error_code ec;
    http::read_header(stream_, buffer_, hp, ec);
    if (ec) {
      if (ec == http::error::end_of_stream) return false;  // closed between requests
      if (ec == beast::error::timeout) {
        Observe(req, 408, " (header read timeout)");
        SendError(408, "bad_request", "timed out reading the request header", 11);
        return false;
      }
      if (ec == http::error::partial_message || ec == net::error::eof) return false;
      if (ec == http::error::header_limit || ec == http::error::buffer_overflow) {
        SendError(400, "bad_request",
                  Cat("request header too large (limit ", opts_.max_header_bytes, " bytes)"), 11);
        Observe(req, 400, " (header too large)");
        return false;
      }
      if (ec.category() == boost::system::system_category()) return false;  // socket error
      SendError(400, "bad_request", Cat("malformed HTTP request: ", ec.message()), 11);
      Observe(req, 400, " (malformed)");
      return false;
    }

    const auto& h = hp.get();
    const unsigned version = h.version();
    req.method_ = std::string(h.method_string());
    req.target_ = std::string(h.target());
    for (const auto& f : h) {
      req.headers_.emplace_back(std::string(f.name_string()), std::string(f.value()));
    }
    bool keep_alive = hp.keep_alive();
    const bool chunked = hp.chunked();
    // Content-Length, or 0 if absent (chunked bodies are limited while they are read).
    const uint64_t clen = hp.content_length().value_or(0);
    const bool has_body = chunked || clen > 0;
    req.has_body_ = has_body;
    const bool expect_continue =
        EqualsIgnoreCase(TrimAscii(req.HeaderOr("expect", "")), "100-continue");

    // Target: origin-form only.
    std::string_view target = req.target_;
    size_t q = target.find('?');
    std::string_view raw_path = target.substr(0, q);
    std::vector<std::string> segments;
    if (!SplitPath(raw_path, &segments) || !PercentDecode(raw_path, false, &req.path_) ||
        (q != std::string_view::npos && !ParseQuery(target.substr(q + 1), &req.query_))) {
      req.path_.clear();
      return Finish(req, ErrorResponse(400, "bad_request", "malformed request target"), version,
                    false);
    }

    // Strict framing and identity headers (RFC 9110/9112): ambiguity here is how requests
    // get smuggled past a proxy or authenticated as someone else.
    if (std::optional<Response> bad = CheckHeaders(req, version)) {
      return Finish(req, std::move(*bad), version, false);
    }

    Router::Match match = srv_.router.Find(req.method_, segments);
    if (match.handler == nullptr) {
      if (match.path_known) {
        Response r = ErrorResponse(405, "method_not_allowed",
                                   Cat("method ", req.method_, " not allowed for ", req.path_,
                                       " (allowed: ", match.allow, ")"));
        r.SetHeader("Allow", match.allow);
        return Finish(req, std::move(r), version, keep_alive && !has_body);
      }
      return Finish(
          req,
          ErrorResponse(404, "not_found", Cat("no such endpoint: ", req.method_, " ", req.path_)),
          version, keep_alive && !has_body);
    }
    req.params_ = std::move(match.params);

    // A route that takes no body never reads one: the request is answered on its header, so an
    // announced body that never comes holds no thread and no budget.
    if (has_body && !match.options->accepts_body && !match.options->stream_body) {
      return Finish(req,
                    ErrorResponse(413, "payload_too_large",
                                  Cat(req.method_, " ", req.path_, " takes no request body")),
                    version, false);
    }

    // Admission (authentication) on the header alone: a client that is turned away never gets
    // a body byte read or buffered, nor a "100 Continue".
    if (match.options->before_body) {
      std::optional<Response> refused;
      try {
        refused = match.options->before_body(req);
      } catch (const std::exception& e) {
        LogError(Cat("http: before_body for ", req.method_, " ", req.path_, " threw: ", e.what()));
        refused = ErrorResponse(500, "internal", "internal server error");
      }
      if (refused) return Finish(req, std::move(*refused), version, keep_alive && !has_body);
    }
    // The admitted principal's fair share of the request threads.
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
                    version, keep_alive && !has_body);
    }
    slot.held = true;

    std::unique_ptr<StreamBodyReader> reader;
    BodyBudget budget{srv_, slot.principal};  // held until the handler is done with req.body_
    if (match.options->stream_body) {
      uint64_t cap = match.options->max_stream_body_bytes;
      if (clen > cap) {
        return Finish(req, TooLarge(cap), version, false);
      }
      reader = std::make_unique<StreamBodyReader>(stream_, buffer_, std::move(hp), cap,
                                                  opts_.body_timeout.count(),
                                                  expect_continue && has_body,
                                                  opts_.min_read_bytes_per_second,
                                                  opts_.min_rate_grace.count());
      req.body_reader_ = reader.get();
    } else if (has_body) {
      if (clen > opts_.max_body_bytes) {
        return Finish(req, TooLarge(opts_.max_body_bytes), version, false);
      }
      if (expect_continue) {
        static constexpr std::string_view kContinue = "HTTP/1.1 100 Continue\r\n\r\n";
        net::write(stream_, net::buffer(kContinue.data(), kContinue.size()), ec);
        if (ec) return false;
      }
      bool gone = false;
      std::optional<Response> failed = ReadBufferedBody(req, hp, clen, budget, &gone);
      if (failed || gone) {
        budget.Release();  // the partial body is freed already; the linger must not hold it
        if (gone) {
          Observe(req, 499, " (client went away during the body)");
          return false;
        }
        return Finish(req, std::move(*failed), version, false);
      }
    }

    Response resp;
    try {
      resp = (*match.handler)(req);
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
    if (!resp.stream) {
      // The body is not needed any more: free it (and its budget) before a possibly slow write.
      // (A stream function may still read the request, body included.)
      req.body_ = std::string();
      budget.Release();
    }
    return Finish(req, std::move(resp), version, keep_alive);
  }

  // Headers the server refuses to guess about: a second Host, Authorization or Content-Type
  // (which one would count?), an HTTP/1.1 request without Host, and any transfer coding other
  // than plain "chunked" (a "gzip, chunked" body decoded as plain chunked would be wrong).
  static std::optional<Response> CheckHeaders(const Request& req, unsigned version) {
    int host = 0, auth = 0, ctype = 0;
    std::vector<std::string> codings;
    for (const auto& [k, v] : req.headers_) {
      if (EqualsIgnoreCase(k, "host")) ++host;
      if (EqualsIgnoreCase(k, "authorization")) ++auth;
      if (EqualsIgnoreCase(k, "content-type")) ++ctype;
      if (EqualsIgnoreCase(k, "transfer-encoding")) {
        for (std::string_view c : SplitString(v, ',')) {
          codings.push_back(ToLowerAscii(TrimAscii(c)));
        }
      }
    }
    for (auto [count, name] : {std::pair{host, "Host"}, std::pair{auth, "Authorization"},
                               std::pair{ctype, "Content-Type"}}) {
      if (count > 1) {
        return ErrorResponse(400, "bad_request", Cat("more than one ", name, " header"));
      }
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

  // Reads a buffered body into req.body_, its memory counted in the server-wide budget: all of
  // a Content-Length up front (the parser reserves that much), a chunked body as it grows.
  // Returns the answer for a body that cannot be had (too large, over budget, too slow,
  // malformed), or sets *gone when the client went away; the partial body is freed by then.
  std::optional<Response> ReadBufferedBody(Request& req, http::request_parser<http::empty_body>& hp,
                                           uint64_t clen, BodyBudget& budget, bool* gone) {
    if (std::optional<Response> refused = Refusal(budget.Grow(clen))) return refused;
    http::request_parser<http::string_body> bp(std::move(hp));
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
      http::read_some(stream_, buffer_, bp, ec);
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
      return ErrorResponse(408, "bad_request",
                           too_slow ? SlowBodyMessage(opts_.min_read_bytes_per_second,
                                                      opts_.min_rate_grace.count())
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
  std::optional<Response> Refusal(HttpServer::Impl::Reserved r) {
    if (r == HttpServer::Impl::Reserved::kOk) return std::nullopt;
    if (r == HttpServer::Impl::Reserved::kOverShare) {
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
    Response resp = ErrorResponse(503, "unavailable",
                                  "the server is receiving too many request bodies at once; "
                                  "retry shortly");
    resp.SetHeader("Retry-After", "1");
    return resp;
  }

  static Response OverShare(std::string message) {
    Response r = ErrorResponse(429, "too_many_requests", message);
    r.SetHeader("Retry-After", "1");
    return r;
  }

  Response TooLarge(uint64_t limit) {
    return ErrorResponse(413, "payload_too_large",
                         Cat("request body exceeds the limit of ", limit, " bytes"));
  }

  void Observe(const Request& req, int status, std::string_view extra) {
    srv_.Observe(req, status, req.start_ms_ ? req.start_ms_ : MonotonicMs(), extra);
  }

  // Writes a complete error response and closes politely.
  void SendError(int status, std::string_view code, std::string_view message, unsigned version) {
    http::response<http::string_body> res{static_cast<http::status>(status), version};
    res.set(http::field::server, opts_.server_name);
    res.set(http::field::content_type, "application/json");
    res.body() = boost::json::serialize(ErrorBody(code, message));
    res.keep_alive(false);
    res.prepare_payload();
    error_code ec;
    {
      WriteBudget wb(stream_);
      http::write(stream_, res, ec);
    }
    if (!ec) Linger();
  }

  // Sends `resp` (plain or streamed) and logs it. Returns true if the connection stays open.
  bool Finish(Request& req, Response resp, unsigned version, bool keep_alive) {
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
    auto add_headers = [&](auto& res) {
      res.set(http::field::server, opts_.server_name);
      if (!resp.content_type.empty()) res.set(http::field::content_type, resp.content_type);
      for (const auto& [k, v] : resp.headers) {
        if (k.empty() || HasCrLf(k) || HasCrLf(v) || EqualsIgnoreCase(k, "content-length") ||
            EqualsIgnoreCase(k, "transfer-encoding") || EqualsIgnoreCase(k, "connection")) {
          continue;  // managed here, or would allow header injection
        }
        res.set(k, v);
      }
    };
    error_code ec;
    if (!resp.stream) {
      // A large answer is held until the client has taken it: it must fit the response budget.
      ResponseBudget held{srv_, req.principal_};
      if (resp.body.size() > kUncountedResponseBytes) {
        HttpServer::Impl::Reserved r = srv_.ReserveResponse(req.principal_, resp.body.size());
        if (r == HttpServer::Impl::Reserved::kOk) {
          held.bytes = resp.body.size();
        } else {
          static LogThrottle throttle;
          if (uint64_t n = throttle.Hit()) {
            LogWarn(Cat("http: buffered responses at their budget (",
                        r == HttpServer::Impl::Reserved::kOverShare ? "a principal's share"
                                                                   : "server-wide",
                        "); answering ", resp.body.size(), " bytes with an error (", n,
                        " times so far)"));
          }
          srv_.WantTrim();
          resp = r == HttpServer::Impl::Reserved::kOverShare
                     ? OverShare("this client is being sent too many large answers at once; "
                                 "retry shortly")
                     : ErrorResponse(503, "unavailable",
                                     "the server is sending too many large answers at once; "
                                     "retry shortly");
          if (resp.status == 503) resp.SetHeader("Retry-After", "1");
        }
      }
      http::response<http::string_body> res{static_cast<http::status>(resp.status), version};
      add_headers(res);
      res.body() = std::move(resp.body);
      res.keep_alive(keep_alive);
      res.prepare_payload();
      // Observed before writing, so that metrics are updated by the time the client sees the
      // answer (handy for tests; the write time of a small answer is negligible).
      Observe(req, resp.status, "");
      {
        WriteBudget wb(stream_);
        http::write(stream_, res, ec);
      }
      if (ec) return false;
      if (!keep_alive) Linger();
      return keep_alive;
    }

    // Streamed: chunked on HTTP/1.1; on HTTP/1.0 the body ends when the connection closes.
    const bool chunked = version >= 11;
    if (!chunked) keep_alive = false;
    http::response<http::empty_body> res{static_cast<http::status>(resp.status), version};
    add_headers(res);
    res.keep_alive(keep_alive);
    if (chunked) res.chunked(true);
    http::response_serializer<http::empty_body> sr(res);
    {
      WriteBudget wb(stream_);
      http::write_header(stream_, sr, ec);
    }
    if (ec) {
      Observe(req, resp.status, " (client gone before the stream)");
      return false;
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
    Observe(req, resp.status,
            Cat(" stream ", writer.bytes_written(), "B", writer.ok() ? "" : " (client gone)",
                threw ? " (handler threw)" : ""));
    if (!writer.ok()) return false;
    if (!keep_alive) Linger();
    return keep_alive;
  }

  // Closes politely: stop sending now; the poller swallows what the client still sends for a
  // while (no request thread is held for that), then closes.
  void Linger() {
    shutdown(stream_.fd(), SHUT_WR);
    lingering_ = true;
  }

  HttpServer::Impl& srv_;
  const HttpServer::Options& opts_;
  bool lingering_ = false;
  FdStream stream_;
  beast::flat_buffer buffer_;
  PeerInfo peer_;
  int64_t header_deadline_;
};

}  // namespace

void HttpServer::Impl::Serve(uint64_t id, int fd, PeerInfo peer, std::string prefill,
                             int64_t header_deadline) {
  bool keep = false;
  bool linger = false;
  std::string pending;
  try {
    Connection conn(*this, fd, peer, prefill, header_deadline);
    prefill = std::string();  // the buffer has it now
    keep = conn.Run();
    linger = conn.lingering();
    if (keep) pending = conn.Pending();
  } catch (const std::exception& e) {
    if (uint64_t times = failed_log.Hit()) {
      LogError(Cat("http: connection failed: ", e.what(), " (", times, " times so far)"));
    }
    keep = false;
  } catch (...) {
    if (uint64_t times = failed_log.Hit()) {
      LogError(Cat("http: connection failed with a non-std exception (", times, " times so far)"));
    }
    keep = false;
  }
  if (keep) {
    Park(id, fd, std::move(peer), std::move(pending), /*draining=*/false);
  } else if (linger) {
    Park(id, fd, std::move(peer), std::string(), /*draining=*/true);
  } else {
    Finished(id, fd);
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
  s.max_open = s.opts.max_open_connections;
  if (s.max_open <= 0) {
    rlimit rl{};
    getrlimit(RLIMIT_NOFILE, &rl);
    rlim_t soft = rl.rlim_cur == RLIM_INFINITY ? (1 << 20) : rl.rlim_cur;
    s.max_open = static_cast<int>(std::min<rlim_t>(soft / 2, 1 << 20));
  }
  s.max_open = std::max(s.max_open, s.opts.max_connections + 16);
  s.max_requests_per_principal = s.opts.max_requests_per_principal > 0
                                     ? s.opts.max_requests_per_principal
                                     : std::max(1, s.opts.max_connections / 4);
  s.max_response_per_principal = s.opts.max_buffered_response_bytes_per_principal > 0
                                     ? s.opts.max_buffered_response_bytes_per_principal
                                     : s.opts.max_buffered_response_bytes / 4;
  s.max_body_per_principal = s.opts.max_buffered_body_bytes_per_principal > 0
                                 ? s.opts.max_buffered_body_bytes_per_principal
                                 : s.opts.max_buffered_body_bytes / 4;
  if (s.stop_fd < 0) s.stop_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (s.stop_fd < 0) return ErrnoStatus("eventfd");
  if (s.wake_fd < 0) s.wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (s.wake_fd < 0) return ErrnoStatus("eventfd");
  if (s.epoll_fd < 0) s.epoll_fd = epoll_create1(EPOLL_CLOEXEC);
  if (s.epoll_fd < 0) return ErrnoStatus("epoll_create1");
  if (s.reserve_fd < 0) s.reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (s.reserve_fd < 0) return ErrnoStatus("open /dev/null");
  absl::Status st;
  if (s.opts.port >= 0) st = s.ListenTcp();
  if (st.ok() && !s.opts.unix_socket_path.empty()) st = s.ListenUnix();
  std::vector<int> watched = {s.stop_fd, s.wake_fd};
  for (const Impl::Listener& l : s.listeners) watched.push_back(l.fd);
  for (int fd : watched) {
    if (!st.ok()) break;
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    if (epoll_ctl(s.epoll_fd, EPOLL_CTL_ADD, fd, &ev) != 0) st = ErrnoStatus("epoll_ctl");
  }
  if (!st.ok()) {
    for (const Impl::Listener& l : s.listeners) close(l.fd);
    s.listeners.clear();
    s.tcp_port = -1;
    return st;
  }
  s.poller = std::thread([impl = impl_.get()] { impl->PollLoop(); });
  s.started = true;
  std::vector<std::string> where;
  if (s.tcp_port >= 0) where.push_back(Cat(s.opts.host, ":", s.tcp_port));
  if (!s.opts.unix_socket_path.empty()) where.push_back(s.opts.unix_socket_path);
  LogInfo(Cat("http: listening on ", JoinStrings(where, " and "), " (", s.opts.max_connections,
              " requests at once, ", s.max_open, " open connections)"));
  return absl::OkStatus();
}

bool HttpServer::Stop() {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lock(s.lifecycle_mu);
  if (!s.started || s.stopped) return true;
  s.stopped = true;
  s.stopping.store(true);
  uint64_t one = 1;
  (void)!write(s.stop_fd, &one, sizeof(one));  // wakes the poller and idle request reads
  if (s.poller.joinable()) s.poller.join();    // it closes idle and header-phase connections
  for (Impl::Listener& l : s.listeners) {
    close(l.fd);
    l.fd = -1;
  }
  if (!s.opts.unix_socket_path.empty()) unlink(s.opts.unix_socket_path.c_str());

  std::unique_lock<std::mutex> ul(s.mu);
  s.cv.wait_for(ul, s.opts.drain_timeout, [&] { return s.conns.empty(); });
  if (!s.conns.empty()) {
    LogWarn(Cat("http: ", s.conns.size(),
                " connection(s) still busy after the drain timeout; shutting them down"));
    // SECURITY-neutral: shutdown() on fds we own and that are still open (closed only under mu).
    for (const auto& [id, fd] : s.conns) shutdown(fd, SHUT_RDWR);
    s.cv.wait_for(ul, std::chrono::seconds(2), [&] { return s.conns.empty(); });
  }
  bool clean = s.conns.empty();
  if (!clean) {
    LogWarn(
        Cat("http: ", s.conns.size(), " handler thread(s) still running after Stop(); detached"));
  }
  return clean;
}

int HttpServer::tcp_port() const { return impl_->tcp_port; }

int HttpServer::active_connections() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return static_cast<int>(impl_->conns.size());
}

int HttpServer::open_connections() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return static_cast<int>(impl_->conns.size() + impl_->parked.size()) + impl_->poller_conns.load();
}

}  // namespace esb::api
