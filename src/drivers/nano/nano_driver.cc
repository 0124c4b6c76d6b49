#include "drivers/nano/nano_driver.h"

#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <boost/json.hpp>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/protocol.h"
#include "common/util.h"
#include "drivers/nano/wire.h"

extern char** environ;

namespace esb {

using nano::GetInt;
using nano::GetStr;
using nano::Msg;
using nano::NowMonoMs;
using nano::RecvMsg;
using nano::SendMsg;

struct NanoDriver::Server {
  pid_t pid = -1;
  UniqueFd fd;
  std::string guest;
};

struct NanoDriver::Session {
  std::mutex mu;
  UniqueFd fd;
  int pid = -1;
  bool dead = false;
  int64_t memory_mb = 0;
  int64_t ws_bytes = 0;
  std::map<std::string, std::string> env;
};

namespace {

constexpr int64_t kServerStartMs = 20000;
constexpr int64_t kControlTimeoutMs = 10000;

std::string JoinNul(const std::vector<std::string>& v) {
  std::string out;
  for (size_t i = 0; i < v.size(); i++) {
    if (i) out.push_back('\0');
    out += v[i];
  }
  return out;
}

std::string EnvBlock(const std::map<std::string, std::string>& env) {
  std::vector<std::string> kv;
  for (const auto& [k, v] : env) kv.push_back(k + "=" + v);
  return JoinNul(kv);
}

absl::Status ReplyStatus(const Msg& rep, const std::string& what) {
  if (GetStr(rep, "ok") == "1") return absl::OkStatus();
  // The same errno → Status (→ HTTP) mapping as the container tier's agent (common/util.h).
  return ErrnoNameStatus(GetStr(rep, "errno"), absl::StrCat(what, ": ", GetStr(rep, "error")));
}

// Round trip on a worker/server channel with a deadline. `got_fd`: accept an fd in the reply.
absl::StatusOr<Msg> Call(int fd, const Msg& req, int64_t timeout_ms, int pass_fd = -1,
                         int* got_fd = nullptr) {
  if (!SendMsg(fd, proto::FrameType::kRequest, req, pass_fd)) {
    return absl::UnavailableError(absl::StrCat("nano: send: ", strerror(errno)));
  }
  Msg rep;
  bool timed_out = false;
  if (!RecvMsg(fd, proto::FrameType::kResponse, &rep, got_fd, NowMonoMs() + timeout_ms,
               &timed_out)) {
    if (timed_out) return absl::DeadlineExceededError("nano: worker did not answer in time");
    return absl::UnavailableError("nano: worker channel closed");
  }
  return rep;
}

}  // namespace

// images/python-wasm/README.md, "esb_run" step 4 (ABI 1):
// {"abi":1,"status":"ok|exception|exit|unsupported","exit_code":n,
//  "error":null|{"type","message","traceback","unsupported":null|"module:X"|"socket"|...}}
void ParseGuestResult(const std::string& json, RunResult* result) {
  boost::system::error_code ec;
  boost::json::value v = boost::json::parse(json, ec);
  if (ec || !v.is_object()) return;
  auto str = [](const boost::json::object& o, const char* key) -> std::string {
    auto it = o.find(key);
    if (it == o.end() || !it->value().is_string()) return "";
    return std::string(it->value().as_string());
  };
  const auto& o = v.as_object();
  auto err = o.find("error");
  if (err == o.end() || !err->value().is_object()) return;
  const auto& e = err->value().as_object();
  if (!str(e, "type").empty()) {
    result->error = RunError{str(e, "type"), str(e, "message"), str(e, "traceback")};
  }
  std::string unsupported = str(e, "unsupported");
  if (unsupported.rfind("module:", 0) == 0) unsupported = unsupported.substr(7);
  result->unsupported_module = unsupported;
}

NanoDriver::NanoDriver(NanoDriverOptions options) : options_(std::move(options)) {}

NanoDriver::~NanoDriver() {
  std::lock_guard<std::mutex> lock(server_mu_);
  if (server_) {
    // Closing the control channel makes the server kill its workers and exit.
    server_->fd.reset();
    if (server_->pid > 0) {
      kill(server_->pid, SIGKILL);
      waitpid(server_->pid, nullptr, 0);
    }
  }
  // Workers die with the server (PDEATHSIG); remove the cgroups once they are empty.
  for (int i = 0; i < 50 && !cgroups_.empty(); i++) {
    std::vector<std::string> left;
    for (const std::string& dir : cgroups_) {
      if (rmdir(dir.c_str()) != 0 && errno == EBUSY) left.push_back(dir);
    }
    cgroups_ = std::move(left);
    if (!cgroups_.empty()) usleep(10000);
  }
}

std::unique_ptr<NanoDriver> NewNanoDriver(NanoDriverOptions options) {
  return std::make_unique<NanoDriver>(std::move(options));
}

absl::StatusOr<NanoDriverOptions> PythonNanoOptions(const std::string& worker_path,
                                                    const std::string& artefact_dir) {
  std::string pack = artefact_dir + "/stdlib.pack";
  for (const std::string& f : {worker_path, pack}) {
    if (access(f.c_str(), R_OK) != 0) return ErrnoStatus(absl::StrCat("nano: ", f));
  }
  NanoDriverOptions o;
  o.worker_path = worker_path;
  o.worker_args = {absl::StrCat("--pack=", pack, ":/usr/lib/python3.11")};
  return o;
}

std::string NanoDriver::Describe() const {
  return absl::StrCat("wasm2c guest in seccomp-confined workers forked from ",
                      options_.worker_path);
}

std::vector<std::string> NanoDriver::JoinCgroup(int pid) {
  std::vector<std::string> joined;
  if (options_.cgroup_name.empty() || geteuid() != 0) return joined;
  auto in_place = [](const std::string& path, const std::string& value) {
    FILE* f = fopen(path.c_str(), "w");
    if (!f) return false;
    bool ok = fputs(value.c_str(), f) >= 0;
    return fclose(f) == 0 && ok;
  };
  std::string mem = std::to_string(options_.cgroup_memory_mb << 20);
  std::string pids = std::to_string(options_.cgroup_pids_max);
  // SECURITY: an aggregate ceiling for everything nano runs; workers cannot leave it (no
  // cgroupfs access under seccomp, uid nobody).
  if (access("/sys/fs/cgroup/cgroup.controllers", F_OK) == 0) {  // pure v2
    std::string dir = "/sys/fs/cgroup/" + options_.cgroup_name;
    mkdir(dir.c_str(), 0755);
    if (!in_place(dir + "/memory.max", mem) || !in_place(dir + "/pids.max", pids)) {
      LogWarn(absl::StrCat("nano: cannot set the limits of ", dir, ": ", strerror(errno)));
    }
    if (in_place(dir + "/cgroup.procs", std::to_string(pid))) joined.push_back(dir);
    return joined;
  }
  for (const auto& [ctl, file, value] :
       {std::tuple<std::string, std::string, std::string>{"memory", "memory.limit_in_bytes", mem},
        {"pids", "pids.max", pids}}) {
    std::string dir = "/sys/fs/cgroup/" + ctl + "/" + options_.cgroup_name;
    if (access(("/sys/fs/cgroup/" + ctl).c_str(), F_OK) != 0) continue;
    mkdir(dir.c_str(), 0755);
    if (!in_place(dir + "/" + file, value)) {
      LogWarn(absl::StrCat("nano: cannot set ", dir, "/", file, ": ", strerror(errno)));
    }
    if (in_place(dir + "/cgroup.procs", std::to_string(pid))) joined.push_back(dir);
  }
  return joined;
}

absl::Status NanoDriver::EnsureServer() {
  // Caller holds server_mu_.
  if (server_) {
    int st;
    if (waitpid(server_->pid, &st, WNOHANG) == 0) return absl::OkStatus();
    LogWarn("nano: fork server died; restarting (sessions are lost)");
    server_.reset();
  }
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
    return ErrnoStatus("nano: socketpair");
  }
  UniqueFd ours(sv[0]), theirs(sv[1]);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  // SECURITY: the server gets exactly stdin/stdout/stderr and its control socket as fd 3.
  posix_spawn_file_actions_adddup2(&fa, theirs.get(), 3);
  std::vector<std::string> args = {options_.worker_path, "--server", "--fd=3"};
  args.insert(args.end(), options_.worker_args.begin(), options_.worker_args.end());
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  char* envp[] = {nullptr};
  pid_t pid;
  // Clean signal state: esbd's threads may block or ignore signals the server relies on.
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t none, all;
  sigemptyset(&none);
  sigfillset(&all);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setsigdefault(&attr, &all);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  int rc = posix_spawn(&pid, options_.worker_path.c_str(), &fa, &attr, argv.data(), envp);
  posix_spawnattr_destroy(&attr);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) return ErrnoStatus(absl::StrCat("nano: spawn ", options_.worker_path), rc);
  theirs.reset();
  // Before it forks anything: its workers inherit the cgroup.
  cgroups_ = JoinCgroup(pid);
  Msg ready;
  bool timed_out = false;
  if (!RecvMsg(ours.get(), proto::FrameType::kResponse, &ready, nullptr,
               NowMonoMs() + kServerStartMs, &timed_out) ||
      GetStr(ready, "op") != "ready") {
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    return absl::UnavailableError(
        absl::StrCat("nano: fork server ", options_.worker_path, " failed to start"));
  }
  server_ = std::make_unique<Server>();
  server_->pid = pid;
  server_->fd = std::move(ours);
  server_->guest = GetStr(ready, "guest");
  return absl::OkStatus();
}

