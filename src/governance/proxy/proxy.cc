#include "governance/proxy/proxy.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <boost/asio/as_tuple.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/experimental/awaitable_operators.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/util.h"
#include "governance/audit_redact.h"
#include "governance/dlp/dlp.h"
#include "governance/policy.h"
#include "governance/proxy/host_scan.h"
#include "governance/proxy/quota.h"
#include "governance/proxy/request.h"
#include "governance/tls/ca.h"
#include "governance/tls/context.h"
#include "governance/tls/mitm.h"
#include "storage/sqlite_store.h"

namespace esb::governance::proxy {

namespace beast = boost::beast;
using tcp = asio::ip::tcp;
using asio::awaitable;
using Strand = asio::strand<asio::io_context::executor_type>;
using namespace asio::experimental::awaitable_operators;
constexpr auto kTuple = asio::as_tuple(asio::use_awaitable);
using control::AuditEvent;

namespace {

template <class S>
std::string_view SV(const S& s) {
  return std::string_view(s.data(), s.size());
}

// What one environment is configured with at one moment (replaced whole by Update).
struct EnvConfig {
  std::string env_id;
  std::string tenant;
  EgressPolicy policy;
  std::vector<ActiveIntent> intents;
  std::shared_ptr<const dlp::Engine> dlp;  // nullptr: DLP off
};

absl::StatusOr<std::shared_ptr<const EnvConfig>> MakeConfig(std::string env_id, std::string tenant,
                                                            EgressPolicy policy,
                                                            std::vector<ActiveIntent> intents) {
  auto c = std::make_shared<EnvConfig>();
  c->env_id = std::move(env_id);
  c->tenant = std::move(tenant);
  absl::StatusOr<dlp::DlpConfig> dc = dlp::ParseDlpConfig(boost::json::value(policy.dlp));
  if (!dc.ok()) return dc.status();
  if (dc->enabled) {
    absl::StatusOr<std::shared_ptr<const dlp::Engine>> engine = dlp::Engine::Compile(*dc);
    if (!engine.ok()) return engine.status();
    c->dlp = *std::move(engine);
  }
  c->policy = std::move(policy);
  c->intents = std::move(intents);
  return std::shared_ptr<const EnvConfig>(std::move(c));
}

std::vector<std::string> ActiveIntentNames(const EnvConfig& c, int64_t now) {
  std::vector<std::string> out;
  for (const ActiveIntent& i : c.intents) {
    if (i.ActiveAt(now)) out.push_back(i.name);
  }
  return out;
}

// Replaces every finding's span of `text` with "[REDACTED:<rule>]" (for audit copies: no
// matched text is ever recorded, whatever the rule's action).
std::string MaskFindings(std::string_view text, const std::vector<dlp::Finding>& findings) {
  std::string out;
  size_t pos = 0;
  for (const dlp::Finding& f : findings) {
    if (f.offset < pos || f.offset + f.length > text.size()) continue;
    out.append(text.substr(pos, f.offset - pos));
    absl::StrAppend(&out, "[REDACTED:", f.rule_id, "]");
    pos = f.offset + f.length;
  }
  out.append(text.substr(pos));
  return out;
}

void AddFindings(AuditEvent& e, const dlp::Result& r) {
  for (const dlp::Finding& f : r.findings) {
    std::string where(dlp::WhereName(f.where));
    std::string action(dlp::ActionName(f.action));
    bool merged = false;
    for (control::AuditFinding& a : e.findings) {
      if (a.rule_id == f.rule_id && a.where == where && a.action == action) {
        ++a.count;
        merged = true;
        break;
      }
    }
    if (!merged) e.findings.push_back({f.rule_id, action, where, 1});
    if (std::find(e.rule_ids.begin(), e.rule_ids.end(), f.rule_id) == e.rule_ids.end()) {
      e.rule_ids.push_back(f.rule_id);
    }
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------

struct Conn;

struct Env {
  std::string id;
  mutable std::mutex mu;
  std::shared_ptr<const EnvConfig> config;           // guarded by mu
  std::shared_ptr<tls::InterceptContext> intercept;  // nullptr: no CA → tunnels opaque
  std::set<std::shared_ptr<Conn>> conns;             // guarded by mu
  std::unique_ptr<tcp::acceptor> acceptor;           // used on `accept_strand`
  std::optional<Strand> accept_strand;
  std::atomic<bool> closed{false};

  std::shared_ptr<const EnvConfig> Config() const {
    std::lock_guard<std::mutex> lock(mu);
    return config;
  }
};

// One client connection. Its coroutine and every socket it opens run on `strand`.
struct Conn {
  explicit Conn(Strand s) : strand(std::move(s)) {}
  Strand strand;
  std::shared_ptr<Env> env;
  // The sockets to close on Detach (raw pointers into the coroutine frame; strand only).
  tcp::socket* client = nullptr;
  tcp::socket* upstream = nullptr;
  bool closed = false;  // strand only
  Quota::Reservation tenant_slot;  // its place under max_connections_per_tenant

  void CloseOnStrand() {
    closed = true;
    boost::system::error_code ec;
    if (client != nullptr) client->close(ec);
    if (upstream != nullptr) upstream->close(ec);
  }
};

struct Proxy::Impl : std::enable_shared_from_this<Proxy::Impl> {
  explicit Impl(ProxyOptions o)
      : opts(std::move(o)),
        body_budget(opts.body_budget_bytes, opts.body_budget_per_tenant_bytes),
        tenant_connections(static_cast<int64_t>(opts.max_connections_total),
                           static_cast<int64_t>(opts.max_connections_per_tenant)),
        env_resolutions(INT64_MAX, static_cast<int64_t>(opts.max_resolutions_per_env)),
        tenant_resolutions(INT64_MAX, static_cast<int64_t>(opts.max_resolutions_per_tenant)) {}

  ProxyOptions opts;
  std::shared_ptr<Resolver> resolver;
  AuditSink audit;
  // Fair shares (declared before ioc: reservations held by connection frames are given back
  // when ioc destroys them).
  Quota body_budget;         // bytes of buffered request bodies, per tenant
  Quota tenant_connections;  // client connections, per tenant
  Quota env_resolutions;     // names being resolved, per environment
  Quota tenant_resolutions;  // names being resolved, per tenant
  asio::io_context ioc;
  // DLP body scans (declared after ioc: stopped and joined first, its jobs reference frames).
  std::optional<FairPool> dlp_pool;
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work;
  std::vector<std::thread> threads;
  std::shared_ptr<tls::UpstreamContext> upstream_tls;
  std::unique_ptr<HostAddresses> host_addresses;

  // Mode open: the addresses the exact names of deny rules resolve to (docs/design.md "Deny
  // rules cover addresses"), per name, for kDenyNameTtl; at most kMaxDenyCache names.
  struct DeniedName {
    std::vector<asio::ip::address> addresses;
    int64_t expires_mono = 0;
  };
  std::mutex deny_mu;
  std::map<std::string, DeniedName, std::less<>> deny_cache;  // guarded by deny_mu

  std::mutex mu;
  std::map<std::string, std::shared_ptr<Env>, std::less<>> envs;  // guarded by mu

  std::atomic<int64_t> connections{0};
  std::atomic<int64_t> requests_total{0};
  std::atomic<int64_t> blocked_total{0};
  // Refusals for fairness limits (Health, /healthz).
  std::atomic<int64_t> refused_connections{0};  // a connection cap (env, tenant, total)
  std::atomic<int64_t> refused_body_budget{0};
  std::atomic<int64_t> refused_dlp_busy{0};
  std::atomic<int64_t> refused_resolve_busy{0};
  int64_t started_mono = MonotonicMs();
  std::atomic<bool> stopped{false};

  int64_t Now() const { return opts.now_ms ? opts.now_ms() : NowUnixMs(); }

  void Emit(AuditEvent e) {
    requests_total.fetch_add(1);
    if (e.decision == "blocked") blocked_total.fetch_add(1);
    if (audit) audit(std::move(e));
  }

  // Hashes a buffered body into *sha256 and, when `scanner` is set, scans it into *result:
  // inline when small, else on dlp_pool under the tenant's share. False: the tenant's queue is
  // full (nothing was done).
  awaitable<bool> ScanBody(std::string tenant, dlp::BodyScanner* scanner, const std::string& body,
                           dlp::Result* result, std::string* sha256) {
    auto work = [this, scanner, &body, result, sha256] {
      if (opts.body_work_hook_for_test) opts.body_work_hook_for_test(body.size());
      *sha256 = Sha256Hex(body);
      if (scanner != nullptr) {
        scanner->Feed(body);
        *result = scanner->Finish();
      }
    };
    if (body.size() <= opts.dlp_inline_bytes || !dlp_pool) {
      work();
      co_return true;
    }
    std::function<void()> job = work;
    bool ran = co_await RunInPool(*dlp_pool, std::move(tenant), std::move(job));
    if (!ran) refused_dlp_busy.fetch_add(1);
    co_return ran;
  }

  awaitable<void> AcceptLoop(std::shared_ptr<Env> env);
  awaitable<void> Session(std::shared_ptr<Conn> conn, tcp::socket socket);
  void CloseEnv(const std::shared_ptr<Env>& env);
};

// ---------------------------------------------------------------------------------------------
// Per-connection machinery

namespace {

// A started audit event plus the monotonic start time.
struct Audit {
  AuditEvent e;
  int64_t start_mono = MonotonicMs();
  void Finish(int status, std::string decision) {
    e.status = status;
    e.decision = std::move(decision);
    e.duration_ms = MonotonicMs() - start_mono;
  }
};

// Deny rules and addresses. Names a deny rule lists are resolved in mode open (where any other
// name or IP literal is allowed) so that neither an IP literal nor another name of the same
// address gets around the rule; a bounded number of them, cached.
constexpr int64_t kDenyNameTtlMs = 60'000;
constexpr size_t kMaxDenyNamesResolved = 16;  // per policy: the first exact deny names
constexpr size_t kMaxDenyCache = 1024;        // names, across environments

// The addresses `name` resolves to, for a deny rule (cached), looked up under the environment's
// resolver share. Empty when it does not resolve, or resolves through an --egress-resolve
// override (an operator's mapping, often a shared local address: not evidence of the public
// name's addresses). An error (busy, timeout) is not cached: the caller fails closed.
awaitable<absl::StatusOr<std::vector<asio::ip::address>>> DeniedNameAddresses(
    Proxy::Impl& px, const ResolveScope& scope, const std::string& name) {
  const int64_t now = MonotonicMs();
  {
    std::lock_guard<std::mutex> lock(px.deny_mu);
    auto it = px.deny_cache.find(name);
    if (it != px.deny_cache.end() && it->second.expires_mono > now) co_return it->second.addresses;
  }
  Proxy::Impl::DeniedName entry;
  entry.expires_mono = now + kDenyNameTtlMs;
  std::string host = name;
  ResolveScope for_env = scope;  // named, not a temporary in the co_await (GCC 12)
  absl::StatusOr<Resolution> r =
      co_await px.resolver->ResolveFor(std::move(for_env), std::move(host), 0);
  if (!r.ok() && !absl::IsNotFound(r.status())) co_return r.status();
  if (r.ok() && !r->overridden) {
    for (const tcp::endpoint& e : r->endpoints) entry.addresses.push_back(e.address());
  }
  std::lock_guard<std::mutex> lock(px.deny_mu);
  if (px.deny_cache.size() >= kMaxDenyCache) {
    std::erase_if(px.deny_cache, [&](const auto& kv) { return kv.second.expires_mono <= now; });
    if (px.deny_cache.size() >= kMaxDenyCache) px.deny_cache.erase(px.deny_cache.begin());
  }
  px.deny_cache[name] = entry;
  co_return entry.addresses;
}

// Same address, whatever the form (IPv4-mapped IPv6 is its IPv4 address; scope ids ignored).
bool SameAddress(const asio::ip::address& a, const asio::ip::address& b) {
  auto v4 = [](const asio::ip::address& x) -> std::optional<asio::ip::address_v4> {
    if (x.is_v4()) return x.to_v4();
    if (x.to_v6().is_v4_mapped()) return asio::ip::make_address_v4(asio::ip::v4_mapped, x.to_v6());
    return std::nullopt;
  };
  auto a4 = v4(a), b4 = v4(b);
  if (a4 || b4) return a4 && b4 && *a4 == *b4;
  return a.to_v6().to_bytes() == b.to_v6().to_bytes();
}

// The canonical text of an address as policy rules hold it: IPv4-mapped IPv6 as its IPv4
// address, no scope id.
std::string CanonicalText(const asio::ip::address& a) {
  if (a.is_v4()) return a.to_string();
  asio::ip::address_v6 v6 = a.to_v6();
  if (v6.is_v4_mapped()) return asio::ip::make_address_v4(asio::ip::v4_mapped, v6).to_string();
  return asio::ip::address_v6(v6.to_bytes()).to_string();
}

// SECURITY: a deny rule is not only its text. Removes from `endpoints` every address a deny rule
// covers: an IP or CIDR deny rule (any mode) covers its addresses however the destination was
// named; in
// mode open an exact-name deny rule covers the addresses the name resolves to. Returns the rule
// ("deny:<text>") of the first address removed, "" if none; an error when a deny name could
// not be resolved (the caller refuses: a busy resolver must not open what a rule denies).
awaitable<absl::StatusOr<std::string>> RemoveDeniedAddresses(
    Proxy::Impl& px, const ResolveScope& scope, const EgressPolicy& policy, uint16_t port,
    bool explicit_allow, std::vector<tcp::endpoint>* endpoints) {
  std::string rule;
  auto remove = [&](const HostRule& r, auto&& covers) {
    std::erase_if(*endpoints, [&](const tcp::endpoint& e) {
      if (!covers(e.address())) return false;
      if (rule.empty()) rule = absl::StrCat("deny:", r.text);
      return true;
    });
  };
  for (const HostRule& r : policy.deny) {
    if (r.kind != HostRule::Kind::kIp) continue;
    remove(r, [&](const asio::ip::address& a) { return r.Matches(CanonicalText(a), true, port); });
  }
  if (policy.mode == EgressMode::kOpen && !explicit_allow) {
    size_t resolved = 0;
    for (const HostRule& r : policy.deny) {
      if (endpoints->empty() || resolved == kMaxDenyNamesResolved) break;
      if (r.kind != HostRule::Kind::kExact) continue;
      ++resolved;
      if (r.port && *r.port != port) continue;
      absl::StatusOr<std::vector<asio::ip::address>> denied_or =
          co_await DeniedNameAddresses(px, scope, r.host);
      if (!denied_or.ok()) co_return denied_or.status();
      const std::vector<asio::ip::address>& denied = *denied_or;
      remove(r, [&](const asio::ip::address& a) {
        return std::any_of(denied.begin(), denied.end(),
                           [&](const asio::ip::address& d) { return SameAddress(a, d); });
      });
    }
  }
  co_return rule;
}

// Resolves and connects an upstream for `target`; on failure fills `refusal`.
struct ConnectOutcome {
  std::optional<beast::tcp_stream> stream;
  Refusal refusal;
};

awaitable<ConnectOutcome> ConnectUpstream(Proxy::Impl& px, Conn& conn, const RequestTarget& t,
                                          const Decision& decision, const EgressPolicy& policy) {
  ConnectOutcome out;
  std::vector<tcp::endpoint> endpoints;
  bool explicit_allow = false;
  if (t.host_is_ip) {
    boost::system::error_code ec;
    asio::ip::address a = asio::ip::make_address(t.host, ec);
    if (ec) {
      out.refusal = {400, "bad_request", "invalid IP address"};
      co_return out;
    }
    endpoints.emplace_back(a, t.port);
    // An IP literal an allow or intent rule names is explicitly allowed, private or not.
    explicit_allow =
        absl::StartsWith(decision.rule, "allow:") || absl::StartsWith(decision.rule, "intent:");
  } else {
    // One environment (and one tenant) may have only so many names in resolution at once: a
    // sandbox resolving thousands of slow names is answered "busy" at once instead of queueing
    // in front of everyone else's lookups.
    ResolveScope scope{conn.env->Config()->tenant, conn.env->id};
    Quota::Reservation env_slot = px.env_resolutions.Open(scope.env_id);
    Quota::Reservation tenant_slot = px.tenant_resolutions.Open(scope.tenant);
    if (!env_slot.GrowTo(1) || !tenant_slot.GrowTo(1)) {
      px.refused_resolve_busy.fetch_add(1);
      out.refusal = {
          503, "resolve:busy",
          absl::StrCat("too many names being resolved at once for this ",
                       env_slot.bytes() == 0 ? "environment" : "tenant", "; retry shortly")};
      co_return out;
    }
    std::string host = t.host;
    absl::StatusOr<Resolution> r =
        co_await px.resolver->ResolveFor(std::move(scope), std::move(host), t.port);
    env_slot.Release();  // resolved: the connect that follows is not a resolution
    tenant_slot.Release();
    if (!r.ok()) {
      bool timeout = absl::IsDeadlineExceeded(r.status());
      bool busy = absl::IsUnavailable(r.status());
      if (busy) px.refused_resolve_busy.fetch_add(1);
      out.refusal = {timeout ? 504
                     : busy  ? 503
                             : 502,
                     timeout ? "resolve:timeout"
                     : busy  ? "resolve:busy"
                             : "resolve:failed",
                     std::string(r.status().message())};
      co_return out;
    }
    endpoints = std::move(r->endpoints);
    explicit_allow = r->overridden;
  }
  {
    const std::string first = endpoints.empty() ? "" : endpoints.front().address().to_string();
    ResolveScope scope{conn.env->Config()->tenant, conn.env->id};
    absl::StatusOr<std::string> denied_or =
        co_await RemoveDeniedAddresses(px, scope, policy, t.port, explicit_allow, &endpoints);
    if (!denied_or.ok()) {
      bool timeout = absl::IsDeadlineExceeded(denied_or.status());
      if (!timeout) px.refused_resolve_busy.fetch_add(1);
      out.refusal = {timeout ? 504 : 503, timeout ? "resolve:timeout" : "resolve:busy",
                     absl::StrCat("cannot check the policy's deny rules for ", t.host, " now (",
                                  denied_or.status().message(), "); retry shortly")};
      co_return out;
    }
    const std::string& denied = *denied_or;
    if (endpoints.empty() && !denied.empty()) {
      out.refusal = {
          403, denied,
          absl::StrCat(t.host, " is ", first,
                       ", an address the environment's egress policy denies (", denied, ")")};
      co_return out;
    }
  }
  if (!explicit_allow) {
    std::string refused;
    bool host_address = false;
    std::erase_if(endpoints, [&](const tcp::endpoint& e) {
      bool is_private = IsForbiddenAddress(e.address());
      // SECURITY: the proxy connects from the host: the host's own (public) addresses would
      // reach esbd and every other host service.
      if (!is_private && !px.host_addresses->Contains(e.address())) return false;
      if (refused.empty()) {
        refused = e.address().to_string();
        host_address = !is_private;
      }
      return true;
    });
    if (endpoints.empty()) {
      out.refusal =
          host_address
              ? Refusal{403, "addr:host",
                        absl::StrCat(t.host, " resolves to ", refused,
                                     ", an address of the proxy's host the sandbox may not "
                                     "reach")}
              : Refusal{403, "addr:private",
                        absl::StrCat(t.host, " resolves to ", refused,
                                     ", a private, loopback, link-local or metadata address "
                                     "the sandbox may not reach")};
      co_return out;
    }
  }
  beast::tcp_stream stream(conn.strand);
  stream.expires_after(px.opts.connect_timeout);
  conn.upstream = &stream.socket();
  auto [ec, ep] = co_await stream.async_connect(endpoints, kTuple);
  conn.upstream = nullptr;
  if (ec || conn.closed) {
    out.refusal = {ec == beast::error::timeout ? 504 : 502, "upstream:connect_failed",
                   absl::StrCat("cannot connect to ", t.host, ":", t.port, ": ",
                                conn.closed ? "detached" : ec.message())};
    co_return out;
  }
  stream.expires_never();
  boost::system::error_code ignored;
  // Heads and bodies go out in separate writes: without TCP_NODELAY each small write would
  // wait for the peer's delayed ACK (40 ms per request).
  stream.socket().set_option(tcp::no_delay(true), ignored);
  out.stream.emplace(std::move(stream));
  co_return out;
}

template <class Stream>
beast::tcp_stream& Lowest(Stream& s) {
  return beast::get_lowest_layer(s);
}

template <class Stream>
awaitable<bool> WriteResponse(Stream& client, http::response<http::string_body> res,
                              std::chrono::milliseconds timeout) {
  Lowest(client).expires_after(timeout);
  auto [ec, n] = co_await http::async_write(client, res, kTuple);
  co_return !ec;
}

// The upstream side of the request loop. Plain: one kept-alive TCP connection, replaced when the
// target changes. Inspected tunnel: the fixed verified TLS stream of the tunnel.
struct PlainUpstream {
  std::optional<beast::tcp_stream> stream;
  std::string key;
  beast::flat_buffer buffer;
  beast::tcp_stream& Stream() { return *stream; }
  void Close() {
    if (stream) {
      boost::system::error_code ec;
      stream->socket().shutdown(tcp::socket::shutdown_both, ec);
      stream->close();
    }
    stream.reset();
    buffer.clear();
  }
};

struct TlsUpstream {
  tls::SslStream* stream = nullptr;
  beast::flat_buffer buffer;
  bool broken = false;
  tls::SslStream& Stream() { return *stream; }
  void Close() { broken = true; }
};

// Reads one request head into `buffer` with the raw checks, then parses it into `parser`.
// Returns an error refusal, or nullopt on success; `eof` set when the client closed cleanly.
template <class Stream>
awaitable<std::optional<Refusal>> ReadHead(Stream& client, beast::flat_buffer& buffer,
                                           http::request_parser<http::empty_body>& parser,
                                           bool* eof) {
  *eof = false;
  for (;;) {
    std::string_view data(static_cast<const char*>(buffer.data().data()), buffer.size());
    // Leading CRLFs before a request line are allowed (RFC 9112 §2.2).
    size_t skip = 0;
    while (skip + 1 < data.size() && data[skip] == '\r' && data[skip + 1] == '\n') skip += 2;
    if (skip > 0) {
      buffer.consume(skip);
      continue;
    }
    size_t eoh = data.find("\r\n\r\n");
    if (eoh != std::string_view::npos && eoh + 4 > kMaxHeaderBytes) {
      co_return Refusal{431, "bad_request",
                        absl::StrCat("request head larger than ", kMaxHeaderBytes, " bytes")};
    }
    if (eoh != std::string_view::npos) {
      std::string raw = CheckRawHead(data.substr(0, eoh + 4));
      if (!raw.empty()) co_return Refusal{400, "bad_request", raw};
      boost::system::error_code ec;
      size_t used = parser.put(asio::buffer(data.data(), eoh + 4), ec);
      if (ec || !parser.is_header_done()) {
        co_return Refusal{
            400, "bad_request",
            absl::StrCat("malformed request head: ", ec ? ec.message() : "incomplete")};
      }
      buffer.consume(used);
      co_return std::nullopt;
    }
    if (buffer.size() > kMaxHeaderBytes) {
      co_return Refusal{431, "bad_request",
                        absl::StrCat("request head larger than ", kMaxHeaderBytes, " bytes")};
    }
    auto [ec, n] = co_await client.async_read_some(buffer.prepare(4096), kTuple);
    if (ec) {
      *eof = true;  // closed, reset or timed out: nothing to answer
      co_return std::nullopt;
    }
    buffer.commit(n);
  }
}

}  // namespace

// The request loop, over the client stream type (plain TCP or the inspected TLS stream) and
// the upstream kind. Returns when the connection should end (or, on the proxy port, when a
// CONNECT was read: *connect_out is then set and `head_out` holds it).
struct LoopContext {
  Proxy::Impl* px;
  std::shared_ptr<Conn> conn;
  std::shared_ptr<Env> env;
  const TunnelTarget* tunnel = nullptr;  // inside an inspected tunnel
  // The DLP scan of a CONNECT target's name (set with *connect_target; nullopt: DLP off or an
  // IP literal): the CONNECT's audit row records its findings and masks the name.
  std::optional<dlp::Result> connect_host_scan;
};

namespace {

// The audit copy of a host name a scan found something in: never the name itself.
std::string MaskedHost(const dlp::Result& scan) {
  return absl::StrCat("[REDACTED:", scan.findings.front().rule_id, "]");
}

// `reason` with every occurrence of `host` replaced by `shown` (nothing to do if host is "").
std::string HideHost(absl::string_view reason, absl::string_view host, absl::string_view shown) {
  if (host.empty()) return std::string(reason);
  return absl::StrReplaceAll(reason, {{host, shown}});
}

}  // namespace

template <class Client, class Upstream>
awaitable<void> RequestLoop(LoopContext& lc, Client& client, beast::flat_buffer& buffer,
                            Upstream& upstream,
                            std::unique_ptr<http::request_parser<http::empty_body>>* connect_out,
                            std::optional<RequestTarget>* connect_target) {
  Proxy::Impl& px = *lc.px;
  Conn& conn = *lc.conn;
  bool first = true;
  for (;;) {
    if (conn.closed) co_return;
    Lowest(client).expires_after(first ? px.opts.header_timeout : px.opts.idle_timeout);
    auto parser = std::make_unique<http::request_parser<http::empty_body>>();
    ConfigureRequestParser(*parser);
    bool eof = false;
    std::optional<Refusal> bad = co_await ReadHead(client, buffer, *parser, &eof);
    if (eof) co_return;
    first = false;
    std::shared_ptr<const EnvConfig> cfg = lc.env->Config();
    int64_t now = px.Now();
    Audit audit;
    audit.e.time_ms = now;
    audit.e.env_id = cfg->env_id;
    audit.e.tenant = cfg->tenant;
    audit.e.intents = ActiveIntentNames(*cfg, now);
    audit.e.scheme = lc.tunnel != nullptr ? "https" : "http";
    std::string real_host;  // set when the audit row shows the host masked
    auto refuse = [&](const Refusal& r, bool keep_alive) -> awaitable<bool> {
      unsigned version = parser->is_header_done() ? parser->get().version() : 11;
      auto response = BlockResponse(r.status, r.rule, audit.e.host, r.reason, version, keep_alive);
      if (std::find(audit.e.rule_ids.begin(), audit.e.rule_ids.end(), r.rule) ==
          audit.e.rule_ids.end()) {
        audit.e.rule_ids.insert(audit.e.rule_ids.begin(), r.rule);
      }
      audit.e.reason = HideHost(r.reason, real_host, audit.e.host);
      audit.Finish(r.status, r.status == 403 || r.status == 421 ? "blocked" : "error");
      px.Emit(std::move(audit.e));
      bool ok = co_await WriteResponse(client, std::move(response), px.opts.idle_timeout);
      co_return ok&& keep_alive;
    };
    if (bad) {
      co_await refuse(*bad, false);
      co_return;
    }
    http::request_header<>& head = parser->get();
    audit.e.method = std::string(SV(head.method_string()));
    std::variant<RequestTarget, Refusal> interpreted = InterpretHead(head, lc.tunnel);
    if (auto* r = std::get_if<Refusal>(&interpreted)) {
      co_await refuse(*r, false);
      co_return;
    }
    RequestTarget target = std::get<RequestTarget>(std::move(interpreted));
    audit.e.host = target.host;
    audit.e.port = target.port;
    audit.e.path = MaskUrlQuery(target.path);
    // SECURITY: a host name is data too (its DNS zone sees it before any byte is sent): it is
    // scanned before it is decided, resolved or connected; a finding masks it in the audit row,
    // a block or redact rule refuses the request (a name cannot be redacted).
    std::optional<dlp::Result> host_scan;
    if (cfg->dlp && !target.host_is_ip) {
      absl::StatusOr<dlp::Result> scanned = ScanHost(*cfg->dlp, target.host);
      if (!scanned.ok()) {
        audit.e.host = "[unscannable host name]";
        Refusal r{400, "bad_request", std::string(scanned.status().message())};
        co_await refuse(r, false);
        co_return;
      }
      host_scan = *std::move(scanned);
      if (!host_scan->findings.empty()) {
        AddFindings(audit.e, *host_scan);
        audit.e.host = MaskedHost(*host_scan);
        real_host = target.host;
      }
      if (std::string rule = StoppingRule(*host_scan); !rule.empty()) {
        Refusal r{403, rule,
                  absl::StrCat("the destination host name carries data the DLP policy blocks (",
                               rule, "); it was not resolved and nothing was sent")};
        co_await refuse(r, false);
        co_return;
      }
    }
    // The URL is scanned once, before any row is emitted (a refused request is audited too):
    // the row never keeps a secret that was in the URL, whatever the policy decides next.
    std::optional<dlp::Result> url_scan;
    if (cfg->dlp && !target.connect) {
      url_scan = cfg->dlp->ScanText(target.path, dlp::Where::kUrl);
      audit.e.path = MaskUrlQuery(MaskFindings(target.path, url_scan->findings));
    }
    if (target.connect) {
      lc.connect_host_scan = std::move(host_scan);
      *connect_out = std::move(parser);
      *connect_target = std::move(target);
      co_return;
    }
    bool has_body = parser->content_length() ? *parser->content_length() > 0 : parser->chunked();
    // Policy: decided again on every request (intents may have expired, Update may have run).
    Decision d = Decide(cfg->policy, cfg->intents, now, target.host, target.port);
    audit.e.rule_ids.push_back(d.rule);
    if (!d.allowed) {
      Refusal r{403, d.rule,
                absl::StrCat(target.host, ":", target.port,
                             " is not allowed by the environment's egress policy (", d.rule, ")")};
      audit.e.rule_ids.clear();
      if (!co_await refuse(r, !has_body && parser->keep_alive())) co_return;
      continue;
    }
    // DLP on the URL and the headers. Redact rules change what is sent; the audit copy masks
    // every finding's span whatever its action.
    std::optional<dlp::Result> blocked;
    bool redacted = false;
    std::string target_path = target.path;
    std::vector<std::pair<std::string, std::string>> header_redactions;  // name → new value
    std::map<size_t, std::string> audit_values;  // header index → masked value
    std::map<size_t, std::string> audit_names;   // header index → masked name
    if (cfg->dlp) {
      dlp::Result url = *std::move(url_scan);  // scanned above (target_path is target.path)
      AddFindings(audit.e, url);
      if (url.blocked()) {
        blocked = std::move(url);
      } else if (url.decision == dlp::Action::kRedact && url.redacted) {
        target_path = *url.redacted;
        redacted = true;
      }
      size_t index = 0;
      for (auto it = head.begin(); it != head.end(); ++it, ++index) {
        // Header NAMES carry data as well as values ("X-AKIA...: 1"). A name cannot be
        // redacted and keep its meaning: a block or redact rule on it refuses the request.
        std::string_view name = SV(it->name_string());
        dlp::Result n = cfg->dlp->ScanText(name, dlp::Where::kHeader);
        if (!n.findings.empty()) {
          AddFindings(audit.e, n);
          audit_names[index] = MaskFindings(name, n.findings);
          if (std::string rule = StoppingRule(n); !rule.empty() && !blocked) {
            n.block_rule = std::move(rule);
            n.decision = dlp::Action::kBlock;
            blocked = std::move(n);
          }
        }
        std::string_view value = SV(it->value());
        // The Host field is a name too (split labels, any case): on the proxy port it may
        // differ from the URI's host (it is replaced upstream, but the audit row records it);
        // inside a tunnel it equals the scanned CONNECT target. A finding masks it whole.
        if (it->name() == http::field::host && value != target.host) {
          absl::StatusOr<dlp::Result> hs =
              ScanHost(*cfg->dlp, absl::AsciiStrToLower(AbslView(value)));
          if (!hs.ok() || !hs->findings.empty()) {
            if (hs.ok()) AddFindings(audit.e, *hs);
            audit_values[index] = hs.ok() ? MaskedHost(*hs) : "[unscannable host name]";
            std::string rule = hs.ok() ? StoppingRule(*hs) : "";
            if (!rule.empty() && !blocked) {
              hs->block_rule = std::move(rule);
              hs->decision = dlp::Action::kBlock;
              blocked = *std::move(hs);
            }
            continue;
          }
        }
        dlp::Result h = cfg->dlp->ScanText(value, dlp::Where::kHeader);
        if (h.findings.empty()) continue;
        AddFindings(audit.e, h);
        audit_values[index] = MaskFindings(value, h.findings);
        if (h.blocked()) {
          if (!blocked) blocked = std::move(h);
        } else if (h.decision == dlp::Action::kRedact && h.redacted) {
          header_redactions.emplace_back(std::string(SV(it->name_string())), *h.redacted);
        }
      }
    }
    {
      std::string lines;
      size_t index = 0;
      for (auto it = head.begin(); it != head.end(); ++it, ++index) {
        std::string_view name = SV(it->name_string());
        auto masked = audit_values.find(index);
        auto masked_name = audit_names.find(index);
        std::string line = absl::StrCat(
            masked_name != audit_names.end() ? masked_name->second : AbslView(name), ": ",
            MaskHeaderValue(name, masked != audit_values.end() ? std::string_view(masked->second)
                                                               : SV(it->value())),
            "\n");
        if (lines.size() + line.size() > control::kAuditHeadersCap) break;
        lines += line;
      }
      audit.e.request_headers = std::move(lines);
    }
    for (auto& [name, value] : header_redactions) {
      head.set(name, value);
      redacted = true;
    }
    if (blocked) {
      Refusal r{403, blocked->block_rule,
                absl::StrCat("the request carries data the DLP policy blocks (",
                             blocked->block_rule, "); nothing was sent upstream")};
      co_await refuse(r, false);
      co_return;
    }
    // The body: read whole (up to the cap) before anything goes upstream, so that a blocked
    // body never reaches it.
    const int64_t cap = cfg->policy.max_body_bytes;
    if (parser->content_length() && *parser->content_length() > static_cast<uint64_t>(cap)) {
      Refusal r{413, "body:too_large",
                absl::StrCat("request body larger than the policy's max_body_bytes (", cap, ")")};
      co_await refuse(r, false);
      co_return;
    }
    // The body's bytes are reserved in the shared budget before any is read (Content-Length) or
    // as they arrive (chunked); the reservation goes back when the body went upstream, or on
    // whatever path ends this iteration (refusal, error, the client gone, a timeout, Detach).
    // A body larger than a tenant's whole share can never fit: 413, not "retry".
    Quota::Reservation body_reservation = px.body_budget.Open(cfg->tenant);
    const int64_t share = std::min(px.body_budget.per_key(), px.body_budget.total());
    auto over_budget = [&](int64_t want) {
      px.refused_body_budget.fetch_add(1);
      if (want > share) {
        return Refusal{413, "limit:body_budget",
                       absl::StrCat("request body larger than the egress proxy's buffer share of a "
                                    "tenant (",
                                    share, " bytes)")};
      }
      return Refusal{503, "limit:body_budget",
                     "the egress proxy is buffering too many request bodies of this tenant or in "
                     "total; retry shortly"};
    };
    if (parser->content_length() && *parser->content_length() > 0 &&
        !body_reservation.GrowTo(static_cast<int64_t>(*parser->content_length()))) {
      Refusal r = over_budget(static_cast<int64_t>(*parser->content_length()));
      co_await refuse(r, false);
      co_return;
    }
    if (has_body &&
        absl::EqualsIgnoreCase(AbslView(SV(head[http::field::expect])), "100-continue")) {
      Lowest(client).expires_after(px.opts.idle_timeout);
      co_await asio::async_write(client, asio::buffer("HTTP/1.1 100 Continue\r\n\r\n", 25), kTuple);
    }
    const auto head_fields = std::distance(head.begin(), head.end());
    http::request_parser<http::string_body> body_parser(std::move(*parser));
    // Beast checks the limit of a Content-Length body when the head is parsed (done above);
    // chunked bodies are checked as they arrive.
    body_parser.body_limit(static_cast<uint64_t>(cap));
    if (!body_parser.is_done()) {
      Lowest(client).expires_after(px.opts.body_timeout);  // the whole body
      boost::system::error_code ec;
      int64_t budget_exceeded = 0;  // the size that did not fit
      while (!body_parser.is_done()) {
        auto [rec, n] = co_await http::async_read_some(client, buffer, body_parser, kTuple);
        if (rec) {
          ec = rec;
          break;
        }
        // A chunked body grows its reservation ahead of itself, kBodyBudgetStep at a time.
        constexpr int64_t kBodyBudgetStep = 64 << 10;
        const auto have = static_cast<int64_t>(body_parser.get().body().size());
        if (have > body_reservation.bytes() &&
            !body_reservation.GrowTo(std::max(have, std::min(cap, have + kBodyBudgetStep))) &&
            !body_reservation.GrowTo(have)) {
          budget_exceeded = have;
          break;
        }
      }
      if (budget_exceeded > 0) {
        Refusal r = over_budget(budget_exceeded);
        co_await refuse(r, false);
        co_return;
      }
      if (ec == http::error::body_limit) {
        Refusal r{413, "body:too_large",
                  absl::StrCat("request body larger than the policy's max_body_bytes (", cap, ")")};
        co_await refuse(r, false);
        co_return;
      }
      if (ec) {
        audit.Finish(0, "error");
        audit.e.reason = absl::StrCat("reading the request body: ", ec.message());
        px.Emit(std::move(audit.e));
        co_return;
      }
    }
    http::request<http::string_body> req = body_parser.release();
    // SECURITY: Beast adds a chunked body's trailer fields to the message's fields; they would
    // go upstream as headers that DLP never scanned and the audit never saw. Refused.
    if (std::distance(req.begin(), req.end()) != head_fields) {
      // (Named, not a temporary in the co_await: GCC 12 miscompiles those; see tls/mitm.h.)
      Refusal r{400, "request:trailers",
                "chunked trailer fields are not accepted by the egress proxy"};
      co_await refuse(r, false);
      co_return;
    }
    // SECURITY: DLP decodes the body by one Content-Encoding and one Content-Type; a second
    // field (which an upstream may combine with the first) would have it scan other bytes
    // than the upstream decodes.
    if (req.count(http::field::content_encoding) > 1 || req.count(http::field::content_type) > 1) {
      Refusal r{400, "request:duplicate_fields",
                "more than one Content-Encoding or Content-Type field"};
      co_await refuse(r, false);
      co_return;
    }
    std::string& body = req.body();
    // The per-byte work on the body — its audit hash and the DLP scan — is one job, run on the
    // DLP pool when the body is large (ScanBody): a tenant's big bodies never stall the I/O
    // threads every tenant's connections share.
    dlp::BodyInfo info;
    std::unique_ptr<dlp::BodyScanner> scanner;
    if (cfg->dlp && !body.empty()) {
      info.where = dlp::Where::kBody;
      info.content_type = std::string(SV(req[http::field::content_type]));
      info.content_encoding = std::string(SV(req[http::field::content_encoding]));
      scanner = cfg->dlp->NewBodyScanner(info);
    }
    dlp::Result r;
    if (!body.empty()) {
      std::string work_key = cfg->tenant;  // named, not a temporary in the co_await (GCC 12)
      bool done = co_await px.ScanBody(std::move(work_key), scanner.get(), body, &r,
                                       &audit.e.request_body_sha256);
      if (!done) {
        Refusal busy{503, "limit:dlp_busy",
                     "the egress proxy's DLP scanner is busy with this tenant's requests; retry "
                     "shortly"};
        co_await refuse(busy, false);
        co_return;
      }
    }
    std::string audit_body;
    if (scanner) {
      AddFindings(audit.e, r);
      if (r.decision == dlp::Action::kRedact && r.redacted) {
        body = *r.redacted;
        req.erase(http::field::content_encoding);
        redacted = true;
        audit_body = body;
      } else if (r.redacted) {
        audit_body = *r.redacted;  // a blocked body's audit copy, every finding replaced
      } else if (info.content_encoding.empty() ||
                 absl::EqualsIgnoreCase(info.content_encoding, "identity")) {
        audit_body = MaskFindings(body, r.findings);
      } else {
        audit_body =
            absl::StrCat("[", info.content_encoding, "-encoded body, ", body.size(), " bytes]");
      }
      if (r.blocked()) {
        audit.e.request_body = audit_body.substr(0, control::kAuditBodyCap);
        audit.e.request_body_truncated = audit_body.size() > control::kAuditBodyCap;
        Refusal rr{403, r.block_rule,
                   absl::StrCat("the request body carries data the DLP policy blocks (",
                                r.block_rule, "); nothing was sent upstream")};
        co_await refuse(rr, false);
        co_return;
      }
    } else {
      audit_body = body;
    }
    audit.e.request_body = audit_body.substr(0, control::kAuditBodyCap);
    audit.e.request_body_truncated = audit_body.size() > control::kAuditBodyCap;
    bool client_keep_alive = req.keep_alive();
    target.path = target_path;
    PrepareUpstreamHead(req.base(), target);
    req.erase(http::field::transfer_encoding);
    req.content_length(body.size());
    if (body.empty() && (req.method() == http::verb::get || req.method() == http::verb::head)) {
      req.erase(http::field::content_length);
    }
    bool head_request = req.method() == http::verb::head;

    // Upstream: connect (plain) or reuse; send the request.
    std::string key = absl::StrCat(target.host, ":", target.port);
    boost::system::error_code werr;
    for (int attempt = 0; attempt < 2; ++attempt) {
      bool reused = false;
      if constexpr (std::is_same_v<Upstream, PlainUpstream>) {
        if (upstream.stream && upstream.key == key) {
          reused = true;
        } else {
          upstream.Close();
          ConnectOutcome c = co_await ConnectUpstream(px, conn, target, d, cfg->policy);
          if (!c.stream) {
            if (!co_await refuse(c.refusal, false)) co_return;
            co_return;
          }
          upstream.stream.emplace(std::move(*c.stream));
          upstream.key = key;
        }
      } else {
        if (upstream.broken) {
          Refusal r{502, "upstream:closed", "the upstream closed the tunnel"};
          co_await refuse(r, false);
          co_return;
        }
      }
      conn.upstream = &Lowest(upstream.Stream()).socket();
      Lowest(upstream.Stream()).expires_after(px.opts.upstream_timeout);
      auto [ec, n] = co_await http::async_write(upstream.Stream(), req, kTuple);
      werr = ec;
      if (!ec) break;
      upstream.Close();
      if (!reused) break;  // a fresh connection failed: no retry
    }
    if (werr) {
      Refusal r{502, "upstream:write_failed",
                absl::StrCat("sending the request upstream: ", werr.message())};
      co_await refuse(r, false);
      co_return;
    }
    audit.e.bytes_up = static_cast<int64_t>(body.size());
    // The body went upstream: its memory and its share of the budget go back now, not after the
    // response.
    std::string().swap(body);
    body_reservation.Release();

    // The response: head (skipping 1xx), then the body streamed through.
    std::optional<http::response_parser<http::buffer_body>> rp;
    boost::system::error_code rerr;
    for (int i = 0; i < 8; ++i) {
      rp.emplace();
      rp->header_limit(64 << 10);
      rp->body_limit(boost::none);
      if (head_request) rp->skip(true);
      Lowest(upstream.Stream()).expires_after(px.opts.upstream_timeout);
      auto [ec, n] =
          co_await http::async_read_header(upstream.Stream(), upstream.buffer, *rp, kTuple);
      rerr = ec;
      if (ec) break;
      int code = rp->get().result_int();
      if (code >= 200 || code == 101) break;
    }
    if (rerr || rp->get().result_int() < 200) {
      upstream.Close();
      bool timeout = rerr == beast::error::timeout;
      Refusal r{timeout ? 504 : 502, "upstream:bad_response",
                rerr ? absl::StrCat("reading the upstream response: ", rerr.message())
                     : "the upstream answered with an unsupported status"};
      co_await refuse(r, false);
      co_return;
    }
    auto& res = rp->get();
    PrepareClientResponseHead(res.base());
    bool keep_alive = client_keep_alive && !rp->need_eof();
    res.keep_alive(keep_alive);
    int status = res.result_int();
    std::unique_ptr<dlp::BodyScanner> response_scanner;
    if (cfg->dlp && cfg->dlp->config().scan_responses && !head_request) {
      dlp::BodyInfo info;
      info.where = dlp::Where::kResponseBody;
      info.content_type = std::string(SV(res[http::field::content_type]));
      info.content_encoding = std::string(SV(res[http::field::content_encoding]));
      response_scanner = cfg->dlp->NewBodyScanner(info);
    }
    http::serializer<false, http::buffer_body> sr{res};
    Lowest(client).expires_after(px.opts.idle_timeout);
    auto [hec, hn] = co_await http::async_write_header(client, sr, kTuple);
    bool relay_ok = !hec;
    char chunk[16 << 10];
    while (relay_ok) {
      if (!rp->is_done()) {
        res.body().data = chunk;
        res.body().size = sizeof(chunk);
        Lowest(upstream.Stream()).expires_after(px.opts.upstream_timeout);
        auto [ec, n] = co_await http::async_read(upstream.Stream(), upstream.buffer, *rp, kTuple);
        if (ec == http::error::need_buffer) ec = {};
        if (ec) {
          relay_ok = false;
          audit.e.reason = absl::StrCat("upstream response body: ", ec.message());
          break;
        }
        size_t got = sizeof(chunk) - res.body().size;
        res.body().size = got;
        res.body().data = chunk;
        res.body().more = !rp->is_done();
        audit.e.bytes_down += static_cast<int64_t>(got);
        if (response_scanner) response_scanner->Feed(std::string_view(chunk, got));
      } else {
        res.body().data = nullptr;
        res.body().size = 0;
        res.body().more = false;
      }
      Lowest(client).expires_after(px.opts.idle_timeout);
      auto [ec, n] = co_await http::async_write(client, sr, kTuple);
      if (ec == http::error::need_buffer) ec = {};
      if (ec) {
        relay_ok = false;
        audit.e.reason = absl::StrCat("client went away: ", ec.message());
        break;
      }
      if (rp->is_done() && sr.is_done()) break;
    }
    if (response_scanner) AddFindings(audit.e, response_scanner->Finish());
    if (!rp->keep_alive() || !relay_ok || !rp->is_done()) upstream.Close();
    audit.Finish(status, !relay_ok ? "error" : redacted ? "redacted" : "allowed");
    px.Emit(std::move(audit.e));
    if (!relay_ok || !keep_alive) co_return;
  }
}

namespace {

// Copies bytes one way until EOF or error; then half-closes the other side.
awaitable<void> Pump(tcp::socket& from, tcp::socket& to, int64_t* bytes,
                     std::atomic<int64_t>* last_activity) {
  std::vector<char> buf(32 << 10);
  for (;;) {
    auto [ec, n] = co_await from.async_read_some(asio::buffer(buf), kTuple);
    if (ec || n == 0) break;
    last_activity->store(MonotonicMs());
    auto [wec, wn] = co_await asio::async_write(to, asio::buffer(buf.data(), n), kTuple);
    if (wec) break;
    *bytes += static_cast<int64_t>(n);
  }
  boost::system::error_code ec;
  to.shutdown(tcp::socket::shutdown_send, ec);
}

// Ends when the tunnel idles out, or (checked at least once a second) when `still_allowed`
// says the policy no longer allows it (*revoked = true).
awaitable<void> IdleWatch(std::atomic<int64_t>* last_activity, std::chrono::milliseconds idle,
                          const std::function<bool()>* still_allowed, bool* revoked) {
  asio::steady_timer timer(co_await asio::this_coro::executor);
  for (;;) {
    if (!(*still_allowed)()) {
      *revoked = true;
      co_return;
    }
    int64_t left = last_activity->load() + idle.count() - MonotonicMs();
    if (left <= 0) co_return;
    timer.expires_after(std::chrono::milliseconds(std::min<int64_t>(left, 1000)));
    auto [ec] = co_await timer.async_wait(kTuple);
    if (ec) co_return;
  }
}

}  // namespace

awaitable<void> Proxy::Impl::Session(std::shared_ptr<Conn> conn, tcp::socket socket) {
  std::shared_ptr<Env> env = conn->env;
  beast::tcp_stream client(std::move(socket));
  boost::system::error_code ignored;
  client.socket().set_option(tcp::no_delay(true), ignored);
  conn->client = &client.socket();
  beast::flat_buffer buffer;
  LoopContext lc{this, conn, env, nullptr};
  std::unique_ptr<http::request_parser<http::empty_body>> connect;
  std::optional<RequestTarget> target;
  {
    PlainUpstream upstream;
    co_await RequestLoop(lc, client, buffer, upstream, &connect, &target);
    upstream.Close();
    conn->upstream = nullptr;
  }
  if (!connect || conn->closed) co_return;

  // CONNECT host:port.
  std::shared_ptr<const EnvConfig> cfg = env->Config();
  int64_t now = Now();
  Audit audit;
  audit.e.time_ms = now;
  audit.e.env_id = cfg->env_id;
  audit.e.tenant = cfg->tenant;
  audit.e.intents = ActiveIntentNames(*cfg, now);
  audit.e.method = "CONNECT";
  audit.e.host = target->host;
  audit.e.port = target->port;
  unsigned version = connect->get().version();
  // Arguments of co_await expressions are named locals throughout: GCC 12 miscompiles class
  // temporaries there (see governance/tls/mitm.h).
  std::string real_host;  // set when the audit row shows the host masked
  if (lc.connect_host_scan && !lc.connect_host_scan->findings.empty()) {
    AddFindings(audit.e, *lc.connect_host_scan);  // log-only findings (others were refused)
    audit.e.host = MaskedHost(*lc.connect_host_scan);
    real_host = target->host;
  }
  auto refuse = [&](const Refusal& r, const char* decision) -> awaitable<void> {
    audit.e.rule_ids.insert(audit.e.rule_ids.begin(), r.rule);
    audit.e.reason = HideHost(r.reason, real_host, audit.e.host);
    audit.Finish(r.status, decision);
    Emit(std::move(audit.e));
    auto response = BlockResponse(r.status, r.rule, target->host, r.reason, version, false);
    co_await WriteResponse(client, std::move(response), opts.idle_timeout);
  };
  Decision d = Decide(cfg->policy, cfg->intents, now, target->host, target->port);
  if (!d.allowed) {
    audit.e.scheme = "https";
    Refusal r{403, d.rule,
              absl::StrCat(target->host, ":", target->port,
                           " is not allowed by the environment's egress policy (", d.rule, ")")};
    co_await refuse(r, "blocked");
    co_return;
  }
  audit.e.rule_ids.push_back(d.rule);
  bool inspect = env->intercept != nullptr && !TlsExcluded(cfg->policy, target->host, target->port);
  audit.e.scheme = inspect ? "https" : "tunnel";
  if (inspect && buffer.size() > 0) {
    Refusal r{400, "bad_request", "bytes sent after CONNECT before the proxy answered"};
    co_await refuse(r, "error");
    co_return;
  }
  ConnectOutcome up = co_await ConnectUpstream(*this, *conn, *target, d, cfg->policy);
  if (!up.stream) {
    co_await refuse(up.refusal, up.refusal.status == 403 ? "blocked" : "error");
    co_return;
  }
  Lowest(client).expires_after(opts.idle_timeout);
  static constexpr std::string_view kEstablished = "HTTP/1.1 200 Connection established\r\n\r\n";
  auto [wec, wn] = co_await asio::async_write(
      client, asio::buffer(kEstablished.data(), kEstablished.size()), kTuple);
  if (wec) co_return;

  if (!inspect) {
    // Opaque tunnel: bytes both ways until both sides finish or it idles out.
    beast::tcp_stream upstream = std::move(*up.stream);
    client.expires_never();
    upstream.expires_never();
    conn->upstream = &upstream.socket();
    int64_t up_bytes = 0, down_bytes = 0;
    if (buffer.size() > 0) {
      auto [ec, n] = co_await asio::async_write(upstream.socket(), buffer.data(), kTuple);
      up_bytes += static_cast<int64_t>(buffer.size());
      buffer.consume(buffer.size());
      if (ec) co_return;
    }
    std::atomic<int64_t> last{MonotonicMs()};
    // SECURITY: nothing inside an opaque tunnel is re-decided per request, so the tunnel itself
    // is: once the policy or the active intents no longer allow its target (an intent expired,
    // PUT /network changed the rules) it is closed within a second instead of living on until
    // it idles out.
    const std::string tunnel_host = target->host;
    const uint16_t tunnel_port = target->port;
    const std::function<bool()> still_allowed = [this, env, tunnel_host, tunnel_port] {
      std::shared_ptr<const EnvConfig> c = env->Config();
      return Decide(c->policy, c->intents, Now(), tunnel_host, tunnel_port).allowed;
    };
    bool revoked = false;
    co_await ((Pump(client.socket(), upstream.socket(), &up_bytes, &last) &&
               Pump(upstream.socket(), client.socket(), &down_bytes, &last)) ||
              IdleWatch(&last, opts.idle_timeout, &still_allowed, &revoked));
    conn->upstream = nullptr;
    if (revoked) {
      audit.e.rule_ids.push_back("revoked");
      audit.e.reason = "tunnel closed: the policy no longer allows its target";
    }
    audit.e.bytes_up = up_bytes;
    audit.e.bytes_down = down_bytes;
    audit.Finish(200, "opaque");
    Emit(std::move(audit.e));
    co_return;
  }

  // Inspected tunnel: our leaf towards the client, verified TLS upstream, then the request
  // loop inside.
  tls::MitmRequest mreq;
  mreq.server_ctx = env->intercept;
  mreq.upstream_ctx = upstream_tls;
  mreq.target_host = target->host;
  mreq.deadline = std::chrono::steady_clock::now() + opts.tls_handshake_timeout;
  conn->client = nullptr;
  tls::MitmResult m = co_await tls::AsyncIntercept(std::move(mreq), std::move(client),
                                                   std::move(*up.stream), asio::use_awaitable);
  if (!m.status.ok()) {
    audit.e.rule_ids.insert(audit.e.rule_ids.begin(), m.rule);
    audit.e.reason = HideHost(m.status.message(), real_host, audit.e.host);
    // A mismatched SNI never goes upstream (the proxy sends the target's), but the row records
    // it: scanned like a host name, masked on a finding.
    if (cfg->dlp && !m.sni.empty() && m.sni != target->host) {
      absl::StatusOr<dlp::Result> sni = ScanHost(*cfg->dlp, absl::AsciiStrToLower(m.sni));
      if (!sni.ok() || !sni->findings.empty()) {
        if (sni.ok()) AddFindings(audit.e, *sni);
        audit.e.reason =
            HideHost(audit.e.reason, m.sni, sni.ok() ? MaskedHost(*sni) : "[unscannable name]");
      }
    }
    int status = m.rule == tls::kRuleSniMismatch ? 421 : 502;
    audit.Finish(m.client ? status : 0, m.rule == tls::kRuleSniMismatch ? "blocked" : "error");
    Emit(std::move(audit.e));
    if (m.client) {
      auto response =
          BlockResponse(status, m.rule, target->host, std::string(m.status.message()), 11, false);
      co_await WriteResponse(*m.client, std::move(response), opts.idle_timeout);
    }
    co_return;
  }
  conn->client = &Lowest(*m.client).socket();
  conn->upstream = &Lowest(*m.upstream).socket();
  if (conn->closed) co_return;
  TunnelTarget tunnel{target->host, target->port};
  LoopContext inner{this, conn, env, &tunnel};
  TlsUpstream tu;
  tu.stream = m.upstream.get();
  beast::flat_buffer tls_buffer;
  std::unique_ptr<http::request_parser<http::empty_body>> unused;
  std::optional<RequestTarget> unused_target;
  co_await RequestLoop(inner, *m.client, tls_buffer, tu, &unused, &unused_target);
  conn->client = nullptr;
  conn->upstream = nullptr;
  Lowest(*m.client).expires_after(std::chrono::seconds(2));
  co_await m.client->async_shutdown(kTuple);
}

awaitable<void> Proxy::Impl::AcceptLoop(std::shared_ptr<Env> env) {
  for (;;) {
    Strand strand = asio::make_strand(ioc);
    auto [ec, socket] = co_await env->acceptor->async_accept(strand, kTuple);
    if (env->closed || stopped) co_return;
    if (ec) {
      if (ec == asio::error::operation_aborted || ec == asio::error::bad_descriptor) co_return;
      // EMFILE and friends: back off instead of spinning.
      asio::steady_timer t(co_await asio::this_coro::executor, std::chrono::milliseconds(100));
      co_await t.async_wait(kTuple);
      continue;
    }
    auto conn = std::make_shared<Conn>(strand);
    conn->env = env;
    conn->tenant_slot = tenant_connections.Open(env->Config()->tenant);
    {
      std::lock_guard<std::mutex> lock(env->mu);
      if (env->conns.size() >= opts.max_connections_per_env ||
          connections.load() >= static_cast<int64_t>(opts.max_connections_total) ||
          !conn->tenant_slot.GrowTo(1)) {
        refused_connections.fetch_add(1);
        boost::system::error_code ignored;
        socket.close(ignored);  // over a cap: refused at once (the client sees a reset)
        continue;
      }
      env->conns.insert(conn);
    }
    connections.fetch_add(1);
    auto self = shared_from_this();
    asio::co_spawn(
        strand, Session(conn, std::move(socket)), [self, conn, env](std::exception_ptr e) {
          if (e) {
            try {
              std::rethrow_exception(e);
            } catch (const std::exception& ex) {
              LogWarn(absl::StrCat("esb-proxy: connection of ", env->id, " failed: ", ex.what()));
            }
          }
          {
            std::lock_guard<std::mutex> lock(env->mu);
            env->conns.erase(conn);
          }
          conn->tenant_slot.Release();
          self->connections.fetch_sub(1);
        });
  }
}

void Proxy::Impl::CloseEnv(const std::shared_ptr<Env>& env) {
  env->closed = true;
  asio::post(*env->accept_strand, [env] {
    boost::system::error_code ec;
    env->acceptor->close(ec);
  });
  std::set<std::shared_ptr<Conn>> conns;
  {
    std::lock_guard<std::mutex> lock(env->mu);
    conns = env->conns;
  }
  for (const auto& c : conns) {
    asio::post(c->strand, [c] { c->CloseOnStrand(); });
  }
}

// ---------------------------------------------------------------------------------------------

Proxy::Proxy(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

Proxy::~Proxy() { Stop(); }

absl::StatusOr<std::unique_ptr<Proxy>> Proxy::Create(ProxyOptions options,
                                                     std::shared_ptr<Resolver> resolver,
                                                     AuditSink audit) {
  auto impl = std::make_shared<Impl>(std::move(options));
  impl->resolver = std::move(resolver);
  impl->audit = std::move(audit);
  absl::StatusOr<std::shared_ptr<tls::UpstreamContext>> up =
      tls::UpstreamContext::Create(impl->opts.upstream_ca_file, impl->opts.use_system_roots);
  if (!up.ok()) return up.status();
  impl->upstream_tls = *std::move(up);
  impl->host_addresses =
      std::make_unique<HostAddresses>(impl->opts.host_addresses, impl->opts.host_addresses_refresh);
  if (absl::Status st = impl->host_addresses->Refresh(); !st.ok()) {
    return absl::InternalError(
        absl::StrCat("esb-proxy: cannot read the host's own addresses: ", st.message()));
  }
  impl->dlp_pool.emplace(FairPool::Options{impl->opts.dlp_threads,
                                           impl->opts.dlp_max_running_per_tenant,
                                           impl->opts.dlp_max_queued_per_tenant});
  impl->work.emplace(impl->ioc.get_executor());
  for (int i = 0; i < std::max(1, impl->opts.threads); ++i) {
    impl->threads.emplace_back([impl = impl.get()] { impl->ioc.run(); });
  }
  return std::unique_ptr<Proxy>(new Proxy(std::move(impl)));
}

void Proxy::Stop() {
  if (impl_->stopped.exchange(true)) return;
  std::map<std::string, std::shared_ptr<Env>, std::less<>> envs;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    envs.swap(impl_->envs);
  }
  for (auto& [id, env] : envs) impl_->CloseEnv(env);
  impl_->work.reset();
  impl_->ioc.stop();
  for (std::thread& t : impl_->threads) {
    if (t.joinable()) t.join();
  }
  // After the I/O threads: a scan that finishes now posts to a stopped io_context (dropped).
  if (impl_->dlp_pool) impl_->dlp_pool->Shutdown();
}

absl::Status Proxy::Attach(control::Attach attach) {
  UniqueFd fd = std::move(attach.received_listener);
  if (!fd) {
    // SECURITY: the proxy keeps its own copy of the listener; the caller still owns its fd.
    int dup = fcntl(attach.listener_fd, F_DUPFD_CLOEXEC, 0);
    if (dup < 0) return ErrnoStatus("dup listener");
    fd.reset(dup);
  }
  int accepting = 0, type = 0, domain = 0;
  socklen_t len = sizeof(int);
  if (getsockopt(fd.get(), SOL_SOCKET, SO_ACCEPTCONN, &accepting, &len) != 0 || !accepting ||
      getsockopt(fd.get(), SOL_SOCKET, SO_TYPE, &type, &len) != 0 || type != SOCK_STREAM ||
      getsockopt(fd.get(), SOL_SOCKET, SO_DOMAIN, &domain, &len) != 0 ||
      (domain != AF_INET && domain != AF_INET6)) {
    return absl::InvalidArgumentError("attach: the passed fd is not a listening TCP socket");
  }
  absl::StatusOr<std::shared_ptr<const EnvConfig>> cfg =
      MakeConfig(attach.env_id, attach.tenant, std::move(attach.policy), std::move(attach.intents));
  if (!cfg.ok()) return cfg.status();
  auto env = std::make_shared<Env>();
  env->id = attach.env_id;
  env->config = *std::move(cfg);
  if (!attach.ca_cert_pem.empty()) {
    absl::StatusOr<std::shared_ptr<const tls::Ca>> ca =
        tls::Ca::FromPem(attach.ca_cert_pem, attach.ca_key_pem);
    if (!ca.ok()) return ca.status();
    absl::StatusOr<std::shared_ptr<tls::LeafMinter>> minter = tls::LeafMinter::Create(*ca);
    if (!minter.ok()) return minter.status();
    absl::StatusOr<std::shared_ptr<tls::InterceptContext>> ic =
        tls::InterceptContext::Create(*std::move(minter));
    if (!ic.ok()) return ic.status();
    env->intercept = *std::move(ic);
  }
  env->accept_strand.emplace(asio::make_strand(impl_->ioc));
  env->acceptor = std::make_unique<tcp::acceptor>(*env->accept_strand);
  boost::system::error_code ec;
  env->acceptor->assign(domain == AF_INET ? tcp::v4() : tcp::v6(), fd.get(), ec);
  if (ec) return absl::InternalError(absl::StrCat("attach: ", ec.message()));
  fd.release();
  std::shared_ptr<Env> old;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    if (impl_->stopped) return absl::UnavailableError("proxy stopped");
    auto& slot = impl_->envs[env->id];
    old = std::move(slot);
    slot = env;
  }
  if (old) impl_->CloseEnv(old);
  asio::co_spawn(*env->accept_strand, impl_->AcceptLoop(env), asio::detached);
  return absl::OkStatus();
}

absl::Status Proxy::Update(const control::Update& update) {
  std::shared_ptr<Env> env;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    auto it = impl_->envs.find(update.env_id);
    if (it == impl_->envs.end()) {
      return absl::NotFoundError(
          absl::StrCat("update: environment ", update.env_id, " is not attached"));
    }
    env = it->second;
  }
  std::shared_ptr<const EnvConfig> cur = env->Config();
  absl::StatusOr<std::shared_ptr<const EnvConfig>> cfg =
      MakeConfig(cur->env_id, cur->tenant, update.policy, update.intents);
  if (!cfg.ok()) return cfg.status();
  std::lock_guard<std::mutex> lock(env->mu);
  env->config = *std::move(cfg);
  return absl::OkStatus();
}

absl::Status Proxy::Detach(std::string_view env_id) {
  std::shared_ptr<Env> env;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    auto it = impl_->envs.find(env_id);
    if (it == impl_->envs.end()) {
      return absl::NotFoundError(
          absl::StrCat("detach: environment ", AbslView(env_id), " is not attached"));
    }
    env = std::move(it->second);
    impl_->envs.erase(it);
  }
  impl_->CloseEnv(env);
  return absl::OkStatus();
}

control::Health Proxy::Health() const {
  control::Health h;
  h.pid = getpid();
  h.uptime_ms = MonotonicMs() - impl_->started_mono;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    h.environments = static_cast<int64_t>(impl_->envs.size());
  }
  h.connections = impl_->connections.load();
  h.requests_total = impl_->requests_total.load();
  h.blocked_total = impl_->blocked_total.load();
  h.refused_connections = impl_->refused_connections.load();
  h.refused_body_budget = impl_->refused_body_budget.load();
  h.refused_dlp_busy = impl_->refused_dlp_busy.load();
  h.refused_resolve_busy = impl_->refused_resolve_busy.load();
  h.body_buffered_bytes = impl_->body_budget.used();
  return h;
}

}  // namespace esb::governance::proxy
