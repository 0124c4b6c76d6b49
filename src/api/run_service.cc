#include "api/run_service.h"

#include <algorithm>
#include <functional>
#include <map>
#include <regex>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "api/heavy_kernel.h"
#include "api/kernel_frames.h"
#include "api/json_util.h"
#include "api/sse_output.h"
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
  // Heavy tier: a DataFrame/Series final value as a table, the artifacts kept in the store,
  // and why some were not (too big, over quota, capture failed).
  json::value table;
  json::array artifacts;
  json::array artifact_errors;
  // The output already went to the client as it was produced (SSE from a container).
  bool streamed = false;
  // Packages installed before the run ({name, version, from_cache}) and how long it took.
  json::array packages;
  int64_t install_ms = 0;
};

// Where output goes while the code runs: the code's own stdout/stderr, and pip's output while
// packages are installed.
struct Streams {
  OutputSink output;
  OutputSink install;
};

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
    out["table"] = o.table;
  }
  out["artifacts"] = o.artifacts;
  if (!o.packages.empty()) {
    out["packages"] = o.packages;
    out["install_ms"] = o.install_ms;
  }
  if (!o.artifact_errors.empty()) out["artifact_errors"] = o.artifact_errors;
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

struct RunParams {
  std::string code;
  std::string runtime;
  int64_t timeout_ms = 30000;
  int64_t memory_mb = 0;
  std::vector<std::string> packages;
  std::vector<std::string> figure_formats{"png"};
};

constexpr int64_t kMaxArtifactReadChunk = 4 << 20;
// kernel.py reports at most 32 per cell, but its result file is writable by the cell's own
// code, so the daemon enforces its own bounds on what it copies and shows.
constexpr size_t kMaxArtifactsPerRun = 64;
// kernel.py's result file: value 64 KiB, table 512 KiB, error ~80 KiB (JSON escapes can make
// each up to 6x larger), 32 artifact entries. More than this is not a kernel's answer.
constexpr int64_t kMaxKernelResultBytes = 8 << 20;
constexpr size_t kMaxKernelResultContainers = 4096;
constexpr size_t kMaxKernelResultSeparators = 200000;
constexpr size_t kMaxArtifactText = 256;
constexpr char kArtifactsDir[] = "/workspace/artifacts";

// "type/subtype" made of safe characters, else application/octet-stream (the value becomes
// a Content-Type header).
std::string SafeMimeType(const std::string& mime) {
  static const std::regex kMime(R"([a-z0-9][a-z0-9.+-]{0,63}/[a-z0-9][a-z0-9.+-]{0,127})");
  return std::regex_match(mime, kMime) ? mime : "application/octet-stream";
}

// Files under /workspace/artifacts as {path: (mtime_ms, size)}, for environments whose cells
// cannot report artifacts themselves (nano sessions: no kernel.py there). Bounded: three
// directory levels, 500 entries.
using FileStamps = std::map<std::string, std::pair<int64_t, int64_t>>;
FileStamps ScanArtifactFiles(EnvironmentManager* manager, const std::string& tenant,
                             const std::string& id) {
  FileStamps out;
  size_t seen = 0;
  std::function<void(const std::string&, int)> walk = [&](const std::string& dir, int depth) {
    auto entries = manager->ListDir(tenant, id, dir);
    if (!entries.ok()) return;  // no artifacts directory: nothing to report
    for (const FileEntry& e : entries->entries) {
      if (++seen > 500) return;
      const std::string path = absl::StrCat(dir, "/", e.name);
      if (e.type == "file") out[path] = {e.mtime_ms, e.size};
      else if (e.type == "dir" && depth < 3) walk(path, depth + 1);
    }
  };
  walk(std::string(kArtifactsDir), 1);
  return out;
}

