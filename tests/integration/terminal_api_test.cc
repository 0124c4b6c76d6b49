// The terminal (docs/api.md "Terminal") against the real daemon and a real container: a shell
// over a WebSocket (cd, arithmetic, stty size after a resize, the exit frame with the code),
// the audit rows, and the attacks: an unauthenticated upgrade (401), another tenant's
// environment (404), a runtime without terminals (nano: 400 naming the capability), the caps
// per environment and per tenant (429), an oversized message (1009), a closed socket killing
// the shell, the idle timeout, and terminals serialised with steps (a rewind ends them).
#include <atomic>
#include <chrono>
#include <string>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "cli/ws_client.h"
#include "integration/daemon.h"

namespace esb::testing {
namespace {
namespace json = boost::json;
using cli::WebSocketClient;
using namespace std::chrono_literals;

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

constexpr const char* kKeyA = kTenantKeyA;
constexpr const char* kKeyB = kTenantKeyB;
const std::string kConfig =
    TwoTenantsConfig(R"("max_terminals_per_environment": 2, "max_terminals_per_tenant": 3)");

class TerminalApiTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why = Daemon::SkipReason();
    if (!why.empty()) GTEST_SKIP() << why;
    ASSERT_TRUE(d_.Start({.config_json = config_})) << d_.Log();
    d_.api_key = kKeyA;
  }
  cli::Endpoint Endpoint() const {
    return *cli::ParseUrl(absl::StrCat("http://127.0.0.1:", d_.port()));
  }
  // Opens a terminal; on a refusal returns null and fills `refusal`.
  std::unique_ptr<WebSocketClient> Open(const std::string& id, const std::string& query = "",
                                        const char* key = kKeyA,
                                        WebSocketClient::Refusal* refusal = nullptr) {
    std::vector<std::pair<std::string, std::string>> headers;
    if (key != nullptr) headers.emplace_back("Authorization", absl::StrCat("Bearer ", key));
    WebSocketClient::Refusal local;
    auto c = WebSocketClient::Connect(Endpoint(), "/environments/" + id + "/terminal" + query,
                                      headers, 10s, refusal ? refusal : &local);
    if (!c.ok()) return nullptr;
    return *std::move(c);
  }
  // Reads PTY output until it contains `needle` (10 s); the text read so far.
  static std::string ReadUntil(WebSocketClient& c, const std::string& needle,
                               std::string* controls = nullptr) {
    std::string out;
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    while (!absl::StrContains(out, needle) && std::chrono::steady_clock::now() < deadline) {
      auto m = c.Receive(500ms);
      if (!m.ok()) {
        if (absl::IsDeadlineExceeded(m.status())) continue;
        break;
      }
      if (m->binary)
        out += m->data;
      else if (controls != nullptr)
        *controls += m->data + "\n";
    }
    return out;
  }
  // The audit rows of `id` with `action` (polled: rows may be written behind).
  std::vector<json::object> AuditRows(const std::string& id, const std::string& action,
                                      size_t want) {
    std::vector<json::object> rows;
    for (int i = 0; i < 50; ++i) {
      rows.clear();
      HttpResult r = d_.Call("GET", "/audit?environment_id=" + id + "&limit=100");
      if (r.status == 200) {
        for (const json::value& e : r.obj().at("entries").as_array())
          if (e.as_object().at("action") == json::string_view(action))
            rows.push_back(e.as_object());
      }
      if (rows.size() >= want) break;
      std::this_thread::sleep_for(100ms);
    }
    return rows;
  }
  std::string config_ = kConfig;
  Daemon d_;
};

