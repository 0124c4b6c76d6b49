#include "drivers/heavy_kernel.h"

#include <algorithm>
#include <boost/json.hpp>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/util.h"
#include "drivers/kernel_frames.h"

namespace esb {
namespace json = boost::json;
namespace {

constexpr int64_t kMaxReadChunk = 4 << 20;
// kernel.py's result file: value 64 KiB, table 512 KiB, error ~80 KiB (JSON escapes can make
// each up to 6x larger), 32 artifact entries. More than this is not a kernel's answer.
constexpr int64_t kMaxKernelResultBytes = 8 << 20;
constexpr size_t kMaxKernelResultContainers = 4096;
constexpr size_t kMaxKernelResultSeparators = 200000;
// Text fields of a reported artifact are cut here (they are the sandbox's to forge).
constexpr size_t kMaxArtifactText = 256;
// kernel.py reports at most 32 per cell; more entries than this are not read at all.
constexpr size_t kMaxReportedArtifacts = 128;

std::vector<ReportedArtifact> ParseArtifacts(const json::array& reported) {
  std::vector<ReportedArtifact> out;
  for (const json::value& v : reported) {
    if (out.size() >= kMaxReportedArtifacts) break;
    if (!v.is_object()) continue;
    const json::object& item = v.as_object();
    auto str = [&](const char* key) -> std::string {
      const json::value* x = item.if_contains(key);
      return x && x->is_string() ? std::string(x->as_string()).substr(0, kMaxArtifactText)
                                 : std::string();
    };
    ReportedArtifact a;
    a.path = str("path");
    a.name = str("name");
    a.kind = str("kind");
    a.mime_type = str("mime_type");
    a.title = str("title");
    a.error = str("error");
    if (a.path.empty() && a.error.empty()) continue;
    out.push_back(std::move(a));
  }
  return out;
}

// A Python string literal of `text` (backslash, quote and control characters escaped).
std::string PythonLiteral(std::string_view text) {
  std::string out = "'";
  for (unsigned char c : text) {
    if (c == '\\' || c == '\'') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c < 0x20 || c == 0x7f) {
      out += absl::StrCat("\\x", absl::Hex(c, absl::kZeroPad2));
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "'";
}

// The summary's bounds (esb_vars.py: 64 KiB, at most 500 names of a dozen fields each).
constexpr size_t kMaxVariablesJson = 64 * 1024;
constexpr size_t kMaxVariablesContainers = 2048;
constexpr size_t kMaxVariablesSeparators = 20000;

}  // namespace

const std::string& ShippedHeavyKernel() {
  static const std::string* text = new std::string(absl::StrCat(
      "_ESB_VARS_SOURCE = ", PythonLiteral(EsbVarsSource()), "\n", AbslView(HeavyKernelSource())));
  return *text;
}

std::string ValidVariablesJson(std::string_view text) {
  // SECURITY: from inside the sandbox: bounded in size and shape before it is parsed.
  if (text.empty() || text.size() > kMaxVariablesJson ||
      !JsonShapeWithin(text, kMaxVariablesContainers, kMaxVariablesSeparators)) {
    return "";
  }
  boost::system::error_code ec;
  json::value v = json::parse(text, ec);
  if (ec || !v.is_array()) return "";
  for (const json::value& e : v.as_array()) {
    const json::object* o = e.if_object();
    if (!o || !o->contains("name") || !(*o).at("name").is_string()) return "";
  }
  return json::serialize(v);
}

absl::StatusOr<std::string> ReadWholeSandboxFile(const ChunkReader& read, int64_t cap) {
  std::string data;
  for (;;) {
    const int64_t held = static_cast<int64_t>(data.size());
    const int64_t want = std::min<int64_t>(kMaxReadChunk, cap + 1 - held);
    auto chunk = read(held, want);
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

absl::StatusOr<RunResult> RunHeavyKernel(Driver& driver, const InstanceRef& ref,
                                         const RunRequest& request, const OutputSink& sink,
                                         std::string* variables) {
  if (variables) variables->clear();
  const std::string dir(kHeavyKernelDir), kernel(kHeavyKernelPath);
  const std::string tag = RandomHex(8);
  const std::string cell = absl::StrCat(dir, "/cell-", tag, ".py");
  const std::string result = absl::StrCat(dir, "/result-", tag, ".json");
  if (absl::Status st = driver.WriteFile(ref, cell, request.code, 0, true); !st.ok()) return st;
  const int64_t timeout_ms = request.timeout_ms > 0 ? request.timeout_ms : 30000;
  std::vector<std::string> formats = request.figure_formats;
  if (formats.empty()) formats = {"png"};
  ExecRequest exec;
  exec.command = absl::StrCat("python3 ", kernel, request.once ? " once " : " run ", cell, " ",
                              result, " ", timeout_ms, " ", absl::StrJoin(formats, ","));
  exec.timeout = std::chrono::milliseconds(timeout_ms + 5000);
  // The kernel summarises the namespace after the cell (time travel's variables).
  if (variables && !request.once) exec.env["ESB_KERNEL_VARIABLES"] = "1";
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
  auto r = driver.Exec(ref, exec, framed);
  if (!r.ok()) return r.status();
  RunResult o;
  o.kernel = true;
  o.streamed = static_cast<bool>(sink);
  o.stdout_data = std::move(out_text);
  o.stderr_data = std::move(err_text);
  o.duration_ms = r->duration_ms;
  o.truncated = r->truncated;
  // Best effort, whatever happened: the result file and the staged figures are not needed
  // once read (a one-shot run's environment is destroyed anyway).
  auto cleanup = [&] {
    if (request.once) return;
    ExecRequest rm;
    rm.command = absl::StrCat("rm -rf ", result, " ", dir, "/result-", tag, "-art");
    rm.timeout = std::chrono::milliseconds(5000);
    driver.Exec(ref, rm, nullptr).IgnoreError();
  };
  absl::StatusOr<std::string> raw = ReadWholeSandboxFile(
      [&](int64_t offset, int64_t length) { return driver.ReadFile(ref, result, offset, length); },
      kMaxKernelResultBytes);
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
  if (const json::value* t = res.if_contains("table"); t && t->is_object())
    o.table_json = json::serialize(*t);
  if (const json::value* e = res.if_contains("error"); e && e->is_object()) {
    const json::object& eo = e->as_object();
    auto field = [&](const char* key) -> std::string {
      const json::value* v = eo.if_contains(key);
      return v && v->is_string() ? std::string(v->as_string()) : std::string();
    };
    o.error = RunError{field("type"), field("message"), field("traceback")};
  }
  o.exit_code = status == "ok" ? 0 : (o.timed_out ? 124 : 1);
  if (const json::value* v = res.if_contains("variables"); variables && v && v->is_string())
    *variables = ValidVariablesJson(v->as_string());
  if (const json::value* a = res.if_contains("artifacts"); a && a->is_array())
    o.artifacts = ParseArtifacts(a->as_array());
  // The caller copies the reported files out while they still exist.
  if (request.on_artifacts && !o.artifacts.empty()) request.on_artifacts(o.artifacts);
  cleanup();
  return o;
}

}  // namespace esb
