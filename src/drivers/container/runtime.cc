#include "drivers/container/runtime.h"

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <boost/json.hpp>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "common/util.h"

namespace esb::container {
namespace {

constexpr size_t kMaxCapture = 64 * 1024;

int PidfdOpen(pid_t pid) { return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)); }

// Last non-empty lines of the runtime's output, for error messages.
std::string Tail(absl::string_view text, size_t max = 600) {
  text = absl::StripAsciiWhitespace(text);
  if (text.size() > max) text = text.substr(text.size() - max);
  return std::string(text);
}

}  // namespace

const char* RuntimeName(RuntimeKind kind) {
  switch (kind) {
    case RuntimeKind::kCrun:
      return "crun";
    case RuntimeKind::kRunc:
      return "runc";
    case RuntimeKind::kRunsc:
      return "runsc";
  }
  return "?";
}

bool ParseRuntimeKind(const std::string& name, RuntimeKind* kind) {
  if (name == "crun")
    *kind = RuntimeKind::kCrun;
  else if (name == "runc")
    *kind = RuntimeKind::kRunc;
  else if (name == "runsc" || name == "gvisor")
    *kind = RuntimeKind::kRunsc;
  else
    return false;
  return true;
}

std::string FindExecutable(const std::string& name) {
  std::string path = getenv("PATH") ? getenv("PATH") : "";
  absl::StrAppend(&path, ":/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin");
  for (absl::string_view dir : absl::StrSplit(path, ':', absl::SkipEmpty())) {
    if (dir.empty() || dir[0] != '/') continue;
    std::string candidate = absl::StrCat(dir, "/", name);
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

absl::StatusOr<ProcessResult> RunProcess(const std::vector<std::string>& argv,
                                         const SpawnOptions& options) {
  if (argv.empty() || argv[0].empty() || argv[0][0] != '/') {
    return absl::InvalidArgumentError("RunProcess needs an absolute program path");
  }
  // Everything the child needs is prepared before fork(): after it only async-signal-safe
  // system calls run (esbd is multi-threaded).
  std::vector<char*> cargv;
  for (const std::string& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  const char* hide = options.hide_mount.empty() ? nullptr : options.hide_mount.c_str();

  UniqueFd devnull(::open("/dev/null", O_RDWR | O_CLOEXEC));
  if (!devnull) return ErrnoStatus("open /dev/null");
  int pipefd[2] = {-1, -1};
  const bool capture = options.output_fd < 0;
  if (capture && ::pipe2(pipefd, O_CLOEXEC) != 0) return ErrnoStatus("pipe2");
  UniqueFd read_end(pipefd[0]);
  UniqueFd write_end(pipefd[1]);
  // The child's dup2s onto 0-2 (then 3) must not overwrite a source that sits there (esbd
  // started with closed stdio gets its sockets and logs as fds 0-2), and dup2(fd, fd) would
  // keep O_CLOEXEC: every source is first copied above 3 (close-on-exec, in the parent).
  UniqueFd raised[3];
  auto above_stdio = [&](int fd, UniqueFd* holder) -> int {
    if (fd < 0 || fd > 3) return fd;
    holder->reset(::fcntl(fd, F_DUPFD_CLOEXEC, 4));
    return holder->get();
  };
  const int null_fd = above_stdio(devnull.get(), &raised[0]);
  const int out_fd = above_stdio(capture ? write_end.get() : options.output_fd, &raised[1]);
  const int pass_fd = above_stdio(options.pass_fd, &raised[2]);
  if (null_fd < 0 || (out_fd < 0) || (options.pass_fd >= 0 && pass_fd < 0)) {
    return ErrnoStatus("fcntl F_DUPFD_CLOEXEC");
  }

  pid_t pid = ::fork();
  if (pid < 0) return ErrnoStatus("fork");
  if (pid == 0) {
    // Own process group, so a timeout can kill the runtime and anything it spawned.
    ::setpgid(0, 0);
    if (hide != nullptr) {
      // SECURITY: a private mount namespace for this runtime invocation only; the host's
      // mount table is not changed. Hiding the cgroup2 mount makes crun see a pure v1 host.
      if (::unshare(CLONE_NEWNS) != 0) _exit(126);
      if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) _exit(126);
      if (::umount2(hide, MNT_DETACH) != 0 && errno != EINVAL && errno != ENOENT) _exit(126);
    }
    // SECURITY: the runtime (and thus a detached container) gets /dev/null and the log fd
    // only, never esbd's stdout/stderr, sockets or database handles.
    // All sources are > 3 (see above_stdio), so no dup2 overwrites one still to be copied.
    if (::dup2(null_fd, 0) < 0 || ::dup2(out_fd, 1) < 0 || ::dup2(out_fd, 2) < 0) {
      _exit(126);
    }
    if (pass_fd >= 0) {
      // SECURITY: exactly one extra descriptor (the agent's listening socket) crosses into
      // the runtime and from there into the container, as fd 3.
      if (::dup2(pass_fd, 3) < 0) _exit(126);
      ::syscall(SYS_close_range, 4, ~0U, 0);
    } else {
      ::syscall(SYS_close_range, 3, ~0U, 0);
    }
    ::execv(cargv[0], cargv.data());
    _exit(127);
  }
  write_end.reset();
  if (capture) ::fcntl(read_end.get(), F_SETFL, O_NONBLOCK);

  ProcessResult result;
  UniqueFd pidfd(PidfdOpen(pid));
  const int64_t deadline = MonotonicMs() + options.timeout_ms;
  bool exited = false;
  int wstatus = 0;
  bool pipe_open = capture;
  while (!exited || pipe_open) {
    int64_t left = deadline - MonotonicMs();
    if (left <= 0) break;
    struct pollfd fds[2];
    int n = 0;
    if (pidfd && !exited) fds[n++] = {pidfd.get(), POLLIN, 0};
    if (pipe_open) fds[n++] = {read_end.get(), POLLIN, 0};
    // Without a pidfd (old kernel) fall back to polling waitpid every 5 ms.
    int wait_ms = (!pidfd && !exited) ? 5 : static_cast<int>(std::min<int64_t>(left, 1000));
    // After the child exited, a grandchild may still hold the pipe: drain briefly only.
    if (exited) wait_ms = std::min(wait_ms, 200);
    int r = n > 0 ? ::poll(fds, n, wait_ms) : (::usleep(wait_ms * 1000), 0);
    if (r < 0 && errno != EINTR) return ErrnoStatus("poll");
    if (pipe_open) {
      char buf[8192];
      while (true) {
        ssize_t got = ::read(read_end.get(), buf, sizeof(buf));
        if (got > 0) {
          if (result.output.size() < kMaxCapture) result.output.append(buf, got);
          continue;
        }
        if (got == 0) pipe_open = false;  // EOF; otherwise EAGAIN: nothing more for now
        break;
      }
      if (r == 0 && exited) pipe_open = false;  // drained long enough
    }
    if (!exited) {
      pid_t w = ::waitpid(pid, &wstatus, WNOHANG);
      if (w == pid)
        exited = true;
      else if (w < 0 && errno != EINTR)
        return ErrnoStatus("waitpid");
    }
  }
  if (!exited) {
    result.timed_out = true;
    // SECURITY: kills only the runtime's own process group (it was made leader above).
    ::kill(-pid, SIGKILL);
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &wstatus, 0);
  }
  if (WIFEXITED(wstatus)) result.exit_code = WEXITSTATUS(wstatus);
  if (WIFSIGNALED(wstatus)) result.term_signal = WTERMSIG(wstatus);
  return result;
}

OciRuntime::OciRuntime(RuntimeKind kind, std::string binary, std::string root,
                       std::string hide_mount)
    : kind_(kind),
      binary_(std::move(binary)),
      root_(std::move(root)),
      hide_mount_(std::move(hide_mount)) {}

std::vector<std::string> OciRuntime::BaseArgs() const {
  std::vector<std::string> args = {binary_, "--root", root_};
  if (kind_ == RuntimeKind::kRunsc) {
    // gVisor: no host network at all (loopback inside the sentry only), let the agent create
    // its unix socket on the bind-mounted host directory, and enforce our seccomp profile
    // inside the sandbox as well.
    args.insert(args.end(), {"--network=none", "--host-uds=create", "--oci-seccomp"});
  }
  return args;
}

absl::StatusOr<ProcessResult> OciRuntime::Invoke(std::vector<std::string> args, int timeout_ms,
                                                 int output_fd, int pass_fd) const {
  std::vector<std::string> argv = BaseArgs();
  argv.insert(argv.end(), args.begin(), args.end());
  SpawnOptions options;
  options.timeout_ms = timeout_ms;
  options.output_fd = output_fd;
  options.pass_fd = pass_fd;
  options.hide_mount = hide_mount_;
  return RunProcess(argv, options);
}

std::string OciRuntime::Version() const {
  SpawnOptions options;
  options.timeout_ms = 5000;
  auto r = RunProcess({binary_, "--version"}, options);
  if (!r.ok() || r->exit_code != 0) return std::string(RuntimeName(kind_)) + " (version unknown)";
  std::string first(
      absl::StripAsciiWhitespace(absl::string_view(r->output).substr(0, r->output.find('\n'))));
  return first;
}

absl::StatusOr<int> OciRuntime::RunDetached(const std::string& id, const std::string& bundle,
                                            const std::string& log_path,
                                            const std::string& runtime_log_path, int timeout_ms,
                                            int listen_fd) const {
  if (listen_fd >= 0 && kind_ == RuntimeKind::kRunsc) {
    return absl::InvalidArgumentError("runsc cannot pass descriptors to a container");
  }
  std::vector<std::string> args;
  if (kind_ != RuntimeKind::kRunsc && !runtime_log_path.empty()) {
    args = {"--log", runtime_log_path};
  }
  args.insert(args.end(), {"run", "--detach"});
  if (listen_fd >= 0) args.insert(args.end(), {"--preserve-fds", "1"});
  return StartDetached(std::move(args), "run", id, bundle, log_path, runtime_log_path, timeout_ms,
                       listen_fd);
}

absl::StatusOr<int> OciRuntime::RestoreDetached(const std::string& id, const std::string& bundle,
                                                const std::string& image_dir,
                                                const std::string& log_path, int timeout_ms) const {
  if (kind_ != RuntimeKind::kRunsc) {
    return absl::UnimplementedError(absl::StrCat(RuntimeName(kind_), " restore is not used"));
  }
  return StartDetached({"restore", "--detach", "--image-path", image_dir}, "restore", id, bundle,
                       log_path, "", timeout_ms, -1);
}

absl::StatusOr<int> OciRuntime::StartDetached(std::vector<std::string> args,
                                              const std::string& what, const std::string& id,
                                              const std::string& bundle,
                                              const std::string& log_path,
                                              const std::string& runtime_log_path, int timeout_ms,
                                              int listen_fd) const {
  UniqueFd log(::open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600));
  if (!log) return ErrnoStatus("open " + log_path);
  const std::string pid_file = bundle + "/container.pid";
  ::unlink(pid_file.c_str());
  args.insert(args.end(), {"--pid-file", pid_file, "--bundle", bundle, id});
  absl::StatusOr<ProcessResult> r = Invoke(args, timeout_ms, log.get(), listen_fd);
  if (!r.ok()) return r.status();
  if (r->timed_out) {
    return absl::DeadlineExceededError(absl::StrCat(RuntimeName(kind_), " ", what, " of ", id,
                                                    " did not finish in ", timeout_ms, " ms"));
  }
  if (r->exit_code != 0) {
    std::string diag;
    if (!runtime_log_path.empty()) ReadFileToString(runtime_log_path, &diag).IgnoreError();
    std::string out;
    ReadFileToString(log_path, &out).IgnoreError();
    return absl::InternalError(absl::StrCat(RuntimeName(kind_), " ", what, " of ", id,
                                            " failed (exit ", r->exit_code,
                                            "): ", Tail(diag + "\n" + out)));
  }
  std::string pid_text;
  int pid = 0;
  if (!ReadFileToString(pid_file, &pid_text).ok() ||
      !absl::SimpleAtoi(absl::StripAsciiWhitespace(pid_text), &pid) || pid <= 0) {
    return absl::InternalError(
        absl::StrCat(RuntimeName(kind_), " ", what, " of ", id, " left no usable pid file"));
  }
  return pid;
}

