#include "api/mcp/mcp_endpoint.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <algorithm>
#include <atomic>
#include <boost/json/basic_parser_impl.hpp>
#include <condition_variable>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <utility>
#include <variant>

#include "absl/strings/cord.h"
#include "api/host_check.h"
#include "api/json_util.h"
#include "api/mcp/mcp_call.h"
#include "common/util.h"

namespace esb::api::mcp {
namespace json = boost::json;

// ---------------------------------------------------------------------------------------------
// mcp_call.h

namespace {
thread_local McpCallExtras* current_call = nullptr;
constexpr std::string_view kCapabilityPayload = "esb.mcp/required-capabilities";
}  // namespace

McpCallExtras* CurrentCall() { return current_call; }

bool RequireInput(json::object requests, std::string state) {
  if (!current_call || !current_call->input_requests_allowed) return false;
  current_call->input_requests = std::move(requests);
  current_call->next_request_state = std::move(state);
  return true;
}

ScopedCall::ScopedCall(McpCallExtras* extras) : previous_(current_call) { current_call = extras; }
ScopedCall::~ScopedCall() { current_call = previous_; }

absl::Status MissingClientCapability(const json::object& required) {
  std::string names;
  for (const auto& [k, v] : required) names += (names.empty() ? "" : ", ") + std::string(k);
  absl::Status st = absl::FailedPreconditionError(
      Cat("this call needs client capabilities the client did not declare: ", names));
  st.SetPayload(AbslView(kCapabilityPayload), absl::Cord(AbslView(json::serialize(required))));
  return st;
}

std::optional<json::object> RequiredCapabilitiesOf(const absl::Status& status) {
  auto p = status.GetPayload(AbslView(kCapabilityPayload));
  if (!p) return std::nullopt;
  json::error_code ec;
  json::value v = json::parse(std::string(*p), ec);
  if (ec || !v.is_object()) return std::nullopt;
  return v.as_object();
}

namespace {

// JSON-RPC error codes.
constexpr int kParseError = -32700;
constexpr int kInvalidRequest = -32600;
constexpr int kMethodNotFound = -32601;
constexpr int kInvalidParams = -32602;
constexpr int kInternalError = -32603;
constexpr int kHeaderMismatch = -32020;      // 2026-07-28
constexpr int kMissingCapability = -32021;   // 2026-07-28
constexpr int kUnsupportedVersion = -32022;  // 2026-07-28
constexpr int kSessionNotFound = -32001;     // esbd's: unknown or expired session

constexpr std::string_view kMetaVersion = "io.modelcontextprotocol/protocolVersion";
constexpr std::string_view kMetaCapabilities = "io.modelcontextprotocol/clientCapabilities";
constexpr std::string_view kMetaLogLevel = "io.modelcontextprotocol/logLevel";
constexpr std::string_view kMetaServerInfo = "io.modelcontextprotocol/serverInfo";

// Legacy revisions served (initialize echoes one of these; others get the newest).
constexpr std::string_view kLegacyVersions[] = {"2025-11-25", "2025-06-18", "2025-03-26",
                                                "2024-11-05"};
constexpr size_t kMaxIdBytes = 256;
constexpr size_t kMaxSessionIdBytes = 128;
constexpr size_t kMaxCursorBytes = 64;

bool IsLegacyVersion(std::string_view v) {
  for (std::string_view k : kLegacyVersions) {
    if (v == k) return true;
  }
  return false;
}

// RFC 5424 levels as MCP names them, lowest first.
int LogLevelRank(std::string_view level) {
  static constexpr std::string_view kLevels[] = {"debug", "info",     "notice", "warning",
                                                 "error", "critical", "alert",  "emergency"};
  for (int i = 0; i < 8; ++i) {
    if (level == kLevels[i]) return i;
  }
  return -1;
}

// An answer the endpoint could not give as a result: a JSON-RPC error with an HTTP status.
struct RpcError {
  int http = 200;
  int code = kInternalError;
  std::string message;
  json::value data;  // null: none
};

json::object ErrorMessage(const json::value& id, const RpcError& e) {
  json::object err{{"code", e.code}, {"message", e.message}};
  if (!e.data.is_null()) err["data"] = e.data;
  return json::object{{"jsonrpc", "2.0"}, {"id", id}, {"error", std::move(err)}};
}

Response JsonRpcResponse(int status, const json::object& message) {
  Response r = JsonResponse(status, message);
  return r;
}

Response ErrorAnswer(const json::value& id, const RpcError& e) {
  return JsonRpcResponse(e.http, ErrorMessage(id, e));
}

Response Accepted() {
  Response r;
  r.status = 202;
  r.content_type = "";
  return r;
}

// An absl::Status from a provider or the admission as an HTTP status and JSON-RPC error.
RpcError FromStatus(const absl::Status& st) {
  RpcError e;
  e.http = HttpStatusFor(st);
  if (e.http >= 500) e.http = st.code() == absl::StatusCode::kUnavailable ? 503 : 500;
  e.code = kInternalError;
  e.message = std::string(StdView(st.message()));
  return e;
}

// The header's value with optional whitespace around it removed (RFC 9110 §5.5).
std::optional<std::string> TrimmedHeader(const Request& req, std::string_view name) {
  std::optional<std::string> v = req.Header(name);
  if (!v) return std::nullopt;
  return std::string(TrimAscii(*v));
}

// A JSON-RPC id: a string (bounded) or an integer. Fractions, null, objects are refused.
bool ValidId(const json::value& id) {
  if (id.is_string()) return id.as_string().size() <= kMaxIdBytes;
  return id.is_int64() || id.is_uint64();
}

// Decodes one Mcp-Param-* value: "=?base64?<b64>?=" is base64 (strictly: padding and
// alphabet), anything else is literal.
absl::StatusOr<std::string> DecodeParamHeader(std::string_view v) {
  if (v.size() >= 12 && v.starts_with("=?base64?") && v.ends_with("?=")) {
    std::string_view b64 = v.substr(9, v.size() - 11);
    if (b64.size() % 4 != 0) return absl::InvalidArgumentError("base64 value without its padding");
    return Base64Decode(b64);
  }
  return std::string(v);
}

// How a body value of an x-mcp-header parameter appears in its header.
std::optional<std::string> HeaderForm(const json::value& v) {
  if (v.is_string()) return std::string(v.as_string());
  if (v.is_bool()) return v.as_bool() ? "true" : "false";
  if (v.is_int64()) return std::to_string(v.as_int64());
  if (v.is_uint64()) return std::to_string(v.as_uint64());
  if (v.is_double()) return json::serialize(v);
  return std::nullopt;
}

// Whole numbers as JSON integers (Boost.JSON writes the double 100 as 1E2).
json::value Number(double d) {
  if (d >= -9e15 && d <= 9e15 && d == static_cast<double>(static_cast<int64_t>(d)))
    return json::value(static_cast<int64_t>(d));
  return json::value(d);
}

// Finds a key named twice in one object, anywhere in a JSON text (Boost.JSON keeps the last
// one silently; a gateway in front of esbd may read the first, so the two would disagree on
// "method" or a tool's arguments).
class DuplicateKeyFinder {
 public:
  static constexpr std::size_t max_object_size = std::size_t(-1);
  static constexpr std::size_t max_array_size = std::size_t(-1);
  static constexpr std::size_t max_key_size = std::size_t(-1);
  static constexpr std::size_t max_string_size = std::size_t(-1);
  std::vector<std::set<std::string>> objects;
  std::string key, duplicate;
  bool found = false;

