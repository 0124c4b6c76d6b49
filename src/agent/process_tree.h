// Process trees the agent starts (each exec's shell, each spawned process): the exec shim that
// makes the tree's root a child subreaper, and killing a whole tree.
#pragma once

#include <spawn.h>
#include <sys/types.h>

#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace esb::agent {

// The running agent binary (in the child of posix_spawn, still the agent's image).
inline constexpr char kSelfExe[] = "/proc/self/exe";

// argv for posix_spawn of the agent binary as the exec shim (main.cc: --exec-shim): it sets
// PR_SET_CHILD_SUBREAPER (which survives execve) and execv()s `program` (a path: no PATH
// search) with args[1...]; the program's argv[0] is `program` itself (args[0] is not passed).
// So `setsid` and double-fork escapees of the tree are
// reparented to its root, where KillTree finds them.
std::vector<std::string> ShimArgv(const std::string& program, const std::vector<std::string>& args);

// Starts `path` through `reaper` (which learns its exit on `notify_fd`) as the leader of a new
// session (so its own process group, a PTY can be its terminal, a kill of the group reaches
// everything it starts), with default signal dispositions (the agent ignores SIGPIPE; user
// code must not) and nothing blocked. `actions` sets up its descriptors. Returns the pid, or
// -1 with the posix_spawn error in *spawn_err.
class Reaper;
pid_t SpawnSessionLeader(Reaper* reaper, int notify_fd, const char* path,
                         const posix_spawn_file_actions_t* actions, char* const argv[],
                         char* const envp[], int* spawn_err);

// The environment every process the agent starts for the user begins with (HOME is the
// workspace; TERM=dumb: exec's output goes to pipes). Callers lay the configured base
// environment and per-call variables over it.
std::map<std::string, std::string> UserBaseEnv(const std::string& workspace,
                                               const std::string& user, const std::string& shell);

// SIGKILL to the process group `pgid` (nothing for pgid <= 1).
void KillGroup(pid_t pgid);

// True for the /proc state letters of a process that does not run (stopped, traced, zombie).
bool StoppedState(char state);

// Held by every sweep that stops processes and resumes some of them afterwards (KillTree as
// PID 1, Freezer::Freeze and Freezer::Thaw in quiesce.h), so that one never resumes what the
// other has just stopped.
std::mutex& StopSweepMutex();

// Kills everything the tree rooted at `root` (a subreaper started through the shim) holds: every
// live descendant — including `setsid` and double-fork escapees, which the root inherits — then
// the root's process group. In a sandbox (the agent is PID 1) the whole sandbox is frozen for
// the moment this takes (kill(-1, SIGSTOP)), the tree is killed from a table that can no longer
// change, and everything else resumes (what was stopped before stays stopped). Outside one
// (tests on the host, where kill(-1) would reach the host) it works in rounds: the root's group
// is frozen (SIGSTOP) and re-frozen each round, so a shell that saw its foreground command die
// cannot run its next command before the group kill lands, and orphans of killed processes keep
// reparenting to the live, frozen root. Nothing stays stopped: everything SIGSTOP reached is
// SIGKILLed or resumed. Call only while `root` is unreaped (Reaper::WhileUnreaped), so its pid
// cannot belong to another process.
void KillTree(pid_t root);

}  // namespace esb::agent
