// End-to-end tests of the Environment API: real esbd, real containers.
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "integration/daemon.h"
#include "storage/store.h"

namespace esb::testing {
namespace {
namespace json = boost::json;

std::string Base64(const std::string& in) {
  static const char* k = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  size_t i = 0;
  for (; i + 2 < in.size(); i += 3) {
    uint32_t n = (uint8_t(in[i]) << 16) | (uint8_t(in[i + 1]) << 8) | uint8_t(in[i + 2]);
    out += {k[n >> 18], k[(n >> 12) & 63], k[(n >> 6) & 63], k[n & 63]};
  }
  if (i + 1 == in.size()) {
    uint32_t n = uint8_t(in[i]) << 16;
    out += {k[n >> 18], k[(n >> 12) & 63], '=', '='};
  } else if (i + 2 == in.size()) {
    uint32_t n = (uint8_t(in[i]) << 16) | (uint8_t(in[i + 1]) << 8);
    out += {k[n >> 18], k[(n >> 12) & 63], k[(n >> 6) & 63], '='};
  }
  return out;
}

class ApiTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why = Daemon::SkipReason();
    if (!why.empty()) GTEST_SKIP() << why;
  }
};

TEST_F(ApiTest, HealthzAndMetrics) {
  Daemon d;
  ASSERT_TRUE(d.Start({}));
  HttpResult h = d.Call("GET", "/healthz");
  EXPECT_EQ(h.status, 200);
  EXPECT_EQ(h.str("status"), "ok");
  EXPECT_TRUE(h.obj().at("drivers").as_object().contains("container")) << h.body;
  HttpResult m = d.Call("GET", "/metrics");
  EXPECT_EQ(m.status, 200);
  EXPECT_NE(m.body.find("esb_environments{state=\"running\"}"), std::string::npos) << m.body;
  EXPECT_NE(m.body.find("esb_exec_duration_seconds_bucket"), std::string::npos);
}

TEST_F(ApiTest, CreateExecuteFilesDelete) {
  Daemon d;
  ASSERT_TRUE(d.Start({}));
  HttpResult c = d.Call("POST", "/environments", json::object{{"env", {{"GREETING", "hej"}}}});
  ASSERT_EQ(c.status, 201) << c.body;
  std::string id = c.str("environment_id");
  ASSERT_EQ(id.rfind("env_", 0), 0u);
  EXPECT_EQ(c.str("state"), "running");

  HttpResult e = d.Exec(id, "echo hi; echo err >&2; echo $GREETING; id -u; pwd");
  ASSERT_EQ(e.status, 200) << e.body;
  EXPECT_EQ(e.str("stdout"), "hi\nhej\n1000\n/workspace\n");
  EXPECT_EQ(e.str("stderr"), "err\n");
  EXPECT_EQ(e.num("exit_code"), 0);
  EXPECT_FALSE(e.flag("error"));
  EXPECT_FALSE(e.flag("timed_out"));

  HttpResult fail = d.Exec(id, "exit 7");
  EXPECT_EQ(fail.num("exit_code"), 7);
  EXPECT_TRUE(fail.flag("error"));

  HttpResult w = d.Call("POST", "/environments/" + id + "/files/write",
                        json::object{{"path", "src/main.py"}, {"content", "print('héllo')\n"}});
  ASSERT_EQ(w.status, 200) << w.body;
  EXPECT_FALSE(w.flag("error"));
  EXPECT_EQ(w.str("message"), "File saved successfully.");
  HttpResult run = d.Exec(id, "python3 src/main.py");
  EXPECT_EQ(run.str("stdout"), "héllo\n") << run.body;
  HttpResult r = d.Call("GET", "/environments/" + id + "/files/read?path=src/main.py");
  ASSERT_EQ(r.status, 200);
  EXPECT_EQ(r.str("content"), "print('héllo')\n");
  EXPECT_EQ(r.str("encoding"), "utf-8");
  HttpResult l = d.Call("GET", "/environments/" + id + "/files/list?path=src");
  ASSERT_EQ(l.status, 200) << l.body;
  ASSERT_EQ(l.obj().at("entries").as_array().size(), 1u);
  EXPECT_EQ(l.obj().at("entries").as_array()[0].as_object().at("name").as_string(), "main.py");

  HttpResult g = d.Call("GET", "/environments/" + id);
  EXPECT_EQ(g.status, 200);
  EXPECT_EQ(g.str("state"), "running");
  EXPECT_GE(g.obj().at("usage").as_object().at("exec_count").as_int64(), 3);

  HttpResult del = d.Call("DELETE", "/environments/" + id);
  EXPECT_EQ(del.status, 200) << del.body;
  EXPECT_EQ(d.Call("DELETE", "/environments/" + id).status, 200) << "idempotent";
  HttpResult gone = d.Exec(id, "true");
  EXPECT_EQ(gone.status, 404);
  EXPECT_NE(gone.str("message").find("destroyed"), std::string::npos) << gone.body;
  EXPECT_EQ(d.Call("DELETE", "/environments/env_doesnotexist").status, 404);
  EXPECT_EQ(d.Call("GET", "/environments/" + id).str("state"), "destroyed");
}

