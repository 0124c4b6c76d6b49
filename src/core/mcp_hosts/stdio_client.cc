#include "core/mcp_hosts/stdio_client.h"

#include <algorithm>
#include <chrono>
#include <set>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/utf8.h"
#include "common/util.h"

namespace esb::mcp_hosts {

namespace json = boost::json;

namespace {

// How long one Wait on the process lasts before the reader loops (it re-checks its stop flag).
constexpr int kReaderWaitMs = 1000;
// Progress items queued for one call before older ones are dropped (the caller drains them).
constexpr size_t kMaxQueuedProgress = 64;
// A caller re-checks its cancellation this often while it waits.
constexpr int64_t kCancelPollMs = 100;

std::string Excerpt(std::string_view s, size_t max = 120) {
  std::string out = SanitizeUtf8(s.substr(0, max));
  if (s.size() > max) out += "...";
  return out;
}

int64_t RemainingMs(int64_t deadline_ms) { return deadline_ms - MonotonicMs(); }

}  // namespace

StdioClient::StdioClient(std::unique_ptr<ProcessSession> process, ClientLimits limits,
                         std::string label)
    : process_(std::move(process)), limits_(limits), label_(std::move(label)) {
  byte_tokens_ = static_cast<double>(
      std::max(2 * limits_.max_output_bytes_per_second, 2 * limits_.max_message_bytes));
  line_tokens_ = static_cast<double>(2 * limits_.max_lines_per_second);
  last_refill_ms_ = MonotonicMs();
  reader_ = std::thread([this] { ReaderLoop(); });
}

StdioClient::~StdioClient() {
  Kill("the client closed");
  if (reader_.joinable()) reader_.join();
}

void StdioClient::Kill(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (kill_reason_.empty()) kill_reason_ = reason;
    stop_reading_ = true;
  }
  process_->Kill().IgnoreError();
  cv_.notify_all();
}

void StdioClient::Fail(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (kill_reason_.empty()) kill_reason_ = reason;
    stop_reading_ = true;
  }
  // The process is killed by the reader once its wait returns (the sink answers false).
}

void StdioClient::ReaderLoop() {
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_reading_) break;
    }
    absl::StatusOr<std::optional<int>> st = process_->Wait(
        kReaderWaitMs, [this](Stream s, std::string_view chunk) { return OnOutput(s, chunk); });
    if (!st.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      exit_.reason = absl::StrCat("lost the process: ", st.status().message());
      break;
    }
    if (st->has_value()) {
      std::lock_guard<std::mutex> lock(mu_);
      exit_.exit_code = **st;
      const int code = **st;
      exit_.reason = code > 128 ? absl::StrCat("killed by signal ", code - 128)
                                : absl::StrCat("exited with code ", code);
      break;
    }
  }
  // The process is over, or must be: kill it (idempotent) so nothing outlives the reader.
  process_->Kill().IgnoreError();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!kill_reason_.empty()) {
      exit_.killed_by_client = true;
      exit_.reason = kill_reason_;
    }
    if (exit_.reason.empty()) exit_.reason = "ended";
    exit_.ended = true;
    stop_reading_ = true;
  }
  cv_.notify_all();
}

