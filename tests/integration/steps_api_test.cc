// Time travel (issue 13) through the real esbd: the steps routes' contract and attacks
// (StepsApiTest), then P4-030 on every driver this host has (StepsDriverTest, below).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <iostream>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "integration/daemon.h"

namespace esb::testing {
namespace {
namespace json = boost::json;

constexpr char kKeys[] = R"({"keys": [
    {"key": "esb_steps_tenant_a_00001", "tenant": "a"},
    {"key": "esb_steps_tenant_b_00002", "tenant": "b"}]})";

class StepsApiTest : public SharedDaemonTest<StepsApiTest> {
 public:
  static Daemon::Options SuiteOptions() { return {.config_json = kKeys}; }

 protected:
  static void SetUpTestSuite() {
    SharedDaemonTest::SetUpTestSuite();
    if (daemon_) daemon_->api_key = "esb_steps_tenant_a_00001";
  }
  HttpResult Steps(const std::string& id, const std::string& query = "") {
    return daemon_->Call("GET", "/environments/" + id + "/steps" + query);
  }
};

TEST_F(StepsApiTest, EnvironmentJsonSaysWhetherItRecordsStepsAndWhy) {
  HttpResult r = daemon_->Call("POST", "/environments", json::object{});
  ASSERT_EQ(r.status, 201) << r.body;
  const json::object& steps = r.obj().at("steps").as_object();
  for (const char* k : {"capture", "head", "count", "memory", "memory_reason"})
    EXPECT_TRUE(steps.contains(k)) << k << " in " << r.body;
  const std::string id = r.str("environment_id");
  if (!steps.at("capture").as_bool()) {
    EXPECT_FALSE(steps.at("memory_reason").as_string().empty()) << r.body;
    HttpResult list = Steps(id);
    ASSERT_EQ(list.status, 200) << list.body;
    EXPECT_TRUE(list.obj().at("steps").as_array().empty());
    HttpResult rw =
        daemon_->Call("POST", "/environments/" + id + "/rewind", json::object{{"step", 0}});
    EXPECT_EQ(rw.status, 409) << rw.body;
  } else {
    EXPECT_EQ(steps.at("head").as_int64(), 0);
  }
  daemon_->Call("DELETE", "/environments/" + id);
}

TEST_F(StepsApiTest, CaptureOffAtCreateIsHonoured) {
  HttpResult r = daemon_->Call("POST", "/environments", json::object{{"steps", false}});
  ASSERT_EQ(r.status, 201) << r.body;
  EXPECT_FALSE(r.obj().at("steps").as_object().at("capture").as_bool());
  const std::string id = r.str("environment_id");
  ASSERT_EQ(daemon_->Exec(id, "echo hi").status, 200);
  EXPECT_TRUE(Steps(id).obj().at("steps").as_array().empty());
  HttpResult fk = daemon_->Call("POST", "/environments/" + id + "/fork", json::object{{"step", 0}});
  EXPECT_EQ(fk.status, 409) << fk.body;
  daemon_->Call("DELETE", "/environments/" + id);
}

TEST_F(StepsApiTest, BadSettingsAndBadInputAreClear400s) {
  for (const json::value& bad : {json::value("yes"), json::value(json::object{{"max_steps", 0}}),
                                 json::value(json::object{{"max_steps", int64_t{1} << 40}}),
                                 json::value(json::object{{"max_live_memory", -1}}),
                                 json::value(json::object{{"bogus", 1}})}) {
    HttpResult r = daemon_->Call("POST", "/environments", json::object{{"steps", bad}});
    EXPECT_EQ(r.status, 400) << json::serialize(bad) << " -> " << r.body;
  }
  HttpResult env = daemon_->Call("POST", "/environments", json::object{});
  ASSERT_EQ(env.status, 201);
  const std::string id = env.str("environment_id");
  const std::string base = "/environments/" + id;
  // Huge and negative limits, negative and non-numeric step numbers.
  EXPECT_EQ(Steps(id, "?limit=99999999999999999999").status, 400);
  EXPECT_EQ(Steps(id, "?limit=0").status, 400);
  EXPECT_EQ(Steps(id, "?limit=-3").status, 400);
  EXPECT_EQ(Steps(id, "?before=-1").status, 400);
  EXPECT_EQ(daemon_->Call("GET", base + "/steps/-1").status, 400);
  EXPECT_EQ(daemon_->Call("GET", base + "/steps/abc").status, 400);
  EXPECT_EQ(daemon_->Call("GET", base + "/steps/99999999999999999999999").status, 400);
  EXPECT_EQ(daemon_->Call("POST", base + "/rewind", json::object{{"step", -1}}).status, 400);
  EXPECT_EQ(daemon_->Call("POST", base + "/rewind", json::object{{"step", "1"}}).status, 400);
  EXPECT_EQ(daemon_->Call("POST", base + "/fork", json::object{}).status, 400);
  EXPECT_EQ(daemon_->Call("GET", base + "/steps/0/files").status, 400) << "path is required";
  daemon_->Call("DELETE", "/environments/" + id);
}

