// The `sync` op's machinery (docs/agent-protocol.md, "sync"): flush file systems and freeze
// user processes so a snapshot taken meanwhile is consistent, then thaw.
//
// Order for a snapshot: Freezer::Freeze (nothing runs that could dirty a file), then
// SyncFilesystems (dirty data reaches the disks), snapshot, Freezer::Thaw. The freeze is
// bounded: it ends by itself after max_frozen_ms if nobody thaws it (a crashed host must not
// leave the sandbox stopped forever).
//
// What is quiesced: every thread of every process in scope is stopped (SIGSTOP, checked per
// thread in /proc/<pid>/task; a vfork() parent blocked until its stopped child execs counts as
// stopped: it cannot run either), so none writes files, sends packets or uses CPU; the page cache
// of the file systems holding the given paths is written back (syncfs).
// What is not: the agent itself (it keeps serving the connection that will thaw it; its own
// log may still be appended to); processes started after the freeze (the agent must not
// exec/spawn until the thaw); a process in uninterruptible sleep (D) stops only when its I/O
// ends — if that takes longer than the settle timeout it is reported in `not_stopped`; data a
// process holds in its own memory (unflushed stdio buffers, a database's cache) — consistent
// only with a memory snapshot; the network (peers keep sending; TCP timers run on); clocks
// (a thawed process sees time jump). A SIGSTOP is observable: a parent waiting with WUNTRACED
// or a tracer sees the stop and the continue.
//
// No Abseil: the agent is a static binary.
#pragma once

#include <sys/types.h>

#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "agent/util.h"

namespace esb::agent {

struct PathSync {
  std::string path;
  bool ok = false;
  std::string error;  // "syncfs /workspace: Permission denied"
  std::string errno_name;
};

// syncfs() on the file system of each path (a directory or file). One result per path.
std::vector<PathSync> SyncFilesystems(const std::vector<std::string>& paths);

struct FreezeResult {
  bool ok = false;  // every process in scope is stopped (all threads)
  std::string error;
  std::string errno_name;
  int stopped = 0;                 // processes this freeze stopped (Thaw resumes exactly these)
  int already_stopped = 0;         // stopped before (by someone else): left stopped by Thaw
  std::vector<pid_t> not_stopped;  // still running at the settle timeout (e.g. in D state)
  int64_t duration_ms = 0;
};

struct ThawResult {
  bool was_frozen = false;
  int resumed = 0;           // processes sent SIGCONT (those the freeze stopped, still alive)
  bool auto_thawed = false;  // the last freeze had already ended at its max_frozen_ms
};

class Freezer {
 public:
  // Scope: as PID 1 (in the sandbox), every process of the pid namespace except the agent;
  // otherwise (tests on the host) the descendants of `scope_root` (default: this process).
  explicit Freezer(pid_t scope_root = -1);
  ~Freezer();  // thaws
  Freezer(const Freezer&) = delete;
  Freezer& operator=(const Freezer&) = delete;

  // SIGSTOPs every process in scope, remembering (pid, start time) of each it stopped, and
  // waits up to settle_ms (capped at 10 s) until all their threads are stopped; processes
  // forked meanwhile are stopped too. Thaws by itself after max_frozen_ms (1 ms .. 10 min).
  // EBUSY if already frozen. ok == false with `not_stopped` when the settle time ran out:
  // the freeze stays in force (Thaw it, or snapshot knowing what still ran).
  FreezeResult Freeze(int64_t settle_ms, int64_t max_frozen_ms);
  // SIGCONTs the processes the freeze stopped that still exist (same pid and start time);
  // idempotent.
  ThawResult Thaw();
  bool frozen() const;

 private:
  struct Stopped {
    pid_t pid;
    unsigned long long start_time;
  };
  int ThawLocked();  // mu_ held; returns the number resumed
  // The pids in the freeze's scope, from one reading of /proc.
  std::vector<pid_t> InScope(const std::map<pid_t, ProcInfo>& table) const;

  const pid_t scope_root_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool frozen_ = false;
  bool auto_thawed_ = false;
  uint64_t generation_ = 0;
  std::vector<Stopped> stopped_;
  std::thread watchdog_;
};

}  // namespace esb::agent