  bool on_document_begin(json::error_code&) { return true; }
  bool on_document_end(json::error_code&) { return true; }
  bool on_object_begin(json::error_code&) {
    objects.emplace_back();
    return true;
  }
  bool on_object_end(std::size_t, json::error_code&) {
    objects.pop_back();
    return true;
  }
  bool on_array_begin(json::error_code&) { return true; }
  bool on_array_end(std::size_t, json::error_code&) { return true; }
  bool on_key_part(json::string_view s, std::size_t, json::error_code&) {
    key.append(s.data(), s.size());
    return true;
  }
  bool on_key(json::string_view s, std::size_t, json::error_code&) {
    key.append(s.data(), s.size());
    if (!found && !objects.empty() && !objects.back().insert(key).second) {
      found = true;
      duplicate = key;
    }
    key.clear();
    return true;
  }
  bool on_string_part(json::string_view, std::size_t, json::error_code&) { return true; }
  bool on_string(json::string_view, std::size_t, json::error_code&) { return true; }
  bool on_number_part(json::string_view, json::error_code&) { return true; }
  bool on_int64(std::int64_t, json::string_view, json::error_code&) { return true; }
  bool on_uint64(std::uint64_t, json::string_view, json::error_code&) { return true; }
  bool on_double(double, json::string_view, json::error_code&) { return true; }
  bool on_bool(bool, json::error_code&) { return true; }
  bool on_null(json::error_code&) { return true; }
  bool on_comment_part(json::string_view, json::error_code&) { return true; }
  bool on_comment(json::string_view, json::error_code&) { return true; }
};

// The first key named twice in one object of `text` (already parsed once, so valid JSON).
std::optional<std::string> DuplicateKey(std::string_view text, const json::parse_options& o) {
  json::basic_parser<DuplicateKeyFinder> p(o);
  json::error_code ec;
  p.write_some(false, text.data(), text.size(), ec);
  if (p.handler().found) return p.handler().duplicate;
  return std::nullopt;
}

// requestState as the client sees it: "<base64 state>.<issued ms>.<hex HMAC-SHA256 over the
// tenant, the request path, the tool, the issue time and the state>", so a client cannot forge,
// alter, move (to another hosted server's path or tool) or replay it after its lifetime.
std::string Mac(const std::string& key, std::string_view tenant, std::string_view path,
                std::string_view tool, int64_t issued_ms, std::string_view state) {
  std::string msg = Cat(tenant, "\n", path, "\n", tool, "\n", issued_ms, "\n", state);
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
       reinterpret_cast<const unsigned char*>(msg.data()), msg.size(), out, &len);
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex;
  for (unsigned int i = 0; i < len; ++i) {
    hex.push_back(kHex[out[i] >> 4]);
    hex.push_back(kHex[out[i] & 0xf]);
  }
  return hex;
}

struct Session {
  std::string id, tenant, path, protocol_version;
  json::object client_capabilities;
  int64_t created_ms = 0;
  int64_t last_used_ms = 0;
  int min_log_rank = 0;  // logging/setLevel; default: everything
  bool closed = false;
  int get_streams = 0;
  int busy = 0;  // requests in progress (a busy session does not expire)
  // Calls in progress: JSON-serialised request id → its cancellation flag.
  std::map<std::string, std::shared_ptr<std::atomic<bool>>> inflight;
};

// A parsed POST body: one JSON-RPC message.
struct Message {
  json::object obj;
  json::value id;  // null for notifications and responses
  bool has_id = false;
  std::string method;
  bool is_request() const { return has_id && !method.empty(); }
  bool is_notification() const { return !has_id && !method.empty(); }
  const json::object* params() const {
    const json::value* p = obj.if_contains("params");
    return p && p->is_object() ? &p->as_object() : nullptr;
  }
  const json::object* meta() const {
    const json::object* p = params();
    if (!p) return nullptr;
    const json::value* m = p->if_contains("_meta");
    return m && m->is_object() ? &m->as_object() : nullptr;
  }
};

class Endpoint final : public McpEndpoint, public std::enable_shared_from_this<Endpoint> {
 public:
  Endpoint(McpAdmission admission, ProviderFor provider_for, McpEndpointOptions options)
      : admission_(std::move(admission)),
        provider_for_(std::move(provider_for)),
        opts_(std::move(options)),
        state_key_(RandomHex(32)) {}

  int session_count() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int>(sessions_.size());
  }

  void Shutdown() override {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    for (auto& [id, s] : sessions_) {
      s->closed = true;
      for (auto& [rid, flag] : s->inflight) flag->store(true);
    }
    sessions_.clear();
    cv_.notify_all();
  }

  // The before_body hook: Origin, then the server's admission (API key / dev mode).
  std::optional<Response> Admit(Request& req) {
    if (std::optional<Response> bad = CheckOrigin(req)) return bad;
    if (admission_.admit) return admission_.admit(req);
    return std::nullopt;
  }

  Response Handle(Request& req) override {
    if (std::optional<Response> bad = CheckOrigin(req)) return *bad;
    if (req.principal().empty() && admission_.admit) {
      if (std::optional<Response> refused = admission_.admit(req)) return *refused;
    }
    if (req.method() == "POST") return Post(req);
    if (req.method() == "GET") return Get(req);
    if (req.method() == "DELETE") return Delete(req);
    Response r = ErrorAnswer(json::value(), {405, kInvalidRequest, "method not allowed", {}});
    r.SetHeader("Allow", "GET, POST, DELETE");
    return r;
  }