TEST_F(TerminalApiTest, RunsAShellResizesAndExitsWithItsCode) {
  std::string id = d_.CreateEnv();
  ASSERT_FALSE(id.empty()) << d_.Log();
  auto t = Open(id, "?cols=100&rows=30");
  ASSERT_NE(t, nullptr) << d_.Log();
  ASSERT_TRUE(t->Send("stty size\n", true).ok());
  EXPECT_TRUE(absl::StrContains(ReadUntil(*t, "30 100"), "30 100"));
  ASSERT_TRUE(t->Send("cd /tmp; echo $((6*7))\n", true).ok());
  // The echoed command line has no "42" in it: only the shell's arithmetic prints it.
  std::string out = ReadUntil(*t, "42\r\n");
  EXPECT_TRUE(absl::StrContains(out, "42\r\n")) << out;
  ASSERT_TRUE(t->Send(R"({"type":"resize","cols":120,"rows":40})", false).ok());
  ASSERT_TRUE(t->Send("stty size; pwd; whoami\n", true).ok());
  out = ReadUntil(*t, "appuser\r\n");
  EXPECT_TRUE(absl::StrContains(out, "40 120")) << out;
  EXPECT_TRUE(absl::StrContains(out, "/tmp\r\n")) << out;  // the shell kept its cwd
  ASSERT_TRUE(t->Send("exit 3\n", true).ok());
  std::string controls;
  ReadUntil(*t, "never", &controls);
  EXPECT_TRUE(absl::StrContains(controls, R"({"type":"exit","code":3})")) << controls;
  EXPECT_EQ(t->close_code(), 1000);

  std::vector<json::object> open = AuditRows(id, "terminal.open", 1);
  ASSERT_EQ(open.size(), 1u);
  EXPECT_EQ(open[0].at("detail"), "100x30");
  std::vector<json::object> close = AuditRows(id, "terminal.close", 1);
  ASSERT_EQ(close.size(), 1u);
  EXPECT_EQ(close[0].at("exit_code"), 3);
  EXPECT_GT(close[0].at("bytes").as_int64(), 0);
}

// Input that arrives after the shell exited (typed ahead, or the ^D a piped stdin ends with:
// `printf 'exit 7\n' | esb shell`) has nowhere to go; it must not cost the client the exit
// status. It did: the failed input closed the socket before the exit frame went out, and the
// CLI exited 2 instead of 7.
TEST_F(TerminalApiTest, InputAfterTheShellExitedDoesNotLoseTheExitStatus) {
  std::string id = d_.CreateEnv();
  ASSERT_FALSE(id.empty()) << d_.Log();
  auto t = Open(id);
  ASSERT_NE(t, nullptr) << d_.Log();
  ASSERT_TRUE(t->Send("exit 7\n", true).ok());
  // Keeps typing until the socket closes, so keystrokes reach esbd while the shell exits.
  std::string controls;
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (std::chrono::steady_clock::now() < deadline) {
    if (!t->Send("x", true).ok()) break;
    auto m = t->Receive(1ms);
    if (m.ok()) {
      if (!m->binary) controls += m->data + "\n";
    } else if (!absl::IsDeadlineExceeded(m.status())) {
      break;
    }
  }
  ReadUntil(*t, "never", &controls);
  EXPECT_TRUE(absl::StrContains(controls, R"({"type":"exit","code":7})")) << controls;
  EXPECT_EQ(t->close_code(), 1000) << t->close_reason();
}

TEST_F(TerminalApiTest, TheShellStartsInTheWorkspace) {
  std::string id = d_.CreateEnv();
  ASSERT_FALSE(id.empty()) << d_.Log();
  auto t = Open(id);
  ASSERT_NE(t, nullptr);
  ASSERT_TRUE(t->Send("pwd\n", true).ok());
  std::string out = ReadUntil(*t, "/workspace\r\n");
  EXPECT_TRUE(absl::StrContains(out, "/workspace\r\n")) << out;
}

TEST_F(TerminalApiTest, UnauthenticatedUpgradeIs401) {
  std::string id = d_.CreateEnv();
  ASSERT_FALSE(id.empty());
  WebSocketClient::Refusal refusal;
  EXPECT_EQ(Open(id, "", nullptr, &refusal), nullptr);
  EXPECT_EQ(refusal.status, 401) << refusal.body;
  EXPECT_EQ(Open(id, "", "esb_wrong_key_000000000", &refusal), nullptr);
  EXPECT_EQ(refusal.status, 401) << refusal.body;
  // Nothing was started: the audit log has no terminal row.
  EXPECT_TRUE(AuditRows(id, "terminal.open", 0).empty());
}

