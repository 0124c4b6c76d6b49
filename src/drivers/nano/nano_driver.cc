#include "drivers/nano/nano_driver.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <boost/json.hpp>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <set>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/protocol.h"
#include "common/util.h"
#include "drivers/heavy_kernel.h"
#include "drivers/nano/image.h"
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

// The part of an image file's name that says whose it is (12 hex of FNV-1a of the environment
// id): per-environment image caps are counted from the names, so they hold after a restart.
std::string ImageKey(const std::string& source_id) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : source_id) h = (h ^ c) * 1099511628211ull;
  char out[13];
  snprintf(out, sizeof(out), "%012llx", static_cast<unsigned long long>(h & 0xffffffffffffull));
  return out;
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

NanoDriver::NanoDriver(NanoDriverOptions options) : options_(std::move(options)) {
  // The image directory as a previous esbd left it: images half-written when it died
  // (<name>.tmp, renamed when complete) and images the driver made of live clones on its own
  // that the core had not adopted (<name>.e: their steps are lost_on_restart) are removed; the
  // others are counted against the image caps (their owner is in the name).
  if (DIR* d = options_.snapshot_dir.empty() ? nullptr : opendir(options_.snapshot_dir.c_str())) {
    while (dirent* e = readdir(d)) {
      std::string name = e->d_name;
      auto ends = [&](std::string_view tail) {
        return name.size() > tail.size() &&
               name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
      };
      if (ends(".tmp") || ends(".e")) {
        unlinkat(dirfd(d), name.c_str(), 0);
        continue;
      }
      struct stat st;
      if (name.rfind("img_", 0) != 0 ||
          fstatat(dirfd(d), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode)) {
        continue;
      }
      // img_<key>_<random> (older images, img_<random>, count in the total only).
      std::string key = name.size() == 29 && name[16] == '_' ? name.substr(4, 12) : "";
      images_[name] = {key, static_cast<int64_t>(st.st_size)};
    }
    closedir(d);
  }
}

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
          Capability::kFork,  Capability::kSnapshot,      Capability::kSteps};
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
    absl::StatusOr<std::shared_ptr<Session>> fresh =
        StartSession(sess.memory_mb, sess.ws_bytes, sess.env);
    if (!fresh.ok()) return fresh.status();
    sess.fd = std::move((*fresh)->fd);
    sess.pid = (*fresh)->pid;
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

absl::StatusOr<std::shared_ptr<NanoDriver::Session>> NanoDriver::StartSession(
    int64_t memory_mb, int64_t ws_bytes, const std::map<std::string, std::string>& env) {
  auto sess = std::make_shared<Session>();
  sess->memory_mb = memory_mb;
  sess->ws_bytes = ws_bytes;
  sess->env = env;
  int fd = -1, pid = -1;
  if (absl::Status s = Spawn(true, memory_mb, ws_bytes, env, &fd, &pid); !s.ok()) return s;
  sess->fd.reset(fd);
  sess->pid = pid;
  return sess;
}

absl::StatusOr<InstanceRef> NanoDriver::Create(const std::string& id, const EnvSpec& spec) {
  absl::StatusOr<std::shared_ptr<Session>> sess =
      StartSession(std::clamp<int64_t>(spec.memory_mb, 16, options_.max_memory_mb),
                   std::min<int64_t>(spec.disk_mb, options_.workspace_max_mb) << 20, spec.env);
  if (!sess.ok()) return sess.status();
  {
    std::lock_guard<std::mutex> lock(sessions_mu_);
    sessions_[id] = *sess;
  }
  boost::json::object state{{"pid", (*sess)->pid}, {"memory_mb", (*sess)->memory_mb}};
  return InstanceRef{id, "nano", boost::json::serialize(state)};
}

absl::StatusOr<std::shared_ptr<NanoDriver::Session>> NanoDriver::CloneSession(
    const std::string& source_id) {
  absl::StatusOr<std::shared_ptr<Session>> src = GetSession(InstanceRef{source_id, "nano", ""});
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
  return copy;
}

absl::StatusOr<InstanceRef> NanoDriver::Fork(const InstanceRef& source, const std::string& new_id) {
  absl::StatusOr<std::shared_ptr<Session>> copy = CloneSession(source.id);
  if (!copy.ok()) return copy.status();
  return Install(new_id, *copy, source.id);
}

InstanceRef NanoDriver::Install(const std::string& id, std::shared_ptr<Session> session,
                                const std::string& forked_from) {
  boost::json::object state{{"pid", session->pid}, {"memory_mb", session->memory_mb}};
  if (!forked_from.empty()) state["forked_from"] = forked_from;
  std::shared_ptr<Session> old;
  {
    std::lock_guard<std::mutex> lock(sessions_mu_);
    auto [it, inserted] = sessions_.try_emplace(id, session);
    if (!inserted) {
      old = std::move(it->second);
      it->second = std::move(session);
    }
  }
  if (old) KillSession(old);
  return InstanceRef{id, "nano", boost::json::serialize(state)};
}

void NanoDriver::KillSession(const std::shared_ptr<Session>& session) {
  std::lock_guard<std::mutex> lock(session->mu);
  session->fd.reset();  // the worker exits on EOF
  (void)Kill(session->pid);
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
  SnapshotRef snap{id, "nano", content, ref.id, held->state};
  snap.live = true;
  return snap;
}

absl::StatusOr<InstanceRef> NanoDriver::Restore(const SnapshotRef& snapshot,
                                                const std::string& new_id) {
  absl::StatusOr<std::shared_ptr<Session>> sess = SessionFromSnapshot(snapshot);
  if (!sess.ok()) return sess.status();
  return Install(new_id, *sess, snapshot.id);
}

