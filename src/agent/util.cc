#include "agent/util.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <atomic>
#include <mutex>

namespace esb::agent {
namespace {
std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};

// Where Log writes: fd 2 until RedirectLog, then a capped file inside the sandbox.
struct LogSink {
  std::mutex mu;
  int fd = 2;
  std::string path;       // "" while logging to the inherited stderr
  int64_t max_bytes = 0;  // 0 = no cap (stderr)
  int64_t written = 0;    // bytes in the current file
};
LogSink& Sink() {
  static LogSink* sink = new LogSink;  // never destroyed: threads may log during exit
  return *sink;
}

int OpenLogFile(const std::string& path) {
  return open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | O_NOFOLLOW | O_NOCTTY,
              0600);
}
}  // namespace

bool WriteAll(int fd, std::string_view data) {
  while (!data.empty()) {
    ssize_t n = write(fd, data.data(), data.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    data.remove_prefix(static_cast<size_t>(n));
  }
  return true;
}

std::string ErrnoName(int err) {
  const char* name = strerrorname_np(err);
  return name ? name : "EIO";
}

std::map<pid_t, ProcInfo> ReadProcessTable() {
  std::map<pid_t, ProcInfo> table;
  DIR* proc = opendir("/proc");
  if (!proc) return table;
  while (dirent* e = readdir(proc)) {
    char* end = nullptr;
    long pid = strtol(e->d_name, &end, 10);
    if (pid <= 0 || *end != '\0') continue;
    std::string stat_path = std::string("/proc/") + e->d_name + "/stat";
    int fd = open(stat_path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    char buf[1024];
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) continue;
    buf[n] = '\0';
    // "pid (comm) state ppid ...": comm may contain anything, so parse after the last ')'.
    char* close_paren = strrchr(buf, ')');
    if (!close_paren) continue;
    char state;
    int ppid, pgid, sid;
    unsigned long long start_time = 0;
    // Fields 3-6, then 7-21 skipped, then 22 (starttime).
    int got = sscanf(close_paren + 1,
                     " %c %d %d %d %*d %*d %*u %*u %*u %*u %*u %*u %*u %*d %*d %*d %*d %*d %*d "
                     "%llu",
                     &state, &ppid, &pgid, &sid, &start_time);
    if (got < 4) continue;
    table[static_cast<pid_t>(pid)] = {static_cast<pid_t>(ppid), state, static_cast<pid_t>(pgid),
                                      static_cast<pid_t>(sid), start_time};
  }
  closedir(proc);
  return table;
}

std::map<pid_t, pid_t> ReadParentMap(bool skip_zombies) {
  std::map<pid_t, pid_t> parent;
  for (const auto& [pid, info] : ReadProcessTable()) {
    if (skip_zombies && (info.state == 'Z' || info.state == 'X')) continue;
    parent[pid] = info.ppid;
  }
  return parent;
}

void SetLogLevel(LogLevel level) { g_level = static_cast<int>(level); }

bool ParseLogLevel(std::string_view text, LogLevel* level) {
  if (text == "debug")
    *level = LogLevel::kDebug;
  else if (text == "info")
    *level = LogLevel::kInfo;
  else if (text == "warn" || text == "warning")
    *level = LogLevel::kWarn;
  else if (text == "error")
    *level = LogLevel::kError;
  else
    return false;
  return true;
}

void Log(LogLevel level, std::string_view message) {
  if (static_cast<int>(level) < g_level.load()) return;
  static const char* const kNames[] = {"DEBUG", "INFO ", "WARN ", "ERROR"};
  std::string line = "esb-agent ";
  line += kNames[static_cast<int>(level)];
  line += ' ';
  line += message;
  line += '\n';
  LogSink& sink = Sink();
  std::lock_guard<std::mutex> lock(sink.mu);
  if (sink.max_bytes > 0 && sink.written + static_cast<int64_t>(line.size()) > sink.max_bytes) {
    // Rotate: keep one previous generation, so the log's total size stays bounded.
    std::string old = sink.path + ".1";
    rename(sink.path.c_str(), old.c_str());
    int fd = OpenLogFile(sink.path);
    if (fd >= 0) {
      dup3(fd, sink.fd, O_CLOEXEC);
      close(fd);
      if (ftruncate(sink.fd, 0) != 0) return;
    } else if (ftruncate(sink.fd, 0) != 0) {
      return;  // neither a new file nor an empty one: drop the line rather than grow
    }
    sink.written = 0;
  }
  ssize_t n = write(sink.fd, line.data(), line.size());
  if (n > 0) sink.written += n;
}

bool RedirectLog(const std::string& path, int64_t max_bytes) {
  int fd = OpenLogFile(path);
  if (fd < 0) return false;
  int null_fd = open("/dev/null", O_RDWR | O_CLOEXEC);
  if (null_fd < 0) {
    int err = errno;
    close(fd);
    errno = err;
    return false;
  }
  struct stat st;
  LogSink& sink = Sink();
  std::lock_guard<std::mutex> lock(sink.mu);
  sink.fd = fd;
  sink.path = path;
  sink.max_bytes = max_bytes;
  sink.written = fstat(fd, &st) == 0 ? st.st_size : 0;
  // SECURITY: the container's stdio is a host file (the start-up log esbd reads on failure);
  // after this no descriptor of the agent (or anything it spawns) refers to it.
  for (int target = 0; target < 3; ++target) dup2(null_fd, target);
  close(null_fd);
  return true;
}

}  // namespace esb::agent
