#include "core/mcp_hosts/hosts.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/utf8.h"
#include "common/util.h"

namespace esb::mcp_hosts {

namespace json = boost::json;

namespace {

constexpr size_t kMaxCommandBytes = 4096;
constexpr size_t kMaxArgs = 256;
constexpr size_t kMaxArgvBytes = 64 << 10;
constexpr size_t kMaxEnvVars = 128;
constexpr size_t kMaxEnvBytes = 64 << 10;
constexpr int64_t kMaxBackoffMs = 30'000;
// Reading a changed tools list after notifications/tools/list_changed.
constexpr int64_t kRefreshTimeoutMs = 10'000;

bool ValidServerName(std::string_view n) {
  if (n.empty() || n.size() > 63) return false;
  if (!((n[0] >= 'a' && n[0] <= 'z') || (n[0] >= '0' && n[0] <= '9'))) return false;
  for (char c : n)
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '-')) return false;
  return true;
}

bool ValidEnvName(std::string_view n) {
  if (n.empty() || n.size() > 256) return false;
  if (n[0] >= '0' && n[0] <= '9') return false;
  for (char c : n)
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_'))
      return false;
  return true;
}

// Whether `<server>.<tool>`, the name in the environment's registry, is a valid MCP tool name
// (both parts are valid on their own: only the length can fail).
bool FitsRegistry(std::string_view server, std::string_view tool) {
  return server.size() + 1 + tool.size() <= kMaxToolNameBytes;
}

std::string ToolNameOf(const json::object& tool) {
  const json::value* n = tool.if_contains("name");
  return n != nullptr && n->is_string() ? std::string(n->as_string()) : std::string();
}

tools::ToolResult ErrorResult(std::string text) {
  tools::ToolResult r;
  r.is_error = true;
  r.content.push_back(json::object{{"type", "text"}, {"text", std::move(text)}});
  return r;
}

std::string Tail(const std::string& s, size_t max) {
  return s.size() <= max ? s : s.substr(s.size() - max);
}

}  // namespace

absl::Status ValidateServerSpec(const ServerSpec& spec) {
  if (!ValidServerName(spec.name))
    return absl::InvalidArgumentError(
        "'name' must be 1-63 characters of [a-z0-9_-], starting with a letter or digit");
  if (spec.command.empty() || spec.command.size() > kMaxCommandBytes ||
      spec.command.find('\0') != std::string::npos)
    return absl::InvalidArgumentError(
        absl::StrCat("'command' must be 1-", kMaxCommandBytes, " bytes without NUL"));
  if (spec.args.size() > kMaxArgs)
    return absl::InvalidArgumentError(absl::StrCat("'args' has over ", kMaxArgs, " entries"));
  size_t argv_bytes = spec.command.size();
  for (const std::string& a : spec.args) {
    if (a.find('\0') != std::string::npos)
      return absl::InvalidArgumentError("'args' entries must not contain NUL");
    argv_bytes += a.size() + 1;
  }
  if (argv_bytes > kMaxArgvBytes)
    return absl::InvalidArgumentError(
        absl::StrCat("'command' and 'args' exceed ", kMaxArgvBytes, " bytes"));
  if (spec.env.size() > kMaxEnvVars)
    return absl::InvalidArgumentError(absl::StrCat("'env' has over ", kMaxEnvVars, " entries"));
  size_t env_bytes = 0;
  for (const auto& [k, v] : spec.env) {
    if (!ValidEnvName(k))
      return absl::InvalidArgumentError(absl::StrCat("'env' name '", SanitizeUtf8(k.substr(0, 64)),
                                                     "' must match [A-Za-z_][A-Za-z0-9_]*"));
    if (v.find('\0') != std::string::npos)
      return absl::InvalidArgumentError("'env' values must not contain NUL");
    env_bytes += k.size() + v.size() + 2;
  }
  if (env_bytes > kMaxEnvBytes)
    return absl::InvalidArgumentError(absl::StrCat("'env' exceeds ", kMaxEnvBytes, " bytes"));
  return absl::OkStatus();
}

