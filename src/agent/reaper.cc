#include "agent/reaper.h"

#include <errno.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>

namespace esb::agent {

void Reaper::Start() {
  thread_ = std::thread([this] { Loop(); });
  thread_.detach();  // lives as long as the process
}

pid_t Reaper::Spawn(const std::function<pid_t()>& spawn, int notify_fd) {
  std::lock_guard<std::mutex> lock(mu_);
  pid_t pid = spawn();
  if (pid > 0) {
    entries_[pid] = Entry{notify_fd, false, 0};
    ++spawns_;
    cv_.notify_all();
  }
  return pid;
}

bool Reaper::TryCollect(pid_t pid, int* status) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(pid);
  if (it == entries_.end() || !it->second.exited) return false;
  *status = it->second.status;
  entries_.erase(it);
  return true;
}

bool Reaper::Wait(pid_t pid, int* status, int64_t timeout_ms) {
  std::unique_lock<std::mutex> lock(mu_);
  auto done = [&] {
    auto it = entries_.find(pid);
    return it == entries_.end() || it->second.exited;
  };
  if (timeout_ms < 0) {
    cv_.wait(lock, done);
  } else if (!cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms), done)) {
    return false;
  }
  auto it = entries_.find(pid);
  if (it == entries_.end()) return false;
  *status = it->second.status;
  entries_.erase(it);
  return true;
}

bool Reaper::WhileUnreaped(pid_t pid, const std::function<void()>& fn) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(pid);
  if (it == entries_.end() || it->second.exited) return false;
  fn();
  return true;
}

void Reaper::Forget(pid_t pid) {
  std::lock_guard<std::mutex> lock(mu_);
  entries_.erase(pid);
}

int64_t Reaper::orphans_reaped() const {
  std::lock_guard<std::mutex> lock(mu_);
  return orphans_;
}

void Reaper::Loop() {
  for (;;) {
    uint64_t seen;
    {
      std::lock_guard<std::mutex> lock(mu_);
      seen = spawns_;
    }
    // Learn which child exited without reaping it (WNOWAIT): it stays a zombie, its pid
    // reserved, until it is reaped below under mu_ (see WhileUnreaped).
    siginfo_t info{};
    if (waitid(P_ALL, 0, &info, WEXITED | WNOWAIT | __WALL) != 0) {
      if (errno == EINTR) continue;
      // ECHILD: no children right now. New children only appear through Spawn (orphans are
      // reparented before their parent's exit is reported), so sleep until the next spawn;
      // `seen` was taken before waitpid, so a spawn in between is not missed.
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_for(lock, std::chrono::seconds(1), [&] { return spawns_ != seen; });
      continue;
    }
    std::lock_guard<std::mutex> lock(mu_);
    int status = 0;
    pid_t pid = waitpid(info.si_pid, &status, __WALL | WNOHANG);
    if (pid <= 0) continue;
    auto it = entries_.find(pid);
    if (it == entries_.end()) {
      ++orphans_;
      continue;
    }
    it->second.exited = true;
    it->second.status = status;
    if (it->second.notify_fd >= 0) {
      uint64_t one = 1;
      ssize_t ignored = write(it->second.notify_fd, &one, sizeof one);
      (void)ignored;
    }
    cv_.notify_all();
  }
}

}  // namespace esb::agent