namespace {

// The image file a compact snapshot's state names, checked to be one of ours.
absl::StatusOr<std::string> ImagePath(const std::string& dir, const boost::json::object& state) {
  auto it = state.find("image");
  if (it == state.end() || !it->value().is_string()) {
    return absl::InvalidArgumentError("nano: snapshot state has no image");
  }
  std::string name(it->value().as_string());
  // SECURITY: the name comes from the step log; it must name a file directly in snapshot_dir.
  if (dir.empty() || name.empty() || name.size() > 64 ||
      name.find_first_not_of("0123456789abcdef_img.") != std::string::npos || name[0] == '.') {
    return absl::InvalidArgumentError("nano: bad image name in snapshot state");
  }
  return dir + "/" + name;
}

absl::Status WriteAllFd(int fd, const char* p, size_t n, const std::string& what) {
  while (n > 0) {
    ssize_t w = write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return ErrnoStatus("nano: write " + what);
    p += w;
    n -= static_cast<size_t>(w);
  }
  return absl::OkStatus();
}

absl::StatusOr<boost::json::object> ParseState(const std::string& state) {
  boost::system::error_code ec;
  boost::json::value v = boost::json::parse(state, ec);
  if (ec || !v.is_object()) return absl::InvalidArgumentError("nano: bad snapshot state");
  return v.as_object();
}

int64_t JsonInt(const boost::json::object& o, const char* key, int64_t def) {
  auto it = o.find(key);
  return it != o.end() && it->value().is_int64() ? it->value().as_int64() : def;
}

// The proportional set size of `pid` (its share of the pages it maps), 0 when unreadable.
int64_t PssBytes(int pid) {
  std::string text;
  if (!ReadFileToString(absl::StrCat("/proc/", pid, "/smaps_rollup"), &text).ok()) return 0;
  size_t at = text.find("\nPss:");
  if (at == std::string::npos) return 0;
  return std::strtoll(text.c_str() + at + 5, nullptr, 10) * 1024;
}

// The bytes of the values of `map` owned by `owner` (all when empty); `owner_and_bytes(value)`
// says whose a value is and how many bytes it holds.
template <typename Map, typename Fn>
int64_t SumBytes(const Map& map, const std::string& owner, Fn owner_and_bytes) {
  int64_t total = 0;
  for (const auto& [k, v] : map) {
    auto [who, bytes] = owner_and_bytes(v);
    if (owner.empty() || who == owner) total += bytes;
  }
  return total;
}

// A manifest path from a worker: relative, '/'-separated, no empty/./.. component.
bool ValidManifestPath(const std::string& path) {
  if (path.empty() || path.size() > 4096 || path[0] == '/') return false;
  for (absl::string_view c : absl::StrSplit(path, '/')) {
    if (c.empty() || c == "." || c == "..") return false;
  }
  return true;
}

constexpr int64_t kReadChunk = 16 << 20;     // the worker's read op bound
constexpr int64_t kImageChunk = 32 << 20;    // the worker's dump/load chunk bound
constexpr int64_t kVarsMaxBytes = 64 << 10;  // step_state.h: variables_json ≤ 64 KiB
constexpr int64_t kDumpTimeoutMs = 60000;

}  // namespace

StepMemorySupport NanoDriver::StepMemory() const { return {true, "fork", ""}; }

absl::StatusOr<WorkspaceManifest> NanoDriver::WalkWorkspace(Session& session,
                                                            const CaptureOptions& options,
                                                            BlobStore& blobs) {
  std::lock_guard<std::mutex> lock(session.mu);
  if (session.dead) return absl::UnavailableError("nano: session worker is not running");
  int fd = session.fd.get();
  absl::StatusOr<Msg> rep = Call(
      fd, {{"op", "walk"}, {"max_entries", std::to_string(options.max_files)}}, kControlTimeoutMs);
  if (!rep.ok()) return rep.status();
  if (absl::Status st = ReplyStatus(*rep, "nano: walk"); !st.ok()) return st;
  if (GetStr(*rep, "truncated") == "1") {
    return absl::FailedPreconditionError(
        absl::StrCat("nano: /workspace has more than ", options.max_files, " entries"));
  }
  std::map<std::string, const ManifestEntry*> previous;
  if (options.previous) {
    for (const ManifestEntry& e : options.previous->entries) previous[e.path] = &e;
  }
  WorkspaceManifest out;
  // SECURITY: the worker runs guest code: every field is checked, counts and sizes bounded.
  const std::string entries = GetStr(*rep, "entries");
  nano::ByteReader r(entries);
  std::set<std::string> seen;
  while (!r.done()) {
    uint8_t type = r.U8();
    std::string_view path = r.Str();
    uint64_t size = r.U64();
    uint64_t mtime = r.U64();
    std::string_view key = r.Str();
    if (!r.ok() || type > 1 || key.size() > 64) {
      return absl::InternalError("nano: the worker sent a malformed workspace listing");
    }
    ManifestEntry e;
    e.path = std::string(path.substr(0, 4097));
    if (e.path.find('\0') != std::string::npos) {
      return absl::FailedPreconditionError(
          "nano: a name in /workspace contains a NUL byte; it cannot be recorded");
    }
    if (!ValidManifestPath(e.path) || !seen.insert(e.path).second) {
      return absl::InternalError("nano: the worker reported a bad or repeated workspace path");
    }
    if (static_cast<int64_t>(out.entries.size()) >= options.max_files) {
      return absl::FailedPreconditionError(
          absl::StrCat("nano: /workspace has more than ", options.max_files, " entries"));
    }
    e.type = type == 0 ? ManifestEntry::Type::kDir : ManifestEntry::Type::kFile;
    e.mode = e.type == ManifestEntry::Type::kDir ? 0755 : 0644;
    if (size > (uint64_t{1} << 40)) {
      return absl::InternalError("nano: the worker reported a bad file size");
    }
    e.size = static_cast<int64_t>(size);
    e.mtime_ns = static_cast<int64_t>(std::min<uint64_t>(mtime, INT64_MAX));
    e.change_key = std::string(key);
    out.total_bytes += e.size;
    if (out.total_bytes > options.max_bytes) {
      return absl::FailedPreconditionError(
          absl::StrCat("nano: /workspace holds more than ", options.max_bytes, " bytes"));
    }
    out.entries.push_back(std::move(e));
  }
  std::sort(out.entries.begin(), out.entries.end(),
            [](const ManifestEntry& a, const ManifestEntry& b) { return a.path < b.path; });
  for (ManifestEntry& e : out.entries) {
    if (e.type != ManifestEntry::Type::kFile) continue;
    auto it = previous.find(e.path);
    if (it != previous.end() && it->second->type == ManifestEntry::Type::kFile &&
        !e.change_key.empty() && it->second->change_key == e.change_key &&
        it->second->size == e.size && it->second->mtime_ns == e.mtime_ns &&
        blobs.Has(it->second->sha256)) {
      e.sha256 = it->second->sha256;  // unchanged: not read again
      continue;
    }
    std::string data;
    while (static_cast<int64_t>(data.size()) < e.size) {
      int64_t want = std::min<int64_t>(kReadChunk, e.size - static_cast<int64_t>(data.size()));
      absl::StatusOr<Msg> r = Call(fd,
                                   {{"op", "read"},
                                    {"path", "/workspace/" + e.path},
                                    {"offset", std::to_string(data.size())},
                                    {"length", std::to_string(want)}},
                                   kControlTimeoutMs);
      if (!r.ok()) return r.status();
      if (absl::Status st = ReplyStatus(*r, "nano: read " + e.path); !st.ok()) return st;
      const std::string& chunk = GetStr(*r, "data");
      if (chunk.empty() || static_cast<int64_t>(chunk.size()) > want) {
        return absl::InternalError(absl::StrCat("nano: ", e.path, " changed size during capture"));
      }
      data += chunk;
    }
    absl::StatusOr<std::string> sha = blobs.Put(data);
    if (!sha.ok()) return sha.status();
    e.sha256 = *sha;
  }
  return out;
}

