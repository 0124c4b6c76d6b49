// Egress plumbing end to end (issue 12): the real esbd starts the real esb-proxy, a real crun
// container with a governed network reaches a local upstream (127.0.0.1, named upstream.test
// through --egress-resolve) only through the proxy's listener in its netns; bypasses, DNS and
// UDP fail; killing the proxy fails the sandbox's egress closed, /healthz says so, esbd restarts
// it and egress works again (also after an esbd restart); a non-governed sandbox has no network.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <string>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "integration/daemon.h"

namespace esb::testing {
namespace {
namespace json = boost::json;

// A tiny HTTP upstream on 127.0.0.1 that answers every request with "upstream-ok <request
// line>" and counts what it served.
class Upstream {
 public:
  Upstream() {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a = {};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a));
    ::listen(fd_, 64);
    socklen_t len = sizeof(a);
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    thread_ = std::thread([this] { Serve(); });
  }
  ~Upstream() {
    ::shutdown(fd_, SHUT_RDWR);
    ::close(fd_);
    thread_.join();
  }
  int port() const { return port_; }
  int served() const { return served_; }

 private:
  void Serve() {
    while (true) {
      int c = ::accept(fd_, nullptr, nullptr);
      if (c < 0) return;
      struct timeval tv = {5, 0};
      ::setsockopt(c, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
      std::string req;
      char buf[4096];
      ssize_t n;
      while (req.find("\r\n\r\n") == std::string::npos && (n = ::read(c, buf, sizeof buf)) > 0) {
        req.append(buf, n);
      }
      std::string body = "upstream-ok " + req.substr(0, req.find("\r\n")) + "\n";
      std::string resp = absl::StrCat("HTTP/1.1 200 OK\r\nContent-Length: ", body.size(),
                                      "\r\nConnection: close\r\n\r\n", body);
      (void)!::write(c, resp.data(), resp.size());
      ::close(c);
      ++served_;
    }
  }
  int fd_ = -1;
  int port_ = 0;
  std::atomic<int> served_{0};
  std::thread thread_;
};

bool WaitFor(const std::function<bool()>& done, int timeout_s = 30) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  while (!done()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return true;
}

class EgressNetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why = Daemon::SkipReason();
    if (!why.empty()) GTEST_SKIP() << why;
    if (!std::filesystem::exists(std::string(ESB_BUILD_DIR) + "/esb-proxy")) {
      GTEST_SKIP() << "esb-proxy is not built (target esb-proxy)";
    }
    options_.extra_args = {"--egress-resolve",
                           absl::StrCat("upstream.test=127.0.0.1:", upstream_.port())};
    ASSERT_TRUE(daemon_.Start(options_)) << daemon_.Log();
    // /healthz answers before the proxy reported ready.
    ASSERT_TRUE(WaitFor([&] { return Egress().at("state").as_string() == "up"; }))
        << json::serialize(Egress()) << daemon_.Log();
  }
  void TearDown() override { daemon_.StopAndCleanup(); }

  json::object Egress() const {
    return daemon_.Call("GET", "/healthz").obj().at("egress").as_object();
  }
  // A governed environment allowed to reach upstream.test, attached at the proxy.
  std::string Governed() {
    const int64_t attached = Egress().at("attached").as_int64();
    std::string id = daemon_.CreateEnv(json::object{
        {"network", json::object{{"mode", "allowlist"}, {"allow", json::array{"upstream.test"}}}}});
    EXPECT_TRUE(WaitFor([&] { return Egress().at("attached").as_int64() > attached; }))
        << json::serialize(Egress());
    return id;
  }
  // curl through the proxy (the variables esbd set) to the upstream's name.
  HttpResult CurlUpstream(const std::string& env, const std::string& path = "/hello") {
    return daemon_.Exec(env, absl::StrCat("curl -sS -m 10 http://upstream.test:", upstream_.port(),
                                          path, "; echo rc=$?"));
  }

  Upstream upstream_;
  Daemon::Options options_;
  Daemon daemon_;
};