bool StdioClient::OnOutput(Stream stream, std::string_view chunk) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_reading_) return false;
  }
  // Flood: token buckets refilled at the configured rates, holding two seconds' worth (and at
  // least two max-size messages of bytes).
  const int64_t now = MonotonicMs();
  const double elapsed_s = static_cast<double>(now - last_refill_ms_) / 1000.0;
  last_refill_ms_ = now;
  const double byte_cap = static_cast<double>(
      std::max(2 * limits_.max_output_bytes_per_second, 2 * limits_.max_message_bytes));
  const double line_cap = static_cast<double>(2 * limits_.max_lines_per_second);
  byte_tokens_ =
      std::min(byte_cap,
               byte_tokens_ + elapsed_s * static_cast<double>(limits_.max_output_bytes_per_second));
  line_tokens_ = std::min(
      line_cap, line_tokens_ + elapsed_s * static_cast<double>(limits_.max_lines_per_second));
  byte_tokens_ -= static_cast<double>(chunk.size());
  if (byte_tokens_ < 0) {
    Fail(absl::StrCat("killed: it flooded its output (over ", limits_.max_output_bytes_per_second,
                      " bytes per second: mcp.max_output_bytes_per_second)"));
    return false;
  }
  if (chunk.empty()) return true;  // a liveness tick
  if (stream == Stream::kStderr) {
    std::lock_guard<std::mutex> lock(mu_);
    stderr_tail_.append(chunk);
    const size_t cap = static_cast<size_t>(limits_.stderr_tail_bytes);
    if (stderr_tail_.size() > cap) stderr_tail_.erase(0, stderr_tail_.size() - cap);
    return true;
  }
  size_t pos = 0;
  while (pos < chunk.size()) {
    const size_t nl = chunk.find('\n', pos);
    const std::string_view piece =
        chunk.substr(pos, nl == std::string_view::npos ? std::string_view::npos : nl - pos);
    if (line_.size() + piece.size() > static_cast<size_t>(limits_.max_message_bytes)) {
      Fail(absl::StrCat("killed: it wrote a message over ", limits_.max_message_bytes,
                        " bytes on stdout (mcp.max_message_bytes)"));
      return false;
    }
    line_.append(piece);
    if (nl == std::string_view::npos) break;
    pos = nl + 1;
    line_tokens_ -= 1;
    if (line_tokens_ < 0) {
      Fail(absl::StrCat("killed: it flooded stdout (over ", limits_.max_lines_per_second,
                        " lines per second: mcp.max_lines_per_second)"));
      return false;
    }
    std::string line = std::move(line_);
    line_.clear();
    OnLine(line);
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_reading_) return false;
  }
  return true;
}

void StdioClient::OnLine(std::string_view line) {
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  if (line.find_first_not_of(" \t") == std::string_view::npos) return;  // blank: ignored
  boost::system::error_code ec;
  json::parse_options opts;
  opts.max_depth = 64;
  json::value v = json::parse(line, ec, {}, opts);
  const bool rpc = !ec && v.is_object() && v.as_object().contains("jsonrpc");
  if (!rpc) {
    if (++garbage_lines_ > limits_.max_garbage_lines) {
      Fail(absl::StrCat("killed: it wrote ", garbage_lines_,
                        " lines on stdout that are not JSON-RPC messages (mcp.max_garbage_lines "
                        "is ",
                        limits_.max_garbage_lines, "), e.g. \"", Excerpt(line), "\""));
      return;
    }
    std::lock_guard<std::mutex> lock(mu_);
    stderr_tail_.append(absl::StrCat("[esbd: not JSON-RPC on stdout] ", Excerpt(line), "\n"));
    const size_t cap = static_cast<size_t>(limits_.stderr_tail_bytes);
    if (stderr_tail_.size() > cap) stderr_tail_.erase(0, stderr_tail_.size() - cap);
    return;
  }
  OnMessage(v.as_object());
}

void StdioClient::OnMessage(const json::object& m) {
  const json::value* method = m.if_contains("method");
  const json::value* id = m.if_contains("id");
  if (method != nullptr && method->is_string()) {
    const std::string name(method->as_string());
    if (id != nullptr && !id->is_null()) {
      // A request from the server: esbd serves ping only.
      json::object reply{{"jsonrpc", "2.0"}, {"id", *id}};
      if (name == "ping") {
        reply["result"] = json::object();
      } else {
        reply["error"] =
            json::object{{"code", -32601},
                         {"message", absl::StrCat("method not found: esbd does not serve ",
                                                  Excerpt(name, 64), " to hosted servers")}};
      }
      Send(reply).IgnoreError();
      return;
    }
    if (name == "notifications/progress") {
      const json::value* params = m.if_contains("params");
      if (params == nullptr || !params->is_object()) return;
      const json::object& p = params->as_object();
      const json::value* token = p.if_contains("progressToken");
      const json::value* progress = p.if_contains("progress");
      if (token == nullptr || progress == nullptr || !progress->is_number()) return;
      const std::string key =
          token->is_string() ? std::string(token->as_string()) : json::serialize(*token);
      tools::Progress item;
      item.progress = progress->to_number<double>();
      if (const json::value* t = p.if_contains("total"); t && t->is_number())
        item.total = t->to_number<double>();
      if (const json::value* msg = p.if_contains("message"); msg && msg->is_string())
        item.message = SanitizeUtf8(std::string_view(msg->as_string()).substr(0, 4096));
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& [rid, pending] : pending_) {
        if (pending->progress_token != key) continue;
        if (pending->progress.size() >= kMaxQueuedProgress) pending->progress.pop_front();
        pending->progress.push_back(std::move(item));
        cv_.notify_all();
        break;
      }
    } else if (name == "notifications/tools/list_changed") {
      std::lock_guard<std::mutex> lock(mu_);
      tools_changed_ = true;
    }
    return;  // other notifications (logs, resources) are not used
  }
  // A response: matched by id; one nobody waits for (late, or a wrong id) is dropped.
  if (id == nullptr || !id->is_int64()) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = pending_.find(id->as_int64());
  if (it == pending_.end()) return;
  if (const json::value* err = m.if_contains("error"); err != nullptr) {
    it->second->error = err->is_object()
                            ? err->as_object()
                            : json::object{{"code", -32603}, {"message", "malformed error"}};
  } else if (const json::value* res = m.if_contains("result"); res != nullptr) {
    it->second->result = *res;
  } else {
    it->second->error = json::object{{"code", -32603}, {"message", "response without a result"}};
  }
  cv_.notify_all();
}