std::string NanoDriver::SummarizeVariables(const std::string& frozen_id) {
  // The same summary as the container tier's kernel (src/agent/python/esb_vars.py).
  const std::string module(EsbVarsSource());
  {
    std::lock_guard<std::mutex> lock(server_mu_);
    if (!server_ || server_->guest != "python") return "";
  }
  // The module's code object, compiled once by the guest in a fresh one-shot interpreter (no
  // user code ever ran there); it only ever goes back into guests, never parsed by esbd.
  std::string code_hex;
  {
    std::lock_guard<std::mutex> lock(vars_mu_);
    if (vars_code_hex_.empty()) {
      std::string hex;
      hex.reserve(module.size() * 2);
      static const char kHex[] = "0123456789abcdef";
      for (unsigned char c : module) {
        hex.push_back(kHex[c >> 4]);
        hex.push_back(kHex[c & 15]);
      }
      RunRequest compile;
      compile.code = absl::StrCat(
          "import marshal, sys\nsys.stdout.write(marshal.dumps(compile(bytes.fromhex('", hex,
          "').decode('utf-8'), 'esb_vars.py', 'exec')).hex())\n");
      compile.timeout_ms = 10000;
      compile.max_output_bytes = 4 << 20;
      absl::StatusOr<RunResult> r = RunCode(nullptr, compile, nullptr);
      if (r.ok() && r->exit_code == 0 && !r->truncated && !r->stdout_data.empty() &&
          r->stdout_data.find_first_not_of("0123456789abcdef") == std::string::npos) {
        vars_code_hex_ = r->stdout_data;
      } else {
        LogWarn("nano: cannot compile esb_vars.py in the guest; no variables summaries");
        return "";
      }
    }
    code_hex = vars_code_hex_;
  }
  absl::StatusOr<std::shared_ptr<Session>> clone = CloneSession(frozen_id);
  if (!clone.ok()) return "";
  // In the throwaway clone only: the session and its frozen step never run this.
  RunRequest req;
  req.code = absl::StrCat(
      "_esb_vars_ns = {'__name__': 'esb_vars'}\n"
      "exec(__import__('marshal').loads(bytes.fromhex('",
      code_hex,
      "')), _esb_vars_ns)\n"
      "import sys as _esb_vars_sys\n"
      "_esb_vars_n = _esb_vars_sys.stdout.write(_esb_vars_ns['summarize'](dict(globals())))\n");
  req.timeout_ms = 5000;
  req.max_output_bytes = kVarsMaxBytes + 1;
  std::string out;
  bool dead = false;
  absl::StatusOr<RunResult> r;
  {
    std::lock_guard<std::mutex> lock((*clone)->mu);
    r = RunOn((*clone)->fd.get(), (*clone)->pid, req, &dead, false);
  }
  if (r.ok() && !dead) {
    // It answered: closing its channel makes it exit by itself, and the fork server reaps it.
    // (SIGKILL + waitpid here would put the teardown of its address space on the capture's
    // critical path.)
    std::lock_guard<std::mutex> lock((*clone)->mu);
    (*clone)->fd.reset();
  } else {
    KillSession(*clone);
  }
  // SECURITY: the summary comes from the sandbox (it runs in the user's globals, which can
  // shadow builtins): kept only when it has the summary's bounded shape, as the container's.
  if (!r.ok() || r->exit_code != 0 || r->truncated ||
      static_cast<int64_t>(r->stdout_data.size()) > kVarsMaxBytes) {
    return "";
  }
  return ValidVariablesJson(r->stdout_data);
}

