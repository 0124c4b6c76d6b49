// Driver::OpenTerminal for every driver whose sandbox runs esb-agent: a login-less interactive
// bash on a PTY through the agent's process ops (docs/agent-protocol.md "Processes": spawn with
// pty, input, resize, wait, kill).
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "drivers/agent_client.h"
#include "drivers/driver.h"

namespace esb {

// Spawns `bash -i` in /workspace on a PTY of request.rows x request.cols through `agent` and
// returns the session (which keeps `agent` alive and kills the shell when destroyed).
absl::StatusOr<std::unique_ptr<TerminalSession>> OpenAgentTerminal(
    std::shared_ptr<AgentClient> agent, const TerminalRequest& request);

}  // namespace esb