absl::Status StdioClient::Send(const json::value& message) {
  std::string line = json::serialize(message);
  line.push_back('\n');
  std::lock_guard<std::mutex> lock(write_mu_);
  return process_->Input(line, false);
}

std::string StdioClient::EndedError() const {
  // Needs mu_. The client's own reason (a limit, a stop) says more than the signal it sent.
  const std::string& why =
      !kill_reason_.empty() ? kill_reason_ : (!exit_.reason.empty() ? exit_.reason : "ended");
  std::string out = absl::StrCat(label_, " ended: ", why);
  if (!stderr_tail_.empty()) {
    const size_t from = stderr_tail_.size() > 1024 ? stderr_tail_.size() - 1024 : 0;
    absl::StrAppend(&out, "; stderr: ", Excerpt(std::string_view(stderr_tail_).substr(from), 1024));
  }
  return out;
}

json::object StdioClient::WithMeta(json::object params) const {
  if (!modern_) return params;
  json::object meta;
  if (const json::value* m = params.if_contains("_meta"); m && m->is_object())
    meta = m->as_object();
  meta["io.modelcontextprotocol/protocolVersion"] = kModernProtocol;
  meta["io.modelcontextprotocol/clientCapabilities"] = json::object();
  params["_meta"] = std::move(meta);
  return params;
}

absl::StatusOr<json::value> StdioClient::Request(const std::string& method, json::object params,
                                                 int64_t deadline_ms,
                                                 const tools::CallContext* ctx) {
  Pending pending;
  int64_t id = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (exit_.ended || stop_reading_) return absl::UnavailableError(EndedError());
    id = next_id_++;
    if (ctx != nullptr && ctx->progress) {
      pending.progress_token = absl::StrCat("esbd-", id);
      json::object meta;
      if (const json::value* m = params.if_contains("_meta"); m && m->is_object())
        meta = m->as_object();
      meta["progressToken"] = pending.progress_token;
      params["_meta"] = std::move(meta);
    }
    pending_[id] = &pending;
  }
  struct Unregister {
    StdioClient* self;
    int64_t id;
    ~Unregister() {
      std::lock_guard<std::mutex> lock(self->mu_);
      self->pending_.erase(id);
    }
  } unregister{this, id};
  json::object message{{"jsonrpc", "2.0"}, {"id", id}, {"method", method}};
  message["params"] = WithMeta(std::move(params));
  if (absl::Status st = Send(message); !st.ok()) {
    // Most likely it just died: give the reader a moment to say how.
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, std::chrono::milliseconds(2000), [&] { return exit_.ended; });
    if (exit_.ended) return absl::UnavailableError(EndedError());
    return absl::UnavailableError(absl::StrCat("cannot write to ", label_, ": ", st.message()));
  }
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    while (!pending.progress.empty()) {
      tools::Progress p = std::move(pending.progress.front());
      pending.progress.pop_front();
      lock.unlock();
      ctx->progress(p);
      lock.lock();
    }
    if (pending.result) return *std::move(pending.result);
    if (pending.error) {
      const json::object& e = *pending.error;
      std::string msg = "error";
      if (const json::value* m = e.if_contains("message"); m && m->is_string())
        msg = Excerpt(m->as_string(), 2048);
      int64_t code = 0;
      if (const json::value* c = e.if_contains("code"); c && c->is_int64()) code = c->as_int64();
      absl::Status st = absl::FailedPreconditionError(
          absl::StrCat(label_, " answered ", method, " with error ", code, ": ", msg));
      st.SetPayload("type.entersandbox/jsonrpc_code", absl::Cord(absl::StrCat(code)));
      return st;
    }
    if (exit_.ended || stop_reading_) {
      // Wait briefly for the reader to record why (it kills and reaps the process).
      cv_.wait_for(lock, std::chrono::milliseconds(2000), [&] { return exit_.ended; });
      return absl::UnavailableError(absl::StrCat(EndedError(), " (during ", method, ")"));
    }
    const bool cancelled = ctx != nullptr && ctx->cancelled && [&] {
      lock.unlock();
      const bool c = ctx->cancelled();
      lock.lock();
      return c;
    }();
    const int64_t left = RemainingMs(deadline_ms);
    if (cancelled || left <= 0) {
      lock.unlock();
      // Tell the server to stop; its late answer, if any, is dropped.
      Send(json::object{{"jsonrpc", "2.0"},
                        {"method", "notifications/cancelled"},
                        {"params", json::object{{"requestId", id},
                                                {"reason", cancelled ? "cancelled by the client"
                                                                     : "timed out"}}}})
          .IgnoreError();
      if (cancelled)
        return absl::CancelledError(absl::StrCat(method, " on ", label_, " was cancelled"));
      return absl::DeadlineExceededError(
          absl::StrCat(label_, " did not answer ", method, " in time"));
    }
    cv_.wait_for(lock, std::chrono::milliseconds(std::min(left, kCancelPollMs)));
  }
}