absl::StatusOr<StepState> NanoDriver::CaptureStep(const InstanceRef& ref,
                                                  const CaptureOptions& options, BlobStore& blobs) {
  absl::StatusOr<std::shared_ptr<Session>> sess = GetSession(ref);
  if (!sess.ok()) return sess.status();
  StepState state;
  std::shared_ptr<Session> source = *sess;  // where the workspace is read
  std::string frozen_id = ref.id;           // what the variables summary forks
  if (options.memory) {
    absl::StatusOr<SnapshotRef> snap = Snapshot(ref, SnapshotContent::kMemoryAndDisk);
    if (!snap.ok()) return snap.status();
    absl::StatusOr<std::shared_ptr<Session>> frozen = GetSession({snap->id, "nano", ""});
    if (!frozen.ok()) return frozen.status();
    source = *frozen;
    frozen_id = snap->id;
    state.memory = *snap;
  }
  absl::StatusOr<WorkspaceManifest> manifest = WalkWorkspace(*source, options, blobs);
  if (!manifest.ok()) {
    if (state.memory) (void)DeleteSnapshot(*state.memory);
    return manifest.status();
  }
  state.workspace = std::move(*manifest);
  if (options.variables) state.variables_json = SummarizeVariables(frozen_id);
  if (state.memory) {
    // The clone is charged to the environment: its PSS now (its share of the pages it still
    // has in common with the session; it grows as the session dirties pages and is measured
    // again at each capture; see README.md "Time travel"), within the live-memory budgets.
    const std::string id = state.memory->id;
    {
      std::lock_guard<std::mutex> lock(live_mu_);
      live_[id] = {ref.id, ++live_seq_, PssBytes(source->pid)};
    }
    const int64_t env_budget =
        (options_.live_snapshot_env_max_mb > 0 ? options_.live_snapshot_env_max_mb
                                               : (*sess)->memory_mb)
        << 20;
    std::optional<SnapshotRef> image;
    if (EnforceLiveBudget(ref.id, id, env_budget, &image)) {
      std::lock_guard<std::mutex> lock(live_mu_);
      if (auto it = live_.find(id); it != live_.end()) state.memory->bytes = it->second.bytes;
    } else {
      state.memory = std::move(image);  // compacted at once, or not kept
    }
  }
  return state;
}

absl::StatusOr<std::shared_ptr<NanoDriver::Session>> NanoDriver::SessionFromSnapshot(
    const SnapshotRef& snapshot) {
  absl::StatusOr<boost::json::object> st = ParseState(snapshot.state);
  if (!st.ok()) return st.status();
  if (!st->contains("image")) {
    std::optional<Released> released;
    {
      std::lock_guard<std::mutex> lock(live_mu_);
      if (auto it = released_.find(snapshot.id); it != released_.end()) released = it->second;
    }
    if (!released) {
      absl::StatusOr<std::shared_ptr<Session>> clone = CloneSession(snapshot.id);
      if (absl::IsNotFound(clone.status())) {
        return absl::FailedPreconditionError(
            "nano: the step's live memory snapshot is gone (esbd or its fork server restarted)");
      }
      return clone;
    }
    // Compacted or released over the live-memory budget (the core has not reconciled it yet).
    if (released->image_state.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "nano: the step's live memory snapshot was released (collected): ", released->why));
    }
    st = ParseState(released->image_state);
    if (!st.ok()) return st.status();
  }
  absl::StatusOr<std::string> path = ImagePath(options_.snapshot_dir, *st);
  if (!path.ok()) return path.status();
  const int64_t memory_mb = std::clamp<int64_t>(
      JsonInt(*st, "memory_mb", options_.default_memory_mb), 16, options_.max_memory_mb);
  const int64_t ws_bytes =
      std::clamp<int64_t>(JsonInt(*st, "ws_bytes", options_.workspace_max_mb << 20), 0,
                          options_.workspace_max_mb << 20);
  std::map<std::string, std::string> env;
  if (auto it = st->find("env"); it != st->end() && it->value().is_object()) {
    for (const auto& [k, v] : it->value().as_object()) {
      if (v.is_string()) env[std::string(k)] = std::string(v.as_string());
    }
  }
  UniqueFd file(open(path->c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
  if (!file) {
    if (errno == ENOENT) {
      return absl::FailedPreconditionError("nano: the step's memory image is gone (collected)");
    }
    return ErrnoStatus("nano: open " + *path);
  }
  absl::StatusOr<std::shared_ptr<Session>> started = StartSession(memory_mb, ws_bytes, env);
  if (!started.ok()) return started.status();
  std::shared_ptr<Session> sess = *std::move(started);
  const int fd = sess->fd.get();
  auto fail = [&](absl::Status s) {
    KillSession(sess);
    return s;
  };
  // Inflate the image in bounded pieces, each sent on as it fills (esbd never holds more than
  // one piece); the total is bounded here and again by the loading worker.
  const int64_t max_image = (sess->memory_mb << 21) + sess->ws_bytes + (16 << 20);
  z_stream zs{};
  if (inflateInit(&zs) != Z_OK) return fail(absl::InternalError("nano: inflateInit"));
  std::string in(1 << 20, '\0'), piece(kImageChunk, '\0');
  size_t filled = 0;
  int64_t total = 0;
  bool end = false;
  absl::Status status;
  auto send = [&]() {
    absl::StatusOr<Msg> rep =
        Call(fd, {{"op", "load_chunk"}, {"data", piece.substr(0, filled)}}, kControlTimeoutMs);
    status = rep.ok() ? ReplyStatus(*rep, "nano: load image") : rep.status();
    filled = 0;
  };
  while (status.ok() && !end) {
    ssize_t got = read(file.get(), in.data(), in.size());
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) {
      status = ErrnoStatus("nano: read " + *path);
      break;
    }
    if (got == 0) {
      status = absl::DataLossError("nano: image truncated (" + *path + ")");
      break;
    }
    zs.next_in = reinterpret_cast<Bytef*>(in.data());
    zs.avail_in = static_cast<uInt>(got);
    while (status.ok() && zs.avail_in > 0 && !end) {
      zs.next_out = reinterpret_cast<Bytef*>(piece.data() + filled);
      zs.avail_out = static_cast<uInt>(piece.size() - filled);
      int rc = inflate(&zs, Z_NO_FLUSH);
      size_t produced = piece.size() - filled - zs.avail_out;
      filled += produced;
      total += static_cast<int64_t>(produced);
      if (rc == Z_STREAM_END) {
        end = true;
        if (zs.avail_in > 0) status = absl::DataLossError("nano: bytes after the image");
      } else if (rc != Z_OK && rc != Z_BUF_ERROR) {
        status = absl::DataLossError("nano: image is corrupt (" + *path + ")");
      }
      if (status.ok() && total > max_image) {
        status = absl::DataLossError("nano: image larger than the session's caps");
      }
      if (status.ok() && (filled == piece.size() || (end && filled > 0))) send();
    }
  }
  if (status.ok()) {
    // Nothing may follow the stream in the file either.
    char extra;
    if (read(file.get(), &extra, 1) != 0)
      status = absl::DataLossError("nano: bytes after the image");
  }
  inflateEnd(&zs);
  if (!status.ok()) return fail(status);
  absl::StatusOr<Msg> rep = Call(fd, {{"op", "load"}}, kDumpTimeoutMs);
  if (!rep.ok()) return fail(rep.status());
  if (absl::Status s = ReplyStatus(*rep, "nano: load image"); !s.ok()) return fail(s);
  return sess;
}

