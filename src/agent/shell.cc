#include "agent/shell.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <set>
#include <vector>

#include "agent/process_tree.h"
#include "agent/util.h"
#include "common/protocol.h"
#include "common/shell_quote.h"

namespace esb::agent {
namespace {

// After the shell itself has exited, background jobs may keep the output pipes open forever;
// read whatever they still write for this long, then stop.
constexpr int64_t kExitGraceMs = 50;
constexpr size_t kReadChunk = 64 * 1024;

// Runs right after the command and again as the EXIT trap (for the user's own `exit N` or
// `set -e`); the first run dumps cwd, variables, functions and aliases into the agent's FIFO,
// then the shell exits with the command's status. A command that replaces the EXIT trap
// still gets its state saved (unless it also exits early) and its own trap still runs.
// Only builtins, so saving costs no fork and no file is written; the agent filters the dump
// (FilterState), keeps it in memory and replays it at the start of the next exec.
// Single quotes must not appear here: this text is itself single-quoted in the script.
constexpr char kSave[] = R"SH(__esb_rc=$?
\builtin shopt -u expand_aliases
builtin set +eux +o pipefail
if [[ -z ${__esb_saved-} ]]; then
__esb_saved=1
%RESTORE%{
builtin printf "builtin cd -- %q 2>/dev/null\n" "$PWD"
builtin declare -p
builtin printf "%s\n" "#esb:functions"
builtin declare -f
builtin alias -p
builtin printf "%s\n" "#esb:end"
} >"$__esb_out" 2>/dev/null
fi
builtin exit "$__esb_rc")SH";

constexpr char kFunctionsMarker[] = "#esb:functions";
constexpr std::string_view kEndMarker = "#esb:end\n";
// A state dump larger than this is dropped (the previous state is kept).
constexpr size_t kMaxStateBytes = 64 << 20;

// Variables that must not be restored: bash's own (restoring them fails or lies) and the
// agent's script variables. Readonly variables are dropped as well.
bool SkipVariable(std::string_view name) {
  static const char* const kSkip[] = {
      "_",          "BASH",          "BASHOPTS",     "BASHPID",  "COLUMNS",
      "DIRSTACK",   "EPOCHREALTIME", "EPOCHSECONDS", "EUID",     "FUNCNAME",
      "GROUPS",     "HISTCMD",       "HOSTNAME",     "HOSTTYPE", "LINENO",
      "LINES",      "MACHTYPE",      "OPTERR",       "OPTIND",   "OSTYPE",
      "PIPESTATUS", "PPID",          "PWD",          "RANDOM",   "SECONDS",
      "SHELLOPTS",  "SHLVL",         "SRANDOM",      "UID",
  };
  if (name.rfind("__esb_", 0) == 0 || name.rfind("BASH_", 0) == 0 || name.rfind("COMP_", 0) == 0) {
    return true;
  }
  for (const char* skip : kSkip) {
    if (name == skip) return true;
  }
  return false;
}

// The shell's -c program: run the script the agent writes to fd 3. `source` of a pipe reads
// it whole before running it. It goes through /proc (bash fakes `[[ -e /dev/fd/N ]]` even
// where /dev/fd cannot be opened); without /proc fall back to `read` (byte by byte: slower).
constexpr char kBoot[] = R"SH(if [[ -r /proc/self/fd/3 ]]; then builtin source /proc/self/fd/3
else IFS= builtin read -r -d "" __esb_s <&3; builtin eval -- "$__esb_s"; fi)SH";

// Start of every exec script. fd 3 is closed at once so commands do not inherit it.
constexpr char kScriptHead[] = R"SH(builtin exec 3<&-
\builtin shopt -s expand_aliases
)SH";

std::string ReplaceAll(std::string s, std::string_view from, std::string_view to) {
  size_t pos = 0;
  while ((pos = s.find(from, pos)) != std::string::npos) {
    s.replace(pos, from.size(), to);
    pos += to.size();
  }
  return s;
}

