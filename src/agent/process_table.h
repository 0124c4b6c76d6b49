// Long-lived processes of the agent (the `spawn`, `input`, `signal`, `resize`, `wait` and
// `kill` ops; docs/agent-protocol.md, "Process table"). Each process is started through the
// exec shim (process_tree.h), so it is a child subreaper in a new session (its own process
// group): `setsid` and double-fork escapees stay in its tree while it lives, and Kill ends the
// whole tree as exec's timeout does. Its stdin/stdout/stderr are pipes, or one PTY that is its
// controlling terminal.
//
// One I/O thread per table reads every process's output and delivers it in chunks to the
// process's own callback, under credit-based flow control: the table reads no more than the
// credit the consumer granted (SpawnSpec::output_window, then GrantOutput), so a consumer that
// falls behind stops the reads, the pipe fills and the process blocks in write(); memory stays
// bounded by the credit. Input is written without blocking, with a per-process cap on bytes not
// yet accepted by the pipe. Exit statuses come from the agent's Reaper (never waitpid here).
//
// Thread-safe: every method may be called from any thread, including from the callbacks
// (but the table must not be destroyed from one).
// The callbacks run on the I/O thread, one at a time, and must not block (queue the data and
// grant credit when it has been consumed): a blocked callback stalls every process's output.
//
// No Abseil: the agent is a static binary (src/agent/CMakeLists.txt).
#pragma once

#include <sys/types.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "agent/process_tree.h"
#include "agent/reaper.h"
#include "agent/util.h"

namespace esb::agent {

// Outcome of a table operation: ok, or a message with the errno name the protocol's error
// replies carry (ENOENT unknown id, EINVAL bad argument, EAGAIN limit/backpressure, ESRCH the
// process has exited, ...).
struct OpStatus {
  bool ok = true;
  std::string error;
  std::string errno_name;

  static OpStatus Ok() { return {}; }
  // `err` gives the errno name; with `append_strerror` the message gets ": <strerror>".
  static OpStatus Error(std::string message, int err, bool append_strerror = false);
};

enum class OutputStream { kStdout, kStderr, kPty };
// "stdout", "stderr", "pty".
const char* OutputStreamName(OutputStream stream);

// How a process ended.
struct ExitInfo {
  bool exited = false;  // false: still running (Wait timed out)
  int exit_code = -1;   // its exit status if it exited normally, else -1
  int signal = 0;       // the signal that killed it, else 0
  bool core_dumped = false;
  int64_t duration_ms = 0;  // spawn to reap
};

struct SpawnSpec {
  // argv[0] without a '/' is looked up in the PATH of the process's environment (like
  // execvp); the process sees the resolved path as its argv[0]. 1-4096 arguments, no NUL,
  // at most 1 MiB together with the environment.
  std::vector<std::string> argv;
  // Laid over UserBaseEnv() and the table's Configure() environment. Names are non-empty
  // without '=' or NUL (≤ 256 bytes); values have no NUL. With a PTY, TERM defaults to
  // xterm-256color.
  std::map<std::string, std::string> env;
  // Working directory: relative to the workspace (or absolute), resolved with exec's and the
  // file ops' path rules (OpenSandboxPath: no /proc magic links, not on procfs/sysfs);
  // "" = the workspace.
  std::string cwd;
  // false: stdin, stdout and stderr are three pipes. true: one PTY (rows x cols, 1-1000 each)
  // is the controlling terminal of the process's new session and its stdin/stdout/stderr;
  // output comes as OutputStream::kPty.
  bool pty = false;
  int rows = 24;
  int cols = 80;
  // Initial output credit in bytes (1 .. kMaxOutputWindow). The table reads no more output
  // than it has credit for; GrantOutput adds credit.
  int64_t output_window = 256 * 1024;

  // Output as it is read, in chunks of at most 64 KiB (and at most the credit left). Never
  // called after on_exit. May be empty: output is then read and dropped (no credit needed).
  std::function<void(uint64_t id, OutputStream stream, std::string_view data)> on_output;
  // Called once, after the last on_output, when the process has been reaped and its output
  // streams are closed: at EOF, or kExitGraceMs after the exit (with credit available) if
  // background children still hold them open; what they write after that is lost (SIGPIPE).
  std::function<void(uint64_t id, const ExitInfo& exit)> on_exit;
  // Called when input queued by WriteInput (after an EAGAIN or a partial pipe write) has all
  // been written to the process: the consumer may send more.
  std::function<void(uint64_t id)> on_input_drained;
};

struct ProcessTableOptions {
  std::string workspace = "/workspace";
  std::string user = "appuser";     // USER/LOGNAME; processes run as the agent's own uid/gid
  std::string shell = "/bin/bash";  // SHELL
  // The agent binary to start as the exec shim (tests pass the built esb-agent).
  std::string shim = kSelfExe;
  int max_processes = 32;  // processes not yet ended (running, or exited and draining)
  int max_exited = 64;     // ended processes whose status Wait/Info still answer ...
  int64_t exited_ttl_ms = 10 * 60 * 1000;  // ... for this long after they ended
  int64_t max_pending_input = 1 << 20;     // per process, bytes queued and not yet written
};

// What Info/List report about one process.
struct ProcessInfo {
  uint64_t id = 0;
  pid_t pid = -1;  // pid in the agent's pid namespace (the session and process group id too)
  bool pty = false;
  std::vector<std::string> argv;
  // "running"; "exited" (reaped, output still being delivered); "ended" (outputs closed,
  // on_exit called or about to be).
  std::string state;
  ExitInfo exit;
  int64_t pending_input = 0;  // bytes queued for stdin
  int64_t output_credit = 0;  // bytes the table may still read and deliver
  bool output_paused = false;
};

class ProcessTable {
 public:
  static constexpr int64_t kMaxOutputWindow = 16 << 20;
  static constexpr int64_t kExitGraceMs = 100;
  static constexpr size_t kChunkBytes = 64 * 1024;