absl::StatusOr<std::shared_ptr<NanoDriver::Session>> NanoDriver::SessionFromManifest(
    const WorkspaceManifest& manifest, int64_t memory_mb, int64_t ws_bytes,
    const std::map<std::string, std::string>& env, BlobStore& blobs) {
  absl::StatusOr<std::shared_ptr<Session>> started = StartSession(memory_mb, ws_bytes, env);
  if (!started.ok()) return started.status();
  std::shared_ptr<Session> sess = *std::move(started);
  const int fd = sess->fd.get();
  auto fail = [&](absl::Status s) {
    KillSession(sess);
    return s;
  };
  for (const ManifestEntry& e : manifest.entries) {
    if (!ValidManifestPath(e.path)) return fail(absl::InvalidArgumentError("bad manifest path"));
    Msg req;
    if (e.type == ManifestEntry::Type::kDir) {
      req = {{"op", "mkdir"}, {"path", "/workspace/" + e.path}};
    } else if (e.type == ManifestEntry::Type::kFile) {
      absl::StatusOr<std::string> data = blobs.Get(e.sha256);
      if (!data.ok()) return fail(data.status());
      req = {{"op", "write"},
             {"path", "/workspace/" + e.path},
             {"data", std::move(*data)},
             {"offset", "0"},
             {"truncate", "1"}};
    } else {
      return fail(absl::UnimplementedError(
          absl::StrCat("nano: ", e.path, ": the in-memory workspace has no symlinks")));
    }
    absl::StatusOr<Msg> rep = Call(fd, req, kControlTimeoutMs);
    if (!rep.ok()) return fail(rep.status());
    if (absl::Status s = ReplyStatus(*rep, "nano: restore " + e.path); !s.ok()) return fail(s);
  }
  return sess;
}

absl::StatusOr<InstanceRef> NanoDriver::RestoreStep(const InstanceRef& ref, const StepState& state,
                                                    BlobStore& blobs) {
  // The session's worker may be gone (esbd restarted): a step with a compact image, or a
  // files-only step, still comes back (the latter with the instance's recorded memory cap).
  absl::StatusOr<std::shared_ptr<Session>> current = GetSession(ref);
  absl::StatusOr<std::shared_ptr<Session>> sess;
  if (state.memory) {
    sess = SessionFromSnapshot(*state.memory);
  } else {
    int64_t memory_mb = options_.default_memory_mb, ws_bytes = options_.workspace_max_mb << 20;
    std::map<std::string, std::string> env;
    if (current.ok()) {
      std::lock_guard<std::mutex> lock((*current)->mu);
      memory_mb = (*current)->memory_mb;
      ws_bytes = (*current)->ws_bytes;
      env = (*current)->env;
    } else if (absl::StatusOr<boost::json::object> st = ParseState(ref.state); st.ok()) {
      memory_mb =
          std::clamp<int64_t>(JsonInt(*st, "memory_mb", memory_mb), 16, options_.max_memory_mb);
    }
    sess = SessionFromManifest(state.workspace, memory_mb, ws_bytes, env, blobs);
  }
  if (!sess.ok()) return sess.status();
  return Install(ref.id, *sess, state.memory ? state.memory->id : "");
}

absl::StatusOr<InstanceRef> NanoDriver::ForkStep(const StepState& state, const EnvSpec& spec,
                                                 const std::string& new_id, BlobStore& blobs) {
  absl::StatusOr<std::shared_ptr<Session>> sess;
  if (state.memory) {
    sess = SessionFromSnapshot(*state.memory);
  } else {
    sess = SessionFromManifest(
        state.workspace, std::clamp<int64_t>(spec.memory_mb, 16, options_.max_memory_mb),
        std::min<int64_t>(spec.disk_mb, options_.workspace_max_mb) << 20, spec.env, blobs);
  }
  if (!sess.ok()) return sess.status();
  return Install(new_id, *sess, state.memory ? state.memory->id : "");
}

