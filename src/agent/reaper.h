// Central child reaper for esb-agent. As PID 1 (or a child subreaper on the host) the agent
// inherits every orphan; one thread calls waitpid(-1) and hands each exit status to whoever
// registered interest in that pid, so no status is lost and nothing races on waitpid.
#pragma once

#include <sys/types.h>

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

namespace esb::agent {

class Reaper {
 public:
  Reaper() = default;
  Reaper(const Reaper&) = delete;
  Reaper& operator=(const Reaper&) = delete;

  // Starts the reaping thread. Call once, before any child is spawned.
  void Start();

  // Runs `spawn` (which forks/spawns and returns the child pid, or -1) while holding the
  // registry lock, then registers the pid with `notify_fd` (an eventfd written when the child
  // exits; may be -1). Holding the lock across the spawn means the reaper cannot collect the
  // child's status before it is registered.
  pid_t Spawn(const std::function<pid_t()>& spawn, int notify_fd);

  // If `pid` has exited, stores its wait status in *status, forgets the pid and returns true.
  bool TryCollect(pid_t pid, int* status);
  // Blocks until `pid` exits (or the timeout passes; timeout_ms < 0 waits forever).
  bool Wait(pid_t pid, int* status, int64_t timeout_ms = -1);
  // Runs `fn` and returns true only if `pid` is tracked and not yet reaped; holds the registry
  // lock meanwhile. The reaper frees a pid (reaps it) only under that lock, so a signal `fn`
  // sends to `pid` or its process group cannot reach a recycled pid.
  bool WhileUnreaped(pid_t pid, const std::function<void()>& fn);
  // Stops tracking `pid` (its status, when it comes, is discarded).
  void Forget(pid_t pid);

  // Number of orphans and untracked children reaped so far (for tests and logs).
  int64_t orphans_reaped() const;

 private:
  struct Entry {
    int notify_fd = -1;
    bool exited = false;
    int status = 0;
  };
  void Loop();

  mutable std::mutex mu_;
  std::condition_variable cv_;  // signalled on spawn (wakes an idle reaper) and on exit
  std::map<pid_t, Entry> entries_;
  uint64_t spawns_ = 0;
  int64_t orphans_ = 0;
  std::thread thread_;
};

}  // namespace esb::agent