TEST_F(TerminalApiTest, AnotherTenantsEnvironmentIs404) {
  std::string id = d_.CreateEnv();
  ASSERT_FALSE(id.empty());
  WebSocketClient::Refusal refusal;
  EXPECT_EQ(Open(id, "", kKeyB, &refusal), nullptr);
  EXPECT_EQ(refusal.status, 404) << refusal.body;
  EXPECT_EQ(Open("env_doesnotexist", "", kKeyA, &refusal), nullptr);
  EXPECT_EQ(refusal.status, 404) << refusal.body;
}

TEST_F(TerminalApiTest, NanoHasNoTerminalAndSaysSo) {
  HttpResult r = d_.Call("POST", "/environments", json::object{{"runtime", "nano"}});
  if (r.status == 400 && absl::StrContains(r.str("message"), "not available"))
    GTEST_SKIP() << "nano is not available on this daemon: " << r.body;
  ASSERT_EQ(r.status, 201) << r.body;
  WebSocketClient::Refusal refusal;
  EXPECT_EQ(Open(r.str("environment_id"), "", kKeyA, &refusal), nullptr);
  EXPECT_EQ(refusal.status, 400) << refusal.body;
  EXPECT_TRUE(absl::StrContains(refusal.body, "'terminal'")) << refusal.body;
}

// gVisor's PTY does not work here (the shell reads EOF at once): refused, not a dead shell.
TEST_F(TerminalApiTest, GvisorHasNoTerminalAndSaysSo) {
  HttpResult r = d_.Call("POST", "/environments", json::object{{"runtime", "gvisor"}});
  if (r.status == 400 && absl::StrContains(r.str("message"), "not available"))
    GTEST_SKIP() << "gvisor is not available on this daemon: " << r.body;
  ASSERT_EQ(r.status, 201) << r.body;
  WebSocketClient::Refusal refusal;
  EXPECT_EQ(Open(r.str("environment_id"), "", kKeyA, &refusal), nullptr);
  EXPECT_EQ(refusal.status, 400) << refusal.body;
  EXPECT_TRUE(absl::StrContains(refusal.body, "'terminal'")) << refusal.body;
}

TEST_F(TerminalApiTest, BadSizesAndPlainGetsAreRefused) {
  std::string id = d_.CreateEnv();
  ASSERT_FALSE(id.empty());
  WebSocketClient::Refusal refusal;
  for (const char* q : {"?cols=0", "?rows=1001", "?cols=abc", "?rows=-5"}) {
    EXPECT_EQ(Open(id, q, kKeyA, &refusal), nullptr) << q;
    EXPECT_EQ(refusal.status, 400) << q << ": " << refusal.body;
  }
  HttpResult plain = d_.Call("GET", "/environments/" + id + "/terminal");
  EXPECT_EQ(plain.status, 426) << plain.body;
}

TEST_F(TerminalApiTest, OverTheCapsIs429AndAClosedTerminalFreesItsSlot) {
  std::string e1 = d_.CreateEnv(), e2 = d_.CreateEnv();
  ASSERT_FALSE(e1.empty());
  ASSERT_FALSE(e2.empty());
  auto a = Open(e1), b = Open(e1);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  WebSocketClient::Refusal refusal;
  EXPECT_EQ(Open(e1, "", kKeyA, &refusal), nullptr);  // per environment: 2
  EXPECT_EQ(refusal.status, 429) << refusal.body;
  EXPECT_TRUE(absl::StrContains(refusal.body, "max_terminals_per_environment")) << refusal.body;
  auto c = Open(e2);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(Open(e2, "", kKeyA, &refusal), nullptr);  // per tenant: 3
  EXPECT_EQ(refusal.status, 429) << refusal.body;
  EXPECT_TRUE(absl::StrContains(refusal.body, "max_terminals_per_tenant")) << refusal.body;
  // Closing one frees its slot (the shell is killed, the count released).
  a->Close();
  a.reset();
  std::unique_ptr<WebSocketClient> again;
  for (int i = 0; i < 50 && again == nullptr; ++i) {
    again = Open(e1, "", kKeyA, &refusal);
    if (again == nullptr) std::this_thread::sleep_for(100ms);
  }
  EXPECT_NE(again, nullptr) << "the closed terminal's slot was not released: " << refusal.body;
}

