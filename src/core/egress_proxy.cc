#include "core/egress_proxy.h"

#include <fcntl.h>
#include <grp.h>
#include <pwd.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace esb {
namespace control = governance::control;

namespace {

// Tenants of detached environments kept for late audit events.
constexpr size_t kMaxDetachedTenants = 1024;
// Unclaimed Results kept (an attach whose caller gave up waiting).
constexpr size_t kMaxPendingResults = 1024;
// A proxy that sent no Health for this long is hung: killed and restarted.
constexpr int64_t kHealthSilenceMs = 4 * control::kHealthIntervalMs;

std::string DescribeWait(int status) {
  if (WIFEXITED(status)) return absl::StrCat("exited with status ", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return absl::StrCat("killed by signal ", WTERMSIG(status));
  return "ended";
}

// Moves `fd` to the lowest free descriptor >= 1000 (in the forked child, before the fixed
// descriptors 3..5 are laid out, so no dup2 overwrites a descriptor still needed).
int MoveHigh(int fd) { return fd < 0 ? -1 : ::fcntl(fd, F_DUPFD, 1000); }

// The upstream CA file as a sealed memfd: esbd reads it (it may be root-only, below a private
// directory), the proxy opens /proc/self/fd/4 (a fresh open of the memfd, which any uid may
// read) and cannot change it.
absl::StatusOr<UniqueFd> SealedCopy(const std::string& path) {
  constexpr size_t kMaxCaFileBytes = 4 << 20;
  std::string data;
  {
    UniqueFd in(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
    struct stat st;
    if (!in) return ErrnoStatus("open --egress-upstream-ca " + path);
    if (::fstat(in.get(), &st) != 0 || !S_ISREG(st.st_mode)) {
      return absl::InvalidArgumentError("--egress-upstream-ca " + path + " is not a regular file");
    }
    if (static_cast<size_t>(st.st_size) > kMaxCaFileBytes) {
      return absl::InvalidArgumentError("--egress-upstream-ca " + path + " is over 4 MiB");
    }
    data.resize(static_cast<size_t>(st.st_size));
    ssize_t n = ::pread(in.get(), data.data(), data.size(), 0);
    if (n < 0) return ErrnoStatus("read " + path);
    data.resize(static_cast<size_t>(n));
  }
  UniqueFd fd(::memfd_create("esb-upstream-ca", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd) return ErrnoStatus("memfd_create");
  if (::write(fd.get(), data.data(), data.size()) != static_cast<ssize_t>(data.size())) {
    return ErrnoStatus("write memfd");
  }
  // SECURITY: sealed before it crosses into the proxy: it can read the roots, never change them.
  if (::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL) !=
      0) {
    return ErrnoStatus("seal memfd");
  }
  return fd;
}

}  // namespace

ProxyIdentity FindProxyIdentity() {
  struct passwd pw;
  struct passwd* found = nullptr;
  char buf[4096];
  if (::getpwnam_r("esb-proxy", &pw, buf, sizeof(buf), &found) == 0 && found != nullptr &&
      pw.pw_uid != 0 && pw.pw_gid != 0) {
    return {pw.pw_uid, pw.pw_gid, "user esb-proxy"};
  }
  return {kProxyFallbackId, kProxyFallbackId, absl::StrCat("fallback id ", kProxyFallbackId)};
}

EgressAuditRow ToAuditRow(const control::AuditEvent& event, const std::string& tenant) {
  EgressAuditRow row;
  row.time_ms = event.time_ms;
  row.tenant = tenant;
  row.environment_id = event.env_id;
  row.intents = event.intents;
  row.method = event.method;
  row.host = event.host;
  row.port = event.port;
  row.path = event.path;
  row.status = event.status;
  row.decision = ParseEgressDecision(event.decision).value_or(EgressDecision::kError);
  row.rule_ids = event.rule_ids;
  for (const control::AuditFinding& f : event.findings) {
    if (std::find(row.rule_ids.begin(), row.rule_ids.end(), f.rule_id) == row.rule_ids.end()) {
      row.rule_ids.push_back(f.rule_id);
    }
  }
  row.bytes_up = event.bytes_up;
  row.bytes_down = event.bytes_down;
  row.duration_ms = event.duration_ms;
  row.scheme = event.scheme;
  row.reason = event.reason;
  row.request_headers = event.request_headers;  // RecordEgress masks every line again
  row.body = event.request_body;
  row.body_truncated = event.request_body_truncated;
  // The event carries the redacted body; its size is the original's only when nothing was cut.
  row.body_bytes = event.request_body_truncated ? 0
                                                : static_cast<int64_t>(event.request_body.size());
  row.body_sha256 = event.request_body_sha256;
  return row;
}

ProxyEgressControl::ProxyEgressControl(ProxyEgressOptions options, AuditSink audit_sink)
    : options_(std::move(options)), audit_sink_(std::move(audit_sink)) {
  health_.state = "disabled";
  health_.detail = "not started";
  health_.since_ms = NowUnixMs();
}

ProxyEgressControl::~ProxyEgressControl() { Stop(); }

absl::Status ProxyEgressControl::Start() {
  std::string why;
  if (options_.proxy_binary.empty()) {
    why = "no esb-proxy binary configured";
  } else if (::access(options_.proxy_binary.c_str(), X_OK) != 0) {
    why = absl::StrCat("esb-proxy binary ", options_.proxy_binary, ": ", strerror(errno));
  } else if (options_.uid == 0 || options_.gid == 0) {
    why = "esb-proxy must not run as root (uid/gid 0)";
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (started_) return absl::OkStatus();
  if (!why.empty()) {
    health_.detail = why;
    return absl::FailedPreconditionError("egress disabled: " + why);
  }
  started_ = true;
  stopping_ = false;
  health_.state = "starting";
  health_.detail = "";
  health_.since_ms = NowUnixMs();
  supervisor_ = std::thread([this] { SupervisorLoop(); });
  return absl::OkStatus();
}

void ProxyEgressControl::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!started_) return;
    stopping_ = true;
  }
  cv_.notify_all();
  if (supervisor_.joinable()) supervisor_.join();
  std::lock_guard<std::mutex> lock(mu_);
  started_ = false;
  health_.state = "disabled";
  health_.detail = "stopped";
  health_.pid = 0;
  health_.since_ms = NowUnixMs();
}