struct McpHosts::Server {
  Caller caller{""};  // who started it (its spawns, its lifecycle rows)
  std::string environment_id;
  ServerSpec spec;
  std::mutex mu;
  std::condition_variable cv;
  std::string state = "starting";
  std::string protocol;
  std::string error;
  std::string stderr_tail;  // of the last process that ended
  int restarts = 0;
  int64_t started_ms = 0;
  bool stop = false;
  bool settled = false;  // the first start is over (ready or failed): Start returns
  std::vector<json::object> tools;
  std::vector<std::string> skipped_tools;  // ToolList::skipped (+ names too long to namespace)
  int skipped_tools_count = 0;
  std::shared_ptr<StdioClient> client;
  EnvironmentManager::Process* process = nullptr;  // owned by `client`
};

McpHosts::McpHosts(EnvironmentManager* manager, McpConfig config)
    : manager_(manager), config_(std::move(config)) {}

McpHosts::~McpHosts() {
  std::vector<std::shared_ptr<Server>> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [env, by_name] : servers_)
      for (auto& [name, s] : by_name) all.push_back(s);
  }
  for (const auto& s : all) StopServer(*s, "esbd is shutting down");
  // The supervisors end within a second of their stop (their waits are bounded); wait for all.
  std::unique_lock<std::mutex> lock(mu_);
  supervisors_cv_.wait(lock, [&] { return supervisors_ == 0; });
}

void McpHosts::StopServer(Server& server, std::string_view reason) {
  std::shared_ptr<StdioClient> client;
  {
    std::lock_guard<std::mutex> lock(server.mu);
    server.stop = true;
    client = server.client;
  }
  server.cv.notify_all();
  if (client) client->Kill(std::string(reason));
}

ClientLimits McpHosts::LimitsFor() const {
  ClientLimits l;
  l.max_message_bytes = config_.max_message_bytes;
  l.max_output_bytes_per_second = config_.max_output_bytes_per_second;
  l.max_lines_per_second = config_.max_lines_per_second;
  l.max_garbage_lines = config_.max_garbage_lines;
  l.max_concurrent_calls = config_.max_concurrent_calls_per_server;
  l.stderr_tail_bytes = config_.stderr_tail_bytes;
  l.max_tools = config_.max_tools_per_server;
  return l;
}

absl::Status McpHosts::CheckEnvironment(const Caller& caller, const std::string& environment_id) {
  auto info = manager_->Get(caller, environment_id);
  if (!info.ok()) return info.status();
  if (info->record.state != EnvState::kRunning)
    return EnvironmentNotFoundError(
        absl::StrCat("environment ", environment_id, " is not running"));
  return absl::OkStatus();
}

int MaxServersPerTenant(const McpConfig& config) {
  return std::max(config.max_servers_per_environment, config.max_servers / 4);
}

int McpHosts::TenantServersLocked(const std::string& tenant) const {
  int n = 0;
  for (const auto& [env, by_name] : servers_)
    for (const auto& [name, s] : by_name) n += s->caller.tenant == tenant;
  return n;
}

std::shared_ptr<McpHosts::Server> McpHosts::Find(const std::string& tenant,
                                                 const std::string& environment_id,
                                                 const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  auto env = servers_.find(environment_id);
  if (env == servers_.end()) return nullptr;
  auto it = env->second.find(name);
  if (it == env->second.end() || it->second->caller.tenant != tenant) return nullptr;
  return it->second;
}

ServerInfo McpHosts::InfoOf(const Server& s) {
  ServerInfo info;
  info.environment_id = s.environment_id;
  info.spec = s.spec;
  info.state = s.state;
  // Its process has just ended and the supervisor has not caught up yet: not ready any more.
  if (s.state == "ready" && s.client && s.client->exit_info().ended) info.state = "restarting";
  info.protocol = s.protocol;
  info.tools = static_cast<int>(s.tools.size());
  info.skipped_tools = s.skipped_tools;
  info.skipped_tools_count = s.skipped_tools_count;
  info.restarts = s.restarts;
  info.error = s.error;
  info.started_ms = s.started_ms;
  info.stderr_tail = s.client ? s.client->stderr_tail() : s.stderr_tail;
  return info;
}