 private:
  // SECURITY: a browser page from elsewhere (cross-site, or DNS rebinding to loopback) must not
  // reach the tools, whatever the authentication mode: its Origin must be this machine or one
  // the operator allowed, and on a loopback listener every Host must name this machine (or an
  // allowed origin's host): a rebinding page's requests carry its own name in Host, with or
  // without an Origin. Requests without Origin are not made by browsers; unix-socket ones
  // neither.
  std::optional<Response> CheckOrigin(const Request& req) {
    for (const auto& [name, value] : req.headers()) {
      std::string_view v = TrimAscii(value);
      if (EqualsIgnoreCase(name, "host") && opts_.loopback_listener && !req.peer().is_unix) {
        bool ok = IsLoopbackHostPort(v);
        for (const std::string& a : opts_.allowed_origins)
          ok = ok || (!OriginHostPort(a).empty() && EqualsIgnoreCase(v, OriginHostPort(a)));
        if (!ok) {
          return ErrorAnswer(json::value(),
                             {403,
                              kInvalidRequest,
                              Cat("Host '", v.substr(0, 200),
                                  "' is not allowed: this daemon listens on loopback, address it "
                                  "as localhost, 127.0.0.1 or [::1] (DNS rebinding protection; "
                                  "other names: the hosts of mcp.allowed_origins)"),
                              {}});
        }
        continue;
      }
      if (!EqualsIgnoreCase(name, "origin")) continue;
      bool ok = IsLoopbackOrigin(v);
      for (const std::string& a : opts_.allowed_origins) ok = ok || EqualsIgnoreCase(v, a);
      if (!ok) {
        return ErrorAnswer(json::value(),
                           {403,
                            kInvalidRequest,
                            Cat("Origin '", v.substr(0, 200),
                                "' is not allowed (cross-site / DNS rebinding protection; "
                                "allow it with the daemon config mcp.allowed_origins)"),
                            {}});
      }
    }
    return std::nullopt;
  }

  Caller CallerFor(const Request& req) {
    Caller c = admission_.caller_of ? admission_.caller_of(req) : Caller(req.principal());
    c.channel = "mcp";
    return c;
  }

  // ------------------------------------------------------------------------------------------
  // Parsing

  // Parses the body into one message; an error answer otherwise.
  std::variant<Message, Response> Parse(const Request& req) {
    if (req.body().size() > opts_.max_message_bytes) {
      return ErrorAnswer(json::value(),
                         {413,
                          kInvalidRequest,
                          Cat("message larger than ", opts_.max_message_bytes, " bytes"),
                          {}});
    }
    std::string ct = req.ContentType();
    if (ct != "application/json") {
      return ErrorAnswer(json::value(),
                         {415,
                          kInvalidRequest,
                          Cat("POST bodies must be one JSON-RPC message with Content-Type: "
                              "application/json (got '",
                              ct.substr(0, 100), "')"),
                          {}});
    }
    json::parse_options popts;
    popts.max_depth = static_cast<size_t>(std::max(1, opts_.max_json_depth));
    json::parser p(json::storage_ptr(), popts);
    json::error_code ec;
    p.write(req.body().data(), req.body().size(), ec);
    if (ec) {
      return ErrorAnswer(json::value(), {400, kParseError, Cat("parse error: ", ec.message()), {}});
    }
    if (auto dup = DuplicateKey(req.body(), popts)) {
      return ErrorAnswer(json::value(),
                         {400,
                          kInvalidRequest,
                          Cat("duplicate key '", dup->substr(0, 64),
                              "' in one object: every key may appear once (readers would "
                              "disagree on which one counts)"),
                          {}});
    }
    json::value v = p.release();
    if (v.is_array()) {
      return ErrorAnswer(json::value(), {400,
                                         kInvalidRequest,
                                         "JSON-RPC batches are not supported: send one message "
                                         "per request",
                                         {}});
    }
    if (!v.is_object()) {
      return ErrorAnswer(json::value(),
                         {400, kInvalidRequest, "a JSON-RPC message must be an object", {}});
    }
    Message m;
    m.obj = std::move(v.as_object());
    const json::value* id = m.obj.if_contains("id");
    if (id) {
      if (!ValidId(*id)) {
        return ErrorAnswer(json::value(), {400,
                                           kInvalidRequest,
                                           Cat("'id' must be a string (at most ", kMaxIdBytes,
                                               " bytes) or an integer"),
                                           {}});
      }
      m.id = *id;
      m.has_id = true;
    }
    const json::value* jv = m.obj.if_contains("jsonrpc");
    if (!jv || !jv->is_string() || jv->as_string() != "2.0") {
      return ErrorAnswer(m.id, {400, kInvalidRequest, "'jsonrpc' must be \"2.0\"", {}});
    }
    const json::value* method = m.obj.if_contains("method");
    if (method) {
      if (!method->is_string() || method->as_string().empty() || method->as_string().size() > 256) {
        return ErrorAnswer(m.id, {400, kInvalidRequest, "'method' must be a short string", {}});
      }
      m.method = std::string(method->as_string());
      const json::value* params = m.obj.if_contains("params");
      if (params && !params->is_object()) {
        return ErrorAnswer(m.id, {400, kInvalidParams, "'params' must be an object", {}});
      }
      if (const json::object* p = m.params()) {
        const json::value* meta = p->if_contains("_meta");
        if (meta && !meta->is_object())
          return ErrorAnswer(m.id, {400, kInvalidParams, "'_meta' must be an object", {}});
      }
    } else if (!m.obj.contains("result") && !m.obj.contains("error")) {
      return ErrorAnswer(m.id, {400,
                                kInvalidRequest,
                                "a JSON-RPC message needs 'method' (request, notification) or "
                                "'result'/'error' (response)",
                                {}});
    }
    return m;
  }

  // ------------------------------------------------------------------------------------------
  // POST

  Response Post(Request& req) {
    auto parsed = Parse(req);
    if (auto* r = std::get_if<Response>(&parsed)) return std::move(*r);
    Message& m = std::get<Message>(parsed);

    const json::object* meta = m.meta();
    const bool modern_meta = meta && meta->contains(kMetaVersion);
    std::optional<std::string> header_version = TrimmedHeader(req, "MCP-Protocol-Version");
    std::optional<std::string> session_id = TrimmedHeader(req, "Mcp-Session-Id");
    const bool modern =
        modern_meta || (header_version && *header_version == kModernVersion) ||
        (!session_id && m.method != "initialize" &&
         (!header_version || !IsLegacyVersion(*header_version)) && !m.method.empty());
    Caller caller = CallerFor(req);
    auto provider = provider_for_(req, caller);
    if (!provider.ok()) return ErrorAnswer(m.id, FromStatus(provider.status()));
    if (modern) return Modern(req, m, caller, *provider, header_version);
    return Legacy(req, m, caller, *provider, header_version, session_id);
  }

  // --- 2025-11-25 and before: sessions -----------------------------------------------------

