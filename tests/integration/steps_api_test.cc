// Time travel (issue 13) through the real esbd: the steps routes, rewind, fork and the attacks
// on them. Which runtime records steps depends on the drivers built into this esbd (nano and
// container gain the steps capability in their own parts): the tests that need a recording
// runtime say so and skip when none does; the contract tests run on any runtime.
#include <algorithm>
#include <filesystem>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "integration/daemon.h"

namespace esb::testing {
namespace {
namespace json = boost::json;

constexpr char kKeys[] = R"({"keys": [
    {"key": "esb_steps_tenant_a_00001", "tenant": "a"},
    {"key": "esb_steps_tenant_b_00002", "tenant": "b"}]})";

class StepsApiTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    skip_ = Daemon::SkipReason();
    if (!skip_.empty()) return;
    daemon_ = new Daemon();
    if (!daemon_->Start({.config_json = kKeys})) skip_ = "esbd did not start";
    daemon_->api_key = "esb_steps_tenant_a_00001";
  }
  static void TearDownTestSuite() {
    if (daemon_) daemon_->StopAndCleanup();
    delete daemon_;
    daemon_ = nullptr;
  }
  void SetUp() override {
    if (!skip_.empty()) GTEST_SKIP() << skip_;
  }
  static bool HaveNano() {
    return std::filesystem::exists(std::string(ESB_BUILD_DIR) + "/esb-nano-worker");
  }
  // An environment on a runtime that records steps (nano first), or "" with `why` set.
  std::string RecordingEnv(std::string* why) {
    std::vector<std::string> runtimes;
    if (HaveNano()) runtimes.push_back("nano");
    runtimes.push_back("container");
    for (const std::string& rt : runtimes) {
      HttpResult r = daemon_->Call("POST", "/environments", json::object{{"runtime", rt}});
      if (r.status != 201) continue;
      const json::object& steps = r.obj().at("steps").as_object();
      if (steps.at("capture").as_bool()) return r.str("environment_id");
      absl::StrAppend(why, rt, ": ", std::string(steps.at("memory_reason").as_string()), "; ");
      daemon_->Call("DELETE", "/environments/" + r.str("environment_id"));
    }
    return "";
  }
  HttpResult Steps(const std::string& id, const std::string& query = "") {
    return daemon_->Call("GET", "/environments/" + id + "/steps" + query);
  }

  static Daemon* daemon_;
  static std::string skip_;
};
Daemon* StepsApiTest::daemon_ = nullptr;
std::string StepsApiTest::skip_;

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

