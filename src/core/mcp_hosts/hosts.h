// MCP servers hosted inside sandboxes (issue 14 §2, P3-021/P3-022; docs/design.md "Hosted MCP
// servers", docs/api.md "Hosted MCP servers"). Per environment, named stdio servers started
// through the environment's process spawn (EnvironmentManager::SpawnProcess, capability
// kProcesses); esbd is their MCP client (StdioClient). Their tools form the environment's tool
// registry, namespaced "<server>.<tool>".
//
// Lifecycle: Start spawns the server and waits (at most mcp.start_timeout_seconds) for the
// handshake and its tools/list. A server that ends after it was ready is restarted with backoff
// (1, 2, 4 ... 30 s) up to mcp.max_restarts times, then reported "failed" with the reason (exit
// code or the limit it broke, stderr tail); calls in flight when it dies fail with that reason.
// A server whose first start fails is "failed" at once (a bad command is not retried). A
// rewind of the environment ends its processes (EnvironmentManager::CloseProcesses): the servers
// are restarted right after it, without counting as a crash. When the environment is deleted
// its servers end with it ("stopped", then forgotten). Servers are not persisted: after an esbd
// restart an environment has none (esbd kills them on a clean shutdown; create them again).
//
// Every entry point takes the Caller: an environment of another tenant is NotFound, like a
// missing one. Lifecycle events are audited through the core's audit path (mcp.server.start,
// mcp.server.stop, mcp.server.exit, mcp.server.failed); tool calls go through the call gate
// (SetCallGate: tools::ToolCallGate, DLP and one "tool.call" row per call).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "boost/json.hpp"
#include "core/config.h"
#include "core/environment_manager.h"
#include "core/mcp_hosts/stdio_client.h"
#include "core/tools/tool_call.h"
#include "core/tools/tool_gate.h"

namespace esb::mcp_hosts {

// What POST /environments/{id}/mcp-servers asks for.
struct ServerSpec {
  std::string name;     // [a-z0-9][a-z0-9_-]{0,62}: unique in its environment
  std::string command;  // argv[0] (looked up in the sandbox's PATH)
  std::vector<std::string> args;
  std::map<std::string, std::string> env;
};

struct ServerInfo {
  std::string environment_id;
  ServerSpec spec;
  std::string state;     // starting | ready | restarting | failed | stopped
  std::string protocol;  // the negotiated revision ("2026-07-28", "2025-11-25", ...)
  int tools = 0;
  // Tools the server listed that esbd left out, "<name>: <why>" (at most 16; the count is of
  // all of them): invalid MCP names, repeated names, names too long to namespace.
  std::vector<std::string> skipped_tools;
  int skipped_tools_count = 0;
  int restarts = 0;
  std::string error;  // why it is not ready (the last end, a refused start); "" when none
  std::string stderr_tail;
  int64_t started_ms = 0;  // unix ms of the current process's start
};

// A tool of the environment's registry.
struct HostedTool {
  std::string server;
  std::string tool;                // its own name on its server
  boost::json::object definition;  // as the server listed it
};

// How many servers one tenant may host at once: a quarter of mcp.max_servers, at least
// mcp.max_servers_per_environment (so one tenant cannot take every slot from the others).
int MaxServersPerTenant(const McpConfig& config);

// Checks a ServerSpec (names, sizes); InvalidArgument naming the field.
absl::Status ValidateServerSpec(const ServerSpec& spec);

class McpHosts {
 public:
  McpHosts(EnvironmentManager* manager, McpConfig config);
  // Stops every server (kills its process).
  ~McpHosts();

  // Every hosted tool call passes `gate` (DLP on arguments, progress and result; one tool.call
  // audit row). Not owned; set once at startup, before any call (null: tests only).
  void SetCallGate(tools::ToolCallGate* gate) { gate_ = gate; }

