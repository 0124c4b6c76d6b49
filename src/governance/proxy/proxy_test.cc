// esb-proxy end to end, in-process and as a subprocess, without root: the proxy serves a
// loopback listener the test attaches, names map to local upstreams on 127.0.0.1 through the
// resolver, and the upstreams record every request they receive (to prove blocked requests
// never arrived).
#include "governance/proxy/proxy.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/json.hpp>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <iostream>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "common/util.h"
#include "governance/control.h"
#include "governance/policy.h"
#include "governance/proxy/resolver.h"
#include "governance/tls/ca.h"
#include "gtest/gtest.h"
#include "storage/sqlite_store.h"

namespace esb::governance::proxy {
namespace {

namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;
using control::AuditEvent;

// ---- a recording HTTP upstream on 127.0.0.1:0 (thread per connection, Beast sync)

struct Received {
  std::string method, target, host, body;
  std::map<std::string, std::string> headers;  // lower-case names
};

class Upstream {
 public:
  using Handler = std::function<http::response<http::string_body>(const Received&)>;
  explicit Upstream(Handler handler = nullptr) : handler_(std::move(handler)) {
    acceptor_.open(tcp::v4());
    acceptor_.set_option(tcp::acceptor::reuse_address(true));
    acceptor_.bind(tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
    acceptor_.listen();
    port_ = acceptor_.local_endpoint().port();
    thread_ = std::thread([this] { AcceptLoop(); });
  }
  ~Upstream() {
    stopping_ = true;
    boost::system::error_code ec;
    ::shutdown(acceptor_.native_handle(), SHUT_RDWR);  // wakes the blocking accept()
    thread_.join();
    acceptor_.close(ec);
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& s : sockets_) s->shutdown(tcp::socket::shutdown_both, ec);
    }
    for (std::thread& t : conns_) t.join();
  }
  uint16_t port() const { return port_; }
  std::vector<Received> requests() {
    std::lock_guard<std::mutex> lock(mu_);
    return requests_;
  }
  int connections() const { return accepted_.load(); }
  // Everything the upstream received, raw (for "the secret never arrived").
  std::string raw() {
    std::lock_guard<std::mutex> lock(mu_);
    return raw_;
  }

 private:
  void AcceptLoop() {
    for (;;) {
      auto s = std::make_shared<tcp::socket>(ioc_);
      boost::system::error_code ec;
      acceptor_.accept(*s, ec);
      if (ec || stopping_) return;
      ++accepted_;
      std::lock_guard<std::mutex> lock(mu_);
      sockets_.push_back(s);
      conns_.emplace_back([this, s] { Serve(*s); });
    }
  }
  void Serve(tcp::socket& s) {
    beast::flat_buffer buf;
    for (;;) {
      http::request_parser<http::string_body> parser;
      parser.body_limit(boost::none);  // the proxy enforces the policy's cap, not the upstream
      boost::system::error_code ec;
      http::read(s, buf, parser, ec);
      if (ec) return;
      http::request<http::string_body> req = parser.release();
      Received r;
      r.method = std::string(req.method_string());
      r.target = std::string(req.target());
      r.body = req.body();
      for (const auto& f : req) {
        std::string n(f.name_string());
        for (char& c : n) c = static_cast<char>(tolower(c));
        r.headers[n] = std::string(f.value());
      }
      r.host = r.headers["host"];
      {
        std::lock_guard<std::mutex> lock(mu_);
        requests_.push_back(r);
        std::ostringstream os;
        os << req;
        raw_ += os.str();
      }
      http::response<http::string_body> res;
      if (handler_) {
        res = handler_(r);
      } else {
        res.result(200);
        res.set(http::field::content_type, "text/plain");
        res.body() = "hello from upstream " + r.target;
      }
      res.version(11);
      res.keep_alive(req.keep_alive());
      res.prepare_payload();
      http::write(s, res, ec);
      if (ec || !req.keep_alive()) return;
    }
  }

  Handler handler_;
  asio::io_context ioc_;
  tcp::acceptor acceptor_{ioc_};
  uint16_t port_ = 0;
  std::atomic<bool> stopping_{false};
  std::atomic<int> accepted_{0};
  std::thread thread_;
  std::mutex mu_;
  std::vector<std::shared_ptr<tcp::socket>> sockets_;
  std::vector<std::thread> conns_;
  std::vector<Received> requests_;
  std::string raw_;
};

// ---- the resolver the tests inject: names → endpoints, with or without "explicitly allowed"

class FakeResolver : public Resolver {
 public:
  void Map(std::string name, uint16_t port, bool overridden = true,
           std::string address = "127.0.0.1") {
    std::lock_guard<std::mutex> lock(mu_);
    map_[name] = {tcp::endpoint(asio::ip::make_address(address), port), overridden};
  }
  asio::awaitable<absl::StatusOr<Resolution>> Resolve(std::string host, uint16_t port) override {
    std::lock_guard<std::mutex> lock(mu_);
    ++lookups_;
    asked_.push_back(host);
    if (auto f = fail_.find(host); f != fail_.end()) co_return f->second;
    auto it = map_.find(host);
    if (it == map_.end()) co_return absl::NotFoundError("cannot resolve '" + host + "'");
    Resolution r;
    r.endpoints.push_back(it->second.first);
    r.overridden = it->second.second;
    co_return r;
  }

  // Lookups of `name` fail with `status` (until Map or Heal).
  void Fail(std::string name, absl::Status status) {
    std::lock_guard<std::mutex> lock(mu_);
    fail_[name] = std::move(status);
  }
  void Heal(const std::string& name) {
    std::lock_guard<std::mutex> lock(mu_);
    fail_.erase(name);
  }

  // How many lookups reached the resolver, and for which names.
  int lookups() {
    std::lock_guard<std::mutex> lock(mu_);
    return lookups_;
  }
  std::vector<std::string> asked() {
    std::lock_guard<std::mutex> lock(mu_);
    return asked_;
  }

 private:
  std::mutex mu_;
  std::map<std::string, std::pair<tcp::endpoint, bool>> map_;
  std::map<std::string, absl::Status> fail_;
  int lookups_ = 0;
  std::vector<std::string> asked_;
};

// ---- audit capture

class AuditLog {
 public:
  void Add(AuditEvent e) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      events_.push_back(std::move(e));
    }
    cv_.notify_all();
  }
  // Waits until at least n events arrived (2 s), returns them.
  std::vector<AuditEvent> WaitFor(size_t n) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, std::chrono::seconds(2), [&] { return events_.size() >= n; });
    return events_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<AuditEvent> events_;
};

// ---- a listener like the one esbd opens in the env's netns (here: loopback, port 0)

UniqueFd Listen(uint16_t* port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  EXPECT_EQ(listen(fd, 64), 0);
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  *port = ntohs(a.sin_port);
  return UniqueFd(fd);
}

EgressPolicy Policy(const std::string& json) {
  absl::StatusOr<EgressPolicy> p = ParseEgressPolicy(boost::json::parse(json));
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? *p : EgressPolicy{};
}

// ---- a client of the proxy (sync Beast over its own io_context)

class Client {
 public:
  explicit Client(uint16_t port) {
    socket_.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), port));
  }
  http::response<http::string_body> Send(http::request<http::string_body> req) {
    req.prepare_payload();
    http::write(socket_, req);
    return Read();
  }
  http::response<http::string_body> Get(const std::string& url) {
    http::request<http::string_body> req{http::verb::get, url, 11};
    req.set(http::field::host, HostOf(url));
    return Send(std::move(req));
  }
  void WriteRaw(std::string_view bytes) { asio::write(socket_, asio::buffer(bytes)); }
  http::response<http::string_body> Read() {
    http::response<http::string_body> res;
    boost::system::error_code ec;
    http::read(socket_, buf_, res, ec);
    if (ec) res.result(599);  // the proxy closed without an answer
    return res;
  }
  // Reads a CONNECT answer (no body).
  http::response<http::empty_body> ReadConnect() {
    http::response_parser<http::empty_body> p;
    p.skip(true);
    boost::system::error_code ec;
    http::read_header(socket_, buf_, p, ec);
    http::response<http::empty_body> res = p.release();
    if (ec) res.result(599);
    return res;
  }
  tcp::socket& socket() { return socket_; }
  beast::flat_buffer& buffer() { return buf_; }
  // True if the proxy closed the connection (EOF within 2 s).
  bool ClosedByPeer() {
    timeval tv{2, 0};
    setsockopt(socket_.native_handle(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    char c;
    return recv(socket_.native_handle(), &c, 1, 0) == 0;
  }

 private:
  static std::string HostOf(const std::string& url) {
    size_t s = url.find("://");
    std::string rest = url.substr(s + 3);
    return rest.substr(0, rest.find('/'));
  }
  asio::io_context ioc_;
  tcp::socket socket_{ioc_};
  beast::flat_buffer buf_;
};

// ---- fixture: an in-process proxy with one attached environment

class ProxyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    resolver_ = std::make_shared<FakeResolver>();
    ProxyOptions o;
    o.threads = 2;
    o.header_timeout = std::chrono::milliseconds(2000);
    o.idle_timeout = std::chrono::milliseconds(2000);
    o.use_system_roots = false;
    o.now_ms = [this] { return now_.load(); };
    // The host's own addresses: what a test sets (re-read on every check).
    o.host_addresses = [this]() -> absl::StatusOr<std::vector<asio::ip::address>> {
      std::lock_guard<std::mutex> lock(host_addresses_mu_);
      return host_addresses_;
    };
    o.host_addresses_refresh = std::chrono::milliseconds(0);
    absl::StatusOr<std::unique_ptr<Proxy>> p =
        Proxy::Create(o, resolver_, [this](AuditEvent e) { audit_.Add(std::move(e)); });
    ASSERT_TRUE(p.ok()) << p.status();
    proxy_ = *std::move(p);
  }

  void Attach(const std::string& policy_json, std::vector<ActiveIntent> intents = {}) {
    UniqueFd listener = Listen(&port_);
    control::Attach a;
    a.env_id = "env-1";
    a.tenant = "t1";
    a.policy = Policy(policy_json);
    a.intents = std::move(intents);
    a.listener_fd = listener.get();
    ASSERT_TRUE(proxy_->Attach(std::move(a)).ok());
  }

  void Update(const std::string& policy_json, std::vector<ActiveIntent> intents = {}) {
    control::Update u;
    u.env_id = "env-1";
    u.policy = Policy(policy_json);
    u.intents = std::move(intents);
    ASSERT_TRUE(proxy_->Update(u).ok());
  }

  void SetHostAddresses(const std::vector<std::string>& addresses) {
    std::lock_guard<std::mutex> lock(host_addresses_mu_);
    host_addresses_.clear();
    for (const std::string& a : addresses) host_addresses_.push_back(asio::ip::make_address(a));
  }

  std::mutex host_addresses_mu_;
  std::vector<asio::ip::address> host_addresses_;
  std::atomic<int64_t> now_{1'700'000'000'000};
  std::shared_ptr<FakeResolver> resolver_;
  AuditLog audit_;
  std::unique_ptr<Proxy> proxy_;
  uint16_t port_ = 0;
};