absl::Status OciRuntime::Checkpoint(const std::string& id, const std::string& image_dir,
                                    int timeout_ms) const {
  if (kind_ != RuntimeKind::kRunsc) {
    return absl::UnimplementedError(absl::StrCat(RuntimeName(kind_), " checkpoint is not used"));
  }
  absl::StatusOr<ProcessResult> r =
      Invoke({"checkpoint", "--image-path", image_dir, id}, timeout_ms);
  if (!r.ok()) return r.status();
  if (r->timed_out) {
    return absl::DeadlineExceededError(
        absl::StrCat("runsc checkpoint of ", id, " did not finish in ", timeout_ms, " ms"));
  }
  if (r->exit_code != 0) {
    // gVisor prints the whole object it could not encode on its first line, the reason last.
    std::string first(absl::StripAsciiWhitespace(r->output));
    first = first.substr(0, first.find('\n'));
    if (first.size() > 400)
      first = first.substr(0, 150) + " ... " + first.substr(first.size() - 200);
    return absl::InternalError(
        absl::StrCat("runsc checkpoint of ", id, " failed (exit ", r->exit_code, "): ", first));
  }
  return absl::OkStatus();
}

absl::StatusOr<ProcessResult> OciRuntime::RunForeground(const std::string& id,
                                                        const std::string& bundle,
                                                        const std::string& log_path,
                                                        int timeout_ms) const {
  UniqueFd log(::open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600));
  if (!log) return ErrnoStatus("open " + log_path);
  return Invoke({"run", "--bundle", bundle, id}, timeout_ms, log.get());
}

