// esbd's own tools as a ToolProvider (issue 14 §1, docs/api.md "MCP tools"): what `/mcp` lists
// and calls. The definitions are the catalogue's (sdk/tools.json, api/tools_catalog.h McpTools);
// each call is validated against the tool's inputSchema, then runs through the ToolCallGate
// (DLP on arguments and result, one audit row "tool.call") and calls the core with the
// CallContext's Caller: EnvironmentManager for environments and files, the run pipeline
// (core/run) for run_code. The core operations a call makes are Steps of it (Caller::Step):
// the gate's row is the call's one row. Another tenant's environment is NotFound, as in REST.
//
// Results: tool-level failures (bad arguments, a missing environment, a refused call) are
// is_error results with the server's message; a result carries structuredContent (the shapes of
// the catalogue's output descriptions) and the same JSON as text. execute_command and run_code
// stream their output as CallContext::progress messages; run_code's image artifacts come back
// as MCP image content (base64, mimeType), a final DataFrame as a text table and in
// structuredContent.
//
// list_environment_tools / call_environment_tool reach the MCP servers hosted in the
// environment through EsbToolsDeps::environment_tools (m-hosted); without it they answer
// is_error "hosted MCP servers are not available on this daemon". A call_environment_tool that
// reaches a hosted provider is gated (and audited) by that provider with the hosted server's
// name, not a second time here.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "boost/json.hpp"
#include "core/artifact_store.h"
#include "core/environment_manager.h"
#include "core/run/run_pipeline.h"
#include "core/tools/tool_call.h"
#include "core/tools/tool_gate.h"

namespace esb::api {
class ApiService;
}

namespace esb::api::mcp {

// An environment's hosted tools (names "<server>.<tool>"); NotFound for an environment the
// caller does not have.
using EnvironmentToolsFn = std::function<absl::StatusOr<std::shared_ptr<tools::ToolProvider>>(
    const Caller& caller, const std::string& environment_id)>;

inline constexpr char kHostedUnavailable[] = "hosted MCP servers are not available on this daemon";

struct EsbToolsDeps {
  EnvironmentManager* manager = nullptr;       // required
  ApiService* api = nullptr;                   // create_environment's checks; required
  tools::ToolCallGate* gate = nullptr;         // required
  const run::RunPipeline* pipeline = nullptr;  // null: run_code answers is_error
  ArtifactStore* artifacts = nullptr;          // null: no image content for run_code's figures
  EnvironmentToolsFn environment_tools;        // null: the two hosted-tool tools answer is_error
};

struct EsbToolsOptions {
  int64_t max_read_bytes = 1 << 20;    // read_file returns at most this much text
  int max_images = 8;                  // image content items per run_code result
  int64_t max_image_bytes = 4 << 20;   // larger figures are listed, not inlined
  int64_t max_output_bytes = 1 << 20;  // per stream of execute_command
};

class EsbTools : public tools::ToolProvider {
 public:
  explicit EsbTools(EsbToolsDeps deps, EsbToolsOptions options = {});

  absl::StatusOr<std::vector<tools::ToolDefinition>> ListTools(const Caller& caller) override;
  absl::StatusOr<tools::ToolResult> CallTool(std::string_view name,
                                             const boost::json::object& arguments,
                                             const tools::CallContext& context) override;

 private:
  absl::StatusOr<tools::ToolResult> Dispatch(const std::string& name,
                                             const boost::json::object& args,
                                             const tools::CallContext& context);

  EsbToolsDeps deps_;
  EsbToolsOptions options_;
  std::vector<tools::ToolDefinition> definitions_;  // McpTools(), parsed once
};

// The first way `value` breaks `schema` (the JSON Schema subset the catalogue uses: type,
// properties, required, additionalProperties: false, enum, minimum, maximum, exclusiveMinimum,
// minLength, maxLength (code points), pattern, items, maxItems), as "'field': why"; "" when it
// conforms.
std::string SchemaViolation(const boost::json::object& schema, const boost::json::value& value,
                            const std::string& where = "");

}  // namespace esb::api::mcp