boost::json::object JsonBody(const http::response<http::string_body>& res) {
  boost::json::error_code ec;
  boost::json::value v = boost::json::parse(res.body(), ec);
  if (ec || !v.is_object()) return {};
  return v.as_object();
}

std::string Str(const boost::json::object& o, const char* key) {
  const boost::json::value* v = o.if_contains(key);
  return v && v->is_string() ? std::string(v->as_string()) : "";
}

TEST_F(ProxyTest, AllowedHostIsForwardedAndAudited) {
  Upstream up;
  resolver_->Map("weather.test", up.port());
  Attach(R"({"mode":"allowlist","allow":["weather.test"],"dlp":{"enabled":false}})");
  Client c(port_);
  auto res = c.Get("http://weather.test/forecast?city=paris");
  EXPECT_EQ(res.result_int(), 200);
  EXPECT_EQ(res.body(), "hello from upstream /forecast?city=paris");
  std::vector<Received> got = up.requests();
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].target, "/forecast?city=paris");  // origin-form upstream
  EXPECT_EQ(got[0].host, "weather.test");
  auto events = audit_.WaitFor(1);
  ASSERT_EQ(events.size(), 1u);
  const AuditEvent& e = events[0];
  EXPECT_EQ(e.env_id, "env-1");
  EXPECT_EQ(e.tenant, "t1");
  EXPECT_EQ(e.method, "GET");
  EXPECT_EQ(e.scheme, "http");
  EXPECT_EQ(e.host, "weather.test");
  EXPECT_EQ(e.port, 80);
  EXPECT_EQ(e.path, "/forecast?city=paris");
  EXPECT_EQ(e.status, 200);
  EXPECT_EQ(e.decision, "allowed");
  ASSERT_FALSE(e.rule_ids.empty());
  EXPECT_EQ(e.rule_ids[0], "allow:weather.test");
  EXPECT_EQ(e.bytes_down, static_cast<int64_t>(res.body().size()));
  EXPECT_EQ(e.time_ms, now_.load());
}

TEST_F(ProxyTest, DeniedHostGets403WithExplainingJsonAndNothingReachesUpstream) {
  Upstream up;
  resolver_->Map("evil.test", up.port());
  Attach(R"({"mode":"allowlist","allow":["weather.test"]})");
  Client c(port_);
  auto res = c.Get("http://evil.test/steal");
  EXPECT_EQ(res.result_int(), 403);
  EXPECT_EQ(std::string(res["X-Esb-Blocked"]), "not_allowed");
  EXPECT_EQ(std::string(res[http::field::content_type]), "application/json");
  boost::json::object body = JsonBody(res);
  EXPECT_EQ(Str(body, "error"), "egress_blocked");
  EXPECT_EQ(Str(body, "rule"), "not_allowed");
  EXPECT_EQ(Str(body, "host"), "evil.test");
  EXPECT_NE(Str(body, "reason").find("evil.test"), std::string::npos);
  EXPECT_NE(Str(body, "hint").find("will not help"), std::string::npos);
  EXPECT_EQ(up.connections(), 0);
  auto events = audit_.WaitFor(1);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].decision, "blocked");
  EXPECT_EQ(events[0].status, 403);
  EXPECT_EQ(events[0].rule_ids, std::vector<std::string>{"not_allowed"});
  // A policy block without a body keeps the connection usable.
  resolver_->Map("weather.test", up.port());
  EXPECT_EQ(c.Get("http://weather.test/").result_int(), 200);
}

TEST_F(ProxyTest, DenyWinsOverAllow) {
  Upstream up;
  resolver_->Map("bad.weather.test", up.port());
  resolver_->Map("api.weather.test", up.port());
  Attach(R"({"allow":["*.weather.test"],"deny":["bad.weather.test"]})");
  Client c(port_);
  auto res = c.Get("http://bad.weather.test/");
  EXPECT_EQ(res.result_int(), 403);
  EXPECT_EQ(std::string(res["X-Esb-Blocked"]), "deny:bad.weather.test");
  EXPECT_EQ(c.Get("http://api.weather.test/").result_int(), 200);
  EXPECT_EQ(up.requests().size(), 1u);
}

TEST_F(ProxyTest, WildcardMatchesSubdomainsNotTheApex) {
  Upstream up;
  resolver_->Map("weather.test", up.port());
  resolver_->Map("a.b.weather.test", up.port());
  Attach(R"({"allow":["*.weather.test"]})");
  Client c(port_);
  EXPECT_EQ(c.Get("http://a.b.weather.test/").result_int(), 200);
  EXPECT_EQ(c.Get("http://weather.test/").result_int(), 403);
}

TEST_F(ProxyTest, PortRuleAllowsOnlyThatPort) {
  Upstream up;
  resolver_->Map("weather.test", up.port());  // any requested port goes to the upstream
  Attach(R"({"allow":["weather.test:8080"]})");
  Client c(port_);
  EXPECT_EQ(c.Get("http://weather.test:8080/").result_int(), 200);
  auto res = c.Get("http://weather.test/");
  EXPECT_EQ(res.result_int(), 403);
  EXPECT_EQ(std::string(res["X-Esb-Blocked"]), "not_allowed");
}

TEST_F(ProxyTest, NameResolvingToPrivateAddressIsRefused) {
  Upstream up;
  // Resolved (not an override): 127.0.0.1 is loopback, refused even in mode open.
  resolver_->Map("internal.test", up.port(), /*overridden=*/false);
  resolver_->Map("metadata.test", 80, /*overridden=*/false, "169.254.169.254");
  Attach(R"({"mode":"open"})");
  Client c(port_);
  auto res = c.Get("http://internal.test/");
  EXPECT_EQ(res.result_int(), 403);
  EXPECT_EQ(std::string(res["X-Esb-Blocked"]), "addr:private");
  EXPECT_NE(Str(JsonBody(res), "reason").find("127.0.0.1"), std::string::npos);
  Client c2(port_);
  auto meta = c2.Get("http://metadata.test/latest/meta-data/");
  EXPECT_EQ(meta.result_int(), 403);
  EXPECT_EQ(std::string(meta["X-Esb-Blocked"]), "addr:private");
  EXPECT_EQ(up.connections(), 0);
  auto events = audit_.WaitFor(2);
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].decision, "blocked");
  EXPECT_EQ(events[0].rule_ids[0], "addr:private");
}

TEST_F(ProxyTest, IpLiteralIsJudgedAsAnIpRule) {
  Upstream up;
  std::string url = "http://127.0.0.1:" + std::to_string(up.port()) + "/";
  // A name rule does not cover an IP literal.
  Attach(R"({"allow":["weather.test"]})");
  {
    Client c(port_);
    auto res = c.Get(url);
    EXPECT_EQ(res.result_int(), 403);
    EXPECT_EQ(std::string(res["X-Esb-Blocked"]), "not_allowed");
  }
  // Mode open does not open private addresses.
  Update(R"({"mode":"open"})");
  {
    Client c(port_);
    auto res = c.Get(url);
    EXPECT_EQ(res.result_int(), 403);
    EXPECT_EQ(std::string(res["X-Esb-Blocked"]), "addr:private");
  }
  EXPECT_EQ(up.connections(), 0);
  // An allow rule naming the IP literal explicitly allows it.
  Update(R"({"allow":["127.0.0.1"]})");
  {
    Client c(port_);
    EXPECT_EQ(c.Get(url).result_int(), 200);
  }
}

TEST_F(ProxyTest, IntentAllowsOnlyUntilItExpiresEvenOnAKeptAliveConnection) {
  Upstream up;
  resolver_->Map("weather.test", up.port());
  ActiveIntent intent;
  intent.name = "check-weather";
  intent.allow.push_back(*ParseHostRule("weather.test"));
  intent.expires_ms = now_.load() + 1000;
  Attach(R"({"allow":[]})", {intent});
  Client c(port_);
  auto res = c.Get("http://weather.test/");
  EXPECT_EQ(res.result_int(), 200);
  now_ += 1000;  // expired AT expires_ms; same connection, next request
  auto later = c.Get("http://weather.test/");
  EXPECT_EQ(later.result_int(), 403);
  EXPECT_EQ(std::string(later["X-Esb-Blocked"]), "not_allowed");
  auto events = audit_.WaitFor(2);
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].rule_ids[0], "intent:check-weather");
  EXPECT_EQ(events[0].intents, std::vector<std::string>{"check-weather"});
  EXPECT_TRUE(events[1].intents.empty());
  EXPECT_EQ(up.requests().size(), 1u);
}

TEST_F(ProxyTest, UpdateRevokesOnTheNextKeptAliveRequest) {
  Upstream up;
  resolver_->Map("weather.test", up.port());
  Attach(R"({"allow":["weather.test"]})");
  Client c(port_);
  EXPECT_EQ(c.Get("http://weather.test/").result_int(), 200);
  Update(R"({"allow":["weather.test"],"deny":["weather.test"]})");
  auto res = c.Get("http://weather.test/");
  EXPECT_EQ(res.result_int(), 403);
  EXPECT_EQ(std::string(res["X-Esb-Blocked"]), "deny:weather.test");
}

TEST_F(ProxyTest, RedirectToDeniedHostIsCheckedAgain) {
  Upstream up([](const Received& r) {
    http::response<http::string_body> res{http::status::found, 11};
    res.set(http::field::location, "http://evil.test/collect");
    return res;
  });
  resolver_->Map("weather.test", up.port());
  resolver_->Map("evil.test", up.port());
  Attach(R"({"allow":["weather.test"]})");
  Client c(port_);
  auto res = c.Get("http://weather.test/go");
  EXPECT_EQ(res.result_int(), 302);
  std::string location(res[http::field::location]);
  EXPECT_EQ(location, "http://evil.test/collect");
  // The client follows the redirect: its second request is decided on its own.
  auto second = c.Get(location);
  EXPECT_EQ(second.result_int(), 403);
  EXPECT_EQ(std::string(second["X-Esb-Blocked"]), "not_allowed");
  EXPECT_EQ(up.requests().size(), 1u);
}

TEST_F(ProxyTest, PostBodyIsForwardedWithLengthAndHopByHopHeadersRemoved) {
  Upstream up;
  resolver_->Map("weather.test", up.port());
  Attach(R"({"allow":["weather.test"],"dlp":{"enabled":false}})");
  Client c(port_);
  http::request<http::string_body> req{http::verb::post, "http://weather.test/submit", 11};
  req.set(http::field::host, "weather.test");
  req.set("Proxy-Authorization", "Basic c2VjcmV0");
  req.set(http::field::connection, "keep-alive, X-Private");
  req.set("X-Private", "hop");
  req.chunked(true);
  req.body() = "a=1&b=2";
  auto res = c.Send(std::move(req));
  EXPECT_EQ(res.result_int(), 200);
  auto got = up.requests();
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].body, "a=1&b=2");
  EXPECT_EQ(got[0].headers["content-length"], "7");
  EXPECT_EQ(got[0].headers.count("transfer-encoding"), 0u);
  EXPECT_EQ(got[0].headers.count("proxy-authorization"), 0u);
  EXPECT_EQ(got[0].headers.count("x-private"), 0u);
  auto events = audit_.WaitFor(1);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].request_body, "a=1&b=2");
  EXPECT_EQ(events[0].bytes_up, 7);
  EXPECT_EQ(events[0].request_body_sha256, Sha256Hex("a=1&b=2"));
  // Credential headers are masked in the audit.
  EXPECT_EQ(events[0].request_headers.find("c2VjcmV0"), std::string::npos);
}

