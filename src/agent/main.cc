// esb-agent: the guest agent, PID 1 inside every container and microVM (docs/agent-protocol.md).
// main only wires: flags, signals, the reaper, the server.
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>

#include "agent/agent.h"
#include "agent/reaper.h"
#include "agent/util.h"
#include "common/log_throttle.h"

namespace {

using esb::agent::Log;
using esb::agent::LogLevel;

void Usage() {
  fprintf(stderr,
          "usage: esb-agent [--socket PATH | --listen-fd N | --serve-fd N] [--workspace DIR]\n"
          "                 [--volume-root /mnt/NAME]...\n"
          "                 [--state-dir DIR]\n"
          "                 [--shell PATH] [--log-level debug|info|warn|error]\n"
          "                 [--log-file PATH] [--allow-uid UID] [--host-uds-peers]\n"
          "  --listen-fd N   serve the listening unix socket inherited as fd N (from the host)\n"
          "  --serve-fd N    serve one already-open byte stream (a virtio-serial port) as fd N\n"
          "  --log-file PATH log here once listening (default <state-dir>/agent.log, capped at\n"
          "                  1 MiB + one rotated file); until then to stderr\n"
          "  --allow-uid UID also serve connections from this uid (besides 0)\n"
          "  --host-uds-peers (gVisor) also serve peers reported as pid 1 with our uid: host\n"
          "                  connections to a --host-uds=create socket\n");
}

// Name of the current user from /etc/passwd (no NSS: this binary is static).
std::string UserName() {
  uid_t uid = getuid();
  std::ifstream passwd("/etc/passwd");
  std::string line;
  while (std::getline(passwd, line)) {
    size_t a = line.find(':');
    size_t b = a == std::string::npos ? a : line.find(':', a + 1);
    size_t c = b == std::string::npos ? b : line.find(':', b + 1);
    if (c == std::string::npos) continue;
    if (line.substr(b + 1, c - b - 1) == std::to_string(uid)) return line.substr(0, a);
  }
  const char* env_user = getenv("USER");
  if (env_user && *env_user) return env_user;
  return uid == 0 ? "root" : "appuser";
}

// As PID 1 the agent may start without stdin/stdout/stderr; pipes created later must never
// land on fds 0-2 (dup2 onto the same number would keep O_CLOEXEC).
void EnsureStdFds() {
  for (int fd = 0; fd < 3; ++fd) {
    if (fcntl(fd, F_GETFD) < 0) {
      int n = open("/dev/null", O_RDWR);
      if (n >= 0 && n != fd) {
        dup2(n, fd);
        close(n);
      }
    }
  }
}

// Cap of the agent's own log inside the sandbox (one rotated generation more).
constexpr int64_t kLogFileBytes = 1 << 20;

bool ParseInt(const std::string& text, int64_t min, int64_t max, int64_t* out) {
  if (text.empty() || text.size() > 18) return false;
  int64_t v = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return false;
    v = v * 10 + (c - '0');
  }
  if (v < min || v > max) return false;
  *out = v;
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 3 && strcmp(argv[1], "--exec-shim") == 0) {
    // Started by the agent for each exec's shell (shell.cc): become a child subreaper (the
    // attribute survives execve, children do not inherit it), then become the shell.
    prctl(PR_SET_CHILD_SUBREAPER, 1);
    execv(argv[2], argv + 2);
    _exit(127);
  }
  EnsureStdFds();
  // SECURITY: PID 1 holds the host's listening socket (and, until it is ready, the host's
  // start-up log); a non-dumpable process keeps sandbox code (same uid) out of /proc/1/fd
  // and away from ptrace.
  prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
  esb::agent::AgentOptions options;
  std::string log_file;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    std::string value;
    size_t eq = arg.find('=');
    bool inline_value = arg.rfind("--", 0) == 0 && eq != std::string::npos;
    if (inline_value) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
    }
    if (arg == "--help" || arg == "-h") {
      Usage();
      return 0;
    }
    if (arg == "--host-uds-peers") {
      options.host_uds_peers = true;
      continue;
    }
    if (!inline_value) {
      if (i + 1 >= argc) {
        Usage();
        return 2;
      }
      value = argv[++i];
    }
    if (arg == "--socket") {
      options.socket_path = value;
    } else if (arg == "--workspace") {
      options.workspace = value;
    } else if (arg == "--volume-root") {
      // Only absolute, normalised paths below /mnt (where the container driver binds volumes).
      if (value.size() <= 5 || value.compare(0, 5, "/mnt/") != 0 ||
          value.find("/.") != std::string::npos || value.find("//") != std::string::npos ||
          value.back() == '/') {
        fprintf(stderr, "esb-agent: bad --volume-root %s\n", value.c_str());
        return 2;
      }
      options.volume_roots.push_back(value);
    } else if (arg == "--state-dir") {
      options.state_dir = value;
    } else if (arg == "--listen-fd" || arg == "--serve-fd" || arg == "--allow-uid") {
      int64_t v = 0;
      if (!ParseInt(value, arg == "--allow-uid" ? 0 : 3, 1 << 30, &v)) {
        fprintf(stderr, "esb-agent: bad value for %s: %s\n", arg.c_str(), value.c_str());
        return 2;
      }
      if (arg == "--listen-fd") {
        options.listen_fd = static_cast<int>(v);
      } else if (arg == "--serve-fd") {
        options.serve_fd = static_cast<int>(v);
      } else {
        options.allow_peer_uid = v;
      }
    } else if (arg == "--log-file") {
      log_file = value;
    } else if (arg == "--shell") {
      options.shell = value;
    } else if (arg == "--log-level") {
      LogLevel level;
      if (!esb::agent::ParseLogLevel(value, &level)) {
        Usage();
        return 2;
      }
      esb::agent::SetLogLevel(level);
    } else {
      fprintf(stderr, "esb-agent: unknown flag %s\n", arg.c_str());
      Usage();
      return 2;
    }
  }
  while (options.workspace.size() > 1 && options.workspace.back() == '/') {
    options.workspace.pop_back();
  }
  if (options.listen_fd >= 0 && options.serve_fd >= 0) {
    fprintf(stderr, "esb-agent: --listen-fd and --serve-fd exclude each other\n");
    return 2;
  }
  // Descriptors inherited from whoever started us must not leak into user commands; the one
  // exception is the socket or port the host handed over.
  if (int keep = std::max(options.listen_fd, options.serve_fd); keep >= 3) {
    if (keep > 3) close_range(3, static_cast<unsigned>(keep) - 1, 0);
    close_range(static_cast<unsigned>(keep) + 1, ~0U, 0);
    // SECURITY: fd hand-over — the kept descriptor is close-on-exec, never a command's.
    fcntl(keep, F_SETFD, FD_CLOEXEC);
  } else {
    close_range(3, ~0U, 0);
  }

  // Outside a PID namespace (tests, plain host processes) become a subreaper so orphans of
  // our sessions come back to us exactly as they do to PID 1. Needs no privilege.
  if (getpid() != 1) prctl(PR_SET_CHILD_SUBREAPER, 1);

  // Every thread inherits this mask; the signal thread takes SIGTERM/SIGINT with sigwait.
  // Commands get default dispositions and an empty mask back (posix_spawn attributes).
  signal(SIGPIPE, SIG_IGN);
  sigset_t wait_set;
  sigemptyset(&wait_set);
  sigaddset(&wait_set, SIGTERM);
  sigaddset(&wait_set, SIGINT);
  sigaddset(&wait_set, SIGUSR1);  // from outside: listen again after a checkpoint (gVisor)
  pthread_sigmask(SIG_BLOCK, &wait_set, nullptr);

  mkdir(options.workspace.c_str(), 0755);  // usually a mount; harmless if it exists

  esb::agent::Reaper reaper;
  reaper.Start();
  esb::agent::Agent agent(options, &reaper, UserName());
  std::string error;
  if (!agent.Listen(&error)) {
    Log(LogLevel::kError, error);
    return 1;
  }
  // Until here errors go to the inherited stderr (for crun/runc the host's start-up log, read
  // by esbd when a start fails). From here on the agent logs inside the sandbox, before it
  // spawns a shell or serves a request (Listen created the state directory).
  if (log_file.empty()) log_file = options.state_dir + "/agent.log";
  if (!esb::agent::RedirectLog(log_file, kLogFileBytes)) {
    Log(LogLevel::kError, "cannot open log file " + log_file + ": " + strerror(errno));
    return 1;
  }
  agent.PrepareShell();
  std::thread([&agent, wait_set] {
    const bool init = getpid() == 1;
    esb::LogThrottle ignored;  // a loop of `kill 1` cannot flood the log
    for (;;) {
      siginfo_t info{};
      int sig = sigwaitinfo(&wait_set, &info);
      if (sig < 0) continue;
      // SECURITY: as PID 1 of the sandbox's PID namespace, only a sender outside it (the
      // runtime, the host's kernel: si_pid 0 here) may stop the agent. A blocked SIGTERM is
      // not dropped for a namespace init the way an unhandled one is, so sandbox code could
      // otherwise end the environment with `kill 1`.
      if (init && info.si_pid != 0) {
        if (uint64_t n = ignored.Hit()) {
          Log(LogLevel::kWarn, std::string("ignoring ") + strsignal(sig) + " from pid " +
                                   std::to_string(info.si_pid) + " inside the sandbox (" +
                                   std::to_string(n) + " times so far)");
        }
        continue;
      }
      if (sig == SIGUSR1) {
        agent.Relisten();
        continue;
      }
      Log(LogLevel::kInfo, std::string("signal ") + strsignal(sig) + ": stopping");
      agent.Shutdown();
      _exit(0);  // no static destructors while connection threads still run
    }
  }).detach();
  Log(LogLevel::kInfo,
      (options.serve_fd >= 0
           ? "serving fd " + std::to_string(options.serve_fd)
           : "listening on " + (options.listen_fd >= 0 ? "fd " + std::to_string(options.listen_fd)
                                                       : options.socket_path)) +
          " (pid " + std::to_string(getpid()) + ", workspace " + options.workspace + ")");
  agent.Serve();
  return 0;
}