TEST_F(ApiTest, ShellStatePersistsLikeARealSession) {
  Daemon d;
  ASSERT_TRUE(d.Start({}));
  std::string id = d.CreateEnv();
  ASSERT_EQ(d.Exec(id, "mkdir -p proj/sub && cd proj/sub && export TOKEN='a b'\"'\"'c'"
                       " && PLAIN=$'line1\\nline2' && greet() { echo \"hi $1\"; }"
                       " && alias ll='ls -la'").num("exit_code"), 0);
  HttpResult r = d.Exec(id, "pwd; echo \"$TOKEN\"; echo \"$PLAIN\"; greet bob; "
                            "bash -c 'echo child:$TOKEN'; type ll >/dev/null && echo alias-ok");
  EXPECT_EQ(r.str("stdout"),
            "/workspace/proj/sub\na b'c\nline1\nline2\nhi bob\nchild:a b'c\nalias-ok\n")
      << r.body;
  // `exit N` returns N and still keeps the session.
  EXPECT_EQ(d.Exec(id, "cd /tmp; exit 3").num("exit_code"), 3);
  EXPECT_EQ(d.Exec(id, "pwd").str("stdout"), "/tmp\n");
}

TEST_F(ApiTest, TimeoutKillsTheWholeProcessGroupAndTheSessionSurvives) {
  Daemon d;
  ASSERT_TRUE(d.Start({}));
  std::string id = d.CreateEnv();
  d.Exec(id, "export KEEP=1");
  auto start = std::chrono::steady_clock::now();
  HttpResult r = d.Exec(id, "sleep 300 & sleep 300; echo never", 1);
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(r.status, 200) << r.body;
  EXPECT_TRUE(r.flag("timed_out"));
  EXPECT_EQ(r.num("exit_code"), 124);
  EXPECT_LT(secs, 5.0);
  HttpResult ps = d.Exec(id, "ps -eo comm | grep -c '^sleep$' || true; echo $KEEP");
  EXPECT_EQ(ps.str("stdout"), "0\n1\n") << "no sleep left behind, state kept: " << ps.body;
}

TEST_F(ApiTest, OutputIsCappedAndSaysSo) {
  Daemon d;
  ASSERT_TRUE(d.Start({}));
  std::string id = d.CreateEnv();
  HttpResult r = d.Exec(id, "head -c 5000000 /dev/zero | tr '\\0' x; echo done >&2");
  ASSERT_EQ(r.status, 200);
  EXPECT_TRUE(r.flag("truncated"));
  EXPECT_EQ(r.str("stdout").size(), 1u << 20);
  EXPECT_EQ(r.str("stderr"), "done\n");
  EXPECT_EQ(r.num("exit_code"), 0);
}

TEST_F(ApiTest, StreamingExecuteDeliversChunksInOrderThenTheResult) {
  Daemon d;
  ASSERT_TRUE(d.Start({}));
  std::string id = d.CreateEnv();
  HttpResult r = Http(d.port(), "POST", "/environments/" + id + "/execute",
                      R"({"command": "for i in 1 2 3; do echo out$i; echo err$i >&2; sleep 0.2; done"})",
                      {{"Accept", "text/event-stream"}});
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.headers["content-type"].rfind("text/event-stream", 0), 0u);
  auto events = ParseSse(r.body);
  ASSERT_GE(events.size(), 7u) << r.body;
  std::string out, err;
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    const auto& o = events[i].data.as_object();
    if (events[i].event == "stdout") out += o.at("data").as_string().c_str();
    if (events[i].event == "stderr") err += o.at("data").as_string().c_str();
  }
  EXPECT_EQ(out, "out1\nout2\nout3\n");
  EXPECT_EQ(err, "err1\nerr2\nerr3\n");
  EXPECT_EQ(events.back().event, "result");
  EXPECT_EQ(events.back().data.as_object().at("exit_code").as_int64(), 0);
  EXPECT_EQ(events.back().data.as_object().at("stdout").as_string(), "out1\nout2\nout3\n");
}

