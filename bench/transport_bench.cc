// Transport benchmarks for esbd (issue 10): an epoll-based HTTP/1.1 load generator that can hold
// tens of thousands of connections from one thread, and the same-run baselines each row is
// compared with. bench/run.sh (`bash bench/run.sh transport`) starts the daemons and runs:
//
//   transport_bench healthz --target ESBD --baseline BEAST [--pid P --baseline-pid P]
//       [--conns 4] [--seconds 2] [--rounds 4]
//       /healthz requests/s over keep-alive connections, esbd vs a Beast hello-world server
//       (bench/beast_hello.cc), alternating rounds so both see the same machine load; with the
//       pids, also each server's CPU time per request.
//   transport_bench idle --target ESBD --pid PID [--conns 10000] [--probe-seconds 5]
//       [--baseline BEAST --baseline-pid PID]
//       Opens --conns keep-alive connections (one GET /healthz each, then silent), holds them,
//       and probes /healthz latency on another connection before and while they are held;
//       reports the server's RSS per idle connection (VmRSS after - before, / connections held).
//   transport_bench sse --target ESBD [--conns 1000] [--path /run] [--body JSON] [--expect S]
//       Starts --conns streaming requests (Accept: text/event-stream) at once and reads every
//       stream to its end: wall time, errors, time to first byte, peak concurrent open streams.
//   transport_bench exec --target ESBD --env ID [--n 200] [--gap-ms 0]
//       `echo hi` through POST /environments/{id}/execute on one keep-alive connection,
//       interleaved with the baseline, fork+exec of /bin/echo (stdout read through a pipe), and
//       two context rows: fork+exec of `bash --noprofile --norc -c 'echo hi'` and GET /healthz
//       on the same connection (the HTTP floor). --gap-ms pauses before each of the four.
//
// Every row prints n, p50 and p99 (ms), its same-run baseline, and a verdict against the issue's
// target. Exit status 0 unless the bench itself could not run (a missed target is a result).
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace {

int64_t NowNs() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

double MsSince(int64_t t0) { return static_cast<double>(NowNs() - t0) / 1e6; }

// Nearest-rank percentile (same definition as bench/bench.py).
double Pct(std::vector<double> v, double p) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  size_t k = static_cast<size_t>(std::lround(p / 100.0 * static_cast<double>(v.size() - 1)));
  return v[std::min(k, v.size() - 1)];
}

[[noreturn]] void Die(const std::string& msg) {
  std::fprintf(stderr, "transport_bench: %s\n", msg.c_str());
  std::exit(2);
}

// Clients need one fd per connection. As root the hard limit can be raised too.
void RaiseNofile(rlim_t want) {
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return;
  if (rl.rlim_max < want) {
    rlimit up{want, want};
    if (setrlimit(RLIMIT_NOFILE, &up) == 0) return;
  }
  rl.rlim_cur = std::min(want, rl.rlim_max);
  setrlimit(RLIMIT_NOFILE, &rl);
  getrlimit(RLIMIT_NOFILE, &rl);
  if (rl.rlim_cur < want) {
    std::fprintf(stderr, "transport_bench: RLIMIT_NOFILE is %llu (< %llu wanted)\n",
                 static_cast<unsigned long long>(rl.rlim_cur),
                 static_cast<unsigned long long>(want));
  }
}

struct Target {
  sockaddr_in addr{};
  std::string host;  // for the Host header
};

Target ParseTarget(std::string s) {
  if (s.rfind("http://", 0) == 0) s = s.substr(7);
  while (!s.empty() && s.back() == '/') s.pop_back();
  size_t colon = s.rfind(':');
  if (colon == std::string::npos) Die("target must be HOST:PORT: " + s);
  Target t;
  t.host = s;
  t.addr.sin_family = AF_INET;
  t.addr.sin_port = htons(static_cast<uint16_t>(std::atoi(s.c_str() + colon + 1)));
  std::string ip = s.substr(0, colon);
  if (ip == "localhost") ip = "127.0.0.1";
  if (inet_pton(AF_INET, ip.c_str(), &t.addr.sin_addr) != 1) Die("not an IPv4 address: " + ip);
  return t;
}

std::string Get(const Target& t, const std::string& path) {
  return "GET " + path + " HTTP/1.1\r\nHost: " + t.host + "\r\n\r\n";
}

std::string Post(const Target& t, const std::string& path, const std::string& body,
                 bool sse = false) {
  return "POST " + path + " HTTP/1.1\r\nHost: " + t.host +
         "\r\nContent-Type: application/json\r\n" + (sse ? "Accept: text/event-stream\r\n" : "") +
         "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
}

bool IEquals(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(static_cast<unsigned char>(x)) ==
                  std::tolower(static_cast<unsigned char>(y));
         });
}

// An incremental HTTP/1.1 response parser: Content-Length, chunked, or close-delimited bodies.
// Keeps at most `body_cap` bytes of the body (the rest is counted, not stored).
class ResponseParser {
 public:
  explicit ResponseParser(size_t body_cap = 1 << 20) : body_cap_(body_cap) {}

  void Reset() { *this = ResponseParser(body_cap_); }

