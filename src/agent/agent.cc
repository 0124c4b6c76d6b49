#include "agent/agent.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <system_error>
#include <thread>
#include <utility>

#include "agent/handlers.h"
#include "agent/peer_cred.h"
#include "agent/util.h"

namespace esb::agent {
namespace json = boost::json;

namespace {

constexpr int kMaxConnections = 512;
constexpr int64_t kIdleTimeoutMs = 15 * 60 * 1000;  // between requests on one connection
constexpr int kSendTimeoutSec = 30;                 // a host that stops reading is gone

int MkdirAll(const std::string& path, mode_t mode) {
  for (size_t pos = 1; pos != std::string::npos;) {
    pos = path.find('/', pos + 1);
    std::string dir = path.substr(0, pos);
    if (mkdir(dir.c_str(), mode) != 0 && errno != EEXIST) return errno;
  }
  return 0;
}

}  // namespace

Agent::Agent(AgentOptions options, Reaper* reaper, std::string user)
    : options_(std::move(options)),
      reaper_(reaper),
      shell_(ShellOptions{options_.workspace, options_.state_dir, options_.shell, std::move(user)},
             reaper),
      start_ms_(proto::MonotonicMs()) {}

bool Agent::Listen(std::string* error) {
  MkdirAll(options_.state_dir, 0700);
  if (options_.listen_fd >= 0) {
    int fd = options_.listen_fd;
    int listening = 0, domain = 0;
    socklen_t len = sizeof listening;
    socklen_t dlen = sizeof domain;
    if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) != 0 || !listening ||
        getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &domain, &dlen) != 0 || domain != AF_UNIX) {
      *error = "--listen-fd " + std::to_string(fd) + " is not a listening unix socket";
      return false;
    }
    fcntl(fd, F_SETFD, FD_CLOEXEC);
    listen_fd_ = fd;
    return true;
  }
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (options_.socket_path.empty() || options_.socket_path.size() >= sizeof addr.sun_path) {
    *error = "socket path empty or too long: " + options_.socket_path;
    return false;
  }
  memcpy(addr.sun_path, options_.socket_path.data(), options_.socket_path.size());
  size_t slash = options_.socket_path.rfind('/');
  if (slash != std::string::npos && slash > 0) {
    MkdirAll(options_.socket_path.substr(0, slash), 0755);
  }
  struct stat st;
  if (lstat(options_.socket_path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode)) {
    unlink(options_.socket_path.c_str());  // stale socket from a previous run
  }
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    *error = std::string("socket: ") + strerror(errno);
    return false;
  }
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    *error = "bind " + options_.socket_path + ": " + strerror(errno);
    close(fd);
    return false;
  }
  // SECURITY: the socket is reachable by anyone who can reach its directory; on the host that
  // directory belongs to esbd (<state>/envs/<id>/run), inside the sandbox every process is
  // already the agent's own user. World-connectable so a rootless esbd with a mapped uid works.
  chmod(options_.socket_path.c_str(), 0666);
  if (listen(fd, 128) != 0) {
    *error = std::string("listen: ") + strerror(errno);
    close(fd);
    return false;
  }
  listen_fd_ = fd;
  return true;
}

void Agent::PrepareShell() { shell_.PrepareStandby(); }

void Agent::Serve() {
  for (;;) {
    int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      Log(LogLevel::kWarn, std::string("accept: ") + strerror(errno));
      usleep(10000);  // EMFILE and friends: back off instead of spinning
      continue;
    }
    if (!PeerAllowed(fd)) {
      close(fd);
      continue;
    }
    if (connections_.load() >= kMaxConnections) {
      if (uint64_t n = refused_busy_.Hit()) {
        Log(LogLevel::kWarn,
            "too many connections; closing a new one (" + std::to_string(n) + " so far)");
      }
      close(fd);
      continue;
    }
    ++connections_;
    try {
      std::thread([this, fd] {
        try {
          HandleConnection(fd);
        } catch (const std::exception& e) {  // e.g. bad_alloc under a memory limit
          Log(LogLevel::kWarn, std::string("connection dropped: ") + e.what());
        }
        close(fd);
        --connections_;
      }).detach();
    } catch (const std::system_error& e) {
      // No thread (a fork bomb at the pids limit): refuse this connection, keep serving.
      Log(LogLevel::kWarn, std::string("cannot start connection thread: ") + e.what());
      close(fd);
      --connections_;
      usleep(10000);
    }
  }
}

bool Agent::PeerAllowed(int fd) {
  ucred cred{};
  socklen_t len = sizeof cred;
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0 && len == sizeof cred &&
      (cred.uid == 0 || IsUnmappedOutsidePeer(cred) ||  // uid 0 on the host, seen via a userns
       (options_.allow_peer_uid >= 0 && cred.uid == static_cast<uid_t>(options_.allow_peer_uid)) ||
       (options_.host_uds_peers && cred.pid == 1 && getpid() == 1 && cred.uid == getuid()))) {
    return true;
  }
  // SECURITY: only esbd (uid 0 on the host) may drive the agent; sandbox code runs as the
  // agent's own unprivileged uid and is refused before a single byte is read.
  if (uint64_t n = refused_peers_.Hit()) {  // a loop of attempts cannot flood the log
    Log(LogLevel::kWarn, "refused connection from uid " + std::to_string(cred.uid) + " pid " +
                             std::to_string(cred.pid) + " (" + std::to_string(n) + " so far)");
  }
  return false;
}