  ProcessTable(ProcessTableOptions options, Reaper* reaper);
  // KillAll(), then waits (≤ 2 s) for the processes to be reaped and stops the I/O thread.
  // No callback runs after the destructor returns.
  ~ProcessTable();
  ProcessTable(const ProcessTable&) = delete;
  ProcessTable& operator=(const ProcessTable&) = delete;

  // Base environment of later spawns (the `configure` op's env), between UserBaseEnv and
  // SpawnSpec::env.
  void Configure(std::map<std::string, std::string> env);

  // Starts a process. Ids start at 1 and are never reused in the table's life. EAGAIN when
  // max_processes are already live; EINVAL for a bad spec; ENOENT for a program not found; the
  // cwd's open error (ENOENT, ENOTDIR, EACCES for /proc, ELOOP for magic links).
  OpStatus Spawn(SpawnSpec spec, uint64_t* id);

  // Queues `data` for the process's stdin (a PTY: its input, as if typed). Never blocks:
  // what the pipe does not take at once is written by the I/O thread. All or nothing: EAGAIN
  // (nothing queued) if it would take the queue past max_pending_input; retry after
  // on_input_drained. *pending (optional) = bytes still queued after this call. EPIPE once the
  // input was closed or the process closed its end; ESRCH after the process exited.
  OpStatus WriteInput(uint64_t id, std::string_view data, int64_t* pending = nullptr);
  // End of input: pipes — stdin is closed once the queue is written (the process reads EOF).
  // PTY — the terminal's EOF character (VEOF, normally ^D) is queued: EOF for a reader in
  // canonical mode at the start of a line; the terminal itself stays open. A no-op (ok) once
  // the process has exited.
  OpStatus CloseInput(uint64_t id);

  // Sends `signo` (only those SignalAllowed accepts; EINVAL otherwise) to the process's
  // process group — for a PTY to the terminal's foreground process group, as a keyboard
  // would — while the process is unreaped (ESRCH after it exited).
  OpStatus Signal(uint64_t id, int signo);
  static bool SignalAllowed(int signo);
  // "INT"/"SIGINT" (any case) -> SIGINT, for the allowed signals; 0 otherwise.
  static int SignalFromName(std::string_view name);

  // Sets the PTY's window size (TIOCSWINSZ; the kernel sends SIGWINCH to the terminal's
  // foreground process group). EINVAL for a pipe process or a size outside 1-1000; ESRCH
  // once the process ended.
  OpStatus Resize(uint64_t id, int rows, int cols);

  // Flow control. GrantOutput adds credit (capped at kMaxOutputWindow); PauseOutput stops
  // reading the process's output regardless of credit until ResumeOutput.
  OpStatus GrantOutput(uint64_t id, int64_t bytes);
  OpStatus PauseOutput(uint64_t id);
  OpStatus ResumeOutput(uint64_t id);

  // Waits up to timeout_ms (0: just look; capped at 24 h) for the process to exit (be reaped;
  // its output may still be being delivered). ok with exit->exited == false on timeout.
  // ENOENT for an id never issued or whose status has expired (max_exited, exited_ttl_ms).
  OpStatus Wait(uint64_t id, int64_t timeout_ms, ExitInfo* exit);

  // Kills the process's whole tree (KillTree: freeze, then SIGKILL every descendant and the
  // process group) while it is unreaped. Once it has exited, background processes it left
  // behind are, as for exec, not touched; output still held for a consumer that is behind is
  // dropped and the process ends (on_exit), freeing its max_processes slot.
  OpStatus Kill(uint64_t id);
  // Kill() for every running process (environment destroyed, agent shutting down).
  void KillAll();

  OpStatus Info(uint64_t id, ProcessInfo* info);
  // Every process whose id is still known (running, exited, ended), by id.
  std::vector<ProcessInfo> List();

 private:
  enum class State { kRunning, kExited, kEnded };
  struct Proc;
  struct Delivery;

  void Loop();
  void Wake();
  // mu_ held. Reaps, finishes, expires; appends callbacks to run after unlocking.
  void CollectExitsLocked(std::vector<Delivery>* out);
  void FinishLocked(Proc* p, std::vector<Delivery>* out);
  void ExpireLocked();
  void FlushInputLocked(const std::shared_ptr<Proc>& p, std::vector<Delivery>* out);
  std::shared_ptr<Proc> FindLocked(uint64_t id);
  ProcessInfo InfoLocked(const Proc& p) const;
  OpStatus KillLocked(Proc* p);

  const ProcessTableOptions options_;
  Reaper* const reaper_;
  Fd wake_fd_;  // eventfd: poll set changed
  Fd exit_fd_;  // eventfd the Reaper writes when any of our processes exits

  mutable std::mutex mu_;
  std::condition_variable exited_cv_;
  std::map<uint64_t, std::shared_ptr<Proc>> procs_;
  std::deque<uint64_t> ended_;  // ids of ended processes, oldest first
  std::map<std::string, std::string> base_env_;
  uint64_t next_id_ = 1;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace esb::agent
