#include "api/mcp/esb_tools.h"

#include <atomic>
#include <chrono>
#include <cmath>
#include <regex>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "api/service.h"
#include "api/tools_catalog.h"
#include "common/utf8.h"
#include "common/util.h"

namespace esb::api::mcp {
namespace json = boost::json;
using tools::CallContext;
using tools::ToolResult;

namespace {

size_t CodePoints(std::string_view s) {
  size_t n = 0;
  for (unsigned char c : s)
    if ((c & 0xC0) != 0x80) ++n;
  return n;
}

std::string Field(const std::string& where, std::string_view key) {
  return where.empty() ? std::string(key) : absl::StrCat(where, ".", std::string(key));
}

// A text result with the same JSON in structuredContent (MCP: structured content is also
// given as text for clients that do not read it).
ToolResult Structured(json::object out, bool is_error) {
  ToolResult r;
  r.content.push_back(json::object{{"type", "text"}, {"text", json::serialize(out)}});
  r.structured = std::move(out);
  r.is_error = is_error;
  return r;
}

ToolResult Failure(std::string_view message) {
  return Structured(json::object{{"error", true}, {"message", SanitizeUtf8(message)}}, true);
}

ToolResult FailureFrom(const absl::Status& status) { return Failure(StdView(status.message())); }

std::string Str(const json::object& args, std::string_view key, std::string dflt = "") {
  const json::value* v = args.if_contains(key);
  return v && v->is_string() ? std::string(v->get_string()) : dflt;
}

int64_t Int(const json::object& args, std::string_view key, int64_t dflt) {
  const json::value* v = args.if_contains(key);
  if (v == nullptr) return dflt;
  if (v->is_int64()) return v->get_int64();
  if (v->is_uint64()) return static_cast<int64_t>(v->get_uint64());
  if (v->is_double()) return static_cast<int64_t>(v->get_double());
  return dflt;
}

bool HasNul(std::string_view s) { return s.find('\0') != std::string_view::npos; }

// Streams chunks of output as progress messages (numbered, monotonic).
class ProgressSink {
 public:
  explicit ProgressSink(const CallContext& ctx) : ctx_(ctx) {}
  void Send(std::string_view prefix, std::string_view chunk) {
    if (!ctx_.progress || chunk.empty()) return;
    tools::Progress p;
    p.progress = static_cast<double>(++n_);
    p.message = absl::StrCat(std::string(prefix), SanitizeUtf8(chunk));
    ctx_.progress(p);
  }
  bool Cancelled() const { return ctx_.cancelled && ctx_.cancelled(); }

