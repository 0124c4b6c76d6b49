// The official MCP conformance suite's fixture tools (test_simple_text, test_image_content, ...,
// and the 2026-07-28 diagnostics test_missing_capability, test_logging_tool), as a separate
// ToolProvider. TEST ONLY: esbd merges it into /mcp only with --mcp-conformance-fixtures (off by
// default, logged loudly), so the suite can check content shapes, progress, logging and errors.
#pragma once

#include <memory>

#include "core/tools/tool_call.h"

namespace esb::api::mcp {

std::shared_ptr<tools::ToolProvider> NewConformanceFixtures();

}  // namespace esb::api::mcp
