// The agent's one shell session: `exec` runs each command in a fresh `bash --noprofile --norc`
// process group (its own session) whose script first replays the session's state (cwd,
// variables, functions, aliases) and whose EXIT trap dumps that state again (through a FIFO
// in the state directory). The agent keeps the state in memory, so nothing touches the disk
// on the critical path, and writes it to <state-dir>/shell.state after responding (read back
// at start-up). See docs/agent-protocol.md, "Exec semantics". A timeout or a vanished client
// kills the whole process group; the session's state survives because it lives in the agent,
// not in a long-lived shell. The next exec's shell is started ahead of time (bash start-up is
// most of an exec's latency).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "agent/reaper.h"
#include "agent/util.h"

namespace esb::agent {

struct ShellOptions {
  std::string workspace = "/workspace";
  std::string state_dir = "/run/esb/state";
  std::string shell = "/bin/bash";
  std::string user = "appuser";
};

struct ExecParams {
  std::string command;
  int64_t timeout_ms = 60000;
  int64_t max_output_bytes = 1 << 20;  // per stream
  std::map<std::string, std::string> env;
  // false: stdin is at EOF from the start; true: ExecIo::take_input delivers it.
  bool has_stdin = false;
};

struct ExecOutcome {
  bool ok = false;  // false: the command could not be started (see error/errno)
  std::string error;
  std::string errno_name;
  bool cancelled = false;  // the call was cancelled (or its connection lost)
  int exit_code = -1;
  bool timed_out = false;
  bool truncated = false;
  int64_t duration_ms = 0;
};

// Receives output as it arrives; returns false when the client is gone (cancels the exec).
using OutputFn = std::function<bool(bool is_stderr, std::string_view data)>;

// How one exec talks to its call (agent.cc): cancellation, stdin and output.
struct ExecIo {
  // Readable (an eventfd) when cancelled() or take_input() may have changed; -1: never.
  int wake_fd = -1;
  std::function<bool()> cancelled;
  // Appends the stdin bytes that arrived to *data; returns true once the sender said EOF.
  std::function<bool(std::string* data)> take_input;
  OutputFn output;
};

// Environment names must be shell identifiers, not bash-readonly or agent-reserved ones
// (values are checked for NUL separately).
bool ValidEnvName(std::string_view name);

class ShellSession {
 public:
  ShellSession(ShellOptions options, Reaper* reaper);

  // Replaces the base environment. The new values are also applied (exported) at the start of
  // the next exec, so they win over values saved in the shell state.
  void Configure(std::map<std::string, std::string> env);

  // Runs one command. Serialised: concurrent calls wait for each other. When `io` says
  // cancelled, the exec's process tree is killed (KillTree).
  ExecOutcome Exec(const ExecParams& params, const ExecIo& io);

  // Starts the next exec's shell ahead of time (bash start-up is most of an exec's latency).
  // Never blocks: does nothing while an exec runs (each exec prepares the next one).
  void PrepareStandby();

  // Pid of the idle standby shell, or -1 (it is agent machinery, not a user process).
  pid_t standby_pid() const;

  // The session's saved state (a bash script: cd, declarations, functions, aliases), and
  // replacing it (time travel's rewind: the next exec starts from `state`; written to the
  // state file at once).
  std::string State();
  void SetState(std::string state);

  // Kills every process group this session has started (SIGTERM path).
  void KillAll();

 private:
  // A started `bash` waiting for its script on fd 3.
  struct Shell {
    pid_t pid = -1;
    uint64_t generation = 0;  // base environment it was started with
    Fd script_w, in_w, out_r, err_r, exit_fd;
  };
  bool StartShell(Shell* shell, std::string* error, int* err);
  void DiscardShell(Shell* shell);
  // (Re)creates the FIFO the shell's EXIT trap dumps its state into; returns its read end.
  int OpenDumpFifo();
  void EnsureStandbyLocked();  // exec_mu_ held
  // Writes the state file (tmp + rename) unless a newer state (higher seq) was written.
  void PersistState(const std::string& state, uint64_t seq);
  void LoadState();
  std::string BuildScript(const ExecParams& params,
                          const std::map<std::string, std::string>& pending) const;
  std::vector<std::string> BuildEnv() const;

  const ShellOptions options_;
  Reaper* const reaper_;
  const std::string dump_fifo_;
  const std::string state_path_;  // the state, persisted off the critical path
  // Guarded by exec_mu_: the session's shell state (filtered dump), kept in memory and
  // replayed by each exec; whether it changed since it was last persisted.
  std::string state_;
  bool state_dirty_ = false;
  uint64_t persist_seq_ = 0;
  std::mutex persist_mu_;
  uint64_t persisted_seq_ = 0;  // guarded by persist_mu_

  std::mutex exec_mu_;  // one exec at a time; guards standby_
  std::optional<Shell> standby_;
  mutable std::mutex mu_;  // guards the members below
  std::map<std::string, std::string> base_env_;
  std::map<std::string, std::string> pending_env_;  // configure values not yet applied
  std::set<pid_t> pgids_;                           // process groups started (pruned when empty)
  uint64_t generation_ = 0;                         // bumped by Configure
  pid_t standby_pid_ = -1;
};

}  // namespace esb::agent
