// Time travel on gVisor through the real esbd (issue 13): every step of a `runtime: "gvisor"`
// environment carries a memory snapshot (a runsc checkpoint), so a rewind brings back the
// Python kernel's live variables and the processes that ran at the step, and a fork starts
// from them; destroying the environment removes its checkpoint images. Skips (saying why) when
// this host's esbd has no gvisor driver.
#include <filesystem>
#include <string>

#include "absl/strings/str_cat.h"
#include "integration/daemon.h"

namespace esb::testing {
namespace {
namespace json = boost::json;
namespace fs = std::filesystem;

class GvisorStepsApiTest : public SharedDaemonTest<GvisorStepsApiTest> {
 protected:
  void SetUp() override {
    SharedDaemonTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    if (!daemon_->Call("GET", "/healthz").obj().at("drivers").as_object().contains("gvisor"))
      GTEST_SKIP() << "the gvisor runtime is not available here (runsc): see GET /healthz";
  }
  static HttpResult Run(const std::string& id, const std::string& code) {
    return daemon_->Call("POST", "/environments/" + id + "/run", json::object{{"code", code}});
  }
  // The checkpoint images of environment `id` below the daemon's state directory.
  static std::vector<std::string> Images(const std::string& id) {
    std::vector<std::string> found;
    std::error_code ec;
    for (auto it = fs::recursive_directory_iterator(daemon_->state_dir(), ec);
         it != fs::recursive_directory_iterator(); it.increment(ec)) {
      const std::string p = it->path().string();
      if (p.find("/envs/" + id + "/images/") != std::string::npos &&
          it->path().filename() == "checkpoint.img") {
        found.push_back(p);
      }
    }
    return found;
  }
};

TEST_F(GvisorStepsApiTest, RewindAndForkBringBackLiveVariablesAndProcesses) {
  HttpResult created = daemon_->Call("POST", "/environments", json::object{{"runtime", "gvisor"}});
  ASSERT_EQ(created.status, 201) << created.body;
  const std::string id = created.str("environment_id");
  const json::object& status = created.obj().at("steps").as_object();
  EXPECT_EQ(status.at("memory").as_string(), "snapshot") << created.body;
  const std::string base = "/environments/" + id;
  HttpResult r1 = Run(id, "x = 41");
  ASSERT_EQ(r1.status, 200) << r1.body;
  HttpResult bg = daemon_->Exec(
      id,
      "(while :; do echo t >> /tmp/ticks; sleep 0.1; done) >/dev/null 2>&1 & echo $! > /tmp/bg");
  ASSERT_EQ(bg.status, 200) << bg.body;
  HttpResult list = daemon_->Call("GET", base + "/steps");
  ASSERT_EQ(list.status, 200) << list.body;
  const json::object& at = list.obj().at("steps").as_array()[0].as_object();
  EXPECT_EQ(at.at("memory").as_string(), "snapshot") << list.body;
  const int64_t step = at.at("step").as_int64();
  EXPECT_FALSE(Images(id).empty());
  // Later: x changes, the background process dies.
  ASSERT_EQ(Run(id, "x = 99").status, 200);
  ASSERT_EQ(daemon_->Exec(id, "kill $(cat /tmp/bg)").status, 200);
  HttpResult rw = daemon_->Call("POST", base + "/rewind", json::object{{"step", step}});
  ASSERT_EQ(rw.status, 200) << rw.body;
  EXPECT_EQ(rw.str("memory"), "snapshot") << rw.body;
  HttpResult x = Run(id, "print(x)");
  ASSERT_EQ(x.status, 200) << x.body;
  EXPECT_EQ(x.str("stdout"), "41\n") << x.body;  // from memory, not re-run
  HttpResult alive = daemon_->Exec(id, "kill -0 $(cat /tmp/bg) && echo alive");
  EXPECT_EQ(alive.str("stdout"), "alive\n") << alive.body;
  // A fork of the same step: its own sandbox with the same live state.
  HttpResult fork = daemon_->Call("POST", base + "/fork", json::object{{"step", step}});
  ASSERT_EQ(fork.status, 201) << fork.body;
  EXPECT_EQ(fork.str("memory"), "snapshot") << fork.body;
  const std::string fid = fork.str("environment_id");
  HttpResult fx = Run(fid, "x += 1\nprint(x)");
  EXPECT_EQ(fx.str("stdout"), "42\n") << fx.body;
  EXPECT_EQ(Run(id, "print(x)").str("stdout"), "41\n");  // the source did not move
  // Destroy removes every image of the environment.
  EXPECT_EQ(daemon_->Call("DELETE", base).status, 200);
  EXPECT_EQ(daemon_->Call("DELETE", "/environments/" + fid).status, 200);
  EXPECT_TRUE(Images(id).empty());
  EXPECT_TRUE(Images(fid).empty());
}

}  // namespace
}  // namespace esb::testing