void McpHosts::KeepTools(Server& s, ToolList list) {
  s.skipped_tools = std::move(list.skipped);
  s.skipped_tools_count = list.skipped_count;
  for (const json::object& t : list.tools) {
    const std::string tool = ToolNameOf(t);
    if (FitsRegistry(s.spec.name, tool)) continue;
    if (s.skipped_tools.size() < kMaxSkippedReported)
      s.skipped_tools.push_back(absl::StrCat(tool.substr(0, 64),
                                             "...: not in the environment's "
                                             "registry (",
                                             s.spec.name, ".<tool> is over ", kMaxToolNameBytes,
                                             " characters)"));
    ++s.skipped_tools_count;
  }
  s.tools = std::move(list.tools);
}

void McpHosts::Forget(const Server& server) {
  std::lock_guard<std::mutex> lock(mu_);
  auto env = servers_.find(server.environment_id);
  if (env == servers_.end()) return;
  auto it = env->second.find(server.spec.name);
  if (it == env->second.end() || it->second.get() != &server) return;
  env->second.erase(it);
  --total_;
  if (env->second.empty()) servers_.erase(env);
}

absl::StatusOr<ServerInfo> McpHosts::Start(const Caller& caller, const std::string& environment_id,
                                           ServerSpec spec) {
  if (absl::Status st_ = CheckEnvironment(caller, environment_id); !st_.ok()) return st_;
  auto runtime = manager_->RuntimeOf(caller, environment_id);
  if (!runtime.ok()) return runtime.status();
  if (!manager_->CapabilitiesOf(*runtime).Has(Capability::kProcesses))
    return MissingCapabilityError(ToString(*runtime), Capability::kProcesses);
  if (absl::Status st_ = ValidateServerSpec(spec); !st_.ok()) return st_;
  auto server = std::make_shared<Server>();
  server->caller = caller;
  server->environment_id = environment_id;
  server->spec = std::move(spec);
  const std::string name = server->spec.name;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto& by_name = servers_[environment_id];
    absl::Status refused;
    if (by_name.count(name)) {
      refused = absl::AlreadyExistsError(absl::StrCat(
          "environment ", environment_id, " already has an MCP server named '", name, "'"));
    } else if (static_cast<int>(by_name.size()) >= config_.max_servers_per_environment) {
      refused = absl::ResourceExhaustedError(
          absl::StrCat("environment ", environment_id, " already has ", by_name.size(),
                       " MCP servers (mcp.max_servers_per_environment is ",
                       config_.max_servers_per_environment, ")"));
    } else if (total_ >= config_.max_servers) {
      refused = absl::ResourceExhaustedError(absl::StrCat(
          "this daemon already hosts ", total_, " MCP servers (mcp.max_servers); try later"));
    } else if (const int cap = MaxServersPerTenant(config_);
               TenantServersLocked(caller.tenant) >= cap) {
      // SECURITY: one tenant cannot take every hosted-server slot of the daemon from the others.
      refused = absl::ResourceExhaustedError(
          absl::StrCat("this tenant already hosts ", cap,
                       " MCP servers (a quarter of mcp.max_servers, at least "
                       "mcp.max_servers_per_environment); stop some first"));
    }
    if (!refused.ok()) {
      if (by_name.empty()) servers_.erase(environment_id);
      manager_->audit().Record(caller, {.environment_id = environment_id,
                                        .action = "mcp.server.start",
                                        .detail = name,
                                        .outcome = refused});
      return refused;
    }
    by_name[name] = server;
    ++total_;
    ++supervisors_;
  }
  std::thread([this, server] {
    Supervise(server);
    std::lock_guard<std::mutex> lock(mu_);
    if (--supervisors_ == 0) supervisors_cv_.notify_all();
  }).detach();
  // Bounded: the first start ends (ready or failed) within the start timeout plus the spawn's
  // own bound; the extra seconds cover a step lock the spawn waits for.
  std::unique_lock<std::mutex> lock(server->mu);
  server->cv.wait_for(lock, std::chrono::seconds(config_.start_timeout_s + 35),
                      [&] { return server->settled; });
  return InfoOf(*server);
}

