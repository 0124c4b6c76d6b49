// esbd as an MCP server (issue 14, docs/api.md "MCP", docs/design.md "MCP"): JSON-RPC 2.0 over
// Streamable HTTP, both protocol eras the official conformance suite tests, on one route:
//
//  - 2025-11-25 ("legacy"): `initialize` opens a session (Mcp-Session-Id, crypto-random, bound
//    to the tenant and the route's path, bounded in number, expired when idle), then
//    notifications/initialized (202), ping, tools/list (paginated), tools/call (JSON or, with
//    _meta.progressToken, an SSE stream carrying notifications/progress), notifications/
//    cancelled, GET (an SSE stream for server messages), DELETE (ends the session).
//  - 2026-07-28 ("modern", stateless): every request carries _meta with the protocol version
//    and the client's capabilities; server/discover, tools/list (ttlMs, cacheScope),
//    tools/call; Mcp-Method / Mcp-Name headers must match the body (-32020); an unsupported
//    version is -32022 {supported, requested}; unknown methods 404 -32601; GET/DELETE 405; a
//    client closing the response stream cancels the call.
//
// The same transport serves esbd's own `/mcp` and every hosted server's
// `/environments/{id}/mcp/{name}`: only the ToolProvider differs, chosen per request.
//
//   auto endpoint = esb::api::mcp::RegisterMcpEndpoint(
//       server.router(), "/mcp",
//       {.admit = [&](Request& r) { return service.Admit(r, false); },
//        .caller_of = [&](const Request& r) { return service.CallerOf(r); }},
//       [&](const Request&, const Caller&) -> absl::StatusOr<std::shared_ptr<ToolProvider>> {
//         return esbd_tools;
//       },
//       options);
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "api/http_server.h"
#include "core/audit.h"
#include "core/tools/tool_call.h"

namespace esb::api::mcp {

// The protocol revisions served: legacy (session) ones, newest first, and the modern one.
inline constexpr std::string_view kLegacyVersion = "2025-11-25";
inline constexpr std::string_view kModernVersion = "2026-07-28";

// How a request is admitted and who it is: ApiService::Admit(req, /*json_body=*/false) and
// ApiService::CallerOf (the same API keys and tenants as REST). The endpoint sets the caller's
// channel to "mcp".
struct McpAdmission {
  std::function<std::optional<Response>(Request&)> admit;
  std::function<Caller(const Request&)> caller_of;
};

// The tools a request reaches: esbd's own for `/mcp`, a hosted server's for
// `/environments/{id}/mcp/{name}` (req.Param("id"), req.Param("name")). NotFound answers 404
// (e.g. no such environment for this tenant), other errors their HTTP status.
using ProviderFor = std::function<absl::StatusOr<std::shared_ptr<tools::ToolProvider>>(
    const Request& req, const Caller& caller)>;

struct McpEndpointOptions {
  std::string server_name = "esbd";
  std::string server_version = ESB_VERSION;
  std::string instructions;  // initialize / server/discover "instructions"; empty: none
  // Legacy sessions: in all, per tenant, and how long one may sit unused before it expires.
  int max_sessions = 1024;
  int max_sessions_per_tenant = 64;
  int64_t session_idle_timeout_ms = 30 * 60 * 1000;
  // A JSON-RPC message: bytes (413 beyond) and nesting depth (-32700 beyond).
  uint64_t max_message_bytes = 4 << 20;
  int max_json_depth = 64;
  // tools/list page size (nextCursor beyond).
  int page_size = 100;
  // Origins allowed besides this machine's pages (http(s)://localhost|127.x|[::1][:port]),
  // exact "scheme://host[:port]" strings. A request with any other Origin is refused with 403
  // (DNS rebinding / cross-site protection); requests without an Origin are not browsers.
  std::vector<std::string> allowed_origins;
  // The daemon listens on a loopback address only: every Host must then be localhost,
  // 127.x.y.z or [::1] (any port) or the host[:port] of an allowed origin, else 403 (DNS
  // rebinding). esbd.cc clears it for a non-loopback listen address (whose names it cannot
  // know); unix-socket requests are not checked.
  bool loopback_listener = true;
  // A 2026-07-28 requestState is valid this long after it was issued (then -32602).
  int64_t request_state_ttl_ms = 10 * 60 * 1000;
  // modern tools/list caching hints.
  int64_t list_ttl_ms = 60'000;
  // An idle legacy GET stream gets an SSE comment this often (also how often it notices a
  // deleted session or a stopping server).
  int64_t keepalive_ms = 15'000;
};

// The session table and the protocol logic behind one registered route. Thread-safe.
class McpEndpoint {
 public:
  virtual ~McpEndpoint() = default;
  // Legacy sessions currently open (tests, metrics).
  virtual int session_count() const = 0;
  // Ends every session and wakes GET streams (before HttpServer::Stop).
  virtual void Shutdown() = 0;
  // Handles one request as the route does (tests call it without a server).
  virtual Response Handle(Request& req) = 0;
};

// Registers POST, GET and DELETE on `pattern` (which may have {params}) and returns the
// endpoint (keep it alive as long as the router; the routes hold a reference too).
std::shared_ptr<McpEndpoint> RegisterMcpEndpoint(Router& router, std::string_view pattern,
                                                 McpAdmission admission, ProviderFor provider_for,
                                                 McpEndpointOptions options = {});

// The endpoint without a route (tests, and the handler RegisterMcpEndpoint installs).
std::shared_ptr<McpEndpoint> NewMcpEndpoint(McpAdmission admission, ProviderFor provider_for,
                                            McpEndpointOptions options = {});

// Two providers as one (esbd's tools plus the conformance fixtures): `first`'s tools, then
// `second`'s; a call goes to whichever lists the name.
std::shared_ptr<tools::ToolProvider> MergeProviders(std::shared_ptr<tools::ToolProvider> first,
                                                    std::shared_ptr<tools::ToolProvider> second);

}  // namespace esb::api::mcp
