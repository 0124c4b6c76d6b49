// esb-agent's server: protocol v2 (docs/agent-protocol.md). Listens on a unix socket (one
// reader thread per connection) or serves one already-open byte stream (a microVM's
// virtio-serial port); every connection multiplexes many calls, each dispatched to a thread of
// its own up to a cap (beyond it the call is answered "busy"). Exec calls are serialised by the
// shell session; file ops run concurrently.
#pragma once

#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "agent/process_table.h"
#include "agent/quiesce.h"
#include "agent/reaper.h"
#include "agent/reseed.h"
#include "agent/shell.h"
#include "agent/workspace.h"
#include "common/log_throttle.h"
#include "common/protocol.h"

namespace esb::agent {

struct AgentOptions {
  std::string socket_path = "/run/esb/agent.sock";
  std::string workspace = "/workspace";
  // Mount paths of the persistent volumes (--volume-root, from esbd): files/mkdir, remove and
  // rename act inside them as inside the workspace.
  std::vector<std::string> volume_roots;
  std::string state_dir = "/run/esb/state";
  std::string shell = "/bin/bash";
  // A listening unix socket inherited from the host (--listen-fd): the container driver binds
  // it on the host, so no path inside the sandbox leads to it. -1: bind socket_path instead.
  int listen_fd = -1;
  // An already-open byte stream that carries everything (--serve-fd: a virtio-serial port, or
  // a socketpair/pty in tests). Served instead of a listening socket; only the host can reach
  // such a port, so there is no peer check. -1: none.
  int serve_fd = -1;
  // Besides uid 0 (esbd), the one peer uid whose connections are served (-1: none). Tests
  // that run the agent as an ordinary user pass their own uid.
  int64_t allow_peer_uid = -1;
  // gVisor (--host-uds-peers): connections made from the host to a socket the agent created
  // with runsc --host-uds=create are reported with the agent's own credentials (pid 1, uid
  // 1000); sandbox processes never have pid 1. Serve those too.
  bool host_uds_peers = false;
};

// The ops this agent serves, announced in its HELLO.
std::vector<std::string> Capabilities();

class Agent {
 public:
  Agent(AgentOptions options, Reaper* reaper, std::string user);

  // Binds and listens (creating the socket's directory), or takes over options.listen_fd.
  // false with a message on failure.
  bool Listen(std::string* error);
  // Starts the first (standby) shell; call after RedirectLog, before Serve.
  void PrepareShell();
  // Accepts connections forever (or serves serve_fd until it closes).
  void Serve();
  // SIGTERM path: kills every session process group and removes the socket.
  void Shutdown();
  // gVisor checkpoint (op "release_listener"; docs/agent-protocol.md): gVisor cannot save a
  // socket bound on the host, nor a host connection. After the op answered, Serve closes the
  // listener and every connection, then creates `<socket dir>/released` and waits for
  // Relisten (SIGUSR1 from outside the sandbox, sent by esbd after the restore).
  void Relisten();

 private:
  struct Conn;
  struct Call;
  // Serves one connection until it closes or breaks the protocol; its calls are then
  // cancelled.
  void HandleConnection(int fd, bool owned);
  // SO_PEERCRED: whether the connecting process may talk to the agent at all.
  bool PeerAllowed(int fd);
  // Starts a REQUEST's call on a thread of its own; false on a protocol violation.
  bool StartCall(const std::shared_ptr<Conn>& conn, proto::Frame request);
  void RunCall(const std::shared_ptr<Conn>& conn, const std::shared_ptr<Call>& call,
               const proto::Frame& request);
  // The call's RESPONSE, or nullopt when the handler already sent it.
  std::optional<proto::Frame> HandleRequest(Conn& conn, Call& call, const proto::Frame& request);
  std::optional<proto::Frame> HandleExec(Conn& conn, Call& call, const boost::json::object& header,
                                         const std::string& payload);
  void Answer(Conn& conn, Call& call, proto::Frame response);
  proto::Frame HandleConfigure(const boost::json::object& header);
  // Long-lived processes (process_table.h), sync/thaw (quiesce.h), reseed (reseed.h).
  struct ProcOutput;
  std::shared_ptr<ProcOutput> Output(uint64_t id);
  proto::Frame HandleSpawn(const boost::json::object& header);
  proto::Frame HandleProcessOp(const std::string& op, const boost::json::object& header,
                               const std::string& payload);
  std::optional<proto::Frame> HandleWait(Conn& conn, Call& call, const boost::json::object& header);
  proto::Frame HandleSync(const boost::json::object& header);
  proto::Frame HandleReseed(const std::string& payload);
  // Time travel: the shell session's state, read or replaced (workspace.h has walk/apply).
  proto::Frame HandleShellState(const boost::json::object& header, const std::string& payload);
  proto::Frame HandleReleaseListener();
  // Serve's part of a release: closes the listener and the connections, marks the release on
  // the host and waits for Relisten (again after a failed bind); true once listening.
  bool ReleaseAndWait();

  const AgentOptions options_;
  Reaper* const reaper_;
  ShellSession shell_;
  ProcessTable processes_;
  Freezer freezer_;
  Reseeder reseeder_;
  WalkCache walk_cache_;
  std::mutex outputs_mu_;
  std::map<uint64_t, std::shared_ptr<ProcOutput>> outputs_;  // by process id
  const int64_t start_ms_;
  int listen_fd_ = -1;
  std::atomic<int> connections_{0};
  std::mutex release_mu_;
  std::condition_variable release_cv_;
  bool release_requested_ = false;  // guarded by release_mu_
  bool relisten_ = false;           // guarded by release_mu_
  std::set<int> conn_fds_;          // open accepted connections; guarded by release_mu_
  std::atomic<int> calls_{0};  // in flight on every connection
  LogThrottle refused_peers_;
  LogThrottle refused_busy_;
};

}  // namespace esb::agent
