// `esbd mcp-stdio`: an MCP stdio server (newline-delimited JSON-RPC on stdin/stdout, logs on
// stderr only) for MCP clients that launch a command (Claude Desktop, the inspector), talking to
// a running esbd's /mcp over its unix socket or --url: every message is POSTed to /mcp with the
// session (Mcp-Session-Id after initialize) or the 2026-07-28 headers (MCP-Protocol-Version,
// Mcp-Method, Mcp-Name); answers and notifications (progress, logs) from JSON or SSE answers are
// written back as lines. notifications/cancelled is forwarded (2025-11-25) and, for a
// 2026-07-28 call, closes that call's stream (the modern HTTP cancel).
#pragma once

#include <istream>
#include <ostream>
#include <string>

#include "cli/http_client.h"

namespace esb {

struct McpStdioOptions {
  cli::Endpoint endpoint;            // UnixEndpoint(...) or ParseUrl(--url)
  std::string api_key;               // ESB_API_KEY; empty: none (dev mode, unix socket)
  std::string path = "/mcp";         // or a hosted server's /environments/{id}/mcp/{name}
  int max_concurrent = 16;           // requests in flight at once (more wait)
  size_t max_line_bytes = 8u << 20;  // a longer line is answered -32700 and skipped
};

// Serves `in` until it ends (then cancels what is in flight and ends the session). Returns the
// process exit code.
int RunMcpStdio(const McpStdioOptions& options, std::istream& in, std::ostream& out,
                const cli::TransportFactory& transport);

}  // namespace esb