int ExitCodeOf(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

// Turns the shell's raw dump into the saved state: keeps the cd line, the `declare -p` lines of
// user variables (bash 5.2 prints one variable per line, escaping newlines; a line that does
// not start a declaration belongs to the previous one) and everything after the marker.
std::string FilterState(std::string_view raw) {
  std::string out;
  out.reserve(raw.size());
  bool in_vars = true;
  bool keep = true;
  bool first = true;
  while (!raw.empty()) {
    size_t nl = raw.find('\n');
    std::string_view line = raw.substr(0, nl == std::string_view::npos ? raw.size() : nl + 1);
    raw.remove_prefix(line.size());
    if (first) {  // builtin cd -- ...
      first = false;
      out += line;
      continue;
    }
    if (!in_vars) {
      out += line;
      continue;
    }
    if (line.rfind(kFunctionsMarker, 0) == 0) {
      in_vars = false;
      continue;
    }
    if (line.rfind("declare -", 0) == 0) {
      // declare -ATTRS NAME[=VALUE]
      std::string_view rest = line.substr(9);
      size_t space = rest.find(' ');
      std::string_view attrs = rest.substr(0, space);
      std::string_view name =
          space == std::string_view::npos ? std::string_view() : rest.substr(space + 1);
      name = name.substr(0, name.find_first_of("=\n"));
      keep = !name.empty() && attrs.find('r') == std::string_view::npos && !SkipVariable(name);
    }
    if (keep) out += line;
  }
  return out;
}

// Reads what is available from the (non-blocking) dump FIFO. Returns true at EOF. Bytes past
// kMaxStateBytes are drained and dropped (the writer must never block).
bool DrainDump(int fd, std::string* buf, std::string* dump) {
  for (;;) {
    ssize_t got = read(fd, buf->data(), buf->size());
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) return errno != EAGAIN;
    if (got == 0) return true;
    if (dump->size() <= kMaxStateBytes) dump->append(buf->data(), static_cast<size_t>(got));
  }
}

}  // namespace

bool ValidEnvName(std::string_view name) {
  if (name.empty() || name.size() > 256) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    char c = name[i];
    bool alpha = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || c == '_';
    bool digit = c >= '0' && c <= '9';
    if (!alpha && !(digit && i > 0)) return false;
  }
  // Readonly in bash (exporting them fails) or reserved for the agent's script.
  static const char* const kReserved[] = {"BASHOPTS", "BASH_VERSINFO", "EUID",
                                          "PPID",     "SHELLOPTS",     "UID"};
  for (const char* r : kReserved) {
    if (name == r) return false;
  }
  return name.rfind("__esb_", 0) != 0;
}

ShellSession::ShellSession(ShellOptions options, Reaper* reaper)
    : options_(std::move(options)),
      reaper_(reaper),
      dump_fifo_(options_.state_dir + "/state.fifo"),
      state_path_(options_.state_dir + "/shell.state") {
  LoadState();  // an agent restarted inside the same sandbox resumes the session
}

void ShellSession::Configure(std::map<std::string, std::string> env) {
  std::lock_guard<std::mutex> lock(mu_);
  pending_env_ = env;
  base_env_ = std::move(env);
  ++generation_;  // a standby shell started with the old environment is stale
}

std::vector<std::string> ShellSession::BuildEnv() const {
  std::map<std::string, std::string> env =
      UserBaseEnv(options_.workspace, options_.user, options_.shell);
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [k, v] : base_env_) env[k] = v;
  }
  std::vector<std::string> out;
  out.reserve(env.size());
  for (const auto& [k, v] : env) out.push_back(k + "=" + v);
  return out;
}