TEST_F(EgressNetTest, AllowedHostThroughTheProxyAndNothingElse) {
  ASSERT_EQ(Egress().at("state").as_string(), "up") << json::serialize(Egress());
  // The real proxy's fair-share refusal and audit-drop counters reach /healthz (none yet).
  ASSERT_TRUE(Egress().contains("refused")) << json::serialize(Egress());
  for (const char* k : {"connections", "body_budget", "dlp_busy", "resolve_busy"}) {
    EXPECT_EQ(Egress().at("refused").as_object().at(k).as_int64(), 0) << k;
  }
  EXPECT_EQ(Egress().at("audit_dropped").as_int64(), 0);
  const std::string env = Governed();
  ASSERT_FALSE(env.empty());
  HttpResult ok = CurlUpstream(env);
  EXPECT_TRUE(absl::StrContains(ok.str("stdout"), "upstream-ok GET /hello")) << ok.body;
  EXPECT_TRUE(absl::StrContains(ok.str("stdout"), "rc=0")) << ok.body;
  // A host the policy does not allow: the proxy answers 403 (curl -f: rc 22), nothing upstream.
  const int served = upstream_.served();
  HttpResult denied = daemon_.Exec(env,
                                   "curl -s -o /dev/null -w '%{http_code}' -m 10 "
                                   "http://denied.test/; echo");
  EXPECT_EQ(denied.str("stdout"), "403\n") << denied.body;
  EXPECT_EQ(upstream_.served(), served);
  // Attack: bypass the proxy and connect straight to the upstream's address.
  HttpResult direct = daemon_.Exec(
      env, absl::StrCat("curl -sS -m 5 --noproxy '*' http://127.0.0.1:", upstream_.port(),
                        "/ 2>&1; echo rc=$?"));
  EXPECT_TRUE(absl::StrContains(direct.str("stdout"), "rc=7")) << direct.body;
  // Attack: DNS (no resolver, no route) and UDP anywhere.
  HttpResult dns = daemon_.Exec(
      env, "python3 -c \"import socket; socket.getaddrinfo('example.com', 80)\" 2>&1; echo rc=$?");
  EXPECT_FALSE(absl::StrContains(dns.str("stdout"), "rc=0")) << dns.body;
  HttpResult udp = daemon_.Exec(
      env,
      "python3 -c \"import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
      "s.sendto(b'x', ('8.8.8.8', 53))\" 2>&1; echo rc=$?");
  EXPECT_TRUE(absl::StrContains(udp.str("stdout"), "Network is unreachable")) << udp.body;
  EXPECT_EQ(upstream_.served(), served);
  // Every request through the proxy is one egress row in the audit log, written by esbd (the
  // one audit path) for this environment: the allowed one and the blocked one.
  bool allowed = false, blocked = false;
  ASSERT_TRUE(WaitFor([&] {
    HttpResult audit = daemon_.Call("GET", "/audit?kind=egress&environment_id=" + env);
    if (audit.status != 200) return false;
    for (const json::value& row : audit.obj().at("entries").as_array()) {
      const json::object& e = row.as_object().at("egress").as_object();
      if (e.at("host").as_string() == "upstream.test" && e.at("decision").as_string() == "allowed")
        allowed = true;
      if (e.at("host").as_string() == "denied.test" && e.at("decision").as_string() == "blocked")
        blocked = true;
    }
    return allowed && blocked;
  })) << daemon_.Call("GET", "/audit?kind=egress").body;
}

