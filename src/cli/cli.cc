#include "cli/cli.h"

#include <sys/stat.h>

#include <algorithm>
#include <boost/json.hpp>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <istream>
#include <iterator>
#include <optional>
#include <ostream>
#include <sstream>
#include <utility>

#include "cli/format.h"
#include "cli/sse.h"
#include "cli/terminal.h"
#include "common/shell_quote.h"
#include "common/util.h"

namespace esb::cli {
namespace {

namespace json = boost::json;

// ---------------------------------------------------------------------------------------------
// Command table

struct FlagSpec {
  const char* name;
  bool takes_value;
  enum Kind { kText, kInt, kNumber, kKeyValue } kind = kText;
};

struct CommandSpec {
  const char* name;
  std::vector<FlagSpec> flags;
  int min_positionals;
  int max_positionals;  // -1: unlimited
  const char* usage;
};

const std::vector<CommandSpec>& Commands() {
  static const auto* commands = new std::vector<CommandSpec>{
      {"create",
       {{"--image", true},
        {"--runtime", true},
        {"--memory-mb", true, FlagSpec::kInt},
        {"--cpu", true, FlagSpec::kNumber},
        {"--ttl", true, FlagSpec::kInt},
        {"--pids", true, FlagSpec::kInt},
        {"--disk-mb", true, FlagSpec::kInt},
        {"--env", true, FlagSpec::kKeyValue}},
       0,
       0,
       "Usage: esb create [--image I] [--runtime R] [--memory-mb N] [--cpu X] [--ttl S]\n"
       "                  [--pids N] [--disk-mb N] [--env K=V]...\n"
       "\n"
       "Creates an environment and prints its id (with --json: the whole answer).\n"
       "  --image I       image name (default: the daemon's default image)\n"
       "  --runtime R     container | gvisor | nano | auto | microvm\n"
       "  --memory-mb N   memory limit in MiB        --cpu X      CPU cores (e.g. 0.5)\n"
       "  --ttl S         lease in seconds; extended by use and heartbeats\n"
       "  --pids N        process limit              --disk-mb N  workspace size in MiB\n"
       "  --env K=V       environment variable (repeatable)\n"
       "\n"
       "Example: ENV=$(esb create --memory-mb 1024 --ttl 3600)\n"},
      {"ls",
       {{"--all", false}},
       0,
       0,
       "Usage: esb ls [--all]\n"
       "\n"
       "Lists your environments (--all includes destroyed ones).\n"},
      {"exec",
       {{"--timeout", true, FlagSpec::kInt}, {"--env", true, FlagSpec::kKeyValue}},
       1,
       1,
       "Usage: esb exec [--timeout S] [--env K=V]... ENV -- COMMAND...\n"
       "\n"
       "Runs COMMAND with bash in the environment's /workspace and streams its output live.\n"
       "Exits with the command's exit code (124 on timeout). One COMMAND word is passed to\n"
       "bash as written (esb exec ENV -- 'ls | wc -l'); several words are quoted one by one.\n"
       "  --timeout S     seconds before the command is killed (default 60, max 3600)\n"
       "  --env K=V       extra environment variable for this command (repeatable)\n"},
      {"cp",
       {},
       2,
       2,
       "Usage: esb cp LOCAL ENV:PATH     upload a file\n"
       "       esb cp ENV:PATH LOCAL     download a file\n"
       "\n"
       "PATH is relative to /workspace. LOCAL may be '-' for stdin/stdout. Uploading to\n"
       "'ENV:' or 'ENV:dir/' keeps the local file name; downloading into a directory too.\n"},
      {"cat",
       {},
       2,
       2,
       "Usage: esb cat ENV PATH\n"
       "\n"
       "Prints a file from the environment (PATH relative to /workspace).\n"},
      {"rm",
       {},
       1,
       -1,
       "Usage: esb rm ENV...\n"
       "\n"
       "Destroys environments (already destroyed ones are fine).\n"},
      {"logs",
       {{"--limit", true, FlagSpec::kInt}},
       1,
       1,
       "Usage: esb logs [--limit N] ENV\n"
       "\n"
       "Shows the audit entries of one environment, oldest first (the newest N, default 100).\n"},
      {"audit",
       {{"--since", true},
        {"--until", true},
        {"--env", true},
        {"--q", true},
        {"--limit", true, FlagSpec::kInt},
        {"--kind", true},
        {"--decision", true}},
       0,
       0,
       "Usage: esb audit [--since T] [--until T] [--env ID] [--q QUERY] [--limit N]\n"
       "                 [--kind egress|tool] [--decision D]\n"
       "\n"
       "Searches your audit log, newest first.\n"
       "  --since/--until T  RFC 3339 time (2026-11-22T04:30:00Z), unix seconds, or an age\n"
       "                     such as 30s, 15m, 2h, 7d (meaning that long ago)\n"
       "  --env ID           only this environment\n"
       "  --q QUERY          full-text search over action and detail (words, \"a phrase\",\n"
       "                     prefix*, AND/OR/NOT)\n"
       "  --limit N          at most N entries (1-1000, default 100)\n"
       "  --kind egress      only egress requests (the sandbox's traffic through the proxy)\n"
       "  --kind tool        only tool calls (MCP tools, esbd's and hosted servers')\n"
       "  --decision D       egress (or, with --kind tool, tool-call) rows with this\n"
       "                     decision: allowed, blocked, redacted, opaque or error\n"},
      {"report",
       {{"--period", true}, {"--format", true}, {"--env", true}, {"--date", true}},
       0,
       0,
       "Usage: esb report [--period daily|weekly] [--format json|csv|html] [--env ID]\n"
       "                  [--date YYYY-MM-DD]\n"
       "\n"
       "Egress compliance report of your tenant: requests, blocks by rule, top hosts, DLP\n"
       "findings by type and bytes, per environment. Without --format: tables.\n"
       "  --period P   daily (default: the UTC day) or weekly (the ISO week, Monday to Sunday)\n"
       "  --format F   print the daemon's json, csv or printable html as is\n"
       "               (e.g. esb report --period weekly --format html > report.html)\n"
       "  --env ID     only this environment\n"
       "  --date D     a UTC day in the period (default: today)\n"},
      {"steps",
       {{"--limit", true, FlagSpec::kInt}, {"--before", true, FlagSpec::kInt}},
       1,
       1,
       "Usage: esb steps [--limit N] [--before N] ENV\n"
       "\n"
       "Shows the environment's step log, newest first: every execute, run, file change,\n"
       "package install and network change, with the state captured after it ('*' marks\n"
       "the head, the step the environment is at).\n"
       "  --limit N    at most N steps (default 50)\n"
       "  --before N   only steps numbered below N (the next page)\n"},
      {"step",
       {},
       2,
       2,
       "Usage: esb step ENV N\n"
       "\n"
       "Shows step N: its input, output, exit code, the Python variables after it, the\n"
       "files it changed and the shell's directory.\n"},
      {"rewind",
       {},
       2,
       2,
       "Usage: esb rewind ENV N\n"
       "\n"
       "Puts the environment back to what it was after step N, in place. The later steps\n"
       "are kept (as a branch). With memory \"none\" the files and the shell state come\n"
       "back, running processes and Python's memory do not.\n"},
      {"fork",
       {},
       2,
       2,
       "Usage: esb fork ENV N\n"
       "\n"
       "Creates a new environment at step N of ENV and prints its id; ENV is untouched.\n"},
      {"shell",
       {{"--step", true, FlagSpec::kInt}},
       1,
       1,
       "Usage: esb shell [--step N] ENV\n"
       "\n"
       "Opens an interactive shell (bash in /workspace) in the environment over a\n"
       "WebSocket. With --step N: forks ENV at step N first and opens the shell in the fork\n"
       "(printed on stderr; delete it with esb rm). Exits with the shell's exit code.\n"},
      {"health",
       {},
       0,
       0,
       "Usage: esb health\n"
       "\n"
       "Checks that esbd answers and shows its version and drivers.\n"},
      {"help", {}, 0, 1, "Usage: esb help [COMMAND]\n"},
      {"version", {}, 0, 0, "Usage: esb version\n"},
  };
  return *commands;
}

const CommandSpec* FindCommand(const std::string& name) {
  for (const auto& c : Commands()) {
    if (name == c.name) return &c;
  }
  return nullptr;
}

constexpr char kGeneralUsage[] =
    "esb: command-line client for esbd (EnterSandBox)\n"
    "\n"
    "Usage: esb [--url URL] [--api-key KEY] [--json] COMMAND [ARGS]\n"
    "\n"
    "Commands:\n"
    "  create    Create an environment and print its id\n"
    "  ls        List environments\n"
    "  exec      Run a command in an environment (output streams live)\n"
    "  cp        Copy a file into or out of an environment\n"
    "  cat       Print a file from an environment\n"
    "  rm        Destroy environments\n"
    "  logs      Show the audit entries of one environment\n"
    "  audit     Search the audit log\n"
    "  report    Egress compliance report (daily or weekly; json, csv or html)\n"
    "  steps     Show an environment's step log (time travel)\n"
    "  step      Show one step: input, output, variables, changed files\n"
    "  rewind    Put an environment back to a step\n"
    "  fork      Create a new environment at a step\n"
    "  shell     Open an interactive shell (optionally in a fork at a step)\n"
    "  health    Check that esbd is up\n"
    "\n"
    "Global options (before or after the command):\n"
    "  --url URL       esbd address (default: $ESB_URL, else http://127.0.0.1:8080)\n"
    "  --api-key KEY   API key, sent as a Bearer token (default: $ESB_API_KEY)\n"
    "  --json          print the daemon's raw JSON instead of tables\n"
    "  -h, --help      help; `esb COMMAND --help` for one command\n"
    "  --version       print the version\n"
    "\n"
    "Exit status: 0 success, 1 the daemon answered with an error, 2 usage error or esbd\n"
    "unreachable; `esb exec` exits with the command's exit code.\n";

bool ParseInt64(const std::string& text, int64_t* out) {
  if (text.empty()) return false;
  const char* end = text.data() + text.size();
  auto [p, ec] = std::from_chars(text.data(), end, *out);
  return ec == std::errc() && p == end;
}

bool ParseDouble(const std::string& text, double* out) {
  if (text.empty()) return false;
  const char* end = text.data() + text.size();
  auto [p, ec] = std::from_chars(text.data(), end, *out);
  return ec == std::errc() && p == end && std::isfinite(*out);
}

absl::Status CheckFlagValue(const FlagSpec& spec, const std::string& value) {
  int64_t i;
  double d;
  switch (spec.kind) {
    case FlagSpec::kText:
      return absl::OkStatus();
    case FlagSpec::kInt:
      if (ParseInt64(value, &i)) return absl::OkStatus();
      return absl::InvalidArgumentError(std::string(spec.name) + " needs a whole number, got '" +
                                        value + "'");
    case FlagSpec::kNumber:
      if (ParseDouble(value, &d)) return absl::OkStatus();
      return absl::InvalidArgumentError(std::string(spec.name) + " needs a number, got '" + value +
                                        "'");
    case FlagSpec::kKeyValue: {
      const size_t eq = value.find('=');
      if (eq != std::string::npos && eq > 0) return absl::OkStatus();
      return absl::InvalidArgumentError(std::string(spec.name) + " needs KEY=VALUE, got '" + value +
                                        "'");
    }
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// JSON helpers (the daemon's answers are untrusted input: never assume a shape)

const json::value* Field(const json::value& v, std::string_view key) {
  const json::object* o = v.if_object();
  return o == nullptr ? nullptr : o->if_contains(key);
}

std::string Str(const json::value& v, std::string_view key) {
  const json::value* f = Field(v, key);
  if (f == nullptr) return "";
  if (const json::string* s = f->if_string()) return std::string(s->data(), s->size());
  return "";
}

std::optional<double> Num(const json::value& v, std::string_view key) {
  const json::value* f = Field(v, key);
  if (f == nullptr) return std::nullopt;
  if (f->is_int64()) return static_cast<double>(f->get_int64());
  if (f->is_uint64()) return static_cast<double>(f->get_uint64());
  if (f->is_double()) return f->get_double();
  return std::nullopt;
}

bool Bool(const json::value& v, std::string_view key) {
  const json::value* f = Field(v, key);
  return f != nullptr && f->is_bool() && f->get_bool();
}

std::optional<json::value> ParseJson(const std::string& text) {
  json::error_code ec;
  json::value v = json::parse(text, ec);
  if (ec) return std::nullopt;
  return v;
}

std::string IntText(std::optional<double> n) {
  if (!n.has_value()) return "-";
  return std::to_string(static_cast<long long>(*n));
}

// ---------------------------------------------------------------------------------------------
// Talking to esbd

class Runner {
 public:
  Runner(const Invocation& inv, CliContext& ctx)
      : inv_(inv), ctx_(ctx), out_(*ctx.out), err_(*ctx.err) {}

  int Run() {
    absl::StatusOr<Endpoint> ep = ParseUrl(inv_.global.url);
    if (!ep.ok()) return Usage(std::string(ep.status().message()));
    endpoint_ = *ep;
    transport_ = ctx_.transport ? ctx_.transport(endpoint_) : MakeBeastTransport(endpoint_);
    const std::string& c = inv_.command;
    if (c == "health") return Health();
    if (c == "create") return Create();
    if (c == "ls") return List();
    if (c == "exec") return Exec();
    if (c == "cp") return Copy();
    if (c == "cat") return Cat();
    if (c == "rm") return Remove();
    if (c == "logs") return Logs();
    if (c == "audit") return Audit();
    if (c == "report") return Report();
    if (c == "steps") return Steps();
    if (c == "step") return StepDetail();
    if (c == "rewind") return Rewind();
    if (c == "fork") return Fork();
    if (c == "shell") return Shell();
    return Usage("unknown command '" + c + "'");
  }

 private:
  int Usage(const std::string& message) {
    err_ << "esb: " << message << "\n";
    return kExitUsage;
  }

  // A failure below HTTP (connect, I/O, local files).
  int Fail(const absl::Status& status) {
    err_ << "esb: " << status.message() << "\n";
    return status.code() == absl::StatusCode::kUnavailable ? kExitConnect : kExitError;
  }

  // The daemon answered non-2xx: show its message.
  int ApiFail(const HttpResponse& r, const std::string& prefix = "") {
    err_ << "esb: " << prefix << ApiErrorText(r) << "\n";
    return kExitError;
  }

  static std::string ApiErrorText(const HttpResponse& r) {
    std::optional<json::value> v = ParseJson(r.body);
    std::string message = v ? Str(*v, "message") : "";
    std::string code = v ? Str(*v, "code") : "";
    std::string text;
    if (!message.empty()) {
      text = SanitizeCell(message, 2000) + " (HTTP " + std::to_string(r.status) +
             (code.empty() ? "" : " " + SanitizeCell(code, 64)) + ")";
    } else {
      text = "esbd answered HTTP " + std::to_string(r.status);
      if (!r.body.empty()) text += ": " + SanitizeCell(r.body, 200);
    }
    if (r.status == 401) text += "; set --api-key or ESB_API_KEY";
    return text;
  }

  static bool Ok(const HttpResponse& r) { return r.status >= 200 && r.status < 300; }

  HttpRequest Request(const std::string& method, const std::string& target) const {
    HttpRequest req;
    req.method = method;
    req.target = target;
    if (!inv_.global.api_key.empty()) {
      req.headers.emplace_back("Authorization", "Bearer " + inv_.global.api_key);
    }
    return req;
  }

  absl::StatusOr<HttpResponse> Call(const std::string& method, const std::string& target,
                                    const json::value* body = nullptr, BodySink* sink = nullptr,
                                    const std::string& accept = "application/json") {
    HttpRequest req = Request(method, target);
    req.headers.emplace_back("Accept", accept);
    if (body != nullptr) {
      req.headers.emplace_back("Content-Type", "application/json");
      req.body = json::serialize(*body);
    }
    return transport_->Send(req, sink);
  }

  static std::string EnvPath(const std::string& env) {
    return "/environments/" + PercentEncode(env, false);
  }

  static std::string Query(const std::vector<std::pair<std::string, std::string>>& params) {
    std::string q;
    for (const auto& [k, v] : params) {
      q += q.empty() ? "?" : "&";
      q += k + "=" + PercentEncode(v, true);
    }
    return q;
  }

  int64_t Now() const { return ctx_.now_ms != 0 ? ctx_.now_ms : NowUnixMs(); }

  int64_t TimeMs(const json::value& v, std::string_view key) const {
    int64_t ms = 0;
    std::string text = Str(v, key);
    return !text.empty() && ParseTime(text, &ms) ? ms : 0;
  }

  void PrintJson(const HttpResponse& r) {
    out_ << r.body;
    if (r.body.empty() || r.body.back() != '\n') out_ << "\n";
  }

  json::object EnvObject(const std::string& flag) const {
    json::object env;
    auto it = inv_.flags.find(flag);
    if (it == inv_.flags.end()) return env;
    for (const std::string& kv : it->second) {
      const size_t eq = kv.find('=');
      env[kv.substr(0, eq)] = kv.substr(eq + 1);
    }
    return env;
  }

  // --- commands ---

  int Health() {
    absl::StatusOr<HttpResponse> r = Call("GET", "/healthz");
    if (!r.ok()) return Fail(r.status());
    if (!Ok(*r)) return ApiFail(*r);
    if (inv_.global.json) {
      PrintJson(*r);
      return kExitOk;
    }
    std::optional<json::value> v = ParseJson(r->body);
    if (!v) {
      out_ << "esbd at " << endpoint_.url << ": HTTP " << r->status << "\n";
      return kExitOk;
    }
    std::string status = Str(*v, "status");
    out_ << "esbd " << SanitizeCell(Str(*v, "version"), 40) << " at " << endpoint_.url << ": "
         << SanitizeCell(status.empty() ? "ok" : status, 40) << "\n";
    if (const json::value* d = Field(*v, "drivers"); d != nullptr && d->is_object()) {
      std::vector<std::vector<std::string>> rows;
      for (const auto& [name, value] : d->get_object()) {
        rows.push_back({"  " + SanitizeCell(std::string(name), 40),
                        value.is_string() ? SanitizeCell(std::string(value.get_string()), 200)
                                          : SanitizeCell(json::serialize(value), 200)});
      }
      if (!rows.empty()) out_ << RenderTable({"drivers:", ""}, rows);
    }
    return kExitOk;
  }

  int Create() {
    json::object body;
    if (inv_.Has("--image")) body["image"] = inv_.Value("--image");
    if (inv_.Has("--runtime")) body["runtime"] = inv_.Value("--runtime");
    int64_t i = 0;
    double d = 0;
    if (ParseInt64(inv_.Value("--memory-mb"), &i)) body["memory_mb"] = i;
    if (ParseDouble(inv_.Value("--cpu"), &d)) body["cpu"] = d;
    if (ParseInt64(inv_.Value("--ttl"), &i)) body["ttl_seconds"] = i;
    if (ParseInt64(inv_.Value("--pids"), &i)) body["pids"] = i;
    if (ParseInt64(inv_.Value("--disk-mb"), &i)) body["disk_mb"] = i;
    if (inv_.Has("--env")) body["env"] = EnvObject("--env");
    json::value v = std::move(body);
    absl::StatusOr<HttpResponse> r = Call("POST", "/environments", &v);
    if (!r.ok()) return Fail(r.status());
    if (!Ok(*r)) return ApiFail(*r);
    if (inv_.global.json) {
      PrintJson(*r);
      return kExitOk;
    }
    std::optional<json::value> ans = ParseJson(r->body);
    std::string id = ans ? Str(*ans, "environment_id") : "";
    if (id.empty()) {
      err_ << "esb: unexpected answer from esbd (no environment_id): " << SanitizeCell(r->body, 200)
           << "\n";
      return kExitError;
    }
    out_ << SanitizeCell(id) << "\n";
    return kExitOk;
  }

  int List() {
    absl::StatusOr<HttpResponse> r =
        Call("GET", std::string("/environments") + (inv_.Has("--all") ? "?all=1" : ""));
    if (!r.ok()) return Fail(r.status());
    if (!Ok(*r)) return ApiFail(*r);
    if (inv_.global.json) {
      PrintJson(*r);
      return kExitOk;
    }
    std::optional<json::value> v = ParseJson(r->body);
    const json::value* envs = v ? Field(*v, "environments") : nullptr;
    if (envs == nullptr || !envs->is_array()) {
      err_ << "esb: unexpected answer from esbd: " << SanitizeCell(r->body, 200) << "\n";
      return kExitError;
    }
    const int64_t now = Now();
    std::vector<std::vector<std::string>> rows;
    for (const json::value& e : envs->get_array()) {
      const json::value* limits = Field(e, "limits");
      std::optional<double> cpu = limits ? Num(*limits, "cpu") : std::nullopt;
      std::optional<double> mem = limits ? Num(*limits, "memory_mb") : std::nullopt;
      const std::string state = Str(e, "state");
      rows.push_back({SanitizeCell(Str(e, "environment_id"), 64), SanitizeCell(state, 20),
                      SanitizeCell(Str(e, "runtime"), 20), SanitizeCell(Str(e, "image"), 30),
                      cpu ? FormatNumber(*cpu) : "-", mem ? FormatMiB(*mem) : "-",
                      FormatRelative(TimeMs(e, "created_at"), now),
                      state == "destroyed" || state == "failed"
                          ? "-"
                          : FormatRelative(TimeMs(e, "expires_at"), now)});
    }
    out_ << RenderTable({"ID", "STATE", "RUNTIME", "IMAGE", "CPU", "MEMORY", "CREATED", "EXPIRES"},
                        rows);
    return kExitOk;
  }

  int Remove() {
    int rc = kExitOk;
    for (const std::string& env : inv_.positionals) {
      absl::StatusOr<HttpResponse> r = Call("DELETE", EnvPath(env));
      if (!r.ok()) return Fail(r.status());
      if (!Ok(*r)) {
        rc = ApiFail(*r, SanitizeCell(env, 64) + ": ");
        continue;
      }
      if (inv_.global.json) {
        PrintJson(*r);
      } else {
        out_ << SanitizeCell(env, 64) << " destroyed\n";
      }
    }
    return rc;
  }

  // Streams execute's SSE answer to the terminal as it arrives.
  class ExecSink final : public BodySink {
   public:
    ExecSink(std::ostream& out, std::ostream& err)
        : out_(out), err_(err), parser_([this](const SseEvent& e) { return OnEvent(e); }) {}
    bool OnHeaders(int status, const std::string& content_type) override {
      return status == 200 && content_type.starts_with("text/event-stream");
    }
    absl::Status OnData(std::string_view chunk) override { return parser_.Feed(chunk); }

    bool got_result = false;
    json::value result;
    std::string error;  // message of an `event: error`

   private:
    absl::Status OnEvent(const SseEvent& e) {
      std::optional<json::value> v = ParseJson(e.data);
      if (!v) return absl::OkStatus();  // not ours to judge; skip what we cannot read
      if (e.event == "stdout" || e.event == "stderr") {
        std::ostream& os = e.event == "stdout" ? out_ : err_;
        if (const json::value* d = Field(*v, "data"); d != nullptr && d->is_string()) {
          os.write(d->get_string().data(), static_cast<std::streamsize>(d->get_string().size()));
        } else if (std::string b64 = Str(*v, "data_b64"); !b64.empty()) {
          std::string raw;
          if (Base64Decode(b64, &raw))
            os.write(raw.data(), static_cast<std::streamsize>(raw.size()));
        }
        os.flush();
      } else if (e.event == "result") {
        got_result = true;
        result = std::move(*v);
      } else if (e.event == "error") {
        error = Str(*v, "message");
        if (error.empty()) error = "esbd reported an error: " + e.data;
      }
      return absl::OkStatus();
    }

    std::ostream& out_;
    std::ostream& err_;
    SseParser parser_;
  };

  int ExitCodeOf(const json::value& result) {
    std::optional<double> code = Num(result, "exit_code");
    if (Bool(result, "timed_out")) {
      err_ << "esb: command timed out and was killed\n";
    }
    if (Bool(result, "truncated")) {
      err_ << "esb: output was truncated by esbd (per-stream output cap)\n";
    }
    if (!code.has_value()) {
      err_ << "esb: the result from esbd has no exit_code\n";
      return kExitError;
    }
    const long long c = static_cast<long long>(*code);
    return c < 0 || c > 255 ? kExitError : static_cast<int>(c);
  }

  int Exec() {
    json::object body;
    body["command"] = JoinCommand(inv_.command_words);
    int64_t timeout = 0;
    if (ParseInt64(inv_.Value("--timeout"), &timeout)) body["timeout_seconds"] = timeout;
    if (inv_.Has("--env")) body["env"] = EnvObject("--env");
    json::value v = std::move(body);
    const std::string target = EnvPath(inv_.positionals[0]) + "/execute";

    if (inv_.global.json) {
      absl::StatusOr<HttpResponse> r = Call("POST", target, &v);
      if (!r.ok()) return Fail(r.status());
      if (!Ok(*r)) return ApiFail(*r);
      PrintJson(*r);
      std::optional<json::value> res = ParseJson(r->body);
      std::optional<double> code = res ? Num(*res, "exit_code") : std::nullopt;
      return code && *code >= 0 && *code <= 255 ? static_cast<int>(*code) : kExitError;
    }

    ExecSink sink(out_, err_);
    absl::StatusOr<HttpResponse> r = Call("POST", target, &v, &sink, "text/event-stream");
    out_.flush();
    if (!r.ok()) return Fail(r.status());
    if (!Ok(*r)) return ApiFail(*r);
    if (!r->streamed) {  // a daemon that answered with plain JSON
      std::optional<json::value> res = ParseJson(r->body);
      if (!res) return ApiFail(*r);
      std::string so = Str(*res, "stdout"), se = Str(*res, "stderr");
      out_ << so;
      out_.flush();
      err_ << se;
      return ExitCodeOf(*res);
    }
    if (!sink.error.empty()) {
      err_ << "esb: " << SanitizeCell(sink.error, 2000) << "\n";
      return kExitError;
    }
    if (!sink.got_result) {
      err_ << "esb: the output stream from esbd ended before the command finished\n";
      return kExitError;
    }
    return ExitCodeOf(sink.result);
  }

  // Writes a streamed download to a stream or (atomically) to a file.
  class DownloadSink final : public BodySink {
   public:
    explicit DownloadSink(std::ostream* os) : os_(os) {}
    explicit DownloadSink(std::string path) : path_(std::move(path)) {}
    ~DownloadSink() override {
      if (!path_.empty() && !committed_ && opened_) {
        file_.close();
        std::remove(TempPath().c_str());
      }
    }
    bool OnHeaders(int status, const std::string&) override {
      if (status != 200) return false;
      if (!path_.empty()) {
        file_.open(TempPath(), std::ios::binary | std::ios::trunc);
        opened_ = file_.is_open();
        if (!opened_) open_error_ = ErrnoStatus("cannot write " + TempPath());
      }
      return true;
    }
    absl::Status OnData(std::string_view chunk) override {
      if (!open_error_.ok()) return open_error_;
      std::ostream& os = path_.empty() ? *os_ : file_;
      os.write(chunk.data(), static_cast<std::streamsize>(chunk.size()));
      if (!os) return absl::DataLossError("write failed while saving the download");
      bytes_ += chunk.size();
      return absl::OkStatus();
    }
    // After a successful transfer: moves the temporary file into place.
    absl::Status Commit() {
      if (!open_error_.ok()) return open_error_;
      if (path_.empty()) {
        os_->flush();
        return absl::OkStatus();
      }
      file_.close();
      if (!file_) return absl::DataLossError("cannot write " + TempPath());
      if (std::rename(TempPath().c_str(), path_.c_str()) != 0) {
        return ErrnoStatus("rename " + TempPath() + " to " + path_);
      }
      committed_ = true;
      return absl::OkStatus();
    }
    size_t bytes() const { return bytes_; }

   private:
    std::string TempPath() const { return path_ + ".esb-partial"; }
    std::ostream* os_ = nullptr;
    std::string path_;
    std::ofstream file_;
    bool opened_ = false;
    bool committed_ = false;
    absl::Status open_error_;
    size_t bytes_ = 0;
  };

  int Download(const std::string& env, const std::string& path, DownloadSink& sink) {
    HttpRequest req = Request("GET", EnvPath(env) + "/files/raw" + Query({{"path", path}}));
    absl::StatusOr<HttpResponse> r = transport_->Send(req, &sink);
    if (!r.ok()) return Fail(r.status());
    if (!Ok(*r)) return ApiFail(*r);
    if (absl::Status s = sink.Commit(); !s.ok()) return Fail(s);
    return kExitOk;
  }

  int Cat() {
    DownloadSink sink(&out_);
    return Download(inv_.positionals[0], inv_.positionals[1], sink);
  }

  static std::string BaseName(const std::string& path) {
    std::string p = path;
    while (p.size() > 1 && p.back() == '/') p.pop_back();
    const size_t slash = p.rfind('/');
    return slash == std::string::npos ? p : p.substr(slash + 1);
  }

  int Copy() {
    std::string src_env, src_path, dst_env, dst_path;
    const bool src_remote = SplitRemote(inv_.positionals[0], &src_env, &src_path);
    const bool dst_remote = SplitRemote(inv_.positionals[1], &dst_env, &dst_path);
    if (src_remote == dst_remote) {
      return Usage(src_remote ? "cp copies between this machine and an environment, not "
                                "between two environments"
                              : "one side of cp must be ENV:PATH (e.g. esb cp a.txt env_1:a.txt)");
    }
    if (dst_remote) return Upload(inv_.positionals[0], dst_env, dst_path);

    const std::string local = inv_.positionals[1];
    if (src_path.empty()) return Usage("give the file to download: ENV:PATH");
    if (local == "-") {
      DownloadSink sink(&out_);
      return Download(src_env, src_path, sink);
    }
    std::string target = local;
    std::error_code ec;
    if (std::filesystem::is_directory(local, ec)) {
      const std::string base = BaseName(src_path);
      if (base.empty() || base == "." || base == ".." || base == "/") {
        return Usage("cannot tell the file name from '" + src_path + "'");
      }
      target = (std::filesystem::path(local) / base).string();
    }
    DownloadSink sink(target);
    int rc = Download(src_env, src_path, sink);
    if (rc == kExitOk && !inv_.global.json) {
      err_ << "copied " << sink.bytes() << " bytes from " << SanitizeCell(src_env, 64) << ":"
           << SanitizeCell(src_path, 200) << " to " << target << "\n";
    }
    return rc;
  }

  int Upload(const std::string& local, const std::string& env, std::string path) {
    std::string body, body_file;
    if (local == "-") {
      if (path.empty() || path.back() == '/') return Usage("give a file name: ENV:PATH");
      body.assign(std::istreambuf_iterator<char>(*ctx_.in), std::istreambuf_iterator<char>());
    } else {
      struct stat st;
      if (::stat(local.c_str(), &st) != 0) return Fail(ErrnoStatus("cannot read " + local));
      if (S_ISDIR(st.st_mode)) {
        return Usage(local + " is a directory; esb cp copies single files (tar it first)");
      }
      if (!S_ISREG(st.st_mode)) return Usage(local + " is not a regular file");
      if (path.empty() || path.back() == '/') path += BaseName(local);
      body_file = local;  // streamed by the transport, never loaded whole
    }
    HttpRequest full = Request("PUT", EnvPath(env) + "/files/raw" + Query({{"path", path}}));
    full.headers.emplace_back("Content-Type", "application/octet-stream");
    full.headers.emplace_back("Accept", "application/json");
    full.body = std::move(body);
    full.body_file = std::move(body_file);
    absl::StatusOr<HttpResponse> r = transport_->Send(full, nullptr);
    if (!r.ok()) return Fail(r.status());
    if (!Ok(*r)) return ApiFail(*r);
    if (inv_.global.json) {
      PrintJson(*r);
      return kExitOk;
    }
    std::optional<json::value> v = ParseJson(r->body);
    std::optional<double> bytes = v ? Num(*v, "bytes") : std::nullopt;
    err_ << "copied " << IntText(bytes) << " bytes to " << SanitizeCell(env, 64) << ":"
         << SanitizeCell(path, 200) << "\n";
    return kExitOk;
  }

  // Resolves --since/--until: an age ("15m") or a time ParseTime understands.
  bool ResolveTime(const std::string& text, std::string* rfc3339) const {
    static const std::pair<char, int64_t> kUnits[] = {
        {'s', 1000}, {'m', 60'000}, {'h', 3'600'000}, {'d', 86'400'000}, {'w', 604'800'000}};
    if (text.size() >= 2) {
      int64_t n = 0;
      for (const auto& [unit, ms] : kUnits) {
        if (text.back() == unit && ParseInt64(text.substr(0, text.size() - 1), &n) && n >= 0) {
          *rfc3339 = FormatRfc3339(Now() - n * ms);
          return true;
        }
      }
    }
    int64_t ms = 0;
    if (!ParseTime(text, &ms)) return false;
    *rfc3339 = FormatRfc3339(ms);
    return true;
  }

  int ShowAudit(const std::vector<std::pair<std::string, std::string>>& params, bool per_env) {
    absl::StatusOr<HttpResponse> r = Call("GET", "/audit" + Query(params));
    if (!r.ok()) return Fail(r.status());
    if (!Ok(*r)) return ApiFail(*r);
    if (inv_.global.json) {
      PrintJson(*r);
      return kExitOk;
    }
    std::optional<json::value> v = ParseJson(r->body);
    const json::value* entries = v ? Field(*v, "entries") : nullptr;
    if (entries == nullptr || !entries->is_array()) {
      err_ << "esb: unexpected answer from esbd: " << SanitizeCell(r->body, 200) << "\n";
      return kExitError;
    }
    std::vector<std::vector<std::string>> rows;
    for (const json::value& e : entries->get_array()) {
      std::optional<double> dur = Num(e, "duration_ms");
      std::vector<std::string> row = {SanitizeCell(Str(e, "time"), 40)};
      if (!per_env) row.push_back(SanitizeCell(Str(e, "environment_id"), 64));
      row.push_back(SanitizeCell(Str(e, "action"), 40));
      row.push_back(IntText(Num(e, "status")));
      row.push_back(IntText(Num(e, "exit_code")));
      row.push_back(dur ? FormatDurationMs(static_cast<int64_t>(*dur)) : "-");
      row.push_back(SanitizeCell(Str(e, "detail"), 80));
      rows.push_back(std::move(row));
    }
    std::vector<std::string> headers = {"TIME"};
    if (!per_env) headers.push_back("ENVIRONMENT");
    for (const char* h : {"ACTION", "STATUS", "EXIT", "DURATION", "DETAIL"}) headers.push_back(h);
    if (per_env) std::reverse(rows.begin(), rows.end());  // logs read oldest first
    out_ << RenderTable(headers, rows);
    return kExitOk;
  }

  // --- time travel (docs/api.md "Steps") ---

  // A step number from the command line: a whole number >= 0.
  bool StepArg(const std::string& text, int64_t* n) {
    if (ParseInt64(text, n) && *n >= 0) return true;
    Usage("the step must be a whole number >= 0, not '" + SanitizeCell(text, 40) + "'");
    return false;
  }

  // Runs one JSON call; prints the raw answer with --json. nullopt: the failure was reported
  // and *rc is the exit code (also when --json printed it: then *rc is kExitOk).
  std::optional<json::value> JsonCall(const std::string& method, const std::string& target,
                                      const json::value* body, int* rc) {
    absl::StatusOr<HttpResponse> r = Call(method, target, body);
    if (!r.ok()) {
      *rc = Fail(r.status());
      return std::nullopt;
    }
    if (!Ok(*r)) {
      *rc = ApiFail(*r);
      return std::nullopt;
    }
    if (inv_.global.json) {
      PrintJson(*r);
      *rc = kExitOk;
      return std::nullopt;
    }
    std::optional<json::value> v = ParseJson(r->body);
    if (!v || !v->is_object()) {
      err_ << "esb: unexpected answer from esbd: " << SanitizeCell(r->body, 200) << "\n";
      *rc = kExitError;
      return std::nullopt;
    }
    return v;
  }

  static std::string MemoryText(const json::value& s) {
    std::string memory = SanitizeCell(Str(s, "memory"), 20);
    const std::string detail = Str(s, "memory_detail");
    if (!detail.empty()) memory += " (" + SanitizeCell(detail, 60) + ")";
    return memory.empty() ? "-" : memory;
  }

  int Steps() {
    std::vector<std::pair<std::string, std::string>> params;
    if (inv_.Has("--limit")) params.emplace_back("limit", inv_.Value("--limit"));
    if (inv_.Has("--before")) params.emplace_back("before", inv_.Value("--before"));
    int rc = kExitOk;
    std::optional<json::value> v =
        JsonCall("GET", EnvPath(inv_.positionals[0]) + "/steps" + Query(params), nullptr, &rc);
    if (!v) return rc;
    const json::value* steps = Field(*v, "steps");
    if (steps == nullptr || !steps->is_array()) {
      err_ << "esb: unexpected answer from esbd (no steps)\n";
      return kExitError;
    }
    const std::optional<double> head = Num(*v, "head");
    std::vector<std::vector<std::string>> rows;
    for (const json::value& s : steps->get_array()) {
      const std::optional<double> n = Num(s, "step");
      std::optional<double> dur = Num(s, "duration_ms");
      std::string mark = head && n && *head == *n ? "*" : (Bool(s, "on_head") ? "" : "~");
      rows.push_back({mark + IntText(n), IntText(Num(s, "parent")),
                      SanitizeCell(Str(s, "kind"), 20), SanitizeCell(Str(s, "status"), 10),
                      IntText(Num(s, "exit_code")), MemoryText(s), IntText(Num(s, "files_changed")),
                      dur ? FormatDurationMs(static_cast<int64_t>(*dur)) : "-",
                      FormatRelative(static_cast<int64_t>(Num(s, "created_at").value_or(0)), Now()),
                      SanitizeCell(Str(s, "summary"), 60)});
    }
    out_ << RenderTable({"STEP", "PARENT", "KIND", "STATUS", "EXIT", "MEMORY", "FILES", "DURATION",
                         "WHEN", "SUMMARY"},
                        rows);
    if (const std::optional<double> next = Num(*v, "next_before")) {
      out_ << "(older steps: esb steps --before " << IntText(next) << " "
           << SanitizeCell(inv_.positionals[0], 64) << ")\n";
    }
    return kExitOk;
  }

  // Untrusted multi-line text (a step's output), each line made safe for the terminal.
  void PrintBlock(const std::string& text, size_t max_lines = 200) {
    size_t start = 0, lines = 0;
    while (start < text.size() && lines < max_lines) {
      size_t end = text.find('\n', start);
      if (end == std::string::npos) end = text.size();
      out_ << "  " << SanitizeCell(std::string_view(text).substr(start, end - start), 400) << "\n";
      start = end + 1;
      ++lines;
    }
    if (start < text.size()) out_ << "  ...\n";
  }

  int StepDetail() {
    int64_t n = 0;
    if (!StepArg(inv_.positionals[1], &n)) return kExitUsage;
    int rc = kExitOk;
    std::optional<json::value> v =
        JsonCall("GET", EnvPath(inv_.positionals[0]) + "/steps/" + std::to_string(n), nullptr, &rc);
    if (!v) return rc;
    const json::value& s = *v;
    std::optional<double> dur = Num(s, "duration_ms");
    std::vector<std::vector<std::string>> info = {
        {"step", IntText(Num(s, "step"))},
        {"parent", IntText(Num(s, "parent"))},
        {"kind", SanitizeCell(Str(s, "kind"), 40)},
        {"summary", SanitizeCell(Str(s, "summary"), 200)},
        {"status", SanitizeCell(Str(s, "status"), 20)},
        {"exit code", IntText(Num(s, "exit_code"))},
        {"duration", dur ? FormatDurationMs(static_cast<int64_t>(*dur)) : "-"},
        {"tier", SanitizeCell(Str(s, "tier"), 40)},
        {"memory", MemoryText(s)},
        {"on head", Bool(s, "on_head") ? "yes" : "no"}};
    if (const std::string e = Str(s, "error"); !e.empty())
      info.push_back({"error", SanitizeCell(e, 400)});
    if (const json::value* shell = Field(s, "shell"); shell != nullptr)
      info.push_back({"shell cwd", SanitizeCell(Str(*shell, "cwd"), 200)});
    for (const auto& row : info) {
      std::string key = row[0] + ":";
      key.resize(std::max<size_t>(key.size(), 11), ' ');
      out_ << key << row[1] << "\n";
    }
    if (const json::value* output = Field(s, "output"); output != nullptr) {
      for (const char* stream : {"stdout", "stderr"}) {
        const std::string text = Str(*output, stream);
        if (text.empty()) continue;
        out_ << "\n" << stream << (Bool(*output, "truncated") ? " (truncated)" : "") << ":\n";
        PrintBlock(text);
      }
    }
    if (const json::value* vars = Field(s, "variables"); vars != nullptr && vars->is_array()) {
      std::vector<std::vector<std::string>> rows;
      for (const json::value& var : vars->get_array()) {
        rows.push_back({SanitizeCell(Str(var, "name"), 60), SanitizeCell(Str(var, "type"), 40),
                        SanitizeCell(Str(var, "repr"), 80)});
      }
      out_ << "\nvariables:\n" << RenderTable({"NAME", "TYPE", "VALUE"}, rows);
    }
    if (const json::value* changes = Field(s, "changes");
        changes != nullptr && changes->is_array() && !changes->get_array().empty()) {
      std::vector<std::vector<std::string>> rows;
      for (const json::value& c : changes->get_array())
        rows.push_back({SanitizeCell(Str(c, "change"), 20), SanitizeCell(Str(c, "path"), 200)});
      out_ << "\nchanged files:\n" << RenderTable({"CHANGE", "PATH"}, rows);
      // The daemon sends a window of the changes (docs/api.md: changes_after / changes_next).
      if (std::optional<double> total = Num(s, "changes_total");
          total && *total > static_cast<double>(rows.size()))
        out_ << "(" << rows.size() << " of " << IntText(total) << " changes shown)\n";
    }
    if (const json::value* files = Field(s, "files"); files != nullptr && files->is_array()) {
      std::optional<double> total = Num(s, "files_total");
      out_ << "\nfiles at this step: "
           << (total ? IntText(total) : std::to_string(files->get_array().size())) << "\n";
    }
    return kExitOk;
  }

  int Rewind() {
    int64_t n = 0;
    if (!StepArg(inv_.positionals[1], &n)) return kExitUsage;
    json::value body = json::object{{"step", n}};
    int rc = kExitOk;
    std::optional<json::value> v =
        JsonCall("POST", EnvPath(inv_.positionals[0]) + "/rewind", &body, &rc);
    if (!v) return rc;
    const std::string memory = Str(*v, "memory");
    out_ << "rewound " << SanitizeCell(inv_.positionals[0], 64) << " to step "
         << IntText(Num(*v, "head")) << " (memory: " << SanitizeCell(memory, 20)
         << (memory == "none" ? ": files and shell state restored; processes and Python "
                                "memory were not"
                              : "")
         << ")\n";
    return kExitOk;
  }

  // POST .../fork; the new environment's id, or "" after reporting the failure in *rc.
  std::string ForkAt(const std::string& env, int64_t n, int* rc) {
    json::value body = json::object{{"step", n}};
    absl::StatusOr<HttpResponse> r = Call("POST", EnvPath(env) + "/fork", &body);
    if (!r.ok()) {
      *rc = Fail(r.status());
      return "";
    }
    if (!Ok(*r)) {
      *rc = ApiFail(*r);
      return "";
    }
    std::optional<json::value> v = ParseJson(r->body);
    std::string id = v ? Str(*v, "environment_id") : "";
    if (id.empty()) {
      err_ << "esb: unexpected answer from esbd (no environment_id): " << SanitizeCell(r->body, 200)
           << "\n";
      *rc = kExitError;
      return "";
    }
    if (inv_.global.json && inv_.command == "fork") PrintJson(*r);
    return id;
  }

  int Fork() {
    int64_t n = 0;
    if (!StepArg(inv_.positionals[1], &n)) return kExitUsage;
    int rc = kExitOk;
    std::string id = ForkAt(inv_.positionals[0], n, &rc);
    if (id.empty()) return rc;
    if (!inv_.global.json) out_ << SanitizeCell(id) << "\n";
    return kExitOk;
  }

  int Shell() {
    std::string env = inv_.positionals[0];
    if (inv_.Has("--step")) {
      int64_t n = 0;
      if (!StepArg(inv_.Value("--step"), &n)) return kExitUsage;
      int rc = kExitOk;
      std::string id = ForkAt(env, n, &rc);
      if (id.empty()) return rc;
      err_ << "esb: forked " << SanitizeCell(env, 64) << " at step " << n << " into "
           << SanitizeCell(id) << " (esb rm " << SanitizeCell(id) << " when done)\n";
      err_.flush();
      env = id;
    }
    TerminalOptions topts;
    topts.in_fd = ctx_.stdin_fd;
    topts.out_fd = ctx_.stdout_fd;
    std::vector<std::pair<std::string, std::string>> headers;
    if (!inv_.global.api_key.empty())
      headers.emplace_back("Authorization", "Bearer " + inv_.global.api_key);
    absl::StatusOr<int> code = RunTerminal(endpoint_, EnvPath(env) + "/terminal", headers, topts);
    if (!code.ok()) {
      err_ << "esb: " << code.status().message() << "\n";
      return code.status().code() == absl::StatusCode::kUnavailable ? kExitConnect : kExitError;
    }
    return *code;
  }

  int Logs() {
    std::string limit = inv_.Has("--limit") ? inv_.Value("--limit") : "100";
    return ShowAudit({{"environment_id", inv_.positionals[0]}, {"limit", limit}}, true);
  }

  int Audit() {
    std::vector<std::pair<std::string, std::string>> params;
    for (const auto& [flag, key] : {std::pair{"--since", "since"}, {"--until", "until"}}) {
      if (!inv_.Has(flag)) continue;
      std::string t;
      if (!ResolveTime(inv_.Value(flag), &t)) {
        return Usage(std::string(flag) + ": cannot read '" + inv_.Value(flag) +
                     "' (use RFC 3339, unix seconds, or an age like 15m, 2h, 7d)");
      }
      params.emplace_back(key, t);
    }
    if (inv_.Has("--env")) params.emplace_back("environment_id", inv_.Value("--env"));
    if (inv_.Has("--q")) params.emplace_back("q", inv_.Value("--q"));
    if (inv_.Has("--limit")) params.emplace_back("limit", inv_.Value("--limit"));
    if (inv_.Has("--kind")) params.emplace_back("kind", inv_.Value("--kind"));
    if (inv_.Has("--decision")) params.emplace_back("decision", inv_.Value("--decision"));
    return ShowAudit(params, false);
  }

  int Report() {
    const std::string period = inv_.Has("--period") ? inv_.Value("--period") : "daily";
    if (period != "daily" && period != "weekly") {
      return Usage("--period: daily or weekly, not '" + SanitizeCell(period, 40) + "'");
    }
    const std::string format = inv_.Has("--format") ? inv_.Value("--format") : "json";
    if (format != "json" && format != "csv" && format != "html") {
      return Usage("--format: json, csv or html, not '" + SanitizeCell(format, 40) + "'");
    }
    std::vector<std::pair<std::string, std::string>> params = {{"period", period},
                                                               {"format", format}};
    if (inv_.Has("--env")) params.emplace_back("environment_id", inv_.Value("--env"));
    if (inv_.Has("--date")) params.emplace_back("date", inv_.Value("--date"));
    absl::StatusOr<HttpResponse> r = Call("GET", "/reports" + Query(params));
    if (!r.ok()) return Fail(r.status());
    if (!Ok(*r)) return ApiFail(*r);
    if (inv_.Has("--format") || inv_.global.json) {
      PrintJson(*r);  // the daemon's document as is (JSON, CSV or HTML)
      return kExitOk;
    }
    std::optional<json::value> v = ParseJson(r->body);
    const json::value* totals = v ? Field(*v, "totals") : nullptr;
    if (totals == nullptr || !totals->is_object()) {
      err_ << "esb: unexpected answer from esbd: " << SanitizeCell(r->body, 200) << "\n";
      return kExitError;
    }
    out_ << (period == "weekly" ? "Weekly" : "Daily") << " egress report, tenant "
         << SanitizeCell(Str(*v, "tenant"), 64) << ", " << SanitizeCell(Str(*v, "from"), 40)
         << " to " << SanitizeCell(Str(*v, "to"), 40) << "\n\n";
    auto counts = [](const json::value& e) {
      std::vector<std::string> row;
      for (const char* k : {"requests", "allowed", "blocked", "redacted", "opaque", "errors",
                            "bytes_up", "bytes_down"}) {
        row.push_back(IntText(Num(e, k)));
      }
      return row;
    };
    const std::vector<std::string> kCountHeads = {"REQUESTS", "ALLOWED", "BLOCKED",  "REDACTED",
                                                  "OPAQUE",   "ERRORS",  "BYTES UP", "BYTES DOWN"};
    std::vector<std::vector<std::string>> rows;
    std::vector<std::string> total = {"(all)"};
    for (auto& c : counts(*totals)) total.push_back(std::move(c));
    rows.push_back(std::move(total));
    if (const json::value* envs = Field(*v, "environments"); envs && envs->is_array()) {
      for (const json::value& e : envs->get_array()) {
        std::vector<std::string> row = {SanitizeCell(Str(e, "environment_id"), 64)};
        for (auto& c : counts(e)) row.push_back(std::move(c));
        rows.push_back(std::move(row));
      }
    }
    std::vector<std::string> heads = {"ENVIRONMENT"};
    heads.insert(heads.end(), kCountHeads.begin(), kCountHeads.end());
    out_ << RenderTable(heads, rows);
    // The smaller tables: (title, array field, name key, columns).
    auto section = [&](const char* title, const char* field, const char* key,
                       const std::vector<std::pair<std::string, std::string>>& cols) {
      const json::value* arr = Field(*v, field);
      out_ << "\n" << title << ":";
      if (arr == nullptr || !arr->is_array() || arr->get_array().empty()) {
        out_ << " none\n";
        return;
      }
      out_ << "\n";
      std::vector<std::string> h = {key == std::string("host") ? "HOST" : "RULE"};
      std::vector<std::vector<std::string>> t;
      for (const auto& [name, head] : cols) h.push_back(head);
      for (const json::value& e : arr->get_array()) {
        std::vector<std::string> row = {SanitizeCell(Str(e, key), 80)};
        for (const auto& [name, head] : cols) row.push_back(IntText(Num(e, name)));
        t.push_back(std::move(row));
      }
      out_ << RenderTable(h, t);
    };
    section("Blocks by rule", "blocks_by_rule", "rule", {{"count", "COUNT"}});
    section("Top hosts", "top_hosts", "host",
            {{"requests", "REQUESTS"},
             {"blocked", "BLOCKED"},
             {"bytes_up", "BYTES UP"},
             {"bytes_down", "BYTES DOWN"}});
    section("DLP findings by type", "dlp_findings", "rule", {{"count", "COUNT"}});
    return kExitOk;
  }

  const Invocation& inv_;
  CliContext& ctx_;
  std::ostream& out_;
  std::ostream& err_;
  Endpoint endpoint_;
  std::unique_ptr<HttpTransport> transport_;
};

}  // namespace

std::string Invocation::Value(const std::string& flag) const {
  auto it = flags.find(flag);
  return it == flags.end() || it->second.empty() ? "" : it->second.back();
}

absl::StatusOr<Invocation> ParseCommandLine(const std::vector<std::string>& args,
                                            const std::map<std::string, std::string>& env) {
  Invocation inv;
  auto env_or = [&](const char* name, const char* fallback) {
    auto it = env.find(name);
    return it != env.end() && !it->second.empty() ? it->second : std::string(fallback);
  };
  inv.global.url = env_or("ESB_URL", kDefaultUrl);
  inv.global.api_key = env_or("ESB_API_KEY", "");

  const CommandSpec* spec = nullptr;
  bool in_command = false;  // exec: collecting the command's words
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (in_command) {
      inv.command_words.push_back(a);
      continue;
    }
    if (a == "--") {
      for (++i; i < args.size(); ++i) {
        if (spec != nullptr && inv.command == "exec") {
          inv.command_words.push_back(args[i]);
        } else {
          inv.positionals.push_back(args[i]);
        }
      }
      break;
    }
    if (a.size() > 1 && a[0] == '-') {
      std::string name = a;
      std::optional<std::string> inline_value;
      if (const size_t eq = a.find('='); a.starts_with("--") && eq != std::string::npos) {
        name = a.substr(0, eq);
        inline_value = a.substr(eq + 1);
      }
      auto value = [&]() -> absl::StatusOr<std::string> {
        if (inline_value) return *inline_value;
        if (i + 1 >= args.size()) return absl::InvalidArgumentError(name + " needs a value");
        return args[++i];
      };
      if (name == "-h" || name == "--help") {
        inv.global.help = true;
      } else if (name == "--json") {
        inv.global.json = true;
      } else if (name == "--version") {
        if (inv.command.empty()) inv.command = "version";
      } else if (name == "--url" || name == "--api-key") {
        absl::StatusOr<std::string> v = value();
        if (!v.ok()) return v.status();
        (name == "--url" ? inv.global.url : inv.global.api_key) = *v;
      } else if (spec == nullptr) {
        return absl::InvalidArgumentError("unknown option " + name +
                                          " (command options go after the command)");
      } else {
        const FlagSpec* flag = nullptr;
        for (const auto& f : spec->flags) {
          if (name == f.name) flag = &f;
        }
        if (flag == nullptr) {
          return absl::InvalidArgumentError("unknown option " + name + " for 'esb " + inv.command +
                                            "' (see esb " + inv.command + " --help)");
        }
        if (!flag->takes_value) {
          if (inline_value) return absl::InvalidArgumentError(name + " takes no value");
          inv.flags[name].push_back("");
        } else {
          absl::StatusOr<std::string> v = value();
          if (!v.ok()) return v.status();
          if (absl::Status s = CheckFlagValue(*flag, *v); !s.ok()) return s;
          inv.flags[name].push_back(*v);
        }
      }
      continue;
    }
    if (spec == nullptr && inv.command.empty()) {
      spec = FindCommand(a);
      if (spec == nullptr) {
        return absl::InvalidArgumentError("unknown command '" + a + "' (see esb --help)");
      }
      inv.command = a;
      continue;
    }
    if (inv.command == "exec" && !inv.positionals.empty()) {
      in_command = true;  // `esb exec ENV ls -la`: everything from here is the command
      inv.command_words.push_back(a);
      continue;
    }
    inv.positionals.push_back(a);
  }

  if (inv.global.help || inv.command == "help" || inv.command == "version") return inv;
  if (inv.command.empty()) {
    return absl::InvalidArgumentError("no command given (see esb --help)");
  }
  if (spec == nullptr) return inv;  // `--version` without a command
  const int n = static_cast<int>(inv.positionals.size());
  if (n < spec->min_positionals || (spec->max_positionals >= 0 && n > spec->max_positionals)) {
    std::string usage = spec->usage;
    return absl::InvalidArgumentError("wrong number of arguments for 'esb " + inv.command + "'\n" +
                                      usage.substr(0, usage.find('\n')));
  }
  if (inv.command == "exec" && inv.command_words.empty()) {
    return absl::InvalidArgumentError(
        "no command to run: esb exec ENV -- COMMAND... (e.g. esb exec env_1 -- ls -la)");
  }
  return inv;
}

std::string JoinCommand(const std::vector<std::string>& words) {
  if (words.size() == 1) return words[0];
  std::string out;
  for (const std::string& w : words) {
    if (!out.empty()) out += ' ';
    out += ShellQuote(w);
  }
  return out;
}

bool SplitRemote(const std::string& arg, std::string* env, std::string* path) {
  const size_t colon = arg.find(':');
  if (colon == std::string::npos || colon == 0) return false;
  const std::string prefix = arg.substr(0, colon);
  if (prefix.find('/') != std::string::npos) return false;
  *env = prefix;
  *path = arg.substr(colon + 1);
  return true;
}

std::string UsageText(const std::string& command) {
  if (command.empty()) return kGeneralUsage;
  const CommandSpec* spec = FindCommand(command);
  return spec == nullptr ? "" : spec->usage;
}

int RunCli(const std::vector<std::string>& args, CliContext& ctx) {
  std::ostream& out = *ctx.out;
  std::ostream& err = *ctx.err;
  absl::StatusOr<Invocation> inv = ParseCommandLine(args, ctx.env);
  if (!inv.ok()) {
    err << "esb: " << inv.status().message() << "\n";
    return kExitUsage;
  }
  if (inv->command == "version") {
    out << "esb " << ESB_VERSION << "\n";
    return kExitOk;
  }
  if (inv->global.help || inv->command == "help") {
    std::string topic = inv->command == "help"
                            ? (inv->positionals.empty() ? "" : inv->positionals[0])
                            : inv->command;
    std::string text = UsageText(topic);
    if (text.empty()) {
      err << "esb: unknown command '" << topic << "' (see esb --help)\n";
      return kExitUsage;
    }
    out << text;
    return kExitOk;
  }
  Runner runner(*inv, ctx);
  return runner.Run();
}

}  // namespace esb::cli
