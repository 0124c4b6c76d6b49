// Test helper: runs the real esb-agent binary as a child process on a temporary socket,
// workspace and state directory (header-only; used by agent_test and agent_client_test).
#pragma once

#include <signal.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace esb::testing {

class AgentProcess {
 public:
  // `prefix`: a command that runs the agent (e.g. unshare ...); empty runs it directly.
  // `dir`: reuse this directory (kept afterwards) instead of a fresh temporary one.
  // `extra`: more agent flags (e.g. --host-uds-peers).
  explicit AgentProcess(std::vector<std::string> prefix = {}, std::string dir = "",
                        std::string binary = ESB_AGENT_BINARY, std::vector<std::string> extra = {})
      : keep_dir_(!dir.empty()) {
    if (dir.empty()) {
      char tmpl[] = "/tmp/esb-agent-test-XXXXXX";
      dir = mkdtemp(tmpl);
    }
    dir_ = dir;
    workspace_ = dir_ + "/workspace";
    socket_ = dir_ + "/run/agent.sock";
    std::filesystem::create_directories(workspace_);
    std::vector<std::string> args = prefix;
    // --allow-uid: the agent serves only uid 0 unless told otherwise; tests may run as anyone.
    std::vector<std::string> agent_args = {binary,
                                           "--socket",
                                           socket_,
                                           "--workspace",
                                           workspace_,
                                           "--state-dir",
                                           dir_ + "/state",
                                           "--log-level",
                                           "warn",
                                           "--allow-uid",
                                           std::to_string(getuid())};
    args.insert(args.end(), agent_args.begin(), agent_args.end());
    args.insert(args.end(), extra.begin(), extra.end());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    if (posix_spawnp(&pid_, args[0].c_str(), nullptr, nullptr, argv.data(), environ) != 0) {
      pid_ = -1;
    }
  }
  AgentProcess(const AgentProcess&) = delete;
  AgentProcess& operator=(const AgentProcess&) = delete;

  ~AgentProcess() {
    if (pid_ > 0) {
      kill(pid_, SIGTERM);
      Wait(5000);
      if (pid_ > 0) {
        kill(pid_, SIGKILL);
        waitpid(pid_, nullptr, 0);
      }
    }
    std::error_code ec;
    if (!keep_dir_) std::filesystem::remove_all(dir_, ec);
  }

  // Waits until the socket accepts connections.
  bool WaitReady(int timeout_ms = 5000) const {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    while (std::chrono::steady_clock::now() < deadline) {
      int fd = Connect();
      if (fd >= 0) {
        close(fd);
        return true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return false;
  }

  // A connected socket (or -1).
  int Connect() const {
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    strncpy(addr.sun_path, socket_.c_str(), sizeof addr.sun_path - 1);
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
      close(fd);
      return -1;
    }
    return fd;
  }

  // Waits for the agent to exit; returns its wait status, or -1 on timeout.
  int Wait(int timeout_ms) {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    while (pid_ > 0) {
      int status = 0;
      pid_t r = waitpid(pid_, &status, WNOHANG);
      if (r == pid_) {
        pid_ = -1;
        return status;
      }
      if (std::chrono::steady_clock::now() >= deadline) return -1;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return -1;
  }

  pid_t pid() const { return pid_; }
  const std::string& dir() const { return dir_; }
  const std::string& socket_path() const { return socket_; }
  const std::string& workspace() const { return workspace_; }

 private:
  std::string dir_, workspace_, socket_;
  pid_t pid_ = -1;
  bool keep_dir_ = false;
};

// True once no process with this pid exists (polling up to timeout_ms).
inline bool ProcessGone(pid_t pid, int timeout_ms) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  for (;;) {
    if (kill(pid, 0) != 0 && errno == ESRCH) return true;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

}  // namespace esb::testing