absl::Status NanoDriver::Spawn(bool session, int64_t memory_mb, int64_t ws_bytes,
                               const std::map<std::string, std::string>& env, int* fd,
                               int* pid) {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
    return ErrnoStatus("nano: socketpair");
  }
  UniqueFd ours(sv[0]), theirs(sv[1]);
  Msg req{{"op", "spawn"},
          {"mode", session ? "session" : "oneshot"},
          {"memory_pages", std::to_string(memory_mb * 16)},
          {"ws_max_bytes", std::to_string(ws_bytes)},
          {"ws_max_files", std::to_string(options_.workspace_max_files)}};
  if (!env.empty()) req["env"] = EnvBlock(env);
  absl::StatusOr<Msg> rep;
  int handed = -1;  // a pre-forked worker's channel, if the server hands one over
  {
    std::lock_guard<std::mutex> lock(server_mu_);
    for (int attempt = 0; attempt < 2; attempt++) {
      if (absl::Status s = EnsureServer(); !s.ok()) return s;
      // SECURITY: the worker's end of the channel is handed to the server, which forks the
      // worker with it; we keep only our end.
      rep = Call(server_->fd.get(), req, kControlTimeoutMs, theirs.get(), &handed);
      if (rep.ok()) break;
      server_->fd.reset();
      kill(server_->pid, SIGKILL);
      waitpid(server_->pid, nullptr, 0);
      server_.reset();
    }
  }
  if (handed >= 0) ours.reset(handed);
  if (!rep.ok()) return rep.status();
  if (absl::Status s = ReplyStatus(*rep, "nano: spawn"); !s.ok()) return s;
  *pid = static_cast<int>(GetInt(*rep, "pid", -1));
  *fd = ours.release();
  return absl::OkStatus();
}

