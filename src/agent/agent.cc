#include "agent/agent.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <system_error>
#include <thread>
#include <utility>

#include "agent/handlers.h"
#include "agent/peer_cred.h"
#include "agent/util.h"
#include "common/channel.h"

namespace esb::agent {
namespace json = boost::json;

namespace {

// esbd holds one connection per agent; more appear only while an esbd restarts, and tests.
constexpr int kMaxConnections = 64;
// Calls in flight on all connections together, each on a thread of its own; one more is
// answered EBUSY.
constexpr int kMaxCalls = 64;
// Longest frame of each type esbd may send (checked before the body is read).
constexpr uint32_t kControlFrameBytes = proto::FrameBytesFor(4096, 0);
constexpr uint32_t kInputFrameBytes = proto::FrameBytesFor(4096, proto::kMaxChunkBytes);

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
      shell_(ShellOptions{options_.workspace, options_.state_dir, options_.shell, user}, reaper),
      processes_(ProcessTableOptions{options_.workspace, user, options_.shell}, reaper),
      start_ms_(proto::MonotonicMs()) {}

bool Agent::Listen(std::string* error) {
  MkdirAll(options_.state_dir, 0700);
  if (options_.serve_fd >= 0) return true;  // the host's port; nothing to listen on
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
  if (options_.serve_fd >= 0) {
    HandleConnection(options_.serve_fd, /*owned=*/false);
    Log(LogLevel::kInfo, "serve fd closed");
    return;
  }
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(release_mu_);
      if (release_requested_) {
        lock.unlock();
        if (!ReleaseAndWait()) return;
        continue;
      }
    }
    // Polled so a release (asked on a connection thread) is noticed within 100 ms.
    pollfd pfd{listen_fd_, POLLIN, 0};
    if (poll(&pfd, 1, 100) <= 0) continue;
    int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED || errno == EAGAIN) continue;
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
    {
      std::lock_guard<std::mutex> lock(release_mu_);
      conn_fds_.insert(fd);
    }
    try {
      std::thread([this, fd] {
        HandleConnection(fd, /*owned=*/true);
        {
          std::lock_guard<std::mutex> lock(release_mu_);
          conn_fds_.erase(fd);
        }
        --connections_;
      }).detach();
    } catch (const std::system_error& e) {
      // No thread (a fork bomb at the pids limit): refuse this connection, keep serving.
      Log(LogLevel::kWarn, std::string("cannot start connection thread: ") + e.what());
      {
        std::lock_guard<std::mutex> lock(release_mu_);
        conn_fds_.erase(fd);
      }
      close(fd);
      --connections_;
      usleep(10000);
    }
  }
}

proto::Frame Agent::HandleReleaseListener() {
  // Only the gVisor layout binds its socket itself; a listener inherited from the host (crun,
  // runc) or a serve fd is not the agent's to give back.
  if (!options_.host_uds_peers || options_.listen_fd >= 0 || options_.serve_fd >= 0) {
    return ErrorResponse("release_listener is for a socket bound with --host-uds-peers", "EINVAL");
  }
  std::lock_guard<std::mutex> lock(release_mu_);
  release_requested_ = true;
  relisten_ = false;
  return OkResponse();
}