  // False on a malformed response (error()).
  bool Feed(std::string_view data) {
    buf_.append(data);
    for (;;) {
      switch (state_) {
        case kHead: {
          size_t end = buf_.find("\r\n\r\n");
          if (end == std::string::npos) {
            return buf_.size() <= 64 * 1024 || Fail("response header over 64 KiB");
          }
          if (!ParseHead(std::string_view(buf_).substr(0, end))) return false;
          buf_.erase(0, end + 4);
          headers_done_ = true;
          if (chunked_) {
            state_ = kChunkSize;
          } else if (content_length_ >= 0) {
            state_ = content_length_ == 0 ? kDone : kBody;
          } else if (status_ == 204 || status_ == 304 || status_ < 200) {
            state_ = kDone;
          } else {
            close_delimited_ = true;
            keep_alive_ = false;
            state_ = kBody;
          }
          break;
        }
        case kBody: {
          size_t take = buf_.size();
          if (!close_delimited_) {
            take = std::min<size_t>(take, static_cast<size_t>(content_length_) - body_seen_);
          }
          Keep(std::string_view(buf_).substr(0, take));
          buf_.erase(0, take);
          if (!close_delimited_ && body_seen_ == static_cast<size_t>(content_length_)) {
            state_ = kDone;
            break;
          }
          return true;
        }
        case kChunkSize: {
          size_t eol = buf_.find("\r\n");
          if (eol == std::string::npos) {
            return buf_.size() <= 1024 || Fail("chunk size line over 1 KiB");
          }
          std::string line = buf_.substr(0, eol);
          buf_.erase(0, eol + 2);
          char* end = nullptr;
          errno = 0;
          unsigned long long n = std::strtoull(line.c_str(), &end, 16);
          if (end == line.c_str() || errno != 0) return Fail("bad chunk size: " + line);
          if (n == 0) {
            state_ = kTrailers;
          } else {
            chunk_left_ = n;
            state_ = kChunkData;
          }
          break;
        }
        case kChunkData: {
          size_t take = std::min<size_t>(buf_.size(), chunk_left_);
          Keep(std::string_view(buf_).substr(0, take));
          buf_.erase(0, take);
          chunk_left_ -= take;
          if (chunk_left_ > 0) return true;
          state_ = kChunkEnd;
          break;
        }
        case kChunkEnd:
          if (buf_.size() < 2) return true;
          if (buf_.compare(0, 2, "\r\n") != 0) return Fail("chunk not followed by CRLF");
          buf_.erase(0, 2);
          state_ = kChunkSize;
          break;
        case kTrailers: {
          size_t eol = buf_.find("\r\n");
          if (eol == std::string::npos) return true;
          buf_.erase(0, eol + 2);
          if (eol == 0) state_ = kDone;
          break;
        }
        case kDone:
          if (!buf_.empty())
            return Fail("bytes after the response (" + std::to_string(buf_.size()) + ")");
          return true;
        case kError:
          return false;
      }
    }
  }

  // The peer closed: completes a close-delimited body. False if the response is incomplete.
  bool Eof() {
    if (state_ == kBody && close_delimited_) state_ = kDone;
    return state_ == kDone;
  }

  bool done() const { return state_ == kDone; }
  bool headers_done() const { return headers_done_; }
  int status() const { return status_; }
  bool keep_alive() const { return keep_alive_; }
  const std::string& body() const { return body_; }
  const std::string& error() const { return error_; }

 private:
  enum State { kHead, kBody, kChunkSize, kChunkData, kChunkEnd, kTrailers, kDone, kError };

  bool Fail(std::string e) {
    error_ = std::move(e);
    state_ = kError;
    return false;
  }

  void Keep(std::string_view d) {
    body_seen_ += d.size();
    if (body_.size() < body_cap_) body_.append(d.substr(0, body_cap_ - body_.size()));
  }

  bool ParseHead(std::string_view head) {
    size_t eol = head.find("\r\n");
    std::string_view status_line = head.substr(0, eol);
    if (status_line.size() < 12 || status_line.substr(0, 5) != "HTTP/") {
      return Fail("bad status line: " + std::string(status_line.substr(0, 80)));
    }
    keep_alive_ = status_line.substr(0, 8) == "HTTP/1.1";
    status_ = std::atoi(std::string(status_line.substr(9, 3)).c_str());
    while (eol != std::string_view::npos) {
      size_t start = eol + 2;
      eol = head.find("\r\n", start);
      std::string_view line = head.substr(start, eol == std::string_view::npos ? eol : eol - start);
      size_t colon = line.find(':');
      if (colon == std::string_view::npos) continue;
      std::string_view name = line.substr(0, colon);
      std::string_view value = line.substr(colon + 1);
      while (!value.empty() && (value.front() == ' ' || value.front() == '\t'))
        value.remove_prefix(1);
      if (IEquals(name, "content-length")) {
        content_length_ = std::atoll(std::string(value).c_str());
      } else if (IEquals(name, "transfer-encoding")) {
        chunked_ = value.find("chunked") != std::string_view::npos;
      } else if (IEquals(name, "connection")) {
        if (IEquals(value, "close")) keep_alive_ = false;
        if (IEquals(value, "keep-alive")) keep_alive_ = true;
      }
    }
    return true;
  }

  size_t body_cap_;
  State state_ = kHead;
  std::string buf_;
  std::string body_;
  std::string error_;
  size_t body_seen_ = 0;
  int64_t content_length_ = -1;
  uint64_t chunk_left_ = 0;
  int status_ = 0;
  bool chunked_ = false;
  bool close_delimited_ = false;
  bool keep_alive_ = true;
  bool headers_done_ = false;
};