absl::StatusOr<pid_t> ProxyEgressControl::Spawn(UniqueFd* control) {
  int pair[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) != 0) {
    return ErrnoStatus("socketpair");
  }
  UniqueFd ours(pair[0]);
  UniqueFd theirs(pair[1]);
  UniqueFd exe(::open(options_.proxy_binary.c_str(), O_PATH | O_CLOEXEC));
  if (!exe) return ErrnoStatus("open " + options_.proxy_binary);
  UniqueFd ca;
  if (!options_.upstream_ca.empty()) {
    absl::StatusOr<UniqueFd> copy = SealedCopy(options_.upstream_ca);
    if (!copy.ok()) return copy.status();
    ca = *std::move(copy);
  }
  UniqueFd devnull(::open("/dev/null", O_RDWR | O_CLOEXEC));
  if (!devnull) return ErrnoStatus("open /dev/null");

  std::vector<std::string> args = {"esb-proxy", "--control-fd", "3"};
  for (const std::string& r : options_.resolve) {
    args.push_back("--egress-resolve");
    args.push_back(r);
  }
  if (ca) {
    args.push_back("--egress-upstream-ca");
    args.push_back("/proc/self/fd/4");
  }
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::string env_path = "PATH=/usr/bin:/bin";
  std::string env_lang = "LANG=C.UTF-8";
  char* envp[] = {env_path.data(), env_lang.data(), nullptr};
  const uid_t uid = options_.uid;
  const gid_t gid = options_.gid;
  const pid_t parent = ::getpid();

  const pid_t pid = ::fork();
  if (pid < 0) return ErrnoStatus("fork esb-proxy");
  if (pid == 0) {
    // The child: async-signal-safe calls only until exec.
    // SECURITY: the proxy dies with esbd's supervisor thread (no orphan keeps listeners).
    if (::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || ::getppid() != parent) _exit(125);
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);  // esbd blocks SIGTERM/SIGINT for sigwait
    const int hi_control = MoveHigh(theirs.get());
    const int hi_ca = MoveHigh(ca.get());
    const int hi_exe = MoveHigh(exe.get());
    if (hi_control < 0 || hi_exe < 0 || (ca && hi_ca < 0)) _exit(126);
    // SECURITY: exactly these descriptors cross into the proxy: stdin /dev/null, esbd's
    // stdout/stderr (its log), fd 3 the control socket, fd 4 the upstream CA file (read-only).
    if (::dup2(devnull.get(), 0) != 0 || ::dup2(2, 1) != 1 || ::dup2(hi_control, 3) != 3) {
      _exit(126);
    }
    if (hi_ca >= 0 ? ::dup2(hi_ca, 4) != 4 : (::close(4), false)) _exit(126);
    if (::dup2(hi_exe, 5) != 5) _exit(126);
    ::syscall(SYS_close_range, 6u, ~0u, 0u);
    ::setpgid(0, 0);  // not in esbd's process group (terminal signals)
    struct rlimit no_core = {0, 0};
    ::setrlimit(RLIMIT_CORE, &no_core);  // it holds CA keys
    // SECURITY: the proxy parses hostile traffic: it runs as its own unprivileged uid/gid with
    // no supplementary groups, no capabilities (dropped by setresuid from root) and no way to
    // gain privileges again.
    if (::setgroups(0, nullptr) != 0 || ::setresgid(gid, gid, gid) != 0 ||
        ::setresuid(uid, uid, uid) != 0 || ::getuid() != uid || ::geteuid() != uid) {
      _exit(126);
    }
    if (::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) _exit(126);
    if (::chdir("/") != 0) _exit(126);
    ::syscall(SYS_execveat, 5, "", argv.data(), envp, AT_EMPTY_PATH);
    _exit(127);
  }
  *control = std::move(ours);
  return pid;
}