  Response Legacy(Request& req, Message& m, const Caller& caller,
                  const std::shared_ptr<tools::ToolProvider>& provider,
                  const std::optional<std::string>& header_version,
                  const std::optional<std::string>& session_id) {
    if (m.method == "initialize") {
      if (!m.has_id)
        return ErrorAnswer(json::value(), {400, kInvalidRequest, "initialize is a request", {}});
      return Initialize(req, m, caller);
    }
    if (header_version && !IsLegacyVersion(*header_version)) {
      return ErrorAnswer(m.id,
                         {400,
                          kInvalidRequest,
                          Cat("unsupported MCP-Protocol-Version '", header_version->substr(0, 64),
                              "' (supported: ", SupportedList(), ")"),
                          {}});
    }
    if (!session_id) {
      return ErrorAnswer(m.id, {400,
                                kInvalidRequest,
                                "missing Mcp-Session-Id: send initialize first (or use the "
                                "2026-07-28 protocol with _meta on every request)",
                                {}});
    }
    std::shared_ptr<Session> s = FindSession(*session_id, caller, req);
    if (!s) return SessionNotFound(m.id);
    struct Busy {
      Endpoint* e;
      std::shared_ptr<Session> s;
      ~Busy() { e->Release(*s); }
    } busy{this, s};

    if (!m.is_request()) {
      if (m.method == "notifications/cancelled") {
        const json::object* p = m.params();
        const json::value* rid = p ? p->if_contains("requestId") : nullptr;
        if (rid && ValidId(*rid)) {
          std::lock_guard<std::mutex> lock(mu_);
          auto it = s->inflight.find(json::serialize(*rid));
          if (it != s->inflight.end()) it->second->store(true);
        }
      }
      // notifications/initialized, responses to requests we never send, and others: accepted.
      return Accepted();
    }
    if (m.method == "ping") return Result(m.id, json::object(), false);
    if (m.method == "logging/setLevel") {
      const json::object* p = m.params();
      const json::value* level = p ? p->if_contains("level") : nullptr;
      int rank = level && level->is_string() ? LogLevelRank(level->as_string()) : -1;
      if (rank < 0)
        return ErrorAnswer(m.id, {200,
                                  kInvalidParams,
                                  "'level' must be an RFC 5424 level name "
                                  "(debug, info, notice, warning, error, critical, alert, "
                                  "emergency)",
                                  {}});
      std::lock_guard<std::mutex> lock(mu_);
      s->min_log_rank = rank;
      return Result(m.id, json::object(), false);
    }
    if (m.method == "tools/list") return ToolsList(m, caller, *provider, false);
    if (m.method == "tools/call") {
      json::object caps;
      int min_rank;
      {
        std::lock_guard<std::mutex> lock(mu_);
        caps = s->client_capabilities;
        min_rank = s->min_log_rank;
      }
      return ToolsCall(req, m, caller, provider, false, s, std::move(caps), min_rank);
    }
    return ErrorAnswer(m.id, {200,
                              kMethodNotFound,
                              Cat("method '", m.method.substr(0, 64), "' is not supported by esbd"),
                              {}});
  }

  std::string SupportedList() const {
    std::string out = std::string(kModernVersion);
    for (std::string_view v : kLegacyVersions) out += Cat(", ", v);
    return out;
  }

  Response SessionNotFound(const json::value& id) {
    return ErrorAnswer(id, {404,
                            kSessionNotFound,
                            "session not found (unknown, ended or expired): initialize again",
                            {}});
  }

