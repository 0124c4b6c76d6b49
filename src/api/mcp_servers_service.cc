// MCP servers hosted in sandboxes (issue 14; docs/api.md "Hosted MCP servers"): the
// /environments/{id}/mcp-servers routes and the environment's tool registry
// (/environments/{id}/tools, /environments/{id}/tools/{name}/call). They parse, call the core
// (core/mcp_hosts: it decides, limits and audits) and render.
#include "absl/strings/str_cat.h"
#include "api/json_util.h"
#include "api/service.h"
#include "common/util.h"
#include "core/mcp_hosts/hosts.h"

namespace esb::api {

namespace json = boost::json;

namespace {

constexpr size_t kMaxArgs = 256;

json::object RenderServer(const mcp_hosts::ServerInfo& s) {
  json::array args;
  for (const std::string& a : s.spec.args) args.emplace_back(SanitizeUtf8(a));
  // The env values may be secrets (tokens for the server): only their names are shown.
  json::array env;
  for (const auto& [k, v] : s.spec.env) env.emplace_back(k);
  json::array skipped;
  for (const std::string& why : s.skipped_tools) skipped.emplace_back(SanitizeUtf8(why));
  return json::object{
      {"name", s.spec.name},
      {"environment_id", s.environment_id},
      {"command", SanitizeUtf8(s.spec.command)},
      {"args", std::move(args)},
      {"env", std::move(env)},
      {"state", s.state},
      {"protocol", s.protocol.empty() ? json::value(nullptr) : json::value(s.protocol)},
      {"tools", s.tools},
      {"skipped_tools", std::move(skipped)},
      {"skipped_tools_count", s.skipped_tools_count},
      {"restarts", s.restarts},
      {"error", s.error.empty() ? json::value(nullptr) : json::value(SanitizeUtf8(s.error))},
      {"stderr_tail", SanitizeUtf8(s.stderr_tail)},
      {"started_at",
       s.started_ms > 0 ? json::value(FormatRfc3339(s.started_ms)) : json::value(nullptr)},
      {"url", absl::StrCat("/environments/", s.environment_id, "/mcp/", s.spec.name)}};
}

json::object RenderResult(const tools::ToolResult& r) {
  json::object o{{"content", r.content}, {"isError", r.is_error}};
  if (r.structured) o["structuredContent"] = *r.structured;
  return o;
}

}  // namespace

void ApiService::RegisterMcpServers(
    const std::function<void(std::string, std::string_view, RouteFn)>& add) {
  auto unavailable = [] {
    return ErrorResponse(503, "unavailable", "this daemon hosts no MCP servers");
  };

  add("POST", "/environments/{id}/mcp-servers", [this, unavailable](Request& req, const Caller& t) {
    if (mcp_hosts_ == nullptr) return unavailable();
    auto body = ParseJsonObjectBody(req, /*allow_empty=*/false);
    if (!body.ok()) return body.error();
    JsonFields f(body.value());
    mcp_hosts::ServerSpec spec;
    spec.name = f.RequiredString("name");
    spec.command = f.RequiredString("command");
    if (const json::value* args = f.OptionalValue("args"); args != nullptr && !args->is_null()) {
      if (!args->is_array() || args->as_array().size() > kMaxArgs) {
        f.Fail(absl::StrCat("'args' must be an array of at most ", kMaxArgs, " strings"));
      } else {
        for (const json::value& a : args->as_array()) {
          if (!a.is_string()) {
            f.Fail("'args' must be an array of strings");
            break;
          }
          spec.args.emplace_back(a.as_string());
        }
      }
    }
    spec.env = f.OptionalStringMap("env", 128);
    if (!f.ok()) return f.ErrorResponse();
    auto info = mcp_hosts_->Start(t, req.Param("id"), std::move(spec));
    if (!info.ok()) return StatusResponse(info.status());
    return JsonResponse(201, RenderServer(*info));
  });

  add("GET", "/environments/{id}/mcp-servers", [this, unavailable](Request& req, const Caller& t) {
    if (mcp_hosts_ == nullptr) return unavailable();
    auto servers = mcp_hosts_->List(t, req.Param("id"));
    if (!servers.ok()) return StatusResponse(servers.status());
    json::array out;
    for (const mcp_hosts::ServerInfo& s : *servers) out.push_back(RenderServer(s));
    return JsonResponse(200, json::object{{"servers", std::move(out)}});
  });

  add("GET", "/environments/{id}/mcp-servers/{name}",
      [this, unavailable](Request& req, const Caller& t) {
        if (mcp_hosts_ == nullptr) return unavailable();
        auto info = mcp_hosts_->Get(t, req.Param("id"), req.Param("name"));
        if (!info.ok()) return StatusResponse(info.status());
        return JsonResponse(200, RenderServer(*info));
      });

  add("DELETE", "/environments/{id}/mcp-servers/{name}",
      [this, unavailable](Request& req, const Caller& t) {
        if (mcp_hosts_ == nullptr) return unavailable();
        absl::Status st = mcp_hosts_->Stop(t, req.Param("id"), req.Param("name"));
        if (!st.ok()) return StatusResponse(st);
        return JsonResponse(200,
                            json::object{{"error", false}, {"message", "MCP server stopped."}});
      });

  add("GET", "/environments/{id}/tools", [this, unavailable](Request& req, const Caller& t) {
    if (mcp_hosts_ == nullptr) return unavailable();
    auto tools = mcp_hosts_->Tools(t, req.Param("id"));
    if (!tools.ok()) return StatusResponse(tools.status());
    json::array out;
    for (const mcp_hosts::HostedTool& tool : *tools) {
      json::object o{{"name", absl::StrCat(tool.server, ".", tool.tool)},
                     {"server", tool.server},
                     {"tool", tool.tool}};
      const json::value* d = tool.definition.if_contains("description");
      o["description"] = d != nullptr && d->is_string() ? *d : json::value("");
      const json::value* s = tool.definition.if_contains("inputSchema");
      o["inputSchema"] =
          s != nullptr && s->is_object() ? *s : json::value(json::object{{"type", "object"}});
      out.push_back(std::move(o));
    }
    return JsonResponse(200, json::object{{"tools", std::move(out)}});
  });

  add("POST", "/environments/{id}/tools/{name}/call",
      [this, unavailable](Request& req, const Caller& t) {
        if (mcp_hosts_ == nullptr) return unavailable();
        auto body = ParseJsonObjectBody(req, /*allow_empty=*/true);
        if (!body.ok()) return body.error();
        JsonFields f(body.value());
        json::object arguments;
        if (const json::value* a = f.OptionalValue("arguments"); a != nullptr && !a->is_null()) {
          if (!a->is_object())
            f.Fail("'arguments' must be an object");
          else
            arguments = a->as_object();
        }
        if (!f.ok()) return f.ErrorResponse();
        tools::CallContext ctx{.caller = t};
        // A client that went away cancels the call (notifications/cancelled to the server),
        // which frees the server's call slot now rather than at the call timeout.
        ctx.cancelled = [&req] { return req.ClientGone(); };
        auto result = mcp_hosts_->CallTool(t, req.Param("id"), req.Param("name"), arguments, ctx);
        if (!result.ok()) return StatusResponse(result.status());
        return JsonResponse(200, RenderResult(*result));
      });
}

}  // namespace esb::api