std::string ShellSession::BuildScript(const ExecParams& params,
                                      const std::map<std::string, std::string>& pending) const {
  // Per-exec variables apply to this call only: remember each one's previous declaration,
  // export the new value, and at exit put the old declaration back unless the command itself
  // changed the variable.
  std::string capture, restore;
  int i = 0;
  for (const auto& [name, value] : params.env) {
    std::string idx = std::to_string(i++);
    capture += "__esb_p" + idx + "=${" + name + "@A} __esb_e" + idx + "=" + ShellQuote(value) +
               "\nbuiltin export " + name + "=\"$__esb_e" + idx + "\"\n";
    restore += "[[ ${" + name + "-} == \"$__esb_e" + idx + "\" ]] && { builtin unset -v " + name +
               "; [[ -n $__esb_p" + idx + " ]] && builtin eval -- \"${__esb_p" + idx +
               "/#declare /declare -g }\"; }\n";
  }
  std::string script = kScriptHead;
  // Readonly: a command that clobbers it must not make the trap write somewhere else.
  script += "builtin declare -r __esb_out=" + ShellQuote(dump_fifo_) + "\n";
  script += "__esb_c=" + ShellQuote(params.command) + "\n";
  const std::string save = ReplaceAll(kSave, "%RESTORE%", restore);
  script += "builtin trap " + ShellQuote(save) + " EXIT\n";
  // The saved state runs through eval so that a broken line cannot abort the whole script.
  if (!state_.empty()) {
    script += "__esb_state=" + ShellQuote(state_) + "\n";
    script += "builtin eval -- \"$__esb_state\" >/dev/null 2>&1; builtin unset -v __esb_state\n";
  }
  for (const auto& [name, value] : pending) {
    script += "builtin export " + name + "=" + ShellQuote(value) + "\n";
  }
  script += capture;
  script += "builtin eval -- \"$__esb_c\"\n";
  script += save + "\n";
  return script;
}

bool ShellSession::StartShell(Shell* shell, std::string* error, int* err) {
  auto fail = [&](const char* what) {
    *err = errno;
    *error = what;
    return false;
  };
  int p[2];
  if (pipe2(p, O_CLOEXEC) != 0) return fail("pipe");
  Fd in_r(p[0]);
  shell->in_w.reset(p[1]);
  if (pipe2(p, O_CLOEXEC) != 0) return fail("pipe");
  Fd script_r(p[0]);
  shell->script_w.reset(p[1]);
  if (pipe2(p, O_CLOEXEC) != 0) return fail("pipe");
  shell->out_r.reset(p[0]);
  Fd out_w(p[1]);
  if (pipe2(p, O_CLOEXEC) != 0) return fail("pipe");
  shell->err_r.reset(p[0]);
  Fd err_w(p[1]);
  shell->exit_fd.reset(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!shell->exit_fd) return fail("eventfd");
  {
    std::lock_guard<std::mutex> lock(mu_);
    shell->generation = generation_;
  }

  // The agent binary re-executed as a shim (main.cc: --exec-shim) makes the shell a child
  // subreaper before it becomes bash: orphans of the exec come back to its shell, so a
  // timeout finds and kills them (KillTree). posix_spawn offers no prctl of its own.
  std::vector<std::string> args =
      ShimArgv(options_.shell, {options_.shell, "--noprofile", "--norc", "-c", kBoot, "esb-exec"});
  std::vector<std::string> env = BuildEnv();
  std::vector<char*> argv, envp;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  struct stat st;
  std::string cwd =
      stat(options_.workspace.c_str(), &st) == 0 && S_ISDIR(st.st_mode) ? options_.workspace : "/";

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  // SECURITY: fd hand-over — the shell gets only its own pipes: stdin on 0, output on 1/2 and
  // its script on 3 (every agent descriptor is O_CLOEXEC, so sockets and other sessions'
  // pipes do not leak into user code).
  posix_spawn_file_actions_adddup2(&actions, in_r.get(), 0);
  posix_spawn_file_actions_adddup2(&actions, out_w.get(), 1);
  posix_spawn_file_actions_adddup2(&actions, err_w.get(), 2);
  posix_spawn_file_actions_adddup2(&actions, script_r.get(), 3);
  posix_spawn_file_actions_addchdir_np(&actions, cwd.c_str());
  // A new session = a new process group that a timeout can kill as a whole.
  int spawn_err = 0;
  pid_t pid = SpawnSessionLeader(reaper_, shell->exit_fd.get(), kSelfExe, &actions, argv.data(),
                                 envp.data(), &spawn_err);
  posix_spawn_file_actions_destroy(&actions);
  if (pid < 0) {
    errno = spawn_err;
    return fail("spawn shell");
  }
  shell->pid = pid;
  {
    std::lock_guard<std::mutex> lock(mu_);
    pgids_.insert(pid);
  }
  fcntl(shell->script_w.get(), F_SETFL, O_NONBLOCK);
  fcntl(shell->in_w.get(), F_SETFL, O_NONBLOCK);
  fcntl(shell->out_r.get(), F_SETFL, O_NONBLOCK);
  fcntl(shell->err_r.get(), F_SETFL, O_NONBLOCK);
  return true;
}