void ProxyEgressControl::SetState(const std::string& state, const std::string& detail) {
  std::lock_guard<std::mutex> lock(mu_);
  health_.state = state;
  health_.detail = detail;
  health_.since_ms = NowUnixMs();
}

void ProxyEgressControl::SupervisorLoop() {
  int64_t backoff = options_.min_backoff_ms;
  int64_t last_health = 0;
  while (true) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) break;
    }
    UniqueFd control;
    absl::StatusOr<pid_t> pid = Spawn(&control);
    const int64_t started = MonotonicMs();
    std::string ended;
    if (!pid.ok()) {
      ended = absl::StrCat("could not start: ", pid.status().message());
    } else {
      uint64_t gen = 0;
      {
        std::lock_guard<std::mutex> lock(mu_);
        gen = ++generation_;
        ready_ = false;
        closed_ = false;
        serving_ = false;
        results_.clear();
        for (auto& [id, entry] : entries_) entry.attached = false;
        if (gen > 1) ++health_.restarts;
        health_.pid = *pid;
        health_.state = "starting";
        health_.since_ms = NowUnixMs();
        last_health = MonotonicMs();
      }
      LogInfo(absl::StrCat("egress: started esb-proxy pid ", *pid, " (uid ", options_.uid, ")"));
      Client::Callbacks callbacks;
      callbacks.on_audit = [this](control::AuditEvent event) { OnAudit(std::move(event)); };
      callbacks.on_health = [this, gen, &last_health](const control::Health& h) {
        std::lock_guard<std::mutex> lock(mu_);
        if (gen != generation_) return;
        ready_ = true;
        last_health = MonotonicMs();
        health_.connections = h.connections;
        health_.requests_total = h.requests_total;
        health_.blocked_total = h.blocked_total;
        health_.refused_connections = h.refused_connections;
        health_.refused_body_budget = h.refused_body_budget;
        health_.refused_dlp_busy = h.refused_dlp_busy;
        health_.refused_resolve_busy = h.refused_resolve_busy;
        health_.audit_dropped = h.audit_dropped;
        cv_.notify_all();
      };
      callbacks.on_result = [this, gen](const control::Result& r) {
        std::lock_guard<std::mutex> lock(mu_);
        if (gen != generation_) return;
        if (results_.size() >= kMaxPendingResults) results_.erase(results_.begin());
        results_[r.seq] = r;
        cv_.notify_all();
      };
      callbacks.on_closed = [this, gen](const absl::Status& status) {
        std::lock_guard<std::mutex> lock(mu_);
        if (gen != generation_) return;
        closed_ = true;
        close_reason_ = std::string(status.message());
        cv_.notify_all();
      };
      auto client = std::make_shared<Client>(std::move(control), std::move(callbacks));
      bool ready = false;
      {
        std::unique_lock<std::mutex> lock(mu_);
        client_ = client;
        cv_.wait_for(lock, std::chrono::milliseconds(options_.ready_timeout_ms),
                     [&] { return ready_ || closed_ || stopping_; });
        ready = ready_ && !closed_ && !stopping_;
        if (ready) {
          health_.state = "up";
          health_.detail = "";
          health_.since_ms = NowUnixMs();
        }
      }
      if (ready) {
        LogInfo(absl::StrCat("egress: esb-proxy pid ", *pid, " is up"));
        ReattachAll(client, gen);
        std::unique_lock<std::mutex> lock(mu_);
        while (!closed_ && !stopping_) {
          cv_.wait_for(lock, std::chrono::milliseconds(500));
          if (MonotonicMs() - last_health > kHealthSilenceMs) {
            ended = absl::StrCat("sent no health report for ", kHealthSilenceMs, " ms (hung)");
            break;
          }
        }
      } else {
        std::lock_guard<std::mutex> lock(mu_);
        if (!closed_ && !stopping_) {
          ended = absl::StrCat("not ready within ", options_.ready_timeout_ms, " ms");
        }
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (ended.empty() && closed_) ended = "control socket closed: " + close_reason_;
        client_.reset();
        ready_ = false;
        serving_ = false;
        for (auto& [id, entry] : entries_) entry.attached = false;
        ++generation_;  // waiters of this proxy's Results give up now
        cv_.notify_all();
      }
      // Dropping the client closes esbd's end (the proxy exits on EOF); wait briefly, then
      // make sure.
      client.reset();
      int status = 0;
      pid_t reaped = 0;
      for (int i = 0; i < 20 && reaped == 0; ++i) {
        reaped = ::waitpid(*pid, &status, WNOHANG);
        if (reaped == 0) std::this_thread::sleep_for(std::chrono::milliseconds(25));
      }
      if (reaped == 0) {
        // SECURITY: the pid is our own unreaped child, so it cannot have been recycled.
        ::kill(*pid, SIGKILL);
        reaped = ::waitpid(*pid, &status, 0);
      }
      if (reaped == *pid) absl::StrAppend(&ended, ended.empty() ? "" : "; ", DescribeWait(status));
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      health_.pid = 0;
      if (stopping_) break;
    }
    if (MonotonicMs() - started >= options_.stable_after_ms) backoff = options_.min_backoff_ms;
    const std::string detail = absl::StrCat("esb-proxy ", ended, "; restarting in ", backoff,
                                            " ms (governed sandboxes' egress fails closed)");
    LogWarn("egress: " + detail);
    SetState("down", detail);
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, std::chrono::milliseconds(backoff), [&] { return stopping_; });
    backoff = std::min(backoff * 2, options_.max_backoff_ms);
  }
}