TEST_F(ProxyTest, BodyOverThePolicyCapIsRefusedAndNothingReachesUpstream) {
  Upstream up;
  resolver_->Map("weather.test", up.port());
  Attach(R"({"allow":["weather.test"],"max_body_bytes":1024,"dlp":{"enabled":false}})");
  Client c(port_);
  http::request<http::string_body> req{http::verb::post, "http://weather.test/upload", 11};
  req.set(http::field::host, "weather.test");
  req.body() = std::string(4096, 'x');
  auto res = c.Send(std::move(req));
  EXPECT_EQ(res.result_int(), 413);
  EXPECT_EQ(up.connections(), 0);
}

TEST_F(ProxyTest, MalformedHeadsGet4xxNotACrash) {
  Attach(R"({"mode":"open"})");
  struct Case {
    const char* raw;
    int status;
  } cases[] = {
      {"GET /relative HTTP/1.1\r\nHost: x\r\n\r\n", 400},  // origin-form on the proxy port
      {"GET https://weather.test/ HTTP/1.1\r\nHost: weather.test\r\n\r\n", 400},
      {"GET http://user:pw@weather.test/ HTTP/1.1\r\nHost: weather.test\r\n\r\n", 400},
      {"POST http://w.test/ HTTP/1.1\r\nHost: w.test\r\nContent-Length: 1\r\n"
       "Transfer-Encoding: chunked\r\n\r\n",
       400},
      {"GET http://w.test/ HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400},
      {"GET http://w.test/ HTTP/1.1\r\nHost: w.test\r\nX: a\r\n folded\r\n\r\n", 400},
      {"GET http://w.test/ HTTP/1.1\r\nHost: w.test\r\nUpgrade: websocket\r\n"
       "Connection: Upgrade\r\n\r\n",
       501},
      {"CONNECT weather.test HTTP/1.1\r\nHost: weather.test\r\n\r\n", 400},
      {"GARBAGE\r\n\r\n", 400},
  };
  for (const Case& k : cases) {
    Client c(port_);
    c.WriteRaw(k.raw);
    auto res = c.Read();
    EXPECT_EQ(res.result_int(), k.status) << k.raw;
  }
  // An over-long head: 431.
  Client c(port_);
  c.WriteRaw("GET http://w.test/ HTTP/1.1\r\nX: " + std::string(20000, 'a') + "\r\n\r\n");
  EXPECT_EQ(c.Read().result_int(), 431);
}

TEST_F(ProxyTest, ConnectToDeniedHostIsRefusedAndAudited) {
  Attach(R"({"allow":["weather.test"]})");
  Client c(port_);
  c.WriteRaw("CONNECT evil.test:443 HTTP/1.1\r\nHost: evil.test:443\r\n\r\n");
  auto res = c.Read();
  EXPECT_EQ(res.result_int(), 403);
  EXPECT_EQ(std::string(res["X-Esb-Blocked"]), "not_allowed");
  auto events = audit_.WaitFor(1);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].method, "CONNECT");
  EXPECT_EQ(events[0].host, "evil.test");
  EXPECT_EQ(events[0].port, 443);
  EXPECT_EQ(events[0].decision, "blocked");
}

TEST_F(ProxyTest, OpaqueTunnelRelaysBytesAndIsAuditedAsOpaque) {
  // A raw TCP echo upstream.
  asio::io_context ioc;
  tcp::acceptor acc(ioc, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
  std::thread echo([&] {
    tcp::socket s(ioc);
    acc.accept(s);
    char buf[256];
    boost::system::error_code ec;
    size_t n = s.read_some(asio::buffer(buf), ec);
    if (!ec) asio::write(s, asio::buffer(buf, n), ec);
  });
  resolver_->Map("pinned.test", acc.local_endpoint().port());
  Attach(R"({"allow":["pinned.test"],"tls_inspect":false})");
  {
    Client c(port_);
    c.WriteRaw("CONNECT pinned.test:443 HTTP/1.1\r\nHost: pinned.test:443\r\n\r\n");
    EXPECT_EQ(c.ReadConnect().result_int(), 200);
    c.WriteRaw("ping-through-tunnel");
    char buf[64];
    size_t n = asio::read(c.socket(), asio::buffer(buf, 19));
    EXPECT_EQ(std::string(buf, n), "ping-through-tunnel");
  }
  echo.join();
  auto events = audit_.WaitFor(1);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].decision, "opaque");
  EXPECT_EQ(events[0].scheme, "tunnel");
  EXPECT_EQ(events[0].bytes_up, 19);
  EXPECT_EQ(events[0].bytes_down, 19);
  EXPECT_EQ(events[0].rule_ids[0], "allow:pinned.test");
}

// Attack: open an opaque tunnel while an intent allows the host and keep it busy after the
// intent expires (or after PUT /network revoked the host). Nothing inside an opaque tunnel is
// re-decided per request, so the tunnel itself is closed within about a second.
TEST_F(ProxyTest, OpaqueTunnelIsClosedOnceThePolicyNoLongerAllowsIt) {
  asio::io_context ioc;
  tcp::acceptor acc(ioc, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
  std::thread echo([&] {
    tcp::socket s(ioc);
    acc.accept(s);
    char buf[256];
    boost::system::error_code ec;
    for (;;) {
      size_t n = s.read_some(asio::buffer(buf), ec);
      if (ec) break;
      asio::write(s, asio::buffer(buf, n), ec);
      if (ec) break;
    }
  });
  resolver_->Map("pinned.test", acc.local_endpoint().port());
  Attach(R"({"allow":["pinned.test"],"tls_inspect":false})");
  Client c(port_);
  c.WriteRaw("CONNECT pinned.test:443 HTTP/1.1\r\nHost: pinned.test:443\r\n\r\n");
  ASSERT_EQ(c.ReadConnect().result_int(), 200);
  c.WriteRaw("before");
  char buf[64];
  ASSERT_EQ(asio::read(c.socket(), asio::buffer(buf, 6)), 6u);
  Update(R"({"allow":["other.test"],"tls_inspect":false})");
  // The proxy closes the tunnel: a read ends (EOF or reset) within a few seconds although the
  // echo upstream would keep answering.
  auto start = std::chrono::steady_clock::now();
  boost::system::error_code ec;
  for (int i = 0; i < 50 && !ec; ++i) {
    asio::write(c.socket(), asio::buffer("x", 1), ec);
    if (!ec) c.socket().read_some(asio::buffer(buf, 1), ec);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(ec) << "the tunnel was still open 5 s after the policy revoked its host";
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(4));
  c.socket().close();
  acc.close();
  echo.join();
  auto events = audit_.WaitFor(1);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].decision, "opaque");
  EXPECT_NE(std::find(events[0].rule_ids.begin(), events[0].rule_ids.end(), "revoked"),
            events[0].rule_ids.end());
}

TEST_F(ProxyTest, DetachClosesTheListenerAndLiveConnections) {
  Upstream up;
  resolver_->Map("weather.test", up.port());
  Attach(R"({"allow":["weather.test"]})");
  Client c(port_);
  EXPECT_EQ(c.Get("http://weather.test/").result_int(), 200);
  ASSERT_TRUE(proxy_->Detach("env-1").ok());
  EXPECT_TRUE(c.ClosedByPeer());
  EXPECT_TRUE(absl::IsNotFound(proxy_->Detach("env-1")));
  EXPECT_EQ(proxy_->Health().environments, 0);
}