void ShellSession::DiscardShell(Shell* shell) {
  if (shell->pid > 0) {
    // Only while unreaped: a reaped shell's pid may already be another process's.
    reaper_->WhileUnreaped(shell->pid, [&] { KillGroup(shell->pid); });
    reaper_->Forget(shell->pid);  // before exit_fd closes: the reaper must not write to it
    std::lock_guard<std::mutex> lock(mu_);
    if (standby_pid_ == shell->pid) standby_pid_ = -1;
  }
  shell->pid = -1;
}

void ShellSession::PrepareStandby() {
  std::string to_persist;
  uint64_t seq = 0;
  {
    std::unique_lock<std::mutex> serial(exec_mu_, std::try_to_lock);
    if (!serial.owns_lock()) return;  // an exec is running; it prepares the next shell itself
    EnsureStandbyLocked();
    if (state_dirty_) {
      to_persist = state_;
      seq = ++persist_seq_;
      state_dirty_ = false;
    }
  }
  if (seq > 0) PersistState(to_persist, seq);
}

void ShellSession::EnsureStandbyLocked() {
  uint64_t generation;
  {
    std::lock_guard<std::mutex> lock(mu_);
    generation = generation_;
  }
  if (standby_) {
    int status;
    if (standby_->generation == generation && !reaper_->TryCollect(standby_->pid, &status)) {
      return;  // still good
    }
    DiscardShell(&*standby_);
    standby_.reset();
  }
  Shell shell;
  std::string error;
  int err = 0;
  if (!StartShell(&shell, &error, &err)) {
    Log(LogLevel::kWarn, "standby shell: " + error + ": " + strerror(err));
    DiscardShell(&shell);
    return;
  }
  standby_ = std::move(shell);
  std::lock_guard<std::mutex> lock(mu_);
  standby_pid_ = standby_->pid;
}

void ShellSession::PersistState(const std::string& state, uint64_t seq) {
  std::lock_guard<std::mutex> lock(persist_mu_);
  if (seq <= persisted_seq_) return;  // a newer state was written already
  std::string tmp = state_path_ + ".tmp";
  Fd out(open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600));
  if (!out || !WriteAll(out.get(), state) || rename(tmp.c_str(), state_path_.c_str()) != 0) {
    Log(LogLevel::kWarn, "cannot save shell state to " + state_path_ + ": " + strerror(errno));
    return;
  }
  persisted_seq_ = seq;
}

std::string ShellSession::State() {
  std::lock_guard<std::mutex> serial(exec_mu_);
  return state_;
}

void ShellSession::SetState(std::string state) {
  uint64_t seq;
  {
    std::lock_guard<std::mutex> serial(exec_mu_);
    state_ = std::move(state);
    state_dirty_ = false;
    seq = ++persist_seq_;
  }
  PersistState(State(), seq);
}