struct Conn;
// Called once per request: ok with the parsed response, or !ok with a reason.
using DoneFn = std::function<void(Conn* c, bool ok, const std::string& error)>;

struct Conn {
  enum class Phase { kConnecting, kSending, kReceiving, kIdle, kClosed };
  int fd = -1;
  Phase phase = Phase::kConnecting;
  std::string out;
  size_t out_off = 0;
  ResponseParser resp;
  int64_t t_sent = 0;         // request handed to the loop
  int64_t t_headers = 0;      // response header complete
  bool dropped_idle = false;  // the server closed it (or sent bytes) while it was idle
  DoneFn on_done;
};

// One thread, one epoll set, level-triggered.
class Loop {
 public:
  Loop() : ep_(epoll_create1(EPOLL_CLOEXEC)) {
    if (ep_ < 0) Die(std::string("epoll_create1: ") + std::strerror(errno));
  }
  ~Loop() {
    for (auto& c : conns_) {
      if (c->fd >= 0) close(c->fd);
    }
    close(ep_);
  }

  // A new non-blocking connection (phase kConnecting), or nullptr with `error`.
  Conn* Connect(const Target& t, std::string* error) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      *error = std::string("socket: ") + std::strerror(errno);
      return nullptr;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    if (connect(fd, reinterpret_cast<const sockaddr*>(&t.addr), sizeof(t.addr)) != 0 &&
        errno != EINPROGRESS) {
      *error = std::string("connect: ") + std::strerror(errno);
      close(fd);
      return nullptr;
    }
    auto c = std::make_unique<Conn>();
    c->fd = fd;
    Watch(c.get(), EPOLLOUT | EPOLLIN | EPOLLRDHUP, EPOLL_CTL_ADD);
    conns_.push_back(std::move(c));
    return conns_.back().get();
  }

  // Sends a request (queued until the connection is up); `done` gets its response.
  void Send(Conn* c, std::string request, DoneFn done) {
    c->out = std::move(request);
    c->out_off = 0;
    c->resp.Reset();
    c->on_done = std::move(done);
    c->t_sent = NowNs();
    c->t_headers = 0;
    if (c->phase == Conn::Phase::kConnecting) return;
    c->phase = Conn::Phase::kSending;
    Watch(c, EPOLLOUT | EPOLLRDHUP, EPOLL_CTL_MOD);
  }

  void Close(Conn* c) {
    if (c->fd < 0) return;
    epoll_ctl(ep_, EPOLL_CTL_DEL, c->fd, nullptr);
    close(c->fd);
    c->fd = -1;
    c->phase = Conn::Phase::kClosed;
  }

  // Runs until `stop()` is true or `deadline_ns` passes; `tick` runs after every wake-up
  // (at least every `tick_ms`). False if the deadline passed.
  bool RunUntil(const std::function<bool()>& stop, int64_t deadline_ns,
                const std::function<void()>& tick = nullptr, int tick_ms = 50) {
    epoll_event events[512];
    while (!stop()) {
      if (NowNs() >= deadline_ns) return false;
      int n = epoll_wait(ep_, events, 512, tick_ms);
      if (n < 0 && errno != EINTR) Die(std::string("epoll_wait: ") + std::strerror(errno));
      for (int i = 0; i < n; ++i) Handle(static_cast<Conn*>(events[i].data.ptr), events[i].events);
      if (tick) tick();
    }
    return true;
  }

  size_t idle_dropped() const { return idle_dropped_; }

 private:
  void Watch(Conn* c, uint32_t events, int op) {
    epoll_event ev{};
    ev.events = events;
    ev.data.ptr = c;
    if (epoll_ctl(ep_, op, c->fd, &ev) != 0) Die(std::string("epoll_ctl: ") + std::strerror(errno));
  }

  void Fail(Conn* c, const std::string& why) {
    Close(c);
    if (c->on_done) {
      DoneFn done = std::move(c->on_done);
      c->on_done = nullptr;
      done(c, false, why);
    }
  }

  void Handle(Conn* c, uint32_t ev) {
    if (c->fd < 0) return;
    if (c->phase == Conn::Phase::kConnecting) {
      int err = 0;
      socklen_t len = sizeof(err);
      getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &len);
      if (err != 0) return Fail(c, std::string("connect: ") + std::strerror(err));
      if (!(ev & EPOLLOUT)) return;
      if (c->on_done) {
        c->phase = Conn::Phase::kSending;
      } else {
        c->phase = Conn::Phase::kIdle;
        Watch(c, EPOLLIN | EPOLLRDHUP, EPOLL_CTL_MOD);
        return;
      }
    }
    switch (c->phase) {
      case Conn::Phase::kSending: {
        while (c->out_off < c->out.size()) {
          ssize_t w =
              send(c->fd, c->out.data() + c->out_off, c->out.size() - c->out_off, MSG_NOSIGNAL);
          if (w < 0) {
            if (errno == EAGAIN || errno == EINTR) return;
            return Fail(c, std::string("send: ") + std::strerror(errno));
          }
          c->out_off += static_cast<size_t>(w);
        }
        c->phase = Conn::Phase::kReceiving;
        Watch(c, EPOLLIN | EPOLLRDHUP, EPOLL_CTL_MOD);
        return;
      }
      case Conn::Phase::kReceiving:
        return Receive(c);
      case Conn::Phase::kIdle: {
        char b[512];
        ssize_t r = recv(c->fd, b, sizeof(b), 0);
        if (r < 0 && (errno == EAGAIN || errno == EINTR)) return;
        c->dropped_idle = true;
        ++idle_dropped_;
        Close(c);
        return;
      }
      default:
        return;
    }
  }

  void Receive(Conn* c) {
    char buf[64 * 1024];
    for (;;) {
      ssize_t r = recv(c->fd, buf, sizeof(buf), 0);
      if (r < 0) {
        if (errno == EAGAIN || errno == EINTR) return;
        return Fail(c, std::string("recv: ") + std::strerror(errno));
      }
      if (r == 0) {
        if (!c->resp.Eof()) {
          return Fail(
              c, c->resp.headers_done() ? "closed mid-response" : "closed before the response");
        }
        Close(c);
        return Complete(c);
      }
      if (!c->resp.Feed(std::string_view(buf, static_cast<size_t>(r)))) {
        return Fail(c, "bad response: " + c->resp.error());
      }
      if (c->t_headers == 0 && c->resp.headers_done()) c->t_headers = NowNs();
      if (c->resp.done()) {
        if (c->resp.keep_alive()) {
          c->phase = Conn::Phase::kIdle;
        } else {
          Close(c);
        }
        return Complete(c);
      }
    }
  }

  void Complete(Conn* c) {
    DoneFn done = std::move(c->on_done);
    c->on_done = nullptr;
    if (done) done(c, true, "");
  }

  int ep_;
  std::vector<std::unique_ptr<Conn>> conns_;
  size_t idle_dropped_ = 0;
};