  Response Initialize(Request& req, Message& m, const Caller& caller) {
    const json::object* p = m.params();
    const json::value* pv = p ? p->if_contains("protocolVersion") : nullptr;
    if (!pv || !pv->is_string()) {
      return ErrorAnswer(m.id, {400, kInvalidParams, "initialize needs 'protocolVersion'", {}});
    }
    std::string version = IsLegacyVersion(pv->as_string()) ? std::string(pv->as_string())
                                                           : std::string(kLegacyVersion);
    json::object caps;
    if (const json::value* c = p->if_contains("capabilities"); c && c->is_object())
      caps = c->as_object();
    auto s = std::make_shared<Session>();
    s->id = RandomHex(32);
    s->tenant = caller.tenant;
    s->path = req.path();
    s->protocol_version = version;
    s->client_capabilities = std::move(caps);
    s->created_ms = s->last_used_ms = MonotonicMs();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return ErrorAnswer(m.id, {503, kInternalError, "esbd is shutting down", {}});
      ExpireLocked();
      int tenant_sessions = 0;
      for (const auto& [id, other] : sessions_) tenant_sessions += other->tenant == s->tenant;
      if (tenant_sessions >= opts_.max_sessions_per_tenant) {
        return ErrorAnswer(
            m.id, {429,
                   kInternalError,
                   Cat("too many MCP sessions for this tenant (", opts_.max_sessions_per_tenant,
                       "): end unused ones with DELETE"),
                   {}});
      }
      if (static_cast<int>(sessions_.size()) >= opts_.max_sessions) {
        return ErrorAnswer(
            m.id,
            {503, kInternalError, Cat("too many MCP sessions (", opts_.max_sessions, ")"), {}});
      }
      sessions_[s->id] = s;
    }
    json::object result{
        {"protocolVersion", version},
        {"capabilities", json::object{{"tools", json::object{{"listChanged", false}}},
                                      {"logging", json::object()}}},
        {"serverInfo", ServerInfo()}};
    if (!opts_.instructions.empty()) result["instructions"] = opts_.instructions;
    Response r = Result(m.id, std::move(result), false);
    r.SetHeader("Mcp-Session-Id", s->id);
    return r;
  }

  json::object ServerInfo() const {
    return json::object{{"name", opts_.server_name}, {"version", opts_.server_version}};
  }

  // Expired sessions are dropped (the caller holds mu_).
  void ExpireLocked() {
    const int64_t now = MonotonicMs();
    for (auto it = sessions_.begin(); it != sessions_.end();) {
      Session& s = *it->second;
      if (s.busy == 0 && s.get_streams == 0 && s.inflight.empty() &&
          now - s.last_used_ms > opts_.session_idle_timeout_ms) {
        s.closed = true;
        it = sessions_.erase(it);
      } else {
        ++it;
      }
    }
  }

  // The session `id` if it exists, is this tenant's and this route's (another tenant's, or one
  // opened on another path, is "not found" like an unknown one). Marks it busy.
  std::shared_ptr<Session> FindSession(const std::string& id, const Caller& caller,
                                       const Request& req) {
    if (id.empty() || id.size() > kMaxSessionIdBytes) return nullptr;
    std::lock_guard<std::mutex> lock(mu_);
    ExpireLocked();
    auto it = sessions_.find(id);
    if (it == sessions_.end()) return nullptr;
    std::shared_ptr<Session> s = it->second;
    // SECURITY: a session is its tenant's alone: another tenant's key holding a leaked id gets
    // the same answer as for an unknown one.
    if (s->tenant != caller.tenant || s->path != req.path() || s->closed) return nullptr;
    s->last_used_ms = MonotonicMs();
    ++s->busy;
    return s;
  }

  void Release(Session& s) {
    std::lock_guard<std::mutex> lock(mu_);
    --s.busy;
    s.last_used_ms = MonotonicMs();
  }

  // --- 2026-07-28: stateless ---------------------------------------------------------------

  Response Modern(Request& req, Message& m, const Caller& caller,
                  const std::shared_ptr<tools::ToolProvider>& provider,
                  const std::optional<std::string>& header_version) {
    if (!m.is_request()) return Accepted();  // notifications and responses: nothing to do
    const json::object* meta = m.meta();
    const json::value* mv = meta ? meta->if_contains(kMetaVersion) : nullptr;
    const json::value* mc = meta ? meta->if_contains(kMetaCapabilities) : nullptr;
    if (!mv || !mv->is_string() || !mc || !mc->is_object()) {
      return ErrorAnswer(m.id,
                         {400,
                          kInvalidParams,
                          Cat("every 2026-07-28 request needs params._meta with '", kMetaVersion,
                              "' (a string) and '", kMetaCapabilities,
                              "' (an object); a 2025-11-25 client sends initialize first, then "
                              "Mcp-Session-Id on every request"),
                          {}});
    }
    std::string version(mv->as_string());
    if (!header_version || *header_version != version) {
      return ErrorAnswer(m.id, {400,
                                kHeaderMismatch,
                                Cat("the MCP-Protocol-Version header (",
                                    header_version ? header_version->substr(0, 64) : "missing",
                                    ") must equal _meta's protocol version"),
                                {}});
    }
    if (version != kModernVersion) {
      return ErrorAnswer(m.id,
                         {400, kUnsupportedVersion,
                          Cat("unsupported protocol version '", version.substr(0, 64), "'"),
                          json::object{{"supported", json::array{json::value(kModernVersion)}},
                                       {"requested", version}}});
    }
    std::optional<std::string> header_method = TrimmedHeader(req, "Mcp-Method");
    if (!header_method || *header_method != m.method) {
      return ErrorAnswer(m.id, {400,
                                kHeaderMismatch,
                                Cat("the Mcp-Method header (",
                                    header_method ? header_method->substr(0, 64) : "missing",
                                    ") must equal the body's method"),
                                {}});
    }
    if (m.method == "tools/call") {
      const json::object* p = m.params();
      const json::value* name = p ? p->if_contains("name") : nullptr;
      if (name && name->is_string()) {
        std::optional<std::string> header_name = TrimmedHeader(req, "Mcp-Name");
        if (!header_name || *header_name != name->as_string()) {
          return ErrorAnswer(m.id, {400,
                                    kHeaderMismatch,
                                    Cat("the Mcp-Name header (",
                                        header_name ? header_name->substr(0, 128) : "missing",
                                        ") must equal params.name"),
                                    {}});
        }
      }
    }
    if (m.method == "server/discover") {
      json::object result{{"supportedVersions", json::array{json::value(kModernVersion)}},
                          {"capabilities", json::object{{"tools", json::object()}}},
                          {"serverInfo", ServerInfo()},
                          {"_meta", json::object{{kMetaServerInfo, ServerInfo()}}}};
      if (!opts_.instructions.empty()) result["instructions"] = opts_.instructions;
      return Result(m.id, std::move(result), true);
    }
    if (m.method == "tools/list") return ToolsList(m, caller, *provider, true);
    if (m.method == "tools/call") {
      int min_rank = 1000;  // no log messages unless the request asks for a level
      if (const json::value* lv = meta->if_contains(kMetaLogLevel); lv && lv->is_string()) {
        int rank = LogLevelRank(lv->as_string());
        if (rank >= 0) min_rank = rank;
      }
      if (absl::Status st = CheckParamHeaders(req, m, caller, *provider); !st.ok()) {
        return ErrorAnswer(m.id, {400, kHeaderMismatch, std::string(StdView(st.message())), {}});
      }
      return ToolsCall(req, m, caller, provider, true, nullptr, mc->as_object(), min_rank);
    }
    return ErrorAnswer(m.id, {404,
                              kMethodNotFound,
                              Cat("method '", m.method.substr(0, 64),
                                  "' is not supported by esbd in protocol ", kModernVersion),
                              {}});
  }

  // SEP-2243: a tool's parameters marked x-mcp-header travel in Mcp-Param-<Name> headers too;
  // each must be present when its value is, and equal it (base64 when wrapped).
  absl::Status CheckParamHeaders(const Request& req, const Message& m, const Caller& caller,
                                 tools::ToolProvider& provider) {
    const json::object* p = m.params();
    const json::value* name = p ? p->if_contains("name") : nullptr;
    if (!name || !name->is_string()) return absl::OkStatus();
    const json::object empty;
    const json::object* args = &empty;
    if (const json::value* a = p->if_contains("arguments"); a && a->is_object())
      args = &a->as_object();
    auto tools = provider.ListTools(caller);
    if (!tools.ok()) return absl::OkStatus();  // the call reports it
    for (const tools::ToolDefinition& t : *tools) {
      const json::value* tn = t.if_contains("name");
      if (!tn || !tn->is_string() || tn->as_string() != name->as_string()) continue;
      const json::value* schema = t.if_contains("inputSchema");
      const json::value* props =
          schema && schema->is_object() ? schema->as_object().if_contains("properties") : nullptr;
      if (!props || !props->is_object()) return absl::OkStatus();
      for (const auto& [pname, pschema] : props->as_object()) {
        const json::value* hdr =
            pschema.is_object() ? pschema.as_object().if_contains("x-mcp-header") : nullptr;
        if (!hdr || !hdr->is_string()) continue;
        std::string header = Cat("Mcp-Param-", std::string_view(hdr->as_string()));
        const json::value* value = args->if_contains(pname);
        std::optional<std::string> sent = TrimmedHeader(req, header);
        if (!value || value->is_null()) continue;
        std::optional<std::string> want = HeaderForm(*value);
        if (!want) continue;
        if (!sent) return absl::InvalidArgumentError(Cat("missing header ", header));
        auto got = DecodeParamHeader(*sent);
        if (!got.ok()) {
          return absl::InvalidArgumentError(
              Cat("header ", header, ": invalid base64 (", StdView(got.status().message()), ")"));
        }
        if (*got != *want)
          return absl::InvalidArgumentError(Cat("header ", header, " does not match arguments"));
      }
      return absl::OkStatus();
    }
    return absl::OkStatus();
  }

  // --- Shared methods ----------------------------------------------------------------------

  Response Result(const json::value& id, json::object result, bool modern) {
    if (modern) result["resultType"] = "complete";
    return JsonRpcResponse(
        200, json::object{{"jsonrpc", "2.0"}, {"id", id}, {"result", std::move(result)}});
  }

  Response ToolsList(const Message& m, const Caller& caller, tools::ToolProvider& provider,
                     bool modern) {
    size_t offset = 0;
    if (const json::object* p = m.params()) {
      if (const json::value* c = p->if_contains("cursor"); c && !c->is_null()) {
        bool ok = c->is_string() && c->as_string().size() <= kMaxCursorBytes &&
                  c->as_string().starts_with("o") && c->as_string().size() > 1;
        if (ok) {
          std::string_view digits = std::string_view(c->as_string()).substr(1);
          for (char ch : digits) ok = ok && ch >= '0' && ch <= '9';
          ok = ok && digits.size() <= 9;
          if (ok) offset = static_cast<size_t>(std::stoul(std::string(digits)));
        }
        if (!ok) return ErrorAnswer(m.id, {200, kInvalidParams, "invalid cursor", {}});
      }
    }
    auto tools = provider.ListTools(caller);
    if (!tools.ok()) return ErrorAnswer(m.id, FromStatus(tools.status()));
    if (offset > tools->size())
      return ErrorAnswer(m.id, {200, kInvalidParams, "invalid cursor (past the end)", {}});
    const size_t page = static_cast<size_t>(std::max(1, opts_.page_size));
    json::array list;
    size_t end = std::min(tools->size(), offset + page);
    for (size_t i = offset; i < end; ++i) list.push_back((*tools)[i]);
    json::object result{{"tools", std::move(list)}};
    if (end < tools->size()) result["nextCursor"] = Cat("o", end);
    if (modern) {
      result["ttlMs"] = opts_.list_ttl_ms;
      result["cacheScope"] = "private";  // per tenant
    }
    return Result(m.id, std::move(result), modern);
  }

  Response ToolsCall(Request& req, const Message& m, const Caller& caller,
                     std::shared_ptr<tools::ToolProvider> provider, bool modern,
                     std::shared_ptr<Session> session, json::object client_caps, int min_rank) {
    const json::object* p = m.params();
    const json::value* name = p ? p->if_contains("name") : nullptr;
    if (!name || !name->is_string() || name->as_string().empty()) {
      return ErrorAnswer(
          m.id, {modern ? 400 : 200, kInvalidParams, "tools/call needs 'name' (a string)", {}});
    }
    json::object args;
    if (const json::value* a = p->if_contains("arguments"); a && !a->is_null()) {
      if (!a->is_object()) {
        return ErrorAnswer(
            m.id, {modern ? 400 : 200, kInvalidParams, "'arguments' must be an object", {}});
      }
      args = a->as_object();
    }
    // SEP-2322 (2026-07-28): the answers to a previous round's input requests, and its state.
    std::optional<json::object> input_responses;
    std::string request_state;
    if (modern) {
      if (const json::value* ir = p->if_contains("inputResponses"); ir && !ir->is_null()) {
        if (!ir->is_object()) {
          return ErrorAnswer(m.id, {400,
                                    kInvalidParams,
                                    "'inputResponses' must be an object "
                                    "of the client's answers by input request key",
                                    {}});
        }
        for (const auto& [k, v] : ir->as_object()) {
          if (!v.is_object()) {
            return ErrorAnswer(m.id, {400,
                                      kInvalidParams,
                                      Cat("inputResponses['", std::string_view(k).substr(0, 64),
                                          "'] must be an object (the answer's result)"),
                                      {}});
          }
        }
        input_responses = ir->as_object();
      }
      if (const json::value* rs = p->if_contains("requestState"); rs && !rs->is_null()) {
        auto state = VerifyState(*rs, caller.tenant, req.path(), name->as_string());
        if (!state) {
          return ErrorAnswer(m.id, {400,
                                    kInvalidParams,
                                    "requestState failed its integrity check (it must be "
                                    "returned exactly as the server sent it, to the same "
                                    "tool and path, within its lifetime)",
                                    {}});
        }
        request_state = std::move(*state);
      }
    }
    std::optional<json::value> progress_token;
    if (const json::object* meta = m.meta()) {
      if (const json::value* t = meta->if_contains("progressToken")) {
        if (!ValidId(*t)) {
          return ErrorAnswer(m.id, {modern ? 400 : 200,
                                    kInvalidParams,
                                    "'progressToken' must be a string or an integer",
                                    {}});
        }
        progress_token = *t;
      }
    }
    auto cancelled = std::make_shared<std::atomic<bool>>(false);
    std::string key = json::serialize(m.id);
    if (session) {
      std::lock_guard<std::mutex> lock(mu_);
      if (session->inflight.size() >= 256 || session->inflight.count(key)) {
        return ErrorAnswer(
            m.id, {409,
                   kInvalidRequest,
                   session->inflight.count(key) ? "a call with this id is already in progress"
                                                : "too many calls in progress in this session",
                   {}});
      }
      session->inflight[key] = cancelled;
    }
    struct Unregister {
      Endpoint* e;
      std::shared_ptr<Session> s;
      std::string key;
      void Release() {
        if (!s) return;
        std::lock_guard<std::mutex> lock(e->mu_);
        s->inflight.erase(key);
        s = nullptr;
      }
      ~Unregister() { Release(); }
    } unregister{this, session, key};

    auto self = shared_from_this();
    std::string tool(name->as_string());
    json::value id = m.id;
    // Runs the call; `emit` sends a notification on the response stream (false: none).
    auto run = [self, provider, caller, tool, args, id, modern, progress_token, cancelled,
                client_caps, min_rank, input_responses, request_state, path = req.path()](
                   const std::function<bool(const json::object&)>& emit,
                   const std::function<bool()>& gone) -> std::optional<json::object> {
      tools::CallContext ctx{.caller = caller};
      ctx.cancelled = [cancelled, gone, modern] {
        // On modern HTTP the client closing the stream is the cancel; on legacy only
        // notifications/cancelled is (a disconnect is not a cancel, but nobody is listening).
        return cancelled->load() || (gone && gone());
      };
      std::mutex progress_mu;
      double last_progress = -1;
      if (progress_token && emit) {
        ctx.progress = [&, token = *progress_token](const tools::Progress& pr) {
          std::lock_guard<std::mutex> lock(progress_mu);
          if (pr.progress <= last_progress) return;  // progress only increases
          last_progress = pr.progress;
          json::object params{{"progressToken", token}, {"progress", Number(pr.progress)}};
          if (pr.total) params["total"] = Number(*pr.total);
          if (!pr.message.empty()) params["message"] = pr.message;
          emit(json::object{{"jsonrpc", "2.0"},
                            {"method", "notifications/progress"},
                            {"params", std::move(params)}});
        };
      }
      McpCallExtras extras;
      extras.client_capabilities = &client_caps;
      extras.input_requests_allowed = modern;
      extras.input_responses = input_responses ? &*input_responses : nullptr;
      extras.request_state = request_state;
      if (emit && min_rank < 1000) {
        extras.log = [&emit, min_rank](std::string_view level, std::string_view logger,
                                       const json::value& data) {
          int rank = LogLevelRank(level);
          if (rank < 0 || rank < min_rank) return;
          json::object params{{"level", level}, {"data", data}};
          if (!logger.empty()) params["logger"] = logger;
          emit(json::object{{"jsonrpc", "2.0"},
                            {"method", "notifications/message"},
                            {"params", std::move(params)}});
        };
      }
      absl::StatusOr<tools::ToolResult> r;
      {
        ScopedCall scope(&extras);
        try {
          r = provider->CallTool(tool, args, ctx);
        } catch (const std::exception& e) {
          r = absl::InternalError(Cat("tool '", tool, "' failed: ", e.what()));
        }
      }
      if (cancelled->load()) return std::nullopt;  // cancelled: no response
      if (!r.ok()) {
        RpcError e;
        if (auto required = RequiredCapabilitiesOf(r.status())) {
          e = {400, kMissingCapability, std::string(StdView(r.status().message())),
               json::object{{"requiredCapabilities", *required}}};
        } else if (absl::IsNotFound(r.status())) {
          e = {200, kInvalidParams, std::string(StdView(r.status().message())), {}};
          if (e.message.empty()) e.message = Cat("unknown tool '", tool, "'");
        } else if (absl::IsInvalidArgument(r.status())) {
          e = {200, kInvalidParams, std::string(StdView(r.status().message())), {}};
        } else {
          e = FromStatus(r.status());
          e.http = 200;
        }
        json::object msg = ErrorMessage(id, e);
        msg["_http"] = e.http;  // taken out by the caller
        return msg;
      }
      if (extras.input_requests) {  // only ever set on modern requests (RequireInput)
        json::object result{{"resultType", "input_required"},
                            {"inputRequests", std::move(*extras.input_requests)}};
        if (!extras.next_request_state.empty())
          result["requestState"] =
              self->SignState(extras.next_request_state, caller.tenant, path, tool);
        return json::object{{"jsonrpc", "2.0"}, {"id", id}, {"result", std::move(result)}};
      }
      json::object result{{"content", r->content}, {"isError", r->is_error}};
      if (r->structured) result["structuredContent"] = *r->structured;
      if (modern) result["resultType"] = "complete";
      return json::object{{"jsonrpc", "2.0"}, {"id", id}, {"result", std::move(result)}};
    };

    const bool stream = req.Accepts("text/event-stream") && (progress_token || min_rank < 1000);
    if (!stream) {
      std::optional<json::object> msg =
          run(nullptr, modern ? std::function<bool()>([&req] { return req.ClientGone(); })
                              : std::function<bool()>());
      if (!msg) return Accepted();  // cancelled: the request gets no JSON-RPC response
      int http = 200;
      if (const json::value* h = msg->if_contains("_http")) {
        http = static_cast<int>(h->as_int64());
        msg->erase("_http");
      }
      return JsonRpcResponse(http, *msg);
    }
    // SSE: notifications while the call runs, then its response. The session's in-flight entry
    // lives as long as the call: the stream function releases it before it writes the response
    // (a client may reuse the id as soon as it has the response, before this stream's function
    // object is destroyed).
    auto owner = std::make_shared<Unregister>(std::move(unregister));
    unregister.s = nullptr;
    const int64_t keepalive_ms = std::max<int64_t>(10, opts_.keepalive_ms);
    return Response::Sse([run, owner, modern, keepalive_ms](ResponseWriter& w) {
      std::mutex write_mu;
      int64_t last_write = MonotonicMs();
      auto emit = [&w, &write_mu, &last_write](const json::object& msg) {
        std::lock_guard<std::mutex> lock(write_mu);
        last_write = MonotonicMs();
        return w.WriteEvent("message", msg);
      };
      // A silent long call (a command without output) still shows the client and any proxy
      // that the stream is alive.
      std::mutex done_mu;
      std::condition_variable done_cv;
      bool done = false;
      std::thread keepalive([&] {
        std::unique_lock<std::mutex> lock(done_mu);
        while (!done_cv.wait_for(lock, std::chrono::milliseconds(keepalive_ms),
                                 [&] { return done; })) {
          std::lock_guard<std::mutex> wl(write_mu);
          if (MonotonicMs() - last_write >= keepalive_ms) {
            last_write = MonotonicMs();
            if (!w.WriteComment("keep-alive")) break;
          }
        }
      });
      struct Join {
        std::mutex& mu;
        std::condition_variable& cv;
        bool& done;
        std::thread& t;
        ~Join() {
          {
            std::lock_guard<std::mutex> lock(mu);
            done = true;
          }
          cv.notify_all();
          t.join();
        }
      } join{done_mu, done_cv, done, keepalive};
      std::optional<json::object> msg =
          run(emit, modern ? std::function<bool()>([&w] { return w.ClientGone(); })
                           : std::function<bool()>());
      owner->Release();
      if (!msg) return;
      msg->erase("_http");
      emit(*msg);
    });
  }

  std::string SignState(std::string_view state, std::string_view tenant, std::string_view path,
                        std::string_view tool) const {
    std::string b64 = Base64Encode(state);
    const int64_t issued = MonotonicMs();
    return Cat(b64, ".", issued, ".", Mac(state_key_, tenant, path, tool, issued, b64));
  }

  // The state a tool attached to its previous round, if `v` is exactly what SignState made for
  // this tenant, path and tool, no longer than request_state_ttl_ms ago.
  std::optional<std::string> VerifyState(const json::value& v, std::string_view tenant,
                                         std::string_view path, std::string_view tool) const {
    if (!v.is_string() || v.as_string().size() > 64 * 1024) return std::nullopt;
    std::string_view s = v.as_string();
    size_t dot = s.rfind('.');
    if (dot == std::string_view::npos || dot == 0) return std::nullopt;
    size_t dot2 = s.rfind('.', dot - 1);
    if (dot2 == std::string_view::npos) return std::nullopt;
    std::string_view b64 = s.substr(0, dot2), issued_text = s.substr(dot2 + 1, dot - dot2 - 1),
                     mac = s.substr(dot + 1);
    if (issued_text.empty() || issued_text.size() > 18) return std::nullopt;
    int64_t issued = 0;
    for (char c : issued_text) {
      if (c < '0' || c > '9') return std::nullopt;
      issued = issued * 10 + (c - '0');
    }
    std::string want = Mac(state_key_, tenant, path, tool, issued, b64);
    if (mac.size() != want.size() || CRYPTO_memcmp(mac.data(), want.data(), want.size()) != 0)
      return std::nullopt;
    const int64_t age = MonotonicMs() - issued;
    if (age < 0 || age > opts_.request_state_ttl_ms) return std::nullopt;
    auto state = Base64Decode(b64);
    if (!state.ok()) return std::nullopt;
    return *state;
  }

  // ------------------------------------------------------------------------------------------
  // GET and DELETE

  std::optional<std::shared_ptr<Session>> SessionForStream(Request& req, Response* error) {
    std::optional<std::string> sid = TrimmedHeader(req, "Mcp-Session-Id");
    std::optional<std::string> hv = TrimmedHeader(req, "MCP-Protocol-Version");
    if (!sid || (hv && *hv == kModernVersion)) {
      // 2026-07-28 has no sessions and no GET stream; a sessionless legacy client neither.
      *error = ErrorAnswer(json::value(), {405,
                                           kInvalidRequest,
                                           Cat(req.method(),
                                               " needs a 2025-11-25 session (Mcp-Session-Id); "
                                               "2026-07-28 is stateless: POST only"),
                                           {}});
      error->SetHeader("Allow", "POST");
      return std::nullopt;
    }
    if (hv && !IsLegacyVersion(*hv)) {
      *error = ErrorAnswer(json::value(),
                           {400,
                            kInvalidRequest,
                            Cat("unsupported MCP-Protocol-Version '", hv->substr(0, 64), "'"),
                            {}});
      return std::nullopt;
    }
    Caller caller = CallerFor(req);
    auto provider = provider_for_(req, caller);
    if (!provider.ok()) {
      *error = ErrorAnswer(json::value(), FromStatus(provider.status()));
      return std::nullopt;
    }
    std::shared_ptr<Session> s = FindSession(*sid, caller, req);
    if (!s) {
      *error = SessionNotFound(json::value());
      return std::nullopt;
    }
    return s;
  }

  Response Get(Request& req) {
    Response error;
    auto s = SessionForStream(req, &error);
    if (!s) return error;
    std::shared_ptr<Session> session = *s;
    if (!req.Accepts("text/event-stream")) {
      Release(*session);
      return ErrorAnswer(json::value(),
                         {406, kInvalidRequest, "GET needs Accept: text/event-stream", {}});
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (session->get_streams >= 1) {
        --session->busy;
        return ErrorAnswer(json::value(),
                           {409, kInvalidRequest, "this session already has a GET stream", {}});
      }
      ++session->get_streams;
      --session->busy;
    }
    auto self = shared_from_this();
    return Response::Sse([self, session](ResponseWriter& w) {
      // A priming event (an id and empty data) so the client knows the stream is up. esbd sends
      // no server-initiated messages (tools do not change, no sampling): the stream carries
      // keep-alives until the session ends, esbd stops or the client leaves.
      w.Write("id: 0\ndata: \n\n");
      int64_t last_write = MonotonicMs();
      std::unique_lock<std::mutex> lock(self->mu_);
      while (!session->closed && !self->stopping_) {
        self->cv_.wait_for(lock, std::chrono::milliseconds(std::min<int64_t>(
                                     1000, std::max<int64_t>(10, self->opts_.keepalive_ms))));
        if (session->closed || self->stopping_) break;
        lock.unlock();
        bool ok = !w.ClientGone();
        if (ok && MonotonicMs() - last_write >= self->opts_.keepalive_ms) {
          ok = w.WriteComment("keep-alive");
          last_write = MonotonicMs();
        }
        lock.lock();
        if (!ok) break;
        session->last_used_ms = MonotonicMs();  // an open stream keeps its session alive
      }
      --session->get_streams;
      session->last_used_ms = MonotonicMs();
    });
  }

  Response Delete(Request& req) {
    Response error;
    auto s = SessionForStream(req, &error);
    if (!s) return error;
    std::lock_guard<std::mutex> lock(mu_);
    (*s)->closed = true;
    for (auto& [rid, flag] : (*s)->inflight) flag->store(true);
    sessions_.erase((*s)->id);
    --(*s)->busy;
    cv_.notify_all();
    Response r;
    r.status = 204;
    r.content_type = "";
    return r;
  }

  McpAdmission admission_;
  ProviderFor provider_for_;
  McpEndpointOptions opts_;
  const std::string state_key_;  // signs requestState (per process: a restart voids them)
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::map<std::string, std::shared_ptr<Session>> sessions_;
};