absl::StatusOr<std::string> NanoDriver::DumpImage(const std::string& id,
                                                  const std::string& source_id,
                                                  const std::string& suffix, int64_t* bytes) {
  if (options_.snapshot_dir.empty()) {
    return absl::FailedPreconditionError("nano: no snapshot directory configured");
  }
  absl::StatusOr<std::shared_ptr<Session>> frozen = GetSession({id, "nano", ""});
  if (!frozen.ok()) {
    return absl::FailedPreconditionError(
        "nano: the live memory snapshot is gone (esbd or its fork server restarted)");
  }
  const std::string key = ImageKey(source_id);
  const int64_t env_cap = options_.image_env_max_mb << 20, cap = options_.image_max_mb << 20;
  auto over_caps = [&](int64_t adding) -> absl::Status {
    // Caller holds images_mu_.
    auto owner_and_bytes = [](const std::pair<std::string, int64_t>& image) { return image; };
    const int64_t env_used = SumBytes(images_, key, owner_and_bytes);
    const int64_t used = SumBytes(images_, "", owner_and_bytes);
    if (env_used + adding > env_cap || (adding == 0 && env_used >= env_cap)) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "nano: this environment's memory images would exceed their cap (", env_used + adding,
          " of ", env_cap, " bytes); the step's memory is not kept"));
    }
    if (used + adding > cap || (adding == 0 && used >= cap)) {
      return absl::ResourceExhaustedError(
          absl::StrCat("nano: the memory images of all environments would exceed their cap (",
                       used + adding, " of ", cap, " bytes); the step's memory is not kept"));
    }
    return absl::OkStatus();
  };
  {
    std::lock_guard<std::mutex> lock(images_mu_);
    if (absl::Status st = over_caps(0); !st.ok()) return st;
  }
  if (mkdir(options_.snapshot_dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return ErrnoStatus("nano: mkdir " + options_.snapshot_dir);
  }
  const std::string name = absl::StrCat("img_", key, "_", RandomHex(6), suffix);
  const std::string path = options_.snapshot_dir + "/" + name;
  const std::string tmp = path + ".tmp";
  boost::json::object state{{"image", name}};
  int64_t size = 0, compressed = 0;
  {
    Session& s = **frozen;
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.dead) return absl::FailedPreconditionError("nano: the snapshot's worker is gone");
    state["memory_mb"] = s.memory_mb;
    state["ws_bytes"] = s.ws_bytes;
    boost::json::object env;
    for (const auto& [k, v] : s.env) env[k] = v;
    state["env"] = std::move(env);
    absl::StatusOr<Msg> rep = Call(s.fd.get(), {{"op", "dump"}}, kDumpTimeoutMs);
    if (!rep.ok()) return rep.status();
    if (GetStr(*rep, "ok") != "1") {
      // A state this guest cannot express in an image (e.g. a file open after it was
      // unlinked): the core keeps what it can and marks the memory collected.
      return absl::UnimplementedError(
          absl::StrCat("nano: this snapshot cannot be compacted: ", GetStr(*rep, "error")));
    }
    size = GetInt(*rep, "size", -1);
    // SECURITY: the clone ran guest code: its image is bounded by its memory and workspace.
    int64_t max = (s.memory_mb << 21) + s.ws_bytes + (16 << 20);
    if (size <= 0 || size > max) return absl::InternalError("nano: bad image size from worker");
    UniqueFd out(open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600));
    if (!out) return ErrnoStatus("nano: create " + tmp);
    // The image goes to disk deflated (zlib, fast level): heap pages compress well.
    z_stream zs{};
    if (deflateInit(&zs, 1) != Z_OK) return absl::InternalError("nano: deflateInit");
    std::string zbuf(1 << 20, '\0');
    absl::Status status;
    auto deflate_some = [&](const char* p, size_t n, int flush) {
      zs.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(p));
      zs.avail_in = static_cast<uInt>(n);
      int rc = Z_OK;
      do {
        zs.next_out = reinterpret_cast<Bytef*>(zbuf.data());
        zs.avail_out = static_cast<uInt>(zbuf.size());
        rc = deflate(&zs, flush);
        if (rc == Z_STREAM_ERROR) {
          status = absl::InternalError("nano: deflate");
          return;
        }
        status = WriteAllFd(out.get(), zbuf.data(), zbuf.size() - zs.avail_out, tmp);
      } while (status.ok() && (zs.avail_out == 0 || (flush == Z_FINISH && rc != Z_STREAM_END)));
    };
    int64_t written = 0;
    while (written < size && status.ok()) {
      absl::StatusOr<Msg> c =
          Call(s.fd.get(), {{"op", "dump_chunk"}, {"offset", std::to_string(written)}},
               kControlTimeoutMs);
      if (!c.ok()) {
        status = c.status();
        break;
      }
      const std::string& data = GetStr(*c, "data");
      if (data.empty() || static_cast<int64_t>(data.size()) > size - written) {
        status = absl::InternalError("nano: bad image chunk from worker");
        break;
      }
      deflate_some(data.data(), data.size(), Z_NO_FLUSH);
      written += static_cast<int64_t>(data.size());
      // SECURITY: the deflated file may not outgrow the caps while it is written either.
      if (status.ok()) {
        std::lock_guard<std::mutex> lock(images_mu_);
        status = over_caps(static_cast<int64_t>(zs.total_out));
      }
    }
    if (status.ok()) deflate_some(nullptr, 0, Z_FINISH);
    compressed = static_cast<int64_t>(zs.total_out);
    deflateEnd(&zs);
    if (status.ok()) {
      // Charged before it is published: two compactions cannot both pass the caps.
      std::lock_guard<std::mutex> lock(images_mu_);
      status = over_caps(compressed);
      if (status.ok()) images_[name] = {key, compressed};
    }
    if (status.ok() && fsync(out.get()) != 0) status = ErrnoStatus("nano: fsync " + tmp);
    if (status.ok() && rename(tmp.c_str(), path.c_str()) != 0) {
      status = ErrnoStatus("nano: rename " + tmp);
    }
    if (!status.ok()) {
      unlink(tmp.c_str());
      ForgetImage(name);
      return status;
    }
  }
  *bytes = compressed;
  return boost::json::serialize(state);
}