absl::Status NanoDriver::Kill(int pid) {
  std::lock_guard<std::mutex> lock(server_mu_);
  if (!server_ || pid <= 0) return absl::OkStatus();
  absl::StatusOr<Msg> rep =
      Call(server_->fd.get(), {{"op", "kill"}, {"pid", std::to_string(pid)}}, kControlTimeoutMs);
  return rep.status();
}

absl::StatusOr<std::string> NanoDriver::WorkerStatus(int pid) {
  std::lock_guard<std::mutex> lock(server_mu_);
  if (!server_) return absl::FailedPreconditionError("nano: no fork server");
  absl::StatusOr<Msg> rep = Call(server_->fd.get(),
                                 {{"op", "status"}, {"pid", std::to_string(pid)}},
                                 kControlTimeoutMs);
  if (!rep.ok()) return rep.status();
  if (absl::Status s = ReplyStatus(*rep, "nano: status"); !s.ok()) return s;
  if (GetStr(*rep, "running") == "1") return std::string("running");
  if (rep->count("signal")) return absl::StrCat("signal ", GetStr(*rep, "signal"));
  return absl::StrCat("exit ", GetStr(*rep, "exit"));
}

absl::StatusOr<RunResult> NanoDriver::RunOn(int fd, int pid, const RunRequest& request,
                                            bool* worker_dead, bool oneshot) {
  *worker_dead = false;
  int64_t timeout = request.timeout_ms > 0 ? request.timeout_ms : options_.default_timeout_ms;
  timeout = std::min(timeout, options_.max_timeout_ms);
  int64_t max_out = request.max_output_bytes > 0 ? request.max_output_bytes
                                                 : options_.default_max_output_bytes;
  Msg req{{"op", "run"},
          {"stdin", request.code},
          {"timeout_ms", std::to_string(timeout)},
          {"max_output_bytes", std::to_string(max_out)}};
  if (request.test_no_interrupt) req.insert_or_assign("test_no_interrupt", std::string(1, '1'));
  if (oneshot) {
    // A pre-forked worker gets its limits with the run.
    req["memory_pages"] = std::to_string(request.memory_limit_mb * 16);
    req["ws_max_bytes"] = std::to_string(options_.workspace_max_mb << 20);
    req["ws_max_files"] = std::to_string(options_.workspace_max_files);
  }
  const std::vector<std::string>& argv = request.argv.empty() ? options_.argv : request.argv;
  if (!argv.empty()) req["argv"] = JoinNul(argv);
  int64_t t0 = NowMonoMs();
  RunResult result;
  if (!SendMsg(fd, proto::FrameType::kRequest, req)) {
    *worker_dead = true;
    return absl::UnavailableError("nano: worker is gone");
  }
  Msg rep;
  bool timed_out = false;
  bool got = RecvMsg(fd, proto::FrameType::kResponse, &rep, nullptr,
                     NowMonoMs() + timeout + options_.kill_grace_ms, &timed_out);
  if (!got) {
    *worker_dead = true;
    // SECURITY: the SIGKILL backstop: a guest that ignores the interrupt flag, or a worker
    // that died (seccomp SIGSYS, RLIMIT_CPU SIGXCPU), is reaped by the server.
    (void)Kill(pid);
    absl::StatusOr<std::string> how = WorkerStatus(pid);
    result.exit_code = timed_out ? 124 : 137;
    result.timed_out = timed_out;
    result.instance_reset = true;
    result.stderr_data = timed_out ? absl::StrCat("nano: killed after ", timeout, " ms timeout\n")
                                   : absl::StrCat("nano: worker ", pid, " died (",
                                                  how.ok() ? *how : how.status().ToString(),
                                                  ")\n");
    result.duration_ms = NowMonoMs() - t0;
    return result;
  }
  if (absl::Status s = ReplyStatus(rep, "nano: run"); !s.ok()) return s;
  result.stdout_data = GetStr(rep, "stdout");
  result.stderr_data = GetStr(rep, "stderr");
  result.exit_code = static_cast<int>(GetInt(rep, "exit_code", -1));
  result.timed_out = GetStr(rep, "timed_out") == "1";
  result.truncated = GetStr(rep, "truncated") == "1";
  result.instance_reset = GetStr(rep, "instance_reset") == "1";
  result.duration_exact_ms = static_cast<double>(GetInt(rep, "duration_us")) / 1000.0;
  if (rep.count("result")) ParseGuestResult(GetStr(rep, "result"), &result);
  result.duration_ms = NowMonoMs() - t0;
  return result;
}