class Merged final : public tools::ToolProvider {
 public:
  Merged(std::shared_ptr<tools::ToolProvider> a, std::shared_ptr<tools::ToolProvider> b)
      : a_(std::move(a)), b_(std::move(b)) {}
  absl::StatusOr<std::vector<tools::ToolDefinition>> ListTools(const Caller& caller) override {
    auto first = a_->ListTools(caller);
    if (!first.ok()) return first.status();
    auto second = b_->ListTools(caller);
    if (!second.ok()) return second.status();
    std::set<std::string> seen;
    for (const auto& t : *first) {
      if (const json::value* n = t.if_contains("name"); n && n->is_string())
        seen.insert(std::string(n->as_string()));
    }
    for (auto& t : *second) {
      const json::value* n = t.if_contains("name");
      if (n && n->is_string() && !seen.count(std::string(n->as_string())))
        first->push_back(std::move(t));
    }
    return first;
  }
  absl::StatusOr<tools::ToolResult> CallTool(std::string_view name, const json::object& arguments,
                                             const tools::CallContext& context) override {
    auto first = a_->ListTools(context.caller);
    if (first.ok()) {
      for (const auto& t : *first) {
        const json::value* n = t.if_contains("name");
        if (n && n->is_string() && n->as_string() == name)
          return a_->CallTool(name, arguments, context);
      }
    }
    return b_->CallTool(name, arguments, context);
  }