void NanoDriver::ForgetImage(const std::string& name) {
  std::lock_guard<std::mutex> lock(images_mu_);
  images_.erase(name);
}

absl::StatusOr<SnapshotRef> NanoDriver::CompactSnapshot(const SnapshotRef& snapshot) {
  absl::StatusOr<boost::json::object> st = ParseState(snapshot.state);
  if (!st.ok()) return st.status();
  if (st->contains("image")) return absl::InvalidArgumentError("nano: snapshot is already compact");
  SnapshotRef out{absl::StrCat("img_", RandomHex(12)), "nano", snapshot.content, snapshot.source_id,
                  ""};
  out.live = false;
  std::optional<Released> released;
  {
    std::lock_guard<std::mutex> lock(live_mu_);
    if (auto it = released_.find(snapshot.id); it != released_.end()) {
      released = std::move(it->second);
      released_.erase(it);
    }
  }
  if (released) {
    // The driver already compacted (or released) it over the live-memory budget: the core
    // adopts the image under its final name (pending ones do not survive a restart).
    if (released->image_state.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("nano: the live memory snapshot was released: ", released->why));
    }
    absl::StatusOr<boost::json::object> image = ParseState(released->image_state);
    if (!image.ok()) return image.status();
    absl::StatusOr<std::string> path = ImagePath(options_.snapshot_dir, *image);
    if (!path.ok()) return path.status();
    const std::string pending((*image)["image"].as_string());
    const std::string name = pending.substr(0, pending.size() - 2);  // without ".e"
    if (rename(path->c_str(), (options_.snapshot_dir + "/" + name).c_str()) != 0) {
      absl::Status failed = ErrnoStatus("nano: rename " + *path);
      unlink(path->c_str());
      ForgetImage(pending);
      return failed;
    }
    {
      std::lock_guard<std::mutex> lock(images_mu_);
      if (auto node = images_.extract(pending)) {
        node.key() = name;
        images_.insert(std::move(node));
      }
    }
    (*image)["image"] = name;
    out.state = boost::json::serialize(*image);
    out.bytes = released->bytes;
    return out;
  }
  absl::StatusOr<std::string> state =
      DumpImage(snapshot.id, snapshot.source_id, /*suffix=*/"", &out.bytes);
  if (!state.ok()) return state.status();
  out.state = *std::move(state);
  (void)DeleteSnapshot(snapshot);  // the live clone is released
  return out;
}

absl::Status NanoDriver::DeleteSnapshot(const SnapshotRef& snapshot) {
  absl::StatusOr<boost::json::object> st = ParseState(snapshot.state);
  std::string pending;  // an image the driver made of it on its own, not adopted yet
  if (!st.ok() || !st->contains("image")) {
    std::lock_guard<std::mutex> lock(live_mu_);
    live_.erase(snapshot.id);
    if (auto it = released_.find(snapshot.id); it != released_.end()) {
      pending = it->second.image_state;
      released_.erase(it);
    }
    if (!pending.empty()) st = ParseState(pending);
  }
  if (st.ok() && st->contains("image")) {
    absl::StatusOr<std::string> path = ImagePath(options_.snapshot_dir, *st);
    if (!path.ok()) return path.status();
    if (unlink(path->c_str()) != 0 && errno != ENOENT) return ErrnoStatus("nano: unlink " + *path);
    ForgetImage(std::string((*st)["image"].as_string()));
    if (pending.empty()) return absl::OkStatus();
  }
  return Destroy(InstanceRef{snapshot.id, "nano", snapshot.state});
}

std::set<std::string> NanoDriver::ReleasedSnapshots(const std::string& source_id) {
  std::lock_guard<std::mutex> lock(live_mu_);
  std::set<std::string> out;
  for (const auto& [id, r] : released_) {
    if (r.source == source_id) out.insert(id);
  }
  return out;
}

bool NanoDriver::HasReleasedSnapshots() {
  std::lock_guard<std::mutex> lock(live_mu_);
  return !released_.empty();
}

int64_t NanoDriver::LiveSnapshotBytes(const std::string& source_id) {
  std::lock_guard<std::mutex> lock(live_mu_);
  return SumBytes(live_, source_id,
                  [](const LiveClone& c) { return std::pair(c.source, c.bytes); });
}

int64_t NanoDriver::ImageBytes(const std::string& source_id) {
  std::lock_guard<std::mutex> lock(images_mu_);
  return SumBytes(images_, source_id.empty() ? "" : ImageKey(source_id),
                  [](const std::pair<std::string, int64_t>& image) { return image; });
}

