// EnvironmentManager's interactive terminals (docs/api.md "Terminal"): the capability check,
// the per-environment and per-tenant caps, the idle clock and the audit rows around a driver's
// TerminalSession. The API (api/terminal_service.cc) carries the bytes over a WebSocket.
#include <chrono>
#include <thread>

#include "absl/strings/str_cat.h"
#include "core/environment_manager.h"

namespace esb {

absl::StatusOr<std::unique_ptr<EnvironmentManager::Terminal>> EnvironmentManager::OpenTerminal(
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
  std::unique_ptr<Terminal> t(new Terminal());
  t->manager_ = this;  // from here on the destructor releases the slots
  t->caller_ = caller;
  t->env_ = *env;
  t->id_ = id;
  t->start_ms_ = MonotonicMs();
  t->last_activity_ms_ = t->start_ms_;
  Touch(**env);
  TerminalRequest request;
  request.rows = rows;
  request.cols = cols;
  auto session = (*env)->driver->OpenTerminal((*env)->ref, request);
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
  {
    std::lock_guard<std::mutex> lock(terminals_mu_);
    open_terminals_[id].insert(t.get());
  }
  audit_.Record(caller, {.environment_id = id, .action = "terminal.open", .detail = detail});
  return t;
}

EnvironmentManager::Terminal::~Terminal() {
  if (manager_ == nullptr) return;
  {
    // First out of the registry (CloseTerminals holds terminals_mu_ while it ends one).
    std::lock_guard<std::mutex> lock(manager_->terminals_mu_);
    if (auto it = manager_->open_terminals_.find(id_); it != manager_->open_terminals_.end()) {
      it->second.erase(this);
      if (it->second.empty()) manager_->open_terminals_.erase(it);
    }
  }
  if (session_) session_->Kill().IgnoreError();
  session_.reset();
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

absl::Status EnvironmentManager::Terminal::Input(std::string_view data) {
  last_activity_ms_ = MonotonicMs();
  bytes_ += static_cast<int64_t>(data.size());
  manager_->Touch(*env_);  // typing keeps the environment's lease alive
  // The guest queues at most 1 MiB of input per process and refuses more (Unavailable) until
  // the shell has read some: wait for it rather than drop keystrokes, but not forever.
  const int64_t deadline = MonotonicMs() + 5000;
  for (;;) {
    absl::Status st = session_->Input(data);
    if (!absl::IsUnavailable(st) || MonotonicMs() >= deadline) return st;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

absl::Status EnvironmentManager::Terminal::Resize(int rows, int cols) {
  if (rows < 1 || rows > 1000 || cols < 1 || cols > 1000)
    return absl::InvalidArgumentError("terminal rows and cols must be 1-1000");
  last_activity_ms_ = MonotonicMs();
  return session_->Resize(rows, cols);
}

absl::StatusOr<std::optional<int>> EnvironmentManager::Terminal::Wait(int timeout_ms,
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

void EnvironmentManager::Terminal::Close(std::string reason) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (close_reason_.empty()) close_reason_ = std::move(reason);
  }
  session_->Kill().IgnoreError();
}

std::string EnvironmentManager::Terminal::ended_by() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ended_by_;
}

void EnvironmentManager::CloseTerminals(const std::string& id, const std::string& reason) {
  std::lock_guard<std::mutex> lock(terminals_mu_);
  auto it = open_terminals_.find(id);
  if (it == open_terminals_.end()) return;
  for (Terminal* t : it->second) {
    {
      std::lock_guard<std::mutex> tlock(t->mu_);
      if (t->ended_by_.empty()) t->ended_by_ = reason;
    }
    // Kills the shell and everything started in it (the session's process tree).
    t->Close(reason);
  }
}

bool EnvironmentManager::Terminal::Idle() const {
  return MonotonicMs() - last_activity_ms_.load() >= manager_->options_.terminal_idle_timeout_ms;
}

}  // namespace esb