bool Agent::ReleaseAndWait() {
  const std::string dir = options_.socket_path.substr(0, options_.socket_path.rfind('/'));
  const std::string marker = dir + "/released";
  // Give the op's answer a moment to leave, then end every host connection.
  usleep(20000);
  close(listen_fd_);
  listen_fd_ = -1;
  unlink(options_.socket_path.c_str());
  {
    std::lock_guard<std::mutex> lock(release_mu_);
    for (int fd : conn_fds_) shutdown(fd, SHUT_RDWR);
  }
  for (int i = 0; i < 500 && connections_.load() > 0; ++i) usleep(10000);
  if (connections_.load() > 0) {
    Log(LogLevel::kWarn, "release: connections still open after 5 s");
  } else {
    // The host waits for this file before it checkpoints (sandbox code can make it too: then
    // the checkpoint fails and esbd restarts this sandbox, its own loss only).
    Fd m(open(marker.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600));
  }
  Log(LogLevel::kInfo, "listener released (checkpoint)");
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(release_mu_);
      release_cv_.wait(lock, [this] { return relisten_; });
      relisten_ = false;
    }
    unlink(marker.c_str());
    // The host removes the old socket file before it signals (gVisor may still show it to the
    // sandbox as deleted while it exists on the host); a failed bind waits for the next signal.
    std::string error;
    if (Listen(&error)) break;
    Log(LogLevel::kError, "listening again after a release: " + error);
  }
  {
    std::lock_guard<std::mutex> lock(release_mu_);
    release_requested_ = false;
  }
  Log(LogLevel::kInfo, "listening again on " + options_.socket_path);
  return true;
}

void Agent::Relisten() {
  std::lock_guard<std::mutex> lock(release_mu_);
  if (!release_requested_) return;
  relisten_ = true;
  release_cv_.notify_all();
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
  processes_.KillAll();
  if (options_.listen_fd < 0 && options_.serve_fd < 0) unlink(options_.socket_path.c_str());
}

// One connection: the byte stream, its flow control and the calls in flight on it. Call
// threads hold it (shared_ptr), so the fd is closed only after the last of them answered.
struct Agent::Conn {
  Conn(int fd, bool owned)
      : fd(fd),
        owned(owned),
        wake(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)),
        channel(fd, wake.get()) {}
  ~Conn() {
    if (owned) close(fd);
  }
  const int fd;
  const bool owned;
  Fd wake;  // readable once the channel shut down (a write broke the stream): the reader stops
  proto::Channel channel;
  std::mutex mu;
  std::map<uint32_t, std::shared_ptr<Call>> calls;  // guarded by mu
};