CapabilitySet NanoDriver::Capabilities() const {
  return {Capability::kFiles, Capability::kPythonSession, Capability::kPythonOneShot,
          Capability::kFork, Capability::kSnapshot};
}

absl::StatusOr<RunResult> NanoDriver::RunCode(const InstanceRef* session, const RunRequest& request,
                                              const OutputSink&) {
  if (request.memory_limit_mb < 0 || request.memory_limit_mb > options_.max_memory_mb) {
    return absl::InvalidArgumentError(
        absl::StrCat("memory_limit_mb must be 1..", options_.max_memory_mb));
  }
  if (request.timeout_ms < 0) return absl::InvalidArgumentError("timeout_ms must be >= 0");
  if (session == nullptr) {
    int64_t t0 = NowMonoMs();
    int64_t mem = request.memory_limit_mb > 0 ? request.memory_limit_mb
                                              : options_.default_memory_mb;
    int fd = -1, pid = -1;
    if (absl::Status s = Spawn(false, mem, options_.workspace_max_mb << 20, {}, &fd, &pid);
        !s.ok()) {
      return s;
    }
    UniqueFd channel(fd);
    bool dead = false;
    RunRequest req = request;
    req.memory_limit_mb = mem;
    absl::StatusOr<RunResult> r = RunOn(channel.get(), pid, req, &dead, /*oneshot=*/true);
    if (r.ok()) r->duration_ms = NowMonoMs() - t0;
    return r;
  }
  absl::StatusOr<std::shared_ptr<Session>> s = GetSession(*session);
  if (!s.ok()) return s.status();
  Session& sess = **s;
  std::lock_guard<std::mutex> lock(sess.mu);
  if (sess.dead) {
    // The previous worker was killed (timeout backstop): start a fresh interpreter.
    int fd = -1, pid = -1;
    if (absl::Status st = Spawn(true, sess.memory_mb, sess.ws_bytes, sess.env, &fd, &pid);
        !st.ok()) {
      return st;
    }
    sess.fd.reset(fd);
    sess.pid = pid;
    sess.dead = false;
  }
  bool dead = false;
  absl::StatusOr<RunResult> r = RunOn(sess.fd.get(), sess.pid, request, &dead, false);
  if (dead) sess.dead = true;
  return r;
}

