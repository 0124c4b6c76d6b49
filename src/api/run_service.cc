#include "api/run_service.h"

#include <algorithm>
#include <regex>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "api/heavy_kernel.h"
#include "api/json_util.h"
#include "common/util.h"

namespace esb::api {
namespace json = boost::json;
namespace {

struct Outcome {
  std::string stdout_data, stderr_data;
  int exit_code = -1;
  int64_t duration_ms = 0;
  bool timed_out = false, truncated = false;
  std::optional<RunError> error;
  std::string unsupported_module;
  std::string tier, reason;
  bool instance_reset = false;
  // Stateful container kernel only: the repr of the cell's final expression, and whether the
  // kernel had to be killed (its state is gone).
  bool kernel = false;
  std::optional<std::string> value;
  bool kernel_restarted = false;
};

// The last "Type: message" line of a CPython traceback on stderr.
std::optional<RunError> ErrorFromTraceback(const std::string& stderr_data) {
  size_t tb = stderr_data.rfind("Traceback (most recent call last):");
  if (tb == std::string::npos) return std::nullopt;
  RunError e;
  e.traceback = stderr_data.substr(tb);
  static const std::regex kLast(R"(\n([A-Za-z_][\w.]*)(?:: ([^\n]*))?\n?$)");
  std::smatch m;
  if (std::regex_search(e.traceback, m, kLast)) {
    e.type = m[1];
    e.message = m[2];
  } else {
    e.type = "Error";
  }
  return e;
}

json::object Render(const Outcome& o) {
  json::value error;
  if (o.error)
    error = json::object{{"type", SanitizeUtf8(o.error->type)},
                         {"message", SanitizeUtf8(o.error->message)},
                         {"traceback", SanitizeUtf8(o.error->traceback)}};
  json::object out{{"stdout", SanitizeUtf8(o.stdout_data)},
                   {"stderr", SanitizeUtf8(o.stderr_data)},
                   {"exit_code", o.exit_code},
                   {"error", std::move(error)},
                   {"duration_ms", o.duration_ms},
                   {"timed_out", o.timed_out},
                   {"truncated", o.truncated},
                   {"tier", o.tier},
                   {"reason", o.reason}};
  if (!o.unsupported_module.empty()) out["unsupported_module"] = o.unsupported_module;
  if (o.instance_reset) out["instance_reset"] = true;
  if (o.kernel) {
    out["value"] = o.value ? json::value(SanitizeUtf8(*o.value)) : json::value(nullptr);
    out["kernel_restarted"] = o.kernel_restarted;
  }
  return out;
}

Outcome FromNano(const RunResult& r) {
  Outcome o;
  o.stdout_data = r.stdout_data;
  o.stderr_data = r.stderr_data;
  o.exit_code = r.exit_code;
  o.duration_ms = r.duration_ms;
  o.timed_out = r.timed_out;
  o.truncated = r.truncated;
  o.error = r.error;
  o.unsupported_module = r.unsupported_module;
  o.instance_reset = r.instance_reset;
  o.tier = "nano";
  return o;
}

// A stateful cell in a container environment, through kernel.py (heavy_kernel.cc) and the
// ordinary WriteFile / Exec / ReadFile calls.
absl::StatusOr<Outcome> RunInContainerKernel(EnvironmentManager* manager,
                                             const std::string& tenant, const std::string& id,
                                             const std::string& code, int64_t timeout_ms) {
  const std::string dir(kHeavyKernelDir), kernel(kHeavyKernelPath);
  // Written every time: it is small, and a stale or tampered copy gets replaced.
  if (absl::Status st = manager->WriteFile(tenant, id, kernel, HeavyKernelSource(), 0, true);
      !st.ok())
    return st;
  const std::string tag = RandomHex(8);
  const std::string cell = absl::StrCat(dir, "/cell-", tag, ".py");
  const std::string result = absl::StrCat(dir, "/result-", tag, ".json");
  if (absl::Status st = manager->WriteFile(tenant, id, cell, code, 0, true); !st.ok()) return st;
  ExecRequest exec;
  exec.command = absl::StrCat("python3 ", kernel, " run ", cell, " ", result, " ", timeout_ms);
  exec.timeout = std::chrono::milliseconds(timeout_ms + 5000);
  auto r = manager->Exec(tenant, id, exec, nullptr);
  if (!r.ok()) return r.status();
  Outcome o;
  o.kernel = true;
  o.tier = "heavy";
  o.reason = "stateful container kernel";
  o.stdout_data = r->stdout_data;
  o.stderr_data = r->stderr_data;
  o.duration_ms = r->duration_ms;
  o.truncated = r->truncated;
  auto chunk = manager->ReadFile(tenant, id, result, 0, 1 << 20);
  json::object res;
  if (chunk.ok()) {
    boost::system::error_code ec;
    json::value v = json::parse(chunk->data, ec);
    if (!ec && v.is_object()) res = v.as_object();
  }
  if (res.empty()) {
    // The client itself failed (python3 missing, killed by the exec timeout, ...).
    o.timed_out = r->timed_out;
    o.exit_code = r->timed_out ? 124 : (r->exit_code == 0 ? 1 : r->exit_code);
    o.error = RunError{"KernelError",
                       r->timed_out ? "the kernel client did not finish in time"
                                    : "the kernel client wrote no result (is python3 installed "
                                      "in the image?)",
                       r->stderr_data};
    return o;
  }
  // Best effort: the result file is not needed any more.
  ExecRequest rm;
  rm.command = absl::StrCat("rm -f ", result);
  rm.timeout = std::chrono::milliseconds(5000);
  manager->Exec(tenant, id, rm, nullptr).IgnoreError();
  auto str = [&](const char* key) -> std::string {
    const json::value* v = res.if_contains(key);
    return v && v->is_string() ? std::string(v->as_string()) : std::string();
  };
  auto flag = [&](const char* key) {
    const json::value* v = res.if_contains(key);
    return v && v->is_bool() && v->as_bool();
  };
  const std::string status = str("status");
  o.timed_out = flag("timed_out");
  o.kernel_restarted = flag("kernel_restarted");
  o.truncated = o.truncated || flag("truncated");
  if (const json::value* v = res.if_contains("value"); v && v->is_string())
    o.value = std::string(v->as_string());
  if (const json::value* e = res.if_contains("error"); e && e->is_object()) {
    const json::object& eo = e->as_object();
    auto field = [&](const char* key) -> std::string {
      const json::value* v = eo.if_contains(key);
      return v && v->is_string() ? std::string(v->as_string()) : std::string();
    };
    o.error = RunError{field("type"), field("message"), field("traceback")};
  }
  o.exit_code = status == "ok" ? 0 : (o.timed_out ? 124 : 1);
  return o;
}

struct RunParams {
  std::string code;
  std::string runtime;
  int64_t timeout_ms = 30000;
  int64_t memory_mb = 0;
  std::vector<std::string> packages;
};

}  // namespace

RunHandler MakeRunHandler(EnvironmentManager* manager, NanoDriver* nano,
                          router::RulesHolder* rules, ApiService* service) {
  // One-shot heavy run: a throw-away container environment of the caller's tenant.
  auto run_heavy = [manager](const std::string& tenant, const RunParams& p,
                             const std::string& why) -> absl::StatusOr<Outcome> {
    EnvSpec spec = manager->options().default_spec;
    spec.runtime = "container";
    if (p.memory_mb > 0) spec.memory_mb = p.memory_mb;
    int64_t timeout_s = std::max<int64_t>(1, (p.timeout_ms + 999) / 1000);
    auto env = manager->Create(tenant, spec, std::max<int64_t>(60, timeout_s + 60));
    if (!env.ok()) return env.status();
    const std::string id = env->record.id;
    absl::StatusOr<Outcome> result = [&]() -> absl::StatusOr<Outcome> {
      if (absl::Status st = manager->WriteFile(tenant, id, ".esb_run.py", p.code, 0, true);
          !st.ok())
        return st;
      ExecRequest exec;
      exec.command = "python3 .esb_run.py";
      exec.timeout = std::chrono::milliseconds(p.timeout_ms);
      auto r = manager->Exec(tenant, id, exec, nullptr);
      if (!r.ok()) return r.status();
      Outcome o;
      o.stdout_data = r->stdout_data;
      o.stderr_data = r->stderr_data;
      o.exit_code = r->exit_code;
      o.duration_ms = r->duration_ms;
      o.timed_out = r->timed_out;
      o.truncated = r->truncated;
      if (o.exit_code != 0 && !o.timed_out) o.error = ErrorFromTraceback(o.stderr_data);
      o.tier = "heavy";
      o.reason = why;
      return o;
    }();
    manager->Destroy(tenant, id, "run_finished").IgnoreError();
    return result;
  };

  return [manager, nano, rules, service, run_heavy](const std::string& tenant,
                                                    const std::string& env_id,
                                                    Request& req) -> Response {
    int64_t start = MonotonicMs();
    auto body = ParseJsonObjectBody(req, /*allow_empty=*/false);
    if (!body.ok()) return body.error();
    JsonFields f(body.value());
    RunParams p;
    p.code = f.RequiredString("code");
    p.runtime = f.OptionalEnum("runtime", env_id.empty() ? "auto" : "nano",
                               {"auto", "nano", "heavy", "container"});
    p.timeout_ms = f.OptionalInt("timeout_ms", 30000, 1, 600000);
    p.memory_mb = f.OptionalInt("memory_limit_mb", 0, 16, 16384);
    if (const json::value* pk = f.OptionalValue("packages")) {
      if (!pk->is_array()) f.Fail("'packages' must be an array of strings");
      else
        for (const auto& v : pk->as_array()) {
          if (!v.is_string()) f.Fail("'packages' must be an array of strings");
          else p.packages.emplace_back(v.as_string());
        }
    }
    std::optional<std::vector<std::string>> allowed;
    if (const json::value* am = f.OptionalValue("allowed_modules"); am && !am->is_null()) {
      allowed.emplace();
      if (!am->is_array()) f.Fail("'allowed_modules' must be an array of strings");
      else
        for (const auto& v : am->as_array()) {
          if (!v.is_string()) f.Fail("'allowed_modules' must be an array of strings");
          else allowed->emplace_back(v.as_string());
        }
    }
    if (!f.ok()) return f.ErrorResponse();
    if (p.code.size() > (4 << 20))
      return ErrorResponse(413, "payload_too_large", "'code' is longer than 4 MiB");
    if (!p.packages.empty())
      return ErrorResponse(400, "bad_request",
                           "'packages' (pip install before the run) is not supported yet");

    const router::ImportScan scan = router::ExtractImports(p.code);
    if (allowed) {
      // A policy check on what the code imports (static, like the router): not a sandbox
      // boundary — both tiers are isolated whatever the code imports.
      std::vector<std::string> refused;
      for (const std::string& m : scan.modules)
        if (std::find(allowed->begin(), allowed->end(), m) == allowed->end()) refused.push_back(m);
      if (!refused.empty())
        return ErrorResponse(400, "bad_request",
                             absl::StrCat("imports not in allowed_modules: ",
                                          absl::StrJoin(refused, ", ")));
      if (scan.has_dynamic_import)
        return ErrorResponse(400, "bad_request",
                             "dynamic imports (__import__, importlib, exec, eval) cannot be "
                             "checked against allowed_modules");
    }

    absl::StatusOr<Outcome> outcome;
    if (!env_id.empty()) {
      // Stateful run in an existing environment.
      auto resolved = manager->Resolve(tenant, env_id);
      if (!resolved.ok()) return StatusResponse(resolved.status());
      auto [driver, ref] = *resolved;
      if (driver->name() != "nano") {
        outcome = RunInContainerKernel(manager, tenant, env_id, p.code, p.timeout_ms);
      } else {
        if (!nano)
          return ErrorResponse(400, "bad_request",
                               "the nano tier is not available on this daemon");
        RunRequest rr;
        rr.code = p.code;
        rr.timeout_ms = p.timeout_ms;
        auto r = nano->Run(&ref, rr);
        if (!r.ok()) return StatusResponse(r.status());
        Outcome o = FromNano(*r);
        o.reason = "stateful nano session";
        outcome = o;
      }
    } else {
      // One-shot: pick the tier, then run; auto may fall back from nano to heavy.
      bool use_nano = false, may_fall_back = false;
      std::string reason;
      if (p.runtime == "nano") {
        if (!nano)
          return ErrorResponse(400, "bad_request",
                               "runtime 'nano' is not available on this daemon (see GET /healthz)");
        use_nano = true;
        reason = "runtime nano requested";
      } else if (p.runtime != "auto") {
        reason = absl::StrCat("runtime ", p.runtime, " requested");
      } else if (!nano) {
        reason = "auto: nano tier not available on this daemon";
      } else if (rules) {
        router::RouteDecision d =
            rules->Current()->Decide(scan, router::RouteRequest{"auto", p.packages, ""});
        use_nano = d.tier == router::Tier::kNano;
        may_fall_back = true;
        reason = d.reason;
      } else {
        use_nano = may_fall_back = true;
        reason = "auto: no routing rules, nano first";
      }
      if (use_nano) {
        RunRequest rr;
        rr.code = p.code;
        rr.timeout_ms = p.timeout_ms;
        rr.memory_limit_mb = p.memory_mb;
        auto r = nano->Run(nullptr, rr);
        if (!r.ok()) return StatusResponse(r.status());
        Outcome o = FromNano(*r);
        o.reason = reason;
        // Fallback (seed P2-013): a one-shot nano run has no effects beyond its own instance,
        // so rerunning on heavy is safe.
        if (may_fall_back && !o.unsupported_module.empty() && manager->HasDriver("container")) {
          outcome = run_heavy(tenant, p,
                              absl::StrCat(reason, "; nano cannot provide '",
                                           o.unsupported_module, "', reran on heavy"));
        } else {
          outcome = o;
        }
      } else if (!manager->HasDriver("container")) {
        return ErrorResponse(400, "bad_request",
                             "no tier can run this here: the container driver is not available");
      } else {
        outcome = run_heavy(tenant, p, reason);
      }
    }
    Response resp = outcome.ok() ? JsonResponse(200, Render(*outcome))
                                 : StatusResponse(outcome.status());
    service->Audit(tenant, env_id, "run",
                   outcome.ok() ? absl::StrCat("[", outcome->tier, "] ", p.code) : p.code,
                   outcome.ok() ? std::optional<int64_t>(outcome->exit_code) : std::nullopt,
                   MonotonicMs() - start, static_cast<int64_t>(p.code.size()), resp.status);
    return resp;
  };
}

}  // namespace esb::api
