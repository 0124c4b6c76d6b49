// Time-travel routes (issue 13; docs/api.md "Steps"): parse, call the core
// (EnvironmentManager's step log), render. Paths and JSON are a contract (CLI, SDK, web UI).
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "api/json_util.h"
#include "api/service.h"
#include "common/utf8.h"
#include "common/util.h"

namespace esb::api {

namespace json = boost::json;

namespace {

constexpr int64_t kStepFileChunk = 1 << 20;

// A non-negative integer query or path parameter within [0, max]; nullopt when malformed.
std::optional<int64_t> ParseCount(const std::string& text, int64_t max) {
  if (text.empty() || text.size() > 19) return std::nullopt;
  for (char c : text) {
    if (c < '0' || c > '9') return std::nullopt;
  }
  char* end = nullptr;
  long long v = std::strtoll(text.c_str(), &end, 10);
  if (*end != '\0' || v < 0 || v > max) return std::nullopt;
  return v;
}

json::value OptInt(const std::optional<int64_t>& v) { return v ? json::value(*v) : json::value(); }
json::value OptStr(const std::optional<std::string>& v) {
  return v ? json::value(SanitizeUtf8(*v)) : json::value();
}

json::object RenderStep(const StepRecord& r, bool on_head) {
  return json::object{{"step", r.n},
                      {"parent", OptInt(r.parent)},
                      {"kind", r.kind},
                      {"summary", SanitizeUtf8(r.summary)},
                      {"status", r.status},
                      {"exit_code", OptInt(r.exit_code)},
                      {"error", OptStr(r.error)},
                      {"duration_ms", r.duration_ms},
                      {"capture_ms", r.capture_ms},
                      {"tier", r.tier},
                      {"memory", r.memory},
                      {"memory_detail", OptStr(r.memory_detail)},
                      {"files_changed", r.files_changed},
                      {"created_at", r.created_ms},
                      {"on_head", on_head}};
}

json::object RenderAudit(const AuditEntry& e) {
  json::object o{{"id", e.id},
                 {"time", FormatRfc3339(e.time_ms)},
                 {"action", e.action},
                 {"detail", SanitizeUtf8(e.detail)},
                 {"exit_code", OptInt(e.exit_code)},
                 {"status", e.status},
                 {"duration_ms", e.duration_ms}};
  if (e.egress) {
    o["host"] = SanitizeUtf8(e.egress->host);
    o["method"] = e.egress->method;
    o["path"] = SanitizeUtf8(e.egress->path);
    o["decision"] = e.egress->decision;
  }
  return o;
}

const char* TypeName(ManifestEntry::Type t) {
  switch (t) {
    case ManifestEntry::Type::kDir:
      return "dir";
    case ManifestEntry::Type::kSymlink:
      return "symlink";
    default:
      return "file";
  }
}

// The step number in the path: 400 when it is not a non-negative integer.
std::optional<Response> StepParam(Request& req, int64_t* n) {
  auto v = ParseCount(req.Param("n"), int64_t{1} << 53);
  if (!v)
    return ErrorResponse(400, "bad_request",
                         "the step number must be a non-negative integer (0 is the "
                         "environment's initial state)");
  *n = *v;
  return std::nullopt;
}

// Errors of the steps routes (docs/api.md "Steps"): 410 "collected" when retention released
// what was asked for; 410 "corrupt" when stored state fails verification (the core logged
// it); 409 for a step without state, capture off or another conflict; the rest by the one
// status table.
Response StepStatusResponse(const absl::Status& st) {
  if (IsStepCollected(st) || absl::IsDataLoss(st)) {
    json::object o = ErrorBody("gone", StdView(st.message()));
    o["detail"] = IsStepCollected(st) ? "collected" : "corrupt";
    return JsonResponse(410, o);
  }
  if (absl::IsFailedPrecondition(st)) return ErrorResponse(409, "conflict", StdView(st.message()));
  return StatusResponse(st);
}

// `<name>_after` and `<name>_limit` of GET .../steps/{n} (a window of its files or changes).
std::optional<Response> WindowParams(Request& req, const std::string& name, StepListWindow* w) {
  if (auto v = req.Query(name + "_limit")) {
    auto parsed = ParseCount(*v, kMaxStepFilesListed);
    if (!parsed || *parsed < 1)
      return ErrorResponse(
          400, "bad_request",
          absl::StrCat("'", name, "_limit' must be an integer in 1..", kMaxStepFilesListed));
    w->limit = *parsed;
  }
  if (auto v = req.Query(name + "_after")) {
    if (v->size() > 4096 || !IsValidUtf8(*v))
      return ErrorResponse(400, "bad_request",
                           absl::StrCat("'", name, "_after' must be a path (UTF-8, ≤ 4096 bytes)"));
    w->after = *v;
  }
  return std::nullopt;
}

// The body of rewind/fork: {"step": n}.
std::optional<Response> StepBody(Request& req, int64_t* n) {
  auto body = ParseJsonObjectBody(req, /*allow_empty=*/false);
  if (!body.ok()) return body.error();
  JsonFields f(body.value());
  *n = f.RequiredInt("step", 0, int64_t{1} << 53);
  if (!f.ok()) return f.ErrorResponse();
  return std::nullopt;
}

}  // namespace

json::object RenderStepsStatus(const StepsStatus& s) {
  return json::object{{"capture", s.capture},
                      {"head", OptInt(s.head)},
                      {"count", s.count},
                      {"memory", s.memory},
                      {"memory_reason", SanitizeUtf8(s.memory_reason)}};
}

absl::StatusOr<StepSettings> ParseStepSettings(const json::value& value) {
  StepSettings s;
  if (value.is_bool()) {
    s.capture = value.as_bool();
    return s;
  }
  if (!value.is_object())
    return absl::InvalidArgumentError(
        "'steps' must be false, true or {\"capture\": bool, \"max_steps\": int, \"max_bytes\": "
        "int, \"max_live_memory\": int, \"ttl_s\": int}");
  JsonFields f(value.as_object());
  s.capture = f.OptionalBool("capture", true);
  s.max_steps = f.OptionalInt("max_steps", s.max_steps, 1, kMaxStepsSetting);
  s.max_bytes = f.OptionalInt("max_bytes", s.max_bytes, 0, kMaxStepBytesSetting);
  s.max_live_memory = f.OptionalInt("max_live_memory", s.max_live_memory, 0, kMaxLiveMemorySetting);
  s.ttl_s = f.OptionalInt("ttl_s", s.ttl_s, 0, kMaxStepTtlSetting);
  if (!f.ok()) return absl::InvalidArgumentError(absl::StrCat("steps: ", f.error()));
  return s;
}

void ApiService::RegisterSteps(
    const std::function<void(std::string, std::string_view, RouteFn)>& add) {
  add("GET", "/environments/{id}/steps", [this](Request& req, const Caller& t) {
    int64_t limit = 50;
    int64_t before = -1;
    if (auto v = req.Query("limit")) {
      auto parsed = ParseCount(*v, kMaxStepsListed);
      if (!parsed || *parsed < 1)
        return ErrorResponse(400, "bad_request",
                             absl::StrCat("'limit' must be an integer in 1..", kMaxStepsListed));
      limit = *parsed;
    }
    if (auto v = req.Query("before")) {
      auto parsed = ParseCount(*v, int64_t{1} << 53);
      if (!parsed)
        return ErrorResponse(400, "bad_request", "'before' must be a non-negative step number");
      before = *parsed;
    }
    auto page = manager_->ListSteps(t, req.Param("id"), before, static_cast<int>(limit));
    if (!page.ok()) return StepStatusResponse(page.status());
    json::array steps;
    for (size_t i = 0; i < page->steps.size(); ++i)
      steps.push_back(RenderStep(page->steps[i], page->on_head[i]));
    return JsonResponse(200, json::object{{"steps", std::move(steps)},
                                          {"head", OptInt(page->head)},
                                          {"next_before", OptInt(page->next_before)}});
  });

  add("GET", "/environments/{id}/steps/{n}", [this](Request& req, const Caller& t) {
    int64_t n = 0;
    if (auto bad = StepParam(req, &n)) return *bad;
    StepListWindow files_window, changes_window;
    if (auto bad = WindowParams(req, "files", &files_window)) return *bad;
    if (auto bad = WindowParams(req, "changes", &changes_window)) return *bad;
    auto d = manager_->GetStep(t, req.Param("id"), n, files_window, changes_window);
    if (!d.ok()) return StepStatusResponse(d.status());
    json::object o = RenderStep(d->record, d->on_head);
    json::object detail;
    {
      boost::system::error_code ec;
      json::value v = json::parse(d->record.detail_json, ec);
      if (!ec && v.is_object()) detail = std::move(v.as_object());
    }
    auto take = [&](const char* key, json::value fallback) {
      json::value* v = detail.if_contains(key);
      return v ? std::move(*v) : fallback;
    };
    o["input"] = take("input", json::object{});
    o["output"] =
        take("output", json::object{{"stdout", ""}, {"stderr", ""}, {"truncated", false}});
    json::value vars;  // null: not captured
    if (!d->variables_json.empty()) {
      boost::system::error_code ec;
      json::value v = json::parse(d->variables_json, ec);
      if (!ec && v.is_array()) vars = std::move(v);
    }
    o["variables"] = std::move(vars);
    json::array files;
    for (const ManifestEntry& e : d->files.entries) {
      char mode[8];
      std::snprintf(mode, sizeof mode, "%04o", e.mode & 07777);
      json::object f{
          {"path", SanitizeUtf8(e.path)},
          {"type", TypeName(e.type)},
          {"size", e.size},
          {"mode", mode},
          {"sha256", e.type == ManifestEntry::Type::kFile ? json::value(e.sha256) : json::value()}};
      if (e.type == ManifestEntry::Type::kSymlink) f["target"] = SanitizeUtf8(e.target);
      files.push_back(std::move(f));
    }
    o["files"] = d->has_files ? json::value(std::move(files)) : json::value();
    o["files_total"] = d->files_total;
    o["files_next"] = OptStr(d->files_next);
    json::array changes;
    for (const ManifestChange& c : d->changes)
      changes.push_back(json::object{{"path", SanitizeUtf8(c.path)}, {"change", c.change}});
    o["changes"] = std::move(changes);
    o["changes_total"] = d->changes_total;
    o["changes_next"] = OptStr(d->changes_next);
    o["artifacts"] = take("artifacts", json::array{});
    json::array audit, egress;
    for (const AuditEntry& e : d->audit) audit.push_back(RenderAudit(e));
    for (const AuditEntry& e : d->egress) egress.push_back(RenderAudit(e));
    o["audit"] = std::move(audit);
    o["egress"] = std::move(egress);
    o["shell"] =
        json::object{{"cwd", d->cwd.empty() ? json::value() : json::value(SanitizeUtf8(d->cwd))}};
    return JsonResponse(200, o);
  });

  add("GET", "/environments/{id}/steps/{n}/files", [this](Request& req, const Caller& t) {
    int64_t n = 0;
    if (auto bad = StepParam(req, &n)) return *bad;
    auto path = req.Query("path");
    if (!path || path->empty())
      return ErrorResponse(400, "bad_request", "'path' is required (a file under /workspace)");
    auto file = manager_->OpenStepFile(t, req.Param("id"), n, *path);
    if (!file.ok()) return StepStatusResponse(file.status());
    if (file->symlink) return Response::Text(200, file->target, "application/octet-stream");
    // Streamed a chunk at a time (a blob is up to 256 MiB); the first chunk before answering,
    // so that a collected or corrupt blob is a clean 410.
    auto first = file->read(0, kStepFileChunk);
    if (!first.ok()) return StepStatusResponse(first.status());
    const int64_t size = file->size;
    Response resp = Response::Stream(
        200, "application/octet-stream",
        [f = *std::move(file), chunk = *std::move(first)](ResponseWriter& w) mutable {
          int64_t offset = 0;
          while (!chunk.empty()) {
            if (!w.Write(chunk)) return;  // the client went away
            offset += static_cast<int64_t>(chunk.size());
            if (offset >= f.size) return;
            auto next = f.read(offset, kStepFileChunk);
            if (!next.ok()) return;  // headers are gone: the cut chunked body tells the client
            chunk = *std::move(next);
          }
        });
    resp.SetHeader("X-File-Size", std::to_string(size));
    return resp;
  });

  add("GET", "/environments/{id}/steps/{n}/diff", [this](Request& req, const Caller& t) {
    int64_t n = 0;
    if (auto bad = StepParam(req, &n)) return *bad;
    auto path = req.Query("path");
    if (!path || path->empty())
      return ErrorResponse(400, "bad_request", "'path' is required (a file under /workspace)");
    auto d = manager_->DiffStepFile(t, req.Param("id"), n, *path);
    if (!d.ok()) return StepStatusResponse(d.status());
    return JsonResponse(
        200, json::object{{"path", SanitizeUtf8(d->path)},
                          {"change", d->change.empty() ? json::value() : json::value(d->change)},
                          {"binary", d->binary},
                          {"truncated", d->truncated},
                          {"diff", d->diff}});
  });

  add("POST", "/environments/{id}/rewind", [this](Request& req, const Caller& t) {
    int64_t n = 0;
    if (auto bad = StepBody(req, &n)) return *bad;
    auto r = manager_->Rewind(t, req.Param("id"), n);
    if (!r.ok()) return StepStatusResponse(r.status());
    return JsonResponse(200,
                        json::object{{"head", r->head},
                                     {"memory", r->memory},
                                     {"environment", RenderEnvironment(r->environment, false)}});
  });

  add("POST", "/environments/{id}/fork", [this](Request& req, const Caller& t) {
    int64_t n = 0;
    if (auto bad = StepBody(req, &n)) return *bad;
    auto f = manager_->Fork(t, req.Param("id"), n);
    if (!f.ok()) return StepStatusResponse(f.status());
    json::object o = RenderEnvironment(f->environment, false);
    o["forked_from"] = json::object{{"environment_id", f->source_id}, {"step", f->step}};
    o["memory"] = f->memory;
    return JsonResponse(201, o);
  });
}

}  // namespace esb::api