absl::StatusOr<std::shared_ptr<NanoDriver::Session>> NanoDriver::GetSession(
    const InstanceRef& ref) {
  std::lock_guard<std::mutex> lock(sessions_mu_);
  auto it = sessions_.find(ref.id);
  if (it == sessions_.end()) {
    return absl::NotFoundError(absl::StrCat("nano session ", ref.id, " is not running"));
  }
  return it->second;
}

absl::StatusOr<InstanceRef> NanoDriver::Create(const std::string& id, const EnvSpec& spec) {
  auto sess = std::make_shared<Session>();
  sess->memory_mb = std::clamp<int64_t>(spec.memory_mb, 16, options_.max_memory_mb);
  sess->ws_bytes = std::min<int64_t>(spec.disk_mb, options_.workspace_max_mb) << 20;
  sess->env = spec.env;
  int fd = -1, pid = -1;
  if (absl::Status s = Spawn(true, sess->memory_mb, sess->ws_bytes, sess->env, &fd, &pid);
      !s.ok()) {
    return s;
  }
  sess->fd.reset(fd);
  sess->pid = pid;
  {
    std::lock_guard<std::mutex> lock(sessions_mu_);
    sessions_[id] = sess;
  }
  boost::json::object state{{"pid", pid}, {"memory_mb", sess->memory_mb}};
  return InstanceRef{id, "nano", boost::json::serialize(state)};
}

