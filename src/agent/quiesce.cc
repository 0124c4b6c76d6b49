#include "agent/quiesce.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <set>

#include "agent/process_tree.h"
#include "agent/util.h"
#include "common/protocol.h"

namespace esb::agent {
namespace {

constexpr int64_t kMaxSettleMs = 10000;
constexpr int64_t kMaxFrozenMs = 10 * 60 * 1000;

// True if every thread of `pid` is stopped (or gone): a group stop reaches the threads one by
// one, and the process's own stat shows only its main thread.
bool AllThreadsStopped(pid_t pid) {
  std::string dir = "/proc/" + std::to_string(pid) + "/task";
  DIR* tasks = opendir(dir.c_str());
  if (!tasks) return true;  // gone
  bool all = true;
  while (dirent* e = readdir(tasks)) {
    if (e->d_name[0] == '.') continue;
    std::string path = dir + "/" + e->d_name + "/stat";
    int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    char buf[512];
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) continue;
    buf[n] = '\0';
    const char* paren = strrchr(buf, ')');
    if (paren && paren[1] == ' ' && !StoppedState(paren[2])) {
      all = false;
      break;
    }
  }
  closedir(tasks);
  return all;
}

// A vfork() parent waits (state D, in the clone syscall) until its child execs or exits; when
// the freeze stopped that child before its exec, the parent cannot run either (nor take its
// own pending stop). It is as quiescent as a stopped process, and the thaw resumes both.
bool BlockedInVfork(pid_t pid, const std::map<pid_t, ProcInfo>& table) {
  auto it = table.find(pid);
  if (it == table.end() || it->second.state != 'D') return false;
  Fd fd(open(("/proc/" + std::to_string(pid) + "/wchan").c_str(), O_RDONLY | O_CLOEXEC));
  char buf[64] = {};
  if (!fd || read(fd.get(), buf, sizeof buf - 1) <= 0) return false;
  std::string_view wchan(buf);
  if (wchan.find("clone") == std::string_view::npos &&
      wchan.find("fork") == std::string_view::npos) {
    return false;
  }
  for (const auto& [child, info] : table) {
    if (info.ppid == pid && StoppedState(info.state)) return true;
  }
  return false;
}

}  // namespace

std::vector<PathSync> SyncFilesystems(const std::vector<std::string>& paths) {
  std::vector<PathSync> out;
  for (const std::string& path : paths) {
    PathSync r;
    r.path = path;
    // O_NONBLOCK: a FIFO at the path must not block the agent.
    Fd fd(open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY));
    if (!fd) {
      r.error = "open " + path + ": " + strerror(errno);
      r.errno_name = ErrnoName(errno);
    } else if (syncfs(fd.get()) != 0) {
      r.error = "syncfs " + path + ": " + strerror(errno);
      r.errno_name = ErrnoName(errno);
    } else {
      r.ok = true;
    }
    out.push_back(std::move(r));
  }
  return out;
}

Freezer::Freezer(pid_t scope_root) : scope_root_(scope_root > 0 ? scope_root : getpid()) {}

Freezer::~Freezer() { Thaw(); }

bool Freezer::frozen() const {
  std::lock_guard<std::mutex> lock(mu_);
  return frozen_;
}

std::vector<pid_t> Freezer::InScope(const std::map<pid_t, ProcInfo>& table) const {
  std::vector<pid_t> out;
  const pid_t self = getpid();
  for (const auto& [pid, info] : table) {
    if (pid == self) continue;
    if (self == 1) {
      out.push_back(pid);
      continue;
    }
    pid_t p = info.ppid;
    for (int hops = 0; hops < 4096 && p > 1 && p != scope_root_; ++hops) {
      auto up = table.find(p);
      p = up == table.end() ? 0 : up->second.ppid;
    }
    if (p == scope_root_ && pid != scope_root_) out.push_back(pid);
  }
  return out;
}

