// ProxyEgressControl: supervision of the egress proxy, against fake_esb_proxy (the real control
// protocol, no policy). Tests that start the proxy need root (it switches to its own uid); they
// say so when they skip.
#include "core/egress_proxy.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/util.h"
#include "gtest/gtest.h"

namespace esb {
namespace {

namespace control = governance::control;

// A listening socket on 127.0.0.1 (what the driver's OpenEgressListener gives, minus the netns).
absl::StatusOr<UniqueFd> LoopbackListener(int* port) {
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in a = {};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      ::listen(fd.get(), 16) != 0) {
    return ErrnoStatus("listen");
  }
  socklen_t len = sizeof(a);
  ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&a), &len);
  *port = ntohs(a.sin_port);
  return fd;
}

// One HTTP GET to 127.0.0.1:port; the response, or "refused"/"error".
std::string GetPath(int port, const std::string& path) {
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in a = {};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  struct timeval tv = {5, 0};
  ::setsockopt(fd.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    return errno == ECONNREFUSED ? "refused" : "error";
  }
  const std::string req =
      absl::StrCat("GET http://fake.test", path, " HTTP/1.1\r\nHost: fake.test\r\n\r\n");
  (void)!::write(fd.get(), req.data(), req.size());
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(fd.get(), buf, sizeof(buf))) > 0) out.append(buf, n);
  return out;
}

std::string Get(int port) { return GetPath(port, "/x"); }

struct Sink {
  std::mutex mu;
  std::vector<EgressAuditRow> rows;
  void operator()(const EgressAuditRow& row) {
    std::lock_guard<std::mutex> lock(mu);
    rows.push_back(row);
  }
  size_t size() {
    std::lock_guard<std::mutex> lock(mu);
    return rows.size();
  }
};