TEST_F(ApiTest, BinaryAndLargeFilesRoundTrip) {
  Daemon d;
  ASSERT_TRUE(d.Start({}));
  std::string id = d.CreateEnv();
  std::string all;
  for (int i = 0; i < 256; ++i) all.push_back(static_cast<char>(i));
  HttpResult w = d.Call("POST", "/environments/" + id + "/files/write",
                        json::object{{"path", "bin/all.bin"}, {"content", Base64(all)},
                                     {"encoding", "base64"}});
  ASSERT_EQ(w.status, 200) << w.body;
  EXPECT_EQ(d.Exec(id, "sha256sum < bin/all.bin | cut -c1-16").str("stdout"),
            "40aff2e9d2d8922e\n");
  HttpResult r = d.Call("GET", "/environments/" + id + "/files/read?path=bin/all.bin");
  EXPECT_EQ(r.str("encoding"), "base64");
  EXPECT_EQ(r.str("content"), Base64(all));

  // 24 MiB through the raw endpoints (more than one agent chunk, more than the JSON limit).
  std::string big(24 << 20, '\0');
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>((i * 131) ^ (i >> 9));
  HttpResult put = Http(d.port(), "PUT", "/environments/" + id + "/files/raw?path=big.bin", big,
                        {{"Content-Type", "application/octet-stream"}});
  ASSERT_EQ(put.status, 200) << put.body;
  EXPECT_EQ(put.num("bytes"), static_cast<int64_t>(big.size()));
  HttpResult get = Http(d.port(), "GET", "/environments/" + id + "/files/raw?path=big.bin");
  ASSERT_EQ(get.status, 200);
  EXPECT_TRUE(get.body == big) << "downloaded " << get.body.size() << " bytes";
  HttpResult json_read = d.Call("GET", "/environments/" + id + "/files/read?path=big.bin");
  EXPECT_EQ(json_read.status, 413) << "files/read points large files to files/raw";

  HttpResult missing = d.Call("GET", "/environments/" + id + "/files/read?path=nope.txt");
  EXPECT_EQ(missing.status, 404);
  EXPECT_TRUE(missing.flag("error"));
  EXPECT_FALSE(missing.str("content").empty());
}

TEST_F(ApiTest, HeartbeatExtendsTheLeaseAndTheReaperDestroysExpiredOnes) {
  Daemon d;
  ASSERT_TRUE(d.Start({}));
  std::string keep = d.CreateEnv(json::object{{"ttl_seconds", 10}});
  std::string doomed = d.CreateEnv(json::object{{"ttl_seconds", 10}});
  std::string before = d.Call("GET", "/environments/" + keep).str("expires_at");
  std::this_thread::sleep_for(std::chrono::seconds(6));
  HttpResult hb = d.Call("POST", "/environments/" + keep + "/heartbeat",
                         json::object{{"ttl_seconds", 60}});
  ASSERT_EQ(hb.status, 200) << hb.body;
  EXPECT_GT(hb.str("expires_at"), before);
  // `doomed` expires ~10 s after creation; the reaper (1 s tick) then destroys it. Poll, so a
  // slow destroy on a loaded machine does not make the test flaky.
  HttpResult g;
  for (int i = 0; i < 100; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    g = d.Call("GET", "/environments/" + doomed);
    if (g.str("state") == "destroyed") break;
  }
  EXPECT_EQ(g.str("state"), "destroyed") << g.body;
  EXPECT_EQ(g.str("destroy_reason"), "ttl_expired");
  EXPECT_EQ(d.Call("GET", "/environments/" + keep).str("state"), "running");
}