// Review M4/M5 through the real esbd: a step's tree and changes come in windows with a
// cursor; a step's file is streamed (X-File-Size); an unchanged path's diff says change null;
// bad window parameters are 400 (410 "collected"/"corrupt" of a blob: StepsTest).
TEST_F(StepsApiTest, StepWindowsStreamedFilesAndGoneOrUnchangedAnswers) {
  const bool nano =
      std::filesystem::exists(std::string(ESB_BUILD_DIR) + "/esb-nano-worker");
  HttpResult env = daemon_->Call("POST", "/environments",
                                 json::object{{"runtime", nano ? "nano" : "container"},
                                              {"steps", json::object{{"max_steps", 2}}}});
  ASSERT_EQ(env.status, 201) << env.body;
  ASSERT_TRUE(env.obj().at("steps").as_object().at("capture").as_bool())
      << "this runtime records no steps: " << env.body;
  const std::string base = "/environments/" + env.str("environment_id");
  auto write = [&](const std::string& path, const std::string& content) {
    HttpResult w = daemon_->Call("POST", base + "/files/write",
                                 json::object{{"path", path}, {"content", content}});
    ASSERT_EQ(w.status, 200) << w.body;
  };
  for (int i = 0; i < 5; ++i) write("f" + std::to_string(i), "file " + std::to_string(i));
  // Step 5 (f4 added): its tree has five files, shown two at a time.
  std::vector<std::string> seen;
  std::string after;
  int64_t total = -1;
  for (int page = 0; page < 50; ++page) {
    HttpResult d = daemon_->Call(
        "GET", base + "/steps/5?files_limit=2" + (after.empty() ? "" : "&files_after=" + after));
    ASSERT_EQ(d.status, 200) << d.body;
    total = d.num("files_total");
    const json::array& files = d.obj().at("files").as_array();
    EXPECT_LE(files.size(), 2u);
    for (const json::value& f : files)
      seen.push_back(std::string(f.as_object().at("path").as_string()));
    if (d.obj().at("files_next").is_null()) break;
    after = d.str("files_next");
  }
  EXPECT_EQ(static_cast<int64_t>(seen.size()), total);
  EXPECT_TRUE(std::is_sorted(seen.begin(), seen.end()));
  EXPECT_EQ(std::set<std::string>(seen.begin(), seen.end()).size(), seen.size());
  for (const char* want : {"f0", "f1", "f2", "f3", "f4"})
    EXPECT_NE(std::find(seen.begin(), seen.end(), want), seen.end()) << want;
  for (const char* bad : {"?files_limit=0", "?files_limit=10001", "?changes_limit=x"}) {
    HttpResult b = daemon_->Call("GET", base + "/steps/5" + bad);
    EXPECT_EQ(b.status, 400) << bad << ": " << b.body;
  }
  // Streamed bytes.
  HttpResult f = daemon_->Call("GET", base + "/steps/5/files?path=f4");
  ASSERT_EQ(f.status, 200) << f.body;
  EXPECT_EQ(f.body, "file 4");
  EXPECT_EQ(f.headers["x-file-size"], "6");
  // f0 did not change at step 5.
  HttpResult same = daemon_->Call("GET", base + "/steps/5/diff?path=f0");
  ASSERT_EQ(same.status, 200) << same.body;
  EXPECT_TRUE(same.obj().at("change").is_null()) << same.body;
  EXPECT_EQ(same.str("diff"), "");
  // Step 1's f0 blob is still referenced by later steps; step 1 itself was collected (max_steps
  // 2), so rewinding to it is a conflict, and its manifest is kept (its tree is shown).
  HttpResult one = daemon_->Call("GET", base + "/steps/1");
  ASSERT_EQ(one.status, 200) << one.body;
  EXPECT_EQ(one.str("memory_detail"), "collected") << one.body;
  EXPECT_EQ(daemon_->Call("POST", base + "/rewind", json::object{{"step", 1}}).status, 409);
  daemon_->Call("DELETE", base);
}