TEST_F(TerminalApiTest, ClosingTheSocketKillsTheShell) {
  std::string id = d_.CreateEnv();
  ASSERT_FALSE(id.empty());
  auto t = Open(id);
  ASSERT_NE(t, nullptr);
  ASSERT_TRUE(t->Send("echo $$ > /workspace/shell.pid; echo sa''ved\n", true).ok());
  ASSERT_TRUE(absl::StrContains(ReadUntil(*t, "saved"), "saved"));
  t->Close();
  t.reset();
  bool gone = false;
  for (int i = 0; i < 50 && !gone; ++i) {
    HttpResult r = d_.Exec(id, "kill -0 $(cat /workspace/shell.pid) 2>/dev/null && echo alive");
    gone = r.status == 200 && !absl::StrContains(r.str("stdout"), "alive");
    if (!gone) std::this_thread::sleep_for(100ms);
  }
  EXPECT_TRUE(gone) << "the shell outlived its WebSocket";
  std::vector<json::object> close = AuditRows(id, "terminal.close", 1);
  ASSERT_EQ(close.size(), 1u);
}

TEST_F(TerminalApiTest, OversizedMessageIsClosedWith1009) {
  std::string id = d_.CreateEnv();
  ASSERT_FALSE(id.empty());
  auto t = Open(id);
  ASSERT_NE(t, nullptr);
  t->Send(std::string(100 << 10, 'x'), true).IgnoreError();
  ReadUntil(*t, "never");
  EXPECT_EQ(t->close_code(), 1009);
}

TEST_F(TerminalApiTest, BadControlMessagesGetAnErrorAndTheTerminalLives) {
  std::string id = d_.CreateEnv();
  ASSERT_FALSE(id.empty());
  auto t = Open(id);
  ASSERT_NE(t, nullptr);
  std::string controls;
  for (const char* bad :
       {"not json", R"({"type":"launch"})", R"({"type":"resize","cols":0,"rows":5})",
        R"({"type":"resize","cols":"80","rows":24})", "[1,2]"}) {
    ASSERT_TRUE(t->Send(bad, false).ok()) << bad;
  }
  ASSERT_TRUE(t->Send("echo st''ill here\n", true).ok());
  std::string out = ReadUntil(*t, "still here", &controls);
  EXPECT_TRUE(absl::StrContains(out, "still here")) << out;
  EXPECT_TRUE(absl::StrContains(controls, "unknown control message type 'launch'")) << controls;
  EXPECT_TRUE(absl::StrContains(controls, "1-1000")) << controls;
}