absl::Status StdioClient::Initialize(int64_t deadline_ms) {
  // The modern era: server/discover. Anything but a modern answer (an error, silence until the
  // probe timeout, a result without 2026-07-28) falls back to the legacy handshake.
  {
    std::lock_guard<std::mutex> lock(mu_);
    modern_ = true;  // server/discover carries the modern _meta
  }
  const int64_t probe_deadline = std::min(deadline_ms, MonotonicMs() + limits_.probe_timeout_ms);
  json::object discover_params{
      {"_meta", json::object{{"io.modelcontextprotocol/clientInfo",
                              json::object{{"name", "esbd"}, {"version", ESB_VERSION}}}}}};
  absl::StatusOr<json::value> d =
      Request("server/discover", discover_params, probe_deadline, nullptr);
  bool modern = false;
  if (d.ok() && d->is_object()) {
    if (const json::value* v = d->as_object().if_contains("supportedVersions");
        v && v->is_array()) {
      for (const json::value& s : v->as_array())
        if (s.is_string() && s.as_string() == kModernProtocol) modern = true;
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (exit_.ended) return absl::UnavailableError(EndedError());
    modern_ = modern;
    if (modern) {
      protocol_ = kModernProtocol;
      return absl::OkStatus();
    }
  }
  json::object init{{"protocolVersion", kLegacyProtocol},
                    {"capabilities", json::object()},
                    {"clientInfo", json::object{{"name", "esbd"}, {"version", ESB_VERSION}}}};
  absl::StatusOr<json::value> r = Request("initialize", std::move(init), deadline_ms, nullptr);
  if (!r.ok()) return r.status();
  std::string version;
  if (r->is_object()) {
    if (const json::value* v = r->as_object().if_contains("protocolVersion"); v && v->is_string())
      version = Excerpt(v->as_string(), 32);
  }
  if (version.empty())
    return absl::FailedPreconditionError(
        absl::StrCat(label_, " answered initialize without a protocolVersion"));
  if (absl::Status st_ =
          Send(json::object{{"jsonrpc", "2.0"}, {"method", "notifications/initialized"}});
      !st_.ok())
    return st_;
  std::lock_guard<std::mutex> lock(mu_);
  protocol_ = version;
  return absl::OkStatus();
}

bool ValidToolName(std::string_view n) {
  if (n.empty() || n.size() > kMaxToolNameBytes) return false;
  for (char c : n)
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
          c == '.' || c == '-'))
      return false;
  return true;
}