TEST_F(StepsApiTest, StepsOfAnotherTenantsEnvironmentAre404) {
  HttpResult env = daemon_->Call("POST", "/environments", json::object{});
  ASSERT_EQ(env.status, 201);
  const std::string id = env.str("environment_id");
  const std::string base = "/environments/" + id;
  std::map<std::string, std::string> as_b = {{"Authorization", "Bearer esb_steps_tenant_b_00002"}};
  EXPECT_EQ(daemon_->Call("GET", base + "/steps", nullptr, as_b).status, 404);
  EXPECT_EQ(daemon_->Call("GET", base + "/steps/0", nullptr, as_b).status, 404);
  EXPECT_EQ(daemon_->Call("GET", base + "/steps/0/files?path=a", nullptr, as_b).status, 404);
  EXPECT_EQ(daemon_->Call("GET", base + "/steps/0/diff?path=a", nullptr, as_b).status, 404);
  EXPECT_EQ(daemon_->Call("POST", base + "/rewind", json::object{{"step", 0}}, as_b).status, 404);
  EXPECT_EQ(daemon_->Call("POST", base + "/fork", json::object{{"step", 0}}, as_b).status, 404);
  daemon_->Call("DELETE", "/environments/" + id);
}

// ---------------------------------------------------------------------------------------------
// P4-030 per driver: the state after a restore equals the state at capture. One suite,
// parameterised over every driver esbd has (nano; container on crun and on runc; gvisor). A
// driver this host lacks is skipped with the reason (never silently). Expectations about memory
// follow what the environment says (`steps.memory`): "snapshot" = live values come back,
// "none" = the recorded summary, and the Python session starts fresh.

struct DriverCase {
  const char* name;     // test name suffix
  const char* runtime;  // "runtime" of POST /environments
  const char* oci;      // esbd --runtime: the container driver's OCI runtime in that daemon
};

std::string PrintDriver(const ::testing::TestParamInfo<DriverCase>& info) {
  return info.param.name;
}
void PrintTo(const DriverCase& c, std::ostream* os) { *os << c.name; }

constexpr char kDriverConfig[] = R"({"keys": [
    {"key": "esb_steps_tenant_a_00001", "tenant": "a"}],
    "steps": {"sweep_interval_seconds": 1}})";

class StepsDriverTest : public ::testing::TestWithParam<DriverCase> {
 protected:
  // One daemon per OCI runtime (nano and gvisor share the crun daemon).
  static Daemon* DaemonFor(const std::string& oci, std::string* why) {
    auto it = daemons_.find(oci);
    if (it != daemons_.end()) {
      *why = reasons_[oci];
      return it->second;
    }
    Daemon* d = nullptr;
    if (FindInPath(oci).empty()) {
      reasons_[oci] = oci + " is not installed on this host";
    } else {
      d = new Daemon();
      d->api_key = "esb_steps_tenant_a_00001";
      if (!d->Start(Options(oci))) {
        delete d;
        d = nullptr;
        reasons_[oci] = "esbd --runtime " + oci + " did not start";
      }
    }
    daemons_[oci] = d;
    *why = reasons_[oci];
    return d;
  }
  static Daemon::Options Options(const std::string& oci) {
    return {.config_json = kDriverConfig, .extra_args = {"--runtime", oci}};
  }
  static std::string FindInPath(const std::string& name) {
    for (const char* dir :
         {"/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"}) {
      std::string p = std::string(dir) + "/" + name;
      if (access(p.c_str(), X_OK) == 0) return p;
    }
    return "";
  }
  static void TearDownTestSuite() {
    for (auto& [oci, d] : daemons_) {
      if (d) d->StopAndCleanup();
      delete d;
    }
    daemons_.clear();
    reasons_.clear();
  }
  void SetUp() override {
    std::string why = Daemon::SkipReason();
    if (!why.empty()) GTEST_SKIP() << why;
    const DriverCase& c = GetParam();
    d_ = DaemonFor(c.oci, &why);
    if (d_ == nullptr) {
      ASSERT_FALSE(why.find("did not start") != std::string::npos) << why;
      std::cerr << "[ SKIP     ] driver " << c.name << ": " << why << "\n";
      GTEST_SKIP() << "driver " << c.name << ": " << why;
    }
    // What this daemon runs: /healthz lists each runtime with its backend, or why not.
    HttpResult h = d_->Call("GET", "/healthz");
    ASSERT_EQ(h.status, 200) << h.body;
    const json::object& drivers = h.obj().at("drivers").as_object();
    const json::value* desc = drivers.if_contains(c.runtime);
    if (desc == nullptr) {
      const json::value* un = h.obj().at("unavailable").as_object().if_contains(c.runtime);
      why = un && un->is_string() ? std::string(un->as_string()) : "not built into this esbd";
      std::cerr << "[ SKIP     ] driver " << c.name << ": " << why << "\n";
      GTEST_SKIP() << "driver " << c.name << " is unavailable here: " << why;
    }
    if (std::string(c.runtime) == "container") {
      ASSERT_NE(std::string(desc->as_string()).find(c.oci), std::string::npos)
          << "esbd --runtime " << c.oci << " runs " << h.body;
    }
  }
  void TearDown() override {
    if (d_ == nullptr) return;
    for (const std::string& id : envs_) d_->Call("DELETE", "/environments/" + id);
  }