// ---- output ----

void Header() {
  std::printf("| %-50s | %6s | %9s | %9s | %-24s | %-28s |\n", "transport benchmark (ms)", "n",
              "p50", "p99", "same-run baseline", "target -> verdict");
  std::printf("|%s|%s|%s|%s|%s|%s|\n", std::string(52, '-').c_str(), std::string(8, '-').c_str(),
              std::string(11, '-').c_str(), std::string(11, '-').c_str(),
              std::string(26, '-').c_str(), std::string(30, '-').c_str());
}

void Row(const std::string& name, const std::vector<double>& v, const std::string& baseline = "",
         const std::string& verdict = "") {
  std::printf("| %-50s | %6zu | %9.3f | %9.3f | %-24s | %-28s |\n", name.c_str(), v.size(),
              Pct(v, 50), Pct(v, 99), baseline.c_str(), verdict.c_str());
}

std::string Fmt(const char* fmt, double a, double b = 0) {
  char buf[256];
  std::snprintf(buf, sizeof(buf), fmt, a, b);
  return buf;
}

// ---- /proc helpers ----

// VmRSS of `pid` in KiB (-1 if unreadable).
long RssKiB(int pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::atol(line.c_str() + 6);
  }
  return -1;
}

// CPU time (user + system) `pid` has used so far, in seconds (-1 if unreadable).
double CpuSeconds(int pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  size_t paren = stat.rfind(')');
  if (pid <= 0 || paren == std::string::npos) return -1;
  // Fields after "(comm)": state is field 3; utime and stime are fields 14 and 15.
  std::vector<std::string> fields;
  size_t pos = paren + 2;
  while (pos < stat.size() && fields.size() < 13) {
    size_t end = stat.find(' ', pos);
    if (end == std::string::npos) end = stat.size();
    fields.push_back(stat.substr(pos, end - pos));
    pos = end + 1;
  }
  if (fields.size() < 13) return -1;
  return static_cast<double>(std::atoll(fields[11].c_str()) + std::atoll(fields[12].c_str())) /
         static_cast<double>(sysconf(_SC_CLK_TCK));
}

int Threads(int pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("Threads:", 0) == 0) return std::atoi(line.c_str() + 8);
  }
  return -1;
}

// ---- args ----

struct Args {
  std::map<std::string, std::string> kv;
  std::string Str(const std::string& k, const std::string& def = "") const {
    auto it = kv.find(k);
    return it == kv.end() ? def : it->second;
  }
  long Int(const std::string& k, long def) const {
    auto it = kv.find(k);
    return it == kv.end() ? def : std::atol(it->second.c_str());
  }
  double Num(const std::string& k, double def) const {
    auto it = kv.find(k);
    return it == kv.end() ? def : std::atof(it->second.c_str());
  }
};

// ---- healthz throughput ----

struct Throughput {
  double rps = 0;
  std::vector<double> lat;
  size_t errors = 0;
  std::string first_error;
};

