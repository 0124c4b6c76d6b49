#include "agent/process_table.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>

#include "agent/handlers.h"
#include "common/protocol.h"

namespace esb::agent {
namespace {

constexpr size_t kMaxArgs = 4096;
constexpr size_t kMaxArgvEnvBytes = 1 << 20;
constexpr int kMaxTermSize = 1000;
// The I/O thread wakes at least this often (expiry of ended processes' statuses).
constexpr int64_t kHousekeepingMs = 1000;

struct AllowedSignal {
  int signo;
  const char* name;
};
constexpr AllowedSignal kAllowedSignals[] = {
    {SIGINT, "INT"},   {SIGTERM, "TERM"}, {SIGKILL, "KILL"},   {SIGHUP, "HUP"},   {SIGQUIT, "QUIT"},
    {SIGUSR1, "USR1"}, {SIGUSR2, "USR2"}, {SIGWINCH, "WINCH"}, {SIGCONT, "CONT"}, {SIGSTOP, "STOP"},
};

bool ValidSpawnEnvName(const std::string& name) {
  return !name.empty() && name.size() <= 256 && name.find('=') == std::string::npos &&
         name.find('\0') == std::string::npos;
}

// execvp's lookup, done by the agent because the shim execs a path: the first regular,
// executable file named `name` in the absolute directories of `path`.
bool FindInPath(const std::string& name, const std::string& path, std::string* out) {
  size_t start = 0;
  while (start <= path.size()) {
    size_t end = path.find(':', start);
    if (end == std::string::npos) end = path.size();
    std::string dir = path.substr(start, end - start);
    start = end + 1;
    if (dir.empty() || dir[0] != '/') continue;  // relative PATH entries are not searched
    std::string candidate = dir + "/" + name;
    struct stat st;
    if (stat(candidate.c_str(), &st) == 0 && S_ISREG(st.st_mode) &&
        access(candidate.c_str(), X_OK) == 0) {
      *out = candidate;
      return true;
    }
  }
  return false;
}

ExitInfo ExitFromStatus(int status, int64_t duration_ms) {
  ExitInfo e;
  e.exited = true;
  e.duration_ms = duration_ms;
  if (WIFEXITED(status)) {
    e.exit_code = WEXITSTATUS(status);
  } else if (WIFSIGNALED(status)) {
    e.signal = WTERMSIG(status);
    e.core_dumped = WCOREDUMP(status);
  }
  return e;
}

// Caller-supplied text quoted in an error message, cut to a readable length.
std::string Clip(const std::string& text) {
  return text.size() <= 200 ? text : text.substr(0, 200) + "...";
}

void SetNonBlocking(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK); }

}  // namespace

OpStatus OpStatus::Error(std::string message, int err, bool append_strerror) {
  OpStatus s;
  s.ok = false;
  s.error = std::move(message);
  if (append_strerror) s.error += std::string(": ") + strerror(err);
  s.errno_name = ErrnoName(err);
  return s;
}

const char* OutputStreamName(OutputStream stream) {
  switch (stream) {
    case OutputStream::kStdout:
      return "stdout";
    case OutputStream::kStderr:
      return "stderr";
    case OutputStream::kPty:
      return "pty";
  }
  return "stdout";
}

struct ProcessTable::Proc {
  uint64_t id = 0;
  pid_t pid = -1;
  bool pty = false;
  std::vector<std::string> argv;
  State state = State::kRunning;
  ExitInfo exit;
  int64_t started_ms = 0;
  int64_t ended_ms = 0;
  int64_t grace_deadline = 0;  // kExited: outputs are closed at this time (credit permitting)
  // Pipes: in (our write end of stdin), out, err (our read ends). PTY: master only.
  Fd in, out, err, master;
  std::string pending;       // input not yet written
  bool close_input = false;  // pipes: close stdin once `pending` is written
  bool input_closed = false;
  int64_t credit = 0;
  bool paused = false;
  std::function<void(uint64_t, OutputStream, std::string_view)> on_output;
  std::function<void(uint64_t, const ExitInfo&)> on_exit;
  std::function<void(uint64_t)> on_input_drained;

  int input_fd() const { return pty ? master.get() : in.get(); }
  bool readable() const { return credit > 0 && !paused; }
  bool outputs_open() const { return out || err || master; }
};