absl::StatusOr<ContainerState> OciRuntime::State(const std::string& id, int timeout_ms) const {
  absl::StatusOr<ProcessResult> r = Invoke({"state", id}, timeout_ms);
  if (!r.ok()) return r.status();
  if (r->timed_out) return absl::DeadlineExceededError(absl::StrCat("state ", id, " timed out"));
  if (r->exit_code != 0) {
    if (absl::StrContains(r->output, "not exist") || absl::StrContains(r->output, "not found") ||
        absl::StrContains(r->output, "No such file")) {
      return absl::NotFoundError(absl::StrCat("container ", id, " does not exist"));
    }
    return absl::InternalError(
        absl::StrCat(RuntimeName(kind_), " state ", id, ": ", Tail(r->output)));
  }
  // runsc may print warnings before the JSON document.
  size_t brace = r->output.find('{');
  if (brace == std::string::npos) {
    return absl::InternalError(absl::StrCat("state ", id, ": no JSON in: ", Tail(r->output)));
  }
  boost::system::error_code ec;
  boost::json::value v = boost::json::parse(r->output.substr(brace), ec);
  if (ec || !v.is_object()) {
    return absl::InternalError(absl::StrCat("state ", id, ": bad JSON: ", Tail(r->output)));
  }
  ContainerState state;
  const boost::json::object& o = v.as_object();
  if (auto* s = o.if_contains("status"); s && s->is_string()) state.status = s->as_string();
  if (auto* p = o.if_contains("pid"); p && p->is_int64())
    state.pid = static_cast<int>(p->as_int64());
  if (auto* b = o.if_contains("bundle"); b && b->is_string()) state.bundle = b->as_string();
  return state;
}

absl::Status OciRuntime::Kill(const std::string& id, const std::string& signal) const {
  absl::StatusOr<ProcessResult> r = Invoke({"kill", id, signal}, 5000);
  if (!r.ok()) return r.status();
  if (r->exit_code != 0) {
    return absl::InternalError(absl::StrCat("kill ", id, ": ", Tail(r->output)));
  }
  return absl::OkStatus();
}

absl::Status OciRuntime::Delete(const std::string& id, int timeout_ms) const {
  absl::StatusOr<ProcessResult> r = Invoke({"delete", "--force", id}, timeout_ms);
  if (!r.ok()) return r.status();
  if (r->timed_out) return absl::DeadlineExceededError(absl::StrCat("delete ", id, " timed out"));
  if (r->exit_code == 0) return absl::OkStatus();
  absl::StatusOr<ContainerState> st = State(id);
  if (absl::IsNotFound(st.status())) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat(RuntimeName(kind_), " delete ", id, ": ", Tail(r->output)));
}

}  // namespace esb::container