void ProxyEgressControl::ReattachAll(const std::shared_ptr<Client>& client, uint64_t generation) {
  std::vector<EgressAttachment> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (generation != generation_) return;
    // From here on Attach sends new attachments itself; every earlier one is in `all`.
    serving_ = true;
    attach_wait_expired_ = false;
    cv_.notify_all();  // an Attach waiting for the proxy sends its own attachment now
    for (const auto& [id, entry] : entries_) all.push_back(entry.attachment);
  }
  int ok = 0;
  for (const EgressAttachment& a : all) {
    absl::Status s = SendAttach(client, generation, a);
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(a.env_id);
    if (s.ok() && generation == generation_ && it != entries_.end()) {
      it->second.attached = true;
      ++ok;
    } else if (!s.ok()) {
      LogWarn(absl::StrCat("egress: re-attaching environment ", a.env_id, ": ", s.message()));
    }
  }
  cv_.notify_all();
  if (!all.empty()) {
    LogInfo(absl::StrCat("egress: attached ", ok, " of ", all.size(), " governed environments"));
  }
}

absl::Status ProxyEgressControl::SendAttach(const std::shared_ptr<Client>& client,
                                            uint64_t generation,
                                            const EgressAttachment& attachment) {
  if (!attachment.open_listener) {
    return absl::FailedPreconditionError("egress attachment without a listener");
  }
  absl::StatusOr<UniqueFd> listener = attachment.open_listener();
  if (!listener.ok()) return listener.status();
  control::Attach message;
  message.env_id = attachment.env_id;
  message.tenant = attachment.tenant;
  message.policy = attachment.policy;
  message.intents = attachment.intents;
  message.ca_cert_pem = attachment.ca_cert_pem;
  message.ca_key_pem = attachment.ca_key_pem;
  // SECURITY: the environment's listener goes to the proxy alone; esbd's copy closes when
  // `listener` goes out of scope right after the send, so only the proxy serves it.
  message.listener_fd = listener->get();
  absl::StatusOr<uint32_t> seq = client->Attach(message);
  if (!seq.ok()) {
    return absl::UnavailableError(absl::StrCat("egress proxy: ", seq.status().message()));
  }
  return AwaitResult(generation, *seq);
}