// A callback to run once mu_ is released.
struct ProcessTable::Delivery {
  enum Kind { kOutput, kExit, kDrained } kind;
  std::shared_ptr<Proc> proc;
  OutputStream stream = OutputStream::kStdout;
  std::string data;
};

ProcessTable::ProcessTable(ProcessTableOptions options, Reaper* reaper)
    : options_(std::move(options)),
      reaper_(reaper),
      wake_fd_(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)),
      exit_fd_(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {
  thread_ = std::thread([this] { Loop(); });
}

ProcessTable::~ProcessTable() {
  KillAll();
  {
    std::unique_lock<std::mutex> lock(mu_);
    exited_cv_.wait_for(lock, std::chrono::seconds(2), [&] {
      for (const auto& [id, p] : procs_) {
        if (p->state == State::kRunning) return false;
      }
      return true;
    });
    stopping_ = true;
  }
  Wake();
  thread_.join();
  std::lock_guard<std::mutex> lock(mu_);
  // Before exit_fd_ closes: the reaper must not write to it any more.
  for (const auto& [id, p] : procs_) {
    if (p->state == State::kRunning) reaper_->Forget(p->pid);
  }
  exited_cv_.notify_all();
}

void ProcessTable::Wake() {
  uint64_t one = 1;
  ssize_t ignored = write(wake_fd_.get(), &one, sizeof one);
  (void)ignored;
}

void ProcessTable::Configure(std::map<std::string, std::string> env) {
  std::lock_guard<std::mutex> lock(mu_);
  base_env_ = std::move(env);
}

bool ProcessTable::SignalAllowed(int signo) {
  for (const auto& s : kAllowedSignals) {
    if (s.signo == signo) return true;
  }
  return false;
}

int ProcessTable::SignalFromName(std::string_view name) {
  std::string upper;
  for (char c : name) upper += static_cast<char>(toupper(static_cast<unsigned char>(c)));
  if (upper.rfind("SIG", 0) == 0) upper.erase(0, 3);
  for (const auto& s : kAllowedSignals) {
    if (upper == s.name) return s.signo;
  }
  return 0;
}

std::shared_ptr<ProcessTable::Proc> ProcessTable::FindLocked(uint64_t id) {
  auto it = procs_.find(id);
  return it == procs_.end() ? nullptr : it->second;
}

OpStatus ProcessTable::Spawn(SpawnSpec spec, uint64_t* id) {
  // Check the spec.
  if (spec.argv.empty() || spec.argv.size() > kMaxArgs || spec.argv[0].empty()) {
    return OpStatus::Error("argv must have 1 to 4096 arguments and a program name", EINVAL);
  }
  size_t bytes = 0;
  for (const auto& a : spec.argv) {
    if (a.find('\0') != std::string::npos) return OpStatus::Error("argv contains NUL", EINVAL);
    bytes += a.size() + 1;
  }
  for (const auto& [k, v] : spec.env) {
    if (!ValidSpawnEnvName(k) || v.find('\0') != std::string::npos) {
      return OpStatus::Error("invalid environment variable name or value: " + Clip(k), EINVAL);
    }
    bytes += k.size() + v.size() + 2;
  }
  if (bytes > kMaxArgvEnvBytes) {
    return OpStatus::Error("argv and env exceed 1 MiB", EINVAL);
  }
  if (spec.pty &&
      (spec.rows < 1 || spec.rows > kMaxTermSize || spec.cols < 1 || spec.cols > kMaxTermSize)) {
    return OpStatus::Error("terminal rows and cols must be 1-1000", EINVAL);
  }
  if (spec.output_window < 1 || spec.output_window > kMaxOutputWindow) {
    return OpStatus::Error("output_window must be 1 byte to 16 MiB", EINVAL);
  }

  // The working directory, opened with the file ops' path rules; the child fchdir()s to it.
  std::string cwd_path;
  if (!ResolvePath(options_.workspace, spec.cwd.empty() ? options_.workspace : spec.cwd,
                   &cwd_path)) {
    return OpStatus::Error("invalid cwd", EINVAL);
  }
  bool kernel_fs = false;
  Fd cwd(OpenSandboxPath(cwd_path, O_RDONLY | O_DIRECTORY | O_NONBLOCK, 0, &kernel_fs));
  if (!cwd) {
    if (kernel_fs)
      return OpStatus::Error("cwd: refused: /proc and /sys are not sandbox files", EACCES);
    return OpStatus::Error("cwd " + Clip(spec.cwd), errno, true);
  }

  std::map<std::string, std::string> env =
      UserBaseEnv(options_.workspace, options_.user, options_.shell);
  if (spec.pty) env["TERM"] = "xterm-256color";
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [k, v] : base_env_) env[k] = v;
  }
  for (const auto& [k, v] : spec.env) env[k] = v;
  // Looked up before taking mu_: stat() of PATH entries may be slow.
  std::string program = spec.argv[0];
  if (program.find('/') == std::string::npos && !FindInPath(program, env["PATH"], &program)) {
    return OpStatus::Error(Clip(spec.argv[0]) + ": command not found in PATH", ENOENT);
  }

  std::unique_lock<std::mutex> lock(mu_);
  if (stopping_) return OpStatus::Error("the process table is shutting down", EAGAIN);
  if (!wake_fd_ || !exit_fd_) return OpStatus::Error("process table: no eventfd", EMFILE);
  int live = 0;
  for (const auto& [pid, p] : procs_) {
    if (p->state != State::kEnded) ++live;
  }
  if (live >= options_.max_processes) {
    return OpStatus::Error("too many processes: " + std::to_string(live) + " of at most " +
                               std::to_string(options_.max_processes) +
                               " are running (kill or wait for one)",
                           EAGAIN);
  }

  auto p = std::make_shared<Proc>();
  p->pty = spec.pty;
  p->argv = spec.argv;
  p->credit = spec.output_window;
  p->on_output = std::move(spec.on_output);
  p->on_exit = std::move(spec.on_exit);
  p->on_input_drained = std::move(spec.on_input_drained);

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  Fd child_in, child_out, child_err;
  auto fail = [&](const char* what) {
    int err = errno;
    posix_spawn_file_actions_destroy(&actions);
    return OpStatus::Error(what, err, true);
  };
  if (spec.pty) {
    p->master.reset(posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC));
    if (!p->master) return fail("open pty");
    char name[128];
    if (grantpt(p->master.get()) != 0 || unlockpt(p->master.get()) != 0 ||
        ptsname_r(p->master.get(), name, sizeof name) != 0) {
      return fail("pty");
    }
    winsize ws{};
    ws.ws_row = static_cast<unsigned short>(spec.rows);
    ws.ws_col = static_cast<unsigned short>(spec.cols);
    if (ioctl(p->master.get(), TIOCSWINSZ, &ws) != 0) return fail("pty size");
    // SECURITY: fd hand-over — the child gets only its terminal. It opens the slave itself,
    // after setsid (POSIX_SPAWN_SETSID runs before file actions) and without O_NOCTTY, so the
    // terminal becomes its session's controlling terminal; the agent never opens the slave
    // (and opens the master O_NOCTTY), so the terminal can never become the agent's.
    posix_spawn_file_actions_addopen(&actions, 0, name, O_RDWR, 0);
    posix_spawn_file_actions_adddup2(&actions, 0, 1);
    posix_spawn_file_actions_adddup2(&actions, 0, 2);
    SetNonBlocking(p->master.get());
  } else {
    int fds[2];
    if (pipe2(fds, O_CLOEXEC) != 0) return fail("pipe");
    child_in.reset(fds[0]);
    p->in.reset(fds[1]);
    if (pipe2(fds, O_CLOEXEC) != 0) return fail("pipe");
    p->out.reset(fds[0]);
    child_out.reset(fds[1]);
    if (pipe2(fds, O_CLOEXEC) != 0) return fail("pipe");
    p->err.reset(fds[0]);
    child_err.reset(fds[1]);
    // SECURITY: fd hand-over — the child gets only its own three pipes (every agent
    // descriptor is O_CLOEXEC, so sockets and other processes' pipes do not leak into it).
    posix_spawn_file_actions_adddup2(&actions, child_in.get(), 0);
    posix_spawn_file_actions_adddup2(&actions, child_out.get(), 1);
    posix_spawn_file_actions_adddup2(&actions, child_err.get(), 2);
    SetNonBlocking(p->in.get());
    SetNonBlocking(p->out.get());
    SetNonBlocking(p->err.get());
  }
  posix_spawn_file_actions_addfchdir_np(&actions, cwd.get());

  std::vector<std::string> args = ShimArgv(program, spec.argv);
  std::vector<std::string> env_strings;
  for (const auto& [k, v] : env) env_strings.push_back(k + "=" + v);
  std::vector<char*> argv, envp;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  for (auto& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);

  int spawn_err = 0;
  pid_t pid = SpawnSessionLeader(reaper_, exit_fd_.get(), options_.shim.c_str(), &actions,
                                 argv.data(), envp.data(), &spawn_err);
  posix_spawn_file_actions_destroy(&actions);
  if (pid < 0) return OpStatus::Error("spawn " + Clip(spec.argv[0]), spawn_err, true);

  p->id = next_id_++;
  p->pid = pid;
  p->started_ms = proto::MonotonicMs();
  procs_[p->id] = p;
  *id = p->id;
  lock.unlock();
  Wake();
  return OpStatus::Ok();
}