TEST_F(ProxyTest, PerEnvironmentConnectionCap) {
  resolver_ = std::make_shared<FakeResolver>();
  ProxyOptions o;
  o.max_connections_per_env = 2;
  o.use_system_roots = false;
  auto p = Proxy::Create(o, resolver_, nullptr);
  ASSERT_TRUE(p.ok());
  proxy_ = *std::move(p);
  Attach(R"({"mode":"open"})");
  Client a(port_), b(port_);
  // Let the proxy accept both before the third.
  for (int i = 0; i < 100 && proxy_->Health().connections < 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_EQ(proxy_->Health().connections, 2);
  Client third(port_);
  EXPECT_TRUE(third.ClosedByPeer());
}

// ---- fair shares between tenants (ProxyOptions: body budget, DLP pool, resolutions, tenant
// connection cap). Each test performs the abuse from tenant A and asserts tenant B is unaffected.

class FairShareTest : public ProxyTest {
 protected:
  void Start(ProxyOptions o, std::shared_ptr<Resolver> resolver = nullptr) {
    proxy_.reset();
    o.use_system_roots = false;
    o.header_timeout = std::chrono::milliseconds(5000);
    o.idle_timeout = std::chrono::milliseconds(5000);
    absl::StatusOr<std::unique_ptr<Proxy>> p = Proxy::Create(
        o, resolver ? resolver : resolver_, [this](AuditEvent e) { audit_.Add(std::move(e)); });
    ASSERT_TRUE(p.ok()) << p.status();
    proxy_ = *std::move(p);
  }
  uint16_t AttachEnv(const std::string& env, const std::string& tenant,
                     const std::string& policy_json) {
    uint16_t port = 0;
    UniqueFd listener = Listen(&port);
    control::Attach a;
    a.env_id = env;
    a.tenant = tenant;
    a.policy = Policy(policy_json);
    a.listener_fd = listener.get();
    EXPECT_TRUE(proxy_->Attach(std::move(a)).ok());
    return port;
  }
  template <class F>
  static bool WaitUntil(F done, int ms = 5000) {
    for (int i = 0; i < ms / 5; ++i) {
      if (done()) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return done();
  }
  static int64_t MsSince(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() -
                                                                 t0)
        .count();
  }
  static http::request<http::string_body> Post(const std::string& url, std::string body,
                                               bool chunked = false) {
    http::request<http::string_body> req{http::verb::post, url, 11};
    req.set(http::field::host, "weather.test");
    req.body() = std::move(body);
    if (chunked) req.chunked(true);
    return req;
  }
};

TEST_F(FairShareTest, TenantHoldingItsBodyBudgetGets503AndAnotherTenantIsServed) {
  Upstream up;
  resolver_->Map("weather.test", up.port());
  ProxyOptions o;
  o.body_budget_bytes = 3 << 20;
  o.body_budget_per_tenant_bytes = 1 << 20;
  Start(o);
  const std::string policy = R"({"allow":["weather.test"],"dlp":{"enabled":false}})";
  uint16_t pa = AttachEnv("env-a", "ta", policy);
  uint16_t pb = AttachEnv("env-b", "tb", policy);
  // Attack: A announces two 512 KiB bodies, sends two bytes of each and stalls: the proxy holds
  // A's whole share for them.
  const std::string stall =
      "POST http://weather.test/slow HTTP/1.1\r\nHost: weather.test\r\n"
      "Content-Length: 524288\r\n\r\nxx";
  Client h1(pa), h2(pa);
  h1.WriteRaw(stall);
  h2.WriteRaw(stall);
  ASSERT_TRUE(WaitUntil([&] { return proxy_->Health().body_buffered_bytes == (1 << 20); }))
      << proxy_->Health().body_buffered_bytes;
  // A's next body is refused at once (503, Retry-After, the reason as JSON) ...
  auto t0 = std::chrono::steady_clock::now();
  Client a3(pa);
  a3.WriteRaw(
      "POST http://weather.test/more HTTP/1.1\r\nHost: weather.test\r\n"
      "Content-Length: 1000\r\n\r\n");
  auto res = a3.Read();
  EXPECT_EQ(res.result_int(), 503);
  EXPECT_EQ(std::string(res[http::field::retry_after]), "1");
  EXPECT_EQ(Str(JsonBody(res), "rule"), "limit:body_budget");
  EXPECT_LT(MsSince(t0), 1000);
  // ... and so is a chunked one, as soon as its first chunk does not fit.
  Client a4(pa);
  a4.WriteRaw(
      "POST http://weather.test/more HTTP/1.1\r\nHost: weather.test\r\n"
      "Transfer-Encoding: chunked\r\n\r\n10\r\n0123456789abcdef\r\n");
  res = a4.Read();
  EXPECT_EQ(res.result_int(), 503);
  EXPECT_EQ(Str(JsonBody(res), "rule"), "limit:body_budget");
  // B is unaffected: its own share, Content-Length and chunked.
  Client b(pb);
  EXPECT_EQ(b.Send(Post("http://weather.test/b1", std::string(900 << 10, 'b'))).result_int(), 200);
  EXPECT_EQ(b.Send(Post("http://weather.test/b2", std::string(900 << 10, 'c'), true)).result_int(),
            200);
  // A body larger than a tenant's whole share can never fit: 413, not "retry".
  Client b3(pb);
  b3.WriteRaw(
      "POST http://weather.test/huge HTTP/1.1\r\nHost: weather.test\r\n"
      "Content-Length: 2097152\r\n\r\n");
  res = b3.Read();
  EXPECT_EQ(res.result_int(), 413);
  EXPECT_EQ(Str(JsonBody(res), "rule"), "limit:body_budget");
  // A's stalled clients go away: their reservations are released (disconnect path), and A is
  // served again.
  h1.socket().close();
  h2.socket().close();
  ASSERT_TRUE(WaitUntil([&] { return proxy_->Health().body_buffered_bytes == 0; }))
      << proxy_->Health().body_buffered_bytes;
  Client a5(pa);
  EXPECT_EQ(a5.Send(Post("http://weather.test/a5", std::string(900 << 10, 'a'))).result_int(), 200);
  EXPECT_EQ(proxy_->Health().body_buffered_bytes, 0);  // released after the upstream write
  EXPECT_EQ(proxy_->Health().refused_body_budget, 3);
  int bodies_b = 0;
  for (const Received& r : up.requests()) bodies_b += r.target == "/b1" || r.target == "/b2";
  EXPECT_EQ(bodies_b, 2);
  // The refusals are audited like any other.
  int audited = 0;
  for (const AuditEvent& e : audit_.WaitFor(8)) {
    if (!e.rule_ids.empty() && e.rule_ids[0] == "limit:body_budget") {
      ++audited;
      EXPECT_EQ(e.decision, "error");
    }
  }
  EXPECT_EQ(audited, 3);
}

// A reservation is given back on the paths where nobody closes anything: the body deadline
// passes on a stalled body, and the environment is detached under a stalled body.
TEST_F(FairShareTest, StalledBodyReservationIsReleasedAtTheBodyDeadlineAndOnDetach) {
  Upstream up;
  resolver_->Map("weather.test", up.port());
  ProxyOptions o;
  o.body_timeout = std::chrono::milliseconds(300);
  Start(o);
  const std::string policy = R"({"allow":["weather.test"],"dlp":{"enabled":false}})";
  uint16_t pa = AttachEnv("env-a", "ta", policy);
  const std::string stall =
      "POST http://weather.test/slow HTTP/1.1\r\nHost: weather.test\r\n"
      "Content-Length: 100000\r\n\r\nxx";
  Client c1(pa);
  c1.WriteRaw(stall);
  ASSERT_TRUE(WaitUntil([&] { return proxy_->Health().body_buffered_bytes == 100000; }));
  ASSERT_TRUE(WaitUntil([&] { return proxy_->Health().body_buffered_bytes == 0; }, 3000))
      << "not released at the body deadline";
  EXPECT_TRUE(c1.ClosedByPeer());
  // Detach under a stalled body (a long deadline this time).
  o.body_timeout = std::chrono::milliseconds(60000);
  Start(o);
  pa = AttachEnv("env-a", "ta", policy);
  Client c2(pa);
  c2.WriteRaw(stall);
  ASSERT_TRUE(WaitUntil([&] { return proxy_->Health().body_buffered_bytes == 100000; }));
  ASSERT_TRUE(proxy_->Detach("env-a").ok());
  EXPECT_TRUE(WaitUntil([&] { return proxy_->Health().body_buffered_bytes == 0; }, 3000))
      << "not released on detach";
}

// Attack: tenant A floods the proxy with large bodies, each a long scan, while tenant B sends
// small requests. Every large body's scan is made 150 ms long (a hook that sleeps: the machine is
// shared and noisy, a sleep is not), and B's latency is compared with a baseline measured in the
// same run under the same flood: the same proxy running every scan inline on its one I/O thread.
// The pooled scans must keep B well under that baseline.
TEST_F(FairShareTest, TenantFloodingDlpWithLargeBodiesDoesNotStallAnotherTenant) {
  Upstream up;
  resolver_->Map("weather.test", up.port());
  const std::string big(1 << 20, 'x');  // A's bodies: over dlp_inline_bytes
  struct Outcome {
    int64_t median = 0, max = 0;
    int a_ok = 0, a_busy = 0, a_other = 0;
    int64_t refused_dlp_busy = 0;
  };
  auto flood_and_sample = [&](bool inline_scans) {
    ProxyOptions o;
    o.threads = 1;  // one I/O thread: a scan run on it stalls every connection
    o.dlp_threads = 2;
    o.dlp_max_running_per_tenant = 1;
    o.dlp_max_queued_per_tenant = 1;
    if (inline_scans) o.dlp_inline_bytes = SIZE_MAX;
    o.body_work_hook_for_test = [](size_t bytes) {
      if (bytes >= (1u << 20)) std::this_thread::sleep_for(std::chrono::milliseconds(150));
    };
    Start(o);
    const std::string policy = R"({"allow":["weather.test"]})";  // DLP on (default rules)
    uint16_t pa = AttachEnv("env-a", "ta", policy);
    uint16_t pb = AttachEnv("env-b", "tb", policy);
    std::atomic<bool> stop{false};
    std::atomic<int> a_ok{0}, a_busy{0}, a_other{0};
    std::vector<std::thread> flood;
    for (int t = 0; t < 4; ++t) {
      flood.emplace_back([&] {
        while (!stop) {
          http::response<http::string_body> r;
          try {
            Client c(pa);
            r = c.Send(Post("http://weather.test/big", big));
          } catch (const std::exception& e) {
            if (stop) break;  // the proxy restarts for the next round
            std::cout << "A's request failed: " << e.what() << "\n";
            ++a_other;
            continue;
          }
          if (r.result_int() == 200) {
            ++a_ok;
          } else if (r.result_int() == 503 && Str(JsonBody(r), "rule") == "limit:dlp_busy") {
            ++a_busy;
          } else {
            std::cout << "A got " << r.result_int() << ": " << Str(JsonBody(r), "rule") << "\n";
            ++a_other;
          }
        }
      });
    }
    // A is flooding (its scans run; those over its queue share are refused with
    // limit:dlp_busy when enough of them overlap: FairPoolTest pins that bound).
    EXPECT_TRUE(WaitUntil([&] { return a_ok >= 3; }, 20000))
        << a_ok << " ok, " << a_busy << " busy, " << a_other << " other";
    // B: small requests (scanned inline) on one kept-alive connection.
    std::vector<int64_t> latencies;
    Client b(pb);
    for (int i = 0; i < 20; ++i) {
      auto t0 = std::chrono::steady_clock::now();
      auto r = b.Send(Post("http://weather.test/small", "{\"q\":\"weather in Paris\"}"));
      latencies.push_back(MsSince(t0));
      EXPECT_EQ(r.result_int(), 200);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));  // sample the whole flood
    }
    stop = true;
    for (std::thread& t : flood) t.join();
    std::sort(latencies.begin(), latencies.end());
    Outcome out{latencies[latencies.size() / 2],
                latencies.back(),
                a_ok.load(),
                a_busy.load(),
                a_other.load(),
                proxy_->Health().refused_dlp_busy};
    std::cout << (inline_scans ? "inline scans" : "pooled scans") << ": B latency ms median "
              << out.median << ", max " << out.max << "; A: " << out.a_ok << " ok, " << out.a_busy
              << " dlp_busy, " << out.a_other << " other\n";
    return out;
  };
  Outcome inline_scans = flood_and_sample(true);
  Outcome pooled = flood_and_sample(false);
  EXPECT_LT(pooled.median * 2, inline_scans.median) << "B waits behind A's scans";
  EXPECT_EQ(pooled.a_other, 0);
  EXPECT_GE(pooled.refused_dlp_busy, pooled.a_busy);
}

TEST_F(FairShareTest, EnvironmentResolvingManySlowNamesGetsBusyAndAnotherTenantStillResolves) {
  Upstream up;
  SystemResolver::Options ro;
  ro.threads = 2;
  ro.max_running_per_tenant = 1;
  ro.max_queued_per_tenant = 2;
  ro.timeout = std::chrono::milliseconds(6000);
  const uint16_t up_port = up.port();
  ro.lookup = [up_port](const std::string& host, uint16_t) -> absl::StatusOr<Resolution> {
    if (host.rfind("slow", 0) == 0) {
      // Long enough that every attacking request arrives while the first ones are still in
      // flight, even on a loaded machine (at 700 ms a late thread found a slot freed).
      std::this_thread::sleep_for(std::chrono::milliseconds(2500));
      return absl::NotFoundError("cannot resolve '" + host + "'");
    }
    Resolution r;
    r.endpoints.emplace_back(asio::ip::make_address("127.0.0.1"), up_port);
    r.overridden = true;  // a local test upstream
    return r;
  };
  auto resolver = std::make_shared<SystemResolver>(ro);
  ProxyOptions o;
  o.max_resolutions_per_env = 3;
  o.max_resolutions_per_tenant = 5;
  Start(o, resolver);
  uint16_t pa1 = AttachEnv("env-a1", "ta", R"({"mode":"open"})");
  uint16_t pa2 = AttachEnv("env-a2", "ta", R"({"mode":"open"})");
  uint16_t pb = AttachEnv("env-b", "tb", R"({"mode":"open"})");
  // Attack: env-a1 resolves 8 slow names at once, env-a2 (same tenant) 4 more.
  std::mutex mu;
  std::vector<std::pair<std::string, int64_t>> busy;  // (env, ms) of each resolve:busy
  std::vector<std::thread> attack;
  auto slow = [&](uint16_t port, std::string env, int i) {
    auto t0 = std::chrono::steady_clock::now();
    Client c(port);
    auto r = c.Get("http://slow" + std::to_string(i) + ".test/");
    if (r.result_int() == 503 && Str(JsonBody(r), "rule") == "resolve:busy") {
      std::lock_guard<std::mutex> lock(mu);
      busy.emplace_back(env, MsSince(t0));
    }
  };
  for (int i = 0; i < 8; ++i) attack.emplace_back(slow, pa1, "env-a1", i);
  ASSERT_TRUE(WaitUntil([&] { return proxy_->Health().refused_resolve_busy >= 5; }));
  for (int i = 0; i < 4; ++i) attack.emplace_back(slow, pa2, "env-a2", 100 + i);
  ASSERT_TRUE(WaitUntil([&] { return proxy_->Health().refused_resolve_busy >= 7; }));
  // B resolves at once: A holds at most one of the two resolver threads.
  auto t0 = std::chrono::steady_clock::now();
  Client b(pb);
  EXPECT_EQ(b.Get("http://fast.test/").result_int(), 200);
  int64_t b_ms = MsSince(t0);
  for (std::thread& t : attack) t.join();
  std::cout << "B resolved in " << b_ms << " ms while A's slow names were pending\n";
  EXPECT_LT(b_ms, 500);
  int a1 = 0, a2 = 0;
  for (const auto& [env, ms] : busy) {
    (env == "env-a1" ? a1 : a2)++;
    EXPECT_LT(ms, 500) << env;  // refused quickly, not after waiting for a thread
  }
  EXPECT_EQ(a1, 5);  // over the environment's 3 in flight
  EXPECT_GE(a2, 2);  // over the tenant's share (5 in flight at the proxy, 1+2 in the resolver)
}

