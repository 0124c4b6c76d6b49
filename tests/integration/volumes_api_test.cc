// Persistent volumes (issue 11) against the real daemon and real containers: lifecycle,
// size cap, tenant isolation, restart, the one-writer rule, and the attacks on them (each named
// after what it tries, performed through the API, asserted to fail).
#include <sys/stat.h>

#include <cstdio>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "integration/daemon.h"

namespace esb::testing {
namespace {
namespace json = boost::json;

std::string Shell(const std::string& cmd) {
  std::string out;
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return out;
  char buf[512];
  while (fgets(buf, sizeof buf, p) != nullptr) out += buf;
  pclose(p);
  return out;
}

json::object WithVolume(const std::string& name, const std::string& path, bool ro = false) {
  return {
      {"volumes", json::array{json::object{{"name", name}, {"path", path}, {"read_only", ro}}}}};
}

class VolumesApiTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why = Daemon::SkipReason();
    if (!why.empty()) GTEST_SKIP() << why;
    if (Shell("command -v mkfs.ext4").empty()) {
      GTEST_SKIP() << "mkfs.ext4 (e2fsprogs) is not installed: scripts/install-deps.sh";
    }
  }
  HttpResult CreateVolume(Daemon& d, const std::string& name, int64_t size_mb) {
    return d.Call("POST", "/volumes", json::object{{"name", name}, {"size_mb", size_mb}});
  }
  // The volume's row in GET /volumes (null when absent).
  json::value VolumeRow(Daemon& d, const std::string& name) {
    HttpResult r = d.Call("GET", "/volumes");
    EXPECT_EQ(r.status, 200) << r.body;
    for (const json::value& v : r.obj().at("volumes").as_array()) {
      if (v.as_object().at("name").as_string() == name) return v;
    }
    return nullptr;
  }
  HttpResult WriteFile(Daemon& d, const std::string& id, const std::string& path,
                       const std::string& content) {
    return d.Call("POST", "/environments/" + id + "/files/write",
                  json::object{{"path", path}, {"content", content}});
  }
  HttpResult ReadFile(Daemon& d, const std::string& id, const std::string& path) {
    return d.Call("GET", "/environments/" + id + "/files/read?path=" + path);
  }
};

TEST_F(VolumesApiTest, ContentsOutliveEnvironmentsAndOneWriterAtATime) {
  Daemon d;
  ASSERT_TRUE(d.Start({}));
  HttpResult c = CreateVolume(d, "data", 32);
  ASSERT_EQ(c.status, 201) << c.body;
  EXPECT_EQ(c.str("name"), "data");
  EXPECT_EQ(c.num("size_mb"), 32);
  EXPECT_EQ(CreateVolume(d, "data", 32).status, 409) << "name taken";

  std::string a = d.CreateEnv(WithVolume("data", "/mnt/data"));
  ASSERT_FALSE(a.empty()) << d.Log();
  HttpResult w = d.Exec(a, "echo hello > /mnt/data/f.txt && id -u && stat -c %u /mnt/data/f.txt");
  ASSERT_EQ(w.status, 200) << w.body;
  EXPECT_EQ(w.num("exit_code"), 0) << w.body;
  EXPECT_EQ(w.str("stdout"), "1000\n1000\n") << "the sandbox user owns what it writes";
  // The files API reaches the mount point like /workspace (write and read take absolute paths).
  HttpResult fw = WriteFile(d, a, "/mnt/data/api.txt", "from the api");
  EXPECT_EQ(fw.status, 200) << fw.body;
  EXPECT_EQ(ReadFile(d, a, "/mnt/data/f.txt").str("content"), "hello\n");
  HttpResult listing = d.Call("GET", "/environments/" + a + "/files/list?path=/mnt/data");
  EXPECT_TRUE(absl::StrContains(listing.body, "\"api.txt\"")) << listing.body;
  // mkdir/remove/rename act inside the volume like /workspace (docs/api.md "Reaching volumes").
  HttpResult mkdir = d.Call("POST", "/environments/" + a + "/files/mkdir",
                            json::object{{"path", "/mnt/data/sub"}});
  EXPECT_EQ(mkdir.status, 200) << mkdir.body;
  EXPECT_EQ(VolumeRow(d, "data").as_object().at("mounted_by").as_string(), a);

  HttpResult del = d.Call("DELETE", "/volumes/data");
  EXPECT_EQ(del.status, 409) << "refused while mounted: " << del.body;
  HttpResult second = d.Call("POST", "/environments", WithVolume("data", "/mnt/data", true));
  EXPECT_EQ(second.status, 409) << "one environment mounts a volume at a time: " << second.body;

  ASSERT_EQ(d.Call("DELETE", "/environments/" + a).status, 200);
  EXPECT_TRUE(VolumeRow(d, "data").as_object().at("mounted_by").is_null());

  std::string b = d.CreateEnv(WithVolume("data", "/mnt/other/place", /*ro=*/true));
  ASSERT_FALSE(b.empty()) << d.Log();
  HttpResult r = d.Exec(b,
                        "cat /mnt/other/place/f.txt /mnt/other/place/api.txt; echo; "
                        "touch /mnt/other/place/x 2>&1; echo rc=$?");
  EXPECT_EQ(r.str("stdout").substr(0, 19), "hello\nfrom the api\n") << r.body;
  EXPECT_TRUE(absl::StrContains(r.str("stdout"), "Read-only file system")) << r.body;
  EXPECT_TRUE(absl::StrContains(r.str("stdout"), "rc=1")) << r.body;
  ASSERT_EQ(d.Call("DELETE", "/environments/" + b).status, 200);

  EXPECT_FALSE(Shell("find " + d.state_dir() + " -name data.img").empty());
  HttpResult gone = d.Call("DELETE", "/volumes/data");
  EXPECT_EQ(gone.status, 200) << gone.body;
  EXPECT_TRUE(VolumeRow(d, "data").is_null());
  EXPECT_EQ(Shell("find " + d.state_dir() + " -name data.img"), "") << "the image is deleted";
  EXPECT_EQ(d.Call("DELETE", "/volumes/data").status, 404);
  EXPECT_EQ(d.Call("POST", "/environments", WithVolume("data", "/mnt/data")).status, 404)
      << "a deleted volume cannot be mounted";
  d.StopAndCleanup();
}