absl::StatusOr<InstanceRef> NanoDriver::Fork(const InstanceRef& source, const std::string& new_id) {
  absl::StatusOr<std::shared_ptr<Session>> src = GetSession(source);
  if (!src.ok()) return src.status();
  auto copy = std::make_shared<Session>();
  {
    Session& s = **src;
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.dead) return absl::FailedPreconditionError("nano: source session is not running");
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
      return ErrnoStatus("nano: socketpair");
    }
    UniqueFd ours(sv[0]), theirs(sv[1]);
    // SECURITY: the clone's channel is handed to the source worker, which passes it to its
    // copy-on-write clone and closes its own copy.
    absl::StatusOr<Msg> rep = Call(s.fd.get(), {{"op", "fork"}}, kControlTimeoutMs,
                                   theirs.get());
    if (!rep.ok()) return rep.status();
    if (absl::Status st = ReplyStatus(*rep, "nano: fork"); !st.ok()) return st;
    copy->pid = static_cast<int>(GetInt(*rep, "pid", -1));
    copy->fd = std::move(ours);
    copy->memory_mb = s.memory_mb;
    copy->ws_bytes = s.ws_bytes;
    copy->env = s.env;
  }
  {
    std::lock_guard<std::mutex> lock(server_mu_);
    if (!server_) return absl::UnavailableError("nano: fork server gone");
    absl::StatusOr<Msg> rep = Call(server_->fd.get(),
                                   {{"op", "adopt"}, {"pid", std::to_string(copy->pid)}},
                                   kControlTimeoutMs);
    if (!rep.ok()) return rep.status();
    if (absl::Status st = ReplyStatus(*rep, "nano: adopt"); !st.ok()) return st;
  }
  {
    std::lock_guard<std::mutex> lock(sessions_mu_);
    sessions_[new_id] = copy;
  }
  boost::json::object state{{"pid", copy->pid}, {"memory_mb", copy->memory_mb},
                            {"forked_from", source.id}};
  return InstanceRef{new_id, "nano", boost::json::serialize(state)};
}

absl::StatusOr<SnapshotRef> NanoDriver::Snapshot(const InstanceRef& ref, SnapshotContent content) {
  if (content != SnapshotContent::kMemoryAndDisk) {
    return absl::InvalidArgumentError(
        absl::StrCat("nano snapshots hold the interpreter and its in-memory /workspace together (",
                     AbslView(SnapshotContentName(SnapshotContent::kMemoryAndDisk)), "), not ",
                     AbslView(SnapshotContentName(content)), " alone"));
  }
  const std::string id = absl::StrCat("snap_", RandomHex(12));
  absl::StatusOr<InstanceRef> held = Fork(ref, id);
  if (!held.ok()) return held.status();
  return SnapshotRef{id, "nano", content, ref.id, held->state};
}

absl::StatusOr<InstanceRef> NanoDriver::Restore(const SnapshotRef& snapshot,
                                                const std::string& new_id) {
  return Fork(InstanceRef{snapshot.id, "nano", snapshot.state}, new_id);
}

absl::Status NanoDriver::DeleteSnapshot(const SnapshotRef& snapshot) {
  return Destroy(InstanceRef{snapshot.id, "nano", snapshot.state});
}

absl::StatusOr<int> NanoDriver::SessionPid(const InstanceRef& ref) {
  absl::StatusOr<std::shared_ptr<Session>> s = GetSession(ref);
  if (!s.ok()) return s.status();
  std::lock_guard<std::mutex> lock((*s)->mu);
  return (*s)->pid;
}

absl::Status NanoDriver::TestHook(const InstanceRef& ref, const std::string& what) {
  absl::StatusOr<std::shared_ptr<Session>> s = GetSession(ref);
  if (!s.ok()) return s.status();
  std::lock_guard<std::mutex> lock((*s)->mu);
  absl::StatusOr<Msg> rep = Call((*s)->fd.get(), {{"op", "test_hook"}, {"what", what}},
                                 kControlTimeoutMs);
  if (!rep.ok()) {
    (*s)->dead = true;
    return rep.status();
  }
  return ReplyStatus(*rep, "test_hook");
}

absl::Status NanoDriver::Destroy(const InstanceRef& ref) {
  std::shared_ptr<Session> sess;
  {
    std::lock_guard<std::mutex> lock(sessions_mu_);
    auto it = sessions_.find(ref.id);
    if (it == sessions_.end()) return absl::OkStatus();
    sess = it->second;
    sessions_.erase(it);
  }
  std::lock_guard<std::mutex> lock(sess->mu);
  sess->fd.reset();  // the worker exits on EOF
  return Kill(sess->pid);
}

absl::Status NanoDriver::Attach(const InstanceRef& ref) {
  absl::StatusOr<std::shared_ptr<Session>> s = GetSession(ref);
  if (!s.ok()) {
    return absl::UnavailableError(
        "nano sessions live in memory and do not survive a daemon restart");
  }
  return absl::OkStatus();
}

