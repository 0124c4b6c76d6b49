// esb-agent's server: listens on a unix socket, one thread per connection, dispatches the ops
// of docs/agent-protocol.md. Exec calls are serialised by the shell session; file ops run
// concurrently.
#pragma once

#include <atomic>
#include <string>

#include "agent/reaper.h"
#include "agent/shell.h"
#include "common/protocol.h"

namespace esb::agent {

struct AgentOptions {
  std::string socket_path = "/run/esb/agent.sock";
  std::string workspace = "/workspace";
  std::string state_dir = "/run/esb/state";
  std::string shell = "/bin/bash";
};

class Agent {
 public:
  Agent(AgentOptions options, Reaper* reaper, std::string user);

  // Binds and listens (creating the socket's directory). false with a message on failure.
  bool Listen(std::string* error);
  // Accepts connections forever.
  void Serve();
  // SIGTERM path: kills every session process group and removes the socket.
  void Shutdown();

 private:
  void HandleConnection(int fd);
  // Returns false when the connection must be closed.
  bool HandleRequest(int fd, const proto::Frame& request);
  bool HandleExec(int fd, const boost::json::object& header, const std::string& payload);
  proto::Frame HandleConfigure(const boost::json::object& header);

  const AgentOptions options_;
  Reaper* const reaper_;
  ShellSession shell_;
  const int64_t start_ms_;
  int listen_fd_ = -1;
  std::atomic<int> connections_{0};
};

}  // namespace esb::agent
