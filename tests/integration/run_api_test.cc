// POST /run and nano environments, end to end: real esbd, real CPython-on-wasm workers, and the
// container tier for the fallback.
#include <unistd.h>

#include <chrono>
#include <filesystem>

#include <gtest/gtest.h>

#include "integration/daemon.h"

namespace esb::testing {
namespace {
namespace json = boost::json;

class RunApiTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!Reason().empty()) return;
    daemon_ = new Daemon();
    if (!daemon_->Start({})) {
      delete daemon_;
      daemon_ = nullptr;
    }
  }
  static void TearDownTestSuite() {
    delete daemon_;
    daemon_ = nullptr;
  }
  static std::string Reason() {
    std::string why = Daemon::SkipReason();
    if (!why.empty()) return why;
    const char* wasm = std::getenv("ESBD_PYTHON_WASM");
    if (!wasm || !*wasm) return "ESBD_PYTHON_WASM is not set (run via `make test`)";
    if (!std::filesystem::exists(std::string(ESB_BUILD_DIR) + "/esb-nano-worker"))
      return "build/esb-nano-worker was not built (it needs the python.wasm artefact)";
    return "";
  }
  void SetUp() override {
    std::string why = Reason();
    if (!why.empty()) GTEST_SKIP() << why;
    ASSERT_NE(daemon_, nullptr) << "suite set-up failed";
  }
  HttpResult Run(const std::string& code, json::object extra = {}) {
    extra["code"] = code;
    return daemon_->Call("POST", "/run", extra);
  }
  static Daemon* daemon_;
};
Daemon* RunApiTest::daemon_ = nullptr;

TEST_F(RunApiTest, PrintRunsOnNano) {
  HttpResult r = Run("print(1 + 1)");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.str("stdout"), "2\n");
  EXPECT_EQ(r.num("exit_code"), 0);
  EXPECT_EQ(r.str("tier"), "nano");
  EXPECT_TRUE(r.obj().at("error").is_null());
  EXPECT_TRUE(daemon_->Call("GET", "/healthz").obj().at("drivers").as_object().contains("nano"));
}

TEST_F(RunApiTest, StdlibLogicWorks) {
  HttpResult r = Run(
      "import json, re, datetime, collections, decimal, dataclasses, statistics\n"
      "@dataclasses.dataclass\nclass P:\n    x: int\n"
      "print(json.dumps({'n': collections.Counter('abca')['a'], 'm': re.findall(r'\\d+', 'a1b22'),"
      " 'd': str(decimal.Decimal('1.1') + decimal.Decimal('2.2')), 'p': P(3).x,"
      " 'mean': statistics.mean([1, 2, 3]), 'y': datetime.date(2026, 11, 22).year}))");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.str("stdout"),
            "{\"n\": 2, \"m\": [\"1\", \"22\"], \"d\": \"3.3\", \"p\": 3, \"mean\": 2, \"y\": 2026}\n")
      << r.body;
}

TEST_F(RunApiTest, ExceptionComesBackStructured) {
  HttpResult r = Run("def f():\n    return {}['missing']\nf()\n");
  ASSERT_EQ(r.status, 200);
  EXPECT_EQ(r.num("exit_code"), 1);
  const auto& e = r.obj().at("error").as_object();
  EXPECT_EQ(e.at("type").as_string(), "KeyError");
  EXPECT_EQ(e.at("message").as_string(), "'missing'");
  EXPECT_NE(std::string(e.at("traceback").as_string()).find("in f"), std::string::npos);
}

TEST_F(RunApiTest, UnsupportedModuleOnNanoIsReportedAndAutoFallsBackToHeavy) {
  HttpResult nano = Run("import numpy", {{"runtime", "nano"}});
  ASSERT_EQ(nano.status, 200) << nano.body;
  EXPECT_EQ(nano.str("unsupported_module"), "numpy") << nano.body;
  EXPECT_NE(nano.num("exit_code"), 0);
  HttpResult aut = Run("import numpy\nprint(int(numpy.arange(5).sum()))");
  ASSERT_EQ(aut.status, 200) << aut.body;
  EXPECT_EQ(aut.str("stdout"), "10\n");
  EXPECT_EQ(aut.str("tier"), "heavy");
  EXPECT_NE(aut.str("reason").find("numpy"), std::string::npos) << aut.body;
}