absl::StatusOr<ExecResult> NanoDriver::Exec(const InstanceRef&, const ExecRequest&,
                                            const OutputSink&) {
  return absl::UnimplementedError(
      "nano environments have no shell; use POST /environments/{id}/run");
}

absl::Status NanoDriver::WriteFile(const InstanceRef& ref, const std::string& path,
                                   std::string_view data, int64_t offset, bool truncate) {
  absl::StatusOr<std::shared_ptr<Session>> s = GetSession(ref);
  if (!s.ok()) return s.status();
  std::lock_guard<std::mutex> lock((*s)->mu);
  if ((*s)->dead) return absl::UnavailableError("nano: session worker is not running");
  absl::StatusOr<Msg> rep = Call((*s)->fd.get(),
                                 {{"op", "write"},
                                  {"path", path},
                                  {"data", std::string(data)},
                                  {"offset", std::to_string(offset)},
                                  {"truncate", truncate ? "1" : "0"}},
                                 kControlTimeoutMs);
  if (!rep.ok()) return rep.status();
  return ReplyStatus(*rep, absl::StrCat("write ", path));
}

absl::StatusOr<FileChunk> NanoDriver::ReadFile(const InstanceRef& ref, const std::string& path,
                                               int64_t offset, int64_t length) {
  absl::StatusOr<std::shared_ptr<Session>> s = GetSession(ref);
  if (!s.ok()) return s.status();
  std::lock_guard<std::mutex> lock((*s)->mu);
  if ((*s)->dead) return absl::UnavailableError("nano: session worker is not running");
  absl::StatusOr<Msg> rep = Call((*s)->fd.get(),
                                 {{"op", "read"},
                                  {"path", path},
                                  {"offset", std::to_string(offset)},
                                  {"length", std::to_string(length)}},
                                 kControlTimeoutMs);
  if (!rep.ok()) return rep.status();
  if (absl::Status st = ReplyStatus(*rep, absl::StrCat("read ", path)); !st.ok()) return st;
  FileChunk chunk;
  chunk.data = GetStr(*rep, "data");
  chunk.file_size = GetInt(*rep, "size");
  chunk.eof = GetStr(*rep, "eof") == "1";
  return chunk;
}

absl::StatusOr<DirListing> NanoDriver::ListDir(const InstanceRef& ref, const std::string& path) {
  absl::StatusOr<std::shared_ptr<Session>> s = GetSession(ref);
  if (!s.ok()) return s.status();
  std::lock_guard<std::mutex> lock((*s)->mu);
  if ((*s)->dead) return absl::UnavailableError("nano: session worker is not running");
  absl::StatusOr<Msg> rep = Call((*s)->fd.get(), {{"op", "list"}, {"path", path}},
                                 kControlTimeoutMs);
  if (!rep.ok()) return rep.status();
  if (absl::Status st = ReplyStatus(*rep, absl::StrCat("list ", path)); !st.ok()) return st;
  // Fields come in fives: name, type, size, mtime_ms, w|r. Walked lazily, so a worker that
  // sends millions of empty fields costs nothing beyond its message.
  DirListing out;
  std::string fields[5];
  int n = 0;
  const std::string entries = GetStr(*rep, "entries");
  for (absl::string_view piece : absl::StrSplit(entries, '\0')) {
    fields[n++] = std::string(piece.substr(0, 1024));
    if (n < 5) continue;
    n = 0;
    // SECURITY: the worker runs guest code; its listing is cut at the protocol's limit.
    if (out.entries.size() >= proto::kMaxListEntries) {
      out.truncated = true;
      break;
    }
    FileEntry e;
    e.name = fields[0];
    e.type = fields[1];
    e.size = std::strtoll(fields[2].c_str(), nullptr, 10);
    e.mtime_ms = std::strtoll(fields[3].c_str(), nullptr, 10);
    e.mode = e.type == "dir" ? (fields[4] == "w" ? 0755 : 0555) : (fields[4] == "w" ? 0644 : 0444);
    out.entries.push_back(std::move(e));
  }
  return out;
}