TEST_F(VolumesApiTest, BadNamesPathsAndSizesAre400AndQuotasHold) {
  Daemon d;
  ASSERT_TRUE(d.Start({.config_json = R"({"max_volume_mb": 64, "max_volumes_per_tenant": 2})"}));
  EXPECT_EQ(CreateVolume(d, "Data", 32).status, 400);
  EXPECT_EQ(CreateVolume(d, "../x", 32).status, 400);
  EXPECT_EQ(CreateVolume(d, std::string(64, 'a'), 32).status, 400);
  EXPECT_EQ(CreateVolume(d, "tiny", 1).status, 400) << "below the minimum";
  EXPECT_EQ(CreateVolume(d, "big", 65).status, 400) << "above max_volume_mb";
  EXPECT_EQ(CreateVolume(d, "huge", 1 << 20).status, 400) << "above max_volume_mb";
  EXPECT_EQ(d.Call("POST", "/volumes", json::object{{"name", "x"}}).status, 400) << "no size";
  ASSERT_EQ(CreateVolume(d, "ok2", 64).status, 201);
  ASSERT_EQ(CreateVolume(d, "ok", 16).status, 201);
  EXPECT_EQ(CreateVolume(d, "ok3", 16).status, 429) << "max_volumes_per_tenant";
  EXPECT_EQ(d.Call("POST", "/environments", json::object{{"volumes", "ok"}}).status, 400);
  EXPECT_EQ(d.Call("POST", "/environments",
                   json::object{{"volumes", json::array{json::object{{"name", "ok"}}}}})
                .status,
            400)
      << "no path";
  d.StopAndCleanup();
}

// The mount path is where an attacker would try to hide a system directory or climb out of
// /mnt: each of these is refused before any container exists.
TEST_F(VolumesApiTest, VolumePathTraversalAttackIsRefused) {
  Daemon d;
  ASSERT_TRUE(d.Start({}));
  ASSERT_EQ(CreateVolume(d, "v", 16).status, 201);
  for (const char* path :
       {"/mnt/../etc", "/mnt/a/../../proc", "/proc/sys", "/sys", "/dev/x", "/run/esb", "/workspace",
        "/workspace/v", "/etc", "/", "/mnt", "mnt/v", "/mnt//v", "/mnt/./v", "/sbin/esb-agent"}) {
    HttpResult r = d.Call("POST", "/environments", WithVolume("v", path));
    EXPECT_EQ(r.status, 400) << path << ": " << r.body;
  }
  json::object two{{"volumes", json::array{json::object{{"name", "v"}, {"path", "/mnt/a"}},
                                           json::object{{"name", "v"}, {"path", "/mnt/b"}}}}};
  EXPECT_EQ(d.Call("POST", "/environments", two).status, 400) << "one volume listed twice";
  EXPECT_TRUE(VolumeRow(d, "v").as_object().at("mounted_by").is_null()) << "nothing claimed it";
  d.StopAndCleanup();
}

