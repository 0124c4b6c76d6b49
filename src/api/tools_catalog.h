// The one tool catalogue (sdk/tools.json), embedded here at build time and read by the Python
// SDK (agentbox/tools.json links to it), so the daemon and the SDK cannot drift apart. GET /tools
// serves it; esbd's MCP server (/mcp, api/mcp/esb_tools.h) lists its tools from the same file.
//
// Each entry: {"name": "<prefix>.<MCP name>", "scope": "environment" | "daemon",
// "planner": bool, "description", "input_schema", "output_description", "annotations"?}.
// Planner tools (seed 004's meta-tools, list_files) are what a planner bound to one environment
// gets; "environment" tools gain a required `environment_id` in the MCP view.
#pragma once

#include <boost/json.hpp>
#include <string_view>

namespace esb::api {

// sdk/tools.json's bytes, as embedded at build time.
std::string_view ToolsCatalogSource();

// {"tools": [neutral planner tools], "openai": [function tools], "anthropic": [tools],
//  "mcp": [MCP tools]}. The vendor formats are derived from the planner tools as the SDK
// derives them: name with '.' as '_' (both vendors accept only ^[a-zA-Z0-9_-]+$), description
// followed by the output description. "mcp" is McpTools().
boost::json::object ToolsCatalog();

// Every catalogue tool as MCP's tools/list shows it: {"name": MCP name (after the first '.'),
// "description": description + " " + output_description, "inputSchema" (environment tools:
// `environment_id` added first and required), "annotations"?}, in the file's order.
boost::json::array McpTools();

// The environment_id property the MCP view adds to environment tools.
boost::json::object EnvironmentIdSchema();

}  // namespace esb::api