absl::Status McpHosts::StartOnce(Server& s) {
  const int64_t deadline = MonotonicMs() + config_.start_timeout_s * 1000;
  ProcessRequest request;
  request.argv.push_back(s.spec.command);
  request.argv.insert(request.argv.end(), s.spec.args.begin(), s.spec.args.end());
  request.env = s.spec.env;
  // The spawn is part of the server's lifecycle, audited as such (mcp.server.*).
  auto process = manager_->SpawnProcess(s.caller.Step(), s.environment_id, std::move(request));
  if (!process.ok()) return process.status();
  EnvironmentManager::Process* raw = process->get();
  auto client = std::make_shared<StdioClient>(*std::move(process), LimitsFor(),
                                              absl::StrCat("MCP server '", s.spec.name, "'"));
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.client = client;
    s.process = raw;
    s.started_ms = NowUnixMs();
    if (s.stop) {
      client->Kill("stopped");
      return absl::CancelledError("stopped");
    }
  }
  absl::Status st = client->Initialize(deadline);
  absl::StatusOr<ToolList> tools =
      st.ok() ? client->ListTools(deadline) : absl::StatusOr<ToolList>(st);
  if (!tools.ok()) {
    client->Kill(std::string(tools.status().message()));
    client->WaitEnded(2000);
    return absl::Status(
        tools.status().code(),
        absl::StrCat(tools.status().message(),
                     client->stderr_tail().empty()
                         ? ""
                         : absl::StrCat("; stderr: ", Tail(client->stderr_tail(), 1024))));
  }
  std::lock_guard<std::mutex> lock(s.mu);
  KeepTools(s, *std::move(tools));
  s.protocol = client->protocol();
  s.state = "ready";
  s.error.clear();
  return absl::OkStatus();
}

void McpHosts::Supervise(std::shared_ptr<Server> server) {
  Server& s = *server;
  bool ever_ready = false;
  std::string end_state;  // why the loop ended: "stopped" | "failed" | "gone"
  for (;;) {
    absl::Status st = StartOnce(s);
    std::string reason;
    bool by_esbd = false;
    {
      std::lock_guard<std::mutex> lock(s.mu);
      if (s.stop) break;
    }
    if (st.ok()) {
      manager_->audit().Record(
          s.caller, {.environment_id = s.environment_id,
                     .action = "mcp.server.start",
                     .detail = ever_ready ? absl::StrCat(s.spec.name, " (restart ", s.restarts, ")")
                                          : s.spec.name});
      ever_ready = true;
      {
        std::lock_guard<std::mutex> lock(s.mu);
        s.settled = true;
      }
      s.cv.notify_all();
      std::shared_ptr<StdioClient> client;
      {
        std::lock_guard<std::mutex> lock(s.mu);
        client = s.client;
      }
      // Up: watch it until it ends (or is stopped); re-read its tools when they change.
      for (;;) {
        if (client->WaitEnded(1000)) break;
        {
          std::lock_guard<std::mutex> lock(s.mu);
          if (s.stop) break;
        }
        if (client->tools_changed()) {
          auto tools = client->ListTools(MonotonicMs() + kRefreshTimeoutMs);
          if (tools.ok()) {
            std::lock_guard<std::mutex> lock(s.mu);
            KeepTools(s, *std::move(tools));
          }
        }
      }
      {
        std::lock_guard<std::mutex> lock(s.mu);
        if (s.stop) break;
      }
      {
        std::lock_guard<std::mutex> lock(s.mu);
        s.state = "restarting";
      }
      const ExitInfo exit = client->exit_info();
      reason = exit.reason;
      {
        std::lock_guard<std::mutex> lock(s.mu);
        if (s.process != nullptr) {
          const std::string ended_by = s.process->ended_by();
          if (!ended_by.empty()) {
            by_esbd = true;
            reason = ended_by;
          }
        }
        s.stderr_tail = client->stderr_tail();
      }
      manager_->audit().Record(
          s.caller, {.environment_id = s.environment_id,
                     .action = "mcp.server.exit",
                     .detail = absl::StrCat(s.spec.name, ": ", reason),
                     .exit_code = exit.exit_code,
                     .outcome = by_esbd ? absl::OkStatus() : absl::UnavailableError(reason)});
    } else {
      reason = std::string(st.message());
    }
    // The environment is gone (deleted, expired): the server ends with it.
    if (!CheckEnvironment(s.caller, s.environment_id).ok()) {
      end_state = "gone";
      break;
    }
    std::shared_ptr<StdioClient> old;
    {
      std::lock_guard<std::mutex> lock(s.mu);
      old = std::move(s.client);
      s.process = nullptr;
      if (old) s.stderr_tail = old->stderr_tail();
      KeepTools(s, {});
    }
    old.reset();  // joins its reader (the process has ended or been killed)
    if (by_esbd) {
      // A rewind ended it: start it again at once (the spawn waits for the rewind to finish).
      std::lock_guard<std::mutex> lock(s.mu);
      s.state = "restarting";
      s.error = reason;
      continue;
    }
    std::unique_lock<std::mutex> lock(s.mu);
    if (!ever_ready || s.restarts >= config_.max_restarts) {
      s.state = "failed";
      s.error = ever_ready ? absl::StrCat(reason, " (gave up after ", s.restarts, " restarts)")
                           : absl::StrCat("it did not start: ", reason);
      s.settled = true;
      lock.unlock();
      s.cv.notify_all();
      manager_->audit().Record(s.caller, {.environment_id = s.environment_id,
                                          .action = "mcp.server.failed",
                                          .detail = absl::StrCat(s.spec.name, ": ", s.error),
                                          .outcome = absl::UnavailableError(s.error)});
      end_state = "failed";
      break;
    }
    ++s.restarts;
    s.state = "restarting";
    s.error = reason;
    const int64_t backoff = std::min<int64_t>(kMaxBackoffMs, 1000ll << std::min(s.restarts - 1, 5));
    s.cv.wait_for(lock, std::chrono::milliseconds(backoff), [&] { return s.stop; });
    if (s.stop) break;
  }
  std::shared_ptr<StdioClient> last;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    last = std::move(s.client);
    s.process = nullptr;
    if (last) s.stderr_tail = last->stderr_tail();
    if (end_state != "failed") {
      s.state = "stopped";
      KeepTools(s, {});
      if (end_state == "gone") s.error = "the environment ended";
    }
    s.settled = true;
  }
  s.cv.notify_all();
  if (last) last->Kill("stopped");
  last.reset();
  if (end_state == "gone") Forget(s);
}

