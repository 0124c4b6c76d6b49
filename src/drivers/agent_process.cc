#include "drivers/agent_process.h"

#include <atomic>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace esb {

namespace {

class AgentProcess : public ProcessSession {
 public:
  AgentProcess(std::shared_ptr<AgentClient> agent, std::string id, bool pty)
      : agent_(std::move(agent)), id_(std::move(id)), pty_(pty) {}
  ~AgentProcess() override { Kill().IgnoreError(); }

  absl::Status Input(std::string_view data, bool eof) override {
    return agent_->Input(id_, data, eof);
  }
  absl::Status Resize(int rows, int cols) override {
    if (!pty_) return absl::InvalidArgumentError("the process has no terminal to resize");
    return agent_->Resize(id_, rows, cols);
  }
  absl::StatusOr<std::optional<int>> Wait(int timeout_ms, const OutputSink& sink) override {
    absl::StatusOr<ProcessStatus> st = agent_->Wait(id_, timeout_ms, sink);
    if (!st.ok()) return st.status();
    if (!st->exited) return std::optional<int>();
    return std::optional<int>(st->exit_code);
  }
  absl::Status Kill() override {
    if (killed_.exchange(true)) return absl::OkStatus();
    absl::Status st = agent_->Kill(id_);
    // Already reaped and forgotten: nothing left to kill.
    return absl::IsNotFound(st) ? absl::OkStatus() : st;
  }

 private:
  std::shared_ptr<AgentClient> agent_;
  const std::string id_;
  const bool pty_;
  std::atomic<bool> killed_{false};
};

}  // namespace

absl::StatusOr<std::unique_ptr<ProcessSession>> SpawnAgentProcess(
    std::shared_ptr<AgentClient> agent, const ProcessRequest& request) {
  if (request.argv.empty() || request.argv[0].empty())
    return absl::InvalidArgumentError("a process needs a command (argv[0])");
  if (request.pty &&
      (request.rows < 1 || request.rows > 1000 || request.cols < 1 || request.cols > 1000))
    return absl::InvalidArgumentError("terminal rows and cols must be 1-1000");
  absl::StatusOr<std::string> id = agent->Spawn(request);
  if (!id.ok())
    return absl::Status(id.status().code(), absl::StrCat("cannot start ", request.argv[0], ": ",
                                                         id.status().message()));
  return std::unique_ptr<ProcessSession>(
      new AgentProcess(std::move(agent), *std::move(id), request.pty));
}

}  // namespace esb