  bool HasShell() const { return std::string(GetParam().runtime) != "nano"; }
  // Gaps this suite found on gVisor (memory "none", this runsc) that belong to the gVisor part
  // of issue 13 (its memory snapshots replace the paths that fail): printed, not asserted, and
  // asserted again once the environment says memory "snapshot". "" when there is none.
  std::string KnownGap(const std::string& what, const std::string& memory) const {
    if (std::string(GetParam().name) != "gvisor" || memory == "snapshot") return "";
    std::string gap;
    if (what == "shell")
      gap =
          "under gVisor the agent's saved shell state lags one exec (cd/export of exec N are "
          "seen from exec N+2 on), so a step captures the previous exec's cwd/env";
    if (what == "python")
      gap =
          "under gVisor no variables summary is recorded and a rewind after a Python cell "
          "fails (500: restarting the Python kernel failed, exit code 137)";
    if (!gap.empty()) std::cerr << "[ KNOWN GAP] gvisor: " << gap << "\n";
    return gap;
  }
  std::string Base(const std::string& id) const { return "/environments/" + id; }

  // A new environment of this driver that records steps (its steps.memory in *memory).
  std::string NewEnv(json::object steps = {}, std::string* memory = nullptr) {
    json::object body{{"runtime", GetParam().runtime}};
    if (!steps.empty()) body["steps"] = std::move(steps);
    HttpResult r = d_->Call("POST", "/environments", body);
    EXPECT_EQ(r.status, 201) << r.body;
    if (r.status != 201) return "";
    const std::string id = r.str("environment_id");
    envs_.push_back(id);
    const json::object& st = r.obj().at("steps").as_object();
    EXPECT_TRUE(st.at("capture").as_bool()) << GetParam().name << " records no steps: " << r.body;
    const std::string mem(st.at("memory").as_string());
    EXPECT_TRUE(mem == "snapshot" || mem == "none") << r.body;
    // nano keeps the interpreter's memory at every step; the others say what they keep.
    if (std::string(GetParam().runtime) == "nano") EXPECT_EQ(mem, "snapshot") << r.body;
    if (mem == "none") EXPECT_FALSE(st.at("memory_reason").as_string().empty()) << r.body;
    if (memory) *memory = mem;
    if (!st.at("capture").as_bool()) return "";
    return id;
  }
  void Write(const std::string& id, const std::string& path, const std::string& content) {
    HttpResult w = d_->Call("POST", Base(id) + "/files/write",
                            json::object{{"path", path}, {"content", content}});
    EXPECT_EQ(w.status, 200) << path << ": " << w.body;
  }
  // The file's content, or "<status>" when it cannot be read.
  std::string Read(const std::string& id, const std::string& path) {
    HttpResult r = d_->Call("GET", Base(id) + "/files/read?path=" + path);
    if (r.status != 200) return "<" + std::to_string(r.status) + ">";
    return r.str("content");
  }
  HttpResult Run(const std::string& id, const std::string& code) {
    HttpResult r = d_->Call("POST", Base(id) + "/run", json::object{{"code", code}});
    EXPECT_EQ(r.status, 200) << code << ": " << r.body;
    return r;
  }
  std::string Shell(const std::string& id, const std::string& command) {
    HttpResult r = d_->Exec(id, command);
    EXPECT_EQ(r.status, 200) << command << ": " << r.body;
    return r.str("stdout");
  }
  int64_t Head(const std::string& id) {
    HttpResult r = d_->Call("GET", Base(id));
    EXPECT_EQ(r.status, 200) << r.body;
    const json::value* steps = r.obj().if_contains("steps");
    if (!steps || !steps->as_object().at("head").is_int64()) return -1;
    return steps->as_object().at("head").as_int64();
  }
  json::array StepList(const std::string& id) {
    HttpResult r = d_->Call("GET", Base(id) + "/steps?limit=1000");
    EXPECT_EQ(r.status, 200) << r.body;
    if (r.status != 200) return {};
    return r.obj().at("steps").as_array();
  }
  static const json::object* FindStep(const json::array& steps, int64_t n) {
    for (const json::value& v : steps)
      if (v.as_object().at("step").as_int64() == n) return &v.as_object();
    return nullptr;
  }
  HttpResult Rewind(const std::string& id, int64_t n) {
    return d_->Call("POST", Base(id) + "/rewind", json::object{{"step", n}});
  }
  // Forks step n; returns the new environment (cleaned up at the end) or "".
  std::string Fork(const std::string& id, int64_t n, std::string* memory = nullptr) {
    HttpResult f = d_->Call("POST", Base(id) + "/fork", json::object{{"step", n}});
    EXPECT_EQ(f.status, 201) << f.body;
    if (f.status != 201) return "";
    const std::string fid = f.str("environment_id");
    envs_.push_back(fid);
    EXPECT_EQ(f.obj().at("forked_from").as_object().at("step").as_int64(), n) << f.body;
    if (memory) *memory = f.str("memory");
    return fid;
  }
  // The honest flag, on every step of `id`: "snapshot" only without a detail; "none" always
  // with one (off, unsupported: why, collected, lost_on_restart).
  void ExpectHonestMemoryFlags(const std::string& id, const std::string& env_memory) {
    for (const json::value& v : StepList(id)) {
      const json::object& s = v.as_object();
      const std::string mem(s.at("memory").as_string());
      const json::value& detail = s.at("memory_detail");
      SCOPED_TRACE(json::serialize(s));
      if (mem == "snapshot") {
        EXPECT_TRUE(detail.is_null());
        EXPECT_EQ(env_memory, "snapshot") << "a step cannot have more than its runtime keeps";
      } else {
        ASSERT_EQ(mem, "none");
        ASSERT_TRUE(detail.is_string());
        const std::string d(detail.as_string());
        EXPECT_TRUE(d == "collected" || d == "lost_on_restart" || d == "off" ||
                    d.rfind("unsupported: ", 0) == 0)
            << d;
        // A fresh step of a runtime that keeps memory keeps it.
        if (env_memory == "snapshot") EXPECT_TRUE(d == "collected" || d == "lost_on_restart");
      }
    }
  }
  // x's repr in step n's variables summary, or "<absent>".
  std::string VariableAt(const std::string& id, int64_t n, const std::string& name) {
    HttpResult s = d_->Call("GET", Base(id) + "/steps/" + std::to_string(n));
    EXPECT_EQ(s.status, 200) << s.body;
    const json::value* vars = s.obj().if_contains("variables");
    if (!vars || !vars->is_array()) return "<no summary>";
    for (const json::value& v : vars->as_array())
      if (v.as_object().at("name").as_string() == name)
        return std::string(v.as_object().at("repr").as_string());
    return "<absent>";
  }

