#include "agent/util.h"

#include <errno.h>
#include <string.h>

#include <atomic>

namespace esb::agent {
namespace {
std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};
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
  ssize_t ignored = write(2, line.data(), line.size());
  (void)ignored;
}

}  // namespace esb::agent