TEST_F(FairShareTest, TenantConnectionCapSpansItsEnvironments) {
  Upstream up;
  resolver_->Map("weather.test", up.port());
  ProxyOptions o;
  o.max_connections_per_env = 4;
  o.max_connections_per_tenant = 3;
  Start(o);
  uint16_t pa1 = AttachEnv("env-a1", "ta", R"({"mode":"open"})");
  uint16_t pa2 = AttachEnv("env-a2", "ta", R"({"mode":"open"})");
  uint16_t pb = AttachEnv("env-b", "tb", R"({"mode":"open"})");
  // Attack: A opens connections from two environments, each under its per-env cap.
  Client a1(pa1), a2(pa1), a3(pa2);
  ASSERT_TRUE(WaitUntil([&] { return proxy_->Health().connections == 3; }));
  Client a4(pa2);
  EXPECT_TRUE(a4.ClosedByPeer());
  EXPECT_EQ(proxy_->Health().refused_connections, 1);
  Client b(pb);
  EXPECT_EQ(b.Get("http://weather.test/").result_int(), 200);
}

TEST_F(ProxyTest, AttachRefusesAnFdThatIsNotAListener) {
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  control::Attach a;
  a.env_id = "env-x";
  a.listener_fd = sv[0];
  absl::Status s = proxy_->Attach(std::move(a));
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  close(sv[0]);
  close(sv[1]);
}

// ---- esb-proxy as a subprocess, driven through the control protocol like esbd does

TEST(EsbProxyProcessTest, AttachServeAuditAndExitWhenControlCloses) {
  Upstream up;
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  std::string resolve = "weather.test=127.0.0.1:" + std::to_string(up.port());
  std::string binary = ESB_PROXY_BINARY;
  ASSERT_EQ(access(binary.c_str(), X_OK), 0) << binary << " is not built";
  pid_t pid = fork();
  if (pid == 0) {
    int fd = dup(sv[1]);  // without CLOEXEC
    std::string fd_text = std::to_string(fd);
    execl(binary.c_str(), binary.c_str(), "--control-fd", fd_text.c_str(), "--egress-resolve",
          resolve.c_str(), "--threads", "1", nullptr);
    _exit(127);
  }
  close(sv[1]);
  std::mutex mu;
  std::condition_variable cv;
  std::vector<AuditEvent> events;
  std::vector<control::Result> results;
  int healths = 0;
  bool closed = false;
  control::ControlClient::Callbacks cb;
  cb.on_audit = [&](AuditEvent e) {
    std::lock_guard<std::mutex> l(mu);
    events.push_back(std::move(e));
    cv.notify_all();
  };
  cb.on_health = [&](const control::Health& h) {
    std::lock_guard<std::mutex> l(mu);
    ++healths;
    cv.notify_all();
  };
  cb.on_result = [&](const control::Result& r) {
    std::lock_guard<std::mutex> l(mu);
    results.push_back(r);
    cv.notify_all();
  };
  cb.on_closed = [&](const absl::Status&) {
    std::lock_guard<std::mutex> l(mu);
    closed = true;
    cv.notify_all();
  };
  auto client = std::make_unique<control::ControlClient>(UniqueFd(sv[0]), cb);
  auto wait = [&](auto pred) {
    std::unique_lock<std::mutex> l(mu);
    return cv.wait_for(l, std::chrono::seconds(5), pred);
  };
  EXPECT_TRUE(wait([&] { return healths >= 1; })) << "no health report at start";

  uint16_t port = 0;
  UniqueFd listener = Listen(&port);
  control::Attach a;
  a.env_id = "env-p";
  a.tenant = "t";
  a.policy = Policy(R"({"allow":["weather.test"],"dlp":{"enabled":false}})");
  a.listener_fd = listener.get();
  absl::StatusOr<uint32_t> seq = client->Attach(a);
  ASSERT_TRUE(seq.ok()) << seq.status();
  listener.reset();  // the proxy holds its own copy now
  ASSERT_TRUE(wait([&] { return !results.empty(); }));
  EXPECT_EQ(results[0].seq, *seq);
  EXPECT_TRUE(results[0].ok) << results[0].error;
  {
    Client c(port);
    EXPECT_EQ(c.Get("http://weather.test/x").result_int(), 200);
    EXPECT_EQ(c.Get("http://evil.test/x").result_int(), 403);
  }
  ASSERT_TRUE(wait([&] { return events.size() >= 2; }));
  EXPECT_EQ(events[0].env_id, "env-p");
  EXPECT_EQ(events[0].decision, "allowed");
  EXPECT_EQ(events[1].decision, "blocked");

  // Update over the control socket: now weather.test is denied too.
  control::Update u{"env-p", Policy(R"({"allow":["weather.test"],"deny":["weather.test"]})"), {}};
  ASSERT_TRUE(client->Update(u).ok());
  ASSERT_TRUE(wait([&] { return results.size() >= 2; }));
  EXPECT_TRUE(results[1].ok);
  {
    Client c(port);
    EXPECT_EQ(c.Get("http://weather.test/x").result_int(), 403);
  }
  // Updating an unknown env is an error result, not a crash.
  ASSERT_TRUE(client->Update(control::Update{"nope", Policy("{}"), {}}).ok());
  ASSERT_TRUE(wait([&] { return results.size() >= 3; }));
  EXPECT_FALSE(results[2].ok);

  // esbd goes away: the proxy exits and the sandbox's listener is closed (fail closed).
  client.reset();
  int status = 0;
  pid_t r = 0;
  for (int i = 0; i < 500 && (r = waitpid(pid, &status, WNOHANG)) == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (r == 0) {
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
  }
  EXPECT_EQ(r, pid) << "esb-proxy did not exit when the control socket closed";
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  int probe = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(port);
  EXPECT_NE(connect(probe, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  EXPECT_EQ(errno, ECONNREFUSED);
  close(probe);
}

}  // namespace
}  // namespace esb::governance::proxy

namespace esb::governance::proxy {
namespace {

constexpr char kCard[] = "4111 1111 1111 1111";       // Luhn-valid test card
constexpr char kAwsKeyId[] = "AKIAQ2WE3RT4YU5I6PAZ";  // shape of a real key id (not EXAMPLE)

TEST_F(ProxyTest, DlpBlocksACardInAPlainHttpBodyAndUpstreamReceivesNothing) {
  Upstream up;
  resolver_->Map("weather.test", up.port());
  Attach(R"({"allow":["weather.test"]})");
  Client c(port_);
  http::request<http::string_body> req{http::verb::post, "http://weather.test/pay", 11};
  req.set(http::field::host, "weather.test");
  req.set(http::field::content_type, "application/json");
  req.body() = std::string(R"({"note":"hi","card":")") + kCard + "\"}";
  auto res = c.Send(std::move(req));
  EXPECT_EQ(res.result_int(), 403);
  EXPECT_EQ(std::string(res["X-Esb-Blocked"]), "dlp:credit_card");
  EXPECT_EQ(Str(JsonBody(res), "error"), "egress_blocked");
  EXPECT_EQ(up.connections(), 0);
  EXPECT_EQ(up.raw().find("4111"), std::string::npos);
  auto events = audit_.WaitFor(1);
  ASSERT_EQ(events.size(), 1u);
  const AuditEvent& e = events[0];
  EXPECT_EQ(e.decision, "blocked");
  EXPECT_EQ(e.rule_ids[0], "allow:weather.test");
  EXPECT_NE(std::find(e.rule_ids.begin(), e.rule_ids.end(), "dlp:credit_card"), e.rule_ids.end());
  ASSERT_FALSE(e.findings.empty());
  EXPECT_EQ(e.findings[0].rule_id, "dlp:credit_card");
  EXPECT_EQ(e.findings[0].action, "block");
  // The audit row has no secret text, but the hash of the original body.
  EXPECT_EQ(ToJson(e).at("request_body").as_string().find("4111"), std::string::npos);
  EXPECT_EQ(boost::json::serialize(ToJson(e)).find("4111 1111"), std::string::npos);
  EXPECT_EQ(e.request_body_sha256.size(), 64u);
}

TEST_F(ProxyTest, DlpBlocksAnAwsKeyInTheUrlAndInAHeader) {
  Upstream up;
  resolver_->Map("weather.test", up.port());
  Attach(R"({"allow":["weather.test"]})");
  {
    Client c(port_);
    auto res = c.Get(std::string("http://weather.test/x?key=") + kAwsKeyId);
    EXPECT_EQ(res.result_int(), 403);
    EXPECT_EQ(std::string(res["X-Esb-Blocked"]), "dlp:aws_access_key");
  }
  {
    Client c(port_);
    http::request<http::string_body> req{http::verb::get, "http://weather.test/", 11};
    req.set(http::field::host, "weather.test");
    req.set("X-Debug", std::string("id=") + kAwsKeyId);
    auto res = c.Send(std::move(req));
    EXPECT_EQ(res.result_int(), 403);
    EXPECT_EQ(std::string(res["X-Esb-Blocked"]), "dlp:aws_access_key");
  }
  EXPECT_EQ(up.connections(), 0);
  auto events = audit_.WaitFor(2);
  ASSERT_EQ(events.size(), 2u);
  for (const AuditEvent& e : events) {
    EXPECT_EQ(boost::json::serialize(ToJson(e)).find(kAwsKeyId), std::string::npos);
  }
}

// Attack: a secret sent in a chunked TRAILER field. Beast merges trailers into the message's
// fields after the body, so before they went upstream unscanned and unaudited. Now 400, and
// nothing reaches the upstream.
TEST_F(ProxyTest, ChunkedTrailerFieldsAreRefusedAndNothingReachesUpstream) {
  Upstream up;
  resolver_->Map("weather.test", up.port());
  Attach(R"({"allow":["weather.test"]})");
  Client c(port_);
  c.WriteRaw(std::string("POST http://weather.test/t HTTP/1.1\r\nHost: weather.test\r\n"
                         "Transfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\nX-Leak: ") +
             kAwsKeyId + "\r\n\r\n");
  auto res = c.Read();
  EXPECT_EQ(res.result_int(), 400);
  EXPECT_EQ(Str(JsonBody(res), "rule"), "request:trailers");
  EXPECT_EQ(up.connections(), 0);
  EXPECT_EQ(up.raw().find(kAwsKeyId), std::string::npos);
}

// Attack: "Content-Encoding: identity" then "Content-Encoding: gzip" over a gzip body: DLP
// would read the first and scan compressed bytes while an upstream may decode gzip. 400.
TEST_F(ProxyTest, DuplicateContentEncodingIsRefused) {
  Upstream up;
  resolver_->Map("weather.test", up.port());
  Attach(R"({"allow":["weather.test"]})");
  Client c(port_);
  c.WriteRaw(
      "POST http://weather.test/t HTTP/1.1\r\nHost: weather.test\r\n"
      "Content-Encoding: identity\r\nContent-Encoding: gzip\r\nContent-Length: 2\r\n"
      "\r\nhi");
  auto res = c.Read();
  EXPECT_EQ(res.result_int(), 400);
  EXPECT_EQ(Str(JsonBody(res), "rule"), "request:duplicate_fields");
  EXPECT_EQ(up.connections(), 0);
}

// A refused request is audited too: its row must not keep a card number from its URL.
TEST_F(ProxyTest, DeniedRequestsAuditRowHasNoSecretFromItsUrl) {
  Attach(R"({"allow":["weather.test"]})");
  std::string digits(kCard);
  digits.erase(std::remove(digits.begin(), digits.end(), ' '), digits.end());
  Client c(port_);
  auto res = c.Get("http://denied.test/?q=" + digits);
  EXPECT_EQ(res.result_int(), 403);
  auto events = audit_.WaitFor(1);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].decision, "blocked");
  const std::string row = boost::json::serialize(ToJson(events[0]));
  EXPECT_EQ(row.find(kCard), std::string::npos) << row;
  EXPECT_EQ(row.find(digits), std::string::npos) << row;
}

TEST_F(ProxyTest, DlpRedactForwardsTheRedactedBodyWithItsLength) {
  Upstream up;
  resolver_->Map("weather.test", up.port());
  Attach(R"({"allow":["weather.test"],"dlp":{"rules":{"dlp:credit_card":"redact"}}})");
  Client c(port_);
  http::request<http::string_body> req{http::verb::post, "http://weather.test/pay", 11};
  req.set(http::field::host, "weather.test");
  req.set(http::field::content_type, "text/plain");
  req.body() = std::string("card ") + kCard + " thanks";
  auto res = c.Send(std::move(req));
  EXPECT_EQ(res.result_int(), 200);
  auto got = up.requests();
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].body.find("4111"), std::string::npos);
  EXPECT_NE(got[0].body.find("[REDACTED:dlp:credit_card]"), std::string::npos);
  EXPECT_EQ(got[0].headers["content-length"], std::to_string(got[0].body.size()));
  auto events = audit_.WaitFor(1);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].decision, "redacted");
  EXPECT_EQ(events[0].request_body, got[0].body);
}