TEST_F(RunApiTest, AutoRoutesJsonToNanoAndPandasToHeavyAndSaysWhy) {
  HttpResult j = Run("import json\nprint(json.dumps([1]))");
  ASSERT_EQ(j.status, 200) << j.body;
  EXPECT_EQ(j.str("tier"), "nano");
  EXPECT_EQ(j.str("reason"), "imports: json") << j.body;
  HttpResult p = Run("import pandas as pd\nprint(pd.Series([1, 2]).sum())");
  ASSERT_EQ(p.status, 200) << p.body;
  EXPECT_EQ(p.str("stdout"), "3\n");
  EXPECT_EQ(p.str("tier"), "heavy");
  EXPECT_NE(p.str("reason").find("pandas"), std::string::npos) << p.body;
}

TEST_F(RunApiTest, AutoFallsBackWhenNanoMeetsWhatTheRouterCouldNotSee) {
  // The router sees only `import os` (nano); at run time nano refuses os.system.
  HttpResult r = Run("import os\nrc = getattr(os, 'sys' + 'tem')('echo fell back')\nprint(rc)");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.str("stdout"), "fell back\n0\n") << r.body;
  EXPECT_EQ(r.str("tier"), "heavy");
  EXPECT_NE(r.str("reason").find("reran on heavy"), std::string::npos) << r.body;
  EXPECT_NE(r.str("reason").find("imports: os"), std::string::npos) << r.body;
}

TEST_F(RunApiTest, EscapeAttemptsAreContained) {
  std::string secret = "/tmp/esb-nano-secret-" + std::to_string(getpid());
  FILE* f = fopen(secret.c_str(), "w");
  fputs("HOST-SECRET", f);
  fclose(f);
  struct Case {
    const char* name;
    std::string code;
  } cases[] = {
      {"read host file", "print(open('" + secret + "').read())"},
      {"dot-dot traversal", "print(open('../../../../../../.." + secret + "').read())"},
      {"etc passwd", "print(open('/etc/passwd').read())"},
      {"proc", "print(open('/proc/self/environ').read())"},
      {"socket", "import socket; s = socket.socket(); s.connect(('127.0.0.1', 22)); print('CONNECTED')"},
      {"subprocess", "import subprocess; print(subprocess.run(['id']).returncode)"},
      {"os.system", "import os; print(os.system('id'))"},
  };
  for (const auto& c : cases) {
    HttpResult r = Run(c.code, {{"runtime", "nano"}});
    ASSERT_EQ(r.status, 200) << c.name << ": " << r.body;
    EXPECT_EQ(r.body.find("HOST-SECRET"), std::string::npos) << c.name;
    EXPECT_EQ(r.body.find("root:x:0:0"), std::string::npos) << c.name;
    EXPECT_EQ(r.str("stdout").find("CONNECTED"), std::string::npos) << c.name;
    EXPECT_NE(r.num("exit_code"), 0) << c.name << ": " << r.body;
  }
  std::filesystem::remove(secret);
}

TEST_F(RunApiTest, InfiniteLoopTimesOutAndTheDaemonStaysHealthy) {
  auto start = std::chrono::steady_clock::now();
  HttpResult r = Run("while True:\n    pass\n", {{"runtime", "nano"}, {"timeout_ms", 500}});
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_TRUE(r.flag("timed_out"));
  EXPECT_EQ(r.num("exit_code"), 124);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  EXPECT_EQ(Run("print('still fine')").str("stdout"), "still fine\n");
}

TEST_F(RunApiTest, MemoryRecursionAndOutputBombsAreContained) {
  HttpResult mem = Run("x = bytearray(512 * 1024 * 1024)",
                       {{"runtime", "nano"}, {"memory_limit_mb", 64}});
  ASSERT_EQ(mem.status, 200) << mem.body;
  EXPECT_EQ(mem.obj().at("error").as_object().at("type").as_string(), "MemoryError") << mem.body;
  HttpResult rec = Run("def f(n): return f(n + 1)\nf(0)", {{"runtime", "nano"}});
  EXPECT_EQ(rec.obj().at("error").as_object().at("type").as_string(), "RecursionError")
      << rec.body;
  HttpResult out = Run("print('x' * (50 * 1024 * 1024))", {{"runtime", "nano"}});
  ASSERT_EQ(out.status, 200);
  EXPECT_TRUE(out.flag("truncated"));
  EXPECT_LE(out.str("stdout").size(), 1u << 20);
}