// `conns` keep-alive connections each sending GET `path` back to back for `seconds`.
Throughput MeasureRps(const Target& t, const std::string& path, int conns, double seconds) {
  Loop loop;
  Throughput out;
  const std::string req = Get(t, path);
  int64_t t0 = NowNs();
  int64_t end = t0 + static_cast<int64_t>(seconds * 1e9);
  size_t ok = 0;
  int active = 0;
  DoneFn again = [&](Conn* c, bool good, const std::string& err) {
    if (good && c->resp.status() == 200) {
      ++ok;
      out.lat.push_back(static_cast<double>(NowNs() - c->t_sent) / 1e6);
    } else {
      ++out.errors;
      if (out.first_error.empty()) {
        out.first_error = good ? "HTTP " + std::to_string(c->resp.status()) : err;
      }
    }
    if (NowNs() < end && c->phase == Conn::Phase::kIdle) {
      loop.Send(c, req, again);
    } else {
      --active;
    }
  };
  for (int i = 0; i < conns; ++i) {
    std::string err;
    Conn* c = loop.Connect(t, &err);
    if (!c) Die(err);
    ++active;
    loop.Send(c, req, again);
  }
  loop.RunUntil([&] { return active == 0; }, end + 30'000'000'000LL);
  out.rps = static_cast<double>(ok) / (static_cast<double>(NowNs() - t0) / 1e9);
  return out;
}

int CmdHealthz(const Args& a) {
  Target esbd = ParseTarget(a.Str("target"));
  Target base = ParseTarget(a.Str("baseline"));
  int conns = static_cast<int>(a.Int("conns", 4));
  double seconds = a.Num("seconds", 2);
  int rounds = static_cast<int>(a.Int("rounds", 4));
  const int pids[2] = {static_cast<int>(a.Int("pid", 0)),
                       static_cast<int>(a.Int("baseline-pid", 0))};
  Throughput e, b;
  double e_rps = 0, b_rps = 0;
  // Server CPU seconds spent and requests answered, per server: CPU per request does not
  // depend on how much of the machine other work leaves to the benchmark, req/s does.
  double cpu[2] = {0, 0};
  size_t answered[2] = {0, 0};
  // Alternating rounds, so the machine's load is shared fairly between the two.
  for (int r = 0; r < rounds; ++r) {
    for (int which = 0; which < 2; ++which) {
      bool is_base = (r + which) % 2 == 0;
      double cpu0 = CpuSeconds(pids[is_base]);
      Throughput x = MeasureRps(is_base ? base : esbd, "/healthz", conns, seconds);
      cpu[is_base] += CpuSeconds(pids[is_base]) - cpu0;
      answered[is_base] += x.lat.size();
      Throughput& acc = is_base ? b : e;
      (is_base ? b_rps : e_rps) += x.rps / rounds;
      acc.lat.insert(acc.lat.end(), x.lat.begin(), x.lat.end());
      acc.errors += x.errors;
      if (acc.first_error.empty()) acc.first_error = x.first_error;
    }
  }
  Header();
  double ratio = e_rps / b_rps;
  Row("GET /healthz, " + std::to_string(conns) + " keep-alive conns (esbd)", e.lat,
      Fmt("%.2fx Beast's req/s", ratio), "reported (ratio)");
  Row("baseline: Beast hello-world (bench/beast_hello)", b.lat);
  std::printf(
      "\nhealthz throughput: esbd %.0f req/s, Beast hello %.0f req/s → esbd/Beast %.2fx "
      "(%d conns, %d x %.1f s alternating rounds each); errors: esbd %zu, Beast %zu%s%s\n",
      e_rps, b_rps, ratio, conns, rounds, seconds, e.errors, b.errors,
      e.first_error.empty() ? "" : "; first esbd error: ", e.first_error.c_str());
  if (pids[0] > 0 && pids[1] > 0 && answered[0] > 0 && answered[1] > 0) {
    double e_us = cpu[0] * 1e6 / static_cast<double>(answered[0]);
    double b_us = cpu[1] * 1e6 / static_cast<double>(answered[1]);
    std::printf(
        "healthz server CPU per request: esbd %.1f us, Beast hello %.1f us → %.2fx "
        "(CPU time from /proc/PID/stat, %ld ticks/s)\n",
        e_us, b_us, e_us / b_us, sysconf(_SC_CLK_TCK));
  }
  return 0;
}

// ---- idle connections ----

struct Probe {
  std::vector<double> lat;
  size_t errors = 0;
  std::string first_error;
};

struct IdleResult {
  Probe before, during;
  size_t opened = 0, open_errors = 0, held = 0, reuse_ok = 0, reuse_tried = 0;
  std::string first_open_error, first_reuse_error;
  long rss_before = -1, rss_after = -1;
  int threads_before = -1, threads_after = -1;
  double open_ms = 0;
};

// /healthz every `interval_ms` on one keep-alive connection for `seconds` (closed loop: the next
// probe waits for the previous answer); reconnects after a failure.
void RunProbe(Loop& loop, const Target& t, double seconds, int interval_ms, Probe* out) {
  const std::string req = Get(t, "/healthz");
  std::string err;
  Conn* c = loop.Connect(t, &err);
  if (!c) Die(err);
  int64_t end = NowNs() + static_cast<int64_t>(seconds * 1e9);
  int64_t next = NowNs();
  bool busy = false;
  DoneFn done = [&](Conn* cc, bool ok, const std::string& e) {
    busy = false;
    if (ok && cc->resp.status() == 200) {
      out->lat.push_back(static_cast<double>(NowNs() - cc->t_sent) / 1e6);
    } else {
      ++out->errors;
      if (out->first_error.empty())
        out->first_error = ok ? "HTTP " + std::to_string(cc->resp.status()) : e;
    }
  };
  loop.RunUntil([&] { return !busy && NowNs() >= end; }, end + 30'000'000'000LL,
                [&] {
                  if (busy || NowNs() < next || NowNs() >= end) return;
                  if (c->phase != Conn::Phase::kIdle && c->phase != Conn::Phase::kConnecting) {
                    std::string e2;
                    c = loop.Connect(t, &e2);
                    if (!c) Die(e2);
                  }
                  busy = true;
                  next = NowNs() + interval_ms * 1'000'000LL;
                  loop.Send(c, req, done);
                },
                1);
  loop.Close(c);
}

IdleResult MeasureIdle(const Target& t, int pid, int conns, double probe_seconds, int interval_ms,
                       int max_in_flight) {
  Loop loop;
  IdleResult r;
  RunProbe(loop, t, probe_seconds, interval_ms, &r.before);
  r.rss_before = RssKiB(pid);
  r.threads_before = Threads(pid);
  const std::string req = Get(t, "/healthz");
  std::vector<Conn*> idle;
  idle.reserve(conns);
  int started = 0, in_flight = 0;
  DoneFn opened = [&](Conn* c, bool ok, const std::string& e) {
    --in_flight;
    if (ok && c->resp.status() == 200 && c->phase == Conn::Phase::kIdle) {
      ++r.opened;
      idle.push_back(c);
    } else {
      ++r.open_errors;
      if (r.first_open_error.empty()) {
        r.first_open_error = ok ? "HTTP " + std::to_string(c->resp.status()) +
                                      (c->resp.keep_alive() ? "" : " (Connection: close)")
                                : e;
      }
      loop.Close(c);
    }
  };
  auto start_more = [&] {
    while (started < conns && in_flight < max_in_flight) {
      std::string err;
      Conn* c = loop.Connect(t, &err);
      ++started;
      if (!c) {
        ++r.open_errors;
        if (r.first_open_error.empty()) r.first_open_error = err;
        continue;
      }
      ++in_flight;
      loop.Send(c, req, opened);
    }
  };
  int64_t t0 = NowNs();
  start_more();
  loop.RunUntil([&] { return started == conns && in_flight == 0; }, t0 + 300'000'000'000LL,
                start_more, 5);
  r.open_ms = MsSince(t0);
  // Let the server settle (threads exit, buffers shrink) before reading its RSS.
  loop.RunUntil([] { return false; }, NowNs() + 1'000'000'000LL);
  r.rss_after = RssKiB(pid);
  r.threads_after = Threads(pid);
  RunProbe(loop, t, probe_seconds, interval_ms, &r.during);
  // The held connections must still be usable keep-alive connections: reuse every 100th.
  int pending = 0;
  for (size_t i = 0; i < idle.size(); i += 100) {
    Conn* c = idle[i];
    if (c->phase != Conn::Phase::kIdle) continue;
    ++r.reuse_tried;
    ++pending;
    loop.Send(c, req, [&](Conn* cc, bool ok, const std::string& e) {
      --pending;
      if (ok && cc->resp.status() == 200) {
        ++r.reuse_ok;
      } else if (r.first_reuse_error.empty()) {
        r.first_reuse_error = ok ? "HTTP " + std::to_string(cc->resp.status()) : e;
      }
    });
  }
  loop.RunUntil([&] { return pending == 0; }, NowNs() + 60'000'000'000LL);
  for (Conn* c : idle) {
    if (c->phase == Conn::Phase::kIdle) ++r.held;
  }
  return r;
}

int CmdIdle(const Args& a) {
  Target esbd = ParseTarget(a.Str("target"));
  int pid = static_cast<int>(a.Int("pid", 0));
  int conns = static_cast<int>(a.Int("conns", 10000));
  double probe_seconds = a.Num("probe-seconds", 5);
  int interval = static_cast<int>(a.Int("probe-interval-ms", 10));
  int max_in_flight = static_cast<int>(a.Int("max-in-flight", 64));
  RaiseNofile(static_cast<rlim_t>(conns) + 1024);

  struct Named {
    std::string name;
    IdleResult r;
  };
  std::vector<Named> results;
  if (!a.Str("baseline").empty()) {
    results.push_back({"Beast hello", MeasureIdle(ParseTarget(a.Str("baseline")),
                                                  static_cast<int>(a.Int("baseline-pid", 0)), conns,
                                                  probe_seconds, interval, max_in_flight)});
  }
  results.push_back(
      {"esbd", MeasureIdle(esbd, pid, conns, probe_seconds, interval, max_in_flight)});
  Header();
  for (const auto& [name, r] : results) {
    bool is_esbd = name == "esbd";
    double p99 = Pct(r.during.lat, 99);
    bool met = r.held == static_cast<size_t>(conns) && p99 < 10.0 && r.during.errors == 0 &&
               r.reuse_ok == r.reuse_tried;
    Row("GET /healthz, no idle conns (" + name + ")", r.before.lat);
    Row("GET /healthz, " + std::to_string(conns) + " idle held (" + name + ")", r.during.lat,
        Fmt("p99 %.2fx no-idle p99", p99 / Pct(r.before.lat, 99)),
        is_esbd ? std::string("all held, p99<10ms -> ") + (met ? "MET" : "NOT MET") : "");
  }
  std::printf("\n");
  for (const auto& [name, r] : results) {
    double per_conn =
        r.held > 0 ? static_cast<double>(r.rss_after - r.rss_before) / static_cast<double>(r.held)
                   : NAN;
    std::printf(
        "idle (%s): %zu/%d opened in %.0f ms (%zu open errors%s%s), %zu held to the end "
        "(%zu closed by the server), reuse of every 100th: %zu/%zu ok%s%s; probe errors "
        "before %zu, during %zu%s%s; RSS %ld → %ld KiB = %.2f KiB per idle connection; "
        "threads %d → %d\n",
        name.c_str(), r.opened, conns, r.open_ms, r.open_errors,
        r.first_open_error.empty() ? "" : ", first: ", r.first_open_error.c_str(), r.held,
        r.opened - r.held, r.reuse_ok, r.reuse_tried,
        r.first_reuse_error.empty() ? "" : ", first error: ", r.first_reuse_error.c_str(),
        r.before.errors, r.during.errors,
        r.during.first_error.empty() ? "" : ", first: ", r.during.first_error.c_str(), r.rss_before,
        r.rss_after, per_conn, r.threads_before, r.threads_after);
  }
  return 0;
}

// ---- concurrent SSE streams ----

int CmdSse(const Args& a) {
  Target t = ParseTarget(a.Str("target"));
  int conns = static_cast<int>(a.Int("conns", 1000));
  std::string path = a.Str("path", "/run");
  std::string body =
      a.Str("body", R"J({"code":"import time\ntime.sleep(5)\nprint('ok')","runtime":"nano"})J");
  std::string expect = a.Str("expect", "event: result");
  double timeout_s = a.Num("timeout-seconds", 120);
  int max_in_flight_connects = static_cast<int>(a.Int("max-connecting", 256));
  RaiseNofile(static_cast<rlim_t>(conns) + 1024);

  Loop loop;
  const std::string req = Post(t, path, body, /*sse=*/true);
  std::vector<double> total, ttfb;
  std::map<std::string, size_t> errors;
  int started = 0, pending = 0, connecting = 0, open_streams = 0, peak = 0;
  std::vector<Conn*> mine;
  DoneFn done = [&](Conn* c, bool ok, const std::string& e) {
    --pending;
    if (c->t_headers != 0) --open_streams;
    std::string why;
    if (!ok) {
      why = e;
    } else if (c->resp.status() != 200) {
      why = "HTTP " + std::to_string(c->resp.status());
    } else if (c->resp.body().find("event: error") != std::string::npos) {
      why = "event: error";
    } else if (c->resp.body().find(expect) == std::string::npos) {
      why = "stream ended without '" + expect + "'";
    }
    if (why.empty()) {
      total.push_back(static_cast<double>(NowNs() - c->t_sent) / 1e6);
      ttfb.push_back(static_cast<double>(c->t_headers - c->t_sent) / 1e6);
    } else {
      ++errors[why];
    }
    loop.Close(c);
  };
  auto tick = [&] {
    // Streams whose response header has arrived and that have not ended.
    int open = 0;
    connecting = 0;
    for (Conn* c : mine) {
      if (c->phase == Conn::Phase::kConnecting) ++connecting;
      if (c->on_done && c->t_headers != 0) ++open;
    }
    open_streams = open;
    peak = std::max(peak, open);
    while (started < conns && connecting < max_in_flight_connects) {
      std::string err;
      Conn* c = loop.Connect(t, &err);
      ++started;
      if (!c) {
        ++errors[err];
        continue;
      }
      mine.push_back(c);
      ++pending;
      ++connecting;
      loop.Send(c, req, done);
    }
  };
  int64_t t0 = NowNs();
  tick();
  bool finished = loop.RunUntil([&] { return started == conns && pending == 0; },
                                t0 + static_cast<int64_t>(timeout_s * 1e9), tick, 20);
  double wall = MsSince(t0);
  if (!finished)
    errors["no end within " + std::to_string(static_cast<int>(timeout_s)) + " s"] += pending;
  size_t n_err = 0;
  for (const auto& [k, v] : errors) n_err += v;
  Header();
  Row(std::to_string(conns) + " concurrent SSE streams: each, to the end", total, "",
      std::string("0 errors -> ") + (n_err == 0 ? "MET" : "NOT MET"));
  Row(std::to_string(conns) + " concurrent SSE streams: time to first byte", ttfb);
  std::printf(
      "\nsse: %d streams (POST %s, Accept: text/event-stream), %zu complete, %zu errors, "
      "wall time %.0f ms, peak concurrently open streams %d (sampled every 20 ms)\n",
      conns, path.c_str(), total.size(), n_err, wall, peak);
  for (const auto& [k, v] : errors) std::printf("  error x%zu: %s\n", v, k.c_str());
  return 0;
}

// ---- exec round trip ----

// fork + exec `argv` with stdout on a pipe read to EOF, then waitpid. Returns ms, <0 on failure.
double ForkExec(const std::vector<const char*>& argv, const std::string& expect_out) {
  int64_t t0 = NowNs();
  int p[2];
  if (pipe2(p, O_CLOEXEC) != 0) return -1;
  pid_t pid = fork();
  if (pid == 0) {
    dup2(p[1], 1);
    execv(argv[0], const_cast<char* const*>(argv.data()));
    _exit(127);
  }
  close(p[1]);
  std::string out;
  char buf[256];
  for (;;) {
    ssize_t r = read(p[0], buf, sizeof(buf));
    if (r > 0) {
      out.append(buf, static_cast<size_t>(r));
    } else if (r == 0 || errno != EINTR) {
      break;
    }
  }
  close(p[0]);
  int status = 0;
  if (pid < 0 || waitpid(pid, &status, 0) != pid || status != 0 || out != expect_out) return -1;
  return MsSince(t0);
}

int CmdExec(const Args& a) {
  Target t = ParseTarget(a.Str("target"));
  std::string env = a.Str("env");
  if (env.empty()) Die("exec needs --env ID");
  int n = static_cast<int>(a.Int("n", 200));
  int warmup = static_cast<int>(a.Int("warmup", 10));
  Loop loop;
  std::string err;
  Conn* c = loop.Connect(t, &err);
  if (!c) Die(err);
  const std::string req = Post(t, "/environments/" + env + "/execute", R"({"command":"echo hi"})");
  std::vector<double> api, echo, bash, healthz;
  size_t errors = 0;
  const int gap_ms = static_cast<int>(a.Int("gap-ms", 0));
  std::string first_error;
  // One request on the keep-alive connection; ms, or -1 if its answer was not `want`.
  auto one_call = [&](const std::string& request, std::string_view want) -> double {
    if (c->phase != Conn::Phase::kIdle) {
      c = loop.Connect(t, &err);
      if (!c) Die(err);
    }
    bool finished = false;
    double ms = -1;
    loop.Send(c, request, [&](Conn* cc, bool ok, const std::string& e) {
      finished = true;
      std::string_view b = cc->resp.body();
      // The JSON may or may not have a space after the colon.
      std::string spaced(want);
      if (size_t colon = spaced.find("\":"); colon != std::string::npos) {
        spaced.insert(colon + 2, " ");
      }
      bool good =
          ok && cc->resp.status() == 200 &&
          (b.find(want) != std::string_view::npos || b.find(spaced) != std::string_view::npos);
      if (good) {
        ms = static_cast<double>(NowNs() - cc->t_sent) / 1e6;
      } else if (first_error.empty()) {
        first_error =
            ok ? "HTTP " + std::to_string(cc->resp.status()) + ": " + std::string(b.substr(0, 200))
               : e;
      }
    });
    loop.RunUntil([&] { return finished; }, NowNs() + 120'000'000'000LL);
    return ms;
  };
  auto one_exec = [&] { return one_call(req, R"("stdout":"hi\n")"); };
  const std::string healthz_req = Get(t, "/healthz");
  auto one_healthz = [&] { return one_call(healthz_req, "\"status\":\"ok\""); };
  auto pause = [&] {
    if (gap_ms > 0) loop.RunUntil([] { return false; }, NowNs() + gap_ms * 1'000'000LL);
  };
  const std::vector<const char*> echo_argv = {"/bin/echo", "hi", nullptr};
  const std::vector<const char*> bash_argv = {"/bin/bash", "--noprofile", "--norc",
                                              "-c",        "echo hi",     nullptr};
  for (int i = 0; i < warmup; ++i) {
    one_exec();
    one_healthz();
    ForkExec(echo_argv, "hi\n");
    ForkExec(bash_argv, "hi\n");
  }
  first_error.clear();
  // Interleaved, so the three see the same machine load.
  for (int i = 0; i < n; ++i) {
    pause();
    double x = one_exec();
    if (x >= 0) {
      api.push_back(x);
    } else {
      ++errors;
    }
    pause();
    if (double h = one_healthz(); h >= 0) healthz.push_back(h);
    pause();
    if (double y = ForkExec(echo_argv, "hi\n"); y >= 0) echo.push_back(y);
    pause();
    if (double z = ForkExec(bash_argv, "hi\n"); z >= 0) bash.push_back(z);
  }
  double ratio = Pct(api, 50) / Pct(echo, 50);
  Header();
  Row("execute `echo hi` (API, keep-alive)", api, Fmt("%.2fx fork+exec echo", ratio),
      std::string("p50 <= 1.3x -> ") + (ratio <= 1.3 && errors == 0 ? "MET" : "NOT MET"));
  Row("baseline: local fork+exec /bin/echo (pipe)", echo);
  Row("context: local fork+exec bash -c 'echo hi'", bash,
      Fmt("%.2fx fork+exec echo", Pct(bash, 50) / Pct(echo, 50)));
  Row("context: GET /healthz, same connection and pace", healthz,
      Fmt("%.2fx fork+exec echo", Pct(healthz, 50) / Pct(echo, 50)));
  std::printf(
      "\nexec: %d calls after %d warm-up (%d ms pause between calls), %zu errors%s%s; "
      "API p10/p50/p90 %.3f/%.3f/%.3f ms = %.2fx fork+exec /bin/echo (p50 %.3f ms), "
      "%.2fx bash -c (p50 %.3f ms)\n",
      n, warmup, gap_ms, errors, first_error.empty() ? "" : ", first: ", first_error.c_str(),
      Pct(api, 10), Pct(api, 50), Pct(api, 90), ratio, Pct(echo, 50), Pct(api, 50) / Pct(bash, 50),
      Pct(bash, 50));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  signal(SIGPIPE, SIG_IGN);
  if (argc < 2) {
    std::fprintf(stderr,
                 "usage: transport_bench healthz|idle|sse|exec --target HOST:PORT ...\n"
                 "(see the comment at the top of bench/transport_bench.cc)\n");
    return 2;
  }
  std::string cmd = argv[1];
  Args a;
  for (int i = 2; i < argc; ++i) {
    std::string k = argv[i];
    if (k.rfind("--", 0) != 0 || i + 1 >= argc) Die("bad argument: " + k);
    a.kv[k.substr(2)] = argv[++i];
  }
  if (a.Str("target").empty()) Die("--target HOST:PORT is required");
  setvbuf(stdout, nullptr, _IOLBF, 0);
  if (cmd == "healthz") return CmdHealthz(a);
  if (cmd == "idle") return CmdIdle(a);
  if (cmd == "sse") return CmdSse(a);
  if (cmd == "exec") return CmdExec(a);
  Die("unknown command: " + cmd);
}
