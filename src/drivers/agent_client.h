// Host side of the esb-agent protocol (docs/agent-protocol.md), shared by every driver whose
// sandbox runs esb-agent. One connection per call; safe to use from many threads at once.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "drivers/driver.h"

namespace esb {

class AgentClient {
 public:
  // `connect` returns a connected stream fd to the agent (or an error status).
  using Connector = std::function<absl::StatusOr<int>()>;
  explicit AgentClient(Connector connect) : connect_(std::move(connect)) {}

  // Unix-socket connector with a connect timeout.
  static Connector UnixSocket(std::string path, int timeout_ms = 2000);

  absl::Status Ping(int timeout_ms = 2000);
  // Waits until the agent answers a ping or the deadline passes.
  absl::Status WaitReady(int timeout_ms);
  absl::StatusOr<ExecResult> Exec(const ExecRequest& request, const OutputSink& sink);
  absl::Status Write(const std::string& path, std::string_view data, int64_t offset,
                     bool truncate);
  absl::StatusOr<FileChunk> Read(const std::string& path, int64_t offset, int64_t length);
  absl::StatusOr<DirListing> List(const std::string& path);
  absl::StatusOr<FileEntry> Stat(const std::string& path);
  // mkdir -p; true when the directory was created (false: it already was one).
  absl::StatusOr<bool> MakeDir(const std::string& path);
  absl::Status Remove(const std::string& path, bool recursive);
  absl::Status Rename(const std::string& source, const std::string& destination, bool overwrite);
  absl::Status Configure(const std::map<std::string, std::string>& env);

 private:
  Connector connect_;
};

}  // namespace esb