void ShellSession::LoadState() {
  Fd in(open(state_path_.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK));
  struct stat st;
  if (!in || fstat(in.get(), &st) != 0 || !S_ISREG(st.st_mode) ||
      static_cast<size_t>(st.st_size) > kMaxStateBytes) {
    return;
  }
  std::string text(static_cast<size_t>(st.st_size), '\0');
  size_t got = 0;
  while (got < text.size()) {
    ssize_t n = read(in.get(), text.data() + got, text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += static_cast<size_t>(n);
  }
  text.resize(got);
  std::lock_guard<std::mutex> serial(exec_mu_);
  state_ = std::move(text);
}

pid_t ShellSession::standby_pid() const {
  std::lock_guard<std::mutex> lock(mu_);
  return standby_pid_;
}

void ShellSession::KillAll() {
  std::lock_guard<std::mutex> lock(mu_);
  for (pid_t pgid : pgids_) KillGroup(pgid);
}

int ShellSession::OpenDumpFifo() {
  struct stat st;
  if (lstat(dump_fifo_.c_str(), &st) == 0 && !S_ISFIFO(st.st_mode)) unlink(dump_fifo_.c_str());
  if (mkfifo(dump_fifo_.c_str(), 0600) != 0 && errno != EEXIST) return -1;
  // O_NONBLOCK: opening the read end must not wait for the writer (the shell's EXIT trap).
  return open(dump_fifo_.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
}

ExecOutcome ShellSession::Exec(const ExecParams& params, const ExecIo& io) {
  ExecOutcome result;
  auto fail = [&](std::string message, int err) {
    result.ok = false;
    result.error = std::move(message);
    if (err) result.error += std::string(": ") + strerror(err);
    result.errno_name = ErrnoName(err ? err : EINVAL);
    return result;
  };
  if (params.command.find('\0') != std::string::npos) return fail("command contains NUL", 0);
  for (const auto& [k, v] : params.env) {
    if (!ValidEnvName(k) || v.find('\0') != std::string::npos) {
      return fail("invalid environment variable name or value: " + k, 0);
    }
  }

  // The timeout counts from the request's arrival, so a call queued behind another exec still
  // ends within its timeout (the host's deadline is timeout + a grace).
  const int64_t start = proto::MonotonicMs();
  std::lock_guard<std::mutex> serial(exec_mu_);
  if (io.cancelled && io.cancelled()) {
    result.cancelled = true;  // the client gave up while queued
    return result;
  }
  if (proto::MonotonicMs() - start >= params.timeout_ms) {
    result.ok = true;
    result.timed_out = true;
    result.exit_code = 124;
    result.duration_ms = proto::MonotonicMs() - start;
    return result;
  }

  if (mkdir(options_.state_dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return fail("mkdir " + options_.state_dir, errno);
  }
  std::map<std::string, std::string> pending;
  uint64_t generation;
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending = pending_env_;
    generation = generation_;
    standby_pid_ = -1;
    // Forget process groups whose members are all gone.
    for (auto it = pgids_.begin(); it != pgids_.end();) {
      if (kill(-*it, 0) != 0 && errno == ESRCH) {
        it = pgids_.erase(it);
      } else {
        ++it;
      }
    }
  }

  // Use the standby shell if it is still alive and has the current base environment.
  Shell shell;
  if (standby_) {
    int status;
    if (standby_->generation == generation && !reaper_->TryCollect(standby_->pid, &status)) {
      shell = std::move(*standby_);
    } else {
      Log(LogLevel::kDebug, "standby shell stale or dead; starting a new one");
      DiscardShell(&*standby_);
    }
    standby_.reset();
  }
  if (shell.pid < 0) {
    Log(LogLevel::kDebug, "no standby shell; starting one");
    std::string error;
    int err = 0;
    if (!StartShell(&shell, &error, &err)) {
      DiscardShell(&shell);
      return fail(error, err);
    }
  }
  const pid_t pid = shell.pid;
  // Stdin: bytes from the call on their way into the shell's stdin pipe.
  std::string stdin_buf;
  bool stdin_eof = !params.has_stdin;
  if (stdin_eof) shell.in_w.reset();

  // The shell's EXIT trap writes its state dump here; while the read end is open, the
  // trap's open never blocks.
  Fd dump_r(OpenDumpFifo());
  if (!dump_r) {
    int err = errno;
    DiscardShell(&shell);
    return fail("state fifo " + dump_fifo_, err);
  }
  std::string dump;
  bool dump_eof = false;
  const std::string script = BuildScript(params, pending);
  size_t script_sent = 0;

  const int64_t timeout = std::clamp<int64_t>(params.timeout_ms, 1, int64_t{24} * 3600 * 1000);
  const int64_t deadline = start + timeout;
  const int64_t cap = std::max<int64_t>(params.max_output_bytes, 0);
  int64_t sent[2] = {0, 0};
  bool shell_exited = false;
  int status = 0;
  int64_t grace_deadline = 0;
  std::string buf(kReadChunk, '\0');
  Fd* pipes[2] = {&shell.out_r, &shell.err_r};

  // Kills the exec's processes while its shell runs. Once the shell is reaped (shell_exited;
  // and WhileUnreaped covers the reaper thread getting there first) its pid may belong to
  // another process, so nothing is signalled: the command completed, and what it left behind
  // are its background jobs (reparented to the agent), which by design keep running
  // (servers) until the environment ends.
  auto kill_tree = [&]() {
    if (!shell_exited) reaper_->WhileUnreaped(pid, [&] { KillTree(pid); });
  };
  auto cancel = [&]() {
    kill_tree();
    result.cancelled = true;
  };

  while (!result.cancelled) {
    int64_t now = proto::MonotonicMs();
    // After the shell exited, the command finished in time; only its output is drained.
    if (!shell_exited && !result.timed_out && now >= deadline) {
      kill_tree();
      result.timed_out = true;
    }
    if (shell_exited && (now >= grace_deadline || (!shell.out_r && !shell.err_r && dump_eof))) {
      break;
    }
    int64_t wake = shell_exited ? grace_deadline : (result.timed_out ? now + 1000 : deadline);
    if (shell_exited || result.timed_out) shell.in_w.reset();  // nobody reads stdin any more
    // Stdin that arrived (bounded by the call's flow-control window) joins the buffer; taking
    // it grants the host more credit.
    if (shell.in_w && !stdin_eof && io.take_input && stdin_buf.size() < kReadChunk) {
      stdin_eof = io.take_input(&stdin_buf);
    }
    if (shell.in_w && stdin_eof && stdin_buf.empty()) shell.in_w.reset();
    pollfd fds[7];
    int n = 0;
    int idx_out = -1, idx_err = -1, idx_exit = -1, idx_wake = -1, idx_script = -1;
    int idx_dump = -1, idx_in = -1;
    if (!dump_eof) {
      idx_dump = n;
      fds[n++] = {dump_r.get(), POLLIN, 0};
    }
    if (shell.out_r) {
      idx_out = n;
      fds[n++] = {shell.out_r.get(), POLLIN, 0};
    }
    if (shell.err_r) {
      idx_err = n;
      fds[n++] = {shell.err_r.get(), POLLIN, 0};
    }
    if (!shell_exited) {
      idx_exit = n;
      fds[n++] = {shell.exit_fd.get(), POLLIN, 0};
    }
    if (io.wake_fd >= 0) {
      idx_wake = n;
      fds[n++] = {io.wake_fd, POLLIN, 0};
    }
    if (shell.in_w && !stdin_buf.empty()) {
      idx_in = n;
      fds[n++] = {shell.in_w.get(), POLLOUT, 0};
    }
    if (shell.script_w) {
      idx_script = n;
      fds[n++] = {shell.script_w.get(), POLLOUT, 0};
    }
    int r = poll(fds, n, static_cast<int>(std::max<int64_t>(wake - now, 0)));
    if (r < 0) {
      if (errno == EINTR) continue;
      cancel();  // cannot happen with valid fds; never leave a group running unwatched
      break;
    }
    if (idx_wake >= 0 && fds[idx_wake].revents) {
      uint64_t v;
      ssize_t ignored = read(io.wake_fd, &v, sizeof v);
      (void)ignored;
    }
    if (io.cancelled && io.cancelled()) {
      cancel();
      break;
    }
    if (idx_in >= 0 && fds[idx_in].revents) {
      ssize_t w = write(shell.in_w.get(), stdin_buf.data(), stdin_buf.size());
      if (w > 0) stdin_buf.erase(0, static_cast<size_t>(w));
      // EPIPE: the command does not read its stdin; the rest is dropped.
      if (w < 0 && errno != EAGAIN && errno != EINTR) {
        shell.in_w.reset();
        stdin_buf.clear();
      }
    }
    if (shell.in_w && stdin_eof && stdin_buf.empty()) shell.in_w.reset();
    if (idx_dump >= 0 && fds[idx_dump].revents) dump_eof = DrainDump(dump_r.get(), &buf, &dump);
    if (idx_script >= 0 && fds[idx_script].revents) {
      // Feed the script; the shell runs it once it sees EOF (we close the pipe).
      ssize_t w =
          write(shell.script_w.get(), script.data() + script_sent, script.size() - script_sent);
      if (w > 0) script_sent += static_cast<size_t>(w);
      if ((w < 0 && errno != EAGAIN && errno != EINTR) || script_sent == script.size()) {
        shell.script_w.reset();
      }
    }
    for (int s = 0; s < 2; ++s) {
      int idx = s == 0 ? idx_out : idx_err;
      if (idx < 0 || !(fds[idx].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      ssize_t got = read(pipes[s]->get(), buf.data(), buf.size());
      if (got < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      if (got <= 0) {
        pipes[s]->reset();
        continue;
      }
      int64_t room = cap - sent[s];
      int64_t take = std::min<int64_t>(room, got);
      if (take < got) result.truncated = true;
      if (take > 0) {
        sent[s] += take;
        if (!io.output(s == 1, std::string_view(buf.data(), take))) {
          cancel();
          break;
        }
      }
    }
    if (idx_exit >= 0 && (fds[idx_exit].revents & POLLIN)) {
      uint64_t v;
      ssize_t ignored = read(shell.exit_fd.get(), &v, sizeof v);
      (void)ignored;
      if (reaper_->TryCollect(pid, &status)) {
        shell_exited = true;
        grace_deadline = proto::MonotonicMs() + kExitGraceMs;
      }
    }
  }

  if (!shell_exited) {
    // Cancelled: the group was SIGKILLed; collect the shell so the eventfd can be closed.
    if (!reaper_->Wait(pid, &status, 5000)) reaper_->Forget(pid);
  }
  if (!dump_eof) DrainDump(dump_r.get(), &buf, &dump);
  result.duration_ms = proto::MonotonicMs() - start;
  result.ok = true;
  result.exit_code = result.timed_out ? 124 : ExitCodeOf(status);

  // Keep the new state only from a complete dump of a shell that exited by itself.
  bool saved = false;
  if (!result.timed_out && !result.cancelled && WIFEXITED(status) &&
      dump.size() <= kMaxStateBytes && dump.size() >= kEndMarker.size() &&
      std::string_view(dump).substr(dump.size() - kEndMarker.size()) == kEndMarker) {
    dump.resize(dump.size() - kEndMarker.size());
    state_ = FilterState(dump);
    state_dirty_ = true;  // written to the state file after the response (PrepareStandby)
    saved = true;
  }
  if (saved) {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [k, v] : pending) {
      auto it = pending_env_.find(k);
      if (it != pending_env_.end() && it->second == v) pending_env_.erase(it);
    }
  }
  return result;
}

}  // namespace esb::agent