void ProcessTable::FlushInputLocked(const std::shared_ptr<Proc>& p, std::vector<Delivery>* out) {
  bool had = !p->pending.empty();
  while (!p->pending.empty() && p->input_fd() >= 0) {
    ssize_t n = write(p->input_fd(), p->pending.data(), p->pending.size());
    if (n > 0) {
      p->pending.erase(0, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) break;
    // EPIPE/EIO: the process closed its end (or the terminal is gone): input is over.
    p->pending.clear();
    p->input_closed = true;
    if (!p->pty) p->in.reset();
    break;
  }
  if (p->pending.empty()) {
    if (p->close_input && p->in) {
      p->in.reset();
      p->input_closed = true;
    }
    if (had && out && p->on_input_drained && !p->input_closed) {
      out->push_back(Delivery{Delivery::kDrained, p});
    }
  }
}

OpStatus ProcessTable::WriteInput(uint64_t id, std::string_view data, int64_t* pending) {
  std::lock_guard<std::mutex> lock(mu_);
  auto p = FindLocked(id);
  if (!p) return OpStatus::Error("no process " + std::to_string(id), ENOENT);
  if (p->state != State::kRunning) {
    return OpStatus::Error("process " + std::to_string(id) + " has exited", ESRCH);
  }
  if (p->input_closed || p->close_input) {
    return OpStatus::Error("input of process " + std::to_string(id) + " is closed", EPIPE);
  }
  if (static_cast<int64_t>(data.size()) > options_.max_pending_input) {
    return OpStatus::Error("input chunk larger than the " +
                               std::to_string(options_.max_pending_input) +
                               "-byte input queue: split it",
                           EINVAL);
  }
  if (static_cast<int64_t>(p->pending.size() + data.size()) > options_.max_pending_input) {
    return OpStatus::Error("input queue of process " + std::to_string(id) + " is full (" +
                               std::to_string(p->pending.size()) +
                               " bytes not yet read by the process): retry later",
                           EAGAIN);
  }
  p->pending.append(data);
  FlushInputLocked(p, nullptr);
  if (pending) *pending = static_cast<int64_t>(p->pending.size());
  if (!p->pending.empty()) Wake();  // the I/O thread writes the rest when the pipe has room
  return OpStatus::Ok();
}

OpStatus ProcessTable::CloseInput(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto p = FindLocked(id);
  if (!p) return OpStatus::Error("no process " + std::to_string(id), ENOENT);
  // A process that has exited has no input left to close. Not an error: a caller that writes
  // its last input and then closes (two ops) may see the process end in between.
  if (p->state != State::kRunning) return OpStatus::Ok();
  if (p->pty) {
    termios t{};
    char eof = 4;  // ^D
    if (tcgetattr(p->master.get(), &t) == 0 && t.c_cc[VEOF] != 0) {
      eof = static_cast<char>(t.c_cc[VEOF]);
    }
    if (static_cast<int64_t>(p->pending.size()) + 1 > options_.max_pending_input) {
      return OpStatus::Error("input queue is full: retry later", EAGAIN);
    }
    p->pending += eof;
  } else {
    p->close_input = true;
  }
  FlushInputLocked(p, nullptr);
  Wake();
  return OpStatus::Ok();
}

OpStatus ProcessTable::Signal(uint64_t id, int signo) {
  if (!SignalAllowed(signo)) {
    return OpStatus::Error("signal " + std::to_string(signo) +
                               " not allowed (INT TERM KILL HUP QUIT USR1 USR2 WINCH CONT STOP)",
                           EINVAL);
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto p = FindLocked(id);
  if (!p) return OpStatus::Error("no process " + std::to_string(id), ENOENT);
  int err = 0;
  bool ran = p->state == State::kRunning && reaper_->WhileUnreaped(p->pid, [&] {
    pid_t group = p->pid;
    pid_t foreground = -1;
    // The terminal's foreground process group is in the process's session (the terminal is
    // that session's controlling terminal), so it is part of the process's tree.
    if (p->pty && ioctl(p->master.get(), TIOCGPGRP, &foreground) == 0 && foreground > 1) {
      group = foreground;
    }
    // SECURITY: the process group of a process this table started and has not reaped (its pid
    // cannot have been reused), or the foreground group of its own terminal.
    if (kill(-group, signo) != 0) err = errno;
  });
  if (!ran) return OpStatus::Error("process " + std::to_string(id) + " has exited", ESRCH);
  if (err) return OpStatus::Error("kill", err, true);
  return OpStatus::Ok();
}

OpStatus ProcessTable::Resize(uint64_t id, int rows, int cols) {
  if (rows < 1 || rows > kMaxTermSize || cols < 1 || cols > kMaxTermSize) {
    return OpStatus::Error("terminal rows and cols must be 1-1000", EINVAL);
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto p = FindLocked(id);
  if (!p) return OpStatus::Error("no process " + std::to_string(id), ENOENT);
  if (!p->pty) {
    return OpStatus::Error(
        "process " + std::to_string(id) + " has no terminal (spawned with pipes)", EINVAL);
  }
  if (p->state != State::kRunning || !p->master) {
    return OpStatus::Error("process " + std::to_string(id) + " has exited", ESRCH);
  }
  winsize ws{};
  ws.ws_row = static_cast<unsigned short>(rows);
  ws.ws_col = static_cast<unsigned short>(cols);
  if (ioctl(p->master.get(), TIOCSWINSZ, &ws) != 0) return OpStatus::Error("resize", errno, true);
  return OpStatus::Ok();
}

OpStatus ProcessTable::GrantOutput(uint64_t id, int64_t bytes) {
  if (bytes < 1 || bytes > kMaxOutputWindow) {
    return OpStatus::Error("credit must be 1 byte to 16 MiB", EINVAL);
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto p = FindLocked(id);
  if (!p) return OpStatus::Error("no process " + std::to_string(id), ENOENT);
  bool was = p->readable();
  p->credit = std::min(p->credit + bytes, kMaxOutputWindow);
  if (!was && p->readable()) {
    // A process that exited while its consumer was behind gets its full grace to drain.
    if (p->state == State::kExited) {
      p->grace_deadline = std::max(p->grace_deadline, proto::MonotonicMs() + kExitGraceMs);
    }
    Wake();
  }
  return OpStatus::Ok();
}

OpStatus ProcessTable::PauseOutput(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto p = FindLocked(id);
  if (!p) return OpStatus::Error("no process " + std::to_string(id), ENOENT);
  p->paused = true;
  return OpStatus::Ok();
}

OpStatus ProcessTable::ResumeOutput(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto p = FindLocked(id);
  if (!p) return OpStatus::Error("no process " + std::to_string(id), ENOENT);
  bool was = p->readable();
  p->paused = false;
  if (!was && p->readable()) {
    if (p->state == State::kExited) {
      p->grace_deadline = std::max(p->grace_deadline, proto::MonotonicMs() + kExitGraceMs);
    }
    Wake();
  }
  return OpStatus::Ok();
}

OpStatus ProcessTable::Wait(uint64_t id, int64_t timeout_ms, ExitInfo* exit) {
  timeout_ms = std::clamp<int64_t>(timeout_ms, 0, int64_t{24} * 3600 * 1000);
  std::unique_lock<std::mutex> lock(mu_);
  auto p = FindLocked(id);
  if (!p) {
    return OpStatus::Error("no process " + std::to_string(id) +
                               " (never spawned, or its exit "
                               "status has expired)",
                           ENOENT);
  }
  exited_cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms),
                      [&] { return p->state != State::kRunning || stopping_; });
  *exit = p->exit;  // exited == false while it runs
  return OpStatus::Ok();
}

OpStatus ProcessTable::KillLocked(Proc* p) {
  if (p->state == State::kRunning) {
    reaper_->WhileUnreaped(p->pid, [&] { KillTree(p->pid); });
  } else if (p->state == State::kExited) {
    // Exited, its output still held for a consumer that is behind: drop it and end.
    p->out.reset();
    p->err.reset();
    p->master.reset();
    Wake();
  }
  return OpStatus::Ok();
}

OpStatus ProcessTable::Kill(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto p = FindLocked(id);
  if (!p) return OpStatus::Error("no process " + std::to_string(id), ENOENT);
  return KillLocked(p.get());
}

void ProcessTable::KillAll() {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [id, p] : procs_) KillLocked(p.get());
}

ProcessInfo ProcessTable::InfoLocked(const Proc& p) const {
  ProcessInfo info;
  info.id = p.id;
  info.pid = p.pid;
  info.pty = p.pty;
  info.argv = p.argv;
  info.state = p.state == State::kRunning  ? "running"
               : p.state == State::kExited ? "exited"
                                           : "ended";
  info.exit = p.exit;
  info.pending_input = static_cast<int64_t>(p.pending.size());
  info.output_credit = p.credit;
  info.output_paused = p.paused;
  return info;
}

OpStatus ProcessTable::Info(uint64_t id, ProcessInfo* info) {
  std::lock_guard<std::mutex> lock(mu_);
  auto p = FindLocked(id);
  if (!p) return OpStatus::Error("no process " + std::to_string(id), ENOENT);
  *info = InfoLocked(*p);
  return OpStatus::Ok();
}

std::vector<ProcessInfo> ProcessTable::List() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<ProcessInfo> out;
  for (const auto& [id, p] : procs_) out.push_back(InfoLocked(*p));
  return out;
}