// Review L5: a terminal was not serialised with steps, and what it started survived a rewind
// (a process of the "future" running in the past). A rewind now ends the environment's
// terminals (the client is told why) and kills what they started; a terminal's open waits for
// a step in progress instead of seeing a half-restored workspace.
TEST_F(TerminalApiTest, RewindAttackProcessesStartedInATerminalDoNotSurviveTheRewind) {
  std::string id = d_.CreateEnv();
  ASSERT_FALSE(id.empty());
  HttpResult w = d_.Call("POST", "/environments/" + id + "/files/write",
                         json::object{{"path", "a.txt"}, {"content", "1"}});
  ASSERT_EQ(w.status, 200) << w.body;
  auto t = Open(id);
  ASSERT_NE(t, nullptr);
  // A background process started in the terminal, detached from it as far as it can be.
  ASSERT_TRUE(t->Send("setsid nohup sleep 600 >/dev/null 2>&1 & echo $! > /workspace/bg.pid; "
                      "echo st''arted\n",
                      true)
                  .ok());
  ASSERT_TRUE(absl::StrContains(ReadUntil(*t, "started"), "started"));
  HttpResult pid = d_.Exec(id, "cat /workspace/bg.pid");
  ASSERT_EQ(pid.status, 200);
  const std::string bg = std::string(absl::StripAsciiWhitespace(pid.str("stdout")));
  ASSERT_FALSE(bg.empty());
  HttpResult rw = d_.Call("POST", "/environments/" + id + "/rewind", json::object{{"step", 1}});
  ASSERT_EQ(rw.status, 200) << rw.body;
  std::string controls;
  ReadUntil(*t, "never", &controls);
  EXPECT_TRUE(absl::StrContains(controls, "\"type\":\"exit\"")) << controls;
  EXPECT_TRUE(absl::StrContains(controls, "environment rewound to step 1")) << controls;
  EXPECT_EQ(t->close_code(), 1000);
  bool gone = false;
  for (int i = 0; i < 50 && !gone; ++i) {
    HttpResult r = d_.Exec(id, "kill -0 " + bg + " 2>/dev/null && echo alive");
    gone = r.status == 200 && !absl::StrContains(r.str("stdout"), "alive");
    if (!gone) std::this_thread::sleep_for(100ms);
  }
  EXPECT_TRUE(gone) << "a process started in the terminal survived the rewind";
  std::vector<json::object> close = AuditRows(id, "terminal.close", 1);
  ASSERT_EQ(close.size(), 1u);
  EXPECT_EQ(close[0].at("detail"), "environment rewound to step 1");
}

TEST_F(TerminalApiTest, ATerminalDoesNotOpenWhileAStepIsRunning) {
  std::string id = d_.CreateEnv();
  ASSERT_FALSE(id.empty());
  // The step runs `sleep 2` after the request left: a terminal that waited for the step cannot
  // be open before 2 s past that. (Comparing with the exec's own answer time raced: the
  // terminal's 101 and the exec's 200 travel on two connections, read by two threads.)
  const int64_t step_sent_ms = NowMs();
  std::thread step([&] { d_.Exec(id, "sleep 2"); });
  std::this_thread::sleep_for(500ms);  // the execute holds the environment's step lock
  auto t = Open(id);
  const int64_t opened_ms = NowMs();
  step.join();
  ASSERT_NE(t, nullptr);
  EXPECT_GE(opened_ms, step_sent_ms + 2000) << "the terminal opened while the step ran";
}

class TerminalIdleTest : public TerminalApiTest {
 protected:
  TerminalIdleTest() { config_ = R"({"terminal_idle_timeout_seconds": 2})"; }
};

TEST_F(TerminalIdleTest, AnIdleTerminalIsClosedAndItsShellKilled) {
  d_.api_key.clear();  // dev mode (no keys in this config)
  std::string id = d_.CreateEnv();
  ASSERT_FALSE(id.empty()) << d_.Log();
  auto t = Open(id, "", nullptr);
  ASSERT_NE(t, nullptr);
  std::string controls;
  const auto start = std::chrono::steady_clock::now();
  while (std::chrono::steady_clock::now() - start < 10s) {
    auto m = t->Receive(500ms);
    if (m.ok()) {
      if (!m->binary) controls += m->data;
      continue;
    }
    if (!absl::IsDeadlineExceeded(m.status())) break;
  }
  EXPECT_EQ(t->close_code(), 1008);
  EXPECT_TRUE(absl::StrContains(controls, "idle")) << controls;
  std::vector<json::object> close = AuditRows(id, "terminal.close", 1);
  ASSERT_EQ(close.size(), 1u);
  EXPECT_EQ(close[0].at("detail"), "idle timeout");
}

}  // namespace
}  // namespace esb::testing
