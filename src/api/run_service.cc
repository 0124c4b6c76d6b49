#include "api/run_service.h"

#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "api/json_util.h"
#include "api/sse_output.h"
#include "common/util.h"

namespace esb::api {
namespace json = boost::json;
namespace {

json::object Render(const run::RunOutcome& o) {
  const RunResult& r = o.result;
  json::value error;
  if (r.error)
    error = json::object{{"type", SanitizeUtf8(r.error->type)},
                         {"message", SanitizeUtf8(r.error->message)},
                         {"traceback", SanitizeUtf8(r.error->traceback)}};
  json::object out{{"stdout", SanitizeUtf8(r.stdout_data)},
                   {"stderr", SanitizeUtf8(r.stderr_data)},
                   {"exit_code", r.exit_code},
                   {"error", std::move(error)},
                   {"duration_ms", r.duration_ms},
                   {"timed_out", r.timed_out},
                   {"truncated", r.truncated},
                   {"tier", o.tier},
                   {"reason", o.reason}};
  if (!r.unsupported_module.empty()) out["unsupported_module"] = r.unsupported_module;
  if (r.instance_reset) out["instance_reset"] = true;
  if (r.kernel) {
    out["value"] = r.value ? json::value(SanitizeUtf8(*r.value)) : json::value(nullptr);
    out["kernel_restarted"] = r.kernel_restarted;
    json::value table;  // null unless the kernel reported one
    if (!r.table_json.empty()) {
      boost::system::error_code ec;
      json::value t = json::parse(r.table_json, ec);
      if (!ec && t.is_object()) table = std::move(t);
    }
    out["table"] = std::move(table);
  }
  json::array artifacts;
  for (const ArtifactMeta& a : o.artifacts) artifacts.push_back(RenderArtifact(a));
  out["artifacts"] = std::move(artifacts);
  if (!o.packages.empty()) {
    json::array packages;
    for (const packages::InstalledPackage& p : o.packages) {
      json::object e{{"name", p.name}, {"version", p.version}};
      if (p.preinstalled)
        e["preinstalled"] = true;
      else
        e["from_cache"] = p.from_cache;
      packages.push_back(std::move(e));
    }
    out["packages"] = std::move(packages);
    out["install_ms"] = o.install_ms;
  }
  if (!o.artifact_errors.empty()) {
    json::array errors;
    for (const std::string& e : o.artifact_errors) errors.emplace_back(SanitizeUtf8(e));
    out["artifact_errors"] = std::move(errors);
  }
  return out;
}

// One line of requirements.txt: comments and blank lines are skipped, a requirement is
// appended to `out`; "" or why the line is refused (pip options, continuation lines).
std::string RequirementLine(absl::string_view line, std::vector<std::string>* out) {
  // A comment starts at '#' at the line's start or after white space (pip's rule).
  for (size_t i = 0; i < line.size(); ++i) {
    if (line[i] == '#' && (i == 0 || line[i - 1] == ' ' || line[i - 1] == '\t')) {
      line = line.substr(0, i);
      break;
    }
  }
  line = absl::StripAsciiWhitespace(line);
  if (line.empty()) return "";
  if (line.front() == '-')
    return absl::StrCat("pip options such as '", SanitizeUtf8(StdView(line.substr(0, 40))),
                        "' are not supported (the index is the daemon's)");
  if (line.back() == '\\') return "line continuations are not supported";
  out->emplace_back(line);
  return "";
}

// Prepare's refusals; a missing tier gets its own machine-readable code (docs/api.md).
Response RunErrorResponse(const absl::Status& status) {
  if (run::IsTierUnavailable(status)) {
    return ErrorResponse(400, "tier_unavailable", StdView(status.message()));
  }
  return StatusResponse(status);
}

}  // namespace

RunHandler MakeRunHandler(const run::RunPipeline* pipeline) {
  return [pipeline](const Caller& caller, const std::string& env_id, Request& req) -> Response {
    auto body = ParseJsonObjectBody(req, /*allow_empty=*/false);
    if (!body.ok()) return body.error();
    JsonFields f(body.value());
    run::RunSpec spec;
    spec.environment_id = env_id;
    spec.code = f.RequiredString("code");
    spec.runtime = f.OptionalEnum("runtime", env_id.empty() ? "auto" : "nano",
                                  {"auto", "nano", "heavy", "container"});
    spec.timeout_ms = f.OptionalInt("timeout_ms", 30000, 1, run::kMaxRunTimeoutMs);
    spec.memory_mb = f.OptionalInt("memory_limit_mb", 0, 16, 16384);
    auto string_list = [&f](const char* key, std::vector<std::string>* out) -> bool {
      const json::value* v = f.OptionalValue(key);
      if (!v || v->is_null()) return false;
      if (!v->is_array()) {
        f.Fail(absl::StrCat("'", key, "' must be an array of strings"));
        return true;
      }
      out->clear();
      for (const auto& x : v->as_array()) {
        if (!x.is_string()) f.Fail(absl::StrCat("'", key, "' must be an array of strings"));
        else out->emplace_back(x.as_string());
      }
      return true;
    };
    string_list("packages", &spec.packages);
    // `requirements`: requirements.txt text, or its lines as an array (what seed 003's tool
    // plugin sends). Its requirement lines join `packages`.
    if (const json::value* rq = f.OptionalValue("requirements"); rq && !rq->is_null()) {
      std::vector<std::string> lines;
      if (rq->is_string()) {
        lines = absl::StrSplit(AbslView(rq->as_string()), '\n');
      } else if (rq->is_array()) {
        string_list("requirements", &lines);
      } else {
        f.Fail("'requirements' must be requirements.txt text or an array of strings");
      }
      for (size_t i = 0; i < lines.size(); ++i) {
        if (auto error = RequirementLine(lines[i], &spec.packages); !error.empty()) {
          f.Fail(absl::StrCat("'requirements' line ", i + 1, ": ", error));
          break;  // the first bad line is enough to say
        }
      }
    }
    std::vector<std::string> allowed;
    if (string_list("allowed_modules", &allowed)) spec.allowed_modules = allowed;
    string_list("figure_formats", &spec.figure_formats);
    spec.intent = f.OptionalString("intent", "");  // active for this run only
    if (!f.ok()) return f.ErrorResponse();
    if (!spec.intent.empty()) {
      if (absl::Status st = governance::ValidateIntentName(spec.intent); !st.ok())
        return ErrorResponse(400, "bad_request", absl::StrCat("'intent': ", st.message()));
    }
    if (spec.code.size() > (4 << 20))
      return ErrorResponse(413, "payload_too_large", "'code' is longer than 4 MiB");

    // Everything the core can refuse with a plain 4xx is refused before running (and before
    // an SSE stream starts).
    absl::StatusOr<run::RunPlan> plan = pipeline->Prepare(caller, std::move(spec));
    if (!plan.ok()) return RunErrorResponse(plan.status());

    if (req.Accepts("text/event-stream")) {
      return Response::Sse([pipeline, caller, plan = *std::move(plan)](ResponseWriter& w) {
        SseOutput output(w);
        SseOutput install(w, "install", "install");
        absl::StatusOr<run::RunOutcome> outcome =
            pipeline->Execute(caller, plan, run::RunStreams{output.Sink(), install.Sink()});
        output.Flush();
        install.Flush();
        if (!outcome.ok()) {
          Response err = StatusResponse(outcome.status());
          w.WriteEvent("error", ErrorBody(ErrorCodeForStatus(err.status),
                                          StdView(outcome.status().message())));
          return;
        }
        if (!outcome->result.streamed) {  // the nano tier answers at the end
          output.Emit(Stream::kStdout, outcome->result.stdout_data);
          output.Emit(Stream::kStderr, outcome->result.stderr_data);
        }
        w.WriteEvent("result", Render(*outcome));
      });
    }
    // Not streaming: still notice a client that went away, and stop its code.
    auto alive = [&req](Stream, std::string_view) { return !req.ClientGone(); };
    absl::StatusOr<run::RunOutcome> outcome =
        pipeline->Execute(caller, *plan, run::RunStreams{alive, alive});
    if (!outcome.ok()) return StatusResponse(outcome.status());
    return JsonResponse(200, Render(*outcome));
  };
}

}  // namespace esb::api
