// Driver::SpawnProcess for every driver whose sandbox runs esb-agent: a process started through
// the agent's process ops (docs/agent-protocol.md "Processes": spawn, input, resize, wait, kill),
// with stdio pipes (an MCP server hosted in the sandbox) or on a PTY (the interactive terminal).
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "drivers/agent_client.h"
#include "drivers/driver.h"

namespace esb {

// Spawns request.argv through `agent` and returns the session (which keeps `agent` alive and
// kills the process tree when destroyed). InvalidArgument for an empty argv or, with a PTY,
// rows/cols outside 1-1000.
absl::StatusOr<std::unique_ptr<ProcessSession>> SpawnAgentProcess(
    std::shared_ptr<AgentClient> agent, const ProcessRequest& request);

}  // namespace esb