// A sandbox plants symlinks in its volume (to the host's / and /etc/shadow); a later
// environment mounting the volume, and esbd unmounting and removing the environment
// directory, never follow them to the host.
TEST_F(VolumesApiTest, VolumeSymlinkAttackStaysInsideTheSandbox) {
  Daemon d;
  ASSERT_TRUE(d.Start({}));
  ASSERT_EQ(CreateVolume(d, "v", 16).status, 201);
  const std::string canary = d.state_dir() + "/canary";
  ASSERT_EQ(std::system(("echo host-canary > " + canary).c_str()), 0);
  std::string a = d.CreateEnv(WithVolume("v", "/mnt/v"));
  ASSERT_FALSE(a.empty());
  HttpResult plant = d.Exec(a,
                            "ln -s / /mnt/v/hostroot && ln -s /etc/shadow /mnt/v/shadow && "
                            "ln -s " +
                                canary + " /mnt/v/canary && echo planted");
  ASSERT_EQ(plant.str("stdout"), "planted\n") << plant.body;
  ASSERT_EQ(d.Call("DELETE", "/environments/" + a).status, 200);
  EXPECT_EQ(Shell("cat " + canary), "host-canary\n") << "destroy did not follow the links";
  std::string b = d.CreateEnv(WithVolume("v", "/mnt/v"));
  ASSERT_FALSE(b.empty());
  HttpResult host = ReadFile(d, b, "/mnt/v/canary");
  EXPECT_NE(host.status, 200) << "the host file is not reachable: " << host.body;
  HttpResult shadow = ReadFile(d, b, "/mnt/v/shadow");
  EXPECT_NE(shadow.status, 200) << "the sandbox's own /etc/shadow is root-only: " << shadow.body;
  HttpResult root = d.Exec(b, "cat /mnt/v/hostroot/etc/hostname; ls /mnt/v/hostroot/" +
                                  d.state_dir().substr(1) + " 2>&1 | head -1");
  EXPECT_FALSE(absl::StrContains(root.str("stdout"), "canary")) << root.body;
  d.Call("DELETE", "/environments/" + b);
  d.StopAndCleanup();
}

// Host users must not reach a volume's files through its host mount (on-disk uid 1000 is
// possibly a real host user): the mount lives below esbd's root-only state directory.
// files/mkdir, rename and remove inside /mnt/<vol>, with the workspace's rules: no symlink
// followed, no rename across roots, the volume's root itself and non-volume paths refused.
TEST_F(VolumesApiTest, MkdirRenameRemoveInsideAVolumeAndTheirSymlinkAttacksFail) {
  Daemon d;
  ASSERT_TRUE(d.Start({}));
  ASSERT_EQ(CreateVolume(d, "fv", 16).status, 201);
  std::string a = d.CreateEnv(WithVolume("fv", "/mnt/fv"));
  ASSERT_FALSE(a.empty()) << d.Log();
  auto call = [&](const std::string& op, json::object body) {
    return d.Call("POST", "/environments/" + a + "/files/" + op, body);
  };
  HttpResult r = call("mkdir", {{"path", "/mnt/fv/x/y"}});
  ASSERT_EQ(r.status, 200) << r.body;
  r = call("rename", {{"source", "/mnt/fv/x/y"}, {"destination", "/mnt/fv/z"}});
  ASSERT_EQ(r.status, 200) << r.body;
  r = call("remove", {{"path", "/mnt/fv/x"}, {"recursive", true}});
  ASSERT_EQ(r.status, 200) << r.body;
  HttpResult ls = d.Exec(a, "ls -A /mnt/fv | grep -v lost+found | tr '\\n' ' '");
  EXPECT_EQ(ls.str("stdout"), "z ") << ls.body;

  // Symlinks planted in the volume, to the workspace and to /: never followed.
  ASSERT_EQ(d.Exec(a,
                   "echo keep > /workspace/keep && ln -s /workspace /mnt/fv/ws && "
                   "ln -s / /mnt/fv/root && echo ok")
                .str("stdout"),
            "ok\n");
  r = call("remove", {{"path", "/mnt/fv/ws/keep"}});
  EXPECT_EQ(r.status / 100, 4) << r.body;
  r = call("rename", {{"source", "/mnt/fv/ws/keep"}, {"destination", "/mnt/fv/k"}});
  EXPECT_EQ(r.status / 100, 4) << r.body;
  r = call("mkdir", {{"path", "/mnt/fv/root/tmp/esb-escape"}});
  EXPECT_EQ(r.status / 100, 4) << r.body;
  r = call("remove", {{"path", "/mnt/fv/ws"}, {"recursive", true}});  // the link itself
  EXPECT_EQ(r.status, 200) << r.body;
  HttpResult check = d.Exec(a, "cat /workspace/keep; test -e /tmp/esb-escape || echo none");
  EXPECT_EQ(check.str("stdout"), "keep\nnone\n") << check.body;

  // Across roots, the volume's root itself, and a path under /mnt that is no volume: refused.
  r = call("rename", {{"source", "/workspace/keep"}, {"destination", "/mnt/fv/keep"}});
  EXPECT_EQ(r.status, 400) << r.body;
  EXPECT_TRUE(absl::StrContains(r.body, "different roots")) << r.body;
  EXPECT_EQ(call("remove", {{"path", "/mnt/fv"}, {"recursive", true}}).status, 400);
  EXPECT_EQ(call("rename", {{"source", "/mnt/fv"}, {"destination", "/mnt/fv2"}}).status, 400);
  r = call("mkdir", {{"path", "/mnt/not-a-volume/d"}});
  EXPECT_EQ(r.status, 400) << r.body;
  EXPECT_EQ(d.Exec(a, "test -d /mnt/fv && cat /workspace/keep").str("stdout"), "keep\n");
}