void Agent::Shutdown() {
  shell_.KillAll();
  if (options_.listen_fd < 0) unlink(options_.socket_path.c_str());
}

void Agent::HandleConnection(int fd) {
  timeval tv{kSendTimeoutSec, 0};
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  proto::Frame hello;
  hello.type = proto::FrameType::kHello;
  hello.header["agent"] = "esb-agent";
  hello.header["version"] = proto::kVersion;
  hello.header["pid"] = static_cast<int64_t>(getpid());
  std::string error;
  if (!proto::WriteFrame(fd, hello, &error)) return;
  for (;;) {
    proto::Frame request;
    if (!proto::ReadFrame(fd, &request, &error, proto::MonotonicMs() + kIdleTimeoutMs)) {
      if (error != "connection closed") Log(LogLevel::kDebug, "closing connection: " + error);
      return;
    }
    if (request.type != proto::FrameType::kRequest) {
      Log(LogLevel::kDebug, "closing connection: expected a REQUEST frame");
      return;
    }
    if (!HandleRequest(fd, request)) return;
  }
}

bool Agent::HandleRequest(int fd, const proto::Frame& request) {
  const json::value* op_value = request.header.if_contains("op");
  std::string op = op_value && op_value->is_string() ? std::string(op_value->as_string()) : "";
  Log(LogLevel::kDebug, "request op=" + op);
  proto::Frame response;
  if (op == "exec") {
    return HandleExec(fd, request.header, request.payload);
  } else if (op == "ping") {
    response = OkResponse();
  } else if (op == "write") {
    response = HandleWrite(options_.workspace, request.header, request.payload);
  } else if (op == "read") {
    response = HandleRead(options_.workspace, request.header);
  } else if (op == "list") {
    response = HandleList(options_.workspace, request.header);
  } else if (op == "stat") {
    response = HandleStat(options_.workspace, request.header);
  } else if (op == "mkdir") {
    response = HandleMkdir(options_.workspace, request.header);
  } else if (op == "remove") {
    response = HandleRemove(options_.workspace, request.header);
  } else if (op == "rename") {
    response = HandleRename(options_.workspace, request.header);
  } else if (op == "stats") {
    response = HandleStats(options_.workspace, start_ms_);
    // The idle standby shell is agent machinery, not a user process.
    if (shell_.standby_pid() > 0 && kill(shell_.standby_pid(), 0) == 0) {
      response.header["processes"] = response.header["processes"].as_int64() - 1;
    }
  } else if (op == "configure") {
    response = HandleConfigure(request.header);
  } else {
    response = ErrorResponse("unknown op: " + op, "EINVAL");
  }
  std::string error;
  return proto::WriteFrame(fd, response, &error);
}

proto::Frame Agent::HandleConfigure(const json::object& header) {
  Fields f(header);
  std::vector<std::pair<std::string, std::string>> env;
  if (!f.StringMap("env", &env)) return ErrorResponse(f.error(), "EINVAL");
  std::map<std::string, std::string> map;
  for (auto& [k, v] : env) {
    if (!ValidEnvName(k) || v.find('\0') != std::string::npos) {
      return ErrorResponse("invalid environment variable: " + k, "EINVAL");
    }
    map[k] = v;
  }
  shell_.Configure(std::move(map));
  try {
    std::thread([this] { shell_.PrepareStandby(); }).detach();  // with the new environment
  } catch (const std::system_error&) {
    // The next exec starts its shell itself.
  }
  return OkResponse();
}

bool Agent::HandleExec(int fd, const json::object& header, const std::string& payload) {
  Fields f(header);
  ExecParams params;
  // Extension to the documented format: commands too long for the 64 KiB header come in the
  // payload.
  if (f.Bool("command_in_payload", false)) {
    params.command = payload;
  } else {
    params.command = f.String("command", "", true);
  }
  params.timeout_ms = f.Int("timeout_ms", 60000);
  params.max_output_bytes = f.Int("max_output_bytes", 1 << 20);
  std::vector<std::pair<std::string, std::string>> env;
  f.StringMap("env", &env);
  for (auto& [k, v] : env) params.env[k] = v;
  std::string error;
  if (!f.ok()) return proto::WriteFrame(fd, ErrorResponse(f.error(), "EINVAL"), &error);

  ExecOutcome outcome = shell_.Exec(params, fd, [fd](bool is_stderr, std::string_view data) {
    proto::Frame out;
    out.type = proto::FrameType::kOutput;
    out.header["stream"] = is_stderr ? "stderr" : "stdout";
    out.payload.assign(data);
    std::string err;
    return proto::WriteFrame(fd, out, &err);
  });
  if (outcome.cancelled) {
    Log(LogLevel::kInfo, "exec cancelled: client went away; process group killed");
    shell_.PrepareStandby();
    return false;
  }
  if (!outcome.ok) {
    return proto::WriteFrame(fd, ErrorResponse(outcome.error, outcome.errno_name), &error);
  }
  proto::Frame response = OkResponse();
  response.header["exit_code"] = outcome.exit_code;
  response.header["timed_out"] = outcome.timed_out;
  response.header["truncated"] = outcome.truncated;
  response.header["duration_ms"] = outcome.duration_ms;
  bool ok = proto::WriteFrame(fd, response, &error);
  shell_.PrepareStandby();  // off the critical path: the response is already sent
  return ok;
}

}  // namespace esb::agent
