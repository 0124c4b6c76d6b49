#include "drivers/agent_terminal.h"

#include <atomic>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace esb {

namespace {

class AgentTerminal : public TerminalSession {
 public:
  AgentTerminal(std::shared_ptr<AgentClient> agent, std::string id)
      : agent_(std::move(agent)), id_(std::move(id)) {}
  ~AgentTerminal() override { Kill().IgnoreError(); }

  absl::Status Input(std::string_view data) override { return agent_->Input(id_, data, false); }
  absl::Status Resize(int rows, int cols) override { return agent_->Resize(id_, rows, cols); }
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
  std::atomic<bool> killed_{false};
};

}  // namespace

absl::StatusOr<std::unique_ptr<TerminalSession>> OpenAgentTerminal(
    std::shared_ptr<AgentClient> agent, const TerminalRequest& request) {
  if (request.rows < 1 || request.rows > 1000 || request.cols < 1 || request.cols > 1000)
    return absl::InvalidArgumentError("terminal rows and cols must be 1-1000");
  SpawnRequest spawn;
  // Interactive (a PTY on stdin), not a login shell: the image's profile scripts do not run.
  spawn.argv = {"bash", "-i"};
  spawn.env = request.env;
  spawn.pty = true;
  spawn.rows = request.rows;
  spawn.cols = request.cols;
  absl::StatusOr<std::string> id = agent->Spawn(spawn);
  if (!id.ok())
    return absl::Status(id.status().code(),
                        absl::StrCat("cannot start the terminal's shell: ", id.status().message()));
  return std::unique_ptr<TerminalSession>(new AgentTerminal(std::move(agent), *std::move(id)));
}

}  // namespace esb