TEST_F(ApiTest, BadInputGetsClear4xx) {
  Daemon d;
  ASSERT_TRUE(d.Start({}));
  std::string id = d.CreateEnv();
  struct Case {
    std::string method, target, body;
    int status;
    std::string needle;
  } cases[] = {
      {"POST", "/environments", "{not json", 400, "malformed"},
      {"POST", "/environments", "[1,2]", 400, "object"},
      {"POST", "/environments", R"({"memroy_mb": 5})", 400, "memroy_mb"},
      {"POST", "/environments", R"({"memory_mb": "lots"})", 400, "memory_mb"},
      {"POST", "/environments", R"({"memory_mb": 1})", 400, "memory_mb"},
      {"POST", "/environments", R"({"runtime": "docker"})", 400, "runtime"},
      {"POST", "/environments", R"({"runtime": "microvm"})", 400, "not available"},
      {"POST", "/environments", R"({"image": "nope"})", 400, "image"},
      {"POST", "/environments", R"({"network": "host"})", 400, "network"},
      {"POST", "/environments", R"({"env": {"1BAD": "x"}})", 400, "1BAD"},
      {"POST", "/environments/" + id + "/execute", "{}", 400, "command"},
      {"POST", "/environments/" + id + "/execute", R"({"command": 5})", 400, "command"},
      {"POST", "/environments/" + id + "/execute", R"({"command": "x", "timeout_seconds": 0})",
       400, "timeout_seconds"},
      {"POST", "/environments/" + id + "/files/write", R"({"path": "a"})", 400, "content"},
      {"POST", "/environments/" + id + "/files/write",
       R"({"path": "a", "content": "!!", "encoding": "base64"})", 400, "base64"},
      {"GET", "/environments/" + id + "/files/read", "", 400, "path"},
      {"PATCH", "/environments/" + id, "", 405, ""},
      {"GET", "/no/such/route", "", 404, ""},
      {"GET", "/audit?limit=100000", "", 400, "limit"},
  };
  for (const auto& c : cases) {
    HttpResult r = Http(d.port(), c.method, c.target, c.body);
    EXPECT_EQ(r.status, c.status) << c.method << " " << c.target << " " << c.body << " → "
                                  << r.body;
    EXPECT_TRUE(r.flag("error")) << r.body;
    EXPECT_NE(r.str("message").find(c.needle), std::string::npos)
        << "message should mention '" << c.needle << "': " << r.body;
  }
  std::string huge(17 << 20, 'x');
  HttpResult big = Http(d.port(), "POST", "/environments/" + id + "/execute",
                        "{\"command\": \"" + huge + "\"}");
  EXPECT_EQ(big.status, 413);
  EXPECT_EQ(d.Call("GET", "/healthz").status, 200) << "the daemon survived all of it";
}

TEST_F(ApiTest, ApiKeysScopeTenantsAndCrossTenantAccessIsNotFound) {
  Daemon d;
  ASSERT_TRUE(d.Start({.config_json = TwoTenantsConfig()}));
  EXPECT_EQ(d.Call("POST", "/environments").status, 401) << "no key";
  EXPECT_EQ(d.Call("GET", "/environments", nullptr, {{"Authorization", "Bearer wrong"}}).status,
            401);
  d.api_key = kTenantKeyA;
  std::string id = d.CreateEnv();
  d.Exec(id, "echo secret > s.txt");
  d.api_key = kTenantKeyB;
  EXPECT_EQ(d.Call("GET", "/environments/" + id).status, 404);
  EXPECT_EQ(d.Exec(id, "cat s.txt").status, 404);
  EXPECT_EQ(d.Call("GET", "/environments/" + id + "/files/read?path=s.txt").status, 404);
  EXPECT_EQ(d.Call("POST", "/environments/" + id + "/heartbeat").status, 404);
  EXPECT_EQ(d.Call("DELETE", "/environments/" + id).status, 404);
  EXPECT_TRUE(d.Call("GET", "/environments").obj().at("environments").as_array().empty());
  EXPECT_TRUE(d.Call("GET", "/audit").obj().at("entries").as_array().empty());
  d.api_key = kTenantKeyA;
  EXPECT_EQ(d.Exec(id, "cat s.txt").str("stdout"), "secret\n") << "owner unaffected";
  // The core's audit rows name the key that acted (its public id), never the secret.
  HttpResult rows = d.Call("GET", "/audit?environment_id=" + id);
  ASSERT_FALSE(rows.obj().at("entries").as_array().empty()) << rows.body;
  for (const auto& e : rows.obj().at("entries").as_array()) {
    const std::string principal(e.as_object().at("principal").as_string());
    EXPECT_TRUE(principal.rfind("key_", 0) == 0) << rows.body;
  }
  EXPECT_EQ(rows.body.find("secret_0001"), std::string::npos) << rows.body;
  EXPECT_EQ(d.Call("GET", "/environments").obj().at("environments").as_array().size(), 1u);
}