TEST_F(EgressNetTest, KilledProxyFailsClosedIsReportedAndRestarted) {
  const std::string env = Governed();
  ASSERT_FALSE(env.empty());
  ASSERT_TRUE(absl::StrContains(CurlUpstream(env).str("stdout"), "upstream-ok"));
  json::object before = Egress();
  const int64_t pid = before.at("pid").as_int64();
  ASSERT_GT(pid, 0) << json::serialize(before);
  // The proxy runs as its own unprivileged user, without capabilities.
  std::string status;
  {
    FILE* f = fopen(absl::StrCat("/proc/", pid, "/status").c_str(), "r");
    ASSERT_NE(f, nullptr);
    char line[256];
    while (fgets(line, sizeof line, f)) status += line;
    fclose(f);
  }
  EXPECT_FALSE(absl::StrContains(status, "Uid:\t0\t")) << status;
  EXPECT_TRUE(absl::StrContains(status, "CapEff:\t0000000000000000")) << status;

  // Attack on availability: the proxy dies (SIGKILL) while the sandbox keeps requesting; its
  // listener goes with it. A loop inside the sandbox sees 200s, then refusals (curl rc 7: the
  // port is closed, nothing else answers), then 200s again once esbd restarted the proxy.
  HttpResult loop;
  std::thread requests([&] {
    loop = daemon_.Exec(env,
                        absl::StrCat("for i in $(seq 150); do curl -s -m 2 -o /dev/null "
                                     "-w '%{http_code}' http://upstream.test:",
                                     upstream_.port(),
                                     "/loop; echo \" rc=$?\"; "
                                     "sleep 0.02; done"),
                        120);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(700));
  ASSERT_EQ(::kill(static_cast<pid_t>(pid), SIGKILL), 0);
  bool reported = false;
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (std::chrono::steady_clock::now() < end && !reported) {
    json::object h = Egress();
    reported = h.at("restarts").as_int64() >= 1 || h.at("state").as_string() != "up";
  }
  EXPECT_TRUE(reported) << json::serialize(Egress());
  requests.join();
  const std::string out = loop.str("stdout");
  const size_t first_ok = out.find("200 rc=0");
  const size_t refused = out.find("000 rc=7", first_ok);
  EXPECT_NE(first_ok, std::string::npos) << out;
  EXPECT_NE(refused, std::string::npos) << "never refused: " << out;
  EXPECT_NE(out.find("200 rc=0", refused), std::string::npos) << "never served again: " << out;
  for (const char* other : {" rc=28", " rc=52"}) {
    EXPECT_FALSE(absl::StrContains(out, other)) << "not a clean refusal: " << out;
  }
  // The one request in flight when the proxy was killed may see its connection reset (curl 56:
  // nothing more was received); every later one is refused at connect.
  const size_t reset = out.find(" rc=56");
  if (reset != std::string::npos) {
    EXPECT_EQ(out.find(" rc=56", reset + 1), std::string::npos) << "more than one reset: " << out;
    EXPECT_LT(reset, refused) << "a reset after the refusals began: " << out;
  }
  // Restarted and re-attached: works again, from a new proxy process.
  ASSERT_TRUE(WaitFor([&] {
    json::object h = Egress();
    return h.at("state").as_string() == "up" && h.at("pid").as_int64() != pid &&
           h.at("attached").as_int64() >= 1;
  })) << json::serialize(Egress());
  EXPECT_GE(Egress().at("restarts").as_int64(), 1);
  HttpResult again = CurlUpstream(env, "/again");
  EXPECT_TRUE(absl::StrContains(again.str("stdout"), "upstream-ok GET /again")) << again.body;
}

TEST_F(EgressNetTest, GovernedEnvWorksAgainAfterAnEsbdRestart) {
  const std::string env = Governed();
  ASSERT_FALSE(env.empty());
  ASSERT_TRUE(absl::StrContains(CurlUpstream(env).str("stdout"), "upstream-ok"));
  const std::string state = daemon_.state_dir();
  daemon_.Stop();
  // esbd (and with it the proxy) is down: the sandbox keeps running, its egress fails closed.
  ASSERT_TRUE(daemon_.Start(options_, state)) << daemon_.Log();
  ASSERT_TRUE(WaitFor([&] { return Egress().at("attached").as_int64() >= 1; }))
      << json::serialize(Egress());
  HttpResult after = CurlUpstream(env, "/after-restart");
  EXPECT_TRUE(absl::StrContains(after.str("stdout"), "upstream-ok GET /after-restart"))
      << after.body;
}

TEST_F(EgressNetTest, NonGovernedEnvStillHasNoNetworkAtAll) {
  const std::string env = daemon_.CreateEnv();
  ASSERT_FALSE(env.empty());
  HttpResult r = daemon_.Exec(
      env, absl::StrCat("env | grep -ci proxy; curl -sS -m 5 http://127.0.0.1:", upstream_.port(),
                        "/ 2>&1; echo rc=$?; curl -sS -m 5 http://127.0.0.1:3128/ 2>&1; echo rc=$?;"
                        "ls /sys/class/net"));
  const std::string out = r.str("stdout");
  EXPECT_TRUE(absl::StartsWith(out, "0\n")) << out;
  EXPECT_FALSE(absl::StrContains(out, "rc=0")) << out;
  EXPECT_TRUE(absl::EndsWith(out, "rc=7\nlo\n")) << out;
}

}  // namespace
}  // namespace esb::testing