TEST_F(StepsApiTest, RecordRewindForkAndInspectEndToEnd) {
  std::string why;
  const std::string id = RecordingEnv(&why);
  ASSERT_FALSE(id.empty()) << "no runtime of this esbd records steps: " << why;
  const std::string base = "/environments/" + id;
  auto write = [&](const std::string& path, const std::string& content) {
    HttpResult w = daemon_->Call("POST", base + "/files/write",
                                 json::object{{"path", path}, {"content", content}});
    ASSERT_EQ(w.status, 200) << w.body;
  };
  write("notes.txt", "one\n");
  write("notes.txt", "one\ntwo\n");
  HttpResult list = Steps(id);
  ASSERT_EQ(list.status, 200) << list.body;
  const json::array& steps = list.obj().at("steps").as_array();
  ASSERT_EQ(steps.size(), 3u) << list.body;
  EXPECT_EQ(list.num("head"), 2);
  EXPECT_EQ(steps[0].as_object().at("kind").as_string(), "files.write");
  EXPECT_EQ(steps[2].as_object().at("step").as_int64(), 0);
  HttpResult one = daemon_->Call("GET", base + "/steps/1");
  ASSERT_EQ(one.status, 200) << one.body;
  EXPECT_TRUE(one.obj().contains("files"));
  EXPECT_TRUE(one.obj().contains("changes"));
  HttpResult f1 = daemon_->Call("GET", base + "/steps/1/files?path=notes.txt");
  ASSERT_EQ(f1.status, 200) << f1.body;
  EXPECT_EQ(f1.body, "one\n");
  HttpResult diff = daemon_->Call("GET", base + "/steps/2/diff?path=notes.txt");
  ASSERT_EQ(diff.status, 200) << diff.body;
  EXPECT_NE(diff.str("diff").find("+two"), std::string::npos) << diff.body;
  EXPECT_EQ(daemon_->Call("GET", base + "/steps/0/files?path=notes.txt").status, 404);
  // Path traversal at a step.
  for (const char* p : {"../../etc/passwd", "/etc/passwd", "a/../../x", "%2e%2e/etc/passwd"}) {
    HttpResult t = daemon_->Call("GET", base + "/steps/1/files?path=" + p);
    EXPECT_TRUE(t.status == 400 || t.status == 404) << p << " -> " << t.status << " " << t.body;
    EXPECT_EQ(t.body.find("root:"), std::string::npos) << p;
  }
  // Rewind to step 1, check the file, continue: the new step's parent is 1.
  HttpResult rw = daemon_->Call("POST", base + "/rewind", json::object{{"step", 1}});
  ASSERT_EQ(rw.status, 200) << rw.body;
  EXPECT_EQ(rw.num("head"), 1);
  HttpResult read = daemon_->Call("GET", base + "/files/read?path=notes.txt");
  ASSERT_EQ(read.status, 200) << read.body;
  EXPECT_EQ(read.str("content"), "one\n");
  write("other.txt", "x");
  HttpResult after = Steps(id, "?limit=1");
  ASSERT_EQ(after.status, 200);
  EXPECT_EQ(after.obj().at("steps").as_array()[0].as_object().at("parent").as_int64(), 1);
  EXPECT_EQ(after.num("next_before"), 3);
  // Fork step 2 twice: independent.
  HttpResult fa = daemon_->Call("POST", base + "/fork", json::object{{"step", 2}});
  HttpResult fb = daemon_->Call("POST", base + "/fork", json::object{{"step", 2}});
  ASSERT_EQ(fa.status, 201) << fa.body;
  ASSERT_EQ(fb.status, 201) << fb.body;
  EXPECT_EQ(fa.obj().at("forked_from").as_object().at("step").as_int64(), 2);
  const std::string a = fa.str("environment_id"), b = fb.str("environment_id");
  ASSERT_EQ(daemon_
                ->Call("POST", "/environments/" + a + "/files/write",
                       json::object{{"path", "notes.txt"}, {"content", "A"}})
                .status,
            200);
  HttpResult rb = daemon_->Call("GET", "/environments/" + b + "/files/read?path=notes.txt");
  EXPECT_EQ(rb.str("content"), "one\ntwo\n");
  for (const std::string& e : {a, b, id}) daemon_->Call("DELETE", "/environments/" + e);
}

TEST_F(StepsApiTest, APythonCellIsAStepWithItsVariablesAndRewindBringsThemBack) {
  std::string why;
  const std::string id = RecordingEnv(&why);
  ASSERT_FALSE(id.empty()) << "no runtime of this esbd records steps: " << why;
  const std::string base = "/environments/" + id;
  HttpResult r1 = daemon_->Call("POST", base + "/run", json::object{{"code", "x = 41"}});
  ASSERT_EQ(r1.status, 200) << r1.body;
  HttpResult r2 = daemon_->Call("POST", base + "/run", json::object{{"code", "x = x + 1\n1/0"}});
  ASSERT_EQ(r2.status, 200) << r2.body;
  HttpResult list = Steps(id);
  ASSERT_EQ(list.status, 200) << list.body;
  const json::object& last = list.obj().at("steps").as_array()[0].as_object();
  EXPECT_EQ(last.at("kind").as_string(), "run");
  EXPECT_EQ(last.at("status").as_string(), "error") << list.body;
  EXPECT_NE(std::string(last.at("error").as_string()).find("ZeroDivisionError"), std::string::npos)
      << list.body;
  const int64_t before_error = last.at("parent").as_int64();
  HttpResult step = daemon_->Call("GET", base + "/steps/" + std::to_string(before_error));
  ASSERT_EQ(step.status, 200) << step.body;
  const json::value& vars = step.obj().at("variables");
  // The summary comes from esb_vars.py (src/agent/python/, t-container's part) run by the
  // runtime: null here means the runtime took none.
  EXPECT_TRUE(vars.is_array()) << "no variables summary at the step: " << step.body;
  bool found = false;
  for (const json::value& v : vars.is_array() ? vars.as_array() : json::array()) {
    if (v.as_object().at("name").as_string() == "x") {
      found = true;
      EXPECT_EQ(v.as_object().at("repr").as_string(), "41") << step.body;
    }
  }
  EXPECT_TRUE(found) << step.body;
  // Back to the step before the error: x is 41 again (memory "snapshot": the live value).
  HttpResult rw = daemon_->Call("POST", base + "/rewind", json::object{{"step", before_error}});
  ASSERT_EQ(rw.status, 200) << rw.body;
  HttpResult again = daemon_->Call("POST", base + "/run", json::object{{"code", "print(x)"}});
  ASSERT_EQ(again.status, 200) << again.body;
  // With memory "snapshot" the live value comes back; with "none" the session restarts fresh
  // (said by the flag), so x is then undefined.
  if (rw.str("memory") == "snapshot") {
    EXPECT_EQ(again.str("stdout"), "41\n") << again.body;
  } else {
    EXPECT_EQ(rw.str("memory"), "none") << rw.body;
  }
  daemon_->Call("DELETE", base);
}