TEST_F(RunApiTest, NanoEnvironmentKeepsStateAndHasNoShell) {
  HttpResult c = daemon_->Call("POST", "/environments", json::object{{"runtime", "nano"}});
  ASSERT_EQ(c.status, 201) << c.body;
  std::string id = c.str("environment_id");
  auto run = [&](const std::string& code) {
    return daemon_->Call("POST", "/environments/" + id + "/run", json::object{{"code", code}});
  };
  EXPECT_EQ(run("import math\ntotal = 40").num("exit_code"), 0);
  EXPECT_EQ(run("total += 2\nprint(total, math.pi > 3)").str("stdout"), "42 True\n");
  HttpResult w = daemon_->Call("POST", "/environments/" + id + "/files/write",
                               json::object{{"path", "data.txt"}, {"content", "from api"}});
  ASSERT_EQ(w.status, 200) << w.body;
  EXPECT_EQ(run("print(open('data.txt').read())").str("stdout"), "from api\n");
  EXPECT_EQ(run("open('out.txt', 'w').write('from python')").num("exit_code"), 0);
  EXPECT_EQ(daemon_->Call("GET", "/environments/" + id + "/files/read?path=out.txt")
                .str("content"),
            "from python");
  HttpResult sh = daemon_->Exec(id, "ls");
  EXPECT_EQ(sh.status, 400);
  EXPECT_NE(sh.str("message").find("no shell"), std::string::npos) << sh.body;
  EXPECT_EQ(daemon_->Call("DELETE", "/environments/" + id).status, 200);
  EXPECT_EQ(run("print(1)").status, 404);
}

TEST_F(RunApiTest, NanoSessionFilesUnderWorkspaceArtifactsAreArtifacts) {
  HttpResult c = daemon_->Call("POST", "/environments", json::object{{"runtime", "nano"}});
  ASSERT_EQ(c.status, 201) << c.body;
  std::string id = c.str("environment_id");
  auto run = [&](const std::string& code) {
    return daemon_->Call("POST", "/environments/" + id + "/run", json::object{{"code", code}});
  };
  HttpResult r = run("import os, json\nos.makedirs('/workspace/artifacts/sub', exist_ok=True)\n"
                     "open('/workspace/artifacts/sub/r.json', 'w').write(json.dumps([1, 2]))");
  ASSERT_EQ(r.status, 200) << r.body;
  const json::array& arts = r.obj().at("artifacts").as_array();
  ASSERT_EQ(arts.size(), 1u) << r.body;
  EXPECT_EQ(arts[0].at("name").as_string(), "sub/r.json");
  EXPECT_EQ(arts[0].at("mime_type").as_string(), "application/json");
  HttpResult got = daemon_->Call("GET", std::string(arts[0].at("url").as_string()));
  EXPECT_EQ(got.status, 200);
  EXPECT_EQ(got.body, "[1, 2]");
  // Untouched since: not reported again.
  EXPECT_TRUE(run("x = 1").obj().at("artifacts").as_array().empty());
  daemon_->Call("DELETE", "/environments/" + id);
}

TEST_F(RunApiTest, BadRunRequestsGet4xx) {
  EXPECT_EQ(daemon_->Call("POST", "/run", json::object{}).status, 400);
  EXPECT_EQ(daemon_->Call("POST", "/run", json::object{{"code", 5}}).status, 400);
  EXPECT_EQ(Run("1", {{"runtime", "gpu"}}).status, 400);
  EXPECT_EQ(Run("1", {{"timeout_ms", 0}}).status, 400);
  EXPECT_EQ(Run("1", {{"bogus", true}}).status, 400);
}

TEST_F(RunApiTest, OtherBadRequestsAreNotTierUnavailable) {
  HttpResult r = Run("1", {{"timeout_ms", 0}});
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(r.str("code"), "bad_request") << r.body;
}

// A daemon without the nano tier answers runtime "nano" with the machine-readable code
// "tier_unavailable" (400), which clients (the Python SDK) test instead of the message text.
TEST(RunTierUnavailableTest, RuntimeNanoWithoutTheNanoTierSaysTierUnavailable) {
  std::string why = Daemon::SkipReason();
  if (!why.empty()) GTEST_SKIP() << why;
  Daemon daemon;
  ASSERT_TRUE(daemon.Start({.extra_args = {"--nano-worker", "/nonexistent/esb-nano-worker"}}))
      << daemon.Log();
  ASSERT_FALSE(daemon.Call("GET", "/healthz").obj().at("drivers").as_object().contains("nano"));
  HttpResult r =
      daemon.Call("POST", "/run", json::object{{"code", "print(1)"}, {"runtime", "nano"}});
  EXPECT_EQ(r.status, 400) << r.body;
  EXPECT_EQ(r.str("code"), "tier_unavailable") << r.body;
  EXPECT_NE(r.str("message").find("not available"), std::string::npos) << r.body;
}