 private:
  std::shared_ptr<tools::ToolProvider> a_, b_;
};

}  // namespace

std::shared_ptr<McpEndpoint> NewMcpEndpoint(McpAdmission admission, ProviderFor provider_for,
                                            McpEndpointOptions options) {
  return std::make_shared<Endpoint>(std::move(admission), std::move(provider_for),
                                    std::move(options));
}

std::shared_ptr<McpEndpoint> RegisterMcpEndpoint(Router& router, std::string_view pattern,
                                                 McpAdmission admission, ProviderFor provider_for,
                                                 McpEndpointOptions options) {
  auto endpoint =
      std::make_shared<Endpoint>(std::move(admission), std::move(provider_for), std::move(options));
  for (const char* method : {"POST", "GET", "DELETE"}) {
    RouteOptions ro;
    ro.accepts_body = std::string_view(method) == "POST";
    ro.before_body = [endpoint](Request& req) { return endpoint->Admit(req); };
    router.Add(
        method, pattern, [endpoint](Request& req) { return endpoint->Handle(req); }, std::move(ro));
  }
  return endpoint;
}

std::shared_ptr<tools::ToolProvider> MergeProviders(std::shared_ptr<tools::ToolProvider> first,
                                                    std::shared_ptr<tools::ToolProvider> second) {
  return std::make_shared<Merged>(std::move(first), std::move(second));
}

}  // namespace esb::api::mcp