  static std::map<std::string, Daemon*> daemons_;
  static std::map<std::string, std::string> reasons_;
  Daemon* d_ = nullptr;
  std::vector<std::string> envs_;
};
std::map<std::string, Daemon*> StepsDriverTest::daemons_;
std::map<std::string, std::string> StepsDriverTest::reasons_;

TEST_P(StepsDriverTest, FilesAndShellStateAfterRewindAndForkEqualTheStep) {
  std::string memory;
  const std::string id = NewEnv({}, &memory);
  ASSERT_FALSE(id.empty());
  const bool shell = HasShell() && KnownGap("shell", memory).empty();
  Write(id, "keep.txt", "v1\n");
  ASSERT_EQ(d_->Call("POST", Base(id) + "/files/mkdir", json::object{{"path", "dir/sub"}}).status,
            200);
  Write(id, "dir/sub/x.txt", "abc");
  if (HasShell()) {
    EXPECT_EQ(Shell(id,
                    "mkdir -p /workspace/w && cd /workspace/w && export STEPVAR=at_k && "
                    "echo ok"),
              "ok\n");
  }
  if (!HasShell()) {
    std::cerr << "[ NOTE     ] " << GetParam().name << " has no shell: no cwd/env to compare\n";
  }
  const int64_t k = Head(id);
  ASSERT_GT(k, 0);
  // Change everything after step k.
  Write(id, "keep.txt", "v2\n");
  Write(id, "later.txt", "later");
  ASSERT_EQ(d_->Call("POST", Base(id) + "/files/remove",
                     json::object{{"path", "dir"}, {"recursive", true}})
                .status,
            200);
  if (HasShell()) Shell(id, "cd / && export STEPVAR=later");
  ASSERT_EQ(Read(id, "dir/sub/x.txt"), "<404>");

  auto expect_state_of_k = [&](const std::string& env, const std::string& what) {
    SCOPED_TRACE(what);
    EXPECT_EQ(Read(env, "keep.txt"), "v1\n");
    EXPECT_EQ(Read(env, "dir/sub/x.txt"), "abc");
    EXPECT_EQ(Read(env, "later.txt"), "<404>");
    if (HasShell()) EXPECT_EQ(Shell(env, "[ -d /workspace/w ] && echo w"), "w\n");
    if (shell) {
      EXPECT_EQ(Shell(env, "pwd; echo \"$STEPVAR\"; [ -d /workspace/w ] && echo w"),
                "/workspace/w\nat_k\nw\n");
    }
  };
  HttpResult rw = Rewind(id, k);
  ASSERT_EQ(rw.status, 200) << rw.body;
  EXPECT_EQ(rw.num("head"), k);
  EXPECT_EQ(rw.str("memory"), memory) << rw.body;
  expect_state_of_k(id, "after rewind");
  const std::string fork = Fork(id, k);
  ASSERT_FALSE(fork.empty());
  expect_state_of_k(fork, "in the fork");
  ExpectHonestMemoryFlags(id, memory);
  ExpectHonestMemoryFlags(fork, memory);
}