absl::Status ProxyEgressControl::AwaitResult(uint64_t generation, uint32_t seq) {
  std::unique_lock<std::mutex> lock(mu_);
  const bool done = cv_.wait_for(lock, std::chrono::milliseconds(options_.result_timeout_ms), [&] {
    return generation != generation_ || closed_ || results_.count(seq) > 0;
  });
  auto it = results_.find(seq);
  if (generation == generation_ && it != results_.end()) {
    control::Result result = it->second;
    results_.erase(it);
    if (result.ok) return absl::OkStatus();
    return absl::FailedPreconditionError("egress proxy refused: " + result.error);
  }
  if (!done) {
    return absl::DeadlineExceededError(
        absl::StrCat("egress proxy did not answer within ", options_.result_timeout_ms, " ms"));
  }
  return absl::UnavailableError("egress proxy restarted");
}

absl::Status ProxyEgressControl::Attach(const EgressAttachment& attachment) {
  if (attachment.env_id.empty() || attachment.tenant.empty()) {
    return absl::InvalidArgumentError("egress attachment needs an environment id and tenant");
  }
  std::shared_ptr<Client> client;
  uint64_t generation = 0;
  bool was_attached = false;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (!started_ || stopping_) {
      return absl::UnavailableError(
          absl::StrCat("egress is not available on this daemon: ", health_.detail));
    }
    if (!serving_ && !attach_wait_expired_) {
      // The proxy is (re)starting (e.g. right after esbd started): wait for it a bounded time
      // so a new environment has working egress when its create returns. Past that the entry
      // is kept and ReattachAll sends it once the proxy is up (fails closed until then). Once
      // one wait has expired in an outage later callers do not wait, so a proxy that never
      // comes up cannot stall every create.
      if (!cv_.wait_for(lock, std::chrono::milliseconds(options_.attach_wait_ms),
                        [&] { return serving_ || stopping_; })) {
        attach_wait_expired_ = true;
      }
      if (stopping_) return absl::UnavailableError("egress is stopping");
    }
    auto it = entries_.find(attachment.env_id);
    was_attached = it != entries_.end() && it->second.attached && serving_;
    entries_[attachment.env_id] = Entry{attachment, was_attached};
    detached_tenants_.erase(attachment.env_id);
    if (!serving_) return absl::OkStatus();  // ReattachAll sends it once the proxy is up
    client = client_;
    generation = generation_;
  }
  if (was_attached) {
    // Already served through a listener: only policy and intents can have changed.
    return Update(attachment.env_id, attachment.policy, attachment.intents);
  }
  absl::Status status = SendAttach(client, generation, attachment);
  client.reset();  // never the last reference inside the lock
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(attachment.env_id);
  if (status.ok()) {
    if (generation == generation_ && it != entries_.end()) it->second.attached = true;
    cv_.notify_all();
    return absl::OkStatus();
  }
  if (absl::IsUnavailable(status) && generation != generation_) {
    // The proxy died meanwhile: the entry stays and the next proxy gets it (fails closed).
    return absl::OkStatus();
  }
  if (it != entries_.end()) entries_.erase(it);
  return status;
}