absl::StatusOr<std::vector<ServerInfo>> McpHosts::List(const Caller& caller,
                                                       const std::string& environment_id) {
  if (absl::Status st_ = CheckEnvironment(caller, environment_id); !st_.ok()) return st_;
  std::vector<std::shared_ptr<Server>> servers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto env = servers_.find(environment_id);
    if (env != servers_.end())
      for (auto& [name, s] : env->second)
        if (s->caller.tenant == caller.tenant) servers.push_back(s);
  }
  std::vector<ServerInfo> out;
  for (const auto& s : servers) {
    std::lock_guard<std::mutex> lock(s->mu);
    out.push_back(InfoOf(*s));
  }
  return out;
}

namespace {
// NotFound for a server name the environment does not have (the name is client text: bounded).
absl::Status NoSuchServer(const std::string& environment_id, const std::string& name) {
  return absl::NotFoundError(absl::StrCat("environment ", environment_id,
                                          " has no MCP server named '",
                                          SanitizeUtf8(name.substr(0, 64)), "'"));
}
}  // namespace

absl::StatusOr<ServerInfo> McpHosts::Get(const Caller& caller, const std::string& environment_id,
                                         const std::string& name) {
  if (absl::Status st_ = CheckEnvironment(caller, environment_id); !st_.ok()) return st_;
  auto s = Find(caller.tenant, environment_id, name);
  if (!s) return NoSuchServer(environment_id, name);
  std::lock_guard<std::mutex> lock(s->mu);
  return InfoOf(*s);
}

