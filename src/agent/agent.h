// esb-agent's server: listens on a unix socket, one thread per connection, dispatches the ops
// of docs/agent-protocol.md. Exec calls are serialised by the shell session; file ops run
// concurrently.
#pragma once

#include <atomic>
#include <string>

#include "agent/reaper.h"
#include "agent/shell.h"
#include "common/log_throttle.h"
#include "common/protocol.h"

namespace esb::agent {

struct AgentOptions {
  std::string socket_path = "/run/esb/agent.sock";
  std::string workspace = "/workspace";
  std::string state_dir = "/run/esb/state";
  std::string shell = "/bin/bash";
  // A listening unix socket inherited from the host (--listen-fd): the container driver binds
  // it on the host, so no path inside the sandbox leads to it. -1: bind socket_path instead.
  int listen_fd = -1;
  // Besides uid 0 (esbd), the one peer uid whose connections are served (-1: none). Tests
  // that run the agent as an ordinary user pass their own uid.
  int64_t allow_peer_uid = -1;
  // gVisor (--host-uds-peers): connections made from the host to a socket the agent created
  // with runsc --host-uds=create are reported with the agent's own credentials (pid 1, uid
  // 1000); sandbox processes never have pid 1. Serve those too.
  bool host_uds_peers = false;
};

class Agent {
 public:
  Agent(AgentOptions options, Reaper* reaper, std::string user);

  // Binds and listens (creating the socket's directory), or takes over options.listen_fd.
  // false with a message on failure.
  bool Listen(std::string* error);
  // Starts the first (standby) shell; call after RedirectLog, before Serve.
  void PrepareShell();
  // Accepts connections forever.
  void Serve();
  // SIGTERM path: kills every session process group and removes the socket.
  void Shutdown();

 private:
  void HandleConnection(int fd);
  // SO_PEERCRED: whether the connecting process may talk to the agent at all.
  bool PeerAllowed(int fd);
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
  LogThrottle refused_peers_;
  LogThrottle refused_busy_;
};

}  // namespace esb::agent
