// Tool calls (issue 14, docs/design.md "MCP"): the one shape of a tool, a call and its result
// that esbd's MCP server (api/mcp/), REST's tool routes and the MCP servers hosted inside
// sandboxes share, and the one gate every call passes: DLP on the arguments before dispatch and
// on the result after it, and one audit row per call (core/audit.h, the one audit path).
//
//   tools::ToolProvider& esbd_tools = ...;                  // esbd's own catalogue
//   absl::StatusOr<tools::ToolResult> r = esbd_tools.CallTool("execute_command", args, ctx);
//   if (!r.ok()) ...          // a protocol error: unknown tool (NotFound), unavailable, ...
//   else if (r->is_error) ... // the tool failed; its message is in r->content
//
// Entry points (MCP, REST) only parse, say who is calling (CallContext::caller) and render;
// every provider's CallTool runs its dispatch through ToolCallGate::Call, so no tool call can
// skip DLP or the audit log.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "boost/json.hpp"
#include "core/audit.h"

namespace esb::tools {

// A tool as MCP lists it: {"name", "description", "inputSchema", ...} (names ≤ 128 characters
// of [A-Za-z0-9_.-]).
using ToolDefinition = boost::json::object;

// A tool's answer, MCP-shaped. A failure of the tool itself (bad arguments, a command that could
// not run, a refused call) is a result with is_error and a text item saying why; protocol-level
// failures (unknown tool, caller not allowed) are a non-OK status instead.
struct ToolResult {
  // MCP content items: {"type": "text", "text"}, {"type": "image", "data", "mimeType"}, ...
  boost::json::array content;
  std::optional<boost::json::object> structured;  // structuredContent
  bool is_error = false;
};

// One progress report of a long call (MCP notifications/progress: progress increases).
struct Progress {
  double progress = 0;
  std::optional<double> total;
  std::string message;  // e.g. a chunk of output
};

struct CallContext {
  Caller caller;  // tenant, principal, channel ("mcp" | "rest")
  // Called as a long call makes progress (its output as it comes). May be empty. Thread-safe.
  std::function<void(const Progress&)> progress;
  // True once the client gave up (notifications/cancelled, a closed stream). May be empty.
  std::function<bool()> cancelled;
  // Absolute deadline (NowMs() clock) for the whole call; 0: the tool's own default.
  int64_t deadline_ms = 0;
};

class ToolProvider {
 public:
  virtual ~ToolProvider() = default;
  // The tools `caller` may call, in a stable order.
  virtual absl::StatusOr<std::vector<ToolDefinition>> ListTools(const Caller& caller) = 0;
  // NotFound: no tool of that name (MCP answers JSON-RPC -32602). Arguments that do not match
  // the tool's schema are a ToolResult with is_error (MCP 2025-11-25: the model can correct it).
  virtual absl::StatusOr<ToolResult> CallTool(std::string_view name,
                                              const boost::json::object& arguments,
                                              const CallContext& context) = 0;
};

}  // namespace esb::tools
