// Request handlers for the non-exec ops of docs/agent-protocol.md: files, stats. Each takes
// the (untrusted) request header and payload and returns the RESPONSE frame; failures carry
// the errno name. They are independent of each other and safe to run concurrently.
#pragma once

#include <sys/types.h>

#include <boost/json.hpp>
#include <cstdint>
#include <string>

#include "agent/fs_ops.h"
#include "common/protocol.h"

namespace esb::agent {

// Typed, checked access to request header fields; remembers the first problem.
class Fields {
 public:
  explicit Fields(const boost::json::object& object) : object_(object) {}
  std::string String(const char* key, std::string fallback = "", bool required = false);
  int64_t Int(const char* key, int64_t fallback, bool required = false);
  bool Bool(const char* key, bool fallback);
  bool Has(const char* key) const { return object_.contains(key); }
  // Object of string values (e.g. `env`); empty if absent.
  bool StringMap(const char* key, std::vector<std::pair<std::string, std::string>>* out);
  bool ok() const { return error_.empty(); }
  const std::string& error() const { return error_; }

 private:
  const boost::json::object& object_;
  std::string error_;
};

proto::Frame OkResponse();
proto::Frame ErrorResponse(const std::string& message, const std::string& errno_name);
proto::Frame ErrnoResponse(const std::string& what, int err);

// Resolves a request path against the workspace ("" → error; absolute paths are kept).
bool ResolvePath(const std::string& workspace, const std::string& path, std::string* out);

// open() for every path a request names: resolved without /proc magic links (openat2
// RESOLVE_NO_MAGICLINKS; without openat2, a statfs walk of the path's prefixes), and refused
// (-1, EACCES, *kernel_fs = true) when the file is on procfs or sysfs. O_CLOEXEC is added.
int OpenSandboxPath(const std::string& path, int flags, mode_t mode, bool* kernel_fs);
// The error reply for a failed OpenSandboxPath.
proto::Frame OpenError(const std::string& what, const std::string& rel, int err, bool kernel_fs);

proto::Frame HandleWrite(const std::string& workspace, const boost::json::object& header,
                         const std::string& payload);
proto::Frame HandleRead(const std::string& workspace, const boost::json::object& header);
proto::Frame HandleList(const std::string& workspace, const boost::json::object& header);
proto::Frame HandleStat(const std::string& workspace, const boost::json::object& header);
// The files API's mutating ops (agent/fs_ops.h): confined to the workspace, never following a
// symlink.
proto::Frame HandleMkdir(const FsRoots& roots, const boost::json::object& header);
proto::Frame HandleRemove(const FsRoots& roots, const boost::json::object& header);
proto::Frame HandleRename(const FsRoots& roots, const boost::json::object& header);
proto::Frame HandleStats(const std::string& workspace, int64_t start_ms);

// Counts processes: every pid in /proc when the agent is PID 1, else the agent and its
// descendants.
int64_t CountProcesses();
// Disk usage of a directory tree in bytes (allocated blocks, hard links once, one device).
int64_t DiskUsage(const std::string& path);

}  // namespace esb::agent