// One files-API request on a session's worker (the memfs lives there).
absl::StatusOr<Msg> NanoDriver::FileCall(const InstanceRef& ref, const Msg& request,
                                         const std::string& what) {
  absl::StatusOr<std::shared_ptr<Session>> s = GetSession(ref);
  if (!s.ok()) return s.status();
  std::lock_guard<std::mutex> lock((*s)->mu);
  if ((*s)->dead) return absl::UnavailableError("nano: session worker is not running");
  absl::StatusOr<Msg> rep = Call((*s)->fd.get(), request, kControlTimeoutMs);
  if (!rep.ok()) return rep.status();
  if (absl::Status st = ReplyStatus(*rep, what); !st.ok()) return st;
  return rep;
}

absl::StatusOr<FileEntry> NanoDriver::Stat(const InstanceRef& ref, const std::string& path) {
  absl::StatusOr<Msg> rep =
      FileCall(ref, {{"op", "pathstat"}, {"path", path}}, absl::StrCat("stat ", path));
  if (!rep.ok()) return rep.status();
  FileEntry e;
  size_t slash = path.find_last_of('/');
  e.name = slash == std::string::npos ? path : path.substr(slash + 1);
  e.type = GetStr(*rep, "type") == "dir" ? "dir" : "file";
  e.size = std::max<int64_t>(GetInt(*rep, "size"), 0);
  e.mtime_ms = GetInt(*rep, "mtime_ms");
  bool writable = GetStr(*rep, "access") == "w";
  e.mode = e.type == "dir" ? (writable ? 0755 : 0555) : (writable ? 0644 : 0444);
  return e;
}

absl::StatusOr<bool> NanoDriver::MakeDir(const InstanceRef& ref, const std::string& path) {
  absl::StatusOr<Msg> rep =
      FileCall(ref, {{"op", "mkdir"}, {"path", path}}, absl::StrCat("mkdir ", path));
  if (!rep.ok()) return rep.status();
  return GetStr(*rep, "created") == "1";
}

absl::Status NanoDriver::Remove(const InstanceRef& ref, const std::string& path, bool recursive) {
  return FileCall(ref, {{"op", "remove"}, {"path", path}, {"recursive", recursive ? "1" : "0"}},
                  absl::StrCat("remove ", path))
      .status();
}

absl::Status NanoDriver::Rename(const InstanceRef& ref, const std::string& source,
                                const std::string& destination, bool overwrite) {
  return FileCall(ref,
                  {{"op", "rename"},
                   {"source", source},
                   {"destination", destination},
                   {"overwrite", overwrite ? "1" : "0"}},
                  absl::StrCat("rename ", source, " -> ", destination))
      .status();
}

absl::StatusOr<Usage> NanoDriver::Stats(const InstanceRef& ref) {
  absl::StatusOr<std::shared_ptr<Session>> s = GetSession(ref);
  if (!s.ok()) return s.status();
  std::lock_guard<std::mutex> lock((*s)->mu);
  Usage u;
  if ((*s)->dead) return u;
  absl::StatusOr<Msg> rep = Call((*s)->fd.get(), {{"op", "stat"}}, kControlTimeoutMs);
  if (!rep.ok()) return u;
  u.alive = true;
  u.pids = 1;
  u.cpu_ms = GetInt(*rep, "cpu_ms");
  u.memory_bytes = GetInt(*rep, "guest_memory_bytes") + GetInt(*rep, "workspace_bytes");
  return u;
}

absl::Status NanoDriver::Configure(const InstanceRef& ref,
                                   const std::map<std::string, std::string>& env) {
  absl::StatusOr<std::shared_ptr<Session>> s = GetSession(ref);
  if (!s.ok()) return s.status();
  std::lock_guard<std::mutex> lock((*s)->mu);
  (*s)->env = env;
  if ((*s)->dead) return absl::OkStatus();
  absl::StatusOr<Msg> rep = Call((*s)->fd.get(), {{"op", "env"}, {"env", EnvBlock(env)}},
                                 kControlTimeoutMs);
  if (!rep.ok()) return rep.status();
  return ReplyStatus(*rep, "configure");
}

}  // namespace esb