TEST_F(ApiTest, AuditRecordsEveryActionAndFilters) {
  Daemon d;
  ASSERT_TRUE(d.Start({}));
  std::string a = d.CreateEnv();
  std::string b = d.CreateEnv();
  d.Exec(a, "echo needle-in-haystack; exit 4");
  d.Exec(b, "echo other");
  d.Call("POST", "/environments/" + a + "/files/write",
         json::object{{"path", "notes.txt"}, {"content", "x"}});
  // A missing file is audited whatever its name; an unknown environment is not.
  d.Call("GET", "/environments/" + a + "/files/read?path=environment-missing.txt");
  d.Call("GET", "/environments/env_nope/files/read?path=x.txt");
  HttpResult missing = d.Call("GET", "/audit?q=environment-missing");
  ASSERT_EQ(missing.obj().at("entries").as_array().size(), 1u) << missing.body;
  EXPECT_EQ(missing.obj().at("entries").as_array()[0].as_object().at("action").as_string(),
            "files.read");
  HttpResult nope = d.Call("GET", "/audit?environment_id=env_nope");
  EXPECT_TRUE(nope.obj().at("entries").as_array().empty()) << nope.body;
  HttpResult q = d.Call("GET", "/audit?q=haystack");
  ASSERT_EQ(q.status, 200) << q.body;
  auto entries = q.obj().at("entries").as_array();
  ASSERT_EQ(entries.size(), 1u) << q.body;
  EXPECT_EQ(entries[0].as_object().at("environment_id").as_string(), a);
  EXPECT_EQ(entries[0].as_object().at("exit_code").as_int64(), 4);
  EXPECT_EQ(entries[0].as_object().at("action").as_string(), "execute");
  EXPECT_EQ(entries[0].as_object().at("principal").as_string(), "dev") << "no keys: dev mode";
  HttpResult env_a = d.Call("GET", "/audit?environment_id=" + a);
  std::set<std::string> actions;
  for (const auto& e : env_a.obj().at("entries").as_array())
    actions.insert(std::string(e.as_object().at("action").as_string()));
  EXPECT_TRUE(actions.count("environment.create") && actions.count("execute") &&
              actions.count("files.write"))
      << env_a.body;
  EXPECT_EQ(d.Call("GET", "/audit?since=2999-01-01T00:00:00Z").obj().at("entries").as_array().size(),
            0u);
  EXPECT_EQ(d.Call("GET", "/audit?since=yesterday").status, 400);
}

TEST_F(ApiTest, EnvironmentsSurviveADaemonRestartAndDeadOnesAreCleanedUp) {
  Daemon d;
  ASSERT_TRUE(d.Start({}));
  std::string keep = d.CreateEnv();
  std::string victim = d.CreateEnv();
  d.Exec(keep, "echo persisted > state.txt; export X=42");
  std::string state = d.state_dir();
  d.Stop();
  EXPECT_EQ(d.Call("GET", "/healthz").status, 0) << "the daemon is really down";
  // While esbd is down, the victim's container dies: kill every process in its cgroup.
  std::string kill_cmd = "for i in 1 2 3; do grep -l " + victim +
                         " /proc/[0-9]*/cgroup 2>/dev/null | cut -d/ -f3 | xargs -r kill -9; "
                         "sleep 0.3; done; ! grep -lq " + victim + " /proc/[0-9]*/cgroup";
  ASSERT_EQ(std::system(("bash -c '" + kill_cmd + "'").c_str()), 0);
  Daemon d2;
  ASSERT_TRUE(d2.Start({}, state));
  HttpResult r = d2.Exec(keep, "cat state.txt; echo $X");
  EXPECT_EQ(r.str("stdout"), "persisted\n42\n") << r.body << d2.Log();
  HttpResult v = d2.Call("GET", "/environments/" + victim);
  EXPECT_EQ(v.str("state"), "destroyed") << v.body;
  EXPECT_EQ(v.str("destroy_reason"), "died_while_daemon_down");
  d2.Call("DELETE", "/environments/" + keep);
}

std::string ShellOutput(const std::string& cmd) {
  std::string out;
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return out;
  char buf[256];
  while (fgets(buf, sizeof buf, p) != nullptr) out += buf;
  pclose(p);
  return out;
}

// Host uid owning /workspace/<file> of environment `id` (via its init's /proc/<pid>/root).
std::string HostOwner(const std::string& id, const std::string& file) {
  return ShellOutput("pid=$(grep -l " + id +
                     " /proc/[0-9]*/cgroup 2>/dev/null | head -1 | "
                     "cut -d/ -f3); stat -c %u /proc/$pid/root/workspace/" +
                     file);
}

// Registry entries (userns uid ranges) held by environment `id` of the daemon's state dir.
std::string RangesOf(const Daemon& d, const std::string& id) {
  return ShellOutput("grep -lx '" + d.state_dir() + "/container/envs/" + id +
                     "' /run/entersandbox/userns/* 2>/dev/null");
}

