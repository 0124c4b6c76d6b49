// EnvironmentManager's processes in environments: interactive terminals (docs/api.md
// "Terminal": the capability check, the per-environment and per-tenant caps, the idle clock and
// the audit rows around a driver's ProcessSession on a PTY; api/terminal_service.cc carries the
// bytes over a WebSocket) and spawned stdio processes (hosted MCP servers, core/mcp_hosts).
#include <chrono>
#include <thread>

#include "absl/strings/str_cat.h"
#include "core/environment_manager.h"

namespace esb {

absl::StatusOr<std::unique_ptr<EnvironmentManager::Process>> EnvironmentManager::OpenTerminal(
    const Caller& caller, const std::string& id, int rows, int cols) {
  auto env = Lookup(caller.tenant, id);
  if (!env.ok()) return env.status();  // nothing happened to an environment: no row
  const std::string detail = absl::StrCat(cols, "x", rows);
  auto refuse = [&](absl::Status st) {
    audit_.Record(
        caller, {.environment_id = id, .action = "terminal.open", .detail = detail, .outcome = st});
    return st;
  };
  if (!(*env)->driver->Capabilities().Has(Capability::kTerminal))
    return refuse(MissingCapabilityError((*env)->driver->name(), Capability::kTerminal));
  if (rows < 1 || rows > 1000 || cols < 1 || cols > 1000)
    return refuse(absl::InvalidArgumentError("terminal rows and cols must be 1-1000"));
  {
    std::lock_guard<std::mutex> lock((*env)->mu);
    if ((*env)->record.state != EnvState::kRunning)
      return refuse(EnvironmentNotFoundError(absl::StrCat(
          "environment ", id, " is being destroyed (", (*env)->record.destroy_reason, ")")));
  }
  // A terminal does not open while a step captures or restores the environment (it would see,
  // or change, a half-restored workspace): it waits for the step lock, for a bounded time. Held
  // until the terminal is registered, so a rewind that follows finds it and closes it.
  std::unique_lock<std::recursive_timed_mutex> step_lock((*env)->step_mu, std::defer_lock);
  if (!step_lock.try_lock_for(std::chrono::milliseconds(options_.terminal_step_wait_ms)))
    return refuse(absl::UnavailableError(absl::StrCat(
        "a step of environment ", id, " (a capture, rewind or fork) has been running for over ",
        options_.terminal_step_wait_ms / 1000, " s; try the terminal again")));
  {
    std::lock_guard<std::mutex> lock(terminals_mu_);
    const int on_env = terminals_by_env_[id];
    const int of_tenant = terminals_by_tenant_[caller.tenant];
    if (on_env >= options_.max_terminals_per_environment) {
      if (on_env == 0) terminals_by_env_.erase(id);
      if (of_tenant == 0) terminals_by_tenant_.erase(caller.tenant);
      return refuse(absl::ResourceExhaustedError(
          absl::StrCat("environment ", id, " already has ", on_env,
                       " open terminals (max_terminals_per_environment)")));
    }
    if (of_tenant >= options_.max_terminals_per_tenant) {
      if (on_env == 0) terminals_by_env_.erase(id);
      if (of_tenant == 0) terminals_by_tenant_.erase(caller.tenant);
      return refuse(absl::ResourceExhaustedError(absl::StrCat(
          "tenant already has ", of_tenant, " open terminals (max_terminals_per_tenant)")));
    }
    ++terminals_by_env_[id];
    ++terminals_by_tenant_[caller.tenant];
  }
  std::unique_ptr<Process> t(new Process());
  t->manager_ = this;  // from here on the destructor releases the slots
  t->terminal_ = true;
  t->caller_ = caller;
  t->env_ = *env;
  t->id_ = id;
  t->start_ms_ = MonotonicMs();
  t->last_activity_ms_ = t->start_ms_;
  Touch(**env);
  ProcessRequest request;
  // Interactive (a PTY on stdin), not a login shell: the image's profile scripts do not run.
  request.argv = {"bash", "-i"};
  request.pty = true;
  request.rows = rows;
  request.cols = cols;
  auto session = (*env)->driver->SpawnProcess((*env)->ref, request);
  if (!session.ok()) {
    t->manager_ = nullptr;  // no close row for a terminal that never opened
    {
      std::lock_guard<std::mutex> lock(terminals_mu_);
      if (--terminals_by_env_[id] <= 0) terminals_by_env_.erase(id);
      if (--terminals_by_tenant_[caller.tenant] <= 0) terminals_by_tenant_.erase(caller.tenant);
    }
    return refuse(session.status());
  }
  t->session_ = *std::move(session);
  RegisterProcess(t.get());
  audit_.Record(caller, {.environment_id = id, .action = "terminal.open", .detail = detail});
  return t;
}

absl::StatusOr<std::unique_ptr<EnvironmentManager::Process>> EnvironmentManager::SpawnProcess(
    const Caller& caller, const std::string& id, ProcessRequest request) {
  auto env = Lookup(caller.tenant, id);
  if (!env.ok()) return env.status();
  if (!(*env)->driver->Capabilities().Has(Capability::kProcesses))
    return MissingCapabilityError((*env)->driver->name(), Capability::kProcesses);
  if (request.argv.empty() || request.argv[0].empty())
    return absl::InvalidArgumentError("a process needs a command (argv[0])");
  request.pty = false;
  {
    std::lock_guard<std::mutex> lock((*env)->mu);
    if ((*env)->record.state != EnvState::kRunning)
      return EnvironmentNotFoundError(absl::StrCat("environment ", id, " is being destroyed (",
                                                   (*env)->record.destroy_reason, ")"));
  }
  // Like a terminal: not while a step captures or restores the environment, and registered
  // before the step lock is released so that a rewind that follows ends it.
  std::unique_lock<std::recursive_timed_mutex> step_lock((*env)->step_mu, std::defer_lock);
  if (!step_lock.try_lock_for(std::chrono::milliseconds(options_.terminal_step_wait_ms)))
    return absl::UnavailableError(absl::StrCat(
        "a step of environment ", id, " (a capture, rewind or fork) has been running for over ",
        options_.terminal_step_wait_ms / 1000, " s; try again"));
  Touch(**env);
  auto session = (*env)->driver->SpawnProcess((*env)->ref, request);
  if (!session.ok()) return session.status();
  std::unique_ptr<Process> p(new Process());
  p->manager_ = this;
  p->caller_ = caller;
  p->env_ = *env;
  p->id_ = id;
  p->start_ms_ = MonotonicMs();
  p->last_activity_ms_ = p->start_ms_;
  p->session_ = *std::move(session);
  RegisterProcess(p.get());
  return p;
}

void EnvironmentManager::RegisterProcess(Process* p) {
  std::lock_guard<std::mutex> lock(terminals_mu_);
  open_processes_[p->id_].insert(p);
}

EnvironmentManager::Process::~Process() {
  if (manager_ == nullptr) return;
  {
    // First out of the registry (CloseProcesses holds terminals_mu_ while it ends one).
    std::lock_guard<std::mutex> lock(manager_->terminals_mu_);
    if (auto it = manager_->open_processes_.find(id_); it != manager_->open_processes_.end()) {
      it->second.erase(this);
      if (it->second.empty()) manager_->open_processes_.erase(it);
    }
  }
  if (session_) session_->Kill().IgnoreError();
  session_.reset();
  if (!terminal_) return;
  {
    std::lock_guard<std::mutex> lock(manager_->terminals_mu_);
    if (--manager_->terminals_by_env_[id_] <= 0) manager_->terminals_by_env_.erase(id_);
    if (--manager_->terminals_by_tenant_[caller_.tenant] <= 0)
      manager_->terminals_by_tenant_.erase(caller_.tenant);
  }
  std::lock_guard<std::mutex> lock(mu_);
  manager_->audit_.Record(caller_,
                          {.environment_id = id_,
                           .action = "terminal.close",
                           .detail = close_reason_.empty() ? std::string("closed") : close_reason_,
                           .exit_code = exit_code_,
                           .duration_ms = MonotonicMs() - start_ms_,
                           .bytes = bytes_.load()});
}

absl::Status EnvironmentManager::Process::Input(std::string_view data, bool eof) {
  last_activity_ms_ = MonotonicMs();
  bytes_ += static_cast<int64_t>(data.size());
  manager_->Touch(*env_);  // typing keeps the environment's lease alive
  // The guest queues at most 1 MiB of input per process and refuses more (Unavailable) until
  // the shell has read some: wait for it rather than drop keystrokes, but not forever.
  const int64_t deadline = MonotonicMs() + 5000;
  for (;;) {
    absl::Status st = session_->Input(data, eof);
    if (!absl::IsUnavailable(st) || MonotonicMs() >= deadline) return st;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

absl::Status EnvironmentManager::Process::Resize(int rows, int cols) {
  if (rows < 1 || rows > 1000 || cols < 1 || cols > 1000)
    return absl::InvalidArgumentError("terminal rows and cols must be 1-1000");
  last_activity_ms_ = MonotonicMs();
  return session_->Resize(rows, cols);
}

absl::StatusOr<std::optional<int>> EnvironmentManager::Process::Wait(int timeout_ms,
                                                                     const OutputSink& sink) {
  auto counting = [&](Stream s, std::string_view chunk) {
    if (!chunk.empty()) {
      last_activity_ms_ = MonotonicMs();
      bytes_ += static_cast<int64_t>(chunk.size());
    }
    return !sink || sink(s, chunk);
  };
  absl::StatusOr<std::optional<int>> st = session_->Wait(timeout_ms, counting);
  if (st.ok() && st->has_value()) {
    std::lock_guard<std::mutex> lock(mu_);
    exit_code_ = **st;
    if (close_reason_.empty()) close_reason_ = "exited";
  }
  return st;
}

void EnvironmentManager::Process::Close(std::string reason) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (close_reason_.empty()) close_reason_ = std::move(reason);
  }
  session_->Kill().IgnoreError();
}

std::string EnvironmentManager::Process::ended_by() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ended_by_;
}

void EnvironmentManager::CloseProcesses(const std::string& id, const std::string& reason) {
  std::lock_guard<std::mutex> lock(terminals_mu_);
  auto it = open_processes_.find(id);
  if (it == open_processes_.end()) return;
  for (Process* t : it->second) {
    {
      std::lock_guard<std::mutex> tlock(t->mu_);
      if (t->ended_by_.empty()) t->ended_by_ = reason;
    }
    // Kills the process and everything started in it (the session's process tree).
    t->Close(reason);
  }
}

bool EnvironmentManager::Process::Idle() const {
  return MonotonicMs() - last_activity_ms_.load() >= manager_->options_.terminal_idle_timeout_ms;
}

}  // namespace esb