FreezeResult Freezer::Freeze(int64_t settle_ms, int64_t max_frozen_ms) {
  FreezeResult result;
  const int64_t start = proto::MonotonicMs();
  settle_ms = std::clamp<int64_t>(settle_ms, 0, kMaxSettleMs);
  max_frozen_ms = std::clamp<int64_t>(max_frozen_ms, 1, kMaxFrozenMs);
  std::thread old_watchdog;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (frozen_) {
      result.error = "already frozen (thaw first)";
      result.errno_name = "EBUSY";
      return result;
    }
    old_watchdog = std::move(watchdog_);  // it has ended (or is about to): frozen_ is false
  }
  if (old_watchdog.joinable()) old_watchdog.join();

  std::unique_lock<std::mutex> lock(mu_);
  std::lock_guard<std::mutex> sweep(StopSweepMutex());
  stopped_.clear();
  auto_thawed_ = false;
  std::set<pid_t> before;     // stopped by someone else: not ours to resume
  std::set<pid_t> signalled;  // SIGSTOP sent
  std::set<pid_t> scope;
  {
    std::map<pid_t, ProcInfo> table = ReadProcessTable();
    for (pid_t pid : InScope(table)) {
      if (StoppedState(table[pid].state)) before.insert(pid);
    }
  }
  if (getpid() == 1) {
    // SECURITY: kill(-1) from PID 1 reaches exactly the processes of this pid namespace that
    // the agent's uid may signal (the sandbox's own; never the agent itself, never the host).
    // One call: a process forking meanwhile cannot outrun it.
    kill(-1, SIGSTOP);
  }
  std::vector<pid_t> pending;
  for (;;) {
    std::map<pid_t, ProcInfo> table = ReadProcessTable();
    pending.clear();
    for (pid_t pid : InScope(table)) {
      if (before.count(pid)) continue;
      const ProcInfo& info = table[pid];
      if (info.state == 'Z' || info.state == 'X') continue;
      if (!signalled.count(pid)) {
        // SECURITY: a process in the freeze's scope (the sandbox's, or this agent's
        // descendants on the host).
        kill(pid, SIGSTOP);
        signalled.insert(pid);
        stopped_.push_back({pid, info.start_time});
      }
      if (!AllThreadsStopped(pid) && !BlockedInVfork(pid, table)) pending.push_back(pid);
    }
    if (pending.empty() || proto::MonotonicMs() - start >= settle_ms) break;
    usleep(1000);
  }
  // With kill(-1) every process was signalled at once; the loop above records those that
  // were not stopped before as ours. Forget those that exited instead of stopping (a signal
  // can land while a process is already exiting).
  {
    std::map<pid_t, ProcInfo> table = ReadProcessTable();
    std::erase_if(stopped_, [&](const Stopped& s) {
      auto it = table.find(s.pid);
      return it == table.end() || it->second.start_time != s.start_time ||
             it->second.state == 'Z' || it->second.state == 'X';
    });
  }
  frozen_ = true;
  ++generation_;
  result.stopped = static_cast<int>(stopped_.size());
  result.already_stopped = static_cast<int>(before.size());
  result.not_stopped = pending;
  result.ok = pending.empty();
  if (!result.ok) {
    result.error = std::to_string(pending.size()) + " process(es) not stopped within " +
                   std::to_string(settle_ms) + " ms";
    result.errno_name = "ETIMEDOUT";
  }
  result.duration_ms = proto::MonotonicMs() - start;

  const uint64_t generation = generation_;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(max_frozen_ms);
  watchdog_ = std::thread([this, generation, deadline] {
    std::unique_lock<std::mutex> l(mu_);
    if (!cv_.wait_until(l, deadline, [&] { return !frozen_ || generation_ != generation; })) {
      Log(LogLevel::kWarn, "freeze not thawed in time: thawing");
      ThawLocked();
      auto_thawed_ = true;
    }
  });
  return result;
}

int Freezer::ThawLocked() {
  int resumed = 0;
  if (frozen_) {
    std::lock_guard<std::mutex> sweep(StopSweepMutex());
    std::map<pid_t, ProcInfo> table = ReadProcessTable();
    for (const Stopped& s : stopped_) {
      auto it = table.find(s.pid);
      // Same pid and start time: the very process stopped (a pid freed meanwhile by a kill may
      // belong to a new process now).
      if (it == table.end() || it->second.start_time != s.start_time) continue;
      // SECURITY: only processes this freeze stopped.
      if (kill(s.pid, SIGCONT) == 0) ++resumed;
    }
    stopped_.clear();
    frozen_ = false;
  }
  cv_.notify_all();
  return resumed;
}

ThawResult Freezer::Thaw() {
  ThawResult result;
  std::thread watchdog;
  {
    std::lock_guard<std::mutex> lock(mu_);
    result.was_frozen = frozen_;
    result.auto_thawed = auto_thawed_;
    auto_thawed_ = false;
    result.resumed = ThawLocked();
    watchdog = std::move(watchdog_);
  }
  if (watchdog.joinable()) watchdog.join();
  return result;
}

}  // namespace esb::agent