// Stateful Python in a container environment (issue 5, heavy tier): kernel.py keeps one
// interpreter per environment. Needs only the container driver, not the nano artefact.
class ContainerKernelTest : public SharedDaemonTest<ContainerKernelTest> {
 protected:
  void SetUp() override {
    SharedDaemonTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    id_ = daemon_->CreateEnv(json::object{{"runtime", "container"}});
    ASSERT_FALSE(id_.empty());
  }
  void TearDown() override {
    if (daemon_ && !id_.empty()) daemon_->Call("DELETE", "/environments/" + id_);
  }
  HttpResult Cell(const std::string& code, int64_t timeout_ms = 30000) {
    HttpResult r = daemon_->Call("POST", "/environments/" + id_ + "/run",
                                 json::object{{"code", code}, {"timeout_ms", timeout_ms}});
    EXPECT_EQ(r.status, 200) << r.body;
    return r;
  }
  static bool ValueIsNull(const HttpResult& r) {
    const json::value* v = r.obj().if_contains("value");
    return v && v->is_null();
  }
  std::string id_;
};

TEST_F(ContainerKernelTest, StatePersistsAndTheFinalExpressionIsTheValue) {
  HttpResult a = Cell("x = 1");
  EXPECT_EQ(a.num("exit_code"), 0) << a.body;
  EXPECT_TRUE(ValueIsNull(a)) << a.body;
  EXPECT_EQ(a.str("tier"), "heavy");
  EXPECT_EQ(a.str("reason"), "stateful container kernel");
  EXPECT_FALSE(a.flag("kernel_restarted"));
  HttpResult b = Cell("x + 1");
  EXPECT_EQ(b.str("value"), "2") << b.body;
  EXPECT_EQ(b.str("stdout"), "");
  EXPECT_TRUE(b.obj().at("error").is_null()) << b.body;
  // A statement at the end has no value; None is not shown either (like a notebook).
  EXPECT_TRUE(ValueIsNull(Cell("y = x * 10\nNone"))) << "None must not be a value";
  EXPECT_EQ(Cell("[y, 'a']").str("value"), "[10, 'a']");
}

TEST_F(ContainerKernelTest, ImportsAndDefinitionsPersist) {
  EXPECT_EQ(Cell("import math\ndef sq(v):\n    return v * v").num("exit_code"), 0);
  HttpResult r = Cell("sq(3) + int(math.sqrt(16))");
  EXPECT_EQ(r.str("value"), "13") << r.body;
}

TEST_F(ContainerKernelTest, PrintOutputAndFinalValueBothComeBack) {
  HttpResult r = Cell("import sys\nprint('hello')\nprint('oops', file=sys.stderr)\n6 * 7");
  EXPECT_EQ(r.str("stdout"), "hello\n") << r.body;
  EXPECT_EQ(r.str("stderr"), "oops\n") << r.body;
  EXPECT_EQ(r.str("value"), "42") << r.body;
  EXPECT_EQ(r.num("exit_code"), 0);
}

TEST_F(ContainerKernelTest, ExceptionComesBackStructuredAndStateSurvives) {
  Cell("kept = 'yes'");
  HttpResult r = Cell("def f():\n    return {}['missing']\nf()\n");
  EXPECT_EQ(r.num("exit_code"), 1) << r.body;
  ASSERT_TRUE(r.obj().at("error").is_object()) << r.body;
  const auto& e = r.obj().at("error").as_object();
  EXPECT_EQ(e.at("type").as_string(), "KeyError");
  EXPECT_EQ(e.at("message").as_string(), "'missing'");
  std::string tb(e.at("traceback").as_string());
  EXPECT_NE(tb.find("in f"), std::string::npos) << tb;
  EXPECT_EQ(tb.find("kernel.py"), std::string::npos) << "kernel frames leak: " << tb;
  EXPECT_TRUE(ValueIsNull(r));
  HttpResult syn = Cell("def broken(:");
  EXPECT_EQ(syn.obj().at("error").as_object().at("type").as_string(), "SyntaxError") << syn.body;
  EXPECT_EQ(Cell("kept").str("value"), "'yes'");
}