std::string MimeTypeForName(std::string_view name) {
  static const std::map<std::string, std::string> kTypes = {
      {"png", "image/png"},      {"jpg", "image/jpeg"},     {"jpeg", "image/jpeg"},
      {"gif", "image/gif"},      {"webp", "image/webp"},    {"svg", "image/svg+xml"},
      {"csv", "text/csv"},       {"txt", "text/plain"},     {"md", "text/markdown"},
      {"json", "application/json"}, {"html", "text/html"}, {"pdf", "application/pdf"}};
  size_t dot = name.rfind('.');
  if (dot == std::string_view::npos) return "application/octet-stream";
  std::string ext(name.substr(dot + 1));
  for (char& c : ext) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  auto it = kTypes.find(ext);
  return it == kTypes.end() ? "application/octet-stream" : it->second;
}

// What changed between two scans, in kernel.py's report format (for CollectArtifacts).
json::array ChangedArtifactFiles(const FileStamps& before, const FileStamps& after) {
  json::array out;
  const std::string prefix = absl::StrCat(kArtifactsDir, "/");
  for (const auto& [path, stamp] : after) {
    auto it = before.find(path);
    if (it != before.end() && it->second == stamp) continue;
    const std::string mime = MimeTypeForName(path);
    out.push_back(json::object{{"path", path},
                               {"name", path.substr(prefix.size())},
                               {"kind", mime.rfind("image/", 0) == 0 ? "image" : "file"},
                               {"mime_type", mime}});
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

// A whole file from inside the sandbox, at most `cap` bytes (else ResourceExhausted).
absl::StatusOr<std::string> ReadSandboxFile(EnvironmentManager* manager,
                                            const std::string& tenant, const std::string& id,
                                            const std::string& path, int64_t cap) {
  std::string data;
  for (;;) {
    const int64_t held = static_cast<int64_t>(data.size());
    const int64_t want = std::min<int64_t>(kMaxArtifactReadChunk, cap + 1 - held);
    auto chunk = manager->ReadFile(tenant, id, path, held, want);
    if (!chunk.ok()) return chunk.status();
    // SECURITY: sizes and lengths come from inside the sandbox; what we hold is what counts.
    if (chunk->file_size > cap || static_cast<int64_t>(chunk->data.size()) > want ||
        held + static_cast<int64_t>(chunk->data.size()) > cap) {
      return absl::ResourceExhaustedError(
          absl::StrCat("it is larger than the limit of ", cap, " bytes"));
    }
    data += chunk->data;
    if (chunk->eof || chunk->data.empty()) return data;
  }
}

// Copies the files the kernel reported (figures it saved, files written under
// /workspace/artifacts) out of the sandbox into the host store; each becomes an entry of
// `o->artifacts`, and each one that could not be kept an entry of `o->artifact_errors`.
void CollectArtifacts(EnvironmentManager* manager, ArtifactStore* store,
                      const std::string& tenant, const std::string& id,
                      const json::array& reported, Outcome* o) {
  if (reported.empty()) return;
  int64_t step = 0;
  if (auto info = manager->Get(tenant, id); info.ok()) step = info->record.exec_count;
  for (const json::value& v : reported) {
    if (!v.is_object()) continue;
    if (o->artifacts.size() + o->artifact_errors.size() >= kMaxArtifactsPerRun) {
      o->artifact_errors.emplace_back(absl::StrCat("more than ", kMaxArtifactsPerRun,
                                                   " artifacts in one run: the rest were not kept"));
      break;
    }
    const json::object& item = v.as_object();
    auto str = [&](const char* key) -> std::string {
      const json::value* x = item.if_contains(key);
      return x && x->is_string()
                 ? std::string(x->as_string()).substr(0, kMaxArtifactText)
                 : std::string();
    };
    if (!str("error").empty()) {
      o->artifact_errors.emplace_back(SanitizeUtf8(str("error")));
      continue;
    }
    const std::string path = str("path");
    if (path.empty()) continue;
    if (store == nullptr) {
      o->artifact_errors.emplace_back(
          absl::StrCat(SanitizeUtf8(str("name")), ": this daemon keeps no artifacts"));
      continue;
    }
    absl::StatusOr<std::string> data =
        ReadSandboxFile(manager, tenant, id, path, store->options().max_artifact_bytes);
    ArtifactMeta meta;
    meta.tenant = tenant;
    meta.environment_id = id;
    meta.kind = str("kind") == "image" ? "image" : "file";
    meta.name = SanitizeUtf8(str("name"));
    meta.mime_type = SafeMimeType(str("mime_type"));
    meta.title = SanitizeUtf8(str("title"));
    meta.step = step;
    absl::StatusOr<ArtifactMeta> kept =
        data.ok() ? store->Put(meta, *data) : absl::StatusOr<ArtifactMeta>(data.status());
    if (kept.ok()) {
      o->artifacts.push_back(RenderArtifact(*kept));
    } else {
      o->artifact_errors.emplace_back(
          absl::StrCat(meta.name, ": not kept: ", kept.status().message()));
    }
  }
}

// Runs Python through kernel.py (heavy_kernel.h) and the ordinary WriteFile / Exec /
// ReadFile calls: `once` = a one-shot run in a fresh process, else a cell of the environment's
// persistent kernel. Output goes to `sink` as it is produced.
absl::StatusOr<Outcome> RunInContainer(EnvironmentManager* manager, ArtifactStore* store,
                                       const std::string& tenant, const std::string& id,
                                       const RunParams& p, bool once, const OutputSink& sink) {
  const std::string dir(kHeavyKernelDir), kernel(kHeavyKernelPath);
  // Written every time: it is small, and a stale or tampered copy gets replaced.
  if (absl::Status st = manager->WriteFile(tenant, id, kernel, HeavyKernelSource(), 0, true);
      !st.ok())
    return st;
  const std::string tag = RandomHex(8);
  const std::string cell = absl::StrCat(dir, "/cell-", tag, ".py");
  const std::string result = absl::StrCat(dir, "/result-", tag, ".json");
  if (absl::Status st = manager->WriteFile(tenant, id, cell, p.code, 0, true); !st.ok())
    return st;
  ExecRequest exec;
  exec.command = absl::StrCat("python3 ", kernel, once ? " once " : " run ", cell, " ", result,
                              " ", p.timeout_ms, " ", absl::StrJoin(p.figure_formats, ","));
  exec.timeout = std::chrono::milliseconds(p.timeout_ms + 5000);
  // kernel.py's 2 MiB of cell output (ASCII), framed; more is cut by the agent (`truncated`).
  exec.max_output_bytes = 3 << 20;
  // The cell's stdout and stderr come framed on the exec's stdout, in the order written
  // (kernel_frames.h); the exec's stderr carries only kernel.py's own failures.
  std::string out_text, err_text;
  KernelFrameDecoder decoder([&](Stream s, std::string_view d) {
    (s == Stream::kStderr ? err_text : out_text).append(d);
    return !sink || sink(s, d);
  });
  OutputSink framed = [&](Stream s, std::string_view d) {
    if (d.empty()) return !sink || sink(s, d);  // a liveness tick: lets the caller cancel
    if (s == Stream::kStdout) return decoder.Feed(d);
    err_text.append(d);
    return !sink || sink(s, d);
  };
  auto r = manager->Exec(tenant, id, exec, framed);
  if (!r.ok()) return r.status();
  Outcome o;
  o.kernel = true;
  o.tier = "heavy";
  o.streamed = static_cast<bool>(sink);
  o.stdout_data = std::move(out_text);
  o.stderr_data = std::move(err_text);
  o.duration_ms = r->duration_ms;
  o.truncated = r->truncated;
  // Best effort, whatever happened: the result file and the staged figures are not needed
  // once read (a one-shot run's environment is destroyed anyway).
  auto cleanup = [&] {
    if (once) return;
    ExecRequest rm;
    rm.command = absl::StrCat("rm -rf ", result, " ", dir, "/result-", tag, "-art");
    rm.timeout = std::chrono::milliseconds(5000);
    manager->Exec(tenant, id, rm, nullptr).IgnoreError();
  };
  absl::StatusOr<std::string> raw =
      ReadSandboxFile(manager, tenant, id, result, kMaxKernelResultBytes);
  json::object res;
  // SECURITY: the result file is sandbox-writable. A real result (a table of at most 200 x 50
  // cells, a few strings) has a small shape; anything beyond it is refused unparsed.
  const bool shape_ok =
      raw.ok() && JsonShapeWithin(*raw, kMaxKernelResultContainers, kMaxKernelResultSeparators);
  if (shape_ok) {
    boost::system::error_code ec;
    json::value v = json::parse(*raw, ec);
    if (!ec && v.is_object()) res = v.as_object();
  }
  if (res.empty()) {
    // The client itself failed (python3 missing, killed by the exec timeout, the cell's own
    // os._exit in once mode, ...), or what it wrote is not a result.
    o.timed_out = r->timed_out;
    o.exit_code = r->timed_out ? 124 : (r->exit_code == 0 ? 1 : r->exit_code);
    std::string why;
    if (r->timed_out) {
      why = "the run did not finish in time and was killed";
    } else if (absl::IsResourceExhausted(raw.status())) {
      why = absl::StrCat("the kernel's result is too large (", raw.status().message(), ")");
    } else if (raw.ok() && !shape_ok) {
      why = "the kernel's result has more values than a result can have";
    } else if (raw.ok()) {
      why = "the kernel's result is not valid JSON";
    } else {
      why = absl::StrCat("the kernel wrote no result (exit code ", r->exit_code,
                         "; the code may have ended the interpreter, e.g. with os._exit, or "
                         "python3 is missing from the image)");
    }
    o.error = RunError{r->timed_out ? "TimeoutError" : "KernelError", why, r->stderr_data};
    cleanup();
    return o;
  }
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
  if (const json::value* t = res.if_contains("table"); t && t->is_object()) o.table = *t;
  if (const json::value* e = res.if_contains("error"); e && e->is_object()) {
    const json::object& eo = e->as_object();
    auto field = [&](const char* key) -> std::string {
      const json::value* v = eo.if_contains(key);
      return v && v->is_string() ? std::string(v->as_string()) : std::string();
    };
    o.error = RunError{field("type"), field("message"), field("traceback")};
  }
  o.exit_code = status == "ok" ? 0 : (o.timed_out ? 124 : 1);
  if (const json::value* a = res.if_contains("artifacts"); a && a->is_array())
    CollectArtifacts(manager, store, tenant, id, a->as_array(), &o);
  cleanup();
  return o;
}


// `packages` first (when asked), then the code through kernel.py.
absl::StatusOr<Outcome> InstallAndRun(const RunDeps& deps, const std::string& tenant,
                                      const std::string& id, const RunParams& p, bool once,
                                      const Streams& streams, const std::string& reason) {
  json::array installed;
  int64_t install_ms = 0;
  if (!p.packages.empty()) {
    int64_t t0 = MonotonicMs();
    auto pk = deps.installer->Install(tenant, id, p.packages, streams.install);
    if (!pk.ok()) return pk.status();
    installed = std::move(*pk);
    install_ms = MonotonicMs() - t0;
  }
  auto o = RunInContainer(deps.manager, deps.artifacts, tenant, id, p, once, streams.output);
  if (!o.ok()) return o;
  o->reason = reason;
  o->packages = std::move(installed);
  o->install_ms = install_ms;
  return o;
}

}  // namespace

RunHandler MakeRunHandler(const RunDeps& deps) {
  EnvironmentManager* manager = deps.manager;
  // One-shot heavy run: a throw-away container environment of the caller's tenant, running
  // the code once through kernel.py (value, table and artifacts like a stateful cell).
  auto run_heavy = [deps](const std::string& tenant, const RunParams& p, const std::string& why,
                          const Streams& streams) -> absl::StatusOr<Outcome> {
    EnvironmentManager* manager = deps.manager;
    EnvSpec spec = manager->options().default_spec;
    spec.runtime = "container";
    if (p.memory_mb > 0) spec.memory_mb = p.memory_mb;
    int64_t timeout_s = std::max<int64_t>(1, (p.timeout_ms + 999) / 1000);
    auto env = manager->Create(tenant, spec, std::max<int64_t>(60, timeout_s + 60));
    if (!env.ok()) return env.status();
    const std::string id = env->record.id;
    absl::StatusOr<Outcome> result =
        InstallAndRun(deps, tenant, id, p, /*once=*/true, streams, why);
    manager->Destroy(tenant, id, "run_finished").IgnoreError();
    return result;
  };

  return [deps, manager, run_heavy](const std::string& tenant, const std::string& env_id,
                                    Request& req) -> Response {
    NanoDriver* nano = deps.nano;
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
    string_list("packages", &p.packages);
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
        if (auto error = RequirementLine(lines[i], &p.packages); !error.empty()) {
          f.Fail(absl::StrCat("'requirements' line ", i + 1, ": ", error));
          break;  // the first bad line is enough to say
        }
      }
    }
    std::vector<std::string> allowed_list;
    std::optional<std::vector<std::string>> allowed;
    if (string_list("allowed_modules", &allowed_list)) allowed = allowed_list;
    if (string_list("figure_formats", &p.figure_formats)) {
      for (const std::string& fmt : p.figure_formats)
        if (fmt != "png" && fmt != "svg")
          f.Fail(absl::StrCat("'figure_formats' entries must be \"png\" or \"svg\", not \"",
                              SanitizeUtf8(fmt), "\""));
      if (p.figure_formats.empty()) p.figure_formats = {"png"};
    }
    if (!f.ok()) return f.ErrorResponse();
    if (p.code.size() > (4 << 20))
      return ErrorResponse(413, "payload_too_large", "'code' is longer than 4 MiB");
    if (!p.packages.empty()) {
      if (env_id.empty() && p.runtime == "nano")
        return ErrorResponse(400, "bad_request",
                             "'packages' need the heavy tier: the nano tier cannot install "
                             "packages (use runtime \"auto\" or \"heavy\")");
      if (deps.installer == nullptr)
        return ErrorResponse(400, "bad_request", "this daemon cannot install 'packages'");
      if (absl::Status st = deps.installer->Validate(p.packages); !st.ok())
        return StatusResponse(st);
    }

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

    // Everything that can be refused with a plain 4xx is decided before running (and before
    // an SSE stream starts): the environment, the tier.
    std::function<absl::StatusOr<Outcome>(const Streams&)> work;
    if (!env_id.empty()) {
      // Stateful run in an existing environment.
      auto resolved = manager->Resolve(tenant, env_id);
      if (!resolved.ok()) return StatusResponse(resolved.status());
      auto [driver, ref] = *resolved;
      if (driver->name() != "nano") {
        work = [deps, tenant, env_id, p](const Streams& streams) {
          return InstallAndRun(deps, tenant, env_id, p, /*once=*/false, streams,
                               "stateful container kernel");
        };
      } else {
        if (!nano)
          return ErrorResponse(400, "bad_request",
                               "the nano tier is not available on this daemon");
        if (!p.packages.empty())
          return ErrorResponse(400, "bad_request",
                               "'packages' cannot be installed in a nano environment (create "
                               "the environment with runtime \"container\")");
        work = [deps, nano, ref, tenant, env_id, p](const Streams&) -> absl::StatusOr<Outcome> {
          RunRequest rr;
          rr.code = p.code;
          rr.timeout_ms = p.timeout_ms;
          InstanceRef r = ref;
          const FileStamps before = ScanArtifactFiles(deps.manager, tenant, env_id);
          auto res = nano->Run(&r, rr);
          if (!res.ok()) return res.status();
          Outcome o = FromNano(*res);
          o.reason = "stateful nano session";
          if (!res->instance_reset)
            CollectArtifacts(deps.manager, deps.artifacts, tenant, env_id,
                             ChangedArtifactFiles(before,
                                                  ScanArtifactFiles(deps.manager, tenant, env_id)),
                             &o);
          return o;
        };
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
      } else if (deps.rules) {
        router::RouteDecision d =
            deps.rules->Current()->Decide(scan, router::RouteRequest{"auto", p.packages, ""});
        use_nano = d.tier == router::Tier::kNano;
        may_fall_back = true;
        reason = d.reason;
      } else if (!p.packages.empty()) {
        reason = "auto: packages requested";
      } else {
        use_nano = may_fall_back = true;
        reason = "auto: no routing rules, nano first";
      }
      if (!use_nano && !manager->HasDriver("container"))
        return ErrorResponse(400, "bad_request",
                             "no tier can run this here: the container driver is not available");
      work = [manager, nano, tenant, p, use_nano, may_fall_back, reason,
              run_heavy](const Streams& streams) -> absl::StatusOr<Outcome> {
        if (!use_nano) return run_heavy(tenant, p, reason, streams);
        RunRequest rr;
        rr.code = p.code;
        rr.timeout_ms = p.timeout_ms;
        rr.memory_limit_mb = p.memory_mb;
        auto r = nano->Run(nullptr, rr);
        if (!r.ok()) return r.status();
        Outcome o = FromNano(*r);
        o.reason = reason;
        // Fallback (seed P2-013): a one-shot nano run has no effects beyond its own instance,
        // so rerunning on heavy is safe.
        if (may_fall_back && !o.unsupported_module.empty() && manager->HasDriver("container"))
          return run_heavy(tenant, p,
                           absl::StrCat(reason, "; nano cannot provide '",
                                        o.unsupported_module, "', reran on heavy"),
                           streams);
        return o;
      };
    }

    auto audit = [deps, tenant, env_id, p, start](const absl::StatusOr<Outcome>& outcome,
                                                  int status) {
      deps.service->Audit(
          tenant, env_id, "run",
          outcome.ok() ? absl::StrCat("[", outcome->tier, "] ", p.code) : p.code,
          outcome.ok() ? std::optional<int64_t>(outcome->exit_code) : std::nullopt,
          MonotonicMs() - start, static_cast<int64_t>(p.code.size()), status);
    };

    if (req.Accepts("text/event-stream")) {
      return Response::Sse([work, audit](ResponseWriter& w) {
        SseOutput output(w);
        SseOutput install(w, "install", "install");
        Streams streams{output.Sink(), install.Sink()};
        absl::StatusOr<Outcome> outcome = work(streams);
        output.Flush();
        install.Flush();
        if (!outcome.ok()) {
          Response err = StatusResponse(outcome.status());
          w.WriteEvent("error", ErrorBody(ErrorCodeForStatus(err.status),
                                          StdView(outcome.status().message())));
          audit(outcome, err.status);
          return;
        }
        if (!outcome->streamed) {  // the nano tier answers at the end
          output.Emit(Stream::kStdout, outcome->stdout_data);
          output.Emit(Stream::kStderr, outcome->stderr_data);
        }
        w.WriteEvent("result", Render(*outcome));
        audit(outcome, w.ok() ? 200 : 499);
      });
    }
    // Not streaming: still notice a client that went away, and stop its code.
    auto alive = [&req](Stream, std::string_view) { return !req.ClientGone(); };
    absl::StatusOr<Outcome> outcome = work(Streams{alive, alive});
    if (outcome.ok()) outcome->streamed = false;
    Response resp = outcome.ok() ? JsonResponse(200, Render(*outcome))
                                 : StatusResponse(outcome.status());
    audit(outcome, resp.status);
    return resp;
  };
}

}  // namespace esb::api
