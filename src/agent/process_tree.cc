#include "agent/process_tree.h"

#include <signal.h>
#include <unistd.h>

#include <map>
#include <set>

#include "agent/reaper.h"
#include "agent/util.h"

namespace esb::agent {
namespace {

constexpr char kShimArgv0[] = "esb-agent-shim";

// True if `pid` descends from `root` in `table` (not root itself).
bool DescendsFrom(pid_t pid, pid_t root, const std::map<pid_t, ProcInfo>& table) {
  auto it = table.find(pid);
  pid_t p = it == table.end() ? 0 : it->second.ppid;
  for (int hops = 0; hops < 4096 && p > 1 && p != root; ++hops) {
    auto up = table.find(p);
    p = up == table.end() ? 0 : up->second.ppid;
  }
  return pid != root && p == root;
}

// As PID 1 of the sandbox's pid namespace: freezes every process of the sandbox at once, kills
// the tree from a table that can no longer change, and resumes the rest. A process that
// forks and exits in a loop (each child calling setsid) outruns any scan-then-kill, but not a
// freeze: kill(-1) reaches every process, and a fork under way hands the stop to its child.
void FreezeAndKillTree(pid_t root) {
  std::lock_guard<std::mutex> sweep(StopSweepMutex());
  std::set<pid_t> stopped_before;
  for (const auto& [pid, info] : ReadProcessTable()) {
    if (StoppedState(info.state)) stopped_before.insert(pid);
  }
  // SECURITY: kill(-1) from PID 1 reaches exactly the processes of this pid namespace that the
  // agent's uid may signal (the sandbox's own; never the agent itself, never the host).
  kill(-1, SIGSTOP);
  std::map<pid_t, ProcInfo> table;
  for (int wait = 0; wait < 200; ++wait) {  // bounded: a task in D state stops when it wakes
    table = ReadProcessTable();
    bool all = true;
    for (const auto& [pid, info] : table) {
      if (pid != 1 && !StoppedState(info.state) && DescendsFrom(pid, root, table)) all = false;
    }
    if (all && table.count(root) && StoppedState(table[root].state)) break;
    usleep(500);
  }
  std::set<pid_t> killed;
  for (const auto& [pid, info] : table) {
    if (DescendsFrom(pid, root, table)) {
      kill(pid, SIGKILL);  // SECURITY: descendants of this tree's own root only
      killed.insert(pid);
    }
  }
  KillGroup(root);
  kill(root, SIGKILL);
  killed.insert(root);
  // Everything else the freeze stopped runs on (what was stopped before stays stopped).
  for (const auto& [pid, info] : ReadProcessTable()) {
    if (pid != 1 && !killed.count(pid) && !stopped_before.count(pid)) kill(pid, SIGCONT);
  }
}

}  // namespace

std::mutex& StopSweepMutex() {
  static std::mutex* mu = new std::mutex;  // never destroyed: threads may sweep during exit
  return *mu;
}

std::vector<std::string> ShimArgv(const std::string& program,
                                  const std::vector<std::string>& args) {
  std::vector<std::string> argv = {kShimArgv0, "--exec-shim", program};
  for (size_t i = 1; i < args.size(); ++i) argv.push_back(args[i]);
  return argv;
}

std::map<std::string, std::string> UserBaseEnv(const std::string& workspace,
                                               const std::string& user, const std::string& shell) {
  return {
      {"HOME", workspace},
      {"PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"},
      {"USER", user},
      {"LOGNAME", user},
      {"SHELL", shell},
      {"LANG", "C.UTF-8"},
      // Nothing in the sandbox reads /etc/environment (no PAM): set what the image promises.
      {"MPLBACKEND", "Agg"},
      // Python's output goes to pipes: unbuffered, so it streams as it is printed.
      {"PYTHONUNBUFFERED", "1"},
      {"TERM", "dumb"},
  };
}

void KillGroup(pid_t pgid) {
  if (pgid > 1) kill(-pgid, SIGKILL);
}

bool StoppedState(char state) {
  return state == 'T' || state == 't' || state == 'Z' || state == 'X';
}

void KillTree(pid_t root) {
  if (root <= 1) return;
  if (getpid() == 1) {
    FreezeAndKillTree(root);
    return;
  }
  for (int round = 0; round < 200; ++round) {
    // SECURITY: only the root's own process group (its session) is frozen.
    kill(-root, SIGSTOP);
    std::map<pid_t, ProcInfo> table = ReadProcessTable();
    int killed = 0;
    for (const auto& [pid, info] : table) {
      if (info.state == 'Z' || info.state == 'X' || !DescendsFrom(pid, root, table)) continue;
      // SECURITY: only descendants of the tree's own root are signalled.
      kill(pid, SIGKILL);
      ++killed;
    }
    if (killed == 0) break;
    usleep(1000);  // let the killed exit and their children reparent to the root
  }
  KillGroup(root);
}

pid_t SpawnSessionLeader(Reaper* reaper, int notify_fd, const char* path,
                         const posix_spawn_file_actions_t* actions, char* const argv[],
                         char* const envp[], int* spawn_err) {
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t all, none;
  sigfillset(&all);
  sigemptyset(&none);
  posix_spawnattr_setsigdefault(&attr, &all);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setflags(&attr,
                           POSIX_SPAWN_SETSID | POSIX_SPAWN_SETSIGDEF | POSIX_SPAWN_SETSIGMASK);
  *spawn_err = 0;
  pid_t pid = reaper->Spawn(
      [&]() -> pid_t {
        pid_t child = -1;
        *spawn_err = posix_spawn(&child, path, actions, &attr, argv, envp);
        return *spawn_err == 0 ? child : -1;
      },
      notify_fd);
  posix_spawnattr_destroy(&attr);
  return pid;
}

}  // namespace esb::agent