TEST_F(VolumesApiTest, HostUserCannotReachVolumeMount) {
  if (Shell("command -v setpriv").empty()) GTEST_SKIP() << "setpriv (util-linux) missing";
  Daemon d;
  ASSERT_TRUE(d.Start({}));
  ASSERT_EQ(CreateVolume(d, "v", 16).status, 201);
  std::string a = d.CreateEnv(WithVolume("v", "/mnt/v"));
  ASSERT_FALSE(a.empty());
  ASSERT_EQ(d.Exec(a, "echo private > /mnt/v/p.txt").status, 200);
  std::string mounts = Shell("grep -F '" + d.state_dir() + "' /proc/self/mountinfo | grep ext4");
  ASSERT_FALSE(mounts.empty()) << "the volume's host mount is below the state directory";
  std::string file = Shell("find " + d.state_dir() + " -path '*/vol/*' -name p.txt | head -1");
  ASSERT_FALSE(file.empty());
  file.pop_back();
  std::string as_1000 =
      Shell("setpriv --reuid=1000 --regid=1000 --clear-groups cat '" + file + "' 2>&1; echo rc=$?");
  EXPECT_TRUE(absl::StrContains(as_1000, "Permission denied")) << as_1000;
  EXPECT_FALSE(absl::StrContains(as_1000, "private")) << as_1000;
  d.Call("DELETE", "/environments/" + a);
  d.StopAndCleanup();
}

TEST_F(VolumesApiTest, SizeCapIsHardWritesPastItFail) {
  Daemon d;
  ASSERT_TRUE(d.Start({}));
  ASSERT_EQ(CreateVolume(d, "small", 16).status, 201);
  std::string img = Shell("find " + d.state_dir() + " -name small.img | head -1");
  ASSERT_FALSE(img.empty());
  img.pop_back();
  struct stat st;
  ASSERT_EQ(stat(img.c_str(), &st), 0);
  EXPECT_EQ(st.st_size, 16 << 20) << "the image is the cap";
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_LT(st.st_blocks * 512, 16 << 20) << "sparse";
  std::string a = d.CreateEnv(WithVolume("small", "/mnt/s"));
  ASSERT_FALSE(a.empty());
  HttpResult r = d.Exec(a,
                        "dd if=/dev/zero of=/mnt/s/big bs=1M count=40 2>&1; echo rc=$?; "
                        "sync; df -k /mnt/s | tail -1");
  EXPECT_TRUE(absl::StrContains(r.str("stdout"), "No space left on device")) << r.body;
  EXPECT_FALSE(absl::StrContains(r.str("stdout"), "rc=0")) << r.body;
  HttpResult full = WriteFile(d, a, "/mnt/s/more.txt", std::string(1 << 20, 'x'));
  EXPECT_EQ(full.status, 507) << "ENOSPC through the files API: " << full.body << r.body;
  ASSERT_EQ(stat(img.c_str(), &st), 0);
  EXPECT_EQ(st.st_size, 16 << 20) << "the image did not grow";
  d.Call("DELETE", "/environments/" + a);
  d.StopAndCleanup();
}