// ---- HTTPS through inspection: env CA towards the client, a test root upstream

struct TlsFixture {
  TlsFixture() {
    env_ca = *tls::GenerateCa("EnterSandBox env test");
    upstream_root = *tls::GenerateCa("Test upstream root");
    auto root = *tls::Ca::FromPem(upstream_root.cert_pem, upstream_root.key_pem);
    auto minter = *tls::LeafMinter::Create(root);
    leaf = *minter->LeafFor("secure.test");
    char path[] = "/tmp/esb-proxy-test-root-XXXXXX";
    int fd = mkstemp(path);
    EXPECT_EQ(write(fd, upstream_root.cert_pem.data(), upstream_root.cert_pem.size()),
              static_cast<ssize_t>(upstream_root.cert_pem.size()));
    close(fd);
    root_file = path;
  }
  ~TlsFixture() { unlink(root_file.c_str()); }
  tls::CaPem env_ca, upstream_root;
  std::shared_ptr<const tls::Leaf> leaf;
  std::string root_file;
};

// A TLS upstream for secure.test that records requests (one connection, keep-alive).
class TlsUpstream {
 public:
  explicit TlsUpstream(const tls::Leaf& leaf) : ctx_(asio::ssl::context::tls_server) {
    SSL_CTX_use_certificate(ctx_.native_handle(), leaf.cert.get());
    SSL_CTX_use_PrivateKey(ctx_.native_handle(), leaf.key.get());
    acceptor_.open(tcp::v4());
    acceptor_.bind(tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
    acceptor_.listen();
    port_ = acceptor_.local_endpoint().port();
    thread_ = std::thread([this] {
      tcp::socket s(ioc_);
      boost::system::error_code ec;
      acceptor_.accept(s, ec);
      if (ec) return;
      ++connections_;
      asio::ssl::stream<tcp::socket> tls(std::move(s), ctx_);
      tls.handshake(asio::ssl::stream_base::server, ec);
      if (ec) return;
      beast::flat_buffer buf;
      for (;;) {
        http::request<http::string_body> req;
        http::read(tls, buf, req, ec);
        if (ec) return;
        {
          std::lock_guard<std::mutex> l(mu_);
          requests_.push_back(std::string(req.target()) + " " +
                              std::string(req[http::field::host]) + " " + req.body());
        }
        http::response<http::string_body> res{http::status::ok, 11};
        res.body() = "secure hello";
        res.keep_alive(req.keep_alive());
        res.prepare_payload();
        http::write(tls, res, ec);
        if (ec) return;
      }
    });
  }
  ~TlsUpstream() {
    ::shutdown(acceptor_.native_handle(), SHUT_RDWR);
    thread_.join();
  }
  uint16_t port() const { return port_; }
  int connections() const { return connections_; }
  std::vector<std::string> requests() {
    std::lock_guard<std::mutex> l(mu_);
    return requests_;
  }

 private:
  asio::io_context ioc_;
  asio::ssl::context ctx_;
  tcp::acceptor acceptor_{ioc_};
  uint16_t port_ = 0;
  std::atomic<int> connections_{0};
  std::thread thread_;
  std::mutex mu_;
  std::vector<std::string> requests_;
};

class InspectedProxyTest : public ProxyTest {
 protected:
  void SetUp() override {
    resolver_ = std::make_shared<FakeResolver>();
    ProxyOptions o;
    o.threads = 2;
    o.idle_timeout = std::chrono::milliseconds(3000);
    o.upstream_ca_file = tls_.root_file;
    o.use_system_roots = false;
    o.now_ms = [this] { return now_.load(); };
    auto p = Proxy::Create(o, resolver_, [this](AuditEvent e) { audit_.Add(std::move(e)); });
    ASSERT_TRUE(p.ok()) << p.status();
    proxy_ = *std::move(p);
  }
  void AttachWithCa(const std::string& policy_json) {
    UniqueFd listener = Listen(&port_);
    control::Attach a;
    a.env_id = "env-1";
    a.tenant = "t1";
    a.policy = Policy(policy_json);
    a.ca_cert_pem = tls_.env_ca.cert_pem;
    a.ca_key_pem = tls_.env_ca.key_pem;
    a.listener_fd = listener.get();
    absl::Status s = proxy_->Attach(std::move(a));
    ASSERT_TRUE(s.ok()) << s;
  }
  TlsFixture tls_;
};

// A client that CONNECTs through the proxy and speaks TLS trusting only the env CA.
class TlsClient {
 public:
  TlsClient(uint16_t proxy_port, const std::string& env_ca_pem, const std::string& target)
      : ctx_(asio::ssl::context::tls_client), plain_(proxy_port) {
    ctx_.add_certificate_authority(asio::buffer(env_ca_pem));
    ctx_.set_verify_mode(asio::ssl::verify_peer);
    std::string host = target.substr(0, target.find(':'));
    plain_.WriteRaw("CONNECT " + target + " HTTP/1.1\r\nHost: " + target + "\r\n\r\n");
    connect_status_ = plain_.ReadConnect().result_int();
    if (connect_status_ != 200) return;
    tls_.emplace(plain_.socket(), ctx_);
    SSL_set_tlsext_host_name(tls_->native_handle(), host.c_str());
    tls_->set_verify_callback(asio::ssl::host_name_verification(host));
    boost::system::error_code ec;
    tls_->handshake(asio::ssl::stream_base::client, ec);
    handshake_ok_ = !ec;
  }
  int connect_status() const { return connect_status_; }
  bool handshake_ok() const { return handshake_ok_; }
  http::response<http::string_body> Send(http::request<http::string_body> req) {
    req.prepare_payload();
    boost::system::error_code ec;
    http::write(*tls_, req, ec);
    http::response<http::string_body> res;
    http::read(*tls_, buf_, res, ec);
    if (ec) res.result(599);
    return res;
  }

 private:
  asio::ssl::context ctx_;
  Client plain_;
  std::optional<asio::ssl::stream<tcp::socket&>> tls_;
  beast::flat_buffer buf_;
  int connect_status_ = 0;
  bool handshake_ok_ = false;
};

TEST_F(InspectedProxyTest, HttpsIsInspectedForwardedVerifiedAndAuditedPerRequest) {
  TlsUpstream up(*tls_.leaf);
  resolver_->Map("secure.test", up.port());
  AttachWithCa(R"({"allow":["secure.test"]})");
  TlsClient c(port_, tls_.env_ca.cert_pem, "secure.test:443");
  ASSERT_EQ(c.connect_status(), 200);
  ASSERT_TRUE(c.handshake_ok()) << "the client does not trust the leaf minted by the env CA";
  for (int i = 0; i < 2; ++i) {  // keep-alive inside the tunnel
    http::request<http::string_body> req{http::verb::get, "/api/v1?i=" + std::to_string(i), 11};
    req.set(http::field::host, "secure.test");
    auto res = c.Send(std::move(req));
    EXPECT_EQ(res.result_int(), 200);
    EXPECT_EQ(res.body(), "secure hello");
  }
  EXPECT_EQ(up.connections(), 1);
  ASSERT_EQ(up.requests().size(), 2u);
  EXPECT_EQ(up.requests()[0], "/api/v1?i=0 secure.test ");
  auto events = audit_.WaitFor(2);
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].scheme, "https");
  EXPECT_EQ(events[0].path, "/api/v1?i=0");
  EXPECT_EQ(events[0].port, 443);
  EXPECT_EQ(events[0].decision, "allowed");
}

TEST_F(InspectedProxyTest, HostHeaderNotMatchingTheConnectTargetGets421) {
  TlsUpstream up(*tls_.leaf);
  resolver_->Map("secure.test", up.port());
  AttachWithCa(R"({"allow":["secure.test","evil.test"]})");
  TlsClient c(port_, tls_.env_ca.cert_pem, "secure.test:443");
  ASSERT_TRUE(c.handshake_ok());
  http::request<http::string_body> req{http::verb::get, "/", 11};
  req.set(http::field::host, "evil.test");  // domain fronting inside an allowed tunnel
  auto res = c.Send(std::move(req));
  EXPECT_EQ(res.result_int(), 421);
  EXPECT_TRUE(up.requests().empty());
  auto events = audit_.WaitFor(1);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].decision, "blocked");
  EXPECT_EQ(events[0].rule_ids[0], "tls:host_mismatch");
}

