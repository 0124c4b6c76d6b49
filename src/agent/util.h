// Small helpers for the static agent (no Abseil here: the agent links only libc, libstdc++,
// esb_proto and Boost.JSON).
#pragma once

#include <unistd.h>

#include <map>
#include <string>
#include <string_view>

namespace esb::agent {

// Owns a file descriptor.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept {
    reset(o.release());
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }
  int get() const { return fd_; }
  int release() {
    int f = fd_;
    fd_ = -1;
    return f;
  }
  void reset(int fd = -1) {
    if (fd_ >= 0) close(fd_);
    fd_ = fd;
  }
  explicit operator bool() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

// Writes everything (retrying on EINTR); false with errno set on failure.
bool WriteAll(int fd, std::string_view data);

// "ENOENT" for ENOENT; "EIO" if the number has no name.
std::string ErrnoName(int err);

// One process as /proc/<pid>/stat shows it.
struct ProcInfo {
  pid_t ppid = 0;
  char state = '?';  // R, S, D, T (stopped), t (traced), Z, X, ...
  pid_t pgid = 0;
  pid_t sid = 0;
  // Clock ticks after boot when the process started: with the pid, identifies a process
  // across pid reuse.
  unsigned long long start_time = 0;
};
// Every process in /proc.
std::map<pid_t, ProcInfo> ReadProcessTable();
// pid -> parent pid of every process in /proc (zombies too unless `skip_zombies`).
std::map<pid_t, pid_t> ReadParentMap(bool skip_zombies = false);

enum class LogLevel { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };
void SetLogLevel(LogLevel level);
bool ParseLogLevel(std::string_view text, LogLevel* level);
// One line to the log (stderr until RedirectLog), prefixed with the level. Thread-safe.
void Log(LogLevel level, std::string_view message);

// Moves logging from the inherited stderr to `path` (inside the sandbox), capped at
// `max_bytes`: at the cap the file is renamed to `path`.1 (replacing the previous one) and a
// new one started, so the agent's logs never exceed 2 * max_bytes. Then puts /dev/null on fds
// 0-2, so no descriptor of the agent refers to the host file the container started with.
// false with errno set if the log cannot be opened (logging stays on stderr, fds unchanged).
bool RedirectLog(const std::string& path, int64_t max_bytes);

}  // namespace esb::agent