TEST_P(StepsDriverTest, PythonVariablesAfterRewindAndForkAreLiveOrTheHonestSummary) {
  std::string memory;
  const std::string id = NewEnv({}, &memory);
  ASSERT_FALSE(id.empty());
  if (std::string gap = KnownGap("python", memory); !gap.empty()) GTEST_SKIP() << gap;
  Run(id, "x = 41\nwords = ['a', 'b']");
  const int64_t k = Head(id);
  Run(id, "x = 99\nwords.append('c')");
  EXPECT_EQ(VariableAt(id, k, "x"), "41");
  EXPECT_EQ(VariableAt(id, Head(id), "x"), "99");
  auto expect_x_of_k = [&](const std::string& env, const std::string& mem,
                           const std::string& what) {
    SCOPED_TRACE(what + " (memory " + mem + ")");
    HttpResult r = Run(env, "print(x, len(words))");
    if (mem == "snapshot") {
      EXPECT_EQ(r.str("stdout"), "41 2\n") << r.body;  // the live objects of step k
    } else {
      ASSERT_EQ(mem, "none");
      // Memory "none": the Python session is fresh (nothing from step 99 leaks back in), and
      // the step's recorded summary is what says x was 41.
      EXPECT_NE(r.body.find("NameError"), std::string::npos) << r.body;
    }
  };
  HttpResult rw = Rewind(id, k);
  ASSERT_EQ(rw.status, 200) << rw.body;
  EXPECT_EQ(rw.str("memory"), memory) << rw.body;
  expect_x_of_k(id, rw.str("memory"), "after rewind");
  std::string fork_memory;
  const std::string fork = Fork(id, k, &fork_memory);
  ASSERT_FALSE(fork.empty());
  EXPECT_EQ(fork_memory, memory);
  expect_x_of_k(fork, fork_memory, "in the fork");
  ExpectHonestMemoryFlags(id, memory);
}

TEST_P(StepsDriverTest, ContinueAfterRewindParentsTheNextStepOnItAndKeepsTheBranch) {
  const std::string id = NewEnv();
  ASSERT_FALSE(id.empty());
  Write(id, "f", "1");
  const int64_t s1 = Head(id);
  Write(id, "f", "2");
  const int64_t s2 = Head(id);
  Write(id, "f", "3");
  const int64_t s3 = Head(id);
  ASSERT_EQ(Rewind(id, s1).status, 200);
  EXPECT_EQ(Read(id, "f"), "1");
  Write(id, "g", "after");
  const int64_t s4 = Head(id);
  EXPECT_GT(s4, s3);
  json::array steps = StepList(id);
  const json::object* four = FindStep(steps, s4);
  ASSERT_NE(four, nullptr);
  EXPECT_EQ(four->at("parent").as_int64(), s1);
  for (int64_t n : {s2, s3}) {
    const json::object* s = FindStep(steps, n);
    ASSERT_NE(s, nullptr) << "step " << n << " of the branch is kept";
    EXPECT_FALSE(s->at("on_head").as_bool()) << json::serialize(*s);
  }
  for (int64_t n : {s1, s4}) EXPECT_TRUE(FindStep(steps, n)->at("on_head").as_bool());
  // The branch is still there to go back to.
  ASSERT_EQ(Rewind(id, s3).status, 200);
  EXPECT_EQ(Read(id, "f"), "3");
  EXPECT_EQ(Read(id, "g"), "<404>");
}

TEST_P(StepsDriverTest, TwoForksOfOneStepDivergeIndependently) {
  std::string memory;
  const std::string id = NewEnv({}, &memory);
  ASSERT_FALSE(id.empty());
  Write(id, "f", "base");
  Run(id, "z = 1");
  const int64_t k = Head(id);
  const std::string a = Fork(id, k), b = Fork(id, k);
  ASSERT_FALSE(a.empty());
  ASSERT_FALSE(b.empty());
  Write(a, "f", "A");
  Write(b, "f", "B");
  Write(b, "only_b", "b");
  EXPECT_EQ(Read(a, "f"), "A");
  EXPECT_EQ(Read(b, "f"), "B");
  EXPECT_EQ(Read(a, "only_b"), "<404>");
  EXPECT_EQ(Read(id, "f"), "base");
  if (memory == "snapshot") {
    EXPECT_EQ(Run(a, "z += 10\nprint(z)").str("stdout"), "11\n");
    EXPECT_EQ(Run(b, "z += 20\nprint(z)").str("stdout"), "21\n");
    EXPECT_EQ(Run(id, "print(z)").str("stdout"), "1\n");
  }
  if (HasShell()) {
    Shell(a, "cd /tmp && export WHO=a");
    EXPECT_EQ(Shell(b, "pwd; echo \"${WHO:-unset}\""), "/workspace\nunset\n");
  }
  // Each fork has its own log: step 0 is the fork, then its own steps.
  for (const std::string& f : {a, b}) {
    json::array steps = StepList(f);
    ASSERT_FALSE(steps.empty());
    EXPECT_EQ(steps.back().as_object().at("kind").as_string(), "fork");
  }
}