// User namespaces end to end: /healthz says so, a sandbox's files have mapped host uids (not 0,
// not 1000, different per sandbox), the mapping survives a daemon restart, and DELETE and
// `esbd cleanup` free the environments' uid ranges.
TEST_F(ApiTest, UserNamespacesMapSandboxUidsAcrossRestartAndCleanup) {
  Daemon d;
  ASSERT_TRUE(d.Start({}));
  HttpResult h = d.Call("GET", "/healthz");
  const boost::json::object& userns = h.obj().at("userns").as_object().at("container").as_object();
  ASSERT_TRUE(userns.at("enabled").as_bool()) << h.body;
  std::string a = d.CreateEnv();
  std::string b = d.CreateEnv();
  EXPECT_EQ(d.Exec(a, "touch mine; stat -c %u mine").str("stdout"), "1000\n");
  EXPECT_EQ(d.Exec(b, "touch mine; stat -c %u mine").str("stdout"), "1000\n");
  const std::string owner_a = HostOwner(a, "mine");
  const std::string owner_b = HostOwner(b, "mine");
  std::printf("[ userns   ] host owners: %s %s", owner_a.c_str(), owner_b.c_str());
  EXPECT_GE(std::atoll(owner_a.c_str()), 65536) << owner_a;
  EXPECT_GE(std::atoll(owner_b.c_str()), 65536) << owner_b;
  EXPECT_NE(owner_a, owner_b);
  EXPECT_FALSE(RangesOf(d, a).empty());
  ASSERT_EQ(d.Call("DELETE", "/environments/" + a).status, 200);
  EXPECT_EQ(RangesOf(d, a), "") << "the range of a deleted environment is still taken";
  std::string state = d.state_dir();
  d.Stop();
  Daemon d2;
  ASSERT_TRUE(d2.Start({}, state));
  HttpResult r = d2.Exec(b, "echo again > mine2; cat mine2");
  EXPECT_EQ(r.str("stdout"), "again\n") << r.body << d2.Log();
  EXPECT_EQ(HostOwner(b, "mine2"), owner_b) << "re-attach keeps the same mapping";
  d2.StopAndCleanup();
  EXPECT_EQ(RangesOf(d2, b), "") << "esbd cleanup left the range taken";
}

TEST_F(ApiTest, WarmPoolServesCreatesQuicklyAndRefills) {
  Daemon d;
  ASSERT_TRUE(d.Start({.pool_size = 2}));
  for (int i = 0; i < 100 && d.Call("GET", "/healthz").num("pool_ready") < 2; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ASSERT_EQ(d.Call("GET", "/healthz").num("pool_ready"), 2);
  auto start = std::chrono::steady_clock::now();
  HttpResult c = d.Call("POST", "/environments", json::object{{"env", {{"FROM", "pool"}}}});
  double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  ASSERT_EQ(c.status, 201) << c.body;
  EXPECT_TRUE(c.flag("pooled"));
  EXPECT_LT(ms, 500.0);
  EXPECT_EQ(d.Exec(c.str("environment_id"), "echo $FROM").str("stdout"), "pool\n");
  for (int i = 0; i < 100 && d.Call("GET", "/healthz").num("pool_ready") < 2; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(d.Call("GET", "/healthz").num("pool_ready"), 2) << "refilled";
}

TEST_F(ApiTest, UnixSocketListenerServesTheApi) {
  Daemon d;
  ASSERT_TRUE(d.Start({}));
  HttpResult h = Http(0, "GET", "/environments", "", {}, d.state_dir() + "/esbd.sock");
  EXPECT_EQ(h.status, 200) << h.error;
}

TEST_F(ApiTest, NothingLeaksAfterCreateDeleteCycles) {
  Daemon d;
  ASSERT_TRUE(d.Start({}));
  std::vector<std::string> ids;
  for (int i = 0; i < 5; ++i) {
    std::string id = d.CreateEnv();
    d.Exec(id, "sleep 1000 >/dev/null 2>&1 &");
    ids.push_back(id);
  }
  for (const auto& id : ids) ASSERT_EQ(d.Call("DELETE", "/environments/" + id).status, 200);
  for (const auto& id : ids) {
    EXPECT_FALSE(std::filesystem::exists(d.state_dir() + "/container/envs/" + id)) << id;
    std::ifstream mounts("/proc/self/mountinfo");
    std::string line;
    while (std::getline(mounts, line)) EXPECT_EQ(line.find(id), std::string::npos) << line;
    std::string cg = "grep -l " + id + " /proc/[0-9]*/cgroup 2>/dev/null | wc -l";
    FILE* p = popen(cg.c_str(), "r");
    char buf[32] = {0};
    fgets(buf, sizeof buf, p);
    pclose(p);
    EXPECT_EQ(std::atoi(buf), 0) << "processes left in the cgroup of " << id;
  }
  FILE* p = popen("pgrep -f '^sleep 1000$' | wc -l", "r");
  char buf[32] = {0};
  fgets(buf, sizeof buf, p);
  pclose(p);
  EXPECT_EQ(std::atoi(buf), 0) << "background processes of deleted environments survived";
}

}  // namespace
}  // namespace esb::testing

