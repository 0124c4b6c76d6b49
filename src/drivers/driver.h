// The one interface every isolation driver implements (container, nano, microvm).
// The core decides *what* happens to an environment; a driver only knows *how* to do it in
// its isolation technology. Drivers never run user code in esbd's process.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/cord.h"

namespace esb {

// What an environment is asked to be. Validated by the API layer before it gets here.
struct EnvSpec {
  std::string image = "default";
  std::string runtime = "container";  // driver name ("container", "gvisor", "nano", ...)
  double cpu = 1.0;                   // CPU cores (CFS quota)
  int64_t memory_mb = 512;
  int64_t pids = 256;
  int64_t disk_mb = 1024;             // size cap of /workspace
  std::map<std::string, std::string> env;
  std::string network = "none";
};

// A live environment as the driver knows it. `state` is the driver's own serialised data
// (JSON), stored in SQLite so a restarted daemon can re-attach.
struct InstanceRef {
  std::string id;          // environment id
  std::string driver;      // driver name
  std::string state;       // driver-private JSON
};

struct ExecRequest {
  std::string command;
  std::chrono::milliseconds timeout{60000};
  int64_t max_output_bytes = 1 << 20;  // per stream
  std::map<std::string, std::string> env;
  // Bytes the command reads on stdin (then EOF); none: stdin is at EOF from the start.
  std::optional<std::string> stdin_data;
};

enum class Stream { kStdout = 1, kStderr = 2 };
// Called for each output chunk as it arrives (from the thread that called Exec), and with an
// empty chunk at least every ~250 ms while the command is silent (a liveness tick).
// Returning false cancels the command (e.g. the SSE client went away).
using OutputSink = std::function<bool(Stream, std::string_view)>;

struct ExecResult {
  int exit_code = -1;
  bool timed_out = false;
  bool truncated = false;
  int64_t duration_ms = 0;
  std::string stdout_data;
  std::string stderr_data;
};

struct FileEntry {
  std::string name;
  std::string type;  // file | dir | symlink | other
  int64_t size = 0;
  uint32_t mode = 0;
  int64_t mtime_ms = 0;
};

// A directory's entries; `truncated` when the listing was cut at the protocol's limit
// (proto::kMaxListEntries entries).
struct DirListing {
  std::vector<FileEntry> entries;
  bool truncated = false;
};

struct FileChunk {
  std::string data;
  int64_t file_size = 0;  // size of the whole file
  bool eof = false;
};

struct Usage {
  int64_t memory_bytes = 0;
  int64_t cpu_ms = 0;
  int64_t pids = 0;
  bool alive = false;
};

// Errors use absl canonical codes, which the API maps to HTTP:
// NotFound → 404, InvalidArgument → 400, PermissionDenied → 400 (inside-sandbox EACCES),
// ResourceExhausted → 413/429, FailedPrecondition → 409, Unavailable → 503,
// DeadlineExceeded → 504, Unimplemented → 400 with the message, others → 500.
// Attach's answer for an instance that is alive but was created by an older esbd whose
// sandbox layout lacks protections the current one relies on (so it must not be adopted).
// The core destroys such an instance and records destroy_reason "sandbox_outdated".
inline constexpr char kSandboxOutdatedPayload[] = "type.entersandbox/sandbox_outdated";
inline absl::Status SandboxOutdatedError(const std::string& message) {
  absl::Status status = absl::FailedPreconditionError(message);
  status.SetPayload(kSandboxOutdatedPayload, absl::Cord("1"));
  return status;
}
inline bool IsSandboxOutdated(const absl::Status& status) {
  return status.GetPayload(kSandboxOutdatedPayload).has_value();
}

class Driver {
 public:
  virtual ~Driver() = default;

  virtual std::string name() const = 0;
  // Human-readable description of the backend in use (e.g. "crun 1.8.1 (cgroup v1)").
  virtual std::string Describe() const = 0;

  // Creates and starts an environment ready to execute. Must clean up after itself on failure.
  virtual absl::StatusOr<InstanceRef> Create(const std::string& id, const EnvSpec& spec) = 0;
  // Destroys everything the instance owns (processes, mounts, cgroups, directories).
  // Idempotent: destroying a dead or half-created instance succeeds.
  virtual absl::Status Destroy(const InstanceRef& ref) = 0;
  // After a daemon restart: checks the instance is still alive and usable. An instance whose
  // sandbox layout is older than the driver's answers SandboxOutdatedError.
  virtual absl::Status Attach(const InstanceRef& ref) = 0;

  virtual absl::StatusOr<ExecResult> Exec(const InstanceRef& ref, const ExecRequest& request,
                                          const OutputSink& sink) = 0;
  // Writes `data` at `offset` (truncating first when `truncate`); parent dirs are created.
  virtual absl::Status WriteFile(const InstanceRef& ref, const std::string& path,
                                 std::string_view data, int64_t offset, bool truncate) = 0;
  virtual absl::StatusOr<FileChunk> ReadFile(const InstanceRef& ref, const std::string& path,
                                             int64_t offset, int64_t length) = 0;
  virtual absl::StatusOr<DirListing> ListDir(const InstanceRef& ref, const std::string& path) = 0;
  virtual absl::StatusOr<Usage> Stats(const InstanceRef& ref) = 0;
  // Sets the base environment variables of an instance (used when a pooled instance is
  // handed to a request with its own `env`).
  virtual absl::Status Configure(const InstanceRef& ref,
                                 const std::map<std::string, std::string>& env) = 0;
};

}  // namespace esb