TEST_F(InspectedProxyTest, DlpBlocksAnAwsKeyInAnHttpsBodyAndUpstreamReceivesNothing) {
  TlsUpstream up(*tls_.leaf);
  resolver_->Map("secure.test", up.port());
  AttachWithCa(R"({"allow":["secure.test"]})");
  TlsClient c(port_, tls_.env_ca.cert_pem, "secure.test:443");
  ASSERT_TRUE(c.handshake_ok());
  http::request<http::string_body> req{http::verb::post, "/upload", 11};
  req.set(http::field::host, "secure.test");
  req.set(http::field::content_type, "application/x-www-form-urlencoded");
  req.body() = std::string("aws_access_key_id=") + kAwsKeyId + "&x=1";
  auto res = c.Send(std::move(req));
  EXPECT_EQ(res.result_int(), 403);
  EXPECT_EQ(std::string(res["X-Esb-Blocked"]), "dlp:aws_access_key");
  EXPECT_TRUE(up.requests().empty());
  auto events = audit_.WaitFor(1);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].scheme, "https");
  EXPECT_EQ(boost::json::serialize(ToJson(events[0])).find(kAwsKeyId), std::string::npos);
}

TEST_F(InspectedProxyTest, ExcludedHostIsTunnelledOpaque) {
  TlsUpstream up(*tls_.leaf);
  resolver_->Map("secure.test", up.port());
  AttachWithCa(R"({"allow":["secure.test"],"tls_exclude":["secure.test"]})");
  {
    // The client sees the upstream's own certificate (it trusts the upstream root here).
    asio::ssl::context ctx(asio::ssl::context::tls_client);
    ctx.add_certificate_authority(asio::buffer(tls_.upstream_root.cert_pem));
    ctx.set_verify_mode(asio::ssl::verify_peer);
    Client plain(port_);
    plain.WriteRaw("CONNECT secure.test:443 HTTP/1.1\r\nHost: secure.test:443\r\n\r\n");
    ASSERT_EQ(plain.ReadConnect().result_int(), 200);
    asio::ssl::stream<tcp::socket&> s(plain.socket(), ctx);
    SSL_set_tlsext_host_name(s.native_handle(), "secure.test");
    boost::system::error_code ec;
    s.handshake(asio::ssl::stream_base::client, ec);
    ASSERT_FALSE(ec) << ec.message();
    http::request<http::string_body> req{http::verb::get, "/", 11};
    req.set(http::field::host, "secure.test");
    req.keep_alive(false);
    http::write(s, req, ec);
    http::response<http::string_body> res;
    beast::flat_buffer b;
    http::read(s, b, res, ec);
    EXPECT_EQ(res.result_int(), 200);
    s.shutdown(ec);
  }
  auto events = audit_.WaitFor(1);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].decision, "opaque");
  EXPECT_EQ(events[0].scheme, "tunnel");
}

}  // namespace
}  // namespace esb::governance::proxy

// ---- DLP on names: host names and header names (issue 12)

namespace esb::governance::proxy {
namespace {

constexpr char kAwsKeyLower[] = "akiaq2we3rt4yu5i6paz";  // kAwsKeyId as a DNS name has it

// The row as JSON, upper-cased: no form of the key may be in it.
std::string UpperRow(const AuditEvent& e) {
  std::string row = boost::json::serialize(ToJson(e));
  for (char& c : row) c = static_cast<char>(toupper(static_cast<unsigned char>(c)));
  return row;
}

// Attack: exfiltrate an AWS key id through the DNS name of an absolute-URI request in mode
// open (the attacker runs attacker.test's DNS zone). Refused before the name is resolved.
TEST_F(ProxyTest, SecretInASubdomainIsBlockedBeforeResolution) {
  Upstream up;
  Attach(R"({"mode":"open"})");
  const std::string host = std::string(kAwsKeyLower) + ".attacker.test";
  resolver_->Map(host, up.port());
  Client c(port_);
  auto res = c.Get("http://" + host + "/");
  EXPECT_EQ(res.result_int(), 403);
  EXPECT_EQ(std::string(res["X-Esb-Blocked"]), "dlp:aws_access_key");
  EXPECT_EQ(resolver_->lookups(), 0);
  EXPECT_EQ(up.connections(), 0);
  auto events = audit_.WaitFor(1);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].decision, "blocked");
  EXPECT_EQ(events[0].host, "[REDACTED:dlp:aws_access_key]");
  ASSERT_FALSE(events[0].findings.empty());
  EXPECT_EQ(events[0].findings[0].where, "host");
  EXPECT_EQ(UpperRow(events[0]).find(kAwsKeyId), std::string::npos) << UpperRow(events[0]);
}

// Attack: the same key split over labels and dashes, under a "*.suffix" the policy allows.
TEST_F(ProxyTest, SecretSplitOverLabelsUnderAnAllowedSuffixIsBlockedBeforeResolution) {
  Upstream up;
  Attach(R"({"mode":"allowlist","allow":["*.attacker.test"]})");
  const std::string host = "akiaq2we-3rt4yu.5i6paz.x1.attacker.test";
  resolver_->Map(host, up.port());
  Client c(port_);
  auto res = c.Get("http://" + host + ":8080/x");
  EXPECT_EQ(res.result_int(), 403);
  EXPECT_EQ(std::string(res["X-Esb-Blocked"]), "dlp:aws_access_key");
  EXPECT_EQ(resolver_->lookups(), 0);
  EXPECT_EQ(up.connections(), 0);
}

// Attack: a card number split into labels of a CONNECT target. Refused before resolution; the
// audit row has neither the digits nor the name.
TEST_F(ProxyTest, CardSplitIntoLabelsOfAConnectTargetIsBlockedBeforeResolution) {
  Upstream up;
  Attach(R"({"mode":"open"})");
  const std::string host = "4111.1111.1111.1111.attacker.test";
  resolver_->Map(host, up.port());
  Client c(port_);
  c.WriteRaw("CONNECT " + host + ":443 HTTP/1.1\r\nHost: " + host + ":443\r\n\r\n");
  auto res = c.ReadConnect();
  EXPECT_EQ(res.result_int(), 403);
  EXPECT_EQ(std::string(res["X-Esb-Blocked"]), "dlp:credit_card");
  EXPECT_EQ(resolver_->lookups(), 0);
  EXPECT_EQ(up.connections(), 0);
  auto events = audit_.WaitFor(1);
  ASSERT_EQ(events.size(), 1u);
  const std::string row = boost::json::serialize(ToJson(events[0]));
  EXPECT_EQ(row.find("4111"), std::string::npos) << row;
}

// Attack: a key in a header NAME (values were scanned, names were not).
TEST_F(ProxyTest, SecretInAHeaderNameIsBlockedAndNothingReachesUpstream) {
  Upstream up;
  resolver_->Map("weather.test", up.port());
  Attach(R"({"mode":"open"})");
  Client c(port_);
  http::request<http::string_body> req{http::verb::get, "http://weather.test/", 11};
  req.set(http::field::host, "weather.test");
  req.set(std::string("X-") + kAwsKeyId, "1");
  auto res = c.Send(std::move(req));
  EXPECT_EQ(res.result_int(), 403);
  EXPECT_EQ(std::string(res["X-Esb-Blocked"]), "dlp:aws_access_key");
  EXPECT_EQ(up.connections(), 0);
  EXPECT_EQ(up.raw().find(kAwsKeyId), std::string::npos);
  auto events = audit_.WaitFor(1);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(UpperRow(events[0]).find(kAwsKeyId), std::string::npos) << UpperRow(events[0]);
  EXPECT_NE(events[0].request_headers.find("[REDACTED:dlp:aws_access_key]"), std::string::npos);
}

// Attack: a key split over labels in the Host header of a proxy-port request (it is replaced
// upstream, but was kept in the audit row, and a value scan does not join labels).
TEST_F(ProxyTest, SecretSplitInTheHostHeaderIsBlockedAndNotRecorded) {
  Upstream up;
  resolver_->Map("weather.test", up.port());
  Attach(R"({"mode":"open"})");
  Client c(port_);
  http::request<http::string_body> req{http::verb::get, "http://weather.test/", 11};
  req.set(http::field::host, "akiaq2we3r.t4yu5i6paz.x.test");
  auto res = c.Send(std::move(req));
  EXPECT_EQ(res.result_int(), 403);
  EXPECT_EQ(std::string(res["X-Esb-Blocked"]), "dlp:aws_access_key");
  EXPECT_EQ(up.connections(), 0);
  auto events = audit_.WaitFor(1);
  ASSERT_EQ(events.size(), 1u);
  const std::string row = boost::json::serialize(ToJson(events[0]));
  EXPECT_EQ(row.find("akiaq2we3r"), std::string::npos) << row;
  EXPECT_EQ(row.find("t4yu5i6paz"), std::string::npos) << row;
}

// False positives: ordinary names (digits, dashes, punycode, long labels), ports and IP
// literals pass the name scan and are forwarded with no finding.
TEST_F(ProxyTest, OrdinaryHostNamesAndIpLiteralsPassTheNameScan) {
  Upstream up;
  const std::vector<std::string> hosts = {
      "ec2-54-210-167-204.compute-1.amazonaws.test",
      "r3---sn-4g5e6nz7.googlevideo.test",
      "xn--bcher-kva.example.test",
      "ip-10-0-0-1.ec2.internal.test",
      "d1a2b3c4d5e6f7.cloudfront.test",
      "files.pythonhosted.test",
      "cdn-123456789.example.test",
      "s3.us-east-1.amazonaws.test",
  };
  for (const std::string& h : hosts) resolver_->Map(h, up.port());
  Attach(R"({"mode":"open"})");
  Client c(port_);
  for (const std::string& h : hosts) {
    auto res = c.Get("http://" + h + ":8080/");
    EXPECT_EQ(res.result_int(), 200) << h;
  }
  // An IP literal (allowed explicitly: it is loopback) is not scanned as a name.
  Update(R"({"allow":["127.0.0.1"]})");
  Client c2(port_);
  EXPECT_EQ(c2.Get("http://127.0.0.1:" + std::to_string(up.port()) + "/").result_int(), 200);
  auto events = audit_.WaitFor(hosts.size() + 1);
  ASSERT_EQ(events.size(), hosts.size() + 1);
  for (const AuditEvent& e : events) {
    EXPECT_TRUE(e.findings.empty()) << e.host << ": " << e.findings[0].rule_id;
    EXPECT_EQ(e.decision, "allowed") << e.host;
  }
}

}  // namespace
}  // namespace esb::governance::proxy

// ---- the host's own addresses (issue 12)