  // Starts a server and waits for its handshake (bounded). Errors: NotFound (environment),
  // MissingCapabilityError (a runtime without processes: 400), AlreadyExists (the name),
  // ResourceExhausted (mcp.max_servers_per_environment, mcp.max_servers, the tenant's share:
  // MaxServersPerTenant), InvalidArgument.
  // A server that cannot start is returned in state "failed" with the reason.
  absl::StatusOr<ServerInfo> Start(const Caller& caller, const std::string& environment_id,
                                   ServerSpec spec);
  absl::StatusOr<std::vector<ServerInfo>> List(const Caller& caller,
                                               const std::string& environment_id);
  absl::StatusOr<ServerInfo> Get(const Caller& caller, const std::string& environment_id,
                                 const std::string& name);
  // Ends the server (its process is killed; calls in flight fail) and forgets it.
  absl::Status Stop(const Caller& caller, const std::string& environment_id,
                    const std::string& name);

  // The environment's registry: the tools of its ready servers, namespaced "<server>.<tool>"
  // (tools whose names cannot be namespaced, over 128 characters or outside [A-Za-z0-9_.-],
  // are left out), by server name then the server's order.
  absl::StatusOr<std::vector<HostedTool>> Tools(const Caller& caller,
                                                const std::string& environment_id);
  // Calls "<server>.<tool>". NotFound: no such server or tool; Unavailable: the server is not
  // ready (restarting, failed); ResourceExhausted: too many calls on it at once. The server's
  // own failure (its error answer, a timeout, a crash mid-call, a cancellation) is a result
  // with is_error and the reason.
  absl::StatusOr<tools::ToolResult> CallTool(const Caller& caller,
                                             const std::string& environment_id,
                                             std::string_view namespaced_name,
                                             const boost::json::object& arguments,
                                             const tools::CallContext& context);

  // The environment's registry as a ToolProvider (namespaced names): m-tools'
  // list_environment_tools / call_environment_tool.
  absl::StatusOr<std::shared_ptr<tools::ToolProvider>> EnvironmentProvider(
      const Caller& caller, const std::string& environment_id);
  // One server's own tools, names unchanged: /environments/{id}/mcp/{name}.
  absl::StatusOr<std::shared_ptr<tools::ToolProvider>> ServerProvider(
      const Caller& caller, const std::string& environment_id, const std::string& name);

  const McpConfig& config() const { return config_; }

 private:
  struct Server;
  class EnvProvider;
  class OneServerProvider;

  absl::Status CheckEnvironment(const Caller& caller, const std::string& environment_id);
  std::shared_ptr<Server> Find(const std::string& tenant, const std::string& environment_id,
                               const std::string& name);
  void Supervise(std::shared_ptr<Server> server);
  // One start of the server's process: spawn, handshake, tools/list.
  absl::Status StartOnce(Server& server);
  ServerInfo InfoOf(const Server& server);
  // The server's tools from `list` (server.mu held): its skipped ones are reported, and so is
  // a tool whose namespaced name (<server>.<tool>) would be over 128 characters (it stays on
  // the server's own endpoint, not in the environment's registry).
  static void KeepTools(Server& server, ToolList list);
  void Forget(const Server& server);
  // Tells the server's supervisor to stop (no restart) and kills its process with `reason`.
  void StopServer(Server& server, std::string_view reason);
  // The one dispatch path of a hosted tool call (through the gate).
  absl::StatusOr<tools::ToolResult> Dispatch(const Caller& caller, std::shared_ptr<Server> server,
                                             const std::string& tool,
                                             const boost::json::object& arguments,
                                             const tools::CallContext& context);
  ClientLimits LimitsFor() const;
  // Servers `tenant` hosts now (the caller holds mu_).
  int TenantServersLocked(const std::string& tenant) const;

  EnvironmentManager* manager_;
  const McpConfig config_;
  tools::ToolCallGate* gate_ = nullptr;

  std::mutex mu_;
  // environment id → server name → server.
  std::map<std::string, std::map<std::string, std::shared_ptr<Server>>> servers_;
  int total_ = 0;
  // Supervisor threads alive (detached; the destructor waits for them), under mu_.
  int supervisors_ = 0;
  std::condition_variable supervisors_cv_;
};

}  // namespace esb::mcp_hosts