TEST_F(StepsApiTest, RetentionCollectsOldStepsAndSaysSo) {
  std::string why;
  const std::string probe = RecordingEnv(&why);
  ASSERT_FALSE(probe.empty()) << "no runtime of this esbd records steps: " << why;
  daemon_->Call("DELETE", "/environments/" + probe);
  HttpResult env = daemon_->Call(
      "POST", "/environments",
      json::object{{"runtime", HaveNano() ? "nano" : "container"},
                   {"steps", json::object{{"max_steps", 2}, {"max_live_memory", 1}}}});
  ASSERT_EQ(env.status, 201) << env.body;
  const std::string base = "/environments/" + env.str("environment_id");
  for (int i = 0; i < 4; ++i) {
    ASSERT_EQ(daemon_
                  ->Call("POST", base + "/files/write",
                         json::object{{"path", "f" + std::to_string(i)}, {"content", "x"}})
                  .status,
              200);
  }
  HttpResult list = daemon_->Call("GET", base + "/steps");
  ASSERT_EQ(list.status, 200) << list.body;
  const json::array& steps = list.obj().at("steps").as_array();
  ASSERT_EQ(steps.size(), 5u) << "collected steps stay listed: " << list.body;
  int collected = 0;
  for (const json::value& v : steps) {
    const json::object& o = v.as_object();
    const json::value& detail = o.at("memory_detail");
    if (detail.is_string() && detail.as_string() == "collected") ++collected;
  }
  EXPECT_GE(collected, 3) << list.body;
  EXPECT_EQ(steps[0].as_object().at("memory_detail").is_string() &&
                steps[0].as_object().at("memory_detail").as_string() == "collected",
            false)
      << "the head is never collected: " << list.body;
  HttpResult rw = daemon_->Call("POST", base + "/rewind", json::object{{"step", 0}});
  EXPECT_EQ(rw.status, 409) << "a collected step cannot be rewound to: " << rw.body;
  daemon_->Call("DELETE", base);
}

// Review M4/M5 through the real esbd: a step's tree and changes come in windows with a
// cursor; a step's file is streamed (X-File-Size); an unchanged path's diff says change null;
// bad window parameters are 400 (410 "collected"/"corrupt" of a blob: StepsTest).
TEST_F(StepsApiTest, StepWindowsStreamedFilesAndGoneOrUnchangedAnswers) {
  std::string why;
  const std::string probe = RecordingEnv(&why);
  ASSERT_FALSE(probe.empty()) << "no runtime of this esbd records steps: " << why;
  daemon_->Call("DELETE", "/environments/" + probe);
  HttpResult env = daemon_->Call("POST", "/environments",
                                 json::object{{"runtime", HaveNano() ? "nano" : "container"},
                                              {"steps", json::object{{"max_steps", 2}}}});
  ASSERT_EQ(env.status, 201) << env.body;
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

}  // namespace
}  // namespace esb::testing
