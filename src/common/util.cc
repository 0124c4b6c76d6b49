#include "common/util.h"

#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <mutex>

#include "absl/strings/str_cat.h"

namespace esb {
namespace {

// The one errno name table: numbers to names for messages (ErrnoStatus), names to numbers for
// what the agent and the nano worker report (ErrnoNameStatus).
constexpr struct {
  const char* name;
  int err;
} kErrnoNames[] = {
    {"ENOENT", ENOENT},       {"EACCES", EACCES},       {"EPERM", EPERM},
    {"EEXIST", EEXIST},       {"ENOSPC", ENOSPC},       {"EDQUOT", EDQUOT},
    {"EFBIG", EFBIG},         {"ENOMEM", ENOMEM},       {"EINVAL", EINVAL},
    {"EISDIR", EISDIR},       {"ENOTDIR", ENOTDIR},     {"ELOOP", ELOOP},
    {"ETIMEDOUT", ETIMEDOUT}, {"ECONNREFUSED", ECONNREFUSED}, {"EAGAIN", EAGAIN},
    {"EBUSY", EBUSY},         {"ENAMETOOLONG", ENAMETOOLONG}, {"EROFS", EROFS},
    {"ESRCH", ESRCH},         {"ENXIO", ENXIO},         {"ENODEV", ENODEV},
    {"EOPNOTSUPP", EOPNOTSUPP}, {"ENOTEMPTY", ENOTEMPTY}, {"EPIPE", EPIPE},
    {"ECANCELED", ECANCELED}, {"EMFILE", EMFILE},
};

const char* ErrnoName(int err) {
  for (const auto& n : kErrnoNames) {
    if (n.err == err) return n.name;
  }
  return "E?";
}

absl::Status StatusFor(int err, std::string message) {
  switch (err) {
    case ENOENT: case ESRCH: return absl::NotFoundError(message);
    case EACCES: case EPERM: case EROFS: return absl::PermissionDeniedError(message);
    case EEXIST: return absl::AlreadyExistsError(message);
    case ENOSPC: case EDQUOT: case EFBIG: case ENOMEM:
      return absl::ResourceExhaustedError(message);
    // ENXIO/ENODEV/EOPNOTSUPP: the path names a socket, a device without a driver or a
    // terminal that is not ours — bad input, not a server fault.
    case EINVAL: case EISDIR: case ENOTDIR: case ELOOP: case ENAMETOOLONG: case ENXIO:
    case ENODEV: case EOPNOTSUPP:
      return absl::InvalidArgumentError(message);
    case ENOTEMPTY:
    case EPIPE:
      return absl::FailedPreconditionError(message);
    case ECANCELED:
      return absl::CancelledError(message);
    case EMFILE:
      return absl::ResourceExhaustedError(message);
    case ETIMEDOUT: return absl::DeadlineExceededError(message);
    case ECONNREFUSED: case EAGAIN: case EBUSY: return absl::UnavailableError(message);
    default: return absl::InternalError(message);
  }
}

LogLevel g_level = LogLevel::kInfo;
std::mutex g_log_mu;

}  // namespace

absl::Status ErrnoStatus(std::string_view what, int err) {
  return StatusFor(err, absl::StrCat(AbslView(what), ": ", std::strerror(err), " (", ErrnoName(err), ")"));
}

absl::Status ErrnoStatus(std::string_view what) { return ErrnoStatus(what, errno); }

int HttpStatusFor(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kOk:
      return 200;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kPermissionDenied:
    case absl::StatusCode::kUnimplemented:
      return 400;
    case absl::StatusCode::kUnauthenticated:
      return 401;
    case absl::StatusCode::kNotFound:
      return 404;
    case absl::StatusCode::kAlreadyExists:
    case absl::StatusCode::kAborted:
      return 409;
    case absl::StatusCode::kResourceExhausted:
      return 429;
    case absl::StatusCode::kCancelled:
      return 499;
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDeadlineExceeded:
      return 503;
    default:
      return 500;
  }
}

absl::Status ErrnoNameStatus(std::string_view name, std::string_view message) {
  for (const auto& n : kErrnoNames) {
    if (name == n.name) return StatusFor(n.err, std::string(message));
  }
  return absl::InternalError(std::string(message));
}

bool JsonShapeWithin(std::string_view text, size_t max_containers, size_t max_separators) {
  size_t containers = 0, separators = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++containers > max_containers) return false;
    } else if (c == ':' || c == ',') {
      if (++separators > max_separators) return false;
    }
  }
  return true;
}

std::string RandomHex(int bytes) {
  std::string raw(bytes, '\0');
  size_t got = 0;
  while (got < raw.size()) {
    ssize_t n = getrandom(raw.data() + got, raw.size() - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      std::abort();  // invariant: getrandom on Linux ≥ 3.17 does not fail otherwise
    }
    got += n;
  }
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes * 2);
  for (unsigned char c : raw) {
    out.push_back(kHex[c >> 4]);
    out.push_back(kHex[c & 15]);
  }
  return out;
}