namespace esb::testing {
namespace {

double MedianMs(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

double ElapsedMs(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

TEST_F(ApiTest, OneTenantsExpensiveAuditSearchLoopDoesNotStallAnotherTenant) {
  // Tenant "b" attacks, tenant "a" is the bystander.
  const std::string config = TwoTenantsConfig(R"("audit": {"query_timeout_ms": 100})");
  Daemon d;
  ASSERT_TRUE(d.Start({.config_json = config}));
  std::string state = d.state_dir();
  d.Stop();
  {
    // Thousands of the attacker's rows, each ~1 KiB of distinct words behind a few common
    // prefixes: the worst case for a prefix search.
    StoreOptions fill;
    fill.audit_burst = 1e9;
    auto store = Store::Open(state + "/esbd.db", fill);
    ASSERT_TRUE(store.ok()) << store.status();
    for (int i = 0; i < 4000; ++i) {
      AuditEntry e;
      e.tenant = "b";
      e.action = "files.read";
      e.status = 404;
      // Recent (inside retention), as an attacker's own rows would be.
      e.time_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                      std::chrono::system_clock::now().time_since_epoch())
                      .count() - 10'000 + i;
      static const char* kStarts[] = {"abc", "abd", "abe", "xyz"};
      for (int w = 0; e.detail.size() < 1000; ++w)
        e.detail += absl::StrCat(kStarts[w % 4], i * 131 + w * 7919, " ");
      ASSERT_TRUE((*store)->AppendAudit(e).ok());
    }
  }
  Daemon d2;
  ASSERT_TRUE(d2.Start({.config_json = config}, state));
  // The reported attack query is refused outright (single-letter prefixes).
  std::string letters;
  for (char c = 'a'; c <= 'z'; ++c) letters += absl::StrCat(c == 'a' ? "" : "%20OR%20", std::string(1, c), "*");
  HttpResult refused =
      d2.Call("GET", "/audit?limit=1000&q=" + letters, nullptr, BearerAuth(kTenantKeyB));
  EXPECT_EQ(refused.status, 400) << refused.body;
  // The most expensive query the caps allow, looped by two clients of the attacker.
  const std::string expensive = "/audit?limit=1000&q=abc*%20OR%20abd*%20OR%20abe*%20OR%20xyz*";
  std::atomic<bool> stop{false};
  std::atomic<int> cut_off{0}, answered{0}, other{0};
  std::atomic<int64_t> slowest_attack_ms{0};
  std::vector<std::thread> attackers;
  for (int t = 0; t < 2; ++t) {
    attackers.emplace_back([&] {
      while (!stop) {
        auto t0 = std::chrono::steady_clock::now();
        HttpResult r = d2.Call("GET", expensive, nullptr, BearerAuth(kTenantKeyB));
        int64_t ms = static_cast<int64_t>(ElapsedMs(t0));
        if (ms > slowest_attack_ms) slowest_attack_ms = ms;
        if (r.status == 503 && r.body.find("too expensive") != std::string::npos) ++cut_off;
        else if (r.status == 200) ++answered;
        else ++other;  // 429: the tenant's other search is still running
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  std::vector<double> victim;
  for (int i = 0; i < 40; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    HttpResult r = d2.Call("GET", "/environments", nullptr, BearerAuth(kTenantKeyA));
    victim.push_back(ElapsedMs(t0));
    EXPECT_EQ(r.status, 200) << r.body;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  stop = true;
  for (auto& t : attackers) t.join();
  std::sort(victim.begin(), victim.end());
  std::cout << "victim GET /environments median " << MedianMs(victim) << " ms, p90 "
            << victim[victim.size() * 9 / 10] << " ms, max "
            << *std::max_element(victim.begin(), victim.end()) << " ms; attacker: " << cut_off
            << " cut off (503), " << answered << " answered, " << other
            << " other; slowest attack request " << slowest_attack_ms << " ms\n";
  EXPECT_LT(MedianMs(victim), 100.0);
  // Whether a search hits the 100 ms deadline depends on the machine's speed (a fast one
  // answers it in time): cut_off is a measurement, not a condition. What the test asserts is
  // that the attack ran and the other tenant was not stalled by it (the deadline itself:
  // AuditHardeningTest.ExpensiveSearchIsCutOffByTheDeadline, with a query proven to overrun).
  EXPECT_GT(cut_off.load() + answered.load(), 0) << "the attacker's searches must actually run";
  EXPECT_LT(slowest_attack_ms.load(), 2000) << "no attack request hangs";
}

TEST_F(ApiTest, AuditFloodOfMissing4KiBPathReadsStaysBounded) {
  Daemon d;
  ASSERT_TRUE(d.Start({}));
  std::string id = d.CreateEnv();
  const std::string db = d.state_dir() + "/esbd.db";
  auto bytes = [&] {
    struct stat st {};
    int64_t n = ::stat(db.c_str(), &st) == 0 ? st.st_size : 0;
    if (::stat((db + "-wal").c_str(), &st) == 0) n += st.st_size;
    return n;
  };
  const int64_t before = bytes();
  std::atomic<int> reads{0};
  auto end = std::chrono::steady_clock::now() + std::chrono::seconds(4);
  std::vector<std::thread> threads;
  for (int t = 0; t < 12; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; std::chrono::steady_clock::now() < end; ++i) {
        // ~4 KiB, in components a filesystem accepts (NAME_MAX), so the read is a plain miss.
        std::string path = "/workspace/" + std::to_string(t) + "_" + std::to_string(i);
        while (path.size() < 4000) path += "/" + std::string(200, 'a' + i % 26);
        HttpResult r = d.Call("GET", "/environments/" + id + "/files/read?path=" + path);
        if (r.status == 404) ++reads;
        else if (i == 0) ADD_FAILURE() << "expected a 404 miss: " << r.status << " " << r.body;
      }
    });
  }
  for (auto& th : threads) th.join();
  const int64_t growth = bytes() - before;
  HttpResult a = d.Call("GET", "/audit?limit=1000&environment_id=" + id);
  ASSERT_EQ(a.status, 200) << a.body;
  const auto& entries = a.obj().at("entries").as_array();
  size_t truncated = 0;
  for (const auto& e : entries) {
    const auto& detail = e.as_object().at("detail").as_string();
    EXPECT_LT(detail.size(), 1200u);
    if (std::string_view(detail).find("…[truncated") != std::string_view::npos) ++truncated;
  }
  d.Call("DELETE", "/environments/" + id);
  d.Stop();  // closing the store checkpoints the WAL into esbd.db: what stays on disk
  const int64_t kept = bytes() - before;
  std::cout << reads << " reads of missing 4 KiB paths in 4 s → " << entries.size()
            << " audit rows; esbd.db+wal +" << growth << " bytes while running, +" << kept
            << " bytes after the checkpoint\n";
  ASSERT_GT(reads.load(), 300) << "the attack must actually run";
  // Burst 200 + 20/s over ~4-5 s (+ the create row); the rest is counted into summaries.
  EXPECT_LE(entries.size(), 200u + 20u * 6u);
  EXPECT_GT(truncated, 100u) << "cut paths are marked";
  // The WAL may hold up to its 4 MiB autocheckpoint size while running; the data is small.
  EXPECT_LT(growth, 6 << 20);
  EXPECT_LT(kept, 2 << 20);
}

TEST_F(ApiTest, ConcurrentCreatesCannotOvershootTheTenantQuota) {
  Daemon d;
  ASSERT_TRUE(d.Start({.config_json = R"({"max_environments_per_tenant": 3})"}));
  std::atomic<int> created{0}, refused{0}, other{0};
  std::vector<std::string> ids;
  std::mutex ids_mu;
  std::vector<std::thread> threads;
  for (int i = 0; i < 10; ++i) {
    threads.emplace_back([&] {
      HttpResult r = d.Call("POST", "/environments", json::object{});
      if (r.status == 201) {
        ++created;
        std::lock_guard<std::mutex> lock(ids_mu);
        ids.push_back(r.str("environment_id"));
      } else if (r.status == 429) {
        ++refused;
      } else {
        ++other;
        ADD_FAILURE() << r.status << " " << r.body;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(created.load(), 3);
  EXPECT_EQ(refused.load(), 7);
  EXPECT_EQ(d.Call("GET", "/environments").obj().at("environments").as_array().size(), 3u);
  for (const auto& id : ids) d.Call("DELETE", "/environments/" + id);
}

TEST_F(ApiTest, NanoSessionsDoNotSurviveADaemonRestartAndAreReportedGone) {
  Daemon d;
  ASSERT_TRUE(d.Start({}));
  if (!d.Call("GET", "/healthz").obj().at("drivers").as_object().contains("nano"))
    GTEST_SKIP() << "the nano runtime is not available in this build (needs python.wasm)";
  std::string nano = d.CreateEnv({{"runtime", "nano"}});
  std::string container = d.CreateEnv();
  std::string state = d.state_dir();
  d.Stop();
  Daemon d2;
  ASSERT_TRUE(d2.Start({}, state));
  // As documented (README, docs/api.md): containers survive, nano sessions do not.
  HttpResult n = d2.Call("GET", "/environments/" + nano);
  EXPECT_EQ(n.str("state"), "destroyed") << n.body;
  EXPECT_EQ(n.str("destroy_reason"), "died_while_daemon_down") << n.body;
  EXPECT_EQ(d2.Call("GET", "/environments/" + container).str("state"), "running");
  d2.Call("DELETE", "/environments/" + container);
}

}  // namespace
}  // namespace esb::testing