void ProcessTable::CollectExitsLocked(std::vector<Delivery>* out) {
  (void)out;
  const int64_t now = proto::MonotonicMs();
  for (const auto& [id, p] : procs_) {
    int status = 0;
    if (p->state != State::kRunning || !reaper_->TryCollect(p->pid, &status)) continue;
    p->state = State::kExited;
    p->exit = ExitFromStatus(status, now - p->started_ms);
    p->grace_deadline = now + kExitGraceMs;
    p->pending.clear();
    p->in.reset();
    p->input_closed = true;
    exited_cv_.notify_all();
  }
}

void ProcessTable::FinishLocked(Proc* p, std::vector<Delivery>* out) {
  p->out.reset();
  p->err.reset();
  p->master.reset();
  p->in.reset();
  p->state = State::kEnded;
  p->ended_ms = proto::MonotonicMs();
  ended_.push_back(p->id);
  out->push_back(Delivery{Delivery::kExit, procs_[p->id]});
}

void ProcessTable::ExpireLocked() {
  const int64_t now = proto::MonotonicMs();
  while (!ended_.empty()) {
    auto it = procs_.find(ended_.front());
    bool expire = static_cast<int>(ended_.size()) > options_.max_exited || it == procs_.end() ||
                  now - it->second->ended_ms > options_.exited_ttl_ms;
    if (!expire) break;
    if (it != procs_.end()) procs_.erase(it);
    ended_.pop_front();
  }
}