bool WaitFor(const std::function<bool()>& done, int64_t timeout_ms = 10000) {
  const int64_t end = MonotonicMs() + timeout_ms;
  while (!done()) {
    if (MonotonicMs() > end) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

// The proxy's outbox reports the audit events it had to drop as one event per environment
// (governance/proxy/outbox.h): it becomes an ordinary error row, so the gap is in the log.
TEST(ToAuditRowTest, AnAuditDroppedEventBecomesAnErrorRowWithTheCount) {
  control::AuditEvent e;
  e.time_ms = 1'700'000'000'000;
  e.env_id = "e1";
  e.tenant = "t1";
  e.decision = "error";
  e.rule_ids = {"audit:dropped"};
  e.reason = "audit events dropped: 42 of this environment (...)";
  EgressAuditRow row = ToAuditRow(e, "t1");
  EXPECT_EQ(row.tenant, "t1");
  EXPECT_EQ(row.environment_id, "e1");
  EXPECT_EQ(row.decision, EgressDecision::kError);
  EXPECT_EQ(row.rule_ids, std::vector<std::string>{"audit:dropped"});
  EXPECT_EQ(row.reason, e.reason);
}

TEST(ToAuditRowTest, TakesEsbdsTenantAndSplitsHeadersAndAddsFindingRules) {
  control::AuditEvent e;
  e.env_id = "e1";
  e.tenant = "forged";
  e.method = "POST";
  e.host = "api.test";
  e.port = 443;
  e.path = "/v1?q=1";
  e.status = 403;
  e.decision = "blocked";
  e.rule_ids = {"allow:api.test", "dlp:aws_access_key"};
  e.findings = {{"dlp:aws_access_key", "block", "body", 1}, {"dlp:email", "log", "header", 2}};
  e.request_headers = "Host: api.test\nAuthorization: ***\r\nbad line\n";
  e.request_body = "redacted";
  e.request_body_sha256 = "ab";
  e.scheme = "https";
  e.reason = "dlp";
  e.bytes_up = 10;
  EgressAuditRow row = ToAuditRow(e, "tenant-a");
  EXPECT_EQ(row.tenant, "tenant-a");
  EXPECT_EQ(row.environment_id, "e1");
  EXPECT_EQ(row.decision, EgressDecision::kBlocked);
  EXPECT_EQ(row.rule_ids,
            (std::vector<std::string>{"allow:api.test", "dlp:aws_access_key", "dlp:email"}));
  // The proxy's lines as sent; AuditLog::RecordEgress masks every line again when storing.
  EXPECT_EQ(row.request_headers, e.request_headers);
  EXPECT_EQ(row.scheme, "https");
  EXPECT_EQ(row.reason, "dlp");
  EXPECT_EQ(row.body, "redacted");
  EXPECT_EQ(row.body_sha256, "ab");
  e.decision = "nonsense";
  EXPECT_EQ(ToAuditRow(e, "t").decision, EgressDecision::kError);
}

TEST(ProxyEgressControlTest, MissingBinaryDisablesEgressAndRefusesAttach) {
  ProxyEgressOptions o;
  o.proxy_binary = "/nonexistent/esb-proxy";
  o.uid = o.gid = kProxyFallbackId;
  ProxyEgressControl egress(o, nullptr);
  absl::Status st = egress.Start();
  EXPECT_TRUE(absl::IsFailedPrecondition(st)) << st;
  EXPECT_EQ(egress.Health().state, "disabled");
  EXPECT_TRUE(absl::StrContains(egress.Health().detail, "/nonexistent/esb-proxy"));
  EgressAttachment a;
  a.env_id = "e";
  a.tenant = "t";
  EXPECT_TRUE(absl::IsUnavailable(egress.Attach(a)));
  egress.Detach("e");  // never fails
}

TEST(ProxyEgressControlTest, RefusesToRunTheProxyAsRoot) {
  ProxyEgressOptions o;
  o.proxy_binary = FAKE_ESB_PROXY;
  ProxyEgressControl egress(o, nullptr);
  EXPECT_TRUE(absl::IsFailedPrecondition(egress.Start()));
}

class ProxyEgressControlRootTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::geteuid() != 0) GTEST_SKIP() << "needs root (the proxy is started as its own uid)";
    options_.proxy_binary = FAKE_ESB_PROXY;
    ProxyIdentity id = FindProxyIdentity();
    options_.uid = id.uid;
    options_.gid = id.gid;
    options_.min_backoff_ms = 50;
    options_.resolve = {"git.test=127.0.0.1:1234"};
  }

  // An attachment whose listener is a loopback socket; `port` gets its current port.
  EgressAttachment Attachment(const std::string& env, std::atomic<int>* port,
                              std::atomic<int>* opened) {
    EgressAttachment a;
    a.env_id = env;
    a.tenant = "tenant-" + env;
    a.open_listener = [port, opened]() -> absl::StatusOr<UniqueFd> {
      int p = 0;
      absl::StatusOr<UniqueFd> fd = LoopbackListener(&p);
      *port = p;
      ++*opened;
      return fd;
    };
    return a;
  }

  ProxyEgressOptions options_;
  Sink sink_;
};