// One call: cancellation and (for exec) the stdin that arrived in INPUT frames.
struct Agent::Call {
  explicit Call(uint32_t stream) : stream(stream), wake(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {}
  void Wake() {
    uint64_t one = 1;
    ssize_t ignored = write(wake.get(), &one, sizeof one);
    (void)ignored;
  }
  void Cancel() {
    cancelled = true;
    Wake();
  }
  const uint32_t stream;
  Fd wake;
  std::atomic<bool> cancelled{false};
  std::atomic<bool> answered{false};  // its RESPONSE is sent (it no longer counts in calls_)
  std::mutex mu;
  std::string input;  // guarded by mu; at most the window esbd was granted
  bool input_eof = false;
};

std::vector<std::string> Capabilities() {
  return {"ping",  "exec",   "write",  "read",  "list",        "stat",
          "mkdir", "remove", "rename", "stats", "configure",   "spawn",
          "input", "signal", "resize", "wait",  "kill",        "sync",
          "thaw",  "reseed", "walk",   "apply", "shell_state", "release_listener"};
}

void Agent::HandleConnection(int fd, bool owned) {
  // Non-blocking: a host that stops reading makes a write give up after 30 s (WriteFrame)
  // instead of holding the connection's writers forever.
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  auto conn = std::make_shared<Conn>(fd, owned);
  proto::Frame hello;
  hello.type = proto::FrameType::kHello;
  hello.header["agent"] = "esb-agent";
  hello.header["version"] = proto::kVersion;
  hello.header["pid"] = static_cast<int64_t>(getpid());
  boost::json::array ops;
  for (const std::string& op : Capabilities()) ops.emplace_back(op);
  hello.header["ops"] = std::move(ops);
  hello.header["max_calls"] = kMaxCalls;
  hello.header["window"] = proto::kInitialWindow;
  if (!conn->channel.Send(hello)) return;
  const proto::FrameLimit limit = [](proto::FrameType type, uint32_t) -> uint32_t {
    switch (type) {
      case proto::FrameType::kRequest:
        return proto::kMaxFrameBytes;
      case proto::FrameType::kInput:
        return kInputFrameBytes;
      case proto::FrameType::kCancel:
      case proto::FrameType::kWindow:
        return kControlFrameBytes;
      default:
        return 0;  // HELLO, OUTPUT, RESPONSE: never sent by esbd
    }
  };
  std::string error;
  try {
    for (;;) {
      proto::Frame frame;
      if (!proto::ReadFrame(fd, &frame, &error, -1, proto::kMaxFrameBytes, limit,
                            conn->wake.get())) {
        // Woken: a write failed and left the stream unusable; say why that was.
        if (error == "interrupted") error = conn->channel.close_reason();
        break;
      }
      if (frame.type == proto::FrameType::kRequest) {
        if (!StartCall(conn, std::move(frame))) {
          error = "REQUEST reuses a stream in flight";
          break;
        }
        continue;
      }
      std::shared_ptr<Call> call;
      {
        std::lock_guard<std::mutex> lock(conn->mu);
        auto it = conn->calls.find(frame.stream);
        if (it != conn->calls.end()) call = it->second;
      }
      if (frame.type == proto::FrameType::kWindow) {
        const boost::json::value* bytes = frame.header.if_contains("bytes");
        if (!bytes || !(bytes->is_int64() || bytes->is_uint64())) {
          error = "WINDOW without bytes";
          break;
        }
        conn->channel.Grant(frame.stream,
                            bytes->is_uint64()
                                ? bytes->as_uint64()
                                : static_cast<uint64_t>(std::max<int64_t>(bytes->as_int64(), 0)));
      } else if (frame.type == proto::FrameType::kCancel) {
        if (call) {  // a call that already answered: nothing to do
          call->Cancel();
          // Its senders stop waiting for credit esbd will never grant (an exec blocked on
          // output notices the cancel at once).
          conn->channel.Close(frame.stream);
        }
      } else if (frame.type == proto::FrameType::kInput) {
        // The call ended or was cancelled; its remaining input is dropped.
        if (!call || call->cancelled) continue;
        if (!conn->channel.Received(frame.stream, frame.payload.size())) {
          error = "INPUT beyond the flow-control window";
          break;
        }
        const boost::json::value* eof = frame.header.if_contains("eof");
        {
          std::lock_guard<std::mutex> lock(call->mu);
          call->input += frame.payload;
          if (eof && eof->is_bool() && eof->as_bool()) call->input_eof = true;
        }
        call->Wake();
      } else {
        error = "unexpected frame type from the host";
        break;
      }
    }
  } catch (const std::exception& e) {  // e.g. bad_alloc under a memory limit
    error = e.what();
  }
  if (error != "connection closed") {
    Log(conn->channel.closed() ? LogLevel::kWarn : LogLevel::kDebug,
        "closing connection: " + error);
  }
  // As in v1, a connection that goes away takes its calls with it (an exec's tree is killed).
  // The host sees the end at once (EOF), not when the last call thread let go of the fd: a
  // connection this side stopped serving must never look alive to esbd.
  conn->channel.Shutdown(error);
  shutdown(fd, SHUT_RDWR);
  std::lock_guard<std::mutex> lock(conn->mu);
  for (auto& [stream, call] : conn->calls) call->Cancel();
}

bool Agent::StartCall(const std::shared_ptr<Conn>& conn, proto::Frame request) {
  auto call = std::make_shared<Call>(request.stream);
  {
    std::lock_guard<std::mutex> lock(conn->mu);
    if (!conn->calls.emplace(request.stream, call).second) return false;
  }
  conn->channel.Open(request.stream);
  auto refuse = [&](const std::string& why) {
    proto::Frame busy = ErrorResponse(why, "EBUSY");
    busy.stream = request.stream;
    conn->channel.Send(busy);
    {
      std::lock_guard<std::mutex> lock(conn->mu);
      conn->calls.erase(request.stream);
    }
    conn->channel.Close(request.stream);
  };
  if (!call->wake) {
    refuse("agent busy: cannot create an eventfd");
    return true;
  }
  if (++calls_ > kMaxCalls) {
    --calls_;
    if (uint64_t n = refused_busy_.Hit()) {
      Log(LogLevel::kWarn,
          "too many calls in flight; refusing one (" + std::to_string(n) + " so far)");
    }
    refuse("agent busy: " + std::to_string(kMaxCalls) + " calls in flight");
    return true;
  }
  try {
    std::thread([this, conn, call, request = std::move(request)] {
      RunCall(conn, call, request);
      if (!call->answered.exchange(true)) --calls_;  // never left uncounted
    }).detach();
  } catch (const std::system_error& e) {
    --calls_;
    refuse(std::string("agent busy: cannot start a thread: ") + e.what());
  }
  return true;
}

void Agent::RunCall(const std::shared_ptr<Conn>& conn, const std::shared_ptr<Call>& call,
                    const proto::Frame& request) {
  std::optional<proto::Frame> response;
  try {
    response = HandleRequest(*conn, *call, request);
  } catch (const std::exception& e) {  // e.g. bad_alloc under a memory limit
    response = ErrorResponse(std::string("agent: ") + e.what(), "ENOMEM");
  }
  if (response) Answer(*conn, *call, std::move(*response));
  {
    std::lock_guard<std::mutex> lock(conn->mu);
    conn->calls.erase(call->stream);
  }
  conn->channel.Close(call->stream);
}

void Agent::Answer(Conn& conn, Call& call, proto::Frame response) {
  // The slot is free from the moment esbd can see the answer (it may send the next call at
  // once), even if this thread still has work to do (an exec prepares the next shell).
  if (!call.answered.exchange(true)) --calls_;
  response.type = proto::FrameType::kResponse;
  response.stream = call.stream;
  conn.channel.Send(response);
}

std::optional<proto::Frame> Agent::HandleRequest(Conn& conn, Call& call,
                                                 const proto::Frame& request) {
  const json::value* op_value = request.header.if_contains("op");
  std::string op = op_value && op_value->is_string() ? std::string(op_value->as_string()) : "";
  Log(LogLevel::kDebug, "request op=" + op);
  if (op == "exec") return HandleExec(conn, call, request.header, request.payload);
  if (op == "ping") return OkResponse();
  if (op == "write") return HandleWrite(options_.workspace, request.header, request.payload);
  if (op == "read") return HandleRead(options_.workspace, request.header);
  if (op == "list") return HandleList(options_.workspace, request.header);
  if (op == "stat") return HandleStat(options_.workspace, request.header);
  if (op == "mkdir")
    return HandleMkdir(FsRoots(options_.workspace, options_.volume_roots), request.header);
  if (op == "remove")
    return HandleRemove(FsRoots(options_.workspace, options_.volume_roots), request.header);
  if (op == "rename")
    return HandleRename(FsRoots(options_.workspace, options_.volume_roots), request.header);
  if (op == "stats") {
    proto::Frame response = HandleStats(options_.workspace, start_ms_);
    // The idle standby shell is agent machinery, not a user process.
    if (shell_.standby_pid() > 0 && kill(shell_.standby_pid(), 0) == 0) {
      response.header["processes"] = response.header["processes"].as_int64() - 1;
    }
    return response;
  }
  if (op == "configure") return HandleConfigure(request.header);
  if (op == "spawn") return HandleSpawn(request.header);
  if (op == "wait") return HandleWait(conn, call, request.header);
  if (op == "input" || op == "signal" || op == "resize" || op == "kill") {
    return HandleProcessOp(op, request.header, request.payload);
  }
  if (op == "sync" || op == "thaw") return HandleSync(request.header);
  if (op == "reseed") return HandleReseed(request.payload);
  if (op == "walk") return HandleWalk(options_.workspace, request.header, &walk_cache_);
  if (op == "apply") return HandleApply(options_.workspace, request.header, request.payload);
  if (op == "shell_state") return HandleShellState(request.header, request.payload);
  if (op == "release_listener") return HandleReleaseListener();
  if (op.empty()) return ErrorResponse("request without an op", "EINVAL");
  return ErrorResponse("unknown op: " + op, "ENOSYS");
}

proto::Frame Agent::HandleShellState(const json::object& header, const std::string& payload) {
  // A state this large is not a shell session's; time travel keeps at most 256 KiB of it.
  constexpr size_t kMaxShellState = 4 << 20;
  Fields f(header);
  const bool set = f.Bool("set", false);
  if (!f.ok()) return ErrorResponse(f.error(), "EINVAL");
  if (set) {
    if (payload.size() > kMaxShellState || payload.find('\0') != std::string::npos)
      return ErrorResponse("shell_state: the state is too large or has NUL bytes", "EINVAL");
    shell_.SetState(payload);
    return OkResponse();
  }
  std::string state = shell_.State();
  const int64_t max_bytes = f.Int("max_bytes", static_cast<int64_t>(kMaxShellState));
  if (!f.ok() || max_bytes < 0) return ErrorResponse("shell_state: invalid max_bytes", "EINVAL");
  const size_t cap = std::min(kMaxShellState, static_cast<size_t>(max_bytes));
  if (state.size() > cap) {
    return ErrorResponse("shell_state: the state is larger than " + std::to_string(cap) + " bytes",
                         "EFBIG");
  }
  proto::Frame resp = OkResponse();
  resp.header["bytes"] = static_cast<int64_t>(state.size());
  resp.payload = std::move(state);
  return resp;
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
  processes_.Configure(map);
  shell_.Configure(std::move(map));
  try {
    std::thread([this] { shell_.PrepareStandby(); }).detach();  // with the new environment
  } catch (const std::system_error&) {
    // The next exec starts its shell itself.
  }
  return OkResponse();
}

std::optional<proto::Frame> Agent::HandleExec(Conn& conn, Call& call, const json::object& header,
                                              const std::string& payload) {
  Fields f(header);
  ExecParams params;
  // Commands too long for the 64 KiB header come in the payload.
  if (f.Bool("command_in_payload", false)) {
    params.command = payload;
  } else {
    params.command = f.String("command", "", true);
  }
  params.timeout_ms = f.Int("timeout_ms", 60000);
  params.max_output_bytes = f.Int("max_output_bytes", 1 << 20);
  params.has_stdin = f.Bool("stdin", false);
  std::vector<std::pair<std::string, std::string>> env;
  f.StringMap("env", &env);
  for (auto& [k, v] : env) params.env[k] = v;
  if (!f.ok()) return ErrorResponse(f.error(), "EINVAL");

  // Output waits for esbd's credit at most until the command's deadline; after that it is
  // dropped (the exec loop then times the command out), so a host that stops reading cannot
  // hold the exec past its timeout.
  const int64_t deadline = proto::MonotonicMs() + std::max<int64_t>(params.timeout_ms, 1);
  bool dropped = false;
  ExecIo io;
  io.wake_fd = call.wake.get();
  io.cancelled = [&call] { return call.cancelled.load(); };
  io.take_input = [&conn, &call](std::string* data) {
    std::lock_guard<std::mutex> lock(call.mu);
    size_t n = call.input.size();
    data->append(call.input);
    call.input.clear();
    if (n > 0) conn.channel.Consumed(call.stream, n);
    return call.input_eof;
  };
  io.output = [&](bool is_stderr, std::string_view data) {
    if (dropped) return !call.cancelled.load();
    json::object out{{"stream", is_stderr ? "stderr" : "stdout"}};
    std::string error;
    if (!conn.channel.SendData(proto::FrameType::kOutput, call.stream, out, data, deadline,
                               /*write_deadline_ms=*/-1, &error)) {
      if (conn.channel.closed() || call.cancelled.load()) return false;
      dropped = true;  // credit never came before the deadline
    }
    return true;
  };
  ExecOutcome outcome = shell_.Exec(params, io);
  if (outcome.cancelled) {
    Log(LogLevel::kInfo, "exec cancelled; its process tree was killed");
    shell_.PrepareStandby();
    return ErrorResponse("exec cancelled", "ECANCELED");
  }
  if (!outcome.ok) return ErrorResponse(outcome.error, outcome.errno_name);
  proto::Frame response = OkResponse();
  response.header["exit_code"] = outcome.exit_code;
  response.header["timed_out"] = outcome.timed_out;
  response.header["truncated"] = outcome.truncated || dropped;
  response.header["duration_ms"] = outcome.duration_ms;
  // The next shell starts after the answer is on its way (off the critical path).
  Answer(conn, call, std::move(response));
  shell_.PrepareStandby();
  return std::nullopt;  // answered
}

// ---------------------------------------------------------------------------------------
// Long-lived processes. The table's I/O thread hands output to ProcOutput (never blocking); a
// `wait` call sends it on as OUTPUT frames and grants the table credit for what it sent, so
// what a process writes while nobody waits stays within the table's window (the process then
// blocks in write()).

struct Agent::ProcOutput {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::pair<OutputStream, std::string>> chunks;  // ≤ the table's output window
  bool ended = false;
  ExitInfo exit;
  bool waiting = false;  // one `wait` at a time
};

std::shared_ptr<Agent::ProcOutput> Agent::Output(uint64_t id) {
  std::lock_guard<std::mutex> lock(outputs_mu_);
  auto it = outputs_.find(id);
  return it == outputs_.end() ? nullptr : it->second;
}

namespace {

proto::Frame OpError(const OpStatus& s) { return ErrorResponse(s.error, s.errno_name); }

// Process ids travel as decimal strings.
bool ParseId(Fields& f, uint64_t* id) {
  std::string text = f.String("id", "", true);
  if (!f.ok() || text.empty() || text.size() > 19 ||
      text.find_first_not_of("0123456789") != std::string::npos) {
    return false;
  }
  *id = std::stoull(text);
  return true;
}

}  // namespace

proto::Frame Agent::HandleSpawn(const json::object& header) {
  SpawnSpec spec;
  const json::value* argv = header.if_contains("argv");
  if (!argv || !argv->is_array()) return ErrorResponse("spawn: argv must be an array", "EINVAL");
  for (const json::value& a : argv->as_array()) {
    if (!a.is_string()) return ErrorResponse("spawn: argv must be strings", "EINVAL");
    spec.argv.emplace_back(a.as_string());
  }
  Fields f(header);
  std::vector<std::pair<std::string, std::string>> env;
  f.StringMap("env", &env);
  for (auto& [k, v] : env) spec.env[k] = v;
  spec.cwd = f.String("cwd", "");
  spec.pty = f.Bool("pty", false);
  spec.rows = static_cast<int>(f.Int("rows", 24));
  spec.cols = static_cast<int>(f.Int("cols", 80));
  if (!f.ok()) return ErrorResponse(f.error(), "EINVAL");
  auto out = std::make_shared<ProcOutput>();
  spec.on_output = [out](uint64_t, OutputStream stream, std::string_view data) {
    std::lock_guard<std::mutex> lock(out->mu);
    out->chunks.emplace_back(stream, std::string(data));
    out->cv.notify_all();
  };
  spec.on_exit = [out](uint64_t, const ExitInfo& exit) {
    std::lock_guard<std::mutex> lock(out->mu);
    out->ended = true;
    out->exit = exit;
    out->cv.notify_all();
  };
  uint64_t id = 0;
  OpStatus s = processes_.Spawn(std::move(spec), &id);
  if (!s.ok) return OpError(s);
  {
    std::lock_guard<std::mutex> lock(outputs_mu_);
    outputs_[id] = out;
    // Bounded: the table forgets ended processes too (max_exited); so do we, oldest first —
    // never a process still running (at most 32 are), whose output would then have no way
    // out (a long-lived terminal outlives many hosted-server restarts).
    for (auto it = outputs_.begin(); outputs_.size() > 256 && it != outputs_.end();) {
      bool ended;
      {
        std::lock_guard<std::mutex> olock(it->second->mu);
        ended = it->second->ended;
      }
      it = ended ? outputs_.erase(it) : std::next(it);
    }
  }
  proto::Frame response = OkResponse();
  response.header["id"] = std::to_string(id);
  ProcessInfo info;
  if (processes_.Info(id, &info).ok) response.header["pid"] = static_cast<int64_t>(info.pid);
  return response;
}

proto::Frame Agent::HandleProcessOp(const std::string& op, const json::object& header,
                                    const std::string& payload) {
  Fields f(header);
  uint64_t id = 0;
  if (!ParseId(f, &id)) return ErrorResponse(op + ": id must be a process id", "EINVAL");
  OpStatus s;
  if (op == "input") {
    bool eof = f.Bool("eof", false);
    if (!f.ok()) return ErrorResponse(f.error(), "EINVAL");
    if (!payload.empty()) s = processes_.WriteInput(id, payload);
    if (s.ok && eof) s = processes_.CloseInput(id);
  } else if (op == "signal") {
    int signo = 0;
    if (const json::value* v = header.if_contains("signal"); v && v->is_string()) {
      signo = ProcessTable::SignalFromName(v->as_string());
    } else {
      signo = static_cast<int>(f.Int("signal", 0, true));
    }
    if (!f.ok()) return ErrorResponse(f.error(), "EINVAL");
    s = processes_.Signal(id, signo);
  } else if (op == "resize") {
    int rows = static_cast<int>(f.Int("rows", 0, true));
    int cols = static_cast<int>(f.Int("cols", 0, true));
    if (!f.ok()) return ErrorResponse(f.error(), "EINVAL");
    s = processes_.Resize(id, rows, cols);
  } else {  // kill
    s = processes_.Kill(id);
  }
  return s.ok ? OkResponse() : OpError(s);
}

std::optional<proto::Frame> Agent::HandleWait(Conn& conn, Call& call, const json::object& header) {
  Fields f(header);
  uint64_t id = 0;
  if (!ParseId(f, &id)) return ErrorResponse("wait: id must be a process id", "EINVAL");
  int64_t timeout_ms = std::clamp<int64_t>(f.Int("timeout_ms", 0), 0, int64_t{24} * 3600 * 1000);
  if (!f.ok()) return ErrorResponse(f.error(), "EINVAL");
  std::shared_ptr<ProcOutput> out = Output(id);
  ExitInfo exit;
  if (!out) {  // not spawned by this agent run (or forgotten): the table may still know it
    OpStatus s = processes_.Wait(id, timeout_ms, &exit);
    if (!s.ok) return OpError(s);
  } else {
    {
      std::lock_guard<std::mutex> lock(out->mu);
      if (out->waiting) return ErrorResponse("wait: another wait is in progress", "EBUSY");
      out->waiting = true;
    }
    const int64_t deadline = proto::MonotonicMs() + timeout_ms;
    // Chunks still to send once the timeout passed: those queued by then. A wait answers at
    // its timeout even while output keeps coming (a flooding process would otherwise hold it
    // for as long as esbd keeps granting credit); the rest waits for the next wait.
    int64_t late_chunks = -1;
    std::unique_lock<std::mutex> lock(out->mu);
    for (;;) {
      if (call.cancelled) {
        out->waiting = false;
        return ErrorResponse("wait cancelled", "ECANCELED");
      }
      const int64_t left = deadline - proto::MonotonicMs();
      if (left <= 0 && late_chunks < 0) late_chunks = static_cast<int64_t>(out->chunks.size());
      if (!out->chunks.empty() && (left > 0 || late_chunks > 0)) {
        if (left <= 0) --late_chunks;
        auto [stream, data] = std::move(out->chunks.front());
        out->chunks.pop_front();
        lock.unlock();
        json::object h{{"stream", stream == OutputStream::kStderr ? "stderr" : "stdout"}};
        std::string error;
        // The deadline bounds the wait for esbd's credit, never a frame's write: abandoning a
        // frame half written breaks the connection for every call on it (F11).
        bool sent = conn.channel.SendData(proto::FrameType::kOutput, call.stream, h, data, deadline,
                                          /*write_deadline_ms=*/-1, &error);
        lock.lock();
        if (!sent) {
          // Cancelled, or no credit before the deadline: nothing of the chunk was sent (it is
          // one frame, ≤ 64 KiB), so it goes back for the next wait, still counted against
          // the table's credit (granting it here would let the table read past the window;
          // dropping it ungranted would shrink the window for good).
          out->chunks.emplace_front(stream, std::move(data));
          out->waiting = false;
          if (conn.channel.closed() || call.cancelled) {
            return ErrorResponse("wait cancelled", "ECANCELED");
          }
          break;  // the wait times out
        }
        lock.unlock();
        processes_.GrantOutput(id, static_cast<int64_t>(data.size()));  // taken from the table
        lock.lock();
        continue;
      }
      if (out->ended && out->chunks.empty()) break;
      if (left <= 0) break;
      // Short slices: a CANCEL sets call.cancelled without notifying this condition variable.
      out->cv.wait_for(lock, std::chrono::milliseconds(std::min<int64_t>(left, 50)));
    }
    out->waiting = false;
    exit = out->exit;
    // The end comes after the last output: not while some is still queued.
    if (!out->ended || !out->chunks.empty()) exit.exited = false;
  }
  proto::Frame response = OkResponse();
  response.header["exited"] = exit.exited;
  if (exit.exited) {
    response.header["exit_code"] = exit.signal ? 128 + exit.signal : exit.exit_code;
    response.header["signal"] = exit.signal;
    response.header["duration_ms"] = exit.duration_ms;
  }
  return response;
}

proto::Frame Agent::HandleSync(const json::object& header) {
  Fields f(header);
  const json::value* op = header.if_contains("op");
  if (op && op->is_string() && op->as_string() == "thaw") {
    ThawResult t = freezer_.Thaw();
    proto::Frame response = OkResponse();
    response.header["was_frozen"] = t.was_frozen;
    response.header["resumed"] = t.resumed;
    response.header["auto_thawed"] = t.auto_thawed;
    return response;
  }
  bool freeze = f.Bool("freeze", false);
  int64_t settle_ms = f.Int("settle_ms", 2000);
  int64_t max_frozen_ms = f.Int("max_frozen_ms", 60000);
  if (!f.ok()) return ErrorResponse(f.error(), "EINVAL");
  proto::Frame response = OkResponse();
  if (freeze) {
    FreezeResult fr = freezer_.Freeze(settle_ms, max_frozen_ms);
    if (!fr.ok && fr.not_stopped.empty()) return ErrorResponse(fr.error, fr.errno_name);
    response.header["frozen"] = true;
    response.header["stopped"] = fr.stopped;
    json::array still;
    for (pid_t pid : fr.not_stopped) still.emplace_back(static_cast<int64_t>(pid));
    response.header["not_stopped"] = std::move(still);
  }
  json::array synced;
  for (const PathSync& p : SyncFilesystems({options_.workspace, options_.state_dir})) {
    if (!p.ok) {
      if (freeze) freezer_.Thaw();
      return ErrorResponse(p.error, p.errno_name);
    }
    synced.emplace_back(p.path);
  }
  response.header["synced"] = std::move(synced);
  return response;
}

proto::Frame Agent::HandleReseed(const std::string& payload) {
  ReseedResult r = reseeder_.Reseed(payload);
  if (!r.ok) return ErrorResponse(r.error, r.errno_name);
  proto::Frame response = OkResponse();
  auto steps = [](const std::vector<ReseedStep>& in) {
    json::array out;
    for (const ReseedStep& s : in) {
      out.push_back(json::object{{"name", s.name}, {"status", s.status}, {"detail", s.detail}});
    }
    return out;
  };
  response.header["kernel"] = steps(r.kernel);
  response.header["hooks"] = steps(r.hooks);
  return response;
}

}  // namespace esb::agent