TEST_P(StepsDriverTest, AFailingStepThenRewindToTheStepBeforeItAndACorrectedRetry) {
  std::string memory;
  const std::string id = NewEnv({}, &memory);
  ASSERT_FALSE(id.empty());
  const bool python = KnownGap("python", memory).empty();
  if (python) {
    Run(id, "data = [1, 2, 3]\nopen('/workspace/out.txt', 'w').write('good')");
    const int64_t good = Head(id);
    HttpResult bad = Run(id, "open('/workspace/out.txt', 'w').write('bad')\nresult = data[10]");
    EXPECT_NE(bad.body.find("IndexError"), std::string::npos) << bad.body;
    json::array steps = StepList(id);
    ASSERT_FALSE(steps.empty());
    const json::object& failed = steps[0].as_object();
    EXPECT_EQ(failed.at("status").as_string(), "error") << json::serialize(failed);
    EXPECT_NE(std::string(failed.at("error").as_string()).find("IndexError"), std::string::npos);
    ASSERT_EQ(failed.at("parent").as_int64(), good);
    EXPECT_EQ(Read(id, "out.txt"), "bad");
    HttpResult rw = Rewind(id, good);
    ASSERT_EQ(rw.status, 200) << rw.body;
    EXPECT_EQ(Read(id, "out.txt"), "good");
    // The corrected retry. With memory "none" the session is fresh: the retry says so by
    // defining what it needs (the step's summary shows what `data` was).
    std::string retry = "open('/workspace/out.txt', 'w').write('fixed')\nprint(data[2])";
    if (rw.str("memory") == "none") {
      EXPECT_EQ(VariableAt(id, good, "data"), "[1, 2, 3]");
      retry = "data = [1, 2, 3]\n" + retry;
    }
    HttpResult fixed = Run(id, retry);
    EXPECT_EQ(fixed.str("stdout"), "3\n") << fixed.body;
    steps = StepList(id);
    ASSERT_FALSE(steps.empty());
    const json::object& ok = steps[0].as_object();
    EXPECT_EQ(ok.at("status").as_string(), "ok") << json::serialize(ok);
    EXPECT_EQ(ok.at("parent").as_int64(), good);
    EXPECT_EQ(Read(id, "out.txt"), "fixed");
  }
  if (HasShell()) {  // a failing shell step is a step with its exit code too
    Shell(id, "echo oops > shell.txt; exit 3");
    json::array after = StepList(id);
    ASSERT_FALSE(after.empty());
    const json::object& s = after[0].as_object();
    EXPECT_EQ(s.at("status").as_string(), "error");
    EXPECT_EQ(s.at("exit_code").as_int64(), 3);
    const int64_t before = s.at("parent").as_int64();
    ASSERT_EQ(Rewind(id, before).status, 200);
    EXPECT_EQ(Read(id, "shell.txt"), "<404>");
    EXPECT_EQ(Shell(id, "echo fixed > shell.txt && cat shell.txt"), "fixed\n");
    after = StepList(id);
    ASSERT_FALSE(after.empty());
    EXPECT_EQ(after[0].as_object().at("status").as_string(), "ok");
    EXPECT_EQ(after[0].as_object().at("parent").as_int64(), before);
  }
  ExpectHonestMemoryFlags(id, memory);
}