 private:
  const CallContext& ctx_;
  std::atomic<int64_t> n_{0};
};

}  // namespace

std::string SchemaViolation(const json::object& schema, const json::value& value,
                            const std::string& where) {
  const std::string name = where.empty() ? "arguments" : absl::StrCat("'", where, "'");
  if (const json::value* t = schema.if_contains("type"); t && t->is_string()) {
    const std::string_view type = t->get_string();
    bool ok = true;
    if (type == "object")
      ok = value.is_object();
    else if (type == "array")
      ok = value.is_array();
    else if (type == "string")
      ok = value.is_string();
    else if (type == "boolean")
      ok = value.is_bool();
    else if (type == "number")
      ok = value.is_number();
    else if (type == "integer")
      ok = value.is_int64() || value.is_uint64() ||
           (value.is_double() && std::isfinite(value.get_double()) &&
            std::floor(value.get_double()) == value.get_double());
    if (!ok) {
      const char* article = type == "object" || type == "array" || type == "integer" ? "an" : "a";
      return absl::StrCat(name, " must be ", article, " ", std::string(type));
    }
  }
  if (const json::value* e = schema.if_contains("enum"); e && e->is_array()) {
    bool found = false;
    for (const json::value& x : e->get_array()) found = found || x == value;
    if (!found) {
      std::string options;
      for (const json::value& x : e->get_array())
        absl::StrAppend(&options, options.empty() ? "" : ", ", json::serialize(x));
      return absl::StrCat(name, " must be one of ", options);
    }
  }
  if (value.is_number()) {
    const double x = value.to_number<double>();
    if (const json::value* m = schema.if_contains("minimum"); m && x < m->to_number<double>())
      return absl::StrCat(name, " must be at least ", json::serialize(*m));
    if (const json::value* m = schema.if_contains("maximum"); m && x > m->to_number<double>())
      return absl::StrCat(name, " must be at most ", json::serialize(*m));
    if (const json::value* m = schema.if_contains("exclusiveMinimum");
        m && x <= m->to_number<double>())
      return absl::StrCat(name, " must be greater than ", json::serialize(*m));
  }
  if (value.is_string()) {
    std::string_view s = value.get_string();
    const size_t n = CodePoints(s);
    if (const json::value* m = schema.if_contains("minLength");
        m && n < static_cast<size_t>(m->to_number<int64_t>()))
      return n == 0 ? absl::StrCat(name, " must not be empty")
                    : absl::StrCat(name, " must be at least ", json::serialize(*m),
                                   " characters long");
    if (const json::value* m = schema.if_contains("maxLength");
        m && n > static_cast<size_t>(m->to_number<int64_t>()))
      return absl::StrCat(name, " must be at most ", json::serialize(*m), " characters long");
    if (const json::value* p = schema.if_contains("pattern"); p && p->is_string()) {
      // Only the catalogue's own patterns, on strings maxLength already bounded.
      if (!std::regex_search(std::string(s), std::regex(std::string(p->get_string()))))
        return absl::StrCat(name, " must match ", std::string(p->get_string()));
    }
  }
  if (value.is_array()) {
    const json::array& a = value.get_array();
    if (const json::value* m = schema.if_contains("maxItems");
        m && a.size() > static_cast<size_t>(m->to_number<int64_t>()))
      return absl::StrCat(name, " must have at most ", json::serialize(*m), " items");
    if (const json::value* items = schema.if_contains("items"); items && items->is_object()) {
      for (size_t i = 0; i < a.size(); ++i) {
        std::string err =
            SchemaViolation(items->get_object(), a[i], absl::StrCat(where, "[", i, "]"));
        if (!err.empty()) return err;
      }
    }
  }
  if (value.is_object()) {
    const json::object& o = value.get_object();
    const json::value* props = schema.if_contains("properties");
    if (const json::value* req = schema.if_contains("required"); req && req->is_array()) {
      for (const json::value& k : req->get_array()) {
        if (k.is_string() && !o.contains(k.get_string()))
          return absl::StrCat("missing required argument '", Field(where, k.get_string()), "'");
      }
    }
    for (const auto& kv : o) {
      const json::value* sub =
          props && props->is_object() ? props->get_object().if_contains(kv.key()) : nullptr;
      if (sub == nullptr) {
        if (const json::value* ap = schema.if_contains("additionalProperties");
            ap && ap->is_bool() && !ap->get_bool()) {
          return absl::StrCat("unknown argument '",
                              SanitizeUtf8(Field(where, kv.key()).substr(0, 100)), "'");
        }
        continue;
      }
      if (sub->is_object()) {
        std::string err = SchemaViolation(sub->get_object(), kv.value(), Field(where, kv.key()));
        if (!err.empty()) return err;
      }
    }
  }
  return "";
}

EsbTools::EsbTools(EsbToolsDeps deps, EsbToolsOptions options)
    : deps_(std::move(deps)), options_(options) {
  for (json::value& t : McpTools()) definitions_.push_back(std::move(t.as_object()));
}

absl::StatusOr<std::vector<tools::ToolDefinition>> EsbTools::ListTools(const Caller&) {
  return definitions_;
}

absl::StatusOr<ToolResult> EsbTools::CallTool(std::string_view name, const json::object& arguments,
                                              const CallContext& context) {
  const tools::ToolDefinition* def = nullptr;
  for (const tools::ToolDefinition& d : definitions_)
    if (d.at("name").as_string() == name) def = &d;
  if (def == nullptr)
    return absl::NotFoundError(absl::StrCat("unknown tool '", std::string(name), "'"));
  const std::string tool(name);
  const json::value* env = arguments.if_contains("environment_id");
  const std::string env_id = env && env->is_string() ? std::string(env->get_string()) : "";

  // A call for a hosted server's tool is that server's call: its provider gates and audits it
  // (with the server's name); only when it cannot get there is it esbd's own failed call.
  if (tool == "call_environment_tool" && deps_.environment_tools &&
      SchemaViolation(def->at("inputSchema").as_object(), arguments).empty()) {
    absl::StatusOr<std::shared_ptr<tools::ToolProvider>> hosted =
        deps_.environment_tools(context.caller, env_id);
    if (hosted.ok() && *hosted != nullptr) {
      const json::value* a = arguments.if_contains("arguments");
      absl::StatusOr<ToolResult> r = (*hosted)->CallTool(
          Str(arguments, "name"), a ? a->get_object() : json::object(), context);
      if (r.ok() || !absl::IsNotFound(r.status())) return r.ok() ? r : FailureFrom(r.status());
      // An unknown hosted tool is the model's mistake: a tool result, through the gate below.
    }
  }

  return deps_.gate->Call(
      tools::GateCall{tool, "esbd", env_id}, arguments, context,
      tools::ToolCallGate::StreamingDispatch(
          [&](const json::object& args, const CallContext& guarded) -> absl::StatusOr<ToolResult> {
            std::string violation = SchemaViolation(def->at("inputSchema").as_object(), args);
            if (!violation.empty()) return Failure(absl::StrCat(tool, ": ", violation));
            return Dispatch(tool, args, guarded);  // its progress is scanned by the gate
          }));
}

absl::StatusOr<ToolResult> EsbTools::Dispatch(const std::string& name, const json::object& args,
                                              const CallContext& context) {
  // The gate writes the call's row: the core's own rows would be a second one.
  const Caller step = context.caller.Step();
  const std::string id = Str(args, "environment_id");
  EnvironmentManager& m = *deps_.manager;

  if (name == "create_environment") {
    auto info = deps_.api->CreateEnvironmentFrom(args, step);
    if (!info.ok()) return FailureFrom(info.status());
    json::object out = deps_.api->RenderEnvironment(*info, false);
    out["pooled"] = info->pooled;
    return Structured(std::move(out), false);
  }
  if (name == "list_environments") {
    auto list = m.List(step, false);
    if (!list.ok()) return FailureFrom(list.status());
    json::array envs;
    for (const EnvironmentInfo& info : *list)
      envs.push_back(deps_.api->RenderEnvironment(info, false));
    return Structured(json::object{{"environments", std::move(envs)}}, false);
  }
  if (name == "delete_environment") {
    absl::Status st = m.Destroy(step, id);
    if (!st.ok()) return FailureFrom(st);
    return Structured(json::object{{"error", false}, {"message", "Environment deleted."}}, false);
  }
  if (name == "execute_command") {
    ExecRequest req;
    req.command = Str(args, "command");
    if (HasNul(req.command)) return Failure("'command' must not contain NUL bytes");
    int64_t timeout_s = Int(args, "timeout_seconds", 60);
    if (context.deadline_ms > 0) {
      const int64_t left_s = (context.deadline_ms - NowUnixMs()) / 1000;
      if (left_s < 1) return Failure("the call's deadline has passed");
      timeout_s = std::min(timeout_s, left_s);
    }
    req.timeout = std::chrono::seconds(timeout_s);
    req.max_output_bytes = options_.max_output_bytes;
    ProgressSink progress(context);
    auto result = m.Exec(step, id, req, [&](Stream s, std::string_view chunk) {
      progress.Send(s == Stream::kStderr ? "[stderr] " : "", chunk);
      return !progress.Cancelled();
    });
    if (!result.ok()) return FailureFrom(result.status());
    const bool error = result->exit_code != 0;
    json::object out{{"error", error},
                     {"stdout", SanitizeUtf8(result->stdout_data)},
                     {"stderr", SanitizeUtf8(result->stderr_data)},
                     {"exit_code", result->exit_code}};
    if (result->timed_out) out["timed_out"] = true;
    if (result->truncated) out["truncated"] = true;
    return Structured(std::move(out), error);
  }
  if (name == "write_file") {
    const std::string path = Str(args, "path");
    if (HasNul(path)) return Failure("'path' must not contain NUL bytes");
    absl::Status st = m.WriteFile(step, id, path, Str(args, "content"), 0, true);
    if (!st.ok()) return FailureFrom(st);
    return Structured(json::object{{"error", false}, {"message", "File saved successfully."}},
                      false);
  }
  if (name == "read_file") {
    const std::string path = Str(args, "path");
    if (HasNul(path)) return Failure("'path' must not contain NUL bytes");
    std::string data;
    for (int64_t offset = 0;;) {
      auto chunk = m.ReadFile(step, id, path, offset, options_.max_read_bytes + 1 - offset);
      if (!chunk.ok()) {
        return Structured(
            json::object{{"error", true},
                         {"content", SanitizeUtf8(StdView(chunk.status().message()))}},
            true);
      }
      if (chunk->file_size > options_.max_read_bytes) {
        return Structured(
            json::object{
                {"error", true},
                {"content", absl::StrCat("'", SanitizeUtf8(path), "' is ", chunk->file_size,
                                         " bytes; read_file returns at "
                                         "most ",
                                         options_.max_read_bytes,
                                         " bytes: read parts of it with "
                                         "execute_command (head, tail, sed -n)")}},
            true);
      }
      data += chunk->data;
      offset += static_cast<int64_t>(chunk->data.size());
      if (chunk->eof || chunk->data.empty() || offset > options_.max_read_bytes) break;
    }
    if (!IsValidUtf8(data)) {
      return Structured(
          json::object{{"error", true},
                       {"content", absl::StrCat("'", SanitizeUtf8(path), "' is not UTF-8 text")}},
          true);
    }
    return Structured(json::object{{"error", false}, {"content", std::move(data)}}, false);
  }
  if (name == "list_files") {
    const std::string path = Str(args, "path", ".");
    if (path.empty() || HasNul(path)) return Failure("'path' must be a non-empty path");
    auto listing = m.ListDir(step, id, path);
    if (!listing.ok()) return FailureFrom(listing.status());
    json::array entries;
    for (const FileEntry& e : listing->entries) {
      entries.push_back(
          json::object{{"name", SanitizeUtf8(e.name)}, {"type", e.type}, {"size", e.size}});
    }
    return Structured(
        json::object{
            {"error", false}, {"entries", std::move(entries)}, {"truncated", listing->truncated}},
        false);
  }
  if (name == "run_code") {
    if (deps_.pipeline == nullptr) return Failure("run_code is not available on this daemon");
    run::RunSpec spec;
    spec.environment_id = id;
    spec.code = Str(args, "code");
    spec.runtime = id.empty() ? Str(args, "tier", "auto") : "";  // "": the environment's own
    spec.timeout_ms = Int(args, "timeout_seconds", 30) * 1000;
    if (const json::value* p = args.if_contains("packages"); p && p->is_array()) {
      for (const json::value& x : p->get_array()) spec.packages.emplace_back(x.get_string());
    }
    auto plan = deps_.pipeline->Prepare(step, std::move(spec));
    if (!plan.ok()) return FailureFrom(plan.status());
    ProgressSink progress(context);
    run::RunStreams streams{[&](Stream s, std::string_view chunk) {
                              progress.Send(s == Stream::kStderr ? "[stderr] " : "", chunk);
                              return !progress.Cancelled();
                            },
                            [&](Stream, std::string_view chunk) {
                              progress.Send("[install] ", chunk);
                              return !progress.Cancelled();
                            }};
    auto outcome = deps_.pipeline->Execute(step, *plan, streams);
    if (!outcome.ok()) return FailureFrom(outcome.status());
    const RunResult& r = outcome->result;
    const bool error = r.exit_code != 0 || r.error.has_value() || r.timed_out;
    json::object out{{"error", error},
                     {"stdout", SanitizeUtf8(r.stdout_data)},
                     {"stderr", SanitizeUtf8(r.stderr_data)},
                     {"exit_code", r.exit_code},
                     {"tier", outcome->tier},
                     {"reason", SanitizeUtf8(outcome->reason)}};
    out["exception"] =
        r.error ? json::value(json::object{{"type", SanitizeUtf8(r.error->type)},
                                           {"message", SanitizeUtf8(r.error->message)},
                                           {"traceback", SanitizeUtf8(r.error->traceback)}})
                : json::value();
    out["value"] = r.value ? json::value(SanitizeUtf8(*r.value)) : json::value();
    json::value table;
    if (!r.table_json.empty()) {
      boost::system::error_code ec;
      json::value t = json::parse(r.table_json, ec);
      if (!ec && t.is_object()) table = std::move(t);
    }
    out["table"] = table;
    if (r.timed_out) out["timed_out"] = true;
    if (!r.unsupported_module.empty()) out["unsupported_module"] = r.unsupported_module;
    json::array artifacts;
    for (const ArtifactMeta& a : outcome->artifacts) {
      artifacts.push_back(json::object{{"id", a.id},
                                       {"name", SanitizeUtf8(a.name)},
                                       {"kind", a.kind},
                                       {"mime_type", a.mime_type},
                                       {"size", a.size}});
    }
    out["artifacts"] = std::move(artifacts);
    ToolResult result = Structured(std::move(out), error);
    if (!table.is_null()) {
      result.content.push_back(json::object{
          {"type", "text"}, {"text", absl::StrCat("table: ", json::serialize(table))}});
    }
    int images = 0;
    for (const ArtifactMeta& a : outcome->artifacts) {
      if (deps_.artifacts == nullptr || a.kind != "image" || !a.mime_type.starts_with("image/") ||
          a.size > options_.max_image_bytes || images >= options_.max_images) {
        continue;
      }
      auto bytes = deps_.artifacts->Read(context.caller.tenant, a.environment_id, a.id);
      if (!bytes.ok()) continue;
      result.content.push_back(json::object{
          {"type", "image"}, {"data", absl::Base64Escape(*bytes)}, {"mimeType", a.mime_type}});
      ++images;
    }
    return result;
  }
  if (name == "list_environment_tools" || name == "call_environment_tool") {
    if (!deps_.environment_tools) return Failure(kHostedUnavailable);
    auto hosted = deps_.environment_tools(context.caller, id);
    if (!hosted.ok()) return FailureFrom(hosted.status());
    if (*hosted == nullptr) return Failure(kHostedUnavailable);
    if (name == "call_environment_tool") {
      // Reached only when the hosted provider does not know the tool (CallTool above).
      return Failure(absl::StrCat("environment ", id, " has no tool '",
                                  SanitizeUtf8(Str(args, "name")),
                                  "': list_environment_tools names them"));
    }
    auto list = (*hosted)->ListTools(context.caller);
    if (!list.ok()) return FailureFrom(list.status());
    json::array out;
    for (const tools::ToolDefinition& t : *list) out.push_back(t);
    return Structured(json::object{{"tools", std::move(out)}}, false);
  }
  return absl::NotFoundError(absl::StrCat("unknown tool '", std::string(name), "'"));
}

}  // namespace esb::api::mcp