TEST_F(ContainerKernelTest, BusyLoopTimesOutAndTheKernelKeepsWorking) {
  Cell("before = 5");
  auto start = std::chrono::steady_clock::now();
  HttpResult r = Cell("while True:\n    pass\n", 1500);
  auto took = std::chrono::steady_clock::now() - start;
  EXPECT_TRUE(r.flag("timed_out")) << r.body;
  EXPECT_EQ(r.num("exit_code"), 124) << r.body;
  EXPECT_LT(took, std::chrono::seconds(8));
  ASSERT_TRUE(r.obj().at("error").is_object()) << r.body;
  EXPECT_EQ(r.obj().at("error").as_object().at("type").as_string(), "KeyboardInterrupt");
  HttpResult after = Cell("before + 1");
  if (r.flag("kernel_restarted")) {
    // Allowed, but then it must say so and the state is gone.
    EXPECT_EQ(after.obj().at("error").as_object().at("type").as_string(), "NameError");
  } else {
    EXPECT_EQ(after.str("value"), "6") << after.body;
  }
}

TEST_F(ContainerKernelTest, SleepIsInterruptedAndAnIgnoredInterruptRestartsTheKernel) {
  Cell("state = 1");
  HttpResult r = Cell("import time; time.sleep(100)", 1500);
  EXPECT_TRUE(r.flag("timed_out")) << r.body;
  EXPECT_FALSE(r.flag("kernel_restarted")) << r.body;
  EXPECT_EQ(r.obj().at("error").as_object().at("type").as_string(), "KeyboardInterrupt");
  EXPECT_EQ(Cell("state").str("value"), "1");
  // A cell that swallows KeyboardInterrupt: the kernel is killed, restarted, and says so.
  auto start = std::chrono::steady_clock::now();
  HttpResult stubborn = Cell(
      "import time\nwhile True:\n    try:\n        time.sleep(1)\n"
      "    except KeyboardInterrupt:\n        pass\n",
      1000);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(8));
  EXPECT_TRUE(stubborn.flag("timed_out")) << stubborn.body;
  EXPECT_TRUE(stubborn.flag("kernel_restarted")) << stubborn.body;
  HttpResult fresh = Cell("state");
  EXPECT_EQ(fresh.obj().at("error").as_object().at("type").as_string(), "NameError")
      << fresh.body;
  EXPECT_EQ(Cell("1 + 1").str("value"), "2");
}

TEST_F(ContainerKernelTest, OutputOfSubprocessesIsPartOfTheCell) {
  HttpResult r = Cell(
      "import os, subprocess\nprint('python')\nsubprocess.run(['echo', 'from a child'])\n"
      "os.system('echo to stderr >&2')\nNone");
  EXPECT_EQ(r.num("exit_code"), 0) << r.body;
  EXPECT_EQ(r.str("stdout"), "python\nfrom a child\n") << r.body;
  EXPECT_EQ(r.str("stderr"), "to stderr\n") << r.body;
}

// The caller gives up (its HTTP connection closes) while its cell still runs: the cell is
// interrupted, so the next caller neither waits for it nor finds it still running.
TEST_F(ContainerKernelTest, ACallerThatGoesAwayInterruptsItsCell) {
  Cell("flag = 'unset'");
  const std::string code =
      "import time\ntry:\n    while True:\n        print('tick', flush=True)\n"
      "        time.sleep(0.2)\nexcept KeyboardInterrupt:\n    flag = 'interrupted'\n"
      "    raise\n";
  HttpResult gone =
      Http(daemon_->port(), "POST", "/environments/" + id_ + "/run",
           json::serialize(json::object{{"code", code}, {"timeout_ms", 120000}}), {}, "",
           /*timeout_s=*/3);
  auto start = std::chrono::steady_clock::now();
  HttpResult next = Cell("flag", 60000);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(15));
  EXPECT_EQ(next.str("value"), "'interrupted'") << next.body;
  EXPECT_FALSE(next.flag("kernel_restarted")) << next.body;
}

TEST_F(ContainerKernelTest, OutputBombIsTruncatedAndTheKernelSurvives) {
  Cell("alive = True");
  HttpResult r = Cell("print('x' * (50 * 1024 * 1024))\n'done'", 20000);
  EXPECT_TRUE(r.flag("truncated")) << r.body.substr(0, 300);
  EXPECT_LE(r.str("stdout").size(), 2u << 20);
  EXPECT_FALSE(r.flag("timed_out"));
  EXPECT_EQ(r.str("value"), "'done'");
  EXPECT_EQ(Cell("alive").str("value"), "True");
}

}  // namespace
}  // namespace esb::testing
