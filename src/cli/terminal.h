// `esb shell`: esbd's terminal (GET /environments/{id}/terminal, a WebSocket; docs/api.md
// "Terminal") on this process's terminal: raw mode while it runs (restored however it ends:
// a return, exit(), or SIGTERM/SIGHUP/SIGINT/SIGQUIT, after which the signal ends the process),
// the window size at the start and on every SIGWINCH, the shell's exit code at the end.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "cli/http_client.h"

namespace esb::cli {

struct TerminalOptions {
  int in_fd = 0;                             // keystrokes (raw mode when it is a terminal)
  int out_fd = 1;                            // the shell's output
  int default_rows = 24, default_cols = 80;  // when neither fd is a terminal
};

// Opens the terminal at `target` (a path such as /environments/ID/terminal) and runs it until
// the shell exits. Returns the shell's exit code; an error when the daemon refused (its
// message and HTTP status) or the connection ended without an exit status.
absl::StatusOr<int> RunTerminal(const Endpoint& endpoint, const std::string& target,
                                const std::vector<std::pair<std::string, std::string>>& headers,
                                const TerminalOptions& options);

}  // namespace esb::cli