void ProcessTable::Loop() {
  std::string buf(kChunkBytes, '\0');
  for (;;) {
    std::vector<pollfd> fds;
    // What each pollfd is: the process and 0 stdin / 1 stdout / 2 stderr / 3 pty master.
    std::vector<std::pair<std::shared_ptr<Proc>, int>> who;
    int64_t timeout = kHousekeepingMs;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return;
      ExpireLocked();
      const int64_t now = proto::MonotonicMs();
      fds.push_back({wake_fd_.get(), POLLIN, 0});
      fds.push_back({exit_fd_.get(), POLLIN, 0});
      who.emplace_back(nullptr, -1);
      who.emplace_back(nullptr, -1);
      for (const auto& [id, p] : procs_) {
        if (p->state == State::kEnded) continue;
        const bool want_in = !p->pending.empty();
        if (p->pty) {
          short events = static_cast<short>((p->readable() ? POLLIN : 0) | (want_in ? POLLOUT : 0));
          // A fd with no events still reports POLLHUP: leave it out while paused.
          if (p->master && events) {
            fds.push_back({p->master.get(), events, 0});
            who.emplace_back(p, 3);
          }
        } else {
          if (want_in && p->in) {
            fds.push_back({p->in.get(), POLLOUT, 0});
            who.emplace_back(p, 0);
          }
          if (p->readable()) {
            if (p->out) {
              fds.push_back({p->out.get(), POLLIN, 0});
              who.emplace_back(p, 1);
            }
            if (p->err) {
              fds.push_back({p->err.get(), POLLIN, 0});
              who.emplace_back(p, 2);
            }
          }
        }
        if (p->state == State::kExited && p->readable()) {
          timeout = std::clamp<int64_t>(p->grace_deadline - now, 0, timeout);
        }
      }
    }
    int r = poll(fds.data(), fds.size(), static_cast<int>(timeout));
    if (r < 0 && errno != EINTR) {
      Log(LogLevel::kError, std::string("process table poll: ") + strerror(errno));
      usleep(10000);
    }
    std::vector<Delivery> deliveries;
    {
      std::lock_guard<std::mutex> lock(mu_);
      uint64_t v;
      if (r > 0 && fds[0].revents) {
        ssize_t ignored = read(wake_fd_.get(), &v, sizeof v);
        (void)ignored;
      }
      for (size_t i = 2; r > 0 && i < fds.size(); ++i) {
        if (!fds[i].revents) continue;
        const std::shared_ptr<Proc>& sp = who[i].first;
        Proc* p = sp.get();
        const int role = who[i].second;
        const short re = fds[i].revents;
        // The fd may have been closed (and its number reused) since poll was set up.
        Fd* fd = role == 0 ? &p->in : role == 1 ? &p->out : role == 2 ? &p->err : &p->master;
        if (fd->get() != fds[i].fd || p->state == State::kEnded) continue;
        if ((role == 0 || role == 3) && (re & (POLLOUT | POLLERR | POLLHUP))) {
          FlushInputLocked(sp, &deliveries);
          if (role == 0) continue;
        }
        if (role == 3 && !p->master) continue;
        if (!(re & (POLLIN | POLLHUP | POLLERR)) || !p->readable()) continue;
        size_t want = static_cast<size_t>(std::min<int64_t>(p->credit, kChunkBytes));
        ssize_t n = read(fd->get(), buf.data(), want);
        if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
        if (n <= 0) {  // EOF; EIO from a PTY master: no process holds the terminal any more
          fd->reset();
          continue;
        }
        if (p->on_output) {
          p->credit -= n;  // output nobody consumes costs no credit
          OutputStream stream = role == 1   ? OutputStream::kStdout
                                : role == 2 ? OutputStream::kStderr
                                            : OutputStream::kPty;
          deliveries.push_back(Delivery{Delivery::kOutput, sp, stream,
                                        std::string(buf.data(), static_cast<size_t>(n))});
        }
      }
      if (r > 0 && fds[1].revents) {
        ssize_t ignored = read(exit_fd_.get(), &v, sizeof v);
        (void)ignored;
        CollectExitsLocked(&deliveries);
      }
      const int64_t now = proto::MonotonicMs();
      for (const auto& [id, p] : procs_) {
        if (p->state != State::kExited) continue;
        if (p->outputs_open() && p->readable() && now >= p->grace_deadline) {
          // Background children still hold the output open: stop reading (they get SIGPIPE).
          p->out.reset();
          p->err.reset();
          p->master.reset();
        }
        if (!p->outputs_open()) FinishLocked(p.get(), &deliveries);
      }
      ExpireLocked();  // a late Wait must not see more than max_exited statuses
    }
    for (Delivery& d : deliveries) {
      Proc* p = d.proc.get();
      if (!p) continue;
      switch (d.kind) {
        case Delivery::kOutput:
          p->on_output(p->id, d.stream, d.data);
          break;
        case Delivery::kExit:
          if (p->on_exit) p->on_exit(p->id, p->exit);
          break;
        case Delivery::kDrained:
          if (p->on_input_drained) p->on_input_drained(p->id);
          break;
      }
    }
  }
}

}  // namespace esb::agent
