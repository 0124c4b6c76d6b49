// The one gate every tool call passes (issue 14 §3, docs/design.md "MCP"): esbd's own tools
// (api/mcp/esb_tools.h) and the tools of MCP servers hosted in sandboxes run their dispatch
// through ToolCallGate::Call, which
//   1. scans the arguments with the DLP engine (governance/dlp/dlp.h) before dispatch:
//      block → an is_error result naming the rule, nothing dispatched; redact → the dispatch
//      gets the arguments with the matched spans replaced by "[REDACTED:<rule>]" (still a JSON
//      object); log → dispatched as given, the rules recorded;
//   2. scans the result after dispatch: findings are always recorded; blocking or redacting a
//      result is opt-in with the policy's `dlp.scan_responses` (the same switch that makes the
//      egress proxy act on response bodies: "act on what comes back");
//   3. writes ONE audit row (action "tool.call", core/audit.h AuditLog::RecordToolCall): tool,
//      server, environment, decision (allowed | redacted | blocked | error), rules hit, the
//      redacted arguments, result size, duration; and counts the call in /metrics.
//
// The policy is the environment's DLP config (its network policy's `dlp` object, which was laid
// over the tenant's default at create) or, for an environment without a governed network and
// for calls about no environment, the tenant's default policy's `dlp` (the built-in defaults
// unless the daemon config sets one): a planted AWS key in tool arguments is blocked by default.
// Engines are compiled once per distinct `dlp` object and cached (bounded, LRU).
//
// What is scanned (all bounded by GateOptions::max_scanned_bytes and the policy's
// max_body_bytes; above: the rule dlp:oversize with the policy's on_oversize):
//   - the arguments serialised as JSON (the engine decodes JSON escapes and percent-encoding):
//     the spans the redaction replaces;
//   - a second pass: every string value in document order glued without separators, each
//     object key on its own line glued to the string values after it, every key glued, string
//     values that are JSON themselves (parsed, their layers too), and every base64 run of 16+
//     characters anywhere in a string or key (decoded, and looked into again: base64 of
//     base64 or of JSON), up to 4 levels. Secrets found only there cannot be cut out of the
//     arguments in place: their redact or block action blocks the call (fail closed).
//   - results the same way (both passes), with image and audio `data` scanned decoded; every
//     other field of every content item (a text's `data`, a resource's `blob`, unknown fields)
//     is scanned as it is and in the second pass.
// What this catches is the accidental leak and the lazy disguise (a key in base64, escaped,
// percent-encoded, in nested JSON, split over adjacent values or a key and its value). A
// deliberate encoder still gets through: hex or any other encoding, changed case, a key split
// inside words or with a word-like value glued before its first piece ({"p":"hello","a":
// "AKIA..","b":"..."}: the rules' word boundary fails), base64 glued to a word or of a prefixed
// key, zero-width or full-width characters, spaced letters. It is a seatbelt, not a sandbox:
// the sandbox's egress policy is what keeps data in.
// Arguments nested deeper than kMaxArgumentDepth are refused (is_error) before anything runs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "boost/json.hpp"
#include "core/audit.h"
#include "core/tools/tool_call.h"

namespace esb {
class EnvironmentManager;
namespace governance::dlp {
class Engine;
}
}  // namespace esb

namespace esb::tools {

struct GateCall {
  std::string tool;            // the tool's name as its server knows it ("execute_command")
  std::string server;          // "esbd" for esbd's own tools, else the hosted server's name
  std::string environment_id;  // "" for calls about no environment (list_environments, ...)
};

// The `dlp` object (governance/dlp/dlp.h config JSON) that applies to a call of `caller` about
// `environment_id` ("" for none). An empty object means the built-in defaults.
using DlpPolicySource = std::function<absl::StatusOr<boost::json::object>(
    const Caller& caller, const std::string& environment_id)>;

// The daemon's source: a governed environment's policy `dlp`, else the tenant default's.
// An environment that does not exist for the caller gets the tenant default (the dispatch
// then reports NotFound itself: the gate tells nothing about other tenants' environments).
DlpPolicySource DlpPolicyFrom(EnvironmentManager* manager);

inline constexpr int kMaxArgumentDepth = 64;  // nesting of arrays/objects in the arguments

struct GateOptions {
  // Serialised JSON bytes of the arguments (and of a result) scanned at most; the policy's
  // max_body_bytes lowers it. Above: dlp:oversize with the policy's on_oversize (block by
  // default: an argument too big to scan is not dispatched).
  size_t max_scanned_bytes = 4 << 20;
  size_t max_cached_engines = 32;              // distinct policies kept compiled
  size_t max_audit_argument_bytes = 16 << 10;  // redacted arguments kept in the audit row
};

class ToolCallGate {
 public:
  // `audit`: not owned, required (it also counts the call in /metrics). `policy`: where the
  // DLP config of a call comes from (nullptr: the built-in defaults for every call).
  ToolCallGate(AuditLog* audit, DlpPolicySource policy, GateOptions options = {});
  ~ToolCallGate();

  using Dispatch = std::function<absl::StatusOr<ToolResult>(const boost::json::object& arguments)>;

  // Scans, dispatches (unless blocked), scans the result, audits once. A non-OK status from
  // `dispatch` is passed through (and audited as "error"); so is a policy that cannot be
  // loaded (Internal/Unavailable, nothing dispatched).
  absl::StatusOr<ToolResult> Call(const GateCall& call, const boost::json::object& arguments,
                                  const CallContext& context, const Dispatch& dispatch);

  // The same for a dispatch that streams progress: it gets `context` with a progress function
  // that scans each message first (its rules join the result's; with dlp.scan_responses a
  // message with a block finding is withheld and a redact finding redacted). Use it whenever
  // the dispatch reports progress: streamed output is part of the result.
  using StreamingDispatch = std::function<absl::StatusOr<ToolResult>(
      const boost::json::object& arguments, const CallContext& context)>;
  absl::StatusOr<ToolResult> Call(const GateCall& call, const boost::json::object& arguments,
                                  const CallContext& context, const StreamingDispatch& dispatch);

  // The compiled engine for a `dlp` object (cached). InvalidArgument for a bad config.
  absl::StatusOr<std::shared_ptr<const governance::dlp::Engine>> EngineFor(
      const boost::json::object& dlp);
  size_t cached_engines() const;

 private:
  AuditLog* audit_;
  DlpPolicySource policy_;
  GateOptions options_;
  mutable std::mutex cache_mu_;
  // serialised dlp object → engine; LRU order in cache_order_ (front = most recent).
  std::list<std::string> cache_order_;
  struct CacheEntry {
    std::shared_ptr<const governance::dlp::Engine> engine;
    std::list<std::string>::iterator order;
  };
  std::unordered_map<std::string, CacheEntry> cache_;
};

}  // namespace esb::tools