absl::StatusOr<ToolList> StdioClient::ListTools(int64_t deadline_ms) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    tools_changed_ = false;
  }
  ToolList out;
  std::vector<json::object>& tools = out.tools;
  std::set<std::string, std::less<>> seen;
  auto skip = [&](std::string_view name, std::string_view why) {
    if (out.skipped.size() < kMaxSkippedReported)
      out.skipped.push_back(absl::StrCat(absl::CHexEscape(Excerpt(name, 64)), ": ", AbslView(why)));
    ++out.skipped_count;
  };
  size_t tools_bytes = 0;  // serialised, of the tools kept so far
  std::string cursor;
  for (int page = 0; page < limits_.max_list_pages; ++page) {
    json::object params;
    if (!cursor.empty()) params["cursor"] = cursor;
    absl::StatusOr<json::value> r = Request("tools/list", std::move(params), deadline_ms, nullptr);
    if (!r.ok()) return r.status();
    if (!r->is_object())
      return absl::FailedPreconditionError(
          absl::StrCat(label_, ": tools/list answered a non-object"));
    const json::value* list = r->as_object().if_contains("tools");
    if (list == nullptr || !list->is_array())
      return absl::FailedPreconditionError(
          absl::StrCat(label_, ": tools/list answered without a tools array"));
    for (const json::value& t : list->as_array()) {
      if (!t.is_object()) continue;
      const json::value* name = t.as_object().if_contains("name");
      if (name == nullptr || !name->is_string() || name->as_string().empty()) continue;
      if (static_cast<int>(tools.size()) >= limits_.max_tools) return out;  // cut
      const std::string_view tool_name = name->as_string();
      if (!ValidToolName(tool_name)) {
        skip(tool_name, "not a valid MCP tool name (1-128 of A-Z a-z 0-9 _ . -)");
        continue;
      }
      if (!seen.insert(std::string(tool_name)).second) {
        skip(tool_name, "listed twice (the first one is kept)");
        continue;
      }
      // SECURITY: pages of max_message_bytes each would otherwise let a hostile server pin
      // max_list_pages times that in esbd's memory, per server.
      tools_bytes += json::serialize(t).size();
      if (tools_bytes > static_cast<size_t>(limits_.max_message_bytes))
        return absl::FailedPreconditionError(absl::StrCat(label_, ": its tools/list is over ",
                                                          limits_.max_message_bytes,
                                                          " bytes in all (mcp.max_message_bytes)"));
      tools.push_back(t.as_object());
    }
    const json::value* next = r->as_object().if_contains("nextCursor");
    if (next == nullptr || !next->is_string() || next->as_string().empty()) return out;
    if (next->as_string() == cursor) return out;  // a server looping on one page
    cursor = std::string(next->as_string().subview().substr(0, 4096));
  }
  return out;
}

absl::StatusOr<json::object> StdioClient::CallTool(const std::string& name,
                                                   const json::object& arguments,
                                                   const tools::CallContext& ctx,
                                                   int64_t deadline_ms) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (in_flight_ >= limits_.max_concurrent_calls)
      return absl::ResourceExhaustedError(
          absl::StrCat(label_, " already has ", in_flight_,
                       " calls in progress (mcp.max_concurrent_calls_per_server); try again"));
    ++in_flight_;
  }
  struct Release {
    StdioClient* self;
    ~Release() {
      std::lock_guard<std::mutex> lock(self->mu_);
      --self->in_flight_;
    }
  } release{this};
  absl::StatusOr<json::value> r = Request(
      "tools/call", json::object{{"name", name}, {"arguments", arguments}}, deadline_ms, &ctx);
  if (!r.ok()) return r.status();
  if (!r->is_object())
    return absl::FailedPreconditionError(
        absl::StrCat(label_, ": tools/call answered a non-object"));
  return r->as_object();
}

bool StdioClient::WaitEnded(int64_t timeout_ms) {
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_for(lock, std::chrono::milliseconds(std::max<int64_t>(0, timeout_ms)),
                      [&] { return exit_.ended; });
}

ExitInfo StdioClient::exit_info() const {
  std::lock_guard<std::mutex> lock(mu_);
  return exit_;
}

std::string StdioClient::stderr_tail() const {
  std::lock_guard<std::mutex> lock(mu_);
  return SanitizeUtf8(stderr_tail_);
}

std::string StdioClient::protocol() const {
  std::lock_guard<std::mutex> lock(mu_);
  return protocol_;
}

bool StdioClient::tools_changed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return tools_changed_;
}

int StdioClient::calls_in_flight() const {
  std::lock_guard<std::mutex> lock(mu_);
  return in_flight_;
}

}  // namespace esb::mcp_hosts