TEST_F(ProxyEgressControlRootTest, RunsUnprivilegedServesAttachedListenersAndAudits) {
  // The upstream CA file sits in a root-only directory: the proxy reads it through the
  // descriptor esbd opened, not through the path.
  char dir[] = "/tmp/esb-egress-ca-XXXXXX";
  ASSERT_NE(::mkdtemp(dir), nullptr);
  ::chmod(dir, 0700);
  const std::string ca = std::string(dir) + "/upstream.pem";
  std::ofstream(ca) << "FAKE-UPSTREAM-CA\n";
  ::chmod(ca.c_str(), 0600);
  options_.upstream_ca = ca;
  ProxyEgressControl egress(options_, [this](const EgressAuditRow& r) { sink_(r); });
  ASSERT_TRUE(egress.Start().ok());
  std::atomic<int> port{0}, opened{0};
  ASSERT_TRUE(egress.Attach(Attachment("e1", &port, &opened)).ok());
  ASSERT_TRUE(egress.WaitUntilServing(10000));
  std::string answer = Get(port);
  EXPECT_TRUE(absl::StrContains(answer, "200 OK")) << answer;
  EXPECT_TRUE(absl::StrContains(answer, "env=e1")) << answer;
  EXPECT_TRUE(absl::StrContains(answer, absl::StrCat("uid=", options_.uid))) << answer;
  EXPECT_TRUE(absl::StrContains(answer, "resolve=git.test=127.0.0.1:1234")) << answer;
  EXPECT_TRUE(absl::StrContains(answer, "ca=FAKE-UPSTREAM-CA")) << answer;
  // The proxy process: its own uid and gid, no capabilities, no new privileges.
  EgressHealth h = egress.Health();
  EXPECT_EQ(h.state, "up");
  EXPECT_EQ(h.environments, 1);
  EXPECT_EQ(h.attached, 1);
  // The proxy's fair-share refusal and audit-drop counters reach /healthz.
  EXPECT_EQ(h.refused_body_budget, 3);
  EXPECT_EQ(h.refused_resolve_busy, 5);
  EXPECT_EQ(h.audit_dropped, 7);
  ASSERT_GT(h.pid, 0);
  std::string status;
  ASSERT_TRUE(ReadFileToString(absl::StrCat("/proc/", h.pid, "/status"), &status).ok());
  EXPECT_TRUE(absl::StrContains(status, absl::StrCat("Uid:\t", options_.uid, "\t", options_.uid)))
      << status;
  EXPECT_TRUE(absl::StrContains(status, absl::StrCat("Gid:\t", options_.gid))) << status;
  EXPECT_TRUE(absl::StrContains(status, "CapEff:\t0000000000000000")) << status;
  EXPECT_TRUE(absl::StrContains(status, "CapBnd:") && absl::StrContains(status, "NoNewPrivs:\t1"))
      << status;
  EXPECT_TRUE(absl::StrContains(status, "Groups:\t \n") || absl::StrContains(status, "Groups:\t\n"))
      << "no supplementary groups: " << status;
  // The audit row carries esbd's tenant for the environment, not the one the proxy claimed.
  ASSERT_TRUE(WaitFor([&] { return sink_.size() >= 1; }));
  {
    std::lock_guard<std::mutex> lock(sink_.mu);
    EXPECT_EQ(sink_.rows[0].tenant, "tenant-e1");
    EXPECT_EQ(sink_.rows[0].environment_id, "e1");
    EXPECT_EQ(sink_.rows[0].decision, EgressDecision::kAllowed);
  }
  // Detach: the proxy closes the listener; refused from then on.
  egress.Detach("e1");
  EXPECT_TRUE(WaitFor([&] { return Get(port) == "refused"; }));
  EXPECT_EQ(egress.Health().environments, 0);
  std::filesystem::remove_all(dir);
}

TEST_F(ProxyEgressControlRootTest, KilledProxyFailsClosedThenRestartsAndReattachesEveryEnv) {
  ProxyEgressControl egress(options_, [this](const EgressAuditRow& r) { sink_(r); });
  ASSERT_TRUE(egress.Start().ok());
  std::atomic<int> port1{0}, port2{0}, opened1{0}, opened2{0};
  ASSERT_TRUE(egress.Attach(Attachment("e1", &port1, &opened1)).ok());
  ASSERT_TRUE(egress.Attach(Attachment("e2", &port2, &opened2)).ok());
  ASSERT_TRUE(egress.WaitUntilServing(10000));
  const int old_port = port1;
  EXPECT_TRUE(absl::StrContains(Get(port1), "env=e1"));
  const int64_t pid = egress.Health().pid;
  ASSERT_GT(pid, 0);
  ASSERT_EQ(::kill(static_cast<pid_t>(pid), SIGKILL), 0);
  // Fails closed: the listener died with the proxy.
  EXPECT_TRUE(WaitFor([&] { return Get(old_port) == "refused"; }));
  // Reported, restarted, and both environments attached again with fresh listeners.
  EXPECT_TRUE(WaitFor([&] {
    EgressHealth h = egress.Health();
    return h.restarts >= 1 && h.state == "up" && h.pid != pid;
  })) << egress.Health().state
      << " " << egress.Health().detail;
  ASSERT_TRUE(egress.WaitUntilServing(10000));
  EXPECT_GE(opened1.load(), 2);
  EXPECT_GE(opened2.load(), 2);
  EXPECT_TRUE(absl::StrContains(Get(port1), "env=e1"));
  EXPECT_TRUE(absl::StrContains(Get(port2), "env=e2"));
  // An update reaches the new proxy; the state is what a later re-attach would send.
  governance::EgressPolicy policy;
  policy.mode = governance::EgressMode::kOpen;
  EXPECT_TRUE(egress.Update("e1", policy, {}).ok());
  EXPECT_TRUE(absl::IsNotFound(egress.Update("nope", policy, {})));
  // Stop: the proxy goes and its listeners with it.
  const int64_t pid2 = egress.Health().pid;
  egress.Stop();
  EXPECT_EQ(egress.Health().state, "disabled");
  EXPECT_EQ(Get(port1), "refused");
  EXPECT_NE(::kill(static_cast<pid_t>(pid2), 0), 0) << "the proxy outlived Stop";
}