TEST_P(StepsDriverTest, RetentionCollectsOldStepsUnderTheCapsAndSaysSo) {
  std::string memory;
  const std::string id = NewEnv({{"max_steps", 2}, {"max_live_memory", 1}}, &memory);
  ASSERT_FALSE(id.empty());
  for (int i = 0; i < 4; ++i) Write(id, "f", "version " + std::to_string(i));  // steps 1..4
  json::array steps = StepList(id);
  ASSERT_EQ(steps.size(), 5u) << "collected steps stay listed";
  int collected = 0;
  for (const json::value& v : steps) {
    const json::value& d = v.as_object().at("memory_detail");
    if (d.is_string() && d.as_string() == "collected") ++collected;
  }
  EXPECT_GE(collected, 3);
  const json::value& head_detail = steps[0].as_object().at("memory_detail");
  EXPECT_FALSE(head_detail.is_string() && head_detail.as_string() == "collected")
      << "the head is never collected";
  ExpectHonestMemoryFlags(id, memory);
  // Step 1 is collected: it stays inspectable (summary, tree) but cannot come back.
  HttpResult one = d_->Call("GET", Base(id) + "/steps/1");
  ASSERT_EQ(one.status, 200) << one.body;
  EXPECT_EQ(one.obj().at("memory_detail").as_string(), "collected");
  for (const char* route : {"/rewind", "/fork"}) {
    HttpResult r = d_->Call("POST", Base(id) + route, json::object{{"step", 1}});
    EXPECT_TRUE(r.status == 409 || r.status == 410) << route << ": " << r.body;
    EXPECT_NE(r.body.find("collected"), std::string::npos) << route << ": " << r.body;
  }
  // Its file contents ("version 0", referenced by no later step) are swept (this daemon's
  // sweep grace is 0; the sweep runs at most every 10 s): then 410 "collected".
  HttpResult f;
  for (int i = 0; i < 150; ++i) {
    f = d_->Call("GET", Base(id) + "/steps/1/files?path=f");
    if (f.status != 200) break;
    EXPECT_EQ(f.body, "version 0");
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  EXPECT_EQ(f.status, 410) << f.body;
  EXPECT_EQ(f.str("detail"), "collected") << f.body;
  // The head's contents are kept.
  HttpResult head = d_->Call("GET", Base(id) + "/steps/4/files?path=f");
  EXPECT_EQ(head.status, 200);
  EXPECT_EQ(head.body, "version 3");
}

TEST_P(StepsDriverTest, RestartKeepsTheLogAndSaysWhichMemoryWasLost) {
  std::string memory;
  const std::string id = NewEnv({}, &memory);
  ASSERT_FALSE(id.empty());
  Write(id, "a.txt", "one");
  const bool python = KnownGap("python", memory).empty();
  if (python)
    Run(id, "v = 7");
  else
    Write(id, "b.txt", "no cell");
  Write(id, "a.txt", "two");
  const json::array before = StepList(id);
  ASSERT_EQ(before.size(), 4u);
  d_->Stop();
  ASSERT_TRUE(d_->Start(Options(GetParam().oci), d_->state_dir()));
  HttpResult env = d_->Call("GET", Base(id));
  ASSERT_EQ(env.status, 200) << env.body;
  if (std::string(GetParam().runtime) == "nano") {
    // nano sessions live in esbd's workers: the environment does not survive a restart, and
    // esbd says so instead of pretending (its step log goes with it).
    EXPECT_NE(env.str("state"), "running") << env.body;
    std::cerr << "[ NOTE     ] nano environments do not survive a restart: " << env.body << "\n";
    envs_.clear();
    return;
  }
  ASSERT_EQ(env.str("state"), "running") << env.body;
  const json::array after = StepList(id);
  ASSERT_EQ(after.size(), before.size());
  for (size_t i = 0; i < after.size(); ++i) {
    const json::object& a = after[i].as_object();
    const json::object& b = before[i].as_object();
    SCOPED_TRACE(json::serialize(a));
    for (const char* k : {"step", "parent", "kind", "status", "on_head"})
      EXPECT_EQ(json::serialize(a.at(k)), json::serialize(b.at(k))) << k;
    if (b.at("memory").as_string() == "snapshot") {
      // A live snapshot was held by a process of the old esbd; a compacted one survives.
      EXPECT_TRUE(a.at("memory").as_string() == "snapshot" ||
                  a.at("memory_detail") == json::value("lost_on_restart"));
    } else {
      EXPECT_EQ(json::serialize(a.at("memory_detail")), json::serialize(b.at("memory_detail")));
    }
  }
  ExpectHonestMemoryFlags(id, memory);
  EXPECT_EQ(d_->Call("GET", Base(id) + "/steps/1/files?path=a.txt").body, "one");
  if (python) EXPECT_EQ(VariableAt(id, 2, "v"), "7");
  HttpResult rw = Rewind(id, 1);
  ASSERT_EQ(rw.status, 200) << rw.body;
  EXPECT_EQ(Read(id, "a.txt"), "one");
  Write(id, "b.txt", "new");
  const json::array last = StepList(id);
  ASSERT_FALSE(last.empty());
  EXPECT_EQ(last[0].as_object().at("parent").as_int64(), 1);
}

INSTANTIATE_TEST_SUITE_P(Drivers, StepsDriverTest,
                         ::testing::Values(DriverCase{"nano", "nano", "crun"},
                                           DriverCase{"crun", "container", "crun"},
                                           DriverCase{"runc", "container", "runc"},
                                           DriverCase{"gvisor", "gvisor", "crun"}),
                         PrintDriver);

}  // namespace
}  // namespace esb::testing
