// Host side of the esb-agent protocol v2 (docs/agent-protocol.md), shared by every driver whose
// sandbox runs esb-agent. One connection per agent, multiplexed: a reader thread hands each
// frame to its call, so many threads may call at once; a call that is cancelled (its sink says
// stop, or its deadline passes) sends CANCEL and the connection stays up. When the connection
// breaks (the agent exited or restarted) every pending call fails at once and the next call
// connects again (unix socket) or fails (a single fd cannot be reopened).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "drivers/driver.h"

namespace esb {

// Where the agent is: hands out a connected byte stream to it.
class AgentTransport {
 public:
  virtual ~AgentTransport() = default;
  // A connected stream fd (the caller owns it), or why there is none.
  virtual absl::StatusOr<int> Connect() = 0;
};

// What esbd says when an agent speaks an older protocol (the sandbox must be recreated).
// AgentProtocolOutdated tells such a status apart.
bool AgentProtocolOutdated(const absl::Status& status);

// A `walk` answer as the agent sent it (docs/agent-protocol.md "Workspace steps"): the
// manifest's JSON and the contents it carries, unparsed and untrusted (drivers/
// workspace_steps.h validates them).
struct AgentWalkReply {
  std::string token;  // the base for the next walk
  std::string manifest_json;
  std::string contents;
  int64_t skipped = 0;
};

struct ProcessStatus {
  bool exited = false;  // false: still running when the wait's timeout passed
  int exit_code = -1;   // 128 + signal when killed by one
  bool truncated = false;
};

class AgentClient {
 public:
  // `connect` returns a connected stream fd to the agent (or an error status).
  using Connector = std::function<absl::StatusOr<int>()>;
  // Connects with `connect` now and again whenever the connection broke (the agent restarted).
  explicit AgentClient(Connector connect);
  explicit AgentClient(std::unique_ptr<AgentTransport> transport);
  ~AgentClient();
  AgentClient(const AgentClient&) = delete;
  AgentClient& operator=(const AgentClient&) = delete;

  // Names the agent in esbd's log (e.g. "agent of env_..."); call before the first call.
  void SetLabel(std::string label) { label_ = std::move(label); }

  // Unix-socket connector with a connect timeout.
  static Connector UnixSocket(std::string path, int timeout_ms = 2000);
  // One already-open byte stream that carries everything (a microVM's virtio-serial port).
  // Takes `fd`; once that connection broke, calls fail (it cannot be reopened).
  static std::unique_ptr<AgentTransport> SingleFd(int fd);

  absl::Status Ping(int timeout_ms = 2000);
  // Waits until the agent answers a ping or the deadline passes (an outdated agent fails at
  // once).
  absl::Status WaitReady(int timeout_ms);
  // The ops the agent announced in its HELLO (connects if needed).
  absl::StatusOr<std::vector<std::string>> Capabilities(int timeout_ms = 2000);

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

  // Long-lived processes (docs/agent-protocol.md, "Processes"). Spawn returns the process id.
  absl::StatusOr<std::string> Spawn(const ProcessRequest& request);
  absl::Status Input(const std::string& id, std::string_view data, bool eof);
  absl::Status Signal(const std::string& id, int signal);
  absl::Status Resize(const std::string& id, int rows, int cols);
  // Streams the process's output to `sink` until it exits or `timeout_ms` passes.
  absl::StatusOr<ProcessStatus> Wait(const std::string& id, int timeout_ms, const OutputSink& sink);
  absl::Status Kill(const std::string& id);
  // Before a snapshot: with `freeze`, stops every sandbox process (until Thaw, or by itself
  // after `max_frozen_ms`), then flushes the sandbox's file systems (syncfs).
  absl::Status Sync(bool freeze, int64_t max_frozen_ms = 60000);
  absl::Status Thaw();
  // Fresh entropy for the guest's RNGs after a restore (`entropy`: 16..4096 bytes).
  absl::Status Reseed(std::string_view entropy);

  // Time travel: the workspace as a manifest plus the contents of files changed since walk
  // `base` (empty: all, within the budgets), and putting one back (`apply`).
  absl::StatusOr<AgentWalkReply> Walk(const std::string& base, bool contents, int64_t max_entries,
                                      int64_t max_content_bytes);
  absl::Status Apply(std::string manifest_json, std::string_view data, bool prune, bool finish);
  // The shell session's state (bounded by `max_bytes`), and replacing it.
  absl::StatusOr<std::string> ShellState(int64_t max_bytes);
  absl::Status SetShellState(std::string_view state);
  // gVisor, before a checkpoint: the agent closes its host-bound listener and every
  // connection (this one too), creates `released` next to its socket, and listens again on
  // SIGUSR1 from outside the sandbox (docs/agent-protocol.md "Checkpoint").
  absl::Status ReleaseListener();

  class Connection;
  struct CallSpec;
  struct CallReply;

 private:
  // The live connection, connecting first if there is none (or it broke).
  absl::StatusOr<std::shared_ptr<Connection>> Connected(int64_t deadline_ms);
  absl::StatusOr<CallReply> Call(const CallSpec& spec);
  absl::StatusOr<CallReply> CallOn(const std::shared_ptr<Connection>& conn, const CallSpec& spec);
  // A call ran to its deadline without a single frame from the agent since `since_ms`: pings
  // the connection itself and gives it up when that gets no answer either (pending calls fail
  // at once, the next call connects again). True if it was given up.
  bool ProbeSilentConnection(const std::shared_ptr<Connection>& conn, int64_t since_ms);

  std::unique_ptr<AgentTransport> transport_;
  std::string label_ = "agent";
  std::timed_mutex connect_mu_;  // one connect at a time; guards conn_
  std::shared_ptr<Connection> conn_;
};

}  // namespace esb