TEST_F(VolumesApiTest, AnotherTenantsVolumeIsNotFound) {
  Daemon d;
  ASSERT_TRUE(d.Start({.config_json = TwoTenantsConfig()}));
  d.api_key = kTenantKeyA;
  ASSERT_EQ(CreateVolume(d, "data", 16).status, 201);
  std::string a = d.CreateEnv(WithVolume("data", "/mnt/data"));
  ASSERT_FALSE(a.empty());
  ASSERT_EQ(d.Exec(a, "echo tenant-a > /mnt/data/secret").status, 200);
  ASSERT_EQ(d.Call("DELETE", "/environments/" + a).status, 200);

  d.api_key = kTenantKeyB;
  EXPECT_TRUE(d.Call("GET", "/volumes").obj().at("volumes").as_array().empty());
  HttpResult env = d.Call("POST", "/environments", WithVolume("data", "/mnt/data"));
  EXPECT_EQ(env.status, 404) << env.body;
  EXPECT_EQ(d.Call("DELETE", "/volumes/data").status, 404);
  // b's own "data" is another volume: empty, and a's stays a's.
  ASSERT_EQ(CreateVolume(d, "data", 16).status, 201);
  std::string b = d.CreateEnv(WithVolume("data", "/mnt/data"));
  ASSERT_FALSE(b.empty());
  HttpResult ls = d.Exec(b, "ls -A /mnt/data | grep -v lost+found; echo end");
  EXPECT_EQ(ls.str("stdout"), "end\n") << ls.body;
  ASSERT_EQ(d.Call("DELETE", "/environments/" + b).status, 200);
  ASSERT_EQ(d.Call("DELETE", "/volumes/data").status, 200);

  d.api_key = kTenantKeyA;
  std::string a2 = d.CreateEnv(WithVolume("data", "/mnt/data"));
  ASSERT_FALSE(a2.empty());
  EXPECT_EQ(d.Exec(a2, "cat /mnt/data/secret").str("stdout"), "tenant-a\n");
  d.Call("DELETE", "/environments/" + a2);
  d.StopAndCleanup();
}

TEST_F(VolumesApiTest, ContentsAndMountsSurviveADaemonRestart) {
  Daemon d;
  ASSERT_TRUE(d.Start({}));
  ASSERT_EQ(CreateVolume(d, "keep", 16).status, 201);
  std::string a = d.CreateEnv(WithVolume("keep", "/mnt/keep"));
  ASSERT_FALSE(a.empty());
  ASSERT_EQ(d.Exec(a, "echo before > /mnt/keep/f").status, 200);
  const std::string state = d.state_dir();
  d.Stop();
  Daemon d2;
  ASSERT_TRUE(d2.Start({}, state));
  HttpResult r = d2.Exec(a, "cat /mnt/keep/f && echo after >> /mnt/keep/f && cat /mnt/keep/f");
  EXPECT_EQ(r.str("stdout"), "before\nbefore\nafter\n") << r.body << d2.Log();
  EXPECT_EQ(VolumeRow(d2, "keep").as_object().at("mounted_by").as_string(), a)
      << "the restarted daemon knows who mounts it";
  EXPECT_EQ(d2.Call("DELETE", "/volumes/keep").status, 409);
  EXPECT_EQ(d2.Call("POST", "/environments", WithVolume("keep", "/mnt/k")).status, 409);
  ASSERT_EQ(d2.Call("DELETE", "/environments/" + a).status, 200);
  std::string b = d2.CreateEnv(WithVolume("keep", "/mnt/k"));
  ASSERT_FALSE(b.empty());
  EXPECT_EQ(d2.Exec(b, "cat /mnt/k/f").str("stdout"), "before\nafter\n");
  d2.Call("DELETE", "/environments/" + b);
  EXPECT_EQ(d2.Call("DELETE", "/volumes/keep").status, 200);
  d2.StopAndCleanup();
}

TEST_F(VolumesApiTest, NanoTierRefusesVolumesNamingTheCapability) {
  Daemon d;
  ASSERT_TRUE(d.Start({}));
  if (!d.Call("GET", "/healthz").obj().at("drivers").as_object().contains("nano")) {
    GTEST_SKIP() << "the nano runtime is not available here (needs python.wasm)";
  }
  ASSERT_EQ(CreateVolume(d, "v", 16).status, 201);
  json::object body = WithVolume("v", "/mnt/v");
  body["runtime"] = "nano";
  HttpResult r = d.Call("POST", "/environments", body);
  EXPECT_EQ(r.status, 400) << r.body;
  EXPECT_TRUE(absl::StrContains(r.body, "volumes")) << r.body;
  d.StopAndCleanup();
}

}  // namespace
}  // namespace esb::testing