absl::Status McpHosts::Stop(const Caller& caller, const std::string& environment_id,
                            const std::string& name) {
  if (absl::Status st_ = CheckEnvironment(caller, environment_id); !st_.ok()) return st_;
  auto s = Find(caller.tenant, environment_id, name);
  if (!s) return NoSuchServer(environment_id, name);
  StopServer(*s, "stopped");
  Forget(*s);
  manager_->audit().Record(
      caller, {.environment_id = environment_id, .action = "mcp.server.stop", .detail = name});
  return absl::OkStatus();
}

absl::StatusOr<std::vector<HostedTool>> McpHosts::Tools(const Caller& caller,
                                                        const std::string& environment_id) {
  auto servers = List(caller, environment_id);
  if (!servers.ok()) return servers.status();
  std::vector<HostedTool> out;
  for (const ServerInfo& info : *servers) {
    auto s = Find(caller.tenant, environment_id, info.spec.name);
    if (!s) continue;
    std::lock_guard<std::mutex> lock(s->mu);
    if (s->state != "ready") continue;
    for (const json::object& t : s->tools) {
      const std::string tool = ToolNameOf(t);
      if (!FitsRegistry(s->spec.name, tool)) continue;  // reported by KeepTools
      out.push_back(HostedTool{s->spec.name, tool, t});
    }
  }
  return out;
}

absl::StatusOr<tools::ToolResult> McpHosts::CallTool(const Caller& caller,
                                                     const std::string& environment_id,
                                                     std::string_view namespaced_name,
                                                     const json::object& arguments,
                                                     const tools::CallContext& context) {
  if (absl::Status st_ = CheckEnvironment(caller, environment_id); !st_.ok()) return st_;
  const size_t dot = namespaced_name.find('.');
  if (dot == std::string_view::npos || dot == 0 || dot + 1 == namespaced_name.size())
    return absl::NotFoundError(absl::StrCat(
        "no tool '", SanitizeUtf8(namespaced_name.substr(0, 200)),
        "': hosted tools are named <server>.<tool> (GET /environments/{id}/tools lists them)"));
  const std::string server_name(namespaced_name.substr(0, dot));
  const std::string tool(namespaced_name.substr(dot + 1));
  auto s = Find(caller.tenant, environment_id, server_name);
  if (!s) return NoSuchServer(environment_id, server_name);
  return Dispatch(caller, s, tool, arguments, context);
}

absl::StatusOr<tools::ToolResult> McpHosts::Dispatch(const Caller& /*caller*/,
                                                     std::shared_ptr<Server> s,
                                                     const std::string& tool,
                                                     const json::object& arguments,
                                                     const tools::CallContext& context) {
  std::shared_ptr<StdioClient> client;
  {
    std::lock_guard<std::mutex> lock(s->mu);
    if (s->state != "ready" || !s->client)
      return absl::UnavailableError(
          absl::StrCat("MCP server '", s->spec.name, "' is ", s->state,
                       s->error.empty() ? "" : absl::StrCat(": ", s->error)));
    bool known = false;
    for (const json::object& t : s->tools)
      if (ToolNameOf(t) == tool) known = true;
    if (!known)
      return absl::NotFoundError(absl::StrCat("MCP server '", s->spec.name, "' has no tool '",
                                              SanitizeUtf8(tool.substr(0, 128)), "'"));
    client = s->client;
  }
  tools::ToolCallGate::StreamingDispatch dispatch =
      [&, client](const json::object& args,
                  const tools::CallContext& ctx) -> absl::StatusOr<tools::ToolResult> {
    int64_t deadline = MonotonicMs() + config_.call_timeout_s * 1000;
    if (ctx.deadline_ms > 0)
      deadline = std::min(deadline, MonotonicMs() + (ctx.deadline_ms - NowUnixMs()));
    auto r = client->CallTool(tool, args, ctx, deadline);
    if (!r.ok()) {
      if (absl::IsResourceExhausted(r.status()) || absl::IsCancelled(r.status())) return r.status();
      std::string text(r.status().message());
      if (absl::IsDeadlineExceeded(r.status()))
        absl::StrAppend(&text, " (call timeout ", config_.call_timeout_s,
                        " s: mcp.call_timeout_seconds)");
      return ErrorResult(std::move(text));
    }
    tools::ToolResult result;
    if (const json::value* c = r->if_contains("content"); c && c->is_array())
      result.content = c->as_array();
    if (const json::value* e = r->if_contains("isError"); e && e->is_bool())
      result.is_error = e->as_bool();
    if (const json::value* sc = r->if_contains("structuredContent"); sc && sc->is_object())
      result.structured = sc->as_object();
    return result;
  };
  // The one dispatch path of every hosted call: through the gate (DLP, the tool.call row).
  if (gate_ != nullptr)
    return gate_->Call(tools::GateCall{tool, s->spec.name, s->environment_id}, arguments, context,
                       dispatch);
  return dispatch(arguments, context);
}