absl::Status ProxyEgressControl::Update(const std::string& env_id,
                                        const governance::EgressPolicy& policy,
                                        const std::vector<governance::ActiveIntent>& intents) {
  std::shared_ptr<Client> client;
  uint64_t generation = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(env_id);
    if (it == entries_.end()) {
      return absl::NotFoundError(absl::StrCat("environment ", env_id, " has no egress"));
    }
    // Remembered first: whatever happens next, a re-attach sends this state.
    it->second.attachment.policy = policy;
    it->second.attachment.intents = intents;
    if (!serving_ || !it->second.attached) {
      return absl::UnavailableError(
          "the egress proxy is restarting; the change applies when it is back");
    }
    client = client_;
    generation = generation_;
  }
  absl::StatusOr<uint32_t> seq = client->Update(control::Update{env_id, policy, intents});
  client.reset();
  if (!seq.ok()) {
    return absl::UnavailableError(absl::StrCat("egress proxy: ", seq.status().message()));
  }
  return AwaitResult(generation, *seq);
}

void ProxyEgressControl::Detach(const std::string& env_id) {
  std::shared_ptr<Client> client;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(env_id);
    if (it == entries_.end()) return;
    if (detached_tenants_.size() >= kMaxDetachedTenants) {
      detached_tenants_.erase(detached_tenants_.begin());
    }
    detached_tenants_[env_id] = it->second.attachment.tenant;
    if (serving_ && it->second.attached) client = client_;
    entries_.erase(it);
  }
  if (client) {
    // Not awaited: the environment goes either way (its netns and listener with it).
    absl::StatusOr<uint32_t> seq = client->Detach(env_id);
    if (!seq.ok()) LogWarn(absl::StrCat("egress: detach ", env_id, ": ", seq.status().message()));
  }
}

EgressHealth ProxyEgressControl::Health() const {
  std::lock_guard<std::mutex> lock(mu_);
  EgressHealth h = health_;
  h.environments = static_cast<int64_t>(entries_.size());
  h.attached = 0;
  for (const auto& [id, entry] : entries_) h.attached += entry.attached ? 1 : 0;
  return h;
}

bool ProxyEgressControl::WaitUntilServing(int64_t timeout_ms) {
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms), [&] {
    if (!serving_) return false;
    for (const auto& [id, entry] : entries_) {
      if (!entry.attached) return false;
    }
    return true;
  });
}

std::string ProxyEgressControl::TenantOf(const std::string& env_id) {
  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = entries_.find(env_id); it != entries_.end()) return it->second.attachment.tenant;
  if (auto it = detached_tenants_.find(env_id); it != detached_tenants_.end()) return it->second;
  return "";
}

void ProxyEgressControl::OnAudit(control::AuditEvent event) {
  // SECURITY: the proxy parses hostile traffic, so its word on whose request this was is not
  // taken: the row gets the tenant esbd attached the environment for, and events for an
  // environment esbd never attached are dropped.
  const std::string tenant = TenantOf(event.env_id);
  if (tenant.empty()) {
    LogWarn(absl::StrCat("egress: dropped an audit event for unknown environment '",
                         event.env_id.substr(0, 80), "'"));
    return;
  }
  if (audit_sink_) audit_sink_(ToAuditRow(event, tenant));
}

}  // namespace esb