namespace esb::governance::proxy {
namespace {

// Attack: reach a service on the proxy's host through the host's PUBLIC address (not a private
// range), by a name that resolves to it, as an IP literal (v4, v6, v4-mapped), by CONNECT, and
// via 0.0.0.0 / :: (which reach the host's listeners). All refused, nothing connected.
TEST_F(ProxyTest, HostsOwnAddressesAreRefusedByNameLiteralAndConnect) {
  Upstream up;
  SetHostAddresses({"127.0.0.1", "93.184.216.34", "2a00:1450:4001::1"});
  resolver_->Map("self.test", up.port(), /*overridden=*/false, "93.184.216.34");
  resolver_->Map("self6.test", up.port(), /*overridden=*/false, "2a00:1450:4001::1");
  Attach(R"({"mode":"open"})");
  for (const std::string url : {"http://self.test/", "http://self6.test/",
                                "http://93.184.216.34:8080/", "http://[2a00:1450:4001::1]/"}) {
    Client c(port_);
    auto res = c.Get(url);
    EXPECT_EQ(res.result_int(), 403) << url;
    EXPECT_EQ(std::string(res["X-Esb-Blocked"]), "addr:host") << url;
  }
  for (const std::string url : {std::string("http://[::ffff:93.184.216.34]/"),
                                "http://0.0.0.0:" + std::to_string(up.port()) + "/",
                                "http://[::]:" + std::to_string(up.port()) + "/"}) {
    Client c(port_);
    auto res = c.Get(url);
    EXPECT_EQ(res.result_int(), 403) << url;
    EXPECT_TRUE(absl::StartsWith(std::string(res["X-Esb-Blocked"]), "addr:")) << url;
  }
  {
    Client c(port_);
    c.WriteRaw("CONNECT 93.184.216.34:443 HTTP/1.1\r\nHost: 93.184.216.34:443\r\n\r\n");
    auto res = c.ReadConnect();
    EXPECT_EQ(res.result_int(), 403);
    EXPECT_EQ(std::string(res["X-Esb-Blocked"]), "addr:host");
  }
  EXPECT_EQ(up.connections(), 0);
}

// An address the host gains while the proxy runs (DHCP, a new interface) is refused once the
// copy is refreshed (the fixture refreshes on every check).
TEST_F(ProxyTest, AnAddressTheHostGainsLaterIsRefusedAfterTheRefresh) {
  SetHostAddresses({"127.0.0.1"});
  resolver_->Map("later.test", 80, /*overridden=*/false, "93.184.216.35");
  Attach(R"({"mode":"open"})");
  SetHostAddresses({"127.0.0.1", "93.184.216.35"});
  Client c(port_);
  auto res = c.Get("http://later.test/");
  EXPECT_EQ(res.result_int(), 403);
  EXPECT_EQ(std::string(res["X-Esb-Blocked"]), "addr:host");
}

TEST(HostAddressesTest, SystemListHasEveryInterfaceAddressAndTheUnspecifiedOnes) {
  absl::StatusOr<std::vector<asio::ip::address>> sys = SystemInterfaceAddresses();
  ASSERT_TRUE(sys.ok()) << sys.status();
  HostAddresses host(nullptr, std::chrono::seconds(60));
  ASSERT_TRUE(host.Refresh().ok());
  bool loopback = false;
  for (const asio::ip::address& a : *sys) {
    loopback |= a == asio::ip::make_address("127.0.0.1");
    EXPECT_TRUE(host.Contains(a)) << a.to_string();
  }
  EXPECT_TRUE(loopback);
  EXPECT_TRUE(host.Contains(asio::ip::make_address("::ffff:127.0.0.1")));
  EXPECT_TRUE(host.Contains(asio::ip::make_address("0.0.0.0")));
  EXPECT_TRUE(host.Contains(asio::ip::make_address("::")));
  EXPECT_TRUE(host.Contains(asio::ip::make_address("::ffff:0.0.0.0")));
  EXPECT_FALSE(host.Contains(asio::ip::make_address("192.0.2.1")));  // TEST-NET: never ours
}

TEST(HostAddressesTest, ScopeIdsAreIgnoredAndAFailedRefreshKeepsTheLastSet) {
  bool fail = false;
  HostAddresses host(
      [&]() -> absl::StatusOr<std::vector<asio::ip::address>> {
        if (fail) return absl::InternalError("getifaddrs: boom");
        return std::vector<asio::ip::address>{asio::ip::make_address("fe80::1%1"),
                                              asio::ip::make_address("198.51.100.7")};
      },
      std::chrono::milliseconds(0));
  ASSERT_TRUE(host.Refresh().ok());
  EXPECT_TRUE(host.Contains(asio::ip::make_address("fe80::1")));
  EXPECT_TRUE(host.Contains(asio::ip::make_address("::ffff:198.51.100.7")));
  fail = true;
  EXPECT_FALSE(host.Refresh().ok());
  EXPECT_TRUE(host.Contains(asio::ip::make_address("198.51.100.7")));
}

}  // namespace
}  // namespace esb::governance::proxy

// ---- deny rules cover addresses (issue 12)

namespace esb::governance::proxy {
namespace {

// Attack: mode open with a deny rule for evil.test; reach the same server through its IP
// literal (plain and CONNECT) or through another name of the same address. All refused with the
// deny rule; an unrelated name still works; the denied name is resolved once (cached).
TEST_F(ProxyTest, DenyRuleCannotBeBypassedByAnIpLiteralOrAnotherNameInModeOpen) {
  Upstream up;
  resolver_->Map("evil.test", 80, /*overridden=*/false, "93.184.216.34");
  resolver_->Map("alias.test", 80, /*overridden=*/false, "93.184.216.34");
  resolver_->Map("fine.test", up.port());
  Attach(R"({"mode":"open","deny":["evil.test"]})");
  for (const std::string url : {"http://evil.test/", "http://alias.test/x", "http://93.184.216.34/",
                                "http://[::ffff:93.184.216.34]/"}) {
    Client c(port_);
    auto res = c.Get(url);
    EXPECT_EQ(res.result_int(), 403) << url;
    EXPECT_EQ(std::string(res["X-Esb-Blocked"]), "deny:evil.test") << url;
  }
  {
    Client c(port_);
    c.WriteRaw("CONNECT 93.184.216.34:443 HTTP/1.1\r\nHost: 93.184.216.34:443\r\n\r\n");
    auto res = c.ReadConnect();
    EXPECT_EQ(res.result_int(), 403);
    EXPECT_EQ(std::string(res["X-Esb-Blocked"]), "deny:evil.test");
  }
  Client c(port_);
  EXPECT_EQ(c.Get("http://fine.test/").result_int(), 200);
  EXPECT_EQ(up.requests().size(), 1u);
  std::vector<std::string> asked = resolver_->asked();
  EXPECT_EQ(std::count(asked.begin(), asked.end(), "evil.test"), 1) << "cached for its TTL";
}

// An IP deny rule covers every name that resolves to that address, in any mode, and an
// --egress-resolve mapping (explicitly allowed) does not lift it: deny wins.
TEST_F(ProxyTest, IpDenyRuleCoversEveryNameOfThatAddress) {
  Upstream up;
  resolver_->Map("alias.test", 80, /*overridden=*/false, "93.184.216.34");
  resolver_->Map("local.test", up.port());  // override → 127.0.0.1
  Attach(R"({"allow":["alias.test","local.test"],"deny":["93.184.216.34","127.0.0.1"]})");
  {
    Client c(port_);
    auto res = c.Get("http://alias.test/");
    EXPECT_EQ(res.result_int(), 403);
    EXPECT_EQ(std::string(res["X-Esb-Blocked"]), "deny:93.184.216.34");
  }
  {
    Client c(port_);
    auto res = c.Get("http://local.test/");
    EXPECT_EQ(res.result_int(), 403);
    EXPECT_EQ(std::string(res["X-Esb-Blocked"]), "deny:127.0.0.1");
  }
  EXPECT_EQ(up.connections(), 0);
  Update(R"({"allow":["local.test"]})");
  Client c(port_);
  EXPECT_EQ(c.Get("http://local.test/").result_int(), 200);
}

// A CIDR deny rule covers every name resolving into its range, in mode open too.
TEST_F(ProxyTest, CidrDenyRuleCoversNamesResolvingIntoTheRange) {
  resolver_->Map("alias.test", 80, /*overridden=*/false, "93.184.216.34");
  resolver_->Map("alias6.test", 80, /*overridden=*/false, "2a00:1450:4001::5");
  Attach(R"({"mode":"open","deny":["93.184.216.0/24","2a00:1450::/32"]})");
  Client c(port_);
  auto res = c.Get("http://alias.test/");
  EXPECT_EQ(res.result_int(), 403);
  EXPECT_EQ(std::string(res["X-Esb-Blocked"]), "deny:93.184.216.0/24");
  Client c6(port_);
  auto res6 = c6.Get("http://alias6.test/");
  EXPECT_EQ(res6.result_int(), 403);
  EXPECT_EQ(std::string(res6["X-Esb-Blocked"]), "deny:2a00:1450::/32");
}

// SECURITY: when a deny name cannot be resolved now (the resolver is busy or times out), mode
// open fails closed — the request is refused "resolve:busy"/"resolve:timeout", not let through
// to an address the rule may cover — and the failure is not cached: once the resolver answers,
// the rule is enforced from its real addresses.
TEST_F(ProxyTest, DenyNameThatCannotBeResolvedNowFailsClosedAndIsNotCached) {
  Upstream up;
  resolver_->Map("alias.test", up.port(), /*overridden=*/false);
  resolver_->Map("evil.test", 80, /*overridden=*/false);  // the same address as alias.test
  // (127.0.0.1, refused as private anyway: the status tells which check refused it)
  resolver_->Fail("evil.test", absl::UnavailableError("too many lookups"));
  Attach(R"({"mode":"open","deny":["evil.test"]})");
  {
    Client c(port_);
    auto res = c.Get("http://alias.test/");
    EXPECT_EQ(res.result_int(), 503);
    EXPECT_EQ(Str(JsonBody(res), "rule"), "resolve:busy");
  }
  resolver_->Fail("evil.test", absl::DeadlineExceededError("timed out"));
  {
    Client c(port_);
    auto res = c.Get("http://alias.test/");
    EXPECT_EQ(res.result_int(), 504);
    EXPECT_EQ(Str(JsonBody(res), "rule"), "resolve:timeout");
  }
  resolver_->Heal("evil.test");
  {
    Client c(port_);
    auto res = c.Get("http://alias.test/");
    EXPECT_EQ(res.result_int(), 403);
    EXPECT_EQ(std::string(res["X-Esb-Blocked"]), "deny:evil.test");
  }
  EXPECT_EQ(up.connections(), 0);
}

// The deny names resolved per request are bounded (16): a policy with many deny names does not
// turn one request into many lookups.
TEST_F(ProxyTest, DenyNamesResolvedPerRequestAreBounded) {
  std::string deny;
  for (int i = 0; i < 40; ++i) deny += (i ? ",\"d" : "\"d") + std::to_string(i) + ".test\"";
  Attach(R"({"mode":"open","deny":[)" + deny + "]}");
  SetHostAddresses({"93.184.216.36"});  // so that nothing is connected afterwards
  Client c(port_);
  auto res = c.Get("http://93.184.216.36/");  // an IP literal: resolves nothing itself
  EXPECT_EQ(std::string(res["X-Esb-Blocked"]), "addr:host");
  EXPECT_EQ(resolver_->lookups(), 16);
}

}  // namespace
}  // namespace esb::governance::proxy