// The environment's registry as a provider (namespaced names).
class McpHosts::EnvProvider : public tools::ToolProvider {
 public:
  EnvProvider(McpHosts* hosts, std::string environment_id)
      : hosts_(hosts), environment_id_(std::move(environment_id)) {}
  absl::StatusOr<std::vector<tools::ToolDefinition>> ListTools(const Caller& caller) override {
    auto tools = hosts_->Tools(caller, environment_id_);
    if (!tools.ok()) return tools.status();
    std::vector<tools::ToolDefinition> out;
    for (HostedTool& t : *tools) {
      json::object def = std::move(t.definition);
      def["name"] = absl::StrCat(t.server, ".", t.tool);
      out.push_back(std::move(def));
    }
    return out;
  }
  absl::StatusOr<tools::ToolResult> CallTool(std::string_view name, const json::object& arguments,
                                             const tools::CallContext& context) override {
    return hosts_->CallTool(context.caller, environment_id_, name, arguments, context);
  }

 private:
  McpHosts* hosts_;
  const std::string environment_id_;
};

// One server's own tools, unchanged.
class McpHosts::OneServerProvider : public tools::ToolProvider {
 public:
  OneServerProvider(McpHosts* hosts, std::string environment_id, std::string name)
      : hosts_(hosts), environment_id_(std::move(environment_id)), name_(std::move(name)) {}
  absl::StatusOr<std::vector<tools::ToolDefinition>> ListTools(const Caller& caller) override {
    if (absl::Status st_ = hosts_->CheckEnvironment(caller, environment_id_); !st_.ok()) return st_;
    auto s = hosts_->Find(caller.tenant, environment_id_, name_);
    if (!s) return absl::NotFoundError(absl::StrCat("no MCP server named '", name_, "'"));
    std::lock_guard<std::mutex> lock(s->mu);
    if (s->state != "ready")
      return absl::UnavailableError(absl::StrCat("MCP server '", name_, "' is ", s->state,
                                                 s->error.empty() ? "" : ": " + s->error));
    return s->tools;
  }
  absl::StatusOr<tools::ToolResult> CallTool(std::string_view name, const json::object& arguments,
                                             const tools::CallContext& context) override {
    if (absl::Status st_ = hosts_->CheckEnvironment(context.caller, environment_id_); !st_.ok())
      return st_;
    auto s = hosts_->Find(context.caller.tenant, environment_id_, name_);
    if (!s) return absl::NotFoundError(absl::StrCat("no MCP server named '", name_, "'"));
    return hosts_->Dispatch(context.caller, s, std::string(name), arguments, context);
  }

 private:
  McpHosts* hosts_;
  const std::string environment_id_, name_;
};

absl::StatusOr<std::shared_ptr<tools::ToolProvider>> McpHosts::EnvironmentProvider(
    const Caller& caller, const std::string& environment_id) {
  if (absl::Status st_ = CheckEnvironment(caller, environment_id); !st_.ok()) return st_;
  return std::shared_ptr<tools::ToolProvider>(new EnvProvider(this, environment_id));
}

absl::StatusOr<std::shared_ptr<tools::ToolProvider>> McpHosts::ServerProvider(
    const Caller& caller, const std::string& environment_id, const std::string& name) {
  if (absl::Status st_ = CheckEnvironment(caller, environment_id); !st_.ok()) return st_;
  if (!Find(caller.tenant, environment_id, name)) return NoSuchServer(environment_id, name);
  return std::shared_ptr<tools::ToolProvider>(new OneServerProvider(this, environment_id, name));
}

}  // namespace esb::mcp_hosts