TEST_F(ProxyEgressControlRootTest, AttachWhileTheProxyIsDownIsKeptAndSentWhenItIsUp) {
  options_.min_backoff_ms = 1500;  // a window in which the proxy is down
  options_.attach_wait_ms = 0;     // do not wait for it (the test below does)
  ProxyEgressControl egress(options_, [this](const EgressAuditRow& r) { sink_(r); });
  ASSERT_TRUE(egress.Start().ok());
  ASSERT_TRUE(egress.WaitUntilServing(10000));
  ::kill(static_cast<pid_t>(egress.Health().pid), SIGKILL);
  ASSERT_TRUE(WaitFor([&] { return egress.Health().state == "down"; }));
  std::atomic<int> port{0}, opened{0};
  ASSERT_TRUE(egress.Attach(Attachment("late", &port, &opened)).ok());
  EXPECT_EQ(opened.load(), 0) << "no listener while there is no proxy to hold it";
  EXPECT_TRUE(absl::IsUnavailable(egress.Update("late", {}, {})));
  ASSERT_TRUE(egress.WaitUntilServing(10000));
  EXPECT_EQ(opened.load(), 1);
  EXPECT_TRUE(absl::StrContains(Get(port), "env=late"));
}

// A create right after esbd started (or during a restart) waits for the proxy a bounded time,
// so the new environment's egress works when the create returns (the e2e tests saw refused
// connections otherwise).
TEST_F(ProxyEgressControlRootTest, AttachWaitsForARestartingProxyAndIsServedWhenItReturns) {
  options_.min_backoff_ms = 1500;
  ProxyEgressControl egress(options_, [this](const EgressAuditRow& r) { sink_(r); });
  ASSERT_TRUE(egress.Start().ok());
  ASSERT_TRUE(egress.WaitUntilServing(10000));
  ::kill(static_cast<pid_t>(egress.Health().pid), SIGKILL);
  ASSERT_TRUE(WaitFor([&] { return egress.Health().state == "down"; }));
  std::atomic<int> port{0}, opened{0};
  ASSERT_TRUE(egress.Attach(Attachment("waits", &port, &opened)).ok());
  EXPECT_EQ(opened.load(), 1) << "served by the restarted proxy when Attach returns";
  EXPECT_TRUE(absl::StrContains(Get(port), "env=waits"));
}

// Attack: a compromised proxy reports requests as another environment's (to plant rows in
// another tenant's audit log). Events for environments esbd did not attach are dropped.
TEST_F(ProxyEgressControlRootTest, AuditEventsForUnattachedEnvironmentsAreDropped) {
  ProxyEgressControl egress(options_, [this](const EgressAuditRow& r) { sink_(r); });
  ASSERT_TRUE(egress.Start().ok());
  std::atomic<int> port{0}, opened{0};
  ASSERT_TRUE(egress.Attach(Attachment("known", &port, &opened)).ok());
  ASSERT_TRUE(egress.WaitUntilServing(10000));
  std::string forged = GetPath(port, "/forge");
  EXPECT_TRUE(absl::StrContains(forged, "200 OK")) << forged;
  Get(port);
  ASSERT_TRUE(WaitFor([&] { return sink_.size() >= 1; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  std::lock_guard<std::mutex> lock(sink_.mu);
  ASSERT_EQ(sink_.rows.size(), 1u);
  EXPECT_EQ(sink_.rows[0].environment_id, "known");
  EXPECT_EQ(sink_.rows[0].tenant, "tenant-known");
}

}  // namespace
}  // namespace esb
