// What an MCP tool call carries beyond tools::CallContext, for the providers of src/api/mcp/
// that need it (the conformance fixtures): the client's declared capabilities, a way to send it
// log messages (notifications/message), and the MRTR fields of a modern retry. The endpoint
// sets it for the duration of a provider's CallTool on the calling thread.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "boost/json.hpp"

namespace esb::api::mcp {

struct McpCallExtras {
  // The client's capabilities (initialize's, or the modern request's _meta). Never null.
  const boost::json::object* client_capabilities = nullptr;
  // Sends notifications/message {level, logger, data} when the client asked for that level
  // (legacy: logging/setLevel, default all; modern: only with _meta .../logLevel). May be empty.
  std::function<void(std::string_view level, std::string_view logger,
                     const boost::json::value& data)>
      log;

  // 2026-07-28 multi-round calls (SEP-2322, "MRTR"): a tool that needs input from the client
  // (elicitation, sampling, roots) answers with an InputRequiredResult; the client calls again
  // with the answers. In: whether this request may be answered so (modern requests only), the
  // client's answers to the previous round (params.inputResponses; null on the first round) and
  // the state the tool attached to that round (the endpoint signs requestState, so this is what
  // the tool wrote, never something the client made up; "" on the first round).
  bool input_requests_allowed = false;
  const boost::json::object* input_responses = nullptr;
  std::string request_state;
  // Out: set by RequireInput(); the tool's ToolResult is then ignored.
  std::optional<boost::json::object> input_requests;
  std::string next_request_state;
};

// The extras of the call running on this thread; null outside a call.
McpCallExtras* CurrentCall();

// From a tool: answer this call with an InputRequiredResult {inputRequests: requests,
// requestState: state (signed by the endpoint)}. False when the request cannot carry input
// requests (a 2025-11-25 session): the tool must then answer without the input.
bool RequireInput(boost::json::object requests, std::string state = "");

// RAII: makes `extras` the current call's on this thread.
class ScopedCall {
 public:
  explicit ScopedCall(McpCallExtras* extras);
  ~ScopedCall();
  ScopedCall(const ScopedCall&) = delete;
  ScopedCall& operator=(const ScopedCall&) = delete;

 private:
  McpCallExtras* previous_;
};

// A provider's CallTool answer when the call needs a client capability that was not declared:
// the endpoint answers MissingRequiredClientCapabilityError (-32021, HTTP 400) with
// data.requiredCapabilities = `required` (e.g. {"sampling": {}}).
absl::Status MissingClientCapability(const boost::json::object& required);
// The required capabilities if `status` came from MissingClientCapability.
std::optional<boost::json::object> RequiredCapabilitiesOf(const absl::Status& status);

}  // namespace esb::api::mcp
