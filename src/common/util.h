// Small shared helpers: errno → Status, ids, time, logging, fd ownership.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "common/log_throttle.h"
#include "common/shell_quote.h"  // ShellQuote, for the callers of these helpers

namespace esb {

// Debian's Abseil is built with its own absl::string_view (ABSL_OPTION_USE_STD_STRING_VIEW=0),
// which does not convert to or from std::string_view. These bridge the two.
inline std::string_view StdView(absl::string_view s) { return {s.data(), s.size()}; }
inline absl::string_view AbslView(std::string_view s) { return {s.data(), s.size()}; }

// Builds a Status from the current errno: "<what>: <strerror> (errno NAME)".
// ENOENT → NotFound, EACCES/EPERM → PermissionDenied, EEXIST → AlreadyExists,
// ENOSPC/EDQUOT/EFBIG/ENOMEM → ResourceExhausted, EINVAL/EISDIR/ENOTDIR/ELOOP → InvalidArgument,
// ETIMEDOUT → DeadlineExceeded, others → Internal.
absl::Status ErrnoStatus(std::string_view what, int err);
absl::Status ErrnoStatus(std::string_view what);  // uses errno
// Maps an errno *name* ("ENOENT") reported by the agent to a Status with `message`.
absl::Status ErrnoNameStatus(std::string_view errno_name, std::string_view message);

// The one absl::Status → HTTP status table (API responses and audit rows): Ok 200;
// InvalidArgument/OutOfRange/FailedPrecondition/PermissionDenied/Unimplemented 400;
// Unauthenticated 401; NotFound 404; AlreadyExists/Aborted 409; ResourceExhausted 429;
// Cancelled 499 (the caller went away); Unavailable/DeadlineExceeded 503; others 500.
int HttpStatusFor(const absl::Status& status);

// Cryptographically random lowercase hex string of 2*bytes characters (getrandom).
std::string RandomHex(int bytes);

// True when JSON text has at most `max_containers` objects and arrays and at most
// `max_separators` commas and colons outside strings. Parsed JSON costs up to ~40x its text
// for values like `[{},{},...]`: text from an untrusted peer (a sandbox) is counted with this
// before it is parsed, so the parse's memory is bounded by the counts, not the text's shape.
bool JsonShapeWithin(std::string_view text, size_t max_containers, size_t max_separators);

int64_t NowUnixMs();
int64_t MonotonicMs();
// RFC 3339 UTC with milliseconds: 2026-11-22T04:30:00.123Z
std::string FormatRfc3339(int64_t unix_ms);
// Parses RFC 3339 (Z or ±hh:mm offset, optional fraction) or a plain integer of unix seconds.
bool ParseTime(std::string_view text, int64_t* unix_ms);

enum class LogLevel { kDebug, kInfo, kWarn, kError };
void SetLogLevel(LogLevel level);
// One line to stderr: "2026-11-22T04:30:00.123Z INFO  message". Thread-safe.
void Log(LogLevel level, std::string_view message);
inline void LogInfo(std::string_view m) { Log(LogLevel::kInfo, m); }
inline void LogWarn(std::string_view m) { Log(LogLevel::kWarn, m); }
inline void LogError(std::string_view m) { Log(LogLevel::kError, m); }
inline void LogDebug(std::string_view m) { Log(LogLevel::kDebug, m); }

// Owns a file descriptor; closes it on destruction.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& o) noexcept : fd_(o.release()) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept;
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd();
  int get() const { return fd_; }
  int release() { int f = fd_; fd_ = -1; return f; }
  void reset(int fd = -1);
  explicit operator bool() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

// Reads a whole (small) file; writes a file atomically (tmp + rename).
absl::Status ReadFileToString(const std::string& path, std::string* out);
absl::Status WriteStringToFile(const std::string& path, std::string_view data, int mode = 0644);

}  // namespace esb