int64_t NowUnixMs() {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return int64_t(ts.tv_sec) * 1000 + ts.tv_nsec / 1000000;
}

int64_t MonotonicMs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1000 + ts.tv_nsec / 1000000;
}

std::string FormatRfc3339(int64_t unix_ms) {
  time_t secs = unix_ms / 1000;
  int ms = int(unix_ms % 1000);
  if (ms < 0) { ms += 1000; secs -= 1; }
  tm t;
  gmtime_r(&secs, &t);
  char buf[64];
  std::snprintf(buf, sizeof buf, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", t.tm_year + 1900,
                t.tm_mon + 1, t.tm_mday, t.tm_hour, t.tm_min, t.tm_sec, ms);
  return buf;
}

bool ParseTime(std::string_view text, int64_t* unix_ms) {
  if (text.empty()) return false;
  bool all_digits = true;
  for (char c : text) all_digits = all_digits && c >= '0' && c <= '9';
  if (all_digits) {
    if (text.size() > 12) return false;
    *unix_ms = std::stoll(std::string(text)) * 1000;
    return true;
  }
  int y, mo, d, h, mi, s;
  std::string str(text);
  int consumed = 0;
  if (std::sscanf(str.c_str(), "%4d-%2d-%2dT%2d:%2d:%2d%n", &y, &mo, &d, &h, &mi, &s,
                  &consumed) != 6)
    return false;
  size_t pos = consumed;
  int ms = 0;
  if (pos < str.size() && str[pos] == '.') {
    ++pos;
    int digits = 0;
    while (pos < str.size() && std::isdigit(static_cast<unsigned char>(str[pos]))) {
      if (digits < 3) ms = ms * 10 + (str[pos] - '0');
      ++digits;
      ++pos;
    }
    for (int i = digits; i < 3; ++i) ms *= 10;
  }
  int offset_min = 0;
  if (pos < str.size() && (str[pos] == 'Z' || str[pos] == 'z')) {
    ++pos;
  } else if (pos < str.size() && (str[pos] == '+' || str[pos] == '-')) {
    int oh, om;
    if (std::sscanf(str.c_str() + pos + 1, "%2d:%2d", &oh, &om) != 2) return false;
    offset_min = (oh * 60 + om) * (str[pos] == '-' ? -1 : 1);
    pos += 6;
  } else {
    return false;
  }
  if (pos != str.size()) return false;
  tm t{};
  t.tm_year = y - 1900;
  t.tm_mon = mo - 1;
  t.tm_mday = d;
  t.tm_hour = h;
  t.tm_min = mi;
  t.tm_sec = s;
  time_t secs = timegm(&t);
  *unix_ms = (int64_t(secs) - int64_t(offset_min) * 60) * 1000 + ms;
  return true;
}

void SetLogLevel(LogLevel level) { g_level = level; }

void Log(LogLevel level, std::string_view message) {
  if (level < g_level) return;
  const char* tag = level == LogLevel::kDebug  ? "DEBUG"
                    : level == LogLevel::kInfo ? "INFO "
                    : level == LogLevel::kWarn ? "WARN "
                                               : "ERROR";
  std::string line = absl::StrCat(FormatRfc3339(NowUnixMs()), " ", tag, " ", AbslView(message), "\n");
  std::lock_guard<std::mutex> lock(g_log_mu);
  fwrite(line.data(), 1, line.size(), stderr);
  fflush(stderr);
}

UniqueFd& UniqueFd::operator=(UniqueFd&& o) noexcept {
  if (this != &o) reset(o.release());
  return *this;
}

UniqueFd::~UniqueFd() { reset(); }

void UniqueFd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

absl::Status ReadFileToString(const std::string& path, std::string* out) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) return ErrnoStatus(absl::StrCat("open ", path));
  out->clear();
  char buf[65536];
  for (;;) {
    ssize_t n = ::read(fd.get(), buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(absl::StrCat("read ", path));
    }
    if (n == 0) break;
    out->append(buf, n);
  }
  return absl::OkStatus();
}

absl::Status WriteStringToFile(const std::string& path, std::string_view data, int mode) {
  std::string tmp = absl::StrCat(path, ".tmp.", RandomHex(4));
  UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode));
  if (!fd) return ErrnoStatus(absl::StrCat("open ", tmp));
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = ::write(fd.get(), data.data() + done, data.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      ::unlink(tmp.c_str());
      return ErrnoStatus(absl::StrCat("write ", tmp));
    }
    done += n;
  }
  fd.reset();
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    ::unlink(tmp.c_str());
    return ErrnoStatus(absl::StrCat("rename ", tmp, " -> ", path));
  }
  return absl::OkStatus();
}

}  // namespace esb