void NanoDriver::EvictLive(const std::string& id) {
  Released r;
  {
    std::lock_guard<std::mutex> lock(live_mu_);
    auto it = live_.find(id);
    if (it == live_.end()) return;
    r.source = it->second.source;
    live_.erase(it);
  }
  absl::StatusOr<std::string> image = DumpImage(id, r.source, ".e", &r.bytes);
  if (image.ok()) {
    r.image_state = *image;
  } else {
    r.why = std::string(image.status().message());
  }
  std::shared_ptr<Session> clone;
  {
    std::lock_guard<std::mutex> lock(sessions_mu_);
    if (auto it = sessions_.find(id); it != sessions_.end()) {
      clone = std::move(it->second);
      sessions_.erase(it);
    }
  }
  if (!clone) {
    // Released meanwhile by the core (DeleteSnapshot/CompactSnapshot): nothing to reconcile.
    if (image.ok()) (void)DeleteSnapshot({id, "nano", SnapshotContent::kMemoryAndDisk, "", *image});
    return;
  }
  KillSession(clone);
  LogInfo(absl::StrCat("nano: live step snapshot ", id, " of ", r.source,
                       image.ok() ? " compacted" : " released", " over the live-memory budget",
                       image.ok() ? "" : absl::StrCat(" (", r.why, ")")));
  std::lock_guard<std::mutex> lock(live_mu_);
  released_[id] = std::move(r);
}

bool NanoDriver::EnforceLiveBudget(const std::string& source_id, const std::string& fresh,
                                   int64_t env_budget, std::optional<SnapshotRef>* fresh_image) {
  const int64_t budget = (options_.live_snapshot_max_mb > 0 ? options_.live_snapshot_max_mb
                                                            : options_.cgroup_memory_mb / 2)
                         << 20;
  // What an older clone holds alone grows as the session dirties the pages it shares: its PSS
  // is measured again at the captures of its environment — the newest few (whose pages the
  // session dirties most) at every capture, all of them at every 8th (one smaps_rollup costs
  // ~0.1-0.3 ms; up to 256 clones per environment).
  constexpr size_t kRemeasureNewest = 4;
  std::vector<std::pair<uint64_t, std::string>> mine;  // newest first
  bool all = false;
  {
    std::lock_guard<std::mutex> lock(live_mu_);
    for (const auto& [id, c] : live_) {
      if (c.source == source_id && id != fresh) mine.emplace_back(c.seq, id);
    }
    if (auto it = live_.find(fresh); it != live_.end()) all = it->second.seq % 8 == 0;
  }
  std::sort(mine.rbegin(), mine.rend());
  if (!all && mine.size() > kRemeasureNewest) mine.resize(kRemeasureNewest);
  for (const auto& [seq, id] : mine) {
    absl::StatusOr<int> pid = SessionPid({id, "nano", ""});
    if (!pid.ok()) continue;
    const int64_t bytes = PssBytes(*pid);
    std::lock_guard<std::mutex> lock(live_mu_);
    if (auto it = live_.find(id); it != live_.end()) it->second.bytes = bytes;
  }
  while (true) {
    std::string victim;
    {
      std::lock_guard<std::mutex> lock(live_mu_);
      auto owner_and_bytes = [](const LiveClone& c) { return std::pair(c.source, c.bytes); };
      const bool env_over = SumBytes(live_, source_id, owner_and_bytes) > env_budget;
      if (!env_over && SumBytes(live_, "", owner_and_bytes) <= budget) return true;
      // The oldest other clone (of this environment when it is over its own budget), else the
      // fresh one itself.
      uint64_t oldest = UINT64_MAX;
      for (const auto& [id, c] : live_) {
        if (id == fresh || (env_over && c.source != source_id) || c.seq >= oldest) continue;
        oldest = c.seq;
        victim = id;
      }
      if (victim.empty()) victim = fresh;
    }
    if (victim != fresh) {
      EvictLive(victim);
      continue;
    }
    // The fresh clone alone is over a budget: this step's memory goes straight to an image.
    SnapshotRef image{absl::StrCat("img_", RandomHex(12)), "nano", SnapshotContent::kMemoryAndDisk,
                      source_id, ""};
    absl::StatusOr<std::string> state = DumpImage(fresh, source_id, "", &image.bytes);
    (void)DeleteSnapshot({fresh, "nano", SnapshotContent::kMemoryAndDisk, source_id, "{}"});
    if (state.ok()) {
      image.state = *state;
      *fresh_image = image;
    } else {
      LogInfo(absl::StrCat("nano: the memory of a step of ", source_id,
                           " is not kept: over the live-memory budget and ",
                           state.status().message()));
      fresh_image->reset();
    }
    return false;
  }
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
  return FileCall(ref,
                  {{"op", "write"},
                   {"path", path},
                   {"data", std::string(data)},
                   {"offset", std::to_string(offset)},
                   {"truncate", truncate ? "1" : "0"}},
                  absl::StrCat("write ", path))
      .status();
}

absl::StatusOr<FileChunk> NanoDriver::ReadFile(const InstanceRef& ref, const std::string& path,
                                               int64_t offset, int64_t length) {
  absl::StatusOr<Msg> rep = FileCall(ref,
                                     {{"op", "read"},
                                      {"path", path},
                                      {"offset", std::to_string(offset)},
                                      {"length", std::to_string(length)}},
                                     absl::StrCat("read ", path));
  if (!rep.ok()) return rep.status();
  FileChunk chunk;
  chunk.data = GetStr(*rep, "data");
  chunk.file_size = GetInt(*rep, "size");
  chunk.eof = GetStr(*rep, "eof") == "1";
  return chunk;
}

absl::StatusOr<DirListing> NanoDriver::ListDir(const InstanceRef& ref, const std::string& path) {
  absl::StatusOr<Msg> rep =
      FileCall(ref, {{"op", "list"}, {"path", path}}, absl::StrCat("list ", path));
  if (!rep.ok()) return rep.status();
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
